"""Bounded replication under MLfabric's scheduling (MLfabric §3.3, §5.3;
fabricd/engines/ps/copy_plan.py, copying.py): a batch's copies are planned after its pushes,
what would not reach the replica by the server's last commit is punted and granted with a
later batch (or an idle shard's next decision), a bound that would be broken makes only the
last push wait; a worker's daemon holds punted copies, sends them when granted or after the
hold window, and bounds their bytes; end to end every update reaches the replica once and the
lead stays within the bound."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import copying
from fabricd.engines.ps.bounded import NEED_AFTER, DivergenceBound
from fabricd.engines.ps.consistency import Consistency
from fabricd.engines.ps.copy_plan import CopyPlanner, hold_after, need_after
from fabricd.engines.ps.scheduler import CopyGranted, Granted, ShardScheduler
from fabricd.engines.scheduling.ordering import Planned, Update
from fabricd.engines.scheduling.timelines import Network
from fabricd.frames import ps as ps_frames
from tests.unit.ps_fabric import KEY, Fabric
from tests.unit.test_frames import SHARD
from tests.unit.test_ps_bounded import check_lead
from tests.unit.test_ps_server import moves, run

SERVER, REPLICA = 0, 1
HOSTS = (0, 1, 2, 3, 4)


def planned(count: int) -> tuple[list[Planned], Network]:
    """``count`` pushes of 1 B from hosts 2.., every link 1 B/s, booked to the server in turn
    (the server commits them at 1, 2, 3 s)."""
    rates = dict.fromkeys(HOSTS, 1.0)
    network = Network(rates, rates)
    out = []
    for k in range(count):
        update = Update(key=(k, 0), host=2 + k, version=0, size=1.0, norm=1.0)
        transfer = network.reserve(2 + k, SERVER, 1.0, start=float(k))
        out.append(Planned(update=update, transfer=transfer, position=k + 1))
    return out, network


def planner(**bound: Any) -> CopyPlanner:
    return CopyPlanner(DivergenceBound(**bound), momentum=0.0, rate=1.0, interval=0.1)


def test_a_loose_bound_punts_the_copies_that_come_after_the_last_commit() -> None:
    copies = planner(updates=2)
    batch, network = planned(3)
    plan = copies.plan(0.0, batch, network, REPLICA)
    assert plan.delay is None
    punted = [key for key, wait in plan.waits.items() if wait is None]
    assert punted
    assert copies.pending
    assert all(wait is None or wait >= 0 for wait in plan.waits.values())
    # an idle shard's next decision sends every punted copy
    later = copies.plan(0.5, [], network.copy(), REPLICA)
    assert set(later.later) == set(punted)
    assert not copies.pending


def test_a_tight_bound_makes_only_the_last_push_wait_for_the_replica() -> None:
    copies = planner(norm=1e-9)  # the replica must have everything the server has
    batch, network = planned(3)
    plan = copies.plan(0.0, batch, network, REPLICA)
    assert plan.delay is not None
    assert plan.delay[0] == batch[-1].update.key
    assert plan.delay[1] > batch[-1].transfer.start
    assert all(wait is not None for wait in plan.waits.values())  # nothing punted


def test_punted_copies_older_than_the_hold_window_are_forgotten() -> None:
    copies = planner(updates=1)
    batch, network = planned(3)
    copies.plan(0.0, batch, network, REPLICA)
    assert copies.pending
    later = copies.plan(hold_after(0.1) + 1.0, [], network.copy(), REPLICA)
    assert later.later == {}  # their daemons sent them unplanned meanwhile
    assert not copies.pending


def test_need_after_waits_past_the_hold_window() -> None:
    assert need_after(0.1) >= 2 * hold_after(0.1) > NEED_AFTER
    assert need_after(0.001) >= NEED_AFTER


def test_the_scheduler_grants_copies_and_decides_again_for_punted_ones() -> None:
    scheduler = ShardScheduler(
        server=SERVER,
        delay_bound=None,
        interval=0.1,
        copies=planner(updates=1),
    )
    for worker in range(3):
        assert scheduler.ready(worker, 0, 0, 1, 1.0, 2 + worker, 0.0) == []

    def figures(host: int) -> tuple[float, float]:
        return (1.0, 1.0)

    decided = scheduler.on_timer(0.1, 0, figures, REPLICA)
    grants = [d for d in decided if isinstance(d, Granted)]
    assert len(grants) == 3
    held = [g for g in grants if g.copy_wait is None]
    assert held  # punted: the replica's link is slow
    due = scheduler.next_deadline()
    assert due is not None  # decided again, with no update ready
    again = scheduler.on_timer(due, 3, figures, REPLICA)
    assert {(c.worker, c.iteration) for c in again if isinstance(c, CopyGranted)} == {
        (g.worker, g.iteration) for g in held
    }
    # without a replica that follows, no copy is planned: they go with their pushes
    plain = ShardScheduler(server=SERVER, delay_bound=None, interval=0.1, copies=planner(updates=1))
    plain.ready(0, 0, 0, 1, 1.0, 2, 0.0)
    [grant] = plain.on_timer(0.1, 0, figures)
    assert isinstance(grant, Granted)
    assert grant.copy_wait == 0.0


def test_aggregation_or_bsp_plans_no_copies() -> None:
    for kw in ({"aggregation": True}, {"synchronous": True}):
        scheduler = ShardScheduler(
            server=SERVER, delay_bound=None, interval=0.1, copies=planner(updates=1), **kw
        )
        assert scheduler.copies is None


@pytest.mark.parametrize(
    "grant",
    [
        {"copy_us": None},
        {"copy_us": 2500},
        {"copy_us": 0},
        {"copy_only": True, "wait_us": 7},
    ],
)
def test_grants_with_copy_plans_travel_whole(grant: dict[str, Any]) -> None:
    frame = ps_frames.Grant(**SHARD, worker=2, iteration=3, epoch=0, **{"wait_us": 0, **grant})
    assert ps_frames.Grant.from_meta(frame.to_meta()) == frame


# -- a worker daemon's held copies ------------------------------------------------------------
def push(iteration: int, nbytes: int = 8) -> tuple[ps_frames.Push, bytes]:
    frame = ps_frames.Push(
        job="j",
        name="m",
        shard=0,
        server=1,
        worker=2,
        iteration=iteration,
        base=0,
        epoch=0,
        spec={},
        copy=True,
    )
    return frame, b"x" * nbytes


def test_held_copies_go_when_due_and_the_oldest_first_past_the_byte_bound() -> None:
    held = copying.HeldCopies(max_bytes=20)
    key = ("j", "m")
    for it in range(2):
        held.plan((key, 2, 0, it), None, 0.0, hold=5.0)
        told, at = held.planned((key, 2, 0, it))
        assert (told, at) == (True, None)
        frame, data = push(it)
        held.hold((key, 2, 0, it), 1, frame, data, at=5.0 + it)
    assert held.due(1.0) == []
    held.plan((key, 2, 0, 1), 2.0, 1.0, hold=5.0)  # a copy grant: the second goes at 2 s
    assert [f.iteration for _, f, _ in held.due(2.0)] == [1]
    frame, data = push(2, nbytes=16)
    held.hold((key, 2, 0, 2), 1, frame, data, at=9.0)  # 24 B held: past the bound
    assert [f.iteration for _, f, _ in held.due(2.0)] == [0]
    assert held.nbytes == 16
    assert [f.iteration for _, f, _ in held.due(9.0)] == [2]
    assert len(held) == 0


def test_a_plan_whose_push_never_went_is_forgotten() -> None:
    held = copying.HeldCopies(max_bytes=20)
    held.plan((("j", "m"), 2, 0, 0), None, 0.0, hold=1.0)
    assert held.next() == 2.0
    assert held.due(2.0) == []
    assert held.planned((("j", "m"), 2, 0, 0)) == (False, None)
    assert held.next() is None


# -- end to end -------------------------------------------------------------------------------
def scheduled_bounded(bound: list[Any]) -> Fabric:
    fabric = Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=4,
        consistency=Consistency.ASYNC,
        replicas=True,
        scheduled=True,
        interval=6.0,
        divergence_bound=bound,
    )
    for replica in (5, 6):  # the replicas' downlinks slow: copies are punted
        fabric.figures[replica] = (1e6, 20.0)
    return fabric


def test_copies_are_held_and_granted_and_every_update_reaches_the_replica_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[ps_frames.Grant] = []
    granted = copying.granted

    def record(node: Any, key: Any, grant: ps_frames.Grant, now: float) -> None:
        seen.append(grant)
        granted(node, key, grant, now)

    monkeypatch.setattr(copying, "granted", record)
    fabric = scheduled_bounded([None, 1])
    for _ in range(3000):
        for w in range(3):
            fabric.step(w)
        if not fabric.deliver(0) and not fabric.tick():
            break
        check_lead(fabric, [None, 1])
    fabric.drain()
    fabric.check_settled()  # every push once, each replica equal to its primary
    held = [g for g in seen if g.copy_us is None]
    copy_grants = [g for g in seen if g.copy_only]
    assert held  # punted: held at the workers' daemons
    assert {(g.worker, g.shard, g.iteration) for g in copy_grants} <= {
        (g.worker, g.shard, g.iteration) for g in held
    }
    assert copy_grants  # and granted later
    assert sum(n.copies.nbytes for n in fabric.nodes.values()) == 0


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([[None, 1], [None, 3], [50.0, None], [50.0, 2]]), st.data())
def test_scheduled_copies_under_resets_and_duplicates_keep_the_bound(
    bound: list[Any], data: st.DataObject
) -> None:
    fabric = scheduled_bounded(bound)
    for move in data.draw(moves(3, 2, failover=False)):
        run(fabric, [move])
        check_lead(fabric, bound)
    fabric.drain()
    fabric.check_settled()


# -- the review's findings --------------------------------------------------------------------
def ready_to_push(fabric: Fabric) -> None:
    """Worker 0 pulls, then asks to push (its READY in flight, its push awaiting a grant)."""
    for _ in range(200):
        sim = fabric.workers[0]
        if sim.call == "push" and sim.engine.awaits_grant(0, 0):
            return
        fabric.step(0)
        assert fabric.deliver(0) or fabric.tick()
    raise AssertionError("worker 0 never waited for a grant")


def grant(**fields: Any) -> ps_frames.Grant:
    common: dict[str, Any] = {"job": KEY[0], "name": KEY[1], "shard": 0, "server": 3}
    return ps_frames.Grant(**common, worker=0, iteration=0, epoch=0, **fields)


def test_a_copy_grant_leaves_a_waiting_push_its_own_time() -> None:
    """A copy grant (for a punted copy) is no grant of any push: a push waiting for its
    planned start keeps it (it went at once, or a copy's wait replaced the push's)."""
    fabric = scheduled_bounded([None, 1])
    ready_to_push(fabric)
    node = fabric.nodes[0]
    node.on_frame(3, grant(wait_us=50_000_000, copy_us=None), b"", fabric.now)
    paced = (KEY, 0, 0, 0)
    due = node._paced.get(paced)
    assert due == pytest.approx(fabric.now + 50)
    out = node.on_frame(3, grant(wait_us=0, copy_only=True), b"", fabric.now)
    assert not [a for a in out if isinstance(getattr(a, "frame", None), ps_frames.Push)]
    assert node._paced.get(paced) == due


def test_a_held_copy_never_waits_past_the_hold_window() -> None:
    fabric = scheduled_bounded([None, 1])
    ready_to_push(fabric)
    node = fabric.nodes[0]
    node.on_frame(3, grant(wait_us=0, copy_us=3_000_000_000), b"", fabric.now)  # 50 min
    assert len(node.copies) == 1  # the push went, its copy is held
    due = node.copies.next()
    assert due is not None
    assert due <= fabric.now + hold_after(fabric.interval)


def test_only_planned_copies_make_the_replica_wait_longer_for_them() -> None:
    for aggregation, expected in ((False, need_after(6.0)), (True, NEED_AFTER)):
        fabric = Fabric(
            workers=3,
            shards=1,
            size=5,
            rounds=1,
            consistency=Consistency.ASYNC,
            replicas=True,
            scheduled=True,
            aggregation=aggregation,
            interval=6.0,
            divergence_bound=[None, 1],
        )
        replica = fabric.follower(0)
        assert replica is not None
        assert replica._log.need_after == expected


def test_a_lost_workers_punted_copies_are_forgotten() -> None:
    copies = planner(updates=1)
    batch, network = planned(3)
    copies.plan(0.0, batch, network, REPLICA)
    punted = {key for key, _ in ((u.key, at) for u, at in copies._lagging)}
    assert punted
    for worker, _ in punted:
        copies.forget_worker(worker)
    assert not copies.pending
