"""The main job (``make demo`` / ``fabricctl demo``): eager-SGD hyperplane regression on a fabric.

The experiment of eager-SGD §6.2.1 (:mod:`fabricd.demo.hyperplane`), data-parallel over the
ranks of a local fabric: ``LocalCluster(nodes)`` on loopback, ``ranks_per_node`` processes per
daemon, the total batch split evenly over the ranks.  At every step one rank, the same one for
every rank by the shared seed, sleeps ``delay_ms`` between its gradient and its allreduce (the
paper's injected load imbalance).  The job runs once per mode on the same fabric:

* ``sync``: ``fab.allreduce(g, op="avg")`` waits for every rank, so every step waits for the
  straggler (synch-SGD);
* ``solo`` and ``majority``: the partial allreduce does not wait for it; its gradient goes into
  a later round (eager-SGD, Algorithm 5: every rank updates with the averaged gradient), and
  ``fab.sync_model(w)`` once every ``sync_every`` rounds averages the replicas, which partial
  rounds let drift (eager-SGD §5).

A run stops after a fixed number of steps, counted in allreduce rounds (:func:`train` says why
not in calls), not after a time budget: a stop on each rank's own clock would leave ranks
disagreeing on which round is the last.  The clock starts after a barrier, once every rank has
joined and rank 0 has the held-out set; rank 0 measures the validation loss of its replica
after every call (that evaluation is part of its step's time).  A rank reports nothing but
its failure; rank 0 reports after every call to this process, which draws the progress.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import queue
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from fabricd.client import connect
from fabricd.daemon.launcher import LocalCluster
from fabricd.demo.hyperplane import Hyperplane, default_lr, gradient, loss
from fabricd.errors import FabricError, PeerFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from multiprocessing.queues import Queue

    from fabricd.client import Client
    from fabricd.client.collectives import Mode

MODES: Final[tuple[Mode, ...]] = ("sync", "solo", "majority")
#: a collective call that takes longer than this failed (a straggler sleeps well under a second)
_WAIT: Final = 120.0

#: rank 0's report after a call: (the round it saw, seconds since the start, validation loss,
#: Result.active)
Report = tuple[int, float, float, int]


class DemoFailed(FabricError):
    """A rank of the demo failed (the message carries its traceback's last line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What one run trains, and how.  The defaults take under a minute per mode on two cores
    (eager-SGD §6.2.1 has 8 ranks, a batch of 2,048 and 48 epochs of 16 steps; the demo keeps
    the ranks, the batch and the dimension, and runs 80 steps, which sync needs about 40 of to
    reach the default target).  On two cores the 8 ranks' compute, about 50 ms a step each on
    one core, competes with the injected delay for the time a step takes, where the paper's
    ranks each had a GPU: expect smaller and noisier speedups than its 1.5-2x.  Averaging the
    replicas every 10 steps keeps solo's replicas from drifting far under that contention."""

    nodes: int = 4
    ranks_per_node: int = 2
    dim: int = 8192
    batch: int = 2048  #: in all; each rank draws ``batch // ranks``
    steps: int = 80  #: allreduce rounds
    delay_ms: float = 200.0  #: how long the step's straggler sleeps before its allreduce
    noise: float = 1.0  #: label noise (standard deviation); the best loss is its square
    target: float = 4.0  #: the validation loss to reach, as a multiple of ``noise ** 2``
    lr: float | None = None  #: ``None``: :func:`~fabricd.demo.hyperplane.default_lr`
    sync_every: int = 10  #: partial modes: average the replicas every this many steps
    validation: int = 1024  #: points in the held-out set
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.ranks < 2:
            raise DemoFailed("the demo needs at least 2 ranks (nodes x ranks per node)")
        if self.batch < self.ranks or self.steps < 1 or self.sync_every < 1:
            raise DemoFailed(
                "need a batch of at least one point per rank, steps >= 1 and sync_every >= 1"
            )
        if self.dim < 1 or self.validation < 1 or self.delay_ms < 0 or self.noise <= 0:
            raise DemoFailed("need dim >= 1, validation >= 1, delay_ms >= 0 and noise > 0")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def local_batch(self) -> int:
        """Points per rank and step (the remainder of ``batch / ranks`` is not drawn)."""
        return self.batch // self.ranks

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else default_lr(self.dim, self.batch)

    @property
    def target_loss(self) -> float:
        return self.target * self.noise**2


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeResult:
    """One mode's run, as rank 0 saw it."""

    mode: str
    steps: int
    seconds: float  #: from the start barrier to the end of rank 0's last step
    steps_per_s: float
    time_to_target: float | None  #: seconds until the validation loss first reached the target
    initial_loss: float
    final_loss: float
    mean_active: float  #: ``Result.active`` averaged over rank 0's allreduce calls
    #: ``(seconds, validation loss)``: before the first step, then after each of rank 0's calls
    history: list[tuple[float, float]] = field(default_factory=list)
    #: why the validation loss did not reach the target (:func:`why_missed`); None if it did
    missed: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    settings: Settings
    modes: list[ModeResult]

    @property
    def target_loss(self) -> float:
        return self.settings.target_loss

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": {**asdict(self.settings), "lr": self.settings.step_size},
            "ranks": self.settings.ranks,
            "target_loss": self.target_loss,
            "modes": [asdict(m) for m in self.modes],
        }


def parse_modes(text: str) -> list[Mode]:
    """``"sync,solo"`` -> ``["sync", "solo"]``, in the order given.

    Raises:
        DemoFailed: no mode, or one that is not in :data:`MODES`.
    """
    known: dict[str, Mode] = {m: m for m in MODES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise DemoFailed(f"modes are some of {', '.join(MODES)}, not {text!r}")
    return [known[n] for n in names]


def train(
    fab: Client,
    problem: Hyperplane,
    settings: Settings,
    mode: Mode,
    report: Callable[[Report], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """The body of every rank: (eager-)SGD in ``mode`` until the job's allreduce ran
    ``settings.steps`` rounds.

    Steps are counted in rounds (``Result.round``), not in calls: a rank that a partial round
    left behind more than once gets the latest result at once, so its calls outnumber the
    rounds it saw; a count of calls would send it into rounds that a majority round's
    initiator, done with its own count, never starts.  Every rank sees every round number up
    to the last or a later one, so all of them stop, and each averages the replicas
    (``sync_model``) once per ``sync_every`` rounds it saw up to the last, and after the last:
    the same number of times.  The straggler of round ``r`` sleeps before the call it makes
    for round ``r``.

    Rank 0 passes ``report``: it gets the loss before the first step (as round -1, with every
    rank active) and after each call.  Every rank ends in a barrier, so that no rank leaves
    while another still waits in a training collective: a rank that leaves fails the open
    calls of a sync one.
    """
    rank, size = fab.rank, fab.size
    model = fab.array("model", (problem.parameters,), "float32")
    grad = fab.array("grad", (problem.parameters,), "float32")
    fab.broadcast(model, root=0, timeout=_WAIT)  # rank 0's initial model (zeros) for everyone
    held_out = problem.validation(settings.validation) if report is not None else None
    lr = settings.step_size

    def tell(seen: int, seconds: float, active: int) -> None:
        if report is not None and held_out is not None:
            report((seen, seconds, loss(model, *held_out), active))

    fab.barrier(timeout=_WAIT)
    start = clock()
    tell(-1, 0.0, size)
    seen = -1  # the last round whose result this rank got
    calls = synced = 0
    while seen < settings.steps - 1:
        x, y = problem.batch(calls, rank, settings.local_batch)
        calls += 1
        gradient(model, x, y, out=grad)
        if settings.delay_ms and problem.straggler(seen + 1, size) == rank:
            sleep(settings.delay_ms / 1000)
        result = fab.allreduce(grad, op="avg", mode=mode, timeout=_WAIT)
        seen = max(seen, result.round)
        model -= lr * grad
        if mode != "sync":
            while synced < _averages(seen, settings):
                fab.sync_model(model, timeout=_WAIT)
                synced += 1
        tell(seen, clock() - start, result.active)
    # Nobody leaves before every rank is done training.  A rank whose node finished this
    # barrier may leave while another node still runs it, and the daemons fail a sync
    # collective's open calls when a rank of the job leaves, even one that gave its part:
    # here that only says everybody is past training.
    with contextlib.suppress(PeerFailed):
        fab.barrier(name="end", timeout=_WAIT)


def _averages(seen: int, settings: Settings) -> int:
    """How many times a partial mode's replicas are averaged once round ``seen`` ended: every
    ``sync_every`` rounds, and after the last, so that the job ends with one model."""
    done = min(seen + 1, settings.steps)
    return done // settings.sync_every + (done == settings.steps and done % settings.sync_every > 0)


def summarize(mode: str, settings: Settings, reports: Sequence[Report]) -> ModeResult:
    """Rank 0's reports of one run (the first before any step) as a :class:`ModeResult`.

    ``mean_active`` averages ``Result.active`` over the distinct rounds rank 0 saw (a late
    call's result repeats a round another call may have seen too).
    """
    if len(reports) < 2 or reports[-1][0] < settings.steps - 1:
        last = reports[-1][0] if reports else -1
        raise DemoFailed(f"{mode}: rank 0 saw round {last}, not {settings.steps - 1}")
    history = [(seconds, value) for _, seconds, value, _ in reports]
    reached = next((s for s, value in history if value <= settings.target_loss), None)
    active = {seen: count for seen, _, _, count in reports[1:]}
    mean_active = sum(active.values()) / len(active)
    seconds = reports[-1][1]
    return ModeResult(
        mode=mode,
        steps=settings.steps,
        seconds=seconds,
        steps_per_s=settings.steps / seconds if seconds > 0 else math.inf,
        time_to_target=reached,
        initial_loss=history[0][1],
        final_loss=history[-1][1],
        mean_active=mean_active,
        history=history,
        missed=None if reached is not None else why_missed(history, settings, mean_active),
    )


#: a loss that changed less than this share over the last quarter of a run levelled off
_LEVEL: Final = 0.05


def why_missed(
    history: Sequence[tuple[float, float]], settings: Settings, mean_active: float
) -> str:
    """Why a run's validation loss (``history``: (seconds, loss), the first before any step)
    stayed above the target, as the curve shows it, and what to change.

    The curve's last quarter tells the cases apart: still falling (the run was too short),
    risen from its lowest (the step, or replicas that drifted, pushed it back up), or level (a
    floor above the target: the learning rate and the fresh gradients per round set it).
    """
    target = settings.target_loss
    final = history[-1][1]
    if not math.isfinite(final):
        return f"the loss diverged ({final}): a smaller learning rate"
    quarter = history[max(0, len(history) - 1 - max(1, (len(history) - 1) // 4))][1]
    lowest, when = min((value, seconds) for seconds, value in history)
    above = f"{final:.3g}, above the target {target:.3g}"
    if final < quarter * (1 - _LEVEL):
        return (
            f"still falling at the last step ({quarter:.3g} -> {final:.3g} over the last "
            f"quarter of the steps): more --steps, or a larger --target"
        )
    if final > lowest * (1 + _LEVEL):
        cause = "the step is too large"
        if settings.ranks > mean_active:
            cause += f", or the replicas drifted apart (--sync-every {settings.sync_every})"
        return f"rose from its lowest, {lowest:.3g} at {when:.1f} s, to {above}: {cause}"
    fresh = f"{mean_active:.3g} of {settings.ranks} ranks' gradients fresh per round"
    return f"levelled off at {above}, with this learning rate and {fresh}"


def _rank_main(
    socket_path: str, rank: int, reports: Queue[Any], job: str, settings: Settings, mode: Mode
) -> None:
    """A rank's process (under :func:`run_ranks`): train; rank 0 reports its steps."""
    problem = Hyperplane(settings.dim, settings.noise, settings.seed)
    with connect(job=job, rank=rank, size=settings.ranks, socket_path=socket_path) as fab:
        report = (lambda r: reports.put(("report", r))) if rank == 0 else None
        train(fab, problem, settings, mode, report)


def run_mode(
    cluster: LocalCluster,
    settings: Settings,
    mode: Mode,
    progress: Callable[[Mode, Report], None] | None = None,
) -> ModeResult:
    """One run of the job in ``mode`` on a started ``cluster`` (:func:`run_ranks`).

    Raises:
        DemoFailed: a rank failed or the run outlived its deadline; every rank is stopped.
    """
    steps: list[Report] = []

    def collect(report: Any) -> None:
        steps.append(report)
        if progress is not None:
            progress(mode, report)

    job = f"hyperplane-{mode}-{uuid.uuid4().hex[:8]}"
    # generous: the straggler's sleeps, and every rank slowed by the ranks sharing its cores
    seconds = 60 + settings.steps * (settings.delay_ms / 1000 + 5)
    run_ranks(
        cluster,
        settings.ranks_per_node,
        settings.ranks,
        _rank_main,
        (job, settings, mode),
        seconds=seconds,
        what=mode,
        collect=collect,
    )
    return summarize(mode, settings, steps)


def run_ranks(
    cluster: LocalCluster,
    ranks_per_node: int,
    size: int,
    body: Callable[..., None],
    args: tuple[Any, ...],
    *,
    seconds: float,
    what: str,
    collect: Callable[[Any], None],
) -> None:
    """Run a job of ``size`` ranks on a started ``cluster``: one spawned process per rank,
    rank ``r`` a client of node ``r // ranks_per_node``, running
    ``body(socket_path, rank, reports, *args)``.  What a rank puts on ``reports`` as
    ``("report", x)`` reaches ``collect(x)`` here, in order per rank; a rank that raises tells
    this process before it exits.

    Raises:
        DemoFailed: a rank failed, or the job outlived ``seconds`` (``what`` names the job);
            every rank is stopped.
    """
    context = multiprocessing.get_context("spawn")
    reports: Queue[Any] = context.Queue()
    workers = [
        context.Process(
            target=_rank_process,
            daemon=True,
            args=(body, cluster.nodes[rank // ranks_per_node].socket_path, rank, reports, *args),
        )
        for rank in range(size)
    ]
    deadline = time.monotonic() + seconds
    try:
        for worker in workers:
            worker.start()
        while any(w.exitcode is None for w in workers) or not reports.empty():
            if time.monotonic() > deadline:
                raise DemoFailed(f"{what}: the run did not finish in time")
            with contextlib.suppress(queue.Empty):
                kind, *message = reports.get(timeout=0.1)
                if kind == "error":
                    raise DemoFailed(f"{what}: rank {message[0]} failed: {message[1]}")
                collect(message[0])
            failed = [r for r, w in enumerate(workers) if w.exitcode not in (None, 0)]
            if failed and reports.empty():
                raise DemoFailed(
                    f"{what}: rank {failed[0]} exited with {workers[failed[0]].exitcode}"
                )
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
            worker.join()
        reports.close()


def _rank_process(
    body: Callable[..., None], socket_path: str, rank: int, reports: Queue[Any], *args: Any
) -> None:
    """A rank's process: run ``body``, and tell the launcher of a failure before exiting
    with it."""
    try:
        body(socket_path, rank, reports, *args)
    except BaseException as exc:
        last = traceback.format_exception_only(exc)[-1].strip()
        reports.put(("error", rank, last))
        raise


def run(
    settings: Settings,
    modes: Iterable[Mode] = MODES,
    progress: Callable[[Mode, Report], None] | None = None,
) -> DemoResult:
    """Start a fabric, run the job once per mode on it, stop it; ``progress(mode, report)``
    after each of rank 0's steps.

    Raises:
        DemoFailed: a rank failed.
        ClusterError: the daemons did not start.
    """
    results = []
    with LocalCluster(settings.nodes) as cluster:
        cluster.wait_connected()
        for mode in modes:
            results.append(run_mode(cluster, settings, mode, progress))
    return DemoResult(settings=settings, modes=results)


def speedups(
    settings: Settings,
    delays_ms: Sequence[float] = (200.0, 300.0, 400.0),
    modes: Sequence[Mode] = ("solo", "majority"),
    progress: Callable[[str], None] | None = None,
) -> dict[float, dict[str, ModeResult]]:
    """Each delay's run of sync and of each of ``modes``, on one fabric (eager-SGD §6.2.1's
    throughput comparison): ``{delay: {mode: result}}``; a mode's speedup over sync is its
    ``steps_per_s`` over sync's from the same delay."""
    out: dict[float, dict[str, ModeResult]] = {}
    with LocalCluster(settings.nodes) as cluster:
        cluster.wait_connected()
        for delay in delays_ms:
            at = replace(settings, delay_ms=delay)
            out[delay] = {}
            order: tuple[Mode, ...] = ("sync", *modes)
            for mode in order:
                result = run_mode(cluster, at, mode)
                out[delay][mode] = result
                if progress is not None:
                    progress(f"{delay:g} ms, {mode}: {result.steps_per_s:.3g} steps/s")
    return out
