"""(s4) MLfabric's model distribution trees (§10.3) in virtual time: a batch of pulls answered
through distributors, against every pull answered by the server.

``W`` pullers and a server on a star network, every link 10 Gbit/s ÷ 100 each way (so the
server's one outbound link is what §10.3 calls the bottleneck), a 1 MB model.  Each batch is
one pull per worker, answered at one version; each puller's cache is 1 to 3 versions behind
(fresh caches) or 1 to 20 (stale ones), and a delta from a cache ``d`` versions behind is
``min(1, d / 10)`` of the model (a tenth of the parameters change per version).  Each of
``--batches`` batches is planned on a fresh network four ways, with the same pulls:

* *direct, whole* and *direct, delta*: the server answers each pull itself, shortest first
  (its own delta per puller under ``delta``);
* *tree, whole* and *tree, delta*: :func:`fabricd.engines.scheduling.distribution.distribute`
  with ``k="auto"``; under ``delta`` a distributor's branch carries the delta from its
  oldest cache, and the server sends the pullers it serves itself their own deltas.

Figures: the mean and 95th-percentile pull latency (from the batch's start until the puller
has the model), the server's bytes sent per batch and the distributors chosen.  The ratio is
direct-whole's mean latency over tree-whole's (higher is better).

Run alone: ``python -m bench.distribution [--quick]``.
"""

from __future__ import annotations

import sys
from statistics import fmean
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.report import Column, Progress, Table, fmt_number, percentile, quiet, run_alone
from fabricd.engines.scheduling.distribution import Distribution, Puller, direct, distribute
from fabricd.engines.scheduling.timelines import Network

if TYPE_CHECKING:
    from collections.abc import Sequence

WORKERS: Final = (4, 8, 16, 32, 64)
QUICK_WORKERS: Final = (4, 8)
BATCHES: Final = 30
QUICK_BATCHES: Final = 3
RATE: Final = 10e9 / 8 / 100  #: bytes/s of every link
WHOLE: Final = 1e6  #: bytes of the model
VERSION: Final = 100  #: the version a batch is answered at
SEED: Final = 19
#: how many versions behind the caches are, at most (two settings)
LAGS: Final = (3, 20)
WAYS: Final = ("direct whole", "tree whole", "direct delta", "tree delta")


def plans(workers: int, lag: int, rng: np.random.Generator) -> dict[str, Distribution]:
    """One batch whose caches are 1 to ``lag`` versions behind, planned the four ways."""
    hosts = range(workers + 1)
    net = Network(dict.fromkeys(hosts, RATE), dict.fromkeys(hosts, RATE))
    pullers = [
        Puller(key=w, host=w + 1, cached=VERSION - int(rng.integers(1, lag + 1)))
        for w in range(workers)
    ]

    def delta(v: int) -> float:
        return min(1.0, (VERSION - v) / 10) * WHOLE

    common = {"server": 0, "version": VERSION, "whole": WHOLE, "delta": delta}
    return {
        "direct whole": direct(pullers, net, **common),  # type: ignore[arg-type]
        "tree whole": distribute(pullers, net, **common),  # type: ignore[arg-type]
        "direct delta": direct(pullers, net, policy="delta", **common),  # type: ignore[arg-type]
        "tree delta": distribute(pullers, net, policy="delta", **common),  # type: ignore[arg-type]
    }


def compare(workers: int, lag: int, batches: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng([seed, workers, lag])
    latencies: dict[str, list[float]] = {way: [] for way in WAYS}
    sent: dict[str, list[float]] = {way: [] for way in WAYS}
    distributors: list[int] = []
    for _ in range(batches):
        for way, plan in plans(workers, lag, rng).items():
            latencies[way] += [h.end for h in plan.hops]
            sent[way].append(plan.server_bytes)
            if way == "tree whole":
                distributors.append(len(plan.distributors))
    out: dict[str, float] = {"k": fmean(distributors)}
    for way in WAYS:
        tag = way.replace(" ", "_")
        out[f"{tag}_ms"] = 1e3 * fmean(latencies[way])
        out[f"{tag}_p95"] = 1e3 * percentile(latencies[way], 95)
        out[f"{tag}_mb"] = fmean(sent[way]) / 1e6
    return out


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    counts: Sequence[int] = QUICK_WORKERS if quick else WORKERS
    batches = QUICK_BATCHES if quick else BATCHES
    columns = [Column("k", "k (tree)")]
    for way in WAYS:
        tag = way.replace(" ", "_")
        columns += [
            Column(f"{tag}_ms", f"{way} ms"),
            Column(f"{tag}_p95", f"{way} p95"),
            Column(f"{tag}_mb", f"{way} MB"),
        ]
    table = Table(
        name="distribution",
        title="(s4) MLfabric model distribution trees (virtual time): pull latency, server bytes",
        columns=columns,
        ratio="direct-whole mean pull latency / tree-whole's (higher is better)",
        settings={"batches": batches, "rate": RATE, "whole": WHOLE, "seed": SEED},
    )
    for lag in LAGS:
        for workers in counts:
            f = compare(workers, lag, batches, SEED)
            ratio = f["direct_whole_ms"] / f["tree_whole_ms"]
            label = f"{workers} pullers, lag <= {lag}"
            table.add(label, workers, ratio, **f)
            progress(f"{label}: tree {fmt_number(ratio)}x lower mean latency")
    table.notes.append(
        "virtual time over the engine, a fresh network per batch; not yet the parameter "
        "server's pulls (docs/mlfabric.md)"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("distribution", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
