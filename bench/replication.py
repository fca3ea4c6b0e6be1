"""(s) MLfabric's bounded-divergence replication in virtual time (§3.3, §5.3, §7.3 Fig. 9): the
replica's inbound bytes per update under chain replication against MLfabric's, as workers grow.

Chain replication (what fabricd's replica does today, and the paper's baseline): the primary
forwards every entry it applies to the replica, one per server step (an aggregate the server
took is one entry), so the replica takes the server's inbound bytes and the primary's uplink
carries them.  MLfabric's: workers send copies of their updates to the replica themselves,
planned per batch by :func:`~fabricd.engines.scheduling.replication.replicate` (Alg. 3 toward
the replica on the network the server's transfers left; the prefix the replica will have by
the server's last commit is sent, the rest punted while the replica's lead stays within the
bound, else the server's last transfer waits), so copies punted together can be summed at
the replica's earmarked aggregators.  The figure is chain's replica bytes per update over
MLfabric's per copy (higher is better), counted in a steady window (from :data:`WARMUP` on;
copies still punted when the run ends are not counted): the paper's Fig. 9 saving, which
"plateaus at a factor of 5.6 for 30 workers" as the bound grows to 20 iterations' updates.

A discrete-event simulation, seeded and bounded, of the engines alone (no daemon, no socket):
``n`` workers on a star network, every host 10 Gbit/s both ways (scaled: the sizes are
ResNet-50's 100 MB ÷ 100 and the rates ÷ 100, so a transfer takes what the paper's took), the
server and the replica on hosts of their own, the replica's downlink a worker's or a quarter of
it (a bottleneck near the replica, §5.3's footnote 5).  A worker computes for
Uniform(0.5, 1.5) s, its update is ready, the server's scheduler takes the ready updates every
100 ms (§7) and plans them (Alg. 2 without a delay bound, then Alg. 3 with a tenth of the
workers as aggregators); the replica's plan follows with another tenth earmarked for it (k',
§5.3).  One network is carried from batch to batch with every planned transfer booked on it,
the server's and the copies sent.  The worker's next computation starts once its update
reached the server (async); a delayed last transfer holds the next batch until it starts.
The bound is a count of updates (§7.3 measures it so): ``n`` x 1, 5 and 20 iterations'
updates; the momentum is 0 (the ``sum`` rule: copies may be summed, see the planner).

Run alone: ``python -m bench.replication [--quick]``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.report import Column, Progress, Table, fmt_number, quiet, run_alone
from fabricd.engines.scheduling.aggregation import aggregate
from fabricd.engines.scheduling.ordering import Update, order
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
SECONDS, QUICK_SECONDS = 60.0, 12.0  #: virtual training time of each run
WARMUP: Final = 10.0  #: seconds before the steady window (the lag grows from zero first)
#: the replica's downlink against a worker's: equal, and a bottleneck near the replica
#: (§5.3's footnote 5: punting helps "especially when bottleneck is close to replica server")
REPLICA_DOWN: Final = (1.0, 0.25)
QUICK_REPLICA_DOWN: Final = (0.25,)
SEED: Final = 9
SERVER, REPLICA = 0, 1


@dataclass
class Outcome:
    """What one run moved, counted in its steady window (from :data:`WARMUP` on; copies
    still punted when it ends are not counted: they would be sent later)."""

    updates: int = 0  #: applied at the server in the window
    chain_bytes: float = 0.0  #: what chain replication forwards the replica: one per server step
    copies: int = 0  #: update copies the replica got in the window
    replica_bytes: float = 0.0  #: the bytes they took into the replica (straight or summed)
    grouped: int = 0  #: copies that went inside a replica group's sum
    delayed: int = 0  #: batches whose last server transfer waited for the replica
    lags: list[int] = field(default_factory=list)  #: copies punted, after each batch

    @property
    def saving(self) -> float:
        """Chain's replica bytes per update over MLfabric's per copy."""
        if not self.copies or not self.replica_bytes or not self.updates:
            return math.nan
        return (self.chain_bytes / self.updates) / (self.replica_bytes / self.copies)


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
    rates = dict.fromkeys([SERVER, REPLICA, *hosts], RATE)
    network = Network(rates, rates | {REPLICA: RATE * replica_down})  # carried across batches
    lagging: list[Update] = []
    out = Outcome()
    now, key, hold = 0.0, 0, 0.0
    while now < seconds:
        now += INTERVAL
        counted = now >= WARMUP
        batch_hosts = sorted(h for h, t in ready.items() if t <= now)
        if now < hold or (not batch_hosts and not lagging):
            continue  # (the server's last transfer waits for the replica: nothing starts)
        network.advance(now)
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
        network = plan.network  # the server's transfers stay booked
        replication = replicate(
            batch,
            lagging,
            network,
            replica=REPLICA,
            aggregators=replica_aggs,
            history=0.0,
            momentum=0.0,
            bound=bound,
        )
        forwards = {id(m): g for g in replication.groups for m in g.members}
        for p in replication.sent:  # the copies sent are booked too (their transfers)
            if p.transfer.size and math.isfinite(p.transfer.end):
                network.reserve(
                    p.transfer.src, p.transfer.dst, p.transfer.size, start=p.transfer.start
                )
        for group in replication.groups:
            f = group.forward
            if math.isfinite(f.end):
                network.reserve(f.src, f.dst, f.size, start=f.start)
        if counted:
            out.copies += len(replication.sent)
            out.grouped += len(forwards)
            out.replica_bytes += sum(
                p.transfer.size for p in replication.sent if id(p) not in forwards
            )
            out.replica_bytes += sum(g.forward.size for g in replication.groups)
            out.chain_bytes += plan.server_bytes  # one entry per server step: its bytes
            out.updates += len(batch)
        lagging = replication.punted
        out.lags.append(len(lagging))
        if replication.delay is not None:
            out.delayed += 1
            delayed_key, start = replication.delay
            moved = next((p.transfer for p in plan.direct if p.update.key == delayed_key), None)
            if moved is not None and moved.profile:  # booked again, from its delayed start
                network.release(moved)
                commits[delayed_key] = network.reserve(
                    moved.src, moved.dst, moved.size, start=start
                ).end
            else:  # (an aggregate's member: its group's forward stays; the commit moves)
                commits[delayed_key] = max(commits[delayed_key], start + SIZE / RATE)
            hold = max(hold, start)
        for update, _ in batch:
            ready[update.host] = commits[update.key] + float(rng.uniform(*COMPUTE))
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
            Column("copies", "copies", 0),
            Column("mlfabric_mb", "mlfabric MB"),
            Column("grouped", "grouped", 0),
            Column("delayed", "batches delayed", 0),
            Column("lag_mean", "mean lag"),
            Column("lag_max", "max lag", 0),
        ],
        ratio=(
            "chain's replica bytes per update / MLfabric's per copy, steady window "
            "(higher is better; paper: 5.6x at 30 workers)"
        ),
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
        ratio = out.saving
        label = f"replica down x{down:g}, {workers} workers, {iterations} it."
        table.add(
            label,
            workers,
            ratio,
            updates=out.updates,
            bound=iterations * workers,
            chain_mb=out.chain_bytes / 1e6,
            copies=out.copies,
            mlfabric_mb=out.replica_bytes / 1e6,
            grouped=out.grouped,
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
