"""(r) MLfabric on real daemons in network namespaces with ``tbf``-shaped links (issue 24,
item 7): arrival order against MLfabric-A's scheduling and its aggregation, BSP against
MLfabric-S, and RR-Sync, measured in one run, under a fixed and a shifting network condition.

Four daemons, each in a network namespace of its own joined by a bridge
(``tests/network/netns.py``'s :class:`TestNet`): node 0 hosts the server rank, nodes 1-3 two
workers each.  Every node's link is shaped both ways with ``tbf``: 100 Mbit/s, and the last
worker host 10 Mbit/s (1/10: its workers are the network's stragglers).  Each daemon's
``link_up_bps`` / ``link_down_bps`` is set to its ``tbf`` rate, so the scheduler plans with the
true figures (the *fixed* condition).  The *shift* condition (MLfabric §7.1's N2/N3 in
spirit: some hosts' bandwidth changes over time) runs on a second cluster whose daemons are
told no rates, so the scheduler plans with what the network monitor measures (TCP_INFO,
docs/mlfabric.md, "The network monitor"): the 10 Mbit/s slowdown moves to the next worker host
every :data:`SHIFT_PERIOD` seconds (:class:`bench.netns_shift.Shift`, ``tc qdisc change``), and
node 0's monitor table is read every second and set beside the true rates in the notes.

The mapping to the paper (§7): rates are the paper's ÷100 (a 10 Gbit/s NIC becomes 100 Mbit/s,
its slowest 1 Gbit/s 10 Mbit/s) and the model is 1 MiB of float32 on the wire (ResNet-50's
100 MB ÷100), so a push or a pull at full rate takes what it took in the paper (about 85 ms).
Computation is emulated by sleeping (:data:`COMPUTE` = 0.5 s, the paper's iterations took about
1.3 s, so the network weighs a little more here), each one slowed 4x with probability 10 %
(the paper's C2), drawn per worker and iteration from a seed shared by every mode.  The update
is a stand-in for a gradient: integers in [-4, 4] (exact in float32 under the ``sum`` rule, so
the final model must equal the sum of the updates applied, bit for bit).

Each worker loops for :data:`SECONDS`: pull, compute (sleep), push, and stops after the push
that ends past the deadline. Modes, on the same daemons, one job each, in this order:
``scheduling="arrival"`` with ``delay_bound`` :data:`BOUND`, ``scheduling="mlfabric"`` with the
same bound, and the latter with ``aggregation=True`` (MLfabric-A); then the same loop under
BSP, ``scheduling="arrival"`` (a plain synchronous parameter server) and
``scheduling="mlfabric"`` with ``aggregation=True`` (MLfabric-S, §6), every worker running the
same number of iterations (about :data:`SECONDS` of them at :data:`BSP_ITERATION` each: a
worker that stopped early would hold the others' next iteration); then RR-Sync, §7's baseline:
the same workers and draws, no server, compute then ``fab.allreduce(update, algorithm="ring")``
per iteration, as many iterations. The shift condition runs :data:`SHIFT_MODES`,
:data:`SHIFT_SECONDS` each. Reported per mode: time per iteration (wall seconds per ``n``
pushes applied, ``n`` the number of workers) and pushes applied per second, pushes made /
applied / dropped (the workers' own results), the largest delay applied and the mean (the
server's status row: its delay histogram's highest non-empty bucket, and ``delay_sum /
applied``), how many of the drops the scheduler made (before the push was sent: the status
row's ``dropped_scheduled``; the rest were too stale for the worker's own delay gate, not sent,
or for the server, after they crossed the network), and the server's inbound bytes
(``push_bytes``) in all and per applied push. The ratio is arrival's time per iteration over
the row's, a synchronous row's (RR-Sync's too) against BSP in arrival order, in the same
condition (higher is better); the inbound-bytes ratio and every row against RR-Sync are extra
figures. One run of each mode: the figures are single samples on a shared machine.

Where namespaces or ``tc`` are unavailable (not root, no iproute2, a kernel without them), the
benchmark prints one line, ``mlfabric-netns: skipped: <why>``, and exits 0.

Run alone: ``python -m bench.mlfabric_netns [--quick]``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

import fabricd
from bench import netns_cluster
from bench.netns_cluster import why_not
from bench.netns_shift import Sample, Shift
from bench.report import Column, Extra, Progress, Table, quiet, run_alone
from fabricd.engines.ps.consistency import DELAY_BUCKETS

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

#: each mode's training time (s), and a quick run's
SECONDS: Final = 20.0
QUICK_SECONDS: Final = 5.0
#: emulated computation per mini-batch (s), and the straggler draw (the paper's C2)
COMPUTE: Final = 0.5
STRAGGLE, SLOWDOWN = 0.1, 4.0
#: the delay bound of every mode: the number of workers plus two, a bucket edge of the server's
#: delay histogram (so "nothing applied past the bound" is readable from its status row)
BOUND: Final = 8
#: the modes, in run order, and how each opens the model
MODES: Final[dict[str, dict[str, Any]]] = {
    "arrival": {"consistency": "async", "scheduling": "arrival"},
    "mlfabric": {"consistency": "async", "scheduling": "mlfabric"},
    "mlfabric+agg": {"consistency": "async", "scheduling": "mlfabric", "aggregation": True},
    "bsp": {"consistency": "bsp", "scheduling": "arrival"},
    "bsp mlfabric+agg": {"consistency": "bsp", "scheduling": "mlfabric", "aggregation": True},
}
#: seconds a BSP iteration is planned at, to size a BSP mode's iterations to its time: one
#: computation, its 4x stragglers (one of the workers is one in about half the iterations),
#: and the pushes and pulls
BSP_ITERATION: Final = 1.5
#: RR-Sync (§7's baseline): no server; the workers sum their updates by a ring allreduce
RING: Final = "rr-sync"
#: the network conditions: one slow host for the whole run, or the slowdown moving
FIXED, SHIFT = "fixed", "shift"
#: the moving condition: each mode's training time (s), how often the slowdown moves (s), the
#: modes run in it, and a quick run's
SHIFT_SECONDS: Final = 9.0
SHIFT_PERIOD: Final = 3.0
SHIFT_MODES: Final = ("arrival", "mlfabric+agg", "bsp", "bsp mlfabric+agg", RING)
QUICK_SHIFT_SECONDS: Final = 4.0
QUICK_SHIFT_MODES: Final = ("mlfabric+agg",)


def opened(mode: str, settings: Settings) -> dict[str, Any]:
    """How every rank opens the model in ``mode``: its consistency, scheduling and (async)
    the delay bound."""
    kwargs = dict(MODES[mode])
    if kwargs["consistency"] == "async":
        kwargs["delay_bound"] = settings.delay_bound
    return kwargs


def synchronous(mode: str) -> bool:
    """Whether ``mode`` trains in lockstep (BSP, RR-Sync)."""
    return mode == RING or bool(MODES[mode]["consistency"] == "bsp")


@dataclass(frozen=True, slots=True)
class Settings:
    """One experiment: hosts, rates, the model, and each mode's duration."""

    worker_hosts: int = 3
    workers_per_host: int = 2
    fast_mbit: float = 100.0
    slow_mbit: float = 10.0
    slow_hosts: int = 1  #: the last worker hosts are slow
    elements: int = 1 << 18  #: float32: 1 MiB
    seconds: float = SECONDS
    compute: float = COMPUTE
    straggle: float = STRAGGLE
    slowdown: float = SLOWDOWN
    delay_bound: int = BOUND
    seed: int = 24
    #: the daemons are told their links' rates (``link_up_bps``/``link_down_bps``); without,
    #: the scheduler plans with what the network monitor measures
    configured: bool = True
    #: 0: the slow host stays put; else the slowdown moves to the next worker host every
    #: ``shift_period`` seconds (a whole number of seconds: :class:`bench.netns_shift.Shift`)
    shift_period: float = 0.0

    @property
    def nodes(self) -> int:
        return 1 + self.worker_hosts

    @property
    def bsp_iterations(self) -> int:
        """The iterations of a BSP mode: about ``seconds`` of them, at least two."""
        return max(2, round(self.seconds / BSP_ITERATION))

    @property
    def placement(self) -> tuple[int, ...]:
        """Rank -> node: the server rank 0 on node 0, then the workers host by host."""
        hosts = range(1, self.nodes)
        return (0, *(h for h in hosts for _ in range(self.workers_per_host)))

    def mbit(self, node: int) -> float:
        """Node ``node``'s shaped rate, each way."""
        return self.slow_mbit if node >= self.nodes - self.slow_hosts else self.fast_mbit

    def node_env(self) -> dict[int, dict[str, str]]:
        """Each daemon's ``link_up_bps`` / ``link_down_bps`` (bytes/s): its ``tbf`` rate; none
        where the rates are not ``configured``."""
        if not self.configured:
            return {}
        return netns_cluster.rates_env([self.mbit(node) for node in range(self.nodes)])


@dataclass(slots=True)
class WorkerLog:
    """What one worker did, from its own push results."""

    rank: int
    mode: str
    pushed: int = 0
    applied: int = 0
    dropped: list[str] = field(default_factory=list)
    total: np.ndarray[Any, Any] | None = None  #: the sum of its applied updates (int64)
    final: np.ndarray[Any, Any] | None = None  #: rank 1: the model after every worker ended
    version: int = -1  #: rank 1: that model's version
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's run: the workers' counts and the server's status row."""

    mode: str
    seconds: float  #: wall time from the common start to the last worker's end
    workers: int
    pushed: int
    applied: int
    dropped: int
    reasons: tuple[str, ...]
    server: dict[str, Any] | None  #: the shard's primary status row (``ps_servers``); None:
    #: RR-Sync, no server
    model_is_sum: bool  #: the final model equals the sum of the applied updates, exactly
    version: int  #: the final model's version
    condition: str = FIXED  #: the network condition: :data:`FIXED` or :data:`SHIFT`
    samples: tuple[Sample, ...] = ()  #: the network monitor's figures during the run (shift)

    @property
    def label(self) -> str:
        return self.mode if self.condition == FIXED else f"{self.condition}: {self.mode}"

    @property
    def per_iteration(self) -> float:
        """Wall seconds per ``n`` pushes applied (``n`` workers): one iteration's worth."""
        return self.seconds * self.workers / self.applied if self.applied else math.inf

    def figure(self, key: str) -> float:
        """The server's status figure ``key`` (NaN: no server)."""
        return math.nan if self.server is None else float(self.server[key])

    @property
    def largest_delay(self) -> float:
        """The upper bound of the highest non-empty delay bucket (inf: past the last)."""
        if self.server is None:
            return math.nan
        delays = self.server["delays"]
        top = max((i for i, count in enumerate(delays) if count), default=0)
        return float(DELAY_BUCKETS[top]) if top < len(DELAY_BUCKETS) else math.inf

    @property
    def mean_delay(self) -> float:
        if self.server is None:
            return math.nan
        applied = self.server["applied"]
        return self.server["delay_sum"] / applied if applied else 0.0

    @property
    def inbound_per_push(self) -> float:
        """The server's inbound bytes per push applied."""
        if self.server is None:
            return math.nan
        applied = self.server["applied"]
        return self.server["push_bytes"] / applied if applied else math.nan


def _worker(
    socket_path: str,
    size: int,
    job: str,
    settings: Settings,
    gates: tuple[threading.Barrier, threading.Barrier],
    deadline: list[float],
    log: WorkerLog,
) -> None:
    """One worker's loop: pull, compute (sleep), push, until the deadline; then, once every
    worker is done, rank 1 pulls the final model into ``log.final``.  An error is kept in
    ``log.error`` and breaks the barriers, so that no thread waits for this one."""
    start, end = gates
    rng = np.random.default_rng([settings.seed, log.rank])
    try:
        with fabricd.connect(job=job, rank=log.rank, size=size, socket_path=socket_path) as fab:
            ps = fab.parameter_server(
                "m", (settings.elements,), "float32", servers=[0], **opened(log.mode, settings)
            )
            model = fab.array("w", (settings.elements,), "float32")
            update = fab.array("u", (settings.elements,), "float32")
            log.total = np.zeros(settings.elements, np.int64)
            start.wait(timeout=60)
            # BSP: every worker runs the same iterations (one that stopped would hold the
            # others' next iteration for ever); async: each until the deadline
            iterations = settings.bsp_iterations if synchronous(log.mode) else math.inf
            while (
                time.monotonic() < deadline[0]
                if iterations == math.inf
                else log.pushed < iterations
            ):
                ps.pull(model, timeout=60)
                slow = rng.random() < settings.straggle
                time.sleep(settings.compute * (settings.slowdown if slow else 1.0))
                values = rng.integers(-4, 5, settings.elements)
                update[:] = values
                result = ps.push(update, timeout=60)
                log.pushed += 1
                if result.dropped:
                    log.dropped += result.dropped
                else:
                    log.applied += 1
                    log.total += values
            end.wait(timeout=120)
            if log.rank == 1:
                log.version = ps.pull(model, timeout=60)
                log.final = np.array(model)
    except BaseException as exc:
        log.error = exc
        start.abort()
        end.abort()


def train(sockets: Sequence[str], mode: str, settings: Settings, job: str = "") -> ModeResult:
    """Run ``mode`` on the daemons at ``sockets`` (node ``i``'s client socket) and return
    what the workers and the server say of it.  Bounded: every call has a timeout.

    Raises:
        RuntimeError: a worker failed or did not finish (its error chained).
    """
    placement = settings.placement
    size, job = len(placement), job or f"netns-{mode.replace('+', '-')}"
    logs = [WorkerLog(rank, mode) for rank in range(1, size)]
    gates = (threading.Barrier(len(logs) + 1), threading.Barrier(len(logs)))
    deadline = [math.inf]
    with fabricd.connect(job=job, rank=0, size=size, socket_path=sockets[0]) as server:
        server.parameter_server(
            "m", (settings.elements,), "float32", "server", servers=[0], **opened(mode, settings)
        )
        threads = [
            threading.Thread(
                target=_worker,
                args=(sockets[placement[log.rank]], size, job, settings, gates, deadline, log),
                daemon=True,
            )
            for log in logs
        ]
        for thread in threads:
            thread.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            gates[0].wait(timeout=60)
        began = time.monotonic()
        deadline[0] = began + settings.seconds
        for thread in threads:
            thread.join(timeout=settings.seconds + 180)
        seconds = time.monotonic() - began
        for log in logs:
            if log.error is not None:
                raise RuntimeError(f"{mode}: worker rank {log.rank} failed") from log.error
        if any(thread.is_alive() for thread in threads) or logs[0].final is None:
            raise RuntimeError(f"{mode}: a worker did not finish")
        row = next(
            r for r in server.status()["ps_servers"] if r["job"] == job and r["role"] == "primary"
        )
    expected = sum((log.total for log in logs if log.total is not None), np.zeros(1, np.int64))
    return ModeResult(
        mode=mode,
        seconds=seconds,
        workers=len(logs),
        pushed=sum(log.pushed for log in logs),
        applied=sum(log.applied for log in logs),
        dropped=sum(len(log.dropped) for log in logs),
        reasons=tuple(why for log in logs for why in log.dropped),
        server=row,
        model_is_sum=bool(np.array_equal(logs[0].final, expected.astype(np.float32))),
        version=logs[0].version,
    )


def _ring_worker(
    socket_path: str,
    size: int,
    job: str,
    settings: Settings,
    start: threading.Barrier,
    log: WorkerLog,
) -> None:
    """One RR-Sync worker: compute (sleep), then sum its update with every other worker's by
    a ring allreduce (``algorithm="ring"``); its model is the sum of the results.  PS worker
    rank ``r`` is allreduce rank ``r - 1`` and draws what it draws (the same stragglers and
    updates).  An error is kept in ``log.error`` and breaks the barrier."""
    rng = np.random.default_rng([settings.seed, log.rank])
    try:
        with fabricd.connect(job=job, rank=log.rank - 1, size=size, socket_path=socket_path) as fab:
            update = fab.array("u", (settings.elements,), "float32")
            model = np.zeros(settings.elements, np.float32)
            log.total = np.zeros(settings.elements, np.int64)
            start.wait(timeout=60)
            for _ in range(settings.bsp_iterations):
                slow = rng.random() < settings.straggle
                time.sleep(settings.compute * (settings.slowdown if slow else 1.0))
                values = rng.integers(-4, 5, settings.elements)
                update[:] = values
                fab.allreduce(update, "sum", name="g", timeout=60, algorithm="ring")
                log.pushed += 1
                log.applied += 1
                log.total += values
                model += update
            log.final, log.version = model, log.pushed
    except BaseException as exc:
        log.error = exc
        start.abort()


def train_ring(sockets: Sequence[str], settings: Settings, job: str = "") -> ModeResult:
    """RR-Sync on the daemons at ``sockets``: the workers of :meth:`Settings.placement` (no
    server rank) run :meth:`Settings.bsp_iterations` iterations each, a ring allreduce per
    iteration.  Exact when every worker's model is the sum of every worker's updates.

    Raises:
        RuntimeError: a worker failed or did not finish (its error chained).
    """
    nodes = settings.placement[1:]
    size, job = len(nodes), job or f"netns-{RING}"
    logs = [WorkerLog(rank, RING) for rank in range(1, size + 1)]
    start = threading.Barrier(size + 1)
    threads = [
        threading.Thread(
            target=_ring_worker,
            args=(sockets[nodes[log.rank - 1]], size, job, settings, start, log),
            daemon=True,
        )
        for log in logs
    ]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(timeout=60)
    began = time.monotonic()
    for thread in threads:
        thread.join(timeout=settings.bsp_iterations * 10 + 120)
    seconds = time.monotonic() - began
    for log in logs:
        if log.error is not None:
            raise RuntimeError(f"{RING}: worker rank {log.rank} failed") from log.error
    if any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"{RING}: a worker did not finish")
    expected = sum((log.total for log in logs if log.total is not None), np.zeros(1, np.int64))
    exact = all(
        log.final is not None and np.array_equal(log.final, expected.astype(np.float32))
        for log in logs
    )
    applied = sum(log.applied for log in logs)
    return ModeResult(RING, seconds, size, applied, applied, 0, (), None, exact, logs[0].version)


# -- the bench: its own net and daemons -------------------------------------------------------
@contextlib.contextmanager
def shaped_cluster(settings: Settings, log_dir: Any = None) -> Iterator[tuple[list[str], Any]]:
    """Start the net and one daemon per node, shape every link, yield the client sockets and
    the net (:func:`bench.netns_cluster.shaped_cluster`)."""
    mbit = [settings.mbit(node) for node in range(settings.nodes)]
    with netns_cluster.shaped_cluster(mbit, configured=settings.configured, log_dir=log_dir) as up:
        yield up


@contextlib.contextmanager
def shifting(settings: Settings, net: Any, sockets: Sequence[str]) -> Iterator[Shift | None]:
    """Around one mode's training: nothing (``shift_period`` 0), or a :class:`Shift` moving
    the slowdown over the worker hosts, last first (where :meth:`Settings.mbit` put it), and
    reading node 0's (the server's, its scheduler's) network monitor every second.

    Raises:
        RuntimeError: moving a rate or reading the monitor failed.
    """
    if not settings.shift_period:
        yield None
        return
    first = settings.nodes - settings.slow_hosts
    hosts = (*range(first, settings.nodes), *range(1, first))
    with fabricd.connect(socket_path=sockets[0]) as control:
        shift = Shift(
            net,
            hosts,
            settings.fast_mbit,
            settings.slow_mbit,
            settings.shift_period,
            observe=lambda: list(control.status()["network"]),
        )
        with shift:
            yield shift
    if shift.errors:
        raise RuntimeError("the shifting network failed") from shift.errors[0]


def run_condition(
    condition: str, settings: Settings, modes: Sequence[str], progress: Progress
) -> list[ModeResult]:
    """Every mode of ``modes`` on one shaped cluster, in order, under ``condition``."""
    results = []
    with shaped_cluster(settings) as (sockets, net):
        for mode in modes:
            progress(f"{condition}: {mode}: {settings.seconds:g} s of training")
            job = f"netns-{condition}-{mode.replace('+', '-').replace(' ', '-')}"
            with shifting(settings, net, sockets) as shift:
                if mode == RING:
                    result = train_ring(sockets, settings, job)
                else:
                    result = train(sockets, mode, settings, job)
            samples = tuple(shift.samples) if shift is not None else ()
            results.append(replace(result, condition=condition, samples=samples))
    return results


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    why = why_not()
    if why is not None:
        return Table(name="mlfabric-netns", title="", columns=[], ratio="", skipped=why)
    fixed = Settings(seconds=QUICK_SECONDS if quick else SECONDS)
    moving = Settings(
        seconds=QUICK_SHIFT_SECONDS if quick else SHIFT_SECONDS,
        configured=False,
        shift_period=SHIFT_PERIOD,
    )
    results = run_condition(FIXED, fixed, [*MODES, RING], progress)
    results += run_condition(SHIFT, moving, QUICK_SHIFT_MODES if quick else SHIFT_MODES, progress)
    return tabulate(results, fixed, moving)


def _baselines(results: Sequence[ModeResult]) -> dict[tuple[str, bool], ModeResult]:
    """Each condition's first async mode and first synchronous one (arrival, bsp)."""
    return {(r.condition, synchronous(r.mode)): r for r in reversed(results)}


def tabulate(
    results: Sequence[ModeResult], settings: Settings, moving: Settings | None = None
) -> Table:
    """The table: one row per condition and mode, each against its condition's arrival
    (async rows) or bsp (synchronous rows, RR-Sync's included)."""
    moved = (
        f"; shift: no configured rates, the {moving.slow_mbit:g} Mbit/s link moving every "
        f"{moving.shift_period:g} s, {moving.seconds:g} s per mode"
        if moving is not None and any(r.condition == SHIFT for r in results)
        else ""
    )
    table = Table(
        name="mlfabric-netns",
        title=(
            "MLfabric on real daemons in network namespaces: "
            f"{results[0].workers} workers on {settings.worker_hosts} hosts, links "
            f"{settings.fast_mbit:g} Mbit/s ({settings.slow_hosts} at {settings.slow_mbit:g}), "
            f"tau_max {settings.delay_bound}, {settings.seconds:g} s per mode{moved}"
        ),
        columns=_COLUMNS,
        ratio=(
            "arrival's s/iteration / the row's, synchronous rows bsp's (arrival order), "
            "in the row's condition (higher is better)"
        ),
        settings={"seconds": settings.seconds, "compute": settings.compute},
    )
    bases = _baselines(results)
    for r in results:
        table.add(
            r.label,
            settings.elements * 4,
            bases[r.condition, synchronous(r.mode)].per_iteration / r.per_iteration,
            per_iteration=r.per_iteration,
            rate=r.applied / r.seconds,
            pushed=r.pushed,
            applied=r.applied,
            dropped=r.dropped,
            scheduled=r.figure("dropped_scheduled"),
            largest=r.largest_delay,
            mean=r.mean_delay,
            mbytes=r.figure("push_bytes") / 1e6,
            kib=r.inbound_per_push / 1024,
        )
    table.extras += _extras(results, bases)
    table.notes += _notes(results)
    return table


_COLUMNS: Final = [
    Column("per_iteration", "s/iter"),
    Column("rate", "applied/s"),
    Column("pushed", "pushed", 0),
    Column("applied", "applied", 0),
    Column("dropped", "dropped", 0),
    Column("scheduled", "by sched", 0),
    Column("largest", "max delay <=", 0),
    Column("mean", "mean delay"),
    Column("mbytes", "server MB in"),
    Column("kib", "KiB in/applied"),
]


def _extras(
    results: Sequence[ModeResult], bases: dict[tuple[str, bool], ModeResult]
) -> list[Extra]:
    """The inbound-bytes ratio (rows with a server) and every row against RR-Sync."""
    extras = [
        Extra(
            "server inbound bytes per applied push, arrival's (bsp's) / the mode's",
            {
                r.label: bases[r.condition, synchronous(r.mode)].inbound_per_push
                / r.inbound_per_push
                for r in results
                if r.server is not None
            },
            "x",
        )
    ]
    rings = {r.condition: r for r in results if r.mode == RING}
    if rings:
        extras.append(
            Extra(
                "RR-Sync's s/iteration / the row's, in the row's condition (higher is better)",
                {
                    r.label: rings[r.condition].per_iteration / r.per_iteration
                    for r in results
                    if r.condition in rings
                },
                "x",
            )
        )
    return extras


def _notes(results: Sequence[ModeResult]) -> list[str]:
    exact = all(r.model_is_sum and r.pushed == r.applied + r.dropped for r in results)
    served = [r for r in results if r.server is not None]
    notes = [
        "every push applied or dropped, and the final model the sum of the applied updates "
        "(RR-Sync: every worker's model the sum of every update): "
        + ("yes, every mode" if exact else "NO"),
        "server: pushes taken (each member of an aggregate one) / resent / aggregates / refused: "
        + ", ".join(
            f"{r.label} {r.figure('pushes'):.0f}/{r.figure('resent'):.0f}/"
            f"{r.figure('aggregates'):.0f}/{r.figure('aggregates_refused'):.0f}"
            for r in served
        ),
    ]
    return notes + monitor_notes(results)


def monitor_notes(results: Sequence[ModeResult], shown: str = "mlfabric+agg") -> list[str]:
    """What node 0's network monitor reported under the shifting condition: every reading of
    mode ``shown`` (else the first mode with readings) against the true rates, and over every
    mode's readings the median of measured / true for the slowed host and the others."""
    sampled = [r for r in results if r.samples]
    if not sampled:
        return []
    picked = next((r for r in sampled if r.mode == shown), sampled[0])
    notes = [
        f"monitor ({picked.label}), t: node up/down Mbit/s measured (true): "
        + "; ".join(
            f"{sample.at:.0f}s: "
            + ", ".join(_measured(sample, node) for node in sorted(sample.true))
            for sample in picked.samples
        )
    ]
    for slowed in (True, False):
        parts, unknown = [], 0
        for way, name in ((0, "up"), (1, "down")):
            ratios: list[float] = []
            for r in sampled:
                for sample in r.samples:
                    for node, mbit in sample.true.items():
                        if (mbit == min(sample.true.values())) != slowed:
                            continue
                        up, down, source = sample.measured(node)
                        if source == "measured":
                            ratios.append((up, down)[way] / mbit)
                        else:
                            unknown += 1
            parts.append(
                f"{name} median {np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                if ratios
                else f"{name} none"
            )
        which = "the slowed host" if slowed else "the other hosts"
        notes.append(
            f"monitor, measured / true rate, {which}: {', '.join(parts)}; "
            f"{unknown} figures (up and down) not yet measured"
        )
    return notes


def _measured(sample: Sample, node: int) -> str:
    up, down, source = sample.measured(node)
    shown = f"n{node} {up:.0f}/{down:.0f} ({sample.true[node]:g})"
    return shown if source == "measured" else f"{shown} [{source}]"


if __name__ == "__main__":
    sys.exit(run_alone("mlfabric_netns", __doc__, run, sys.argv[1:]))
