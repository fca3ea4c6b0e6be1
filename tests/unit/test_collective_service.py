"""The collective service on a fake host: what a reset of a peer's links does to a collective.

A reset loses the frames in flight, but the peer may come back, the same daemon, before the
peers engine counts it down: a link that flaps under load must not split a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.daemon.config import Config
from fabricd.daemon.services.collectives import CollectiveService
from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import PeerInfo, PeerState
from tests.unit.test_collective_service_review import (
    FakeHost,
    Link,
    Table,
    call,
    client,
    join,
)

if TYPE_CHECKING:
    from fabricd.engines.collectives.persistent import Collective

THREE = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


class Peers:
    """The peers engine's view, with incarnations a test changes."""

    def __init__(self) -> None:
        self.incarnations = {1: 7, 2: 7}

    def __call__(self, now: float) -> list[PeerInfo]:
        return [
            PeerInfo(
                node=node,
                state=PeerState.UP,
                incarnation=inc,
                silent_for=0.0,
                state_for=0.0,
                links=frozenset(Channel),
            )
            for node, inc in self.incarnations.items()
        ]


def solo() -> tuple[CollectiveService, FakeHost, Peers, Collective]:
    table, peers = Table(), Peers()
    host = FakeHost(Config(node_id=0, nodes=THREE))
    svc = CollectiveService(host, membership=table, peers=peers)  # type: ignore[arg-type]
    for node in (1, 2):
        host.links[node] = Link()
        host.links[node].writable = True
    join(svc, table, 3, (0, 1, 2))
    call(svc, client(0, 3, [1.0] * 4), 1, mode="solo")
    (coll,) = svc.collectives.values()
    return svc, host, peers, coll


def test_a_peer_back_within_down_after_is_not_lost_and_the_round_runs_on() -> None:
    svc, host, _, coll = solo()
    svc.peer_down(1, "control link lost", 0.0)
    assert svc.next_deadline() == host.config.down_after
    assert coll.lost == frozenset()
    svc.peer_up(1, 0.5)
    assert coll.lost == frozenset()
    assert coll.round == 1  # the round in flight is run again under a new number
    assert svc.next_deadline() is None
    sent = [m for m in host.links[2].sent if m["t"] == 2**31 - 1]
    assert sent  # node 2 is told of the new base at once
    assert sent[-1]["b"] == 1


def test_a_peer_that_restarted_is_lost() -> None:
    svc, _, peers, coll = solo()
    svc.peer_down(1, "control link lost", 0.0)
    peers.incarnations[1] = 8  # a new daemon: the old one died
    svc.peer_up(1, 0.5)
    assert coll.lost == frozenset({1})


def test_a_peer_not_back_within_down_after_is_lost() -> None:
    svc, host, _, coll = solo()
    svc.peer_down(1, "control link lost", 0.0)
    svc.on_timer(host.config.down_after / 2)
    assert coll.lost == frozenset()
    svc.on_timer(host.config.down_after)
    assert coll.lost == frozenset({1})
    assert svc.next_deadline() is None
