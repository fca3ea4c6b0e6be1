"""Faults on real daemons: dead and hung peers, bad clients, clients that die mid-transfer.

Liveness settings are the launcher's fast ones: heartbeat 0.1 s, suspect after 0.3 s, down
after D = 1 s.  Bounds are checked as wait timeouts: an operation that outlives its
bound shows up as a Timeout instead of the typed error the test expects.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS
from fabricd.ipc import REPLY_LIMITS
from fabricd.shm import Segment
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, encode
from tests.integration.ranks import join_and_wait, recv_expecting_failure, send_forever

D = FAST_LIVENESS["down_after"]


def _peer_state(socket_path: str, node: int) -> str:
    with fabricd.connect(socket_path=socket_path) as control:
        return next(p["state"] for p in control.status()["peers"] if p["node"] == node)


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_sigkilled_daemon_is_marked_down_and_its_waiters_get_peer_failed(
    make_cluster, spawn, queue
):
    cluster = make_cluster(3)
    spawn(join_and_wait, cluster.nodes[2].socket_path, "kill", 2, 3, 30, queue)
    assert queue.get(timeout=30) == ("joined", 2)
    waiter = spawn(recv_expecting_failure, cluster.nodes[0].socket_path, "kill", 0, 3, 2, queue)
    assert queue.get(timeout=30)[0] == "posted"
    cluster.kill(2, signal.SIGKILL)
    killed_at = time.monotonic()
    outcome = queue.get(timeout=30)
    assert outcome[0] == "PeerFailed", outcome
    assert outcome[1] - killed_at < 2 * D, "a typed error within twice the detection time"
    assert "node 2" in outcome[2]
    assert _wait_for(lambda: _peer_state(cluster.nodes[0].socket_path, 2) == "down", D + 1.0)
    assert _peer_state(cluster.nodes[1].socket_path, 2) in ("down", "suspect")
    waiter.join(10)
    assert waiter.exitcode == 0


def test_hung_daemon_is_detected_by_silence(make_cluster, spawn, queue):
    cluster = make_cluster(2)
    spawn(join_and_wait, cluster.nodes[1].socket_path, "hang", 1, 2, 30, queue)
    assert queue.get(timeout=30) == ("joined", 1)
    spawn(recv_expecting_failure, cluster.nodes[0].socket_path, "hang", 0, 2, 1, queue)
    assert queue.get(timeout=30)[0] == "posted"
    cluster.kill(1, signal.SIGSTOP)  # the links stay open: only heartbeats can tell
    stopped_at = time.monotonic()
    try:
        outcome = queue.get(timeout=30)
        assert outcome[0] == "PeerFailed", outcome
        assert D * 0.9 <= outcome[1] - stopped_at < 2 * D
        assert _peer_state(cluster.nodes[0].socket_path, 1) == "down"
    finally:
        cluster.kill(1, signal.SIGCONT)


def _told_why_and_closed(sock: socket.socket) -> dict[str, object]:
    """Read to the end: the daemon must send one closing event, then close."""
    decoder, frames = Decoder(REPLY_LIMITS), []
    while data := sock.recv(4096):
        decoder.feed(data)
        while (item := decoder.next_event()) is not NEED_DATA:
            if isinstance(item, Frame):
                frames.append((item.kind, item.meta))
    assert len(frames) == 1, frames
    assert frames[0][0] is Kind.EVENT
    assert frames[0][1]["event"] == "closing"
    return frames[0][1]


def test_garbage_on_the_client_socket_closes_only_that_client(make_cluster):
    cluster = make_cluster(1)
    path = cluster.nodes[0].socket_path
    with fabricd.connect(job="g", rank=0, size=1, socket_path=path) as good:
        for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", encode(Kind.HEARTBEAT, {})):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
                bad.settimeout(5)
                bad.connect(path)
                bad.sendall(junk)
                closing = _told_why_and_closed(bad)  # the daemon closes a connection that sent junk
                assert closing["code"] == "protocol"
                assert str(closing["error"]).startswith("protocol error: ")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:  # a malformed request
            bad.settimeout(5)
            bad.connect(path)
            bad.sendall(encode(Kind.REQUEST, {"id": "x", "op": 5}))
            assert _told_why_and_closed(bad)["code"] == "protocol"
        sent, got = good.array("a", (10,), "int64"), good.array("b", (10,), "int64")
        sent[:] = np.arange(10)
        pending = good.send_async(sent, to=0)  # a rank may message itself through its daemon
        good.recv(got, src=0, timeout=10)
        pending.wait(timeout=10)
        assert (got == np.arange(10)).all()
    assert cluster.nodes[0].log_tail(50).count("protocol error") >= 4


def test_requests_with_wrong_fields_get_clear_errors_and_the_client_goes_on(make_cluster):
    cluster = make_cluster(1)
    with fabricd.connect(job="u", rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
        with pytest.raises(fabricd.UsageError, match="rank 5 is outside"):
            fab.send(fab.array("a", (4,), "float32"), to=5)
        with pytest.raises(fabricd.UsageError, match="not in fabricd shared memory"):
            fab.send(np.zeros(4, dtype=np.float32), to=1)
        with pytest.raises(fabricd.UsageError, match="not supported"):
            fab.array("s", (4,), "U8")
        with pytest.raises(fabricd.UsageError, match="already exists"):
            fab.array("a", (5,), "float32")
        seg, _ = fab._arrays.locate(fab.array("a", (4,), "float32"))
        bad_requests = [
            (
                {"seg": seg, "off": 8, "nbytes": 16, "dtype": "float32", "peer": 1, "tag": 0},
                "outside the 16 B segment",
            ),
            (
                {"seg": seg, "off": 0, "nbytes": 6, "dtype": "float32", "peer": 1, "tag": 0},
                "whole number",
            ),
            (
                {"seg": seg, "off": 0, "nbytes": 16, "dtype": "float128", "peer": 1, "tag": 0},
                "not supported",
            ),
            (
                {"seg": 99, "off": 0, "nbytes": 16, "dtype": "float32", "peer": 1, "tag": 0},
                "segment 99 is not attached",
            ),
        ]
        for fields, message in bad_requests:
            with pytest.raises(fabricd.UsageError, match=message):
                fab._call("send", **fields)
        read_end, write_end = os.pipe()
        with pytest.raises(fabricd.UsageError, match="not a memfd"):
            fab._call("attach", fds=[read_end], seg=50, size=1)
        os.close(read_end)
        os.close(write_end)
        unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 4096)
        with pytest.raises(fabricd.UsageError, match="not sealed"):
            fab._call("attach", fds=[unsealed], seg=51, size=4096)
        os.close(unsealed)
        sealed = Segment.create("liar", 4096)
        with pytest.raises(fabricd.UsageError, match="declared"):
            fab._call("attach", fds=[sealed.fd], seg=52, size=1 << 20)
        sealed.close()
        assert fab.status()["state"] == "serving"  # the same client still works


def test_client_killed_mid_send_leaves_the_daemon_serving(make_cluster, spawn, queue):
    cluster = make_cluster(2)
    sender = spawn(send_forever, cluster.nodes[0].socket_path, "mid", 0, 2, 1, 128, queue)
    with fabricd.connect(
        job="mid", rank=1, size=2, socket_path=cluster.nodes[1].socket_path
    ) as fab:
        array = fab.array("big", (128 * 1024 * 1024,), "uint8")
        handle = fab.recv_async(array, src=0)
        assert queue.get(timeout=30) is True
        os.kill(sender.pid, signal.SIGKILL)
        try:  # matched transfers finish from the daemon's own mapping; others fail cleanly
            handle.wait(timeout=10)
            assert (array == 7).all()
        except fabricd.PeerFailed:
            pass
    for node in cluster.nodes:
        assert _wait_for(lambda n=node: _pending(n.socket_path) == 0, 5)
    with fabricd.connect(
        job="mid2", rank=0, size=1, socket_path=cluster.nodes[0].socket_path
    ) as fab:
        x, y = fab.array("x", (3,), "int8"), fab.array("y", (3,), "int8")
        x[:] = (1, 2, 3)
        pending = fab.send_async(x, to=0)
        assert fab.recv(y, src=0, timeout=10).nbytes == 3
        pending.wait(timeout=10)
        assert list(y) == [1, 2, 3]


def _pending(socket_path: str) -> int:
    with fabricd.connect(socket_path=socket_path) as control:
        return int(control.status()["pending_ops"])


def test_dead_clients_leave_no_mappings_in_the_daemon_and_nothing_in_dev_shm(
    make_cluster, spawn, queue
):
    before = set(os.listdir("/dev/shm"))
    cluster = make_cluster(1)
    daemon_pid = cluster.nodes[0].pid
    baseline = _memfd_mappings(daemon_pid)
    path = cluster.nodes[0].socket_path
    with fabricd.connect(job="leak2", rank=0, size=1, socket_path=path) as fab:
        fab.array("mine", (4096,), "uint8")
        assert _memfd_mappings(daemon_pid) == baseline + 1
    assert _wait_for(lambda: _memfd_mappings(daemon_pid) == baseline, 5)  # closed cleanly
    client = spawn(join_and_wait, path, "leak", 0, 1, 30, queue)
    assert queue.get(timeout=30) == ("joined", 0)
    assert _memfd_mappings(daemon_pid) == baseline + 1
    client.kill()  # SIGKILL: the daemon must notice and unmap what the client held
    assert _wait_for(lambda: _memfd_mappings(daemon_pid) == baseline, 5)
    cluster.kill(0, signal.SIGKILL)
    assert set(os.listdir("/dev/shm")) - before == set(), "no new /dev/shm entries"


def _memfd_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum("memfd:fabricd:" in line for line in maps)
