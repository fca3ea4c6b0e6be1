"""MLfabric scheduling of a parameter server's pushes between real daemons on loopback (issue
24): workers on three daemons push concurrently under ``scheduling="mlfabric"``; every push is
applied exactly once or reported dropped, the model is the sum of what was applied, and the
status rows and metrics count what the scheduler did.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.scrape import scrape
from tests.integration.test_collectives import ranks
from tests.integration.test_ps import wait

if TYPE_CHECKING:
    from fabricd.client import Client, ParameterServer

pytestmark = pytest.mark.timeout(240)

COUNT = 2000
#: server rank 0 on node 0; workers on every node (two beside the server)
PLACEMENT = (0, 1, 2, 0, 1, 2, 0)


def open_scheduled(fabs: list[Client], servers: list[int], **kw: Any) -> dict[int, ParameterServer]:
    return {
        rank: fab.parameter_server(
            "m",
            (COUNT,),
            "float64",
            "server" if rank in servers else "worker",
            servers=servers,
            consistency="async",
            scheduling="mlfabric",
            **kw,
        )
        for rank, fab in enumerate(fabs)
    }


#: two shards without a bound: a push dropped on one shard only would not say which
@pytest.mark.parametrize(("servers", "bound"), [([0], None), ([0], 1), ([0, 3], None)])
def test_every_push_applied_once_or_dropped_and_the_model_is_their_sum(
    make_cluster: Any, servers: list[int], bound: int | None
) -> None:
    """Six workers push at once, every round, with a stale pull in between for some: under a
    tight delay bound the scheduler drops what cannot make its deadline (at the worker, before
    it is sent), and ``applied + dropped == pushed`` from the workers' own results."""
    cluster = make_cluster(3)
    with ranks(cluster, PLACEMENT, "ps-mlfabric") as fabs:
        pss = open_scheduled(fabs, servers, delay_bound=bound)
        workers = [r for r in range(len(PLACEMENT)) if r not in servers]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        rng = np.random.default_rng(24)
        expected = np.zeros(COUNT)
        pushed = applied = dropped = 0
        for iteration in range(6):
            pulling = [w for w in workers if (w + iteration) % 3]  # the others stay stale
            for w in pulling:
                wait(pss[w].pull_async(models[w]), fabs)
            handles = {}
            for w in workers:
                updates[w][:] = rng.integers(-4, 5, COUNT)
                handles[w] = pss[w].push_async(updates[w])
            for w, handle in handles.items():
                result = wait(handle, fabs)
                pushed += len(servers)
                dropped += len(result.dropped)
                applied += len(servers) - len(result.dropped)
                reasons = result.dropped
                assert all("dropped by the scheduler" in why or "delay" in why for why in reasons)
                if not reasons:
                    expected += updates[w]
        assert applied + dropped == pushed == 6 * len(workers) * len(servers)
        final = fabs[workers[0]].array("final", (COUNT,), "float64")
        wait(pss[workers[0]].pull_async(final), fabs)
        np.testing.assert_array_equal(final, expected)
        if bound is None:
            assert dropped == 0
        statuses = [fab.status() for fab in fabs[:3]]  # ranks 0, 1, 2: one on each daemon
        mine = [row for st in statuses for row in st["ps_servers"] if row["job"] == "ps-mlfabric"]
        assert {row["scheduling"] for row in mine} == {"mlfabric"}
        scheduler = [row["scheduler"] for row in mine if row["role"] == "primary"]
        # every shard push went to its scheduler, but those the worker's own delay gate
        # dropped first (it heard of a version past the bound already)
        gated = sum(row["delay_dropped"] for st in statuses for row in st["ps_workers"])
        assert sum(s["ready"] for s in scheduler) + gated == pushed
        assert sum(sum(s["denied"].values()) for s in scheduler) == sum(
            row["dropped_scheduled"] for row in mine
        )


LEAD_LABELS = frozenset({"service": "ps", "what": "planned"}.items())


def test_two_shards_are_planned_jointly_and_drop_an_update_whole(make_cluster: Any) -> None:
    """Two shards on two daemons (ranks 0 and 3, on nodes 0 and 1) under a tight delay
    bound: shard 0's scheduler plans every update's two parts (issue 25, MLfabric §10.2) and
    tells shard 1's with PLANs, so a scheduler's drop is on both shards or on neither, unless
    shard 1's planned a part alone (its PLAN late: its status counts it).  Every push is still
    applied or dropped on each shard, once, by the workers' own results."""
    cluster = make_cluster(3)
    servers = [0, 3]
    with ranks(cluster, PLACEMENT, "ps-joint") as fabs:
        pss = open_scheduled(fabs, servers, delay_bound=1)
        workers = [r for r in range(len(PLACEMENT)) if r not in servers]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        partial: list[tuple[str, ...]] = []  #: a scheduler's drop, the other part applied
        pushed = dropped = 0
        for iteration in range(8):
            for w in [w for w in workers if (w + iteration) % 3]:  # the others stay stale
                wait(pss[w].pull_async(models[w]), fabs)
            handles = {}
            for w in workers:
                updates[w][:] = w + iteration
                handles[w] = pss[w].push_async(updates[w])
            for handle in handles.values():
                result = wait(handle, fabs)
                pushed += 2
                dropped += len(result.dropped)
                by_scheduler = any("by the scheduler" in why for why in result.dropped)
                if by_scheduler and len(result.dropped) != 2:
                    partial.append(result.dropped)
        statuses = [fab.status() for fab in fabs[:3]]
        rows = [row for st in statuses for row in st["ps_servers"] if row["job"] == "ps-joint"]
        lead = next(r["scheduler"] for r in rows if r["role"] == "primary" and r["shard"] == 0)
        other = next(r["scheduler"] for r in rows if r["role"] == "primary" and r["shard"] == 1)
        assert lead["joint"]["planned"] > 0
        assert other["joint"]["held"] == 0
        if other["joint"]["fell_back"] == 0:
            # (a part the worker's own delay gate dropped first is planned alone: the other
            # part may then be dropped by its scheduler, the update still dropped whole)
            assert partial == []
        applied = sum(r["applied"] for r in rows if r["role"] == "primary")
        assert applied + dropped == pushed == 8 * len(workers) * 2
        samples = scrape(cluster.nodes[0].metrics_url)  # (node 0 serves shard 0: the lead)
        planned = samples["fabricd_ps_joint_parts_total", LEAD_LABELS]
        assert planned == lead["joint"]["planned"]


def test_scheduling_needs_async_or_bsp(make_cluster: Any) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "ps-mlfabric-ssp") as fabs:
        with pytest.raises(fabricd.UsageError, match="not ssp"):
            fabs[0].parameter_server(
                "m", (8,), "float64", "server", consistency="ssp", scheduling="mlfabric"
            )
        with pytest.raises(fabricd.UsageError, match="scheduling"):
            fabs[1].parameter_server("m", (8,), "float64", scheduling="fifo")


#: eight workers over three daemons, the server's beside two of them
AGGREGATING = (0, 1, 2, 1, 2, 0, 1, 2, 0)


def _subset_sums(updates: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    sums = [np.zeros(COUNT)]
    for update in updates:
        sums += [s + update for s in sums]
    return sums


@pytest.mark.parametrize("kill", [None, 2])
@pytest.mark.parametrize("consistency", ["async", "bsp"])
def test_aggregation_applies_each_push_once_even_when_an_aggregator_dies(
    make_cluster: Any, kill: int | None, consistency: str
) -> None:
    """Eight workers push at once every round, so the shard's scheduler groups their pushes
    at worker daemons (Alg. 3; under BSP, MLfabric-S of §6: a round is an iteration, its
    result waits for every live worker's push); with ``kill``, that node's daemon is
    SIGKILLed mid-run (an aggregator, and its workers, die): the others' pushes it held go
    straight to the server after their wait.  Every acknowledged push is applied once: the
    model is their sum, plus at most the dead workers' pushes in flight (each whole or not at
    all)."""
    cluster = make_cluster(3)
    with ranks(cluster, AGGREGATING, "ps-aggregate") as fabs:
        pss = {
            rank: fab.parameter_server(
                "m",
                (COUNT,),
                "float64",
                "server" if rank == 0 else "worker",
                servers=[0],
                consistency=consistency,
                scheduling="mlfabric",
                aggregation=True,
            )
            for rank, fab in enumerate(fabs)
        }
        workers = list(range(1, len(AGGREGATING)))
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        rng = np.random.default_rng(25)
        acked = np.zeros(COUNT)
        in_flight: list[np.ndarray[Any, Any]] = []
        alive = list(workers)
        pushed = answered = applied = 0
        for iteration in range(8):
            if kill is not None and iteration == 4:
                handles = {}
                for w in alive:
                    updates[w][:] = rng.integers(-4, 5, COUNT)
                    handles[w] = pss[w].push_async(updates[w])
                cluster.kill(kill, signal.SIGKILL)
                dead = [w for w in alive if AGGREGATING[w] == kill]
                in_flight = [np.array(updates[w]) for w in dead]
                alive = [w for w in alive if w not in dead]
                for w in alive:
                    result = wait(handles[w], fabs)
                    pushed += 1
                    answered += 1
                    assert not result.dropped
                    acked += updates[w]
                    applied += 1
                continue
            handles = {}
            for w in alive:
                updates[w][:] = rng.integers(-4, 5, COUNT)
                handles[w] = pss[w].push_async(updates[w])
            for w, handle in handles.items():
                result = wait(handle, fabs)
                pushed += 1
                answered += 1
                assert not result.dropped  # no bound: nothing is dropped
                acked += updates[w]
                applied += 1
        assert answered == pushed
        final = fabs[alive[0]].array("final", (COUNT,), "float64")
        wait(pss[alive[0]].pull_async(final), fabs)
        residual = final - acked
        assert any(np.array_equal(residual, s) for s in _subset_sums(in_flight))
        row = next(r for r in fabs[0].status()["ps_servers"] if r["job"] == "ps-aggregate")
        assert row["aggregates"] > 0  # the scheduler did group pushes
        assert applied <= row["applied"] <= applied + len(in_flight)
