"""Logistic regression on sparse click-through-like data: TDF's LR (§IV) for the parameter
server (issue 12, item 7).  numpy only; nothing here talks to a fabric.

Data (:func:`make_dataset`): ``samples`` rows over ``features`` binary features, drawn from one
seed.  Each row draws ``nnz_min .. nnz_max`` features (uniform; one drawn twice counts once), each
with probability proportional to ``(rank + 1) ** -alpha`` (a Zipf law, as the categorical
fields of click logs: a few features in most rows, most features in a handful), the ranks
shuffled over the feature ids so that frequent features are scattered through the model.  A
row's values are ``1 / sqrt(nnz)`` (unit norm).  The label comes from a hidden model ``w*``
with ``N(0, scale^2)`` weights: ``y = 1`` with probability ``sigmoid(x . w*)``, so even ``w*``
misclassifies some rows, and the weights of rare features can hardly be learnt.  Rows are
stored CSR-like (:class:`Rows`: ``indptr``, ``indices``, ``values``, ``labels``); the last
``test`` rows are the test set, the others the training set, which :meth:`Rows.shard` splits
into contiguous shards, one per worker.

Model: ``p(y = 1 | x) = sigmoid(x . w)``, no bias (the hidden model has none), trained by
minibatch SGD on the parameter server: a worker pulls ``w``, computes the mean logistic-loss
gradient of its next ``batch`` rows (:func:`gradient`, sparse: it touches only the batch's
features, at most ``batch * nnz_max`` of them) and pushes it; the server's ``sgd`` rule steps
``w -= lr * g`` (under BSP with the sum of the workers' gradients).  Why sparse data matters:
a dense float32 push and a dense pull of the model move ``4 * features`` bytes each, while an
iteration changes a few percent of the parameters, which is what TDF's filters and timed
storage exploit.

:func:`train_worker` is one worker's loop against any object with the parameter-server
client's ``push(update)`` and ``pull(out=w) -> version`` (:class:`ParameterServer`), so the
same loop runs against a daemon or against the in-process server of
:mod:`fabricd.demo.logreg_inproc`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

Array = np.ndarray[Any, Any]

#: the model's and the gradient's element type
DTYPE: Final = "float32"


class ParameterServer(Protocol):
    """The worker side of ``fab.parameter_server(..., role="worker")`` that training needs."""

    def push(self, update: Array) -> None: ...

    def pull(self, *, out: Array) -> int: ...


@dataclass(frozen=True, slots=True)
class Rows:
    """Sparse rows, CSR-like: row ``i``'s features are ``indices[indptr[i]:indptr[i + 1]]``
    (ascending, distinct) with ``values`` at the same places; ``labels`` are 0 or 1."""

    indptr: Array  #: int64, ``len(labels) + 1``
    indices: Array  #: int32 feature ids
    values: Array  #: float32
    labels: Array  #: float32, 0 or 1
    features: int

    def __len__(self) -> int:
        return int(self.labels.size)

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def take(self, start: int, stop: int) -> Rows:
        """Rows ``start .. stop - 1`` (views of this one's arrays but ``indptr``)."""
        lo, hi = int(self.indptr[start]), int(self.indptr[stop])
        return Rows(
            indptr=self.indptr[start : stop + 1] - lo,
            indices=self.indices[lo:hi],
            values=self.values[lo:hi],
            labels=self.labels[start:stop],
            features=self.features,
        )

    def shard(self, worker: int, workers: int) -> Rows:
        """Worker ``worker``'s contiguous share of ``workers`` (the first ones get the
        remainder's extra rows)."""
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        bounds = np.linspace(0, len(self), workers + 1).astype(int)
        return self.take(int(bounds[worker]), int(bounds[worker + 1]))

    def scores(self, w: Array) -> Array:
        """``x . w`` of every row, float64."""
        products = self.values.astype(np.float64) * w[self.indices]
        out = np.zeros(len(self), np.float64)
        filled = np.diff(self.indptr) > 0
        out[filled] = np.add.reduceat(products, self.indptr[:-1][filled])
        return out

    def dense(self) -> Array:
        """The rows as a dense float32 matrix (for small checks only)."""
        out = np.zeros((len(self), self.features), np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        out[rows, self.indices] = self.values
        return out


@dataclass(frozen=True, slots=True)
class Dataset:
    """A training set and a test set drawn together (:func:`make_dataset`), and the hidden
    model that labelled them."""

    train: Rows
    test: Rows
    hidden: Array

    @property
    def features(self) -> int:
        return self.train.features


def make_dataset(
    *,
    features: int = 200_000,
    samples: int = 60_000,
    test: int = 10_000,
    nnz_min: int = 20,
    nnz_max: int = 50,
    alpha: float = 1.0,
    scale: float = 4.0,
    seed: int = 0,
) -> Dataset:
    """``samples`` rows, the last ``test`` of them the test set (module docstring).

    Raises:
        ValueError: ``features`` < ``nnz_max``, ``nnz_min`` < 1, ``test`` outside
            ``1 .. samples - 1``, or ``alpha`` or ``scale`` negative.
    """
    if not 1 <= nnz_min <= nnz_max <= features:
        raise ValueError(f"need 1 <= nnz_min <= nnz_max <= features, not {nnz_min, nnz_max}")
    if not 0 < test < samples or alpha < 0 or scale < 0:
        raise ValueError("need 0 < test < samples, alpha >= 0 and scale >= 0")
    rng = np.random.default_rng(seed)
    order = rng.permutation(features)  # rank -> feature id
    weights = np.arange(1, features + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights / weights.sum())
    hidden = (rng.standard_normal(features) * scale).astype(np.float32)
    # ``want`` draws per row; a feature drawn twice in a row counts once
    want = rng.integers(nnz_min, nnz_max + 1, samples)
    drawn = np.minimum(np.searchsorted(cdf, rng.random(int(want.sum()))), features - 1)
    owner = np.repeat(np.arange(samples, dtype=np.int64), want)
    rows, cols = np.divmod(np.unique(owner * features + order[drawn]), features)
    counts = np.bincount(rows, minlength=samples)
    indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    values = (1.0 / np.sqrt(counts[rows])).astype(np.float32)
    everything = Rows(
        indptr=indptr,
        indices=cols.astype(np.int32),
        values=values,
        labels=np.zeros(samples, np.float32),
        features=features,
    )
    p = _sigmoid(everything.scores(hidden))
    labels = (rng.random(samples) < p).astype(np.float32)
    everything = Rows(indptr, everything.indices, values, labels, features)
    cut = samples - test
    return Dataset(train=everything.take(0, cut), test=everything.take(cut, samples), hidden=hidden)


def _sigmoid(z: Array) -> Array:
    out: Array = 0.5 * (1.0 + np.tanh(0.5 * z))
    return out


def gradient(w: Array, rows: Rows, out: Array | None = None) -> Array:
    """The mean logistic-loss gradient over ``rows`` at ``w``,
    ``(1 / m) sum_i (sigmoid(x_i . w) - y_i) x_i``, as a dense float32 array of the model's
    size (into ``out`` if given), nonzero only at the rows' features."""
    residual = (_sigmoid(rows.scores(w)) - rows.labels) / max(len(rows), 1)
    weights = rows.values * np.repeat(residual, np.diff(rows.indptr))
    dense = np.bincount(rows.indices, weights=weights, minlength=rows.features)
    if out is None:
        return dense.astype(np.float32)
    np.copyto(out, dense, casting="same_kind")
    return out


def accuracy(w: Array, rows: Rows) -> float:
    """The share of ``rows`` that ``w`` labels right (``x . w > 0`` says 1)."""
    return float(np.mean((rows.scores(w) > 0) == (rows.labels > 0)))


def log_loss(w: Array, rows: Rows) -> float:
    """The mean logistic loss of ``w`` on ``rows`` (natural log)."""
    z = rows.scores(w)
    y = rows.labels.astype(np.float64)
    # log(1 + e^z) - y z, stable for either sign of z
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


class Worker:
    """One worker's state between iterations: its shard, its cached model, where its next
    minibatch starts.  :meth:`step` is one iteration; :func:`train_worker` repeats it."""

    def __init__(self, shard: Rows, *, batch: int) -> None:
        if batch < 1 or len(shard) < batch:
            raise ValueError(f"a batch of 1 to {len(shard)} rows, not {batch}")
        self.shard = shard
        self.batch = batch
        self.w = np.zeros(shard.features, DTYPE)
        self._grad = np.zeros(shard.features, DTYPE)
        self.iterations = 0
        self.version = 0
        self._next = 0

    def step(self, ps: ParameterServer) -> None:
        """One iteration: :meth:`pull`, then :meth:`push`."""
        self.pull(ps)
        self.push(ps)

    def pull(self, ps: ParameterServer) -> None:
        """Pull the model into the worker's copy."""
        self.version = ps.pull(out=self.w)

    def push(self, ps: ParameterServer) -> None:
        """Push the gradient of the next minibatch at the pulled model (the shard walked in
        order, wrapping round)."""
        start = self._next
        stop = start + self.batch
        if stop > len(self.shard):
            start, stop = 0, self.batch
        self._next = stop
        gradient(self.w, self.shard.take(start, stop), out=self._grad)
        ps.push(self._grad)
        self.iterations += 1


def train_worker(
    ps: ParameterServer,
    shard: Rows,
    *,
    iterations: int,
    batch: int,
    progress: Callable[[Worker], None] | None = None,
) -> Worker:
    """One worker's training: ``iterations`` times pull, gradient of ``batch`` rows of
    ``shard``, push (:meth:`Worker.step`); ``progress`` sees the worker after each.  Returns
    the worker, whose ``w`` is the model of its last pull (the server's model lacks at most
    that last iteration's pushes)."""
    if iterations < 1:
        raise ValueError(f"need 1 iteration or more, not {iterations}")
    worker = Worker(shard, batch=batch)
    for _ in range(iterations):
        worker.step(ps)
        if progress is not None:
            progress(worker)
    return worker


def epochs(iterations: int, batch: int, shard_rows: int) -> float:
    """How many passes over its shard ``iterations`` minibatches are."""
    return iterations * batch / shard_rows if shard_rows else math.inf
