"""The model of the demo: hyperplane regression as in eager-SGD §6.2.1, in numpy only.

Data: ``y = a . x + noise`` with the coefficients ``a ~ N(0, 1)``, Gaussian noise of standard
deviation ``noise``, and inputs ``x`` whose entries are independent signs, -1 or +1 with equal
odds (the paper does not say how it draws its inputs; signs have mean 0 and variance 1, so the
loss landscape is that of ``x ~ N(0, I)``, and they cost a bit each to draw where a normal
number costs some 30 ns: a rank's shard of the paper's size is drawn in 0.15 s instead of
1-4 s).  Model: one linear layer, ``dim`` weights and a bias (8,193 parameters at the paper's
8,192 dimensions), trained on the mean squared error.

Every number comes from a seed all ranks share, so that no data ever travels: the coefficients
from ``(seed, 0)``, rank ``r``'s shard of the training set from ``(seed, 4, r)``
(:class:`Shard`), the held-out set from ``(seed, 2)``, and the rank that straggles at step
``t`` from ``(seed, 3, t)``.

The training job draws each rank's shard of a fixed training set once, before its clock starts,
and cycles through it in epochs, as the paper trains 48 epochs over 32,768 fixed points (4,096
per rank at 8 ranks, 16 steps of 256 an epoch).  Drawing a fresh batch at every step would cost
more than the gradient (0.15 ms at the paper's sizes); a shard drawn once keeps each step's
real math well under a millisecond, so that the emulated device time (``Settings.compute_ms``
of :mod:`fabricd.demo.training`) and not the machine's cores sets how long a step takes.  A
shard of the paper's size is 128 MiB of float32 per rank.

Why the learning rate :func:`default_lr` picks: for inputs with ``E[x x^T] = I`` the expected
loss of ``theta = (w, b)`` is ``|w - a|^2 + b^2 + noise^2``, and a batch of ``B`` gradients has
variance that grows with ``dim / B``; for ``x ~ N(0, I)`` the step
``lr = 1 / (2 (1 + (dim + 1) / B))`` minimises the expected error after one step, shrinking it
by a factor ``1 - 1 / (1 + (dim + 1) / B)`` (0.8 at the paper's sizes), and is half the largest
step that still converges.  Signs have lighter tails (a fourth moment of 1, not 3): their
gradients vary a little less, and the same step converges with more room.
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
        x = signs(rng, count, self.dim)
        y = x @ self.coefficients + np.float32(self.noise) * rng.standard_normal(count, np.float32)
        return x, y

    def validation(self, count: int) -> tuple[Array, Array]:
        """The held-out set: drawn from a stream no batch comes from."""
        return self.sample(count, (2,))

    def straggler(self, step: int, size: int) -> int:
        """The rank that sleeps before its allreduce at step ``step`` (one of ``size``)."""
        return int(np.random.default_rng((self.seed, 3, step)).integers(size))


def signs(rng: np.random.Generator, rows: int, columns: int) -> Array:
    """A ``rows x columns`` float32 array of independent -1 and +1, one random bit each."""
    size = rows * columns
    bits = np.unpackbits(np.frombuffer(rng.bytes(-(-size // 8)), np.uint8), count=size)
    out = bits.reshape(rows, columns).astype(np.float32)
    out *= 2
    out -= 1
    return out


class Shard:
    """Rank ``rank``'s part of the training set, ``points`` drawn once; step ``t`` trains on
    batch ``t`` modulo the batches the shard holds (an epoch is a pass over the shard).

    Raises:
        ValueError: the shard holds less than one batch.
    """

    def __init__(self, problem: Hyperplane, rank: int, points: int, batch: int) -> None:
        if batch < 1 or points < batch:
            raise ValueError(f"a shard of {points} points holds no batch of {batch}")
        self.batches = points // batch  #: batches an epoch
        self.batch_size = batch
        self.x, self.y = problem.sample(self.batches * batch, (4, rank))

    def batch(self, step: int) -> tuple[Array, Array]:
        """The batch of step ``step`` (views into the shard: nothing is copied)."""
        start = step % self.batches * self.batch_size
        end = start + self.batch_size
        return self.x[start:end], self.y[start:end]


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
