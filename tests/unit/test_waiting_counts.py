"""The counts, indexes and deadline heaps that keep a request, a frame and a timer tick O(1)
however many calls wait (issue 28, item 1), on a fake clock.

A count that drifts is a leak, and a heap entry left behind a deadline that moves on: so after
calls complete, fail, time out, or their client leaves, every count is back to zero and every
heap and index holds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.metrics import OperationStats
from fabricd.daemon.service import Request
from fabricd.daemon.services.held_frames import HeldFrames
from fabricd.daemon.services.jobs import EXPIRE_PER_TICK, OpenCall, OpenCalls, WaitingForRanks
from fabricd.daemon.services.stochastic import StochasticService
from fabricd.engines.actions import Failure
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.membership import RankEntry, RankJoined, RankLeft
from fabricd.engines.ps.models import Model
from fabricd.errors import ErrorCode, OperationFailed, UsageError
from tests.unit.test_collective_service_review import (
    FakeHost,
    Link,
    Table,
    call,
    client,
    coll_frame,
    service,
)
from tests.unit.test_jobs_kit import Call, session
from tests.unit.test_ps_service_review import JOB, NAME, Fabric

if TYPE_CHECKING:
    from fabricd.daemon.services.collectives import CollectiveService
    from fabricd.daemon.sessions import ClientSession
    from fabricd.frames import collectives as collectives_frames

NODES = ("127.0.0.1:1", "127.0.0.1:2")


def kit(table: Table, **settings: Any) -> tuple[WaitingForRanks[Call], FakeHost]:
    fake = FakeHost(Config(node_id=0, nodes=NODES, **settings))
    return WaitingForRanks(fake, table, "x calls", lambda c: f"x {c.request_id}"), fake  # type: ignore[arg-type]


def waiting(who: ClientSession, rid: int, deadline: float, name: str = "n") -> Call:
    return Call(session=who, request_id=rid, deadline=deadline, name=name)


def assert_empty(calls: WaitingForRanks[Call], *sessions: ClientSession) -> None:
    """Nothing waits, and no table of the kit remembers anything."""
    assert len(calls) == 0
    assert calls.next_deadline() is None
    for who in sessions:
        assert calls.count(who) == 0
        assert not calls.has(who, "n")
    assert calls._items == {}
    assert len(calls._deadlines) == 0
    assert calls._deadlines.next() is None  # no stale entry left in its heap either
    assert calls._by_job == {}
    assert calls._by_session == {}
    assert calls._named == {}
    assert calls._per_uid == {}
    assert calls._uids == {}


def whole_job(table: Table, job: str = "j") -> None:
    table.join(job, 3, (0, 0, 1), owner=1000)


def half_job(table: Table, job: str = "j") -> None:
    whole_job(table, job)
    del table.entries[job, 2]


# -- the kit ----------------------------------------------------------------------------------
def test_counts_follow_calls_that_run_fail_time_out_or_leave() -> None:
    table = Table()
    half_job(table)
    calls, fake = kit(table, route_timeout=5.0)
    a, b = session(0), session(1)
    for rid, who, deadline in ((1, a, 5.0), (2, a, 6.0), (3, b, 7.0), (4, b, 8.0)):
        calls.add(waiting(who, rid, deadline))
    assert (calls.count(a), calls.count(b), calls.count_uid(1000)) == (2, 2, 4)
    assert calls.has(a, "n")
    assert calls.next_deadline() == 5.0
    calls.expire(5.0)  # call 1 times out
    assert fake.answered[1].code == ErrorCode.NO_SUCH_RANK
    assert (calls.count(a), calls.count_uid(1000), calls.next_deadline()) == (1, 3, 6.0)
    table.entries["j", 2] = table.join("j", 3, (0, 0, 1), owner=1000)[2]  # the job is whole

    def attempt(c: Call) -> bool:
        if c.request_id == 3:
            raise UsageError("called otherwise")  # call 3 fails
        return c.request_id == 2  # call 2 runs, call 4 waits on

    calls.retry("j", attempt)
    assert fake.answered[3].code == ErrorCode.USAGE
    assert [c.request_id for c in calls] == [4]
    assert calls.next_deadline() == 8.0  # call 4 keeps its deadline
    assert (calls.count(a), calls.count(b), calls.count_uid(1000)) == (0, 1, 1)
    calls.client_gone(b)  # call 4's client leaves
    assert_empty(calls, a, b)
    assert 4 not in fake.answered  # a client that left is not answered


def test_the_drain_empties_every_table() -> None:
    table = Table()
    half_job(table)
    calls, fake = kit(table)
    clients = [session(0), session(1)]
    for rid in range(10):
        calls.add(waiting(clients[rid % 2], rid, float(rid)))
    calls.shutdown(Failure(code=ErrorCode.DAEMON_STOPPING, message="stopping"))
    assert len(fake.answered) == 10
    assert_empty(calls, *clients)


def test_one_uid_waits_at_most_max_waiting_calls_per_uid() -> None:
    table = Table()
    half_job(table)
    half_job(table, "other")
    table.owners["other"] = 2000
    calls, _ = kit(table, max_waiting_calls_per_uid=3)
    clients = [session(rank) for rank in range(4)]
    for rid in range(3):  # over three clients of the uid: the bound is the uid's
        calls.add(waiting(clients[rid], rid, 1.0))
    with pytest.raises(OperationFailed, match="max_waiting_calls_per_uid") as refused:
        calls.add(waiting(clients[3], 3, 1.0))
    assert refused.value.code == ErrorCode.LIMIT
    assert "uid 1000 have 3 x calls waiting" in str(refused.value)
    calls.add(waiting(session(0, job="other"), 4, 1.0))  # another uid's room is its own
    calls.client_gone(clients[0])
    calls.add(waiting(clients[3], 5, 1.0))  # room again
    assert (calls.count_uid(1000), calls.count_uid(2000)) == (3, 1)


def test_a_burst_of_expiries_is_answered_over_several_ticks() -> None:
    table = Table()
    half_job(table)
    calls, fake = kit(table, max_ops_per_client=10_000)
    who = session()
    for rid in range(EXPIRE_PER_TICK * 2 + 10):
        calls.add(waiting(who, rid, 1.0))
    calls.expire(1.0)
    assert len(fake.answered) == EXPIRE_PER_TICK
    assert calls.next_deadline() == 1.0  # the rest are still due: the timer runs again at once
    calls.expire(1.0)
    calls.expire(1.0)
    assert len(fake.answered) == EXPIRE_PER_TICK * 2 + 10
    assert_empty(calls, who)


def test_a_rank_of_a_job_still_missing_others_retries_nothing() -> None:
    table = Table()
    table.join("j", 3, (0, 0, 1), owner=1000)
    del table.entries["j", 1], table.entries["j", 2]
    calls, _ = kit(table)
    calls.add(waiting(session(), 1, 1.0))
    tried: list[int] = []
    table.entries["j", 1] = table.join("j", 3, (0, 0, 1), owner=1000)[1]
    del table.entries["j", 2]
    calls.retry("j", lambda c: tried.append(c.request_id) is None)
    assert tried == []  # rank 2 is still missing: no call can be ready
    assert len(calls) == 1


def test_tables_give_their_memory_back_once_most_calls_left() -> None:
    table = Table()
    half_job(table)
    calls, _ = kit(table, max_ops_per_client=100_000)
    who = session()
    for rid in range(10_000):
        calls.add(waiting(who, rid, float(rid)))
    calls.expire(9_000.0)
    while calls.next_deadline() is not None and calls.next_deadline() <= 9_000.0:  # type: ignore[operator]
        calls.expire(9_000.0)
    assert len(calls) == 999
    assert calls._removed <= 2 * len(calls) + 64  # rebuilt on the way: no 9,000 dead slots


def test_deadlines_pop_at_most_the_limit() -> None:
    due: Deadlines[int] = Deadlines()
    for key in range(5):
        due.set(key, 1.0)
    assert due.pop_due(1.0, 2) == [0, 1]
    assert due.next() == 1.0
    assert due.pop_due(1.0) == [2, 3, 4]
    assert due.next() is None


def test_open_calls_by_job_empty_as_calls_end() -> None:
    fake = FakeHost(Config(node_id=0, nodes=NODES))
    calls: OpenCalls[int] = OpenCalls(fake, OperationStats("x", kinds=["barrier"]))  # type: ignore[arg-type]
    mine, theirs = session(0), session(1, job="k")
    for key, who in ((1, mine), (2, mine), (3, theirs)):
        calls.open(
            key, OpenCall(session=who, request=key, kind="barrier", name="n", started=0.0, nbytes=0)
        )
    assert sorted(calls.of_job("j")) == [1, 2]
    calls.reply(1, {})
    calls.fail(3, Failure(code=ErrorCode.PEER_FAILED, message="gone"))
    assert calls.of_job("j") == [2]
    assert calls.of_job("k") == []
    calls.abandon(mine)
    assert calls._by_job == {}
    assert calls._by_session == {}


# -- held frames ------------------------------------------------------------------------------
def frame(name: str = "c", job: str = "j") -> collectives_frames.Coll:
    spec = {"kind": "barrier", "count": 0, "dtype": "uint8", "op": "sum", "mode": "sync"}
    return coll_frame(spec | {"root": 0, "ring": False}, job=job, name=name)


def assert_nothing_held(held: HeldFrames) -> None:
    assert not held
    assert (held.count, held.bytes) == (0, 0)
    assert held.next_deadline() is None
    assert held._landing == {}
    assert held._names == {}
    assert len(held._due) == 0


def test_held_frames_expire_in_order_and_leave_nothing() -> None:
    held = HeldFrames()
    first, second, other = frame(), frame(), frame("d")
    held.hold(1, first, 0, 5.0, whole=True)
    held.hold(1, second, 8, 6.0, whole=False)  # still landing
    held.hold(1, other, 4, 7.0, whole=True)
    assert (held.count, held.bytes) == (3, 12)
    assert held.next_deadline() == 5.0
    assert held.expire(6.0) == [(("j", "c"), 1)]  # the whole one goes; the landing one stays
    assert (held.count, held.bytes) == (2, 12)
    assert held.next_deadline() == 7.0  # a frame still landing has no deadline of its own
    assert held.landed(second) is not None  # its bytes are in, past its deadline
    assert held.next_deadline() == 6.0  # so it goes at the next tick
    assert held.expire(7.0) == [(("j", "c"), 1), (("j", "d"), 1)]
    assert_nothing_held(held)


def test_held_frames_go_with_their_node_their_name_or_their_replay() -> None:
    held = HeldFrames()
    landing = frame()
    held.hold(1, frame(), 0, 5.0, whole=True)
    held.hold(2, landing, 8, 5.0, whole=False)
    held.hold(1, frame(), 4, 5.0, whole=True)
    held.hold(2, frame("d"), 4, 5.0, whole=True)
    assert sorted(held.keys_of("j")) == [("j", "c"), ("j", "d")]
    assert held.drop_node(2) == [("j", "c")]  # node 2's links were reset
    assert held.landed(landing) is None  # its landing went with them
    assert [h.node for h in held.ready(("j", "c"))] == [1, 1]  # replayed
    assert_nothing_held(held)
    held.hold(1, frame(), 4, 5.0, whole=True)
    assert held.drop(("j", "c")) == 1  # its job ended
    assert_nothing_held(held)


# -- the services -----------------------------------------------------------------------------
def test_the_collective_service_forgets_a_job_everywhere() -> None:
    table = Table()
    svc, host = service(table)
    entries = table.join("j", 2, (0, 1), owner=1000)
    del table.entries["j", 1]
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    rank0 = client(0, 2, [1.0] * 4, job="j")
    for rid in range(4):
        call(svc, rank0, rid, name=f"c{rid}")
    land_held(svc)
    assert svc.statistics()["counters"]["collective_calls_waiting_for_ranks"] == 4
    table.entries["j", 1] = entries[1]
    svc.on_rank_event(RankJoined(entry=entries[1]), 0.0)  # the calls run, the frame is placed
    assert len(svc._waiting) == 0
    assert not svc._held
    assert sorted(svc._by_job.of("j")) == [("j", f"c{i}") for i in range(4)] + [("j", "h")]
    assert svc._open.count(rank0) == 4
    for entry in table.leave("j"):
        svc.on_rank_event(RankLeft(entry=entry, reason="it left", lost=False), 0.0)
    assert all(host.answered[rid].code == "peer_failed" for rid in range(4))
    assert svc.collectives == {}
    assert not svc._by_job
    assert len(svc._due) == 0
    assert len(svc._open) == 0
    assert svc._open._by_job == {}
    assert svc.next_deadline() is None


def land_held(svc: CollectiveService) -> None:
    """A zero-byte frame of node 1 for barrier h of job j, held (rank 1 unknown)."""
    svc.on_data(1, frame("h"), 0, 0.0)
    assert svc._held.count == 1


def test_a_sync_rounds_deadline_waits_in_the_heap_and_leaves_it() -> None:
    table = Table()
    svc, host = service(table)
    host.links[1] = Link()
    host.links[1].writable = True
    entries = table.join("j", 3, (0, 1, 1), owner=1000)
    for entry in entries:
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    call(svc, client(0, 3, [1.0] * 4), 1)  # round 0 waits for node 1
    del table.entries["j", 2]
    svc.on_rank_event(RankLeft(entry=entries[2], reason="it left", lost=False), 0.0)
    due = svc.next_deadline()
    assert due == host.config.suspect_after  # the round's grace, in the collectives' heap
    assert svc._due.get(("j", "grad")) == due
    svc.on_timer(due - 0.5)  # not due yet: nothing happens
    assert 1 not in host.answered
    svc.on_timer(due)
    assert host.answered[1].code == "peer_failed"
    assert len(svc._due) == 0
    assert svc.next_deadline() is None


def test_the_stochastic_service_forgets_a_job_everywhere() -> None:
    table = Table()
    fake = FakeHost(Config(node_id=0, nodes=NODES, route_timeout=5.0))
    svc = StochasticService(fake, membership=table)  # type: ignore[arg-type]
    entries = table.join("j", 2, (0, 0), owner=1000)
    del table.entries["j", 1]
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    ranks = [client(r, 2, [1.0] * 4) for r in (0, 1)]
    reduce(svc, ranks[0], 1, "a")
    reduce(svc, ranks[0], 2, "b")
    with pytest.raises(UsageError, match="already has a call"):  # one call of a name waits
        reduce(svc, ranks[0], 3, "a")
    svc.on_timer(5.0)  # both time out
    assert [fake.answered[r].code for r in (1, 2)] == ["no_such_rank"] * 2
    assert len(svc._waiting) == 0
    assert svc.next_deadline() is None
    table.entries["j", 1] = entries[1]
    svc.on_rank_event(RankJoined(entry=entries[1]), 0.0)
    reduce(svc, ranks[0], 4, "a", sync="async")
    reduce(svc, ranks[1], 5, "a", sync="async")
    assert sorted(svc._reducers_of.of("j")) == [("j", "a", 0), ("j", "a", 1)]
    assert svc._names.of("j") == [("j", "a")]
    for entry in table.leave("j"):
        svc.on_rank_event(RankLeft(entry=entry, reason="it left", lost=False), 0.0)
    assert svc.reducers == {}
    assert not svc._reducers_of
    assert not svc._names
    assert svc._specs == {}


def reduce(svc: StochasticService, who: ClientSession, rid: int, name: str, **fields: Any) -> None:
    meta = {"name": name, "graph": "ring", "seed": 0, "sync": "notify-ack", "dtype": "float64"}
    meta |= {"nbytes": 32, "seg": 1, "off": 0} | fields
    svc.on_request(Request(session=who, id=rid, op="stochastic_reduce", meta=meta, fds=[]), 0.0)


def test_the_parameter_server_service_forgets_a_client_everywhere() -> None:
    fabric = Fabric()
    fabric.join_all()
    lossless = {"psmp_threshold": 0.5, "lossless_publish": True}
    fabric.open(0, "server", filters=lossless)
    fabric.open(1, "replica", filters=lossless)
    fabric.open(2, "worker")
    fabric.open(3, "worker")
    assert fabric.deliver(100)
    here = fabric.services[0]
    server, worker = fabric.sessions[0], fabric.sessions[2]
    assert here.client_statistics(worker) == {"ps_calls": 0}
    fabric.call(2, 10, "ps_push")  # its server answers only once the frames are delivered
    fabric.call(3, 10, "ps_push")  # (and, bsp, once every worker pushed)
    assert here.client_statistics(worker) == {"ps_calls": 1}
    assert here.client_statistics(server) == {"ps_calls": 0}
    assert fabric.deliver(100)
    assert here.client_statistics(worker) == {"ps_calls": 0}
    fabric.request(0, 20, "ps_flush", name=NAME)  # its shard's process flushes
    with pytest.raises(UsageError, match="serves no shard"):  # a worker's process serves none
        fabric.request(2, 21, "ps_flush", name=NAME)
    fabric.leave(2)
    fabric.leave(0)
    assert not here._worked
    assert not here._served
    assert not here._flushing
    assert here._flushes == {}
    assert here.engine.models == {}
    assert here.engine._jobs == {}


def test_a_rank_of_another_job_touches_no_parameter_server_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fabric = Fabric()
    fabric.start()
    looked: list[int] = []
    target = Model.target
    monkeypatch.setattr(Model, "target", lambda m, shard: looked.append(shard) or target(m, shard))
    here = fabric.services[0]
    other = RankEntry(job="other", rank=0, size=2, node=0)
    here.on_rank_event(RankJoined(entry=other), 0.0)
    assert looked == []  # job j's models and their shards are not looked at
    entry = fabric.table.entries[JOB, 3]  # a worker of j on node 1 comes back
    here.on_rank_event(RankJoined(entry=entry), 0.0)
    assert looked  # its own job's are
