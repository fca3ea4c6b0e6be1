"""Persistent schedules: a DAG of send, recv, compute and nop operations, run once per round.

Rules: this module decides *when* each operation of one rank's schedule may run, which round an
input belongs to, and when a round ends.  It never says what a send, a recv or a compute *is*:
an :class:`Op` names peers, tags, buffers and functions with small ints and strings the builder
chose (the collectives module builds the DAGs, the daemon's schedule service performs the
actions: one posted-buffer WRITE per message, a reduction on segments).  No I/O, no clock: every
input takes ``now``, which only stamps the round's bookkeeping.

Theory of operation (eager-SGD §4.1.1, §4.3, and the persistent schedules of §4.1):

* A :class:`Schedule` is a DAG: operation ``i`` is ``ops[i]``, and ``Op.after`` lists the
  operations it happens after, combined with ``Join.ALL`` (and) or ``Join.ANY`` (or: the first
  of several inputs fires it, the dashed circles of the paper's Fig. 6).  Validation when it is
  built refuses cycles, dangling or repeated dependencies, two recvs (or two sends) with the
  same (peer, tag), and sources that nothing could fire.
* Sources (no ``after``): the *activation* nop (``Schedule.activation``: the rank's own call,
  the paper's internal activation, fired by :meth:`Executor.activate`) and recvs (posted when
  their round is armed, fired by their message: the external activation of §4.1.1).  A send,
  compute or other nop with no dependencies is refused: it would run unbidden in every round.
* Operations are *consumable* (§4.1.1, "Multiple initiators"): each runs at most once per
  round, so an ``ANY`` operation whose inputs all arrive runs once, and simultaneous triggers
  (the rank's call and an activation message, or two activation messages) run the round once.
* When an operation's dependencies are satisfied the engine returns its action
  (:class:`StartSend`, :class:`StartRecv`, :class:`StartCompute`; a nop completes at once).  A
  send or compute is done when the daemon reports :meth:`Executor.completed`; a recv is done
  once it was started *and* its message :meth:`~Executor.arrived` (in either order).
* A round ends when every operation not marked ``optional`` is done and no send or compute is
  in flight; optional operations that did not run are *skipped* (:class:`RoundEnded` names
  them).  Optional is how activation broadcasts end: a rank activated by one message never
  hears the other partners' recvs, and never makes its own call in that round.
* Persistent (§4.1, §4.3): when a round ends, the next is armed at once, without the
  application: its source recvs are posted and held inputs replayed.

Rounds and the overlap allowed.  The engine runs one round at a time; round ``r`` is *current*
from the moment round ``r - 1`` ended until it ends itself.  Inputs of round ``r + 1`` (a
message, the rank's call) may come while ``r`` runs: they are held for ``r + 1``, never
consumed by ``r``, and replayed when ``r + 1`` is armed.  No action of round ``r + 1`` is
returned before :class:`RoundEnded` of ``r``.  A message may come late, for any ended round,
only for an optional recv that round skipped (a second initiator's activation, which may trail
any number of rounds behind on a slow link while the data flows on other paths); it is absorbed
with a :class:`Discard`, as is a message that came for a recv its round skipped before it was
ready.  The last :data:`LATE_WINDOW` rounds remember which optional recvs they skipped, so a
second message for a recv that ran is still refused; past the window a late message of an
optional recv is absorbed unchecked.  Anything else outside ``.. r + 1``, or a second message
for one recv in one round, is refused with :class:`~fabricd.errors.RemoteProtocolError` (the
peer ran past its flow control, or repeated itself).  One round ahead is enough when a rank's
round cannot end without messages of every peer's same round (allreduce, barrier): a sender in
round ``r + 2`` ended ``r + 1``, which needed this rank's ``r + 1`` messages, sent after this
rank ended ``r``.  Where a schedule lacks that (a broadcast's root hears nobody), it must add
it (the collectives module's broadcast acknowledges up its tree).  For the service this means:
a required recv needs a landing slot per round parity; an optional recv, whose late message
may land beside an early one, needs no bytes at all (activation messages have none).

Cost and memory: an input costs O(the operations it makes ready and their dependents); arming
a round costs O(operations).  Between rounds the engine keeps at most one held input per recv
plus the call, and the recvs the last round skipped: bounded by the schedule's size.

The states, as data (an input a state does not accept is a bug in the daemon, refused with
:class:`~fabricd.errors.LocalProtocolError` before anything moves)::

    schedule  NEW --post--> ARMED --trigger--> RUNNING --end--> ARMED (the next round)
              ARMED, RUNNING --hold (an input of the next round), late--> themselves
              RUNNING --trigger, complete--> RUNNING
              ARMED, RUNNING --retire--> RETIRED

    op        IDLE --ready--> STARTED --complete--> DONE   (every op IDLE again next round)
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError

#: how many rounds ahead of the current one an input may come, and be held
AHEAD: Final = 1
#: how many ended rounds remember their skipped recvs, so that a second message for a recv
#: that ran is still told from a late one for a recv that was skipped
LATE_WINDOW: Final = 64


class Kind(enum.Enum):
    SEND = "send"  #: send ``buffer`` to ``peer`` as message ``tag``
    RECV = "recv"  #: take message ``tag`` from ``peer`` into ``buffer``
    COMPUTE = "compute"  #: ``buffer = fn(*inputs)``: a reduction or a copy the daemon performs
    NOP = "nop"  #: nothing: only builds dependencies (the activation, a join point)


class Join(enum.Enum):
    ALL = "all"  #: ready once every dependency is done (and)
    ANY = "any"  #: ready once the first dependency is done (or)


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation of a schedule; ``after`` holds indexes into ``Schedule.ops``.

    Build them with :meth:`send`, :meth:`recv`, :meth:`compute` and :meth:`nop`.  ``peer``,
    ``tag``, ``buffer``, ``inputs`` and ``fn`` mean whatever the builder and the service agree
    on; the engine only needs (peer, tag) to tell one recv's messages from another's.
    """

    kind: Kind
    after: tuple[int, ...] = ()
    join: Join = Join.ALL
    optional: bool = False  #: the round may end without it (it is then skipped)
    peer: int = -1  #: send, recv: the other rank
    tag: int = 0  #: send, recv: which message between the two ranks, within a round
    buffer: str = ""  #: send: what it sends; recv: where it lands; compute: what it writes
    inputs: tuple[str, ...] = ()  #: compute: what it reads
    fn: str = ""  #: compute: what it does ("sum", "copy", ...)

    @classmethod
    def send(
        cls,
        peer: int,
        buffer: str,
        *,
        tag: int = 0,
        after: tuple[int, ...] = (),
        join: Join = Join.ALL,
        optional: bool = False,
    ) -> Op:
        return cls._message(Kind.SEND, peer, buffer, tag, after, join, optional)

    @classmethod
    def recv(
        cls,
        peer: int,
        buffer: str,
        *,
        tag: int = 0,
        after: tuple[int, ...] = (),
        join: Join = Join.ALL,
        optional: bool = False,
    ) -> Op:
        return cls._message(Kind.RECV, peer, buffer, tag, after, join, optional)

    @classmethod
    def _message(
        cls,
        kind: Kind,
        peer: int,
        buffer: str,
        tag: int,
        after: tuple[int, ...],
        join: Join,
        optional: bool,
    ) -> Op:
        return cls(
            kind=kind, peer=peer, buffer=buffer, tag=tag, after=after, join=join, optional=optional
        )

    @classmethod
    def compute(
        cls,
        fn: str,
        buffer: str,
        inputs: tuple[str, ...],
        *,
        after: tuple[int, ...] = (),
        join: Join = Join.ALL,
        optional: bool = False,
    ) -> Op:
        return cls(
            kind=Kind.COMPUTE,
            fn=fn,
            buffer=buffer,
            inputs=inputs,
            after=after,
            join=join,
            optional=optional,
        )

    @classmethod
    def nop(
        cls, *, after: tuple[int, ...] = (), join: Join = Join.ALL, optional: bool = False
    ) -> Op:
        return cls(kind=Kind.NOP, after=after, join=join, optional=optional)

    def what(self, index: int) -> str:
        """``op 3 (send to peer 1, tag 0)``: how errors name an operation."""
        match self.kind:
            case Kind.SEND:
                detail = f"send to peer {self.peer}, tag {self.tag}"
            case Kind.RECV:
                detail = f"recv from peer {self.peer}, tag {self.tag}"
            case Kind.COMPUTE:
                detail = f"compute {self.fn} into {self.buffer!r}"
            case Kind.NOP:
                detail = "nop"
        return f"op {index} ({detail})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """One rank's DAG of operations; ``activation`` is the nop the rank's own call fires.

    Raises:
        UsageError: the DAG cannot run; the message names the operation and what to change.
    """

    ops: tuple[Op, ...]
    activation: int | None = None

    def __post_init__(self) -> None:
        if not self.ops:
            raise UsageError("a schedule needs at least one operation")
        if all(op.optional for op in self.ops):
            raise UsageError("every operation is optional: a round would end before it began")
        if self.activation is not None and not 0 <= self.activation < len(self.ops):
            raise UsageError(f"activation {self.activation} is not an operation of the schedule")
        matched: set[tuple[Kind, int, int]] = set()
        for index, op in enumerate(self.ops):
            self._check_op(index, op)
            if op.kind in (Kind.SEND, Kind.RECV):
                if (op.kind, op.peer, op.tag) in matched:
                    raise UsageError(
                        f"{op.what(index)}: another {op.kind.value} has the same peer and tag; "
                        "give each message of a round its own tag"
                    )
                matched.add((op.kind, op.peer, op.tag))
        self._check_acyclic()

    def _check_op(self, index: int, op: Op) -> None:
        name = op.what(index)
        for dep in op.after:
            if not 0 <= dep < len(self.ops) or dep == index:
                raise UsageError(f"{name} depends on op {dep}, which is not another operation")
        if len(set(op.after)) != len(op.after):
            raise UsageError(f"{name} names a dependency twice")
        if op.kind in (Kind.SEND, Kind.RECV) and (op.peer < 0 or not op.buffer):
            raise UsageError(f"{name} needs a peer (>= 0) and a buffer")
        if op.kind is Kind.COMPUTE and not (op.fn and op.buffer):
            raise UsageError(f"{name} needs a function and a buffer to write")
        if index == self.activation and (op.kind is not Kind.NOP or op.after):
            raise UsageError(f"{name} is the activation: it must be a nop with no dependencies")
        if not op.after and index != self.activation and op.kind is not Kind.RECV:
            raise UsageError(
                f"{name} has no dependencies, so nothing would ever make it ready: make it "
                "depend on the activation nop or on a recv"
            )

    def _check_acyclic(self) -> None:
        """Kahn's algorithm; what it cannot order lies on or behind a cycle, which is named."""
        missing = [len(op.after) for op in self.ops]
        dependents = _dependents(self.ops)
        ready = deque(i for i, n in enumerate(missing) if n == 0)
        ordered = 0
        while ready:
            ordered += 1
            for d in dependents[ready.popleft()]:
                missing[d] -= 1
                if missing[d] == 0:
                    ready.append(d)
        if ordered == len(self.ops):
            return
        walk = [next(i for i, n in enumerate(missing) if n)]
        while walk.count(walk[-1]) < 2:  # follow unordered dependencies until one repeats
            walk.append(next(d for d in self.ops[walk[-1]].after if missing[d]))
        cycle = walk[walk.index(walk[-1]) :]
        path = " after ".join(self.ops[i].what(i) for i in cycle)
        raise UsageError(f"the schedule has a cycle: {path}")


def _dependents(ops: tuple[Op, ...]) -> list[list[int]]:
    dependents: list[list[int]] = [[] for _ in ops]
    for index, op in enumerate(ops):
        for dep in op.after:
            dependents[dep].append(index)
    return dependents


# -- actions (only this engine returns them) ------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StartSend:
    """Send ``schedule.ops[op]``'s buffer for round ``round``; report :meth:`Executor.completed`."""

    op: int
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRecv:
    """Recv ``op`` of round ``round`` now waits for its message (the service's slot for the
    round's parity may already hold it); nothing to report back but :meth:`Executor.arrived`."""

    op: int
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartCompute:
    """Perform ``schedule.ops[op]``'s function for round ``round``; report
    :meth:`Executor.completed`."""

    op: int
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundStarted:
    """Round ``round`` began: ``internal`` if by the rank's own call, else by a message."""

    round: int
    internal: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundEnded:
    """Round ``round`` ended (the next is armed): what a result can say about it.

    ``activated``: the rank's own call took part (``included`` of a partial collective);
    ``skipped``: optional operations that did not run; ``began``/``ended``: the ``now`` of the
    input that started it and of the one that ended it.
    """

    round: int
    activated: bool
    skipped: tuple[int, ...]
    began: float
    ended: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Discard:
    """Round ``round`` skipped recv ``op``, whose message landed all the same: drop what it
    left in the round's slot.  Returned when the round ends, for a message that came before
    its recv was ready, or later, for one that came after the round had ended."""

    op: int
    round: int


Action = StartSend | StartRecv | StartCompute | RoundStarted | RoundEnded | Discard


# -- states, as data ----------------------------------------------------------------------
class Phase(enum.Enum):
    NEW = "new"  #: built, not posted: no round armed
    ARMED = "armed"  #: the current round waits for its first input (source recvs posted)
    RUNNING = "running"  #: the current round began and has not ended
    RETIRED = "retired"  #: gone: every input is refused


class _Input(enum.Enum):
    POST = enum.auto()  #: arm the first round
    TRIGGER = enum.auto()  #: the rank's call or a message, for the current round
    HOLD = enum.auto()  #: the rank's call or a message, for the next round
    LATE = enum.auto()  #: a message for a recv the last round skipped
    COMPLETE = enum.auto()  #: a send or compute of the current round is done
    END = enum.auto()  #: the current round's required operations are done
    RETIRE = enum.auto()  #: the service drops the schedule


_PHASES: Final[dict[tuple[Phase, _Input], Phase]] = {
    (Phase.NEW, _Input.POST): Phase.ARMED,
    (Phase.ARMED, _Input.TRIGGER): Phase.RUNNING,
    (Phase.ARMED, _Input.HOLD): Phase.ARMED,
    (Phase.ARMED, _Input.LATE): Phase.ARMED,
    (Phase.ARMED, _Input.RETIRE): Phase.RETIRED,
    (Phase.RUNNING, _Input.TRIGGER): Phase.RUNNING,
    (Phase.RUNNING, _Input.HOLD): Phase.RUNNING,
    (Phase.RUNNING, _Input.LATE): Phase.RUNNING,
    (Phase.RUNNING, _Input.COMPLETE): Phase.RUNNING,
    (Phase.RUNNING, _Input.END): Phase.ARMED,
    (Phase.RUNNING, _Input.RETIRE): Phase.RETIRED,
}


class OpState(enum.Enum):
    IDLE = "idle"  #: its dependencies are not satisfied (yet, this round)
    STARTED = "started"  #: its action went out; waiting for completed() or its message
    DONE = "done"  #: ran this round (consumed)


class _OpInput(enum.Enum):
    READY = enum.auto()  #: its dependencies are satisfied
    DONE = enum.auto()  #: completed(), its message (a recv), or at once (a nop)


_OP_MOVES: Final[dict[tuple[OpState, _OpInput], OpState]] = {
    (OpState.IDLE, _OpInput.READY): OpState.STARTED,
    (OpState.STARTED, _OpInput.DONE): OpState.DONE,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStatistics:
    """What ``fabricctl status`` can show of one schedule."""

    round: int  #: the current round
    phase: Phase
    rounds: int  #: rounds ended
    in_flight: int  #: sends and computes started and not completed
    held: int  #: messages and calls held for a recv not ready yet, or for the next round
    late_open: int  #: optional recvs recent rounds skipped: a message may still come (discarded)
    discarded: int  #: late messages of skipped recvs absorbed


class Executor:
    """Runs one persistent :class:`Schedule` for one rank, round after round."""

    def __init__(self, schedule: Schedule, *, first_round: int = 0) -> None:
        """``first_round``: the number of the first round armed (a rank that rejoins a job
        continues at the job's current round)."""
        ops = schedule.ops
        self.schedule = schedule
        self.round = first_round
        self.phase = Phase.NEW
        self._dependents = _dependents(ops)
        #: how many dependencies must be done before each op is ready (ANY: one)
        self._need = [min(len(op.after), 1) if op.join is Join.ANY else len(op.after) for op in ops]
        self._required = sum(not op.optional for op in ops)
        self._sources = [i for i, op in enumerate(ops) if op.kind is Kind.RECV and not op.after]
        self._recv_of = {(op.peer, op.tag): i for i, op in enumerate(ops) if op.kind is Kind.RECV}
        # the current round's tables, reset when a round is armed
        self._state = [OpState.IDLE] * len(ops)
        self._missing = list(self._need)
        self._arrived: set[int] = set()  #: recvs whose message came before they started
        self._required_left = self._required
        self._in_flight = 0
        self._began = 0.0
        # what is kept across rounds
        self._next: list[int | None] = []  #: held for round + 1: recvs, None for the activation
        #: per ended round (the last LATE_WINDOW), the optional recvs it skipped whose message
        #: has not come: it is absorbed when it does
        self._behind: dict[int, set[int]] = {}
        self._rounds = 0
        self._discarded = 0

    # -- inputs ---------------------------------------------------------------------------
    def post(self, now: float) -> list[Action]:
        """Arm the first round: its source recvs are posted (eager-SGD §4.3, "commits")."""
        self.phase = self._move(_Input.POST)
        out: list[Action] = []
        self._arm(now, out)
        return out

    def activate(self, round: int, now: float) -> list[Action]:
        """The rank's own call for ``round`` (the current one, or the next: then held).

        Raises:
            UsageError: the schedule has no activation nop.
            LocalProtocolError: the round is finished or more than one ahead, or was already
                activated: the service must map a call to ``self.round`` (or the next) once.
        """
        op = self.schedule.activation
        if op is None:
            raise UsageError("this schedule has no activation: only messages start its rounds")
        if round == self.round + AHEAD:
            phase = self._move(_Input.HOLD)
            if None in self._next:
                raise LocalProtocolError(f"round {round} was already activated")
            self.phase = phase
            self._next.append(None)
            return []
        if round != self.round:
            raise LocalProtocolError(
                f"cannot activate round {round}: round {self.round} is current, and only it or "
                "the next may be activated (an ended round's result is already in its buffer)"
            )
        if self._state[op] is not OpState.IDLE:
            raise LocalProtocolError(f"round {round} was already activated")
        out: list[Action] = []
        self._trigger(now, internal=True, out=out)
        self._run([op], out)
        self._settle(now, out)
        return out

    def arrived(self, peer: int, tag: int, round: int, now: float) -> list[Action]:
        """Message ``tag`` from ``peer`` for ``round`` has landed (in the round's slot).

        Raises:
            RemoteProtocolError: no recv takes it, its round is outside what may arrive, or
                its recv already has that round's message: close the peer's link.
            LocalProtocolError: the schedule is not posted or is retired.
        """
        op = self._recv_of.get((peer, tag))
        if op is None:
            raise RemoteProtocolError(f"no recv of this schedule takes tag {tag} from peer {peer}")
        what = f"message for {self.schedule.ops[op].what(op)} of round {round}"
        if round == self.round + AHEAD:
            phase = self._move(_Input.HOLD)
            if op in self._next:
                raise RemoteProtocolError(f"second {what}")
            self.phase = phase
            self._next.append(op)
            return []
        if round < self.round and self.schedule.ops[op].optional:
            phase = self._move(_Input.LATE)
            behind = self._behind.get(round)
            remembered = round >= self.round - LATE_WINDOW
            if remembered and (behind is None or op not in behind):
                raise RemoteProtocolError(f"{what}: that round ended with this recv done")
            self.phase = phase
            if behind is not None:
                behind.discard(op)
                if not behind:
                    del self._behind[round]
            self._discarded += 1
            return [Discard(op=op, round=round)]
        if round != self.round:
            raise RemoteProtocolError(
                f"{what}: this rank is in round {self.round}, and messages may arrive only "
                f"up to {AHEAD} round ahead (the sender ran past its flow control) or, for an "
                "optional recv its round skipped, late"
            )
        if op in self._arrived or self._state[op] is OpState.DONE:
            raise RemoteProtocolError(f"second {what}")
        out: list[Action] = []
        self._trigger(now, internal=False, out=out)
        self._deliver(op, out)
        self._settle(now, out)
        return out

    def completed(self, op: int, round: int, now: float) -> list[Action]:
        """Send or compute ``op`` of ``round`` is done: its buffer may be reused.

        Raises:
            LocalProtocolError: it is not a started send or compute of the current round.
        """
        self._move(_Input.COMPLETE)
        kind = self.schedule.ops[op].kind if 0 <= op < len(self.schedule.ops) else None
        if round != self.round or kind not in (Kind.SEND, Kind.COMPUTE):
            raise LocalProtocolError(
                f"completed(op {op}, round {round}): not a send or compute of round {self.round}"
            )
        self._op_move(op, _OpInput.DONE)
        self._in_flight -= 1
        out: list[Action] = []
        self._run(self._done(op), out)
        self._settle(now, out)
        return out

    def retire(self) -> None:
        """Drop the schedule: every later input is refused.  Sends or computes still in flight
        are the service's to wait for or abandon; their completions must not come here."""
        self.phase = self._move(_Input.RETIRE)
        self._next.clear()
        self._behind.clear()
        self._arrived.clear()
        self._in_flight = 0

    def waiting_recvs(self) -> list[int]:
        """The required recvs of the current round that wait for their message (for a stall
        report: whom the round waits for)."""
        ops = self.schedule.ops
        return [
            i
            for i, state in enumerate(self._state)
            if ops[i].kind is Kind.RECV
            and not ops[i].optional
            and state is not OpState.DONE
            and i not in self._arrived
        ]

    def statistics(self) -> ScheduleStatistics:
        return ScheduleStatistics(
            round=self.round,
            phase=self.phase,
            rounds=self._rounds,
            in_flight=self._in_flight,
            held=len(self._next) + len(self._arrived),
            late_open=sum(len(ops) for ops in self._behind.values()),
            discarded=self._discarded,
        )

    # -- moving ---------------------------------------------------------------------------
    def _move(self, event: _Input) -> Phase:
        """The phase ``event`` leads to, without moving there (so a refusal changes nothing)."""
        phase = _PHASES.get((self.phase, event))
        if phase is None:
            raise LocalProtocolError(f"schedule is {self.phase.value}: it takes no {event.name}")
        return phase

    def _op_move(self, op: int, event: _OpInput) -> None:
        state = _OP_MOVES.get((self._state[op], event))
        if state is None:
            what = self.schedule.ops[op].what(op)
            raise LocalProtocolError(
                f"{what} is {self._state[op].value}: it cannot be {event.name}"
            )
        self._state[op] = state

    def _trigger(self, now: float, *, internal: bool, out: list[Action]) -> None:
        if self.phase is Phase.ARMED:
            self._began = now
            out.append(RoundStarted(round=self.round, internal=internal))
        self.phase = self._move(_Input.TRIGGER)

    def _run(self, ops: list[int], out: list[Action]) -> None:
        """The dependencies of ``ops`` are satisfied: start them, and whatever that makes
        ready, in the order they became ready."""
        work = deque(ops)
        while work:
            i = work.popleft()
            self._op_move(i, _OpInput.READY)
            match self.schedule.ops[i].kind:
                case Kind.NOP:
                    self._op_move(i, _OpInput.DONE)
                    work.extend(self._done(i))
                case Kind.RECV:
                    out.append(StartRecv(op=i, round=self.round))
                    if i in self._arrived:
                        self._arrived.remove(i)
                        self._op_move(i, _OpInput.DONE)
                        work.extend(self._done(i))
                case Kind.SEND:
                    self._in_flight += 1
                    out.append(StartSend(op=i, round=self.round))
                case Kind.COMPUTE:
                    self._in_flight += 1
                    out.append(StartCompute(op=i, round=self.round))

    def _deliver(self, op: int, out: list[Action]) -> None:
        if self._state[op] is OpState.IDLE:  # not posted yet: it completes when it starts
            self._arrived.add(op)
            return
        self._op_move(op, _OpInput.DONE)
        self._run(self._done(op), out)

    def _done(self, op: int) -> list[int]:
        """Count ``op`` done; returns the dependents that became ready (consumable: an op
        already past IDLE ignores further dependencies)."""
        if not self.schedule.ops[op].optional:
            self._required_left -= 1
        ready = []
        for d in self._dependents[op]:
            if self._state[d] is OpState.IDLE:
                self._missing[d] -= 1
                if self._missing[d] == 0:
                    ready.append(d)
        return ready

    def _settle(self, now: float, out: list[Action]) -> None:
        """End rounds whose required operations are done, arming the next each time and
        replaying what was held for it."""
        while self._required_left == 0 and self._in_flight == 0:
            self.phase = self._move(_Input.END)
            ops = self.schedule.ops
            skipped = tuple(i for i, s in enumerate(self._state) if s is not OpState.DONE)
            activation = self.schedule.activation
            out.extend(Discard(op=i, round=self.round) for i in sorted(self._arrived))
            out.append(
                RoundEnded(
                    round=self.round,
                    activated=activation is not None and activation not in skipped,
                    skipped=skipped,
                    began=self._began,
                    ended=now,
                )
            )
            self._rounds += 1
            behind = {
                i
                for i in skipped
                if ops[i].kind is Kind.RECV and ops[i].optional and i not in self._arrived
            }
            if behind:
                self._behind[self.round] = behind
            self._behind.pop(self.round - LATE_WINDOW, None)
            self.round += 1
            self._arm(now, out)

    def _arm(self, now: float, out: list[Action]) -> None:
        """Post round ``self.round``'s source recvs, then replay what was held for it."""
        self._state = [OpState.IDLE] * len(self.schedule.ops)
        self._missing = list(self._need)
        self._arrived.clear()
        self._required_left = self._required
        self._began = now
        out.extend(StartRecv(op=i, round=self.round) for i in self._sources)
        for i in self._sources:
            self._op_move(i, _OpInput.READY)
        held, self._next = self._next, []
        for op in held:  # in the order they came
            if op is None:
                activation = self.schedule.activation
                assert activation is not None  # activate() holds nothing without one
                self._trigger(now, internal=True, out=out)
                self._run([activation], out)
            else:
                self._trigger(now, internal=False, out=out)
                self._deliver(op, out)
