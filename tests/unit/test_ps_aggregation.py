"""MLfabric aggregation at worker daemons (§3.2, §5.2) without sockets: the aggregator's
groups (fabricd/engines/ps/g.py), the server's aggregate (applied once for all its
members, or refused whole), the coordinator's versions, and the whole path on the in-process
fabric of ``ps_fabric`` under interleavings, resends, resets, failovers and a dead aggregator.

What must hold (issue 24): an aggregate is applied exactly once per contained update across
aggregator failures and resends; the model is the sum of what was applied; versions advance by
the number of updates inside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.consistency import Apply, Consistency, Drop, DropReason, Sum
from fabricd.engines.ps.filters import Push
from fabricd.engines.ps.gathering import MAX_EARLY, Gathering
from fabricd.engines.ps.scheduler import Gather, Granted, ShardScheduler
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import Acked
from fabricd.errors import RemoteProtocolError
from tests.unit.test_ps_scheduling import FIGURES, outcomes, scheduled, settle
from tests.unit.test_ps_server import moves, run

if TYPE_CHECKING:
    from tests.unit.ps_fabric import Fabric

Array = np.ndarray[Any, Any]
KEY = ("job", "m")
GROUP = (KEY, 0, 9, 0, 1)  # model, shard 0, server rank 9, epoch 0, group 1


F64 = np.dtype(np.float64)


def values(*xs: float) -> Array:
    return np.array(xs, np.float64)


def gathering() -> Gathering:
    return Gathering(grace=1.0, max_bytes=1 << 20)


def decoded(payload: bytearray, size: int) -> Array:
    return ps_push.decode(payload, size, np.dtype(np.float64))


def encoded(*xs: float) -> bytearray:
    array = values(*xs)
    return ps_push.encode(Push(size=array.size, pushed=array.size, indices=None, values=array))


# -- the aggregator ---------------------------------------------------------------------------
def test_a_group_is_forwarded_once_every_member_came_with_their_sum() -> None:
    g = gathering()
    assert g.plan(GROUP, ((1, 0, 0), (2, 3, 1)), wait=0.5, now=0.0, size=2, dtype=F64) == []
    assert g.push(GROUP, 1, 0, 0, encoded(1, 2), now=0.1) == []
    [summed] = g.push(GROUP, 2, 3, 1, encoded(10, 20), now=0.2)
    assert summed.group == GROUP
    assert summed.members == ((1, 0, 0), (2, 3, 1))
    np.testing.assert_array_equal(decoded(summed.payload, 2), values(11, 22))
    assert g.held == 0
    assert g.next_deadline() is None


def test_a_push_before_its_gather_is_held_then_summed() -> None:
    g = gathering()
    assert g.push(GROUP, 2, 3, 1, encoded(10, 20), now=0.0) == []
    assert g.held == 1
    [summed] = g.plan(GROUP, ((2, 3, 1),), wait=0.0, now=0.1, size=2, dtype=F64)
    np.testing.assert_array_equal(decoded(summed.payload, 2), values(10, 20))
    assert g.held == 0


def test_a_member_that_never_comes_leaves_the_others_forwarded_after_the_grace() -> None:
    g = gathering()
    g.plan(GROUP, ((1, 0, 0), (2, 0, 0)), wait=0.5, now=0.0, size=2, dtype=F64)
    g.push(GROUP, 1, 0, 0, encoded(1, 1), now=0.1)
    assert g.next_deadline() == pytest.approx(1.5)
    assert g.on_timer(1.4) == []
    [summed] = g.on_timer(1.5)
    assert summed.members == ((1, 0, 0),)
    # the late member is dropped here: its worker's daemon sends it straight to the server
    assert g.push(GROUP, 2, 0, 0, encoded(5, 5), now=1.6) == []
    assert g.held == 1  # held as early for a GATHER that will not come ...
    assert g.on_timer(2.7) == []  # ... and dropped after the grace
    assert g.counters["late"] == 1
    assert g.held == 0


def test_a_push_that_is_not_a_member_or_comes_twice_is_not_summed() -> None:
    g = gathering()
    g.plan(GROUP, ((1, 0, 0), (2, 0, 0)), wait=0.0, now=0.0, size=2, dtype=F64)
    assert g.push(GROUP, 3, 0, 0, encoded(7, 7), now=0.1) == []  # not a member
    assert g.push(GROUP, 1, 1, 0, encoded(7, 7), now=0.1) == []  # another iteration
    g.push(GROUP, 1, 0, 0, encoded(1, 1), now=0.1)
    assert g.push(GROUP, 1, 0, 0, encoded(1, 1), now=0.2) == []  # sent twice
    [summed] = g.push(GROUP, 2, 0, 0, encoded(2, 2), now=0.3)
    np.testing.assert_array_equal(decoded(summed.payload, 2), values(3, 3))
    assert g.counters["late"] == 3


def test_a_gather_sent_again_is_refused_and_early_pushes_are_bounded() -> None:
    g = gathering()
    g.plan(GROUP, ((1, 0, 0),), wait=0.0, now=0.0, size=2, dtype=F64)
    assert g.plan(GROUP, ((1, 0, 0),), wait=0.0, now=0.0, size=2, dtype=F64) == []
    assert g.counters["refused"] == 1
    other = (KEY, 0, 9, 0, 2)
    for w in range(MAX_EARLY + 5):
        g.push(other, w, 0, 0, encoded(1), now=0.0)
    assert g.held == 1 + MAX_EARLY
    g.forget(KEY)
    assert g.held == 0


# -- the coordinator and the server -----------------------------------------------------------
def aggregated_shard(delay_bound: int | None = None) -> ShardServer:
    """A scheduled, aggregating shard (its scheduler is told the groups each test sends)."""
    return ShardServer(
        initial=np.zeros(2),
        workers=range(4),
        consistency=Consistency.ASYNC,
        delay_bound=delay_bound,
        rule=Sum(),
        scheduler=ShardScheduler(server=9, delay_bound=delay_bound, interval=0.1, aggregation=True),
    )


def aggregate(
    shard: ShardServer, members: tuple[tuple[int, int, int], ...], payload: bytearray, now: float
) -> list[Any]:
    """``members``' aggregate from node 7, as group 0 its scheduler planned there."""
    assert shard.scheduler is not None
    shard.scheduler.expect(0, 7, members, size=len(payload), end=now)
    return shard.push_aggregate(members, payload, now, group=0, sender=7)


def test_an_aggregate_is_one_step_that_advances_the_version_by_its_members() -> None:
    shard = aggregated_shard()
    out = aggregate(shard, ((0, 0, 0), (1, 0, 0), (2, 0, 0)), encoded(1, 2), now=0.0)
    acks = [a for a in out if isinstance(a, Acked)]
    assert sorted(a.worker for a in acks) == [0, 1, 2]
    assert {a.version for a in acks} == {3}
    assert all(a.dropped is None for a in acks)
    np.testing.assert_array_equal(shard.store.model, values(1, 2))
    assert shard.version == 3
    stats = shard.statistics()
    assert (stats.aggregates, stats.pushes, stats.coordinator.applied) == (1, 3, 3)


def test_an_aggregate_holding_a_decided_member_is_refused_whole() -> None:
    """The member's worker sent it straight to the server meanwhile (its aggregator seemed
    dead): the aggregate is refused, so nothing is counted twice; the other member comes
    straight from its worker in turn."""
    shard = aggregated_shard()
    shard.push(1, 0, 0, encoded(5, 5), now=0.0)
    assert aggregate(shard, ((0, 0, 0), (1, 0, 0)), encoded(6, 6), now=0.1) == []
    assert shard.statistics().aggregates_refused == 1
    np.testing.assert_array_equal(shard.store.model, values(5, 5))
    shard.push(0, 0, 0, encoded(1, 1), now=0.2)
    np.testing.assert_array_equal(shard.store.model, values(6, 6))
    assert shard.statistics().coordinator.applied == 2


def test_an_aggregate_with_a_member_over_the_delay_bound_is_refused_for_direct_pushes() -> None:
    """A sum cannot be taken apart: the aggregate is refused, and its members, coming straight
    from their workers' daemons after their wait, are judged one by one."""
    shard = aggregated_shard(delay_bound=1)
    for it in range(3):
        shard.push(3, it, shard.version, encoded(1, 1), now=0.0)
    assert shard.version == 3
    assert aggregate(shard, ((0, 0, 3), (1, 0, 1)), encoded(9, 9), now=0.1) == []
    assert shard.statistics().aggregates_refused == 1
    [fresh] = [a for a in shard.push(0, 0, 3, encoded(4, 4), now=0.2) if isinstance(a, Acked)]
    [stale] = [a for a in shard.push(1, 0, 1, encoded(5, 5), now=0.3) if isinstance(a, Acked)]
    assert fresh.dropped is None
    assert stale.dropped is not None
    assert "delay 3 > bound 1" in stale.dropped


def test_an_aggregate_nobody_asked_for_is_refused() -> None:
    """A peer cannot apply updates in other workers' names: only the group the scheduler
    told a node to sum, from that node, holding (some of) those updates, is taken, once."""
    shard = aggregated_shard()
    assert shard.scheduler is not None
    shard.scheduler.expect(4, 7, ((0, 0, 0), (1, 0, 0)), size=32, end=0.0)
    forged = [
        shard.push_aggregate(((0, 0, 0),), encoded(9, 9), 0.0, group=5, sender=7),  # no group
        shard.push_aggregate(((0, 0, 0),), encoded(9, 9), 0.0, group=4, sender=8),  # not sent
        shard.push_aggregate(((2, 0, 0),), encoded(9, 9), 0.0, group=4, sender=7),  # no member
    ]
    assert forged == [[], [], []]
    assert shard.version == 0
    assert shard.push_aggregate(((0, 0, 0),), encoded(1, 1), 0.1, group=4, sender=7) == []
    assert shard.statistics().aggregates_refused == 4  # the group was used up by the forgery


def test_the_coordinator_applies_a_sum_once() -> None:
    shard = aggregated_shard()
    actions = shard.coordinator.push_aggregate(((0, 0, 0), (1, 0, 0)), values(3, 3), now=0.0)
    [apply] = [a for a in actions if isinstance(a, Apply)]
    assert apply.summed
    assert apply.version == 2
    np.testing.assert_array_equal(apply.combined(), values(3, 3))  # not 6, 6
    assert not any(isinstance(a, Drop) and a.reason is DropReason.LOST for a in actions)


def test_an_aggregate_with_a_malformed_member_is_refused_and_changes_nothing() -> None:
    shard = aggregated_shard()
    with pytest.raises(RemoteProtocolError):
        aggregate(shard, ((0, 0, 7), (1, 0, 0)), encoded(1, 1), now=0.0)  # base 7 > 0
    with pytest.raises(RemoteProtocolError):
        aggregate(shard, ((0, 0, 0),), encoded(1, 1, 1), now=0.0)  # the wrong size
    assert shard.version == 0
    assert shard.push(0, 0, 0, encoded(1, 1), now=0.1)  # worker 0 is not waiting on it


def test_the_scheduler_groups_when_the_server_link_is_the_bottleneck() -> None:
    """Six updates ready at once, the server's downlink 100x slower than the workers': Alg. 3
    sends the first straight and sums the rest at one worker's daemon, granting each member a
    push to it; every update is in exactly one place."""
    scheduler = ShardScheduler(server=9, delay_bound=None, interval=0.1, aggregation=True)
    for w in range(6):
        scheduler.ready(w, 0, 0, 1000, 1.0, host=w, now=0.0)
    decided = scheduler.on_timer(0.1, 0, lambda h: (1e6, 1e4) if h == 9 else (1e6, 1e6))
    grants = [d for d in decided if isinstance(d, Granted)]
    gathers = [d for d in decided if isinstance(d, Gather)]
    assert sorted(g.worker for g in grants) == list(range(6))
    assert gathers
    for gather in gathers:
        members = {g.worker for g in grants if g.group == gather.group}
        assert members == {m[0] for m in gather.members}
        assert all(g.via == gather.aggregator for g in grants if g.group == gather.group)
    direct = [g for g in grants if g.via is None]
    grouped = sum(len(g.members) for g in gathers)
    assert len(direct) + grouped == 6


# -- the whole path ---------------------------------------------------------------------------
def aggregating(**kw: Any) -> Fabric:
    """A scheduled fabric whose batches gather several pushes (a long interval: a frame takes
    a second here) and whose servers' downlinks are slow, so Alg. 3 groups."""
    links = kw.pop("links")
    figures = {n: (up or 1e6, down or 1e6) for n, (up, down) in enumerate(links)}
    for server in (3, 4, 5, 6):
        figures[server] = (figures[server][0], 30.0)
    return scheduled(figures=figures, aggregation=True, interval=6.0, **kw)


LINKS = st.lists(st.tuples(FIGURES, FIGURES), min_size=7, max_size=7)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 3)), st.booleans(), LINKS, st.data())
def test_each_update_applied_once_through_aggregators_under_any_interleaving(
    bound: int | None, replicas: bool, links: Any, data: st.DataObject
) -> None:
    """Aggregates under resends, duplicates, resets and failovers: every push applied
    exactly once (by its own push or inside one aggregate) or dropped, the model the sum of
    what was applied, versions advancing by an aggregate's size (the fabric checks each
    acknowledgement's delay against the version it was applied at)."""
    fabric = aggregating(bound=bound, replicas=replicas, links=links)
    run(fabric, data.draw(moves(3, 2, failover=replicas)))
    settle(fabric)
    made, applied, dropped = outcomes(fabric)
    assert applied + dropped == made * len(fabric.bounds)


@settings(max_examples=60, deadline=None)
@given(LINKS, st.integers(0, 2), st.data())
def test_a_dead_aggregator_loses_and_doubles_nothing(
    links: Any, dead: int, data: st.DataObject
) -> None:
    """A worker's node that may be aggregating is cut off at any point: the members it held
    are sent straight to their servers after their wait, and each is applied once."""
    fabric = aggregating(bound=None, replicas=False, links=links)
    run(fabric, data.draw(moves(3, 2, failover=False)))
    fabric.lose(dead)
    settle(fabric)
    for s in range(len(fabric.bounds)):
        assert fabric.serving(s).coordinator.statistics().applied == len(fabric.applied(s))


def test_aggregation_happens_and_sums_exactly() -> None:
    """One scripted run where groups form (the probe behind the property tests: without it
    they could pass with no aggregate at all)."""
    fabric = aggregating(bound=None, replicas=False, links=[(None, None)] * 7)
    for _ in range(40):
        for w in range(3):
            fabric.step(w)
        if not fabric.deliver(0):
            fabric.tick()
    settle(fabric)
    assert sum(fabric.serving(s).statistics().aggregates for s in range(2)) > 0
    made, applied, dropped = outcomes(fabric)
    assert (applied, dropped) == (made * 2, 0)


def test_a_stale_direct_deadline_leaves_a_newer_push_route_alone() -> None:
    """Found by the property test above: the direct-send deadline of an acknowledged push
    (iteration 0) fired after the next push (iteration 1) was routed via an aggregator; it
    took that route away, and the push, dropped late at its aggregator, never went straight."""
    from fabricd.engines.ps.worker import SendPush, Worker

    worker = Worker(worker=1, size=2, dtype="float64", shards=1, scheduled=True)
    worker.push(values(1, 1))
    worker.route(0, 0, via=5, group=0)
    [sent] = worker.granted(0, 0)
    assert isinstance(sent, SendPush)
    assert sent.via == 5
    worker.pushed(0, 0, version=1, dropped=None)
    worker.push(values(2, 2))
    worker.route(0, 1, via=6, group=1)
    worker.granted(0, 1)
    assert worker.direct(0, 0) == []  # iteration 0's deadline, stale
    [again] = worker.direct(0, 1)
    assert isinstance(again, SendPush)
    assert (again.iteration, again.via) == (1, None)


# -- found in review ---------------------------------------------------------------------------
def test_early_pushes_are_held_encoded_and_bounded_in_bytes() -> None:
    """A tiny sparse push for a group not gathered yet costs its bytes, not a dense shard;
    sums beyond the node's bound refuse the GATHER (its members go straight)."""
    g = Gathering(grace=1.0, max_bytes=64)
    small = encoded(1, 2)
    held = 0
    for w in range(100):
        g.push((KEY, 0, 9, 0, 50 + w), w, 0, 0, small, now=0.0)
        held = g.held
    assert held * len(small) <= 64 + len(small)
    big = (KEY, 0, 9, 0, 1)
    assert g.plan(big, ((1, 0, 0),), wait=0.0, now=0.0, size=100, dtype=F64) == []
    assert g.counters["refused"] == 1  # 800 B of sum > 64 B


def test_a_replicated_entry_is_an_aggregate_or_a_drop_not_both() -> None:
    from fabricd.frames import ps as ps_frames

    meta = {
        "job": "j",
        "name": "m",
        "sh": 0,
        "srv": 1,
        "rep": 2,
        "ix": 1,
        "entry": "push",
        "w": 0,
        "it": 0,
        "b": 0,
        "why": "dropped by the scheduler: deadline passed",
        "in": [[0, 0, 0]],
        "spec": {
            "n": 3,
            "size": 2,
            "dtype": "float64",
            "servers": [1],
            "replicas": [2],
            "consistency": "async",
            "staleness": 0,
            "delay_bound": None,
            "chunk": 1,
            "scheduling": "mlfabric",
            "aggregation": True,
            "replication": "chain",
            "divergence_bound": None,
            "distribution": "direct",
        },
    }
    with pytest.raises(RemoteProtocolError, match="not both"):
        ps_frames.Replicate.from_meta(meta)
    meta.pop("why")
    meta["in"] = [[0, 2**63, 0]]
    with pytest.raises(RemoteProtocolError):
        ps_frames.Replicate.from_meta(meta)


def test_a_gather_from_a_rank_not_serving_the_shard_is_dropped() -> None:
    """Only the shard's serving rank's scheduler picks its aggregators: a GATHER naming
    another rank (a peer filling the node's groups) is dropped and counted."""
    fabric = aggregating(bound=None, replicas=False, links=[(None, None)] * 7)
    node = fabric.nodes[0]
    from fabricd.frames import ps as ps_frames

    gather = ps_frames.Gather(
        job="job",
        name="m",
        shard=0,
        server=1,  # a worker's rank, on node 1
        epoch=0,
        group=0,
        members=((2, 0, 0),),
        wait_us=0,
        spec=fabric.spec,
    )
    before = node.counters["ps_frames_dropped"]
    node.on_frame(1, gather, b"", 0.0)
    assert node.counters["ps_frames_dropped"] == before + 1
    assert node.gathering.held == 0


def test_alg3_decides_the_same_whatever_the_clock_reads() -> None:
    """Found in review: Alg. 3's rounding margin grew with the absolute clock (a daemon's
    seconds since boot), so a machine up for weeks grouped updates whose direct transfers
    were faster.  The same batch must be split the same way at any ``now``."""
    from fabricd.engines.scheduling.aggregation import aggregate
    from fabricd.engines.scheduling.ordering import Update, order
    from fabricd.engines.scheduling.timelines import Network

    def split(now: float) -> tuple[int, int]:
        fast = {h: 12.5e9 for h in range(7)}
        network = Network(fast, fast, now=now)
        updates = [Update(key=w, host=w + 1, version=0, size=1e5) for w in range(6)]
        planned = order(updates, network, server=0, delay_bound=None, v_init=0).planned
        result = aggregate(planned, network, server=0, aggregators=[1, 2, 3, 4, 5, 6])
        return len(result.groups), sum(len(g.members) for g in result.groups)

    assert split(0.0) == split(1e5) == split(1e7)
