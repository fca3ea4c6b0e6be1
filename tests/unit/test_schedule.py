"""The schedule engine: AND/OR readiness, consumable operations, rounds that re-arm themselves.

Time is a hand-moved clock (``Clock``); nothing sleeps.  The property tests drive random DAGs
with random arrival and completion orders across several rounds and compare the engine with a
small model of eager-SGD §4.1.1 written independently of it (``model``).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.schedule import (
    Discard,
    Executor,
    Join,
    Kind,
    Op,
    Phase,
    RoundEnded,
    RoundStarted,
    Schedule,
    StartCompute,
    StartRecv,
    StartSend,
)
from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError

if TYPE_CHECKING:
    from random import Random

    from fabricd.engines.schedule import Action


A = TypeVar("A")


@dataclass
class Clock:
    now: float = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now


def starts(actions: list[Action]) -> list[tuple[str, int, int]]:
    """The Start* actions as (kind, op, round)."""
    names = {StartSend: "send", StartRecv: "recv", StartCompute: "compute"}
    return [
        (names[type(a)], a.op, a.round)
        for a in actions
        if isinstance(a, StartSend | StartRecv | StartCompute)
    ]


def of(actions: list[Action], kind: type[A]) -> list[A]:
    return [a for a in actions if isinstance(a, kind)]


#: activation (0), a recv from peer 1 (1), a send to peer 1 after the activation AND/OR the
#: recv (2), and a compute after the send (3)
def joined(join: Join) -> Schedule:
    return Schedule(
        ops=(
            Op.nop(),
            Op.recv(1, "in"),
            Op.send(1, "out", after=(0, 1), join=join),
            Op.compute("sum", "acc", ("in", "out"), after=(2,)),
        ),
        activation=0,
    )


def posted(schedule: Schedule, clock: Clock, **options: int) -> Executor:
    ex = Executor(schedule, **options)
    ex.post(clock.tick())
    return ex


# -- readiness -----------------------------------------------------------------------------------
def test_and_waits_for_every_dependency() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    assert starts(ex.activate(0, clock.tick())) == []
    assert starts(ex.arrived(1, 0, 0, clock.tick())) == [("send", 2, 0)]


@pytest.mark.parametrize("first", ["activation", "message"])
def test_or_fires_on_the_first_dependency_and_only_once(first: str) -> None:
    clock = Clock()
    ex = posted(joined(Join.ANY), clock)

    def call() -> list[Action]:
        return ex.activate(0, clock.tick())

    def message() -> list[Action]:
        return ex.arrived(1, 0, 0, clock.tick())

    one, other = (call, message) if first == "activation" else (message, call)
    assert starts(one()) == [("send", 2, 0)]
    assert starts(other()) == []  # the send is consumed: it runs once this round
    assert starts(ex.completed(2, 0, clock.tick())) == [("compute", 3, 0)]


def test_a_nop_completes_at_once_and_passes_readiness_on() -> None:
    clock = Clock()
    schedule = Schedule(
        ops=(Op.nop(), Op.nop(after=(0,)), Op.send(1, "out", after=(1,))), activation=0
    )
    ex = posted(schedule, clock)
    assert starts(ex.activate(0, clock.tick())) == [("send", 2, 0)]


def test_a_message_before_its_recv_is_posted_completes_it_when_it_is() -> None:
    clock = Clock()
    schedule = Schedule(
        ops=(
            Op.nop(),
            Op.recv(1, "in", after=(0,)),
            Op.compute("copy", "out", ("in",), after=(1,)),
        ),
        activation=0,
    )
    ex = posted(schedule, clock)
    actions = ex.arrived(1, 0, 0, clock.tick())  # the recv is not posted yet: held
    assert actions == [RoundStarted(round=0, internal=False)]
    assert ex.statistics().held == 1
    assert starts(ex.activate(0, clock.tick())) == [("recv", 1, 0), ("compute", 2, 0)]
    assert ex.statistics().held == 0


# -- rounds ----------------------------------------------------------------------------------------
def test_a_round_ends_and_the_next_is_armed_without_the_application() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    assert ex.statistics().phase is Phase.ARMED
    ex.activate(0, clock.tick())
    ex.arrived(1, 0, 0, clock.tick())
    ex.completed(2, 0, clock.tick())
    actions = ex.completed(3, 0, clock.tick())
    assert actions == [
        RoundEnded(round=0, activated=True, skipped=(), began=2.0, ended=5.0),
        StartRecv(op=1, round=1),  # round 1 armed: its source recv posted
    ]
    assert (ex.round, ex.phase, ex.statistics().rounds) == (1, Phase.ARMED, 1)


def test_rounds_are_numbered_from_first_round() -> None:
    clock = Clock()
    ex = posted(joined(Join.ANY), clock, first_round=7)
    assert starts(ex.arrived(1, 0, 7, clock.tick())) == [("send", 2, 7)]
    with pytest.raises(RemoteProtocolError, match="round 6"):
        ex.arrived(1, 0, 6, clock.tick())


def test_a_message_for_the_next_round_is_held_for_it() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    ex.activate(0, clock.tick())
    assert ex.arrived(1, 0, 1, clock.tick()) == []  # round 1's: never round 0's
    assert starts(ex.activate(1, clock.tick())) == []  # the call for round 1 is held too
    assert ex.statistics().held == 2
    assert starts(ex.arrived(1, 0, 0, clock.tick())) == [("send", 2, 0)]
    ex.completed(2, 0, clock.tick())
    actions = ex.completed(3, 0, clock.tick())
    assert [type(a) for a in actions] == [RoundEnded, StartRecv, RoundStarted, StartSend]
    assert starts(actions) == [("recv", 1, 1), ("send", 2, 1)]
    assert actions[2] == RoundStarted(round=1, internal=False)  # replayed in the order they came
    assert ex.statistics().held == 0


def test_inputs_outside_the_window_are_refused_with_the_reason() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock, first_round=5)
    with pytest.raises(RemoteProtocolError, match=r"round 7.*in round 5.*1 round ahead"):
        ex.arrived(1, 0, 7, clock.tick())
    with pytest.raises(RemoteProtocolError, match="tag 3 from peer 1"):
        ex.arrived(1, 3, 5, clock.tick())
    with pytest.raises(LocalProtocolError, match="cannot activate round 7"):
        ex.activate(7, clock.tick())
    assert ex.statistics().held == 0  # a refusal moves nothing


def test_a_second_message_for_one_recv_is_refused() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    ex.arrived(1, 0, 0, clock.tick())
    with pytest.raises(RemoteProtocolError, match=r"second message .*round 0"):
        ex.arrived(1, 0, 0, clock.tick())
    ex.arrived(1, 0, 1, clock.tick())
    with pytest.raises(RemoteProtocolError, match=r"second message .*round 1"):
        ex.arrived(1, 0, 1, clock.tick())


def test_activating_twice_is_refused() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    ex.activate(0, clock.tick())
    with pytest.raises(LocalProtocolError, match="already activated"):
        ex.activate(0, clock.tick())
    ex.activate(1, clock.tick())
    with pytest.raises(LocalProtocolError, match="already activated"):
        ex.activate(1, clock.tick())


def test_completed_must_name_a_started_send_or_compute_of_the_current_round() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    with pytest.raises(LocalProtocolError, match="takes no COMPLETE"):  # nothing runs yet
        ex.completed(2, 0, clock.tick())
    ex.activate(0, clock.tick())
    with pytest.raises(LocalProtocolError, match="idle"):
        ex.completed(2, 0, clock.tick())
    with pytest.raises(LocalProtocolError, match="not a send or compute"):
        ex.completed(1, 0, clock.tick())  # a recv completes by its message
    with pytest.raises(LocalProtocolError, match="not a send or compute of round 0"):
        ex.completed(2, 1, clock.tick())


# -- activation broadcast: optional operations, simultaneous initiators ---------------------------
def activation(rank: int, size: int) -> Schedule:
    """eager-SGD Fig. 6 (right) for ``rank`` of ``size`` (a power of two): the activation as
    recursive doubling, any rank may initiate.  Op 0 is the rank's call (N0); recv ``k`` and
    send ``k`` talk to ``rank ^ 2**k``; the send forwards after the call or any earlier recv;
    the last op (N1) starts "the collective" -- here a compute -- after the call or any recv."""
    steps = size.bit_length() - 1
    ops = [Op.nop(optional=True)]
    recvs = [len(ops) + k for k in range(steps)]
    ops += [Op.recv(rank ^ 1 << k, "act", tag=k, optional=True) for k in range(steps)]
    for k in range(steps):
        ops.append(Op.send(rank ^ 1 << k, "act", tag=k, after=(0, *recvs[:k]), join=Join.ANY,
                           optional=True))  # fmt: skip
    ops.append(Op.nop(after=(0, *recvs), join=Join.ANY))  # N1: the activation, consumed once
    ops.append(Op.compute("allreduce", "result", ("grad",), after=(len(ops) - 1,)))
    return Schedule(ops=tuple(ops), activation=0)


@dataclass
class Fabric:
    """Executors for ranks 0..P-1 and the messages between them: FIFO per (src, dst) pair,
    delivered in an order ``rng`` picks; sends and computes complete when ``rng`` says."""

    executors: list[Executor]
    rng: Random
    clock: Clock = field(default_factory=Clock)
    links: dict[tuple[int, int], deque[tuple[int, int]]] = field(
        default_factory=lambda: defaultdict(deque)
    )
    pending: list[tuple[int, int, int]] = field(default_factory=list)  #: (rank, op, round)
    log: list[list[Action]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log = [[] for _ in self.executors]
        for rank, ex in enumerate(self.executors):
            self.perform(rank, ex.post(self.clock.tick()))

    def perform(self, rank: int, actions: list[Action]) -> None:
        self.log[rank] += actions
        for action in actions:
            if isinstance(action, StartSend):
                op = self.executors[rank].schedule.ops[action.op]
                self.links[rank, op.peer].append((op.tag, action.round))
            if isinstance(action, StartSend | StartCompute):
                self.pending.append((rank, action.op, action.round))

    def activate(self, rank: int, round: int) -> None:
        self.perform(rank, self.executors[rank].activate(round, self.clock.tick()))

    def step(self) -> bool:
        links = [pair for pair, queue in self.links.items() if queue]
        choices = len(links) + len(self.pending)
        if not choices:
            return False
        pick = self.rng.randrange(choices)
        if pick < len(links):
            src, dst = links[pick]
            tag, round = self.links[src, dst].popleft()
            self.perform(dst, self.executors[dst].arrived(src, tag, round, self.clock.tick()))
        else:
            rank, op, round = self.pending.pop(pick - len(links))
            self.perform(rank, self.executors[rank].completed(op, round, self.clock.tick()))
        return True

    def run(self) -> None:
        for _ in range(10_000):
            if not self.step():
                return
        raise AssertionError("the fabric did not settle")


@settings(max_examples=150)
@given(
    size=st.sampled_from([2, 4, 8]),
    initiators=st.data(),
    rng=st.randoms(use_true_random=False),
)
def test_any_initiators_run_each_round_exactly_once_at_every_rank(
    size: int, initiators: st.DataObject, rng: Random
) -> None:
    fabric = Fabric([Executor(activation(rank, size)) for rank in range(size)], rng)
    collective = len(fabric.executors[0].schedule.ops) - 1
    for round in range(3):
        callers = initiators.draw(st.sets(st.integers(0, size - 1), min_size=1), label="callers")
        for rank in sorted(callers):
            fabric.activate(rank, round)  # simultaneous: before any message moves
        fabric.run()
        for rank, log in enumerate(fabric.log):
            ended = [a for a in of(log, RoundEnded) if a.round == round]
            assert len(ended) == 1, f"rank {rank} ended round {round} {len(ended)} times"
            assert ended[0].activated == (rank in callers)
            computes = [s for s in starts(log) if s == ("compute", collective, round)]
            assert len(computes) == 1
            assert len([a for a in of(log, RoundStarted) if a.round == round]) == 1
    # a rank activated once gets one message per round, so every recv but one is skipped; a
    # second initiator's late activation message is absorbed, never taken for the next round
    for ex in fabric.executors:
        assert ex.round == 3
        assert ex.statistics().in_flight == 0


def test_a_late_message_of_a_skipped_recv_is_discarded_once() -> None:
    clock = Clock()
    ex = posted(activation(0, 4), clock)  # ops: 0 call, 1-2 recvs, 3-4 sends, 5 N1, 6 compute
    ex.arrived(1, 0, 0, clock.tick())  # activated by rank 1: forwards to rank 2
    assert starts(ex.completed(4, 0, clock.tick())) == []
    actions = ex.completed(6, 0, clock.tick())
    assert of(actions, RoundEnded) == [
        RoundEnded(round=0, activated=False, skipped=(0, 2, 3), began=2.0, ended=4.0)
    ]
    assert ex.arrived(2, 1, 0, clock.tick()) == [Discard(op=2, round=0)]
    assert ex.statistics().discarded == 1
    with pytest.raises(RemoteProtocolError, match="round 0: that round ended"):
        ex.arrived(2, 1, 0, clock.tick())
    with pytest.raises(RemoteProtocolError, match="round 0: that round ended"):
        ex.arrived(1, 0, 0, clock.tick())  # that recv ran in round 0: a duplicate


def test_a_round_waits_for_an_optional_send_in_flight() -> None:
    clock = Clock()
    ex = posted(activation(0, 2), clock)  # 0 call, 1 recv, 2 send, 3 N1, 4 compute
    ex.activate(0, clock.tick())
    assert of(ex.completed(4, 0, clock.tick()), RoundEnded) == []  # its send still moves
    assert of(ex.completed(2, 0, clock.tick()), RoundEnded) != []


def test_a_message_for_a_recv_the_round_skipped_is_discarded_not_kept() -> None:
    """Op 2 waits for op 1; its message comes first, then the round ends without either: the
    message is round 0's, and round 1's op 2 must wait for round 1's own."""
    clock = Clock()
    schedule = Schedule(
        ops=(
            Op.nop(),
            Op.recv(1, "a", optional=True),
            Op.recv(2, "b", after=(1,), optional=True),
            Op.compute("copy", "c", ("c",), after=(0,)),
            Op.compute("copy", "d", ("b",), after=(2,), optional=True),
        ),
        activation=0,
    )
    ex = posted(schedule, clock)
    ex.arrived(2, 0, 0, clock.tick())
    ex.activate(0, clock.tick())
    actions = ex.completed(3, 0, clock.tick())
    assert actions[:2] == [
        Discard(op=2, round=0),
        RoundEnded(round=0, activated=True, skipped=(1, 2, 4), began=2.0, ended=4.0),
    ]
    with pytest.raises(RemoteProtocolError, match=r"op 2 .* round 0: that round ended"):
        ex.arrived(2, 0, 0, clock.tick())  # its message came: a second one is a duplicate
    assert ex.arrived(1, 0, 0, clock.tick()) == [Discard(op=1, round=0)]
    # op 2 of round 1 waits for round 1's message: op 4 must not start
    assert starts(ex.arrived(1, 0, 1, clock.tick())) == [("recv", 2, 1)]
    assert starts(ex.arrived(2, 0, 1, clock.tick())) == [("compute", 4, 1)]


# -- retirement ----------------------------------------------------------------------------------
def test_a_retired_schedule_holds_nothing_and_takes_nothing() -> None:
    clock = Clock()
    ex = posted(joined(Join.ALL), clock)
    ex.activate(0, clock.tick())
    ex.arrived(1, 0, 1, clock.tick())
    ex.retire()
    stats = ex.statistics()
    assert (stats.phase, stats.held, stats.late_open, stats.in_flight) == (Phase.RETIRED, 0, 0, 0)
    with pytest.raises(LocalProtocolError, match="retired"):
        ex.arrived(1, 0, 0, clock.tick())
    with pytest.raises(LocalProtocolError, match="retired"):
        ex.retire()


def test_an_unposted_schedule_takes_no_input() -> None:
    ex = Executor(joined(Join.ALL))
    with pytest.raises(LocalProtocolError, match="new"):
        ex.arrived(1, 0, 0, 0.0)


def test_activate_needs_an_activation() -> None:
    ex = Executor(Schedule(ops=(Op.recv(1, "in"),)))
    ex.post(0.0)
    with pytest.raises(UsageError, match="no activation"):
        ex.activate(0, 1.0)


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ops", "activation", "match"),
    [
        ((), None, "at least one operation"),
        ((Op.nop(optional=True),), 0, "every operation is optional"),
        ((Op.nop(),), 3, "activation 3 is not an operation"),
        (
            (Op.nop(), Op.send(1, "b", after=(5,))),
            0,
            r"op 1 \(send to peer 1, tag 0\) depends on op 5",
        ),
        ((Op.nop(), Op.send(1, "b", after=(1,))), 0, "op 1 .* depends on op 1"),
        ((Op.nop(), Op.send(1, "b", after=(0, 0))), 0, "op 1 .* names a dependency twice"),
        ((Op.nop(), Op.send(1, "b")), 0, r"op 1 \(send to peer 1, tag 0\) has no dependencies"),
        ((Op.nop(), Op.nop()), 0, r"op 1 \(nop\) has no dependencies"),
        ((Op.recv(1, "b"),), 0, "op 0 .* is the activation: it must be a nop"),
        ((Op.recv(1, "b"), Op.nop(after=(0,))), 1, "op 1 .* is the activation"),
        ((Op.nop(), Op.recv(1, "b"), Op.recv(1, "c")), 0, "op 2 .*same peer and tag"),
        ((Op.nop(), Op.send(-1, "b", after=(0,))), 0, "needs a peer"),
        ((Op.nop(), Op.compute("", "b", (), after=(0,))), 0, "needs a function"),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_naming_the_op(
    ops: tuple[Op, ...], activation: int | None, match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        Schedule(ops=ops, activation=activation)


def test_a_cycle_is_refused_with_its_path() -> None:
    ops = (
        Op.nop(),
        Op.send(1, "a", after=(0, 3)),
        Op.compute("sum", "b", ("a",), after=(1,)),
        Op.nop(after=(2,)),
        Op.send(2, "c", after=(3,)),  # behind the cycle, not on it
    )
    with pytest.raises(UsageError, match=r"cycle: op 1 .* after op 3 .* after op 2 .* after op 1"):
        Schedule(ops=ops, activation=0)


# -- random DAGs, random orders ------------------------------------------------------------------
@st.composite
def dags(draw: st.DrawFn) -> Schedule:
    """Op 0 is the activation; every other op depends on earlier ones (so the DAG is acyclic),
    a recv possibly on none (a source).  Recvs are drawn twice as often as other kinds, and a
    third of the ops are optional, so that rounds often end with recvs skipped."""
    count = draw(st.integers(2, 10))
    ops = [Op.nop()]
    for i in range(1, count):
        kind = draw(st.sampled_from([Kind.SEND, Kind.RECV, Kind.RECV, Kind.COMPUTE, Kind.NOP]))
        after = tuple(draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)))
        if kind is not Kind.RECV and not after:
            after = (draw(st.integers(0, i - 1)),)
        join = draw(st.sampled_from(Join))
        optional = draw(st.integers(0, 2)) == 0
        peer, fn = (1, "") if kind in (Kind.SEND, Kind.RECV) else (-1, "sum")
        if kind is Kind.NOP:
            fn = ""
        buffer = "" if kind is Kind.NOP else "b"
        ops.append(
            Op(kind=kind, after=after, join=join, optional=optional, peer=peer, tag=i,
               buffer=buffer, fn=fn)
        )  # fmt: skip
    return Schedule(ops=tuple(ops), activation=0)


@dataclass
class Inputs:
    """What the test delivered to one round before it ended: the model's inputs."""

    activated: bool = False
    arrived: set[int] = field(default_factory=set)
    late: set[int] = field(default_factory=set)  #: recvs whose message came after the end
    completed: set[int] = field(default_factory=set)


def model(schedule: Schedule, inputs: Inputs) -> tuple[set[int], set[int]]:
    """(started, done) by eager-SGD §4.1.1 alone: an op starts once its AND/OR dependencies
    are done (a source recv at once, the activation when called); a nop is done when started,
    a recv when started and its message came, a send or compute when completed."""
    ops = schedule.ops
    started: set[int] = set()
    done: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i, op in enumerate(ops):
            if i not in started:
                if i == schedule.activation:
                    ready = inputs.activated
                elif not op.after:
                    ready = True
                else:
                    join = all if op.join is Join.ALL else any
                    ready = join(d in done for d in op.after)
                if ready:
                    started.add(i)
                    changed = True
            finished = {
                Kind.NOP: True,
                Kind.RECV: i in inputs.arrived,
                Kind.SEND: i in inputs.completed,
                Kind.COMPUTE: i in inputs.completed,
            }[op.kind]
            if i in started and i not in done and finished:
                done.add(i)
                changed = True
    return started, done


@settings(max_examples=300)
@given(schedule=dags(), rounds=st.integers(1, 4), rng=st.randoms(use_true_random=False))
def test_random_dags_in_random_orders_run_each_op_once_per_round(
    schedule: Schedule, rounds: int, rng: Random
) -> None:
    ops = schedule.ops
    recvs = [i for i, op in enumerate(ops) if op.kind is Kind.RECV]
    clock = Clock()
    ex = Executor(schedule, first_round=10)
    last = 10 + rounds
    log: list[Action] = ex.post(clock.tick())
    waiting: dict[int, set[tuple[str, int]]] = {
        r: {("call", 0)} | {("msg", i) for i in recvs} for r in range(10, last)
    }
    seen: dict[int, Inputs] = defaultdict(Inputs)
    in_flight: list[tuple[int, int]] = []
    skipped: dict[int, tuple[int, ...]] = {}
    for _ in range(10_000):
        if ex.round == last:
            break
        cur = ex.round
        for r in [r for r in waiting if r < cur - 1]:
            del waiting[r]  # too late to deliver anything
        waiting.get(cur - 1, set()).discard(("call", 0))  # a call maps to a live round
        choices = [(r, inp) for r in sorted(waiting) if r <= cur + 1 for inp in sorted(waiting[r])]
        choices += [(r, ("done", op)) for op, r in in_flight]
        r, (what, op) = rng.choice(choices)
        now = clock.tick()
        if what == "call":
            actions = ex.activate(r, now)
            seen[r].activated = True
        elif what == "msg":
            actions = ex.arrived(1, ops[op].tag, r, now)
            if r == cur - 1:
                assert op in skipped[r]
                assert actions == [Discard(op=op, round=r)]
                seen[r].late.add(op)  # no input of its round: the round had ended
            else:
                seen[r].arrived.add(op)
        else:
            actions = ex.completed(op, r, now)
            seen[r].completed.add(op)
            in_flight.remove((op, r))
        if what != "done":
            waiting[r].remove((what, op))
        log += actions
        in_flight += [(a.op, a.round) for a in actions if isinstance(a, StartSend | StartCompute)]
        for ended in of(actions, RoundEnded):
            skipped[ended.round] = ended.skipped
        if ex.round in range(10, last):  # the current round matches the model, as it stands
            started, done = model(schedule, seen[ex.round])
            engine = {op for _, op, r in starts(log) if r == ex.round}
            assert engine == {i for i in started if ops[i].kind is not Kind.NOP}
            assert any(not ops[i].optional and i not in done for i in range(len(ops))) or any(
                i not in done for i in started if ops[i].kind in (Kind.SEND, Kind.COMPUTE)
            ), "the round should have ended"
    else:
        raise AssertionError("the rounds did not end")
    check_log(schedule, log, range(10, last), seen)
    ex.retire()
    stats = ex.statistics()
    assert (stats.held, stats.late_open, stats.in_flight) == (0, 0, 0)
    assert stats.rounds == rounds
    assert in_flight == []


def check_log(
    schedule: Schedule, log: list[Action], rounds: range, seen: dict[int, Inputs]
) -> None:
    """Every round ended once, after the one before; no action of a round came before the
    previous round's end; each op ran at most once per round, every required op exactly once;
    what ran is what the model says, given what the round was told before it ended."""
    ops = schedule.ops
    ended_at = {a.round: n for n, a in enumerate(log) if isinstance(a, RoundEnded)}
    assert sorted(ended_at) == list(rounds)
    assert len(of(log, RoundEnded)) == len(rounds)
    for n, action in enumerate(log):
        if action.round > rounds.start and not isinstance(action, Discard):
            assert ended_at[action.round - 1] < n, (
                f"{action} came before round {action.round - 1} ended"
            )
    for r in rounds:
        ran = [op for _, op, rr in starts(log) if rr == r]
        assert len(ran) == len(set(ran)), f"round {r} ran an op twice"
        started, done = model(schedule, seen[r])
        (ended,) = [a for a in of(log, RoundEnded) if a.round == r]
        assert set(ended.skipped) == set(range(len(ops))) - done
        assert all(ops[i].optional for i in ended.skipped)
        assert set(ran) == {i for i in started if ops[i].kind is not Kind.NOP}
        assert len([a for a in of(log, RoundStarted) if a.round == r]) == 1
        discarded = [a.op for a in of(log, Discard) if a.round == r]
        assert sorted(discarded) == sorted(
            {i for i in ended.skipped if i in seen[r].arrived} | seen[r].late
        )


# -- a tiny allreduce by exchange, two ranks, real numbers -----------------------------------------
def exchange(rank: int) -> Schedule:
    """Rank ``rank`` of 2: send my gradient, take the other's, sum them -- once my call put my
    gradient in ``mine`` (op 0) and the other's arrived (op 2)."""
    other = 1 - rank
    return Schedule(
        ops=(
            Op.nop(),
            Op.send(other, "mine", after=(0,)),
            Op.recv(other, "theirs"),
            Op.compute("sum", "result", ("mine", "theirs"), after=(0, 2)),
        ),
        activation=0,
    )


@settings(max_examples=100)
@given(rng=st.randoms(use_true_random=False), seed=st.integers(0, 2**32 - 1))
def test_two_ranks_allreduce_by_exchange_over_a_fake_network(rng: Random, seed: int) -> None:
    """Each rank calls round r as soon as the engine lets it (round r - 1 current), so one
    rank may run a round ahead: its message lands in the other's slot for the next round's
    parity (two slots per recv, as a service with posted buffers would keep) and waits there."""
    rounds = 5
    grads = np.random.default_rng(seed).standard_normal((2, rounds, 16))
    clock = Clock()
    ranks = [Executor(exchange(rank)) for rank in range(2)]
    slots: list[list[np.ndarray | None]] = [[None, None], [None, None]]
    results: list[dict[int, np.ndarray]] = [{}, {}]
    wire: list[deque[tuple[int, np.ndarray]]] = [deque(), deque()]  # to rank 0, to rank 1
    work: list[tuple[int, StartSend | StartCompute]] = []
    called = [0, 0]  # the next round each rank calls

    def perform(rank: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StartSend):  # one WRITE into the peer's posted slot
                wire[1 - rank].append((action.round, grads[rank, action.round].copy()))
            if isinstance(action, StartSend | StartCompute):
                work.append((rank, action))

    for rank, ex in enumerate(ranks):
        perform(rank, ex.post(clock.tick()))
    for _ in range(1000):
        options = [("call", r) for r in range(2) if called[r] < min(rounds, ranks[r].round + 2)]
        options += [("wire", r) for r in range(2) if wire[r]]
        options += [("work", n) for n in range(len(work))]
        if not options:
            break
        what, n = rng.choice(options)
        if what == "call":
            perform(n, ranks[n].activate(called[n], clock.tick()))
            called[n] += 1
        elif what == "wire":
            round, data = wire[n].popleft()
            assert slots[n][round % 2] is None, "two rounds' messages in one slot"
            slots[n][round % 2] = data
            perform(n, ranks[n].arrived(1 - n, 0, round, clock.tick()))
        else:
            rank, action = work.pop(n)
            if isinstance(action, StartCompute):
                theirs = slots[rank][action.round % 2]
                assert theirs is not None
                results[rank][action.round] = grads[rank, action.round] + theirs
                slots[rank][action.round % 2] = None
            perform(rank, ranks[rank].completed(action.op, action.round, clock.tick()))
    for rank in range(2):
        assert sorted(results[rank]) == list(range(rounds))
        for r in range(rounds):
            np.testing.assert_array_equal(results[rank][r], grads[0, r] + grads[1, r])
        assert ranks[rank].statistics().rounds == rounds
