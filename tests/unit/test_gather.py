"""Native allgather and reduce-scatter on the persistent engine over a simulated fabric: no
sockets, a fake clock (``Fabric`` of test_persistent.py: FIFO links between nodes, deliveries
in an order a seeded ``Random`` draws, calls interleaved with them).

What must hold: every rank gets exactly numpy's answer, for any placement of ranks on 1 to 5
nodes (uneven, interleaved), odd and empty blocks, every reduce op and dtype, round after
round; and a node sends each round only what the ring needs, ``(nodes - 1) / nodes`` of the
tensor (its chunks but one), half a ring allreduce's bytes.
"""

from __future__ import annotations

from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.dtypes import REDUCE_DTYPES, is_float
from fabricd.engines.collectives.algorithms import chunk_bounds
from fabricd.engines.collectives.gather import Blocks, allgather_ring, reduce_scatter_ring
from fabricd.engines.collectives.persistent import Collective, Deliver, Spec, Transmit
from fabricd.engines.collectives.spec import GATHERS, held_bytes
from fabricd.engines.schedule import Kind
from fabricd.errors import UsageError
from tests.unit.test_collectives import Sim, check_result, reference, synchronous, tensors
from tests.unit.test_persistent import Fabric

#: the node of each rank: one to five nodes, even and uneven, consecutive and interleaved
PLACEMENTS = [
    (0,),
    (0, 0, 0),
    (0, 1),
    (0, 0, 1, 1),
    (0, 1, 2),
    (0, 0, 1, 1, 2, 2),
    (0, 1, 0, 1, 2),
    (2, 0, 0, 1),
    (0, 1, 2, 3),
    (0, 0, 1, 2, 2, 2, 3, 4),
    (4, 3, 2, 1, 0, 0),
]
OPS = ["sum", "avg", "max", "min"]


def run(
    fab: Fabric, inputs: list[np.ndarray[Any, Any]], outputs: list[np.ndarray[Any, Any]], token: int
) -> None:
    """Every rank calls once, in a drawn order, interleaved with deliveries; then drain."""
    order = list(range(len(inputs)))
    fab.rng.shuffle(order)
    for rank in order:
        node = fab.placement[rank]
        coll = fab.colls[node]
        fab.perform(node, coll.call(rank, token + rank, inputs[rank], fab.tick(), outputs[rank]))
        for _ in range(fab.rng.randint(0, 3)):
            fab.deliver_one()
    fab.drain()


def draw(rng: Random, count: int, dtype: str) -> np.ndarray[Any, Any]:
    low = 0 if dtype == "uint8" else -20
    return np.array([rng.randint(low, 20) for _ in range(count)], dtype)


def reduce(blocks: np.ndarray[Any, Any], op: str, size: int) -> np.ndarray[Any, Any]:
    """numpy's answer, reduced in the block's dtype as the daemon does."""
    match op:
        case "sum":
            return blocks.sum(axis=0, dtype=blocks.dtype)
        case "avg":
            total = blocks.sum(axis=0, dtype=blocks.dtype)
            return total / size if is_float(blocks.dtype) else total // size
        case "max":
            return blocks.max(axis=0)
    return blocks.min(axis=0)


@settings(max_examples=120, deadline=None)
@given(
    placement=st.sampled_from(PLACEMENTS),
    dtype=st.sampled_from([*REDUCE_DTYPES, "uint8"]),
    count=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_allgather_gives_every_rank_every_block_in_rank_order(
    placement: tuple[int, ...], dtype: str, count: int, seed: int
) -> None:
    rng = Random(seed)
    fab = Fabric(Spec(kind="allgather", count=count, dtype=dtype), placement, rng)
    size = len(placement)
    for round in range(3):
        inputs = [draw(rng, count, dtype) for _ in placement]
        outputs = [np.full(size * count, 99, dtype) for _ in placement]
        run(fab, inputs, outputs, round * size)
        want = np.concatenate(inputs) if count else np.zeros(0, dtype)
        for rank in range(size):
            got = fab.delivered[round * size + rank]
            assert (got.round, got.included, got.active) == (round, True, size)
            np.testing.assert_array_equal(outputs[rank], want)
            assert not fab.failed


@settings(max_examples=200, deadline=None)
@given(
    placement=st.sampled_from(PLACEMENTS),
    op=st.sampled_from(OPS),
    dtype=st.sampled_from(REDUCE_DTYPES),
    count=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_scatter_gives_each_rank_its_block_reduced_over_every_rank(
    placement: tuple[int, ...], op: str, dtype: str, count: int, seed: int
) -> None:
    rng = Random(seed)
    spec = Spec(kind="reduce_scatter", count=count, dtype=dtype, op=op)
    fab = Fabric(spec, placement, rng)
    size = len(placement)
    for round in range(3):
        inputs = [draw(rng, size * count, dtype) for _ in placement]
        outputs = [np.full(count, 99, dtype) for _ in placement]
        run(fab, inputs, outputs, round * size)
        stacked = np.stack(inputs).reshape(size, size, count)  # (giver, block, element)
        for rank in range(size):
            got = fab.delivered[round * size + rank]
            assert (got.round, got.active) == (round, size)
            want = reduce(stacked[:, rank, :], op, size)
            np.testing.assert_allclose(
                outputs[rank].astype("float64"), want.astype("float64"), rtol=2e-3
            )
        assert not fab.failed


@pytest.mark.parametrize("kind", GATHERS)
@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5])
def test_a_node_sends_only_the_chunks_the_ring_needs(kind: str, nodes: int) -> None:
    """Two ranks a node, 10 float32 each: a node's round sends ``nodes - 1`` chunks of its
    2 * nodes * 10 elements, (nodes - 1) / nodes of the tensor, one frame each (no padding to
    an allreduce, which would send twice that)."""
    placement = tuple(n for n in range(nodes) for _ in range(2))
    count, size = 10, 2 * nodes
    fab = Fabric(Spec(kind=kind, count=count, dtype="float32"), placement, Random(1))
    sent: dict[int, int] = dict.fromkeys(range(nodes), 0)
    perform = fab.perform

    def counting(node: int, actions: list[Any]) -> None:
        sent[node] += sum(len(a.payload) for a in actions if isinstance(a, Transmit))
        perform(node, actions)

    fab.perform = counting  # type: ignore[method-assign]
    total = size * count if kind == "reduce_scatter" else count
    inputs = [np.ones(total, "float32") for _ in placement]
    outputs = [np.zeros(size * count + count - total, "float32") for _ in placement]
    run(fab, inputs, outputs, 0)
    tensor = size * count * 4
    assert sent == dict.fromkeys(range(nodes), tensor * (nodes - 1) // nodes)
    ring = allgather_ring(0, nodes) if kind == "allgather" else reduce_scatter_ring(0, nodes, "sum")
    assert sum(op.kind is Kind.SEND for op in ring.ops) == nodes - 1


def test_the_budget_charges_every_ranks_block() -> None:
    """data, result and the ring's slots (two parities): 4 tensors of size * count."""
    spec = Spec(kind="reduce_scatter", count=10, dtype="float64")
    assert held_bytes(spec, 3, inplace=False, size=6) == 4 * 6 * 10 * 8


def test_blocks_follow_the_nodes_then_the_ranks() -> None:
    blocks = Blocks("allgather", (1, 0, 1, 2), (0, 1, 2), 3)
    assert blocks.order == [1, 0, 2, 3]
    assert blocks.bounds == (0, 3, 9, 12)
    assert blocks.moves
    assert not Blocks("reduce_scatter", (0, 0, 1), (0, 1), 2).moves


def test_a_call_that_disagrees_with_the_first_is_refused() -> None:
    spec = Spec(kind="reduce_scatter", count=4, dtype="float32", op="max")
    assert not spec.same_call(Spec(kind="reduce_scatter", count=4, dtype="float32", op="sum"))
    assert not spec.same_call(Spec(kind="reduce_scatter", count=5, dtype="float32", op="max"))
    assert not spec.same_call(Spec(kind="allgather", count=4, dtype="float32"))
    assert "reduce_scatter max of 4 float32" in spec.describe()
    coll = Collective(spec, job="j", name="n", node=0, ranks=(0, 0), live=frozenset({0, 1}))
    x, out = np.zeros(8, "float32"), np.zeros(4, "float32")
    coll.call(0, 1, x, 0.0, out)
    with pytest.raises(UsageError, match="already has a call"):
        coll.call(0, 2, x, 0.0, out)
    done = coll.call(1, 3, x, 0.0, out)
    assert [type(a) for a in done] == [Deliver, Deliver]


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "allgather", "mode": "solo"},
        {"kind": "reduce_scatter", "mode": "majority"},
        {"kind": "allgather", "op": "max"},
        {"kind": "reduce_scatter", "algorithm": "ring"},
        {"kind": "allgather", "ring": True},
    ],
)
def test_only_sync_with_its_own_ring(fields: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        Spec(count=4, dtype="float32", **fields).check()


# -- the schedules alone, on test_collectives' simulated ranks ---------------------------------
@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(GATHERS),
    size=st.integers(1, 9),
    op=st.sampled_from(OPS),
    dtype=st.sampled_from(REDUCE_DTYPES),
    count=st.integers(0, 30),  # fewer elements than ranks: empty chunks, zero-byte messages
    seed=st.integers(0, 2**32 - 1),
)
def test_the_ring_schedules_are_right_under_any_order_and_round_overlap(
    kind: str, size: int, op: str, dtype: str, count: int, seed: int
) -> None:
    """Sends read their bytes when they complete, the next round's messages arrive while the
    current one runs, and each slot parity must be free when a message lands (test_collectives'
    ``Sim``): an allgather leaves every rank every rank's chunk, a reduce-scatter leaves rank
    ``i`` its chunk ``i`` reduced over every rank, in ``size - 1`` messages a rank a round."""
    rng, rounds = Random(seed), 3
    if kind == "allgather":
        schedules = [allgather_ring(rank, size) for rank in range(size)]
    else:
        schedules = [reduce_scatter_ring(rank, size, op) for rank in range(size)]
    sim = Sim(schedules, rng, inputs=tensors(rng, dtype, count, size, rounds))
    sim.run(rounds, synchronous(sim, rounds))
    for q in range(rounds):
        given = [sim.inputs[rank, q] for rank in range(size)]
        reduced = reference(given, op, dtype)
        for rank in range(size):
            assert sim.sends[rank, q] == size - 1
            for index in range(size) if kind == "allgather" else [rank]:
                start, stop = chunk_bounds(count, size, index)
                got = sim.results[rank, q][start:stop]
                if kind == "allgather":  # rank ``index``'s own chunk, exactly
                    np.testing.assert_array_equal(got, given[index][start:stop])
                else:
                    check_result(got, reduced[start:stop], dtype, size)
    assert not any(sim.links.values())


def test_a_withdrawn_call_leaves_nothing_in_the_round() -> None:
    """A reduce-scatter call whose client left before its node's round started is withdrawn
    (the engine's "A call whose client stops waiting"): the rank's next call gives afresh."""
    spec = Spec(kind="reduce_scatter", count=2, dtype="int64", op="sum")
    fab = Fabric(spec, (0, 0, 1), Random(5))
    out = [np.zeros(2, "int64") for _ in range(3)]
    coll = fab.colls[0]
    fab.perform(0, coll.call(0, 1, np.full(6, 100, "int64"), fab.tick(), out[0]))
    fab.perform(0, coll.abandon(1))
    run(fab, [np.arange(6, dtype="int64") * (r + 1) for r in range(3)], out, 10)
    for rank in range(3):  # (1 + 2 + 3) times block ``rank`` of arange(6)
        np.testing.assert_array_equal(out[rank], 6 * np.arange(2 * rank, 2 * rank + 2))


def test_a_dead_node_fails_the_waiting_calls() -> None:
    fab = Fabric(Spec(kind="allgather", count=3, dtype="float32"), (0, 1, 1), Random(2))
    x, out = np.ones(3, "float32"), np.zeros(9, "float32")
    fab.perform(1, fab.colls[1].call(1, 1, x, fab.tick(), out))
    fab.kill(0)
    assert fab.failed[1].code == "peer_failed"
