"""Stochastic reduce over a communication graph with NOTIFY-ACK, barrier or no synchronisation
(ASAP §3, §4, §6.2; eq. A.2).

Rules: this module decides, for one rank of one stochastic reduce (a job and a name), what the
rank sends to which rank and when, which received updates a round may average, and when the
rank's call completes.  It holds the rank's receive slots and its outgoing update (bytes) and
performs the averaging on them; it never touches a socket or a clock (``now`` only stamps
rounds).  The daemon's graph service (``daemon/services/stochastic.py``) sends what
:class:`SendUpdate` and :class:`SendSignal` say (an update as one UPDATE frame on the data
channel into the slot :meth:`Reducer.landing` gives; NOTIFY and ACK as control frames) and
answers the call when :class:`Reduced` comes.

Theory of operation.  Each rank ``i`` holds a model ``w_i``; a round averages it with the
updates of its in-neighbours in the graph (:mod:`fabricd.engines.stochastic.graphs`):

    w_i <- (w_i + sum of the in-neighbours' round-r updates it may use) / (1 + how many),

ASAP's model averaging (eq. A.2), with the divisor adjusted to the inputs actually used, as
ASAP §6.2 does when a consistency check rejects a buffer.  Every update carries its version
(``round + 1``; 0 means "nothing yet") in an 8-byte header before the model and an 8-byte
footer after it (:data:`VERSION`), and the receiving slot is the update's exact image: a slot
whose header and footer differ is *torn* (an update is landing in it), one whose version is
not the round's is *mixed-version* (stale or overwritten).  Neither is ever averaged.  The
reduction runs on the daemon's one thread between two landings, so the check made before
reading a slot holds until the read ends.

Each mode is a persistent schedule of :mod:`fabricd.engines.schedule` (the collectives'
engine: one round at a time, inputs of the next round held, consumable operations):

* ``notify-ack`` (ASAP §4, Fig. 4).  The call *stages* the model (copies it, with its
  versions, into the rank's outgoing update), then sends it to every out-neighbour followed by
  a NOTIFY, *before* it waits for anything (send-before-wait: on a cyclic graph every rank's
  round-r updates are out before anyone waits, so nobody waits for a rank that waits for it).
  The reduce runs once the NOTIFYs of round ``r`` from all in-neighbours have come, and every
  input is then the round's update, whole: the call returns, and an ACK goes back to each
  in-neighbour.  The round ends once every out-neighbour ACKed: only then may round ``r + 1``
  stage and send, so a sender is never more than one round ahead of a receiver, a slot is
  never written while its round-r update is unread, and one slot per in-neighbour is enough.
  ASAP keeps "ACK counts at each node and sends all outputs before waiting for ACKs across
  iterations" (§5): the same, with the count per round.  NOTIFY and ACK travel on the
  control channel and the update on the data channel, two streams: a NOTIFY that comes
  before its update has fully landed is held until it has (:meth:`Reducer.landed`), so a
  NOTIFY never overtakes its data (over RDMA the write-with-immediate orders them).
* ``barrier`` (BSP, ASAP §4's baseline).  The call stages and sends its update to every
  out-neighbour, then enters a dissemination barrier over all ranks (empty NOTIFYs, tag
  :data:`BARRIER` + step), then averages whatever its slots hold that is round ``r``'s and
  whole.  The barrier says every rank *sent*, not that the updates *landed*, and a fast rank
  leaves it and sends round ``r + 1`` into a slot a slow rank has not read: a round may use
  fewer inputs, which :class:`Reduced` counts (ASAP Fig. 8's torn and mixed-version reads).
* ``async``.  The call stages, sends, and averages at once with every slot that holds a whole
  update newer than the last one it used from that sender.  No round waits for anyone; a rank
  whose previous update to a neighbour is still queued in the daemon sends none newer until it
  left (the service's rule), so a slow link cannot pile updates up.

Failures (:meth:`Reducer.lose`): under ``notify-ack`` a lost in- or out-neighbour, and under
``barrier`` any lost rank, fail the open call and every later one (``peer_failed``): the round
can never complete.  Under ``async`` the rank goes on: updates to a lost rank are not sent, and
what it sent before is used at most once, like any update (:meth:`Reducer.rejoined` empties
its slot and forgets what was used from it when it comes back, its versions starting again at
1).  A reset link (:meth:`Reducer.interrupted`, then :meth:`Reducer.resume` when its node is
back the same daemon) loses no NOTIFY, ACK or notify-ack update and repeats none.

Memory: one slot of ``nbytes + 16`` per in-neighbour and one outgoing update (a fresh one per
round under ``barrier`` and ``async``: a queued frame may still reference the last one).
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.dtypes import FLOAT_DTYPES
from fabricd.engines import schedule as sched
from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError

if TYPE_CHECKING:
    from fabricd.engines.stochastic.graphs import Graph


class Sync(enum.Enum):
    """How a round's ranks synchronise (the ``sync=`` of ``fab.stochastic_reduce``)."""

    NOTIFY_ACK = "notify-ack"
    BARRIER = "barrier"
    ASYNC = "async"


SYNCS: Final = tuple(s.value for s in Sync)

#: schedule tags: an update (with its NOTIFY under notify-ack), an ACK, barrier step k at
#: BARRIER + k
UPDATE: Final = 0
ACK: Final = 1
BARRIER: Final = 2
#: the header and the footer of an update: its version, ``round + 1``, little-endian
VERSION: Final = struct.Struct("<Q")
#: bytes an update adds to the model: header and footer
OVERHEAD: Final = 2 * VERSION.size

_CALL: Final = 0  #: the activation nop: the rank's call
_STAGE: Final = "stage"
_REDUCE: Final = "reduce"


def update_size(nbytes: int) -> int:
    """Bytes of one update (an UPDATE frame's payload) for a model of ``nbytes``."""
    return nbytes + OVERHEAD


def build_schedule(rank: int, graph: Graph, sync: Sync) -> sched.Schedule:
    """Rank ``rank``'s persistent schedule of one round under ``sync`` (module docstring)."""
    if not 0 <= rank < graph.n:
        raise UsageError(f"rank {rank} is not a node of a graph of {graph.n}")
    ops: list[sched.Op] = [sched.Op.nop()]

    def add(op: sched.Op) -> int:
        ops.append(op)
        return len(ops) - 1

    stage = add(sched.Op.compute(_STAGE, "update", ("model",), after=(_CALL,)))
    sends = tuple(
        add(sched.Op.send(dst, "update", tag=UPDATE, after=(stage,)))
        for dst in graph.out_neighbours[rank]
    )
    match sync:
        case Sync.NOTIFY_ACK:
            notifies = tuple(
                add(sched.Op.recv(src, "slot", tag=UPDATE)) for src in graph.in_neighbours[rank]
            )
            # after the sends too: send-before-wait, and nothing reads the slots earlier
            reduce = add(
                sched.Op.compute(_REDUCE, "model", ("slots",), after=(stage, *sends, *notifies))
            )
            for src in graph.in_neighbours[rank]:
                add(sched.Op.send(src, "ack", tag=ACK, after=(reduce,)))
            for dst in graph.out_neighbours[rank]:
                add(sched.Op.recv(dst, "ack", tag=ACK))
        case Sync.BARRIER:
            last: tuple[int, ...] = (stage, *sends)
            for k in range((graph.n - 1).bit_length()):
                sent = add(
                    sched.Op.send((rank + (1 << k)) % graph.n, "empty", tag=BARRIER + k, after=last)
                )
                got = add(sched.Op.recv((rank - (1 << k)) % graph.n, "empty", tag=BARRIER + k))
                last = (sent, got)
            add(sched.Op.compute(_REDUCE, "model", ("slots",), after=last))
        case Sync.ASYNC:
            add(sched.Op.compute(_REDUCE, "model", ("slots",), after=(stage, *sends)))
    return sched.Schedule(ops=tuple(ops), activation=_CALL)


# -- actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SendUpdate:
    """Send ``payload`` (round ``round``'s update, versions included) to rank ``dst`` as one
    UPDATE frame on the data channel, then, if ``notify``, a NOTIFY of the round on the
    control channel.  ``payload`` is not written again before ``dst`` ACKed it (notify-ack)
    or ever (a fresh one per round otherwise, and a copy when sent again after a reset)."""

    dst: int
    round: int
    payload: memoryview
    notify: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SendSignal:
    """Send rank ``dst`` an ACK (``tag`` :data:`ACK`) or a barrier NOTIFY (``tag`` >=
    :data:`BARRIER`) of round ``round``: a control frame with no bytes."""

    dst: int
    round: int
    tag: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduced:
    """The call of round ``round`` is complete: its array holds the average of the model and
    ``inputs`` in-neighbour updates; ``torn`` slots were mid-landing and ``stale`` held another
    round's update (neither was used)."""

    round: int
    inputs: int
    torn: int
    stale: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """The call of round ``round`` failed: ``rank`` was lost (``message`` says how)."""

    round: int
    rank: int | None
    message: str


Action = SendUpdate | SendSignal | Reduced | Failed


@dataclass(frozen=True, slots=True, kw_only=True)
class ReducerStatistics:
    """What ``fabricctl status`` and the metrics show of one rank's stochastic reduce."""

    round: int
    reduces: int
    #: ``used[k]``: reduces that averaged ``k`` in-neighbour updates (0..in-degree)
    used: tuple[int, ...]
    torn: int
    stale: int
    broken: str | None
    notifies: int  #: NOTIFYs taken (each once)
    acks: int  #: ACKs taken (each once)
    duplicates: int  #: messages and updates dropped because they came a second time
    resent: int  #: messages and updates sent again after a link reset (an update's NOTIFY too)
    waiting: tuple[str, ...] = field(default=())


class Reducer:
    """One rank's stochastic reduce of one name: its schedule, slots and update (module
    docstring).  The ``k``-th :meth:`call` is round ``k``."""

    def __init__(self, *, rank: int, graph: Graph, sync: Sync, dtype: str, nbytes: int) -> None:
        if dtype not in FLOAT_DTYPES:
            raise UsageError(f"a stochastic reduce averages {', '.join(FLOAT_DTYPES)}, not {dtype}")
        itemsize = np.dtype(dtype).itemsize
        if nbytes <= 0 or nbytes % itemsize:
            raise UsageError(f"{nbytes} bytes is not a whole number of {dtype} (> 0)")
        self.rank = rank
        self.graph = graph
        self.sync = sync
        self.dtype = np.dtype(dtype)
        self.nbytes = nbytes
        self.sources = graph.in_neighbours[rank]
        self.targets = graph.out_neighbours[rank]
        self.executor = sched.Executor(build_schedule(rank, graph, sync))
        self._slots = {src: bytearray(update_size(nbytes)) for src in self.sources}
        self._update = bytearray(update_size(nbytes))
        self._arrays: dict[int, np.ndarray[Any, Any]] = {}  #: the calls' arrays, by round
        self._calls = 0  #: calls made: the next call is round ``_calls``
        self._open: int | None = None  #: the round of the call not answered yet
        #: notify-ack: the last round whose update from each source was reduced (-1: none);
        #: async: the last version used from each source
        self._consumed = dict.fromkeys(self.sources, -1 if sync is Sync.NOTIFY_ACK else 0)
        self._notified: dict[int, int] = {}  #: NOTIFYs whose update has not fully landed
        #: the last round of each (source, tag) control message handed to the schedule
        self._delivered: dict[tuple[int, int], int] = {}
        self._unacked: dict[int, int] = {}  #: notify-ack: out-neighbours' unACKed round
        self._reduced = -1  #: the last round reduced (whose ACKs went out)
        #: barrier steps sent in the last two rounds (sent again on :meth:`resume`)
        self._barrier_sent: deque[SendSignal] = deque()
        self._counts = {UPDATE: 0, ACK: 0, BARRIER: 0}  #: control messages taken, by kind
        self._duplicates = 0
        self._resent = 0
        self._landing: dict[int, int] = {}  #: sources with an update landing: its round
        self._lost: set[int] = set()
        self._broken: str | None = None
        self._lost_rank: int | None = None  #: the rank whose loss broke the reduce
        self._reduces = 0
        self._used = [0] * (len(self.sources) + 1)
        self._torn = 0
        self._stale = 0
        self.executor.post(0.0)

    # -- inputs ---------------------------------------------------------------------------
    def call(self, array: np.ndarray[Any, Any], now: float) -> list[Action]:
        """The rank's next call with its model ``array`` (averaged in place).

        Raises:
            UsageError: ``array`` is not this reduce's dtype and size, or is read-only (the
                reduce that writes it may run inside :meth:`message`, a peer's frame).
            LocalProtocolError: the rank's previous call is still open.
        """
        if array.dtype != self.dtype or array.nbytes != self.nbytes:
            raise UsageError(
                f"this stochastic reduce averages {self.nbytes} bytes of {self.dtype}, not "
                f"{array.nbytes} bytes of {array.dtype}"
            )
        if not array.flags.writeable:
            raise UsageError(
                "a stochastic reduce averages the model in place: pass a writeable array"
            )
        if self._open is not None:
            raise LocalProtocolError(f"round {self._open}'s call is still open")
        round, self._calls = self._calls, self._calls + 1
        self._open = round
        if self._broken is not None:
            return [self._fail(round)]
        self._arrays[round] = array
        return self._drive(self.executor.activate(round, now), now)

    def landing(self, src: int, round: int, length: int) -> memoryview | None:
        """Where rank ``src``'s update of ``round`` (``length`` bytes) lands: its slot;
        ``None`` once the reduce is broken (read the bytes and drop them).

        An update sent again after a link reset (:meth:`resume`) whose round was reduced
        already is dropped (``None``); one that was not lands again, whole.

        Raises:
            RemoteProtocolError: ``src`` is no in-neighbour, ``length`` is not an update's, or
                (notify-ack) the slot's update of the round before is not reduced yet: the
                sender ran past its ACKs.
        """
        slot = self._slots.get(src)
        if slot is None:
            raise RemoteProtocolError(f"rank {src} is not an in-neighbour of rank {self.rank}")
        if self._broken is not None:
            return None
        if length != len(slot):
            raise RemoteProtocolError(f"an update of {length} bytes; this one takes {len(slot)}")
        if self.sync is Sync.NOTIFY_ACK and (
            round <= self._consumed[src]
            or self._delivered.get((src, UPDATE), -1) >= round
            or (self._whole(src, round) and self._landing.get(src) != round)
        ):
            self._duplicates += 1  # sent again after a link reset: the slot has it already
            return None
        if self.sync is Sync.NOTIFY_ACK and round != self._consumed[src] + 1:
            raise RemoteProtocolError(
                f"rank {src}'s update of round {round} before rank {self.rank} ACKed round "
                f"{round - 1}"
            )
        self._landing[src] = round
        return memoryview(slot)

    def landed(self, src: int, round: int, now: float) -> list[Action]:
        """Rank ``src``'s update of ``round`` is all in its slot (after :meth:`landing`)."""
        if self._broken is not None:
            return []
        if self._landing.get(src) != round:
            raise LocalProtocolError(f"no update of round {round} from rank {src} was landing")
        del self._landing[src]
        if self._notified.get(src) == round:
            del self._notified[src]
            return self._arrived(src, UPDATE, round, now)
        return []

    def message(self, src: int, tag: int, round: int, now: float) -> list[Action]:
        """A control message from rank ``src``: a NOTIFY (``tag`` :data:`UPDATE`), an ACK
        (:data:`ACK`) or a barrier step (:data:`BARRIER` + k) of ``round``.

        Raises:
            RemoteProtocolError: the schedule takes no such message (its round is outside
                what may arrive, or it repeats one).
        """
        if self._broken is not None:
            return []  # the reduce failed; late news changes nothing
        pending = tag == UPDATE and self._notified.get(src) == round
        if pending or round <= self._delivered.get((src, tag), -1):
            self._duplicates += 1  # sent again after a link reset (:meth:`resume`)
            return []
        if tag == UPDATE and self.sync is Sync.NOTIFY_ACK:
            if src not in self._slots:
                raise RemoteProtocolError(f"NOTIFY from rank {src}, no in-neighbour")
            if self._landing.get(src) == round or not self._whole(src, round):
                if src in self._notified:
                    raise RemoteProtocolError(f"second NOTIFY from rank {src} before its update")
                self._notified[src] = round  # its update is still landing: wait for it
                return []
        return self._arrived(src, tag, round, now)

    def _arrived(self, src: int, tag: int, round: int, now: float) -> list[Action]:
        """Hand a control message to the schedule, once: a second copy of it (sent again
        after a link reset) is dropped by :meth:`message`."""
        actions = self.executor.arrived(src, tag, round, now)
        self._delivered[(src, tag)] = round
        if tag == ACK and self._unacked.get(src) == round:
            del self._unacked[src]
        self._counts[tag if tag < BARRIER else BARRIER] += 1
        return self._drive(actions, now)

    def interrupted(self, rank: int) -> None:
        """The links to rank ``rank``'s node were reset: an update of it that was landing
        never will (it is sent again on :meth:`resume`, or the rank is lost).

        Its slot is marked torn (footer 0): bytes cut off anywhere, even inside the footer,
        can leave it looking whole, and the copy :meth:`resume` sends would then be dropped
        as one the slot has, stranding a NOTIFY that waits for :meth:`landed`."""
        if self._landing.pop(rank, None) is not None:
            slot = self._slots[rank]
            VERSION.pack_into(slot, len(slot) - VERSION.size, 0)

    def resume(self, rank: int) -> list[Action]:
        """Rank ``rank``'s node is back, the same daemon, after its links were reset: send
        it again whatever it may not have had (messages in flight are lost with a link).

        Its out-neighbour gets the update it has not ACKed (with its NOTIFY), its
        in-neighbour the ACK of the last round reduced, and anyone the barrier steps of the
        current and the last round.  The receiver drops what it had already
        (:meth:`landing`, :meth:`message`), so each is taken exactly once.
        """
        if self._broken is not None or rank in self._lost:
            return []
        out: list[Action] = []
        unacked = self._unacked.get(rank)
        if unacked is not None:
            out.append(
                # a copy: the ACK may come (and the next round stage into the update) while
                # this frame still waits in the daemon's queue
                SendUpdate(
                    dst=rank, round=unacked, payload=memoryview(bytes(self._update)), notify=True
                )
            )
        if self.sync is Sync.NOTIFY_ACK and rank in self._slots and self._reduced >= 0:
            out.append(SendSignal(dst=rank, round=self._reduced, tag=ACK))
        out += [s for s in self._barrier_sent if s.dst == rank]
        # frames, as the receiver counts its duplicates: an update goes with its NOTIFY
        self._resent += len(out) + (unacked is not None)
        return out

    def lose(self, rank: int, reason: str, now: float) -> list[Action]:
        """Rank ``rank`` left the job or its node went down (module docstring, Failures)."""
        if rank == self.rank or rank in self._lost:
            return []
        self._lost.add(rank)
        needed = self.sync is Sync.BARRIER or (
            self.sync is Sync.NOTIFY_ACK and (rank in self.sources or rank in self.targets)
        )
        if not needed or self._broken is not None:
            return []
        self._broken = f"rank {rank} was lost ({reason}); a {self.sync.value} reduce needs it"
        self._lost_rank = rank
        self.executor.retire()
        self._landing.clear()
        self._notified.clear()
        if self._open is None:
            return []
        return [self._fail(self._open)]

    def rejoined(self, rank: int) -> None:
        """Rank ``rank`` joined (again).  If it was lost (:meth:`lose`), async goes on with
        it: its versions start again at 1, so what was used from it is forgotten and its
        slot emptied (version 0), lest its last update be used twice and its new ones be
        stale until they pass the old count.  A rank never lost (its first join, or its node
        back the same daemon after a reset) goes on counting: nothing changes."""
        if rank not in self._lost:
            return
        self._lost.discard(rank)
        if self.sync is Sync.ASYNC and rank in self._slots:
            self._consumed[rank] = 0
            if rank not in self._landing:  # one landing now is its new life's
                self._slots[rank][:] = bytes(len(self._slots[rank]))

    def close(self, reason: str) -> None:
        """Stop the reduce for ``reason`` (its job is gone, its trainer left mid-call): the
        open call, if any, is the caller's to fail; every input is ignored after this and
        every later call fails, saying ``reason``."""
        if self._broken is None:
            self._broken = reason
            self.executor.retire()
        self._open = None
        self._arrays.clear()
        self._landing.clear()
        self._notified.clear()

    # -- reading --------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """The calls the rank made (its next call is round ``calls``)."""
        return self._calls

    @property
    def open_round(self) -> int | None:
        """The round of the call not answered yet, if any."""
        return self._open

    @property
    def broken(self) -> str | None:
        """Why every call fails, once a rank the reduce needs was lost."""
        return self._broken

    def version(self, src: int) -> tuple[int, int]:
        """Rank ``src``'s slot: (header, footer) versions."""
        slot = self._slots[src]
        return VERSION.unpack_from(slot, 0)[0], VERSION.unpack_from(slot, len(slot) - 8)[0]

    def waiting_for(self) -> list[str]:
        """What the current round waits for (a stall report)."""
        ops = self.executor.schedule.ops
        waiting: list[str] = []
        for i in self.executor.waiting_recvs():
            op = ops[i]
            what = {UPDATE: "NOTIFY", ACK: "ACK"}.get(op.tag, f"barrier step {op.tag - BARRIER}")
            waiting.append(f"{what} from rank {op.peer}")
        return waiting

    def statistics(self) -> ReducerStatistics:
        return ReducerStatistics(
            round=self.executor.round,
            reduces=self._reduces,
            used=tuple(self._used),
            torn=self._torn,
            stale=self._stale,
            broken=self._broken,
            notifies=self._counts[UPDATE],
            acks=self._counts[ACK],
            duplicates=self._duplicates,
            resent=self._resent,
            waiting=tuple(self.waiting_for()) if self._broken is None else (),
        )

    # -- the schedule's actions -----------------------------------------------------------
    def _drive(self, actions: list[sched.Action], now: float) -> list[Action]:
        """Perform the executor's actions (and those their completions bring) in order."""
        out: list[Action] = []
        work = deque(actions)
        ops = self.executor.schedule.ops
        while work:
            action = work.popleft()
            if isinstance(action, sched.StartCompute):
                if ops[action.op].fn == _STAGE:
                    self._stage(action.round)
                else:
                    out.append(self._reduce(action.round))
                work.extend(self.executor.completed(action.op, action.round, now))
            elif isinstance(action, sched.StartSend):
                op = ops[action.op]
                if op.peer not in self._lost:
                    out.append(self._send(op, action.round))
                work.extend(self.executor.completed(action.op, action.round, now))
        return out

    def _send(self, op: sched.Op, round: int) -> Action:
        if op.tag == UPDATE:
            if self.sync is Sync.NOTIFY_ACK:
                self._unacked[op.peer] = round
            return SendUpdate(
                dst=op.peer,
                round=round,
                payload=memoryview(self._update),
                notify=self.sync is Sync.NOTIFY_ACK,
            )
        signal = SendSignal(dst=op.peer, round=round, tag=op.tag)
        if op.tag >= BARRIER:
            while self._barrier_sent and self._barrier_sent[0].round < round - 1:
                self._barrier_sent.popleft()
            self._barrier_sent.append(signal)
        return signal

    def _stage(self, round: int) -> None:
        """Copy round ``round``'s model into the outgoing update, between its versions."""
        if self.sync is not Sync.NOTIFY_ACK:
            self._update = bytearray(update_size(self.nbytes))  # a queued frame may hold the last
        update = self._update
        VERSION.pack_into(update, 0, round + 1)
        np.frombuffer(update, np.uint8, self.nbytes, VERSION.size)[:] = (
            self._arrays[round].reshape(-1).view(np.uint8)
        )
        VERSION.pack_into(update, len(update) - VERSION.size, round + 1)

    def _reduce(self, round: int) -> Reduced:
        """Average the round's model with the usable slots (module docstring), in place."""
        array = self._arrays.pop(round)
        model = array.reshape(-1)  # a copy if ``array`` is not contiguous: written back below
        count = model.size
        total = model.astype(np.float32) if self.dtype == np.float16 else model.copy()
        used = torn = stale = 0
        for src in self.sources:
            header, footer = self.version(src)
            if header != footer:
                torn += 1
                continue
            # async: newer than the last one used; else: the round's own
            asynchronous = self.sync is Sync.ASYNC
            fresh = header > self._consumed[src] if asynchronous else header == round + 1
            if not fresh:
                stale += 1
                continue
            total += np.frombuffer(self._slots[src], self.dtype, count, VERSION.size)
            used += 1
            if self.sync is Sync.ASYNC:
                self._consumed[src] = header
        if self.sync is Sync.NOTIFY_ACK:
            for src in self.sources:
                self._consumed[src] = round
        self._reduced = round
        total /= 1 + used
        array[...] = total.reshape(array.shape)  # in the element order _stage sent
        self._reduces += 1
        self._used[used] += 1
        self._torn += torn
        self._stale += stale
        self._open = None
        return Reduced(round=round, inputs=used, torn=torn, stale=stale)

    def _whole(self, src: int, round: int) -> bool:
        header, footer = self.version(src)
        return header == footer == round + 1

    def _fail(self, round: int) -> Failed:
        self._open = None
        self._arrays.pop(round, None)
        return Failed(round=round, rank=self._lost_rank, message=self._broken or "")
