"""MLfabric scheduling of a parameter server's pushes between real daemons on loopback (issue
24): workers on three daemons push concurrently under ``scheduling="mlfabric"``; every push is
applied exactly once or reported dropped, the model is the sum of what was applied, and the
status rows and metrics count what the scheduler did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
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


def test_scheduling_needs_async(make_cluster: Any) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "ps-mlfabric-bsp") as fabs:
        with pytest.raises(fabricd.UsageError, match="async"):
            fabs[0].parameter_server(
                "m", (8,), "float64", "server", consistency="bsp", scheduling="mlfabric"
            )
        with pytest.raises(fabricd.UsageError, match="scheduling"):
            fabs[1].parameter_server("m", (8,), "float64", scheduling="fifo")
