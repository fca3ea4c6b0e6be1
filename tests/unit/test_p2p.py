"""Point-to-point messaging across a fake network of real engines (see fakenet.py).

The standard layout: job ``"job"`` of size 4 with ranks 0 and 1 on node 0, rank 2 on node 1 and
rank 3 on node 2.  Time stands still unless a test moves it.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections import defaultdict
from random import Random
from typing import TYPE_CHECKING

import pytest
from fakenet import JOB, USER, FakeNet, Posted
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fabricd.engines.actions import Broadcast, Complete, Failure, SendFrame
from fabricd.engines.membership import Membership, RankJoined, RankLeft
from fabricd.engines.p2p.messages import (
    MESSAGES_KEPT,
    CopyLocal,
    Message,
    Messages,
    MessagingStatistics,
    StreamData,
)
from fabricd.engines.p2p.operations import (
    RECV_TRANSITIONS,
    SEND_TRANSITIONS,
    RecvInput,
    RecvState,
    SendInput,
    SendState,
)
from fabricd.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, UsageError
from fabricd.frames.membership import Announce
from fabricd.frames.p2p import Cancel, Cts, Data, Done, Rts
from fabricd.wire import Kind

if TYPE_CHECKING:
    import random

    from fabricd.engines.p2p.matching import Messaging

#: rank -> node of the standard layout
HOME = {0: 0, 1: 0, 2: 1, 3: 2}
DATA = b"the quick brown fox"


def layout(**options: object) -> FakeNet:
    net = FakeNet(3, **options)  # type: ignore[arg-type]
    for rank, node in HOME.items():
        net.attach(node, rank)
    net.run()
    return net


@pytest.fixture
def net() -> FakeNet:
    return layout()


def failed(net: FakeNet, node: int, op: int) -> Failure:
    failure = net.outcome(node, op)
    assert failure is not None, f"op {op} on node {node} succeeded"
    return failure


# -- delivery ---------------------------------------------------------------------------------
@pytest.mark.parametrize("send_first", [True, False])
def test_remote_message_lands_in_the_receive(net: FakeNet, send_first: bool) -> None:
    if send_first:
        send = net.send(0, src=0, dst=2, data=DATA)
        net.run()
        recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    else:
        recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
        net.run()
        send = net.send(0, src=0, dst=2, data=DATA)
    assert net.completed == {}
    net.run()
    assert net.ok(0, send)
    assert net.ok(1, recv)
    assert net.region(1, recv) == DATA
    kinds = [kind for kind in net.kinds() if kind is not Kind.ANNOUNCE]
    if send_first:  # a rendezvous: no payload before CTS
        assert kinds == [Kind.RTS, Kind.CTS, Kind.DONE]
    else:  # the receive was first: its RTR lets the send stream with its RTS, no CTS
        assert kinds == [Kind.RTR, Kind.RTS, Kind.DONE]
    assert net.pending() == [0, 0, 0]


def test_an_early_message_waits_without_moving_bytes(net: FakeNet) -> None:
    net.send(0, src=0, dst=2, data=DATA)
    net.run()
    assert net.engines[1].transfers() == 0  # nothing expected: no byte may come yet
    assert net.engines[1].statistics().unexpected == 1
    assert net.streams == []
    assert net.engines[1].pending() == 0  # the RTS is not an operation of the receiver
    assert net.engines[0].pending() == 1
    assert net.engines[0].transfers() == 0


@pytest.mark.parametrize("send_first", [True, False])
def test_local_message_is_copied_inside_the_daemon(net: FakeNet, send_first: bool) -> None:
    frames = net.in_flight() + len(net.frames)
    if send_first:
        send = net.send(0, src=0, dst=1, data=DATA)
        recv = net.recv(0, src=0, dst=1, nbytes=len(DATA))
    else:
        recv = net.recv(0, src=0, dst=1, nbytes=len(DATA))
        send = net.send(0, src=0, dst=1, data=DATA)
    assert net.ok(0, send)
    assert net.ok(0, recv)
    assert net.region(0, recv) == DATA
    assert net.of(0, CopyLocal) == [CopyLocal(src_op=send, dst_op=recv)]
    assert net.in_flight() + len(net.frames) == frames  # nothing went on the wire


def test_local_copy_under_way_is_a_transfer() -> None:
    net = layout(auto_copy=False)
    send = net.send(0, src=1, dst=0, data=DATA)
    recv = net.recv(0, src=1, dst=0, nbytes=len(DATA))
    assert net.engines[0].transfers() == 1
    net.abandon(0, [send, recv])  # the clients left, but the daemon still maps the segments
    assert net.engines[0].holds(send)
    assert net.engines[0].holds(recv)
    net.finish_copy()
    assert net.ok(0, send)
    assert net.ok(0, recv)
    assert net.engines[0].pending() == 0


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_copy_that_could_not_run_fails_both_operations(abandoned: bool) -> None:
    net = layout(auto_copy=False)
    send = net.send(0, src=1, dst=0, data=DATA)
    recv = net.recv(0, src=1, dst=0, nbytes=len(DATA))
    (_, copy), *_ = net.copies
    if abandoned:  # the clients left while the copy was under way: it must still end
        net.abandon(0, [send, recv])
    reason = "the daemon could not start a thread for the copy"
    net.perform(
        0, net.engines[0].copy_failed(copy.src_op, copy.dst_op, ErrorCode.RESOURCES, reason)
    )
    for op in (send, recv):
        failure = failed(net, 0, op)
        assert (failure.code, failure.message) == ("resources", reason)
        assert len(net.completed[0, op]) == 1
    assert net.region(0, recv) != DATA  # nothing was copied
    assert net.engines[0].transfers() == 0
    assert net.engines[0].pending() == 0
    with pytest.raises(LocalProtocolError):  # a second report of the same copy is a bug
        net.engines[0].copy_failed(copy.src_op, copy.dst_op, ErrorCode.RESOURCES, reason)


def test_a_copy_failure_is_no_input_for_an_operation_that_is_not_copying(net: FakeNet) -> None:
    send = net.send(0, src=0, dst=2, data=DATA)  # remote: RTS, never a copy
    recv = net.recv(0, src=2, dst=0, nbytes=len(DATA))
    with pytest.raises(LocalProtocolError):
        net.engines[0].copy_failed(send, recv, ErrorCode.RESOURCES, "no thread")
    assert (0, send) not in net.completed


@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize("send_first", [True, False])
def test_zero_byte_messages_complete_without_data(
    net: FakeNet, remote: bool, send_first: bool
) -> None:
    node, dst = (1, 2) if remote else (0, 1)
    if send_first:
        send = net.send(0, src=0, dst=dst, data=b"")
        net.run()
        recv = net.recv(node, src=0, dst=dst, nbytes=0)
    else:
        recv = net.recv(node, src=0, dst=dst, nbytes=0)
        net.run()
        send = net.send(0, src=0, dst=dst, data=b"")
    net.run()
    assert net.ok(0, send)
    assert net.ok(node, recv)
    if remote:
        assert net.of(0, StreamData) == []
        assert Kind.CTS not in net.kinds()
    assert [engine.transfers() for engine in net.engines] == [0, 0, 0]


@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize(
    ("sent", "posted", "words"),
    [
        ((8, "uint8"), (16, "uint8"), ("8 B of uint8", "16 B of uint8")),
        ((8, "uint8"), (8, "float32"), ("8 B of uint8", "8 B of float32")),
    ],
)
def test_a_message_that_does_not_fit_fails_both_sides(
    net: FakeNet,
    remote: bool,
    sent: tuple[int, str],
    posted: tuple[int, str],
    words: tuple[str, str],
) -> None:
    node, dst = (1, 2) if remote else (0, 1)
    send = net.send(0, src=0, dst=dst, data=bytes(sent[0]), dtype=sent[1])
    recv = net.recv(node, src=0, dst=dst, nbytes=posted[0], dtype=posted[1])
    net.run()
    for side, op in ((0, send), (node, recv)):
        failure = failed(net, side, op)
        assert failure.code == "mismatch"
        assert all(word in failure.message for word in words)
        assert "same shape and dtype" in failure.message
    assert failed(net, 0, send).message == failed(net, node, recv).message
    assert net.region(node, recv) == b"\xee" * posted[0]  # not a byte was written
    assert net.pending() == [0, 0, 0]


# -- matching ---------------------------------------------------------------------------------
@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize("recvs_first", [True, False])
def test_messages_do_not_overtake_each_other(net: FakeNet, remote: bool, recvs_first: bool) -> None:
    node, dst = (1, 2) if remote else (0, 1)
    payloads = [b"first", b"secnd", b"third"]

    def sends() -> list[int]:
        return [net.send(0, src=0, dst=dst, data=p) for p in payloads]

    def recvs() -> list[int]:
        return [net.recv(node, src=0, dst=dst, nbytes=5) for _ in payloads]

    if recvs_first:
        r, _ = recvs(), net.run()
        s = sends()
    else:
        s, _ = sends(), net.run()
        r = recvs()
    net.run()
    assert [net.region(node, op) for op in r] == payloads
    assert all(net.ok(0, op) for op in s)


def test_tags_keep_messages_apart(net: FakeNet) -> None:
    a = net.send(0, src=0, dst=2, data=b"tag-1", tag=1)
    b = net.send(0, src=0, dst=2, data=b"tag-2", tag=2)
    net.run()
    second = net.recv(1, src=0, dst=2, nbytes=5, tag=2)
    net.run()
    assert net.region(1, second) == b"tag-2"
    assert net.ok(0, b)
    assert (0, a) not in net.completed
    first = net.recv(1, src=0, dst=2, nbytes=5, tag=1)
    net.run()
    assert net.region(1, first) == b"tag-1"


def test_sources_and_jobs_keep_messages_apart() -> None:
    net = layout()
    net.attach(0, 0, size=2, job="other")
    net.run()
    mine = net.send(0, src=1, dst=2, data=b"rank1")
    other = net.send(0, src=0, dst=2, data=b"rank0")
    net.run()
    got = net.recv(1, src=0, dst=2, nbytes=5)
    net.run()
    assert net.region(1, got) == b"rank0"
    assert net.ok(0, other)
    assert (0, mine) not in net.completed
    wrong_job = net.recv(1, src=1, dst=2, nbytes=5, job="other")
    net.run()
    assert (1, wrong_job) not in net.completed


# -- routes -----------------------------------------------------------------------------------
def test_a_send_waits_for_its_rank_to_join() -> None:
    net = FakeNet(2)
    net.attach(0, 0)
    net.run()
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    assert net.kinds()[-1] is Kind.ANNOUNCE  # no RTS: nowhere to send it
    assert net.engines[0].next_deadline() == net.route_timeout
    net.attach(1, 2)
    net.run()  # the ANNOUNCE reaches node 0, which sends the RTS
    assert net.engines[0].next_deadline() is None
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    assert net.ok(0, send)
    assert net.region(1, recv) == DATA


def test_a_local_send_waits_for_its_local_rank() -> None:
    net = FakeNet(1)
    net.attach(0, 0)
    send = net.send(0, src=0, dst=1, data=DATA)
    net.attach(0, 1)
    recv = net.recv(0, src=0, dst=1, nbytes=len(DATA))
    assert net.ok(0, send)
    assert net.region(0, recv) == DATA


def test_a_send_to_a_rank_that_never_joins_fails_after_route_timeout() -> None:
    net = FakeNet(2, route_timeout=2.5, now=100.0)
    net.attach(0, 0)
    send = net.send(0, src=0, dst=3, data=DATA)
    assert net.engines[0].next_deadline() == 102.5
    net.advance(102.4)
    assert net.completed == {}
    net.run_timers()
    failure = failed(net, 0, send)
    assert failure.code == "no_such_rank"
    assert failure.rank == 3
    assert "rank 3 of job 'job' did not join within 2.5s (route_timeout)" in failure.message
    assert net.now == 102.5
    assert net.engines[0].pending() == 0
    assert net.engines[0].next_deadline() is None


def test_a_recv_from_a_rank_that_never_joins_fails_after_route_timeout() -> None:
    net = FakeNet(2, route_timeout=2.5)
    net.attach(1, 2)
    recv = net.recv(1, src=0, dst=2, nbytes=4)
    net.run_timers()
    failure = failed(net, 1, recv)
    assert (failure.code, failure.rank) == ("no_such_rank", 0)
    assert "rank 0 of job 'job' did not join" in failure.message


def test_a_recv_whose_source_joins_in_time_does_not_time_out() -> None:
    net = FakeNet(2, route_timeout=2.5)
    net.attach(1, 2)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.advance(1.0)
    net.attach(0, 0)
    net.run()
    assert net.engines[1].next_deadline() is None
    net.advance(10.0)
    assert net.completed == {}
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    assert net.ok(0, send)
    assert net.region(1, recv) == DATA


def test_an_rts_for_a_rank_that_is_not_here_is_answered_no_such_rank(net: FakeNet) -> None:
    # node 0 believes rank 2 lives on node 2 (a stale announcement): node 2 says no
    members = net.members[0]
    net.perform(
        0, members.on_announce(1, Announce(job=JOB, rank=2, size=4, present=False, owner=USER.uid))
    )
    net.perform(
        0, members.on_announce(2, Announce(job=JOB, rank=2, size=4, present=True, owner=USER.uid))
    )
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    failure = failed(net, 0, send)
    assert (failure.code, failure.node) == ("no_such_rank", 2)
    assert "is not connected to node 2" in failure.message


def test_attach_refuses_a_rank_that_runs_elsewhere(net: FakeNet) -> None:
    with pytest.raises(UsageError, match="already running on node 1"):
        net.attach(0, 2)


def test_a_conflicting_announcement_is_ignored_with_a_notice(net: FakeNet) -> None:
    # node 2 announces rank 2, which node 1 hosts: every daemon keeps the first claim
    net.perform(
        2, [Broadcast(frame=Announce(job=JOB, rank=2, size=4, present=True, owner=USER.uid))]
    )
    net.run()
    assert [n for n, _ in net.notices] == [0, 1]
    assert all("already running on node 1" in text for _, text in net.notices)
    assert net.members[0].lookup(JOB, 2).node == 1  # type: ignore[union-attr]


def test_a_rank_that_restarts_on_another_node_is_reached_though_its_news_cross() -> None:
    """Its departure (from node 1) and its arrival (from node 2) travel on different links:
    node 0 hears the arrival first, and must still route to it once the departure comes."""
    net = layout()
    net.hold(1, 0)
    net.detach(1, 2)
    net.run()
    net.attach(2, 2)  # rank 2 starts again, on node 2
    net.run()
    net.release(1, 0)
    net.run()
    assert net.members[0].lookup(JOB, 2).node == 2  # type: ignore[union-attr]
    send = net.send(0, src=0, dst=2, data=DATA)
    recv = net.recv(2, src=0, dst=2, nbytes=len(DATA))
    net.run_timers()
    assert net.ok(0, send)
    assert net.region(2, recv) == DATA


def test_a_peer_that_comes_up_learns_every_local_rank(net: FakeNet) -> None:
    sends = net.members[0].peer_up(3)
    assert all(isinstance(a, SendFrame) and a.node == 3 for a in sends)
    frames = [a.frame for a in sends if isinstance(a, SendFrame)]
    assert frames == [
        Announce(job=JOB, rank=r, size=4, present=True, owner=USER.uid) for r in (0, 1)
    ]
    fresh = Membership(3)
    for frame in frames:
        assert isinstance(frame, Announce)
        [joined] = fresh.on_announce(0, frame)
        assert isinstance(joined, RankJoined)
    assert [(e.rank, e.node) for e in fresh.entries()] == [(0, 0), (1, 0)]


# -- failures ---------------------------------------------------------------------------------
def test_peer_down_fails_every_operation_that_involves_the_node() -> None:
    net = layout(auto_stream=False)
    announced = net.send(0, src=0, dst=2, data=b"announced")  # RTS, no receive yet
    streaming = net.send(0, src=1, dst=2, data=b"streaming")
    net.recv(1, src=1, dst=2, nbytes=9)
    waiting = net.recv(0, src=2, dst=0, nbytes=4)  # rank 2 has not sent
    matched = net.recv(0, src=2, dst=1, nbytes=6)
    early = net.recv(0, src=3, dst=1, nbytes=3)  # rank 3 is on node 2, which stays up
    local = net.send(0, src=0, dst=1, data=b"local")
    net.send(1, src=2, dst=1, data=b"bytes!")
    net.send(1, src=2, dst=0, data=b"unsent", tag=5)  # node 1's RTS reaches node 0 unmatched …
    net.run()
    assert len(net.streams) == 2  # node 0 -> 1 and node 1 -> 0 are both streaming
    assert net.engines[0].transfers() == 2

    net.crash(1)
    net.detect(0, 1, reason="down")
    for op, rank in ((announced, 2), (streaming, 2), (waiting, 2), (matched, 2)):
        failure = failed(net, 0, op)
        assert failure.code == "peer_failed", op
        assert (failure.rank, failure.node) == (rank, 1)
        assert "node 1 is down" in failure.message
    assert (0, early) not in net.completed
    assert (0, local) not in net.completed
    assert net.engines[0].pending() == 2  # the two that do not involve node 1 can still finish
    assert net.engines[0].transfers() == 0  # the stream to node 1 and matched's landing spot
    assert net.members[0].lookup(JOB, 2) is None
    # … the unmatched RTS from node 1 is forgotten: a receive posted now does not match it
    late = net.recv(0, src=2, dst=0, nbytes=6, tag=5)
    assert (0, late) not in net.completed
    net.run_timers()
    assert failed(net, 0, late).code == "no_such_rank"


def test_peer_down_is_idempotent_and_harmless_for_strangers(net: FakeNet) -> None:
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    first = net.engines[0].peer_down(1, "down")
    assert [type(a) for a in first] == [Complete]
    assert net.engines[0].peer_down(1, "down") == []
    assert net.engines[0].peer_down(2, "down") == []
    net.perform(0, first)
    assert failed(net, 0, send).code == "peer_failed"


def test_detach_cancels_announced_sends_and_fails_the_matched_receive(net: FakeNet) -> None:
    net.hold(1, 0)  # node 1's CTS has not reached node 0 when the client leaves
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    matched = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    assert net.engines[1].transfers() == 1  # the receive's region is ready for the bytes
    net.detach(0, 0, ops=[send])
    assert SendFrame(node=1, frame=Cancel(msg=1)) in net.of(0, SendFrame)
    net.release(1, 0)
    net.run()
    failure = failed(net, 1, matched)
    assert (failure.code, failure.rank, failure.node) == ("peer_failed", 0, 0)
    assert "disconnected before its message was delivered" in failure.message
    assert (0, send) not in net.completed  # its client is gone: nobody to tell
    assert net.streams == []  # the late CTS is ignored
    assert net.pending() == [0, 0, 0]
    assert net.engines[1].transfers() == 0  # the CANCEL forgot where its bytes would land


def test_detach_drops_posted_receives_and_fails_remote_ones_waiting_for_the_rank(
    net: FakeNet,
) -> None:
    mine = net.recv(0, src=2, dst=0, nbytes=4)  # rank 0's own receive: vanishes
    theirs = net.recv(1, src=0, dst=2, nbytes=4)  # rank 2 waits for rank 0: fails
    local = net.recv(0, src=0, dst=1, nbytes=4)  # rank 1 waits for rank 0: fails
    queued = net.send(0, src=1, dst=0, data=b"late")  # rank 1 -> rank 0, never received
    net.run()
    net.detach(0, 0, ops=[mine])
    net.run()
    assert (0, mine) not in net.completed
    for node, op in ((1, theirs), (0, local), (0, queued)):
        failure = failed(net, node, op)
        assert (failure.code, failure.rank, failure.node) == ("peer_failed", 0, 0)
        assert "rank 0 of job 'job'" in failure.message
    assert [members.lookup(JOB, 0) for members in net.members] == [None, None, None]
    assert net.pending() == [0, 0, 0]


def test_an_rts_waiting_for_a_departed_receiver_is_answered(net: FakeNet) -> None:
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    net.detach(1, 2)
    net.run()
    failure = failed(net, 0, send)
    assert (failure.code, failure.node) == ("receiver_left", 1)
    assert net.pending() == [0, 0, 0]


def test_a_receiver_that_leaves_mid_transfer_still_drains_the_data() -> None:
    net = layout(auto_stream=False)
    send = net.send(0, src=0, dst=2, data=DATA)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()  # the RTS and the receive's RTR cross: the RTS takes the receive
    assert net.of(1, SendFrame)[-1] == SendFrame(node=0, frame=Cts(msg=1))
    said = len(net.of(1, SendFrame))
    net.abandon(1, [recv])
    assert len(net.of(1, SendFrame)) == said  # nothing new to say
    assert not net.engines[1].holds(recv)
    assert net.engines[1].transfers() == 1  # the bytes still come and are counted
    net.finish_stream()
    net.run()
    assert net.region(1, recv) == b"\xee" * len(DATA)  # written nowhere
    assert (1, recv) not in net.completed
    assert failed(net, 0, send).code == "receiver_left"
    assert net.pending() == [0, 0, 0]
    assert net.engines[1].transfers() == 0
    assert net.engines[1].statistics().bytes_received == len(DATA)  # counted, though dropped


def test_abandon_keeps_a_streaming_send_until_done() -> None:
    net = layout(auto_stream=False)
    send = net.send(0, src=0, dst=2, data=DATA)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    assert net.streams == [(0, StreamData(node=1, msg=1, op=send))]
    net.abandon(0, [send])
    assert not [a for a in net.of(0, SendFrame) if isinstance(a.frame, Cancel)]  # bytes move
    assert net.engines[0].holds(send)
    assert net.engines[0].transfers() == 1
    net.finish_stream()
    net.run()
    assert net.ok(1, recv)
    assert net.region(1, recv) == DATA
    assert net.ok(0, send)  # reported to a daemon that no longer has a client for it
    assert not net.engines[0].holds(send)


def test_abandon_of_unmatched_operations_forgets_them(net: FakeNet) -> None:
    waiting = net.send(0, src=0, dst=3, data=b"x")  # RTS sent, no receive
    queued = net.send(0, src=0, dst=1, data=b"y")  # local, no receive
    routeless = net.send(0, src=0, dst=7, data=b"z", job="nobody")
    posted = net.recv(0, src=2, dst=0, nbytes=1)
    net.run()
    net.abandon(0, [waiting, queued, routeless, posted, 12345])
    assert net.engines[0].pending() == 0
    assert net.engines[0].next_deadline() is None
    net.run()
    assert net.engines[2].pending() == 0
    late = net.recv(2, src=0, dst=3, nbytes=1)
    assert (2, late) not in net.completed  # the cancelled RTS does not match it
    local = net.recv(0, src=0, dst=1, nbytes=1)
    assert (0, local) not in net.completed
    assert net.completed == {}


def test_stream_failed_fails_the_send_and_cancels_the_receive() -> None:
    net = layout(auto_stream=False)
    send = net.send(0, src=0, dst=2, data=DATA)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    net.fail_stream(reason="sending to node 1 failed: reset")
    failure = failed(net, 0, send)
    assert (failure.code, failure.node) == ("transport", 1)
    assert failure.message == "sending to node 1 failed: reset"
    assert net.engines[0].stream_failed(1, "again") == []
    net.run()
    assert failed(net, 1, recv).code == "peer_failed"
    assert net.engines[1].transfers() == 0  # no DATA of it will come
    assert net.pending() == [0, 0, 0]


@pytest.mark.parametrize("last", [False, True])
def test_a_cancel_while_a_chunk_lands_answers_the_receive_once_the_chunk_is_in(last: bool) -> None:
    """The sender's stream failed mid-way; its CANCEL (control link) overtakes its DATA and
    arrives while a chunk is being read straight into the receive's region.  Answering the
    receive then let its client reuse the region while the rest of that chunk still landed in
    it (over a later message's bytes); the answer waits for the chunk, later chunks are dropped."""
    net = layout(auto_stream=False)
    data = bytes(range(1, 17))  # two chunks of 8
    net.send(0, src=0, dst=2, data=data)
    recv = net.recv(1, src=0, dst=2, nbytes=len(data))
    net.run()
    [(_, stream)] = net.streams
    if last:
        net.stream_chunks(0, 1)
    engine, off = net.engines[1], 8 if last else 0
    chunk = Data(msg=stream.msg, off=off)
    buffer = engine.payload_buffer(0, chunk, 8)  # the transport reads into it, a bit at a time
    assert buffer is not None
    buffer[:4] = data[off : off + 4]
    net.fail_stream(0, "the daemon ran short", ErrorCode.RESOURCES)
    net.run()  # the CANCEL
    assert (1, recv) not in net.completed  # its client must not reuse the region yet
    buffer[4:] = data[off + 4 : off + 8]
    net.perform(1, engine.data_arrived(0, chunk, 8, net.now))
    assert failed(net, 1, recv).code == "peer_failed"
    if not last:  # the chunk after it was on the link too: read and dropped
        assert engine.payload_buffer(0, Data(msg=stream.msg, off=8), 8) is None
    assert leftovers(engine) == {}
    assert net.pending() == [0, 0, 0]


def test_a_reset_after_a_cancel_deferred_by_a_landing_chunk_fails_the_receive_once() -> None:
    net = layout(auto_stream=False)
    net.send(0, src=0, dst=2, data=bytes(16))
    recv = net.recv(1, src=0, dst=2, nbytes=16)
    net.run()
    [(_, stream)] = net.streams
    engine = net.engines[1]
    assert engine.payload_buffer(0, Data(msg=stream.msg, off=0), 8) is not None
    net.fail_stream(0, "the daemon ran short", ErrorCode.RESOURCES)
    net.run()
    net.perform(1, engine.peer_down(0, "reset"))  # the data link closed mid-chunk
    assert failed(net, 1, recv).code == "peer_failed"
    assert leftovers(engine) == {}


def test_control_frames_from_the_wrong_node_or_for_unknown_messages_are_ignored() -> None:
    net = layout(auto_stream=False)
    net.hold(1, 0)
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    engine = net.engines[0]
    for node, frame in [
        (2, Cts(msg=1)),  # node 2 never got this message
        (1, Cts(msg=99)),
        (2, Done(msg=1)),
        (1, Done(msg=99)),
        (1, Done(msg=99, code="mismatch", error="no")),
        (2, Cancel(msg=1)),
        (1, Cancel(msg=99)),
    ]:
        assert engine.on_frame(node, frame, 0.0) == [], (node, frame)
    assert engine.holds(send)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.release(1, 0)
    net.run()
    net.finish_stream()
    net.run()
    assert net.ok(0, send)
    assert net.region(1, recv) == DATA


@pytest.mark.parametrize(
    "meta",
    [
        {"msg": 1, "src": 0, "dst": 2, "tag": 0, "nbytes": 4, "dtype": "uint8"},  # no job
        {"msg": 1, "job": "", "src": 0, "dst": 2, "tag": 0, "nbytes": 4, "dtype": "uint8"},
        {"msg": 1, "job": "j", "src": -1, "dst": 2, "tag": 0, "nbytes": 4, "dtype": "uint8"},
        {"msg": 1, "job": "j", "src": 0, "dst": 2**32, "tag": 0, "nbytes": 4, "dtype": "u8"},
        {"msg": 1, "job": "j", "src": 0, "dst": 2, "tag": "0", "nbytes": 4, "dtype": "uint8"},
        {"msg": 1, "job": "j", "src": 0, "dst": 2, "tag": 0, "nbytes": -4, "dtype": "uint8"},
        {"msg": 1, "job": "j", "src": 0, "dst": 2, "tag": 0, "nbytes": 4.0, "dtype": "uint8"},
        {"msg": 1, "job": "j", "src": 0, "dst": 2, "tag": 0, "nbytes": 4, "dtype": None},
        {"msg": True, "job": "j", "src": 0, "dst": 2, "tag": 0, "nbytes": 4, "dtype": "u8"},
        {"job": "j", "src": 0, "dst": 2, "tag": 0, "nbytes": 4, "dtype": "uint8"},  # no msg
    ],
)
def test_malformed_rts_metadata_is_a_remote_protocol_error(net: FakeNet, meta: dict) -> None:
    with pytest.raises(RemoteProtocolError):
        net.receive(0, 1, Kind.RTS, meta)
    assert net.engines[1].statistics().unexpected == 0
    assert net.engines[1].pending() == 0


@pytest.mark.parametrize(
    ("kind", "meta"),
    [
        (Kind.HEARTBEAT, {"msg": 1}),
        (Kind.DONE, {"msg": 1, "code": "mismatch"}),  # an error code needs its message
        (Kind.CTS, {}),
        (Kind.ANNOUNCE, {"job": JOB, "rank": 0, "size": 0, "present": True}),
        (Kind.ANNOUNCE, {"job": JOB, "size": 4, "present": True}),
    ],
)
def test_other_malformed_frames_are_remote_protocol_errors(kind: Kind, meta: dict) -> None:
    net = layout()
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    assert net.engines[0].holds(send)
    with pytest.raises(RemoteProtocolError):
        net.receive(1, 0, kind, meta)
    assert net.engines[0].holds(send)


def test_a_malformed_done_leaves_the_send_to_fail_with_the_link(net: FakeNet) -> None:
    """The engine must not half-apply a frame it refuses: the daemon closes that peer's link,
    and the reset that follows is what fails the send."""
    send = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    with pytest.raises(RemoteProtocolError, match="'error'"):
        net.receive(1, 0, Kind.DONE, {"msg": 1, "code": "mismatch"})
    assert net.engines[0].holds(send)
    assert (0, send) not in net.completed
    net.detect(0, 1, reason="unreachable (control link lost)")
    failure = failed(net, 0, send)
    assert (failure.code, failure.rank, failure.node) == ("peer_failed", 2, 1)


def test_a_lost_done_is_recovered_only_by_the_link_reset() -> None:
    """The engine trusts the control link to be reliable: a frame lost without the link
    dropping leaves the send waiting, and the reset that a broken link causes fails it."""
    net = layout(drop=lambda src, dst, frame: isinstance(frame, Done))
    send = net.send(0, src=0, dst=2, data=DATA)
    recv = net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run_timers()
    assert net.region(1, recv) == DATA
    assert net.ok(1, recv)
    assert net.engines[0].holds(send)  # no timer rescues it: liveness is the peer table's job
    net.detect(0, 1, reason="unreachable (control link lost)")
    assert failed(net, 0, send).code == "peer_failed"


def test_equal_messages_are_shared_and_the_table_stays_bounded() -> None:
    table = Messages()
    first = table.get("j", 1, 2, 3, 40, "f4")
    assert first == Message(job="j", src=1, dst=2, tag=3, nbytes=40, dtype="f4")
    assert first.key == ("j", 1, 2, 3)
    assert table.get("j", 1, 2, 3, 40, "f4") is first  # built once
    assert table.get("j", 1, 2, 3, 41, "f4") is not first  # another size is another message
    for tag in range(10 * MESSAGES_KEPT):  # tags as step numbers: the table starts afresh
        assert table.get("j", 1, 2, tag, 8, "f4").tag == tag
        assert len(table._known) <= MESSAGES_KEPT
    assert table.get("j", 1, 2, 3, 40, "f4") == first  # equal, whatever was forgotten


def test_the_message_table_holds_little_memory_when_full() -> None:
    tracemalloc.start()
    try:
        table = Messages()
        before = tracemalloc.get_traced_memory()[0]
        for tag in range(MESSAGES_KEPT - 1):  # job names decoded afresh each time, 200 chars
            table.get("".join(["j"] * 200), 1, 2, tag, 8, "float32")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 100 * 1024, held


# -- property: random traffic, random delivery orders, one random crash -----------------------
NODE_OF = {0: 0, 1: 1, 2: 2, 3: 0}
SIZES = (0, 1, 7, 32)

messages = st.lists(
    st.tuples(
        st.integers(0, 3),  # src
        st.integers(0, 3),  # dst
        st.integers(0, 1),  # tag
        st.sampled_from(SIZES),  # bytes sent
        st.sampled_from(SIZES + (None,) * 4),  # bytes the receive expects (None: the same)
    ),
    max_size=14,
)


def payload(uid: int, nbytes: int) -> bytes:
    """Bytes that differ from message to message, so a mix-up shows."""
    return bytes((uid * 31 + i + 1) % 251 for i in range(nbytes))


def run_scenario(rng: random.Random, msgs: list[tuple], crash: tuple[int, int] | None) -> FakeNet:
    """Play the messages with random program orders and delivery; maybe crash one node."""
    net = FakeNet(3, rng=rng)
    program: dict[int, list[tuple]] = {rank: [("attach",)] for rank in NODE_OF}
    for uid, (src, dst, tag, sent, expected) in enumerate(msgs):
        program[src].append(("send", dst, tag, sent, uid))
        program[dst].append(("recv", src, tag, sent if expected is None else expected))
    for rank in NODE_OF:
        head, *ops = program[rank]
        rng.shuffle(ops)
        program[rank] = [head, *ops]
    cursor = dict.fromkeys(NODE_OF, 0)
    detections: list[int] = []
    step = 0

    def post(rank: int) -> None:
        event = program[rank][cursor[rank]]
        cursor[rank] += 1
        node = NODE_OF[rank]
        if node in net.crashed:
            return
        match event:
            case ("attach",):
                net.attach(node, rank)
            case ("send", dst, tag, nbytes, uid):
                net.send(node, src=rank, dst=dst, data=payload(uid, nbytes), tag=tag)
            case ("recv", src, tag, nbytes):
                net.recv(node, src=src, dst=rank, nbytes=nbytes, tag=tag)

    while True:
        step += 1
        if crash is not None and step == crash[1] and crash[0] not in net.crashed:
            net.crash(crash[0])
            detections = [n for n in range(3) if n != crash[0]]
        if detections and rng.random() < 0.2:
            net.detect(detections.pop(rng.randrange(len(detections))), crash[0])  # type: ignore[index]
        ready = [r for r in NODE_OF if cursor[r] < len(program[r])]
        if not ready and not net.in_flight():
            break
        if ready and (not net.in_flight() or rng.random() < 0.5):
            post(rng.choice(ready))
        else:
            net.deliver_one()
    if crash is not None and crash[0] not in net.crashed:
        net.crash(crash[0])
        detections = [n for n in range(3) if n != crash[0]]
    for survivor in detections:
        net.detect(survivor, crash[0])  # type: ignore[index]
    net.run_timers()
    return net


def leftovers(engine: Messaging) -> dict[str, int]:
    """Every table of the engine that still holds something (an idle engine holds nothing)."""
    sizes = {
        "sends": len(engine._sends),
        "recvs": len(engine._recvs),
        "posted": len(engine._posted) + len(engine._posted._queues),
        "arrived": len(engine._arrived) + len(engine._arrived._queues),
        "unrouted": len(engine._unrouted),
        "recvs_from": len(engine._recvs_from),
        "offers_to": len(engine._offers_to),
        "out_to": len(engine._out_to),
        "out": len(engine._out),
        "out_by": len(engine._out_by),
        "remote": len(engine._remote),
        "deadlines": len(engine._deadlines) + len(engine._deadlines._heap),
        "landing": len(engine._landing) + len(engine._landing._entries),
        "moving": engine._moving,
        "stall deadlines": len(engine._stall_at),
        "cancels after a chunk": len(engine._cancel_after_chunk),
    }
    return {name: size for name, size in sizes.items() if size}


def check_history(net: FakeNet, dead: int | None) -> None:
    """Exactly-once completion, FIFO matching and the right bytes in every successful receive."""
    for (node, op), outcomes in net.completed.items():
        assert len(outcomes) == 1, f"op {op} on node {node} completed {len(outcomes)} times"
    survivors = [n for n in range(3) if n != dead]
    for node in survivors:
        assert net.engines[node].pending() == 0
        assert net.engines[node].transfers() == 0
        assert net.engines[node].next_deadline() is None
        assert leftovers(net.engines[node]) == {}, node
    by_key: dict[tuple, tuple[list[Posted], list[Posted]]] = defaultdict(lambda: ([], []))
    for posted in sorted(net.ops.values(), key=lambda p: p.op):
        m = posted.msg
        by_key[m.job, m.src, m.dst, m.tag][0 if posted.send else 1].append(posted)
    for (_, src, dst, _), (sends, recvs) in by_key.items():
        involved = dead in (NODE_OF[src], NODE_OF[dst])
        for posted in sends + recvs:
            if posted.node == dead:
                continue
            failure = net.outcome(posted.node, posted.op)  # survivors: exactly once
            if failure is not None and involved:
                assert failure.code in ("peer_failed", "no_such_rank", "mismatch"), failure
                if failure.code == "peer_failed":
                    assert failure.node == dead
                    assert failure.rank is not None
        for k, recv in enumerate(recvs):
            if recv.node == dead or net.outcome(recv.node, recv.op) is not None:
                continue
            send = sends[k]  # FIFO: the k-th receive meets the k-th send of its key
            assert recv.region.tobytes() == send.region.tobytes()
            assert recv.msg.nbytes == send.msg.nbytes
        if involved:
            continue
        for send, recv in zip(sends, recvs, strict=True):
            fits = send.msg.nbytes == recv.msg.nbytes
            codes = [
                None if f is None else f.code
                for f in (net.outcome(send.node, send.op), net.outcome(recv.node, recv.op))
            ]
            assert codes == ([None, None] if fits else ["mismatch", "mismatch"])


@settings(max_examples=300, deadline=None)
@given(msgs=messages, rng=st.randoms(use_true_random=False))
def test_random_traffic_completes_exactly_once_in_fifo_order(
    msgs: list[tuple], rng: random.Random
) -> None:
    net = run_scenario(rng, msgs, crash=None)
    check_history(net, dead=None)
    assert len(net.completed) == 2 * len(msgs)


@settings(max_examples=300, deadline=None)
@given(
    msgs=messages,
    rng=st.randoms(use_true_random=False),
    dead=st.integers(0, 2),
    when=st.integers(1, 80),
)
def test_random_traffic_with_a_crash_leaves_nothing_behind(
    msgs: list[tuple], rng: random.Random, dead: int, when: int
) -> None:
    net = run_scenario(rng, msgs, crash=(dead, when))
    check_history(net, dead=dead)


def test_a_second_cts_is_reported_and_does_not_stream_twice() -> None:
    net = layout(auto_stream=False)
    net.send(0, src=0, dst=2, data=DATA)
    net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    assert len(net.streams) == 1
    again = net.engines[0].on_frame(1, Cts(msg=1), 0.0)
    assert not any(isinstance(a, StreamData) for a in again)
    assert any("second CTS" in getattr(a, "message", "") for a in again)


# -- the state machines -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("table", "start", "closed", "broken", "abandoned"),
    [
        (
            SEND_TRANSITIONS,
            SendState.ROUTE,
            SendState.CLOSED,
            SendState.BROKEN,
            SendInput.ABANDONED,
        ),
        (
            RECV_TRANSITIONS,
            RecvState.POSTED,
            RecvState.CLOSED,
            RecvState.BROKEN,
            RecvInput.ABANDONED,
        ),
    ],
)
def test_every_state_is_reachable_and_can_end(
    table: dict, start: object, closed: object, broken: object, abandoned: object
) -> None:
    states = {state for state, _ in table} | set(table.values())
    assert closed in states
    assert broken not in states  # only an illegal input gets there
    assert not [key for key in table if key[0] is closed]  # terminal
    reached, frontier = {start}, [start]
    while frontier:
        state = frontier.pop()
        for (source, _), target in table.items():
            if source is state and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == states
    for state in states - {closed}:
        assert (state, abandoned) in table, state  # a client may leave in any state


def test_an_input_the_state_does_not_accept_is_refused() -> None:
    net = layout(auto_stream=False)
    send = net.send(0, src=0, dst=2, data=DATA)  # RTS, waiting for its receive
    recv = net.recv(0, src=2, dst=0, nbytes=4)  # posted
    net.run()
    engine = net.engines[0]
    with pytest.raises(LocalProtocolError, match=r"send \d+ in state RTS cannot take COPIED"):
        engine.copied(send, recv)
    assert not engine.holds(send)  # broken: it never moves again, nor matches anything
    assert engine.holds(recv)
    with pytest.raises(LocalProtocolError, match="no copy"):
        engine.copied(send, recv)


def test_an_operation_id_is_posted_once(net: FakeNet) -> None:
    op = net.send(0, src=0, dst=2, data=DATA)
    engine = net.engines[0]
    message = Message(job=JOB, src=0, dst=2, tag=0, nbytes=1, dtype="uint8")
    with pytest.raises(LocalProtocolError, match="already in the engine"):
        engine.post_send(op, message, 0.0)
    with pytest.raises(LocalProtocolError, match="already in the engine"):
        engine.post_recv(op, message, memoryview(bytearray(1)), 0.0)
    assert engine.pending() == 1


@pytest.mark.parametrize("region", [memoryview(bytearray(3)), memoryview(b"four")])
def test_a_receive_needs_a_writable_region_of_its_size(net: FakeNet, region: memoryview) -> None:
    message = Message(job=JOB, src=2, dst=0, tag=0, nbytes=4, dtype="uint8")
    with pytest.raises(LocalProtocolError, match="needs 4 writable bytes"):
        net.engines[0].post_recv(99, message, region, 0.0)
    assert net.engines[0].pending() == 0


def test_an_rts_that_reuses_a_message_id_is_a_remote_protocol_error(net: FakeNet) -> None:
    rts = Rts(msg=5, job=JOB, src=0, dst=2, tag=0, nbytes=4, dtype="uint8")
    engine = net.engines[1]
    assert engine.on_frame(0, rts, 0.0) == []  # unexpected: waits for its receive
    with pytest.raises(RemoteProtocolError, match="reused the id of message 5"):
        engine.on_frame(0, rts, 0.0)
    recv = net.recv(1, src=0, dst=2, nbytes=4)
    assert net.of(1, SendFrame)[-1] == SendFrame(node=0, frame=Cts(msg=5))
    with pytest.raises(RemoteProtocolError, match="reused"):  # and while its bytes land
        engine.on_frame(0, rts, 0.0)
    assert engine.on_frame(2, rts, 0.0) == []  # ids are per sending node
    assert engine.holds(recv)
    assert engine.statistics().unexpected == 1


# -- keyed matching ---------------------------------------------------------------------------
def test_a_message_meets_the_oldest_receive_of_its_own_key_among_many() -> None:
    net = layout()
    for tag in range(1, 200):  # receives on other tags, and sends waiting for other ranks
        net.recv(1, src=0, dst=2, nbytes=1, tag=tag)
        net.send(0, src=0, dst=9, data=b"x", tag=tag, job="elsewhere")
    first = net.recv(1, src=0, dst=2, nbytes=5)
    second = net.recv(1, src=0, dst=2, nbytes=5)
    net.run()
    send = net.send(0, src=0, dst=2, data=b"hello")
    net.run()
    assert net.ok(0, send)
    assert net.region(1, first) == b"hello"
    assert (1, second) not in net.completed
    assert net.engines[1].statistics().receives == 199 + 1
    assert net.engines[0].statistics().unrouted == 199


def test_a_receive_abandoned_from_the_middle_of_its_queue_keeps_the_order(net: FakeNet) -> None:
    recvs = [net.recv(1, src=0, dst=2, nbytes=1) for _ in range(4)]
    net.abandon(1, [recvs[1]])
    sends = [net.send(0, src=0, dst=2, data=bytes([i])) for i in range(3)]
    net.run()
    assert [net.region(1, op) for op in recvs] == [b"\x00", b"\xee", b"\x01", b"\x02"]
    assert all(net.ok(0, op) for op in sends)


def test_sends_waiting_for_their_rank_go_in_the_order_they_were_posted() -> None:
    net = FakeNet(2)
    net.attach(0, 0)
    sends = [net.send(0, src=0, dst=2, data=bytes([i]) * 3) for i in range(3)]
    net.run()
    net.attach(1, 2)
    recvs = [net.recv(1, src=0, dst=2, nbytes=3) for _ in sends]
    net.run()
    assert [net.region(1, op) for op in recvs] == [b"\x00" * 3, b"\x01" * 3, b"\x02" * 3]
    assert all(net.ok(0, op) for op in sends)


# -- rank events and deadlines ----------------------------------------------------------------
@pytest.mark.parametrize("lost", [True, False])
def test_only_a_lost_rank_fails_the_sends_announced_to_it(lost: bool) -> None:
    net = layout(auto_stream=False)
    announced = net.send(0, src=0, dst=2, data=DATA)
    net.run()
    gone = RankLeft(entry=net.members[0].lookup(JOB, 2), reason="it went", lost=lost)  # type: ignore[arg-type]
    actions = net.engines[0].on_rank_event(gone, net.now)
    if lost:
        failure = Failure(code="peer_failed", message="it went", rank=2, node=1)
        assert actions == [Complete(op=announced, failure=failure)]
    else:
        assert actions == []  # its daemon answers the RTS itself
        assert net.engines[0].holds(announced)


def test_a_deadline_at_zero_is_a_deadline() -> None:
    net = FakeNet(1, route_timeout=0.0)
    send = net.send(0, src=0, dst=1, data=DATA)
    assert net.engines[0].next_deadline() == 0.0
    net.run_timers()
    assert failed(net, 0, send).code == "no_such_rank"


def test_statistics_follow_the_operations(net: FakeNet) -> None:
    assert net.engines[1].statistics() == MessagingStatistics(
        sends=0, receives=0, unrouted=0, unexpected=0, transfers=0, bytes_received=0
    )
    net.send(0, src=0, dst=2, data=DATA)
    net.recv(1, src=3, dst=2, nbytes=1)
    net.send(1, src=2, dst=7, data=b"", job="nowhere")
    net.run()
    assert net.engines[1].statistics() == MessagingStatistics(
        sends=1, receives=1, unrouted=1, unexpected=1, transfers=0, bytes_received=0, rtr_sent=1
    )
    net.recv(1, src=0, dst=2, nbytes=len(DATA))
    net.run()
    assert net.engines[1].statistics().bytes_received == len(DATA)


# -- many clients come and go: nothing stays behind -------------------------------------------
CHURN_HOME = {0: 0, 1: 0, 2: 1, 3: 2, 4: 2}


@pytest.mark.parametrize("seed", range(3))
def test_thousands_of_operations_by_clients_that_come_and_go_leave_every_table_empty(
    seed: int,
) -> None:
    """Sends and receives of every size (matching, mismatched, zero-byte, local and remote) by
    ranks that leave at any moment, with streams and copies that finish (or fail) late and
    frames that cross: once every client has left and the timers ran, each engine is empty."""
    rng = Random(seed)
    net = FakeNet(3, rng=rng, auto_stream=False, auto_copy=False, route_timeout=1.0)
    mine: dict[int, list[int]] = {rank: [] for rank in CHURN_HOME}
    joined: set[int] = set()
    posted = 0
    while posted < 4000:
        roll = rng.random()
        rank, peer = rng.choice(list(CHURN_HOME)), rng.randrange(6)  # rank 5 never joins
        node = CHURN_HOME[rank]
        if roll < 0.04:
            if rank in joined:
                net.detach(node, rank, ops=mine[rank])
                joined.discard(rank)
                mine[rank] = []
            else:
                net.attach(node, rank, size=6)
                joined.add(rank)
        elif roll < 0.6 and rank in joined:
            nbytes, tag = rng.choice((0, 1, 5, 20)), rng.randrange(3)
            if rng.random() < 0.5:
                op = net.send(node, src=rank, dst=peer, data=bytes(nbytes), tag=tag)
            else:
                op = net.recv(node, src=peer, dst=rank, nbytes=nbytes, tag=tag)
            mine[rank].append(op)
            posted += 1
        elif roll < 0.7 and net.streams:
            index = rng.randrange(len(net.streams))
            if rng.random() < 0.1:
                net.fail_stream(index)
            else:
                net.finish_stream(index)
        elif roll < 0.8 and net.copies:
            net.finish_copy(rng.randrange(len(net.copies)))
        elif roll < 0.85:
            net.advance(net.now + 0.1)
        else:
            for _ in range(rng.randrange(1, 6)):
                net.deliver_one()
    for rank in joined:
        net.detach(CHURN_HOME[rank], rank, ops=mine[rank])
    while net.streams or net.copies or net.in_flight() or net.next_deadline() is not None:
        if net.streams:
            net.finish_stream()
        elif net.copies:
            net.finish_copy()
        net.run_timers()
    for (node, op), outcomes in net.completed.items():
        assert len(outcomes) == 1, f"op {op} on node {node} completed {len(outcomes)} times"
    assert len(net.completed) > 1000  # most operations ran to an end their client heard of
    for node, engine in enumerate(net.engines):
        assert leftovers(engine) == {}, node
        assert engine.pending() == engine.transfers() == 0
    for members in net.members:
        assert members.entries() == []


# -- property: the hardening inputs (copy failures, stream failures with codes and late DATA,
# -- the per-peer RTS bound, clients leaving at any moment, stall deadlines) ------------------
#: rank -> node; rank 5 never joins
HARD_HOME = {0: 0, 1: 0, 2: 1, 3: 2, 4: 2}
HARD_SIZES = (20, 5, 20, 0)
STREAM_CODES = (ErrorCode.TRANSPORT, ErrorCode.RESOURCES, ErrorCode.INTERNAL)

steps = st.lists(
    st.tuples(
        st.integers(0, 11),  # what happens
        st.integers(0, 4),  # the rank (or an index)
        st.integers(0, 5),  # the peer rank (see hard_peer), or a count
        st.integers(0, 3),  # a size (or a code)
        st.integers(0, 1),  # a tag (or a choice)
    ),
    min_size=20,
    max_size=120,
)


def hard_peer(rank: int, b: int) -> int:
    """Each rank talks mostly with its two neighbours (so messages meet), sometimes with
    itself or with rank 5, which never joins."""
    return ((rank + 1) % 5, (rank + 1) % 5, (rank - 1) % 5, (rank - 1) % 5, rank, 5)[b]


def check_engine_invariants(net: FakeNet) -> None:
    """Between any two inputs: no deadline outlives its operation, and the counts agree."""
    for engine in net.engines:
        live = engine._sends.keys() | engine._recvs.keys()
        assert set(engine._deadlines._at) <= live
        assert set(engine._stall_at._at) <= live
        queued = sum(1 for s in engine._sends.values() if s.state is SendState.QUEUED)
        remote = sum(len(group) for group in engine._remote.values())
        assert len(engine._arrived) == queued + remote
        posted = sum(1 for r in engine._recvs.values() if r.state is RecvState.POSTED)
        assert len(engine._posted) == posted
        moving = sum(
            1 for s in engine._sends.values() if s.state in (SendState.STREAM, SendState.COPY)
        )
        assert engine._moving == moving
        limit = engine.max_unmatched_rts_per_peer
        assert limit is None or all(len(group) <= limit for group in engine._remote.values())


def play_hardened(plan: list[tuple[int, int, int, int, int]], limit: int | None) -> None:
    net = FakeNet(
        3,
        auto_stream=False,
        auto_copy=False,
        route_timeout=1.0,
        stall_after=0.3,
        max_unmatched_rts_per_peer=limit,
    )
    mine: dict[int, list[int]] = {rank: [] for rank in HARD_HOME}
    abandoned: set[tuple[int, int]] = set()
    joined: set[int] = set()
    uid = itertools.count(1)
    payloads: dict[tuple[int, int], bytes] = {}

    def leave(rank: int) -> None:
        node = HARD_HOME[rank]
        abandoned.update((node, op) for op in mine[rank])
        net.detach(node, rank, ops=mine[rank])
        joined.discard(rank)
        mine[rank] = []

    for rank, node in HARD_HOME.items():
        net.attach(node, rank, size=6)
        joined.add(rank)
    net.run()
    for what, a, b, c, d in plan:
        rank, node = a, HARD_HOME[a]
        if what < 4 and rank in joined:
            if what < 2:
                data = payload(next(uid), HARD_SIZES[c])
                op = net.send(node, src=rank, dst=hard_peer(rank, b), data=data, tag=d)
                payloads[node, op] = data
            else:
                op = net.recv(node, src=hard_peer(rank, b), dst=rank, nbytes=HARD_SIZES[c], tag=d)
            mine[rank].append(op)
        elif what == 4 and d:
            if rank in joined:
                leave(rank)
            else:
                net.attach(node, rank, size=6)
                joined.add(rank)
        elif what == 5:
            for _ in range(b + 1):
                net.deliver_one()
        elif what == 6 and net.streams:
            net.stream_chunks(a % len(net.streams), b - 1 if b else -1)
        elif what == 7 and net.streams:
            net.fail_stream(a % len(net.streams), "failed", STREAM_CODES[c % 3], late=b)
        elif what == 8 and d and net.late:
            net.land_late(a % len(net.late))
        elif what == 8 and not d and net.filling and b % 2:
            net.finish_chunk(*sorted(net.filling)[a % len(net.filling)])
        elif what == 8 and not d and net.streams:
            net.begin_chunk(a % len(net.streams))
        elif what == 9 and net.copies:
            if d:
                net.fail_copy(a % len(net.copies))
            else:
                net.finish_copy(a % len(net.copies))
        elif what == 10:
            net.advance(net.now + 0.1 * (b + 1))
        elif what == 11:
            net.run()
        check_engine_invariants(net)

    def drain(timers: bool) -> None:
        while net.streams or net.copies or net.late or net.filling or net.in_flight():
            if net.filling:
                net.finish_chunk(*min(net.filling))
            elif net.late:
                net.land_late()
            elif net.streams:
                net.finish_stream()
            elif net.copies:
                net.finish_copy()
            net.run()
            check_engine_invariants(net)
        if timers and net.next_deadline() is not None:
            net.run_timers()
            drain(timers)

    drain(timers=False)  # what was posted runs to its end, as far as it can
    for rank in list(joined):
        leave(rank)
    drain(timers=True)
    check_hardened_history(net, abandoned, payloads)
    codes = {f.code for outcomes in net.completed.values() for f in outcomes if f is not None}
    for code in sorted(codes):
        event(f"failed with {code}")
    event(f"completed {min(len(net.completed), 40) // 10 * 10}+")


def check_hardened_history(
    net: FakeNet, abandoned: set[tuple[int, int]], payloads: dict[tuple[int, int], bytes]
) -> None:
    """Exactly once (at most once for what a leaving client abandoned), every byte where it
    belongs, and every table empty."""
    for key in net.ops:
        outcomes = net.completed.get(key, [])
        assert len(outcomes) <= 1, f"op {key} completed {len(outcomes)} times: {outcomes}"
        assert outcomes or key in abandoned, f"op {key} never completed"
    delivered: dict[bytes, int] = defaultdict(int)
    for key, posted in net.ops.items():
        if posted.send or net.completed.get(key) != [None]:
            continue
        data = posted.region.tobytes()
        senders = [k for k, p in net.ops.items() if p.send and p.msg.key == posted.msg.key]
        assert data in {payloads[k] for k in senders}, f"receive {key} got bytes nobody sent"
        delivered[data] += 1
    for key, data in payloads.items():
        if data and net.completed.get(key) == [None]:  # a send that succeeded was received
            assert delivered[data] == 1, (
                f"send {key} succeeded, its bytes arrived {delivered[data]} times"
            )
        assert delivered[data] <= 1 or not data
    for node, engine in enumerate(net.engines):
        assert leftovers(engine) == {}, node
        assert engine.pending() == engine.transfers() == 0
        assert engine.next_deadline() is None


#: rank 0 sends 20 B to rank 4 (node 2), which receives it; a chunk starts landing, the stream
#: fails and its CANCEL arrives while the chunk is still being written
CANCEL_WHILE_A_CHUNK_LANDS = [(0, 0, 2, 0, 0), (2, 4, 0, 0, 0), (11, 0, 0, 0, 0), (8, 0, 0, 0, 0)]
CANCEL_WHILE_A_CHUNK_LANDS += [(7, 0, 0, 1, 0), (11, 0, 0, 0, 0)]


@settings(max_examples=400, deadline=None)
@given(plan=steps, limit=st.sampled_from((None, 1, 2)))
@example(plan=CANCEL_WHILE_A_CHUNK_LANDS, limit=None)
def test_hardening_inputs_complete_exactly_once_and_leave_nothing_behind(
    plan: list[tuple[int, int, int, int, int]], limit: int | None
) -> None:
    play_hardened(plan, limit)
