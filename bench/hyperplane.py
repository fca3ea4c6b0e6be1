"""(k) eager-SGD §6.2.1's throughput comparison: hyperplane regression with one rank late per step.

The demo's job (:mod:`fabricd.demo.training`): data-parallel SGD on 8,192-dimensional
hyperplane regression, 8 ranks on 4 daemons, a total batch of 2,048; at every step one rank,
drawn from a seed all ranks share, sleeps 200, 300 or 400 ms before its allreduce.  Each delay
runs the job three times on one fabric: with a sync allreduce (synch-SGD: every step waits for
the late rank), and with solo and majority allreduce (eager-SGD: the round goes on without it;
its gradient goes into a later round; the replicas are averaged after the last step, as the
paper averages them only every 10 epochs of 16 steps).

Baseline: the sync run at the same delay, in the same run.  The ratio is solo's steps per
second over sync's (higher is better); the majority column is its own speedup over sync.  The
paper, 8 GPU nodes on Piz Daint: solo 1.50x, 1.75x and 2.01x at 200, 300 and 400 ms.  Here the
8 ranks share the machine's cores, so a rank's compute (its batch drawn and its gradient,
about 50 ms on one core) stretches with the number of ranks per core; the late rank's sleep does
not.  The validation loss each run reached is listed too: speed that does not learn is no
speedup.

Run alone: ``python -m bench.hyperplane [--quick]``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from bench.report import Column, Extra, Progress, Table, quiet, run_alone

if TYPE_CHECKING:
    from collections.abc import Sequence

DELAYS_MS: tuple[float, ...] = (200.0, 300.0, 400.0)
QUICK_DELAYS_MS: tuple[float, ...] = (20.0, 40.0)
#: eager-SGD §6.2.1: solo's speedup over synch-SGD at each delay
PAPER_SOLO = {200.0: 1.50, 300.0: 1.75, 400.0: 2.01}


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """One row per delay: sync, solo and majority runs of the demo's job."""
    from fabricd.demo.training import Settings, speedups

    if quick:  # a smoke run: two small nodes, a tiny model, short delays
        settings = Settings(nodes=2, ranks_per_node=2, dim=256, batch=256, steps=8, sync_every=4)
        delays = QUICK_DELAYS_MS
    else:
        # the paper averages the replicas every 10 epochs (160 steps): here only after the last
        settings = Settings(steps=30, sync_every=160)
        delays = DELAYS_MS
    table = Table(
        name="hyperplane",
        title=f"(k) eager-SGD hyperplane regression ({settings.dim} dimensions, {settings.ranks} "
        f"ranks on {settings.nodes} daemons, batch {settings.local_batch * settings.ranks}), one "
        "rank late per step: speedup over sync",
        columns=[
            Column("sync", "sync steps/s"),
            Column("solo", "solo steps/s"),
            Column("majority", "majority steps/s"),
            Column("majority_speedup", "majority speedup"),
            Column("sync_loss", "sync loss"),
            Column("solo_loss", "solo loss"),
            Column("majority_loss", "majority loss"),
        ],
        ratio="solo steps/s / sync steps/s, same delay (higher is better)",
        target="solo faster than sync at every delay (ratio > 1)",
        settings={
            "steps": settings.steps,
            "sync_every": settings.sync_every,
            "delays_ms": list(delays),
            "seed": settings.seed,
        },
    )
    results = speedups(settings, delays, progress=progress)
    nbytes = settings.dim * 4 + 4  # the gradient, weights and bias, float32
    for delay, runs in results.items():
        sync, solo, majority = runs["sync"], runs["solo"], runs["majority"]
        table.add(
            f"{delay:g} ms",
            nbytes,
            solo.steps_per_s / sync.steps_per_s,
            sync=sync.steps_per_s,
            solo=solo.steps_per_s,
            majority=majority.steps_per_s,
            majority_speedup=majority.steps_per_s / sync.steps_per_s,
            sync_loss=sync.final_loss,
            solo_loss=solo.final_loss,
            majority_loss=majority.final_loss,
        )
    table.target_met = all(row.ratio > 1 for row in table.rows)
    if not quick:
        table.extras.append(
            Extra(
                "eager-SGD §6.2.1, solo over synch-SGD on 8 GPU nodes",
                {f"{d:g} ms": PAPER_SOLO[d] for d in delays},
                "x",
            )
        )
    table.notes += [
        f"{settings.steps} steps per run, counted in allreduce rounds; steps/s is rank 0's, "
        "from a barrier after every rank joined to the result of the last round",
        "loss: rank 0's validation loss (mean squared error) after the last step; the best "
        f"model's is the noise variance, {settings.noise**2:g}",
        "the ranks share this machine's cores: compute per step grows with the ranks per core, "
        "the injected delay does not",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("hyperplane", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
