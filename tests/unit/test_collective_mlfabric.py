"""MLfabric-S as an allreduce (fabricd/engines/collectives/mlfabric.py) on a simulated fabric:
no sockets, a fake clock, numpy data.

Each node runs one :class:`MlfabricCollective`; messages travel on FIFO links between node
pairs, are cut into frames as the service cuts them, and are delivered in an order hypothesis
draws, while ranks call in an order it draws too (stragglers: some call many steps late).
What must hold (issue 24, item 4): every round's result, at every node, is the reduction of
every rank's array of that round, exactly once each, and the same bits everywhere; groups do
form when the root's link is the bottleneck; a peer's message that breaks the protocol is
refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.collectives import mlfabric
from fabricd.engines.collectives.mlfabric import MlfabricCollective, root_of
from fabricd.engines.collectives.persistent import NOTICE, Action, Deliver, Fail, Spec, Transmit
from fabricd.engines.collectives.spec import held_bytes
from fabricd.errors import RemoteProtocolError, UsageError

JOB, NAME = "job", "grad"
FRAME = 24  #: bytes of one frame: data messages come in several


class Recording(MlfabricCollective):
    """Keeps every round's result, the most bytes it held, and the groups it summed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.history: dict[int, np.ndarray[Any, Any]] = {}
        self.peak = 0
        super().__init__(*args, **kwargs)

    def _ended(self, round: int, now: float) -> None:
        super()._ended(round, now)
        assert round not in self.history, "a round ended twice"
        self.history[round] = self.result[: self.spec.count].copy()

    def measure(self) -> None:
        self.peak = max(self.peak, sum(a.nbytes for a in self.arrays()))


@dataclass
class Fabric:
    spec: Spec
    placement: tuple[int, ...]
    rng: Random
    figures: dict[int, tuple[float, float]] = field(default_factory=dict)
    interval: float = 0.5
    colls: dict[int, Recording] = field(default_factory=dict)
    links: dict[tuple[int, int], deque[Transmit]] = field(default_factory=dict)
    delivered: dict[int, Deliver] = field(default_factory=dict)
    failed: dict[int, Fail] = field(default_factory=dict)
    sums: int = 0  #: SUM messages sent (groups forwarded by aggregators)
    now: float = 0.0

    def __post_init__(self) -> None:
        live = frozenset(range(len(self.placement)))
        for node in sorted(set(self.placement)):
            self.colls[node] = Recording(
                self.spec,
                job=JOB,
                name=NAME,
                node=node,
                ranks=self.placement,
                live=live,
                interval=self.interval,
                figures=lambda: self.figures,
            )

    def perform(self, node: int, actions: list[Action]) -> None:
        self.colls[node].measure()
        for action in actions:
            match action:
                case Transmit():
                    self.sums += action.tag >= mlfabric.SUM
                    self.links.setdefault((node, action.node), deque()).append(action)
                case Deliver():
                    assert action.token not in self.delivered, "a call completed twice"
                    self.delivered[action.token] = action
                case Fail():
                    self.failed[action.token] = action

    def call(self, rank: int, token: int, array: np.ndarray[Any, Any]) -> None:
        node = self.placement[rank]
        self.now += 0.01
        self.perform(node, self.colls[node].call(rank, token, array, self.now))

    def deliver_one(self) -> bool:
        ready = [pair for pair, queue in self.links.items() if queue]
        if not ready:
            return False
        src, dst = self.rng.choice(ready)
        self.deliver(src, dst, self.links[src, dst].popleft())
        return True

    def deliver(self, src: int, dst: int, message: Transmit) -> None:
        """As the service places a message: frame by frame, each landed, then counted in."""
        coll = self.colls[dst]
        payload = bytes(message.payload)
        # a GRANT or GATHER is one frame: it is far below the least chunk_size
        frame = len(payload) if message.tag in (mlfabric.GRANT, mlfabric.GATHER) else FRAME
        offsets = range(0, len(payload), frame) if payload else [0]
        for offset in offsets:
            self.now += 0.01
            chunk = payload[offset : offset + frame]
            if chunk:
                view = coll.landing(
                    src, message.tag, message.round, offset, len(chunk), (), 0, self.now
                )
                assert view is not None
                view[:] = chunk
            self.perform(
                dst, coll.arrived(src, message.tag, message.round, len(chunk), (), 0, self.now)
            )

    def expire(self) -> bool:
        due = [(d, n) for n, c in self.colls.items() if (d := c.next_deadline()) is not None]
        if not due:
            return False
        deadline, node = min(due)
        self.now = max(self.now, deadline)
        self.perform(node, self.colls[node].on_timer(self.now))
        return True

    def drain(self) -> None:
        for _ in range(100_000):
            if not self.deliver_one() and not self.expire():
                return
        raise AssertionError("the fabric did not settle")


def gift(rank: int, round: int, count: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s array of ``round``: distinct small integers (exact in float64)."""
    return np.arange(count, dtype=np.float64) * (rank + 1) + 100 * round + rank


def expected(ranks: int, round: int, count: int, op: str) -> np.ndarray[Any, Any]:
    gifts = [gift(r, round, count) for r in range(ranks)]
    if op == "max":
        return np.maximum.reduce(gifts)
    total = np.sum(gifts, axis=0)
    return total / ranks if op == "avg" else total


SPEC = Spec(kind="allreduce", count=7, dtype="float64", op="sum", algorithm="mlfabric")
PLACEMENTS = st.sampled_from([(0, 1), (0, 1, 2), (0, 0, 1, 2, 2), (0, 1, 2, 3, 4), (3, 1, 1, 0)])


@settings(max_examples=150, deadline=None)
@given(
    PLACEMENTS,
    st.sampled_from(["sum", "avg", "max"]),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_every_round_is_every_ranks_reduction_with_the_same_bits_everywhere(
    placement: tuple[int, ...], op: str, seed: int, slow_root: bool
) -> None:
    """Ranks call three rounds in a drawn order, some far behind (stragglers), messages come
    in a drawn order, frame by frame: every node's every round is the reduction of every
    rank's array, bit for bit the root's."""
    rng = Random(seed)
    spec = Spec(**{**SPEC.to_meta(), "op": op})
    fabric = Fabric(spec, placement, rng)
    nodes = sorted(set(placement))
    if slow_root:  # the root's downlink the bottleneck: Alg. 3 groups
        fabric.figures = {n: (1e6, 10.0 if n == nodes[0] else 1e6) for n in nodes}
    rounds = 3
    pending = [(r, k) for k in range(rounds) for r in range(len(placement))]
    for _ in range(10_000):  # bounded: a deadlock fails the test, never hangs it
        due = [
            (r, k)
            for r, k in pending
            if k == 0 or fabric.delivered.get(r * rounds + k - 1) is not None
        ]
        busy = any(q for q in fabric.links.values())
        if due and (rng.random() < 0.3 or not busy):
            rank, k = rng.choice(due)
            pending.remove((rank, k))
            fabric.call(rank, rank * rounds + k, gift(rank, k, spec.count))
        elif not fabric.deliver_one() and not fabric.expire() and not pending:
            break
    fabric.drain()
    assert not fabric.failed
    assert len(fabric.delivered) == len(placement) * rounds
    for k in range(rounds):
        want = expected(len(placement), k, spec.count, op)
        results = [c.history[k] for c in fabric.colls.values()]
        np.testing.assert_allclose(results[0], want, rtol=1e-12)
        for result in results[1:]:
            np.testing.assert_array_equal(result, results[0])  # the root's bits
    tensor = spec.count * 8
    for coll in fabric.colls.values():
        assert coll.peak <= held_bytes(spec, len(nodes), inplace=False)
        assert coll.peak >= 2 * tensor


def test_groups_form_when_the_roots_link_is_the_bottleneck() -> None:
    """Five nodes ready at once, the root's downlink 1000x slower than the others' links:
    Alg. 3 sums contributions at other nodes' daemons, and the result is still exact."""
    placement = (0, 1, 2, 3, 4)
    fabric = Fabric(SPEC, placement, Random(1))
    fabric.figures = {
        n: (1e6, 1e3 if n == root_of(JOB, NAME, 0, (0, 1, 2, 3, 4)) else 1e6) for n in placement
    }
    for rank in placement:
        fabric.call(rank, rank, gift(rank, 0, SPEC.count))
    fabric.drain()
    assert fabric.sums > 0
    for coll in fabric.colls.values():
        np.testing.assert_array_equal(coll.history[0], expected(5, 0, SPEC.count, "sum"))


def test_a_lone_straggler_is_granted_after_the_batch_interval() -> None:
    """The root plans the nodes ready within an interval; the straggler's READY opens a batch
    of its own, planned at once (every other node is in)."""
    placement = (0, 1, 2)
    fabric = Fabric(SPEC, placement, Random(2), interval=0.5)
    root = root_of(JOB, NAME, 0, placement)
    straggler = next(n for n in placement if n != root)
    for rank in placement:
        if rank != straggler:
            fabric.call(rank, rank, gift(rank, 0, SPEC.count))
    while fabric.deliver_one():
        pass
    assert fabric.colls[root].next_deadline() is not None  # a batch waits for its interval
    fabric.expire()
    fabric.call(straggler, straggler, gift(straggler, 0, SPEC.count))
    fabric.drain()
    for coll in fabric.colls.values():
        np.testing.assert_array_equal(coll.history[0], expected(3, 0, SPEC.count, "sum"))


def test_one_node_alone_reduces_its_ranks() -> None:
    fabric = Fabric(Spec(**{**SPEC.to_meta(), "op": "avg"}), (0, 0, 0), Random(3))
    for rank in range(3):
        fabric.call(rank, rank, gift(rank, 0, SPEC.count))
    np.testing.assert_allclose(fabric.colls[0].history[0], expected(3, 0, SPEC.count, "avg"))


# -- what a peer may not do ----------------------------------------------------------------
def two_nodes() -> tuple[Fabric, int, int]:
    fabric = Fabric(SPEC, (0, 1, 2), Random(4))
    root = root_of(JOB, NAME, 0, (0, 1, 2))
    other = next(n for n in (0, 1, 2) if n != root)
    return fabric, root, other


def send(fabric: Fabric, src: int, dst: int, tag: int, round: int, payload: bytes) -> None:
    fabric.deliver(
        src,
        dst,
        Transmit(node=dst, round=round, tag=tag, payload=memoryview(payload), lost=(), base=0),
    )


def test_a_part_the_root_did_not_grant_is_refused() -> None:
    fabric, root, other = two_nodes()
    with pytest.raises(RemoteProtocolError, match="not one this node takes"):
        send(fabric, other, root, mlfabric.PART, 0, bytes(SPEC.count * 8))


def test_a_result_from_a_node_that_is_not_root_is_refused() -> None:
    fabric, root, other = two_nodes()
    third = next(n for n in (0, 1, 2) if n not in (root, other))
    fabric.call(third, 0, gift(third, 0, SPEC.count))  # its round is activated
    with pytest.raises(RemoteProtocolError, match="not one this node takes"):
        send(fabric, other, third, mlfabric.RESULT, 0, bytes(SPEC.count * 8))


def test_a_message_two_rounds_ahead_is_refused() -> None:
    fabric, root, other = two_nodes()
    with pytest.raises(RemoteProtocolError, match="round 2"):
        send(fabric, other, root, mlfabric.READY, 2, b"")


def test_a_ready_twice_or_to_a_node_not_root_is_refused() -> None:
    fabric, root, other = two_nodes()
    send(fabric, other, root, mlfabric.READY, 0, b"")
    with pytest.raises(RemoteProtocolError, match="ready twice"):
        send(fabric, other, root, mlfabric.READY, 0, b"")
    with pytest.raises(RemoteProtocolError, match="not root"):
        send(fabric, root, other, mlfabric.READY, 0, b"")


@pytest.mark.parametrize(
    "header",
    [[0], [-1, 1], [0, 99], [0, 1, 1]],
    ids=["no members", "bad group", "not a member", "a member twice"],
)
def test_a_malformed_gather_is_refused(header: list[int]) -> None:
    fabric, root, other = two_nodes()
    payload = np.array(header, "<i8").tobytes()
    with pytest.raises(RemoteProtocolError):
        send(fabric, root, other, mlfabric.GATHER, 0, payload)


def test_bytes_for_a_message_that_carries_none_are_refused() -> None:
    fabric, root, other = two_nodes()
    with pytest.raises(RemoteProtocolError, match="not one this node takes"):
        fabric.colls[root].landing(other, mlfabric.READY, 0, 0, 8, (), 0, 0.0)


def test_mlfabric_is_a_sync_allreduce() -> None:
    with pytest.raises(UsageError, match="sync allreduce"):
        Spec(kind="allreduce", count=4, mode="solo", algorithm="mlfabric").check()
    assert SPEC.mlfabric
    assert not SPEC.doubling
    assert not SPEC.ring


def test_a_lost_node_fails_the_round_everywhere_it_waits() -> None:
    fabric, root, other = two_nodes()
    fabric.call(other, 0, gift(other, 0, SPEC.count))
    fabric.perform(other, fabric.colls[other].lose(root, "down", 1.0))
    assert [f.code for f in fabric.failed.values()] == ["peer_failed"]


def test_an_empty_tensor_is_reduced_too() -> None:
    """Messages of no bytes land nowhere: each still counts."""
    spec = Spec(**{**SPEC.to_meta(), "count": 0})
    fabric = Fabric(spec, (0, 1, 2), Random(5))
    for rank in range(3):
        fabric.call(rank, rank, np.zeros(0))
    fabric.drain()
    assert sorted(fabric.delivered) == [0, 1, 2]


# -- review findings -------------------------------------------------------------------------
def pair() -> tuple[Fabric, int, int]:
    placement = (0, 1)
    fabric = Fabric(SPEC, placement, Random(7))
    root = root_of(JOB, NAME, 0, placement)
    return fabric, root, 1 - root


@pytest.mark.parametrize("at_root", [True, False])
def test_bytes_nobody_planned_are_refused_before_they_are_allocated(at_root: bool) -> None:
    """A peer's first frame of a SUM no plan expects, or of a RESULT from a node that is not
    the root, allocates nothing: a flood of them cannot pass the byte budget."""
    fabric, root, other = pair()
    me, peer = (root, other) if at_root else (other, root)
    coll = fabric.colls[me]
    for tag, round in [(mlfabric.SUM, 0), (mlfabric.SUM + 7, 1), (mlfabric.RESULT, 0)]:
        if tag == mlfabric.RESULT and not at_root:
            continue  # the root's RESULT is the one a non-root node takes (once activated)
        with pytest.raises(RemoteProtocolError, match="not one this node takes"):
            coll.landing(peer, tag, round, 0, 8, (), 0, 0.0)
    assert sum(a.nbytes for a in coll.arrays()) == 2 * SPEC.count * 8


def test_a_message_whose_frames_leave_a_gap_is_refused() -> None:
    """Frames of one message come in order: one that does not begin where the last ended
    would leave bytes unwritten in what is reduced."""
    fabric, root, other = pair()
    fabric.call(other, 0, gift(other, 0, SPEC.count))
    fabric.call(root, 1, gift(root, 0, SPEC.count))
    while not (q := fabric.links.get((other, root))) or q[0].tag != mlfabric.PART:
        assert fabric.deliver_one()
    fabric.links[other, root].popleft()
    coll = fabric.colls[root]
    view = coll.landing(other, mlfabric.PART, 0, 0, 8, (), 0, 1.0)
    assert view is not None
    view[:] = bytes(8)
    coll.arrived(other, mlfabric.PART, 0, 8, (), 0, 1.0)
    with pytest.raises(RemoteProtocolError, match="holds"):
        coll.landing(other, mlfabric.PART, 0, 16, 8, (), 0, 1.0)


def test_a_reset_after_an_abandoned_call_breaks_the_round() -> None:
    """The trainer's call was abandoned once its round was activated (its data is kept), then
    the link reset and its READY was lost: the round is under way, so the collective breaks
    on both sides instead of waiting for ever."""
    fabric, root, other = pair()
    fabric.call(other, 0, gift(other, 0, SPEC.count))
    fabric.perform(other, fabric.colls[other].abandon(0))
    fabric.links[other, root].clear()
    fabric.perform(other, fabric.colls[other].interrupted(root, "reset"))
    assert fabric.colls[other].broken is not None
    fabric.call(root, 1, gift(root, 0, SPEC.count))
    fabric.perform(root, fabric.colls[root].interrupted(other, "reset"))
    assert fabric.colls[root].broken is not None
    assert [f.token for f in fabric.failed.values()] == [1]


@pytest.mark.parametrize("count", [0, SPEC.count])
def test_a_notice_changes_nothing(count: int) -> None:
    """A NOTICE (a peer's view, or its word on a disagreement) comes with round 0 and no
    bytes, whatever round this node is in: it is neither a sum nor out of turn."""
    spec = Spec(**{**SPEC.to_meta(), "count": count})
    fabric = Fabric(spec, (0, 1), Random(8))
    for k in range(2):
        for rank in (0, 1):
            fabric.call(rank, 10 * k + rank, gift(rank, k, count))
        fabric.drain()
    coll = fabric.colls[0]
    assert coll.round == 2
    assert coll.arrived(1, NOTICE, 0, 0, (), 0, 0.0) == []
    assert coll.broken is None


def test_a_gather_overlapping_another_of_the_round_is_refused() -> None:
    fabric = Fabric(SPEC, (0, 1, 2, 3), Random(9))
    nodes = (0, 1, 2, 3)
    root = root_of(JOB, NAME, 0, nodes)
    aggregator, *members = (n for n in nodes if n != root)
    gather = np.array([0, *members], "<i8").tobytes()
    send(fabric, root, aggregator, mlfabric.GATHER, 0, gather)
    overlapping = np.array([1, members[0]], "<i8").tobytes()
    with pytest.raises(RemoteProtocolError, match="GATHER"):
        send(fabric, root, aggregator, mlfabric.GATHER, 0, overlapping)


def test_two_nodes_send_straight_no_relay() -> None:
    """A one-member group is a relay, never faster on a star network: sent straight."""
    fabric, root, _ = pair()
    for rank in (0, 1):
        fabric.call(rank, rank, gift(rank, 0, SPEC.count))
    fabric.drain()
    assert fabric.sums == 0
    np.testing.assert_array_equal(fabric.colls[root].history[0], expected(2, 0, SPEC.count, "sum"))
