"""(a2) Ako's partial gradient exchange on real daemons in network namespaces with ``tbf``-shaped
links (issue 29): time to a target accuracy and bytes a rank sends per round, against
all-to-all exchange (``p = 1``) and a sync allreduce, as the ranks grow.

One daemon per rank, each in a network namespace of its own joined by a bridge
(``tests/network/netns.py``'s :class:`TestNet`), every node's link shaped both ways at
:data:`MBIT` Mbit/s and each daemon told its rate, so ``partitions="auto"`` takes eq. 3's ``B``
from the monitor's true figure.  The model and data are bench/ako_model.py's (3,610
parameters, float32 here: 14.4 kB).  This process plays every rank: each round it computes
every rank's gradient on that rank's replica (the daemons write peers' parts into the
replicas meanwhile), starts every rank's step, sleeps :data:`COMPUTE` (the ranks' compute,
emulated, run in parallel), and waits for the steps; the allreduce baseline sums the gradients
with ``fab.allreduce`` and applies them the same way.  A run ends when rank 0's replica
reaches bench/ako_model.py's target accuracy, or after :data:`LIMIT` seconds.  The bytes per
round are the daemons' own counters: the exchange's status rows, or (the allreduce) the peer
links' bytes sent.

How it maps to the paper's setting: as bench/ako.py's virtual-time run (compute-bound ranks
on a network that cannot carry every gradient to every peer each round), on real daemons; one
thread plays the ranks in lockstep rounds, so the rounds are not as independent as Ako's
workers (the staleness gate never holds anyone here), and single samples on a shared
two-core machine.

Where namespaces or ``tc`` are unavailable (not root, no iproute2), the benchmark prints one
line, ``ako-netns: skipped: <why>``, and exits 0.  Run alone: ``python -m bench.ako_netns``.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from bench import ako_model as model
from bench.netns_cluster import shaped_cluster, why_not
from bench.report import Column, Progress, Table, fmt_number, quiet, run_alone

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.client import Client

WORKERS: Final = (4, 8, 16)
QUICK_WORKERS: Final = (4,)
STRATEGIES: Final = ("ako", "all-to-all", "allreduce")
MBIT: Final = 4.0
#: seconds each round's gradient computation takes (emulated, the ranks in parallel)
COMPUTE: Final = 0.02
#: the summed-gradient rate (bench/ako.py's)
RATE: Final = 0.1
STALENESS: Final = 4
#: wall seconds a run may take before it counts as not reaching the target
LIMIT: Final = 60.0
QUICK_LIMIT: Final = 20.0
WAIT: Final = 120.0
SEED: Final = 29


def _sent(client: Client) -> int:
    return sum(p["bytes_sent"] for p in client.status()["peers"])


def measure(sockets: Sequence[str], strategy: str, limit: float) -> dict[str, float]:
    """One strategy's run: seconds and rounds to the target (NaN: not reached), bytes a rank
    sent per round, the partition count, rank 0's final accuracy."""
    import fabricd

    ranks = len(sockets)
    problem = model.problem(SEED)
    job = f"bench-ako-{strategy}-{ranks}"
    fabs = [
        fabricd.connect(job=job, rank=r, size=ranks, socket_path=socket)
        for r, socket in enumerate(sockets)
    ]
    try:
        models = [f.array("w", (model.PARAMETERS,), "float32") for f in fabs]
        grads = [f.array("g", (model.PARAMETERS,), "float32") for f in fabs]
        for w in models:
            w[:] = problem.w0
        batches = [model.Batches(problem, r, ranks, SEED) for r in range(ranks)]
        exchanges = []
        if strategy != "allreduce":
            partitions: Any = "auto" if strategy == "ako" else 1
            exchanges = [
                f.partial_exchange(
                    "w", w, partitions=partitions, lr=RATE / ranks, staleness=STALENESS
                )
                for f, w in zip(fabs, models, strict=True)
            ]
        before = sum(_sent(f) for f in fabs)
        started = time.perf_counter()
        rounds, reached = 0, None
        while reached is None and time.perf_counter() - started < limit:
            for r in range(ranks):
                replica = models[r].astype(np.float64)
                grads[r][:] = model.gradient(replica, problem, batches[r].next())
            if exchanges:
                steps = [ex.step_async(g) for ex, g in zip(exchanges, grads, strict=True)]
                time.sleep(COMPUTE)
                for step in steps:
                    step.wait(timeout=WAIT)
            else:
                time.sleep(COMPUTE)
                sums = [f.allreduce_async(g, name="g") for f, g in zip(fabs, grads, strict=True)]
                for done in sums:
                    done.wait(timeout=WAIT)
                for w, g in zip(models, grads, strict=True):
                    w -= np.float32(RATE / ranks) * g
            rounds += 1
            if model.accuracy(models[0].astype(np.float64), problem) >= model.TARGET:
                reached = time.perf_counter() - started
        accuracy = model.accuracy(models[0].astype(np.float64), problem)
        if exchanges:
            rows = [
                row
                for f in fabs
                for row in f.status()["partial_exchanges"]
                if row["job"] == job and row["rank"] == f.rank
            ]
            per_round = float(np.mean([row["bytes_per_round"] for row in rows]))
            partitions_used = float(np.mean([row["partitions"] for row in rows]))
        else:
            per_round = (sum(_sent(f) for f in fabs) - before) / ranks / rounds
            partitions_used = float("nan")
    finally:
        for fab in fabs:
            fab.close()
    return {
        "seconds": float("nan") if reached is None else reached,
        "rounds": float(rounds),
        "bytes": per_round,
        "p": partitions_used,
        "accuracy": accuracy,
    }


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    why = why_not()
    if why is not None:
        return Table(name="ako-netns", title="", columns=[], ratio="", skipped=why)
    limit = QUICK_LIMIT if quick else LIMIT
    table = Table(
        name="ako-netns",
        title=(
            "(a2) Ako's partial gradient exchange on real daemons, shaped links: time to "
            f"{model.TARGET:.0%} test accuracy and bytes per round"
        ),
        columns=[
            Column("p", "p"),
            Column("ako_s", "Ako s"),
            Column("all_to_all_s", "p=1 s"),
            Column("allreduce_s", "allreduce s"),
            Column("ako_bytes", "Ako B/round"),
            Column("all_to_all_bytes", "p=1 B/round"),
            Column("allreduce_bytes", "allreduce B/round"),
            Column("ako_rounds", "Ako rounds"),
            Column("ako_kBps", "Ako kB/s sent"),
        ],
        ratio="allreduce's time to the target / Ako's (higher: Ako faster)",
        settings={"mbit": MBIT, "compute_s": COMPUTE, "limit_s": limit, "seed": SEED},
    )
    for ranks in QUICK_WORKERS if quick else WORKERS:
        figures = {}
        for strategy in STRATEGIES:
            progress(f"{ranks} ranks, {strategy}: {ranks} daemons in namespaces")
            with shaped_cluster([MBIT] * ranks) as (sockets, _):
                figures[strategy] = measure(sockets, strategy, limit)
        ako, flat, sync = figures["ako"], figures["all-to-all"], figures["allreduce"]
        ratio = sync["seconds"] / ako["seconds"]
        table.add(
            f"{ranks} ranks",
            ranks,
            ratio,
            p=ako["p"],
            ako_s=ako["seconds"],
            all_to_all_s=flat["seconds"],
            allreduce_s=sync["seconds"],
            ako_bytes=ako["bytes"],
            all_to_all_bytes=flat["bytes"],
            allreduce_bytes=sync["bytes"],
            ako_rounds=ako["rounds"],
            ako_kBps=ako["bytes"] * ako["rounds"] / ako["seconds"] / 1e3,
        )
        progress(f"{ranks} ranks: allreduce/Ako time to the target {fmt_number(ratio)}x")
    table.notes.append(
        f"every link {MBIT:g} Mbit/s both ways (tbf); one daemon per rank; {COMPUTE * 1e3:g} ms "
        "of emulated compute a round; lockstep rounds played by one thread; a dash: not "
        f"reached within {limit:g} s; single samples on a shared two-core machine; Ako's p is "
        "the mean over ranks after profiling (the first five steps use n - 1); eq. 3 keeps "
        "the bytes a rank sends per second near the link's rate (kB/s sent): per round they "
        "grow where one thread playing more ranks on two cores makes rounds slower"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("ako_netns", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
