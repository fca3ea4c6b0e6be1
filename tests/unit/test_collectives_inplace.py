"""The in-place allreduce of a node's only rank against the general path (issue 22 items 2, 3).

The same simulated fabric as test_persistent.py (FIFO links that, like the transport, keep a
*view* of each sent payload until it is delivered; delivery order drawn by hypothesis): every
node runs the engine once with the in-place path and once without it (``IN_PLACE = False``),
and both must give the same bytes.  What a rank may observe is checked the hard way: a rank
writes its array the moment its call completes (the next step's gradient), so a send that
still read the array after the completion, or a landing that still wrote it, shows up as a
wrong result somewhere.
"""

from __future__ import annotations

from dataclasses import replace
from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.collectives import layout, persistent
from fabricd.engines.collectives.algorithms import EMPTY, allreduce_ring
from fabricd.engines.collectives.persistent import Action, Deliver, Fail, Settle, Spec
from fabricd.engines.schedule import Kind
from fabricd.errors import UsageError
from tests.unit.test_persistent import GRACE, JOB, NAME, Fabric, Recording

DTYPES = ["float16", "float32", "float64", "int32", "int64"]


class General(Recording):
    """The general path: the node's buffers, copies in and out."""

    IN_PLACE = False


class Writer(Fabric):
    """A fabric whose ranks write their arrays as soon as their call completes or fails, and
    that answers :class:`Settle` as the service does (``settle``): the call may complete at
    once if nothing sent to those nodes still waits on a link."""

    general: bool = False
    settle: bool = True
    early: int = 0  #: calls completed by a settled round, before its acknowledgements
    arrays: dict[int, np.ndarray[Any, Any]]  #: by token: the array the call gave
    seen: dict[int, np.ndarray[Any, Any]]  #: by token: the array as its completion found it
    after: dict[int, float]  #: by token: what the rank wrote into it then
    touched: int  #: completed calls whose array something wrote after the completion

    def __post_init__(self) -> None:
        live = frozenset(range(len(self.placement)))
        cls = General if self.general else Recording
        for node in sorted(set(self.placement)):
            self.colls[node] = cls(
                self.spec, job=JOB, name=NAME, node=node, ranks=self.placement, live=live
            )
        self.arrays, self.seen, self.after, self.touched = {}, {}, {}, 0

    def call(self, rank: int, token: int, array: np.ndarray[Any, Any] | None) -> None:
        assert array is not None
        self.arrays[token] = array
        super().call(rank, token, array)

    def perform(self, node: int, actions: list[Action]) -> None:
        super().perform(node, actions)
        for action in actions:
            if isinstance(action, Settle) and self.settle and self.flushed(node, action.nodes):
                more = self.colls[node].sent(action.round, self.tick())
                self.early += sum(isinstance(a, Deliver) for a in more)
                self.perform(node, more)
            if isinstance(action, Deliver | Fail) and action.token in self.arrays:
                array = self.arrays[action.token]
                self.seen[action.token] = array.copy()
                self.after[action.token] = -(action.token % 7) - 1  # the next step's data
                array[:] = self.after[action.token]

    def flushed(self, node: int, peers: tuple[int, ...]) -> bool:
        """Whether nothing ``node`` sent to ``peers`` that reads its buffers still waits on a
        link (an empty message, an acknowledgement, reads nothing)."""
        waiting = (m for peer in peers for m in self.links.get((node, peer), ()))
        return not any(len(m.payload) for m in waiting)

    def untouched_since(self, token: int) -> bool:
        """Whether nothing wrote the call's array after its completion."""
        return bool((self.arrays[token] == self.after[token]).all())


def run_rounds(
    placement: tuple[int, ...],
    spec: Spec,
    seed: int,
    *,
    general: bool,
    rounds: int = 3,
    settle: bool = True,
    framed: bool = False,
) -> Writer:
    """``rounds`` rounds, each rank calling with the same array every round (written by the
    rank as soon as its previous call completed), calls and deliveries interleaved."""
    rng = Random(seed)
    fab = (Framed if framed else Writer)(spec, placement, Random(seed + 1))
    fab.general, fab.settle = general, settle
    fab.__post_init__()
    arrays = [np.zeros(spec.count, spec.dtype) for _ in placement]
    for round in range(rounds):
        for rank in range(len(placement)):
            if round:  # before the rank writes the next step's data over it
                fab.touched += not fab.untouched_since((round - 1) * len(placement) + rank)
            values = [rng.randint(-20, 20) for _ in range(spec.count)]
            arrays[rank][:] = np.array(values, spec.dtype)
        order = list(range(len(placement)))
        rng.shuffle(order)
        for rank in order:
            fab.call(rank, round * len(placement) + rank, arrays[rank])
            for _ in range(rng.randint(0, 4)):
                fab.deliver_one()
        fab.drain()
    last = (rounds - 1) * len(placement)
    fab.touched += sum(not fab.untouched_since(last + r) for r in range(len(placement)))
    return fab


@settings(max_examples=120, deadline=None)
@given(
    nodes=st.integers(1, 5),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
    dtype=st.sampled_from(DTYPES),
    count=st.integers(0, 40),
    pieces=st.sampled_from([1, 1, 2, 3]),
    direct=st.booleans(),
    settle=st.booleans(),
    framed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_in_place_gives_the_general_paths_bytes(
    nodes: int,
    op: str,
    dtype: str,
    count: int,
    pieces: int,
    direct: bool,
    settle: bool,
    framed: bool,
    seed: int,
) -> None:
    """Byte-identical results both ways (messages landing whole or in frames of random
    sizes, other messages landing between them), every round, every rank, round the ring (in pieces
    or not) or by direct exchange, completing early (settled) or with the acknowledgements;
    each completion finds the whole result in the array, and nothing writes the array after
    it, nor reads it (a peer would get the rank's next data in its result)."""
    placement = tuple(range(nodes))
    spec = Spec(kind="allreduce", count=count, dtype=dtype, op=op, ring=True, direct=direct)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "RING_PIECES", pieces)
        fast = run_rounds(placement, spec, seed, general=False, settle=settle, framed=framed)
        slow = run_rounds(placement, spec, seed, general=True, framed=framed)
    assert all(c.inplace for c in fast.colls.values())
    assert not any(c.inplace for c in slow.colls.values())
    assert sorted(fast.delivered) == sorted(slow.delivered) == list(range(3 * nodes))
    for token, want in slow.seen.items():
        assert fast.seen[token].tobytes() == want.tobytes(), f"call {token}"
    assert fast.touched == slow.touched == 0
    if fast.early:  # a call completed before its round ended: the rank wrote its array since
        return
    for node, coll in fast.colls.items():
        for round, result in slow.colls[node].history.items():
            assert coll.history[round].tobytes() == result.tobytes()


@pytest.mark.parametrize("direct", [False, True])
def test_a_settled_round_completes_before_its_acknowledgements(direct: bool) -> None:
    """Where nothing a node sent waits on a link any more when its result is whole, its call
    completes then, not a message later; the bytes are the general path's all the same."""
    spec = Spec(kind="allreduce", count=23, dtype="float32", ring=True, direct=direct)
    early = 0
    for seed in range(10):  # whether a send still waits when the result is whole: by chance
        fast = run_rounds((0, 1, 2, 3), spec, seed, general=False)
        slow = run_rounds((0, 1, 2, 3), spec, seed, general=True)
        early += fast.early
        assert slow.early == 0
        for token, want in slow.seen.items():
            assert fast.seen[token].tobytes() == want.tobytes()
        assert fast.touched == 0
    assert early > 0


@pytest.mark.parametrize("placement", [(0, 0, 1), (0, 1, 1, 2)])
def test_a_node_of_several_ranks_keeps_the_general_path_beside_in_place_nodes(
    placement: tuple[int, ...],
) -> None:
    """Mixed layouts: nodes of one rank run in place, the others not; results agree."""
    spec = Spec(kind="allreduce", count=11, dtype="int64", ring=True)
    fast = run_rounds(placement, spec, 7, general=False)
    slow = run_rounds(placement, spec, 7, general=True)
    assert {n: c.inplace for n, c in fast.colls.items()} == {
        n: placement.count(n) == 1 for n in fast.colls
    }
    for token, want in slow.seen.items():
        assert fast.seen[token].tobytes() == want.tobytes()


@pytest.mark.parametrize(
    "spec",
    [
        Spec(kind="allreduce", count=4, dtype="float32", ring=False),  # recursive doubling
        Spec(kind="allreduce", count=4, dtype="float32", ring=True, mode="solo"),
        Spec(kind="allreduce", count=4, dtype="float32", ring=True, mode="majority"),
        Spec(kind="broadcast", count=4, dtype="float32"),
    ],
)
def test_only_a_sync_ring_allreduce_runs_in_place(spec: Spec) -> None:
    """Partial modes keep their accumulator (a rank that has not called takes part with
    it), recursive doubling reduces into the very tensor it sends: both keep the copies."""
    fab = Fabric(spec, (0, 1), Random(0))
    assert not fab.colls[0].inplace


@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_in_place_holds_less_than_one_array_beside_the_ranks(nodes: int) -> None:
    """Daemon memory of an in-place allreduce: the reduce-scatter's slots, one per step and
    not one per round parity, and nothing else: less than the rank's array."""
    spec = Spec(kind="allreduce", count=1000, dtype="float32", ring=True)
    coll = Fabric(spec, tuple(range(nodes)), Random(0)).colls[0]
    held = {id(a): a.nbytes for pair in coll.layout.slots.values() for a in pair}
    held |= {id(coll.data): coll.data.nbytes, id(coll.result): coll.result.nbytes}
    assert sum(held.values()) <= 4000 * (nodes - 1) // nodes + 4 * nodes


@pytest.mark.parametrize("seed", range(12))
def test_a_node_lost_mid_round_fails_the_calls_and_never_touches_the_arrays_after(
    seed: int,
) -> None:
    """A member node dies in the middle of an in-place round: every call fails, as the
    general path's do, and once a failure is delivered nothing of the round writes its
    caller's array again (the round detaches into the daemon's own copy)."""
    rng = Random(seed)
    spec = Spec(kind="allreduce", count=9, dtype="float64", ring=True)
    fab = Writer(spec, (0, 1, 2), Random(seed))
    for rank in range(3):
        fab.call(rank, rank, np.full(9, float(rank + 1)))
    for _ in range(rng.randint(0, 6)):
        fab.deliver_one()
    fab.kill(2)
    fab.drain()
    survivors = [t for t in (0, 1) if t in fab.failed]
    assert set(fab.failed) | set(fab.delivered) >= {0, 1}
    for token in survivors:
        assert fab.failed[token].code == "peer_failed"
        assert fab.untouched_since(token)


@pytest.mark.parametrize("seed", range(12))
def test_a_reset_mid_round_breaks_the_collective_and_leaves_the_arrays_alone(seed: int) -> None:
    """A reset of a member's links with an in-place round under way breaks a sync
    collective, as on the general path; the failed calls' arrays are not written after."""
    rng = Random(seed)
    spec = Spec(kind="allreduce", count=6, dtype="int32", ring=True)
    fab = Writer(spec, (0, 1, 2), Random(seed))
    for rank in range(3):
        fab.call(rank, rank, np.full(6, rank + 1, "int32"))
    for _ in range(rng.randint(0, 5)):
        fab.deliver_one()
    fab.perform(0, fab.colls[0].interrupted(1, "links reset"))
    fab.drain()
    if 0 in fab.failed:
        assert fab.colls[0].broken is not None
        assert fab.untouched_since(0)
    else:  # the round had ended here before the reset
        assert (fab.seen[0] == 6).all()


@pytest.mark.parametrize("direct", [False, True])
def test_a_round_voided_mid_way_still_ends_right_where_it_completes(direct: bool) -> None:
    """Rank 2 left before calling: after the grace, the in-place calls of nodes 0 and 1 fail
    while their round is half done (its messages went out).  Rank 2 then comes back and
    calls: its node completes the round with every rank's data, because nodes 0 and 1 went
    on from their own copies -- and their failed calls' arrays are never written again.
    (The grace is seconds: what the two nodes had sent has left their transports by then;
    a send still queued after it would read the array -- docs/architecture.md.)"""
    spec = Spec(kind="allreduce", count=5, dtype="float64", ring=True, direct=direct)
    fab = Writer(spec, (0, 1, 2), Random(3))
    fab.call(0, 0, np.full(5, 1.0))
    fab.call(1, 1, np.full(5, 2.0))
    fab.drain()
    for node in (0, 1):
        coll = fab.colls[node]
        fab.perform(node, coll.rank_gone(2, frozenset({0, 1}), fab.tick(), grace=GRACE))
        fab.perform(node, coll.on_timer(fab.now + GRACE))
    assert fab.failed.keys() == {0, 1}
    fab.call(2, 2, np.full(5, 4.0))
    fab.drain()
    assert (fab.seen[2] == 7.0).all()
    assert fab.untouched_since(0)
    assert fab.untouched_since(1)


@pytest.mark.parametrize(("size", "pieces"), [(2, 1), (3, 2), (5, 3)])
def test_the_acknowledged_ring_ends_with_an_empty_message_each_way(size: int, pieces: int) -> None:
    """The acknowledgement goes left after every message from the left is in, and the round
    waits for the right neighbour's; pieces multiply the data messages, not the ack."""
    rank = 1
    plain = allreduce_ring(rank, size, "sum", pieces=pieces)
    acked = allreduce_ring(rank, size, "sum", pieces=pieces, acknowledge=True)
    sends = [op for op in plain.ops if op.kind is Kind.SEND]
    assert len(sends) == 2 * (size - 1) * pieces
    extra = acked.ops[len(plain.ops) :]
    tag = 2 * (size - 1) * pieces
    assert [(op.kind, op.peer, op.tag, op.buffer) for op in extra] == [
        (Kind.SEND, (rank - 1) % size, tag, EMPTY),
        (Kind.RECV, (rank + 1) % size, tag, EMPTY),
    ]
    recvs = {i for i, op in enumerate(plain.ops) if op.kind is Kind.RECV}
    assert set(extra[0].after) == recvs


def test_a_ring_of_no_pieces_is_refused() -> None:
    with pytest.raises(UsageError, match="pieces"):
        allreduce_ring(0, 2, "sum", pieces=0)


class Framed(Writer):
    """Links that land each message in frames of random sizes, a step at a time, as the
    service does (``chunk_size``): one step hands out a frame's view (the transport starts
    filling it), the next on that link fills it and says it arrived, so anything may happen
    between frames and within one.  ``copied``: the kernel takes every sent byte at once
    (nothing queued reads an array: the landings alone are under test)."""

    copied: bool = False
    cut: Random
    landing: dict[tuple[int, int], list[Any]]  #: link -> [message, offset, view, size]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cut, self.landing = Random(len(self.placement)), {}

    def perform(self, node: int, actions: list[Action]) -> None:
        if self.copied:
            actions = [
                replace(a, payload=memoryview(bytes(a.payload)))
                if isinstance(a, persistent.Transmit)
                else a
                for a in actions
            ]
        super().perform(node, actions)

    def flushed(self, node: int, peers: tuple[int, ...]) -> bool:
        """Nor is a message being landed (its sender's transport still reads it)."""
        landing = any(
            len(self.landing[node, p][0].payload) for p in peers if (node, p) in self.landing
        )
        return not landing and super().flushed(node, peers)

    def deliver_one(self) -> bool:
        ready = [pair for pair, queue in self.links.items() if queue] + list(self.landing)
        if not ready:
            return False
        src, dst = self.rng.choice(sorted(set(ready)))
        if (src, dst) not in self.landing:
            self.landing[src, dst] = [self.links[src, dst].popleft(), 0, None, 0]
        if dst in self.down or src in self.down:
            del self.landing[src, dst]
        else:
            self.step(src, dst)
        return True

    def step(self, src: int, dst: int) -> None:
        m, offset, view, size = self.landing[src, dst]
        coll, n, now = self.colls[dst], len(m.payload), self.tick()
        if view is None and n:  # a frame's header is in: its view is handed out
            size = self.cut.randint(1, n - offset)
            view = coll.landing(src, m.tag, m.round, offset, size, m.lost, m.base, now)
            self.landing[src, dst][2:] = [view if view is not None else bytearray(size), size]
            return
        if n:
            view[:] = m.payload[offset : offset + size]
        self.perform(dst, coll.arrived(src, m.tag, m.round, size, m.lost, m.base, now))
        self.landing[src, dst][1:] = [offset + size, None, 0]
        if offset + size >= n:
            del self.landing[src, dst]


def _split_next(fab: Framed, phase: str) -> tuple[int, Any] | None:
    """A message with bytes at the head of a link to node 0, of the reduce-scatter (it lands
    in a slot) or of the allgather (it lands in the caller's array)."""
    c0 = fab.colls[0]
    for (src, dst), queue in fab.links.items():
        if dst == 0 and queue and len(queue[0].payload):
            op = c0.layout.recv_of.get((c0.index[src], queue[0].tag))
            if (op in c0.layout.direct) == (phase == "allgather"):
                return src, queue[0]
    return None


@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
@pytest.mark.parametrize("phase", ["allgather", "reduce-scatter"])
@pytest.mark.parametrize("within", [False, True], ids=["between-frames", "within-a-frame"])
def test_a_message_split_when_its_call_fails_lands_nothing_in_the_array_after(
    direct: bool, phase: str, within: bool
) -> None:
    # review of issue 22: a message in two frames, the first landed, then node 0's call fails
    # (rank 2 gave and left, its grace ran out) -- between the frames, or while the transport
    # fills the second.  Once the failure is delivered the rank writes its array (the Writer
    # does); nothing may land in it after, and the round's peers get the exact sum
    spec = Spec(kind="allreduce", count=12, dtype="float64", ring=True, direct=direct)
    fab = Framed(spec, (0, 1, 2), Random(0))
    fab.copied = True
    for r in range(3):
        fab.call(r, r, np.full(12, float(r + 1)))
    c0, split = fab.colls[0], False
    for _ in range(10_000):
        target = None if split else _split_next(fab, phase)
        if target is None:
            if not fab.deliver_one():
                break
            continue
        src, m = fab.links[target[0], 0].popleft(), target[1]
        src, half, n = target[0], len(m.payload) // 2, len(m.payload)
        now = fab.tick()
        c0.landing(src, m.tag, m.round, 0, half, m.lost, m.base, now)[:] = m.payload[:half]
        fab.perform(0, c0.arrived(src, m.tag, m.round, half, m.lost, m.base, now))
        rest = None  # between frames: the second frame's header comes after the failure
        if within:
            rest = c0.landing(src, m.tag, m.round, half, n - half, m.lost, m.base, fab.tick())
        fab.perform(0, c0.rank_gone(2, frozenset({0, 1}), fab.tick(), grace=GRACE))
        fab.perform(0, c0.on_timer(fab.now + GRACE + 1))
        held = within and phase == "allgather"  # the frame lands in the array: it waits
        assert (0 in fab.failed) is not held
        if rest is None:
            rest = c0.landing(src, m.tag, m.round, half, n - half, m.lost, m.base, fab.tick())
        rest[:] = m.payload[half:]
        fab.perform(0, c0.arrived(src, m.tag, m.round, n - half, m.lost, m.base, fab.tick()))
        assert 0 in fab.failed
        assert fab.untouched_since(0), "a frame landed in a failed call's array"
        split = True
    fab.drain()
    assert split
    assert fab.untouched_since(0)
    for token in (1, 2):
        assert token in fab.delivered
        assert (fab.seen[token] == 6.0).all(), fab.seen[token]


@settings(max_examples=150, deadline=None)
@given(
    direct=st.booleans(),
    count=st.integers(2, 30),
    at=st.integers(0, 80),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_call_failing_at_any_step_of_any_frame_leaves_its_array_and_the_sum_right(
    direct: bool, count: int, at: int, seed: int
) -> None:
    """Messages land in frames of random sizes; node 0's call fails (rank 2 left) after
    ``at`` steps, between frames or within one: the failed array is never written after the
    failure, and nodes 1 and 2 get the exact sum."""
    spec = Spec(kind="allreduce", count=count, dtype="float64", ring=True, direct=direct)
    fab = Framed(spec, (0, 1, 2), Random(seed))
    fab.copied, fab.cut = True, Random(seed + 1)
    arrays = [np.full(count, float(r + 1)) for r in range(3)]
    for r in range(3):
        fab.call(r, r, arrays[r])
    for _ in range(at):
        fab.deliver_one()
    c0 = fab.colls[0]
    fab.perform(0, c0.rank_gone(2, frozenset({0, 1}), fab.tick(), grace=GRACE))
    fab.perform(0, c0.on_timer(fab.now + GRACE + 1))
    if 0 in fab.failed:  # nothing of the round reads the array after (its copies neither)
        assert not any(np.shares_memory(a, arrays[0]) for a in _held(c0) if a.size)
    fab.drain()
    assert set(fab.delivered) | set(fab.failed) == {0, 1, 2}
    assert fab.untouched_since(0)
    for token in (1, 2):
        assert (fab.seen[token] == 6.0).all(), fab.seen[token]


def _held(coll: persistent.Collective) -> list[np.ndarray[Any, Any]]:
    """Every buffer the collective keeps between rounds."""
    slots = [a for pair in coll.layout.slots.values() for a in pair]
    return [coll.data, coll.result, *slots, *coll._landed.values()]


def _held_bytes(coll: persistent.Collective) -> int:
    return sum({id(a): a.nbytes for a in _held(coll)}.values())


@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_in_place_keeps_no_view_nor_copy_of_the_array_between_rounds(direct: bool) -> None:
    # review of issue 22: the result stayed a view of the caller's segment after each round
    # (its client could not unmap it), and after a round that failed here and went on in the
    # daemon's copy, a whole copy stayed; in place the daemon holds (n - 1) / n of the array
    spec = Spec(kind="allreduce", count=999, dtype="float32", ring=True, direct=direct)
    fab = Writer(spec, (0, 1, 2), Random(0))
    bound = 999 * 4 * 2 // 3 + 4 * 3
    arrays = [np.full(999, float(r + 1), "float32") for r in range(3)]
    for r in range(3):
        fab.call(r, r, arrays[r])
    fab.drain()
    assert fab.delivered.keys() == {0, 1, 2}
    for node, coll in fab.colls.items():
        assert not any(np.shares_memory(a, arrays[node]) for a in _held(coll))
        assert coll.result.nbytes == coll.data.nbytes == 0
        assert _held_bytes(coll) <= bound
    arrays = [np.full(999, float(r + 1), "float32") for r in range(3)]
    fab.call(0, 10, arrays[0])
    fab.call(1, 11, arrays[1])
    fab.drain()
    for node in (0, 1):  # rank 2 left: the round fails at nodes 0 and 1 and goes on in copies
        coll = fab.colls[node]
        fab.perform(node, coll.rank_gone(2, frozenset({0, 1}), fab.tick(), grace=GRACE))
        fab.perform(node, coll.on_timer(fab.now + GRACE))
    assert fab.failed.keys() == {10, 11}
    fab.call(2, 12, arrays[2])
    fab.drain()
    assert (fab.seen[12] == 6.0).all()
    for coll in fab.colls.values():
        assert coll.result.nbytes == coll.data.nbytes == 0
        assert _held_bytes(coll) <= bound


@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_a_client_leaving_mid_round_leaves_no_view_of_its_array(direct: bool) -> None:
    """The round it gave to goes on in the daemon's copy (peers still get its bytes), so its
    segment can be unmapped, and nothing of the round writes it again."""
    spec = Spec(kind="allreduce", count=10, dtype="int64", ring=True, direct=direct)
    fab = Framed(spec, (0, 1, 2), Random(1))
    fab.copied = True  # (a send still queued would read it: docs/architecture.md)
    arrays = [np.full(10, r + 1, "int64") for r in range(3)]
    for r in range(3):
        fab.call(r, r, arrays[r])
    fab.deliver_one()
    assert fab.colls[0].data is arrays[0]
    assert fab.colls[0].abandon(0) == []
    assert not any(np.shares_memory(a, arrays[0]) for a in _held(fab.colls[0]))
    arrays[0][:] = -99  # the segment is the client's again (or unmapped)
    fab.drain()
    assert fab.delivered.keys() == {1, 2}
    assert (fab.seen[1] == 6).all()
    assert (fab.seen[2] == 6).all()


def test_a_spec_asking_for_direct_exchange_without_the_ring_is_refused():
    # a peer could send one: the node would run recursive doubling while status said direct
    with pytest.raises(UsageError, match="direct needs ring"):
        Spec(kind="allreduce", count=4, dtype="float32", ring=False, direct=True).check()
    Spec(kind="allreduce", count=4, dtype="float32", ring=True, direct=True).check()
