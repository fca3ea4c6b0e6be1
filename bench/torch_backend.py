"""(t1) The torch.distributed backend "fabricd" against gloo, in the same run (issue 30).

Two measures, each a ratio against gloo on the same ranks and the same loopback:

* DDP training steps per second: ``examples/ddp_train.py`` unchanged, ``--backend fabricd-pg``
  (``init_process_group("fabricd")``, no hook) against ``--backend gloo``, one rank per node
  (a daemon each), 25 MiB buckets, no rank delayed: the issue's target is >= 1.0x at 2 and 4
  ranks.  Runs alternate between the two backends (so a noisy minute hits both), and the
  median of each is reported.
* ``all_gather_single`` and ``reduce_scatter_single`` (torch 2.13's names for
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor``) of 4 MiB and 64 MiB (the gathered
  output, the scattered input) on the backend against gloo, each rank in a process of its own
  beside its daemon; the median of the timed rounds after a warm-up, the slowest rank's.

What it does not show: the CUDA path (no GPU here), and nodes apart (loopback only).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from bench.report import Column, Table, fmt_number, quiet
from fabricd.daemon.launcher import LocalCluster

if TYPE_CHECKING:
    from bench.report import Progress

EXAMPLE: Final = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"
#: the issue's bucket size (DDP's default)
BUCKET_MB: Final = 25
MIB: Final = 1 << 20


def _steps_per_s(backend: str, ranks: int, steps: int) -> float:
    """One run of the example; its slowest rank's steps per second."""
    command = [sys.executable, str(EXAMPLE), "--backend", backend, "--ranks", str(ranks)]
    command += ["--nodes", str(ranks), "--steps", str(steps), "--delay-ms", "0"]
    command += ["--bucket-cap-mb", str(BUCKET_MB)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    found = re.search(r"steps_per_s=([0-9.]+)", done.stdout)
    if found is None:
        raise RuntimeError(f"{EXAMPLE.name} printed no summary: {done.stdout[-500:]}")
    return float(found.group(1))


def ddp(table: Table, ranks: int, steps: int, repeats: int, progress: Progress) -> None:
    runs: dict[str, list[float]] = {"fabricd-pg": [], "gloo": []}
    for _ in range(repeats):
        for backend in runs:
            runs[backend].append(_steps_per_s(backend, ranks, steps))
    fabricd, gloo = (statistics.median(runs[b]) for b in ("fabricd-pg", "gloo"))
    table.add(f"DDP {ranks} ranks", 0, fabricd / gloo, fabricd=fabricd, gloo=gloo)
    progress(
        f"DDP at {ranks} ranks: fabricd {fmt_number(fabricd)} steps/s, gloo "
        f"{fmt_number(gloo)}, ratio {fmt_number(fabricd / gloo)}"
    )


def _collective_rank(
    socket: str, init: str, rank: int, n: int, nbytes: int, rounds: int, out: Any
) -> None:
    """Time all_gather_into_tensor and reduce_scatter_tensor on fabricd and on gloo."""
    import torch
    import torch.distributed as dist

    import fabricd.torch  # noqa: F401  (registers the backend)

    os.environ["FABRICD_SOCKET"] = socket
    torch.set_num_threads(1)
    dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    count = nbytes // 4
    times: dict[str, float] = {}
    for name, group in (("fabricd", None), ("gloo", gloo)):
        gathered, part = torch.zeros(count), torch.ones(count // n)
        whole = torch.ones(count)
        for op in ("allgather", "reduce_scatter"):
            samples = []
            for i in range(rounds + 1):
                dist.barrier(group=group)
                start = time.perf_counter()
                if op == "allgather":
                    dist.all_gather_single(gathered, part, group=group)
                else:
                    dist.reduce_scatter_single(part, whole, group=group)
                if i:  # (the first round sets up)
                    samples.append(time.perf_counter() - start)
            times[f"{name}:{op}"] = statistics.median(samples)
    dist.destroy_process_group()
    out.put((rank, times))


def collectives(table: Table, ranks: int, nbytes: int, rounds: int, progress: Progress) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with LocalCluster(ranks) as cluster, tempfile.TemporaryDirectory() as scratch:
        cluster.wait_connected()
        init = f"file://{scratch}/rendezvous"
        processes = [
            context.Process(
                target=_collective_rank,
                args=(cluster.nodes[r].socket_path, init, r, ranks, nbytes, rounds, out),
            )
            for r in range(ranks)
        ]
        for process in processes:
            process.start()
        reports = [out.get(timeout=600) for _ in processes]
        for process in processes:
            process.join(60)
    for op in ("allgather", "reduce_scatter"):
        fabricd = max(times[f"fabricd:{op}"] for _, times in reports)
        gloo = max(times[f"gloo:{op}"] for _, times in reports)
        label = f"{op} {nbytes // MIB} MiB {ranks} ranks"
        table.add(label, nbytes, gloo / fabricd, fabricd_ms=fabricd * 1e3, gloo_ms=gloo * 1e3)
        progress(
            f"{label}: fabricd {fmt_number(fabricd * 1e3)} ms, gloo {fmt_number(gloo * 1e3)} ms"
        )


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    table = Table(
        name="torch-backend",
        title='(t1) torch.distributed backend "fabricd" against gloo: DDP steps/s, collectives',
        columns=[
            Column("fabricd", "fabricd steps/s"),
            Column("gloo", "gloo steps/s"),
            Column("fabricd_ms", "fabricd ms"),
            Column("gloo_ms", "gloo ms"),
        ],
        ratio="fabricd's speed / gloo's (higher is better; target >= 1.0)",
        settings={"bucket_cap_mb": BUCKET_MB, "one_rank_per_node": True},
        target="DDP steps/s and allgather/reduce-scatter >= 1.0x gloo at 2 and 4 ranks",
    )
    rank_counts = (2,) if quick else (2, 4)
    for ranks in rank_counts:
        ddp(table, ranks, 50 if quick else 200, 1 if quick else 3, progress)
    for ranks in rank_counts:
        for nbytes in (4 * MIB,) if quick else (4 * MIB, 64 * MIB):
            collectives(table, ranks, nbytes, 3 if quick else 10, progress)
    table.target_met = all(row.ratio >= 1.0 for row in table.rows)
    return table
