"""Point-to-point messages between ranks: matching, rendezvous, and failure.

Rules: this module decides which send meets which receive, when bytes may flow, and when an
operation is finished or failed.  It moves no bytes: the daemon streams and copies them when
told to, and asks where incoming ones land (the engine's :class:`~fabricd.engines.landing.
Landing` table).  It reads the rank table but never changes it: membership does, and its
:data:`~fabricd.engines.membership.RankEvent` news comes in through
:meth:`Messaging.on_rank_event`.

Theory of operation: sends and receives match like MPI's -- same job, source, destination and
tag, first posted first matched (non-overtaking).  There are no wildcards, so one FIFO queue per
(job, src, dst, tag) key is exactly MPI's rule: a key's posted receives and its unmatched
messages are never both non-empty.  A remote message travels one of three ways (docs/protocol.md
§3.4 has the frames, and the argument that MPI order holds across all three):

* **eager** -- at most ``eager_limit`` bytes, within the sender's credit at that peer: one EAGER
  frame {msg, job, src, dst, tag, nbytes, dtype} + payload on the control channel.  The receiver
  lands it straight in the receive if that is posted, else holds it in its pool for that peer
  (``eager_credit`` bytes, the credit) until it is; a pool without room drops the payload and
  takes the frame as an RTS.  DONE gives the credit back.
* **rendezvous, sender first** -- RTS, then CTS once the receive is posted, then DATA on the
  data channel and DONE; a large message is never buffered, and lands in the segment.
* **rendezvous, receiver first (RTR)** -- a larger receive posted before its message sends an
  RTR {rtr, key, nbytes, dtype} to the source's node, its region registered (unarmed) in the
  landing table under ``-rtr``.  The next send of the key streams at once: RTS{rtr} ahead of
  DATA{rtr} on the control channel, so no later send's RTS can overtake it, while its DATA may
  arrive first.  Crossing: a sender with a send of the key unanswered (RTS or EAGER state) drops
  an RTR, and a receiver that matches a message answering no RTR voids every RTR of the key
  still out (``_void_rtrs``) and sends none while a posted receive of the key has none
  (``_no_rtr``); a sender that drops an RTR for want of room drops every later one of its key
  until a send of it goes plain (``_rtrs_lost``).  So the i-th send of a key always meets the
  i-th receive.

A zero-byte or mismatched message skips CTS and DATA: the receiver answers DONE at once (with
an error when sizes or dtypes differ; both sides then fail with the same message).  Ranks on
the same node meet inside one daemon, which copies segment to segment (:class:`CopyLocal`).

Every operation is a small state machine whose transitions are data
(:mod:`fabricd.engines.p2p.operations`); an input its state does not accept is a bug in fabricd:
the operation moves to ``BROKEN``, leaves the engine, and
:class:`~fabricd.errors.LocalProtocolError` is raised.  Each state files the operation in the
indexes that state needs, and a move takes it out of them, so no input scans the operations
that merely wait (every input is O(1) amortised, ``bench/framecost.py`` measures it):

=====================  =========================================  ===========================
index                  holds                                      serves
=====================  =========================================  ===========================
``_posted``            receives by (job, src, dst, tag), FIFO     matching
``_arrived``           unmatched sends and RTS by key, FIFO       matching
``_unrouted``          ROUTE sends by (job, dst)                  a rank joins
``_recvs_from``        posted receives by (job, src)              a rank joins or leaves
``_offers_to``         unmatched sends and RTS by (job, dst)      a rank leaves
``_out_to``            announced sends by (job, dst)              a rank is lost
``_out``/``_out_by``   announced sends by msg id, by node         CTS/DONE, a peer is down
``_remote``            unmatched RTS by node and msg id           CANCEL, a peer is down
``_deadlines``         route deadlines by op                      the timer
``_stall_at``          stall deadlines by op (post + stall_after) the timer: stall reports
``_unanswered``        sends in RTS or EAGER state, by key        the crossing rule
``_credit_used``       bytes of EAGER sends unanswered, by node   credit
``_pool_used``         pool bytes held (or reserved), by node     the pool's bound
``_arriving``          the EAGER whose payload lands, by node     its end
``_rtrs``/``_by_key``  receives with an RTR out, by number, key   RTS{rtr}, voiding
``_no_rtr``            posted receives without an RTR, by key     RTRs in the receives' order
``_rtrs_in``           RTRs waiting for a send, FIFO by key       dispatch
``_rtrs_in_by/_for``   those RTRs by node, by src and dst rank    a peer or a rank is gone
``_rtrs_lost``         keys of RTRs dropped for room, by node     turn-keeping
``_rtr_top``           the highest RTR number sent, by node       late DATA of a gone receive
=====================  =========================================  ===========================

Memory: a Python dict never returns the memory of deleted entries, so once more operations and
unmatched RTS left the engine than twice the number still in it, every table is rebuilt
(:meth:`Messaging._shrink`, O(what is left), so amortised O(1) per removal): 10^5 operations
that ended keep no memory behind.  A peer holds at most ``max_unmatched_rts_per_peer``
unmatched RTS here; the next one is refused with a DONE of code ``limit`` (its send fails with a
message that names the setting), so a sender that announces without end costs a bounded amount.
The pool holds at most ``eager_credit`` bytes of a peer's eager messages, and at most
``max_unmatched_rts_per_peer`` of its RTRs wait here.

Stalls: with ``stall_after`` set, every operation gets a stall deadline when it is posted (one
heap push) that is cancelled when it ends (one dict removal; the heap entry is dropped
lazily).  An operation still pending then is returned once from :meth:`Messaging.on_timer` as
a :class:`~fabricd.engines.stalls.Stalled` saying what it waits for; :meth:`Messaging.stalls`
describes every such operation on demand.  The timer is told about stall deadlines lazily
(``_stall_check``): it only ever moves earlier when an operation is posted and is recomputed
when it fires, so an operation that ends never moves the daemon's timer, and a busy daemon
wakes for stall checks about once per ``stall_after``.

Failure: when a rank's node goes down every operation that involves the rank fails with code
``peer_failed``; a send whose destination has not joined (or a receive whose source has not)
fails with ``no_such_rank`` after ``route_timeout``.  When a client leaves, its unmatched
operations vanish (the sender's daemon CANCELs announced sends); matched transfers run to the
end because the daemon still maps the segment, and their result is dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from fabricd.engines.actions import Complete, Failure, Notice, SendFrame
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.landing import Landing
from fabricd.engines.membership import RankJoined, RankKey, RankLeft
from fabricd.engines.p2p.operations import (
    RECV_TRANSITIONS,
    SEND_TRANSITIONS,
    TERMINAL,
    Key,
    QueuedRtr,
    Recv,
    RecvInput,
    RecvState,
    Remote,
    Send,
    SendInput,
    SendState,
)
from fabricd.engines.queues import KeyedQueues
from fabricd.engines.stalls import Stalled, Waits, other_tags
from fabricd.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from fabricd.frames.p2p import Cancel, Cts, Done, Eager, Rtr, Rts
from fabricd.wire import Kind

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from fabricd.engines.membership import RankEntry, RankEvent, Routes
    from fabricd.frames import MessageFrame

#: the control frames :meth:`Messaging.on_frame` takes (DATA and EAGER carry a payload: they
#: go to ``payload_buffer`` and ``data_arrived``)
FRAME_KINDS: Final = frozenset({Kind.RTS, Kind.CTS, Kind.DONE, Kind.CANCEL, Kind.RTR})


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """What a send offers or a receive accepts."""

    job: str
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: str

    @classmethod
    def from_rts(cls, frame: Rts | Eager | Rtr) -> Message:
        return cls(
            job=frame.job,
            src=frame.src,
            dst=frame.dst,
            tag=frame.tag,
            nbytes=frame.nbytes,
            dtype=frame.dtype,
        )

    @property
    def key(self) -> Key:
        return (self.job, self.src, self.dst, self.tag)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamData:
    """Stream send ``op``'s bytes to ``node`` as DATA frames of message ``msg`` (carrying
    ``rtr``, the receiver's RTR it answers, if not 0)."""

    node: int
    msg: int
    op: int
    rtr: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SendEager:
    """Send ``frame`` to ``node`` on the control channel, a copy of send ``op``'s bytes as its
    payload (the copy lets the receiver's pool, not the sender's segment, hold them)."""

    node: int
    op: int
    frame: Eager


@dataclass(frozen=True, slots=True, kw_only=True)
class Place:
    """Copy ``payload``, an eager message the pool held, into receive ``op``'s region (before
    the ``Complete`` of ``op`` that follows it)."""

    op: int
    payload: bytearray


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyLocal:
    """Copy send ``src_op``'s bytes into receive ``dst_op``'s region, then report back."""

    src_op: int
    dst_op: int


Action = SendFrame | SendEager | StreamData | Place | CopyLocal | Complete | Notice | Stalled


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagingStatistics:
    """What ``fabricctl status`` shows of the point-to-point engine."""

    sends: int  #: sends not finished yet
    receives: int  #: receives not finished yet
    unrouted: int  #: operations waiting for their peer rank to join (a deadline runs)
    unexpected: int  #: messages (local sends, remote RTS) waiting for their receive
    transfers: int  #: transfers whose bytes are moving now
    bytes_received: int  #: payload bytes of remote messages that arrived
    refused_rts: int = 0  #: RTS refused: their node held max_unmatched_rts_per_peer here
    stalls_reported: int = 0  #: operations reported once as pending past stall_after
    eager_pool_bytes: int = 0  #: bytes of eager messages the pool holds for their receive
    eager_sent: int = 0  #: sends that went eager
    eager_no_credit: int = 0  #: sends small enough for eager that went RTS: no credit left
    eager_pool_full: int = 0  #: EAGER frames whose payload was dropped (pool full): as RTS
    rtr_sent: int = 0  #: receives that sent an RTR ahead of the RTS
    rtr_answered: int = 0  #: sends that found an RTR and streamed at once
    rtr_dropped: int = 0  #: RTRs dropped here: a send of the key was unanswered, or no room


_ANNOUNCED: Final = (SendState.RTS, SendState.EAGER, SendState.STREAM)  #: filed in ``_out``
#: sent, but not yet matched as far as this node knows: an RTR of the key is dropped (crossing)
_UNANSWERED: Final = (SendState.RTS, SendState.EAGER)
_MOVING: Final = (SendState.STREAM, SendState.COPY)  #: counted as transfers
#: what an operation waits for in each state (a receive still POSTED: see ``_stalled``)
_SEND_WAITS: Final = {
    SendState.ROUTE: Waits.JOIN,
    SendState.QUEUED: Waits.MATCH,
    SendState.RTS: Waits.CTS,
    SendState.EAGER: Waits.DONE,
    SendState.STREAM: Waits.DONE,
    SendState.COPY: Waits.COPY,
}
_RECV_WAITS: Final = {RecvState.LANDING: Waits.DATA, RecvState.COPY: Waits.COPY}
#: removals tolerated beyond twice what is left before the tables are rebuilt (small engines
#: are never rebuilt; large ones once per halving)
_SHRINK_SLACK: Final = 1024
#: a stall report names the other tags among at most this many of the peer's oldest operations
#: from (or to) the rank: a scan of all of them made each report O(pending), and a job whose
#: tags all disagree, O(pending^2) in one timer callback
_TAGS_SCANNED: Final = 64


class Messaging:
    """The point-to-point engine of one daemon.

    Args:
        node: this daemon's node id.
        routes: where ranks live (read-only; the engine hears of changes through
            :meth:`on_rank_event`).
        route_timeout: seconds a send or receive waits for its peer rank to join.
        max_unmatched_rts_per_peer: most unmatched RTS one peer node may hold here (``None``:
            no bound); the setting of that name in the daemon's config.
        stall_after: seconds after which a pending operation is reported as stalled
            (``None``: never).
        eager_limit: the largest message sent eager (``0``: none).  Larger receives whose
            source is on another node send an RTR.
        eager_credit: bytes of eager messages this node may have unanswered at each peer, and
            the size of the pool it holds for each peer's (both ends are configured alike; a
            peer that overdraws finds its payloads dropped and its messages taken as RTS).
        receiver_initiated: whether a receive posted before its message sends an RTR.
    """

    def __init__(
        self,
        *,
        node: int,
        routes: Routes,
        route_timeout: float,
        max_unmatched_rts_per_peer: int | None = None,
        stall_after: float | None = None,
        eager_limit: int = 0,
        eager_credit: int = 0,
        receiver_initiated: bool = True,
    ) -> None:
        self.node = node
        self.routes = routes
        self.route_timeout = route_timeout
        self.max_unmatched_rts_per_peer = max_unmatched_rts_per_peer
        self.stall_after = stall_after
        self.eager_limit = eager_limit
        self.eager_credit = eager_credit
        self.receiver_initiated = receiver_initiated
        self._sends: dict[int, Send] = {}
        self._recvs: dict[int, Recv] = {}
        self._posted: KeyedQueues[Key, Recv] = KeyedQueues()
        self._arrived: KeyedQueues[Key, Send | Remote] = KeyedQueues()
        self._unrouted: dict[RankKey, dict[Send, None]] = {}
        self._recvs_from: dict[RankKey, dict[Recv, None]] = {}
        self._offers_to: dict[RankKey, dict[Send | Remote, None]] = {}
        self._out_to: dict[RankKey, dict[Send, None]] = {}
        self._out: dict[int, Send] = {}
        self._out_by: dict[int, dict[int, Send]] = {}
        self._remote: dict[int, dict[int, Remote]] = {}
        self._deadlines: Deadlines[int] = Deadlines()
        self._stall_at: Deadlines[int] = Deadlines()
        #: when the timer must look at ``_stall_at``: never later than its earliest deadline
        self._stall_check: float | None = None
        self._stalls_reported = 0
        self._landing = Landing()
        self._moving = 0  #: sends in STREAM or COPY
        self._removed = 0  #: operations and RTS that left since the tables were last rebuilt
        self._refused_rts = 0
        self._msg_ids = itertools.count(1)
        #: per node, the (message, rtr) whose CANCEL came while one of its chunks was landing in
        #: its receive's region (one data link per node: at most one); applied once it is in
        self._cancel_after_chunk: dict[int, tuple[int, int]] = {}
        # -- eager messages (sender: credit; receiver: pool)
        self._unanswered: dict[Key, int] = {}  #: sends in RTS or EAGER state, by key
        self._credit_used: dict[int, int] = {}  #: bytes of EAGER sends unanswered, by node
        self._pool_used: dict[int, int] = {}  #: bytes the pool holds (or reserved), by node
        #: per node, the EAGER whose payload is arriving now: (msg, its pool buffer or ``None``
        #: when it lands straight in its receive); control frames arrive one at a time
        self._arriving: dict[int, tuple[int, bytearray | None]] = {}
        # -- receiver-initiated rendezvous (receiver: RTRs out; sender: RTRs waiting)
        self._rtr_ids = itertools.count(1)
        self._rtrs: dict[int, Recv] = {}  #: POSTED receives with an RTR out, by its number
        self._rtrs_by_key: dict[Key, dict[Recv, None]] = {}
        self._no_rtr: dict[Key, int] = {}  #: POSTED receives without an RTR out, by key
        self._rtrs_in: KeyedQueues[Key, QueuedRtr] = KeyedQueues()
        self._rtrs_in_by: dict[int, dict[QueuedRtr, None]] = {}  #: by the node that sent them
        self._rtrs_in_for: dict[RankKey, dict[QueuedRtr, None]] = {}  #: by src and by dst rank
        #: per node, the keys one of whose RTRs was dropped for want of room: later RTRs of the
        #: key are dropped too, until a send of the key goes without one (see ``_on_rtr``)
        self._rtrs_lost: dict[int, set[Key]] = {}
        #: per node, the highest RTR number sent there: DATA naming one of those that is no
        #: longer expected is read and dropped (``payload_buffer``), not a protocol error
        self._rtr_top: dict[int, int] = {}
        self._counts = dict.fromkeys(
            (
                "eager_sent",
                "eager_no_credit",
                "eager_pool_full",
                "rtr_sent",
                "rtr_answered",
                "rtr_dropped",
            ),
            0,
        )

    # -- clients ----------------------------------------------------------------------------
    def post_send(self, op: int, msg: Message, now: float) -> list[Action]:
        """A local client sends ``msg`` from the region of operation ``op``.

        Raises:
            LocalProtocolError: ``op`` is already in the engine (a bug in the caller).
        """
        self._check_new(op)
        send = self._sends[op] = Send(op=op, msg=msg, posted=now)
        self._watch(op, now)
        entry = self.routes.lookup(msg.job, msg.dst)
        if entry is None:
            _add(self._unrouted, (msg.job, msg.dst), send)
            self._deadlines.set(op, now + self.route_timeout)
            return []
        return self._dispatch(send, entry)

    def post_recv(self, op: int, msg: Message, region: memoryview, now: float) -> list[Action]:
        """A local client receives ``msg`` into ``region`` (writable, ``msg.nbytes`` bytes).

        Raises:
            LocalProtocolError: ``op`` is already in the engine, or ``region`` does not fit
                ``msg`` (a bug in the caller).
        """
        self._check_new(op)
        if region.readonly or region.nbytes != msg.nbytes:
            raise LocalProtocolError(f"receive {op} needs {msg.nbytes} writable bytes")
        recv = self._recvs[op] = Recv(op=op, msg=msg, region=region, posted=now)
        self._watch(op, now)
        _bump(self._no_rtr, msg.key, 1)  # POSTED, no RTR out
        offer = self._arrived.first(msg.key)
        if offer is not None:
            return self._match(offer, recv)
        recv.slot = self._posted.push(msg.key, recv)
        _add(self._recvs_from, (msg.job, msg.src), recv)
        entry = self.routes.lookup(msg.job, msg.src)
        if entry is None:
            self._deadlines.set(op, now + self.route_timeout)
        elif (
            self.receiver_initiated
            and entry.node != self.node
            and msg.nbytes > self.eager_limit
            and self._no_rtr[msg.key] == 1  # this one: RTRs go out in the receives' order
        ):
            return self._send_rtr(recv, entry.node)
        return []

    def abandon(self, ops: Iterable[int]) -> list[Action]:
        """Forget operations whose client is gone; transfers under way run to their end."""
        actions: list[Action] = []
        for op in ops:
            send = self._sends.get(op)
            if send is not None:
                announced = send.state in _UNANSWERED
                self._move_send(send, SendInput.ABANDONED)
                if announced:
                    cancel = Cancel(msg=send.msg_id, rtr=send.rtr)
                    actions.append(SendFrame(node=send.node, frame=cancel))
            recv = self._recvs.get(op)
            if recv is not None:
                self._move_recv(recv, RecvInput.ABANDONED)
        return actions

    # -- membership's news ------------------------------------------------------------------
    def on_rank_event(self, event: RankEvent, now: float) -> list[Action]:
        """A rank joined (send what waited for it) or left (fail what needed it)."""
        match event:
            case RankJoined(entry=entry):
                rank = (entry.job, entry.rank)
                actions: list[Action] = []
                for send in list(self._unrouted.get(rank, ())):
                    actions += self._dispatch(send, entry)
                for recv in self._recvs_from.get(rank, ()):
                    self._deadlines.cancel(recv.op)
                return actions
            case RankLeft(entry=entry, reason=reason, lost=lost):
                return self._left(entry, reason, lost=lost)

    # -- the daemon's reports ---------------------------------------------------------------
    def payload_buffer(self, node: int, frame: MessageFrame, length: int) -> memoryview | None:
        """Where the ``length`` payload bytes of a DATA or EAGER frame from ``node`` land;
        ``None``: read them and drop them (:meth:`Landing.payload_buffer`; an EAGER whose
        receive is not posted lands in the pool, or nowhere when the pool is full).

        Raises:
            RemoteProtocolError: the chunk was never asked for, or is out of place, or the EAGER
                reuses a message id or carries other than its ``nbytes``; close the link it
                came on.
        """
        if isinstance(frame, Eager):
            return self._eager_buffer(node, frame, length)
        lid = -frame.rtr if frame.rtr else frame.msg
        if 0 < frame.rtr <= self._rtr_top.get(node, 0) and not self._landing.expects(node, lid):
            # An RTR this node sent there whose receive is gone (abandoned, failed, voided):
            # the sender may have answered it, and its DATA outrun the RTS, before it heard.
            # Such receives are not marked cancelled in the landing table: a client leaving
            # with more of them than it remembers pushed out the marks of the answered ones
            # (and of messages whose sender cancelled them), and their DATA reset the peer.
            return None
        return self._landing.payload_buffer(node, lid, frame.off, length)

    def data_arrived(self, node: int, frame: MessageFrame, length: int, now: float) -> list[Action]:
        """A DATA or EAGER frame's ``length`` bytes were written where :meth:`payload_buffer`
        said (for an EAGER of no bytes, :meth:`payload_buffer` was never asked)."""
        if isinstance(frame, Eager):
            if length != frame.nbytes:  # (a payload of any length but 0 was checked at its head)
                raise RemoteProtocolError(
                    f"EAGER {frame.msg} from node {node} says {frame.nbytes} B and carries {length}"
                )
            arriving = self._arriving.pop(node, None)
            if arriving is None or arriving[0] != frame.msg:
                return self._on_rts(node, frame.rts())  # no bytes, or dropped: as an RTS
            if arriving[1] is None:  # straight into its receive
                return self._landed(node, frame.msg, frame.msg, length)
            return self._on_rts(node, frame.rts(), arriving[1])
        lid = -frame.rtr if frame.rtr else frame.msg
        after = self._cancel_after_chunk
        if after and after.get(node) == (frame.msg, frame.rtr):
            self._landing.arrived(node, lid, length)
            del self._cancel_after_chunk[node]  # the chunk is in: now its CANCEL can fail it
            return self._on_cancel(node, frame.msg, frame.rtr)
        return self._landed(node, lid, frame.msg, length)

    def _landed(self, node: int, lid: int, msg_id: int, length: int) -> list[Action]:
        """``length`` more bytes of landing entry (``node``, ``lid``) of message ``msg_id`` are
        in: once all are, the receive is answered."""
        if not self._landing.arrived(node, lid, length):
            return []
        op = self._landing.forget(node, lid)
        if op is None:
            text = "the receiving rank disconnected"
            return [_refuse(node, msg_id, ErrorCode.RECEIVER_LEFT, text)]
        recv = self._recvs[op]
        if recv.state is RecvState.POSTED:  # an RTR's bytes, all in before the RTS answering it
            recv.rtr_done = msg_id
            return []
        self._move_recv(recv, RecvInput.DELIVERED)
        return [SendFrame(node=node, frame=Done(msg=msg_id)), Complete(op=op)]

    def _eager_buffer(self, node: int, frame: Eager, length: int) -> memoryview | None:
        """Where an EAGER's payload lands: its receive's region if that is posted and fits, a
        buffer of the pool if there is room, else nowhere (the frame is then taken as an RTS
        when it ends: :meth:`data_arrived`)."""
        if length != frame.nbytes:
            raise RemoteProtocolError(
                f"EAGER {frame.msg} from node {node} says {frame.nbytes} B and carries {length}"
            )
        if frame.msg in self._remote.get(node, {}) or self._landing.expects(node, frame.msg):
            raise RemoteProtocolError(f"node {node} reused the id of message {frame.msg}")
        msg = Message.from_rts(frame)
        recv = self._posted.first(msg.key)
        if recv is not None:
            if _mismatch(msg, recv.msg) is not None:
                return None  # both fail when the frame ends
            self._land(recv, node, frame.msg)
            self._arriving[node] = (frame.msg, None)
            return self._landing.payload_buffer(node, frame.msg, 0, length)
        entry = self.routes.lookup(msg.job, msg.dst)
        limit = self.max_unmatched_rts_per_peer
        if entry is None or entry.node != self.node:
            return None  # refused when the frame ends
        if limit is not None and len(self._remote.get(node, ())) >= limit:
            return None
        used = self._pool_used.get(node, 0)
        if used + length > self.eager_credit:
            self._counts["eager_pool_full"] += 1
            return None
        payload = bytearray(length)
        _bump(self._pool_used, node, length)
        self._arriving[node] = (frame.msg, payload)
        return memoryview(payload)

    def copied(self, src_op: int, dst_op: int) -> list[Action]:
        """A :class:`CopyLocal` finished.

        Raises:
            LocalProtocolError: the two operations were not being copied (a bug).
        """
        send, recv = self._copying(src_op, dst_op)
        self._move_send(send, SendInput.COPIED)
        self._move_recv(recv, RecvInput.COPIED)
        return [Complete(op=src_op), Complete(op=dst_op)]

    def copy_failed(self, src_op: int, dst_op: int, code: ErrorCode, reason: str) -> list[Action]:
        """A :class:`CopyLocal` could not be done (no worker thread, no memory): both operations
        fail with ``code`` and ``reason``, and the receive's bytes are no whole message.

        Raises:
            LocalProtocolError: the two operations were not being copied (a bug).
        """
        send, recv = self._copying(src_op, dst_op)
        self._move_send(send, SendInput.COPY_FAILED)
        self._move_recv(recv, RecvInput.COPY_FAILED)
        return [
            Complete(op=src_op, failure=Failure(code=code, message=reason)),
            Complete(op=dst_op, failure=Failure(code=code, message=reason)),
        ]

    def _copying(self, src_op: int, dst_op: int) -> tuple[Send, Recv]:
        """The send and receive of a :class:`CopyLocal` under way.

        Raises:
            LocalProtocolError: the two operations were not being copied (a bug).
        """
        send, recv = self._sends.get(src_op), self._recvs.get(dst_op)
        if send is None or recv is None:
            raise LocalProtocolError(f"no copy of operation {src_op} into {dst_op} is under way")
        return send, recv

    def stream_failed(
        self, msg_id: int, reason: str, code: ErrorCode = ErrorCode.TRANSPORT
    ) -> list[Action]:
        """Streaming message ``msg_id`` failed locally: its data link closed (code ``transport``),
        or the daemon ran out of memory for it (``resources``).

        The receiver is told with a CANCEL, so its receive fails instead of waiting.
        """
        send = self._out.get(msg_id)
        if send is None:
            return []
        failed = self._fail_send(send, code, reason, send.node, None)
        return [*failed, SendFrame(node=send.node, frame=Cancel(msg=msg_id, rtr=send.rtr))]

    def peer_down(self, node: int, reason: str) -> list[Action]:
        """``node`` is down or restarted: fail every transfer with it, forget its messages.

        Its ranks' departure comes separately, as :class:`RankLeft` events.
        """
        text = f"node {node} is {reason}"
        actions: list[Action] = []
        self._cancel_after_chunk.pop(node, None)  # its receive fails here, with the others
        arriving = self._arriving.pop(node, None)
        if arriving is not None:
            self._release(node, arriving[1])
        for queued in list(self._rtrs_in_by.get(node, ())):
            self._unqueue_rtr(queued)
        self._rtrs_lost.pop(node, None)
        self._rtr_top.pop(node, None)  # its next incarnation answers none of them
        for recv in [r for r in self._rtrs.values() if r.source[0] == node]:
            self._void_rtr(recv)  # it waits on as a plain receive (its rank's news decides)
        for send in list(self._out_by.get(node, {}).values()):
            actions += self._fail_send(send, ErrorCode.PEER_FAILED, text, node, send.msg.dst)
        for op in self._landing.forget_node(node):
            recv = self._recvs[op]
            actions += self._fail_recv(recv, ErrorCode.PEER_FAILED, text, node, recv.msg.src)
        for offer in list(self._remote.get(node, {}).values()):
            self._unfile(offer)
        return actions

    def on_frame(
        self, node: int, frame: Rts | Cts | Done | Cancel | Rtr, now: float
    ) -> list[Action]:
        """A control frame of :data:`FRAME_KINDS` arrived from ``node``.

        Raises:
            RemoteProtocolError: an RTS reuses the id of a message still under way from
                ``node``; close that peer's links.
        """
        match frame:
            case Rts():
                return self._on_rts(node, frame)
            case Cts(msg=msg_id):
                send = self._out.get(msg_id)
                if send is None or send.node != node:
                    return []  # cancelled meanwhile
                if send.state not in _UNANSWERED or send.rtr:
                    return [Notice(message=f"node {node} sent a second CTS for message {msg_id}")]
                self._move_send(send, SendInput.CTS)
                return [StreamData(node=node, msg=msg_id, op=send.op)]
            case Done(msg=msg_id, code=code, error=error):
                send = self._out.get(msg_id)
                if send is None or send.node != node:
                    return []
                self._move_send(send, SendInput.DONE)
                if code is None or error is None:
                    return [Complete(op=send.op)]
                failure = Failure(code=code, message=error, rank=send.msg.dst, node=node)
                return [Complete(op=send.op, failure=failure)]
            case Cancel(msg=msg_id, rtr=rtr):
                return self._on_cancel(node, msg_id, rtr)
            case Rtr():
                return self._on_rtr(node, frame)

    # -- timers and status ------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run (``None``: nothing waits for a route or a stall
        check)."""
        route, stall = self._deadlines.next(), self._stall_check
        if stall is None or (route is not None and route < stall):
            return route
        return stall

    def on_timer(self, now: float) -> list[Action]:
        """Fail the operations whose peer rank did not join within ``route_timeout``; report,
        once each, those pending for ``stall_after`` (:class:`Stalled`)."""
        actions: list[Action] = []
        for op in self._deadlines.pop_due(now):
            send, recv = self._sends.get(op), self._recvs.get(op)
            if send is not None:
                text = f"rank {send.msg.dst} of job {send.msg.job!r} did not join within "
                actions += self._fail_send(
                    send, ErrorCode.NO_SUCH_RANK, text + self._waited(), None, send.msg.dst
                )
            elif recv is not None:
                text = f"rank {recv.msg.src} of job {recv.msg.job!r} did not join within "
                actions += self._fail_recv(
                    recv, ErrorCode.NO_SUCH_RANK, text + self._waited(), None, recv.msg.src
                )
        if self._stall_check is not None and self._stall_check <= now:
            for op in self._stall_at.pop_due(now):
                operation = self._sends.get(op) or self._recvs.get(op)
                if operation is not None:
                    actions.append(self._stalled(operation, now))
                    self._stalls_reported += 1
            self._stall_check = self._stall_at.next()
        return actions

    def stalls(
        self,
        now: float,
        keep: Callable[[int, str], bool] | None = None,
        limit: int | None = None,
    ) -> list[Stalled]:
        """Every operation pending for ``stall_after`` or longer, longest first, with what it
        waits for.  O(pending operations): an operator's query, not a hot path.

        Args:
            keep: asked once for every such operation, oldest first, with its op and job:
                whether to describe it (the asker may see it).
            limit: describe at most this many (the oldest ``keep`` accepted); ``keep`` is
                still asked about the rest, so it can count them.  Describing one costs tens
                of microseconds, and a client may have tens of thousands pending.
        """
        if self.stall_after is None:
            return []
        since = now - self.stall_after
        found: list[Send | Recv] = [s for s in self._sends.values() if s.posted <= since]
        found += [r for r in self._recvs.values() if r.posted <= since]
        found.sort(key=lambda operation: (operation.posted, operation.op))
        out: list[Stalled] = []
        for operation in found:
            if keep is not None and not keep(operation.op, operation.msg.job):
                continue
            if limit is None or len(out) < limit:
                out.append(self._stalled(operation, now))
        return out

    def stalled(self, now: float) -> int:
        """How many operations are pending for ``stall_after`` or longer (a metrics gauge);
        O(pending operations), nothing described."""
        if self.stall_after is None:
            return 0
        since = now - self.stall_after
        sends = sum(1 for send in self._sends.values() if send.posted <= since)
        return sends + sum(1 for recv in self._recvs.values() if recv.posted <= since)

    def pending(self) -> int:
        """Operations not finished yet."""
        return len(self._sends) + len(self._recvs)

    def holds(self, op: int) -> bool:
        """Whether ``op`` is still in the engine (after :meth:`abandon`: a transfer under way)."""
        return op in self._sends or op in self._recvs

    def transfers(self) -> int:
        """Transfers whose bytes are moving now; a drain waits for these to end."""
        return self._moving + len(self._landing)

    def statistics(self) -> MessagingStatistics:
        return MessagingStatistics(
            sends=len(self._sends),
            receives=len(self._recvs),
            unrouted=len(self._deadlines),
            unexpected=len(self._arrived),
            transfers=self.transfers(),
            bytes_received=self._landing.bytes,
            refused_rts=self._refused_rts,
            stalls_reported=self._stalls_reported,
            eager_pool_bytes=sum(self._pool_used.values()),
            **self._counts,
        )

    # -- stalls -----------------------------------------------------------------------------
    def _watch(self, op: int, now: float) -> None:
        """Give a new operation its stall deadline: one heap push."""
        if self.stall_after is None:
            return
        at = now + self.stall_after
        self._stall_at.set(op, at)
        if self._stall_check is None or at < self._stall_check:
            self._stall_check = at

    def _stalled(self, operation: Send | Recv, now: float) -> Stalled:
        """What ``operation`` waits for, and where its peer rank is."""
        msg = operation.msg
        is_send = isinstance(operation, Send)
        me, peer = (msg.src, msg.dst) if is_send else (msg.dst, msg.src)
        entry = self.routes.lookup(msg.job, peer)
        node = None if entry is None else entry.node
        received: int | None = None
        tags: set[int] = set()
        if isinstance(operation, Send):
            waits = _SEND_WAITS.get(operation.state, Waits.COPY)
            if operation.state in _ANNOUNCED:
                node = operation.node
            elif waits is Waits.MATCH:  # receives the peer posted from this rank, other tags
                posted = self._recvs_from.get((msg.job, me), ())
                near = itertools.islice(posted, _TAGS_SCANNED)
                tags = {recv.msg.tag for recv in near if recv.msg.dst == peer}
        elif operation.state is RecvState.POSTED:
            if node is None:
                waits = Waits.JOIN
            else:
                waits = Waits.MATCH if node == self.node else Waits.RTS
                offers = self._offers_to.get((msg.job, me), ())
                first = itertools.islice(offers, _TAGS_SCANNED)
                tags = {offer.msg.tag for offer in first if offer.msg.src == peer}
        else:
            waits = _RECV_WAITS.get(operation.state, Waits.COPY)
            if operation.state is RecvState.LANDING:
                node = operation.source[0]
                received = self._landing.received(*operation.source)
        return Stalled(
            op=operation.op,
            send=is_send,
            msg=msg,
            node=self.node,
            pending_for=now - operation.posted,
            waits=waits,
            peer_node=node,
            peer_joined=entry is not None,
            other_tags=other_tags(tags, msg.tag),
            received=received,
        )

    # -- matching and rendezvous ------------------------------------------------------------
    def _dispatch(self, send: Send, entry: RankEntry) -> list[Action]:
        """``send``'s destination is known: queue it here or announce it to its node."""
        msg = send.msg
        if entry.node == self.node:
            self._move_send(send, SendInput.ROUTED_HERE)
            recv = self._posted.first(msg.key)
            if recv is not None:
                return self._match(send, recv)
            send.slot = self._arrived.push(msg.key, send)
            _add(self._offers_to, (msg.job, msg.dst), send)
            return []
        node = send.node = entry.node
        send.msg_id = next(self._msg_ids)
        while (queued := self._rtrs_in.first(msg.key)) is not None:
            self._unqueue_rtr(queued)
            if queued.node == node:  # the receiver is ready: announce and stream at once
                return self._answer_rtr(send, queued)
            self._counts["rtr_dropped"] += 1  # stale: the rank lives elsewhere now
        lost = self._rtrs_lost.get(node)
        if lost is not None and msg.key in lost:  # this plain message voids them (``_on_rtr``)
            lost.discard(msg.key)
            if not lost:
                del self._rtrs_lost[node]
        used = self._credit_used.get(node, 0)
        if msg.nbytes <= self.eager_limit:
            if used + msg.nbytes <= self.eager_credit:
                _bump(self._credit_used, node, msg.nbytes)
                self._announce(send, SendInput.SENT_EAGER)
                self._counts["eager_sent"] += 1
                eager = Eager(**_announced(send))
                return [SendEager(node=node, op=send.op, frame=eager)]
            self._counts["eager_no_credit"] += 1
        self._announce(send, SendInput.ROUTED_AWAY)
        return [SendFrame(node=node, frame=_rts(send))]

    def _announce(self, send: Send, event: SendInput) -> None:
        """Move ``send`` to the state ``event`` names, and file it by its message id."""
        self._move_send(send, event)
        self._out[send.msg_id] = send
        self._out_by.setdefault(send.node, {})[send.msg_id] = send
        _add(self._out_to, (send.msg.job, send.msg.dst), send)

    def _answer_rtr(self, send: Send, queued: QueuedRtr) -> list[Action]:
        """``send`` takes the receiver's waiting RTR: its RTS names the RTR and goes ahead of
        its DATA on the control channel (so a later send's RTS cannot overtake it), and its
        DATA, which carries the RTR too, follows at once.  A send that does not fit the
        receive only announces itself: the receiver fails both, in order."""
        send.rtr = queued.rtr
        announce = SendFrame(node=send.node, frame=_rts(send))
        if _mismatch(send.msg, queued.msg) is not None:
            self._announce(send, SendInput.ROUTED_AWAY)  # its DONE brings the mismatch
            return [announce]
        self._announce(send, SendInput.MET_RTR)
        self._counts["rtr_answered"] += 1
        stream = StreamData(node=send.node, msg=send.msg_id, op=send.op, rtr=queued.rtr)
        return [announce, stream]

    def _match(self, offer: Send | Remote, recv: Recv) -> list[Action]:
        """The oldest message of a key meets the oldest receive of that key."""
        problem = _mismatch(offer.msg, recv.msg)
        if isinstance(offer, Send):
            if problem is not None:
                return [
                    *self._fail_send(offer, ErrorCode.MISMATCH, problem, None, offer.msg.dst),
                    *self._fail_recv(recv, ErrorCode.MISMATCH, problem, None, recv.msg.src),
                ]
            self._move_send(offer, SendInput.MATCHED)
            self._move_recv(recv, RecvInput.MATCHED_HERE)
            return [CopyLocal(src_op=offer.op, dst_op=recv.op)]
        self._unfile(offer)
        self._void_rtrs(recv.msg.key)  # a message that answers no RTR: its sender dropped them
        node, msg_id = offer.node, offer.msg_id
        if problem is not None:
            failed = self._fail_recv(recv, ErrorCode.MISMATCH, problem, None, recv.msg.src)
            return [_refuse(node, msg_id, ErrorCode.MISMATCH, problem), *failed]
        if offer.payload is not None:  # an eager message the pool held
            self._move_recv(recv, RecvInput.DELIVERED)
            done = SendFrame(node=node, frame=Done(msg=msg_id))
            return [Place(op=recv.op, payload=offer.payload), done, Complete(op=recv.op)]
        if offer.msg.nbytes == 0:
            self._move_recv(recv, RecvInput.DELIVERED)
            return [SendFrame(node=node, frame=Done(msg=msg_id)), Complete(op=recv.op)]
        self._land(recv, node, msg_id)
        return [SendFrame(node=node, frame=Cts(msg=msg_id))]

    def _land(self, recv: Recv, node: int, msg_id: int) -> None:
        """Message ``msg_id`` of ``node`` lands in ``recv``'s region from now on."""
        self._void_rtrs(recv.msg.key)
        assert recv.region is not None  # a POSTED receive keeps its region
        self._landing.expect(node, msg_id, recv.op, recv.region)
        recv.source = (node, msg_id)
        self._move_recv(recv, RecvInput.MATCHED_AWAY)

    def _on_rts(self, node: int, frame: Rts, payload: bytearray | None = None) -> list[Action]:
        """An RTS, or an EAGER as one (``payload``: its bytes, if the pool holds them)."""
        if frame.rtr:
            return self._on_answer(node, frame)
        if frame.msg in self._remote.get(node, {}) or self._landing.expects(node, frame.msg):
            raise RemoteProtocolError(f"node {node} reused the id of message {frame.msg}")
        msg = Message.from_rts(frame)
        entry = self.routes.lookup(msg.job, msg.dst)
        if entry is None or entry.node != self.node:
            self._release(node, payload)
            text = f"rank {msg.dst} of job {msg.job!r} is not connected to node {self.node}"
            return [_refuse(node, frame.msg, ErrorCode.NO_SUCH_RANK, text)]
        offer = Remote(node=node, msg_id=frame.msg, msg=msg, payload=payload)
        recv = self._posted.first(msg.key)
        if recv is not None:
            return self._match(offer, recv)
        limit = self.max_unmatched_rts_per_peer
        if limit is not None and len(self._remote.get(node, ())) >= limit:
            self._release(node, payload)
            self._refused_rts += 1
            text = (
                f"node {self.node} holds {limit} messages from node {node} that wait for their "
                f"receive, the most max_unmatched_rts_per_peer allows there; post the receives "
                f"first, or raise max_unmatched_rts_per_peer on node {self.node}"
            )
            return [_refuse(node, frame.msg, ErrorCode.LIMIT, text)]
        offer.slot = self._arrived.push(msg.key, offer)
        _add(self._offers_to, (msg.job, msg.dst), offer)
        self._remote.setdefault(node, {})[frame.msg] = offer
        return []

    def _on_answer(self, node: int, frame: Rts) -> list[Action]:
        """The RTS of a message that answers this node's RTR ``frame.rtr`` (its DATA may be in
        already): the receive is matched; it ends when every byte is in."""
        recv = self._rtrs.get(frame.rtr)
        if recv is None or recv.source[0] != node:
            text = "the receive this message answered is gone: its rank left"
            return [_refuse(node, frame.msg, ErrorCode.RECEIVER_LEFT, text)]
        if self._posted.first(recv.msg.key) is not recv:
            raise RemoteProtocolError(f"node {node} answered RTR {frame.rtr} out of turn")
        problem = _mismatch(Message.from_rts(frame), recv.msg)
        if problem is not None:
            failed = self._fail_recv(recv, ErrorCode.MISMATCH, problem, None, recv.msg.src)
            return [_refuse(node, frame.msg, ErrorCode.MISMATCH, problem), *failed]
        if recv.rtr_done:  # every byte came ahead of this RTS
            self._move_recv(recv, RecvInput.DELIVERED)
            return [SendFrame(node=node, frame=Done(msg=frame.msg)), Complete(op=recv.op)]
        self._move_recv(recv, RecvInput.MATCHED_AWAY)
        self._landing.arm(*recv.source)
        return []

    def _on_rtr(self, node: int, frame: Rtr) -> list[Action]:
        """``node``'s receive is ready: keep its RTR for the next send of the key, unless a
        send of the key is unanswered here (the crossing rule: that send's RTS or EAGER will
        take the receive, and the receiver drops its RTRs of the key when it does)."""
        msg = Message.from_rts(frame)
        source = self.routes.lookup(msg.job, msg.src)
        limit = self.max_unmatched_rts_per_peer
        if source is None or source.node != self.node or self._unanswered.get(msg.key):
            self._counts["rtr_dropped"] += 1
            return []
        lost = self._rtrs_lost.get(node)
        if (lost is not None and msg.key in lost) or (
            limit is not None and len(self._rtrs_in_by.get(node, ())) >= limit
        ):
            # No room: the receiver still counts this RTR out, and a later RTR of the key that
            # found room would be taken by the next send, which is this one's (answered out of
            # turn).  So every RTR of the key is dropped until a send of it goes without one:
            # that plain message takes this RTR's receive and voids the later ones there.
            keys = self._rtrs_lost.setdefault(node, set())
            if limit is not None and msg.key not in keys and len(keys) >= _lost_keys(limit):
                # a receiver does not post receives of that many distinct keys at once past
                # the room; a peer that makes up keys would grow this table without end
                raise RemoteProtocolError(
                    f"node {node} sent RTRs of more than {_lost_keys(limit)} keys beyond the "
                    f"{limit} this node keeps (max_unmatched_rts_per_peer)"
                )
            keys.add(msg.key)
            self._counts["rtr_dropped"] += 1
            return []
        queued = QueuedRtr(node=node, rtr=frame.rtr, msg=msg)
        queued.slot = self._rtrs_in.push(msg.key, queued)
        _add(self._rtrs_in_by, node, queued)
        _add(self._rtrs_in_for, (msg.job, msg.src), queued)
        _add(self._rtrs_in_for, (msg.job, msg.dst), queued)
        return []

    def _unqueue_rtr(self, queued: QueuedRtr) -> None:
        """A waiting RTR leaves: a send took it, or its node or rank is gone."""
        if queued.slot is not None:
            self._rtrs_in.remove(queued.slot)
            queued.slot = None
        msg = queued.msg
        _discard(self._rtrs_in_by, queued.node, queued)
        _discard(self._rtrs_in_for, (msg.job, msg.src), queued)
        _discard(self._rtrs_in_for, (msg.job, msg.dst), queued)

    def _send_rtr(self, recv: Recv, node: int) -> list[Action]:
        """Ask ``node`` to stream ``recv``'s message as soon as it is sent: its region is
        registered now (unarmed) under the RTR's number, for DATA that may beat its RTS."""
        rtr = next(self._rtr_ids)
        assert recv.region is not None  # a POSTED receive keeps its region
        self._landing.expect(node, -rtr, recv.op, recv.region, armed=False)
        recv.rtr, recv.source = rtr, (node, -rtr)
        _bump(self._no_rtr, recv.msg.key, -1)
        self._rtrs[rtr] = recv
        self._rtr_top[node] = rtr
        _add(self._rtrs_by_key, recv.msg.key, recv)
        self._counts["rtr_sent"] += 1
        msg = recv.msg
        frame = Rtr(
            rtr=rtr,
            job=msg.job,
            src=msg.src,
            dst=msg.dst,
            tag=msg.tag,
            nbytes=msg.nbytes,
            dtype=msg.dtype,
        )
        return [SendFrame(node=node, frame=frame)]

    def _void_rtrs(self, key: Key) -> None:
        """A message of ``key`` arrived that answers no RTR: its sender dropped every RTR of
        the key still out (it had that message unanswered when they came), so forget them;
        their receives wait on as plain ones, and no RTR of the key goes out until they match."""
        for recv in list(self._rtrs_by_key.get(key, ())):
            self._void_rtr(recv)

    def _void_rtr(self, recv: Recv) -> None:
        """``recv``'s RTR will never be answered: forget it, and its unarmed landing entry."""
        self._unindex_rtr(recv)
        self._landing.forget(*recv.source)
        recv.rtr = recv.rtr_done = 0
        _bump(self._no_rtr, recv.msg.key, 1)

    def _unindex_rtr(self, recv: Recv) -> None:
        del self._rtrs[recv.rtr]
        _discard(self._rtrs_by_key, recv.msg.key, recv)

    def _release(self, node: int, payload: bytearray | None) -> None:
        """Give back the pool bytes an EAGER of ``node`` held (``None``: it held none)."""
        if payload is not None:
            _bump(self._pool_used, node, -len(payload))

    def _on_cancel(self, node: int, msg_id: int, rtr: int = 0) -> list[Action]:
        offer = self._remote.get(node, {}).get(msg_id)
        if offer is not None and not rtr:
            self._unfile(offer)
            return []
        if rtr in self._rtrs:  # before the RTS naming it: no sender does that
            return []
        lid = -rtr if rtr else msg_id
        if self._landing.filling(node, lid):  # a chunk is being written into the region:
            self._cancel_after_chunk[node] = (msg_id, rtr)  # answering now lets the client
            return []  # reuse it
        op = self._landing.cancel(node, lid)  # its DATA already under way is dropped
        if op is None:
            return []
        recv = self._recvs[op]
        text = "the sending rank disconnected before its message was delivered"
        return self._fail_recv(recv, ErrorCode.PEER_FAILED, text, node, recv.msg.src)

    def _left(self, entry: RankEntry, reason: str, *, lost: bool) -> list[Action]:
        """``entry``'s rank is gone: fail receives that wait for it, refuse messages to it and,
        if it was lost, fail the sends announced to it."""
        gone = (entry.job, entry.rank)
        actions: list[Action] = []
        code = ErrorCode.PEER_FAILED
        for recv in list(self._recvs_from.get(gone, ())):
            actions += self._fail_recv(recv, code, reason, entry.node, entry.rank)
        for offer in list(self._offers_to.get(gone, ())):
            if isinstance(offer, Remote):
                self._unfile(offer)
                actions.append(_refuse(offer.node, offer.msg_id, ErrorCode.RECEIVER_LEFT, reason))
            else:
                actions += self._fail_send(offer, code, reason, entry.node, entry.rank)
        if lost:
            for send in list(self._out_to.get(gone, ())):
                actions += self._fail_send(send, code, reason, entry.node, entry.rank)
        for queued in list(self._rtrs_in_for.get(gone, ())):  # asked by it, or for its sends
            self._unqueue_rtr(queued)
        for node, keys in list(self._rtrs_lost.items()):  # its receives or sends are gone too
            keys.difference_update([key for key in keys if gone in (key[:2], key[::2])])
            if not keys:
                del self._rtrs_lost[node]
        return actions

    # -- state changes ----------------------------------------------------------------------
    def _move_send(self, send: Send, event: SendInput) -> None:
        """Apply ``event`` to ``send``: take it out of the indexes its old state kept it in.

        Raises:
            LocalProtocolError: its state does not accept ``event``; it is BROKEN and gone.
        """
        old = send.state
        new = SEND_TRANSITIONS.get((old, event), SendState.BROKEN)
        if new is old:
            return
        msg = send.msg
        if old is SendState.ROUTE:
            self._deadlines.cancel(send.op)
            _discard(self._unrouted, (msg.job, msg.dst), send)
        elif old is SendState.QUEUED:
            if send.slot is not None:
                self._arrived.remove(send.slot)
            _discard(self._offers_to, (msg.job, msg.dst), send)
        elif old in _ANNOUNCED and new not in _ANNOUNCED:
            del self._out[send.msg_id]
            _discard(self._out_by, send.node, send.msg_id)
            _discard(self._out_to, (msg.job, msg.dst), send)
        # A send that answers an RTR (one that does not fit it waits in RTS for its DONE) is
        # matched already: an RTR of its key that comes meanwhile is a later receive's, kept.
        # Dropping it lost that receive's turn: the receiver counts it out, and the next RTR of
        # the key, once this DONE came, was taken ahead of it (answered out of turn).
        unanswered = 0 if send.rtr else (new in _UNANSWERED) - (old in _UNANSWERED)
        if unanswered:
            _bump(self._unanswered, msg.key, unanswered)
        if old is SendState.EAGER:  # answered, refused or withdrawn: its credit is back
            _bump(self._credit_used, send.node, -msg.nbytes)
        self._moving += (new in _MOVING) - (old in _MOVING)
        send.state = new
        if new in TERMINAL:
            del self._sends[send.op]
            self._stall_at.cancel(send.op)
            self._removal()
        if new is SendState.BROKEN:
            raise LocalProtocolError(f"send {send.op} in state {old.name} cannot take {event.name}")

    def _move_recv(self, recv: Recv, event: RecvInput) -> None:
        """Apply ``event`` to ``recv``: take it out of the indexes its old state kept it in.

        Raises:
            LocalProtocolError: its state does not accept ``event``; it is BROKEN and gone.
        """
        old = recv.state
        new = RECV_TRANSITIONS.get((old, event), RecvState.BROKEN)
        if new is old:
            return
        if old is RecvState.POSTED:
            self._deadlines.cancel(recv.op)
            if recv.slot is not None:
                self._posted.remove(recv.slot)
            _discard(self._recvs_from, (recv.msg.job, recv.msg.src), recv)
            recv.region = None  # the landing table holds it from now on, if anyone does
            if not recv.rtr:
                _bump(self._no_rtr, recv.msg.key, -1)
            else:  # its RTR was answered (MATCHED_AWAY, DELIVERED), or it failed or left
                self._unindex_rtr(recv)
                if event is not RecvInput.MATCHED_AWAY and event is not RecvInput.DELIVERED:
                    # DATA under way for it is dropped by its RTR's number (``payload_buffer``)
                    self._landing.forget(*recv.source)
        elif old is RecvState.LANDING:
            self._landing.discard(*recv.source)  # bytes still to come (if any) land nowhere
        recv.state = new
        if new in TERMINAL:
            del self._recvs[recv.op]
            self._stall_at.cancel(recv.op)
            self._removal()
        if new is RecvState.BROKEN:
            raise LocalProtocolError(
                f"receive {recv.op} in state {old.name} cannot take {event.name}"
            )

    def _unfile(self, offer: Remote) -> None:
        """An unmatched RTS or EAGER leaves the engine (matched, cancelled, refused, or its node
        is gone); an EAGER's pool bytes are given back (a match has its payload in hand)."""
        self._release(offer.node, offer.payload)
        if offer.slot is not None:
            self._arrived.remove(offer.slot)
        _discard(self._offers_to, (offer.msg.job, offer.msg.dst), offer)
        _discard(self._remote, offer.node, offer.msg_id)
        self._removal()

    def _removal(self) -> None:
        """An operation or an unmatched RTS left: rebuild the tables once enough did."""
        self._removed += 1
        live = len(self._sends) + len(self._recvs) + len(self._arrived)
        if self._removed > 2 * live + _SHRINK_SLACK:
            self._shrink()

    def _shrink(self) -> None:
        """Rebuild every table, so the memory of entries deleted from it is returned.

        O(operations and RTS still held): called once removals outnumber twice that, so it costs
        amortised O(1) per removal.  Tables of tables are rebuilt inside too (a rank's receives,
        a node's messages).  The queues and deadlines rebuild themselves the same way.
        """
        self._sends = dict(self._sends)
        self._recvs = dict(self._recvs)
        self._out = dict(self._out)
        self._out_by = _rebuilt(self._out_by)
        self._remote = _rebuilt(self._remote)
        self._unrouted = _rebuilt(self._unrouted)
        self._recvs_from = _rebuilt(self._recvs_from)
        self._offers_to = _rebuilt(self._offers_to)
        self._out_to = _rebuilt(self._out_to)
        self._rtrs = dict(self._rtrs)
        self._rtrs_by_key = _rebuilt(self._rtrs_by_key)
        self._no_rtr = dict(self._no_rtr)
        self._unanswered = dict(self._unanswered)
        self._rtrs_in_by = _rebuilt(self._rtrs_in_by)
        self._rtrs_in_for = _rebuilt(self._rtrs_in_for)
        self._removed = 0

    def _fail_send(
        self, send: Send, code: ErrorCode, text: str, node: int | None, rank: int | None
    ) -> list[Action]:
        self._move_send(send, SendInput.FAILED)
        failure = Failure(code=code, message=text, rank=rank, node=node)
        return [Complete(op=send.op, failure=failure)]

    def _fail_recv(
        self, recv: Recv, code: ErrorCode, text: str, node: int | None, rank: int | None
    ) -> list[Action]:
        self._move_recv(recv, RecvInput.FAILED)
        failure = Failure(code=code, message=text, rank=rank, node=node)
        return [Complete(op=recv.op, failure=failure)]

    def _check_new(self, op: int) -> None:
        if self.holds(op):
            raise LocalProtocolError(f"operation {op} is already in the engine")

    def _waited(self) -> str:
        return f"{self.route_timeout:g}s (route_timeout); is it running?"


def _mismatch(offer: Message, want: Message) -> str | None:
    if offer.nbytes == want.nbytes and offer.dtype == want.dtype:
        return None
    return (
        f"message does not fit its receive: rank {offer.src} sent {offer.nbytes} B of "
        f"{offer.dtype}, rank {want.dst} posted {want.nbytes} B of {want.dtype} "
        f"(job {offer.job!r}, tag {offer.tag}); use the same shape and dtype on both sides"
    )


def _lost_keys(limit: int) -> int:
    """The most keys per node whose RTR was dropped for room that are remembered (4x the room,
    and some); one more is a protocol error."""
    return 4 * limit + 1024


def _rts(send: Send) -> Rts:
    """The RTS that announces ``send`` (naming the RTR it answers, if any)."""
    return Rts(**_announced(send), rtr=send.rtr)


def _announced(send: Send) -> dict[str, Any]:
    """What an RTS or EAGER says of ``send``'s message."""
    msg = send.msg
    return {
        "msg": send.msg_id,
        "job": msg.job,
        "src": msg.src,
        "dst": msg.dst,
        "tag": msg.tag,
        "nbytes": msg.nbytes,
        "dtype": msg.dtype,
    }


def _refuse(node: int, msg_id: int, code: ErrorCode, text: str) -> SendFrame:
    """The DONE that tells ``node`` its message ``msg_id`` failed here."""
    return SendFrame(node=node, frame=Done(msg=msg_id, code=code, error=text))


K = TypeVar("K")
V = TypeVar("V")
W = TypeVar("W")


def _bump(counts: dict[K, int], key: K, by: int) -> None:
    """Add ``by`` to ``counts[key]``, dropping the key at zero (so the table holds only live
    keys: tags may be step numbers, one of them per step)."""
    value = counts.get(key, 0) + by
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)


def _add(index: dict[K, dict[V, None]], key: K, item: V) -> None:
    """File ``item`` under ``key`` in an index of insertion-ordered sets."""
    index.setdefault(key, {})[item] = None


def _rebuilt(index: dict[K, dict[V, W]]) -> dict[K, dict[V, W]]:
    """A fresh copy of an index of tables: no memory kept for entries deleted from either."""
    return {key: dict(group) for key, group in index.items()}


def _discard(index: dict[K, dict[V, W]], key: K, item: V) -> None:
    """Take ``item`` out of ``index[key]``, and drop the key when nothing is left under it."""
    group = index.get(key)
    if group is not None:
        group.pop(item, None)
        if not group:
            del index[key]
