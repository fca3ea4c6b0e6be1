"""Bounded-divergence replication between real daemons on loopback (issue 25, MLfabric §3.3,
§5.3): the primary leads its replica by at most the bound and then waits; its daemon is
SIGKILLed mid-run; the workers hear the epoch change (a rollback may have happened), the
served model is within the bound of the last one the primary acknowledged, and nothing is
applied twice.

The replica is made to lag on purpose: its shard runs the update callback in its own process,
which does not serve until the primary is dead, so the replica confirms nothing and the
primary may lead by exactly the bound's count.  Each worker's update of each iteration is a
one-hot vector of its own position, so the model says which updates it holds, and how often.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import ranks
from tests.integration.test_ps import wait

if TYPE_CHECKING:
    from fabricd.client import ParameterServer

pytestmark = pytest.mark.timeout(240)

COUNT = 64
BOUND = 3
WORKERS = (2, 3)


def add(model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
    model += update


def serve(server: ParameterServer) -> None:
    """Serve until the daemon or the client goes (the test kills the primary's daemon)."""
    with contextlib.suppress(fabricd.FabricError):
        server.serve(120.0)


def position(worker: int, iteration: int) -> int:
    return 2 * iteration + WORKERS.index(worker)


def test_a_primary_killed_under_bounded_replication_loses_at_most_the_bound(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3)
    placement = (0, 1, 2, 2)  # primary alone on node 0, replica on node 1, workers on node 2
    spec: dict[str, Any] = {
        "servers": [0],
        "replicas": [1],
        "consistency": "async",
        "replication": "bounded",
        "divergence_bound": fabricd.DivergenceBound(updates=BOUND),
    }
    with ranks(cluster, placement, "ps-bounded") as fabs:
        primary = fabs[0].parameter_server(
            "m", (COUNT,), "float64", "server", update_rule=add, **spec
        )
        replica = fabs[1].parameter_server(
            "m", (COUNT,), "float64", "replica", update_rule=add, **spec
        )
        threading.Thread(target=serve, args=(primary,), daemon=True).start()
        pss = {w: fabs[w].parameter_server("m", (COUNT,), "float64", **spec) for w in WORKERS}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in WORKERS}
        acked: dict[tuple[int, int], tuple[int, int]] = {}  # (worker, it) -> (epoch, version)

        def push(w: int, it: int) -> Any:
            updates[w][:] = 0.0
            updates[w][position(w, it)] = 1.0
            return pss[w].push_async(updates[w])

        # the replica's process does not run its steps: the primary applies BOUND pushes
        # ahead of it, then holds the next
        for it, w in [(0, 2), (0, 3), (1, 2)]:
            result = wait(push(w, it), fabs)
            assert result.dropped == ()
            acked[(w, it)] = (result.epochs[0], result.versions[0])
        held = push(3, 1)
        row = next(r for r in fabs[0].status()["ps_servers"] if r["job"] == "ps-bounded")
        assert (row["replication"], row["lag"]) == ("bounded", BOUND)
        assert not held.done()
        last_acknowledged = np.zeros(COUNT)
        for w, it in acked:
            last_acknowledged[position(w, it)] = 1.0

        cluster.kill(0, signal.SIGKILL)  # the primary's daemon dies mid-run
        threading.Thread(target=serve, args=(replica,), daemon=True).start()
        result = wait(held, fabs)  # sent again to the promoted replica
        assert result.epochs == (1,)
        acked[(3, 1)] = (1, result.versions[0])
        for it in range(2, 4):
            for w in WORKERS:
                result = wait(push(w, it), fabs)
                assert result.epochs == (1,)
                acked[(w, it)] = (1, result.versions[0])

        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in WORKERS}
        for w in WORKERS:
            wait(pss[w].pull_async(models[w]), fabs)
            events = [e.fields for e in fabs[w].poll(1.0) if e.name == "ps_epoch"]
            assert [(e["epoch"], e["server"], e["rollback"]) for e in events] == [(1, 1, True)]
        model = models[2]
        np.testing.assert_array_equal(models[3], model)
        assert set(np.unique(model)) <= {0.0, 1.0}  # nothing applied twice
        for (w, it), (epoch, _) in acked.items():
            if epoch == 1:
                assert model[position(w, it)] == 1.0  # everything the new primary took
        lost = [
            (w, it) for (w, it), (e, _) in acked.items() if e == 0 and not model[position(w, it)]
        ]
        assert len(lost) <= BOUND
        # the served model, less what came after the failover, is within the bound of the
        # last model the primary acknowledged: what it lacks is at most BOUND updates
        survived = model.copy()
        for (w, it), (epoch, _) in acked.items():
            if epoch == 1:
                survived[position(w, it)] = 0.0
        assert np.count_nonzero(last_acknowledged - survived) <= BOUND
        assert not np.any(survived - last_acknowledged > 0)  # nothing the primary never took


def test_scheduled_bounded_replication_plans_copies_and_the_replica_catches_up(
    make_cluster: Any,
) -> None:
    """Under MLfabric's scheduling the shard's scheduler plans the copies (some punted and
    granted later, the daemons told a slow link): every push is applied once and the replica
    ends level with its primary (copy_plan.py, copying.py)."""
    rate = 4e6  # bytes/s, told to every daemon: a 256 KB update takes 64 ms a hop
    cluster = make_cluster(4, link_up_bps=rate, link_down_bps=rate)
    placement = (0, 1, 2, 3)
    spec: dict[str, Any] = {
        "servers": [0],
        "replicas": [1],
        "consistency": "async",
        "scheduling": "mlfabric",
        "replication": "bounded",
        "divergence_bound": fabricd.DivergenceBound(updates=1),
    }
    with ranks(cluster, placement, "ps-sched-bounded") as fabs:
        pss = {
            0: fabs[0].parameter_server("m", (COUNT * 1024,), "float32", "server", **spec),
            1: fabs[1].parameter_server("m", (COUNT * 1024,), "float32", "replica", **spec),
        }
        pss |= {
            w: fabs[w].parameter_server("m", (COUNT * 1024,), "float32", **spec) for w in WORKERS
        }
        updates = {w: fabs[w].array("u", (COUNT * 1024,), "float32") for w in WORKERS}
        model = fabs[2].array("w", (COUNT * 1024,), "float32")
        expected = np.zeros(COUNT * 1024, np.float32)
        for it in range(6):
            for w in WORKERS:
                updates[w][:] = float(w + it)
                expected += updates[w]
            for handle in [pss[w].push_async(updates[w]) for w in WORKERS]:
                assert wait(handle, fabs).dropped == ()
        wait(pss[2].pull_async(model), fabs)
        np.testing.assert_array_equal(model, expected)

        def rows() -> dict[str, Any]:
            found = {}
            for fab in fabs[:2]:
                for row in fab.status()["ps_servers"]:
                    if row["job"] == "ps-sched-bounded":
                        found[row["role"]] = row
            return found

        guard = time.monotonic() + 30  # a hang guard
        while True:
            seen = rows()
            level = seen["primary"]["lag"] == 0
            if level and seen["replica"]["version"] == seen["primary"]["version"]:
                break
            assert time.monotonic() < guard, f"the replica never caught up: {seen}"
            time.sleep(0.05)
        assert seen["primary"]["version"] == 6 * len(WORKERS)
        held = sum(fabs[w].status()["counters"]["ps_copies_held"] for w in WORKERS)
        assert held > 0  # the plan held some copies back (punted, or after their pushes)
