"""One shard's server state (fabricd/engines/ps/server.py) without sockets: the PS node
engines of the in-process fabric of ``ps_fabric`` (their ShardServer and Worker engines inside)
under arbitrary interleavings, resends, duplicates, link resets and failovers, and the shard's
own rules one call at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.consistency import Consistency, Sum
from fabricd.engines.ps.filters import Push
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import (
    LOSE,
    PUSH,
    Acked,
    Answer,
    Entry,
    Forward,
    Logged,
    Refuse,
    Snapshot,
    Step,
)
from fabricd.errors import RemoteProtocolError
from tests.unit.ps_fabric import Fabric

Array = np.ndarray[Any, Any]
SIZE = 4


def payload(*values: float) -> bytearray:
    array = np.array(values, np.float64)
    return ps_push.encode(Push(size=array.size, pushed=array.size, indices=None, values=array))


def shard(
    consistency: Consistency = Consistency.ASYNC,
    *,
    workers: int = 2,
    staleness: int = 0,
    delay_bound: int | None = None,
    replica: bool = False,
    replicated: bool = False,
) -> ShardServer:
    return ShardServer(
        initial=np.zeros(SIZE),
        workers=range(workers),
        consistency=consistency,
        staleness=staleness,
        delay_bound=delay_bound,
        rule=Sum(),
        replica=replica,
        replicated=replicated,
    )


def pair(
    consistency: Consistency = Consistency.ASYNC, **kw: Any
) -> tuple[ShardServer, ShardServer]:
    """A primary and its replica, joined: the replica restored the primary's snapshot."""
    primary = shard(consistency, replicated=True, **kw)
    replica = shard(consistency, replica=True, **kw)
    [snapshot] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert snapshot.index == 0
    assert replica.restore(snapshot.index, snapshot.data)
    return primary, replica


def ones(scale: float = 1.0) -> bytearray:
    return payload(*([scale] * SIZE))


# -- moves the property tests draw ------------------------------------------------------------
def moves(
    workers: int, shards: int, *, failover: bool, joins: bool = False, flushes: bool = False
) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Scripts for :func:`play`: mostly workers' calls and deliveries, and bursts of both (so
    the loops get far), with resends, duplicates, resets, fresh arrays, (``failover``)
    primaries killed, (``joins``) late replicas joining and fresh replicas rejoining a promoted
    one, and (``flushes``) shards flushed."""
    w = st.integers(0, workers - 1)
    s = st.integers(0, shards - 1)
    step = st.tuples(st.just("step"), w)
    deliver = st.tuples(st.just("deliver"), st.integers(0, 63), st.just(False))
    options = [
        step,
        step,
        deliver,
        deliver,
        deliver,
        st.tuples(st.just("deliver"), st.integers(0, 63), st.just(True)),
        st.tuples(st.just("resend"), w, s),
        st.tuples(st.just("reset"), w, s),
        st.tuples(st.just("reset_replica"), s),
        st.tuples(st.just("fresh"), w),
        st.tuples(st.just("burst"), st.integers(1, 30), st.integers(0, 63)),
    ]
    if failover:
        options.append(st.tuples(st.just("kill"), s))
    if joins:
        options += [st.tuples(st.just("join"), s), st.tuples(st.just("rejoin"), s)]
    if flushes:
        options.append(st.tuples(st.just("flush"), s))
    return st.lists(st.one_of(options), min_size=10, max_size=150)


def run(fabric: Fabric, script: list[tuple[Any, ...]]) -> None:
    """Make ``script``'s moves."""
    for move in script:
        name, *args = move
        if name == "step":
            fabric.step(args[0])
        elif name == "deliver":
            fabric.deliver(args[0], twice=args[1])
        elif name == "resend":
            fabric.resend(args[0], args[1])
        elif name == "reset":
            fabric.reset(args[0], args[1])
        elif name == "reset_replica":
            fabric.reset_replica(args[0])
        elif name == "fresh":
            fabric.workers[args[0]].fresh_next = True
        elif name == "burst":
            for i in range(args[0]):
                for w in range(len(fabric.workers)):
                    fabric.step(w)
                fabric.deliver(args[1] * i + i)
        elif name == "join":
            fabric.join(args[0])
        elif name == "rejoin":
            fabric.rejoin(args[0])
        elif name == "flush":
            fabric.flush(args[0])
        else:
            assert name == "kill"
            fabric.kill(args[0])


def play(fabric: Fabric, script: list[tuple[Any, ...]]) -> None:
    """Make ``script``'s moves, run every worker to its end, and check the end state."""
    run(fabric, script)
    fabric.drain()
    fabric.check_settled()


CONSISTENCIES = st.sampled_from(
    [
        (Consistency.BSP, 0),
        (Consistency.SSP, 0),
        (Consistency.SSP, 1),
        (Consistency.SSP, 3),
        (Consistency.ASYNC, 0),
    ]
)


def replicated(consistency: Consistency, staleness: int, **kw: Any) -> Fabric:
    """Three workers over two shards of five parameters, each shard with a replica."""
    return Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=3,
        consistency=consistency,
        staleness=staleness,
        replicas=True,
        **kw,
    )


@settings(max_examples=120)
@given(CONSISTENCIES, st.data())
def test_exactly_once_with_replica_under_any_interleaving(
    mode: tuple[Consistency, int], data: st.DataObject
) -> None:
    """Resends at any point, duplicates of any frame, resets (lost frames, then resent):
    every push applied exactly once, the model the sum of every acknowledged push, versions
    a worker sees never go back, the replica equal to its primary."""
    consistency, staleness = mode
    fabric = replicated(consistency, staleness)
    play(fabric, data.draw(moves(3, 2, failover=False)))
    if consistency is Consistency.BSP:
        assert all(fabric.serving(s).version == 3 for s in range(2))


@settings(max_examples=120)
@given(CONSISTENCIES, st.data())
def test_failover_loses_nothing_acknowledged(
    mode: tuple[Consistency, int], data: st.DataObject
) -> None:
    """The primary vanishes at any point (its unconfirmed entries with it), the replica is
    promoted and the workers fail over: nothing acknowledged is lost, nothing applied twice,
    the replica serves on and versions never go back."""
    consistency, staleness = mode
    fabric = replicated(consistency, staleness)
    run(fabric, data.draw(moves(3, 2, failover=True)))
    replica = fabric.replicas[0]
    assert replica is not None
    while not replica.has_state:  # the replica has its snapshot before shard 0 dies
        fabric.deliver(0)
    fabric.kill(0)
    assert fabric.serving(0) is replica
    play(fabric, data.draw(moves(3, 2, failover=True)))
    if consistency is Consistency.BSP:
        assert all(fabric.serving(s).version == 3 for s in range(2))


@settings(max_examples=80)
@given(CONSISTENCIES, st.data())
def test_without_replica(mode: tuple[Consistency, int], data: st.DataObject) -> None:
    """The same guarantees on a shard with no replica (pushes are processed on arrival)."""
    consistency, staleness = mode
    fabric = Fabric(
        workers=2, shards=3, size=6, rounds=3, consistency=consistency, staleness=staleness
    )
    play(fabric, data.draw(moves(2, 3, failover=False)))


@settings(max_examples=80)
@given(st.integers(0, 3), st.booleans(), st.data())
def test_async_delay_bound(bound: int, replicas: bool, data: st.DataObject) -> None:
    """Async with a delay bound: no update applied with a delay over it (the fabric checks
    every acknowledgement); what the gates or the server dropped is acknowledged, never lost."""
    fabric = Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=4,
        consistency=Consistency.ASYNC,
        delay_bound=bound,
        replicas=replicas,
    )
    play(fabric, data.draw(moves(3, 2, failover=replicas)))
    for sim in fabric.workers:
        for done in sim.pushes:
            assert all("delay" in why for why in done.dropped)


@settings(max_examples=60)
@given(st.sampled_from([Consistency.BSP, Consistency.SSP]), st.data())
def test_lost_worker_with_interleavings(consistency: Consistency, data: st.DataObject) -> None:
    """A worker lost at any point: the others finish (BSP goes on without it), and what it
    pushed before is applied once or acknowledged as dropped."""
    fabric = replicated(consistency, 0)
    run(fabric, data.draw(moves(3, 2, failover=True)))
    fabric.lose(2)
    play(fabric, data.draw(moves(3, 2, failover=True)))
    if consistency is Consistency.BSP:
        for s in range(2):
            assert fabric.serving(s).version == 3


@settings(max_examples=80)
@given(CONSISTENCIES, st.booleans(), st.booleans(), st.data())
def test_callback_flush_and_joins_at_any_point(
    mode: tuple[Consistency, int], callback: bool, lossless: bool, data: st.DataObject
) -> None:
    """The update callback's Steps answered at any point (pushes, pulls, flushes and entries
    queued behind them), flushes between any frames (BSP iterations pending, pulls held),
    a replica that joins late, primaries killed and fresh replicas joining the promoted one
    (a snapshot with entries unconfirmed or a Step out): the same guarantees as ever."""
    consistency, staleness = mode
    fabric = replicated(
        consistency, staleness, callback=callback, lossless=lossless, late_join=True
    )
    for _ in range(3):  # kill and rejoin more than once: the epochs go on
        run(fabric, data.draw(moves(3, 2, failover=True, joins=True, flushes=True)))
    play(fabric, data.draw(moves(3, 2, failover=True, joins=True, flushes=True)))


# -- one call at a time -----------------------------------------------------------------------
def test_push_acked_with_version_and_resend_acked_again() -> None:
    server = shard()
    [ack] = server.push(0, 0, 0, ones(), 0.0)
    assert ack == Acked(worker=0, iteration=0, version=1, dropped=None)
    assert server.push(0, 0, 0, ones(), 1.0) == [ack]  # sent again: acknowledged again
    assert server.version == 1
    np.testing.assert_array_equal(server.store.model, np.ones(SIZE))
    stats = server.statistics()
    assert (stats.pushes, stats.resent) == (1, 1)


def test_second_push_before_ack_is_a_protocol_error() -> None:
    server = shard(Consistency.BSP)
    assert server.push(0, 0, 0, ones(), 0.0) == []  # waits for worker 1
    assert server.push(0, 0, 0, ones(), 0.0) == []  # a resend while it waits: nothing yet
    with pytest.raises(RemoteProtocolError, match="before its iteration 0"):
        server.push(0, 1, 0, ones(), 0.0)
    [a0, a1] = server.push(1, 0, 0, ones(2), 0.0)
    assert {a0.worker, a1.worker} == {0, 1}
    assert a0.version == a1.version == 1
    np.testing.assert_array_equal(server.store.model, np.full(SIZE, 3.0))


def test_malformed_push_changes_nothing() -> None:
    server = shard()
    for bad in (payload(1, 2), b"", ones()[:-1]):
        with pytest.raises(RemoteProtocolError):
            server.push(0, 0, 0, bad, 0.0)
    with pytest.raises(RemoteProtocolError):
        server.push(0, 0, 5, ones(), 0.0)  # a base the model never had
    with pytest.raises(RemoteProtocolError):
        server.push(7, 0, 0, ones(), 0.0)  # not a worker
    assert server.statistics().pushes == 0
    [ack] = server.push(0, 0, 0, ones(), 0.0)  # the worker's real push is still taken
    assert ack.version == 1


def test_replica_refuses_pushes_and_pulls_primary_refuses_entries() -> None:
    replica = shard(replica=True)
    with pytest.raises(RemoteProtocolError):
        replica.push(0, 0, 0, ones(), 0.0)
    with pytest.raises(RemoteProtocolError):
        replica.pull(0, 0, 0, 0.0)
    with pytest.raises(RemoteProtocolError):
        shard().log(Entry(index=1, kind=LOSE, worker=0, reason="x"), 0.0)


def test_replica_refuses_gaps_and_malformed_entries() -> None:
    _, replica = pair()
    with pytest.raises(RemoteProtocolError, match="entry 2 after 0"):
        replica.log(Entry(index=2, kind=LOSE, worker=0, reason="x"), 0.0)
    with pytest.raises(RemoteProtocolError):
        replica.log(Entry(index=1, kind=PUSH, worker=0, payload=b"junk"), 0.0)
    with pytest.raises(RemoteProtocolError):
        replica.log(Entry(index=1, kind="other", worker=0), 0.0)
    assert replica.statistics().logged == 0
    assert replica.log(Entry(index=1, kind=PUSH, worker=0, payload=ones()), 0.0) == [
        Logged(index=1)
    ]
    # logged again (the primary resent it after a reset): confirmed again, not applied again
    assert replica.log(Entry(index=1, kind=PUSH, worker=0, payload=ones()), 0.0) == [
        Logged(index=1)
    ]
    assert replica.version == 1


def test_primary_processes_only_what_the_replica_confirmed() -> None:
    primary, replica = pair()
    [fwd0] = primary.push(0, 0, 0, ones(), 0.0)
    [fwd1] = primary.push(1, 0, 0, ones(2), 0.0)
    assert isinstance(fwd0, Forward)
    assert isinstance(fwd1, Forward)
    assert primary.version == 0
    assert primary.statistics().unreplicated == 2
    assert [f.entry for f in primary.unconfirmed()] == [fwd0.entry, fwd1.entry]
    with pytest.raises(RemoteProtocolError):
        primary.replicated_upto(3, 0.0)
    assert replica.log(fwd0.entry, 0.0) == [Logged(index=1)]
    [ack] = primary.replicated_upto(1, 0.0)
    assert ack == Acked(worker=0, iteration=0, version=1, dropped=None)
    assert primary.replicated_upto(1, 0.0) == []  # a duplicate confirmation
    replica.log(fwd1.entry, 0.0)
    assert primary.replicated_upto(2, 0.0) == [
        Acked(worker=1, iteration=0, version=2, dropped=None)
    ]
    np.testing.assert_array_equal(replica.store.model, primary.store.model)


def test_replica_lost_primary_goes_on_alone() -> None:
    primary = shard(replicated=True)
    primary.push(0, 0, 0, ones(), 0.0)
    [ack] = primary.replica_lost(0.0)
    assert ack.version == 1
    assert not primary.replicated
    assert primary.push(1, 0, 0, ones(), 0.0)[0].version == 2  # processed on arrival now
    assert primary.unconfirmed() == []
    assert primary.replicated_upto(5, 0.0) == []  # a late confirmation


def test_promoted_replica_acks_a_bsp_push_it_logged_once_the_iteration_completes() -> None:
    """BSP: the replica logged worker 0's push of iteration 0 (waiting for worker 1), the
    primary died; worker 0 resends it to the promoted replica: it is not a new push (it waits
    for its iteration), and worker 1's push completes the iteration once."""
    primary, replica = pair(Consistency.BSP)
    [fwd] = primary.push(0, 0, 0, ones(), 0.0)
    replica.log(fwd.entry, 0.0)
    replica.promote()
    assert replica.push(0, 0, 0, ones(), 1.0) == []
    with pytest.raises(RemoteProtocolError, match="before its iteration 0"):
        replica.push(0, 1, 0, ones(), 1.0)  # iteration 0 is not acknowledged yet
    acks = replica.push(1, 0, 0, ones(2), 1.0)
    assert sorted((a.worker, a.version) for a in acks if isinstance(a, Acked)) == [(0, 1), (1, 1)]
    np.testing.assert_array_equal(replica.store.model, np.full(SIZE, 3.0))


def test_promote_bumps_the_epoch_once() -> None:
    _, replica = pair()
    assert replica.promote()
    assert replica.promote()
    assert replica.primary
    assert replica.epoch == 1
    assert replica.statistics().epoch == 1


def test_replica_without_snapshot_cannot_take_over() -> None:
    """A replica that never got its primary's snapshot holds no model: it ignores entries
    and cannot be promoted (the shard is lost)."""
    replica = shard(replica=True)
    assert replica.log(Entry(index=1, kind=PUSH, worker=0, payload=ones()), 0.0) == []
    assert not replica.promote()
    assert not replica.primary


def test_a_replica_joining_late_gets_the_processed_state() -> None:
    """Entries the primary processed before the replica joined come in the snapshot; the
    replica then follows entry by entry and equals the primary."""
    primary = shard(Consistency.BSP, replicated=True)
    replica = shard(Consistency.BSP, replica=True)
    assert primary.push(0, 0, 0, ones(), 0.0) == []  # held for a replica that has not joined
    [snapshot, forward] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert isinstance(forward, Forward)
    assert replica.restore(snapshot.index, snapshot.data)
    assert replica.log(forward.entry, 0.0) == [Logged(index=1)]
    assert primary.replicated_upto(1, 0.0) == []  # BSP: waits for worker 1
    [fwd] = primary.push(1, 0, 0, ones(2), 0.0)
    replica.log(fwd.entry, 0.0)
    acks = primary.replicated_upto(2, 0.0)
    assert sorted(a.worker for a in acks if isinstance(a, Acked)) == [0, 1]
    assert replica.version == primary.version == 1
    np.testing.assert_array_equal(replica.store.model, primary.store.model)


# -- consistency through the shard ------------------------------------------------------------
def test_bsp_applies_each_iteration_once_with_every_push() -> None:
    server = shard(Consistency.BSP, workers=3)
    for it in range(4):
        assert server.push(0, it, it, ones(1), 0.0) == []
        assert server.push(1, it, it, ones(10), 0.0) == []
        acks = server.push(2, it, it, ones(100), 0.0)
        assert sorted(a.worker for a in acks if isinstance(a, Acked)) == [0, 1, 2]
        assert {a.version for a in acks if isinstance(a, Acked)} == {it + 1}
    assert server.version == 4
    np.testing.assert_array_equal(server.store.model, np.full(SIZE, 444.0))


def test_bsp_pull_held_until_its_iteration_is_applied() -> None:
    server = shard(Consistency.BSP)
    server.push(0, 0, 0, ones(), 0.0)
    assert server.pull(0, 1, 0, 0.0) == []  # held: iteration 0 not applied
    assert server.pull(0, 1, 0, 0.0) == []  # the same pull sent again: still held
    out = server.push(1, 0, 0, ones(), 1.0)
    [answer] = [a for a in out if isinstance(a, Answer)]
    assert (answer.worker, answer.clock, answer.version) == (0, 1, 1)
    assert out.index(answer) > max(i for i, a in enumerate(out) if isinstance(a, Acked))


def test_ssp_pull_answered_only_within_staleness() -> None:
    """SSP(1): a pull at clock c is answered once complete >= c - 1, held until then."""
    server = shard(Consistency.SSP, staleness=1)
    for it in range(2):
        server.push(0, it, 0, ones(), 0.0)
    assert server.coordinator.complete == 0  # worker 1 pushed nothing
    assert server.pull(0, 2, 0, 0.0) == []  # needs complete >= 1: held
    assert server.coordinator.held(0) == 2
    [ack, answer] = server.push(1, 0, 0, ones(), 1.0)
    assert isinstance(ack, Acked)
    assert isinstance(answer, Answer)
    assert (answer.clock, answer.version) == (2, 3)
    assert server.coordinator.complete == 1
    [now] = server.pull(1, 1, 0, 2.0)  # complete 1 >= 1 - 1: at once
    assert isinstance(now, Answer)


def test_async_server_drops_a_push_over_the_delay_bound() -> None:
    server = shard(delay_bound=1)
    for it in range(3):
        server.push(0, it, it, ones(), 0.0)
    [ack] = server.push(1, 0, 0, ones(100), 0.0)  # delay 3 > 1
    assert ack.dropped is not None
    assert "delay 3 > bound 1" in ack.dropped
    assert ack.version == 3
    assert server.version == 3
    np.testing.assert_array_equal(server.store.model, np.full(SIZE, 3.0))
    assert server.push(1, 0, 0, ones(100), 0.0) == [ack]  # resent: the same answer
    [ok] = server.push(1, 1, 2, ones(10), 0.0)  # delay 1: applied
    assert ok.dropped is None
    assert ok.version == 4
    assert server.coordinator.statistics().dropped["delay"] == 1


# -- lost workers -----------------------------------------------------------------------------
def test_lost_worker_later_push_dropped_with_reason_bsp_goes_on() -> None:
    server = shard(Consistency.BSP, workers=3)
    server.push(0, 0, 0, ones(), 0.0)
    assert server.pull(0, 1, 0, 0.0) == []
    server.push(1, 0, 0, ones(), 0.0)
    out = server.lose(2, "rank left", 1.0)
    acks = [a for a in out if isinstance(a, Acked)]
    assert sorted(a.worker for a in acks) == [0, 1]
    assert server.version == 1
    assert any(isinstance(a, Answer) and a.worker == 0 for a in out)
    assert server.lose(2, "again", 1.0) == []
    [drop] = server.push(2, 0, 0, ones(), 2.0)
    assert isinstance(drop, Acked)
    assert drop.dropped is not None
    assert "lost" in drop.dropped
    [refused] = server.pull(2, 1, 0, 2.0)
    assert isinstance(refused, Refuse)
    assert "lost" in refused.reason
    for it in (1, 2):
        server.push(0, it, it, ones(), 3.0)
        assert {a.version for a in server.push(1, it, it, ones(), 3.0)} == {it + 1}
    np.testing.assert_array_equal(server.store.model, np.full(SIZE, 6.0))


def test_lost_worker_resending_a_push_its_iteration_holds() -> None:
    """BSP: a worker lost with its push of iteration 0 held (its daemon, cut off, does not
    know and resends it after the links come back): the resend is no protocol error, the
    push is applied once with its iteration and acknowledged, then acknowledged again."""
    server = shard(Consistency.BSP, workers=3)
    server.push(2, 0, 0, ones(100), 0.0)
    assert server.lose(2, "node down", 0.0) == []
    assert server.push(2, 0, 0, ones(100), 1.0) == []  # sent again: it waits, as before
    server.push(0, 0, 0, ones(), 1.0)
    acks = server.push(1, 0, 0, ones(10), 1.0)
    assert sorted(a.worker for a in acks if isinstance(a, Acked)) == [0, 1, 2]
    np.testing.assert_array_equal(server.store.model, np.full(SIZE, 111.0))
    assert server.push(2, 0, 0, ones(100), 2.0) == [
        Acked(worker=2, iteration=0, version=1, dropped=None)
    ]


def test_lost_worker_held_pull_refused() -> None:
    server = shard(Consistency.BSP)
    server.push(1, 0, 0, ones(), 0.0)
    assert server.pull(1, 1, 0, 0.0) == []
    out = server.lose(1, "node down", 0.0)
    assert any(isinstance(a, Refuse) and a.worker == 1 and "node down" in a.reason for a in out)


def test_lose_is_replicated_in_order() -> None:
    primary, replica = pair(Consistency.BSP)
    [f0] = primary.push(0, 0, 0, ones(), 0.0)
    [f1] = primary.lose(1, "gone", 0.0)
    assert f1.entry.kind == LOSE
    assert f1.entry.index == 2
    for f in (f0, f1):
        replica.log(f.entry, 0.0)
    [ack] = primary.replicated_upto(2, 0.0)
    assert ack.version == 1
    assert replica.version == 1
    assert replica.coordinator.live == primary.coordinator.live == frozenset({0})


def test_lose_entry_leaves_a_later_push_in_waiting() -> None:
    """A lost worker's push taken after its LOSE entry, the LOSE confirmed first: the push
    sent again is still in waiting (no second entry for it), then dropped once."""
    primary, replica = pair(Consistency.BSP, workers=3)
    [lose] = primary.lose(2, "node down", 0.0)
    [push] = primary.push(2, 0, 0, ones(), 0.0)
    replica.log(lose.entry, 0.0)
    primary.replicated_upto(1, 0.0)
    assert primary.push(2, 0, 0, ones(), 1.0) == []  # a resend: not a new entry
    replica.log(push.entry, 1.0)
    [drop] = primary.replicated_upto(2, 1.0)
    assert isinstance(drop, Acked)
    assert drop.dropped is not None
    assert "lost" in drop.dropped
    assert primary.statistics().logged == replica.statistics().logged == 2


def test_a_second_snapshot_takes_back_nothing_the_replica_confirmed() -> None:
    """The replica's JOIN arrived twice: the second snapshot is as of an entry older than
    one it confirmed since, which the primary then processes and never sends again; the
    replica keeps its state, so the next entry follows on."""
    primary, replica = pair()
    [forward] = primary.push(0, 0, 0, ones(), 1.0)
    assert isinstance(forward, Forward)
    assert replica.log(forward.entry, 2.0) == [Logged(index=1)]
    snapshot, again = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert snapshot.index == 0
    assert again == forward
    primary.replicated_upto(1, 3.0)
    assert not replica.restore(snapshot.index, snapshot.data)
    assert replica.version == 1
    [forward] = primary.push(1, 0, 0, ones(), 4.0)
    assert isinstance(forward, Forward)
    assert replica.log(forward.entry, 5.0) == [Logged(index=2)]


def test_a_replica_confirms_an_entry_once_its_callback_stepped_it() -> None:
    """With the update callback, a replica confirms an entry only once its process stepped
    it: a process slow to run the callback holds the primary back instead of queueing an
    update per entry without bound.  Promoted with a step out, it acknowledges the push once
    stepped, and takes the worker's next push then."""

    def callback_shard(**kw: Any) -> ShardServer:
        return ShardServer(
            initial=np.zeros(SIZE), workers=range(2), consistency=Consistency.ASYNC, rule=None, **kw
        )

    primary, replica = callback_shard(replicated=True), callback_shard(replica=True)
    [snapshot] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert replica.restore(snapshot.index, snapshot.data)
    [forward] = primary.push(0, 0, 0, ones(), 1.0)
    assert isinstance(forward, Forward)
    [replica_step] = replica.log(forward.entry, 2.0)  # no confirmation while it steps
    assert isinstance(replica_step, Step)
    assert replica.stepped(1, replica_step.model + replica_step.update, 3.0) == [Logged(index=1)]
    [step] = primary.replicated_upto(1, 4.0)
    assert isinstance(step, Step)
    acked = Acked(worker=0, iteration=0, version=1, dropped=None)
    assert primary.stepped(1, step.model + step.update, 5.0) == [acked]
    # the next entry: the primary dies before the replica's process stepped it
    [forward] = primary.push(0, 1, 1, ones(2.0), 6.0)
    [replica_step] = replica.log(forward.entry, 7.0)
    assert replica.promote()
    assert replica.push(0, 1, 1, ones(2.0), 8.0) == []  # sent again: answered after the step
    out = replica.stepped(2, replica_step.model + replica_step.update, 9.0)
    assert out == [Acked(worker=0, iteration=1, version=2, dropped=None)]
    assert replica.push(0, 2, 2, ones(), 10.0)  # and the next one is taken
    np.testing.assert_array_equal(replica.store.model, np.full(SIZE, 3.0))


def test_an_entry_sent_again_while_the_replica_steps_it_is_confirmed_once_stepped() -> None:
    """The primary sends its unconfirmed entries again after a reset: a replica whose process
    had not stepped the entry yet used to confirm it at once, as if processed (the primary
    then went on, and a slow process queued an update per entry again)."""
    primary = ShardServer(
        initial=np.zeros(SIZE),
        workers=range(2),
        consistency=Consistency.ASYNC,
        rule=None,
        replicated=True,
    )
    replica = ShardServer(
        initial=np.zeros(SIZE),
        workers=range(2),
        consistency=Consistency.ASYNC,
        rule=None,
        replica=True,
    )
    [snapshot] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert replica.restore(snapshot.index, snapshot.data)
    [forward] = primary.push(0, 0, 0, ones(), 1.0)
    assert isinstance(forward, Forward)
    [replica_step] = replica.log(forward.entry, 2.0)
    assert isinstance(replica_step, Step)
    assert primary.unconfirmed() == [forward]
    assert replica.log(forward.entry, 3.0) == []  # its confirmation follows the step
    assert replica.stepped(1, replica_step.model + replica_step.update, 4.0) == [Logged(index=1)]
    assert replica.log(forward.entry, 5.0) == [Logged(index=1)]  # and is sent again now
