"""(s2) Bounded-divergence replication on real daemons: what the primary's link carries, against
chain replication and against checkpointing (MLfabric §7.3, Fig. 9 in spirit).

One parameter-server shard of a float32 model of ``--size`` bytes on four local daemons: the
server alone on node 0, its replica alone on node 1, ``W`` worker ranks on nodes 2 and 3 (half
each).  Each worker pushes ``--rounds`` dense updates, all workers at once each round (async,
``update_rule="sum"``), under five setups, each a job of its own on the same daemons:

* ``none``: no replica: the floor, what the pushes alone cost;
* ``chain``: a replica, chain replication (the default: the primary forwards each push);
* ``bounded``: a replica, ``replication="bounded"`` with a bound of ``2 W`` updates: the
  workers' daemons send the replica copies, the primary forwards the order only;
* ``none sched`` and ``bounded sched``: no replica, and bounded replication, under
  ``scheduling="mlfabric"``: the pushes paced by the shard's scheduler (a round waits for its
  batch's decision) and, bounded, the copies planned into its grants after them
  (fabricd/engines/ps/copy_plan.py); the latter's time is over the former's;
* ``ckpt k`` (k = 1, 10): no replica; every k rounds a rank pulls the whole model and writes it
  to a file, fsynced (what a checkpoint of the server's state costs, done from outside).

Every byte count comes from the daemons' status rows (``peers``: bytes each link moved), read
before and after each setup: the primary's daemon's bytes in and out, and the replica's
daemon's bytes in, per update.  The ratio is chain's primary bytes per update over bounded's
(higher is better: how many times less the primary's link carries).  The paper measures the
replica's traffic saved against chain replication in a shaped datacentre network (5.6x at 30
workers) and checkpointing's overhead in time (76 min every update against MLfabric's 16); on
loopback there is no link to saturate, so the time columns (a round's wall time over the
``none`` setup's, the median of five interleaved passes, one process playing every rank) say
what each setup costs in work, not what a network would make of it, and move by tens of
per cent between runs on a shared two-core machine; bench/replication.py has the network in
virtual time.

``replication-netns`` (:func:`run_netns`, root) runs the same sweep on four daemons in network
namespaces, every link ``tbf``-shaped to :data:`MBIT` Mbit/s both ways
(:mod:`bench.netns_cluster`), :data:`NETNS_ROUNDS` rounds a setup, :data:`NETNS_PASSES` passes:
there the time columns are the network's.  ``replication-netns-slow``
(:func:`run_netns` with ``replica_mbit`` :data:`SLOW_REPLICA_MBIT`) shapes the replica's node
slower than the rest: the bottleneck near the replica that §5.3's planned copies are for.  The
mapping to §7.3: the paper's replica traffic is the primary's link; here a link is
full-duplex, so the chain's forwards (the primary's outbound) do not slow its pushes
(inbound), while bounded replication's copies double what each worker's uplink carries.

Run alone: ``python -m bench.replication_daemons [--quick]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from bench.netns_cluster import shaped_cluster, why_not
from bench.report import Column, MiB, Progress, Table, fmt_number, median, quiet, run_alone

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.client import Client

WORKERS: Final = (2, 4, 8)
QUICK_WORKERS: Final = (2,)
ROUNDS: Final = 100
QUICK_ROUNDS: Final = 4
NBYTES: Final = 1 * MiB
QUICK_NBYTES: Final = 64 * 1024
SETUPS: Final = ("none", "chain", "bounded", "none sched", "bounded sched", "ckpt 1", "ckpt 10")
PASSES: Final = 5
QUICK_PASSES: Final = 1
#: replication-netns: every link's shaped rate (Mbit/s), the rounds and passes of a setup;
#: replication-netns-slow: the replica's node's rate (a bottleneck near the replica, §5.3)
MBIT: Final = 100.0
SLOW_REPLICA_MBIT: Final = 25.0
NETNS_ROUNDS: Final = 10
NETNS_PASSES: Final = 3
#: seconds a call may take before the bench says it hung
WAIT: Final = 120.0


def _bytes(client: Client) -> tuple[int, int]:
    """(bytes sent, bytes received) over every link of ``client``'s daemon so far."""
    peers = client.status()["peers"]
    return sum(p["bytes_sent"] for p in peers), sum(p["bytes_received"] for p in peers)


def measure(
    sockets: Sequence[str], setup: str, workers: int, rounds: int, nbytes: int
) -> dict[str, float]:
    """One setup's figures: primary bytes per update (in + out), replica bytes in per update,
    seconds per round."""
    import fabricd

    replicated = setup in ("chain", "bounded", "bounded sched")
    count = nbytes // 4
    first = 2 if replicated else 1  # the first worker rank
    size = first + workers
    job = f"bench-rep-{uuid.uuid4().hex[:8]}"
    nodes = [0, *([1] if replicated else []), *(2 + (w % 2) for w in range(workers))]
    fabs = [
        fabricd.connect(job=job, rank=r, size=size, socket_path=sockets[n])
        for r, n in enumerate(nodes)
    ]
    try:
        spec: dict[str, Any] = {"servers": [0], "consistency": "async"}
        if replicated:
            spec["replicas"] = [1]
        if setup.endswith("sched"):  # (bounded: the copies planned into the grants)
            spec["scheduling"] = "mlfabric"
        if setup.startswith("bounded"):
            spec["replication"] = "bounded"
            spec["divergence_bound"] = fabricd.DivergenceBound(updates=2 * workers)
        roles = ["server", *(["replica"] if replicated else [])]
        pss = [
            fab.parameter_server(
                "m", (count,), "float32", roles[r] if r < first else "worker", **spec
            )
            for r, fab in enumerate(fabs)
        ]
        ranks = range(first, size)
        updates = {r: fabs[r].array("u", (count,), "float32") for r in ranks}
        for r in ranks:
            updates[r][:] = np.random.default_rng(r).standard_normal(count, dtype=np.float32)
        period = int(setup.split()[1]) if setup.startswith("ckpt") else 0
        model = fabs[first].array("ckpt", (count,), "float32")
        before = [_bytes(fabs[0]), _bytes(fabs[1])]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(rounds):
                handles = [pss[r].push_async(updates[r]) for r in ranks]
                for handle in handles:
                    handle.wait(timeout=WAIT)
                if period and (round_ + 1) % period == 0:
                    pss[first].pull_async(model).wait(timeout=WAIT)
                    path = os.path.join(scratch, "model.npy")
                    with open(path, "wb") as out:
                        np.save(out, model)
                        out.flush()
                        os.fsync(out.fileno())
        elapsed = time.perf_counter() - start
        after = [_bytes(fabs[0]), _bytes(fabs[1])]
    finally:
        for fab in fabs:
            fab.close()
    pushes = workers * rounds
    primary = sum(after[0]) - sum(before[0])
    replica_in = after[1][1] - before[1][1] if replicated else 0
    return {
        "primary": primary / pushes,
        "replica": replica_in / pushes,
        "round_s": elapsed / rounds,  # (bytes are the same in every pass: exact counters)
    }


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Every (workers, setup) of the sweep, on one set of four loopback daemons."""
    from fabricd.daemon.launcher import LocalCluster

    table = _table("replication-daemons", "on real daemons", quick)
    with LocalCluster(4) as cluster:
        cluster.wait_connected()
        sockets = [node.socket_path for node in cluster.nodes]
        rounds, passes = (QUICK_ROUNDS, QUICK_PASSES) if quick else (ROUNDS, PASSES)
        _sweep(sockets, table, quick, progress, rounds=rounds, passes=passes)
    table.notes.append(
        "loopback daemons, one process playing every rank: bytes are exact (the daemons' link "
        "counters); times are work, not a network's (bench/replication.py: virtual time; "
        "replication-netns: shaped links)"
    )
    return table


def run_netns(
    quick: bool = False, progress: Progress = quiet, *, replica_mbit: float = MBIT
) -> Table:
    """The same sweep on four daemons in network namespaces, every link shaped to
    :data:`MBIT` Mbit/s both ways but the replica's node's, at ``replica_mbit`` (root; module
    docstring)."""
    name = "replication-netns" if replica_mbit == MBIT else "replication-netns-slow"
    why = why_not()
    if why is not None:
        return Table(name=name, title="", columns=[], ratio="", skipped=why)
    where = f"on shaped links ({MBIT:g} Mbit/s, the replica's {replica_mbit:g})"
    table = _table(name, where, quick)
    table.settings["rounds"] = rounds = QUICK_ROUNDS if quick else NETNS_ROUNDS
    passes = QUICK_PASSES if quick else NETNS_PASSES
    with shaped_cluster([MBIT, replica_mbit, MBIT, MBIT]) as (sockets, _):
        _sweep(sockets, table, quick, progress, rounds=rounds, passes=passes)
    table.notes.append(
        f"four daemons in network namespaces, every link tbf-shaped to {MBIT:g} Mbit/s both "
        f"ways, the replica's {replica_mbit:g}: the times are the network's; single samples' "
        "medians on a shared machine"
    )
    return table


def _table(name: str, where: str, quick: bool) -> Table:
    return Table(
        name=name,
        title=f"(s2) MLfabric bounded replication {where}: the primary's link, chain vs bounded",
        columns=[
            Column("update_kb", "update KB"),
            Column("none_kb", "no replica KB/upd"),
            Column("chain_kb", "chain KB/upd"),
            Column("bounded_kb", "bounded KB/upd"),
            Column("replica_chain_kb", "replica in, chain"),
            Column("replica_bounded_kb", "replica in, bounded"),
            Column("ckpt1_kb", "ckpt/1 KB/upd"),
            Column("chain_t", "chain time x"),
            Column("bounded_t", "bounded time x"),
            Column("sched_t", "bounded sched time x (vs none sched)"),
            Column("ckpt1_t", "ckpt/1 time x"),
            Column("ckpt10_t", "ckpt/10 time x"),
        ],
        ratio="chain's primary bytes per update / bounded's (higher is better)",
        settings={
            "rounds": QUICK_ROUNDS if quick else ROUNDS,
            "nbytes": QUICK_NBYTES if quick else NBYTES,
            "setups": list(SETUPS),
        },
    )


def _sweep(
    sockets: Sequence[str],
    table: Table,
    quick: bool,
    progress: Progress,
    *,
    rounds: int,
    passes: int,
) -> None:
    """Every (workers, setup) on the daemons of ``sockets``, a row per worker count."""
    counts: Sequence[int] = QUICK_WORKERS if quick else WORKERS
    nbytes = QUICK_NBYTES if quick else NBYTES
    for workers in counts:
        measure(sockets, "none", workers, max(2, rounds // 10), nbytes)  # a warm-up, dropped
        # the setups interleaved, ``passes`` times: a round's time is the median pass's (the
        # machine's noise moves one setup's time by half from one pass to the next)
        runs = [
            {setup: measure(sockets, setup, workers, rounds, nbytes) for setup in SETUPS}
            for _ in range(passes)
        ]
        figures = {
            setup: {
                **runs[0][setup],
                "round_s": median([run[setup]["round_s"] for run in runs]),
            }
            for setup in SETUPS
        }
        base = figures["none"]["round_s"]
        ratio = figures["chain"]["primary"] / figures["bounded"]["primary"]
        table.add(
            f"{workers} workers",
            nbytes,
            ratio,
            update_kb=nbytes / 1e3,
            none_kb=figures["none"]["primary"] / 1e3,
            chain_kb=figures["chain"]["primary"] / 1e3,
            bounded_kb=figures["bounded"]["primary"] / 1e3,
            replica_chain_kb=figures["chain"]["replica"] / 1e3,
            replica_bounded_kb=figures["bounded"]["replica"] / 1e3,
            ckpt1_kb=figures["ckpt 1"]["primary"] / 1e3,
            chain_t=figures["chain"]["round_s"] / base,
            bounded_t=figures["bounded"]["round_s"] / base,
            sched_t=figures["bounded sched"]["round_s"] / figures["none sched"]["round_s"],
            ckpt1_t=figures["ckpt 1"]["round_s"] / base,
            ckpt10_t=figures["ckpt 10"]["round_s"] / base,
        )
        progress(f"{workers} workers: chain/bounded primary bytes {fmt_number(ratio)}x")


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("replication_daemons", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
