"""The in-place allgather of a node's only rank against the general path (issue 30: a torch
backend's ``all_gather_into_tensor`` of one rank per node, without the daemon's two copies).

The simulated fabric of test_collectives_inplace.py (FIFO links that keep a *view* of each
sent payload until it is delivered, deliveries in a drawn order, messages in frames of random
sizes): every node runs the engine in place and on the general path, and both must give the
same bytes.  A rank writes its *output* the moment its call completes or fails (the next
step's use of it), and gives the same output again next round, as the torch backend's warm
staging arrays do: a send that still read the output after the completion, or a landing that
still wrote it, shows up as a wrong result somewhere.  An allgather's message may reach a node
before its own rank called (its left neighbour's came first): it lands in a slot there, and
in the output once the round runs.
"""

from __future__ import annotations

from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.collectives.persistent import Spec
from fabricd.engines.collectives.spec import held_bytes
from tests.unit.test_collectives_inplace import Framed, Writer
from tests.unit.test_persistent import GRACE

DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def gather_call(
    fab: Writer, rank: int, token: int, array: np.ndarray[Any, Any], out: np.ndarray[Any, Any]
) -> None:
    """Rank ``rank``'s allgather call of ``array`` into ``out``: the array it rewrites at
    completion is ``out``."""
    fab.arrays[token] = out
    node = fab.placement[rank]
    fab.perform(node, fab.colls[node].call(rank, token, array, fab.tick(), out))


def run_rounds(
    placement: tuple[int, ...],
    spec: Spec,
    seed: int,
    *,
    general: bool,
    framed: bool,
    settle: bool = True,
    rounds: int = 3,
) -> tuple[Writer, list[np.ndarray[Any, Any]]]:
    """``rounds`` rounds, each rank giving fresh data into the same output every round;
    returns the fabric and each round's expected result (every rank's block)."""
    rng = Random(seed)
    fab = (Framed if framed else Writer)(spec, placement, Random(seed + 1))
    fab.general, fab.settle = general, settle
    fab.__post_init__()
    size = len(placement)
    outputs = [np.full(size * spec.count, 99, spec.dtype) for _ in placement]
    wanted = []
    for round in range(rounds):
        for rank in range(size):
            if round:  # before the rank's next call gives the output again
                fab.touched += not fab.untouched_since((round - 1) * size + rank)
        inputs = [
            np.array([rng.randint(0, 20) for _ in range(spec.count)], spec.dtype) for _ in placement
        ]
        wanted.append(np.concatenate(inputs))
        order = list(range(size))
        rng.shuffle(order)
        for rank in order:
            gather_call(fab, rank, round * size + rank, inputs[rank], outputs[rank])
            for _ in range(rng.randint(0, 4)):
                fab.deliver_one()
        fab.drain()
    last = (rounds - 1) * size
    fab.touched += sum(not fab.untouched_since(last + r) for r in range(size))
    return fab, wanted


@settings(max_examples=150, deadline=None)
@given(
    nodes=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    count=st.integers(0, 30),
    settle=st.booleans(),
    framed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_in_place_gives_every_rank_every_block_as_the_general_path_does(
    nodes: int, dtype: str, count: int, settle: bool, framed: bool, seed: int
) -> None:
    """Each completion finds every rank's block in the output, both ways, round after round
    (messages landing whole or in frames, early or in place, the call completing as soon as
    nothing it sent is queued or with the acknowledgements); nothing writes an output after
    its call completed, nor reads it (a peer would get the rank's next data)."""
    placement = tuple(range(nodes))
    spec = Spec(kind="allgather", count=count, dtype=dtype)
    fast, wanted = run_rounds(placement, spec, seed, general=False, framed=framed, settle=settle)
    slow, _ = run_rounds(placement, spec, seed, general=True, framed=framed)
    assert all(c.inplace for c in fast.colls.values())
    assert not any(c.inplace for c in slow.colls.values())
    assert sorted(fast.delivered) == sorted(slow.delivered) == list(range(3 * nodes))
    for token, want in slow.seen.items():
        np.testing.assert_array_equal(want, wanted[token // nodes])
        assert fast.seen[token].tobytes() == want.tobytes(), f"call {token}"
    assert fast.touched == slow.touched == 0
    assert not fast.failed
    assert not slow.failed


def test_a_message_that_comes_before_the_nodes_call_lands_in_a_slot_then_in_place() -> None:
    """Node 0's rank calls first; its message reaches node 1 before node 1's rank calls, so
    it cannot land in an output that is not there yet: it waits in a slot, and is copied into
    node 1's output when its round runs."""
    spec = Spec(kind="allgather", count=4, dtype="int64")
    fab = Writer(spec, (0, 1), Random(0))
    outs = [np.zeros(8, "int64") for _ in range(2)]
    gather_call(fab, 0, 0, np.arange(4, dtype="int64"), outs[0])
    assert fab.deliver_one()  # node 0's chunk, at node 1 before its call
    c1 = fab.colls[1]
    assert any(a.any() for pair in c1.layout.slots.values() for a in pair)
    gather_call(fab, 1, 1, np.arange(4, 8, dtype="int64"), outs[1])
    fab.drain()
    for token in (0, 1):
        np.testing.assert_array_equal(fab.seen[token], np.arange(8))
    assert fab.touched == 0


@pytest.mark.parametrize("placement", [(0, 0, 1), (1, 0), (0, 1, 0)])
def test_only_a_node_of_one_rank_in_order_runs_in_place(placement: tuple[int, ...]) -> None:
    """A node of several ranks folds them into its tensor; ranks not ordered by node move
    blocks on the way out: both keep the general path there, and results agree."""
    spec = Spec(kind="allgather", count=3, dtype="int32")
    fast, wanted = run_rounds(placement, spec, 3, general=False, framed=False)
    sorted_ranks = list(placement) == sorted(placement)
    assert {n: c.inplace for n, c in fast.colls.items()} == {
        n: placement.count(n) == 1 and sorted_ranks for n in fast.colls
    }
    for token, seen in fast.seen.items():
        np.testing.assert_array_equal(seen, wanted[token // len(placement)])
    assert fast.touched == 0


@settings(max_examples=100, deadline=None)
@given(count=st.integers(2, 30), at=st.integers(0, 60), seed=st.integers(0, 2**32 - 1))
def test_a_call_failing_at_any_step_leaves_its_output_alone_and_the_others_right(
    count: int, at: int, seed: int
) -> None:
    """Node 0's call fails (rank 2 left, its grace ran out) after ``at`` frame steps: nothing
    lands in its output after the failure, and nodes 1 and 2 get every block."""
    spec = Spec(kind="allgather", count=count, dtype="float64")
    fab = Framed(spec, (0, 1, 2), Random(seed))
    fab.copied, fab.cut = True, Random(seed + 1)
    outs = [np.zeros(3 * count) for _ in range(3)]
    for r in range(3):
        gather_call(fab, r, r, np.full(count, float(r + 1)), outs[r])
    for _ in range(at):
        fab.deliver_one()
    c0 = fab.colls[0]
    fab.perform(0, c0.rank_gone(2, frozenset({0, 1}), fab.tick(), grace=GRACE))
    fab.perform(0, c0.on_timer(fab.now + GRACE + 1))
    if 0 in fab.failed:  # the round lets go of the output: no buffer of it is a view of it
        assert not np.shares_memory(c0.data, outs[0])
    fab.drain()
    assert set(fab.delivered) | set(fab.failed) == {0, 1, 2}
    assert fab.untouched_since(0)
    want = np.repeat([1.0, 2.0, 3.0], count)
    for token in (1, 2):
        np.testing.assert_array_equal(fab.seen[token], want)


def test_the_budget_charges_one_tensor_less_in_place() -> None:
    """In place the daemon holds no ``data`` of its own between rounds (a failed call's copy
    at most): the charge is one tensor less than the general path's."""
    spec = Spec(kind="allgather", count=100, dtype="float32")
    fast = held_bytes(spec, 4, inplace=True, size=4)
    slow = held_bytes(spec, 4, inplace=False, size=4)
    assert slow - fast == 4 * 100 * 4
    fab, _ = run_rounds((0, 1, 2, 3), spec, 0, general=False, framed=False)
    for coll in fab.colls.values():
        held = {id(a): a.nbytes for a in coll.arrays()}
        assert sum(held.values()) <= fast
        assert coll.data.nbytes == coll.result.nbytes == 0


def run_overlapping(
    nodes: int, count: int, seed: int, *, general: bool, framed: bool, settle: bool, own: bool
) -> tuple[Writer, list[tuple[Any, ...]]]:
    """Four rounds in which each rank calls its next allgather as soon as its last one
    completed (as a trainer does), into the same output, its input given in its own block of
    the output (``own``: MPI_IN_PLACE, as the torch backend does) or apart; calls and
    deliveries drawn in any order, so a round's messages meet the previous round still
    running.  Returns the fabric and what went wrong (an output written after its call
    completed, a result that is not every rank's block)."""
    rng, rounds = Random(seed), 4
    spec = Spec(kind="allgather", count=count, dtype="int64")
    fab = (Framed if framed else Writer)(spec, tuple(range(nodes)), Random(seed + 1))
    fab.general, fab.settle = general, settle
    fab.__post_init__()
    outputs = [np.full(nodes * count, 99, "int64") for _ in range(nodes)]
    inputs = {
        (r, k): np.array([rng.randint(0, 1000) for _ in range(count)], "int64")
        for r in range(nodes)
        for k in range(rounds)
    }
    due, open_calls, bad = [0] * nodes, [-1] * nodes, []
    for _ in range(200_000):
        for r in range(nodes):
            if open_calls[r] in fab.delivered or open_calls[r] in fab.failed:
                open_calls[r] = -1
        ready = [r for r in range(nodes) if open_calls[r] < 0 and due[r] < rounds]
        if ready and rng.random() < 0.4:
            r = rng.choice(ready)
            k = due[r]
            if k and not fab.untouched_since((k - 1) * nodes + r):
                bad.append(("touched", (k - 1) * nodes + r))
            out = outputs[r]
            given_in = out[r * count : (r + 1) * count] if own else inputs[r, k].copy()
            given_in[:] = inputs[r, k]
            gather_call(fab, r, k * nodes + r, given_in, out)
            open_calls[r], due[r] = k * nodes + r, k + 1
        elif not fab.deliver_one() and not ready:
            break
    for token, seen in fab.seen.items():
        want = np.concatenate([inputs[r, token // nodes] for r in range(nodes)])
        if seen.tobytes() != want.tobytes():
            bad.append(("wrong", token))
    return fab, bad


@settings(max_examples=150, deadline=None)
@given(
    nodes=st.integers(2, 5),
    count=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    framed=st.booleans(),
    settle=st.booleans(),
    own=st.booleans(),
    general=st.booleans(),
)
def test_overlapping_rounds_with_the_input_in_its_own_block_give_every_block(
    nodes: int, count: int, seed: int, framed: bool, settle: bool, own: bool, general: bool
) -> None:
    # review of the in-place allgather: the committed tests drained after every round, so no
    # round r + 1 message met round r running (it lands in slot parity (r + 1) % 2), no call
    # completed by Settle with the rank's next call right behind it, and no input was a view
    # of its own output's block
    fab, bad = run_overlapping(
        nodes, count, seed, general=general, framed=framed, settle=settle, own=own
    )
    assert all(c.inplace is not general for c in fab.colls.values())
    assert not fab.failed
    assert len(fab.delivered) == nodes * 4
    assert not bad, bad[:3]
