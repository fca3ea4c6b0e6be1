"""A rank that comes back to an Ako exchange (fabricd/engines/ako/exchange.py, issue 29 item 4):
the handshake (HELLO, FRESH, JOIN), the survivors taking it back at one flush, and the model it
catches up from a survivor, without sockets.

What must hold: the survivors never wait for a rank that is gone (their steps and flushes go on
without it); the newcomer's open is answered with a survivor's model once the survivors flushed;
afterwards every replica is equal, and after more steps and a flush every replica equals that
model minus ``lr`` times every gradient made since, exactly (integer gradients), for any
partition count, any delivery order, and whenever the newcomer's HELLO reaches each survivor.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fabricd.engines.ako.exchange import (
    Exchange,
    Flushed,
    Opened,
    SendPart,
    SendSignal,
    Stepped,
)
from fabricd.errors import LocalProtocolError
from fabricd.frames.ako import Signal

LR = 0.5
SIZE = 9
Frame = SendPart | SendSignal


class Fabric:
    """``n`` exchanges, the frames between them, and what each trainer is waiting for."""

    def __init__(self, n: int, p: int, tau: int) -> None:
        self.n, self.p, self.tau = n, p, tau
        self.w0 = np.arange(SIZE, dtype=np.float64)
        self.ex: list[Exchange] = []
        self.nonces = [r + 1 for r in range(n)]
        self.queues: dict[tuple[int, int], deque[Frame]] = {}
        self.busy = [False] * n  #: a step or flush not answered yet
        self.opened: list[Opened | None] = [None] * n
        self.dead: set[int] = set()
        for r in range(n):
            self.ex.append(self._make(r, self.w0.copy()))
        for r in range(n):
            self.act(r, self.ex[r].start())

    def _make(self, rank: int, model: np.ndarray[Any, Any]) -> Exchange:
        return Exchange(
            rank=rank,
            ranks=self.n,
            model=model,
            partitions=self.p,
            lr=LR,
            staleness=self.tau,
            nonce=self.nonces[rank],
        )

    def act(self, rank: int, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendPart | SendSignal):
                if action.dst not in self.dead:
                    self.queues.setdefault((rank, action.dst), deque()).append(action)
            elif isinstance(action, Opened):
                assert self.opened[rank] is None, "opened twice"
                self.opened[rank] = action
            elif isinstance(action, Stepped):
                assert self.busy[rank]
                self.busy[rank] = False
                ex = self.ex[rank]
                slowest = ex.slowest
                assert slowest is None or ex.clock <= slowest + ex.bound
            else:
                assert isinstance(action, Flushed)
                assert self.busy[rank]
                self.busy[rank] = False

    def deliver(self, pick: int) -> bool:
        pairs = sorted(k for k, q in self.queues.items() if q)
        if not pairs:
            return False
        src, dst = pairs[pick % len(pairs)]
        frame = self.queues[(src, dst)].popleft()
        ex = self.ex[dst]
        if isinstance(frame, SendSignal):
            self.act(dst, ex.signal(src, frame.signal, nonce=frame.nonce, to=frame.to))
            return True
        fields = {
            name: getattr(frame, name)
            for name in SendPart.__slots__
            if name not in ("dst", "payload")
        }
        self.act(dst, ex.received(src, payload=frame.payload, **fields))
        return True

    def drain(self, picks: list[int] | None = None) -> None:
        for i in range(100_000):
            if not self.deliver(picks[i % len(picks)] if picks else 0):
                return
        raise AssertionError("frames without end")

    def step(self, rank: int, gradient: np.ndarray[Any, Any]) -> bool:
        if self.busy[rank] or rank in self.dead or self.opened[rank] is None:
            return False
        self.busy[rank] = True
        self.act(rank, self.ex[rank].step(gradient, 0.0))
        return True

    def flush(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.busy[rank] = True
            self.act(rank, self.ex[rank].flush(0.0))

    def kill(self, rank: int) -> None:
        """``rank``'s trainer and daemon die: what was on its way to or from it is lost."""
        self.dead.add(rank)
        for key in list(self.queues):
            if rank in key:
                del self.queues[key]
        self.busy[rank] = False
        self.opened[rank] = None

    def revive(self, rank: int, nonce: int) -> None:
        """A new trainer opens the exchange again, on a model that is not the job's."""
        self.dead.discard(rank)
        self.nonces[rank] = nonce
        self.ex[rank] = self._make(rank, np.full(SIZE, -99.0))
        self.act(rank, self.ex[rank].start())


def grad_lists(n: int) -> st.SearchStrategy[list[list[np.ndarray[Any, Any]]]]:
    grad = st.lists(st.integers(-8, 8), min_size=SIZE, max_size=SIZE).map(
        lambda xs: np.array(xs, dtype=np.float64)
    )
    return st.lists(st.lists(grad, min_size=n, max_size=n), min_size=1, max_size=5)


def _run_steps(fab: Fabric, ranks: list[int], rounds: list[list[Any]], picks: list[int]) -> Any:
    """Each of ``ranks`` makes every round's gradient, frames delivered in between; returns the
    sum of the gradients made."""
    total = np.zeros(SIZE)
    for grads in rounds:
        pending = list(ranks)
        for i in range(10_000):
            if not pending:
                break
            rank = pending[picks[i % len(picks)] % len(pending)]
            if fab.step(rank, grads[rank]):
                total += grads[rank]
                pending.remove(rank)
            elif not fab.deliver(picks[(i + 1) % len(picks)]):
                raise AssertionError(f"ranks {pending} wait with nothing in flight")
    for _ in range(10_000):  # steps held at the gate are let go as frames come
        if not any(fab.busy) or not fab.deliver(0):
            break
    assert not any(fab.busy)
    return total


@settings(max_examples=120, deadline=None)
@given(st.integers(3, 6), st.data())
def test_a_rank_that_comes_back_catches_up_and_the_sum_is_exact_again(
    n: int, data: st.DataObject
) -> None:
    p = data.draw(st.integers(1, n - 1), label="p")
    tau = data.draw(st.integers(0, 2), label="tau")
    picks = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=30), label="order")
    fab = Fabric(n, p, tau)
    fab.drain(picks)
    assert all(o == Opened() for o in fab.opened), "a first open is FRESH everywhere"
    everyone = list(range(n))
    _run_steps(fab, everyone, data.draw(grad_lists(n), label="before"), picks)

    dead = data.draw(st.integers(0, n - 1), label="dead")
    survivors = [r for r in everyone if r != dead]
    fab.kill(dead)
    # its links reset: it is lost to every survivor; membership's verdict (gone) comes now,
    # or only later (the HELLO of its return may come first)
    told_late = data.draw(st.sets(st.sampled_from(survivors)), label="told late")
    for r in survivors:
        fab.act(r, fab.ex[r].lose(dead))
        if r not in told_late:
            fab.act(r, fab.ex[r].gone(dead))
    _run_steps(fab, survivors, data.draw(grad_lists(n), label="without it"), picks)

    fab.revive(dead, nonce=1000 + dead)
    with pytest.raises(LocalProtocolError, match="not open yet"):
        fab.ex[dead].step(np.zeros(SIZE), 0.0)
    for _ in range(data.draw(st.integers(0, 6), label="HELLOs delivered first")):
        fab.deliver(picks[0])
    for r in sorted(told_late):
        fab.act(r, fab.ex[r].gone(dead))
    for flushes in range(1, 4):  # the survivors' flushes take it back (the next one it is in)
        fab.flush(survivors)
        fab.drain(picks)
        assert not any(fab.busy), "a survivor's flush waited for the rank that is gone"
        if fab.opened[dead] is not None:
            event(f"taken back at the survivors' flush number {flushes}")
            break
        _run_steps(fab, survivors, [[np.ones(SIZE)] * n], picks)
    opened = fab.opened[dead]
    assert opened is not None
    assert opened.joined_from == min(survivors)
    caught_up = fab.ex[survivors[0]].model.copy()
    for ex in fab.ex:
        np.testing.assert_array_equal(ex.model, caught_up)

    after = _run_steps(fab, everyone, data.draw(grad_lists(n), label="after"), picks)
    fab.flush(everyone)
    fab.drain(picks)
    assert not any(fab.busy)
    for ex in fab.ex:
        np.testing.assert_array_equal(ex.model, caught_up - LR * after)
        assert not ex.statistics().gone


def test_a_first_open_is_answered_once_every_peer_said_fresh() -> None:
    fab = Fabric(3, 2, 0)
    hello = fab.queues[(0, 1)][0]
    assert isinstance(hello, SendSignal)
    assert hello.signal is Signal.HELLO
    assert fab.opened == [None, None, None]
    for _ in range(4):  # rank 1's answers to 0 and 2, and 2's to 0, not yet
        fab.deliver(0)
    assert fab.opened[0] is None
    assert fab.ex[0].phase == "hello"
    fab.drain()
    assert fab.opened == [Opened()] * 3
    assert fab.ex[1]._nonce_of[0] == 1


def test_a_newcomer_answers_a_hello_only_once_it_is_taken_back() -> None:
    """Two ranks come back: the second's HELLO to the first (still joining) waits until the
    first knows who is gone; both end members, with the survivors' model."""
    fab = Fabric(4, 1, 0)
    fab.drain()
    for dead in (2, 3):
        fab.kill(dead)
        for r in (0, 1):
            fab.act(r, fab.ex[r].gone(dead))
    fab.revive(2, nonce=77)
    fab.drain()
    fab.revive(3, nonce=78)
    fab.drain()
    assert fab.ex[2].phase == fab.ex[3].phase == "joining"
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] == fab.opened[3] == Opened(joined_from=0)
    total = _run_steps(fab, [0, 1, 2, 3], [[np.full(SIZE, r + 1.0) for r in range(4)]], [0])
    fab.flush([0, 1, 2, 3])
    fab.drain()
    for ex in fab.ex:
        np.testing.assert_array_equal(ex.model, fab.w0 - LR * total)


def test_frames_for_an_earlier_incarnation_are_dropped() -> None:
    fab = Fabric(2, 1, 0)
    fab.drain()
    ex = fab.ex[0]
    before = ex.model.copy()
    stale: dict[str, Any] = {"round": 0, "lo": 0, "payload": np.ones(SIZE), "clock": 1}
    assert ex.received(1, **stale, nonce=2, to=999) == []  # for another incarnation of rank 0
    assert ex.received(1, **stale, nonce=555, to=1) == []  # from another incarnation of rank 1
    np.testing.assert_array_equal(ex.model, before)
    assert ex.signal(1, Signal.FRESH, nonce=2, to=999) == []
