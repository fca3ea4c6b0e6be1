"""Ako's partial gradient exchange (fabricd/engines/ako/exchange.py, cost.py) without sockets:
``n`` engines wired by per-pair queues that the test delivers in any order, under hypothesis.

What must hold (issue 29): with integer gradients, after any steps and a flush every replica
equals ``w0 - lr * (the sum of every rank's gradients)``, for any ``p``, any delivery order, and
with a peer lost and back; the staleness gate never lets a rank's clock run past
``min_i s_{j,i} + p + tau``; every gradient reaches every peer whole within ``p`` rounds.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fabricd.engines.ako.cost import partitions_for
from fabricd.engines.ako.exchange import (
    Exchange,
    Flushed,
    SendPart,
    Stepped,
    partition_bounds,
)
from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError

LR = 0.5
SIZE = 11


class Ring:
    """``n`` exchanges and the frames between them (a queue per ordered pair)."""

    def __init__(self, n: int, p: int, tau: int, w0: np.ndarray[Any, Any]) -> None:
        self.models = [w0.copy() for _ in range(n)]
        self.ex = [
            Exchange(rank=r, ranks=n, model=self.models[r], partitions=p, lr=LR, staleness=tau)
            for r in range(n)
        ]
        self.queues: dict[tuple[int, int], deque[SendPart]] = {}
        self.open = [False] * n  #: a step or flush not answered yet
        self.flushed = [0] * n  #: each rank's last flush completed
        self.total = np.zeros(SIZE)  #: every gradient of every rank
        self.sent_rounds = [0] * n

    def act(self, rank: int, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendPart):
                self.queues.setdefault((rank, action.dst), deque()).append(action)
            elif isinstance(action, Stepped):
                assert self.open[rank]
                self.open[rank] = False
                # the gate lets a rank compute its next gradient only within its bound
                ex = self.ex[rank]
                slowest = ex.statistics().slowest
                assert slowest is None or ex.clock <= slowest + ex.bound
            else:
                assert isinstance(action, Flushed)
                assert self.open[rank]
                self.open[rank] = False
                self.flushed[rank] = action.flush

    def step(self, rank: int, gradient: np.ndarray[Any, Any]) -> bool:
        ex = self.ex[rank]
        if self.open[rank]:
            return False
        self.open[rank] = True
        self.total += gradient
        self.act(rank, ex.step(gradient, 0.0))
        return True

    def deliver(self, pick: int, *, any_order: bool) -> bool:
        pairs = sorted(k for k, q in self.queues.items() if q)
        if not pairs:
            return False
        src, dst = pairs[pick % len(pairs)]
        queue = self.queues[(src, dst)]
        index = pick % len(queue) if any_order else 0
        frame = queue[index]
        del queue[index]
        self.act(
            dst,
            self.ex[dst].received(
                src,
                round=frame.round,
                lo=frame.lo,
                payload=frame.payload,
                clock=frame.clock,
                epoch=frame.epoch,
                flush=frame.flush,
                sent=frame.sent,
                sync=frame.sync,
                back=frame.back,
            ),
        )
        return True

    def drain(self) -> None:
        for _ in range(100_000):
            if not self.deliver(0, any_order=False):
                return
        raise AssertionError("frames without end")

    def flush_all(self) -> None:
        for _ in range(1000):  # steps held at the gate are let go as frames come
            if not any(self.open) or not self.deliver(0, any_order=False):
                break
        assert not any(self.open)
        for rank, ex in enumerate(self.ex):
            self.open[rank] = True
            self.act(rank, ex.flush(0.0))
        self.drain()
        assert not any(self.open), self.open


def gradients(n: int, steps: int) -> st.SearchStrategy[list[list[np.ndarray[Any, Any]]]]:
    grad = st.lists(st.integers(-8, 8), min_size=SIZE, max_size=SIZE).map(
        lambda xs: np.array(xs, dtype=np.float64)
    )
    return st.lists(st.lists(grad, min_size=n, max_size=n), min_size=1, max_size=steps)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6), st.data())
def test_after_a_flush_every_replica_holds_every_gradient_once(n: int, data: st.DataObject) -> None:
    p = data.draw(st.integers(1, n - 1), label="p")
    tau = data.draw(st.integers(0, 3), label="tau")
    rounds = data.draw(gradients(n, 8), label="gradients")
    w0 = np.arange(SIZE, dtype=np.float64)
    ring = Ring(n, p, tau, w0)
    any_order = data.draw(st.booleans(), label="any order")
    for grads in rounds:
        pending = list(range(n))
        for _ in range(10_000):
            if not pending:
                break
            rank = pending[data.draw(st.integers(0, len(pending) - 1))]
            if ring.step(rank, grads[rank]):
                pending.remove(rank)
            elif not ring.deliver(data.draw(st.integers(0, 99)), any_order=any_order):
                raise AssertionError("a rank held at the gate with nothing in flight")
            for _ in range(data.draw(st.integers(0, 3))):
                ring.deliver(data.draw(st.integers(0, 99)), any_order=any_order)
    ring.flush_all()
    expected = w0 - LR * ring.total
    for model in ring.models:
        np.testing.assert_array_equal(model, expected)


@settings(max_examples=100, deadline=None)
@given(st.integers(3, 5), st.data())
def test_a_peer_lost_and_back_is_owed_nothing_and_given_nothing_twice(
    n: int, data: st.DataObject
) -> None:
    """Rank ``lost`` cannot be reached for a while (both ways): the others go on without it
    and without waiting for it; when it is back it is sent its debt, and after a flush every
    replica is again the exact sum."""
    p = data.draw(st.integers(1, n - 1), label="p")
    rounds = data.draw(gradients(n, 8), label="gradients")
    lost = data.draw(st.integers(0, n - 1), label="lost")
    cut, heal = sorted(data.draw(st.lists(st.integers(0, len(rounds)), min_size=2, max_size=2)))
    w0 = np.zeros(SIZE)
    ring = Ring(n, p, 0, w0)
    cut_off = False

    def heal_now() -> None:
        for r in range(n):
            if r != lost:
                ring.act(r, ring.ex[r].back(lost))
                ring.act(lost, ring.ex[lost].back(r))

    for index, grads in enumerate(rounds):
        if index == cut:
            cut_off = True
            for r in range(n):
                if r != lost:
                    ring.act(r, ring.ex[r].lose(lost))
                    ring.act(lost, ring.ex[lost].lose(r))
        if index == heal and cut_off:
            cut_off = False
            heal_now()
        for rank in range(n):
            for _ in range(1000):
                if ring.step(rank, grads[rank]):
                    break
                assert ring.deliver(data.draw(st.integers(0, 99)), any_order=True)
    if cut_off:
        heal_now()
    ring.flush_all()
    for model in ring.models:
        np.testing.assert_array_equal(model, w0 - LR * ring.total)


def test_each_gradient_reaches_a_peer_whole_within_p_rounds() -> None:
    """One gradient, then ``p - 1`` empty rounds: each peer has all of it (the rotation;
    Alg. 1 line 9's ``i mod p`` would send each peer one part only, for ever)."""
    n, p = 4, 3
    ring = Ring(n, p, 10, np.zeros(SIZE))
    one = np.arange(1, SIZE + 1, dtype=np.float64)
    zero = np.zeros(SIZE)
    for t in range(p):
        for rank in range(n):
            assert ring.step(rank, one if (t == 0 and rank == 0) else zero)
        ring.drain()
    for rank in range(1, n):
        np.testing.assert_array_equal(ring.models[rank], -LR * one)


def test_bytes_per_round_are_the_model_over_p_to_each_peer() -> None:
    n, p = 5, 4
    ring = Ring(n, p, 10, np.zeros(400))
    ring.total = np.zeros(400)
    before = ring.ex[0].statistics().bytes_sent
    ring.open[0] = True
    ring.act(0, ring.ex[0].step(np.ones(400), 0.0))
    assert ring.ex[0].statistics().bytes_sent - before == (n - 1) * 400 // p * 8


def test_the_gate_holds_a_step_until_the_slowest_peer_is_heard() -> None:
    """p = 1, tau = 0: a rank may be one round ahead of what it heard; the second step is
    answered only once a peer's first round came."""
    a_model, b_model = np.zeros(4), np.zeros(4)
    a = Exchange(rank=0, ranks=2, model=a_model, partitions=1, lr=1.0, staleness=0)
    b = Exchange(rank=1, ranks=2, model=b_model, partitions=1, lr=1.0, staleness=0)
    first = a.step(np.ones(4), 0.0)
    assert Stepped(round=0) in first
    second = a.step(np.ones(4), 0.0)
    assert not any(isinstance(x, Stepped) for x in second)
    assert a.statistics().held
    with pytest.raises(LocalProtocolError):
        a.step(np.ones(4), 0.0)
    [part] = [x for x in b.step(np.ones(4), 0.0) if isinstance(x, SendPart)]
    got = a.received(1, round=part.round, lo=part.lo, payload=part.payload, clock=part.clock)
    assert got == [Stepped(round=1)]
    # a lost peer is not waited for
    third = a.step(np.ones(4), 0.0)
    assert not any(isinstance(x, Stepped) for x in third)
    assert a.lose(1) == [Stepped(round=2)]


def test_a_bad_part_is_refused_and_changes_nothing() -> None:
    model = np.zeros(6)
    ex = Exchange(rank=0, ranks=3, model=model, partitions=2, lr=1.0, staleness=0)
    ok = np.ones(3)
    for src, lo, payload in (
        (5, 0, ok),  # not a peer
        (0, 0, ok),  # itself
        (1, 4, ok),  # past the end
        (1, -1, ok),
        (1, 0, ok.astype(np.float32)),
        (1, 0, np.array([1.0, np.nan, 1.0])),
        (1, 0, np.zeros(0)),
    ):
        with pytest.raises(RemoteProtocolError):
            ex.received(src, round=0, lo=lo, payload=payload, clock=1)
    assert not model.any()
    assert ex.statistics().parts_received == 0


def test_a_peer_gone_for_good_is_forgotten_and_its_late_frames_dropped() -> None:
    model = np.zeros(4)
    ex = Exchange(rank=0, ranks=3, model=model, partitions=2, lr=1.0, staleness=0)
    ex.step(np.ones(4), 0.0)
    ex.flush(0.0)
    assert ex.gone(2) == []  # still waiting for rank 1's marker
    assert ex.received(2, round=0, lo=0, payload=np.ones(2), clock=1) == []
    np.testing.assert_array_equal(model, -np.ones(4))  # its frame is dropped: nothing applied
    assert ex.statistics().gone == (2,)


@settings(max_examples=100, deadline=None)
@given(st.integers(3, 5), st.data())
def test_survivors_of_a_rank_gone_mid_run_end_equal_among_themselves(
    n: int, data: st.DataObject
) -> None:
    """The last rank dies after some rounds; some of its frames never arrive (they were in
    flight).  The survivors go on without it, then flush: the lowest survivor's model goes to
    the others, and every survivor ends with the same model, which holds every survivor's
    gradients whole (the dead rank's, in whatever part reached rank 0)."""
    p = data.draw(st.integers(1, n - 1), label="p")
    rounds = data.draw(gradients(n, 6), label="gradients")
    dies = data.draw(st.integers(0, len(rounds)), label="dies at")
    dead = n - 1
    ring = Ring(n, p, 1, np.zeros(SIZE))
    for index, grads in enumerate(rounds):
        if index == dies:
            for (src, dst), queue in ring.queues.items():
                if src == dead and queue:  # in flight when it died: some lost
                    keep = data.draw(st.integers(0, len(queue)))
                    for _ in range(len(queue) - keep):
                        queue.pop()
                if dst == dead:
                    queue.clear()
            for r in range(dead):
                ring.act(r, ring.ex[r].lose(dead))
        for rank in range(n if index < dies else dead):
            for _ in range(1000):
                if ring.step(rank, grads[rank]):
                    break
                assert ring.deliver(data.draw(st.integers(0, 99)), any_order=True)
    if dies < len(rounds):
        for r in range(dead):
            ring.act(r, ring.ex[r].gone(dead))
        ring.queues = {k: q for k, q in ring.queues.items() if dead not in k}
        ring.open[dead] = False
        survivors = list(range(dead))
        for _ in range(1000):
            if not any(ring.open[r] for r in survivors) or not ring.deliver(0, any_order=False):
                break
        for r in survivors:
            ring.open[r] = True
            ring.act(r, ring.ex[r].flush(0.0))
        for _ in range(100_000):
            if not ring.deliver(data.draw(st.integers(0, 99)), any_order=True):
                break
        assert not any(ring.open[r] for r in survivors)
        for r in survivors[1:]:
            np.testing.assert_array_equal(ring.models[r], ring.models[0])
    else:
        ring.flush_all()
        for model in ring.models:
            np.testing.assert_array_equal(model, -LR * ring.total)


def test_an_exchange_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(UsageError):
        Exchange(rank=0, ranks=2, model=np.zeros(4, np.int64), partitions=1, lr=1.0, staleness=0)
    with pytest.raises(UsageError):
        Exchange(rank=0, ranks=2, model=np.zeros(4), partitions=5, lr=1.0, staleness=0)
    with pytest.raises(UsageError):
        Exchange(rank=0, ranks=2, model=np.zeros(4), partitions=1, lr=0.0, staleness=0)
    with pytest.raises(UsageError):
        Exchange(rank=2, ranks=2, model=np.zeros(4), partitions=1, lr=1.0, staleness=0)
    ex = Exchange(rank=0, ranks=2, model=np.zeros(4), partitions=1, lr=1.0, staleness=0)
    with pytest.raises(UsageError):
        ex.step(np.array([1.0, np.inf, 0.0, 0.0]), 0.0)
    with pytest.raises(UsageError):
        ex.step(np.zeros(3), 0.0)


def test_partitions_are_contiguous_and_cover_the_model() -> None:
    assert partition_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert partition_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_the_cost_model_keeps_the_bytes_per_second_at_the_bandwidth() -> None:
    """Eq. 3: p = ceil(gamma m (n - 1) / B), clamped to [1, elements]."""
    m, b = 4_000_000, 125_000_000.0  # 4 MB, 1 Gbit/s
    assert partitions_for(gamma=10.0, model_bytes=m, ranks=2, bandwidth=b, elements=10**6) == 1
    assert partitions_for(gamma=10.0, model_bytes=m, ranks=16, bandwidth=b, elements=10**6) == 5
    assert partitions_for(gamma=10.0, model_bytes=m, ranks=64, bandwidth=b, elements=10**6) == 21
    for n in (4, 8, 16, 64):
        p = partitions_for(gamma=10.0, model_bytes=m, ranks=n, bandwidth=b, elements=10**6)
        assert 10.0 * m * (n - 1) / p <= b  # sustainable
    assert partitions_for(gamma=1e9, model_bytes=m, ranks=8, bandwidth=b, elements=7) == 7
    with pytest.raises(UsageError):
        partitions_for(gamma=1.0, model_bytes=m, ranks=8, bandwidth=0.0, elements=7)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.data())
def test_a_rank_that_repartitions_midway_still_sends_everything_once(
    n: int, data: st.DataObject
) -> None:
    """A rank changes its partition count between two steps (``partitions="auto"`` after
    profiling): what it owed under the old cut goes first, and the sum stays exact."""
    rounds = data.draw(gradients(n, 6), label="gradients")
    ring = Ring(n, data.draw(st.integers(1, n - 1)), 2, np.zeros(SIZE))
    at = data.draw(st.integers(0, len(rounds)))
    for index, grads in enumerate(rounds):
        if index == at:
            ring.drain()
            for rank in range(n):
                ring.act(rank, ring.ex[rank].repartition(data.draw(st.integers(1, SIZE))))
        for rank in range(n):
            for _ in range(1000):
                if ring.step(rank, grads[rank]):
                    break
                assert ring.deliver(0, any_order=False)
    ring.flush_all()
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


def test_a_part_frame_round_trips_and_refuses_what_it_cannot_carry() -> None:
    from fabricd.frames.ako import Part

    spec = {"n": 4, "size": 10, "dtype": "float32", "lr": 0.5, "staleness": 2}
    part = Part(job="j", name="w", src=1, dst=2, round=7, lo=3, clock=8, spec=spec, epoch=1)
    assert Part.from_meta(part.to_meta()) == part
    marker = Part(
        job="j",
        name="w",
        src=1,
        dst=2,
        round=None,
        lo=0,
        clock=8,
        spec=spec,
        flush=2,
        sent=5,
        back=True,
    )
    assert Part.from_meta(marker.to_meta()) == marker
    meta = part.to_meta()
    for bad in (
        {"dst": 1},  # to itself
        {"sy": True},  # a SYNC of one round
        {"n": -1},  # a count of frames below 0
        {"spec": {**spec, "lr": 0.0}},
        {"spec": {**spec, "lr": 1}},
        {"spec": {k: v for k, v in spec.items() if k != "n"}},
        {"name": ""},
        {"lo": -1},
    ):
        with pytest.raises(RemoteProtocolError):
            Part.from_meta(meta | bad)


# -- found in review ---------------------------------------------------------------------------
def _cut(ring: Ring, a: int, b: int) -> None:
    ring.act(a, ring.ex[a].lose(b))
    ring.act(b, ring.ex[b].lose(a))


def _heal(ring: Ring, a: int, b: int) -> None:
    ring.act(a, ring.ex[a].back(b))
    ring.act(b, ring.ex[b].back(a))


def _flush(ring: Ring, rank: int) -> None:
    ring.open[rank] = True
    ring.act(rank, ring.ex[rank].flush(0.0))


def _three_stepped(p: int = 2) -> Ring:
    ring = Ring(3, p, 5, np.zeros(SIZE))
    for rank in range(3):
        assert ring.step(rank, np.full(SIZE, rank + 1.0))
    return ring


def test_a_peer_back_during_a_flush_is_sent_the_marker_it_missed() -> None:
    """Link 1-2 is down while rank 1 flushes, then heals: rank 2 gets rank 1's marker with
    its debt, and every flush completes with the exact sum (it used to hang)."""
    ring = _three_stepped()
    ring.drain()
    _cut(ring, 1, 2)
    _flush(ring, 1)
    _heal(ring, 1, 2)
    _flush(ring, 0)
    _flush(ring, 2)
    ring.drain()
    assert ring.flushed == [1, 1, 1]
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


def test_a_flush_waits_for_a_lost_peer_and_a_flap_forgets_nobody() -> None:
    """Link 0-1 flaps while rank 0's flush waits for rank 2: the flush waits for the lost
    peer to be back (not gone: nobody is forgotten), and two flushes later every replica is
    still the exact sum."""
    ring = _three_stepped()
    ring.drain()
    for rank in range(3):
        _flush(ring, rank)
    _cut(ring, 0, 1)
    ring.drain()
    assert ring.open[0]  # waits for rank 1, lost: back or gone decides
    _heal(ring, 0, 1)
    ring.drain()
    assert ring.flushed == [1, 1, 1]
    assert all(ex.statistics().gone == () for ex in ring.ex)
    for rank in range(3):
        assert ring.step(rank, np.full(SIZE, 10.0**rank))
    ring.flush_all()
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


def test_frames_lost_with_a_reset_do_not_hang_the_next_flush() -> None:
    """Round frames between ranks 0 and 1 are lost with their link; lost, then back: the
    debt after the reset carries its sender's count, so the flush completes (the lost parts
    are lost, as §4.3 allows)."""
    ring = _three_stepped()
    for pair in ((0, 1), (1, 0)):
        ring.queues.get(pair, deque()).clear()
    _cut(ring, 0, 1)
    _heal(ring, 0, 1)
    ring.drain()
    for rank in range(3):
        _flush(ring, rank)
    ring.drain()
    assert ring.flushed == [1, 1, 1]


def test_a_flush_marker_counts_a_repartition_s_frame_too() -> None:
    """Rank 1 repartitions, and its flush marker overtakes the frame with what it owed under
    the old cut: rank 0's flush waits for that frame, so the model is exact when it ends."""
    ring = Ring(2, 2, 5, np.zeros(SIZE))
    for rank in range(2):
        assert ring.step(rank, np.full(SIZE, rank + 1.0))
    ring.drain()
    ring.act(1, ring.ex[1].repartition(3))
    _flush(ring, 0)
    _flush(ring, 1)
    queue = ring.queues[(1, 0)]
    queue.rotate(-1)  # the marker first
    assert queue[0].flush == 1
    ring.deliver(0, any_order=False)
    assert ring.open[0]  # the repartition's frame is counted: not complete without it
    ring.drain()
    assert ring.flushed == [1, 1]
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


def test_the_gate_keeps_the_old_bound_after_a_repartition_to_fewer_parts() -> None:
    model = np.zeros(SIZE)
    ex = Exchange(rank=0, ranks=2, model=model, partitions=4, lr=1.0, staleness=0)
    for _ in range(4):
        assert any(isinstance(a, Stepped) for a in ex.step(np.ones(SIZE), 0.0))
    ex.repartition(1)
    slowest = ex.statistics().slowest
    assert slowest is not None
    assert ex.clock <= slowest + ex.bound  # the trainer let go at round 3 is within it
    held = ex.step(np.ones(SIZE), 0.0)
    assert not any(isinstance(a, Stepped) for a in held)  # the next one waits


def test_a_flush_marker_lost_in_a_reset_is_sent_again_on_back() -> None:
    """Both ranks flush; their markers are lost with the link 0-1 (reset), then it is back:
    each sends its open flush's marker again, so both flushes complete (they once waited for
    ever: ``back`` sent a marker only to a peer never sent one)."""
    ring = _three_stepped(p=1)  # (a marker then carries nothing else: the sum stays exact)
    ring.drain()
    for rank in range(3):
        _flush(ring, rank)
    for pair in ((0, 1), (1, 0)):
        ring.queues.get(pair, deque()).clear()
    _cut(ring, 0, 1)
    ring.drain()
    _heal(ring, 0, 1)
    ring.drain()
    assert ring.flushed == [1, 1, 1]
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


def test_a_marker_lost_after_its_sender_completed_the_flush_is_sent_again() -> None:
    """Rank 0 completes its flush; its marker to rank 1 was lost with the link, and it steps
    before the link is back: back, it sends the marker of that flush alone, then its debt (its
    round after the flush), which rank 1 applies after its own flush completes."""
    ring = _three_stepped(p=1)
    ring.drain()
    for rank in range(3):
        _flush(ring, rank)
    ring.queues[(0, 1)].clear()
    ring.drain()
    assert ring.flushed == [1, 0, 1]
    _cut(ring, 0, 1)
    assert ring.step(0, np.full(SIZE, 7.0))
    ring.drain()
    _heal(ring, 0, 1)
    ring.drain()
    assert ring.flushed == [1, 1, 1]
    for rank in (1, 2):
        assert ring.step(rank, np.full(SIZE, 10.0**rank))
    ring.flush_all()
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 4), st.data())
def test_a_reset_at_any_point_of_a_flush_hangs_no_flush(n: int, data: st.DataObject) -> None:
    """Link a-b resets at any point of a flush, the frames on it lost (markers among them);
    a rank done with its flush may step before the link is back: every flush completes, and
    the sum is exact (``p = 1`` and rounds delivered before the flush: a marker carries
    nothing else, and a round made after the reset is a debt)."""
    ring = Ring(n, 1, 5, np.zeros(SIZE))
    for rank in range(n):
        assert ring.step(rank, np.full(SIZE, rank + 1.0))
    ring.drain()
    for rank in range(n):
        _flush(ring, rank)
    for _ in range(data.draw(st.integers(0, 2 * n * n), label="frames before the reset")):
        ring.deliver(data.draw(st.integers(0, 99)), any_order=False)
    a, b = data.draw(st.permutations(range(n)), label="link")[:2]
    for pair in ((a, b), (b, a)):
        ring.queues.get(pair, deque()).clear()
    _cut(ring, a, b)
    for rank in (a, b):
        if not ring.open[rank] and data.draw(st.booleans(), label=f"rank {rank} steps"):
            assert ring.step(rank, np.full(SIZE, 10.0))
    event(f"done before the reset: {sorted(r for r in (a, b) if ring.flushed[r])}")
    ring.drain()
    _heal(ring, a, b)
    ring.drain()
    assert ring.flushed == [1] * n
    ring.flush_all()
    for model in ring.models:
        np.testing.assert_array_equal(model, -LR * ring.total)
