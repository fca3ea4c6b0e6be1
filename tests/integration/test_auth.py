"""Peer authentication, and a peer port bound to the configured address, never all interfaces."""

from __future__ import annotations

import socket
import time

import numpy as np

import fabricd
from fabricd.transports.base import split_address
from fabricd.wire import Kind, encode


def _log(cluster, node: int) -> str:
    return cluster.nodes[node].log_path.read_text(errors="replace")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def test_binds_exactly_the_configured_address(make_cluster):
    cluster = make_cluster(2)
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as control:
            assert control.status()["address"] == node.address  # the listener's getsockname


def test_wrong_secret_is_refused_and_logged(make_cluster, tmp_path):
    other = tmp_path / "other-secret"
    other.write_text("not-the-same-secret-at-all-0123456789")
    other.chmod(0o600)
    from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster

    cluster = LocalCluster(
        2, settings=FAST_LIVENESS, node_env={1: {"FABRICD_SECRET_FILE": str(other)}}
    )
    cluster.start()
    try:
        deadline = time.monotonic() + 10
        while "authentication failed" not in _log(cluster, 0) + _log(cluster, 1):
            assert time.monotonic() < deadline, _log(cluster, 0) + _log(cluster, 1)
            time.sleep(0.05)
        time.sleep(0.3)
        for node in cluster.nodes:
            with fabricd.connect(socket_path=node.socket_path) as control:
                status = control.status()
            assert [p["state"] for p in status["peers"]] == ["connecting"]
            assert status["peers"][0]["links"] == {"control": False, "data": False}
        assert "refused link" in _log(cluster, 0) + _log(cluster, 1)
    finally:
        cluster.stop()


def test_nodes_with_different_data_integrity_never_link_and_say_why():
    from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster

    cluster = LocalCluster(
        2, settings=FAST_LIVENESS, node_env={1: {"FABRICD_DATA_INTEGRITY": "mac"}}
    )
    cluster.start()
    try:
        deadline = time.monotonic() + 10
        said = "node 0 has data_integrity = 'none', this node 'mac'"
        while said not in _log(cluster, 1):
            assert time.monotonic() < deadline, _log(cluster, 0) + _log(cluster, 1)
            time.sleep(0.05)
        for node in cluster.nodes:
            with fabricd.connect(socket_path=node.socket_path) as control:
                status = control.status()
            assert [p["state"] for p in status["peers"]] == ["connecting"]
    finally:
        cluster.stop()


def test_unauthenticated_connections_get_little_and_are_closed(make_cluster):
    cluster = make_cluster(2, handshake_timeout=0.5)
    host, port = split_address(cluster.nodes[1].address)
    pid = cluster.nodes[1].pid

    silent = socket.create_connection((host, port), timeout=5)
    start = time.monotonic()
    assert silent.recv(4096) == b""  # closed after handshake_timeout, no bytes from us
    assert time.monotonic() - start < 2.0
    silent.close()

    rss_before = _rss_kib(pid)
    junk = [
        b"\x00" * 8192,
        b"GET / HTTP/1.0\r\n\r\n",
        encode(Kind.DATA, {"msg": 1}, b"x" * 64),
        encode(Kind.HELLO, {"v": 1, "node": 0, "inc": 1, "nonce": b"n" * 32, "channel": "x"}),
    ]
    for i in range(400):  # nmap-like junk: each is closed, nothing accumulates
        with socket.create_connection((host, port), timeout=5) as conn:
            try:
                conn.sendall(junk[i % len(junk)])
                conn.settimeout(5)
                while conn.recv(4096):  # the acceptor may answer a HELLO before refusing it
                    pass
            except ConnectionResetError:
                pass
    assert _rss_kib(pid) - rss_before < 16 * 1024
    log = _log(cluster, 1)
    assert "no handshake within 0.5s" in log
    assert "refused link" in log
    assert "bad magic" in log  # junk before any handshake frame is logged with its reason

    with (
        fabricd.connect(job="after", rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as a,
        fabricd.connect(job="after", rank=1, size=2, socket_path=cluster.nodes[1].socket_path) as b,
    ):
        x, y = a.array("x", (64,), "float64"), b.array("y", (64,), "float64")
        x[:] = np.arange(64)
        pending = a.send_async(x, to=1)
        b.recv(y, src=0, timeout=10)
        pending.wait(timeout=10)
        assert (y == np.arange(64)).all()  # authenticated peers were never disturbed


def test_restarted_peer_is_a_new_incarnation(make_cluster):
    cluster = make_cluster(2)
    with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as control:
        first = control.status()["peers"][0]["incarnation"]
    cluster.kill(1)
    cluster.nodes[1].process.wait()
    cluster.restart(1)
    cluster.wait_connected()
    with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as control:
        peer = control.status()["peers"][0]
    assert peer["state"] == "up"
    assert peer["incarnation"] > first


def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether the far end closed ``conn`` (waits up to 5 s: a hang guard)."""
    conn.settimeout(5)
    try:
        return conn.recv(16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_unauthenticated_connections_from_a_peers_host_are_capped(make_cluster):
    """Node 0 (on 127.0.0.1) dials node 1: that host has 1 + 2 spare handshake slots there."""
    cluster = make_cluster(2, handshake_timeout=10.0)
    host, port = split_address(cluster.nodes[1].address)
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(20)]
    try:
        # each new link takes the slot of the oldest: all but the last three are closed,
        # long before handshake_timeout
        assert all(_closed_by_peer(conn) for conn in idle[:-3])
        with fabricd.connect(socket_path=cluster.nodes[1].socket_path) as control:
            status = control.status()
        # (17 of the flood's; one more where node 0's own link was redialled meanwhile, as a
        # loaded machine's late heartbeats can make it)
        assert status["counters"]["handshakes_evicted"] >= 17
        assert "replaced by a newer link from 127.0.0.1" in _log(cluster, 1)
    finally:
        for conn in idle:
            conn.close()
    assert [p["state"] for p in status["peers"]] == ["up"]  # the real peer was never affected


def test_a_connection_from_no_configured_host_is_closed_on_arrival(make_cluster):
    cluster = make_cluster(2, handshake_timeout=10.0)
    host, port = split_address(cluster.nodes[1].address)
    for i in range(2, 12):
        conn = socket.create_connection((host, port), timeout=5, source_address=(f"127.0.0.{i}", 0))
        with conn:
            assert _closed_by_peer(conn)  # long before handshake_timeout, and unread
    with fabricd.connect(socket_path=cluster.nodes[1].socket_path) as control:
        status = control.status()
    assert status["counters"]["refused_unknown_hosts"] == 10
    assert [p["state"] for p in status["peers"]] == ["up"]
    assert "127.0.0.2 is not the address of a node in this fabric's nodes list" in _log(cluster, 1)
