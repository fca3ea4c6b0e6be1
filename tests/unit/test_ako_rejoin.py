"""A rank that comes back to an Ako exchange (fabricd/engines/ako/exchange.py, issue 29 item 4):
the handshake (HELLO, FRESH, JOIN), the survivors taking it back at one flush, and the model it
catches up from a survivor, without sockets.

What must hold: the survivors never wait for a rank that is gone (their steps and flushes go on
without it); the newcomer's open is answered with a survivor's model once the survivors flushed;
afterwards every replica is equal, and after more steps and a flush every replica equals that
model minus ``lr`` times every gradient made since, exactly (integer gradients), for any
partition count, any delivery order, and whenever the newcomer's HELLO reaches each survivor
(also when that newcomer dies again before it is taken back or during the flush that takes it
back, heard by each survivor before or after it completes that flush, and another opens).
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
    if data.draw(st.booleans(), label="it dies again before it is taken back"):
        fab.kill(dead)  # (membership says it left: its take-back is cancelled)
        for r in survivors:
            fab.act(r, fab.ex[r].left(dead))
        fab.revive(dead, nonce=2000 + dead)
        for _ in range(data.draw(st.integers(0, 6), label="its next HELLOs delivered first")):
            fab.deliver(picks[0])
    for r in sorted(told_late):
        fab.act(r, fab.ex[r].gone(dead))
    dies_in_flush = data.draw(st.booleans(), label="it dies during the flush that lists it")
    for flushes in range(1, 5):  # the survivors' flushes take it back (the next one it is in)
        fab.flush(survivors)
        if dies_in_flush and fab.opened[dead] is None:
            dies_in_flush = False  # (some survivors done with the flush, others not)
            for _ in range(data.draw(st.integers(0, 4 * n), label="frames before it dies")):
                fab.deliver(picks[0])
            fab.kill(dead)
            for r in data.draw(st.permutations(survivors), label="told in this order"):
                fab.act(r, fab.ex[r].left(dead))
                for _ in range(data.draw(st.integers(0, n), label="frames in between")):
                    fab.deliver(picks[0])
            fab.revive(dead, nonce=3000 + dead)  # (the next flush syncs, and takes it back)
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


# -- review findings (each once a hang or a divergence) ---------------------------------------
def _pick(fab: Fabric, pair: tuple[int, int]) -> int:
    return sorted(k for k, q in fab.queues.items() if q).index(pair)


def _deliver_pair(fab: Fabric, src: int, dst: int) -> None:
    while fab.queues.get((src, dst)):
        fab.deliver(_pick(fab, (src, dst)))


def _gone_and_settled(n: int, *dead: int, partitions: int = 1) -> Fabric:
    """``n`` ranks; the ``dead`` left, and the survivors flushed without them."""
    fab = Fabric(n, partitions, 0)
    fab.drain()
    for rank in dead:
        fab.kill(rank)
    survivors = [r for r in range(n) if r not in dead]
    for r in survivors:
        for rank in dead:
            fab.act(r, fab.ex[r].left(rank))
    fab.flush(survivors)
    fab.drain()
    assert not any(fab.busy)
    return fab


def _newcomer_in_its_flush(
    n: int, data: st.DataObject
) -> tuple[Fabric, list[int], int, list[int], set[int]]:
    """A rank drawn among ``n`` left and comes back as incarnation 77; its HELLO reaches a
    drawn set of the survivors; every survivor steps and flushes, and a drawn number of
    frames is delivered.  Returns the fabric, the delivery order drawn, the newcomer, the
    survivors and those its HELLO reached."""
    picks = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=30), label="order")
    newcomer = data.draw(st.integers(0, n - 1), label="newcomer")
    fab = _gone_and_settled(n, newcomer)
    survivors = [r for r in range(n) if r != newcomer]
    fab.revive(newcomer, nonce=77)
    reached = data.draw(st.sets(st.sampled_from(survivors), min_size=1), label="HELLO reaches")
    for r in survivors:
        if r not in reached:
            fab.queues.pop((newcomer, r), None)
    fab.drain(picks)
    for r in survivors:
        assert fab.step(r, np.full(SIZE, 2.0**r))
    fab.drain(picks)
    fab.flush(survivors)
    for _ in range(data.draw(st.integers(0, 8 * n), label="frames before it dies")):
        fab.deliver(picks[0])
    return fab, picks, newcomer, survivors, reached


def _steps_go_on(fab: Fabric, ranks: list[int], times: int = 3) -> None:
    for _ in range(times):
        for r in ranks:
            assert fab.step(r, np.ones(SIZE)), f"rank {r} is still held"
        fab.drain()
    assert not any(fab.busy[r] for r in ranks)


def _equal_after_a_round(fab: Fabric, ranks: list[int]) -> None:
    """Every rank of ``ranks`` steps once and they flush: every replica is equal."""
    for r in ranks:
        assert fab.step(r, np.full(SIZE, r + 1.0))
        fab.drain()
    fab.flush(ranks)
    fab.drain()
    assert not any(fab.busy)
    for r in ranks:
        np.testing.assert_array_equal(fab.ex[r].model, fab.ex[ranks[0]].model)


def test_a_newcomer_that_leaves_before_it_is_taken_back_is_not() -> None:
    """A1 (a): its departure cancels its admission; the survivors' steps go on."""
    fab = Fabric(3, 1, 0)
    fab.drain()
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.revive(2, nonce=77)
    fab.drain()
    assert fab.ex[2].phase == "joining"
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.flush([0, 1])
    fab.drain()
    assert 2 in fab.ex[0].gone_peers
    assert 2 in fab.ex[1].gone_peers
    _steps_go_on(fab, [0, 1])


def test_a_newcomer_superseded_during_the_flush_that_lists_it_is_not_taken_back() -> None:
    """A1 (b): incarnation 77 listed, 88's HELLO comes while the flush is open: 88 is taken
    back at the next flush, 77 never."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.drain()
    fab.flush([0, 1])
    fab.kill(2)
    fab.revive(2, nonce=88)
    for pair in [(2, 0), (2, 1)]:
        fab.deliver(_pick(fab, pair))
    fab.drain()
    assert not any(fab.busy)
    assert 2 in fab.ex[0].gone_peers
    assert fab.opened[2] is None
    _steps_go_on(fab, [0, 1], 1)
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    assert fab.ex[0]._nonce_of[2] == fab.ex[1]._nonce_of[2] == 88
    _equal_after_a_round(fab, [0, 1, 2])


def test_a_join_sync_lost_in_a_link_reset_is_sent_again() -> None:
    """A2: the lowest keeps the join SYNC until the newcomer is heard from; back, it is sent
    again."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.drain()
    fab.flush([0, 1])
    for src, dst in [(0, 1), (1, 0)]:
        _deliver_pair(fab, src, dst)
    assert not any(fab.busy)
    fab.queues.pop((0, 2), None)  # the join SYNC is lost with a reset of 2's links
    fab.queues.pop((1, 2), None)
    for r in (0, 1):
        fab.act(r, fab.ex[r].lose(2))
        fab.act(r, fab.ex[r].back(2))
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    _equal_after_a_round(fab, [0, 1, 2])


def test_a_newcomer_unreachable_when_taken_back_is_owed_and_sent_its_model_when_back() -> None:
    """A2: suspected between its HELLO and the flush: taken back lost, not live (the flush
    after waits for it), and its join SYNC goes when it is back."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.drain()
    for r in (0, 1):
        fab.act(r, fab.ex[r].lose(2))  # (its node's links reset: nothing reaches it)
    fab.flush([0, 1])
    fab.drain()
    assert not any(fab.busy)
    assert fab.ex[0].lost == {2}
    assert fab.opened[2] is None
    for r in (0, 1):
        fab.act(r, fab.ex[r].back(2))
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    _equal_after_a_round(fab, [0, 1, 2])


def test_the_next_lowest_sends_the_join_sync_when_the_lowest_goes_before_sending_it() -> None:
    """A3 (a): rank 0 dies before completing the flush that took rank 3 back at 1 and 2."""
    fab = _gone_and_settled(4, 3)
    fab.revive(3, nonce=77)
    fab.drain()
    fab.flush([0, 1, 2])
    for src, dst in [(0, 1), (0, 2), (1, 2), (2, 1)]:
        _deliver_pair(fab, src, dst)
    assert not fab.busy[1]
    assert not fab.busy[2]
    fab.kill(0)
    for r in (1, 2, 3):
        fab.act(r, fab.ex[r].left(0))
    fab.drain()
    assert fab.opened[3] == Opened(joined_from=1)
    _steps_go_on(fab, [1, 2], 1)
    fab.drain()
    _equal_after_a_round(fab, [1, 2, 3])


def test_a_newcomer_takes_a_second_join_sync_when_the_first_senders_flush_was_lost() -> None:
    """A3 (b): rank 0 sent its model and died with its markers: 1 and 2 took rank 1's, and
    so does the newcomer (by the difference, keeping what it applied since)."""
    fab = Fabric(4, 1, 0)
    fab.drain()
    fab.kill(3)
    for r in (0, 1, 2):
        fab.act(r, fab.ex[r].left(3))
    fab.revive(3, nonce=77)
    fab.drain()
    for r in (0, 1, 2):
        fab.step(r, np.full(SIZE, 10.0**r))
    fab.flush([0, 1, 2])
    for src, dst in [(1, 0), (2, 0)]:
        _deliver_pair(fab, src, dst)
    _deliver_pair(fab, 0, 3)
    assert fab.opened[3] == Opened(joined_from=0)
    fab.kill(0)
    for r in (1, 2, 3):
        fab.act(r, fab.ex[r].left(0))
    fab.drain()
    assert not any(fab.busy)
    for r in (2, 3):
        np.testing.assert_array_equal(fab.ex[r].model, fab.ex[1].model)
    _equal_after_a_round(fab, [1, 2, 3])


def test_a_marker_sent_again_on_back_lists_the_ranks_its_flush_takes_back() -> None:
    """A4: 0 and 1 lose each other around the flush; the marker 1 sends again says it takes
    3 back, so 0 (the lowest) does too and sends it its model."""
    fab = _gone_and_settled(4, 3)
    fab.revive(3, nonce=77)
    held = {k: fab.queues.pop(k) for k in [(3, 0), (3, 2)]}
    fab.drain()
    assert fab.ex[1]._joins == {3: 77}
    fab.act(0, fab.ex[0].lose(1))
    fab.act(1, fab.ex[1].lose(0))
    fab.flush([0, 1, 2])
    fab.drain()
    fab.act(0, fab.ex[0].back(1))
    fab.act(1, fab.ex[1].back(0))
    fab.drain()
    assert not any(fab.busy)
    assert fab.opened[3] == Opened(joined_from=0)
    fab.queues.update(held)
    fab.drain()
    _equal_after_a_round(fab, [0, 1, 2, 3])


def test_a_newcomer_waits_for_the_survivors_sync_of_a_rank_it_had_gone_itself() -> None:
    """A5: rank 2 dies after the take-back; the newcomer hears first, then adopts: it settles
    only what the SYNC says, so it takes the survivors' next SYNC as they do."""
    fab = _gone_and_settled(4, 3)
    fab.revive(3, nonce=77)
    fab.drain()
    fab.flush([0, 1, 2])
    for pair in [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]:
        _deliver_pair(fab, *pair)
    assert not any(fab.busy[:3])
    fab.step(2, np.full(SIZE, 8.0))  # rank 2's round reaches rank 0 only
    fab.deliver(_pick(fab, (2, 0)))
    fab.kill(2)
    fab.act(3, fab.ex[3].left(2))
    fab.deliver(_pick(fab, (0, 3)))
    assert fab.opened[3] == Opened(joined_from=0)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.flush([0, 1, 3])
    fab.drain()
    assert not any(fab.busy)
    _equal_after_a_round(fab, [0, 1, 3])


def test_a_newcomers_part_before_the_flush_taking_it_back_completes_is_held() -> None:
    """A6: its HELLOs to ranks 1 and 2 were lost; they learn it from rank 0's marker and
    relay it; its first part reaches 1 before 1's flush completes: held, not dropped."""
    fab = _gone_and_settled(4, 3)
    fab.revive(3, nonce=77)
    fab.queues[(3, 1)].clear()
    fab.queues[(3, 2)].clear()
    fab.drain()
    assert fab.ex[0]._joins == {3: 77}
    assert not fab.ex[1]._joins
    fab.flush([0, 1, 2])
    for pair in ((0, 1), (0, 2), (1, 0), (2, 0)):
        _deliver_pair(fab, *pair)  # (1 and 2 relay the listing to 0)
    assert fab.queues[(1, 2)][-1].joins == ((3, 77),)
    _deliver_pair(fab, 0, 3)
    assert fab.opened[3] == Opened(joined_from=0)
    assert fab.busy[1]
    assert fab.step(3, np.full(SIZE, 4.0))
    fab.deliver(_pick(fab, (3, 1)))
    fab.drain()
    assert not any(fab.busy)
    assert fab.ex[1]._got_from[3] == 1
    np.testing.assert_array_equal(fab.ex[1].model, fab.ex[0].model)
    _equal_after_a_round(fab, [0, 1, 2, 3])


def test_a_joining_rank_answers_a_first_openers_hello_at_once() -> None:
    """A7: rank 1 opens while rank 2 waits to be taken back: its open is answered, so the
    survivors can step, flush, and take rank 2 back."""
    fab = Fabric(3, 1, 0)
    for key in [k for k in fab.queues if 1 in k]:
        del fab.queues[key]
    fab.ex[1] = fab._make(1, fab.w0.copy())
    for r in (0, 2):  # rank 1's daemon answers for it (not open yet)
        fab.act(r, fab.ex[r].signal(1, Signal.FRESH, nonce=0, to=fab.nonces[r]))
    fab.drain()
    fab.kill(2)
    fab.act(0, fab.ex[0].left(2))
    fab.revive(2, nonce=77)
    fab.queues.pop((2, 1), None)
    fab.act(2, fab.ex[2].signal(1, Signal.FRESH, nonce=0, to=77))
    fab.drain()
    assert fab.ex[2].phase == "joining"
    fab.act(1, fab.ex[1].start())
    fab.drain()
    assert fab.opened[1] == Opened()
    fab.act(1, fab.ex[1].left(2))  # (rank 1's daemon hears rank 2 left, too)
    _steps_go_on(fab, [0, 1], 1)
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    _equal_after_a_round(fab, [0, 1, 2])


def test_a_survivor_stays_within_the_bound_of_the_newcomer_it_took_back() -> None:
    """A9: the newcomer adopts the lowest's clock; a survivor ahead of it hears it there."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.drain()
    fab.step(1, np.ones(SIZE))
    fab.step(0, np.ones(SIZE))
    fab.drain()
    fab.step(1, np.ones(SIZE))
    fab.drain()
    assert (fab.ex[0].clock, fab.ex[1].clock) == (1, 2)
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] is not None
    assert fab.ex[2].clock == 1
    for _ in range(10):
        fab.step(0, np.ones(SIZE))
        fab.step(1, np.ones(SIZE))
        fab.drain()
    ex = fab.ex[1]
    answered = ex.clock - (1 if ex.statistics().held else 0)
    assert answered - fab.ex[2].clock <= ex.bound


def test_markers_list_ranks_only_for_the_flush_at_hand_and_not_live_ones() -> None:
    """B3: a marker of a flush far ahead, or one listing a member with its own nonce, changes
    nothing (it once grew without bound and made a live peer gone)."""
    fab = Fabric(3, 1, 0)
    fab.drain()
    ex = fab.ex[0]
    frame: dict[str, Any] = {"round": None, "lo": 0, "payload": np.zeros(SIZE), "clock": 0}
    for f in range(5, 50):
        ex.received(1, **frame, flush=f, sent=0, nonce=2, to=1, joins=((2, 500 + f),))
    ex.received(1, **frame, flush=1, sent=0, nonce=2, to=1, joins=((2, 3),))
    assert not ex._joins_heard
    assert not ex.gone_peers


def test_a_marker_listing_an_incarnation_that_left_leaves_a_newer_member_alone() -> None:
    """Incarnation 66 left before it was taken back, 77 is a member: a marker for the next
    flush that lists 66 (late, or sent again) neither takes 66 back nor makes 77 gone."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=66)
    fab.drain()
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.revive(2, nonce=77)
    fab.drain()
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    ex = fab.ex[0]
    frame: dict[str, Any] = {"round": None, "lo": 0, "payload": np.zeros(1), "clock": 0}
    ex.received(1, **frame, flush=ex.statistics().flushes + 1, nonce=2, to=1, joins=((2, 66),))
    assert not ex.gone_peers
    assert ex._nonce_of[2] == 77
    assert not ex._joins_heard


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 5), st.data())
def test_the_lowest_survivor_dying_during_the_flush_that_takes_a_rank_back(
    n: int, data: st.DataObject
) -> None:
    """A3, at any point of the admitting flush (some survivors done with it, others not): the
    newcomer is taken back with a model the remaining survivors hold too, and after a round
    and a flush every replica is equal."""
    picks = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=30), label="order")
    fab = _gone_and_settled(n, n - 1)
    newcomer, survivors = n - 1, list(range(n - 1))
    fab.revive(newcomer, nonce=77)
    fab.drain(picks)
    for r in survivors:
        fab.step(r, np.full(SIZE, 2.0**r))
    fab.flush(survivors)
    for _ in range(data.draw(st.integers(0, 40), label="frames before rank 0 dies")):
        fab.deliver(picks[0])
    event(f"rank 0 done: {not fab.busy[0]}, the others: {not fab.busy[1]}")
    event(f"the newcomer had rank 0's model: {fab.opened[newcomer] is not None}")
    fab.kill(0)
    rest = list(range(1, n))
    for r in rest:
        fab.act(r, fab.ex[r].left(0))
    fab.drain(picks)
    assert not any(fab.busy)
    assert fab.opened[newcomer] is not None
    for r in rest:
        np.testing.assert_array_equal(fab.ex[r].model, fab.ex[1].model)
    _equal_after_a_round(fab, rest)


@settings(max_examples=200, deadline=None)
@given(st.integers(3, 5), st.data())
def test_a_rank_gone_at_any_point_of_a_flush_leaves_the_survivors_equal(
    n: int, data: st.DataObject
) -> None:
    """A rank goes at any point of a flush, some survivors done with it and others not (the
    lowest among them, or not; it may have stepped after its own flush, where the lowest
    survivor was done): every survivor's
    flush completes, and after a round and a flush every replica is equal.  (Once a survivor
    waited for a SYNC the lowest, done first, never sent.)"""
    picks = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=30), label="order")
    fab = Fabric(n, 1, 1)
    fab.drain(picks)
    everyone = list(range(n))
    _run_steps(fab, everyone, data.draw(grad_lists(n), label="before"), picks)
    fab.flush(everyone)
    for _ in range(data.draw(st.integers(0, 12 * n), label="frames before it goes")):
        fab.deliver(picks[0])
    dead = data.draw(st.sampled_from(everyone), label="dead")
    lowest = min(r for r in everyone if r != dead)
    # (it steps after its flush only where the lowest survivor is done with it too: where the
    # lowest was not, and another survivor done got that round, the round stays in some
    # replicas only: docs/ako.md says so)
    steps = not fab.busy[dead] and not fab.busy[lowest]
    if steps and data.draw(st.booleans(), label="it steps first"):
        fab.step(dead, np.full(SIZE, 3.0))
        for _ in range(data.draw(st.integers(0, n), label="its round's frames delivered")):
            fab.deliver(picks[0])
    fab.kill(dead)
    rest = [r for r in everyone if r != dead]
    for r in data.draw(st.permutations(rest), label="told in this order"):
        fab.act(r, fab.ex[r].left(dead))
    fab.drain(picks)
    assert not any(fab.busy)
    _equal_after_a_round(fab, rest)


def test_a_rank_gone_after_the_lowest_completed_the_flush_does_not_hold_the_others() -> None:
    """Rank 0 completed the flush with rank 2; rank 1 had not when rank 2 went: rank 0 sends
    its model at that flush, rank 1 takes it, and the next flush syncs again."""
    fab = Fabric(3, 1, 0)
    fab.drain()
    fab.flush([0, 1, 2])
    for pair in [(1, 0), (2, 0), (2, 1)]:
        fab.deliver(_pick(fab, pair))
    assert not fab.busy[0]
    assert fab.busy[1]
    fab.kill(2)
    for r in (1, 0):
        fab.act(r, fab.ex[r].left(2))
    fab.drain()
    assert not any(fab.busy)
    _equal_after_a_round(fab, [0, 1])


def test_a_newcomer_sent_its_model_by_the_next_lowest_takes_the_lowests_clock() -> None:
    """A9 where the lowest went before sending: rank 1 sends the join SYNC with the clock
    every survivor heard the newcomer at (rank 0's), so the gate still holds."""
    fab = _gone_and_settled(4, 3)
    fab.revive(3, nonce=77)
    fab.drain()
    for r in (1, 2):
        fab.step(r, np.ones(SIZE))
    fab.drain()
    fab.flush([0, 1, 2])
    for src, dst in [(0, 1), (0, 2), (1, 2), (2, 1)]:
        _deliver_pair(fab, src, dst)
    fab.kill(0)
    for r in (1, 2, 3):
        fab.act(r, fab.ex[r].left(0))
    fab.drain()
    assert fab.opened[3] == Opened(joined_from=1)
    assert fab.ex[3].clock == 0  # rank 0's: ranks 1 and 2 made a round more
    assert fab.ex[1]._heard[3] == fab.ex[2]._heard[3] == 0


def test_a_rank_gone_during_the_admitting_flush_of_a_newcomer_below_every_survivor() -> None:
    """Rank 0 comes back; rank 1 completes the admitting flush (and takes 0 back), rank 2 is
    still in it when rank 3 goes: the lowest of that flush's ranks (1, not the newcomer 0)
    sends rank 2 the model it waits for."""
    fab = _gone_and_settled(4, 0)
    fab.revive(0, nonce=77)
    fab.drain()
    fab.flush([1, 2, 3])
    for pair in [(2, 1), (3, 1), (1, 2)]:
        _deliver_pair(fab, *pair)
    assert not fab.busy[1]
    assert fab.busy[2]
    _deliver_pair(fab, 1, 0)
    assert fab.opened[0] == Opened(joined_from=1)
    fab.kill(3)
    for r in (0, 1, 2):
        fab.act(r, fab.ex[r].left(3))
    fab.drain()
    assert not fab.busy[2], "rank 2's flush waited for a model nobody sends"
    _equal_after_a_round(fab, [0, 1, 2])


def test_the_next_lowest_sends_the_join_sync_though_the_newcomer_is_below_it() -> None:
    """Rank 0 comes back; ranks 2 and 3 take it back, rank 1 (the lowest) goes before it sent
    the model: rank 2 sends it (the newcomer is below it, but has no model to send)."""
    fab = _gone_and_settled(4, 0)
    fab.revive(0, nonce=77)
    fab.drain()
    fab.flush([1, 2, 3])
    for pair in [(1, 2), (3, 2), (1, 3), (2, 3)]:
        _deliver_pair(fab, *pair)
    assert fab.busy[1]
    fab.kill(1)
    for r in (0, 2, 3):
        fab.act(r, fab.ex[r].left(1))
    fab.drain()
    assert fab.opened[0] == Opened(joined_from=2)


def test_a_newcomer_leaving_during_its_admitting_flush_hangs_no_flush() -> None:
    """Rank 1 completes the flush that takes rank 2 back, then hears it left; rank 0 hears it
    first: it does not take it back, but unsettles its rank, so both sync at the next flush
    (rank 1 once waited for a model rank 0 did not send)."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.queues.pop((2, 1))  # (its HELLO reaches rank 0 only)
    fab.drain()
    fab.flush([0, 1])
    _deliver_pair(fab, 0, 1)
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.drain()
    fab.flush([0, 1])
    fab.drain()
    assert not any(fab.busy)
    _equal_after_a_round(fab, [0, 1])


def test_a_listing_after_the_newcomer_left_does_not_take_it_back() -> None:
    """Rank 1 never heard incarnation 77 and hears a departure of rank 2 after the one it
    settled: the next nonce a marker lists (77) is the one that left, so rank 1 does not take
    it back (its next flush once waited for it), and unsettles it as rank 0 does."""
    fab = _gone_and_settled(3, 2)
    fab.revive(2, nonce=77)
    fab.queues.pop((2, 1))
    fab.drain()
    fab.flush([0, 1])
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.drain()
    assert fab.ex[1].gone_peers == {2}
    fab.flush([0, 1])
    fab.drain()
    assert not any(fab.busy)
    _equal_after_a_round(fab, [0, 1])


@settings(max_examples=200, deadline=None)
@given(st.integers(3, 5), st.data())
def test_a_newcomer_leaving_at_any_point_of_its_admitting_flush_leaves_the_survivors_equal(
    n: int, data: st.DataObject
) -> None:
    """The newcomer's HELLO reaches some survivors only; it dies at any point of the flush
    that lists it (taken back by some survivors, by none, or by all; it may have stepped once
    taken back), and each survivor hears it before or after completing that flush: every
    survivor's flushes complete, and after a round and a flush every replica is equal."""
    fab, picks, newcomer, survivors, _ = _newcomer_in_its_flush(n, data)
    if fab.opened[newcomer] is not None and data.draw(st.booleans(), label="it steps"):
        fab.step(newcomer, np.full(SIZE, 64.0))
        for _ in range(data.draw(st.integers(0, n), label="its round's frames delivered")):
            fab.deliver(picks[0])
    event(f"taken back by {sum(not fab.busy[r] for r in survivors)} of {n - 1} first")
    fab.kill(newcomer)
    for r in data.draw(st.permutations(survivors), label="told in this order"):
        fab.act(r, fab.ex[r].left(newcomer))
        for _ in range(data.draw(st.integers(0, 2 * n), label="frames in between")):
            fab.deliver(picks[0])
    fab.drain(picks)
    assert not any(fab.busy)
    fab.flush(survivors)
    fab.drain(picks)
    assert not any(fab.busy), "a survivor's flush waited for a model nobody sends"
    _equal_after_a_round(fab, survivors)
