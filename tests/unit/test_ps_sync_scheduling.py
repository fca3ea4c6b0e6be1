"""MLfabric-S (§6): a BSP parameter server's pushes scheduled and aggregated at worker daemons,
without sockets: the list-order planner, the synchronous shard scheduler, the coordinator's
BSP aggregates (held with their iteration, each sum added once, kept across a snapshot), and
the whole path on the in-process fabric of ``ps_fabric`` under interleavings, resends, resets,
failovers and a dead aggregator.

What must hold (issue 24): under BSP nothing is dropped; every update of an iteration is
applied exactly once, in that iteration's one step, whichever way it came (straight, or inside
one aggregate); the model is the sum of the pushes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.daemon.services.ps_requests import check_spec
from fabricd.engines.ps import messages
from fabricd.engines.ps.consistency import (
    SGD,
    Apply,
    Consistency,
    Coordinator,
    Drop,
    DropReason,
    Sum,
)
from fabricd.engines.ps.scheduler import Denied, Gather, Granted, ShardScheduler
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.worker import SendPush, SendReady, Worker
from fabricd.engines.scheduling.ordering import Update, in_list_order
from fabricd.engines.scheduling.timelines import Network
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.frames.ps import MAX_GRANT_WAIT_US
from tests.unit.test_ps_aggregation import LINKS, aggregating, encoded
from tests.unit.test_ps_scheduling import outcomes, settle
from tests.unit.test_ps_server import moves, run

if TYPE_CHECKING:
    from tests.unit.ps_fabric import Fabric

Array = np.ndarray[Any, Any]
BSP = Consistency.BSP
SERVER = 9


def values(*xs: float) -> Array:
    return np.array(xs, np.float64)


# -- the list-order planner -----------------------------------------------------------------
def test_a_synchronous_batch_keeps_its_order_and_drops_nothing() -> None:
    """The shortest transfer is last in the list: it stays last (Alg. 1 would send it first),
    each transfer booked after the one before it on the server's downlink."""
    rates = dict.fromkeys((1, 2, 3, SERVER), 10.0)
    network = Network(rates, rates, now=5.0)
    updates = [Update(key=k, host=k, version=0, size=size) for k, size in ((1, 20), (2, 40))]
    updates.append(Update(key=3, host=3, version=0, size=1))
    plan = in_list_order(updates, network, server=SERVER)
    assert [p.update.key for p in plan.planned] == [1, 2, 3]
    assert plan.dropped == []
    ends = [p.transfer.end for p in plan.planned]
    assert ends == pytest.approx([7.0, 11.0, 11.1])
    assert network.downlink(SERVER) is not plan.network.downlink(SERVER)  # type: ignore[union-attr]


def test_an_update_no_link_carries_is_still_planned_to_go_at_once() -> None:
    network = Network({1: 0.0, SERVER: 10.0}, {1: 10.0, SERVER: 10.0}, now=2.0)
    plan = in_list_order([Update(key=1, host=1, version=0, size=8)], network, server=SERVER)
    assert plan.dropped == []
    assert plan.planned[0].transfer.start == 2.0
    assert plan.planned[0].transfer.end == math.inf


# -- the synchronous scheduler --------------------------------------------------------------
def test_a_synchronous_scheduler_grants_every_update_in_ready_order() -> None:
    """Under BSP the scheduler paces the senders in the order they became ready and denies
    nothing, however stale an update would be under async's deadlines."""
    scheduler = ShardScheduler(server=SERVER, delay_bound=None, interval=0.1, synchronous=True)
    for w, size in enumerate((500, 300, 100)):
        scheduler.ready(w, 0, 0, size, 1.0, host=w, now=0.01 * w)
    decided = scheduler.on_timer(0.1, 0, lambda h: (1e3, 1e3))
    assert not [d for d in decided if isinstance(d, Denied)]
    waits = {d.worker: d.wait for d in decided if isinstance(d, Granted)}
    assert sorted(waits) == [0, 1, 2]
    assert waits[0] == 0.0
    assert waits[0] < waits[1] < waits[2]  # list order: the smallest goes last
    assert waits[1] == pytest.approx(0.5)


def test_a_synchronous_scheduler_takes_no_delay_bound() -> None:
    with pytest.raises(ValueError, match="no delay bound"):
        ShardScheduler(server=SERVER, delay_bound=3, interval=0.1, synchronous=True)


def test_a_synchronous_group_sums_one_iteration_only() -> None:
    """A batch holding two iterations (a fast worker's next one) plans them one after the
    other; no group mixes them, since the server applies an iteration as one step."""
    scheduler = ShardScheduler(
        server=SERVER, delay_bound=None, interval=0.1, aggregation=True, synchronous=True
    )
    for w in range(8):
        scheduler.ready(w, w // 5, 0, 1000, 1.0, host=w, now=0.0)
    decided = scheduler.on_timer(0.1, 0, lambda h: (1e6, 1e4) if h == SERVER else (1e6, 1e6))
    grants = {d.worker: d for d in decided if isinstance(d, Granted)}
    gathers = [d for d in decided if isinstance(d, Gather)]
    assert sorted(grants) == list(range(8))
    assert gathers  # the server's downlink is the bottleneck: Alg. 3 groups
    for gather in gathers:
        assert len({it for _, it, _ in gather.members}) == 1
        assert {w for w, _, _ in gather.members} == {
            w for w, g in grants.items() if g.group == gather.group
        }


def test_a_bsp_push_that_arrived_no_longer_holds_a_link() -> None:
    """A push held for its iteration's others is settled at once: the next batch is not
    planned behind it."""
    shard = ShardServer(
        initial=np.zeros(2),
        workers=range(3),
        consistency=BSP,
        rule=Sum(),
        scheduler=ShardScheduler(server=SERVER, delay_bound=None, interval=0.1, synchronous=True),
    )
    assert shard.scheduler is not None
    shard.ready(0, 0, 0, 100, 1.0, host=0, now=0.0)
    shard.on_timer(0.1, lambda h: (1e3, 1e3))
    assert shard.scheduler.statistics().outstanding == 1
    shard.push(0, 0, 0, encoded(1, 2), now=0.2)
    assert shard.version == 0  # held for workers 1 and 2
    assert shard.scheduler.statistics().outstanding == 0


# -- the coordinator ------------------------------------------------------------------------
def bsp(workers: int = 4) -> Coordinator:
    return Coordinator(workers=range(workers), consistency=BSP)


def applies(actions: list[Any]) -> list[Apply]:
    return [a for a in actions if isinstance(a, Apply)]


def test_a_bsp_aggregate_waits_for_its_iteration_and_is_added_once() -> None:
    c = bsp()
    assert applies(c.push_aggregate(((0, 0, 0), (2, 0, 0)), values(3, 30), now=0.0)) == []
    assert applies(c.push(1, 0, 0, values(1, 10), now=0.0)) == []
    [apply] = applies(c.push(3, 0, 0, values(4, 40), now=0.0))
    assert apply.version == 1  # one step for the iteration, not one per member
    assert [u.worker for u in apply.updates] == [0, 1, 2, 3]
    np.testing.assert_array_equal(apply.combined(), values(8, 80))
    assert c.statistics().applied == 4
    # the next iteration has no aggregate: its parts are the pushes' own
    for w in range(4):
        out = c.push(w, 1, 1, values(1, 1), now=0.0)
    [apply] = applies(out)
    assert apply.parts == ()
    np.testing.assert_array_equal(apply.combined(), values(4, 4))


def test_a_bsp_iteration_of_aggregates_only_sums_each_once() -> None:
    c = bsp()
    c.push_aggregate(((0, 0, 0), (1, 0, 0)), values(1, 1), now=0.0)
    [apply] = applies(c.push_aggregate(((2, 0, 0), (3, 0, 0)), values(2, 2), now=0.0))
    np.testing.assert_array_equal(apply.combined(), values(3, 3))


@pytest.mark.parametrize(
    "members",
    [((0, 0, 0), (1, 1, 0)), ((0, 0, 0), (0, 0, 0)), ()],
    ids=["two iterations", "a worker twice", "empty"],
)
def test_a_malformed_bsp_aggregate_is_refused(members: tuple[tuple[int, int, int], ...]) -> None:
    c = bsp()
    with pytest.raises(RemoteProtocolError):
        c.push_aggregate(members, values(1, 1), now=0.0)


def test_ssp_takes_no_aggregate() -> None:
    c = Coordinator(workers=range(2), consistency=Consistency.SSP, staleness=1)
    with pytest.raises(RemoteProtocolError, match="async or bsp"):
        c.push_aggregate(((0, 0, 0),), values(1, 1), now=0.0)


def test_a_held_bsp_aggregate_survives_a_snapshot() -> None:
    """A replica restored mid-iteration adds the aggregate's sum once, as its primary does."""
    primary = bsp()
    primary.push_aggregate(((0, 0, 0), (1, 0, 0)), values(1, 2), now=0.0)
    replica = bsp()
    replica.restore(primary.state(), size=2, dtype=np.dtype(np.float64))
    for c in (primary, replica):
        c.push(2, 0, 0, values(10, 20), now=0.0)
        [apply] = applies(c.push(3, 0, 0, values(100, 200), now=0.0))
        np.testing.assert_array_equal(apply.combined(), values(111, 222))


@pytest.mark.parametrize(
    "grouped",
    [
        {0: [[0, 2]]},
        {0: [[0], [0]]},
        {0: [[]]},
        {0: "x"},
        {1: [[0]]},
        {0: [[[0]]]},
        {0: [[True]]},
        {"x": []},
        {0: [[0, 1]]},
    ],
    ids=[
        "not held",
        "twice",
        "empty",
        "not a list",
        "another iteration",
        "a list in a list",
        "a bool",
        "no iteration",
        "unlike sums",
    ],
)
def test_a_snapshot_with_bad_aggregates_is_refused(grouped: dict[Any, Any]) -> None:
    primary = bsp()
    primary.push(0, 0, 0, values(1, 2), now=0.0)
    primary.push(1, 0, 0, values(3, 4), now=0.0)
    state = primary.state() | {"grouped": grouped}
    with pytest.raises(RemoteProtocolError):
        bsp().restore(state, size=2, dtype=np.dtype(np.float64))


# -- the spec --------------------------------------------------------------------------------
def spec(consistency: str) -> dict[str, Any]:
    return {
        "n": 3,
        "size": 4,
        "dtype": "float32",
        "servers": [2],
        "replicas": [],
        "consistency": consistency,
        "staleness": 1 if consistency == "ssp" else 0,
        "delay_bound": None,
        "chunk": 1,
        "seed": 0,
        "rule": "sum",
        "lr": None,
        "momentum": None,
        "lr_delay": None,
        "lr_t0": None,
        "filters": None,
        "scheduling": "mlfabric",
        "aggregation": True,
        "replication": "chain",
        "divergence_bound": None,
        "distribution": "direct",
    }


def test_mlfabric_schedules_async_and_bsp_not_ssp() -> None:
    check_spec(spec("bsp"))
    check_spec(spec("async"))
    with pytest.raises(UsageError, match="not ssp"):
        check_spec(spec("ssp"))


# -- the whole path -------------------------------------------------------------------------
def sync_fabric(links: Any, *, replicas: bool) -> Fabric:
    return aggregating(bound=None, replicas=replicas, links=links, consistency=BSP)


@settings(max_examples=80, deadline=None)
@given(st.booleans(), LINKS, st.data())
def test_every_bsp_update_applied_once_through_aggregators_under_any_interleaving(
    replicas: bool, links: Any, data: st.DataObject
) -> None:
    """Resends, duplicates, resets and failovers: nothing dropped, every push applied once in
    its iteration's step (the fabric checks each iteration's version), the model their sum."""
    fabric = sync_fabric(links, replicas=replicas)
    run(fabric, data.draw(moves(3, 2, failover=replicas)))
    settle(fabric)
    made, applied, dropped = outcomes(fabric)
    assert (applied, dropped) == (made * len(fabric.bounds), 0)


@settings(max_examples=40, deadline=None)
@given(LINKS, st.integers(0, 2), st.data())
def test_a_dead_bsp_aggregator_loses_and_doubles_nothing(
    links: Any, dead: int, data: st.DataObject
) -> None:
    fabric = sync_fabric(links, replicas=False)
    run(fabric, data.draw(moves(3, 2, failover=False)))
    fabric.lose(dead)
    settle(fabric)
    for s in range(len(fabric.bounds)):
        assert fabric.serving(s).coordinator.statistics().applied == len(fabric.applied(s))


def test_bsp_aggregation_happens_and_sums_exactly() -> None:
    """The probe behind the property tests: groups do form under BSP."""
    fabric = sync_fabric([(None, None)] * 7, replicas=False)
    for _ in range(60):
        for w in range(3):
            fabric.step(w)
        if not fabric.deliver(0):
            fabric.tick()
    settle(fabric)
    assert sum(fabric.serving(s).statistics().aggregates for s in range(2)) > 0
    made, applied, dropped = outcomes(fabric)
    assert (applied, dropped) == (made * 2, 0)


def test_a_bsp_aggregate_steps_once_at_its_stalest_members_rate() -> None:
    """Delay-adaptive sgd with members of different delays (a worker that did not pull): the
    aggregate's sum is stepped once, at its stalest member's rate, a lone push at its own."""
    c = bsp(3)
    for w in range(3):
        c.push(w, 0, 0, values(0, 0), now=0.0)  # iteration 0: version 1
    c.push_aggregate(((0, 1, 0), (1, 1, 1)), values(1, 2), now=0.0)  # worker 0 did not pull
    [apply] = applies(c.push(2, 1, 1, values(10, 20), now=0.0))
    rule = SGD(lr=1.0, momentum=0.0, lr_delay="adaptive", lr_t0=1.0)
    model = np.zeros(2)
    rule.apply_updates(model, apply)
    stalest, fresh = rule.rate(1, 1), rule.rate(1, 0)
    assert stalest < fresh
    np.testing.assert_allclose(model, -(stalest * values(1, 2) + fresh * values(10, 20)))


# -- review findings ------------------------------------------------------------------------
@pytest.mark.parametrize("synchronous", [True, False])
def test_a_slow_acknowledgement_of_an_aggregated_push(synchronous: bool) -> None:
    """Under BSP an acknowledgement waits for the iteration's stragglers, so a slow one asks
    the shard again with a READY (a few bytes) instead of sending the update's bytes straight
    a second time; under async it says the aggregator is gone, and the push goes straight."""
    worker = Worker(
        worker=0, size=4, dtype="float64", shards=1, scheduled=True, synchronous=synchronous
    )
    [ready] = worker.push(np.ones(4), norm=2.0)
    assert isinstance(ready, SendReady)
    worker.route(0, 0, via=5, group=1)
    [sent] = worker.granted(0, 0)
    assert isinstance(sent, SendPush)
    assert sent.via == 5
    [again] = worker.direct(0, 0)
    if synchronous:
        assert isinstance(again, SendReady)
        assert again.norm == 2.0
        assert worker.awaits_grant(0, 0)  # the shard grants it straight, or holds it already
        [straight] = worker.granted(0, 0)
        assert isinstance(straight, SendPush)
        assert straight.via is None
    else:
        assert isinstance(again, SendPush)
        assert again.via is None
    assert worker.direct(0, 0) == []  # once


def test_a_bsp_aggregate_whose_workers_were_all_lost_meanwhile_is_dropped() -> None:
    """The LOSE entries completed the iteration before the aggregate was processed: held, it
    would wait below ``complete`` for ever (and no replica could take the snapshot)."""
    c = bsp()
    c.push(0, 0, 0, values(1, 1), now=0.0)
    c.push(1, 0, 0, values(1, 1), now=0.0)
    c.lose(2, "down", 0.0)
    c.lose(3, "down", 0.0)
    assert c.version == 1
    out = c.push_aggregate(((2, 0, 0), (3, 0, 0)), values(5, 5), now=0.0)
    assert sorted((d.worker, d.reason) for d in out if isinstance(d, Drop)) == [
        (2, DropReason.LOST),
        (3, DropReason.LOST),
    ]
    assert c.state()["pending"] == {}
    bsp().restore(c.state(), size=2, dtype=np.dtype(np.float64))


def test_a_host_no_link_carries_is_no_aggregator() -> None:
    """Under BSP an update no link carries is still planned (never dropped): it goes straight,
    and its host forwards no group (a wait for ever would not fit in a GATHER)."""
    fabric = sync_fabric([(None, None)] * 7, replicas=False)
    fabric.figures[1] = (0.0, 1e6)
    settle(fabric)
    made, applied, dropped = outcomes(fabric)
    assert (applied, dropped) == (made * 2, 0)


def test_a_wait_for_ever_fits_in_a_grant() -> None:
    assert messages._micros(math.inf) == MAX_GRANT_WAIT_US
    assert messages._micros(-1.0) == 0
