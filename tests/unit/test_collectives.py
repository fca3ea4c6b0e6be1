"""The collectives' schedules, run by one schedule engine per rank over a simulated network.

``Sim`` is the sans-IO stand-in for the daemon's schedule service: it keeps each rank's
buffers by the module's naming convention (``data``, ``data:I``, ``slot:P:T``, ``empty``),
performs StartCompute with numpy, and carries StartSend as messages, FIFO per pair of ranks,
delivered in an order a seeded ``Random`` picks.  A send's bytes are read when it completes
(the latest moment a real send may read them), so a schedule that let a compute overwrite a
buffer under a send in flight would show.  A message of round ``q`` is delivered only once
its receiver is in round ``q - 1`` or later (the data plane's credit), and lands in the slot
for ``q``'s parity, which must be free: the engine's claim that two slots per recv suffice.
Ranks call round ``q + 1`` as soon as round ``q`` is current, so messages of the next round
arrive while the current one runs.  Time is a counter; nothing sleeps.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from random import Random
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.collectives.algorithms import (
    DATA,
    EMPTY,
    REDUCTIONS,
    Algorithm,
    Buffer,
    Region,
    activation_broadcast,
    allreduce,
    allreduce_direct,
    allreduce_recursive_doubling,
    allreduce_ring,
    allreduce_tree,
    barrier,
    broadcast,
    choose_allreduce,
    chunk,
    chunk_bounds,
    parse,
    slot,
)
from fabricd.engines.schedule import (
    Discard,
    Executor,
    Kind,
    Op,
    Phase,
    RoundEnded,
    Schedule,
    StartCompute,
    StartSend,
)
from fabricd.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.engines.schedule import Action

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
SIZES = (1, 2, 3, 5, 8)
BUILDERS: dict[Algorithm, Callable[[int, int, str], Schedule]] = {
    Algorithm.RING: allreduce_ring,
    Algorithm.DIRECT: allreduce_direct,
    Algorithm.RECURSIVE_DOUBLING: allreduce_recursive_doubling,
    Algorithm.TREE: allreduce_tree,
}
#: the algorithms with a static schedule (MLfabric-S's is dynamic: test_collective_mlfabric.py)
STATIC = list(BUILDERS)
FNS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@dataclass
class Sim:
    """Ranks ``0 .. size - 1``, each an :class:`Executor` of its schedule, and the network."""

    schedules: list[Schedule]
    rng: Random
    #: (rank, round) -> the tensor the rank's call gives; a rank that has not called is
    #: passive (zeros) if ``passive`` allows it, else touching its data is a schedule bug
    inputs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    passive: np.ndarray | None = None
    executors: list[Executor] = field(init=False)
    now: float = 0.0
    links: dict[tuple[int, int], deque[tuple[int, int, np.ndarray | None]]] = field(
        default_factory=lambda: defaultdict(deque)
    )
    work: list[tuple[int, StartSend | StartCompute]] = field(default_factory=list)
    buffers: dict[tuple[int, int], dict[str, np.ndarray]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    occupied: dict[tuple[int, str, int], int] = field(default_factory=dict)
    ended: dict[tuple[int, int], RoundEnded] = field(default_factory=dict)
    results: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    sends: Counter[tuple[int, int]] = field(default_factory=Counter)  #: (rank, round) -> count
    events: list[tuple[str, int, int]] = field(default_factory=list)  #: (call|end, rank, round)
    #: links delivered only when nothing else can move: a slow path, overtaken by the others
    slow: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.executors = [Executor(s) for s in self.schedules]
        for rank, ex in enumerate(self.executors):
            self.perform(rank, ex.post(self.tick()))

    @property
    def size(self) -> int:
        return len(self.schedules)

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def call(self, rank: int, round: int) -> None:
        if (rank, round) in self.inputs:
            self.buffers[rank, round][DATA] = self.inputs[rank, round].copy()
        self.events.append(("call", rank, round))
        self.perform(rank, self.executors[rank].activate(round, self.tick()))

    def view(self, rank: int, round: int, name: str) -> np.ndarray:
        """The array ``name`` means at ``rank`` in ``round`` (a chunk is a view of the data)."""
        buffer = parse(name)
        held = self.buffers[rank, round]
        if buffer.region is Region.SLOT:
            return held[name]
        if buffer.region is Region.EMPTY:
            return np.empty(0)
        if DATA not in held:
            assert self.passive is not None, f"rank {rank} used its data before its call"
            held[DATA] = self.passive.copy()
        if buffer.region is Region.DATA:
            return held[DATA]
        start, stop = chunk_bounds(len(held[DATA]), self.size, buffer.index)
        return held[DATA][start:stop]

    def perform(self, rank: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StartSend | StartCompute):
                self.work.append((rank, action))
            elif isinstance(action, RoundEnded):
                self.events.append(("end", rank, action.round))
                assert (rank, action.round) not in self.ended, "a round ended twice"
                self.ended[rank, action.round] = action
                held = self.buffers.pop((rank, action.round), {})
                if DATA in held:
                    self.results[rank, action.round] = held[DATA]
                self.occupied = {
                    k: q for k, q in self.occupied.items() if (k[0], q) != (rank, action.round)
                }
            elif isinstance(action, Discard):
                op = self.schedules[rank].ops[action.op]
                assert op.buffer == EMPTY, "only activation messages may be discarded"

    def deliverable(self, others: bool) -> list[tuple[int, int]]:
        """Links whose next message may be delivered; the slow ones only if nothing else
        (``others``: calls to make) can move."""
        ready = [
            pair
            for pair, queue in self.links.items()
            if queue and queue[0][1] <= self.executors[pair[1]].round + 1
        ]
        fast = [pair for pair in ready if pair not in self.slow]
        return fast if fast or self.work or others else ready

    def step(self, callers: list[tuple[int, int]]) -> bool:
        """One random move: a call from ``callers``, a delivery, or a send or compute done."""
        links = self.deliverable(bool(callers))
        choices = len(callers) + len(links) + len(self.work)
        if not choices:
            return False
        pick = self.rng.randrange(choices)
        if pick < len(callers):
            self.call(*callers[pick])
        elif pick < len(callers) + len(links):
            self.deliver(*links[pick - len(callers)])
        else:
            self.finish(*self.work.pop(pick - len(callers) - len(links)))
        return True

    def deliver(self, src: int, dst: int) -> None:
        tag, round, payload = self.links[src, dst].popleft()
        if payload is not None:
            name = next(
                op.buffer
                for op in self.schedules[dst].ops
                if (op.kind, op.peer, op.tag) == (Kind.RECV, src, tag)
            )
            key = (dst, name, round % 2)
            assert key not in self.occupied, f"rank {dst}: {name} of round {round} lands on a slot"
            self.occupied[key] = round
            self.buffers[dst, round][name] = payload
        self.perform(dst, self.executors[dst].arrived(src, tag, round, self.tick()))

    def finish(self, rank: int, action: StartSend | StartCompute) -> None:
        op = self.schedules[rank].ops[action.op]
        if isinstance(action, StartSend):
            payload = None if op.buffer == EMPTY else self.view(rank, action.round, op.buffer)
            self.links[rank, op.peer].append(
                (op.tag, action.round, None if payload is None else payload.copy())
            )
            self.sends[rank, action.round] += 1
        else:
            args = [self.view(rank, action.round, name) for name in op.inputs]
            out = self.view(rank, action.round, op.buffer)
            if op.fn in FNS:
                out[...] = FNS[op.fn](args[0], args[1])
            elif op.fn == "copy":
                out[...] = args[0]
            elif np.issubdtype(out.dtype, np.integer):
                assert op.fn == "div"
                out[...] = np.floor_divide(args[0], self.size)
            else:
                assert op.fn == "div"
                out[...] = args[0] / self.size
        self.perform(rank, self.executors[rank].completed(action.op, action.round, self.tick()))

    def run(self, rounds: int, calls: Callable[[], list[tuple[int, int]]]) -> None:
        """Until every rank ended ``rounds`` rounds and every message was delivered (late
        activation messages included); ``calls`` says which calls may come now."""
        for _ in range(200_000):
            done = all(ex.round >= rounds for ex in self.executors)
            if done and not self.work and not any(self.links.values()):
                return
            if not self.step([] if done else calls()) and not done:
                raise AssertionError(f"stuck: rounds {[ex.round for ex in self.executors]}")
        raise AssertionError("the ranks did not finish")


def synchronous(sim: Sim, rounds: int) -> Callable[[], list[tuple[int, int]]]:
    """Every rank calls every round, round ``q`` as soon as ``q - 1`` is current."""
    called = [0] * sim.size

    def calls() -> list[tuple[int, int]]:
        return [
            (rank, called[rank])
            for rank, ex in enumerate(sim.executors)
            if called[rank] < min(rounds, ex.round + 2)
        ]

    original = sim.call

    def call(rank: int, round: int) -> None:
        called[rank] += 1
        original(rank, round)

    sim.call = call  # type: ignore[method-assign]
    return calls


def tensors(
    rng: Random, dtype: str, count: int, size: int, rounds: int
) -> dict[tuple[int, int], np.ndarray]:
    gen = np.random.default_rng(rng.getrandbits(32))
    if np.issubdtype(np.dtype(dtype), np.integer):
        return {
            (rank, q): gen.integers(-1000, 1000, count).astype(dtype)
            for rank in range(size)
            for q in range(rounds)
        }
    return {
        (rank, q): gen.standard_normal(count).astype(dtype)
        for rank in range(size)
        for q in range(rounds)
    }


def reference(arrays: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """numpy's answer, in float64 for floats (the simulated order differs from numpy's)."""
    stacked = np.stack(arrays).astype(np.float64 if not dtype.startswith("int") else dtype)
    result: np.ndarray
    match op:
        case "sum":
            result = stacked.sum(axis=0)
        case "avg" if dtype.startswith("int"):
            result = np.floor_divide(stacked.sum(axis=0), len(arrays))
        case "avg":
            result = stacked.sum(axis=0) / len(arrays)
        case "max":
            result = stacked.max(axis=0)
        case _:
            result = stacked.min(axis=0)
    return result


def check_result(result: np.ndarray, expected: np.ndarray, dtype: str, size: int) -> None:
    assert result.dtype == np.dtype(dtype)
    if dtype == "float16":
        np.testing.assert_allclose(result, expected, rtol=1e-2, atol=1e-2 * size)
    elif dtype == "bfloat16":  # 3 significand bits fewer than float16: 8 times its tolerance
        np.testing.assert_allclose(result.astype(np.float64), expected, rtol=8e-2, atol=8e-2 * size)
    elif dtype == "float32":
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5 * size)
    else:
        np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12 * size)


def recursive_doubling_sends(rank: int, size: int) -> int:
    """Messages per rank of recursive doubling, counted from the algorithm's description."""
    steps = size.bit_length() - 1
    rem = size - (1 << steps)
    if rank < 2 * rem:
        return 1 if rank % 2 == 0 else steps + 1
    return steps


def tree_sends(rank: int, size: int) -> int:
    """Messages per rank of the binary tree: one up (but the root), one to each child."""
    return (rank > 0) + sum(child < size for child in (2 * rank + 1, 2 * rank + 2))


def sends(algorithm: Algorithm, rank: int, size: int) -> int:
    """Messages per rank and round, counted from each algorithm's description."""
    match algorithm:
        case Algorithm.RECURSIVE_DOUBLING:
            return recursive_doubling_sends(rank, size)
        case Algorithm.TREE:
            return tree_sends(rank, size)
        case _:
            return 2 * (size - 1)


def run_allreduce(
    algorithm: Algorithm, size: int, op: str, dtype: str, count: int, rounds: int, seed: int
) -> None:
    rng = Random(seed)
    schedules = [BUILDERS[algorithm](rank, size, op) for rank in range(size)]
    sim = Sim(schedules, rng, inputs=tensors(rng, dtype, count, size, rounds))
    sim.run(rounds, synchronous(sim, rounds))
    for q in range(rounds):
        expected = reference([sim.inputs[rank, q] for rank in range(size)], op, dtype)
        for rank in range(size):
            check_result(sim.results[rank, q], expected, dtype, size)
            # every rank holds the same bits: commutative exchanges, one scale per chunk
            np.testing.assert_array_equal(sim.results[rank, q], sim.results[0, q])
            assert sim.ended[rank, q].activated
            assert sim.sends[rank, q] == sends(algorithm, rank, size)
    for ex in sim.executors:
        stats = ex.statistics()
        assert (stats.rounds, stats.in_flight, stats.held) == (rounds, 0, 0)
    assert not any(sim.links.values())


# -- allreduce -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algorithm", STATIC)
def test_allreduce_equals_numpy_round_after_round(
    algorithm: Algorithm, size: int, op: str, dtype: str
) -> None:
    run_allreduce(algorithm, size, op, dtype, count=19, rounds=3, seed=size * 1000 + len(op))


@settings(max_examples=60)
@given(
    algorithm=st.sampled_from(STATIC),
    size=st.integers(1, 16),
    op=st.sampled_from(REDUCTIONS),
    dtype=st.sampled_from(DTYPES),
    count=st.integers(0, 40),  # fewer elements than ranks: empty chunks, zero-byte messages
    rounds=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_allreduce_any_size_any_order(
    algorithm: Algorithm, size: int, op: str, dtype: str, count: int, rounds: int, seed: int
) -> None:
    run_allreduce(algorithm, size, op, dtype, count, rounds, seed)


@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_tree_sums_at_every_node_in_2_n_minus_1_messages(size: int, op: str) -> None:
    """Tr-Sync for 1 to 9 nodes: every node ends with the sum (the same bits), in 2 (n - 1)
    messages a round in all, of which each rank but the root sends one up."""
    run_allreduce(Algorithm.TREE, size, op, "float64", count=7, rounds=3, seed=size)
    total = sum(tree_sends(rank, size) for rank in range(size))
    assert total == 2 * (size - 1)
    ups = [
        sent.peer
        for rank in range(1, size)
        for sent in allreduce_tree(rank, size, "sum").ops
        if sent.kind is Kind.SEND and sent.tag == 0
    ]
    assert ups == [(rank - 1) // 2 for rank in range(1, size)]  # each to its parent, once


def test_the_tree_is_never_chosen_by_size() -> None:
    """Tr-Sync is a baseline a caller asks for: the size rule never picks it."""
    picks = {
        choose_allreduce(size, nbytes, ring_from_bytes=4096)
        for size in range(1, 20)
        for nbytes in (0, 4095, 4096, 1 << 30)
    }
    assert Algorithm.TREE not in picks
    assert allreduce(1, 5, "sum", 0, ring_from_bytes=1) != allreduce_tree(1, 5, "sum")


def test_the_choice_rule_takes_the_switch_point_as_given() -> None:
    assert choose_allreduce(8, 4095, ring_from_bytes=4096) is Algorithm.RECURSIVE_DOUBLING
    assert choose_allreduce(8, 4096, ring_from_bytes=4096) is Algorithm.DIRECT
    assert choose_allreduce(3, 4096, ring_from_bytes=4096) is Algorithm.DIRECT
    assert choose_allreduce(9, 4096, ring_from_bytes=4096) is Algorithm.RING
    # two ranks: the same bytes either way; the ring's halves pipeline on large tensors
    assert choose_allreduce(2, 1 << 30, ring_from_bytes=4096) is Algorithm.RING
    assert choose_allreduce(2, 4095, ring_from_bytes=4096) is Algorithm.RECURSIVE_DOUBLING
    assert choose_allreduce(1, 1 << 30, ring_from_bytes=0) is Algorithm.RECURSIVE_DOUBLING
    assert allreduce(0, 9, "sum", 10, ring_from_bytes=10) == allreduce_ring(0, 9, "sum")
    assert allreduce(0, 4, "sum", 10, ring_from_bytes=10) == allreduce_direct(0, 4, "sum")
    assert allreduce(0, 4, "sum", 9, ring_from_bytes=10) == allreduce_recursive_doubling(
        0, 4, "sum"
    )
    with pytest.raises(UsageError, match=">= 0"):
        choose_allreduce(4, -1, ring_from_bytes=10)


# -- broadcast, barrier ----------------------------------------------------------------------------
@settings(max_examples=60)
@given(
    size=st.integers(1, 16),
    root=st.data(),
    rounds=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_broadcast_from_any_root(size: int, root: st.DataObject, rounds: int, seed: int) -> None:
    source = root.draw(st.integers(0, size - 1), label="root")
    rng = Random(seed)
    schedules = [broadcast(rank, size, source) for rank in range(size)]
    sim = Sim(schedules, rng, inputs=tensors(rng, "float32", 7, size, rounds))
    sim.run(rounds, synchronous(sim, rounds))
    for q in range(rounds):
        for rank in range(size):
            np.testing.assert_array_equal(sim.results[rank, q], sim.inputs[source, q])
        # size - 1 data messages down the tree, as many empty acknowledgements up it
        assert sum(sim.sends[rank, q] for rank in range(size)) == 2 * (size - 1)
        assert max(sim.sends[rank, q] for rank in range(size)) <= (size - 1).bit_length() + 1


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_a_broadcast_root_ends_no_round_before_every_rank_called_it(size: int) -> None:
    """The acknowledgements hold the root back: it hears nobody else, so without them it
    could run two rounds ahead of a slow rank, which the engine refuses."""
    rounds = 4
    rng = Random(size)
    schedules = [broadcast(rank, size, 0) for rank in range(size)]
    sim = Sim(schedules, rng, inputs=tensors(rng, "float32", 7, size, rounds))
    sim.run(rounds, synchronous(sim, rounds))
    for q in range(rounds):
        last_call = max(n for n, e in enumerate(sim.events) if e[0] == "call" and e[2] == q)
        root_end = next(n for n, e in enumerate(sim.events) if e[:3] == ("end", 0, q))
        assert root_end > last_call


@pytest.mark.parametrize("size", [*SIZES, 6, 7, 13, 16])
def test_barrier_ends_nowhere_before_every_rank_called(size: int) -> None:
    rounds = 4
    sim = Sim([barrier(rank, size) for rank in range(size)], Random(size))
    sim.run(rounds, synchronous(sim, rounds))
    steps = (size - 1).bit_length()
    for q in range(rounds):
        last_call = max(n for n, e in enumerate(sim.events) if e[0] == "call" and e[2] == q)
        first_end = min(n for n, e in enumerate(sim.events) if e[0] == "end" and e[2] == q)
        assert first_end > last_call
        assert all(sim.sends[rank, q] == steps for rank in range(size))
    assert all(payload is None for queue in sim.links.values() for _, _, payload in queue)


# -- activation broadcast: solo allreduce ----------------------------------------------------------
@settings(max_examples=80)
@given(
    algorithm=st.sampled_from(STATIC),
    size=st.integers(1, 16),
    op=st.sampled_from(REDUCTIONS),
    rounds=st.integers(1, 4),
    callers=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_initiators_run_the_allreduce_once_per_round_at_every_rank(
    algorithm: Algorithm,
    size: int,
    op: str,
    rounds: int,
    callers: st.DataObject,
    seed: int,
) -> None:
    """Random sets of initiators per round, called in a random order while earlier rounds
    still run; the others contribute zeros.  A rank calls round ``q`` only if its round ``q``
    has not begun (a later call would take part in name only: see the report on activation);
    so the round's result is the reduction of exactly the ranks it reports ``activated``."""
    rng = Random(seed)
    schedules = [
        activation_broadcast(rank, size, BUILDERS[algorithm](rank, size, op))
        for rank in range(size)
    ]
    inputs = tensors(rng, "int64", 11, size, rounds)
    sim = Sim(schedules, rng, inputs=inputs, passive=np.zeros(11, "int64"))
    chosen = [
        sorted(callers.draw(st.sets(st.integers(0, size - 1), min_size=1), label="callers"))
        for _ in range(rounds)
    ]
    order = [(rank, q) for q in range(rounds) for rank in chosen[q]]  # rounds in order

    def calls() -> list[tuple[int, int]]:
        while order:
            rank, q = order[0]
            ex = sim.executors[rank]
            if ex.round < q - 1:
                return []  # too early: wait for the rank to reach round q - 1
            if ex.round < q or (ex.round == q and ex.phase is Phase.ARMED):
                return [order[0]]
            order.pop(0)  # its round began (or ended) without it: it stays passive
        return []

    original = sim.call

    def call(rank: int, round: int) -> None:
        order.pop(0)
        original(rank, round)

    sim.call = call  # type: ignore[method-assign]
    sim.run(rounds, calls)
    channels = (size - 1).bit_length()
    for q in range(rounds):
        included = [rank for rank in range(size) if sim.ended[rank, q].activated]
        assert included, "a round ran with no initiator"
        assert set(included) == {r for e, r, qq in sim.events if e == "call" and qq == q}
        contributions = [
            inputs[rank, q] if rank in included else np.zeros(11, "int64") for rank in range(size)
        ]
        expected = reference(contributions, op, "int64")
        for rank in range(size):
            np.testing.assert_array_equal(sim.results[rank, q], expected)
            collective = sends(algorithm, rank, size)
            assert collective <= sim.sends[rank, q] <= collective + channels
    assert all(ex.round == rounds for ex in sim.executors)


def test_a_duplicate_activation_overtaken_by_two_rounds_is_absorbed() -> None:
    """Size 3, rank 0 initiates every round: its activation reaches rank 1 (channel 0) and
    rank 2 (channel 1), and rank 1 forwards on channel 1 to rank 0 again, a duplicate.  No
    data of the ring goes from 1 to 0 directly, so nothing keeps that link's messages ahead of
    rank 0's rounds: held back until the end, they come several rounds late."""
    size, rounds = 3, 4
    schedules = [
        activation_broadcast(rank, size, allreduce_ring(rank, size, "sum")) for rank in range(size)
    ]
    sim = Sim(schedules, Random(0), passive=np.zeros(4, "int64"), slow={(1, 0)})
    sim.inputs = {(0, q): np.ones(4, "int64") for q in range(rounds)}
    called = [0]

    def calls() -> list[tuple[int, int]]:
        ex = sim.executors[0]
        q = called[0]
        if q < rounds and (q - 1 == ex.round or (ex.round == q and ex.phase is Phase.ARMED)):
            return [(0, q)]
        return []

    original = sim.call

    def call(rank: int, round: int) -> None:
        called[0] += 1
        original(rank, round)

    sim.call = call  # type: ignore[method-assign]
    sim.run(rounds, calls)


def test_the_activation_has_fig_6s_shape() -> None:
    """Rank 3 of 4 (Fig. 6, right): the call and two optional recvs, sends forwarding to the
    channels above the one a message came on, and a required N1 before the collective."""
    schedule = activation_broadcast(3, 4, barrier(3, 4))
    ops = schedule.ops
    assert ops[0].optional
    assert ops[0].kind is Kind.NOP
    assert [(op.peer, op.tag, op.optional) for op in ops[1:3]] == [(2, 0, True), (1, 1, True)]
    assert [(op.peer, op.after) for op in ops[3:5]] == [(0, (0,)), (1, (0, 1))]
    assert ops[5].after == (0, 1, 2)
    assert not ops[5].optional
    assert ops[6].after == (5,)  # the barrier's own activation, now behind N1
    assert {op.tag for op in ops[7:]} == {2, 3}  # the barrier's tags, shifted past the channels


def test_activation_shifts_slot_names_with_tags() -> None:
    schedule = activation_broadcast(0, 3, allreduce_ring(0, 3, "sum"))
    for op in schedule.ops:
        if op.kind is Kind.RECV and op.buffer != EMPTY:
            assert parse(op.buffer) == Buffer(Region.SLOT, peer=op.peer, tag=op.tag)


# -- the naming convention and refusals ------------------------------------------------------------
def test_buffer_names_read_back() -> None:
    assert parse(DATA) == Buffer(Region.DATA)
    assert parse(EMPTY) == Buffer(Region.EMPTY)
    assert parse(chunk(12)) == Buffer(Region.CHUNK, index=12)
    assert parse(slot(3, 40)) == Buffer(Region.SLOT, peer=3, tag=40)
    with pytest.raises(UsageError, match="not a collective buffer"):
        parse("data:x")


@pytest.mark.parametrize(("count", "parts"), [(0, 3), (2, 5), (19, 8), (64, 4)])
def test_chunks_tile_the_tensor(count: int, parts: int) -> None:
    bounds = [chunk_bounds(count, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: allreduce_ring(3, 3, "sum"), "rank 3 of 3"),
        (lambda: allreduce_recursive_doubling(0, 0, "sum"), "size >= 1"),
        (lambda: allreduce_ring(0, 2, "prod"), "op 'prod'"),
        (lambda: allreduce_tree(2, 2, "sum"), "rank 2 of 2"),
        (lambda: broadcast(0, 4, 4), "root 4"),
        (
            lambda: activation_broadcast(0, 2, Schedule(ops=(Op.recv(1, slot(1, 0)),))),
            "no activation",
        ),
    ],
)
def test_what_cannot_be_built_is_refused(build: Callable[[], Schedule], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        build()
