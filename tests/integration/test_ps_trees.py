"""Model distribution trees between real daemons on loopback (issue 25, MLfabric §10.3): a
server alone on its node and one worker on each of four others; under ``distribution="tree"``
every BSP iteration's pulls are answered at one version, some through distributors'
daemons, every worker's model is the sum of every push; a distributor's daemon SIGKILLed
mid-run costs the others a direct pull, never an answer."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests.integration.test_collectives import ranks
from tests.integration.test_ps import wait

if TYPE_CHECKING:
    from fabricd.client import Client, ParameterServer

pytestmark = pytest.mark.timeout(240)

COUNT = 20_000
WORKERS = (1, 2, 3, 4)
RATE = 1.25e8  #: bytes/s: 1 Gbit/s
SPEC: dict[str, Any] = {
    "servers": [0],
    "consistency": "bsp",
    "scheduling": "mlfabric",
    "distribution": "tree",
}


def counter(fabs: list[Client], name: str) -> int:
    return sum(fab.status()["counters"][name] for fab in fabs)


def iterate(
    fabs: list[Client],
    pss: dict[int, ParameterServer],
    workers: tuple[int, ...],
    updates: dict[int, Any],
    models: dict[int, Any],
) -> list[int]:
    pushed = [pss[w].push_async(updates[w]) for w in workers]
    for handle in pushed:
        wait(handle, fabs)
    pulled = [pss[w].pull_async(models[w]) for w in workers]
    return [wait(handle, fabs) for handle in pulled]


def test_bsp_pulls_go_through_distribution_trees_and_survive_a_dead_distributor(
    make_cluster: Any,
) -> None:
    # every daemon told the same link rate: the plan is known (one distributor for four
    # pullers), where loopback's measured figures would make it a draw
    cluster = make_cluster(5, link_up_bps=RATE, link_down_bps=RATE)
    with ranks(cluster, (0, *WORKERS), "ps-trees") as fabs:
        pss = {0: fabs[0].parameter_server("m", (COUNT,), "float64", "server", **SPEC)}
        pss |= {w: fabs[w].parameter_server("m", (COUNT,), "float64", **SPEC) for w in WORKERS}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in WORKERS}
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in WORKERS}
        rng = np.random.default_rng(7)
        expected = np.zeros(COUNT)
        for iteration in range(4):
            for w in WORKERS:
                updates[w][:] = rng.integers(-4, 5, COUNT)
                expected += updates[w]
            versions = iterate(fabs, pss, WORKERS, updates, models)
            assert versions == [iteration + 1] * len(WORKERS)  # one version per batch
            for w in WORKERS:
                np.testing.assert_array_equal(models[w], expected)
        assert counter(fabs, "ps_pulls_forwarded") > 0
        # a forwarded answer is its distributor's, a member's: never refused or dropped
        assert counter(fabs, "frames_refused_not_member") == 0
        assert counter(fabs, "ps_frames_dropped") == 0
        (row,) = [r for r in fabs[0].status()["ps_servers"] if r["job"] == "ps-trees"]
        assert row["distribution"] == "tree"
        assert row["trees"]["forwarded"] > 0
        assert row["trees"]["server_bytes"] < row["trees"]["pulls"] * 8 * COUNT

        # the daemon of a worker that forwarded answers dies: its rank is lost to the
        # server (BSP goes on without it) and the others' pulls come through or straight
        distributor = next(
            w for w in WORKERS if fabs[w].status()["counters"]["ps_pulls_forwarded"] > 0
        )
        cluster.kill(distributor, signal.SIGKILL)
        alive = tuple(w for w in WORKERS if w != distributor)
        live = [fabs[0], *(fabs[w] for w in alive)]
        for _ in range(3):
            for w in alive:
                updates[w][:] = rng.integers(-4, 5, COUNT)
                expected += updates[w]
            iterate(live, pss, alive, updates, models)
            for w in alive:
                np.testing.assert_array_equal(models[w], expected)
