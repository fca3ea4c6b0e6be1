"""The training job of the MLfabric experiment (bench/mlfabric.py): L2-regularised logistic
regression on seeded synthetic data, its gradients, its loss, and the workers' compute times
with MLfabric §7's stragglers.

Rules: numbers only (numpy); no time, no network.  Everything random comes from generators
seeded by (seed, worker) so that every strategy of a setting draws the same straggler slowdowns
and the same mini-batches for a worker's k-th computation, whatever order the simulation asks
in (common random numbers: the strategies differ by their communication only).

Theory of operation.  The model stands for a 1 MB one (ResNet-50's 100 MB ÷ 100) on the wire;
its arithmetic is a small convex problem (:data:`FEATURES` weights) so that a whole sweep runs
in seconds.  §7: "a single worker has an r% chance of being slowed down by a factor of s";
C1 = (10 %, 2x), C2 = (10 %, 4x), C3 = (4 %, 2x), drawn for each computation of each worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

#: §7's compute settings: (chance a computation is slowed, slowdown)
COMPUTES: Final = {"C1": (0.10, 2.0), "C2": (0.10, 4.0), "C3": (0.04, 2.0)}
#: the model's weights and the data set's rows
FEATURES: Final = 32
SAMPLES: Final = 8192
#: rows of one worker's mini-batch (§7.1: "a mini-batch size of 32 per worker")
BATCH: Final = 32
#: the L2 term, so that the optimum is unique
L2: Final = 1e-3
#: a computation's time is its base time times Uniform(1 - JITTER, 1 + JITTER) (times the
#: slowdown when slowed), so that asynchronous workers do not run in lockstep
JITTER: Final = 0.05

Vector = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class Problem:
    """The data set (``x``, labels ``y`` in {0, 1}), the optimum's loss and the start."""

    x: Vector
    y: Vector
    optimum: float
    start: Vector = field(repr=False)

    def loss(self, w: Vector) -> float:
        """The regularised log loss of ``w`` on the whole data set."""
        z = self.x @ w
        return float(np.mean(np.logaddexp(0.0, z) - self.y * z) + 0.5 * L2 * w @ w)

    def gradient(self, w: Vector, rows: np.ndarray[Any, Any]) -> Vector:
        """The loss's gradient at ``w`` on ``rows`` (a mini-batch)."""
        x, y = self.x[rows], self.y[rows]
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        out: Vector = x.T @ (p - y) / len(rows) + L2 * w
        return out


def problem(seed: int) -> Problem:
    """A seeded data set: Gaussian features with scales from 1 to 1/4 (some directions
    converge slower than others, as in real data), labels from a random true model with 10 %
    of them flipped."""
    rng = np.random.default_rng([seed, 0xDA7A])
    scales = np.geomspace(1.0, 0.25, FEATURES)
    x = rng.standard_normal((SAMPLES, FEATURES)) * scales
    truth = rng.standard_normal(FEATURES) * 3.0 / np.sqrt(FEATURES) / scales
    y = (rng.random(SAMPLES) < 1.0 / (1.0 + np.exp(-(x @ truth)))).astype(np.float64)
    flip = rng.random(SAMPLES) < 0.10
    y[flip] = 1.0 - y[flip]
    start = np.zeros(FEATURES)
    return Problem(x=x, y=y, optimum=_optimum(x, y), start=start)


def _optimum(x: Vector, y: Vector) -> float:
    """The least loss, by Newton's method (the problem is smooth and strongly convex)."""
    w = np.zeros(x.shape[1])
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) / len(y) + L2 * w
        hessian = (x.T * (p * (1 - p))) @ x / len(y) + L2 * np.eye(len(w))
        step = np.linalg.solve(hessian, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-12:
            break
    z = x @ w
    return float(np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * L2 * w @ w)


class Workers:
    """Each worker's compute time and mini-batch for its k-th computation (module docstring).

    Args:
        workers: how many.
        base: seconds of an unslowed computation.
        straggle: (chance, slowdown) of :data:`COMPUTES`.
        seed: the setting's seed.
    """

    def __init__(
        self, workers: int, base: float, straggle: tuple[float, float], *, seed: int
    ) -> None:
        self.base = base
        self.chance, self.slowdown = straggle
        self._rngs = [np.random.default_rng([seed, 0xC0DE, w]) for w in range(workers)]
        self._drawn: list[list[tuple[float, np.ndarray[Any, Any]]]] = [[] for _ in range(workers)]
        self.shards = np.array_split(np.arange(SAMPLES), workers)

    def draw(self, worker: int, k: int) -> tuple[float, np.ndarray[Any, Any]]:
        """(seconds, rows) of ``worker``'s ``k``-th computation."""
        drawn = self._drawn[worker]
        while len(drawn) <= k:
            rng = self._rngs[worker]
            slowed = rng.random() < self.chance
            seconds = self.base * rng.uniform(1 - JITTER, 1 + JITTER)
            rows = rng.choice(self.shards[worker], size=BATCH, replace=False)
            drawn.append((seconds * (self.slowdown if slowed else 1.0), rows))
        return drawn[k]
