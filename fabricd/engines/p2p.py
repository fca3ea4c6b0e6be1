"""Point-to-point messages between ranks: matching, rendezvous, and failure.

Rules: this module decides which send meets which receive, when bytes may flow, and when an
operation is finished or failed.  It moves no bytes: the daemon streams and copies them when
told to, and reports back.

Theory of operation: sends and receives match like MPI's — same job, source, destination and
tag, first posted first matched (non-overtaking).  Remote messages use a rendezvous, so a
payload only ever moves into a receive that is already posted, straight into the receiver's
shared-memory segment, and a daemon never buffers an unexpected 256 MiB message::

    sender's daemon                    receiver's daemon
      RTS {msg, job, src, dst, tag, nbytes, dtype}  ──►  match a posted receive (or queue it)
                                       ◄──  CTS {msg}        (receive posted, region ready)
      DATA {msg, off} x n (data channel)            ──►  bytes land in the receive's region
                                       ◄──  DONE {msg[, code, error]}

A zero-byte or mismatched message skips CTS and DATA: the receiver answers DONE at once (with
an error when sizes or dtypes differ; both sides then fail with the same message).  Ranks on
the same node meet inside one daemon, which copies segment to segment (:class:`CopyLocal`).

Failure: when a rank's node goes down every operation that involves the rank fails with code
``peer_failed``; a send whose destination has not joined (or a receive whose source has not)
fails with ``no_such_rank`` after ``route_timeout``.  When a client leaves, its unmatched
operations vanish (the sender's daemon CANCELs announced sends); matched transfers run to the
end because the daemon still maps the segment, and their result is dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.wire import Kind, Meta, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Iterable

    from fabricd.engines.routing import RankEntry, RankTable


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """What a send offers or a receive accepts."""

    job: str
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """Why an operation failed; ``code`` is one of docs/protocol.md's error codes."""

    code: str
    message: str
    rank: int | None = None
    node: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SendFrame:
    node: int
    kind: Kind
    meta: Meta


@dataclass(frozen=True, slots=True, kw_only=True)
class Broadcast:
    """Send to every peer that is up."""

    kind: Kind
    meta: Meta


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamData:
    """Stream send ``op``'s bytes to ``node`` as DATA frames of message ``msg``."""

    node: int
    msg: int
    op: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectData:
    """DATA of (``node``, ``msg``) fills receive ``op``'s region of ``nbytes``."""

    node: int
    msg: int
    op: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscardData:
    """Keep counting DATA of (``node``, ``msg``) but write it nowhere; forget it if done."""

    node: int
    msg: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetData:
    """No more DATA of (``node``, ``msg``) will come (its sender cancelled): drop the record."""

    node: int
    msg: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyLocal:
    """Copy send ``src_op``'s bytes into receive ``dst_op``'s region, then report back."""

    src_op: int
    dst_op: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Complete:
    """Operation ``op`` finished; ``failure`` is ``None`` on success."""

    op: int
    failure: Failure | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """Something an operator should read in the log."""

    message: str


Action = (
    SendFrame
    | Broadcast
    | StreamData
    | ExpectData
    | DiscardData
    | ForgetData
    | CopyLocal
    | Complete
    | Notice
)


class _SendState(enum.Enum):
    ROUTE = enum.auto()  #: waiting for the destination rank to join
    QUEUED = enum.auto()  #: local destination: waiting in the arrived queue for a receive
    RTS = enum.auto()  #: announced to the destination's daemon, waiting for CTS
    STREAM = enum.auto()  #: CTS received, the daemon streams, waiting for DONE
    COPY = enum.auto()  #: matched locally, the daemon copies


@dataclass(slots=True)
class _Send:
    op: int
    msg: Message
    state: _SendState
    deadline: float | None = None
    node: int = -1
    msg_id: int = -1


@dataclass(slots=True)
class _Recv:
    op: int
    msg: Message
    deadline: float | None = None
    source: tuple[int, int] | None = field(default=None)  #: (node, msg) once matched remotely


@dataclass(frozen=True, slots=True)
class _Remote:
    """An RTS that arrived before its receive was posted."""

    node: int
    msg_id: int
    msg: Message


def _matches(offer: Message, want: Message) -> bool:
    return (offer.job, offer.src, offer.dst, offer.tag) == (want.job, want.src, want.dst, want.tag)


def _mismatch(offer: Message, want: Message) -> str | None:
    if offer.nbytes == want.nbytes and offer.dtype == want.dtype:
        return None
    return (
        f"message does not fit its receive: rank {offer.src} sent {offer.nbytes} B of "
        f"{offer.dtype}, rank {want.dst} posted {want.nbytes} B of {want.dtype} "
        f"(job {offer.job!r}, tag {offer.tag}); use the same shape and dtype on both sides"
    )


def parse_message(meta: Meta) -> Message:
    """Read a :class:`Message` from RTS metadata (RemoteProtocolError if malformed)."""
    return Message(
        job=get_str(meta, "job"),
        src=get_int(meta, "src", hi=2**31),
        dst=get_int(meta, "dst", hi=2**31),
        tag=get_int(meta, "tag", hi=2**31),
        nbytes=get_int(meta, "nbytes"),
        dtype=get_str(meta, "dtype"),
    )


class Messaging:
    """The point-to-point engine of one daemon.

    Args:
        node: this daemon's node id.
        routes: the rank table, shared with whoever else needs it (the engine updates it).
        route_timeout: seconds a send or receive waits for its peer rank to join.
    """

    def __init__(self, *, node: int, routes: RankTable, route_timeout: float) -> None:
        self.node = node
        self.routes = routes
        self.route_timeout = route_timeout
        self._sends: dict[int, _Send] = {}
        self._recvs: dict[int, _Recv] = {}
        self._out: dict[int, int] = {}  #: msg id -> send op, for RTS/STREAM sends
        self._posted: list[_Recv] = []
        self._arrived: list[_Remote | _Send] = []
        self._incoming: dict[tuple[int, int], int | None] = {}  #: (node, msg) -> recv op
        self._next_msg = 1

    # -- clients ----------------------------------------------------------------------------
    def attach(self, job: str, rank: int, size: int, now: float) -> list[Action]:
        """A local client claims ``rank`` of ``job``.  Raises UsageError if it cannot."""
        entry = self.routes.claim(job, rank, size, self.node)
        return [Broadcast(kind=Kind.ANNOUNCE, meta=_announce(entry, True)), *self._joined(entry)]

    def detach(self, job: str, rank: int, ops: Iterable[int], now: float) -> list[Action]:
        """A local client left: drop its operations and its rank."""
        actions = self.abandon(ops)
        entry = self.routes.release(job, rank, self.node)
        if entry is not None:
            actions.append(Broadcast(kind=Kind.ANNOUNCE, meta=_announce(entry, False)))
            actions += self._left(entry, f"rank {rank} of job {job!r} disconnected", lost=False)
        return actions

    def announcements(self) -> list[Meta]:
        """ANNOUNCE metadata for every local rank, for a peer that just came up."""
        return [_announce(entry, True) for entry in self.routes.local()]

    def post_send(self, op: int, msg: Message, now: float) -> list[Action]:
        """A local client sends ``msg`` from the region of operation ``op``."""
        send = _Send(op=op, msg=msg, state=_SendState.ROUTE)
        self._sends[op] = send
        entry = self.routes.lookup(msg.job, msg.dst)
        if entry is None:
            send.deadline = now + self.route_timeout
            return []
        return self._dispatch(send, entry)

    def post_recv(self, op: int, msg: Message, now: float) -> list[Action]:
        """A local client receives ``msg`` into the region of operation ``op``."""
        recv = _Recv(op=op, msg=msg)
        self._recvs[op] = recv
        if self.routes.lookup(msg.job, msg.src) is None:
            recv.deadline = now + self.route_timeout
        for i, arrival in enumerate(self._arrived):
            if _matches(arrival.msg, msg):
                del self._arrived[i]
                return self._match(arrival, recv)
        self._posted.append(recv)
        return []

    def abandon(self, ops: Iterable[int]) -> list[Action]:
        """Forget operations whose client is gone; transfers under way run to their end."""
        actions: list[Action] = []
        for op in ops:
            send = self._sends.get(op)
            if send is not None and send.state not in (_SendState.STREAM, _SendState.COPY):
                del self._sends[op]
                if send.state is _SendState.RTS:
                    del self._out[send.msg_id]
                    meta: Meta = {"msg": send.msg_id}
                    actions.append(SendFrame(node=send.node, kind=Kind.CANCEL, meta=meta))
                elif send.state is _SendState.QUEUED:
                    self._arrived.remove(send)
            recv = self._recvs.get(op)
            if recv is not None and recv.source is None and recv in self._posted:
                self._posted.remove(recv)
                del self._recvs[op]
            elif recv is not None and recv.source is not None:
                self._incoming[recv.source] = None
                del self._recvs[op]
                actions.append(DiscardData(node=recv.source[0], msg=recv.source[1]))
        return actions

    # -- the daemon's reports ---------------------------------------------------------------
    def data_complete(self, node: int, msg_id: int) -> list[Action]:
        """Every byte of (``node``, ``msg_id``) arrived."""
        if (node, msg_id) not in self._incoming:
            return []
        op = self._incoming.pop((node, msg_id))
        if op is None:
            return [self._done(node, msg_id, "receiver_left", "the receiving rank disconnected")]
        self._recvs.pop(op, None)
        return [SendFrame(node=node, kind=Kind.DONE, meta={"msg": msg_id}), Complete(op=op)]

    def copied(self, src_op: int, dst_op: int) -> list[Action]:
        """A :class:`CopyLocal` finished."""
        self._sends.pop(src_op, None)
        self._recvs.pop(dst_op, None)
        return [Complete(op=src_op), Complete(op=dst_op)]

    def stream_failed(self, msg_id: int, reason: str) -> list[Action]:
        """Streaming message ``msg_id`` failed locally (its data link closed).

        The receiver is told with a CANCEL, so its receive fails instead of waiting.
        """
        op = self._out.pop(msg_id, None)
        if op is None:
            return []
        send = self._sends.pop(op)
        failure = Failure(code="transport", message=reason, node=send.node)
        cancel: Meta = {"msg": msg_id}
        return [
            Complete(op=op, failure=failure),
            SendFrame(node=send.node, kind=Kind.CANCEL, meta=cancel),
        ]

    def peer_down(self, node: int, reason: str) -> list[Action]:
        """``node`` is down or restarted: fail everything that involved it."""
        actions: list[Action] = []
        for entry in self.routes.drop_node(node):
            actions += self._left(entry, f"node {node} is {reason}", lost=True)
        for send_op in list(self._out.values()):
            if self._sends[send_op].node == node:
                actions += self._fail_send(send_op, "peer_failed", f"node {node} is {reason}", node)
        for key, recv_op in list(self._incoming.items()):
            if key[0] == node:
                del self._incoming[key]
                actions.append(DiscardData(node=node, msg=key[1]))
                if recv_op is not None:
                    text = f"node {node} is {reason}"
                    actions += self._fail_recv(recv_op, "peer_failed", text, node)
        self._arrived = [
            a for a in self._arrived if not (isinstance(a, _Remote) and a.node == node)
        ]
        return actions

    def on_frame(self, node: int, kind: Kind, meta: Meta, now: float) -> list[Action]:
        """A control frame of this engine's kinds arrived from ``node``.

        Raises:
            RemoteProtocolError: malformed metadata; close that peer's link.
        """
        if kind is Kind.ANNOUNCE:
            return self._on_announce(node, meta)
        msg_id = get_int(meta, "msg")
        if kind is Kind.RTS:
            return self._on_rts(node, msg_id, parse_message(meta))
        if kind is Kind.CTS:
            op = self._out.get(msg_id)
            if op is None or self._sends[op].node != node:
                return []  # cancelled meanwhile
            if self._sends[op].state is not _SendState.RTS:
                return [Notice(message=f"node {node} sent a second CTS for message {msg_id}")]
            self._sends[op].state = _SendState.STREAM
            return [StreamData(node=node, msg=msg_id, op=op)]
        if kind is Kind.DONE:
            return self._on_done(node, msg_id, meta)
        if kind is Kind.CANCEL:
            return self._on_cancel(node, msg_id)
        raise RemoteProtocolError(f"{kind.name} is not a messaging frame")

    # -- timers -----------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        waiting = [s.deadline for s in self._sends.values() if s.deadline is not None]
        waiting += [r.deadline for r in self._recvs.values() if r.deadline is not None]
        return min(waiting, default=None)

    def on_timer(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for send in list(self._sends.values()):
            if send.deadline is not None and now >= send.deadline:
                text = f"rank {send.msg.dst} of job {send.msg.job!r} did not join within "
                actions += self._fail_send(send.op, "no_such_rank", text + self._waited(), None)
        for recv in list(self._recvs.values()):
            if recv.deadline is not None and now >= recv.deadline:
                text = f"rank {recv.msg.src} of job {recv.msg.job!r} did not join within "
                actions += self._fail_recv(recv.op, "no_such_rank", text + self._waited(), None)
        return actions

    def pending(self) -> int:
        """Operations not finished yet (for status)."""
        return len(self._sends) + len(self._recvs)

    def holds(self, op: int) -> bool:
        """Whether ``op`` is still in the engine (after :meth:`abandon`: a transfer under way)."""
        return op in self._sends or op in self._recvs

    def transfers(self) -> int:
        """Transfers whose bytes are moving now; a drain waits for these to end."""
        moving = (_SendState.STREAM, _SendState.COPY)
        return sum(s.state in moving for s in self._sends.values()) + len(self._incoming)

    # -- internals --------------------------------------------------------------------------
    def _waited(self) -> str:
        return f"{self.route_timeout:g}s (route_timeout); is it running?"

    def _dispatch(self, send: _Send, entry: RankEntry) -> list[Action]:
        send.deadline = None
        if entry.node == self.node:
            for i, recv in enumerate(self._posted):
                if _matches(send.msg, recv.msg):
                    del self._posted[i]
                    return self._match(send, recv)
            send.state = _SendState.QUEUED
            self._arrived.append(send)
            return []
        send.state, send.node, send.msg_id = _SendState.RTS, entry.node, self._next_msg
        self._next_msg += 1
        self._out[send.msg_id] = send.op
        meta: Meta = {"msg": send.msg_id, "job": send.msg.job, "src": send.msg.src}
        meta.update(dst=send.msg.dst, tag=send.msg.tag, nbytes=send.msg.nbytes)
        meta["dtype"] = send.msg.dtype
        return [SendFrame(node=entry.node, kind=Kind.RTS, meta=meta)]

    def _match(self, offer: _Remote | _Send, recv: _Recv) -> list[Action]:
        recv.deadline = None
        problem = _mismatch(offer.msg, recv.msg)
        if isinstance(offer, _Send):
            if problem is not None:
                return [
                    *self._fail_send(offer.op, "mismatch", problem, None),
                    *self._fail_recv(recv.op, "mismatch", problem, None),
                ]
            offer.state = _SendState.COPY
            return [CopyLocal(src_op=offer.op, dst_op=recv.op)]
        if problem is not None:
            done = self._done(offer.node, offer.msg_id, "mismatch", problem)
            return [done, *self._fail_recv(recv.op, "mismatch", problem, None)]
        if offer.msg.nbytes == 0:
            del self._recvs[recv.op]
            return [
                SendFrame(node=offer.node, kind=Kind.DONE, meta={"msg": offer.msg_id}),
                Complete(op=recv.op),
            ]
        recv.source = (offer.node, offer.msg_id)
        self._incoming[recv.source] = recv.op
        return [
            ExpectData(node=offer.node, msg=offer.msg_id, op=recv.op, nbytes=offer.msg.nbytes),
            SendFrame(node=offer.node, kind=Kind.CTS, meta={"msg": offer.msg_id}),
        ]

    def _on_rts(self, node: int, msg_id: int, msg: Message) -> list[Action]:
        entry = self.routes.lookup(msg.job, msg.dst)
        if entry is None or entry.node != self.node:
            text = f"rank {msg.dst} of job {msg.job!r} is not connected to node {self.node}"
            return [self._done(node, msg_id, "no_such_rank", text)]
        offer = _Remote(node=node, msg_id=msg_id, msg=msg)
        for i, recv in enumerate(self._posted):
            if _matches(msg, recv.msg):
                del self._posted[i]
                return self._match(offer, recv)
        self._arrived.append(offer)
        return []

    def _on_done(self, node: int, msg_id: int, meta: Meta) -> list[Action]:
        op = self._out.get(msg_id)
        if op is None or self._sends[op].node != node:
            return []
        failure = None  # parsed before anything changes: a malformed DONE must not lose the send
        if "code" in meta:
            failure = Failure(code=get_str(meta, "code"), message=get_str(meta, "error"), node=node)
        del self._out[msg_id]
        del self._sends[op]
        return [Complete(op=op, failure=failure)]

    def _on_cancel(self, node: int, msg_id: int) -> list[Action]:
        self._arrived = [
            a
            for a in self._arrived
            if not (isinstance(a, _Remote) and (a.node, a.msg_id) == (node, msg_id))
        ]
        if (node, msg_id) not in self._incoming:
            return []
        op = self._incoming.pop((node, msg_id))
        actions: list[Action] = [ForgetData(node=node, msg=msg_id)]
        if op is not None:
            text = "the sending rank disconnected before its message was delivered"
            actions += self._fail_recv(op, "peer_failed", text, node)
        return actions

    def _on_announce(self, node: int, meta: Meta) -> list[Action]:
        job, rank = get_str(meta, "job"), get_int(meta, "rank", hi=2**31)
        size = get_int(meta, "size", lo=1, hi=2**31)
        if meta.get("present") is not True:
            entry = self.routes.release(job, rank, node)
            text = f"rank {rank} of job {job!r} on node {node} disconnected"
            return [] if entry is None else self._left(entry, text, lost=False)
        try:
            entry = self.routes.claim(job, rank, size, node)
        except UsageError as exc:
            return [Notice(message=f"ignored announcement from node {node}: {exc}")]
        return self._joined(entry)

    def _joined(self, entry: RankEntry) -> list[Action]:
        actions: list[Action] = []
        for send in list(self._sends.values()):
            if send.state is _SendState.ROUTE and (send.msg.job, send.msg.dst) == (
                entry.job,
                entry.rank,
            ):
                actions += self._dispatch(send, entry)
        for recv in self._posted:
            if (recv.msg.job, recv.msg.src) == (entry.job, entry.rank):
                recv.deadline = None
        return actions

    def _left(self, entry: RankEntry, reason: str, *, lost: bool) -> list[Action]:
        """``entry``'s rank is gone: fail receives that wait for it (and, if lost, sends)."""
        actions: list[Action] = []
        gone = (entry.job, entry.rank)
        for recv in list(self._posted):
            if (recv.msg.job, recv.msg.src) == gone:
                actions += self._fail_recv(recv.op, "peer_failed", reason, entry.node, entry.rank)
        for arrival in list(self._arrived):
            if (arrival.msg.job, arrival.msg.dst) != gone:
                continue
            self._arrived.remove(arrival)
            if isinstance(arrival, _Remote):
                actions.append(self._done(arrival.node, arrival.msg_id, "receiver_left", reason))
            else:
                actions += self._fail_send(
                    arrival.op, "peer_failed", reason, entry.node, entry.rank
                )
        if lost:
            for send in list(self._sends.values()):
                if (send.msg.job, send.msg.dst) == gone and send.state is not _SendState.COPY:
                    actions += self._fail_send(
                        send.op, "peer_failed", reason, entry.node, entry.rank
                    )
        return actions

    def _fail_send(
        self, op: int, code: str, text: str, node: int | None, rank: int | None = None
    ) -> list[Action]:
        send = self._sends.pop(op, None)
        if send is None:
            return []
        self._out.pop(send.msg_id, None)
        if send in self._arrived:
            self._arrived.remove(send)
        rank = send.msg.dst if rank is None else rank
        return [Complete(op=op, failure=Failure(code=code, message=text, rank=rank, node=node))]

    def _fail_recv(
        self, op: int, code: str, text: str, node: int | None, rank: int | None = None
    ) -> list[Action]:
        recv = self._recvs.pop(op, None)
        if recv is None:
            return []
        if recv in self._posted:
            self._posted.remove(recv)
        rank = recv.msg.src if rank is None else rank
        return [Complete(op=op, failure=Failure(code=code, message=text, rank=rank, node=node))]

    @staticmethod
    def _done(node: int, msg_id: int, code: str, text: str) -> SendFrame:
        return SendFrame(
            node=node, kind=Kind.DONE, meta={"msg": msg_id, "code": code, "error": text}
        )


def _announce(entry: RankEntry, present: bool) -> Meta:
    return {"job": entry.job, "rank": entry.rank, "size": entry.size, "present": present}
