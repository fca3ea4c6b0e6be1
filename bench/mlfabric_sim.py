"""The strategies of the MLfabric experiment (bench/mlfabric.py), simulated in virtual time:
RR-Sync and Tr-Sync (synchronous allreduce), Async (a plain parameter server) and MLfabric-A
(the same server with fabricd's scheduling engines deciding), with and without aggregation.

Rules: nothing here sleeps, opens a socket or reads a clock; time is a float that jumps from
event to event, every random draw is seeded, and every run stops at its target loss or at
:attr:`Setting.horizon` virtual seconds.  The decisions of MLfabric-A are the real engines':
:class:`fabricd.engines.ps.scheduler.ShardScheduler` batches READYs and orders them (Alg. 2),
:func:`fabricd.engines.scheduling.aggregation.aggregate` groups them (Alg. 3), and
:class:`fabricd.engines.ps.consistency.Coordinator` applies in arrival order and drops what
breaks the delay bound, with the ``sgd`` rule stepping the model; this module only moves the
bytes (:mod:`bench.mlfabric_net`) and computes the gradients (:mod:`bench.mlfabric_model`).

Theory of operation.  Host 0 is the server, worker ``w`` runs on host ``w + 1``.

* RR-Sync: every iteration waits for the slowest worker's computation, then a ring allreduce
  moves ``2 (n - 1) / n`` model sizes through every worker's links at the pace of the slowest
  link (re-read when the rates change), and every worker steps with the sum.
* Tr-Sync: the same, with a binary tree (rank 0 the root, children ``2i + 1``, ``2i + 2``):
  a reduce phase in which every edge sends a model size to its parent at once, then a
  broadcast phase from parent to child, on the fluid network.  Sending every edge at once
  stands for a chunk-pipelined tree whose pipeline never drains (it ignores the pipeline's
  fill time: a lower bound on the tree's time, favourable to Tr-Sync).
* Async: a worker computes on its model, pushes (the push shares the links with every other
  transfer), the server applies it on arrival (no delay bound), the worker pulls the model over
  the server's uplink and computes again.
* MLfabric-A: the worker's daemon sends READY instead of the push; every 100 ms the scheduler
  decides; a granted push starts at its planned start, a denied one is dropped at the worker,
  whose daemon then pulls.  The monitor's figures lag the true rates by ``lag`` (§7's
  t_lag).  With aggregation, Alg. 3 runs on the batch's plan: a grouped update goes to its
  aggregator at its planned start, the aggregator forwards the sum once every member arrived
  (not before the forward's planned start), and the server applies the members one version
  each, stepping the model once with their sum.  The aggregators are the worker hosts the
  batch's network knows (the batch's and the outstanding grants'), fastest downlink first.
  An aggregate holding a member that would break the delay bound is dropped whole: the server
  holds only the sum and cannot take one member out of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.mlfabric_model import COMPUTES, Problem, Vector, Workers
from bench.mlfabric_net import GBPS, NETWORKS, Fluid, Trace
from fabricd.engines.ps.consistency import SGD, Apply, Consistency, Coordinator, Drop
from fabricd.engines.ps.scheduler import Denied, Gather, Granted, ShardScheduler
from fabricd.engines.scheduling.aggregation import aggregate

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.engines.scheduling.ordering import Planned

SERVER = 0
STRATEGIES = ("RR-Sync", "Tr-Sync", "Async", "MLfabric-A", "MLfabric-A+agg")


@dataclass(frozen=True)
class Setting:
    """One run's parameters (bench/mlfabric.py says why each default is what it is)."""

    compute: str  #: C1, C2 or C3
    network: str  #: N1, N2 or N3
    workers: int
    seed: int
    target: float  #: the loss to reach
    lr: float
    tau_max: int
    base_compute: float = 1.0  #: seconds of an unslowed computation
    model_bytes: float = 1e6
    interval: float = 0.1  #: the scheduler's batching (§7: 100 ms)
    lag: float = 0.2  #: the monitor's lag (§7: t_lag)
    server_gbps: float = 10.0  #: the server's NIC, both ways, never varied
    horizon: float = 2000.0  #: virtual seconds a run may last at most

    @property
    def name(self) -> str:
        return f"{self.compute}-{self.network}"


@dataclass
class Outcome:
    """What one strategy did in one setting, up to its target loss (or the horizon)."""

    strategy: str
    reached: float  #: virtual seconds to the target loss, ``inf`` if not reached
    seconds: float  #: virtual seconds simulated
    iterations: float  #: synchronous iterations, or applied updates / workers
    applied: int = 0  #: gradients applied
    computed: int = 0  #: gradients computed
    dropped_scheduler: int = 0
    dropped_server: int = 0
    server_bytes: float = 0.0  #: bytes that reached the server
    delivered: int = 0  #: updates that reached the server (direct or inside an aggregate)
    delays: list[int] = field(default_factory=list)  #: of the applied updates
    log: list[tuple[int, int, Vector]] = field(default_factory=list, repr=False)
    final: Vector | None = field(default=None, repr=False)

    @property
    def per_iteration(self) -> float:
        return self.seconds / self.iterations if self.iterations else math.inf


def simulate(setting: Setting, problem: Problem, strategy: str) -> Outcome:
    """Run ``strategy`` (one of :data:`STRATEGIES`) in ``setting``."""
    hosts = list(range(setting.workers + 1))
    trace = Trace(
        hosts,
        NETWORKS[setting.network],
        seed=setting.seed,
        fixed={SERVER: setting.server_gbps * GBPS},
    )
    workers = Workers(
        setting.workers, setting.base_compute, COMPUTES[setting.compute], seed=setting.seed
    )
    if strategy in ("RR-Sync", "Tr-Sync"):
        return _Sync(setting, problem, trace, workers, ring=strategy == "RR-Sync").run()
    if strategy == "Async":
        return _Ps(setting, problem, trace, workers, scheduled=False, aggregation=False).run()
    aggregation = strategy == "MLfabric-A+agg"
    return _Ps(setting, problem, trace, workers, scheduled=True, aggregation=aggregation).run()


class _Sync:
    """RR-Sync and Tr-Sync (module docstring)."""

    def __init__(
        self, setting: Setting, problem: Problem, trace: Trace, workers: Workers, *, ring: bool
    ) -> None:
        self.s, self.problem, self.trace, self.workers = setting, problem, trace, workers
        self.ring = ring
        self.fluid = Fluid(trace)
        self.hosts = [w + 1 for w in range(setting.workers)]

    def allreduce(self, start: float) -> float:
        """When an allreduce that starts at ``start`` ends."""
        n, size = self.s.workers, self.s.model_bytes
        if self.ring:
            return self.trace.carry(self.hosts, 2 * (n - 1) / n * size, start)
        edges = [(self.hosts[c], self.hosts[(c - 1) // 2]) for c in range(1, n)]
        reduced = self._phase(edges, start)
        return self._phase([(parent, child) for child, parent in edges], reduced)

    def _phase(self, edges: list[tuple[int, int]], start: float) -> float:
        """Send a model size over every edge at once from ``start``; when the last arrives."""
        self.fluid.advance(start)
        left = [len(edges)]

        def done(_t: float) -> None:
            left[0] -= 1

        for src, dst in edges:
            self.fluid.start(src, dst, self.s.model_bytes, done)
        while left[0]:
            self.fluid.advance(self.fluid.next_time())
        return self.fluid.now

    def run(self) -> Outcome:
        s, problem = self.s, self.problem
        name = "RR-Sync" if self.ring else "Tr-Sync"
        model, rule = problem.start.copy(), SGD(lr=s.lr)
        out = Outcome(strategy=name, reached=math.inf, seconds=0.0, iterations=0)
        now, k = 0.0, 0
        while now < s.horizon:
            draws = [self.workers.draw(w, k) for w in range(s.workers)]
            total = sum(problem.gradient(model, rows) for _, rows in draws)
            now = self.allreduce(now + max(seconds for seconds, _ in draws))
            rule.apply(model, np.asarray(total))
            k += 1
            out.computed += s.workers
            out.applied += s.workers
            if problem.loss(model) <= s.target:
                out.reached = now
                break
        out.seconds, out.iterations, out.final = now, k, model
        out.delays = [0] * out.applied
        return out


@dataclass
class _Worker:
    host: int
    model: Vector
    base: int = 0  #: the version its model is
    k: int = 0  #: its next computation


@dataclass
class _Group:
    """An aggregate being gathered at ``aggregator``: (worker, iteration, base, gradient)."""

    aggregator: int
    members: list[tuple[int, int, int, Vector]]
    forward_start: float
    forward_size: float
    waiting: int


class _Ps:
    """Async and MLfabric-A (module docstring)."""

    def __init__(
        self,
        setting: Setting,
        problem: Problem,
        trace: Trace,
        workers: Workers,
        *,
        scheduled: bool,
        aggregation: bool,
    ) -> None:
        self.s, self.problem, self.trace, self.draws = setting, problem, trace, workers
        self.fluid = Fluid(trace)
        self.coordinator = Coordinator(
            workers=range(setting.workers),
            consistency=Consistency.ASYNC,
            delay_bound=setting.tau_max if scheduled else None,
        )
        self.scheduler = (
            ShardScheduler(server=SERVER, delay_bound=setting.tau_max, interval=setting.interval)
            if scheduled
            else None
        )
        self.aggregation = aggregation
        self.rule = SGD(lr=setting.lr)
        self.model = problem.start.copy()
        self.workers = [_Worker(w + 1, problem.start.copy()) for w in range(setting.workers)]
        self.pending: dict[tuple[int, int], tuple[int, Vector]] = {}  #: READY: base, gradient
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.armed: float | None = None
        name = ("MLfabric-A+agg" if aggregation else "MLfabric-A") if scheduled else "Async"
        self.out = Outcome(strategy=name, reached=math.inf, seconds=0.0, iterations=0)

    # -- the event loop ---------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self) -> Outcome:
        for w in range(self.s.workers):
            self._compute(w, 0.0)
        now = 0.0
        while self.out.reached == math.inf:
            t_event = self.events[0][0] if self.events else math.inf
            t_net = self.fluid.next_time()
            now = min(t_event, t_net)
            if now > self.s.horizon:
                now = self.s.horizon
                break
            if t_net <= t_event:
                self.fluid.advance(t_net)
            else:
                _, _, fn = heapq.heappop(self.events)
                self.fluid.advance(now)
                fn(now)
        out = self.out
        out.seconds = min(now, out.reached)
        out.iterations = out.applied / self.s.workers
        out.server_bytes = self.fluid.received.get(SERVER, 0.0)
        out.final = self.model
        return out

    # -- a worker ---------------------------------------------------------------------------
    def _compute(self, w: int, now: float) -> None:
        seconds, _ = self.draws.draw(w, self.workers[w].k)
        self.at(now + seconds, lambda t: self._computed(w, t))

    def _computed(self, w: int, now: float) -> None:
        worker = self.workers[w]
        _, rows = self.draws.draw(w, worker.k)
        k, worker.k = worker.k, worker.k + 1
        gradient = self.problem.gradient(worker.model, rows)
        self.out.computed += 1
        if self.scheduler is None:
            self.fluid.start(
                worker.host, SERVER, self.s.model_bytes,
                lambda t: self._arrived(w, k, worker.base, gradient, t),
            )  # fmt: skip
            return
        self.pending[(w, k)] = (worker.base, gradient)
        norm = float(np.linalg.norm(gradient))
        size = int(self.s.model_bytes)
        granted = self.scheduler.ready(w, k, worker.base, size, norm, worker.host, now)
        assert not granted  # only a READY sent again is granted at once
        self._arm()

    def _pull(self, w: int, now: float) -> None:
        """``w``'s daemon pulls: the server answers with the model as it is now."""
        worker = self.workers[w]
        [reply] = self.coordinator.pull(w, self.coordinator.clock(w), worker.base, now)
        assert reply.__class__.__name__ == "Reply", reply
        snapshot, version = self.model.copy(), self.coordinator.version

        def landed(t: float) -> None:
            worker.model, worker.base = snapshot, version
            self._compute(w, t)

        self.fluid.start(SERVER, worker.host, self.s.model_bytes, landed)

    # -- the server -------------------------------------------------------------------------
    def _arrived(self, w: int, k: int, base: int, gradient: Vector, now: float) -> None:
        """``w``'s push of ``k`` reached the server."""
        self.out.delivered += 1
        for action in self.coordinator.push(w, k, base, gradient, now):
            if isinstance(action, Apply):
                self._applied(action)
                self.rule.apply(self.model, action.combined())
            elif isinstance(action, Drop):
                self.out.dropped_server += 1
        self._settled([w], k_of={w: k}, now=now)

    def _applied(self, action: Apply) -> None:
        for update in action.updates:
            self.out.applied += 1
            self.out.delays.append(update.delay)
            self.out.log.append((update.worker, update.iteration, update.values))

    def _settled(self, ws: list[int], *, k_of: dict[int, int], now: float) -> None:
        """The server processed these workers' pushes: check the loss, they pull."""
        if self.scheduler is not None:
            for w in ws:
                self.scheduler.settled(w, k_of[w])
        if self.out.reached == math.inf and self.problem.loss(self.model) <= self.s.target:
            self.out.reached = now
            return
        for w in ws:
            self._pull(w, now)

    # -- MLfabric-A's scheduler -------------------------------------------------------------
    def _arm(self) -> None:
        assert self.scheduler is not None
        due = self.scheduler.next_deadline()
        if due is not None and due != self.armed:
            self.armed = due
            self.at(due, self._tick)

    def _figures(self, host: int) -> tuple[float, float]:
        """The monitor's (up, down) for ``host``: the true rates ``lag`` seconds ago."""
        then = self.fluid.now - self.s.lag
        return self.trace.rate(host, then, up=True), self.trace.rate(host, then, up=False)

    def _tick(self, now: float) -> None:
        assert self.scheduler is not None
        self.armed = None
        decided = self.scheduler.on_timer(now, self.coordinator.version, self._figures)
        routes, starts = self._routes() if self.aggregation and decided else ({}, {})
        for action in decided:
            if isinstance(action, Gather):
                continue  # (this simulation runs Alg. 3 itself on last_plan)
            key = (action.worker, action.iteration)
            if isinstance(action, Denied):
                self._denied(action, now)
            elif isinstance(action, Granted) and key not in routes:
                start = max(now, starts.get(key, now + action.wait))
                self._send_direct(action.worker, action.iteration, start)
        self._start_groups(routes, now)
        self._arm()

    def _denied(self, action: Denied, now: float) -> None:
        base, _ = self.pending.pop((action.worker, action.iteration))
        self.coordinator.skip(action.worker, action.iteration, base, action.reason)
        self.out.dropped_scheduler += 1
        self._pull(action.worker, now)

    def _send_direct(self, w: int, k: int, start: float) -> None:
        base, gradient = self.pending.pop((w, k))
        host = self.workers[w].host

        def go(_t: float) -> None:
            self.fluid.start(
                host, SERVER, self.s.model_bytes,
                lambda t: self._arrived(w, k, base, gradient, t),
            )  # fmt: skip

        self.at(start, go)

    # -- aggregation --------------------------------------------------------------------------
    def _routes(
        self,
    ) -> tuple[dict[tuple[int, int], tuple[_Group, float]], dict[tuple[int, int], float]]:
        """Alg. 3 on the batch just decided: each grouped update's group and planned start,
        and each direct update's planned start (Alg. 3 books them again)."""
        assert self.scheduler is not None
        plan = self.scheduler.last_plan
        assert plan is not None
        known = set(plan.network.hosts) - {SERVER}
        aggregators = sorted(known, key=lambda h: (-self._figures(h)[1], h))
        planned: list[Planned] = plan.ordering.planned
        if not planned or not aggregators:
            return {}, {}
        result = aggregate(planned, plan.network, server=SERVER, aggregators=aggregators)
        routes: dict[tuple[int, int], tuple[_Group, float]] = {}
        direct: dict[Any, float] = {p.update.key: p.transfer.start for p in result.direct}
        for group in result.groups:
            members = sorted(group.members, key=lambda p: p.position)
            entry = _Group(
                aggregator=group.aggregator,
                members=[],
                forward_start=group.forward.start,
                forward_size=group.forward.size,
                waiting=len(members),
            )
            for p in members:
                key: Any = p.update.key
                routes[key] = (entry, p.transfer.start)
        return routes, direct

    def _start_groups(
        self, routes: dict[tuple[int, int], tuple[_Group, float]], now: float
    ) -> None:
        for (w, k), (group, start) in sorted(routes.items(), key=lambda r: r[1][1]):
            base, gradient = self.pending.pop((w, k))
            group.members.append((w, k, base, gradient))
            host = self.workers[w].host

            def go(_t: float, host: int = host, group: _Group = group) -> None:
                self.fluid.start(
                    host, group.aggregator, self.s.model_bytes,
                    lambda t: self._at_aggregator(group, t),
                )  # fmt: skip

            self.at(max(now, start), go)

    def _at_aggregator(self, group: _Group, now: float) -> None:
        group.waiting -= 1
        if group.waiting:
            return

        def forward(_t: float) -> None:
            self.fluid.start(
                group.aggregator, SERVER, group.forward_size,
                lambda t: self._aggregate_arrived(group, t),
            )  # fmt: skip

        self.at(max(now, group.forward_start), forward)

    def _aggregate_arrived(self, group: _Group, now: float) -> None:
        """The server applies an aggregate's members one version each, or drops it whole."""
        self.out.delivered += len(group.members)
        version, bound = self.coordinator.version, self.s.tau_max
        fits = all(version + i - base <= bound for i, (_, _, base, _) in enumerate(group.members))
        for w, k, base, gradient in group.members:
            if not fits:
                self.coordinator.skip(w, k, base, "dropped at the server: past the delay bound")
                self.out.dropped_server += 1
                continue
            [action] = self.coordinator.push(w, k, base, gradient, now)
            assert isinstance(action, Apply), action
            self._applied(action)
        if fits:
            total = np.sum([g for *_, g in group.members], axis=0)
            self.rule.apply(self.model, total)
        ws = [w for w, *_ in group.members]
        self._settled(ws, k_of={w: k for w, k, *_ in group.members}, now=now)
