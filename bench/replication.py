"""(s) MLfabric's bounded-divergence replication in virtual time (§3.3, §5.3, §7.3 Fig. 9): the
replica's inbound bytes under chain replication against MLfabric's, as workers grow.

Chain replication (what fabricd's replica does today, and the paper's baseline): the primary
forwards every update it applies to the replica, so the replica takes one update's bytes per
update and the primary's uplink carries them.  MLfabric's: workers send copies of their updates
to the replica themselves, planned per batch by
:func:`~fabricd.engines.scheduling.replication.replicate` (Alg. 3 toward the replica on the
network the server's transfers left, a prefix of the server's order sent, the rest punted to
later batches while the replica's lead stays within the bound), so copies punted together are
summed at the replica's earmarked aggregators: the larger the bound, the more copies a batch's
list holds and the fewer bytes reach the replica.  The figure is chain's replica bytes over
MLfabric's (higher is better): the paper's Fig. 9 saving, which "plateaus at a factor of 5.6
for 30 workers" as the bound grows to 20 iterations' updates.

A discrete-event simulation, seeded and bounded, of the engines alone (no daemon, no socket):
``n`` workers on a star network, every host 10 Gbit/s both ways (scaled: the sizes are
ResNet-50's 100 MB ÷ 100 and the rates ÷ 100, so a transfer takes what the paper's took), the
server and the replica on hosts of their own.  A worker computes for Uniform(0.5, 1.5) s, its
update is ready, the server's scheduler takes the ready updates every 100 ms (§7) and plans them
(Alg. 2 without a delay bound, then Alg. 3 with a tenth of the workers as aggregators); the
replica's plan follows with another tenth earmarked for it (k', §5.3).  The worker's next
computation starts once its update reached the server (async), or once the server's last
transfer, if the plan delays it, did.  The bound is a count of updates (§7.3 measures it so):
``n`` x 1, 5 and 20 iterations' updates; the copies still punted when the run ends are sent
too (planned by Alg. 3 as one list), so both strategies give the replica every update.  Each
batch plans on a fresh network from its start
(transfers planned by earlier batches are not carried over): a simplification that favours no
strategy, as both move the same updates.

Run alone: ``python -m bench.replication [--quick]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.report import Column, Progress, Table, fmt_number, quiet, run_alone
from fabricd.engines.scheduling.aggregation import aggregate
from fabricd.engines.scheduling.ordering import Update, in_list_order, order
from fabricd.engines.scheduling.replication import Bound, replicate
from fabricd.engines.scheduling.timelines import Network

if TYPE_CHECKING:
    from collections.abc import Sequence

#: bytes/s of every host's link, each way (10 Gbit/s ÷ 100), and an update's bytes (100 MB ÷ 100)
RATE: Final = 1.25e7
SIZE: Final = 1e6
INTERVAL: Final = 0.1  #: the scheduler's batch (s)
COMPUTE: Final = (0.5, 1.5)  #: a computation's Uniform bounds (s)
AGGREGATORS: Final = (
    0.1  #: the share of the workers aggregating for the server, and for the replica
)
WORKERS: Final = (4, 8, 16, 30)
QUICK_WORKERS: Final = (4, 8)
ITERATIONS: Final = (1, 5, 20)  #: the bound, in iterations' updates (n each)
QUICK_ITERATIONS: Final = (1, 5)
SECONDS, QUICK_SECONDS = 30.0, 10.0  #: virtual training time of each run
#: the replica's downlink against a worker's: equal, and a bottleneck near the replica
#: (§5.3's footnote 5: punting helps "especially when bottleneck is close to replica server")
REPLICA_DOWN: Final = (1.0, 0.25)
QUICK_REPLICA_DOWN: Final = (0.25,)
SEED: Final = 9
SERVER, REPLICA = 0, 1


@dataclass
class Outcome:
    """What one run moved."""

    updates: int = 0  #: applied at the server
    chain_bytes: float = 0.0  #: what chain replication would send the replica
    replica_bytes: float = 0.0  #: what MLfabric's plans sent the replica
    delayed: int = 0  #: batches whose last server transfer waited for the replica
    lags: list[int] = field(default_factory=list)  #: copies punted, after each batch


def simulate(
    workers: int, iterations: int, seconds: float, seed: int, replica_down: float = 1.0
) -> Outcome:
    """One run: ``workers`` workers, a bound of ``iterations`` x ``workers`` updates, the
    replica's downlink ``replica_down`` times a worker's."""
    rng = np.random.default_rng([seed, workers, iterations])
    hosts = list(range(2, 2 + workers))
    k = max(1, round(AGGREGATORS * workers))
    server_aggs = hosts[:k]
    replica_aggs = hosts[k : 2 * k] or hosts[:k]
    ready = {h: float(rng.uniform(*COMPUTE)) for h in hosts}
    bound = Bound(updates=iterations * workers)
    lagging: list[Update] = []
    out = Outcome()
    now, key = 0.0, 0
    while now < seconds:
        now += INTERVAL
        batch_hosts = sorted(h for h, t in ready.items() if t <= now)
        if not batch_hosts and not lagging:
            continue
        rates = dict.fromkeys([SERVER, REPLICA, *hosts], RATE)
        network = Network(rates, rates | {REPLICA: RATE * replica_down}, now=now)
        updates = []
        for host in batch_hosts:
            updates.append(Update(key=key, host=host, version=0, size=SIZE, norm=1.0))
            key += 1
        planned = order(updates, network, server=SERVER, delay_bound=None, v_init=0).planned
        plan = aggregate(planned, network, server=SERVER, aggregators=server_aggs)
        commits = {p.update.key: p.transfer.end for p in plan.direct}
        for group in plan.groups:
            for member in group.members:
                commits[member.update.key] = group.forward.end
        batch = [(p.update, commits[p.update.key]) for p in planned]
        assert plan.network is not None
        replication = replicate(
            batch,
            lagging,
            plan.network,
            replica=REPLICA,
            aggregators=replica_aggs,
            history=0.0,
            momentum=0.0,
            bound=bound,
        )
        direct = [p for p in replication.sent if p.transfer.dst == REPLICA]
        out.replica_bytes += sum(p.transfer.size for p in direct)
        out.replica_bytes += sum(g.forward.size for g in replication.groups)
        out.chain_bytes += SIZE * len(batch)
        out.updates += len(batch)
        lagging = replication.punted
        out.lags.append(len(lagging))
        if replication.delay is not None:
            out.delayed += 1
            delayed_key, start = replication.delay
            commits[delayed_key] = max(commits[delayed_key], start + SIZE / RATE)
        for update, _ in batch:
            ready[update.host] = commits[update.key] + float(rng.uniform(*COMPUTE))
    if lagging:  # what is still punted goes too (the replica must have every update): Alg. 3
        rates = dict.fromkeys([SERVER, REPLICA, *hosts], RATE)
        network = Network(rates, rates | {REPLICA: RATE * replica_down}, now=now)
        listed = in_list_order(lagging, network, server=REPLICA).planned
        rest = aggregate(listed, network, server=REPLICA, aggregators=replica_aggs)
        out.replica_bytes += rest.server_bytes
    return out


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Every (workers, bound) of the sweep."""
    counts: Sequence[int] = QUICK_WORKERS if quick else WORKERS
    bounds: Sequence[int] = QUICK_ITERATIONS if quick else ITERATIONS
    seconds = QUICK_SECONDS if quick else SECONDS
    table = Table(
        name="replication",
        title="(s) MLfabric replication (virtual time): replica inbound bytes, chain vs MLfabric",
        columns=[
            Column("updates", "updates", 0),
            Column("bound", "bound (updates)", 0),
            Column("chain_mb", "chain MB"),
            Column("mlfabric_mb", "mlfabric MB"),
            Column("delayed", "batches delayed", 0),
            Column("lag_mean", "mean lag"),
            Column("lag_max", "max lag", 0),
        ],
        ratio="chain's replica bytes / MLfabric's (higher is better; paper: 5.6x at 30 workers)",
        settings={
            "rate_bytes_per_s": RATE,
            "update_bytes": SIZE,
            "interval_s": INTERVAL,
            "compute_s": list(COMPUTE),
            "aggregators": AGGREGATORS,
            "seconds": seconds,
            "seed": SEED,
        },
    )
    links = QUICK_REPLICA_DOWN if quick else REPLICA_DOWN
    for down, workers, iterations in ((d, w, i) for d in links for w in counts for i in bounds):
        out = simulate(workers, iterations, seconds, SEED, replica_down=down)
        ratio = out.chain_bytes / out.replica_bytes if out.replica_bytes else float("inf")
        label = f"replica down x{down:g}, {workers} workers, {iterations} it."
        table.add(
            label,
            workers,
            ratio,
            updates=out.updates,
            bound=iterations * workers,
            chain_mb=out.chain_bytes / 1e6,
            mlfabric_mb=out.replica_bytes / 1e6,
            delayed=out.delayed,
            lag_mean=float(np.mean(out.lags)) if out.lags else 0.0,
            lag_max=max(out.lags, default=0),
        )
        progress(f"{label}: {out.updates} updates, saving {fmt_number(ratio)}x")
    table.notes.append(
        "virtual time over fabricd's engines (Alg. 2, Alg. 3, the replication planner); no "
        "daemon: what a real replica moves is the parameter server's to wire (issue 25)"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("replication", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
