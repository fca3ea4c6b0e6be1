"""Run the benchmarks: ``python -m bench [--quick] [--json] [--only NAME ...]``.

Each benchmark prints a table whose last column is the ratio against a baseline measured in the
same run (docs/performance.md explains each one).  Progress lines go to stderr, one per case;
with ``--json`` the results go to stdout as one JSON document and nothing else does.  Missing a
target does not change the exit status: on a shared machine a benchmark informs, it does not
fail.  The exit status is non-zero only when a benchmark could not run.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import TYPE_CHECKING

from bench import (
    ako,
    ako_netns,
    allreduce,
    consistency,
    disconnect,
    distribution,
    framecost,
    handoff,
    hopfloor,
    hyperplane,
    integrity,
    joint,
    latency,
    mesh,
    mlfabric,
    mlfabric_netns,
    ps_logreg,
    ps_storage,
    rate,
    replication,
    replication_daemons,
    roundtrip,
    scheduler,
    servicecost,
    skew,
    svm,
    throughput,
    torch_backend,
    trees_netns,
)
from bench.report import Table, dump_json, machine, stderr_progress

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from bench.report import Progress

BENCHMARKS: dict[str, Callable[[bool, Progress], Table]] = {
    "handoff": handoff.run,
    "throughput": throughput.run,
    "throughput-window": functools.partial(throughput.run, window=throughput.WINDOW),
    "latency": latency.run,
    "framecost": framecost.run,
    "servicecost": servicecost.run,
    "disconnect": disconnect.run,
    "mesh": mesh.run,
    "integrity": integrity.run,
    "integrity-frame": integrity.run_frame,
    "hopfloor": hopfloor.run,
    "roundtrip": roundtrip.run,
    "rate": rate.run,
    "allreduce": allreduce.run,
    "allreduce-tree": allreduce.run_tree,
    "skew": skew.run,
    "hyperplane": hyperplane.run,
    "svm": svm.run,
    "consistency": consistency.run,
    "ps-storage": ps_storage.run,
    "ps-logreg": ps_logreg.run,
    "scheduler": scheduler.run,
    "mlfabric": mlfabric.run,
    "mlfabric-netns": mlfabric_netns.run,
    "replication": replication.run,
    "replication-daemons": replication_daemons.run,
    "replication-netns": replication_daemons.run_netns,
    "replication-netns-slow": functools.partial(
        replication_daemons.run_netns, replica_mbit=replication_daemons.SLOW_REPLICA_MBIT
    ),
    "joint": joint.run,
    "distribution": distribution.run,
    "trees-netns": trees_netns.run,
    "ako": ako.run,
    "ako-netns": ako_netns.run,
    "torch-backend": torch_backend.run,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (about 20 s)")
    parser.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    parser.add_argument(
        "--only", action="append", choices=sorted(BENCHMARKS), help="run only this (repeatable)"
    )
    args = parser.parse_args(argv)
    info = machine()
    info["load_before"] = _load()
    if not args.json:
        print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    tables = []
    started = time.monotonic()
    for name in args.only or list(BENCHMARKS):
        progress = stderr_progress(name)
        progress("quick run" if args.quick else "full run")
        table = BENCHMARKS[name](args.quick, progress)
        tables.append(table)
        if not args.json:
            print("\n" + table.render(), flush=True)
    info["load_after"] = _load()
    info["seconds"] = f"{time.monotonic() - started:.0f}"
    if args.json:
        print(dump_json(tables, info), flush=True)
    else:
        print(
            f"\nload average before {info['load_before']}, after {info['load_after']}; "
            f"{info['seconds']} s in all",
            flush=True,
        )
    return 0


def _load() -> str:
    """The 1-minute load average: other work on the machine shows up here."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
