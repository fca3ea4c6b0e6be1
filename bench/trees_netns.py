"""(s5) Model distribution trees on real daemons in network namespaces with ``tbf``-shaped links
(MLfabric §10.3, issue 25): pull latency and the server's outbound bytes, with and without
trees, as workers grow.

``1 + W`` daemons, each in a network namespace of its own joined by a bridge
(``tests/network/netns.py``'s :class:`TestNet`): node 0 hosts the server rank, nodes 1..W one
worker each.  Every node's link is shaped both ways with ``tbf`` at :data:`MBIT` Mbit/s and
each daemon is told its rate (``link_up_bps`` / ``link_down_bps``), so the trees are planned with
the true figures.  The model is :data:`NBYTES` of float32 (a tenth of the paper's ResNet-50
on a link a hundredth of its 10 Gbit/s, as bench/mlfabric_netns.py maps them), under BSP with
``scheduling="mlfabric"``; the two modes, each a job of its own on the same daemons, differ only
in ``distribution``: ``"direct"`` (the server answers every pull) and ``"tree"``.

Each iteration every worker pushes a dense update of small integers (every parameter changes,
so every pull's delta is the whole model; exact in float32, so every worker's model must equal
the sum of the updates bit for bit), all pushes are waited for, then every worker pulls at once
(a thread per worker) and the time from its pull's start to its answer is its latency.  Per
mode: the mean and the last pull latency over the measured iterations (the first is a
warm-up, not counted), and the bytes the server's daemon sent during the pull phases (its
links' counters: the answers, a tree's notices, acknowledgements) per iteration.  The ratio is
direct's mean pull latency over the tree's (higher is better).  The paper has no figure of its
own for this (§10.3 is an extension); bench/distribution.py has the planner in virtual time up
to 64 pullers.  One run of each mode on a shared machine: single samples.

Where namespaces or ``tc`` are unavailable (not root, no iproute2), the benchmark prints one
line, ``trees-netns: skipped: <why>``, and exits 0.

Run alone: ``python -m bench.trees_netns [--quick]``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from bench.netns_cluster import shaped_cluster, why_not
from bench.report import Column, MiB, Progress, Table, fmt_number, quiet, run_alone

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.client import Client

WORKERS: Final = (4, 8, 16)
QUICK_WORKERS: Final = (4,)
MBIT: Final = 100.0
NBYTES: Final = 1 * MiB
QUICK_NBYTES: Final = 256 * 1024
ITERATIONS: Final = 6  #: the first is a warm-up
QUICK_ITERATIONS: Final = 3
MODES: Final = ("direct", "tree")
#: seconds a call may take before the bench says it hung
WAIT: Final = 120.0


def _sent(client: Client) -> int:
    return sum(p["bytes_sent"] for p in client.status()["peers"])


def measure(sockets: Sequence[str], mode: str, iterations: int, nbytes: int) -> dict[str, float]:
    """One mode's figures: mean and last pull latency (s) and the server's bytes sent per
    pull phase, over the iterations after the first."""
    import fabricd

    workers = len(sockets) - 1
    count = nbytes // 4
    job = f"bench-trees-{mode}-{workers}"
    fabs = [
        fabricd.connect(job=job, rank=r, size=len(sockets), socket_path=socket)
        for r, socket in enumerate(sockets)
    ]
    try:
        spec: dict[str, Any] = {
            "servers": [0],
            "consistency": "bsp",
            "scheduling": "mlfabric",
            "distribution": mode,
        }
        pss = [
            fab.parameter_server("m", (count,), "float32", "server" if r == 0 else "worker", **spec)
            for r, fab in enumerate(fabs)
        ]
        ranks = range(1, len(sockets))
        updates = {r: fabs[r].array("u", (count,), "float32") for r in ranks}
        models = {r: fabs[r].array("w", (count,), "float32") for r in ranks}
        rng = np.random.default_rng(25)
        expected = np.zeros(count, np.float32)
        latencies: list[float] = []
        lasts: list[float] = []
        sent = 0
        for iteration in range(iterations):
            for r in ranks:
                updates[r][:] = rng.integers(1, 5, count)
                expected += updates[r]
            for handle in [pss[r].push_async(updates[r]) for r in ranks]:
                handle.wait(timeout=WAIT)
            before = _sent(fabs[0])
            times = _pull_all(pss, models, ranks)
            if iteration:  # the first iteration warms the links up: not counted
                latencies += times
                lasts.append(max(times))
                sent += _sent(fabs[0]) - before
            for r in ranks:
                if not np.array_equal(models[r], expected):
                    raise AssertionError(f"{mode}: worker {r}'s model is not the updates' sum")
    finally:
        for fab in fabs:
            fab.close()
    measured = iterations - 1
    return {
        "mean": float(np.mean(latencies)),
        "last": float(np.mean(lasts)),
        "sent": sent / measured,
    }


def _pull_all(pss: Sequence[Any], models: dict[int, Any], ranks: range) -> list[float]:
    """Every worker pulls at once (a thread each); each pull's seconds to its answer."""
    times: dict[int, float] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(ranks))

    def pull(r: int) -> None:
        try:
            start.wait(timeout=WAIT)
            began = time.perf_counter()
            pss[r].pull_async(models[r]).wait(timeout=WAIT)
            times[r] = time.perf_counter() - began
        except BaseException as exc:  # reported below, in the bench's thread
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * WAIT)
    if errors or len(times) != len(ranks):
        raise RuntimeError("a pull failed or hung") from (errors[0] if errors else None)
    return [times[r] for r in ranks]


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    why = why_not()
    if why is not None:
        return Table(name="trees-netns", title="", columns=[], ratio="", skipped=why)
    counts = QUICK_WORKERS if quick else WORKERS
    iterations = QUICK_ITERATIONS if quick else ITERATIONS
    nbytes = QUICK_NBYTES if quick else NBYTES
    table = Table(
        name="trees-netns",
        title=(
            "(s5) MLfabric distribution trees on real daemons, shaped links: pull latency and "
            "the server's bytes, direct vs tree"
        ),
        columns=[
            Column("direct_ms", "direct mean ms"),
            Column("tree_ms", "tree mean ms"),
            Column("direct_last_ms", "direct last ms"),
            Column("tree_last_ms", "tree last ms"),
            Column("direct_mb", "direct server MB/it"),
            Column("tree_mb", "tree server MB/it"),
        ],
        ratio="direct's mean pull latency / the tree's (higher is better)",
        settings={"mbit": MBIT, "nbytes": nbytes, "iterations": iterations},
    )
    for workers in counts:
        progress(f"{workers} workers: {1 + workers} daemons in namespaces")
        with shaped_cluster([MBIT] * (1 + workers)) as (sockets, _):
            figures = {mode: measure(sockets, mode, iterations, nbytes) for mode in MODES}
        direct, tree = figures["direct"], figures["tree"]
        ratio = direct["mean"] / tree["mean"]
        table.add(
            f"{workers} workers",
            nbytes,
            ratio,
            direct_ms=direct["mean"] * 1e3,
            tree_ms=tree["mean"] * 1e3,
            direct_last_ms=direct["last"] * 1e3,
            tree_last_ms=tree["last"] * 1e3,
            direct_mb=direct["sent"] / 1e6,
            tree_mb=tree["sent"] / 1e6,
        )
        progress(f"{workers} workers: direct/tree mean pull latency {fmt_number(ratio)}x")
    table.notes.append(
        f"every link {MBIT:g} Mbit/s both ways (tbf); BSP, scheduling='mlfabric'; one worker "
        "per node; a pull's latency from its start to its answer, all workers pulling at once; "
        "single samples on a shared two-core machine"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("trees_netns", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
