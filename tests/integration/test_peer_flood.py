"""What a host that floods a daemon's peer port can make it hold: real daemons on loopback.

Every address is in 127.0.0.0/8.  Node 0 (on 127.0.0.1) dials node 1, so 127.0.0.1 is the
only host node 1 takes handshakes from; every other loopback address is no configured node's.
"""

from __future__ import annotations

import contextlib
import selectors
import threading
from typing import TYPE_CHECKING

import fabricd

from .peer_client import connect

if TYPE_CHECKING:
    from fabricd.daemon.launcher import LocalCluster

#: what the issue measured: 17 loopback addresses filled the 256 slots (16 per host) of old
SOURCES = [f"127.0.0.{i}" for i in range(2, 26)]
PER_SOURCE = 16


class Flood:
    """Keeps ``PER_SOURCE`` idle connections open from each of ``SOURCES``, reopening any the
    daemon closes at once, as fast as the daemon accepts them."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.stop = threading.Event()
        self.opened = 0
        self.selector = selectors.DefaultSelector()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()

    def _open(self, source: str) -> None:
        try:
            sock = connect(self.address, source)
        except OSError:
            return  # the backlog was full: next sweep
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, source)
        self.opened += 1

    def _run(self) -> None:
        wanted = [s for s in SOURCES for _ in range(PER_SOURCE)]
        for source in wanted:
            self._open(source)
        while not self.stop.is_set():
            closed = []
            for key, _ in self.selector.select(timeout=0.005):
                with contextlib.suppress(BlockingIOError):
                    try:
                        if key.fileobj.recv(4096):  # type: ignore[union-attr]
                            continue
                    except ConnectionResetError:
                        pass
                    closed.append(key)
            for key in closed:
                self.selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
            for key in closed:
                self._open(key.data)
            missing = len(wanted) - len(self.selector.get_map())
            for source in (SOURCES * PER_SOURCE)[:missing]:  # refused by connect: try again
                self._open(source)


def _status(cluster: LocalCluster, node: int) -> dict:
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as control:
        return control.status()


def test_a_restarted_peer_rejoins_through_a_flood_from_other_loopback_addresses(make_cluster):
    # a flood link may wait 30 s for its handshake: whatever slot it takes, it keeps that long
    cluster = make_cluster(2, handshake_timeout=30.0)
    before = _status(cluster, 1)["peers"][0]["incarnation"]
    with Flood(cluster.nodes[1].address) as flood:
        while flood.opened < len(SOURCES) * PER_SOURCE and flood.thread.is_alive():
            flood.stop.wait(0.05)  # the whole flood is under way before the peer restarts
        cluster.kill(0)
        cluster.nodes[0].process.wait(30)
        cluster.restart(0)
        # a hang guard, shorter than handshake_timeout: before, the flood held every slot
        # until then, and the restarted peer could not get one
        cluster.wait_connected(timeout=20)
        during = _status(cluster, 1)
    assert [p["state"] for p in during["peers"]] == ["up"]
    assert during["peers"][0]["incarnation"] > before  # the restarted daemon got in
    assert during["counters"]["refused_unknown_hosts"] >= len(SOURCES) * PER_SOURCE
    assert during["counters"]["handshakes_evicted"] == 0  # nothing came from node 0's host


def test_refusals_are_logged_as_summaries_not_a_line_each(make_cluster):
    cluster = make_cluster(2)
    for _ in range(2000):
        with contextlib.suppress(OSError), connect(cluster.nodes[1].address, "127.0.0.9") as s:
            s.settimeout(0.0)
    refused = _status(cluster, 1)["counters"]["refused_unknown_hosts"]
    assert refused >= 1000  # (a connect the backlog dropped is not counted)
    cluster.stop()
    log = cluster.nodes[1].log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "from 127.0.0.9" in line]
    left_out = [line for line in lines if "more such lines" in line]
    assert left_out  # one summary per interval, with the count of what it left out
    assert len(lines) < refused / 4  # far fewer lines than refusals
    counted = sum(int(line.split("refused on arrival: ")[1].split()[0]) for line in left_out)
    # every refusal is in a line or a count (the last few may be refused after the status)
    assert refused <= counted + len(lines) - len(left_out) <= 2000


def test_the_flood_is_held_to_what_it_can_hold(make_cluster):
    """However long the flood, the daemon holds no more links than the slots of node 0's host."""
    cluster = make_cluster(2, handshake_timeout=30.0)
    held = [connect(cluster.nodes[1].address) for _ in range(3)]  # node 0's host: 1 + 2 spare
    try:
        with Flood(cluster.nodes[1].address) as flood:
            while flood.opened < len(SOURCES) * PER_SOURCE and flood.thread.is_alive():
                flood.stop.wait(0.05)
            status = _status(cluster, 1)
        assert status["counters"]["handshakes_evicted"] == 0  # the flood took no slot of them
        for sock in held:  # still held: nothing from elsewhere pushed them out
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                assert sock.recv(1) != b""
    finally:
        for sock in held:
            sock.close()
    assert [p["state"] for p in status["peers"]] == ["up"]
