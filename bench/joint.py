"""(s3) MLfabric's joint reservation for a model split over servers (§10.2, eq. 18), in virtual
time: each server ordering its own parts against every update's parts reserved together.

A model split over two servers (hosts of their own, 10 Gbit/s ÷ 100 each way) and ``W``
workers on a star network, a fifth of them on a link ten times slower.  Each batch is one
update per worker, computed from a version up to ``tau + 2`` behind (so some miss their
deadline), with ``tau = W / 2``; an update's part for each server is a filtered, sparse one:
its size is the server's share of 1 MB times a factor drawn from Uniform(0.2, 1.8) per part
(G-SMP keeps a different share of each range).  Each batch is planned on a fresh network two
ways, with the same updates:

* *independent*: each server's parts ordered on their own by Alg. 2
  (:func:`fabricd.engines.scheduling.ordering.order`), as each shard's primary does today,
  one server after the other on the network the previous one's plan left (the workers'
  uplinks are shared: two plans on separate copies would book them twice);
* *joint*: :func:`fabricd.engines.scheduling.joint.order_joint`, eq. 18.

Figures, over ``--batches`` batches: the share of updates applied to part of the model only
(applied by some servers and dropped by others: the paper's "some parts of the model being
updated less frequently than others"), the spread of the servers' applied counts (largest over
smallest), the whole updates applied per batch, and the batch's last transfer end.  The ratio
is independent's partial share over joint's, shown as the share itself (joint's is 0 by
construction; the test checks it).

Run alone: ``python -m bench.joint [--quick]``.
"""

from __future__ import annotations

import sys
from statistics import fmean
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.report import Column, Progress, Table, fmt_number, quiet, run_alone
from fabricd.engines.scheduling.joint import JointUpdate, order_joint
from fabricd.engines.scheduling.ordering import Update, order
from fabricd.engines.scheduling.timelines import Network

if TYPE_CHECKING:
    from collections.abc import Sequence

WORKERS: Final = (8, 16, 32)
QUICK_WORKERS: Final = (8,)
BATCHES: Final = 200
QUICK_BATCHES: Final = 20
RATE: Final = 10e9 / 8 / 100  #: bytes/s of a link
SIZE: Final = 1e6  #: bytes of a whole dense update
SHARES: Final = (0.3, 0.7)  #: each server's share of the model
SEED: Final = 18


def batch(workers: int, rng: np.random.Generator) -> tuple[Network, list[JointUpdate], int]:
    """One batch: its network, its updates, and its delay bound."""
    servers = [workers + s for s in range(len(SHARES))]
    slow = set(rng.choice(workers, size=max(1, workers // 5), replace=False).tolist())
    up = {h: RATE / 10 if h in slow else RATE for h in range(workers)}
    up |= {s: RATE for s in servers}
    down = {h: RATE for h in [*range(workers), *servers]}
    tau = workers // 2
    updates = [
        JointUpdate(
            key=w,
            host=w,
            version=int(rng.integers(-2, 1)) + int(rng.integers(0, tau + 1)),
            sizes={
                s: share * SIZE * rng.uniform(0.2, 1.8)
                for s, share in zip(servers, SHARES, strict=True)
            },
        )
        for w in range(workers)
    ]
    return Network(up, down), updates, tau


def compare(workers: int, batches: int, seed: int) -> dict[str, float]:
    """Both plans of ``batches`` batches: their figures."""
    rng = np.random.default_rng([seed, workers])
    partial_ind: list[float] = []
    whole_ind: list[int] = []
    whole_joint: list[int] = []
    end_ind: list[float] = []
    end_joint: list[float] = []
    counts_ind = np.zeros(len(SHARES))
    counts_joint = np.zeros(len(SHARES))
    for _ in range(batches):
        network, updates, tau = batch(workers, rng)
        servers = list(updates[0].sizes)
        planned: list[set[int]] = []
        last = 0.0
        shared = network  # (each server's plan books the workers' uplinks the next one sees)
        for s, server in enumerate(servers):
            alone = [Update(u.key, u.host, u.version, u.sizes[server]) for u in updates]
            result = order(alone, shared, server=server, delay_bound=tau, v_init=0)
            shared = shared if result.network is None else result.network
            planned.append({p.update.key for p in result.planned})  # type: ignore[misc]
            counts_ind[s] += len(result.planned)
            last = max([last, *(p.transfer.end for p in result.planned)])
        some, every = set().union(*planned), set.intersection(*planned)
        partial_ind.append(len(some - every) / len(some) if some else 0.0)
        whole_ind.append(len(every))
        end_ind.append(last)
        joint = order_joint(updates, network, delay_bound=tau, v_init=0)
        whole_joint.append(len(joint.planned))
        for p in joint.planned:  # each server's applied count, from its own transfers
            assert set(p.transfers) == set(p.update.sizes)  # (no part left out)
            for s, server in enumerate(servers):
                counts_joint[s] += server in p.transfers
        decided = [p.update.key for p in joint.planned] + [u.key for u, _ in joint.dropped]
        assert len(decided) == len(set(decided)) == len(updates)  # each exactly once
        end_joint.append(max((p.end for p in joint.planned), default=0.0))
    return {
        "partial_ind": fmean(partial_ind),
        "spread_ind": float(counts_ind.max() / max(counts_ind.min(), 1.0)),
        "spread_joint": float(counts_joint.max() / max(counts_joint.min(), 1.0)),
        "whole_ind": fmean(whole_ind),
        "whole_joint": fmean(whole_joint),
        "end_ind": fmean(end_ind),
        "end_joint": fmean(end_joint),
    }


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    counts: Sequence[int] = QUICK_WORKERS if quick else WORKERS
    batches = QUICK_BATCHES if quick else BATCHES
    table = Table(
        name="joint",
        title="(s3) MLfabric joint reservation over two servers (virtual time): eq. 18",
        columns=[
            Column("spread_ind", "indep. spread"),
            Column("spread_joint", "joint spread"),
            Column("whole_ind", "indep. whole/batch"),
            Column("whole_joint", "joint whole/batch"),
            Column("end_ind", "indep. end s"),
            Column("end_joint", "joint end s"),
        ],
        ratio=(
            "share of applied updates that reached only part of the model, independent "
            "ordering (joint: 0)"
        ),
        settings={"batches": batches, "shares": list(SHARES), "seed": SEED, "rate": RATE},
    )
    for workers in counts:
        f = compare(workers, batches, SEED)
        table.add(
            f"{workers} workers",
            workers,
            f["partial_ind"],
            **{k: v for k, v in f.items() if k != "partial_ind"},
        )
        progress(f"{workers} workers: {fmt_number(100 * f['partial_ind'])} % partial, independent")
    table.notes.append(
        "virtual time over the engines, a fresh network per batch; the parameter server plans "
        "a sharded async model this way, at shard 0's primary (docs/mlfabric.md)"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("joint", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
