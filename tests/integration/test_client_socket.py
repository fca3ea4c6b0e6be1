"""The client socket on a real daemon: where a user finds it, and why the daemon hangs up.

Users other than root are played by forked children that drop to ``nobody`` (CI runs as
root); without root the children run as the test's own user, which is not root either.  The
daemon's socket is made reachable for them through the file system (pytest's and the
cluster's temporary directories are 0700), so only the daemon's own checks decide.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import fabricd
from fabricd import ipc

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.launcher import LocalCluster

NOBODY = pwd.getpwnam("nobody")


def _as_a_user(child: Callable[[], str]) -> str:
    """Run ``child`` in a forked process as a user that is not root (nobody, when run as root).

    Returns what it returned, or its exception as ``"Name: message"``.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY.pw_gid)
                os.setuid(NOBODY.pw_uid)
            answer = child()
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        answer = report.read().decode()
    os.waitpid(pid, 0)
    return answer


def _open_to_all(cluster: LocalCluster) -> str:
    """Let every user reach node 0's socket through the file system; returns its path."""
    assert cluster.directory is not None
    cluster.directory.chmod(0o755)
    path = cluster.nodes[0].socket_path
    Path(path).chmod(0o666)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid the daemon refuses needs root to switch to")
def test_a_refused_client_raises_the_daemons_reason(make_cluster):
    path = _open_to_all(make_cluster(1))

    def child() -> str:
        with fabricd.connect(socket_path=path, timeout=10) as control:
            return f"admitted: {control.status()['state']}"

    answer = _as_a_user(child)
    assert answer.startswith("DaemonUnavailable: hello: the daemon on "), answer
    assert f"uid {NOBODY.pw_uid} (gid {NOBODY.pw_gid}) may not use this daemon" in answer
    assert "allowed_uids/allowed_gids" in answer
    assert "may have refused" not in answer  # the reason is the daemon's, not a guess
    with fabricd.connect(socket_path=path) as control:
        counters = control.status()["counters"]
    assert counters["refused_clients"] == 1
    assert counters["refused_clients_not_allowed"] == 1


def test_a_user_finds_the_system_daemon_past_their_own_runtime_dir(make_cluster, monkeypatch):
    path = _open_to_all(make_cluster(1, allowed_uids=[NOBODY.pw_uid]))
    runtime = Path(path).parent / "runtime-of-the-user"  # no daemon of their own there
    monkeypatch.delenv("FABRICD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(ipc, "SYSTEM_SOCKET", path)  # the system location, for this test

    def child() -> str:
        assert ipc.socket_candidates() == (str(runtime / "fabricd" / "fabricd.sock"), path)
        with fabricd.connect(timeout=10) as control:
            return f"{control.socket_path} {control.status()['socket']}"

    assert _as_a_user(child) == f"{path} {path}"


def test_a_request_that_breaks_the_protocol_fails_with_the_daemons_reason(make_cluster):
    cluster = make_cluster(1)
    with fabricd.connect(job="p", rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
        waiting = fab.recv_async(fab.array("a", (4,), "float32"), src=1)
        liar = fab._connection.submit("status", {"fds": 3})  # announces fds it does not pass
        with pytest.raises(fabricd.DaemonUnavailable, match="announced 3 fds but fewer arrived"):
            fab._connection.wait(liar, timeout=10).result("status")
        with pytest.raises(fabricd.DaemonUnavailable, match="closed the connection: protocol"):
            waiting.wait(timeout=10)  # every pending call fails with the same reason
        closing = fab.poll()
        assert [event.name for event in closing] == ["closing"]
        assert closing[0].fields["code"] == "protocol"
        assert fab.closed


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to switch to")
def test_one_user_cannot_take_every_client_slot(make_cluster):
    path = _open_to_all(make_cluster(1, allowed_uids=[NOBODY.pw_uid], max_clients_per_uid=2))

    def child() -> str:
        with (
            fabricd.connect(socket_path=path, timeout=10),
            fabricd.connect(socket_path=path, timeout=10),
            fabricd.connect(socket_path=path, timeout=10) as third,
        ):
            return f"admitted: {third.status()['state']}"

    answer = _as_a_user(child)
    assert answer.startswith("DaemonUnavailable: "), answer
    assert f"uid {NOBODY.pw_uid} already has max_clients_per_uid (2) connections" in answer
    with (  # root (an operator) is exempt: three at once
        fabricd.connect(socket_path=path),
        fabricd.connect(socket_path=path),
        fabricd.connect(socket_path=path) as control,
    ):
        counters = control.status()["counters"]
    assert counters["refused_clients_max_clients_per_uid"] == 1
    assert counters["refused_clients"] == 1
