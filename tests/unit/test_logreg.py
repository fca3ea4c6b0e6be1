"""The logistic-regression example of the parameter server (issue 12, item 7): its data, its
gradient against a dense computation, its training, and the in-process server's byte counts
against what the engines report."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from fabricd.demo import logreg
from fabricd.demo.logreg_inproc import RunSettings, simulate
from fabricd.engines.ps.filters import FilterSettings

SMALL = {"features": 500, "samples": 3_000, "test": 500, "nnz_min": 5, "nnz_max": 15}


@pytest.fixture(scope="module")
def small() -> logreg.Dataset:
    return logreg.make_dataset(**SMALL, seed=3)


def _arrays(rows: logreg.Rows) -> list[np.ndarray[Any, Any]]:
    return [rows.indptr, rows.indices, rows.values, rows.labels]


def test_the_data_is_the_same_for_a_seed_and_has_the_shape_asked() -> None:
    one = logreg.make_dataset(**SMALL, seed=7)
    two = logreg.make_dataset(**SMALL, seed=7)
    other = logreg.make_dataset(**SMALL, seed=8)
    for a, b in zip(
        _arrays(one.train) + _arrays(one.test), _arrays(two.train) + _arrays(two.test), strict=True
    ):
        assert a.dtype == b.dtype
        assert np.array_equal(a, b)
    assert not np.array_equal(one.train.indices, other.train.indices)
    assert (len(one.train), len(one.test), one.features) == (2_500, 500, 500)
    for rows in (one.train, one.test):
        counts = np.diff(rows.indptr)
        assert rows.indptr[0] == 0
        assert rows.indptr[-1] == rows.nnz
        assert counts.min() >= 1
        assert counts.max() <= SMALL["nnz_max"]
        assert rows.indices.min() >= 0
        assert rows.indices.max() < rows.features
        for i in range(len(rows)):  # ascending and distinct within a row
            assert np.all(np.diff(rows.indices[rows.indptr[i] : rows.indptr[i + 1]]) > 0)
        norms = np.add.reduceat(rows.values.astype(np.float64) ** 2, rows.indptr[:-1])
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
        assert set(np.unique(rows.labels)) <= {0.0, 1.0}


def test_feature_frequencies_follow_a_power_law() -> None:
    data = logreg.make_dataset(features=20_000, samples=5_000, test=1_000, seed=1)
    counts = np.sort(np.bincount(data.train.indices, minlength=data.features))[::-1]
    # the most frequent 1% of the features hold most occurrences; most features are rare
    assert counts[:200].sum() > 0.4 * counts.sum()
    assert np.count_nonzero(counts <= 5) > 0.5 * data.features


def test_the_gradient_equals_a_dense_computation(small: logreg.Dataset) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(small.features).astype(np.float32)
    rows = small.train.take(100, 164)
    x = rows.dense().astype(np.float64)
    p = 1 / (1 + np.exp(-(x @ w.astype(np.float64))))
    expected = x.T @ (p - rows.labels) / len(rows)
    got = logreg.gradient(w, rows)
    assert got.dtype == np.float32
    assert got.shape == (small.features,)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    out = np.full(small.features, 9.0, np.float32)
    assert logreg.gradient(w, rows, out=out) is out
    np.testing.assert_array_equal(out, got)
    z = x @ w
    loss = np.mean(np.log1p(np.exp(-np.abs(z))) + np.maximum(z, 0) - rows.labels * z)
    assert logreg.log_loss(w, rows) == pytest.approx(loss, rel=1e-9)
    assert logreg.accuracy(w, rows) == np.mean((z > 0) == (rows.labels > 0))


class LocalServer:
    """A single worker's parameter server in memory: ``w -= lr * g`` on each push."""

    def __init__(self, size: int, lr: float) -> None:
        self.w = np.zeros(size, np.float32)
        self.lr = lr
        self.version = 0

    def push(self, update: np.ndarray[Any, Any]) -> None:
        self.w -= np.float32(self.lr) * update
        self.version += 1

    def pull(self, *, out: np.ndarray[Any, Any]) -> int:
        np.copyto(out, self.w)
        return self.version


def test_training_without_filters_beats_chance(small: logreg.Dataset) -> None:
    server = LocalServer(small.features, lr=4.0)
    worker = logreg.train_worker(server, small.train, iterations=300, batch=50)
    assert worker.iterations == 300
    assert worker.version == 299
    majority = max(small.test.labels.mean(), 1 - small.test.labels.mean())
    before = logreg.log_loss(np.zeros(small.features, np.float32), small.test)
    assert logreg.accuracy(server.w, small.test) > majority + 0.05
    assert logreg.log_loss(server.w, small.test) < before - 0.05


RUN = RunSettings(iterations=12, batch=40, lr=4.0)
FILTERS = FilterSettings(
    gsmp_threshold=1e-3, grp_drop=0.9, glnp=True, psmp_threshold=1e-2, plnp=True
)


@pytest.mark.parametrize(("consistency", "staleness"), [("bsp", 0), ("ssp", 2)])
@pytest.mark.parametrize("filters", [FilterSettings(), FILTERS], ids=["off", "on"])
def test_in_process_byte_counts_are_the_engines(
    small: logreg.Dataset, consistency: str, staleness: int, filters: FilterSettings
) -> None:
    settings = replace(RUN, consistency=consistency, staleness=staleness, filters=filters)
    result = simulate(small, settings)
    one = result.workers[0]
    assert result.gradient.pushes == one.pushes == RUN.iterations
    assert result.gradient.pushed_bytes == one.push_bytes
    assert result.store.pulls == sum(w.pulls for w in result.workers) == 4 * RUN.iterations
    assert result.store.pulled_bytes == result.pull_bytes
    assert result.push_bytes == sum(w.push_bytes for w in result.workers)
    assert result.coordinator.applied == 4 * RUN.iterations
    if filters == FilterSettings():  # unfiltered: dense float32 pushes, every pull whole
        assert result.push_bytes == 4 * RUN.iterations * small.features * 4
        assert result.store.dense_pulls == result.store.pulls
    else:
        assert result.push_bytes < result.nonzero_push_bytes
    again = simulate(small, settings)
    assert (again.push_bytes, again.pull_bytes, again.accuracy) == (
        result.push_bytes,
        result.pull_bytes,
        result.accuracy,
    )


def test_ssp_runs_workers_apart_and_bsp_does_not(small: logreg.Dataset) -> None:
    bsp = simulate(small, RUN)
    ssp = simulate(small, replace(RUN, consistency="ssp", staleness=2))
    assert bsp.coordinator.delays[0] == bsp.coordinator.applied  # every update on its model
    assert sum(ssp.coordinator.delays[1:]) > 0  # slow workers' updates land late
    assert bsp.waits > 0
    assert ssp.waits > 0
