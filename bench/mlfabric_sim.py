"""The strategies of the MLfabric experiment (bench/mlfabric.py), simulated in virtual time:
RR-Sync and Tr-Sync (synchronous allreduce), MLfabric-S (fabricd's allreduce of that name),
Async (a plain parameter server) and MLfabric-A (the same server with fabricd's scheduling
engines deciding), with and without aggregation.

Rules: nothing here sleeps, opens a socket or reads a clock; time is a float that jumps from
event to event, every random draw is seeded, and every run stops at its target loss or at
:attr:`Setting.horizon` virtual seconds.  The decisions of MLfabric-A are the real engines':
:class:`fabricd.engines.ps.scheduler.ShardScheduler` batches READYs, orders them (Alg. 2) and,
with ``aggregation=True``, groups them (Alg. 3: its ``Granted.via``/``group`` and ``Gather``
decisions); :class:`fabricd.engines.ps.gathering.Gathering` is each aggregator daemon's side;
:class:`fabricd.engines.ps.consistency.Coordinator` applies pushes (``push``) and aggregates
(``push_aggregate``) in arrival order and drops what breaks the delay bound, and
:func:`~fabricd.engines.ps.consistency.step_model` steps the model by the rule, as the server
does.  This module only moves the bytes (:mod:`bench.mlfabric_net`), computes the gradients
(:mod:`bench.mlfabric_model`), and keeps the server's exactly-once-by-(worker, iteration) rule
(:meth:`fabricd.engines.ps.server.ShardServer.push_aggregate`).

Theory of operation.  Host 0 is the server, worker ``w`` runs on host ``w + 1``.

* RR-Sync: every iteration waits for the slowest worker's computation, then a ring allreduce
  moves ``2 (n - 1) / n`` model sizes through every worker's links at the pace of the slowest
  link (re-read when the rates change), and every worker steps with the sum.
* Tr-Sync: the same, with a binary tree (rank 0 the root, children ``2i + 1``, ``2i + 2``):
  a reduce phase in which every edge sends a model size to its parent at once, then a
  broadcast phase from parent to child, on the fluid network.  Sending every edge at once
  stands for a chunk-pipelined tree whose pipeline never drains (it ignores the pipeline's
  fill time: a lower bound on the tree's time, favourable to Tr-Sync).
* MLfabric-S (§6, fabricd's ``algorithm="mlfabric"`` allreduce): every iteration a root
  worker drawn at random; each other worker, once its computation ends, is ready (its READY
  takes no time here); the root's plan is fabricd's: every ``interval`` from the first READY
  (or at once when every worker is in) the batch, in ready order, goes through
  :func:`~fabricd.engines.scheduling.ordering.in_list_order` and Alg. 3
  (:func:`~fabricd.engines.scheduling.aggregation.aggregate`) on the monitor's lagged figures
  (a round's later batches on the timelines its earlier ones left, as the engine plans),
  every other worker's host an aggregator (rotated one a round), a one-member group sent
  straight; a group's sum (one model size) leaves its aggregator when its last member arrived.
  Once every contribution reached the root and its own computation ended, the root sends the
  model to every worker at once (a star) and the iteration ends when the last has it.  The
  vectors travel with the transfers: an aggregator sums its members in arrival order, the root
  sums what reaches it in arrival order and adds its own last, and the model steps with that
  sum, so its equality with RR-Sync's (the same n vectors summed in worker order) is checked,
  not assumed: bit for bit in exact mode, up to rounding under ``sgd``.  ``communication``
  (and ``reduced``, Tr-Sync too) is the time from the slowest computation's end to the
  iteration's end (to the root, or the tree's root, holding the sum).
* Async: a worker computes on its model, pushes (the push shares the links with every other
  transfer), the server applies it on arrival (no delay bound), the worker pulls the model over
  the server's uplink and computes again.
* MLfabric-A: the worker's daemon sends READY instead of the push; every 100 ms the scheduler
  decides; a granted push starts ``wait`` after the decision, a denied one is dropped at the
  worker, whose daemon then pulls.  The monitor's figures lag the true rates by ``lag`` (§7's
  t_lag).  With aggregation, a push granted ``via`` an aggregator goes to that host (no link
  if it is the worker's own) as a member of its group; the aggregator's ``Gathering`` takes
  the scheduler's ``Gather``, sums the members as they come and forwards the sum (one model
  size) to the server as soon as all came, or at the group's planned forward start plus its
  grace with the members that came.  The server takes an aggregate whole through
  ``Coordinator.push_aggregate`` (one step with the sum, the version advancing by the members'
  count; dropped whole if any member breaks the bound), or refuses it if any member was
  decided already.  A member not acknowledged :func:`~fabricd.engines.ps.aggregating.
  direct_after` seconds after it was sent goes straight to the server, as the worker's daemon
  does (a copy the server decided already is acknowledged again, nothing more).
* ``Setting.exact``: workers push ``-lr g`` rounded to a multiple of 2^-30 and the server's
  rule is ``sum``: every sum of updates is then exact in float64, so the model an aggregate
  gives equals its members applied one by one bit for bit (the equality check).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.mlfabric_model import COMPUTES, Problem, Vector, Workers
from bench.mlfabric_net import GBPS, NETWORKS, Fluid, Trace
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.aggregating import direct_after
from fabricd.engines.ps.consistency import (
    SGD,
    Apply,
    Consistency,
    Coordinator,
    Drop,
    Sum,
    UpdateRule,
    step_model,
)
from fabricd.engines.ps.filters import Push
from fabricd.engines.ps.gathering import Gathering, GroupKey, Summed
from fabricd.engines.ps.scheduler import Denied, Gather, Granted, ShardScheduler
from fabricd.engines.scheduling import aggregation as alg3
from fabricd.engines.scheduling.ordering import Update, in_list_order
from fabricd.engines.scheduling.timelines import Network

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

SERVER = 0
#: the grid ``Setting.exact`` rounds a pushed update to (a power of two: sums stay exact)
QUANTUM: Final = 2.0**-30
#: the model's name in aggregation's group keys (one model, one shard, epoch 0)
MODEL: Final = ("bench", "mlfabric")
STRATEGIES = ("RR-Sync", "Tr-Sync", "MLfabric-S", "Async", "MLfabric-A", "MLfabric-A+agg")


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
    #: the server's uplink, if not ``server_gbps`` (the aggregation rows: bench/mlfabric.py)
    server_up_gbps: float | None = None
    horizon: float = 2000.0  #: virtual seconds a run may last at most
    #: push ``-lr g`` rounded to :data:`QUANTUM` under the ``sum`` rule (module docstring)
    exact: bool = False

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
    aggregates: int = 0  #: aggregates the server took
    grouped: int = 0  #: updates applied or dropped inside them
    refused: int = 0  #: aggregates refused (a member decided already)
    fallbacks: int = 0  #: members sent straight to the server after their wait
    delays: list[int] = field(default_factory=list)  #: of the applied updates
    #: synchronous strategies: seconds from each iteration's slowest computation's end to
    #: its end (the communication nothing overlapped), summed over the iterations
    communication: float = math.nan
    #: Tr-Sync and MLfabric-S: the same up to the reduce's end (the root has the sum)
    reduced: float = math.nan
    log: list[tuple[int, int, Vector]] = field(default_factory=list, repr=False)
    final: Vector | None = field(default=None, repr=False)

    @property
    def per_iteration(self) -> float:
        return self.seconds / self.iterations if self.iterations else math.inf

    @property
    def communication_per_iteration(self) -> float:
        return self.communication / self.iterations if self.iterations else math.nan


def simulate(setting: Setting, problem: Problem, strategy: str) -> Outcome:
    """Run ``strategy`` (one of :data:`STRATEGIES`) in ``setting``."""
    hosts = list(range(setting.workers + 1))
    up = setting.server_up_gbps or setting.server_gbps
    trace = Trace(
        hosts,
        NETWORKS[setting.network],
        seed=setting.seed,
        fixed={SERVER: (up * GBPS, setting.server_gbps * GBPS)},
    )
    workers = Workers(
        setting.workers, setting.base_compute, COMPUTES[setting.compute], seed=setting.seed
    )
    if strategy in ("RR-Sync", "Tr-Sync"):
        return _Sync(setting, problem, trace, workers, ring=strategy == "RR-Sync").run()
    if strategy == "MLfabric-S":
        return _MlfabricS(setting, problem, trace, workers).run()
    if strategy == "Async":
        return _Ps(setting, problem, trace, workers, scheduled=False, aggregation=False).run()
    aggregation = strategy == "MLfabric-A+agg"
    return _Ps(setting, problem, trace, workers, scheduled=True, aggregation=aggregation).run()


def rule_of(setting: Setting) -> UpdateRule:
    """The server's update rule: ``sum`` in exact mode (the worker scaled the step), else
    ``sgd`` at ``lr``."""
    return Sum() if setting.exact else SGD(lr=setting.lr)


def pushed(setting: Setting, gradient: Vector) -> Vector:
    """What a worker pushes for ``gradient``: itself, or in exact mode ``-lr g`` on the grid."""
    if not setting.exact:
        return gradient
    out: Vector = np.round(-setting.lr * gradient / QUANTUM) * QUANTUM
    return out


class _Sync:
    """RR-Sync and Tr-Sync (module docstring)."""

    def __init__(
        self, setting: Setting, problem: Problem, trace: Trace, workers: Workers, *, ring: bool
    ) -> None:
        self.s, self.problem, self.trace, self.workers = setting, problem, trace, workers
        self.ring = ring
        self.fluid = Fluid(trace)
        self.reduced = 0.0
        self.hosts = [w + 1 for w in range(setting.workers)]

    def allreduce(self, start: float) -> float:
        """When an allreduce that starts at ``start`` ends."""
        n, size = self.s.workers, self.s.model_bytes
        if self.ring:
            return self.trace.carry(self.hosts, 2 * (n - 1) / n * size, start)
        edges = [(self.hosts[c], self.hosts[(c - 1) // 2]) for c in range(1, n)]
        reduced = self._phase(edges, start)
        self.reduced += reduced - start
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
        model, rule = problem.start.copy(), rule_of(s)
        out = Outcome(strategy=name, reached=math.inf, seconds=0.0, iterations=0)
        out.communication = 0.0
        now, k = 0.0, 0
        while now < s.horizon:
            draws = [self.workers.draw(w, k) for w in range(s.workers)]
            total = sum(pushed(s, problem.gradient(model, rows)) for _, rows in draws)
            computed = now + max(seconds for seconds, _ in draws)
            now = self.allreduce(computed)
            out.communication += now - computed
            rule.apply(model, np.asarray(total))
            k += 1
            out.computed += s.workers
            out.applied += s.workers
            if problem.loss(model) <= s.target:
                out.reached = now
                break
        out.seconds, out.iterations, out.final = now, k, model
        out.delays = [0] * out.applied
        out.reduced = math.nan if self.ring else self.reduced
        return out


class _MlfabricS:
    """MLfabric-S (module docstring): the sums really travel the round's paths, so that the
    model's equality with RR-Sync's is a check, not a copy."""

    def __init__(self, setting: Setting, problem: Problem, trace: Trace, workers: Workers) -> None:
        self.s, self.problem, self.trace, self.workers = setting, problem, trace, workers
        self.fluid = Fluid(trace)
        self.hosts = [w + 1 for w in range(setting.workers)]
        self.rng = np.random.default_rng([setting.seed, 6])
        self.out = Outcome(
            strategy="MLfabric-S", reached=math.inf, seconds=0.0, iterations=0, communication=0.0,
            reduced=0.0,
        )  # fmt: skip
        self.total: Vector | None = None  #: the last round's sum, as the root made it

    def _figures(self, now: float) -> Network:
        """The monitor's view at ``now``: the true rates ``lag`` seconds ago."""
        then = now - self.s.lag
        up = {h: self.trace.rate(h, then, up=True) for h in self.hosts}
        down = {h: self.trace.rate(h, then, up=False) for h in self.hosts}
        return Network(up, down, now=now)

    def _round(self, start: float, seconds: list[float], values: list[Vector], k: int) -> float:
        """One iteration's allreduce of ``values`` (worker ``w``'s contribution the ``w``-th):
        when every worker has the root's sum, which is left in ``self.total``."""
        n = self.s.workers
        root = int(self.rng.integers(n))
        ready_at = [start + t for t in seconds]
        if n == 1:
            self.total = values[0]
            self.out.log.append((0, k, values[0]))
            return ready_at[0]
        others = [w for w in range(n) if w != root]
        turn = k % len(others)
        aggregators = [self.hosts[w] for w in others[turn:] + others[:turn]]
        state = _SRound(self, root, k, values, aggregators)
        for w in others:
            state.later(ready_at[w], functools.partial(state.ready, w))
        state.root_ready = ready_at[root]
        while len(state.ended) < n - 1:
            t_event = state.events[0][0] if state.events else math.inf
            t_flow = self.fluid.next_time()
            if t_event == math.inf and t_flow == math.inf:
                raise AssertionError("MLfabric-S's round stopped short")
            if t_flow < t_event:
                self.fluid.advance(t_flow)
                continue
            _, _, fn = heapq.heappop(state.events)
            self.fluid.advance(max(self.fluid.now, t_event))
            fn(t_event)
        self.total = state.total
        end = max(state.ended)
        self.out.communication += end - max(ready_at)
        self.out.reduced += state.summed - max(ready_at)
        return end

    def run(self) -> Outcome:
        s, problem, out = self.s, self.problem, self.out
        model, rule = problem.start.copy(), rule_of(s)
        now, k = 0.0, 0
        while now < s.horizon:
            draws = [self.workers.draw(w, k) for w in range(s.workers)]
            values = [pushed(s, problem.gradient(model, rows)) for _, rows in draws]
            self.fluid.advance(max(self.fluid.now, now))
            now = self._round(now, [seconds for seconds, _ in draws], values, k)
            rule.apply(model, np.asarray(self.total))
            k += 1
            out.computed += s.workers
            out.applied += s.workers
            if problem.loss(model) <= s.target:
                out.reached = now
                break
        out.seconds, out.iterations, out.final = now, k, model
        out.delays = [0] * out.applied
        return out


class _SRound:
    """The events of one MLfabric-S iteration (module docstring): READYs batched every
    ``interval``, each batch planned by fabricd's list planner and Alg. 3 on the lagged
    figures, members summed at their aggregator as they come, the sums and direct sends summed
    at the root as they come, the model sent back from the root once every contribution is in."""

    def __init__(
        self, sim: _MlfabricS, root: int, k: int, values: list[Vector], aggregators: list[int]
    ) -> None:
        self.sim, self.root, self.k, self.values = sim, root, k, values
        self.root_host = sim.hosts[root]
        self.aggregators = aggregators
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self.root_ready = math.inf  #: when the root's own computation ends
        self.batch: list[int] = []  #: workers ready since the last plan, in ready order
        self.planned = 0  #: workers planned so far
        self.covered: set[int] = set()  #: workers whose contribution reached the root
        self.total: Vector | None = None  #: the root's running sum
        self.summed = math.inf  #: when it held every contribution, its own included
        self.ended: list[float] = []  #: when each other worker had the model back
        #: the timelines the round's batches left (fabricd's ``engines/collectives/mlfabric.py``)
        self.network: Network | None = None

    def later(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self._order), fn))

    def ready(self, w: int, t: float) -> None:
        """Worker ``w``'s READY: planned with its batch at the interval's end, or at once if
        it completes the iteration's set."""
        self.batch.append(w)
        if self.planned + len(self.batch) == self.sim.s.workers - 1:
            self.plan(t)
        elif len(self.batch) == 1:
            self.later(t + self.sim.s.interval, self.plan)

    def plan(self, t: float) -> None:
        """The batch through ``in_list_order`` and Alg. 3 (module docstring)."""
        if not self.batch:
            return  # (planned earlier: every worker came in before the interval ended)
        sim, size = self.sim, self.sim.s.model_bytes
        by_host = {sim.hosts[w]: w for w in self.batch}
        self.planned += len(self.batch)
        self.batch.clear()
        if self.network is None:
            network = sim._figures(t)
        else:  # the timelines the round's earlier batches left, as the engine plans
            network = self.network
            network.advance(t)
        updates = [Update(key=h, host=h, version=0, size=size) for h in by_host]
        listed = in_list_order(updates, network, server=self.root_host)
        plan = alg3.aggregate(
            listed.planned, network, server=self.root_host, aggregators=self.aggregators
        )
        self.network = plan.network if plan.network is not None else listed.network
        direct = [by_host[p.update.host] for p in plan.direct]
        for group in plan.groups:
            members = [by_host[m.update.host] for m in group.members]
            if len(members) == 1:
                direct += members
                continue
            sim.out.aggregates += 1
            sim.out.grouped += len(members)
            self._gather(group.aggregator, members)
        for w in direct:
            sim.fluid.start(
                sim.hosts[w], self.root_host, size,
                functools.partial(self._arrive, [w], self.values[w]),
            )  # fmt: skip

    def _gather(self, aggregator: int, members: list[int]) -> None:
        """The group's members to its aggregator, summed there as they come; the sum to the
        root once all came."""
        sim, size = self.sim, self.sim.s.model_bytes
        got: list[int] = []

        def arrived(w: int, _t: float) -> None:
            got.append(w)
            if len(got) == len(members):
                value = functools.reduce(operator.add, (self.values[m] for m in got))
                done = functools.partial(self._arrive, list(got), value)
                sim.fluid.start(aggregator, self.root_host, size, done)

        for w in members:
            sim.fluid.start(sim.hosts[w], aggregator, size, functools.partial(arrived, w))

    def _arrive(self, members: list[int], value: Vector, t: float) -> None:
        """A contribution (one worker's, or a group's sum) reached the root."""
        out = self.sim.out
        for w in members:
            if w in self.covered:
                raise AssertionError(f"worker {w}'s update of iteration {self.k} came twice")
            out.log.append((w, self.k, self.values[w]))
        self.covered.update(members)
        out.delivered += len(members)
        out.server_bytes += self.sim.s.model_bytes
        self.total = value if self.total is None else self.total + value
        if len(self.covered) == self.sim.s.workers - 1:
            self.later(max(t, self.root_ready), self._broadcast)

    def _broadcast(self, t: float) -> None:
        """The root adds its own (local) contribution and sends the model to every worker."""
        sim, own = self.sim, self.values[self.root]
        self.summed = t
        sim.out.log.append((self.root, self.k, own))
        self.total = own if self.total is None else self.total + own
        for w in range(sim.s.workers):
            if w != self.root:
                sim.fluid.start(self.root_host, sim.hosts[w], sim.s.model_bytes, self.ended.append)


@dataclass
class _Worker:
    host: int
    model: Vector
    base: int = 0  #: the version its model is
    k: int = 0  #: its next computation


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
            ShardScheduler(
                server=SERVER,
                delay_bound=setting.tau_max,
                interval=setting.interval,
                aggregation=aggregation,
            )
            if scheduled
            else None
        )
        self.rule = rule_of(setting)
        #: each host's aggregator side, made when the scheduler first picks it
        self.gathering: dict[int, Gathering] = {}
        self.gather_armed: dict[int, float] = {}
        self.sent: dict[tuple[int, int], Vector] = {}  #: each update pushed, for the log
        self.decided: dict[int, int] = {}  #: each worker's last iteration the server decided
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
        gradient = pushed(self.s, self.problem.gradient(worker.model, rows))
        self.sent[(w, k)] = gradient
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
        """``w``'s push of ``k`` reached the server: applied or dropped, or, decided already
        (an aggregate held it), acknowledged again and nothing more."""
        if self.decided.get(w, -1) >= k:
            return
        self.decided[w] = k
        self.out.delivered += 1
        self._perform(self.coordinator.push(w, k, base, gradient, now))
        self._settled([w], k_of={w: k}, now=now)

    def _perform(self, actions: Sequence[object]) -> None:
        """Carry out the coordinator's applies and count its drops."""
        for action in actions:
            if isinstance(action, Apply):
                self._applied(action)
                step_model(self.rule, self.model, action)
            elif isinstance(action, Drop):
                self.out.dropped_server += 1
                self.sent.pop((action.worker, action.iteration), None)

    def _applied(self, action: Apply) -> None:
        """Count ``action``'s updates and log each as its worker pushed it (an aggregate's
        members carry the sum; the log keeps each member's own update for the replay)."""
        for update in action.updates:
            self.out.applied += 1
            self.out.delays.append(update.delay)
            values = self.sent.pop((update.worker, update.iteration))
            self.out.log.append((update.worker, update.iteration, values))

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
        """The scheduler's decisions, carried out as the daemons carry them out."""
        assert self.scheduler is not None
        self.armed = None
        for action in self.scheduler.on_timer(now, self.coordinator.version, self._figures):
            if isinstance(action, Denied):
                self._denied(action, now)
            elif isinstance(action, Gather):
                self._gather(action, now)
            elif not isinstance(action, Granted):
                raise AssertionError(f"no replica here to copy to: {action}")
            elif action.via is None:
                self._send_direct(action.worker, action.iteration, now + action.wait)
            else:
                self._send_member(action, now + action.wait)
        self._arm()

    def _denied(self, action: Denied, now: float) -> None:
        w, k = action.worker, action.iteration
        base, _ = self.pending.pop((w, k))
        self.sent.pop((w, k))
        self.coordinator.skip(w, k, base, action.reason)
        self.decided[w] = k
        self.out.dropped_scheduler += 1
        self._pull(w, now)

    def _send_direct(self, w: int, k: int, start: float) -> None:
        base, gradient = self.pending.pop((w, k))
        self.at(start, lambda _t: self._push_to_server(w, k, base, gradient))

    def _push_to_server(self, w: int, k: int, base: int, gradient: Vector) -> None:
        self.fluid.start(
            self.workers[w].host, SERVER, self.s.model_bytes,
            lambda t: self._arrived(w, k, base, gradient, t),
        )  # fmt: skip

    # -- aggregation: the members' daemons and the aggregators' -----------------------------
    def _aggregator(self, host: int) -> Gathering:
        found = self.gathering.get(host)
        if found is None:
            # (no memory bound in a simulation: every group fits)
            grace = direct_after(self.s.interval)
            found = self.gathering[host] = Gathering(grace=grace, max_bytes=1 << 62)
        return found

    def _gather(self, action: Gather, now: float) -> None:
        """The GATHER reaches the aggregator's daemon (control frames take no time here)."""
        key: GroupKey = (MODEL, 0, SERVER, 0, action.group)
        gathering = self._aggregator(action.aggregator)
        plan = gathering.plan(
            key, action.members, action.wait, now, size=self.model.size, dtype=self.model.dtype
        )
        self._forward(action.aggregator, plan)

    def _send_member(self, action: Granted, start: float) -> None:
        """A push granted via an aggregator: sent to it at ``start``; straight to the server
        if the server has not decided it ``direct_after`` seconds later."""
        w, k, via = action.worker, action.iteration, action.via
        assert via is not None
        assert action.group is not None
        key: GroupKey = (MODEL, 0, SERVER, 0, action.group)
        base, gradient = self.pending.pop((w, k))

        payload = ps_push.encode(
            Push(size=gradient.size, pushed=gradient.size, indices=None, values=gradient)
        )

        def arrived(t: float) -> None:
            self._forward(via, self._aggregator(via).push(key, w, k, base, payload, t))

        def go(t: float) -> None:
            self.fluid.start(self.workers[w].host, via, self.s.model_bytes, arrived)
            self.at(t + direct_after(self.s.interval), unacknowledged)

        def unacknowledged(_t: float) -> None:
            if self.decided.get(w, -1) < k:
                self.out.fallbacks += 1
                self._push_to_server(w, k, base, gradient)

        self.at(start, go)

    def _forward(self, host: int, summed: list[Summed]) -> None:
        """Send ``host``'s complete aggregates to the server (a dense sum: one model size),
        and keep its grace timer armed."""
        for aggregate in summed:
            self.fluid.start(
                host, SERVER, self.s.model_bytes,
                lambda t, a=aggregate: self._aggregate_arrived(a, host, t),  # type: ignore[misc]
            )  # fmt: skip
        due = self.gathering[host].next_deadline()
        if due is not None and due != self.gather_armed.get(host):
            self.gather_armed[host] = due
            self.at(due, lambda t: self._gather_timer(host, t))

    def _gather_timer(self, host: int, now: float) -> None:
        self.gather_armed.pop(host, None)
        self._forward(host, self.gathering[host].on_timer(now))

    def _aggregate_arrived(self, aggregate: Summed, host: int, now: float) -> None:
        """The server takes the aggregate whole (``Coordinator.push_aggregate``) or refuses it
        if any member was decided already (``ShardServer.push_aggregate``'s rule)."""
        members = aggregate.members
        assert self.scheduler is not None
        # the real server asks its scheduler whether it planned this aggregate, which also
        # tells the scheduler the forward is over (its booking of the server's link ends)
        self.scheduler.expects(aggregate.group[4], host, members)
        if any(self.decided.get(w, -1) >= k for w, k, _ in members):
            self.out.refused += 1
            return
        for w, k, _ in members:
            self.decided[w] = k
        self.out.delivered += len(members)
        self.out.aggregates += 1
        self.out.grouped += len(members)
        values = ps_push.decode(aggregate.payload, self.model.size, self.model.dtype)
        self._perform(self.coordinator.push_aggregate(members, values, now))
        ws = [w for w, _, _ in members]
        self._settled(ws, k_of={w: k for w, k, _ in members}, now=now)
