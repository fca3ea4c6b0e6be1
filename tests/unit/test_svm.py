"""The SVM demo's pure parts: its data, the SVM-SGD step, one rank's loop around an injected
reduce, and the lockstep simulation over ASAP's graphs (small sizes: a few seconds in all)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from fabricd.demo.svm import (
    History,
    Problem,
    Settings,
    accuracy,
    bytes_ratio,
    objective,
    sgd_steps,
    simulate,
    step_size,
    train,
)

#: 8 ranks of 500 examples in 200 dimensions: one rank alone reaches about 0.73, all of them
#: together about 0.87 within 600 rounds
SMALL = Settings(dim=200, examples=4_000, test=2_000, rounds=600, eval_every=25, target=0.85)


@functools.cache
def simulated(graph: str) -> History:
    return simulate(SMALL, graph)


def test_the_data_is_the_same_for_a_seed_and_differs_between_streams() -> None:
    one, two = Problem(50, seed=4), Problem(50, seed=4)
    assert np.array_equal(one.normal, two.normal)
    for a, b in zip(one.shard(3, 20), two.shard(3, 20), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(one.test_set(10)[1], two.test_set(10)[1])
    assert not np.array_equal(one.shard(3, 20)[0], one.shard(4, 20)[0])
    assert not np.array_equal(one.shard(0, 20)[0], one.test_set(20)[0])
    assert not np.array_equal(one.normal, Problem(50, seed=5).normal)


def test_labels_are_the_hyperplane_side_up_to_the_flips() -> None:
    problem = Problem(40, flip=0.1, seed=1)
    x, y = problem.test_set(20_000)
    assert x.dtype == y.dtype == np.float32
    assert set(np.unique(y)) == {-1.0, 1.0}
    assert np.mean(np.sum(x.astype(np.float64) ** 2, axis=1)) == pytest.approx(1.0, rel=0.02)
    # the hidden normal classifies all but the flipped labels
    assert accuracy(problem.normal, x, y) == pytest.approx(0.9, abs=0.01)
    clean_x, clean_y = Problem(40, flip=0.0, seed=1).test_set(1_000)
    assert accuracy(problem.normal, clean_x, clean_y) == 1.0


def test_an_sgd_step_is_the_hinge_loss_subgradient_step() -> None:
    eta0, lam = 0.5, 0.1
    w = np.array([1.0, 0.0], np.float32)
    x = np.array([[0.5, 2.0], [2.0, 0.0]], np.float32)
    y = np.array([1.0, 1.0], np.float32)
    sgd_steps(w, x, y, t=0, eta0=eta0, lam=lam)
    # step 0: margin 0.5 < 1: w <- w - eta (lam w - y x) with eta = 0.5
    first = np.array([1.0, 0.0]) - 0.5 * (0.1 * np.array([1.0, 0.0]) - np.array([0.5, 2.0]))
    # step 1: eta = 0.5 / (1 + 0.1 * 0.5), margin 2 * 1.2 >= 1: only the shrinking
    eta = 0.5 / 1.05
    assert step_size(1, eta0, lam) == pytest.approx(eta)
    assert first @ np.array([2.0, 0.0]) >= 1
    assert w == pytest.approx(first * (1 - eta * lam), rel=1e-6)
    # a correct label with a margin of 1 or more moves nothing but the regularisation
    v = np.array([3.0, 0.0], np.float32)
    sgd_steps(v, np.array([[1.0, 0.0]], np.float32), np.array([1.0], np.float32), 0, 1.0, 0.1)
    assert v == pytest.approx([2.7, 0.0])


def test_stacked_models_take_the_same_steps_as_single_ones() -> None:
    problem = Problem(30, seed=2)
    shards = [problem.shard(r, 40) for r in range(3)]
    models = np.zeros((3, 30), np.float32)
    x = np.stack([s[0] for s in shards], axis=1)
    y = np.stack([s[1] for s in shards], axis=1)
    sgd_steps(models, x, y, t=5, eta0=2.0, lam=1e-2)
    for r, (xr, yr) in enumerate(shards):
        alone = np.zeros(30, np.float32)
        sgd_steps(alone, xr, yr, t=5, eta0=2.0, lam=1e-2)
        assert models[r] == pytest.approx(alone, rel=1e-5, abs=1e-6)


def test_the_objective_is_the_regulariser_plus_the_mean_hinge() -> None:
    w = np.array([1.0, -1.0], np.float32)
    x = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    y = np.array([1.0, 1.0], np.float32)
    # margins 1 (no loss) and -1 (loss 2): mean 1, plus 0.1 / 2 * 2
    assert objective(w, x, y, lam=0.1) == pytest.approx(1.1)


def test_one_rank_trains_between_reduces_and_counts_what_it_sends() -> None:
    settings = Settings(dim=50, examples=800, test=500, rounds=40, eval_every=15, local_steps=3)
    model = np.full(50, np.nan, np.float32)
    seen: list[np.ndarray[Any, Any]] = []

    def reduce(w: np.ndarray[Any, Any]) -> int:
        assert w is model
        seen.append(w.copy())
        return 2

    ticks = iter(range(10_000))
    points: list[Any] = []
    history = train(
        1,
        settings,
        reduce,
        model=model,
        out_degree=3,
        in_degree=2,
        clock=lambda: float(next(ticks)),
        progress=points.append,
    )
    assert len(seen) == settings.rounds
    assert [p.round for p in history.points] == [0, 15, 30, 40]
    assert list(history.points) == points
    assert history.points[0].accuracy == 0.0  # the zero model: every score a tie
    assert history.points[-1].bytes_sent == 40 * 3 * settings.model_bytes
    assert history.inputs == 40 * 2
    # the fake clock ticks three times a round: 2 s per round, 1 of them in the reduce
    assert history.seconds == 80.0
    assert history.reduce_seconds == 40.0
    assert history.round_seconds == 2.0
    # with a reduce that changes nothing this is SVM-SGD on the shard alone
    alone = np.zeros(50, np.float32)
    x, y = Problem(50, settings.flip, settings.seed).shard(1, settings.shard)
    rows = np.arange(40 * 3) % len(y)
    sgd_steps(alone, x[rows], y[rows], 0, settings.eta0, settings.lam)
    assert model == pytest.approx(alone, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("graph", ["all-to-all", "expander"])
def test_all_to_all_and_the_expander_reach_the_target(graph: str) -> None:
    history = simulated(graph)
    reached = history.reached()
    assert reached is not None
    assert 0 < reached.round < SMALL.rounds
    # every rank's own model, not only the best
    assert all(h.first_reaching(SMALL.target) is not None for h in history.ranks)
    assert history.series()[-1].objective < history.series()[1].objective


def test_no_rank_alone_reaches_the_target() -> None:
    """What makes the averaging necessary: the target is beyond one shard's reach."""
    problem = Problem(SMALL.dim, SMALL.flip, SMALL.seed)
    x, y = problem.shard(0, SMALL.shard)
    x_test, y_test = problem.test_set(SMALL.test)
    w = np.zeros(SMALL.dim, np.float32)
    rows = np.arange(SMALL.rounds) % len(y)
    sgd_steps(w, x[rows], y[rows], 0, SMALL.eta0, SMALL.lam)
    assert accuracy(w, x_test, y_test) < SMALL.target - 0.05


def test_the_expander_needs_fewer_bytes_than_all_to_all() -> None:
    everyone, expander = simulated("all-to-all"), simulated("expander")
    reached_all, reached_expander = everyone.reached(), expander.reached()
    assert reached_all is not None
    assert reached_expander is not None
    assert reached_expander.bytes_sent < reached_all.bytes_sent
    per_round = SMALL.model_bytes
    assert reached_all.bytes_sent == reached_all.round * 7 * per_round
    assert reached_expander.bytes_sent == reached_expander.round * 2 * per_round
    ratio = bytes_ratio(everyone, expander)
    assert ratio == pytest.approx(reached_all.bytes_sent / reached_expander.bytes_sent)
    assert ratio is not None
    assert ratio > 1


def test_the_chain_is_slower_than_the_expander() -> None:
    expander, chain = simulated("expander"), simulated("chain")
    at = expander.reached()
    assert at is not None
    reached = chain.reached()
    assert reached is None or reached.round > at.round
    # when the expander's ranks are all at the target, some chain rank is well below it
    index = [p.round for p in chain.series()].index(at.round)
    assert chain.series()[index].accuracy < SMALL.target
    assert chain.spectral_gap < expander.spectral_gap
