"""Train a logistic regression with fabricd as the parameter server.

Start a fabric and run one process per rank (each may use a different node's socket)::

    fabricctl local-cluster 2 --json          # note each node's socket
    for rank in 0 1 2 3 4; do
        FABRICD_SOCKET=<a node's socket> RANK=$rank WORLD_SIZE=5 \\
            python examples/ps_train.py ssp 4 &
    done

Rank 0 is the server: its daemon holds the model and applies the workers' gradients with the
``sgd`` rule; the process only has to stay connected.  Every other rank is a worker that pulls
the model, computes the gradient of a minibatch of its shard and pushes it.  The consistency
model comes from the command line: ``bsp``, ``ssp S`` (a pull waits until the model lacks at
most the last S iterations of any worker) or ``async``.  ``--filters`` turns on TDF's filters,
which push and pull only what matters.  The data are :mod:`fabricd.demo.logreg`'s sparse
synthetic set, drawn from the same seed by every worker.
"""

from __future__ import annotations

import argparse

import fabricd
from fabricd.demo import logreg

#: TDF's filters: drop gradients below 1e-3 of their parameter (kept for a later push) and
#: parameter changes below 1 %, and send float16 both ways
TDF = fabricd.FilterSettings(gsmp_threshold=1e-3, glnp=True, psmp_threshold=1e-2, plnp=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("consistency", choices=["bsp", "ssp", "async"])
    parser.add_argument("staleness", type=int, nargs="?", default=0, help="SSP's bound")
    parser.add_argument("--iterations", type=int, default=200, help="per worker")
    parser.add_argument("--batch", type=int, default=256, help="rows per gradient")
    parser.add_argument("--features", type=int, default=100_000)
    parser.add_argument("--filters", action="store_true", help="TDF's filters")
    args = parser.parse_args()
    with fabricd.connect(job="ps-train") as fab:
        if fab.size < 2:
            raise SystemExit("run a server and at least one worker (WORLD_SIZE >= 2)")
        role = "server" if fab.rank == 0 else "worker"
        ps = fab.parameter_server(
            "weights",
            (args.features,),
            "float32",
            role,
            servers=[0],
            consistency=args.consistency,
            staleness=args.staleness,
            update_rule="sgd",
            lr=16.0,
            filters=TDF if args.filters else None,
        )
        fab.barrier(timeout=120)  # every rank opened the model
        if role == "server":  # the daemon serves; stay until the workers are done
            fab.barrier(name="trained", timeout=600)
            fab.barrier(name="done", timeout=120)
            return
        data = logreg.make_dataset(features=args.features, samples=30_000, test=5_000)
        shard = data.train.shard(fab.rank - 1, fab.size - 1)
        w = fab.array("w", (args.features,), "float32")  # the model: pulls bring only changes
        g = fab.array("g", (args.features,), "float32")
        for iteration in range(args.iterations):
            ps.pull(w)
            start = iteration * args.batch % (len(shard) - args.batch)
            logreg.gradient(w, shard.take(start, start + args.batch), out=g)
            ps.push(g)
        fab.barrier(name="trained", timeout=600)  # every push is in
        if fab.rank == 1:
            version = ps.pull(w)
            print(
                f"model version {version}: test accuracy {logreg.accuracy(w, data.test):.3f}, "
                f"log loss {logreg.log_loss(w, data.test):.3f}"
            )
        fab.barrier(name="done", timeout=120)


if __name__ == "__main__":
    main()
