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
  (:func:`~fabricd.engines.scheduling.aggregation.aggregate`) on the monitor's lagged figures,
  every other worker's host an aggregator (rotated one a round), a one-member group sent
  straight; a group's sum (one model size) leaves its aggregator when its last member arrived.
  Once every contribution reached the root and its own computation ended, the root sends the
  model to every worker at once (a star) and the iteration ends when the last has it.
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
    log: list[tuple[int, int, Vector]] = field(default_factory=list, repr=False)
    final: Vector | None = field(default=None, repr=False)

    @property
    def per_iteration(self) -> float:
        return self.seconds / self.iterations if self.iterations else math.inf


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
        model, rule = problem.start.copy(), rule_of(s)
        out = Outcome(strategy=name, reached=math.inf, seconds=0.0, iterations=0)
        now, k = 0.0, 0
        while now < s.horizon:
            draws = [self.workers.draw(w, k) for w in range(s.workers)]
            total = sum(pushed(s, problem.gradient(model, rows)) for _, rows in draws)
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


class _MlfabricS:
    """MLfabric-S (module docstring)."""

    def __init__(self, setting: Setting, problem: Problem, trace: Trace, workers: Workers) -> None:
        self.s, self.problem, self.trace, self.workers = setting, problem, trace, workers
        self.fluid = Fluid(trace)
        self.hosts = [w + 1 for w in range(setting.workers)]
        self.rng = np.random.default_rng([setting.seed, 6])
        self.out = Outcome(strategy="MLfabric-S", reached=math.inf, seconds=0.0, iterations=0)

    def _figures(self, now: float) -> Network:
        """The monitor's view at ``now``: the true rates ``lag`` seconds ago."""
        then = now - self.s.lag
        up = {h: self.trace.rate(h, then, up=True) for h in self.hosts}
        down = {h: self.trace.rate(h, then, up=False) for h in self.hosts}
        return Network(up, down, now=now)

    def _round(self, start: float, seconds: list[float], k: int) -> float:
        """One iteration's allreduce: when every worker has the result."""
        n, size = self.s.workers, self.s.model_bytes
        root = int(self.rng.integers(n))
        root_host = self.hosts[root]
        ready_at = [start + t for t in seconds]
        if n == 1:
            return ready_at[0]
        others = [self.hosts[w] for w in range(n) if w != root]
        turn = k % len(others)
        aggregators = others[turn:] + others[:turn]
        events: list[tuple[float, int, Callable[[float], None]]] = []
        order = itertools.count()
        covered: set[int] = set()
        batch: list[int] = []
        planned = [0]
        ended: list[float] = []

        def later(t: float, fn: Callable[[float], None]) -> None:
            heapq.heappush(events, (t, next(order), fn))

        def cover(hosts: set[int], t: float) -> None:
            covered.update(hosts)
            self.out.delivered += len(hosts)
            self.out.server_bytes += size
            if len(covered) == n - 1:
                later(max(t, ready_at[root]), broadcast)

        def cover_one(host: int, t: float) -> None:
            cover({host}, t)

        def broadcast(t: float) -> None:
            for host in others:
                self.fluid.start(root_host, host, size, lambda when: ended.append(when))

        def plan(t: float) -> None:
            if not batch:
                return  # (planned earlier: every worker came in before the interval ended)
            hosts = [self.hosts[w] for w in batch]
            batch.clear()
            planned[0] += len(hosts)
            network = self._figures(t)
            updates = [Update(key=h, host=h, version=0, size=size) for h in hosts]
            listed = in_list_order(updates, network, server=root_host).planned
            plan = alg3.aggregate(listed, network, server=root_host, aggregators=aggregators)
            direct = [p.update.host for p in plan.direct]
            for group in plan.groups:
                members = {m.update.host for m in group.members}
                if len(members) == 1:
                    direct += members
                    continue
                self.out.aggregates += 1
                self.out.grouped += len(members)
                self._gather(group.aggregator, members, root_host, cover)
            for host in direct:
                self.fluid.start(host, root_host, size, functools.partial(cover_one, host))

        def ready(w: int) -> Callable[[float], None]:
            def go(t: float) -> None:
                batch.append(w)
                if planned[0] + len(batch) == n - 1:
                    plan(t)
                elif len(batch) == 1:
                    later(t + self.s.interval, plan)

            return go

        for w in range(n):
            if w != root:
                later(ready_at[w], ready(w))
        while len(ended) < n - 1:
            t_event = events[0][0] if events else math.inf
            t_flow = self.fluid.next_time()
            if t_event == math.inf and t_flow == math.inf:
                raise AssertionError("MLfabric-S's round stopped short")
            if t_flow < t_event:
                self.fluid.advance(t_flow)
                continue
            _, _, fn = heapq.heappop(events)
            self.fluid.advance(max(self.fluid.now, t_event))
            fn(t_event)
        return max(ended)

    def _gather(
        self,
        aggregator: int,
        members: set[int],
        root: int,
        cover: Callable[[set[int], float], None],
    ) -> None:
        """The group's members to its aggregator; its sum to the root once all came."""
        size = self.s.model_bytes
        left = [len(members)]

        def arrived(_t: float) -> None:
            left[0] -= 1
            if not left[0]:
                self.fluid.start(aggregator, root, size, lambda t: cover(members, t))

        for host in members:
            self.fluid.start(host, aggregator, size, arrived)

    def run(self) -> Outcome:
        s, problem, out = self.s, self.problem, self.out
        model, rule = problem.start.copy(), rule_of(s)
        now, k = 0.0, 0
        while now < s.horizon:
            draws = [self.workers.draw(w, k) for w in range(s.workers)]
            total = sum(pushed(s, problem.gradient(model, rows)) for _, rows in draws)
            self.fluid.advance(max(self.fluid.now, now))
            now = self._round(now, [seconds for seconds, _ in draws], k)
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
