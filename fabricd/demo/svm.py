"""A linear SVM trained with SGD and model averaging over a communication graph (ASAP §3, §6).

ASAP's SVM application (§6, Fig. 6/7/10) is Bottou's SVM-SGD on every rank: hinge loss and L2
regularisation, one example per step,

    w <- w - eta_t (lambda w - y x 1[y w.x < 1]),   eta_t = eta0 / (1 + lambda eta0 t),

``t`` counting the rank's steps, and after every ``local_steps`` steps a stochastic reduce:
each rank averages its model with its in-neighbours' of the same round (eq. A.2,
``w_i <- (w_i + sum_{j in N_in(i)} w_j) / (1 + |N_in(i)|)``).  numpy only; nothing here talks
to a fabric: :func:`train` is one rank's loop around an injected ``reduce(w) -> inputs`` (the
real call in :mod:`fabricd.demo.svm_fabric`), and :func:`simulate` runs every rank in lockstep
in this process, averaging with the graph's matrix ``P`` (:mod:`fabricd.engines.stochastic.graphs`).

Data: ``x ~ N(0, I_dim / dim)`` (norm about 1, as Bottou normalises RCV1's rows), dense
float32; the label is the side of a hidden hyperplane through the origin, ``y = sign(a . x)``
with ``a ~ N(0, I)`` (so the model needs no bias), flipped with probability ``flip``: the best
test accuracy is ``1 - flip``.  As in :mod:`fabricd.demo.hyperplane`, every number comes from
a seed all ranks share and no data travels: ``a`` from ``(seed, 0)``, rank ``r``'s shard of
``examples // ranks`` points from ``(seed, 1, r)`` (the training set is the ranks' shards
together), the held-out test set from ``(seed, 2)``.  A rank walks its shard in order, one
example per step, round after round (the draws are already in random order).

Why the defaults: at 2,000 dimensions one rank's 5,000 examples take a model to about 0.76
test accuracy, the 40,000 of all eight ranks to about 0.88 (5 % of the labels flipped, so
0.95 at best), so the target of 0.85 is out of reach of a rank that learns alone: only the
averaging gets there.  ``lambda = 1e-4`` (Bottou's for RCV1) and ``eta0 = 3``: from 1e-5 to
1e-3 and from 1 to 10 the rounds to the target barely move.

Accuracy is each rank's own model's on the test set, measured every ``eval_every`` rounds
(never counted as training time).  The job has reached the target once *every* rank's model
has (:meth:`History.reached`): a rank whose model lags, as the chain's far end does, holds it
back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.engines.stochastic import graphs

if TYPE_CHECKING:
    from collections.abc import Callable

Array = np.ndarray[Any, Any]

#: the model's element type (what a rank's fabric array holds)
DTYPE = "float32"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """One training job: the data, the SVM's hyper-parameters, the rounds, the target.

    ``nodes`` and ``ranks_per_node`` place the ranks on a local fabric
    (:mod:`fabricd.demo.svm_fabric`); :func:`simulate` needs only their product.
    """

    nodes: int = 4
    ranks_per_node: int = 2
    dim: int = 2_000
    examples: int = 40_000  #: in all; each rank's shard has ``examples // ranks``
    test: int = 4_000  #: points in the held-out set
    flip: float = 0.05  #: the probability that a label is flipped (label noise)
    lam: float = 1e-4  #: lambda, the L2 regularisation
    eta0: float = 3.0  #: the first step size
    local_steps: int = 1  #: SGD steps (examples) on each rank between two reduces
    rounds: int = 6_000  #: reduces per rank: every rank stops after this many
    eval_every: int = 100  #: rounds between two measurements of the test accuracy
    target: float = 0.85  #: the test accuracy every rank's model is to reach
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.ranks < 2:
            raise ValueError("need at least 2 ranks (nodes x ranks per node)")
        if self.dim < 1 or self.test < 1 or self.examples < self.ranks:
            raise ValueError("need dim >= 1, test >= 1 and one example per rank or more")
        if not 0 <= self.flip < 0.5 or self.lam <= 0 or self.eta0 <= 0:
            raise ValueError("need 0 <= flip < 0.5, lam > 0 and eta0 > 0")
        if self.local_steps < 1 or self.rounds < 1 or self.eval_every < 1:
            raise ValueError("need local_steps, rounds and eval_every >= 1")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shard(self) -> int:
        """Examples per rank (the remainder of ``examples / ranks`` is not drawn)."""
        return self.examples // self.ranks

    @property
    def model_bytes(self) -> int:
        """The bytes of one model, what a rank sends to each out-neighbour per round."""
        return self.dim * np.dtype(DTYPE).itemsize


class Problem:
    """The classification problem: its hidden hyperplane, and the shards and test set drawn
    from it (module docstring)."""

    def __init__(self, dim: int, flip: float = 0.05, seed: int = 0) -> None:
        if dim < 1 or not 0 <= flip < 0.5:
            raise ValueError(f"need dim >= 1 and 0 <= flip < 0.5, not dim={dim}, flip={flip}")
        self.dim = dim
        self.flip = flip
        self.seed = seed
        #: the normal of the hyperplane that separates the classes before the flips
        self.normal = np.random.default_rng((seed, 0)).standard_normal(dim, np.float32)

    def sample(self, count: int, key: tuple[int, ...]) -> tuple[Array, Array]:
        """``count`` points ``(x, y)`` from the stream named ``key``; ``y`` is +1 or -1."""
        rng = np.random.default_rng((self.seed, *key))
        x = rng.standard_normal((count, self.dim), np.float32)
        x *= np.float32(1 / np.sqrt(self.dim))
        y = np.where(x @ self.normal >= 0, np.float32(1), np.float32(-1))
        y[rng.random(count) < self.flip] *= -1
        return x, y

    def shard(self, rank: int, count: int) -> tuple[Array, Array]:
        """Rank ``rank``'s ``count`` training examples."""
        return self.sample(count, (1, rank))

    def test_set(self, count: int) -> tuple[Array, Array]:
        """The held-out set: drawn from a stream no shard comes from."""
        return self.sample(count, (2,))


def step_size(t: int, eta0: float, lam: float) -> float:
    """SVM-SGD's ``eta_t = eta0 / (1 + lambda eta0 t)`` for the rank's ``t``-th step."""
    return eta0 / (1.0 + lam * eta0 * t)


def sgd_steps(w: Array, x: Array, y: Array, t: int, eta0: float, lam: float) -> None:
    """One SVM-SGD step per row of ``x`` and ``y`` in turn, on ``w`` in place, the first being
    the rank's ``t``-th step.

    ``w`` is one model (``dim``) with ``x`` of shape ``(steps, dim)`` and ``y`` ``(steps,)``, or
    one model per rank (``ranks, dim``) with ``x`` ``(steps, ranks, dim)`` and ``y``
    ``(steps, ranks)``: every rank takes its own example of each step at the same ``eta_t``
    (what :func:`simulate` runs).  The margin is measured before the step's shrinking, as in
    the update rule (module docstring).
    """
    for j in range(len(y)):
        eta = step_size(t + j, eta0, lam)
        margins = y[j] * np.einsum("...d,...d->...", w, x[j])
        w *= np.float32(1.0 - eta * lam)
        gain = np.float32(eta) * y[j] * (margins < 1)
        w += np.asarray(gain, np.float32)[..., None] * x[j]


def accuracies(models: Array, x: Array, y: Array) -> Array:
    """The fraction of ``(x, y)`` each row of ``models`` classifies right (a tie is wrong)."""
    scores = x @ models.T
    right: Array = (scores * y[:, None] > 0).mean(axis=0)
    return right


def accuracy(w: Array, x: Array, y: Array) -> float:
    """The fraction of ``(x, y)`` the model ``w`` classifies right."""
    return float(accuracies(w[None, :], x, y)[0])


def objective(w: Array, x: Array, y: Array, lam: float) -> float:
    """The SVM's primal objective on ``(x, y)``: ``lambda/2 |w|^2 + mean hinge loss``."""
    w64 = w.astype(np.float64)
    hinge = np.maximum(0.0, 1.0 - y * (x @ w).astype(np.float64))
    return float(lam / 2 * (w64 @ w64) + hinge.mean())


@dataclass(frozen=True, slots=True)
class Point:
    """A measurement: after ``round`` reduces, ``bytes_sent`` bytes sent, ``seconds`` of
    training (steps and reduces; measurements not counted), a model with this test
    ``accuracy`` and this ``objective`` on the rank's shard."""

    round: int
    bytes_sent: float
    seconds: float
    accuracy: float
    objective: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RankHistory:
    """One rank's run: its measurements (the first before any step), from round 0 to the last.

    ``inputs``: in-neighbour updates its reduces averaged in, summed over the rounds (under
    notify-ack ``rounds x in-degree``); ``reduce_seconds``: the part of its training time
    spent in reduces.
    """

    rank: int
    out_degree: int
    in_degree: int
    points: tuple[Point, ...]
    inputs: int
    reduce_seconds: float

    @property
    def rounds(self) -> int:
        return self.points[-1].round

    @property
    def seconds(self) -> float:
        return self.points[-1].seconds

    @property
    def round_seconds(self) -> float:
        """Training seconds per round (a step and a reduce)."""
        return self.seconds / self.rounds

    def first_reaching(self, target: float) -> Point | None:
        """The first measurement at or above ``target``; ``None``: never."""
        return next((p for p in self.points if p.accuracy >= target), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """One run of the job over ``graph`` with ``sync`` (``"lockstep"``: :func:`simulate`)."""

    graph: str
    sync: str
    target: float
    spectral_gap: float
    ranks: tuple[RankHistory, ...]

    def series(self) -> list[Point]:
        """The job's measurements, one per measured round: bytes per rank (the mean over the
        ranks: the chain's last rank sends nothing), the slowest rank's seconds, the worst
        rank's accuracy, the mean objective.

        Every rank measures at the same rounds, so the i-th points of all ranks match.
        """
        out = []
        for points in zip(*(h.points for h in self.ranks), strict=True):
            out.append(
                Point(
                    round=points[0].round,
                    bytes_sent=sum(p.bytes_sent for p in points) / len(points),
                    seconds=max(p.seconds for p in points),
                    accuracy=min(p.accuracy for p in points),
                    objective=sum(p.objective for p in points) / len(points),
                )
            )
        return out

    def reached(self) -> Point | None:
        """The first of :meth:`series` at which every rank's model had reached the target."""
        return next((p for p in self.series() if p.accuracy >= self.target), None)

    @property
    def round_seconds(self) -> float:
        """Training seconds per round, the mean over the ranks."""
        return sum(h.round_seconds for h in self.ranks) / len(self.ranks)

    @property
    def final_accuracy(self) -> float:
        """The worst rank's test accuracy after the last round."""
        return self.series()[-1].accuracy


def train(
    rank: int,
    settings: Settings,
    reduce: Callable[[Array], int],
    *,
    model: Array,
    out_degree: int,
    in_degree: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[Point], None] | None = None,
) -> RankHistory:
    """One rank's job: ``settings.rounds`` times ``local_steps`` SVM-SGD steps on its shard and
    ``reduce(model)``, which averages ``model`` in place and returns how many in-neighbour
    updates it used.  ``model`` is where the model lives (a ``fab.array`` for the real call),
    zeroed first; ``out_degree`` counts the ``settings.model_bytes`` sent per round.

    A fixed number of rounds, not a stop at the target: under notify-ack a rank that stopped
    would hold its out-neighbours' next round forever.  The test accuracy (and the objective
    on the shard) is measured before the first round and every ``eval_every`` rounds and
    after the last, off the training clock; ``progress`` gets each measurement.
    """
    problem = Problem(settings.dim, settings.flip, settings.seed)
    x, y = problem.shard(rank, settings.shard)
    x_test, y_test = problem.test_set(settings.test)
    model[:] = 0
    k, sent, inputs, seconds, in_reduce = settings.local_steps, 0, 0, 0.0, 0.0

    def measure(done: int) -> Point:
        point = Point(
            round=done,
            bytes_sent=sent,
            seconds=seconds,
            accuracy=accuracy(model, x_test, y_test),
            objective=objective(model, x, y, settings.lam),
        )
        if progress is not None:
            progress(point)
        return point

    points = [measure(0)]
    for done in range(1, settings.rounds + 1):
        start = clock()
        t = (done - 1) * k
        rows = np.arange(t, t + k) % len(y)
        sgd_steps(model, x[rows], y[rows], t, settings.eta0, settings.lam)
        before = clock()
        inputs += reduce(model)
        end = clock()
        seconds += end - start
        in_reduce += end - before
        sent += out_degree * settings.model_bytes
        if done % settings.eval_every == 0 or done == settings.rounds:
            points.append(measure(done))
    return RankHistory(
        rank=rank,
        out_degree=out_degree,
        in_degree=in_degree,
        points=tuple(points),
        inputs=inputs,
        reduce_seconds=in_reduce,
    )


def simulate(
    settings: Settings,
    graph_kind: str,
    clock: Callable[[], float] = time.perf_counter,
) -> History:
    """Every rank of the job in lockstep in this process, averaged with ``P`` of the graph
    ``graph_kind`` over ``settings.ranks`` (:func:`fabricd.engines.stochastic.graphs.build`): what
    :func:`train` does on every rank with a notify-ack reduce, which averages every
    in-neighbour's update of the round.

    A rank's ``seconds`` are this process's time for all ranks' steps and averages (no
    network): compare them only with another simulation's.
    """
    graph = graphs.build(graph_kind, settings.ranks)
    mixing = graph.averaging_matrix().astype(np.float32)
    problem = Problem(settings.dim, settings.flip, settings.seed)
    shards = [problem.shard(r, settings.shard) for r in range(settings.ranks)]
    x = np.stack([s[0] for s in shards], axis=1)  # (examples, ranks, dim)
    y = np.stack([s[1] for s in shards], axis=1)
    x_test, y_test = problem.test_set(settings.test)
    models = np.zeros((settings.ranks, settings.dim), np.float32)
    sent = np.array(graph.bytes_per_round(settings.model_bytes), np.float64)
    k, seconds = settings.local_steps, 0.0
    series: list[list[Point]] = [[] for _ in range(settings.ranks)]

    def measure(done: int) -> None:
        right = accuracies(models, x_test, y_test)
        for r, points in enumerate(series):
            value = objective(models[r], x[:, r], y[:, r], settings.lam)
            points.append(Point(done, float(sent[r] * done), seconds, float(right[r]), value))

    measure(0)
    for done in range(1, settings.rounds + 1):
        start = clock()
        t = (done - 1) * k
        rows = np.arange(t, t + k) % settings.shard
        sgd_steps(models, x[rows], y[rows], t, settings.eta0, settings.lam)
        models[:] = mixing @ models
        seconds += clock() - start
        if done % settings.eval_every == 0 or done == settings.rounds:
            measure(done)
    return History(
        graph=graph_kind,
        sync="lockstep",
        target=settings.target,
        spectral_gap=graph.spectral_gap,
        ranks=tuple(
            RankHistory(
                rank=r,
                out_degree=graph.out_degrees[r],
                in_degree=graph.in_degrees[r],
                points=tuple(points),
                inputs=settings.rounds * graph.in_degrees[r],
                reduce_seconds=0.0,
            )
            for r, points in enumerate(series)
        ),
    )


def bytes_ratio(baseline: History, other: History) -> float | None:
    """``baseline``'s bytes per rank to the target over ``other``'s (how many times fewer bytes
    ``other`` sent); ``None`` if either never reached it."""
    one, two = baseline.reached(), other.reached()
    if one is None or two is None or two.bytes_sent == 0:
        return None
    return one.bytes_sent / two.bytes_sent
