"""(i) Allreduce bandwidth and latency against torch.distributed's gloo and MPI (issue 10 item 8).

A sum allreduce of float32 arrays of 4 KiB to 64 MiB over P ranks (2, 4, 8), all on this
machine: through fabricd with one rank per node (P daemons on loopback) and with 2 or 4 ranks
per node (P / 2 or P / 4 daemons, their ranks reducing through shared memory first); through
torch.distributed's gloo backend (TCP on 127.0.0.1) and mpi4py's ``Allreduce`` over OpenMPI
(shared memory), when installed (the ``bench`` extra; OpenMPI itself from the system).  Each
rank is a process; the baselines have no notion of a node, so each is measured once per P and
compared with every fabricd layout of that P.

Method, the same for every backend (:func:`bench.collective_ranks.allreduce_body`): per size, a
checked first call (ones in, P out), warm-up calls, then samples of back-to-back calls, each
sample after a barrier and timed at every rank.  A sample's time per call is the slowest rank's;
the figure is the median over samples.  Latency is that time; algorithm bandwidth is the array's
size over it (MiB/s), the figure NCCL's tests call ``algbw``.

The ratio is fabricd's bandwidth over gloo's (gloo's time over fabricd's: higher is better);
the MPI column says the same against MPI.  Targets (issue 10): >= 1.0x gloo at every size of
4 MiB and more, and at 4 KiB a latency of at most 0.5x gloo's (a ratio of at least 2).

The baselines and fabricd run one after another, not interleaved sample by sample as the other
benchmarks here do: they are different sets of processes.  Run alone:
``python -m bench.allreduce [--quick] [--sizes 4KiB,64MiB] [--ranks 2,4] [--per-node 1,2]``.

Tr-Sync (:func:`run_tree`, ``--tree``; ``python -m bench --only allreduce-tree``): fabricd's
binary-tree allreduce (``algorithm="tree"``, MLfabric §7.2's baseline) against its ring
(``algorithm="ring"``) on 3 and 4 daemons of one rank each, at a few sizes, the two
interleaved sample by sample in the same processes (:func:`bench.collective_ranks.algorithms_body`).
The ratio is the tree's time over the ring's (the ring's bandwidth over the tree's): what the
bandwidth-optimal ring gains on the baseline.  No target: it says what the baseline costs.
MLfabric-S (``algorithm="mlfabric"``, §6) runs interleaved with them, its time over the ring's
an extra column: on equal loopback links with every rank calling at once it shows what its
READY and GRANT messages cost, not what it gains under stragglers (bench/mlfabric.py
simulates that).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import socket
import sys
import uuid
from typing import TYPE_CHECKING, Any

from bench import collective_ranks
from bench.report import (
    Column,
    KiB,
    MiB,
    Progress,
    Table,
    fmt_number,
    fmt_size,
    median,
    messages_per_sample,
    parse_size,
    quiet,
    stderr_progress,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB]
RANKS = [2, 4, 8]
QUICK_RANKS = [2]
PER_NODE = [1, 2, 4]
QUICK_PER_NODE = [1, 2]
BASELINES = ("gloo", "mpi")

TARGET_BANDWIDTH_FROM = 4 * MiB
TARGET_BANDWIDTH = 1.0  #: fabricd / gloo algorithm bandwidth, at every size from 4 MiB
TARGET_LATENCY_SIZE = 4 * KiB
TARGET_LATENCY = 0.5  #: fabricd / gloo latency at 4 KiB (a ratio of at least 2)

TREE_SIZES = [64 * KiB, 1 * MiB, 16 * MiB]
QUICK_TREE_SIZES = [64 * KiB, 1 * MiB]
TREE_NODES = [3, 4]
QUICK_TREE_NODES = [3]
#: what run_tree compares: the baseline first, then the ring, then MLfabric-S
TREE_ALGORITHMS = ("tree", "ring", "mlfabric")

Plan = list[tuple[int, int]]


def missing(baseline: str) -> str | None:
    """Why ``baseline`` ("gloo", "mpi") cannot run here, or ``None`` when it can."""
    if baseline == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch not installed: gloo skipped"
        return None
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed: skipped"
    if shutil.which("mpirun") is None:
        return "mpirun not found (OpenMPI): MPI skipped"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (gloo's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def layouts(ranks: Sequence[int], per_node: Sequence[int]) -> list[tuple[int, int]]:
    """(ranks, ranks per node) for every rank count and every per-node count that divides it."""
    return [(p, k) for p in ranks for k in per_node if k <= p and p % k == 0]


def measure(
    backend: str, size: int, per_node: int, plan: Plan, samples: int, warmup: int
) -> list[float]:
    """Seconds per allreduce for each planned size, on ``size`` ranks of ``backend``."""
    spec: dict[str, Any] = {
        "backend": backend,
        "size": size,
        "capacity": max(n for n, _ in plan),
        "plan": plan,
        "samples": samples,
        "warmup": warmup,
    }
    budget = collective_ranks.CALL_TIMEOUT * (2 + len(plan) * (1 + warmup))
    if backend == "mpi":
        results = collective_ranks.run_mpi("allreduce", spec, budget)
    elif backend == "gloo":
        spec["port"] = free_port()
        specs = [{**spec, "rank": r} for r in range(size)]
        results = collective_ranks.run_spawned("allreduce", specs, budget)
    else:
        from fabricd.daemon.launcher import LocalCluster

        with LocalCluster(size // per_node) as cluster:
            cluster.wait_connected()
            spec["job"] = f"bench-allreduce-{uuid.uuid4().hex[:8]}"
            specs = [
                {**spec, "rank": r, "socket_path": cluster.nodes[r // per_node].socket_path}
                for r in range(size)
            ]
            results = collective_ranks.run_spawned("allreduce", specs, budget)
    return slowest_rank_medians([r["times"] for r in results])


def slowest_rank_medians(times: list[list[list[float]]]) -> list[float]:
    """``times[rank][size][sample]`` -> per size, the median over samples of the slowest rank."""
    return [
        median([max(rank[case][sample] for rank in times) for sample in range(len(times[0][case]))])
        for case in range(len(times[0]))
    ]


def run(
    quick: bool = False,
    progress: Progress = quiet,
    *,
    sizes: Sequence[int] | None = None,
    ranks: Sequence[int] | None = None,
    per_node: Sequence[int] | None = None,
    baselines: Sequence[str] = BASELINES,
    samples: int | None = None,
) -> Table:
    """Measure every (ranks, ranks per node, size) through fabricd and each baseline."""
    sizes = list(sizes or (QUICK_SIZES if quick else SIZES))
    if any(n < 4 or n % 4 for n in sizes):
        raise ValueError("every size must be a whole number of float32 elements (4 B)")
    grid = layouts(
        ranks or (QUICK_RANKS if quick else RANKS),
        per_node or (QUICK_PER_NODE if quick else PER_NODE),
    )
    samples = samples or (2 if quick else 5)
    warmup = 1 if quick else 2
    budget, cap = (4 * MiB, 5) if quick else (64 * MiB, 40)
    plan = [(n, messages_per_sample(n, budget, cap)) for n in sizes]
    table = Table(
        name="allreduce",
        title="(i) allreduce (sum, float32), fabricd sync vs gloo and MPI on this machine",
        columns=[
            Column("fabricd_ms", "fabricd ms"),
            Column("fabricd_mibs", "fabricd MiB/s"),
            Column("gloo_ms", "gloo ms"),
            Column("gloo_mibs", "gloo MiB/s"),
            Column("mpi_ms", "MPI ms"),
            Column("mpi_mibs", "MPI MiB/s"),
            Column("vs_mpi", "fabricd/MPI"),
        ],
        ratio="fabricd / gloo algorithm bandwidth = gloo / fabricd latency (higher is better)",
        target=(
            f"ratio >= {TARGET_BANDWIDTH} at sizes >= {fmt_size(TARGET_BANDWIDTH_FROM)}, "
            f">= {1 / TARGET_LATENCY:g} (latency <= {TARGET_LATENCY}x gloo) at "
            f"{fmt_size(TARGET_LATENCY_SIZE)}"
        ),
        settings={
            "samples": samples,
            "warmup": warmup,
            "calls_per_sample": dict((fmt_size(n), k) for n, k in plan),
            "layouts": [f"{p} ranks, {k}/node" for p, k in grid],
        },
    )
    available = []
    for baseline in baselines:
        reason = missing(baseline)
        if reason is None:
            available.append(baseline)
        else:
            table.notes.append(reason)
            progress(reason)
    judged: list[bool] = []
    baseline_times: dict[tuple[str, int], list[float]] = {}
    for size, k in grid:
        for baseline in available:
            if (baseline, size) not in baseline_times:
                progress(f"{size} ranks: {baseline}")
                baseline_times[baseline, size] = measure(baseline, size, 1, plan, samples, warmup)
        progress(f"{size} ranks, {k}/node: fabricd on {size // k} daemon(s)")
        ours = measure("fabricd", size, k, plan, samples, warmup)
        for case, (nbytes, _) in enumerate(plan):
            figures = {"fabricd_ms": ours[case] * 1e3, "fabricd_mibs": nbytes / ours[case] / MiB}
            for baseline in available:
                seconds = baseline_times[baseline, size][case]
                figures[f"{baseline}_ms"] = seconds * 1e3
                figures[f"{baseline}_mibs"] = nbytes / seconds / MiB
            if "mpi" in available:
                figures["vs_mpi"] = figures["mpi_ms"] / figures["fabricd_ms"]
            ratio = (
                figures["gloo_ms"] / figures["fabricd_ms"] if "gloo" in available else float("nan")
            )
            label = f"{size} ranks, {k}/node, {fmt_size(nbytes)}"
            table.add(label, nbytes, ratio, **figures)
            if "gloo" in available:
                if nbytes >= TARGET_BANDWIDTH_FROM:
                    judged.append(ratio >= TARGET_BANDWIDTH)
                if nbytes == TARGET_LATENCY_SIZE:
                    judged.append(ratio >= 1 / TARGET_LATENCY)
            progress(
                ", ".join(
                    [
                        f"{label}: fabricd {fmt_number(figures['fabricd_ms'])} ms "
                        f"({fmt_number(figures['fabricd_mibs'])} MiB/s)",
                        *(f"{b} {fmt_number(figures[f'{b}_ms'])} ms" for b in available),
                        f"ratio {fmt_number(ratio)}x",
                    ]
                )
            )
    table.target_met = all(judged) if judged else None
    table.notes.append(
        "each backend's ranks are processes on this machine; a fabricd layout of k ranks per "
        "node runs ranks/k daemons; the baselines are measured once per rank count"
    )
    return table


def measure_algorithms(
    nodes: int, plan: Plan, samples: int, warmup: int, algorithms: Sequence[str]
) -> list[list[float]]:
    """Seconds per allreduce, ``[size][algorithm]``, on ``nodes`` daemons of one rank each."""
    from fabricd.daemon.launcher import LocalCluster

    spec: dict[str, Any] = {
        "backend": "fabricd",
        "size": nodes,
        "capacity": max(n for n, _ in plan),
        "plan": plan,
        "samples": samples,
        "warmup": warmup,
        "algorithms": list(algorithms),
    }
    budget = collective_ranks.CALL_TIMEOUT * (2 + len(plan) * len(algorithms) * (1 + warmup))
    with LocalCluster(nodes) as cluster:
        cluster.wait_connected()
        spec["job"] = f"bench-tree-{uuid.uuid4().hex[:8]}"
        specs = [
            {**spec, "rank": r, "socket_path": cluster.nodes[r].socket_path} for r in range(nodes)
        ]
        results = collective_ranks.run_spawned("algorithms", specs, budget)
    times = [r["times"] for r in results]  # [rank][size][algorithm][sample]
    return [
        slowest_rank_medians([[rank[case][a] for a in range(len(algorithms))] for rank in times])
        for case in range(len(plan))
    ]


def run_tree(
    quick: bool = False,
    progress: Progress = quiet,
    *,
    sizes: Sequence[int] | None = None,
    nodes: Sequence[int] | None = None,
    samples: int | None = None,
) -> Table:
    """Tr-Sync (the binary tree) against the ring, per (nodes, size): the module docstring."""
    sizes = list(sizes or (QUICK_TREE_SIZES if quick else TREE_SIZES))
    if any(n < 4 or n % 4 for n in sizes):
        raise ValueError("every size must be a whole number of float32 elements (4 B)")
    counts = list(nodes or (QUICK_TREE_NODES if quick else TREE_NODES))
    samples = samples or (2 if quick else 5)
    warmup = 1 if quick else 2
    budget, cap = (4 * MiB, 5) if quick else (64 * MiB, 40)
    plan = [(n, messages_per_sample(n, budget, cap)) for n in sizes]
    table = Table(
        name="allreduce-tree",
        title=(
            "Tr-Sync: fabricd's binary-tree allreduce vs its ring, and MLfabric-S "
            "(sum, float32, 1 rank/node)"
        ),
        columns=[
            Column("ring_ms", "ring ms"),
            Column("ring_mibs", "ring MiB/s"),
            Column("tree_ms", "tree ms"),
            Column("tree_mibs", "tree MiB/s"),
            Column("mlfabric_ms", "mlfabric ms"),
            Column("mlfabric_vs_ring", "mlfabric / ring"),
        ],
        ratio="tree / ring time = ring / tree bandwidth (above 1: the ring is faster)",
        settings={
            "samples": samples,
            "warmup": warmup,
            "calls_per_sample": dict((fmt_size(n), k) for n, k in plan),
            "nodes": counts,
        },
    )
    for count in counts:
        progress(f"{count} daemons: tree and ring, interleaved")
        measured = measure_algorithms(count, plan, samples, warmup, TREE_ALGORITHMS)
        for (nbytes, _), seconds in zip(plan, measured, strict=True):
            tree, ring, mlfabric = seconds
            figures = {"ring_ms": ring * 1e3, "ring_mibs": nbytes / ring / MiB}
            figures |= {"tree_ms": tree * 1e3, "tree_mibs": nbytes / tree / MiB}
            figures |= {"mlfabric_ms": mlfabric * 1e3, "mlfabric_vs_ring": mlfabric / ring}
            label = f"{count} nodes, {fmt_size(nbytes)}"
            table.add(label, nbytes, tree / ring, **figures)
            progress(
                f"{label}: ring {fmt_number(ring * 1e3)} ms, tree {fmt_number(tree * 1e3)} ms, "
                f"mlfabric {fmt_number(mlfabric * 1e3)} ms, ratio {fmt_number(tree / ring)}x"
            )
    table.notes.append(
        "every daemon and rank is a process on this machine (loopback TCP); the tree sends "
        "2 (n - 1) messages of the whole array a round, the ring 2 (n - 1) / n of it per node"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--sizes", default="", help="comma-separated sizes (e.g. 4KiB,64MiB)")
    parser.add_argument("--ranks", default="", help="comma-separated rank counts (e.g. 2,4,8)")
    parser.add_argument("--per-node", default="", help="comma-separated ranks per node (1,2,4)")
    parser.add_argument("--samples", type=int, default=0, help="timing samples per size")
    parser.add_argument(
        "--baselines", default=",".join(BASELINES), help="comma-separated: gloo, mpi, or none"
    )
    parser.add_argument(
        "--tree", action="store_true", help="Tr-Sync (binary tree) vs ring; --ranks: nodes"
    )
    args = parser.parse_args(argv)
    if args.tree:
        tree = run_tree(
            args.quick,
            stderr_progress("allreduce-tree"),
            sizes=[parse_size(s) for s in args.sizes.split(",") if s] or None,
            nodes=[int(r) for r in args.ranks.split(",") if r] or None,
            samples=args.samples or None,
        )
        print(tree.render(), flush=True)
        return 0
    table = run(
        args.quick,
        stderr_progress("allreduce"),
        sizes=[parse_size(s) for s in args.sizes.split(",") if s] or None,
        ranks=[int(r) for r in args.ranks.split(",") if r] or None,
        per_node=[int(k) for k in args.per_node.split(",") if k] or None,
        baselines=[b for b in args.baselines.split(",") if b in BASELINES],
        samples=args.samples or None,
    )
    print(table.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
