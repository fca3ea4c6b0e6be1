"""MLfabric on real daemons in network namespaces with ``tbf``-shaped links (issue 24, item 7):
a short run of ``bench/mlfabric_netns.py``'s experiment, arrival order, MLfabric-A and its
aggregation, then BSP in arrival order and MLfabric-S (BSP, scheduled, aggregating), on four
daemons, one worker host at 1/10 the others' rate; RR-Sync (a ring allreduce per iteration) on
the same daemons; and MLfabric-S where the slow link moves and the rates are measured, not
configured.

Only exactness is asserted, never speed: every push is applied or reported dropped, the
server applied exactly what the workers were told was applied, nothing applied broke the delay
bound, and the final model is the sum of the applied (integer) updates, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from bench.mlfabric_netns import MODES, Settings, shifting, synchronous, train, train_ring
from fabricd.engines.ps.consistency import DELAY_BUCKETS

if TYPE_CHECKING:
    from tests.network.cluster import MakeNetCluster

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]

#: each mode's training time (s): a few iterations of every worker, the slow host's included
SECONDS = 2.0
#: the daemons' default liveness: a 10 Mbit/s link carrying 1 MiB pushes must not make a
#: peer look suspect (the fast liveness of the other network tests is tuned for faults)
LIVENESS = {"heartbeat_interval": 1.0, "suspect_after": 3.0, "down_after": 10.0}


def test_every_push_is_applied_or_dropped_within_the_bound_and_the_model_is_their_sum(
    make_net_cluster: MakeNetCluster,
) -> None:
    settings = Settings(seconds=SECONDS)
    fabric = make_net_cluster(settings.nodes, node_env=settings.node_env(), **LIVENESS)
    for node in range(settings.nodes):
        fabric.net.shape(node, settings.mbit(node))
    sockets = [fabric.socket(node) for node in range(settings.nodes)]
    over = DELAY_BUCKETS.index(settings.delay_bound) + 1  # the first bucket past the bound
    for mode in MODES:
        result = train(sockets, mode, settings)
        row = result.server
        assert row is not None
        print(
            f"{mode}: pushed {result.pushed}, applied {result.applied}, dropped "
            f"{result.dropped} ({row['dropped_scheduled']} by the scheduler), "
            f"aggregates {row['aggregates']}"
        )
        assert result.pushed > 0
        assert result.applied + result.dropped == result.pushed, result.reasons
        if synchronous(mode):  # every iteration applied whole, one version each, none dropped
            assert result.dropped == 0
            assert result.pushed == settings.bsp_iterations * result.workers
            assert row["applied"] == result.applied == result.version * result.workers
        else:
            assert row["applied"] == result.applied == result.version
        assert row["dropped_delay"] + row["dropped_scheduled"] <= result.dropped
        assert sum(row["delays"][over:]) == 0, row["delays"]  # none past the bound
        assert sum(row["delays"]) == row["applied"]
        assert result.model_is_sum
        assert all("delay" in why or "dropped by the scheduler" in why for why in result.reasons)
        if MODES[mode]["scheduling"] == "arrival":
            assert row["dropped_scheduled"] == 0
    ring = train_ring(sockets, settings)  # RR-Sync: every worker's model is every update's sum
    assert ring.pushed == ring.applied == settings.bsp_iterations * ring.workers
    assert ring.version == settings.bsp_iterations
    assert ring.model_is_sum


def test_a_moving_slow_link_with_measured_rates_keeps_mlfabric_s_exact(
    make_net_cluster: MakeNetCluster,
) -> None:
    """The shifting condition: no configured rates (the scheduler plans with what the network
    monitor measures), the slowdown moving every second; MLfabric-S (BSP, scheduled,
    aggregating) still applies every push once and the model is their sum."""
    settings = Settings(seconds=SECONDS, configured=False, shift_period=1.0)
    assert settings.node_env() == {}
    fabric = make_net_cluster(settings.nodes, **LIVENESS)
    for node in range(settings.nodes):
        fabric.net.shape(node, settings.mbit(node))
    sockets = [fabric.socket(node) for node in range(settings.nodes)]
    with shifting(settings, fabric.net, sockets) as shift:
        result = train(sockets, "bsp mlfabric+agg", settings)
    assert shift is not None
    assert result.server is not None
    assert result.dropped == 0
    assert result.pushed == result.applied == settings.bsp_iterations * result.workers
    assert result.server["applied"] == result.applied == result.version * result.workers
    assert result.model_is_sum
    # the monitor was read while the slowdown moved (the run lasts past the first second:
    # two computations of 0.5 s, and 1 MiB pushes and pulls over a 10 Mbit/s link)
    assert shift.samples
    print([(round(s.at, 1), [s.measured(n) for n in sorted(s.true)]) for s in shift.samples])
