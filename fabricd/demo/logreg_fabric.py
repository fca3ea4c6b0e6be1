"""The logistic regression of :mod:`fabricd.demo.logreg` through ``fab.parameter_server`` on a
local fabric (issue 12, item 7): one server process and ``workers`` worker processes.

Each case (a consistency model and a filter setting, :class:`Case`) is a job of its own on the
same ``LocalCluster(nodes)``, launched by :func:`fabricd.demo.training.run_ranks` as the other
demos' ranks are: rank 0 serves the model (the ``sgd`` rule with ``lr``; its state lives in its
daemon while the process stays connected), ranks ``1 .. workers`` each run
:func:`~fabricd.demo.logreg.train_worker` on their shard.  The data set is made once by the
parent and saved as ``.npy`` files that every rank maps (:func:`save_dataset`), so no rank
spends seconds drawing it again.

Stragglers: worker ``w`` sleeps ``delays_ms[w]`` milliseconds before each push (more compute
than the others), so the workers run at different speeds, as the in-process driver's periods
make them (:mod:`fabricd.demo.logreg_inproc`): under SSP the fast ones run ahead and the slow
ones' pushes land several versions late (the server's delay histogram counts them); under BSP
everyone waits for the slowest.

What a run reports (:class:`CaseResult`) comes from the daemons' status rows
(``fab.status()``): each worker's ``ps_workers`` row, read by the worker itself once it has
trained (push bytes sent and their unfiltered, dense equivalent; pull bytes received and the
whole-model equivalent; the filters' counts; drops by the delay bound), and the server's
``ps_servers`` row, read once every worker has trained (the delay histogram, drops).  Then
worker 1 pulls the final model and measures its accuracy and log loss on the test set; that
pull is not in the rows.  The training time is the slowest worker's, from the start barrier to
its last push returning.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.client import connect
from fabricd.daemon.launcher import LocalCluster
from fabricd.demo import logreg
from fabricd.demo.training import DemoFailed, run_ranks
from fabricd.engines.ps.consistency import DELAY_BUCKETS
from fabricd.engines.ps.filters import FilterSettings
from fabricd.errors import PeerFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from multiprocessing.queues import Queue

    from fabricd.client import Client, ParameterServer

Array = np.ndarray[Any, Any]

#: the model's name in every job
MODEL: Final = "logreg"
#: a barrier, push or pull that takes longer than this failed (a held SSP pull waits for the
#: slowest worker, a fraction of a second)
_WAIT: Final = 120.0
#: the arrays of a :class:`~fabricd.demo.logreg.Rows`, as :func:`save_dataset` names them
_ROWS: Final = ("indptr", "indices", "values", "labels")


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One job: a consistency model and the filters."""

    consistency: str = "bsp"  #: "bsp", "ssp" or "async"
    staleness: int = 0
    delay_bound: int | None = None  #: async's tau_max
    filters: FilterSettings = field(default_factory=FilterSettings)
    label: str = "unfiltered"  #: what ``filters`` are, for tables

    @property
    def model(self) -> str:
        """The consistency as a table says it: ``bsp``, ``ssp4``, ``async``."""
        return f"ssp{self.staleness}" if self.consistency == "ssp" else self.consistency


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The fabric, the data, and the training, the same for every case."""

    nodes: int = 3
    ranks_per_node: int = 2  #: rank ``r`` is a client of node ``r // ranks_per_node``
    workers: int = 4
    features: int = 200_000
    samples: int = 60_000
    test: int = 10_000
    iterations: int = 500  #: per worker
    batch: int = 256  #: rows per worker per iteration
    lr: float = 16.0
    #: per worker, milliseconds slept before each push (the stragglers); () for none
    delays_ms: tuple[float, ...] = ()
    seed: int = 0  #: of the data and of G-RP

    def __post_init__(self) -> None:
        if self.workers < 1 or self.nodes < 1 or self.ranks_per_node < 1:
            raise DemoFailed("need a worker, a node and a rank per node at least")
        if self.nodes * self.ranks_per_node < self.ranks:
            raise DemoFailed(f"{self.ranks} ranks do not fit on {self.nodes} nodes")
        if self.delays_ms and len(self.delays_ms) != self.workers:
            raise DemoFailed(f"one delay per worker ({self.workers}), not {self.delays_ms}")

    @property
    def ranks(self) -> int:
        """The server and the workers."""
        return 1 + self.workers

    def delay(self, worker: int) -> float:
        """Worker ``worker``'s (0-based) sleep before each push, in seconds."""
        return self.delays_ms[worker] / 1000 if self.delays_ms else 0.0

    def dataset(self) -> logreg.Dataset:
        return logreg.make_dataset(
            features=self.features, samples=self.samples, test=self.test, seed=self.seed
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseResult:
    """One job's figures: byte counts and drops from the daemons' rows, the final model's
    test figures, the training time."""

    case: Case
    push_bytes: int  #: the workers' pushes as sent
    push_dense_bytes: int  #: the same pushes unfiltered: dense, in the model's dtype
    pull_bytes: int  #: the replies the workers' pulls received
    pull_dense_bytes: int  #: a whole-model reply for each of those pulls
    pushes: int
    pulls: int
    considered: int  #: gradient elements the workers' filters saw
    pushed: int  #: of them, those that went out (the rest is held for later pushes)
    applied: int  #: updates the server applied
    version: int  #: the server's model version at the end
    delays: tuple[int, ...]  #: applied updates per delay bucket (DELAY_BUCKETS)
    delay_sum: int
    dropped_worker: int  #: updates the delay bound dropped at the workers
    dropped_server: int  #: ... and at the server
    accuracy: float
    log_loss: float
    seconds: float  #: the slowest worker's training time

    @property
    def mean_delay(self) -> float:
        """The mean delay (versions) of the applied updates."""
        return self.delay_sum / self.applied if self.applied else 0.0

    @property
    def max_delay(self) -> float:
        """The upper bound of the highest delay histogram bucket with an update in it (0: none
        was delayed; infinity: the last, open-ended bucket)."""
        filled = [i for i, n in enumerate(self.delays) if n]
        if not filled:
            return 0.0
        return float(DELAY_BUCKETS[filled[-1]]) if filled[-1] < len(DELAY_BUCKETS) else math.inf


def save_dataset(data: logreg.Dataset, folder: Path) -> None:
    """Write ``data``'s arrays to ``folder`` as ``.npy`` files, for :func:`load_dataset`."""
    for part, rows in (("train", data.train), ("test", data.test)):
        for name in _ROWS:
            np.save(folder / f"{part}-{name}.npy", getattr(rows, name))
    np.save(folder / "hidden.npy", data.hidden)


def load_dataset(folder: Path) -> logreg.Dataset:
    """The data set :func:`save_dataset` wrote to ``folder``, mapped read-only."""

    def rows(part: str, features: int) -> logreg.Rows:
        arrays = {n: np.load(folder / f"{part}-{n}.npy", mmap_mode="r") for n in _ROWS}
        return logreg.Rows(**arrays, features=features)

    hidden = np.load(folder / "hidden.npy", mmap_mode="r")
    return logreg.Dataset(
        train=rows("train", hidden.size), test=rows("test", hidden.size), hidden=hidden
    )


class _Straggler:
    """A worker's ``push``/``pull`` (:class:`~fabricd.demo.logreg.ParameterServer`) through the
    fabric: it sleeps ``delay`` seconds before each push, and passes the model and the gradient
    through two ``fab.array()`` buffers, so only what changed since the last pull travels into
    the model (the daemon applies each reply to the buffer the previous one went to)."""

    def __init__(self, fab: Client, ps: ParameterServer, size: int, delay: float) -> None:
        self._ps = ps
        self.model = fab.array("model", (size,), logreg.DTYPE)
        self._grad = fab.array("grad", (size,), logreg.DTYPE)
        self._delay = delay

    def push(self, update: Array) -> None:
        if self._delay:
            time.sleep(self._delay)
        np.copyto(self._grad, update)
        self._ps.push(self._grad, timeout=_WAIT)

    def pull(self, *, out: Array) -> int:
        version = self._ps.pull(self.model, timeout=_WAIT)
        np.copyto(out, self.model)
        return version


def _open(fab: Client, settings: Settings, case: Case, role: str) -> ParameterServer:
    return fab.parameter_server(
        MODEL,
        (settings.features,),
        logreg.DTYPE,
        role,
        servers=[0],
        consistency=case.consistency,
        staleness=case.staleness,
        delay_bound=case.delay_bound,
        update_rule="sgd",
        lr=settings.lr,
        filters=case.filters,
        seed=settings.seed,
        timeout=_WAIT,
    )


def _row(fab: Client, table: str, job: str, **match: int) -> dict[str, Any]:
    """This job's model's row of the daemon's ``table`` (``ps_servers`` or ``ps_workers``)
    whose fields equal ``match``."""
    rows = [
        r
        for r in fab.status()[table]
        if r["job"] == job and r["name"] == MODEL and all(r[k] == v for k, v in match.items())
    ]
    if len(rows) != 1:
        raise DemoFailed(f"{len(rows)} rows of {table} for {job}/{MODEL} {match}")
    return dict(rows[0])


def _rank_main(
    socket_path: str,
    rank: int,
    reports: Queue[Any],
    job: str,
    settings: Settings,
    case: Case,
    data_dir: str,
) -> None:
    """A rank's process: serve (rank 0) or train (the others) between barriers, then report
    ``(rank, figures)``: the server its status row; a worker its row and training time, and
    worker 1 the final model's test accuracy and log loss too."""
    data = load_dataset(Path(data_dir)) if rank else None
    with connect(job=job, rank=rank, size=settings.ranks, socket_path=socket_path) as fab:
        ps = _open(fab, settings, case, "server" if rank == 0 else "worker")
        figures: dict[str, Any] = {}
        fab.barrier(name="start", timeout=_WAIT)
        if data is not None:
            shard = data.train.shard(rank - 1, settings.workers)
            handle = _Straggler(fab, ps, settings.features, settings.delay(rank - 1))
            start = time.perf_counter()
            logreg.train_worker(handle, shard, iterations=settings.iterations, batch=settings.batch)
            figures["seconds"] = time.perf_counter() - start
            figures["row"] = _row(fab, "ps_workers", job, rank=rank)
        fab.barrier(name="trained", timeout=_WAIT)
        if data is None:  # every push is in: the server's counts are final
            if case.filters.lossless_publish:  # publish what the mode held back, exactly
                ps.flush(timeout=_WAIT)
            figures["row"] = _row(fab, "ps_servers", job, shard=0)
        fab.barrier(name="counted", timeout=_WAIT)
        if rank == 1 and data is not None:
            final = np.zeros(settings.features, logreg.DTYPE)
            handle.pull(out=final)
            figures["accuracy"] = logreg.accuracy(final, data.test)
            figures["log_loss"] = logreg.log_loss(final, data.test)
        # the server stays until the last pull is answered
        with contextlib.suppress(PeerFailed):
            fab.barrier(name="end", timeout=_WAIT)
    reports.put(("report", (rank, figures)))


def summarise(case: Case, figures: dict[int, dict[str, Any]]) -> CaseResult:
    """A :class:`CaseResult` from every rank's report (rank 0 the server's)."""
    server = figures[0]["row"]
    workers = [figures[r]["row"] for r in sorted(figures) if r]

    def total(key: str) -> int:
        return sum(int(w[key]) for w in workers)

    return CaseResult(
        case=case,
        push_bytes=total("push_bytes"),
        push_dense_bytes=total("push_dense_bytes"),
        pull_bytes=total("pull_bytes"),
        pull_dense_bytes=total("pull_dense_bytes"),
        pushes=total("pushes"),
        pulls=total("pulls"),
        considered=total("considered"),
        pushed=total("pushed"),
        applied=int(server["applied"]),
        version=int(server["version"]),
        delays=tuple(int(n) for n in server["delays"]),
        delay_sum=int(server["delay_sum"]),
        dropped_worker=total("delay_dropped"),
        dropped_server=int(server["dropped_delay"]),
        accuracy=float(figures[1]["accuracy"]),
        log_loss=float(figures[1]["log_loss"]),
        seconds=max(float(figures[r]["seconds"]) for r in figures if r),
    )


def run_case(cluster: LocalCluster, settings: Settings, case: Case, data_dir: Path) -> CaseResult:
    """One job of ``case`` on a started ``cluster``, the data set saved in ``data_dir``.

    Raises:
        DemoFailed: a rank failed, or the run outlived its (generous) deadline.
    """
    figures: dict[int, dict[str, Any]] = {}

    def collect(message: tuple[int, dict[str, Any]]) -> None:
        figures[message[0]] = message[1]

    what = f"{case.model}, {case.label}"
    run_ranks(
        cluster,
        settings.ranks_per_node,
        settings.ranks,
        _rank_main,
        (f"logreg-{uuid.uuid4().hex[:8]}", settings, case, str(data_dir)),
        # the ranks share this machine's cores: an iteration may take tens of milliseconds
        seconds=_WAIT + settings.iterations * (0.2 + max(settings.delays_ms, default=0) / 1000),
        what=what,
        collect=collect,
    )
    if sorted(figures) != list(range(settings.ranks)):
        raise DemoFailed(f"{what}: {len(figures)} of {settings.ranks} ranks reported")
    return summarise(case, figures)


def run(
    settings: Settings,
    cases: Sequence[Case],
    progress: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Make the data set, start a fabric, run each of ``cases`` on it, stop it;
    ``progress`` gets each result as it comes.

    Raises:
        DemoFailed: a rank failed.
        ClusterError: the daemons did not start.
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="fabricd-logreg-") as folder:
        save_dataset(settings.dataset(), Path(folder))
        with LocalCluster(settings.nodes) as cluster:
            cluster.wait_connected()
            for case in cases:
                result = run_case(cluster, settings, case, Path(folder))
                if progress is not None:
                    progress(result)
                results.append(result)
    return results
