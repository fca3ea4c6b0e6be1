"""The SVM job of :mod:`fabricd.demo.svm` on a local fabric, averaging with stochastic reduce.

ASAP §6's SVM experiments (Fig. 6/7: bytes and time to an accuracy over all-to-all, the root
expander and a chain; Fig. 10: NOTIFY-ACK against a barrier on the expander), data-parallel over
the ranks of ``LocalCluster(nodes)``: ``ranks_per_node`` processes per daemon (launched by
:func:`fabricd.demo.training.run_ranks`, as the eager-SGD demo's are), each training on its
shard and averaging its model with its in-neighbours' through
``fab.stochastic_reduce(model, graph=..., sync=...)`` once per round.  Each case (a graph and a
sync mode) is a job of its own on the same fabric, so every case starts from zero models.

Only :func:`fabric_reduce` calls the fabric's reduce; everything else is :func:`~fabricd.demo
.svm.train`, the loop :func:`~fabricd.demo.svm.simulate` runs in lockstep.  Every rank reports
its :class:`~fabricd.demo.svm.RankHistory` at the end; rank 0 reports each measurement as it
makes it, for progress.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import TYPE_CHECKING, Any, Final

from fabricd.client import connect
from fabricd.daemon.launcher import LocalCluster
from fabricd.demo.svm import DTYPE, History, Point, RankHistory, Settings, train
from fabricd.demo.training import DemoFailed, run_ranks
from fabricd.engines.stochastic import graphs
from fabricd.errors import PeerFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from multiprocessing.queues import Queue

    from fabricd.client import Client
    from fabricd.client.stochastic import Sync
    from fabricd.demo.svm import Array

#: the graphs of ASAP Fig. 6/7, in the order a run takes them (all-to-all: the baseline)
GRAPHS: Final = ("all-to-all", "expander", "chain")
#: a reduce or barrier call that takes longer than this failed
_WAIT: Final = 120.0

#: one job: a graph kind and a sync mode
Case = tuple[str, "Sync"]


def cases(sync: Sync = "notify-ack") -> list[Case]:
    """Every graph of :data:`GRAPHS` with ``sync``, then the expander with a barrier (unless
    ``sync`` is one), whose round time ASAP Fig. 10 compares with NOTIFY-ACK's."""
    out: list[Case] = [(graph, sync) for graph in GRAPHS]
    if sync != "barrier":
        out.append(("expander", "barrier"))
    return out


def fabric_reduce(fab: Client, graph: str, sync: Sync) -> Callable[[Array], int]:
    """The ``reduce`` :func:`~fabricd.demo.svm.train` calls: one stochastic reduce of the model
    (a ``fab.array``) over ``graph`` with ``sync``; how many in-neighbour updates it used."""

    def reduce(model: Array) -> int:
        return fab.stochastic_reduce(model, graph=graph, sync=sync, timeout=_WAIT).inputs

    return reduce


def _rank_main(
    socket_path: str,
    rank: int,
    reports: Queue[Any],
    job: str,
    settings: Settings,
    graph: str,
    sync: Sync,
) -> None:
    """A rank's process (under :func:`~fabricd.demo.training.run_ranks`): train after every
    rank joined, wait for every rank to finish, report the history."""
    topology = graphs.build(graph, settings.ranks)
    with connect(job=job, rank=rank, size=settings.ranks, socket_path=socket_path) as fab:
        model = fab.array("model", (settings.dim,), DTYPE)
        fab.barrier(timeout=_WAIT)  # the clocks start once every rank is there
        progress = (lambda p: reports.put(("report", p))) if rank == 0 else None
        history = train(
            rank,
            settings,
            fabric_reduce(fab, graph, sync),
            model=model,
            out_degree=topology.out_degrees[rank],
            in_degree=topology.in_degrees[rank],
            progress=progress,
        )
        # nobody leaves while a neighbour may still wait for its update (training.train)
        with contextlib.suppress(PeerFailed):
            fab.barrier(name="end", timeout=_WAIT)
    reports.put(("report", history))


def run_case(
    cluster: LocalCluster,
    settings: Settings,
    graph: str,
    sync: Sync,
    progress: Callable[[Case, Point], None] | None = None,
) -> History:
    """One job over ``graph`` with ``sync`` on a started ``cluster``; ``progress`` gets rank
    0's measurements.

    Raises:
        DemoFailed: a rank failed, or the run outlived its (generous) deadline.
    """
    histories: dict[int, RankHistory] = {}

    def collect(message: Any) -> None:
        if isinstance(message, RankHistory):
            histories[message.rank] = message
        elif progress is not None:
            progress((graph, sync), message)

    run_ranks(
        cluster,
        settings.ranks_per_node,
        settings.ranks,
        _rank_main,
        (f"svm-{graph}-{sync}-{uuid.uuid4().hex[:8]}", settings, graph, sync),
        # the ranks share this machine's cores: a round may take tens of milliseconds
        seconds=120 + settings.rounds * 0.2,
        what=f"{graph}, {sync}",
        collect=collect,
    )
    if len(histories) != settings.ranks:
        raise DemoFailed(f"{graph}, {sync}: {len(histories)} of {settings.ranks} ranks reported")
    return History(
        graph=graph,
        sync=sync,
        target=settings.target,
        spectral_gap=graphs.build(graph, settings.ranks).spectral_gap,
        ranks=tuple(histories[r] for r in range(settings.ranks)),
    )


def run(
    settings: Settings,
    jobs: Iterable[Case] | None = None,
    progress: Callable[[Case, Point], None] | None = None,
) -> list[History]:
    """Start a fabric, run each case of ``jobs`` (default :func:`cases`) on it, stop it.

    Raises:
        DemoFailed: a rank failed.
        ClusterError: the daemons did not start.
    """
    chosen: Sequence[Case] = list(jobs) if jobs is not None else cases()
    with LocalCluster(settings.nodes) as cluster:
        cluster.wait_connected()
        return [run_case(cluster, settings, graph, sync, progress) for graph, sync in chosen]
