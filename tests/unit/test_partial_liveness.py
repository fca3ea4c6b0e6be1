"""Issue 23 on the engine: partial collectives that always finish, with every result applied
once.  The fabric of :mod:`tests.unit.test_persistent` (FIFO links, deliveries and calls in an
order hypothesis draws, a fake clock that deadlines jump), with uneven step counts per rank,
ranks that leave, and nodes that die.
"""

from __future__ import annotations

from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.collectives.partial import MIN_WAIT, PATIENCE, Patience
from fabricd.engines.collectives.persistent import Spec, initiator
from tests.unit.test_persistent import GRACE, JOB, NAME, PLACEMENTS, Fabric, Recording, run_partial

SIX_ON_FOUR = (0, 1, 2, 3, 0, 1)  #: 6 ranks on 4 nodes, as the issue's hang had them


def applied(fab: Fabric, who: dict[int, tuple[int, int]], arrays: dict[int, Any], rank: int) -> Any:
    """Everything rank ``rank``'s calls got back, summed (what its replica applied)."""
    total = np.zeros_like(next(iter(arrays.values())))
    for token, (r, _) in who.items():
        if r == rank and token in fab.delivered:
            total += arrays[token]
    return total


@settings(max_examples=80, deadline=None)
@given(
    mode=st.sampled_from(["solo", "majority"]),
    late=st.sampled_from(["sum", "latest"]),
    placement=st.sampled_from([*PLACEMENTS, SIX_ON_FOUR]),
    steps=st.lists(st.integers(1, 6), min_size=8, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_call_completes_and_every_gift_is_counted_once(
    mode: str, late: str, placement: tuple[int, ...], steps: list[int], seed: int
) -> None:
    """Ranks make uneven numbers of calls (the training loop that ends at a barrier): every
    call completes (a majority round whose initiator stopped calling starts once a waiting
    call's patience ends), nothing fails, and every gift is in exactly one result or still
    waits at its node."""
    counts = steps[: len(placement)]
    fab, gifts, arrays, who = run_partial(mode, placement, counts, Random(seed), late=late)
    assert not fab.failed
    assert set(fab.delivered) == set(who), "a call never completed"
    histories = [c.history for c in fab.colls.values()]
    assert all(h.keys() == histories[0].keys() for h in histories)
    counted = sum(histories[0].values(), np.zeros_like(gifts.given))
    waiting = sum((c.conservation() for c in fab.colls.values()), np.zeros_like(gifts.given))
    np.testing.assert_array_equal(counted + waiting, gifts.given)
    if late == "sum":  # every rank applied every round's result once, or is owed it
        for rank, node in enumerate(placement):
            owed = fab.colls[node].owed.owed(rank)
            mine = applied(fab, who, arrays, rank) + (0 if owed is None else owed)
            np.testing.assert_array_equal(mine, counted)
    unled = sum(c.counters.unled for c in fab.colls.values())
    assert mode == "majority" or unled == 0


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["solo", "majority"]),
    placement=st.sampled_from([p for p in PLACEMENTS if len(set(p)) >= 3] + [SIX_ON_FOUR]),
    steps=st.lists(st.integers(1, 5), min_size=8, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_survivors_of_a_node_failure_all_finish(
    mode: str, placement: tuple[int, ...], steps: list[int], seed: int
) -> None:
    rng = Random(seed)
    victim = rng.choice(sorted(set(placement)))
    counts = steps[: len(placement)]
    fab, _gifts, _arrays, who = run_partial(mode, placement, counts, rng, kill=victim)
    for token, (rank, k) in who.items():
        if placement[rank] != victim:
            assert token in fab.delivered, f"call {k} of rank {rank} never completed"


def test_a_majority_round_whose_initiator_is_done_starts_within_the_stated_wait() -> None:
    """The issue's hang: every rank ran its steps but the drawn initiator of the next round
    has finished and waits elsewhere.  The others' calls start the round once they waited
    ``majority_wait`` (here the default 2 s: no interval is learned yet after one round) and
    complete with what was given."""
    placement = SIX_ON_FOUR
    spec = Spec(kind="allreduce", count=6, dtype="int64", mode="majority", late="sum")
    fab = Fabric(spec, placement, Random(1))
    for rank in range(6):  # the first round: every rank
        fab.call(rank, rank + 1, np.eye(6, dtype="int64")[rank])
    fab.drain()
    assert len(fab.delivered) == 6
    done = initiator(JOB, NAME, 1, 6, frozenset(range(6)))
    waiting = {}
    for rank in range(6):
        if rank != done:
            waiting[rank] = np.eye(6, dtype="int64")[rank]
            fab.call(rank, 100 + rank, waiting[rank])
    fab.drain()
    assert len(fab.delivered) == 6  # nobody starts round 1 but its initiator ...
    called = fab.now
    deadlines = [c.next_deadline() for c in fab.colls.values()]
    assert all(d is not None and d <= called + 2.0 for d in deadlines)
    assert fab.expire()  # ... until a waiting call's patience ends
    fab.drain()
    assert all(100 + rank in fab.delivered for rank in waiting)
    expected = np.ones(6, "int64")
    expected[done] = 0
    for rank, array in waiting.items():
        assert fab.delivered[100 + rank].round == 1
        np.testing.assert_array_equal(array, expected)
    assert sum(c.counters.unled for c in fab.colls.values()) >= 1


def test_patience_learns_the_interval_between_rounds_and_keeps_to_its_limit() -> None:
    patience = Patience(limit=2.0)
    assert patience.wait() == 2.0  # nothing learned yet
    for k in range(20):
        patience.started(0.1 * k)
    assert patience.wait() == pytest.approx(PATIENCE * 0.1)
    patience.started(0.1 * 20)  # a loop faster than the clock's grain: at least MIN_WAIT
    for k in range(50):
        patience.started(2.0 + 1e-6 * k)
    assert patience.wait() == pytest.approx(MIN_WAIT)
    slow = Patience(limit=0.5)
    for k in range(5):
        slow.started(10.0 * k)
    assert slow.wait() == 0.5  # never past its limit
    assert slow.deadline() is None
    slow.waits(41.0)
    slow.waits(41.2)  # the first waiting call starts the count
    assert slow.deadline() == 41.5


def test_the_first_round_waits_for_every_rank_and_not_for_one_that_left() -> None:
    """The first round is every rank's: a solo call does not complete before every rank's
    first call came (so a call that disagrees fails every rank's), but a rank that left
    before its first call is not waited for."""
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="solo")
    fab = Fabric(spec, (0, 0, 1), Random(0))
    fab.call(0, 1, np.array([1, 0, 0], "int64"))
    fab.call(2, 3, np.array([0, 0, 1], "int64"))
    fab.drain()
    assert not fab.delivered
    assert fab.colls[0].waits()[0] == "ranks"
    live = frozenset({0, 2})
    for node, coll in fab.colls.items():
        fab.perform(node, coll.rank_gone(1, live, fab.tick(), grace=GRACE))
    fab.drain()
    assert set(fab.delivered) == {1, 3}
    assert fab.delivered[1].active == 2


def test_a_rank_that_never_called_is_owed_every_result_under_late_sum() -> None:
    spec = Spec(kind="allreduce", count=2, dtype="float64", mode="solo", op="avg")
    fab = Fabric(spec, (0, 1), Random(0))
    fab.call(0, 1, np.array([2.0, 0.0]))
    fab.call(1, 2, np.array([0.0, 2.0]))
    fab.drain()
    for token in range(3, 8):  # rank 0 alone: five rounds of avg over 2 ranks
        fab.call(0, token, np.array([2.0, 0.0]))
        fab.drain()
    owed = fab.colls[1].owed.owed(1)
    assert owed is not None
    np.testing.assert_array_equal(owed, [5.0, 0.0])
    behind = np.zeros(2)
    fab.call(1, 9, behind)
    assert fab.delivered[9].results == 5
    np.testing.assert_array_equal(behind, [5.0, 0.0])
    assert fab.colls[1].owed.owed(1) is None


def test_a_late_call_answered_at_once_leaves_no_timer_behind() -> None:
    """A majority call of a rank behind is answered at once; unless it is the initiator's, it
    starts nothing, and nothing waits, so its node arms no patience."""
    spec = Spec(kind="allreduce", count=2, dtype="int64", mode="majority")
    fab = Fabric(spec, (0, 1), Random(0))
    fab.call(0, 1, np.zeros(2, "int64"))
    fab.call(1, 2, np.zeros(2, "int64"))
    fab.drain()
    live = frozenset({0, 1})
    leader = initiator(JOB, NAME, 1, 2, live)
    other = 1 - leader
    fab.call(leader, 3, np.array([1, 0], "int64"))  # round 1, the other rank passive
    fab.drain()
    assert 3 in fab.delivered
    fab.call(other, 4, np.array([0, 1], "int64"))  # behind: round 1's result at once
    assert fab.delivered[4].round == 1
    if initiator(JOB, NAME, 2, 2, live) == other:  # it also starts round 2
        fab.drain()
        assert fab.colls[other].round == 3
    else:
        assert fab.colls[other].next_deadline() is None


def test_a_view_change_keeps_what_a_rank_behind_is_owed() -> None:
    """Under late="sum", a rank behind when a node dies keeps its due round: its next call is
    late and gets the rounds that ended here without it (the review of issue 23 found the view
    change moving it up to the new base, stranding them in the owed sum)."""
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="solo", late="sum")
    fab = Fabric(spec, (0, 1, 2), Random(0))
    for rank in range(3):
        fab.call(rank, rank, np.eye(3, dtype="int64")[rank].copy())
    fab.drain()
    for token in (10, 11):  # rank 0 alone: rounds 1 and 2; ranks 1 and 2 miss them
        fab.call(0, token, np.array([1, 0, 0], "int64"))
        fab.drain()
    owed = fab.colls[1].owed.owed(1)
    assert owed is not None
    assert owed.tolist() == [2, 0, 0]
    fab.kill(2)
    fab.drain()
    behind = np.array([0, 5, 0], "int64")
    fab.call(1, 20, behind)
    assert fab.delivered[20].results == 2
    np.testing.assert_array_equal(behind, [2, 0, 0])
    assert fab.colls[1].owed.owed(1) is None


def test_a_node_built_after_its_only_rank_left_takes_part_at_once() -> None:
    """Built from a peer's frame once its only rank had left (the placement it knew), a node
    has no rank to wait for in the first round: it follows its peers' rounds at once."""
    spec = Spec(kind="allreduce", count=2, dtype="int64", mode="solo")
    coll = Recording(spec, job=JOB, name=NAME, node=1, ranks=(0, 0, 1), live=frozenset({0, 1}))
    waits, detail, _ = coll.waits()
    assert waits == "messages", detail  # not "ranks": no local rank's first call to wait for


def test_a_rank_not_live_when_the_collective_was_built_starts_where_the_job_is() -> None:
    """A local rank whose trainer had left before the collective was built is owed nothing
    when it comes back: like any restarted trainer, its first call is for the current round
    (the review found it handed the sum of every result since the build)."""
    spec = Spec(kind="allreduce", count=2, dtype="int64", mode="solo", late="sum")
    live = frozenset({0})
    coll = Recording(spec, job=JOB, name=NAME, node=0, ranks=(0, 0), live=live)
    for token in range(5):
        coll.call(0, token, np.array([1, 0], "int64"), float(token))
    assert coll.owed.owed(1) is None
    coll.rank_back(frozenset({0, 1}))
    mine = np.array([0, 1], "int64")
    coll.call(1, 9, mine, 9.0)
    assert coll.counters.late == 0
    coll.call(0, 10, np.array([1, 0], "int64"), 10.0)
    assert coll.counters.rounds == 6
