"""The parameter server of issue 12 in one process, built from its engines, to measure what
TDF's filters save on :mod:`fabricd.demo.logreg` before (and beside) the daemon path.

Not a fake of the daemon: a measurement tool.  :class:`InProcessServer` wires the sans-IO
engines together the way the ``ps`` service does: per worker a
:class:`~fabricd.engines.ps.filters.GradientFilter` (its own seeded G-RP generator) and a
:class:`~fabricd.engines.ps.consistency.DelayGate`; on the server one
:class:`~fabricd.engines.ps.consistency.Coordinator` (BSP or SSP(s)), the ``sgd`` rule
(:class:`~fabricd.engines.ps.consistency.SGD`), a
:class:`~fabricd.engines.ps.filters.ParameterFilter` and a
:class:`~fabricd.engines.ps.storage.TimedStore`.  :meth:`InProcessServer.handle` gives each
worker an object with the client's ``push(update)`` and ``pull(out=w) -> version``, which keeps
the worker's cached model and brings it up to date with
:func:`~fabricd.engines.ps.storage.apply_delta` from the store's reply since its version.

Bytes, exactly as the engines report them: a push costs :attr:`Push.nbytes
<fabricd.engines.ps.filters.Push.nbytes>` (values, and indices when sparse), a pull the length
of :meth:`TimedStore.pull <fabricd.engines.ps.storage.TimedStore.pull>`'s reply (header
included).  Frame headers of the wire are not counted, with or without filters.  Under P-LNP
the store holds float16 (the published values are float16, so the replies carry 2 bytes a
value); the server keeps its model in float32 either way.

Each model update is one :class:`~fabricd.engines.ps.consistency.Apply`: the rule steps a copy
of :attr:`ParameterFilter.model <fabricd.engines.ps.filters.ParameterFilter.model>` by the
combined gradient, the filter decides what to publish (TDF's ``t`` is the applied iteration
plus 1), and the store publishes it.  At the end :meth:`InProcessServer.finish` flushes the
filter (lossless mode: every remaining difference is published; TDF mode: nothing) and returns
the published model, which is what the accuracy is measured on.

Determinism (:func:`simulate`): one thread, a fixed schedule.  Time goes in ticks; worker
``w`` pulls (:meth:`Worker.pull <fabricd.demo.logreg.Worker.pull>`) as soon as its pull would
be answered (:meth:`InProcessServer.ready`; a blocked pull waits for a later tick), computes
for ``periods[w]`` ticks, and pushes its gradient (:meth:`Worker.push
<fabricd.demo.logreg.Worker.push>`); within a tick the pushes due go first, then the pulls, in
worker order.  Different periods make the workers run at different speeds: under SSP the fast
ones run ahead, read models that lack the slow ones' last iterations, and the slow ones' pushes
land several versions after the model they were computed from (the coordinator's delay
histogram counts them); under BSP everyone waits for the slowest.  The same settings give the
same bytes and the same model, bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.demo import logreg
from fabricd.engines.ps import consistency as ps_consistency
from fabricd.engines.ps import filters as ps_filters
from fabricd.engines.ps import storage as ps_storage
from fabricd.engines.ps.consistency import Apply, Consistency, Coordinator, Reply
from fabricd.engines.ps.delay_gate import DelayGate
from fabricd.engines.ps.filters import FilterSettings, GradientFilter, ParameterFilter

if TYPE_CHECKING:
    from fabricd.demo.logreg import Dataset

Array = np.ndarray[Any, Any]

#: ticks each of the four workers computes a gradient (under SSP the two slow ones fall behind
#: and the fast ones read stale models)
PERIODS: Final = (1, 1, 2, 3)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerCounters:
    """One worker's traffic: pushes and pulls, their bytes, and what an unfiltered push of
    only its gradient's nonzero elements (uint32 index and float32 value each, or dense when
    smaller) would have cost."""

    pushes: int
    push_bytes: int
    nonzero_push_bytes: int
    pulls: int
    pull_bytes: int


class _Handle:
    """A worker's ``push``/``pull`` against the in-process server, with its cached model."""

    def __init__(self, server: InProcessServer, worker: int, seed: int) -> None:
        self._server = server
        self.worker = worker
        self.filter = GradientFilter(
            server.settings,
            size=server.size,
            dtype=logreg.DTYPE,
            rng=np.random.default_rng((seed, worker)),
        )
        self.gate = DelayGate(delay_bound=None)
        self.cache = np.zeros(server.size, logreg.DTYPE)
        self.version = 0
        self.clock = 0  #: iterations pushed: the clock of the next pull
        self.pushes = self.push_bytes = self.nonzero_push_bytes = 0
        self.pulls = self.pull_bytes = 0

    def pull(self, *, out: Array) -> int:
        """The model, at most the consistency's staleness behind this worker, into ``out``."""
        server = self._server
        actions = server.coordinator.pull(self.worker, self.clock, self.version, 0.0)
        if len(actions) != 1 or not isinstance(actions[0], Reply):
            raise RuntimeError(f"worker {self.worker}'s pull was not answered: {actions}")
        reply = server.store.pull(self.version)
        self.version = ps_storage.apply_delta(reply, self.cache, self.version)
        self.gate.pulled(self.version)
        self.pulls += 1
        self.pull_bytes += len(reply)
        np.copyto(out, self.cache)
        return self.version

    def push(self, update: Array) -> None:
        """Push the gradient of this worker's next iteration through its filter."""
        server = self._server
        drop = self.gate.check(self.worker, self.clock)
        if drop is not None:
            raise RuntimeError(drop.message)  # no delay bound under BSP or SSP
        push = self.filter.push(update, self.clock + 1)
        self.pushes += 1
        self.push_bytes += push.nbytes
        nonzero = int(np.count_nonzero(update))
        self.nonzero_push_bytes += min(8 * nonzero, update.nbytes)
        values = push.dense().astype(logreg.DTYPE)
        actions = server.coordinator.push(self.worker, self.clock, self.version, values, 0.0)
        self.clock += 1
        for action in actions:
            if not isinstance(action, Apply):
                raise RuntimeError(f"unexpected action {action} (no pull is ever held)")
            server.apply(action)

    def counters(self) -> WorkerCounters:
        return WorkerCounters(
            pushes=self.pushes,
            push_bytes=self.push_bytes,
            nonzero_push_bytes=self.nonzero_push_bytes,
            pulls=self.pulls,
            pull_bytes=self.pull_bytes,
        )


class InProcessServer:
    """One model of ``size`` float32 parameters (zeros at first) served to ``workers``
    workers under ``consistency`` (``"bsp"`` or ``"ssp"`` with ``staleness``) with the ``sgd``
    rule and ``settings``' filters (module docstring)."""

    def __init__(
        self,
        *,
        size: int,
        workers: int,
        consistency: str,
        staleness: int = 0,
        lr: float,
        settings: FilterSettings,
        seed: int = 0,
    ) -> None:
        self.size = size
        self.settings = settings
        self.consistency = Consistency(consistency)
        if self.consistency is Consistency.ASYNC:
            raise ValueError("the in-process server drives bsp and ssp only")
        self.coordinator = Coordinator(
            workers=range(workers), consistency=self.consistency, staleness=staleness
        )
        self.rule = ps_consistency.SGD(lr=lr)
        initial = np.zeros(size, logreg.DTYPE)
        self.filter = ParameterFilter(settings, initial)
        self.store = ps_storage.TimedStore(
            initial.astype(ps_filters.LOW) if settings.plnp else initial
        )
        self.handles = [_Handle(self, w, seed) for w in range(workers)]

    def handle(self, worker: int) -> _Handle:
        """Worker ``worker``'s ``push``/``pull`` object."""
        return self.handles[worker]

    def ready(self, worker: int) -> bool:
        """Whether ``worker``'s next pull would be answered now (else the coordinator would
        hold it): at most ``staleness`` iterations are missing (BSP: none)."""
        clock = self.handles[worker].clock
        return self.coordinator.complete >= clock - self.coordinator.staleness

    def apply(self, action: Apply) -> None:
        """One model update: the rule's step, the parameter filter, the store's publish."""
        new = self.filter.model.copy()
        self.rule.apply(new, action.combined())
        published = self.filter.update(new, action.iteration + 1)
        self.store.publish(published.mask, published.values)

    def finish(self) -> Array:
        """Flush the parameter filter into the store and return the published model (a
        float32 copy)."""
        published = self.filter.flush()
        if published.values.size:
            self.store.publish(published.mask, published.values)
        return self.store.model.astype(logreg.DTYPE)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """One simulated training run (:func:`simulate`)."""

    consistency: str = "bsp"
    staleness: int = 0
    iterations: int = 400  #: per worker
    batch: int = 256  #: rows per worker per iteration
    lr: float = 8.0
    periods: tuple[int, ...] = PERIODS  #: one per worker (module docstring)
    filters: FilterSettings = field(default_factory=FilterSettings)
    seed: int = 0  #: of the G-RP generators

    @property
    def label(self) -> str:
        return self.consistency if self.consistency == "bsp" else f"ssp{self.staleness}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What a run moved and what it learnt."""

    settings: RunSettings
    workers: tuple[WorkerCounters, ...]
    push_bytes: int  #: every worker's, as Push.nbytes
    pull_bytes: int  #: every worker's, reply lengths
    nonzero_push_bytes: int  #: WorkerCounters.nonzero_push_bytes summed
    gradient: ps_filters.GradientStatistics  #: worker 0's filter
    parameter: ps_filters.ParameterStatistics
    store: ps_storage.StoreStatistics
    coordinator: ps_consistency.CoordinatorStatistics
    accuracy: float
    log_loss: float
    waits: int  #: ticks a worker's pull would have been held (SSP's bound, BSP's barrier)
    seconds: float  #: this process's wall-clock time for the run, evaluation excluded

    @property
    def mean_delay_bucket(self) -> float:
        """The mean delay histogram bucket of the applied updates (0: delay 0)."""
        counts = np.array(self.coordinator.delays, np.float64)
        return float((counts * np.arange(counts.size)).sum() / max(counts.sum(), 1.0))


def simulate(data: Dataset, settings: RunSettings) -> RunResult:
    """Train on ``data`` with ``len(settings.periods)`` workers on an in-process server, on
    the fixed schedule of the module docstring, and measure the test accuracy of the
    published model.

    Raises:
        RuntimeError: no worker could step for a whole round of the schedule (a bug).
    """
    workers = len(settings.periods)
    server = InProcessServer(
        size=data.features,
        workers=workers,
        consistency=settings.consistency,
        staleness=settings.staleness,
        lr=settings.lr,
        settings=settings.filters,
        seed=settings.seed,
    )
    trainers = [
        logreg.Worker(data.train.shard(w, workers), batch=settings.batch) for w in range(workers)
    ]
    start = time.perf_counter()
    computing: dict[int, int] = {}  #: worker -> the tick its gradient is done
    tick = idle = waits = 0
    while computing or any(t.iterations < settings.iterations for t in trainers):
        moved = False
        for w, trainer in enumerate(trainers):
            if computing.get(w, tick + 1) <= tick:
                del computing[w]
                trainer.push(server.handle(w))
                moved = True
        for w, trainer in enumerate(trainers):
            if w in computing or trainer.iterations >= settings.iterations:
                continue
            if not server.ready(w):
                waits += 1
                continue
            trainer.pull(server.handle(w))
            computing[w] = tick + settings.periods[w]
            moved = True
        idle = 0 if moved else idle + 1
        if idle > max(settings.periods):
            raise RuntimeError(f"no worker could move since tick {tick - idle}")
        tick += 1
    model = server.finish()
    seconds = time.perf_counter() - start
    counters = tuple(h.counters() for h in server.handles)
    return RunResult(
        settings=settings,
        workers=counters,
        push_bytes=sum(c.push_bytes for c in counters),
        pull_bytes=sum(c.pull_bytes for c in counters),
        nonzero_push_bytes=sum(c.nonzero_push_bytes for c in counters),
        gradient=server.handles[0].filter.statistics(),
        parameter=server.filter.statistics(),
        store=server.store.statistics(),
        coordinator=server.coordinator.statistics(),
        accuracy=logreg.accuracy(model, data.test),
        log_loss=logreg.log_loss(model, data.test),
        waits=waits,
        seconds=seconds,
    )
