"""Absent nodes (free slots of membership from etcd) in the peers engine: never dialled until
they have an address, dialled at once when they get one, and their links left to the
liveness rules when they lose it (fabricd/engines/link/peers.py, "Dialling")."""

from __future__ import annotations

from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import (
    FIRST_BACKOFF,
    Dial,
    PeerState,
    PeerTable,
    PeerUp,
    Timeouts,
)

TIMEOUTS = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)


def table(absent: frozenset[int]) -> PeerTable:
    return PeerTable(node=0, nodes=4, timeouts=TIMEOUTS, now=0.0, absent=absent)


def dials(actions: list[object]) -> list[int]:
    return [a.node for a in actions if isinstance(a, Dial)]


def fire(peers: PeerTable, until: float) -> list[object]:
    """Every timer firing up to ``until`` (bounded: each must move the deadline on)."""
    fired: list[object] = []
    for _ in range(10_000):
        deadline = peers.next_deadline()
        if deadline is None or deadline > until:
            return fired
        fired += peers.on_timer(deadline)
    raise AssertionError("the timer never stopped firing")


def test_absent_nodes_are_not_dialled_until_present() -> None:
    peers = table(frozenset({2, 3}))
    assert dials(peers.start(0.0)) == [1]
    assert dials(fire(peers, 100.0)) == []
    assert dials(peers.set_present(3, True, 5.0)) == [3]
    assert dials(peers.set_present(3, True, 5.0)) == []  # already dialling


def test_presence_before_start_waits_for_start() -> None:
    peers = table(frozenset({1, 2, 3}))
    assert peers.set_present(1, True, 0.0) == []
    assert dials(peers.start(1.0)) == [1]


def test_a_waiting_dial_is_brought_forward_when_the_address_comes_back() -> None:
    peers = table(frozenset())
    peers.start(0.0)
    peers.on_dial_failed(1, "refused", 0.0)
    peers.set_present(1, False, 0.01)
    assert dials(fire(peers, 50.0)) == []  # the due dial found it absent: stopped
    assert dials(peers.set_present(1, True, 60.0)) == [1]
    for _ in range(5):  # the backoff grows well past FIRST_BACKOFF
        peers.on_dial_failed(1, "refused", 60.0)
        fire(peers, (peers.next_deadline() or 60.0) - 1e-9)
        dials(peers.on_timer(peers.next_deadline() or 60.0))
    peers.on_dial_failed(1, "refused", 70.0)
    assert (peers.next_deadline() or 0.0) > 70.0 + FIRST_BACKOFF
    peers.set_present(1, True, 70.5)  # present all along: the wait is cut to now
    assert peers.next_deadline() == 70.5
    assert dials(fire(peers, 70.5)) == [1]


def test_a_node_that_loses_its_address_keeps_its_links_until_liveness_says_down() -> None:
    peers = table(frozenset())
    peers.start(0.0)
    peers.on_link_authenticated(1, Channel.CONTROL, 7, 0.0)
    assert any(isinstance(a, PeerUp) for a in peers.on_link_authenticated(1, Channel.DATA, 7, 0.0))
    peers.set_present(1, False, 0.1)
    assert peers.state(1) is PeerState.UP
    fired = fire(peers, 5.0)  # silent: suspect, then down and reset, and never redialled
    assert peers.state(1) is PeerState.DOWN
    assert dials(fired) == []
