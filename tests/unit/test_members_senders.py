"""Frames judged by their sender rank (issue 28, item 2): the kit that holds a frame whose rank
is not announced yet, and what the stochastic and parameter-server services do with a
non-member's frames -- refused and counted before anything is built, allocated or held, while
a member's frame that overtook its rank's announcement is taken once the announcement comes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fabricd.daemon.services.senders import Sender, Unannounced, sender
from fabricd.engines.actions import Failure
from fabricd.engines.membership import RankEntry, RankJoined
from fabricd.engines.stochastic.notify_ack import VERSION
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.frames import ps as ps_frames
from fabricd.frames import registry
from fabricd.frames import stochastic as stochastic_frames
from fabricd.wire import Kind
from tests.unit.test_collective_service_review import Table
from tests.unit.test_ps_service_review import JOB as PS_JOB
from tests.unit.test_ps_service_review import NAME as PS_NAME
from tests.unit.test_ps_service_review import Fabric as PSFabric
from tests.unit.test_stochastic_service_review import JOB, NAME, call, client, join, service, spec

FRAME = stochastic_frames.Ack(job=JOB, name=NAME, src=1, dst=0, round=0)


class Suspects(Table):
    """A rank table with a rank lost with its node's links."""

    def __init__(self, suspects: dict[tuple[str, int], int]) -> None:
        super().__init__()
        self.suspects = suspects

    def suspected_on(self, job: str, rank: int) -> int | None:
        return self.suspects.get((job, rank))


# -- the verdict and the hold -------------------------------------------------------------
def test_the_verdict_on_a_sender() -> None:
    table = Suspects({(JOB, 2): 5})
    table.join(JOB, 4, (0, 1), owner=1000)  # ranks 0 and 1 known, 2 and 3 not
    assert sender(table, 1, JOB, 1) is Sender.MEMBER
    assert sender(table, 3, JOB, 1) is Sender.STRANGER  # rank 1 lives on node 1
    assert sender(table, 1, JOB, 4) is Sender.STRANGER  # no rank 4 in a job of 4
    assert sender(table, 5, JOB, 2) is Sender.MEMBER  # lost with node 5's links
    assert sender(table, 6, JOB, 2) is Sender.NOT_YET  # (it may have moved)
    assert sender(table, 1, JOB, 3) is Sender.NOT_YET
    assert sender(table, 1, "other", 0) is Sender.NO_JOB


def test_held_frames_are_bounded_per_node_and_in_all() -> None:
    held = Unannounced(max_payload=100, max_frames=8)  # 200 B, 8 frames; 100 B, 4 a node
    assert held.hold(1, (JOB, 2), FRAME, 100, 1.0) is not None
    with pytest.raises(RemoteProtocolError, match="node 1 sent more frames"):
        held.hold(1, (JOB, 2), FRAME, 1, 1.0)  # node 1's half of the bytes is full
    for _ in range(4):
        held.hold(2, (JOB, 3), FRAME, 0, 1.0)
    with pytest.raises(RemoteProtocolError, match="node 2"):
        held.hold(2, (JOB, 3), FRAME, 0, 1.0)  # node 2's half of the frames
    held.hold(3, (JOB, 3), FRAME, 99, 1.0)
    with pytest.raises(RemoteProtocolError, match="node 4"):
        held.hold(4, (JOB, 3), FRAME, 2, 1.0)  # all of them
    assert (held.count, held.bytes) == (6, 199)
    held.drop_node(2)
    assert (held.count, held.bytes) == (2, 199)


def test_held_frames_go_in_order_and_expire_once_whole() -> None:
    held = Unannounced(max_payload=1000)
    update = stochastic_frames.Update(job=JOB, name=NAME, src=1, dst=0, round=0, spec=spec())
    view = held.hold(1, (JOB, 1), update, 8, 5.0)  # still landing
    assert view is not None
    held.hold(1, (JOB, 1), FRAME, 0, 6.0)
    assert held.take((JOB, 1)) == []  # the ACK waits behind the UPDATE still landing
    assert held.next_deadline() == 6.0  # (a frame still landing has none yet)
    assert [w.frame for w in held.expire(10.0)] == [FRAME]  # the landing one stays
    assert held.next_deadline() is None
    view[:] = b"12345678"
    assert held.landed(update) is not None
    assert held.next_deadline() == 5.0
    (taken,) = held.take((JOB, 1))
    assert (taken.frame, taken.payload) == (update, bytearray(b"12345678"))
    held.hold(1, (JOB, 1), FRAME, 0, 5.0)
    held.hold(1, (JOB, 2), FRAME, 0, 7.0)
    assert [w.rank for w in held.expire(6.0)] == [(JOB, 1)]
    assert held.next_deadline() == 7.0
    assert [w.rank for w in held.take((JOB, 2))] == [(JOB, 2)]
    assert (held.count, held.bytes, held.next_deadline()) == (0, 0, None)


# -- stochastic reduce --------------------------------------------------------------------
def update(src: int, count: int = 4, dst: int = 0) -> stochastic_frames.Update:
    return stochastic_frames.Update(
        job=JOB, name=NAME, src=src, dst=dst, round=0, spec=spec(nbytes=8 * count)
    )


@pytest.mark.parametrize("src", [1, 7])
@pytest.mark.parametrize("count", [4, 9])
def test_a_non_members_reduce_frames_are_refused_before_anything_is_built(
    src: int, count: int
) -> None:
    """Node 1 hosts no rank of the job (ranks 0 and 1 live on node 0): its UPDATE and NOTIFY
    as rank 1 (of node 0) or 7 (of none), with the reduce's spec or another, get no buffer,
    build no reducer, break nothing, and are counted."""
    table = Table()
    svc, host = service(table)
    join(svc, table, (0, 0))
    frame = update(src, count)
    assert svc.payload_buffer(1, frame, 8 * count + 16) is None
    svc.on_data(1, frame, 8 * count + 16, 0.0)
    notify = stochastic_frames.Notify(
        job=JOB, name=NAME, src=src, dst=0, round=0, tag=0, spec=spec(nbytes=8 * count)
    )
    svc.on_frame(1, notify, 0.0)
    assert not svc.reducers
    assert not svc._broken
    assert svc._gate.held.count == 0
    counters = svc.statistics()["counters"]
    assert counters["frames_refused_not_member"] == 2
    call(svc, client(0, 2), 1)  # the job's own ranks are untouched
    call(svc, client(1, 2), 2)
    assert host.answered[1]["inputs"] == host.answered[2]["inputs"] == 1


def test_a_frame_before_its_ranks_announcement_waits_for_it() -> None:
    """Rank 1's UPDATE and NOTIFY reach node 0 before rank 1's ANNOUNCE: they wait, and are
    taken (in order) when it comes; rank 0's call completes with rank 1's update."""
    table = Table()
    svc, host = service(table)
    rank0, rank1 = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 1]  # node 0 has not heard of rank 1 yet
    svc.on_rank_event(RankJoined(entry=rank0), 0.0)
    frame = update(1)
    view = svc.payload_buffer(1, frame, 48)
    assert view is not None
    assert svc._gate.held.count == 1
    assert not svc.reducers
    view[:] = VERSION.pack(1) + np.full(4, 2.0).tobytes() + VERSION.pack(1)  # round 0's
    svc.on_data(1, frame, 48, 0.0)
    notify = stochastic_frames.Notify(job=JOB, name=NAME, src=1, dst=0, round=0, tag=0, spec=spec())
    svc.on_frame(1, notify, 0.0)
    table.entries[JOB, 1] = rank1
    svc.on_rank_event(RankJoined(entry=rank1), 0.0)
    assert svc._gate.held.count == 0
    session = client(0, 2)
    call(svc, session, 1)
    assert host.answered[1]["inputs"] == 1
    assert list(session.segments[1].array) == [1.0] * 4  # type: ignore[attr-defined]
    assert svc.statistics()["counters"]["frames_refused_not_member"] == 0


def test_a_frame_as_a_rank_announced_later_on_another_node_is_refused_then() -> None:
    table = Table()
    svc, _ = service(table)
    rank0, rank1 = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 1]
    svc.on_rank_event(RankJoined(entry=rank0), 0.0)
    frame = update(1, count=9)
    view = svc.payload_buffer(2, frame, 88)  # node 2 sends as rank 1, not announced yet
    assert view is not None
    svc.on_data(2, frame, 88, 0.0)
    table.entries[JOB, 1] = rank1  # rank 1 lives on node 1
    svc.on_rank_event(RankJoined(entry=rank1), 0.0)
    assert not svc.reducers
    assert not svc._broken
    assert svc._gate.held.count == 0
    assert svc.statistics()["counters"]["frames_refused_not_member"] == 1


def test_a_frame_whose_rank_is_never_announced_is_refused_at_route_timeout() -> None:
    table = Table()
    svc, _ = service(table, route_timeout=5.0)
    rank0, _ = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 1]
    svc.on_rank_event(RankJoined(entry=rank0), 0.0)
    svc.on_frame(2, stochastic_frames.Ack(job=JOB, name=NAME, src=1, dst=0, round=0), 0.0)
    assert svc.next_deadline() == 5.0
    svc.on_timer(5.0)
    assert svc._gate.held.count == 0
    assert svc.next_deadline() is None
    assert svc.statistics()["counters"]["frames_refused_not_member"] == 1


def test_a_broken_notify_carries_both_specs_and_only_it_does() -> None:
    fields = {"job": JOB, "name": NAME, "src": 1, "dst": 0, "round": 0}
    broken = stochastic_frames.Notify(
        **fields, tag=stochastic_frames.BROKEN, spec=spec(), other=spec(nbytes=8)
    )
    assert registry.parse(Kind.NOTIFY, broken.to_meta()) == broken
    meta = broken.to_meta()
    del meta["o"]
    with pytest.raises(RemoteProtocolError, match="BROKEN"):
        registry.parse(Kind.NOTIFY, meta)
    meta = {**stochastic_frames.Notify(**fields, tag=0, spec=spec()).to_meta(), "o": spec()}
    with pytest.raises(RemoteProtocolError, match="BROKEN"):
        registry.parse(Kind.NOTIFY, meta)


def test_a_local_disagreement_reaches_every_member_node() -> None:
    """Rank 1 (node 0) calls with another size than rank 0 (node 0): both fail with usage,
    and nodes 1 and 2 (ranks 2 and 3) each get a BROKEN NOTIFY naming both specs."""
    table = Table()
    svc, host = service(table)
    join(svc, table, (0, 0, 1, 2))
    call(svc, client(0, 4), 1)
    with pytest.raises(UsageError, match="40 B of float64"):
        call(svc, client(1, 4, count=5), 2)
    assert isinstance(host.answered[1], Failure)
    assert "32 B" in host.answered[1].message
    notices = [
        (node, f)
        for node, f in host.control
        if isinstance(f, stochastic_frames.Notify) and f.tag == stochastic_frames.BROKEN
    ]
    assert sorted(node for node, _ in notices) == [1, 2]
    for node, notice in notices:
        assert {notice.spec["nbytes"], notice.other["nbytes"]} == {32, 40}  # type: ignore[index]
        assert table.lookup(JOB, notice.dst).node == node  # type: ignore[union-attr]
        assert table.lookup(JOB, notice.src).node == 0  # type: ignore[union-attr]


# -- parameter server -----------------------------------------------------------------------
def ps_push(worker: int, job: str, spec: dict[str, Any]) -> ps_frames.Push:
    return ps_frames.Push(
        job=job,
        name=PS_NAME,
        shard=0,
        server=0,
        worker=worker,
        iteration=0,
        base=0,
        epoch=0,
        spec=spec,
    )


def ps_pull(worker: int, job: str, spec: dict[str, Any]) -> ps_frames.Pull:
    return ps_frames.Pull(
        job=job,
        name=PS_NAME,
        shard=0,
        server=0,
        worker=worker,
        clock=0,
        since=0,
        epoch=0,
        spec=spec,
    )


@pytest.mark.parametrize(
    ("worker", "job", "refused"),
    [(2, PS_JOB, 1), (9, PS_JOB, 1), (3, "no-such-job", 0)],
    ids=["as-a-rank-of-another-node", "as-a-rank-outside-the-job", "of-a-job-not-here"],
)
def test_a_non_members_pushes_and_pulls_get_nothing(worker: int, job: str, refused: int) -> None:
    """Node 1 pushes and pulls as worker 2 (which lives on node 0), as rank 9 of a job of 4,
    or for a job with no rank here: no buffer, nothing held (early or otherwise), nothing
    applied, counted; a job with no rank here is no member's refusal, only a drop."""
    fabric = PSFabric()
    fabric.start()  # ranks 0 and 2 on node 0, 1 and 3 on node 1
    svc = fabric.services[0]
    counters = dict(svc.statistics()["counters"])
    model_spec = svc.engine.models[PS_JOB, PS_NAME].spec  # the model's own: well-formed
    push = ps_push(worker, job, model_spec)
    assert svc.payload_buffer(1, push, 64) is None
    svc.on_data(1, push, 64, 0.0)
    svc.on_frame(1, ps_pull(worker, job, model_spec), 0.0)
    after = svc.statistics()["counters"]
    assert after["frames_refused_not_member"] == counters["frames_refused_not_member"] + 2 * refused
    assert after["ps_frames_dropped"] == counters["ps_frames_dropped"] + 2
    assert after["ps_early_frames"] == 0
    assert svc._gate.held.count == 0
    assert not fabric.wire.frames  # not answered either: nothing was taken


def test_a_push_before_its_workers_announcement_waits_and_is_applied() -> None:
    """Worker 3 (node 1) pushes; node 0, which serves the shard, has not heard of rank 3
    yet: the push waits for the announcement, then is applied and acknowledged."""
    fabric = PSFabric()
    fabric.start(consistency="async")  # (a push is answered once its server applied it)
    fabric.array(3)[:] = 1.0
    fabric.call(3, 10, "ps_push")
    src, dst, frame, payload = fabric.wire.frames.popleft()
    assert (src, dst, frame.KIND) == (1, 0, Kind.PUSH)
    entry = fabric.table.entries.pop((PS_JOB, 3))  # node 0 has not heard of rank 3
    svc = fabric.services[0]
    view = svc.payload_buffer(src, frame, len(payload))  # type: ignore[arg-type]
    assert view is not None
    assert svc._gate.held.count == 1
    view[:] = payload
    svc.on_data(src, frame, len(payload), 0.0)  # type: ignore[arg-type]
    assert not fabric.wire.frames  # waits: not applied, not answered
    fabric.table.entries[PS_JOB, 3] = entry
    svc.on_rank_event(RankJoined(entry=RankEntry(job=PS_JOB, rank=3, size=4, node=1)), 0.0)
    assert svc._gate.held.count == 0
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered[10]["versions"] == [1]  # applied
    assert svc.statistics()["counters"]["frames_refused_not_member"] == 0


def test_a_member_known_only_after_the_break_hears_of_it() -> None:
    """Node 0 breaks the reduce (node 1 sent two specs as rank 1) while rank 2's node is not
    known to it: node 1 is told at once, node 2 when rank 2 is announced, and a rank that only
    ACKs is answered with the news too."""
    table = Table()
    svc, host = service(table)
    rank0, rank1, rank2 = table.join(JOB, 3, (0, 1, 2), owner=1000)
    del table.entries[JOB, 2]
    for entry in (rank0, rank1):
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    fields = {"job": JOB, "name": NAME, "src": 1, "dst": 0, "round": 0}
    svc.on_frame(
        1, stochastic_frames.Notify(**fields, tag=0, spec=spec(n=3, graph="all-to-all")), 0.0
    )
    svc.on_frame(
        1,
        stochastic_frames.Notify(**fields, tag=0, spec=spec(n=3, graph="all-to-all", nbytes=8)),
        0.0,
    )

    def told() -> list[tuple[int, int]]:
        return [
            (node, f.dst)
            for node, f in host.control
            if isinstance(f, stochastic_frames.Notify) and f.tag == stochastic_frames.BROKEN
        ]

    assert told() == [(1, 1)]
    table.entries[JOB, 2] = rank2
    svc.on_rank_event(RankJoined(entry=rank2), 0.0)
    assert (2, 2) in told()
    host.control.clear()
    svc.on_frame(1, stochastic_frames.Ack(job=JOB, name=NAME, src=1, dst=0, round=0), 0.0)
    assert told() == [(1, 1)]
