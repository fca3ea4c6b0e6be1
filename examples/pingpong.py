"""Two ranks bounce a gradient-sized array through their daemons and check it each time.

Start a fabric and run one process per rank (each may use a different node's socket)::

    fabricctl local-cluster 2 --json          # note each node's socket
    FABRICD_SOCKET=<node 0 socket> RANK=0 WORLD_SIZE=2 python examples/pingpong.py &
    FABRICD_SOCKET=<node 1 socket> RANK=1 WORLD_SIZE=2 python examples/pingpong.py

Rank 0 sends, rank 1 adds one to every element and sends it back, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import fabricd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20, help="float32 elements")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with fabricd.connect(job="pingpong") as fab:
        if fab.size != 2:
            raise SystemExit("run exactly two ranks (WORLD_SIZE=2)")
        grad = fab.array("grad", (args.elements,), "float32")
        other = 1 - fab.rank
        start = time.perf_counter()
        for round_ in range(args.rounds):
            if fab.rank == 0:
                grad[:] = round_
                fab.send(grad, to=other, timeout=60)
                fab.recv(grad, src=other, timeout=60)
                if not np.all(grad == round_ + 1):
                    raise SystemExit(f"round {round_}: wrong data came back")
            else:
                fab.recv(grad, src=other, timeout=60)
                grad += 1
                fab.send(grad, to=other, timeout=60)
        seconds = time.perf_counter() - start
        if fab.rank == 0:
            moved = 2 * args.rounds * grad.nbytes
            print(
                f"{args.rounds} round trips of {grad.nbytes} B in {seconds:.3f} s "
                f"({moved / seconds / 1e9:.2f} GB/s), every element checked"
            )


if __name__ == "__main__":
    main()
