"""The collective service on a fake host: what a reset of a peer's links does to a collective.

A reset loses the frames in flight, but the peer may come back, the same daemon, before
membership counts it gone: a link that flaps under load must not split a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.daemon.config import Config
from fabricd.daemon.services.collectives import CollectiveService
from fabricd.engines.membership import Membership, NodeBack, NodeGone
from tests.unit.test_collective_service_review import (
    FakeHost,
    Link,
    Table,
    call,
    client,
    join,
)

if TYPE_CHECKING:
    from fabricd.engines.membership import Action

THREE = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


class Fabric:
    """The collective service, and the membership engine whose verdicts on reset nodes it
    hears (as the membership service delivers them), with incarnations a test changes."""

    def __init__(self) -> None:
        table = Table()
        self.host = FakeHost(Config(node_id=0, nodes=THREE))
        self.svc = CollectiveService(self.host, membership=table)  # type: ignore[arg-type]
        self.members = Membership(node=0, down_after=self.host.config.down_after)
        self.incarnations = {1: 7, 2: 7}
        for node in (1, 2):
            self.host.links[node] = Link()
            self.host.links[node].writable = True
        join(self.svc, table, 3, (0, 1, 2))
        call(self.svc, client(0, 3, [1.0] * 4), 1, mode="solo")
        (self.coll,) = self.svc.collectives.values()

    def reset(self, node: int, now: float) -> None:
        self.svc.peer_down(node, "control link lost", now)
        self._hear(
            self.members.peer_down(node, "control link lost", now, self.incarnations[node]), now
        )

    def up(self, node: int, now: float) -> None:
        self._hear(self.members.peer_up(node, self.incarnations[node]), now)
        self.svc.peer_up(node, now)

    def tick(self, now: float) -> None:
        self._hear(self.members.on_timer(now), now)
        self.svc.on_timer(now)

    def next_deadline(self) -> float | None:
        return min(
            (d for d in (self.members.next_deadline(), self.svc.next_deadline()) if d is not None),
            default=None,
        )

    def _hear(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, NodeBack | NodeGone):
                self.svc.on_suspicion(action, now)


def test_a_peer_back_within_down_after_is_not_lost_and_the_round_runs_on() -> None:
    fab = Fabric()
    fab.reset(1, 0.0)
    assert fab.next_deadline() == fab.host.config.down_after
    assert fab.coll.lost == frozenset()
    fab.up(1, 0.5)
    assert fab.coll.lost == frozenset()
    assert fab.coll.round == 1  # the round in flight is run again under a new number
    assert fab.next_deadline() == fab.host.config.stall_after  # only the call's stall check
    sent = [m for m in fab.host.links[2].sent if m["t"] == 2**31 - 1]
    assert sent  # node 2 is told of the new base at once
    assert sent[-1]["b"] == 1


def test_a_peer_that_restarted_is_lost() -> None:
    fab = Fabric()
    fab.reset(1, 0.0)
    fab.incarnations[1] = 8  # a new daemon: the old one died
    fab.up(1, 0.5)
    assert fab.coll.lost == frozenset({1})


def test_a_peer_not_back_within_down_after_is_lost() -> None:
    fab = Fabric()
    fab.reset(1, 0.0)
    fab.tick(fab.host.config.down_after / 2)
    assert fab.coll.lost == frozenset()
    fab.tick(fab.host.config.down_after)
    assert fab.coll.lost == frozenset({1})
    assert fab.next_deadline() == fab.host.config.stall_after  # only the call's stall check


def test_a_link_that_flaps_is_lost_down_after_its_first_reset() -> None:
    """A second reset before the node is back does not give it down_after again."""
    fab = Fabric()
    fab.reset(1, 0.0)
    fab.reset(1, 2.0)
    fab.tick(fab.host.config.down_after)
    assert fab.coll.lost == frozenset({1})
