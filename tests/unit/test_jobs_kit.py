"""The jobs kit the collective and stochastic services share: the drain's refusal, calls that
wait for their job's ranks, and the calls an engine holds (and when each counts as stalled)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.metrics import OperationStats
from fabricd.daemon.services.jobs import (
    STALLS_PER_TICK,
    OpenCall,
    OpenCalls,
    StallWatch,
    WaitingForRanks,
    refuse_while_draining,
)
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.actions import Failure
from fabricd.errors import ErrorCode, OperationFailed, UsageError
from tests.unit.test_collective_service_review import FakeHost, Table

NODES = ("127.0.0.1:1", "127.0.0.1:2")


@dataclass
class Call:
    """A call that waits for its job's ranks."""

    session: ClientSession
    request_id: int
    deadline: float
    name: str = "n"


def host(**settings: object) -> FakeHost:
    return FakeHost(Config(node_id=0, nodes=NODES, **settings))  # type: ignore[arg-type]


def session(rank: int = 0, job: str = "j") -> ClientSession:
    return ClientSession(conn=None, job=job, rank=rank, size=3)  # type: ignore[arg-type]


def waiting(who: ClientSession, rid: int, deadline: float = 5.0) -> Call:
    return Call(session=who, request_id=rid, deadline=deadline)


def kit(fake: FakeHost, table: Table | None = None) -> WaitingForRanks[Call]:
    table = table or Table()
    return WaitingForRanks(fake, table, "x calls", lambda c: f"x {c.request_id}")  # type: ignore[arg-type]


def test_a_draining_daemon_refuses_new_work() -> None:
    fake = host()
    refuse_while_draining(fake)  # serving: nothing to say
    fake.draining = True
    with pytest.raises(OperationFailed) as refused:
        refuse_while_draining(fake)
    assert refused.value.code == ErrorCode.DAEMON_STOPPING


def test_a_call_that_waited_route_timeout_fails_naming_the_missing_ranks() -> None:
    fake, table = host(route_timeout=5.0), Table()
    table.join("j", 3, (0, 0, 1), owner=1000)
    del table.entries["j", 2]
    calls = kit(fake, table)
    calls.add(waiting(session(), 1, deadline=5.0))
    calls.add(waiting(session(1), 2, deadline=6.0))
    assert calls.next_deadline() == 5.0
    calls.expire(4.9)
    assert fake.answered == {}
    calls.expire(5.0)
    failure = fake.answered[1]
    assert failure.code == ErrorCode.NO_SUCH_RANK
    assert "x 1 of job 'j' waited route_timeout (5.0 s) for ranks 2 to join" in failure.message
    assert len(calls) == 1
    assert calls.next_deadline() == 6.0


def test_a_client_waits_at_most_max_ops_per_client_calls() -> None:
    calls = kit(host(max_ops_per_client=2))
    mine, other = session(), session(1)
    calls.add(waiting(mine, 1))
    calls.add(waiting(mine, 2))
    with pytest.raises(OperationFailed, match="this client has 2 x calls waiting") as refused:
        calls.add(waiting(mine, 3))
    assert refused.value.code == ErrorCode.LIMIT
    calls.add(waiting(other, 4))  # another client's room is its own
    calls.client_gone(mine)
    assert [c.request_id for c in calls] == [4]


def test_a_retry_takes_the_jobs_ready_calls_keeps_the_rest_and_fails_the_refused() -> None:
    fake, table = host(), Table()
    table.join("j", 3, (0, 0, 1), owner=1000)  # every rank of the job is known
    calls = kit(fake, table)
    for rid, job in ((1, "j"), (2, "j"), (3, "k"), (4, "j")):
        calls.add(waiting(session(job=job), rid))
    tried: list[int] = []

    def attempt(call: Call) -> bool:
        tried.append(call.request_id)
        if call.request_id == 4:
            raise UsageError("called otherwise")
        return call.request_id == 1

    calls.retry("j", attempt)
    assert tried == [1, 2, 4]  # only the job's, in order
    assert [c.request_id for c in calls] == [3, 2]
    assert fake.answered[4] == Failure(code=ErrorCode.USAGE, message="called otherwise")


def test_the_end_of_the_drain_fails_every_waiting_call() -> None:
    fake = host()
    calls = kit(fake)
    calls.add(waiting(session(), 1))
    stopping = Failure(code=ErrorCode.DAEMON_STOPPING, message="stopping")
    calls.shutdown(stopping)
    assert fake.answered == {1: stopping}
    assert len(calls) == 0


def open_call(who: ClientSession, rid: int, kind: str = "barrier") -> OpenCall:
    return OpenCall(session=who, request=rid, kind=kind, name="n", started=0.0, nbytes=8)


def test_an_open_call_is_answered_once_and_counted() -> None:
    fake, stats = host(), OperationStats("x", kinds=["barrier"])
    calls: OpenCalls[int] = OpenCalls(fake, stats)  # type: ignore[arg-type]
    mine = session()
    calls.open(10, open_call(mine, 1))
    calls.open(11, open_call(mine, 2))
    assert 10 in calls
    assert calls.count(mine) == 2
    calls.reply(10, {"round": 0})
    calls.reply(10, {"round": 1})  # answered already: nothing
    failure = Failure(code=ErrorCode.PEER_FAILED, message="gone")
    calls.fail(11, failure)
    assert fake.answered == {1: {"round": 0}, 2: failure}
    assert calls.count(mine) == 0
    assert len(calls) == 0
    assert stats.started_by_kind["barrier"] == 2
    assert stats.completed_by_kind["barrier"] == 1
    assert stats.failed_by_kind["barrier", ErrorCode.PEER_FAILED] == 1


def test_a_client_that_leaves_abandons_its_open_calls() -> None:
    fake, stats = host(), OperationStats("x")
    calls: OpenCalls[int] = OpenCalls(fake, stats)  # type: ignore[arg-type]
    mine, other = session(), session(1)
    calls.open(10, open_call(mine, 1, kind="sync"))
    calls.open(11, open_call(other, 2, kind="sync"))
    assert [key for key, _ in calls.abandon(mine)] == [10]
    assert stats.abandoned_by_kind["sync"] == 1
    assert [key for key, _ in calls.items()] == [11]
    assert fake.answered == {}


def test_an_expired_call_of_a_huge_job_looks_up_only_the_ranks_it_names() -> None:
    """A job's size is the client's to say (up to 2**31): naming the missing ranks of an expired
    call must not walk, or list, all of them (review: seconds of loop, or the daemon's memory)."""

    class Counting(Table):
        lookups = 0

        def lookup(self, job: str, rank: int) -> object:
            Counting.lookups += 1
            return super().lookup(job, rank)

    table = Counting()
    size = 2**31 - 1
    table.join("big", size, (0,), owner=1000)  # rank 0 only is known
    fake = FakeHost(Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2")))
    calls = WaitingForRanks(fake, table, "x calls", lambda c: "x")  # type: ignore[arg-type]
    who = ClientSession(conn=None, job="big", rank=0, size=size)  # type: ignore[arg-type]
    calls.add(Call(session=who, request_id=1, deadline=1.0))
    Counting.lookups = 0
    calls.expire(1.0)
    assert Counting.lookups < 100
    failure = fake.answered[1]
    assert isinstance(failure, Failure)
    assert failure.code == ErrorCode.NO_SUCH_RANK
    assert "ranks 1, 2, 3" in failure.message
    assert "..." in failure.message


def test_each_open_call_is_found_stalled_once_a_bounded_number_a_tick() -> None:
    """Issue 23, item 4: a call pending past stall_after is logged once; a whole job stalling
    at once is told over several ticks, never all in one."""
    fake, stats = host(stall_after=2.0), OperationStats("x", kinds=["barrier"])
    calls: OpenCalls[int] = OpenCalls(fake, stats)  # type: ignore[arg-type]
    mine = session()
    many = STALLS_PER_TICK + 10
    for key in range(many):
        calls.open(key, open_call(mine, key))
    calls.reply(0, {"round": 0})  # answered in time: never stalled
    calls.abandon(session(1))  # (another client's leaving touches none of these)
    assert calls.next_stall() == 2.0
    assert calls.stalled(1.9) == []
    first = calls.stalled(2.0)
    assert [key for key, _ in first] == list(range(1, STALLS_PER_TICK + 1))  # oldest first
    assert calls.next_stall() == 2.0  # the rest are still due: the timer runs again at once
    rest = calls.stalled(2.0)
    assert [key for key, _ in rest] == list(range(STALLS_PER_TICK + 1, many))
    assert calls.stalled(100.0) == []  # found once, however long they stay open
    assert calls.next_stall() is None  # nothing left to find: no timer
    assert len(calls) == many - 1


def test_a_stall_check_fires_for_nothing_at_most_once_after_its_call_ended() -> None:
    """The check is lazy (it moves only earlier): an ended call never moves the timer; it is
    cleared once no call is watched."""
    watch: StallWatch[str] = StallWatch(5.0)
    watch.watch("a", 0.0)
    watch.watch("b", 1.0)
    watch.forget("a")
    assert watch.next_deadline() == 5.0  # a's, stale: not recomputed when it ended
    assert watch.due(5.0) == []  # fires, finds nothing
    assert watch.next_deadline() == 6.0  # b's
    watch.forget("b")
    assert watch.next_deadline() is None
