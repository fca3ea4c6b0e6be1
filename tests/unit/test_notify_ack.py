"""The NOTIFY-ACK engine (fabricd/engines/stochastic/notify_ack.py) without sockets: a fake fabric
whose
delivery order hypothesis draws.

The fabric keeps, per ordered pair of ranks, a FIFO data channel (updates) and a FIFO control
channel (NOTIFY, ACK, barrier steps), as the daemon's two links do; across channels and pairs
any interleaving may happen.  An update lands in two steps (its first half, then the rest and
``landed``) with anything in between, so a torn slot can be seen, and the bytes sent are read
from the sender's buffer when they land, not when they were sent: a sender that rewrote its
update before the receiver had it would be caught.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.stochastic import graphs
from fabricd.engines.stochastic.notify_ack import (
    ACK,
    BARRIER,
    UPDATE,
    Failed,
    Reduced,
    Reducer,
    SendSignal,
    SendUpdate,
    Sync,
    build_schedule,
    update_size,
)
from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError

COUNT = 4  #: elements per model


def model(rank: int, round: int) -> np.ndarray[Any, Any]:
    """What rank ``rank`` hands round ``round``: distinct per rank and round."""
    return np.full(COUNT, 1000.0 * rank + round, dtype=np.float64)


@dataclass
class Fabric:
    graph: graphs.Graph
    sync: Sync
    rounds: int
    reducers: list[Reducer] = field(default_factory=list)
    data: dict[tuple[int, int], deque[Any]] = field(default_factory=dict)
    control: dict[tuple[int, int], deque[Any]] = field(default_factory=dict)
    #: updates half landed: (src, dst) -> (round, what was sent, the slot it lands in)
    half: dict[tuple[int, int], tuple[int, memoryview, memoryview]] = field(default_factory=dict)
    arrays: list[np.ndarray[Any, Any]] = field(default_factory=list)
    staged: dict[tuple[int, int], np.ndarray[Any, Any]] = field(default_factory=dict)
    calls: list[int] = field(default_factory=list)  #: calls made per rank
    results: list[list[Reduced]] = field(default_factory=list)
    failures: list[Failed] = field(default_factory=list)
    open: list[bool] = field(default_factory=list)
    resets: int = 0  #: link resets the fabric may still inject (between two ranks)

    def __post_init__(self) -> None:
        n = self.graph.n
        nbytes = COUNT * 8
        self.reducers = [
            Reducer(rank=r, graph=self.graph, sync=self.sync, dtype="float64", nbytes=nbytes)
            for r in range(n)
        ]
        self.arrays = [np.zeros(COUNT) for _ in range(n)]
        self.calls = [0] * n
        self.results = [[] for _ in range(n)]
        self.open = [False] * n

    # -- moves ---------------------------------------------------------------------------
    def moves(self) -> list[tuple[str, Any]]:
        """Every step the fabric could take next."""
        out: list[tuple[str, Any]] = []
        for rank in range(self.graph.n):
            if not self.open[rank] and self.calls[rank] < self.rounds:
                out.append(("call", rank))
        out += [("data", pair) for pair, q in self.data.items() if q or pair in self.half]
        out += [("control", pair) for pair, q in self.control.items() if q]
        if self.resets:
            out += [("reset", edge) for edge in self.graph.edges]
        return out

    def step(self, move: tuple[str, Any]) -> None:
        what, arg = move
        if what == "call":
            self.call(arg)
        elif what == "data":
            self.land(arg)
        elif what == "reset":
            self.reset(*arg)
        else:
            src, dst = arg
            tag, round = self.control[arg].popleft()
            self.perform(dst, self.reducers[dst].message(src, tag, round, 0.0))

    def call(self, rank: int) -> None:
        round = self.calls[rank]
        self.calls[rank] += 1
        self.arrays[rank][:] = model(rank, round)
        self.staged[rank, round] = model(rank, round)
        self.open[rank] = True
        self.perform(rank, self.reducers[rank].call(self.arrays[rank], 0.0))

    def reset(self, a: int, b: int) -> None:
        """The links between ``a`` and ``b`` reset: what was in flight either way is lost
        (a half-landed update stays torn in its slot), then both resume."""
        self.resets -= 1
        for pair in ((a, b), (b, a)):
            self.data.pop(pair, None)
            self.control.pop(pair, None)
            self.half.pop(pair, None)
        self.reducers[a].interrupted(b)
        self.reducers[b].interrupted(a)
        self.perform(a, self.reducers[a].resume(b))
        self.perform(b, self.reducers[b].resume(a))

    def land(self, pair: tuple[int, int]) -> None:
        src, dst = pair
        reducer = self.reducers[dst]
        if pair in self.half:  # the rest of a half-landed update
            round, payload, slot = self.half.pop(pair)
            half = len(payload) // 2
            slot[half:] = payload[half:]
            self.perform(dst, reducer.landed(src, round, 0.0))
            return
        round, payload = self.data[pair].popleft()
        if self.sync is Sync.NOTIFY_ACK:  # a sender is never more than a round ahead
            assert round <= reducer.executor.round + 1
        view = reducer.landing(src, round, len(payload))
        if view is None:  # sent again after a reset, and the slot had it: dropped
            return
        half = len(payload) // 2
        view[:half] = payload[:half]
        self.half[pair] = (round, payload, view)

    def perform(self, rank: int, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendUpdate):
                # the view, not a copy: the bytes are read when they land
                self.data.setdefault((rank, action.dst), deque()).append(
                    (action.round, action.payload)
                )
                if action.notify:
                    self.control.setdefault((rank, action.dst), deque()).append(
                        (UPDATE, action.round)
                    )
            elif isinstance(action, SendSignal):
                self.control.setdefault((rank, action.dst), deque()).append(
                    (action.tag, action.round)
                )
            elif isinstance(action, Reduced):
                self.open[rank] = False
                self.results[rank].append(action)
            else:
                assert isinstance(action, Failed)
                self.open[rank] = False
                self.failures.append(action)

    def run(self, choose: Any) -> None:
        for _ in range(100_000):
            moves = self.moves()
            if not moves:
                return
            self.step(moves[choose(len(moves))])
        raise AssertionError("the fabric did not settle")

    def expected(self, rank: int, round: int) -> np.ndarray[Any, Any]:
        """Round ``round``'s average at ``rank`` when every input is used (notify-ack)."""
        total = model(rank, round)
        for src in self.graph.in_neighbours[rank]:
            total += self.staged[src, round]
        return total / (1 + self.graph.in_degrees[rank])


GRAPHS = [
    graphs.all_to_all(4),
    graphs.expander(6),
    graphs.chain(4),
    graphs.ring(5),
    graphs.star(4),
    graphs.regular(6, 2, seed=3),
    graphs.all_to_all(1),
]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{g.kind}-{g.n}")
@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_notify_ack_never_deadlocks_and_every_reduce_uses_the_rounds_updates(
    graph: graphs.Graph, data: st.DataObject
) -> None:
    rounds = 4
    fabric = Fabric(graph, Sync.NOTIFY_ACK, rounds, resets=data.draw(st.integers(0, 3)))
    fabric.run(lambda n: data.draw(st.integers(0, n - 1)))
    assert not fabric.failures
    for rank in range(graph.n):
        results = fabric.results[rank]
        assert [r.round for r in results] == list(range(rounds))  # no deadlock: all answered
        for r in results:
            assert (r.inputs, r.torn, r.stale) == (graph.in_degrees[rank], 0, 0)
        np.testing.assert_array_equal(fabric.arrays[rank], fabric.expected(rank, rounds - 1))
        # F7 in small: through resets, every NOTIFY and every ACK was taken exactly once
        stats = fabric.reducers[rank].statistics()
        assert stats.notifies == rounds * graph.in_degrees[rank]
        assert stats.acks == rounds * graph.out_degrees[rank]


@pytest.mark.parametrize("sync", [Sync.BARRIER, Sync.ASYNC])
@pytest.mark.parametrize("graph", GRAPHS[:4], ids=lambda g: f"{g.kind}-{g.n}")
@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_barrier_and_async_never_reduce_a_torn_or_mixed_version_update(
    graph: graphs.Graph, sync: Sync, data: st.DataObject
) -> None:
    rounds = 4
    fabric = Fabric(graph, sync, rounds, resets=data.draw(st.integers(0, 2)))
    fabric.run(lambda n: data.draw(st.integers(0, n - 1)))
    assert not fabric.failures
    for rank in range(graph.n):
        results = fabric.results[rank]
        assert [r.round for r in results] == list(range(rounds))
        for r in results:
            assert r.inputs + r.torn + r.stale == graph.in_degrees[rank]
    # each value of an average is (model + used inputs) / (1 + used): with models that are
    # whole numbers per (rank, round), a torn input would leave a value no whole set gives
    for rank in range(graph.n):
        value = fabric.arrays[rank][0]
        assert np.all(fabric.arrays[rank] == value)  # never half of one update, half another


def test_a_notify_before_its_update_waits_for_it() -> None:
    graph = graphs.chain(2)
    fabric = Fabric(graph, Sync.NOTIFY_ACK, 1)
    fabric.call(1)  # the receiver waits for rank 0
    fabric.call(0)
    fabric.step(("control", (0, 1)))  # NOTIFY first
    assert fabric.results[1] == []
    fabric.land((0, 1))  # half the update
    assert fabric.results[1] == []
    fabric.land((0, 1))  # all of it: now the reduce runs
    assert fabric.results[1] == [Reduced(round=0, inputs=1, torn=0, stale=0)]
    np.testing.assert_array_equal(fabric.arrays[1], (model(0, 0) + model(1, 0)) / 2)


def test_an_update_before_the_ack_of_the_last_is_refused() -> None:
    graph = graphs.chain(2)
    reducer = Reducer(rank=1, graph=graph, sync=Sync.NOTIFY_ACK, dtype="float32", nbytes=8)
    with pytest.raises(RemoteProtocolError, match="before rank 1 ACKed round 0"):
        reducer.landing(0, 1, update_size(8))
    with pytest.raises(RemoteProtocolError, match="not an in-neighbour"):
        reducer.landing(2, 0, update_size(8))
    with pytest.raises(RemoteProtocolError, match="an update of 9 bytes"):
        reducer.landing(0, 0, 9)


def test_barrier_reduce_skips_a_torn_slot_and_counts_it() -> None:
    graph = graphs.chain(2)
    fabric = Fabric(graph, Sync.BARRIER, 1)
    fabric.call(0)
    fabric.land((0, 1))  # only the first half: header says round 0, footer nothing
    fabric.call(1)
    fabric.run(lambda n: n - 1)  # barrier messages first: the rest stays behind
    assert fabric.results[1] == [Reduced(round=0, inputs=0, torn=1, stale=0)]
    np.testing.assert_array_equal(fabric.arrays[1], model(1, 0))
    assert fabric.reducers[1].statistics().used == (1, 0)


def test_async_uses_each_update_once() -> None:
    graph = graphs.chain(2)
    fabric = Fabric(graph, Sync.ASYNC, 2)
    fabric.call(0)
    fabric.run(lambda n: n - 1)  # rank 0's update lands whole, then rank 1 calls twice
    assert [r.inputs for r in fabric.results[1]] == [1, 0]


def test_a_lost_neighbour_fails_notify_ack_and_barrier_but_not_async() -> None:
    graph = graphs.ring(3)
    for sync in (Sync.NOTIFY_ACK, Sync.BARRIER):
        reducer = Reducer(rank=0, graph=graph, sync=sync, dtype="float64", nbytes=8)
        reducer.call(np.zeros(1), 0.0)
        [failed] = reducer.lose(2, "node 4 went down", 0.0)
        assert isinstance(failed, Failed)
        assert failed.rank == 2
        assert "rank 2 was lost (node 4 went down)" in failed.message
        [again] = reducer.call(np.zeros(1), 0.0)
        assert isinstance(again, Failed)
        assert again.round == 1
    reducer = Reducer(rank=0, graph=graph, sync=Sync.ASYNC, dtype="float64", nbytes=8)
    assert reducer.lose(1, "left", 0.0) == []
    actions = reducer.call(np.ones(1), 0.0)
    assert not [a for a in actions if isinstance(a, SendUpdate)]  # no update to a lost rank
    assert isinstance(actions[-1], Reduced)


def test_a_notify_ack_neighbour_that_is_not_adjacent_may_go() -> None:
    graph = graphs.chain(4)
    reducer = Reducer(rank=0, graph=graph, sync=Sync.NOTIFY_ACK, dtype="float64", nbytes=8)
    assert reducer.lose(3, "left", 0.0) == []
    assert reducer.broken is None


def test_refusals() -> None:
    graph = graphs.chain(2)
    with pytest.raises(UsageError, match="averages float16, float32, float64"):
        Reducer(rank=0, graph=graph, sync=Sync.ASYNC, dtype="int32", nbytes=8)
    with pytest.raises(UsageError, match="whole number"):
        Reducer(rank=0, graph=graph, sync=Sync.ASYNC, dtype="float32", nbytes=6)
    with pytest.raises(UsageError, match="rank 5 is not a node"):
        build_schedule(5, graph, Sync.ASYNC)
    reducer = Reducer(rank=1, graph=graph, sync=Sync.NOTIFY_ACK, dtype="float32", nbytes=8)
    with pytest.raises(UsageError, match="8 bytes of float32"):
        reducer.call(np.zeros(2, np.float64), 0.0)
    reducer.call(np.zeros(2, np.float32), 0.0)
    with pytest.raises(LocalProtocolError, match="still open"):
        reducer.call(np.zeros(2, np.float32), 0.0)
    assert reducer.waiting_for() == ["NOTIFY from rank 0"]
    with pytest.raises(RemoteProtocolError):
        reducer.message(0, ACK, 0, 0.0)  # rank 1 sends nothing to rank 0
    with pytest.raises(RemoteProtocolError):
        reducer.message(0, BARRIER, 0, 0.0)


def test_float16_averages_in_float32() -> None:
    graph = graphs.chain(2)
    fabric_arrays = np.full(4, 60000.0, np.float16)  # a float16 sum would overflow
    receiver = Reducer(rank=1, graph=graph, sync=Sync.ASYNC, dtype="float16", nbytes=8)
    sender = Reducer(rank=0, graph=graph, sync=Sync.ASYNC, dtype="float16", nbytes=8)
    [update, _] = sender.call(np.full(4, 64000.0, np.float16), 0.0)
    assert isinstance(update, SendUpdate)
    view = receiver.landing(0, 0, len(update.payload))
    assert view is not None
    view[:] = update.payload
    receiver.landed(0, 0, 0.0)
    receiver.call(fabric_arrays, 0.0)
    np.testing.assert_array_equal(fabric_arrays, np.full(4, 62000.0, np.float16))
