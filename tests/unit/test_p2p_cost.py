"""The point-to-point engine's cost per operation does not grow with what is pending.

Issue 7 found cleanup that was quadratic: a client with 2 x 16k pending receives took 35 s to
abandon (a scan of the posted list per operation), and 20k CANCELs cost the remote daemon 21 s
(its queue rebuilt per CANCEL).  These tests count the work (workcount.py: lines of fabricd run
and operation records compared), never the time, for n and 10n pending operations: the work per
operation must stay flat.  Memory is measured with tracemalloc: what ended is given back.

Layout: job ``"j"`` of size 3; rank 0 on node 0, rank 1 on node 1, rank 2 never joins (so
operations with it wait with a route deadline).
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from typing import TYPE_CHECKING

import pytest
from workcount import WorkCounter

from fabricd.engines.actions import Complete, SendFrame
from fabricd.engines.membership import RankEntry, RankLeft
from fabricd.engines.p2p.matching import Messaging
from fabricd.engines.p2p.messages import Message
from fabricd.frames.p2p import Cancel, Done, Rts

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

JOB = "j"
SIZES = (1_000, 10_000)
#: work per operation at 10n over work per operation at n: flat is 1.0; the amortised rebuilds
#: (which a small engine never does) may add a little, a scan per operation adds 10x
FLAT = 1.3


class Table:
    """The rank table both nodes agree on (what membership would tell them)."""

    def __init__(self) -> None:
        self.entries = {
            (JOB, rank): RankEntry(job=JOB, rank=rank, size=3, node=rank) for rank in (0, 1)
        }

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self.entries.get((job, rank))


class Pair:
    """Two nodes' engines with ranks 0 (node 0) and 1 (node 1) joined on both."""

    def __init__(self, **options: int) -> None:
        self.table = Table()
        self.engines = [
            Messaging(node=node, routes=self.table, route_timeout=30.0, **options)
            for node in (0, 1)
        ]
        self.region = memoryview(bytearray(1))

    def leave(self, rank: int) -> RankLeft:
        """Rank ``rank``'s client left cleanly: the news both engines hear."""
        entry = self.table.entries.pop((JOB, rank))
        return RankLeft(entry=entry, reason=f"rank {rank} of job {JOB!r} disconnected", lost=False)

    def post_mixed(self, n: int) -> tuple[list[int], list[Rts]]:
        """Rank 0 posts ``n`` operations that wait, a quarter of each kind; return their ids and
        the RTS frames of the announced sends."""
        engine, ops, announced = self.engines[0], [], []
        for op in range(1, n + 1):
            match op % 4:
                case 0:  # a receive from rank 1: one long queue, every one on tag 0
                    engine.post_recv(op, message(src=1, dst=0), self.region, 0.0)
                case 1:  # a receive from rank 2, which never joins: a route deadline
                    engine.post_recv(op, message(src=2, dst=0), self.region, 0.0)
                case 2:  # a send to rank 1 nobody receives: announced (RTS)
                    [action] = engine.post_send(op, message(src=0, dst=1, tag=1), 0.0)
                    assert isinstance(action, SendFrame)
                    assert isinstance(action.frame, Rts)
                    announced.append(action.frame)
                case _:  # a send to rank 0 itself on a tag it never receives: queued here
                    assert engine.post_send(op, message(src=0, dst=0, tag=2), 0.0) == []
            ops.append(op)
        assert engine.pending() == n
        return ops, announced

    def queue_rts(self, n: int) -> list[Rts]:
        """Node 1 takes ``n`` RTS from node 0 for rank 1, all on one key, none received."""
        frames = [rts(msg) for msg in range(1, n + 1)]
        for frame in frames:
            assert self.engines[1].on_frame(0, frame, 0.0) == []
        assert self.engines[1].statistics().unexpected == n
        return frames


def message(*, src: int, dst: int, tag: int = 0) -> Message:
    return Message(job=JOB, src=src, dst=dst, tag=tag, nbytes=1, dtype="uint8")


def rts(msg: int) -> Rts:
    return Rts(msg=msg, job=JOB, src=0, dst=1, tag=0, nbytes=1, dtype="uint8")


def per_op(
    monkeypatch: pytest.MonkeyPatch, n: int, setup: Callable[[int], Callable[[], object]]
) -> float:
    """Work per operation of the step ``setup(n)`` returns (the setup itself is not counted)."""
    counter = WorkCounter(monkeypatch)
    step = setup(n)
    with counter.counting():
        step()
    return counter.total / n


def assert_flat(monkeypatch: pytest.MonkeyPatch, setup: Callable[[int], Callable[[], object]]):
    small, large = (per_op(monkeypatch, n, setup) for n in SIZES)
    print(f"work per operation: {small:.1f} at n={SIZES[0]}, {large:.1f} at n={SIZES[1]}")
    assert small > 0
    assert large <= FLAT * small, f"work per operation grew from {small:.1f} to {large:.1f}"


def shuffled(items: Sequence[int], seed: int = 7) -> list[int]:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


# -- work per operation -----------------------------------------------------------------------
def test_abandoning_n_pending_operations_does_work_in_proportion_to_n(monkeypatch):
    """The client's daemon: receives in one long queue and with deadlines, sends queued here
    and announced, abandoned in random order (from the middle of every queue)."""

    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        ops, _ = pair.post_mixed(n)
        order = shuffled(ops)

        def step() -> None:
            actions = pair.engines[0].abandon(order)
            pair.engines[0].next_deadline()  # the daemon re-arms its timer after an input
            assert sum(isinstance(a, SendFrame) for a in actions) == n // 4  # one CANCEL each
            assert pair.engines[0].pending() == 0

        return step

    assert_flat(monkeypatch, setup)


@pytest.mark.parametrize("random_order", [False, True])
def test_a_cancel_storm_does_work_in_proportion_to_the_cancels(monkeypatch, random_order):
    """The remote daemon: n queued RTS of one key, then their n CANCELs (the sender's client
    left), in the order sent or any order."""

    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        msgs = [frame.msg for frame in pair.queue_rts(n)]
        if random_order:
            msgs = shuffled(msgs)
        engine = pair.engines[1]

        def step() -> None:
            for msg in msgs:
                assert engine.on_frame(0, Cancel(msg=msg), 0.0) == []
            assert engine.statistics().unexpected == 0

        return step

    assert_flat(monkeypatch, setup)


def test_posting_n_unmatched_receives_does_work_in_proportion_to_n(monkeypatch):
    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        engine = pair.engines[0]

        def step() -> None:
            for op in range(1, n + 1):  # one key, and half of them wait for a route
                src = 1 + op % 2
                engine.post_recv(op, message(src=src, dst=0), pair.region, 0.0)
                engine.next_deadline()
            assert engine.pending() == n

        return step

    assert_flat(monkeypatch, setup)


def test_a_peer_going_down_does_work_in_proportion_to_what_it_held(monkeypatch):
    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        _, announced = pair.post_mixed(n)
        for frame in announced:  # node 1 holds them too, and queues its own for node 0
            pair.engines[1].on_frame(0, frame, 0.0)

        def step() -> None:
            failed = pair.engines[0].peer_down(1, "down")
            assert len(failed) == n // 4  # the announced sends
            assert pair.engines[1].peer_down(0, "down") == []
            assert pair.engines[1].statistics().unexpected == 0

        return step

    assert_flat(monkeypatch, setup)


def test_a_rank_leaving_does_work_in_proportion_to_what_waited_for_it(monkeypatch):
    """Rank 1's client leaves: node 0 fails the receives from it and refuses nothing; node 1
    answers every queued RTS to it with DONE receiver_left."""

    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        pair.post_mixed(n)
        pair.queue_rts(n)
        left = pair.leave(1)

        def step() -> None:
            on_1 = pair.engines[1].on_rank_event(left, 0.0)
            assert sum(isinstance(a, SendFrame) for a in on_1) == n
            on_0 = pair.engines[0].on_rank_event(left, 0.0)
            assert sum(isinstance(a, Complete) for a in on_0) == n // 4

        return step

    assert_flat(monkeypatch, setup)


@pytest.mark.slow
def test_abandoning_and_cancelling_10_5_operations_costs_what_10_3_do(monkeypatch):
    """The review's scale: 10^5 operations abandoned on their daemon, 10^5 CANCELs on the
    remote one, against 10^3 of each; work per operation counted, as above."""

    def abandon(n: int) -> Callable[[], object]:
        pair = Pair()
        ops, _ = pair.post_mixed(n)
        return lambda: pair.engines[0].abandon(shuffled(ops))

    def cancel(n: int) -> Callable[[], object]:
        pair = Pair()
        msgs = shuffled([frame.msg for frame in pair.queue_rts(n)])
        engine = pair.engines[1]
        return lambda: [engine.on_frame(0, Cancel(msg=msg), 0.0) for msg in msgs]

    for setup in (abandon, cancel):
        small, large = (per_op(monkeypatch, n, setup) for n in (1_000, 100_000))
        assert large <= FLAT * small, f"{setup.__name__}: {small:.1f} -> {large:.1f} per op"


def test_the_counter_sees_a_scan_per_operation(monkeypatch):
    """The yardstick itself: a C-level scan per abandoned receive (what the old engine did)
    shows as work that grows with n."""

    def setup(n: int) -> Callable[[], object]:
        pair = Pair()
        pair.post_mixed(n)
        engine = pair.engines[0]
        recvs = list(engine._recvs.values())  # a stand-in for the old list

        def step() -> None:
            for recv in random.Random(3).sample(recvs, len(recvs)):
                recvs.remove(recv)

        return step

    small, large = (per_op(monkeypatch, n, setup) for n in SIZES)
    assert large > 5 * small


# -- memory -----------------------------------------------------------------------------------
N_MEMORY = 30_000
#: what may stay behind after every operation ended (the engines' small tables, the interned
#: bits of a run); the tables of 30k ended operations held ~3 MB before they were rebuilt
RETAINED = 128 * 1024


def traced(step: Callable[[], object]) -> int:
    """Bytes still allocated after ``step`` that were not before it."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    step()
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


@pytest.fixture
def tracing():
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.mark.usefixtures("tracing")
def test_operations_that_were_abandoned_leave_no_memory_behind():
    pair = Pair()

    def post_and_abandon() -> None:
        ops, announced = pair.post_mixed(N_MEMORY)
        for frame in announced:
            pair.engines[1].on_frame(0, frame, 0.0)
        cancels = pair.engines[0].abandon(ops)
        for action in cancels:
            assert isinstance(action, SendFrame)
            assert isinstance(action.frame, Cancel)
            pair.engines[1].on_frame(0, action.frame, 0.0)
        pair.engines[0].next_deadline()

    assert traced(post_and_abandon) < RETAINED
    assert [engine.pending() for engine in pair.engines] == [0, 0]
    assert pair.engines[1].statistics().unexpected == 0


@pytest.mark.usefixtures("tracing")
def test_operations_that_timed_out_or_completed_leave_no_memory_behind():
    pair = Pair()
    engine = pair.engines[0]

    empty = memoryview(bytearray(0))

    def post_and_end() -> None:
        for op in range(1, N_MEMORY + 1):  # half wait for rank 2 and time out, half get a
            if op % 2:  # zero-byte message from rank 1
                zero = Message(job=JOB, src=1, dst=0, tag=op, nbytes=0, dtype="uint8")
                engine.post_recv(op, zero, empty, 0.0)
            else:
                engine.post_recv(op, message(src=2, dst=0, tag=op), pair.region, 0.0)
        for msg in range(1, N_MEMORY + 1, 2):  # a zero-byte message for each: DONE at once
            frame = Rts(msg=msg, job=JOB, src=1, dst=0, tag=msg, nbytes=0, dtype="uint8")
            [reply, done] = engine.on_frame(1, frame, 0.0)
            assert isinstance(reply, SendFrame)
            assert isinstance(reply.frame, Done)
            assert done == Complete(op=msg)
        timed_out = engine.on_timer(31.0)
        assert len(timed_out) == N_MEMORY // 2
        assert engine.next_deadline() is None

    assert traced(post_and_end) < RETAINED
    assert engine.pending() == 0


# -- the per-peer bound -----------------------------------------------------------------------
def test_a_peer_beyond_max_unmatched_rts_per_peer_is_refused_with_limit() -> None:
    pair = Pair(max_unmatched_rts_per_peer=3)
    engine = pair.engines[1]
    pair.queue_rts(3)
    [refusal] = engine.on_frame(0, rts(4), 0.0)
    assert isinstance(refusal, SendFrame)
    assert refusal.node == 0
    done = refusal.frame
    assert isinstance(done, Done)
    assert (done.msg, done.code) == (4, "limit")
    assert "max_unmatched_rts_per_peer" in str(done.error)
    assert engine.statistics().refused_rts == 1
    assert engine.statistics().unexpected == 3  # the refused one is not kept
    # a matching receive still takes a message past the bound: only unmatched RTS count
    engine.post_recv(100, message(src=0, dst=1), pair.region, 0.0)
    assert engine.statistics().unexpected == 2
    assert engine.on_frame(0, rts(5), 0.0) == []
    assert engine.statistics().unexpected == 3


def test_the_sender_of_a_refused_rts_fails_with_the_limit_and_its_setting() -> None:
    pair = Pair(max_unmatched_rts_per_peer=1)
    sender, receiver = pair.engines
    frames = []
    for op in (1, 2):
        [action] = sender.post_send(op, message(src=0, dst=1), 0.0)
        assert isinstance(action, SendFrame)
        frames.append(action.frame)
    assert receiver.on_frame(0, frames[0], 0.0) == []
    [refusal] = receiver.on_frame(0, frames[1], 0.0)
    assert isinstance(refusal, SendFrame)
    [failed] = sender.on_frame(1, refusal.frame, 0.0)
    assert isinstance(failed, Complete)
    assert failed.op == 2
    assert failed.failure is not None
    assert failed.failure.code == "limit"
    assert "max_unmatched_rts_per_peer" in failed.failure.message
    assert sender.pending() == 1  # the first still waits for its receive


def test_the_bound_is_per_peer_node() -> None:
    """Node 1 is full of node 0's messages; node 2's are still taken."""
    engine = Messaging(node=1, routes=Table(), route_timeout=30.0, max_unmatched_rts_per_peer=1)
    assert engine.on_frame(0, rts(1), 0.0) == []
    assert engine.on_frame(2, rts(1), 0.0) == []
    [refusal] = engine.on_frame(0, rts(2), 0.0)
    assert isinstance(refusal, SendFrame)
    assert refusal.node == 0
    assert engine.statistics().unexpected == 2
