"""The client socket of a real daemon process at its limits: fds, slots, deadlines, the umask.

Each daemon here is a subprocess (``python -m fabricd.cli.daemon``) with what the test changes
set in the child before it starts: a low ``RLIMIT_NOFILE`` (soft and hard, so the daemon cannot
raise it), or ``umask 000``.  Waits are hang guards only; what is asserted is what the daemon
did (counted) and said (its closing events, its log).
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

import fabricd
from fabricd.ipc import REPLY_LIMITS
from fabricd.wire import NEED_DATA, Decoder, Frame

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from fabricd.wire import Meta

#: the daemon's fd limit in the fd test: what it opens at start, plus a few dozen clients
FD_LIMIT = 64


@contextlib.contextmanager
def _daemon(
    tmp_path: Path, sock: Path, *args: str, before: Callable[[], None] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon serving ``sock`` (``before`` runs in the child first); stopped on the way out."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)  # hang guard
    command = [sys.executable, "-m", "fabricd.cli.daemon", "--socket", str(sock)]
    command += ["--nodes", "127.0.0.1:0", *args]
    with open(tmp_path / "daemon.log", "ab") as log:
        daemon = subprocess.Popen(
            command,
            env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")},
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=before,
        )
    try:
        while b"READY=1" not in notify.recv(4096):
            pass
        yield daemon
    finally:
        daemon.terminate()
        daemon.wait(30)
        notify.close()
    output = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "Traceback" not in output, output


def _raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))  # blocking: a full backlog waits for the daemon to accept
    sock.settimeout(30)  # hang guard
    return sock


def _closing(sock: socket.socket) -> Meta:
    """Read until the daemon hangs up; its last frame, the closing event."""
    decoder, last = Decoder(REPLY_LIMITS), None
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            decoder.feed(data)
            while (event := decoder.next_event()) is not NEED_DATA:
                if isinstance(event, Frame):
                    last = event.meta
    assert last is not None
    assert last["event"] == "closing", last
    return last


def _counters(path: Path) -> dict[str, Any]:
    with fabricd.connect(socket_path=str(path), timeout=30) as control:
        counters: dict[str, Any] = control.status()["counters"]
        return counters


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def test_at_the_fd_limit_accept_does_not_spin_says_why_and_serves_once_fds_return(tmp_path):
    path = tmp_path / "d.sock"
    settings = ("--max-clients", "500", "--client-hello-timeout", "600")
    with _daemon(tmp_path, path, *settings, before=_low_fd_limit):
        # far more idle connections than the daemon has fds: it admits what fits, and the rest
        # are accepted through its spare fd and refused with the reason, one accept each
        flood = [_raw(path) for _ in range(4 * FD_LIMIT)]
        last = _closing(flood[-1])  # connections are taken in order: the last one was refused
        assert last["code"] == "refused"
        assert "file descriptors" in last["error"]
        assert "LimitNOFILE" in last["error"]
        refused = [s for s in flood if select.select([s], [], [], 0)[0]]  # all told by now
        admitted = [s for s in flood if s not in refused]
        assert admitted, "the daemon admitted no client below its fd limit"
        for sock in refused[:-1]:
            assert "file descriptors" in _closing(sock)["error"]
        for sock in flood:  # fds come back to the daemon as the admitted ones leave
            sock.close()
        early: list[str] = []  # tries before the daemon saw every close: refused, saying why
        while len(early) < 100:
            try:
                counters = _counters(path)  # a real client is served again
                break
            except fabricd.DaemonUnavailable as exc:
                early.append(str(exc))
    assert all("file descriptors" in message for message in early), early
    assert counters["refused_clients_no_fds"] == len(refused) + len(early)
    # one failed accept per refused client, never more: the loop did not retry in place
    assert counters["accept_errors"] == len(refused) + len(early)
    log = (tmp_path / "daemon.log").read_text(errors="replace")
    # rate-limited: a burst of lines per second, then a count; not one line per failed accept
    assert 1 <= log.count("accept on") <= len(refused) // 4, log
    assert log.count("refused client") <= len(refused) // 4, log


def test_a_client_over_max_clients_is_told_so_not_that_its_uid_may_be_wrong(tmp_path):
    path = tmp_path / "d.sock"
    with (
        _daemon(tmp_path, path, "--max-clients", "1"),
        fabricd.connect(socket_path=str(path), timeout=30) as first,
    ):
        with pytest.raises(fabricd.DaemonUnavailable) as refused:
            fabricd.connect(socket_path=str(path), timeout=30)
        message = str(refused.value)
        assert "already serves max_clients (1) clients" in message
        assert "raise max_clients" in message
        assert "uid" not in message
        assert "may have refused" not in message
        counters = first.status()["counters"]
    assert counters["refused_clients_max_clients"] == 1
    assert counters["refused_clients"] == 1
    assert counters["refused_clients_not_allowed"] == 0


def test_a_connection_without_hello_is_closed_and_counted(tmp_path):
    path = tmp_path / "d.sock"
    with _daemon(tmp_path, path, "--client-hello-timeout", "0.3"):
        with _raw(path) as silent:
            closing = _closing(silent)
        assert closing["code"] == "protocol"
        assert "client_hello_timeout (0.3 s)" in closing["error"]
        assert _counters(path)["clients_timed_out"] == 1
    log = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "client_hello_timeout" in log


def test_directories_the_daemon_creates_are_0750_under_umask_000(tmp_path):
    path = tmp_path / "run" / "fabricd" / "d.sock"
    with _daemon(tmp_path, path, before=lambda: os.umask(0)):
        modes = {
            p.name: stat.S_IMODE(p.stat().st_mode) for p in (path, path.parent, path.parent.parent)
        }
    assert modes == {"d.sock": 0o660, "fabricd": 0o750, "run": 0o750}


def test_a_local_cluster_under_umask_000_keeps_its_directories_private(make_cluster):
    old = os.umask(0)
    try:
        cluster = make_cluster(1)
    finally:
        os.umask(old)
    assert cluster.directory is not None
    log_dir = cluster.nodes[0].log_path.parent
    assert stat.S_IMODE(cluster.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cluster.nodes[0].socket_path).st_mode) == 0o660


def test_a_large_request_that_came_while_the_daemon_was_stopped_is_not_cut(make_cluster) -> None:
    """The client socket is read 4 KiB at a time: a request of 12 KiB whose end arrived while the
    daemon's loop was stopped past client_frame_timeout is read whole when the deadline runs,
    not cut as unfinished (review of issue 28: one read at the deadline was not enough)."""
    from fabricd.client.connection import Call

    cluster = make_cluster(1, client_frame_timeout=1.0)
    node = cluster.nodes[0]
    assert node.process is not None
    with fabricd.connect(socket_path=node.socket_path) as fab:
        conn = fab._connection
        fields = {"seg": 1, **{f"p{k}": "x" * 3000 for k in range(4)}}
        rid, frame = conn._protocol.request("detach", fields)
        assert len(frame) > 12_000
        call = Call(rid, "detach")
        conn._calls[rid] = call
        conn._sock.sendall(frame[:100])  # the daemon reads a frame's start: its timer runs
        time.sleep(0.3)
        os.kill(node.process.pid, signal.SIGSTOP)
        try:
            conn._sock.sendall(frame[100:])  # the rest arrives while the daemon is stopped
            time.sleep(2.0)  # past client_frame_timeout
        finally:
            os.kill(node.process.pid, signal.SIGCONT)
        reply = conn.wait(call, 10)
    assert reply.meta.get("code") != "protocol", reply.meta  # answered, not cut
