"""One daemon as a real process: systemd notification, signals, refusals at start, the socket."""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import fabricd
from fabricd.daemon.main import EXIT_CONFIG


def _start(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "fabricd.cli.daemon",
        "--socket",
        str(tmp_path / "d.sock"),
        "--nodes",
        "127.0.0.1:0",
        *args,
    ]
    with open(tmp_path / "daemon.log", "ab") as log:  # a file, so a chatty daemon never blocks
        return subprocess.Popen(
            command, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )


def _output(tmp_path: Path) -> str:
    return (tmp_path / "daemon.log").read_text(errors="replace")


def _notify_socket(tmp_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(10)
    return sock


def _wait_ready(sock: socket.socket) -> list[str]:
    seen: list[str] = []
    while "READY=1" not in seen:
        seen += sock.recv(4096).decode().splitlines()
    return seen


def _wait_for_ping(sock: socket.socket) -> None:
    while "WATCHDOG=1" not in sock.recv(4096).decode().splitlines():
        pass


def test_ready_after_bind_watchdog_from_the_loop_and_stopping_on_sigterm(tmp_path):
    notify = _notify_socket(tmp_path)
    daemon = _start(
        tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "600000"}
    )
    try:
        _wait_ready(notify)
        with fabricd.connect(socket_path=str(tmp_path / "d.sock")) as control:  # bound before READY
            assert control.status()["state"] == "serving"
        pings = []
        while len(pings) < 6:
            if "WATCHDOG=1" in notify.recv(4096).decode().splitlines():
                pings.append(time.monotonic())
        gaps = sorted(b - a for a, b in itertools.pairwise(pings))
        assert gaps[len(gaps) // 2] < 0.45, f"pings every WatchdogSec/2 = 0.3 s, got {gaps}"
        assert gaps[-1] < 0.6, f"a gap of WatchdogSec would have tripped the watchdog: {gaps}"
        daemon.send_signal(signal.SIGSTOP)  # a stalled loop must stop the pings
        notify.settimeout(0.5)
        with pytest.raises(TimeoutError):
            _wait_for_ping(notify)
        daemon.send_signal(signal.SIGCONT)
        notify.settimeout(10)
        daemon.send_signal(signal.SIGTERM)
        seen: list[str] = []
        while "STOPPING=1" not in seen:
            seen += notify.recv(4096).decode().splitlines()
        assert daemon.wait(15) == 0
        assert not (tmp_path / "d.sock").exists()
    finally:
        daemon.kill()
        daemon.wait()
        notify.close()


def test_sigterm_fails_waiting_operations_with_daemon_stopping(tmp_path):
    notify = _notify_socket(tmp_path)
    daemon = _start(
        tmp_path, "--drain-timeout", "1", env={"NOTIFY_SOCKET": str(tmp_path / "notify")}
    )
    try:
        _wait_ready(notify)
        with fabricd.connect(job="t", rank=0, size=2, socket_path=str(tmp_path / "d.sock")) as fab:
            handle = fab.recv_async(fab.array("x", (8,), "float32"), src=1)
            daemon.send_signal(signal.SIGTERM)
            with pytest.raises(fabricd.OperationFailed) as failure:
                handle.wait(timeout=10)
            assert failure.value.code == "daemon_stopping"
        assert daemon.wait(15) == 0
    finally:
        daemon.kill()
        daemon.wait()
        notify.close()


def test_secret_file_readable_by_others_refuses_to_start(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a-perfectly-long-shared-secret-value")
    secret.chmod(0o644)
    daemon = _start(tmp_path, "--nodes", "127.0.0.1:0,127.0.0.1:1", "--secret-file", str(secret))
    daemon.wait(30)
    output = _output(tmp_path)
    assert daemon.returncode == EXIT_CONFIG
    assert f"secret_file {secret} (mode 0644, owner uid {os.geteuid()}," in output
    assert "is open to others; chmod 600" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--node-id", "3"), "node_id 3 is not an index of nodes"),
        (("--nodes", "127.0.0.1:0,127.0.0.1:1"), "or secret_env: one is required"),
        (("--heartbeat-interval", "5"), "heartbeat_interval < suspect_after"),
        (("--listen", "nonsense"), "is not host:port"),
    ],
)
def test_bad_configuration_exits_with_a_clear_message(tmp_path, args, message):
    daemon = _start(tmp_path, *args)
    daemon.wait(30)
    output = _output(tmp_path)
    assert daemon.returncode == EXIT_CONFIG
    assert message in output


def test_second_daemon_on_the_same_socket_is_refused(tmp_path):
    notify = _notify_socket(tmp_path)
    first = _start(tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        _wait_ready(notify)
        second = _start(tmp_path)
        second.wait(30)
        output = _output(tmp_path)
        assert second.returncode == EXIT_CONFIG
        assert "another fabricd already serves" in output
    finally:
        first.terminate()
        first.wait(15)
        notify.close()


def _connect_as(user: pwd.struct_passwd, path: Path, report: int) -> int:
    """In a forked child: become ``user``, connect, and see the daemon say why and hang up."""
    try:
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(path))
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.sendall(b"FBRC")  # may come too late: the daemon hangs up at accept
            answer = b""
            with contextlib.suppress(ConnectionResetError):  # after our bytes it left unread
                while data := sock.recv(4096):
                    answer += data
        os.write(report, f"answer {answer!r}".encode())
        said = b"closing" in answer and b"refused" in answer and b"allowed_uids" in answer
        return 0 if said else 2
    except Exception as exc:
        os.write(report, repr(exc).encode())
        return 1


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to user nobody needs root")
def test_socket_is_0660_and_uids_outside_the_allow_list_are_refused(tmp_path):
    notify = _notify_socket(tmp_path)
    open_dir = Path(tempfile.mkdtemp(prefix="fabricd-s5-"))  # pytest's tmp dirs are 0700
    path = open_dir / "d.sock"
    daemon = _start(
        tmp_path, "--socket", str(path), env={"NOTIFY_SOCKET": str(tmp_path / "notify")}
    )
    try:
        _wait_ready(notify)
        assert str(path).startswith("/")  # never an abstract socket: those have no permissions
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        # let nobody reach the socket through the file system, so only SO_PEERCRED stops it
        open_dir.chmod(0o755)
        path.chmod(0o666)
        nobody = pwd.getpwnam("nobody")
        report, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            os._exit(_connect_as(nobody, path, write_end))
        os.close(write_end)
        _, status = os.waitpid(child, 0)
        outcome = os.read(report, 4096).decode()
        os.close(report)
        assert os.waitstatus_to_exitcode(status) == 0, f"not refused as expected: {outcome}"
        with fabricd.connect(socket_path=str(path)) as control:
            assert control.status()["counters"]["refused_clients"] == 1
    finally:
        daemon.terminate()
        daemon.wait(15)
        notify.close()
        shutil.rmtree(open_dir)
    output = _output(tmp_path)
    assert f"uid={nobody.pw_uid}" in output
    assert "not in allowed_uids/allowed_gids" in output
