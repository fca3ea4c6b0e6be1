"""The demo's model and data (numpy only), and one rank's training loop against a fake client."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from fabricd.client.collectives import Result
from fabricd.demo.hyperplane import Hyperplane, Shard, default_lr, gradient, loss, predict, signs
from fabricd.demo.measures import Tally
from fabricd.demo.training import (
    DemoFailed,
    Settings,
    allreduce_options,
    injected_delay,
    parse_modes,
    summarize,
    train,
)
from fabricd.errors import PeerFailed


def test_every_rank_draws_the_same_numbers_from_the_seed():
    one, two = Hyperplane(64, seed=5), Hyperplane(64, seed=5)
    assert np.array_equal(one.coefficients, two.coefficients)
    assert np.array_equal(Shard(one, 1, 32, 8).x, Shard(two, 1, 32, 8).x)
    assert [one.straggler(t, 8) for t in range(50)] == [two.straggler(t, 8) for t in range(50)]
    assert len({one.straggler(t, 8) for t in range(200)}) == 8  # every rank straggles sometime
    # other ranks' shards and the held-out set are different draws
    shard = Shard(one, 1, 32, 8)
    assert not np.array_equal(shard.x, Shard(one, 2, 32, 8).x)
    assert not np.array_equal(shard.x[:8], one.validation(8)[0])
    assert not np.array_equal(one.coefficients, Hyperplane(64, seed=6).coefficients)


def test_a_shard_is_drawn_once_and_its_batches_cycle_in_epochs():
    problem = Hyperplane(16, seed=1)
    shard = Shard(problem, 3, points=50, batch=8)  # 6 batches; 2 points are never used
    assert shard.batches == 6
    assert shard.x.shape == (48, 16)
    x0, y0 = shard.batch(0)
    assert x0.shape == (8, 16)
    assert y0.shape == (8,)
    assert np.shares_memory(x0, shard.x)  # a view: a step copies nothing
    assert np.array_equal(shard.batch(6)[0], x0)  # the second epoch starts over
    assert np.array_equal(shard.batch(7)[1], shard.batch(1)[1])
    assert not np.array_equal(shard.batch(1)[0], x0)
    with pytest.raises(ValueError, match="holds no batch"):
        Shard(problem, 0, points=7, batch=8)


def test_the_inputs_are_signs_with_the_moments_of_a_standard_normal():
    x = signs(np.random.default_rng(0), 400, 250)
    assert x.shape == (400, 250)
    assert x.dtype == np.float32
    assert set(np.unique(x)) == {-1.0, 1.0}
    assert abs(float(x.mean())) < 0.01
    assert float(x.var()) == pytest.approx(1.0, abs=0.01)
    assert signs(np.random.default_rng(0), 3, 3).shape == (3, 3)  # not a multiple of 8 bits


def test_the_labels_lie_on_the_hyperplane_up_to_the_noise():
    problem = Hyperplane(32, noise=0.5, seed=1)
    x, y = problem.validation(20_000)
    assert x.shape == (20_000, 32)
    assert y.shape == (20_000,)
    assert x.dtype == y.dtype == np.float32
    truth = np.append(problem.coefficients, np.float32(0))
    # the best model's loss is the noise variance
    assert loss(truth, x, y) == pytest.approx(0.25, rel=0.05)
    # the zero model's: the signal's variance |a|^2 as well
    expected = float(problem.coefficients @ problem.coefficients) + 0.25
    assert loss(np.zeros(33, np.float32), x, y) == pytest.approx(expected, rel=0.05)
    assert Hyperplane(32, noise=0.0).sample(4, (9,))[1] == pytest.approx(
        Hyperplane(32, noise=0.0).sample(4, (9,))[0] @ Hyperplane(32).coefficients
    )


def test_the_gradient_is_the_derivative_of_the_loss():
    problem = Hyperplane(6, seed=2)
    x, y = problem.sample(50, (1,))
    theta = np.random.default_rng(0).standard_normal(7).astype(np.float32)
    out = np.full(7, np.nan, np.float32)
    assert gradient(theta, x, y, out=out) is out
    for i in range(7):  # central differences, in float64
        step = np.zeros(7)
        step[i] = 1e-4
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        numeric = (loss(theta + step, x64, y64) - loss(theta - step, x64, y64)) / 2e-4
        assert out[i] == pytest.approx(numeric, rel=1e-3, abs=1e-3)
    assert predict(theta, x).shape == (50,)


def test_the_default_step_learns_the_hyperplane_on_one_process():
    problem = Hyperplane(256, noise=1.0, seed=3)
    batch = 128
    theta = np.zeros(257, np.float32)
    grad = np.empty_like(theta)
    held_out = problem.validation(2000)
    before = loss(theta, *held_out)
    for step in range(60):
        x, y = problem.sample(batch, (1, step))
        theta -= default_lr(256, batch) * gradient(theta, x, y, out=grad)
    # from |a|^2 + 1 (about 257) to within a few noise variances
    assert before > 100
    assert loss(theta, *held_out) < 4.0


class FakeClient:
    """Rank ``rank`` of ``size``: an allreduce leaves the gradient as it is (as if every rank
    gave the same) and returns the rounds of ``rounds`` in turn (default 0, 1, 2, ...); it
    records every call (an allreduce's keyword arguments too)."""

    def __init__(self, rank: int, size: int, active: int, rounds=None) -> None:
        self.rank, self.size, self.active = rank, size, active
        self.calls: list[tuple[Any, ...]] = []
        self.options: list[dict[str, Any]] = []
        self.rounds = iter(rounds) if rounds is not None else itertools.count()

    def array(self, name, shape, dtype):
        return np.zeros(shape, dtype)

    def broadcast(self, array, root=0, *, timeout=None):
        self.calls.append(("broadcast", root))

    def barrier(self, *, name="barrier", timeout=None):
        self.calls.append(("barrier", name))

    def allreduce(self, array, op="sum", mode="sync", *, timeout=None, **options):
        self.calls.append(("allreduce", op, mode))
        self.options.append(options)
        return Result(round=next(self.rounds), included=True, active=self.active)

    def sync_model(self, array, *, timeout=None):
        self.calls.append(("sync_model",))


class FakeTime:
    """A clock that only sleeping moves: the rank's math takes no time at all."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


@pytest.mark.parametrize("mode", ["sync", "solo", "majority"])
def test_a_rank_trains_in_steps_and_rank_0_reports_each(mode):
    settings = Settings(
        nodes=2,
        ranks_per_node=2,
        dim=64,
        batch=256,
        train_points=1024,
        steps=12,
        sync_every=5,
        compute_ms=250,
        delay_ms=30,
        validation=500,
    )
    problem = Hyperplane(settings.dim, seed=settings.seed)
    straggles = [t for t in range(12) if problem.straggler(t, 4) == 0]
    assert straggles, "pick a seed where rank 0 straggles at least once"
    fab = FakeClient(rank=0, size=4, active=3)
    time = FakeTime()
    reports: list[tuple[int, float, float, int]] = []
    tally = train(fab, problem, settings, mode, reports.append, clock=time.clock, sleep=time.sleep)
    # every step sleeps its device time; the straggler's also its delay, after it
    expected = [0.25 if t not in straggles else (0.25, 0.03) for t in range(12)]
    assert time.slept == [x for e in expected for x in (e if isinstance(e, tuple) else (e,))]
    assert fab.calls[:2] == [("broadcast", 0), ("barrier", "barrier")]
    assert fab.calls[-1] == ("barrier", "end")
    assert fab.calls.count(("allreduce", "avg", mode)) == 12
    assert fab.options == [{"late": "sum"}] * 12  # the settings' late=, the default
    # after rounds 4, 9 and 11: every 5 rounds and after the last, partial modes only
    assert fab.calls.count(("sync_model",)) == (0 if mode == "sync" else 3)
    if mode != "sync":
        assert fab.calls[-3:-1] == [("allreduce", "avg", mode), ("sync_model",)]
    assert [r[0] for r in reports] == list(range(-1, 12))
    # stamped when each step's model existed: device time and delays, to the nanosecond
    stamps = [0.0]
    for t in range(12):
        stamps.append(stamps[-1] + 0.25 + (0.03 if t in straggles else 0.0))
    assert [r[1] for r in reports] == pytest.approx(stamps)
    assert reports[0][1:] == (0.0, reports[0][2], 4)  # before any step, every rank counts
    assert all(r[3] == 3 for r in reports[1:])
    assert reports[-1][2] < reports[0][2] / 4  # the validation loss came down
    assert tally.rank == 0
    assert tally.calls == 12
    assert tally.rounds == dict.fromkeys(range(12), 3)
    result = summarize(mode, settings, reports, [tally])
    assert result.steps == 12
    assert result.mean_active == 3
    assert result.initial_loss == reports[0][2]
    assert result.final_loss == reports[-1][2]
    assert result.seconds == reports[-1][1]
    assert result.rounds_per_s == pytest.approx(12 / result.seconds)
    assert result.gradients_per_s == pytest.approx(12 * 3 / 4 / result.seconds)
    assert result.history[0] == (0.0, reports[0][2])


def test_late_is_passed_to_every_allreduce():
    settings = Settings(nodes=1, ranks_per_node=2, dim=16, batch=8, steps=2, delay_ms=0)
    assert allreduce_options(settings, "solo") == {
        "op": "avg",
        "mode": "solo",
        "timeout": 120.0,
        "late": "sum",
    }
    latest = Settings(nodes=1, ranks_per_node=2, dim=16, batch=8, steps=2, late="latest")
    fab = FakeClient(rank=1, size=2, active=2)
    train(fab, Hyperplane(16), latest, "majority", None, sleep=lambda _: None)
    assert fab.options == [{"late": "latest"}] * 2


def test_one_rank_is_late_per_step_or_every_rank_by_a_shifting_share():
    problem = Hyperplane(8, seed=0)
    one = Settings(nodes=4, ranks_per_node=2, delay_ms=200)
    for step in range(20):
        delays = [injected_delay(one, problem, step, r) for r in range(8)]
        assert sorted(delays) == [0.0] * 7 + [0.2]
        assert delays.index(0.2) == problem.straggler(step, 8)
    assert injected_delay(replace(one, delay_ms=0), problem, 0, problem.straggler(0, 8)) == 0
    # eager-SGD §6.2.3: 50 to 400 ms over the 8 ranks, shifted by one rank each step
    severe = replace(one, imbalance="severe", delay_ms=400)
    first = [injected_delay(severe, problem, 0, r) for r in range(8)]
    assert first == pytest.approx([0.05 * (r + 1) for r in range(8)])
    second = [injected_delay(severe, problem, 1, r) for r in range(8)]
    assert second == pytest.approx(first[1:] + first[:1])


def test_a_rank_left_behind_stops_on_rounds_and_averages_as_often_as_the_others():
    """Calls that get a later round's result (the rank was behind) end the loop sooner; the
    number of model averages is one per ``sync_every`` rounds all the same."""
    settings = Settings(
        nodes=1, ranks_per_node=2, dim=16, batch=8, steps=10, sync_every=3, compute_ms=0
    )
    fab = FakeClient(rank=1, size=2, active=1, rounds=[0, 1, 5, 6, 7, 7, 11])
    train(fab, Hyperplane(16), settings, "majority", None, sleep=lambda _: None)
    kinds = [c[0] for c in fab.calls]
    assert kinds.count("allreduce") == 7  # the 7th call saw round 11 >= 9: the last
    # rounds 2, 5 and 8 end a sync_every, and 9 is the last: the jump from 1 to 5 averages
    # twice in a row, the jump to 11 twice too
    assert kinds.count("sync_model") == 4
    assert kinds[-4:] == ["allreduce", "sync_model", "sync_model", "barrier"]
    assert kinds[kinds.index("allreduce") + 2 : kinds.index("allreduce") + 5] == [
        "allreduce",
        "sync_model",
        "sync_model",
    ]


def test_a_rank_that_left_after_training_does_not_fail_the_end_barrier():
    """Whoever left the end barrier early was past training: the rank is done all the same.
    A failure in a training collective is not forgiven."""
    settings = Settings(
        nodes=1, ranks_per_node=2, dim=16, batch=8, steps=2, delay_ms=0, compute_ms=0
    )
    fab = FakeClient(rank=1, size=2, active=2)

    def barrier(*, name="barrier", timeout=None):
        if name == "end":
            raise PeerFailed("rank 0 left during barrier 'end'", rank=0)

    fab.barrier = barrier
    train(fab, Hyperplane(16), settings, "sync", None)

    def allreduce(array, op="sum", mode="sync", *, timeout=None, late="sum"):
        raise PeerFailed("rank 0 left during sync allreduce", rank=0)

    fab.allreduce = allreduce
    with pytest.raises(PeerFailed):
        train(fab, Hyperplane(16), settings, "sync", None)


def test_a_rank_other_than_0_reports_nothing_and_never_evaluates():
    settings = Settings(
        nodes=1, ranks_per_node=2, dim=16, batch=8, steps=3, delay_ms=0, compute_ms=0
    )
    fab = FakeClient(rank=1, size=2, active=2)
    tally = train(fab, Hyperplane(16), settings, "solo", None, sleep=pytest.fail)
    assert fab.calls.count(("allreduce", "avg", "solo")) == 3
    assert tally.rank == 1
    assert tally.rounds == {0: 2, 1: 2, 2: 2}


def test_the_time_to_target_is_the_first_report_at_or_below_it():
    settings = Settings(nodes=1, ranks_per_node=2, steps=3, noise=2.0, target=2.0)  # 8.0
    reports = [
        (-1, 0.0, 100.0, 2),
        (0, 1.0, 9.0, 2),
        (1, 2.0, 8.0, 1),
        (1, 2.5, 8.0, 1),
        (2, 3.0, 7.0, 2),
    ]
    result = summarize("solo", settings, reports)
    assert result.time_to_target == 2.0
    assert result.mean_active == pytest.approx(5 / 3)  # round 1 counts once
    assert result.rounds_per_s == pytest.approx(1.0)
    assert result.gradients_per_s == pytest.approx(5 / 2 / 3.0)
    # rank 1 got round 1 too (the same result) and round 2, which rank 0's view lacks
    others = Tally(rank=1, calls=3, rounds={1: 1, 2: 2})
    assert summarize("solo", settings, reports, [others]).gradients_per_s == pytest.approx(5 / 6)
    gap = [(-1, 0.0, 100.0, 2), (0, 1.0, 9.0, 2), (2, 3.0, 7.0, 2)]  # rank 0 skipped round 1
    alone = summarize("solo", settings, gap)
    assert alone.unseen_rounds == 1
    assert alone.skipped_results == 1.0  # rank 0's own view: it never got round 1
    assert alone.gradients_per_s == pytest.approx(4 / 2 / 3.0)
    told = summarize("solo", settings, gap, [others])
    assert told.unseen_rounds == 0
    assert told.skipped_results == pytest.approx(1.0)  # rank 1 never got round 0
    assert told.gradients_per_s == pytest.approx(5 / 2 / 3.0)
    never = summarize("solo", settings, [(s, t, 50.0, a) for s, t, _, a in reports])
    assert never.time_to_target is None
    with pytest.raises(DemoFailed, match="saw round 1, not 2"):
        summarize("solo", settings, reports[:4])


def test_modes_are_parsed_in_the_order_given():
    assert parse_modes("solo, sync") == ["solo", "sync"]
    for bad in ("", "sync,async", ","):
        with pytest.raises(DemoFailed, match="modes are some of sync, solo, majority"):
            parse_modes(bad)


def test_settings_refuse_what_cannot_run():
    with pytest.raises(DemoFailed, match="at least 2 ranks"):
        Settings(nodes=1, ranks_per_node=1)
    with pytest.raises(DemoFailed, match="one point per rank"):
        Settings(nodes=4, ranks_per_node=2, batch=4)
    assert Settings(nodes=3, ranks_per_node=2, batch=2048).local_batch == 341
    assert Settings(lr=0.01).step_size == 0.01
    assert Settings().step_size == default_lr(8192, 2048)
    with pytest.raises(DemoFailed, match="compute_ms >= 0"):
        Settings(compute_ms=-1)
    with pytest.raises(DemoFailed, match="an imbalance of one, severe"):
        Settings(imbalance="all")  # type: ignore[arg-type]
    with pytest.raises(DemoFailed, match="less than its batch of 256"):
        Settings(train_points=2000)
    assert Settings().shard_points == 4096  # the paper's 32,768 points over 8 ranks
    with pytest.raises(DemoFailed, match="majority_factor > 0"):
        Settings(majority_factor=0)


def test_partial_modes_run_more_rounds_than_sync():
    settings = Settings(steps=50, solo_factor=1.6, majority_factor=2.8)
    assert [settings.rounds(m) for m in ("sync", "solo", "majority")] == [50, 80, 140]
    assert Settings(steps=6).rounds("solo") == 10  # rounded up
    assert Settings(steps=6, solo_factor=0.5).rounds("solo") == 6  # never fewer than sync's
    run = settings.run_of("majority")
    assert run.steps == 140
    assert run.rounds("majority") == run.rounds("sync") == 140  # a run's settings are final
    assert settings.run_of("sync") == replace(settings, solo_factor=1.0, majority_factor=1.0)
