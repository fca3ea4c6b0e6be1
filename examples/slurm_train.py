"""Data-parallel least squares under Slurm: ``srun python examples/slurm_train.py``.

Nothing is set by hand.  Each task finds its rank and the world size in Slurm's variables
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``) and the daemon that the prolog started for the
job on its node (docs/slurm.md); ``examples/slurm_train.sbatch`` submits it.

Every rank draws its own batches of one linear problem, and the ranks average their gradients
with ``fab.allreduce`` at each step, so every replica follows the same model.  Rank 0 prints the
loss as it falls, and at the end every rank prints how far its model is from rank 0's (0.0:
the replicas agree).
"""

from __future__ import annotations

import argparse

import numpy as np

import fabricd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    truth = np.random.default_rng(0).standard_normal(args.features).astype(np.float32)
    with fabricd.connect(job="slurm-train") as fab:
        data = np.random.default_rng(1 + fab.rank)
        model = fab.array("model", (args.features,), "float32")
        grad = fab.array("grad", (args.features,), "float32")
        model[:] = 0
        for step in range(args.steps):
            x = data.standard_normal((32, args.features)).astype(np.float32)
            error = x @ model - x @ truth
            grad[:] = x.T @ error / len(x)
            fab.allreduce(grad, timeout=60)  # the sum over the ranks, in place
            model -= args.lr * grad / fab.size
            if fab.rank == 0 and step % 20 == 0:
                print(f"step {step}: loss {float(np.mean(error**2)):.5f}", flush=True)
        reference = fab.array("reference", (args.features,), "float32")
        reference[:] = model
        fab.broadcast(reference, root=0, timeout=60)
        drift = float(np.max(np.abs(reference - model)))
        print(f"rank {fab.rank} of {fab.size}: distance to rank 0's model {drift}", flush=True)


if __name__ == "__main__":
    main()
