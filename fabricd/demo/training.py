"""The main job (``make demo`` / ``fabricctl demo``): eager-SGD hyperplane regression on a fabric.

The experiment of eager-SGD §6.2.1 (:mod:`fabricd.demo.hyperplane`), data-parallel over the
ranks of a local fabric: ``LocalCluster(nodes)`` on loopback, ``ranks_per_node`` processes per
daemon, the total batch split evenly over the ranks.

**Emulated compute.**  The paper runs one rank per P100 node (its Table 1; 8 nodes here), so
a rank's step takes its device's time whatever the other ranks do.  Here 8 ranks share a
machine's cores, and the real gradient (0.15 ms at the paper's sizes, from a shard of the
training set drawn before the clock starts) is not what a step costs: every rank's step
lasts ``compute_ms`` of wall time from the end of its previous call to its next one, the real
math done within it and the rest slept, the way a rank waits for its accelerator.  Sleeping
ranks leave the cores to the daemons, so 8 ranks on 2 cores stand for 8 accelerators as long
as the daemons' work fits in the idle time (it does at 32 KiB a round).

The default, 300 ms, is the paper's step as its Fig. 10 implies it; the paper states no step
time.  Under this job's imbalance (one rank in 8 sleeps ``d`` at each step, its step ``c + d``
where every other rank's is ``c``), synch-SGD's step is ``c + d`` and a solo rank's is
``c + d / 8`` on average, so solo's speedup is ``(c + d) / (c + d / 8)``: 1.54x, 1.78x and 2.00x
at ``c`` = 300 ms for ``d`` = 200, 300 and 400 ms, against the paper's 1.50x, 1.75x and 2.01x
(no single ``c`` fits better).  The paper's other clue, eager-SGD at 400 ms making 3.8x the
0.64 steps/s of one GPU (2.43 steps/s, 411 ms a step, so ``c`` = 361 ms by the same count), is
within a fifth of it.

**Imbalance** (the paper's injected delays, slept after the step's compute and before its
allreduce): ``"one"`` (§6.2.1, Fig. 10): at every step one rank, the same one for every rank
by the shared seed, sleeps ``delay_ms``; ``"severe"`` (§6.2.3): every rank sleeps at every
step, rank ``r`` at step ``t`` ``delay_ms * (1 + (r + t) mod ranks) / ranks`` -- 50 to 400 ms
for 8 ranks at 400, shifted by one rank after each step.

The job runs once per mode on the same fabric:

* ``sync``: ``fab.allreduce(g, op="avg")`` waits for every rank, so every step waits for the
  straggler (synch-SGD);
* ``solo`` and ``majority``: the partial allreduce does not wait for it; its gradient goes into
  a later round (eager-SGD, Algorithm 5: every rank updates with the averaged gradient), and
  ``fab.sync_model(w)`` once every ``sync_every`` rounds averages the replicas, which partial
  rounds let drift (eager-SGD §5).

A run stops after a fixed number of steps, counted in allreduce rounds (:func:`train` says why
not in calls), not after a time budget: a stop on each rank's own clock would leave ranks
disagreeing on which round is the last.  The clock starts after a barrier, once every rank has
joined, drawn its shard and rank 0 has the held-out set; rank 0 measures the validation loss
of its replica after every call (within its next step's compute time).  Rank 0 reports after
every call to this process, which draws the progress; every rank reports its
:class:`~fabricd.demo.measures.Tally` at the end, or its failure.  What a run measured (time
to the target loss, gradients per second per rank, rounds per second) is
:mod:`fabricd.demo.measures`'s arithmetic.
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
from typing import TYPE_CHECKING, Any, Final, Literal

from fabricd.client import connect
from fabricd.daemon.launcher import LocalCluster
from fabricd.demo import measures
from fabricd.demo.hyperplane import Hyperplane, Shard, default_lr, gradient, loss
from fabricd.demo.measures import Tally
from fabricd.errors import FabricError, PeerFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from multiprocessing.queues import Queue

    from fabricd.client import Client
    from fabricd.client.collectives import Late, Mode

MODES: Final[tuple[Mode, ...]] = ("sync", "solo", "majority")
#: the injected delays: one rank late per step (§6.2.1), or every rank, by 50-400 ms (§6.2.3)
Imbalance = Literal["one", "severe"]
IMBALANCES: Final[tuple[Imbalance, ...]] = ("one", "severe")
#: a collective call that takes longer than this failed (a straggler sleeps well under a second)
_WAIT: Final = 120.0

#: rank 0's report after a call: (the round it saw, seconds since the start, validation loss,
#: Result.active)
Report = tuple[int, float, float, int]


class DemoFailed(FabricError):
    """A rank of the demo failed (the message carries its traceback's last line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What one run trains, and how.  The defaults are eager-SGD §6.2.1's job (8 ranks, 8,192
    dimensions, a batch of 2,048, a training set of 32,768 points) with the paper's 300 ms
    step emulated (the module docstring).

    A sync run is 50 rounds, which it needs about 40 of to reach the default target; solo runs
    1.6 and majority 2.8 times as many (:meth:`rounds`), since their rounds hold fewer fresh
    gradients: measured, solo needed 55-65 rounds and majority 85-105, at 2-3 and 3-4.5 rounds
    a second.  So each run lasts long enough for its mode to reach the target if it can (time
    to target does not depend on how long a run goes on after it).

    The partial modes average the replicas every 160 rounds, the paper's every 10 epochs, so
    only after the last here: with ``late="sum"`` (issue 23, item 2) no rank skips a result.
    With ``late="latest"`` ranks out of step skip results often enough that every 10 rounds
    does better (solo's loss levelled off at 300-900 with only the last average; 400 ms,
    40-60 rounds); measured, the sum with the paper's averaging reached the target 21% (solo)
    and 30% (majority) sooner at 400 ms (docs/performance.md, (k))."""

    nodes: int = 4
    ranks_per_node: int = 2
    dim: int = 8192
    batch: int = 2048  #: in all; each rank trains on ``batch // ranks``
    train_points: int = 32768  #: the training set, in all; each rank holds ``1 / ranks`` of it
    steps: int = 50  #: allreduce rounds of a sync run (:meth:`rounds`)
    solo_factor: float = 1.6  #: a solo run's rounds, as a multiple of ``steps``
    majority_factor: float = 2.8  #: a majority run's rounds, as a multiple of ``steps``
    #: a rank's step, from the end of its previous allreduce to its next, in milliseconds of
    #: wall time: its device time, emulated (module docstring); the real math is done within
    compute_ms: float = 300.0
    #: ``"one"``: the step's straggler sleeps ``delay_ms``; ``"severe"``: every rank sleeps,
    #: up to ``delay_ms`` (the module docstring)
    imbalance: Imbalance = "one"
    delay_ms: float = 200.0
    noise: float = 1.0  #: label noise (standard deviation); the best loss is its square
    target: float = 4.0  #: the validation loss to reach, as a multiple of ``noise ** 2``
    lr: float | None = None  #: ``None``: :func:`~fabricd.demo.hyperplane.default_lr`
    #: partial modes: average the replicas every this many steps (the paper: every 10 epochs,
    #: 160 steps; with late="latest" 10 does better, as ranks then skip results)
    sync_every: int = 160
    validation: int = 1024  #: points in the held-out set
    seed: int = 0
    #: partial modes: what a rank that missed rounds gets (``fab.allreduce(..., late=...)``):
    #: ``"sum"`` of the results it missed (the default), or the ``"latest"`` only
    late: Late = "sum"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.ranks < 2:
            raise DemoFailed("the demo needs at least 2 ranks (nodes x ranks per node)")
        if self.batch < self.ranks or self.steps < 1 or self.sync_every < 1:
            raise DemoFailed(
                "need a batch of at least one point per rank, steps >= 1 and sync_every >= 1"
            )
        if self.dim < 1 or self.validation < 1 or self.delay_ms < 0 or self.noise <= 0:
            raise DemoFailed("need dim >= 1, validation >= 1, delay_ms >= 0 and noise > 0")
        if self.solo_factor <= 0 or self.majority_factor <= 0:
            raise DemoFailed("need solo_factor > 0 and majority_factor > 0")
        if self.compute_ms < 0 or self.imbalance not in IMBALANCES:
            raise DemoFailed(
                f"need compute_ms >= 0 and an imbalance of {', '.join(IMBALANCES)}, "
                f"not {self.compute_ms}, {self.imbalance!r}"
            )
        if self.shard_points < self.local_batch:
            raise DemoFailed(
                f"a training set of {self.train_points} points leaves each of {self.ranks} "
                f"ranks less than its batch of {self.local_batch}"
            )

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def local_batch(self) -> int:
        """Points per rank and step (the remainder of ``batch / ranks`` is not drawn)."""
        return self.batch // self.ranks

    def rounds(self, mode: Mode) -> int:
        """How many allreduce rounds a run in ``mode`` trains (at least ``steps``)."""
        factor = {"solo": self.solo_factor, "majority": self.majority_factor}.get(mode, 1.0)
        return max(self.steps, math.ceil(self.steps * factor - 1e-9))  # 50 x 1.6 is 80

    def run_of(self, mode: Mode) -> Settings:
        """The settings of one run in ``mode``: ``steps`` is its :meth:`rounds`."""
        return replace(self, steps=self.rounds(mode), solo_factor=1.0, majority_factor=1.0)

    @property
    def lateness(self) -> str:
        """The imbalance in words, e.g. ``one rank 200 ms late at every step``."""
        if self.imbalance == "severe":
            return f"every rank late at every step, by up to {self.delay_ms:g} ms"
        return f"one rank {self.delay_ms:g} ms late at every step"

    @property
    def shard_points(self) -> int:
        """Training points per rank."""
        return self.train_points // self.ranks

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else default_lr(self.dim, self.batch)

    @property
    def target_loss(self) -> float:
        return self.target * self.noise**2


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeResult:
    """One mode's run: rank 0's clock and losses, every rank's rounds
    (:mod:`fabricd.demo.measures` defines the figures)."""

    mode: str
    steps: int
    seconds: float  #: from the start barrier to the end of rank 0's last step
    #: seconds until rank 0's validation loss first reached the target (the headline)
    time_to_target: float | None
    gradients_per_s: float  #: gradients that entered a result, per rank and second
    rounds_per_s: float  #: allreduce rounds per second (a partial round holds fewer gradients)
    initial_loss: float
    final_loss: float
    mean_active: float  #: ``Result.active`` averaged over the job's rounds
    unseen_rounds: int = 0  #: rounds no rank's call got (not counted in ``gradients_per_s``)
    skipped_results: float = 0.0  #: rounds whose result a rank's calls did not get, per rank
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


def allreduce_options(settings: Settings, mode: Mode) -> dict[str, Any]:
    """The keyword arguments of every training allreduce, the one place that builds them."""
    return {"op": "avg", "mode": mode, "timeout": _WAIT, "late": settings.late}


def injected_delay(settings: Settings, problem: Hyperplane, step: int, rank: int) -> float:
    """Seconds ``rank`` sleeps before its allreduce for round ``step`` (the module docstring's
    imbalance)."""
    if settings.imbalance == "severe":
        share = (1 + (rank + step) % settings.ranks) / settings.ranks
        return settings.delay_ms * share / 1000
    late = settings.delay_ms and problem.straggler(step, settings.ranks) == rank
    return settings.delay_ms / 1000 if late else 0.0


def train(
    fab: Client,
    problem: Hyperplane,
    settings: Settings,
    mode: Mode,
    report: Callable[[Report], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> Tally:
    """The body of every rank: (eager-)SGD in ``mode`` until the job's allreduce ran
    ``settings.steps`` rounds; returns the rank's :class:`Tally`.

    A step: the gradient on the step's batch of the rank's shard, a sleep to the end of the
    step's ``compute_ms`` (counted from the end of the previous step), the injected delay,
    the allreduce, the update (and, in partial modes, the models' average when one is due).

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
    shard = Shard(problem, rank, settings.shard_points, settings.local_batch)
    fab.broadcast(model, root=0, timeout=_WAIT)  # rank 0's initial model (zeros) for everyone
    held_out = problem.validation(settings.validation) if report is not None else None
    lr = settings.step_size
    options = allreduce_options(settings, mode)
    compute = settings.compute_ms / 1000

    def tell(seen: int, seconds: float, active: int) -> None:
        if report is not None and held_out is not None:
            report((seen, seconds, loss(model, *held_out), active))

    fab.barrier(timeout=_WAIT)
    start = ended = clock()
    tell(-1, 0.0, size)
    seen = -1  # the last round whose result this rank got
    calls = synced = 0
    rounds: dict[int, int] = {}
    summed: set[int] = set()  #: rounds that reached this rank inside a late call's sum
    while seen < settings.steps - 1:
        gradient(model, *shard.batch(calls), out=grad)
        if compute > 0:  # the rest of the step's device time
            sleep(max(0.0, ended + compute - clock()))
        delay = injected_delay(settings, problem, seen + 1, rank)
        if delay > 0:
            sleep(delay)
        result = fab.allreduce(grad, **options)
        calls += 1
        rounds[result.round] = result.active
        summed.update(range(result.round - result.results + 1, result.round))
        seen = max(seen, result.round)
        model -= lr * grad
        if mode != "sync":
            while synced < _averages(seen, settings):
                fab.sync_model(model, timeout=_WAIT)
                synced += 1
        ended = clock()
        tell(seen, ended - start, result.active)
    # Nobody leaves before every rank is done training.  A rank whose node finished this
    # barrier may leave while another node still runs it, and the daemons fail a sync
    # collective's open calls when a rank of the job leaves, even one that gave its part:
    # here that only says everybody is past training.
    with contextlib.suppress(PeerFailed):
        fab.barrier(name="end", timeout=_WAIT)
    return Tally(rank=rank, calls=calls, rounds=rounds, summed=frozenset(summed))


def _averages(seen: int, settings: Settings) -> int:
    """How many times a partial mode's replicas are averaged once round ``seen`` ended: every
    ``sync_every`` rounds, and after the last, so that the job ends with one model."""
    done = min(seen + 1, settings.steps)
    return done // settings.sync_every + (done == settings.steps and done % settings.sync_every > 0)


def summarize(
    mode: str, settings: Settings, reports: Sequence[Report], tallies: Sequence[Tally] = ()
) -> ModeResult:
    """Rank 0's reports of one run (the first before any step) and the ranks' tallies as a
    :class:`ModeResult`.

    The rounds counted are every round a rank's call got, rank 0's from its reports and the
    others' from ``tallies`` (a late call's result repeats a round another call may have got
    too: each counts once).
    """
    if len(reports) < 2 or reports[-1][0] < settings.steps - 1:
        last = reports[-1][0] if reports else -1
        raise DemoFailed(f"{mode}: rank 0 saw round {last}, not {settings.steps - 1}")
    history = [(seconds, value) for _, seconds, value, _ in reports]
    reached = measures.time_to_target(history, settings.target_loss)
    own = Tally(rank=0, calls=len(reports) - 1, rounds={r[0]: r[3] for r in reports[1:]})
    rounds = measures.merge_rounds([own, *tallies])
    active = measures.mean_active(rounds, settings.steps)
    skips = measures.skipped(tallies or [own], settings.steps)
    seconds = reports[-1][1]
    return ModeResult(
        mode=mode,
        steps=settings.steps,
        seconds=seconds,
        time_to_target=reached,
        gradients_per_s=measures.gradients_per_second(
            rounds, settings.steps, settings.ranks, seconds
        ),
        rounds_per_s=settings.steps / seconds if seconds > 0 else math.inf,
        initial_loss=history[0][1],
        final_loss=history[-1][1],
        mean_active=active,
        unseen_rounds=measures.unseen(rounds, settings.steps),
        skipped_results=skips,
        history=history,
        missed=None if reached is not None else why_missed(history, settings, active, skips),
    )


#: a loss that changed less than this share over the last quarter of a run levelled off
_LEVEL: Final = 0.05


def why_missed(
    history: Sequence[tuple[float, float]],
    settings: Settings,
    mean_active: float,
    skipped: float = 0.0,
) -> str:
    """Why a run's validation loss (``history``: (seconds, loss), the first before any step)
    stayed above the target, as the curve shows it, and what to change.

    The curve's last quarter tells the cases apart: still falling (the run was too short),
    risen from its lowest (the step, or replicas that drifted, pushed it back up), or level (a
    floor above the target: the learning rate and the fresh gradients per round set it, or
    the results the ranks skipped, ``skipped`` a rank: each is an update a replica never
    applied).
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
    if skipped >= 1 and settings.late == "latest":  # (under "sum" skipped rounds are summed)
        return (
            f"levelled off at {above}: each rank skipped {skipped:.3g} of {settings.steps} "
            f"rounds' results (a rank left behind gets the latest only), so the replicas "
            f"drift apart between averages (--sync-every {settings.sync_every}); {fresh}"
        )
    return f"levelled off at {above}, with this learning rate and {fresh}"


def _rank_main(
    socket_path: str, rank: int, reports: Queue[Any], job: str, settings: Settings, mode: Mode
) -> None:
    """A rank's process (under :func:`run_ranks`): train; rank 0 reports its steps, and
    every rank its tally at the end."""
    problem = Hyperplane(settings.dim, settings.noise, settings.seed)
    with connect(job=job, rank=rank, size=settings.ranks, socket_path=socket_path) as fab:
        report = (lambda r: reports.put(("report", r))) if rank == 0 else None
        tally = train(fab, problem, settings, mode, report)
    reports.put(("report", tally))


def run_mode(
    cluster: LocalCluster,
    settings: Settings,
    mode: Mode,
    progress: Callable[[Mode, Report], None] | None = None,
) -> ModeResult:
    """One run of the job in ``mode`` on a started ``cluster`` (:func:`run_ranks`), for
    ``settings.rounds(mode)`` rounds.

    Raises:
        DemoFailed: a rank failed or the run outlived its deadline; every rank is stopped.
    """
    settings = settings.run_of(mode)
    steps: list[Report] = []
    tallies: list[Tally] = []

    def collect(report: Any) -> None:
        if isinstance(report, Tally):
            tallies.append(report)
            return
        steps.append(report)
        if progress is not None:
            progress(mode, report)

    job = f"hyperplane-{mode}-{uuid.uuid4().hex[:8]}"
    # generous: the step's compute and delays, and every rank slowed by the others' load
    seconds = 60 + settings.steps * ((settings.compute_ms + settings.delay_ms) / 1000 + 5)
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
    return summarize(mode, settings, steps, tallies)


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
