"""The parameter-server node engine (fabricd/engines/ps/node.py, routing.py) one input at a
time, on a fake clock and a rank table the test edits: where a worker's frames go, the frames
held for a rank or a model not open yet and their bounds and deadlines, failover and
promotion, what is sent again after a reset, and the epoch a late worker's daemon is told."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.engines.actions import SendFrame
from fabricd.engines.membership import RankEntry
from fabricd.engines.ps import routing
from fabricd.engines.ps.consistency import Sum
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.models import Action, CallDone, EpochMoved, Log, SendData
from fabricd.engines.ps.node import PSNode
from fabricd.engines.ps.routing import Early, EarlyFrames, HeldFrames
from fabricd.engines.ps.worker import shard_bounds
from fabricd.errors import ErrorCode
from fabricd.frames import ps as ps_frames
from fabricd.wire import Kind

if TYPE_CHECKING:
    import pytest

JOB, NAME, SIZE = "j", "m", 4
KEY = (JOB, NAME)
SERVER, REPLICA, WORKER = 0, 1, 2  #: each rank on the node of its number
MAX_PAYLOAD = 1 << 16


class Table:
    """The rank table and the links' state, as a test says."""

    def __init__(self) -> None:
        self.nodes = {SERVER: SERVER, REPLICA: REPLICA, WORKER: WORKER}
        self.down: set[int] = set()

    def lookup(self, job: str, rank: int, /) -> RankEntry | None:
        node = self.nodes.get(rank)
        return None if node is None else RankEntry(job=job, rank=rank, size=3, node=node)

    def reachable(self, node: int, /) -> bool:
        return node not in self.down


def spec(replicas: bool = True) -> dict[str, Any]:
    return {
        "n": 3,
        "size": SIZE,
        "dtype": "float64",
        "servers": [SERVER],
        "replicas": [REPLICA] if replicas else [],
        "consistency": "async",
        "staleness": 0,
        "delay_bound": None,
        "chunk": 1,
        "scheduling": "arrival",
        "aggregation": False,
        "replication": "chain",
        "divergence_bound": None,
        "distribution": "direct",
    }


def node(rank: int, table: Table) -> PSNode:
    return PSNode(node=rank, ranks=table, max_payload=MAX_PAYLOAD, route_timeout=5.0)


def worker(table: Table, *, replicas: bool = True, rank: int = WORKER) -> PSNode:
    """A worker's daemon with the model open."""
    daemon = node(rank, table)
    model = spec(replicas)
    daemon.open_worker(
        KEY, model, shard_bounds(SIZE, 1), rank=rank, settings=FilterSettings(), seed=0, now=0.0
    )
    return daemon


def shard(daemon: PSNode, rank: int, *, replicas: bool = True, now: float = 0.0) -> list[Action]:
    return daemon.open_shard(
        KEY,
        spec(replicas),
        shard_bounds(SIZE, 1),
        rank=rank,
        shard=0,
        initial=np.zeros(SIZE),
        rule=Sum(),
        settings=FilterSettings(),
        now=now,
    )


def sent(actions: list[Action]) -> list[tuple[int, Any]]:
    """(node, frame) of every frame the actions send."""
    return [(a.node, a.frame) for a in actions if isinstance(a, SendFrame | SendData)]


def wire(actions: list[Action]) -> list[tuple[int, Any, bytes]]:
    """(node, frame, payload) of every frame the actions send."""
    return [
        (a.node, a.frame, a.payload if isinstance(a, SendData) else b"")
        for a in actions
        if isinstance(a, SendFrame | SendData)
    ]


def push(daemon: PSNode, now: float = 0.0) -> list[Action]:
    return daemon.push(KEY, WORKER, np.ones(SIZE), now)


# -- routing -------------------------------------------------------------------------------
def test_a_push_goes_to_the_rank_serving_the_shard_on_the_data_link() -> None:
    [action] = push(worker(Table()))
    assert isinstance(action, SendData)
    assert action.node == SERVER
    assert isinstance(action.frame, ps_frames.Push)
    assert (action.frame.server, action.frame.epoch, action.frame.iteration) == (SERVER, 0, 0)


def test_a_frame_for_a_serving_rank_not_known_goes_to_its_known_partner() -> None:
    """The partner serves at a later epoch and says so, or follows and refuses."""
    table = Table()
    del table.nodes[SERVER]
    [(to, frame)] = sent(push(worker(table)))
    assert (to, frame.server) == (REPLICA, REPLICA)


# -- holds ---------------------------------------------------------------------------------
def test_a_frame_for_a_suspected_rank_is_held_until_it_is_back() -> None:
    table = Table()
    daemon = worker(table)
    del table.nodes[SERVER]
    daemon.rank_suspected(JOB, SERVER)
    assert sent(push(daemon)) == []  # held: the suspect may come back
    table.nodes[SERVER] = SERVER
    again = sent(daemon.rank_joined(JOB, SERVER, SERVER, 1.0))
    # the held push and the one in flight sent again: the server recognises the second
    assert [(to, f.KIND, f.iteration) for to, f in again] == [(SERVER, Kind.PUSH, 0)] * 2


def test_a_frame_for_a_node_whose_links_are_down_waits_for_them() -> None:
    table = Table()
    daemon = worker(table)
    table.down.add(SERVER)
    assert sent(push(daemon)) == []
    table.down.clear()
    pushes = [f for _, f in sent(daemon.peer_up(SERVER, 1.0)) if isinstance(f, ps_frames.Push)]
    # the held push and the one in flight sent again: the server recognises the second
    assert [f.iteration for f in pushes] == [0, 0]


def test_held_frames_are_bounded_in_number_and_bytes() -> None:
    held = HeldFrames(max_payload=10)
    frame = ps_frames.Replicated(job=JOB, name=NAME, shard=0, server=0, replica=1, index=1)
    assert held.hold((JOB, 0), frame, b"x" * 40)
    assert not held.hold((JOB, 0), frame, b"x")  # 4 x max_payload in all
    assert len(held) == 1
    assert [r for r, _, _ in held.take(lambda job, rank: rank == 0)] == [(JOB, 0)]
    assert len(held) == 0
    assert held.hold((JOB, 0), frame, b"x" * 40)


def test_a_pull_for_a_model_not_open_is_refused_at_its_deadline() -> None:
    table = Table()
    server = node(SERVER, table)
    pull = ps_frames.Pull(
        job=JOB,
        name=NAME,
        shard=0,
        server=SERVER,
        worker=WORKER,
        epoch=0,
        spec=spec(),
        clock=0,
        since=0,
    )
    assert server.on_frame(WORKER, pull, b"", 10.0) == []
    assert (server.early_frames, server.next_deadline()) == (1, 15.0)
    assert server.on_timer(14.9) == []
    [(to, refusal)] = sent(server.on_timer(15.0))
    assert to == WORKER
    assert isinstance(refusal, ps_frames.Pulled)
    assert refusal.error is not None
    assert "route_timeout" in refusal.error
    assert (server.early_frames, server.next_deadline()) == (0, None)
    assert server.counters["ps_early_expired"] == 1


def test_a_push_for_a_shard_not_open_waits_for_its_server_past_any_deadline() -> None:
    table = Table()
    [(_, frame, data)] = wire(push(worker(table, replicas=False)))
    server = node(SERVER, table)
    assert server.on_frame(WORKER, frame, data, 0.0) == []
    assert server.next_deadline() is None  # no deadline: it waits for the server
    assert server.on_timer(1e9) == []
    opened = shard(server, SERVER, replicas=False)
    acks = [f for _, f in sent(opened) if isinstance(f, ps_frames.Pushed)]
    assert [(a.worker, a.iteration, a.version, a.dropped) for a in acks] == [(WORKER, 0, 1, None)]
    assert server.early_frames == 0


def test_early_frames_past_the_bound_are_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push past the bound is not answered (answered as dropped it would count as
    processed); the engine says so in the log."""
    monkeypatch.setattr(routing, "MAX_HELD", 0)
    table = Table()
    [(_, frame)] = sent(push(worker(table)))
    server = node(SERVER, table)
    actions = server.on_frame(WORKER, frame, b"", 0.0)
    assert sent(actions) == []
    assert [a.topic for a in actions if isinstance(a, Log)] == ["early"]
    assert (server.early_frames, server.counters["ps_frames_dropped"]) == (0, 1)


def test_early_frames_keep_their_deadlines_in_order() -> None:
    early = EarlyFrames(max_payload=MAX_PAYLOAD)
    frames = []
    for at in (3.0, 1.0, 2.0):
        pull = ps_frames.Pull(
            job=JOB,
            name=NAME,
            shard=0,
            server=SERVER,
            worker=WORKER,
            epoch=0,
            spec=spec(),
            clock=int(at),
            since=0,
        )
        frames.append(pull)
        early.hold(Early(node=WORKER, frame=pull, payload=b"", deadline=at))
    assert early.next_deadline() == 1.0
    assert [e.frame.clock for e in early.expired(2.0)] == [1, 2]  # type: ignore[union-attr]
    assert early.holds(WORKER, frames[0])
    assert early.next_deadline() == 3.0


# -- failover and promotion ----------------------------------------------------------------
def test_the_serving_rank_gone_moves_the_workers_to_its_partner_one_epoch_later() -> None:
    table = Table()
    daemon = worker(table)
    push(daemon)
    del table.nodes[SERVER]
    actions = daemon.rank_gone(JOB, SERVER, "it left", 1.0)
    [moved] = [a for a in actions if isinstance(a, EpochMoved)]
    assert (moved.rank, moved.epoch, moved.server) == (WORKER, 1, REPLICA)
    [(to, frame)] = sent(actions)  # the push in flight, sent again to the partner
    assert (to, frame.server, frame.epoch) == (REPLICA, REPLICA, 1)
    assert daemon.counters["ps_failovers"] == 1


def synced(primary: PSNode, replica: PSNode) -> None:
    """Open the shard on both, and deliver the JOINs, the snapshot and the confirmations."""
    daemons = {SERVER: primary, REPLICA: replica}
    pending = [(SERVER, *f) for f in wire(shard(primary, SERVER))]
    pending += [(REPLICA, *f) for f in wire(shard(replica, REPLICA))]
    while pending:
        src, dst, frame, payload = pending.pop(0)
        if dst in daemons:  # (the worker's daemon is told the spec: not played here)
            pending += [(dst, *f) for f in wire(daemons[dst].on_frame(src, frame, payload, 0.0))]


def test_a_replica_with_the_state_is_promoted_when_its_primary_is_gone() -> None:
    table = Table()
    primary, replica = node(SERVER, table), node(REPLICA, table)
    synced(primary, replica)
    follower = replica.models[KEY].servers[0]
    assert follower.has_state
    assert not follower.primary
    del table.nodes[SERVER]
    actions = replica.rank_gone(JOB, SERVER, "it left", 1.0)
    assert (follower.primary, follower.epoch) == (True, 1)
    assert any(isinstance(a, Log) and "promoted" in a.message for a in actions)


def test_a_promoted_replica_loses_a_worker_its_daemon_heard_was_gone() -> None:
    """Even one that never pushed: the primary's LOSE entry died with it, and BSP would wait
    for the worker for ever."""
    table = Table()
    primary, replica = node(SERVER, table), node(REPLICA, table)
    synced(primary, replica)
    follower = replica.models[KEY].servers[0]
    del table.nodes[WORKER]
    replica.rank_gone(JOB, WORKER, "it left", 1.0)  # a follower loses nobody itself
    assert WORKER in follower.coordinator.live
    del table.nodes[SERVER]
    replica.rank_gone(JOB, SERVER, "it left", 2.0)
    assert follower.primary
    assert WORKER not in follower.coordinator.live


def test_a_tentative_primary_joins_its_partner_again_when_the_partner_is_back() -> None:
    """A rank back after a failover opens as a tentative primary and JOINs its partner; if
    the JOIN went with a reset, it asks again, rather than send its initial state."""
    table = Table()
    primary = node(SERVER, table)
    [(to, join)] = [(n, f) for n, f in sent(shard(primary, SERVER)) if f.KIND is Kind.JOIN]
    assert (to, join.KIND) == (REPLICA, Kind.JOIN)
    again = sent(primary.rank_joined(JOB, REPLICA, REPLICA, 1.0))
    assert [(to, f.KIND) for to, f in again] == [(REPLICA, Kind.JOIN)]


def test_a_shard_closed_while_tentative_leaves_no_mark_for_the_next_server() -> None:
    """A server rank that opened as a tentative primary (its partner known) and left before
    the partner answered, on a daemon whose local worker keeps the model, used to leave the
    shard marked tentative: the rank opening it again found its frames held as if it waited
    for that old answer (review finding)."""
    table = Table()
    table.nodes[3] = SERVER  # a worker on the server's node keeps the model open there
    daemon = node(SERVER, table)
    daemon.open_worker(
        KEY, spec(), shard_bounds(SIZE, 1), rank=3, settings=FilterSettings(), seed=0, now=0.0
    )
    shard(daemon, SERVER)
    model = daemon.models[KEY]
    assert 0 in model.tentative
    assert daemon.close_shard(KEY, 0) is not None
    assert KEY in daemon.models
    assert (model.tentative, model.answered) == (set(), set())


def test_a_shard_without_a_replica_fails_its_workers_calls_when_its_server_is_gone() -> None:
    table = Table()
    daemon = worker(table, replicas=False)
    push(daemon)
    del table.nodes[SERVER]
    [done] = [a for a in daemon.rank_gone(JOB, SERVER, "it left", 1.0) if isinstance(a, CallDone)]
    assert done.failure is not None
    assert done.failure.code == ErrorCode.PEER_FAILED
    assert daemon.failed(KEY) == (0, "rank 0 serving it left (it left)")


def test_a_failover_to_a_partner_that_is_gone_too_fails_the_shard() -> None:
    table = Table()
    daemon = worker(table)
    del table.nodes[REPLICA]
    del table.nodes[SERVER]
    daemon.rank_gone(JOB, SERVER, "it left", 1.0)
    failed = daemon.failed(KEY)
    assert failed is not None
    assert "partner rank 1 is gone too" in failed[1]
    assert daemon.counters["ps_failovers"] == 0


# -- resends and epochs --------------------------------------------------------------------
def test_a_rank_back_from_a_reset_is_sent_what_is_in_flight_to_it() -> None:
    table = Table()
    daemon = worker(table)
    push(daemon)
    daemon.pull(KEY, WORKER, np.zeros(SIZE), fresh=True, now=0.0)
    kinds = [f.KIND for _, f in sent(daemon.rank_joined(JOB, SERVER, SERVER, 1.0))]
    assert kinds == [Kind.PUSH, Kind.PULL]
    assert sent(daemon.rank_joined(JOB, REPLICA, REPLICA, 1.0)) == []  # nothing in flight to it


def test_a_late_workers_daemon_is_told_the_shards_epoch_and_moves_there() -> None:
    """A daemon that opened the model after a failover it never heard of sends to the
    server; the promoted replica refuses with its epoch, and the worker moves there."""
    table = Table()
    daemon = worker(table)
    [(_, frame)] = sent(push(daemon))
    refusal = ps_frames.Pushed(
        job=JOB,
        name=NAME,
        shard=0,
        server=REPLICA,
        worker=WORKER,
        epoch=1,
        iteration=0,
        version=0,
        dropped="this rank serves the shard at epoch 1",
    )
    actions = daemon.on_frame(REPLICA, refusal, b"", 1.0)
    [moved] = [a for a in actions if isinstance(a, EpochMoved)]
    assert (moved.epoch, moved.server) == (1, REPLICA)
    [(to, again)] = sent(actions)
    assert (to, again.epoch, again.iteration) == (REPLICA, 1, frame.iteration)
    assert not [a for a in actions if isinstance(a, CallDone)]  # the push is still open


def test_a_frame_from_a_node_its_rank_is_not_on_is_dropped_and_counted() -> None:
    table = Table()
    daemon = worker(table)
    forged = ps_frames.Pushed(
        job=JOB,
        name=NAME,
        shard=0,
        server=SERVER,
        worker=WORKER,
        epoch=0,
        iteration=0,
        version=1,
        dropped=None,
    )
    actions = daemon.on_frame(REPLICA, forged, b"", 0.0)
    assert [a.topic for a in actions if isinstance(a, Log)] == ["stray"]
    assert daemon.counters["ps_frames_dropped"] == 1
