"""Stall reports of the point-to-point engine, on the fake network with a fake clock.

The standard layout of test_p2p: job ``"job"`` of size 4, ranks 0 and 1 on node 0, rank 2 on
node 1, rank 3 on node 2; ``stall_after`` is 10 s and ``route_timeout`` 100 s, so a rank that
never joins is reported stalled long before its operations fail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fakenet import FakeNet
from workcount import WorkCounter

from fabricd.engines.stalls import MAX_OTHER_TAGS, Stalled, Waits

if TYPE_CHECKING:
    import pytest

STALL = 10.0
HOME = {0: 0, 1: 0, 2: 1, 3: 2}


def layout(**options: object) -> FakeNet:
    net = FakeNet(3, stall_after=STALL, route_timeout=100.0, **options)  # type: ignore[arg-type]
    for rank, node in HOME.items():
        net.attach(node, rank)
    net.run()
    return net


def reported(net: FakeNet, node: int) -> list[Stalled]:
    return net.of(node, Stalled)


def test_a_recv_waiting_for_an_absent_sender_is_reported_once_after_stall_after() -> None:
    net = layout()
    op = net.recv(1, src=0, dst=2, nbytes=4, tag=5)  # rank 0 (node 0) never sends
    net.run()
    net.advance(STALL - 0.5)
    assert reported(net, 1) == []
    assert net.engines[1].stalls(net.now) == []
    net.advance(STALL)
    [stall] = reported(net, 1)
    assert (stall.op, stall.send, stall.rank, stall.peer) == (op, False, 2, 0)
    assert (stall.waits, stall.peer_node, stall.peer_joined, stall.peer_posted) == (
        Waits.RTS,
        0,
        True,
        False,
    )
    assert stall.pending_for == STALL
    assert "rank 0 on node 0 has sent nothing to rank 2 with tag 5" in stall.detail()
    assert "no RTS has arrived" in stall.detail()
    assert stall.what() == "recv of rank 2 from rank 0, job 'job', tag 5, 4 B uint8"
    net.advance(STALL * 5)  # never again, but still listed as long as it waits
    assert len(reported(net, 1)) == 1
    [listed] = net.engines[1].stalls(net.now)
    assert (listed.op, listed.waits, listed.pending_for) == (op, Waits.RTS, STALL * 5)
    assert net.engines[1].statistics().stalls_reported == 1


def test_a_completed_operation_is_never_reported() -> None:
    net = layout()
    recv = net.recv(1, src=0, dst=2, nbytes=3)
    send = net.send(0, src=0, dst=2, data=b"abc")
    net.run()
    assert net.ok(1, recv)
    assert net.ok(0, send)
    net.run_timers()
    assert net.now == STALL  # at most one wake-up for the check, then nothing is due
    assert reported(net, 0) == reported(net, 1) == []
    assert [engine.next_deadline() for engine in net.engines] == [None, None, None]
    assert net.engines[0].stalls(net.now + STALL) == []


def test_an_operation_that_ends_does_not_move_the_deadline_the_daemon_arms() -> None:
    """The stall check is lazy: the daemon's timer is not re-armed per operation."""
    net = layout()
    engine = net.engines[0]
    assert engine.next_deadline() is None
    recv = net.recv(0, src=1, dst=0, nbytes=1)
    assert engine.next_deadline() == STALL
    net.now = 1.0
    net.send(0, src=1, dst=0, data=b"x")
    assert net.ok(0, recv)
    assert engine.next_deadline() == STALL  # unchanged though both operations ended
    net.advance(STALL)
    assert reported(net, 0) == []
    assert engine.next_deadline() is None


def test_a_rank_that_never_joined_is_named_and_its_route_timeout_still_fails_it() -> None:
    net = FakeNet(2, stall_after=STALL, route_timeout=3 * STALL)
    net.attach(0, 0)
    net.run()
    send = net.send(0, src=0, dst=1, data=b"x", tag=2)
    net.advance(STALL)
    [stall] = reported(net, 0)
    assert (stall.op, stall.send, stall.peer, stall.waits) == (send, True, 1, Waits.JOIN)
    assert (stall.peer_joined, stall.peer_node, stall.peer_posted) == (False, None, False)
    assert "rank 1 has not joined job 'job' on any node" in stall.detail()
    net.advance(3 * STALL)
    assert net.outcome(0, send) is not None
    assert net.engines[0].stalls(net.now) == []


def test_a_route_timeout_due_with_the_stall_fails_the_operation_unreported() -> None:
    net = FakeNet(2, stall_after=STALL, route_timeout=STALL)
    net.attach(0, 0)
    net.run()
    recv = net.recv(0, src=1, dst=0, nbytes=1)
    net.advance(STALL)
    assert net.outcome(0, recv) is not None
    assert reported(net, 0) == []


def test_an_announced_send_waits_for_the_receivers_cts() -> None:
    net = layout()
    send = net.send(0, src=0, dst=2, data=b"abcd", tag=7)
    net.run()  # the RTS waits on node 1 for a receive nobody posts
    net.advance(STALL)
    [stall] = reported(net, 0)
    assert (stall.op, stall.waits, stall.peer, stall.peer_node) == (send, Waits.CTS, 2, 1)
    assert not stall.peer_posted
    assert "rank 2 on node 1 has posted no recv from rank 0 with tag 7" in stall.detail()
    assert reported(net, 1) == []  # an unmatched RTS is not an operation of node 1


def test_a_local_pair_with_different_tags_names_the_tags_on_both_sides() -> None:
    net = layout()
    recv = net.recv(0, src=1, dst=0, nbytes=1, tag=5)
    send = net.send(0, src=1, dst=0, data=b"x", tag=3)
    net.advance(STALL)
    by_op = {stall.op: stall for stall in reported(net, 0)}
    assert by_op.keys() == {recv, send}
    assert (by_op[recv].waits, by_op[recv].other_tags, by_op[recv].peer_node) == (
        Waits.MATCH,
        (3,),
        0,
    )
    assert (by_op[send].waits, by_op[send].other_tags) == (Waits.MATCH, (5,))
    assert by_op[recv].detail() == (
        "rank 1 on this node has posted no send to rank 0 with tag 5; "
        "its sends to rank 0 with tags 3 wait here for their recvs"
    )
    assert by_op[send].detail() == (
        "rank 0 on this node has posted no recv from rank 1 with tag 3; "
        "it has recvs from rank 1 posted with tags 5"
    )


def test_a_remote_sender_on_another_tag_is_named() -> None:
    net = layout()
    net.recv(1, src=0, dst=2, nbytes=1, tag=5)
    net.send(0, src=0, dst=2, data=b"x", tag=3)
    net.run()
    net.advance(STALL)
    [stall] = reported(net, 1)
    assert (stall.waits, stall.other_tags) == (Waits.RTS, (3,))
    [sender] = reported(net, 0)
    assert sender.waits is Waits.CTS


def test_other_tags_are_bounded() -> None:
    net = layout()
    net.recv(0, src=1, dst=0, nbytes=1, tag=999)
    for tag in range(3 * MAX_OTHER_TAGS):
        net.send(0, src=1, dst=0, data=b"x", tag=tag)
    [stall] = net.engines[0].stalls(STALL)[:1]
    assert stall.other_tags == tuple(range(MAX_OTHER_TAGS))


def test_transfers_under_way_say_the_peer_posted_and_how_far_the_bytes_came() -> None:
    net = layout(auto_stream=False, auto_copy=False)
    net.recv(1, src=0, dst=2, nbytes=20)
    net.send(0, src=0, dst=2, data=bytes(20))
    net.recv(0, src=1, dst=0, nbytes=2)
    net.send(0, src=1, dst=0, data=b"xy")
    net.run()
    net.advance(STALL)
    waits = {(stall.send, stall.waits, stall.peer_posted) for stall in reported(net, 0)}
    assert waits == {(True, Waits.DONE, True), (True, Waits.COPY, True), (False, Waits.COPY, True)}
    [landing] = reported(net, 1)
    assert (landing.waits, landing.received, landing.peer_posted) == (Waits.DATA, 0, True)
    assert "0 of 20 B have arrived" in landing.detail()


def test_stalls_lists_the_longest_pending_first_and_only_past_stall_after() -> None:
    net = layout()
    first = net.recv(0, src=2, dst=0, nbytes=1)
    net.now = 4.0
    second = net.recv(0, src=3, dst=0, nbytes=1)
    net.now = 8.0
    net.recv(0, src=1, dst=0, nbytes=1)
    assert [s.op for s in net.engines[0].stalls(14.0)] == [first, second]
    assert [s.pending_for for s in net.engines[0].stalls(14.0)] == [14.0, 10.0]


def test_stalls_asks_keep_about_every_one_oldest_first_and_describes_at_most_limit() -> None:
    net = layout()
    ops = []
    for src in (1, 2, 3):
        ops.append(net.recv(0, src=src, dst=0, nbytes=1))
        net.now += 1.0
    asked: list[int] = []

    def keep(op: int, job: str) -> bool:
        asked.append(op)
        return op != ops[0]  # the asker may not see the oldest

    listed = net.engines[0].stalls(net.now + STALL, keep, limit=1)
    assert asked == ops  # every one, so the caller can count what it hides and leaves out
    assert [s.op for s in listed] == [ops[1]]


def test_without_stall_after_nothing_is_watched() -> None:
    net = FakeNet(2)  # the engine's default: the daemon always passes its setting
    net.attach(0, 0)
    net.attach(1, 1)
    net.run()
    net.recv(1, src=0, dst=1, nbytes=1)
    assert net.next_deadline() is None
    assert net.engines[1].stalls(1e9) == []


def test_a_client_leaving_cancels_its_stall_deadlines() -> None:
    net = layout()
    ops = [net.recv(0, src=2, dst=0, nbytes=1, tag=tag) for tag in range(100)]
    net.abandon(0, ops)
    net.advance(STALL)
    assert reported(net, 0) == []
    assert len(net.engines[0]._stall_at) == 0


# -- cost -------------------------------------------------------------------------------------
def _work_per_operation(
    monkeypatch: pytest.MonkeyPatch, n: int, stall_after: float | None
) -> float:
    """Lines of fabricd run per operation for ``n`` local messages, each a recv and a send that
    meet at once (the copy reported at once), then a stall check once they have all ended."""
    net = FakeNet(1, stall_after=stall_after)
    net.attach(0, 0)
    net.attach(0, 1)
    counter = WorkCounter(monkeypatch)
    with counter.counting():
        for _ in range(n):
            net.recv(0, src=1, dst=0, nbytes=1)
            net.send(0, src=1, dst=0, data=b"x")
            net.engines[0].next_deadline()  # the daemon re-arms after every input
        net.advance(STALL)
    assert net.engines[0].pending() == 0
    return counter.total / (2 * n)


def test_stall_bookkeeping_costs_a_few_lines_per_operation_whatever_is_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One heap push per post and one removal per end: a constant, amortised compaction
    included, never a scan of what is pending."""
    extra = [
        _work_per_operation(monkeypatch, n, STALL) - _work_per_operation(monkeypatch, n, None)
        for n in (500, 5_000)
    ]
    print(f"stall bookkeeping: {extra[0]:.1f} and {extra[1]:.1f} lines per operation")
    assert 0 < extra[0] <= 15
    assert extra[1] <= extra[0] * 1.3 + 1


def test_stalled_counts_what_stalls_lists() -> None:
    net = layout()
    net.recv(0, src=2, dst=0, nbytes=1)
    net.now = 5.0
    net.send(0, src=0, dst=3, data=b"x")
    engine = net.engines[0]
    assert [engine.stalled(now) for now in (9.9, 10.0, 15.0)] == [0, 1, 2]
    assert engine.stalled(15.0) == len(engine.stalls(15.0))
    assert FakeNet(1).engines[0].stalled(1e9) == 0


def _work_per_stall(monkeypatch: pytest.MonkeyPatch, n: int) -> float:
    """Lines of fabricd run per report when ``n`` sends and ``n`` receives between one pair of
    local ranks disagree on every tag (each side's operations are the other's other tags),
    then all stall at once and are reported, then listed."""
    net = FakeNet(1, stall_after=STALL)
    net.attach(0, 0)
    net.attach(0, 1)
    for tag in range(n):
        net.send(0, src=1, dst=0, data=b"x", tag=tag)
        net.recv(0, src=1, dst=0, nbytes=1, tag=n + tag)
    counter = WorkCounter(monkeypatch)
    with counter.counting():
        net.advance(STALL)
        listed = net.engines[0].stalls(STALL)
    assert len(reported(net, 0)) == len(listed) == 2 * n
    assert all(len(stall.other_tags) == MAX_OTHER_TAGS for stall in listed)
    return counter.total / (2 * n)


def test_a_job_whose_tags_all_disagree_costs_the_same_per_report_however_many_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Naming the other tags looks at a bounded number of the peer's operations: before, each
    report scanned every operation the peer posted between the pair, so 10^4 stalled
    operations on each side cost 10^8 steps in one timer callback (the loop stalled)."""
    small, large = (_work_per_stall(monkeypatch, n) for n in (200, 2_000))
    print(f"stall reports: {small:.0f} and {large:.0f} lines per operation")
    assert large <= small * 1.3 + 10
