"""The training job of the Ako experiment (bench/ako.py): a one-hidden-layer network (tanh, then
softmax over 10 classes) on seeded synthetic data, its gradients and its accuracy.

Rules: numbers only (numpy); no time, no network.  Everything random comes from generators
seeded by (seed, rank) so that every strategy of a setting draws the same mini-batches for a
rank's k-th gradient (common random numbers: the strategies differ by their communication).

Theory of operation.  The issue asks for "a small non-convex model": 64 inputs (scikit-learn's
``load_digits`` is 8 x 8 pixels; it is not a dependency here, so the data are synthetic), 48
hidden units and 10 classes, 3,610 parameters.  The labels come from a fixed random *teacher*
network of the same shape, so the task is learnable but not linear: one worker with SGD at
rate 0.1 reaches about 77 % test accuracy in 500 steps and stays there (6,000 training rows);
the experiment times :data:`TARGET`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

INPUTS: Final = 64
HIDDEN: Final = 48
CLASSES: Final = 10
#: the model's parameters, flat: W1 (64 x 48), b1, W2 (48 x 10), b2
PARAMETERS: Final = INPUTS * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
TRAIN: Final = 6000
TEST: Final = 1000
#: rows of one rank's mini-batch
BATCH: Final = 32
#: the test accuracy the experiment times (a student reaches it within a few hundred steps)
TARGET: Final = 0.72

Vector = np.ndarray[Any, np.dtype[np.float64]]


@dataclass(frozen=True)
class Problem:
    """The data set (train and test) and the starting model every strategy shares."""

    x: Vector
    y: np.ndarray[Any, np.dtype[np.int64]]
    x_test: Vector
    y_test: np.ndarray[Any, np.dtype[np.int64]]
    w0: Vector


def _unpack(w: Vector) -> tuple[Vector, Vector, Vector, Vector]:
    a = INPUTS * HIDDEN
    b = a + HIDDEN
    c = b + HIDDEN * CLASSES
    return (
        w[:a].reshape(INPUTS, HIDDEN),
        w[a:b],
        w[b:c].reshape(HIDDEN, CLASSES),
        w[c:],
    )


def problem(seed: int) -> Problem:
    """The seeded data set: standard normal inputs, labels the teacher's argmax (its weights
    scaled so that every class is common); a small random start."""
    rng = np.random.default_rng(seed)
    w1, b1, w2, b2 = _unpack(np.empty(PARAMETERS))
    scales = [1 / np.sqrt(INPUTS)] * w1.size + [0.0] * b1.size
    scales += [4 / np.sqrt(HIDDEN)] * w2.size + [0.0] * b2.size
    teacher = rng.normal(0.0, 1.0, PARAMETERS) * np.array(scales)
    x = rng.normal(0.0, 1.0, (TRAIN + TEST, INPUTS))
    logits = _forward(teacher, x)[1]
    y = logits.argmax(axis=1)
    w0 = rng.normal(0.0, 0.1, PARAMETERS)
    return Problem(x=x[:TRAIN], y=y[:TRAIN], x_test=x[TRAIN:], y_test=y[TRAIN:], w0=w0)


def _forward(w: Vector, x: Vector) -> tuple[Vector, Vector]:
    w1, b1, w2, b2 = _unpack(w)
    hidden = np.tanh(x @ w1 + b1)
    return hidden, hidden @ w2 + b2


def gradient(w: Vector, problem: Problem, rows: np.ndarray[Any, Any]) -> Vector:
    """The mean cross-entropy gradient of the mini-batch ``rows`` at ``w`` (flat)."""
    x, y = problem.x[rows], problem.y[rows]
    _, _, w2, _ = _unpack(w)
    hidden, logits = _forward(w, x)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    g2 = hidden.T @ p
    gb2 = p.sum(axis=0)
    back = (p @ w2.T) * (1.0 - hidden**2)
    g1 = x.T @ back
    gb1 = back.sum(axis=0)
    return np.concatenate([g1.ravel(), gb1, g2.ravel(), gb2])


def accuracy(w: Vector, problem: Problem) -> float:
    """The share of the test set ``w`` classifies right."""
    return float((_forward(w, problem.x_test)[1].argmax(axis=1) == problem.y_test).mean())


class Batches:
    """Rank ``rank``'s mini-batches of ``problem``: its shard of the training set, drawn from a
    generator seeded by (seed, rank)."""

    def __init__(self, problem: Problem, rank: int, ranks: int, seed: int) -> None:
        self.rows = np.arange(rank, TRAIN, ranks)
        self.rng = np.random.default_rng([seed, rank])

    def next(self) -> np.ndarray[Any, Any]:
        return self.rng.choice(self.rows, BATCH, replace=False)
