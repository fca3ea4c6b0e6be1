"""The model of the demo: hyperplane regression as in eager-SGD §6.2.1, in numpy only.

Data: ``y = a . x + noise`` with ``x ~ N(0, I_dim)``, the coefficients ``a ~ N(0, 1)`` and
Gaussian noise of standard deviation ``noise``.  Model: one linear layer, ``dim`` weights and a
bias (8,193 parameters at the paper's 8,192 dimensions), trained on the mean squared error.

Every number comes from a seed all ranks share, so that no data ever travels: the coefficients
from ``(seed, 0)``, rank ``r``'s batch of step ``t`` from ``(seed, 1, t, r)``, the held-out set
from ``(seed, 2)``, and the rank that straggles at step ``t`` from ``(seed, 3, t)``.  Batches are
fresh draws from the distribution, never reused (the paper trains 48 epochs over 32,768 fixed
points; a stream needs no memory for a training set, and the demo runs far fewer steps than
an epoch would hold anyway).

Why the learning rate :func:`default_lr` picks: for ``x ~ N(0, I)`` the expected loss of
``theta = (w, b)`` is ``|w - a|^2 + b^2 + noise^2``, and a batch of ``B`` gradients has
variance that grows with ``dim / B``; the step ``lr = 1 / (2 (1 + (dim + 1) / B))`` minimises
the expected error after one step, shrinking it by a factor ``1 - 1 / (1 + (dim + 1) / B)``
(0.8 at the paper's sizes), and is half the largest step that still converges.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


class Hyperplane:
    """The regression problem: its coefficients, and the batches and held-out set drawn from it.

    Args:
        dim: the input dimension (the paper: 8,192).
        noise: the standard deviation of the label noise; the best model's loss is its square.
        seed: what every rank agrees on.
    """

    def __init__(self, dim: int, noise: float = 1.0, seed: int = 0) -> None:
        if dim < 1 or noise < 0:
            raise ValueError(f"need dim >= 1 and noise >= 0, not dim={dim}, noise={noise}")
        self.dim = dim
        self.noise = noise
        self.seed = seed
        #: the hyperplane the model is to learn
        self.coefficients = np.random.default_rng((seed, 0)).standard_normal(dim, np.float32)

    @property
    def parameters(self) -> int:
        """Weights and bias of the linear layer: the length of the model and gradient arrays."""
        return self.dim + 1

    def sample(self, count: int, key: tuple[int, ...]) -> tuple[Array, Array]:
        """``count`` points ``(x, y)`` drawn from the stream named ``key``."""
        rng = np.random.default_rng((self.seed, *key))
        x = rng.standard_normal((count, self.dim), np.float32)
        y = x @ self.coefficients + np.float32(self.noise) * rng.standard_normal(count, np.float32)
        return x, y

    def batch(self, step: int, rank: int, count: int) -> tuple[Array, Array]:
        """Rank ``rank``'s training batch of step ``step``."""
        return self.sample(count, (1, step, rank))

    def validation(self, count: int) -> tuple[Array, Array]:
        """The held-out set: drawn from a stream no batch comes from."""
        return self.sample(count, (2,))

    def straggler(self, step: int, size: int) -> int:
        """The rank that sleeps before its allreduce at step ``step`` (one of ``size``)."""
        return int(np.random.default_rng((self.seed, 3, step)).integers(size))


def predict(theta: Array, x: Array) -> Array:
    """The linear layer: ``x . w + b`` with ``theta = (w, b)``."""
    out: Array = x @ theta[:-1] + theta[-1]
    return out


def loss(theta: Array, x: Array, y: Array) -> float:
    """The mean squared error of ``theta`` on ``(x, y)`` (summed in float64)."""
    residual = (predict(theta, x) - y).astype(np.float64)
    return float(np.mean(residual * residual))


def gradient(theta: Array, x: Array, y: Array, out: Array) -> Array:
    """The gradient of :func:`loss` with respect to ``theta``, written into ``out`` (a
    ``fab.array``, so that the allreduce finds it in shared memory) and returned."""
    residual = predict(theta, x) - y
    scale = np.float32(2.0 / len(y))
    np.matmul(residual, x, out=out[:-1])
    out[:-1] *= scale
    out[-1] = scale * residual.sum(dtype=np.float32)
    return out


def default_lr(dim: int, batch: int) -> float:
    """The step size for ``dim`` inputs and a total batch of ``batch`` (module docstring)."""
    return 0.5 / (1.0 + (dim + 1) / batch)
