"""The persistent collective engine on a simulated fabric: no sockets, a fake clock, numpy data.

Each node runs one :class:`Collective`; messages travel on FIFO links between node pairs (as
the daemon's data links do) and are delivered in an order hypothesis draws, while ranks call in
an order it draws too.  Partial-mode gifts are unit vectors (gift ``k`` of rank ``r`` sets one
element of its own), so a result says exactly which gifts it counted: every gift must be in
exactly one result or still wait at its node (conservation, no loss, no double count).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from random import Random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.dtypes import is_float
from fabricd.engines.collectives.algorithms import Algorithm
from fabricd.engines.collectives.persistent import (
    Action,
    Collective,
    Deliver,
    Fail,
    Spec,
    Transmit,
    initiator,
)
from fabricd.engines.collectives.spec import algorithm, asked, chosen
from fabricd.errors import RemoteProtocolError, UsageError

JOB, NAME = "job", "grad"
#: seconds a sync round may still end after a rank left (the daemon uses suspect_after)
GRACE = 5.0


class Recording(Collective):
    """A collective that keeps every round's result (each node has its own copy)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.history: dict[int, np.ndarray[Any, Any]] = {}
        self.views: dict[int, Any] = {}  #: the view each round ended in
        super().__init__(*args, **kwargs)

    def _ended(self, round: int, now: float) -> None:
        super()._ended(round, now)
        assert round not in self.history, "a round ended twice"
        self.history[round] = self.result[: self.spec.count].copy()
        self.views[round] = self.view


@dataclass
class Fabric:
    """Nodes, FIFO links, and every call's outcome."""

    spec: Spec
    placement: tuple[int, ...]  #: the node of each rank
    rng: Random
    colls: dict[int, Recording] = field(default_factory=dict)
    links: dict[tuple[int, int], deque[Transmit]] = field(default_factory=dict)
    delivered: dict[int, Deliver] = field(default_factory=dict)
    failed: dict[int, Fail] = field(default_factory=dict)
    down: set[int] = field(default_factory=set)
    now: float = 0.0

    def __post_init__(self) -> None:
        live = frozenset(range(len(self.placement)))
        for node in sorted(set(self.placement)):
            self.colls[node] = Recording(
                self.spec, job=JOB, name=NAME, node=node, ranks=self.placement, live=live
            )

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def perform(self, node: int, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Transmit():
                    self.links.setdefault((node, action.node), deque()).append(action)
                case Deliver():
                    assert action.token not in self.delivered, "a call completed twice"
                    self.delivered[action.token] = action
                case Fail():
                    self.failed[action.token] = action

    def call(self, rank: int, token: int, array: np.ndarray[Any, Any] | None) -> None:
        node = self.placement[rank]
        self.perform(node, self.colls[node].call(rank, token, array, self.tick()))

    def deliver_one(self) -> bool:
        ready = [pair for pair, queue in self.links.items() if queue]
        if not ready:
            return False
        src, dst = self.rng.choice(ready)
        message = self.links[src, dst].popleft()
        if dst not in self.down and src not in self.down:
            self.deliver(src, dst, message)
        return True

    def deliver(self, src: int, dst: int, message: Transmit) -> None:
        """``message`` from ``src`` lands at ``dst`` as the service places it."""
        coll = self.colls[dst]
        now = self.tick()
        n = len(message.payload)
        if n:
            view = coll.landing(
                src, message.tag, message.round, 0, n, message.lost, message.base, now
            )
            if view is None:
                n = 0
            else:
                view[:] = message.payload
        self.perform(
            dst,
            coll.arrived(
                src, message.tag, message.round, n, message.lost, message.base, now, message.notes
            ),
        )

    def expire(self) -> bool:
        """Jump the clock to the earliest deadline of a node that is up and fire it; ``False``:
        no node has one."""
        due = [
            (deadline, node)
            for node, coll in self.colls.items()
            if node not in self.down and (deadline := coll.next_deadline()) is not None
        ]
        if not due:
            return False
        deadline, node = min(due)
        self.now = max(self.now, deadline)
        self.perform(node, self.colls[node].on_timer(self.now))
        return True

    def drain(self) -> None:
        for _ in range(100_000):
            if not self.deliver_one():
                return
        raise AssertionError("messages never stopped")

    def kill(self, node: int) -> None:
        """``node`` goes down: the others hear it (the peers engine) and lose its ranks
        (membership), in that order, as the daemon's services do."""
        self.down.add(node)
        live = frozenset(r for r, n in enumerate(self.placement) if n not in self.down)
        for other, coll in self.colls.items():
            if other not in self.down:
                self.perform(other, coll.lose(node, f"node {node} went down", self.tick()))
                for rank, home in enumerate(self.placement):
                    if home == node:
                        actions = coll.rank_gone(rank, live, self.tick(), grace=GRACE)
                        self.perform(other, actions)


PLACEMENTS = [
    (0,),
    (0, 0),
    (0, 1),
    (0, 1, 2),
    (0, 0, 1),
    (0, 1, 0, 1, 2),
    (0, 0, 1, 1, 2, 2, 3, 3),
    (0, 1, 2, 3, 4),
]
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]


# -- sync ------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    placement=st.sampled_from(PLACEMENTS),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
    dtype=st.sampled_from(DTYPES),
    algorithm=st.sampled_from(["doubling", "ring", "tree"]),
    count=st.integers(0, 13),
    seed=st.integers(0, 2**32 - 1),
)
def test_sync_allreduce_equals_numpy_every_round(
    placement: tuple[int, ...], op: str, dtype: str, algorithm: str, count: int, seed: int
) -> None:
    rng = Random(seed)
    spec = asked(Spec(kind="allreduce", count=count, dtype=dtype, op=op, algorithm=algorithm))
    fab = Fabric(spec, placement, rng)
    size = len(placement)
    for round in range(3):
        inputs = [np.array([rng.randint(-20, 20) for _ in range(count)], dtype) for _ in placement]
        arrays = [x.copy() for x in inputs]
        order = list(range(size))
        rng.shuffle(order)
        for rank in order:  # calls interleaved with message deliveries
            fab.call(rank, round * size + rank, arrays[rank])
            for _ in range(rng.randint(0, 3)):
                fab.deliver_one()
        fab.drain()
        stacked = np.stack(inputs) if count else np.zeros((size, 0), dtype)
        match op:
            case "sum":
                want = stacked.sum(axis=0, dtype=dtype)
            case "avg":
                total = stacked.sum(axis=0, dtype=dtype)
                want = total / size if is_float(np.dtype(dtype)) else total // size
            case "max":
                want = stacked.max(axis=0)
            case _:
                want = stacked.min(axis=0)
        for rank in range(size):
            result = fab.delivered[round * size + rank]
            assert (result.round, result.included, result.active) == (round, True, size)
            np.testing.assert_allclose(
                arrays[rank].astype("float64"), want.astype("float64"), rtol=2e-3
            )
        # every rank has the very same bits
        assert all(np.array_equal(arrays[0], a) for a in arrays)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_broadcast_and_barrier_from_every_root(placement: tuple[int, ...]) -> None:
    size = len(placement)
    for root in range(size):
        fab = Fabric(
            Spec(kind="broadcast", count=5, dtype="int32", root=root), placement, Random(root)
        )
        arrays = [np.full(5, rank, "int32") for rank in range(size)]
        for round in range(3):
            for rank in range(size):
                arrays[rank][:] = rank + 100 * round
                fab.call(rank, round * size + rank, arrays[rank])
            fab.drain()
            assert all((a == root + 100 * round).all() for a in arrays)
            assert all(fab.delivered[round * size + r].round == round for r in range(size))
    fab = Fabric(Spec(kind="barrier"), placement, Random(1))
    for rank in range(size - 1):
        fab.call(rank, rank, None)
    fab.drain()
    assert not fab.delivered  # nobody passes before the last rank came
    fab.call(size - 1, size - 1, None)
    fab.drain()
    assert sorted(fab.delivered) == list(range(size))


def test_a_sync_collective_refuses_a_call_that_disagrees_and_a_second_open_call() -> None:
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1), Random(0))
    fab.call(0, 1, np.zeros(2, "float32"))
    with pytest.raises(UsageError, match="already has a call"):
        fab.call(0, 2, np.zeros(2, "float32"))
    assert Spec(kind="allreduce", count=2, dtype="float32").same_call(fab.spec)
    assert not Spec(kind="allreduce", count=3, dtype="float32").same_call(fab.spec)


@pytest.mark.parametrize("theirs", ["ring", "doubling", "tree"])
@pytest.mark.parametrize("mine", ["auto", "ring", "doubling", "tree"])
def test_the_algorithm_is_part_of_what_every_call_agrees_on(mine: str, theirs: str) -> None:
    """A collective built for one algorithm (its first call's; under ``"auto"`` the size rule
    picked the ring here) agrees with a call only for the same algorithm, and the words of a
    disagreement name both."""
    base = Spec(kind="allreduce", count=4, dtype="float32")
    built = chosen(replace(base, algorithm=mine), 3, ring_from_bytes=0)
    call = asked(replace(base, algorithm=theirs))
    assert built.same_call(asked(replace(base, algorithm=mine)))
    assert built.same_call(call) == (mine == theirs)
    if mine != theirs:
        assert f"algorithm {mine}" in built.describe(call)
        assert f"algorithm {theirs}" in call.describe(built)
    assert Spec.from_meta(built.to_meta()) == built  # it travels in every COLL frame
    assert "algorithm" not in base.describe()  # "auto" alone is not named


def test_an_algorithm_is_checked_and_fixes_ring_and_direct() -> None:
    base = Spec(kind="allreduce", count=1 << 20, dtype="float32")
    assert algorithm(chosen(base, 4, ring_from_bytes=1)) is Algorithm.DIRECT
    assert algorithm(chosen(base, 9, ring_from_bytes=1)) is Algorithm.RING
    assert algorithm(chosen(base, 4, ring_from_bytes=1 << 30)) is Algorithm.RECURSIVE_DOUBLING
    for name, want in [
        ("ring", Algorithm.RING),
        ("doubling", Algorithm.RECURSIVE_DOUBLING),
        ("tree", Algorithm.TREE),
        ("mlfabric", Algorithm.MLFABRIC),
    ]:
        for nbytes in (1, 1 << 30):  # the size rule does not apply
            spec = chosen(replace(base, algorithm=name), 4, ring_from_bytes=nbytes)
            spec.check()
            assert algorithm(spec) is want
    bad = [
        replace(base, algorithm="gossip"),
        replace(base, algorithm="mlfabric", mode="solo"),
        replace(base, algorithm="tree", ring=True),
        replace(base, algorithm="ring"),  # its ring not set: asked() sets it
        replace(base, algorithm="ring", ring=True, direct=True),
        Spec(kind="broadcast", count=1, algorithm="tree"),
    ]
    for spec in bad:
        with pytest.raises(UsageError, match="algorithm"):
            spec.check()
        with pytest.raises(RemoteProtocolError):
            Spec.from_meta(spec.to_meta())
    # an older peer's frame, without the field, means "auto"
    meta = chosen(base, 4, ring_from_bytes=1).to_meta()
    del meta["algorithm"]
    assert Spec.from_meta(meta).algorithm == "auto"


def test_a_dead_node_fails_every_waiting_sync_call_and_breaks_the_collective() -> None:
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1, 2), Random(0))
    fab.call(0, 1, np.ones(2, "float32"))
    fab.call(1, 2, np.ones(2, "float32"))
    fab.drain()
    fab.kill(2)
    assert set(fab.failed) == {1, 2}
    assert all(
        f.code == "peer_failed" and "needs every node" in f.message for f in fab.failed.values()
    )
    with pytest.raises(UsageError, match="needs every node"):
        fab.call(0, 3, np.ones(2, "float32"))


# -- solo and majority -------------------------------------------------------------------------
@dataclass
class Gifts:
    """Unit-vector gifts: element ``rank * per_rank + k`` is gift ``k`` of ``rank``."""

    size: int
    per_rank: int
    given: np.ndarray[Any, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.given = np.zeros(self.size * self.per_rank, "int64")

    def gift(self, rank: int, k: int) -> np.ndarray[Any, Any]:
        array = np.zeros(self.size * self.per_rank, "int64")
        array[rank * self.per_rank + k] = 1
        self.given += array
        return array


def run_partial(
    mode: str,
    placement: tuple[int, ...],
    rounds: int | list[int],
    rng: Random,
    *,
    kill: int | None = None,
    late: str = "latest",
    algorithm: str = "auto",
) -> tuple[Fabric, Gifts, dict[int, np.ndarray[Any, Any]], dict[int, tuple[int, int]]]:
    """Every rank calls ``rounds`` times (or rank ``r`` ``rounds[r]`` times), in an order and
    with deliveries and timers drawn from ``rng``; ``kill``: a node that goes down halfway.
    Returns the fabric, the gifts, each call's array (its result), and each call's (rank, k).
    Runs until nothing moves: every message delivered, every deadline fired."""
    size = len(placement)
    calls = [rounds] * size if isinstance(rounds, int) else rounds
    rounds = max(calls)
    gifts = Gifts(size, rounds)
    spec = asked(
        Spec(
            kind="allreduce",
            count=size * rounds,
            dtype="int64",
            mode=mode,
            late=late,
            algorithm=algorithm,
        )
    )
    fab = Fabric(spec, placement, rng)
    made = [0] * size
    open_: dict[int, int] = {}  #: rank -> open token
    arrays: dict[int, np.ndarray[Any, Any]] = {}
    who: dict[int, tuple[int, int]] = {}
    token = 0
    for _ in range(100_000):
        dead = fab.down
        for rank, t in list(open_.items()):
            if t in fab.delivered or t in fab.failed:
                del open_[rank]
        callers = [
            r
            for r in range(size)
            if made[r] < calls[r] and r not in open_ and placement[r] not in dead
        ]
        if kill is not None and kill not in dead and sum(made) >= sum(calls) // 2:
            fab.kill(kill)
            continue
        if rng.random() < 0.05:
            fab.expire()  # a deadline may fire early (the clock is the fabric's)
        elif callers and (rng.random() < 0.4 or not any(fab.links.values())):
            rank = rng.choice(callers)
            token += 1
            arrays[token] = gifts.gift(rank, made[rank])
            who[token] = (rank, made[rank])
            made[rank] += 1
            open_[rank] = token
            fab.call(rank, token, arrays[token])
        elif not fab.deliver_one() and not callers and not fab.expire():
            break  # nothing moves
    return fab, gifts, arrays, who


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["solo", "majority"]),
    placement=st.sampled_from(PLACEMENTS),
    rounds=st.integers(1, 5),
    algorithm=st.sampled_from(["auto", "tree"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_partial_results_count_every_gift_exactly_once(
    mode: str, placement: tuple[int, ...], rounds: int, algorithm: str, seed: int
) -> None:
    fab, gifts, arrays, who = run_partial(
        mode, placement, rounds, Random(seed), algorithm=algorithm
    )
    # each round's result is the same at every node; gather them from the calls that got them
    results: dict[int, np.ndarray[Any, Any]] = {}
    for token, done in fab.delivered.items():
        got = arrays[token]
        if done.round in results:
            np.testing.assert_array_equal(results[done.round], got)
        results[done.round] = got.copy()
        rank, k = who[token]
        assert bool(got[rank * rounds + k]) == done.included  # included: its gift is in it
        # active: the ranks with a gift in the result
        assert done.active == len({e // rounds for e in np.flatnonzero(got)})
    # every round ran once at every node, with the same result everywhere
    histories = [c.history for c in fab.colls.values()]
    assert all(h.keys() == histories[0].keys() for h in histories)
    for round, result in histories[0].items():
        assert all(np.array_equal(h[round], result) for h in histories)
        if round in results:
            np.testing.assert_array_equal(results[round], result)
    # conservation: everything given is in exactly one result, or still waits
    counted = sum(histories[0].values(), np.zeros_like(gifts.given))
    waiting = sum((c.conservation() for c in fab.colls.values()), np.zeros_like(gifts.given))
    np.testing.assert_array_equal(counted + waiting, gifts.given)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["solo", "majority"]),
    placement=st.sampled_from([p for p in PLACEMENTS if len(set(p)) >= 3]),
    algorithm=st.sampled_from(["auto", "tree"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_partial_modes_go_on_among_the_survivors_and_lose_no_gift(
    mode: str, placement: tuple[int, ...], algorithm: str, seed: int
) -> None:
    """A member node goes down halfway; the survivors rebuild the schedule among themselves
    (the tree: rooted at the first survivor, the root itself may be the one lost)."""
    rng = Random(seed)
    victim = rng.choice(sorted(set(placement)))
    rounds = 4
    fab, gifts, _arrays, who = run_partial(
        mode, placement, rounds, rng, kill=victim, algorithm=algorithm
    )
    survivors = [n for n in fab.colls if n != victim]
    for token, (rank, k) in who.items():
        if placement[rank] != victim:  # liveness: nothing waits for ever, nothing fails
            assert token in fab.delivered, f"call {k} of rank {rank} never completed"
    # exactly once (ledger.py): over the survivors' distinct results (a round of a view is
    # one allreduce, the same wherever it ended) and what still waits at them, every survivor
    # gift once; the victim's at most once (a result it was in may have died with it)
    results: dict[tuple[int, Any], np.ndarray[Any, Any]] = {}
    for node in survivors:
        coll = fab.colls[node]
        assert not coll.ledger.held, "a held snapshot was never settled"
        for round, result in coll.history.items():
            key = (round, coll.views[round])
            if key in results:
                np.testing.assert_array_equal(results[key], result)
            results[key] = result
    counted = sum(results.values(), np.zeros_like(gifts.given))
    counted += sum(fab.colls[n].conservation() for n in survivors)
    for rank, node in enumerate(placement):
        mine = slice(rank * rounds, (rank + 1) * rounds)
        if node != victim:
            np.testing.assert_array_equal(counted[mine], gifts.given[mine], f"rank {rank}")
        else:
            assert (counted[mine] <= gifts.given[mine]).all(), f"rank {rank} counted twice"
    assert all(fab.colls[n].lost == {victim} for n in survivors)


def test_majority_initiator_is_the_same_everywhere_and_skips_dead_ranks() -> None:
    live = frozenset(range(8))
    drawn = [initiator(JOB, NAME, r, 8, live) for r in range(4000)]
    assert drawn == [initiator(JOB, NAME, r, 8, live) for r in range(4000)]
    counts = np.bincount(drawn, minlength=8)
    assert counts.min() > 350  # about 500 each: every rank initiates
    without = frozenset(live - {drawn[0]})
    assert initiator(JOB, NAME, 0, 8, without) == (drawn[0] + 1) % 8


@pytest.mark.parametrize("late", ["latest", "sum"])
def test_a_late_rank_gets_what_it_missed_and_its_gift_joins_the_next_round(late: str) -> None:
    spec = Spec(kind="allreduce", count=2, dtype="int64", mode="solo", late=late)
    fab = Fabric(spec, (0, 1), Random(0))
    first = [np.array([1, 0], "int64"), np.array([0, 1], "int64")]
    fab.call(0, 1, first[0])  # the first round waits for every rank's first call
    fab.drain()
    assert not fab.delivered
    fab.call(1, 2, first[1])
    fab.drain()
    assert [fab.delivered[t].active for t in (1, 2)] == [2, 2]
    assert all(fab.delivered[t].included for t in (1, 2))
    for token in (3, 4):  # rank 0 alone runs rounds 1 and 2
        fab.call(0, token, np.array([1, 0], "int64"))
        fab.drain()
    assert (fab.delivered[3].active, fab.delivered[4].round) == (1, 2)
    behind = np.array([0, 5], "int64")
    fab.call(1, 5, behind)  # rank 1 missed rounds 1 and 2: what it missed, at once
    assert fab.delivered[5].round == 2
    assert not fab.delivered[5].included
    if late == "latest":  # eager-SGD's receive buffer: round 2's result only
        np.testing.assert_array_equal(behind, [1, 0])
        assert fab.delivered[5].results == 1
    else:  # both results it missed, so that it applies each once
        np.testing.assert_array_equal(behind, [2, 0])
        assert fab.delivered[5].results == 2
    fab.call(0, 6, np.array([1, 0], "int64"))
    fab.drain()
    assert fab.delivered[6].round == 3
    assert fab.delivered[6].active == 2
    np.testing.assert_array_equal(fab.colls[0].result[:2], [1, 5])


@pytest.mark.parametrize("mode", ["sync", "solo"])
def test_a_node_that_comes_back_is_told_and_its_calls_fail(mode: str) -> None:
    """Node 2 dies and restarts with an empty collective: the survivors answer its frames with
    their view, which counts it lost, so its call fails with a reason instead of hanging."""
    placement = (0, 1, 2)
    spec = Spec(kind="allreduce", count=2, dtype="float32", mode=mode)
    fab = Fabric(spec, placement, Random(0))
    fab.kill(2)
    fab.down.discard(2)
    live = frozenset(range(3))
    fab.colls[2] = Recording(spec, job=JOB, name=NAME, node=2, ranks=placement, live=live)
    fab.call(2, 99, np.ones(2, "float32"))
    fab.drain()
    assert fab.failed[99].code == "peer_failed"
    assert "counts this node lost" in fab.failed[99].message
    assert [c.counters.rounds for c in fab.colls.values()] == [0, 0, 0]


def test_what_a_round_waits_for_is_said_for_stall_reports() -> None:
    sync = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 0, 1), Random(0))
    sync.call(0, 1, np.ones(2, "float32"))
    assert sync.colls[0].waits() == ("ranks", "round 0 starts once local ranks [1] call it", None)
    sync.call(1, 2, np.ones(2, "float32"))
    waits, detail, node = sync.colls[0].waits()
    assert (waits, node) == ("messages", 1)
    assert "messages from nodes [1]" in detail
    spec = Spec(kind="allreduce", count=2, dtype="float32", mode="majority")
    majority = Fabric(spec, (0, 1), Random(0))
    waits, detail, node = majority.colls[0].waits()
    assert (waits, node) == ("ranks", None)
    assert "round 0 is this node's first: it takes part once local ranks [0] called it" in detail
    majority.call(0, 1, np.ones(2, "float32"))
    majority.call(1, 2, np.ones(2, "float32"))
    majority.drain()
    chosen = initiator(JOB, NAME, 1, 2, frozenset({0, 1}))
    majority.call(1 - chosen, 3, np.ones(2, "float32"))
    assert majority.colls[1 - chosen].waits() == (
        "initiator",
        f"round 1 starts when rank {chosen} calls it, or 2 s after a call here began waiting",
        chosen,
    )


def test_a_rank_that_leaves_after_giving_does_not_fail_a_round_that_completes() -> None:
    """Rank 1 gave and left at once (its node sent its messages): the round still ends at node
    0 within the grace, and rank 0's call gets the whole result."""
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1), Random(0))
    fab.call(0, 1, np.ones(2, "float32"))
    fab.call(1, 2, np.full(2, 2.0, "float32"))  # node 1 ends the round before node 0
    live = frozenset({0})
    fab.perform(0, fab.colls[0].rank_gone(1, live, fab.tick(), grace=GRACE))
    fab.drain()
    assert fab.delivered[1].round == 0
    assert not fab.failed
    assert fab.colls[0].next_deadline() is None  # nothing left to fail


def test_a_rank_that_leaves_before_giving_fails_the_round_after_the_grace() -> None:
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1), Random(0))
    fab.call(0, 1, np.ones(2, "float32"))
    coll = fab.colls[0]
    fab.perform(0, coll.rank_gone(1, frozenset({0}), 10.0, grace=GRACE))
    assert coll.next_deadline() == 10.0 + GRACE
    fab.perform(0, coll.on_timer(12.0))
    assert not fab.failed  # its trainer may still come back and call
    fab.perform(0, coll.on_timer(10.0 + GRACE))
    assert fab.failed[1].code == "peer_failed"
    assert "rank 1" in fab.failed[1].message


@pytest.mark.parametrize("seed", range(20))
def test_a_link_reset_that_heals_restarts_the_round_and_loses_no_gift(seed: int) -> None:
    """Nodes 0 and 1 lose what was in flight between them (their links were reset) and come
    back, the same daemons: they run on from the next round number, the third node adopts it
    from their frames, every call completes, and every gift counts exactly once (ledger.py)."""
    rng = Random(seed)
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="solo")
    fab = Fabric(spec, (0, 1, 2), rng)
    gifts = [np.eye(3, dtype="int64")[r].copy() for r in range(3)]
    for rank in range(3):
        fab.call(rank, rank, gifts[rank])
        for _ in range(rng.randint(0, 4)):
            fab.deliver_one()
    for pair in ((0, 1), (1, 0)):  # the reset: frames in flight either way are gone
        fab.links.pop(pair, None)
    for node, other in ((0, 1), (1, 0)):
        fab.perform(node, fab.colls[node].interrupted(other, "links reset"))
    for node, other in ((0, 1), (1, 0)):
        fab.perform(node, fab.colls[node].resume(other, fab.tick()))
    fab.drain()
    assert sorted(fab.delivered) == [0, 1, 2]
    assert all(not c.lost for c in fab.colls.values())
    results = {(r, c.views[r]): v for c in fab.colls.values() for r, v in c.history.items()}
    seen = sum(results.values(), np.zeros(3, "int64"))
    waiting = sum((c.conservation() for c in fab.colls.values()), np.zeros(3, "int64"))
    np.testing.assert_array_equal(seen + waiting, np.ones(3, "int64"))


def test_a_sync_collective_between_rounds_survives_a_link_reset() -> None:
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1), Random(0))
    for rank in range(2):
        fab.call(rank, rank, np.ones(2, "float32"))
    fab.drain()
    fab.perform(0, fab.colls[0].interrupted(1, "links reset"))  # no round under way
    assert fab.colls[0].broken is None
    fab.call(0, 5, np.ones(2, "float32"))
    fab.perform(0, fab.colls[0].interrupted(1, "links reset"))  # a round under way: broken
    assert fab.failed[5].code == "peer_failed"
