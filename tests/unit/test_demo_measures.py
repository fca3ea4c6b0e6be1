"""The arithmetic of what a training run measured (:mod:`fabricd.demo.measures`): time to the
target loss, gradients per second per rank, and the speedup over sync."""

from __future__ import annotations

import math

import pytest

from fabricd.demo.measures import (
    Tally,
    gradients_per_second,
    mean_active,
    merge_rounds,
    skipped,
    speedup,
    time_to_target,
    unseen,
)


def test_the_time_to_target_is_the_first_time_the_loss_is_at_or_below_it():
    history = [(0.0, 100.0), (1.5, 9.0), (2.0, 4.0), (2.5, 5.0), (3.0, 3.0)]
    assert time_to_target(history, 4.0) == 2.0  # at, not only below
    assert time_to_target(history, 3.5) == 3.0
    assert time_to_target(history, 100.0) == 0.0  # the initial model already
    assert time_to_target(history, 2.0) is None
    assert time_to_target([], 1.0) is None


def test_a_round_counts_once_whichever_ranks_got_it():
    tallies = [
        Tally(rank=0, calls=3, rounds={0: 8, 1: 7, 3: 6}),
        Tally(rank=1, calls=3, rounds={0: 8, 2: 5, 3: 6}),
        Tally(rank=2, calls=1, rounds={4: 2}),
    ]
    rounds = merge_rounds(tallies)
    assert rounds == {0: 8, 1: 7, 2: 5, 3: 6, 4: 2}
    assert unseen(rounds, 5) == 0
    assert unseen({0: 8, 2: 5}, 5) == 3  # rounds 1, 3 and 4
    assert merge_rounds([]) == {}


def test_gradients_per_second_count_the_gradients_in_the_results_per_rank():
    # a sync job: every round holds every rank's gradient, so gradients/s = rounds/s
    sync = dict.fromkeys(range(10), 8)
    assert gradients_per_second(sync, steps=10, ranks=8, seconds=5.0) == pytest.approx(2.0)
    # a partial one: 10 rounds in 4 s (2.5 rounds/s), but 60 gradients, not 80
    partial = {r: (8 if r % 2 else 4) for r in range(10)}
    assert sum(partial.values()) == 60
    assert gradients_per_second(partial, steps=10, ranks=8, seconds=4.0) == pytest.approx(
        60 / 8 / 4.0
    )
    assert mean_active(partial, 10) == pytest.approx(6.0)
    # rounds past the run's last (a rank behind started one) are not the run's
    late = {**partial, 10: 8, 11: 8}
    assert gradients_per_second(late, steps=10, ranks=8, seconds=4.0) == pytest.approx(1.875)
    assert mean_active(late, 10) == pytest.approx(6.0)
    assert math.isnan(mean_active({}, 10))
    assert gradients_per_second(sync, steps=10, ranks=8, seconds=0.0) == math.inf


def test_the_speedup_is_syncs_time_to_target_over_the_modes():
    assert speedup(30.0, 20.0) == pytest.approx(1.5)  # sooner: higher
    assert speedup(20.0, 30.0) == pytest.approx(2 / 3)
    assert speedup(30.0, None) == 0.0  # never reached: worse than any time
    assert math.isnan(speedup(None, 20.0))  # nothing to compare with
    assert math.isnan(speedup(None, None))
    assert speedup(30.0, 0.0) == math.inf  # reached before the first step


def test_skipped_results_are_the_rounds_a_rank_never_got_averaged_over_the_ranks():
    tallies = [
        Tally(rank=0, calls=4, rounds={0: 8, 1: 8, 2: 8, 3: 8}),
        Tally(rank=1, calls=2, rounds={0: 8, 3: 8}),  # rounds 1 and 2 went by
        Tally(rank=2, calls=3, rounds={1: 8, 2: 8, 4: 8}),  # 0 and 3; 4 is past the run
    ]
    assert skipped(tallies, steps=4) == pytest.approx((0 + 2 + 2) / 3)
    assert skipped([], steps=4) == 0.0


def test_rounds_that_reached_a_rank_in_a_sum_are_not_skipped() -> None:
    summed = Tally(rank=0, calls=2, rounds={0: 8, 3: 8}, summed=frozenset({1, 2}))
    latest = Tally(rank=1, calls=2, rounds={0: 8, 3: 8})
    assert skipped([summed], 4) == 0
    assert skipped([latest], 4) == 2
