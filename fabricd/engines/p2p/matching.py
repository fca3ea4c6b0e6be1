"""Point-to-point messages between ranks: matching, sender-first rendezvous, and failure.

Rules: this module decides which send meets which receive, when bytes may flow, and when an
operation is finished or failed; it is the engine's face (:class:`Messaging`), built on the
pieces that each hold one concept:

* :mod:`~fabricd.engines.p2p.messages` -- the vocabulary: messages, actions, statistics;
* :mod:`~fabricd.engines.p2p.tables` -- every table, and the moves between states that keep
  them consistent;
* :mod:`~fabricd.engines.p2p.eager` -- eager messages: the sender's credit, the receiver's pool;
* :mod:`~fabricd.engines.p2p.rendezvous` -- receiver-initiated rendezvous (RTR);
* :mod:`~fabricd.engines.p2p.pending` -- stall deadlines and reports.

It moves no bytes: the daemon streams and copies them when told to, and asks where incoming
ones land (the engine's :class:`~fabricd.engines.landing.Landing` table).  It reads the rank
table but never changes it: membership does, and its
:data:`~fabricd.engines.membership.RankEvent` news comes in through
:meth:`Messaging.on_rank_event`.

Theory of operation: sends and receives match like MPI's -- same job, source, destination and
tag, first posted first matched (non-overtaking).  There are no wildcards, so one FIFO queue per
(job, src, dst, tag) key is exactly MPI's rule: a key's posted receives and its unmatched
messages are never both non-empty.  A remote message travels one of three ways (docs/protocol.md
§3.4 has the frames, and the argument that MPI order holds across all three):

* **eager** -- at most ``eager_limit`` bytes, within the sender's credit at that peer: one EAGER
  frame with its payload on the control channel, landed in the receive or held in the
  receiver's pool (:mod:`~fabricd.engines.p2p.eager`);
* **rendezvous, sender first** -- RTS, then CTS once the receive is posted, then DATA on the
  data channel and DONE; a large message is never buffered, and lands in the segment;
* **rendezvous, receiver first (RTR)** -- a larger receive posted before its message sends an
  RTR, and the next send of the key streams at once (:mod:`~fabricd.engines.p2p.rendezvous`).

A zero-byte or mismatched message skips CTS and DATA: the receiver answers DONE at once (with
an error when sizes or dtypes differ; both sides then fail with the same message).  Ranks on
the same node meet inside one daemon, which copies segment to segment (:class:`CopyLocal`).

Every operation is a small state machine whose transitions are data
(:mod:`fabricd.engines.p2p.operations`); an input its state does not accept is a bug in fabricd:
the operation moves to ``BROKEN``, leaves the engine, and
:class:`~fabricd.errors.LocalProtocolError` is raised.  Each state files the operation in the
indexes that state needs (:mod:`~fabricd.engines.p2p.tables`), so every input is O(1)
amortised.

Failure: when a rank's node goes down every operation that involves the rank fails with code
``peer_failed``; a send whose destination has not joined (or a receive whose source has not)
fails with ``no_such_rank`` after ``route_timeout``.  When a client leaves, its unmatched
operations vanish (the sender's daemon CANCELs announced sends); matched transfers run to the
end because the daemon still maps the segment, and their result is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.actions import Complete, Failure, Notice, SendFrame
from fabricd.engines.membership import RankJoined, RankLeft
from fabricd.engines.p2p.eager import EagerMessages
from fabricd.engines.p2p.indexes import add, bump
from fabricd.engines.p2p.messages import (
    CopyLocal,
    Message,
    MessagingStatistics,
    Place,
    StreamData,
    mismatch,
    refuse,
)
from fabricd.engines.p2p.operations import Recv, RecvInput, RecvState, Remote, Send, SendInput
from fabricd.engines.p2p.pending import Pending
from fabricd.engines.p2p.tables import UNANSWERED
from fabricd.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from fabricd.frames.p2p import Cancel, Cts, Done, Eager, Rtr, Rts

if TYPE_CHECKING:
    from collections.abc import Iterable

    from fabricd.engines.membership import RankEntry, RankEvent
    from fabricd.engines.p2p.messages import Action
    from fabricd.frames.registry import MessageFrame


class Messaging(EagerMessages, Pending):
    """The point-to-point engine of one daemon.

    Built with the arguments :class:`~fabricd.engines.p2p.tables.Tables` documents (node,
    routes, ``route_timeout``, ``max_unmatched_rts_per_peer``, ``stall_after``,
    ``eager_limit``, ``eager_credit``, ``receiver_initiated``); every input takes ``now`` and
    returns the actions the daemon performs.
    """

    # -- clients ------------------------------------------------------------------------------
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
            add(self._unrouted, (msg.job, msg.dst), send)
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
        bump(self._no_rtr, msg.key, 1)  # POSTED, no RTR out
        offer = self._arrived.first(msg.key)
        if offer is not None:
            return self._match(offer, recv)
        recv.slot = self._posted.push(msg.key, recv)
        add(self._recvs_from, (msg.job, msg.src), recv)
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
                announced = send.state in UNANSWERED
                self._move_send(send, SendInput.ABANDONED)
                if announced:
                    cancel = Cancel(msg=send.msg_id, rtr=send.rtr)
                    actions.append(SendFrame(node=send.node, frame=cancel))
            recv = self._recvs.get(op)
            if recv is not None:
                self._move_recv(recv, RecvInput.ABANDONED)
        return actions

    # -- membership's news --------------------------------------------------------------------
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

    # -- the daemon's reports -----------------------------------------------------------------
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
            if arriving is None or arriving[0] != frame.msg:  # no bytes, or dropped: as an RTS
                return self._offered(node, frame.msg, self.messages.of(frame))
            _, msg, payload = arriving
            if payload is None:  # straight into its receive
                return self._landed(node, frame.msg, frame.msg, length)
            return self._offered(node, frame.msg, msg, payload)
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
            return [refuse(node, msg_id, ErrorCode.RECEIVER_LEFT, text)]
        recv = self._recvs[op]
        if recv.state is RecvState.POSTED:  # an RTR's bytes, all in before the RTS answering it
            recv.rtr_done = msg_id
            return []
        self._move_recv(recv, RecvInput.DELIVERED)
        return [SendFrame(node=node, frame=Done(msg=msg_id)), Complete(op=op)]

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
            self._release(node, arriving[2])
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
                if send.state not in UNANSWERED or send.rtr:
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

    # -- timers and status --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run (``None``: nothing waits for a route or a stall
        check)."""
        route, stall = self._deadlines.next(), self._stall_check
        if stall is None or (route is not None and route < stall):
            return route
        return stall

    def on_timer(self, now: float) -> list[Action]:
        """Fail the operations whose peer rank did not join within ``route_timeout``; report,
        once each, those pending for ``stall_after`` (:class:`~fabricd.engines.stalls.Stalled`)."""
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
        actions += self._report_stalls(now)
        return actions

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

    # -- matching -----------------------------------------------------------------------------
    def _dispatch(self, send: Send, entry: RankEntry) -> list[Action]:
        """``send``'s destination is known: queue it here or announce it to its node."""
        msg = send.msg
        if entry.node == self.node:
            self._move_send(send, SendInput.ROUTED_HERE)
            recv = self._posted.first(msg.key)
            if recv is not None:
                return self._match(send, recv)
            send.slot = self._arrived.push(msg.key, send)
            add(self._offers_to, (msg.job, msg.dst), send)
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
        return self._announce_remote(send, node)

    def _match(self, offer: Send | Remote, recv: Recv) -> list[Action]:
        """The oldest message of a key meets the oldest receive of that key."""
        problem = mismatch(offer.msg, recv.msg)
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
            return [refuse(node, msg_id, ErrorCode.MISMATCH, problem), *failed]
        if offer.payload is not None:  # an eager message the pool held
            self._move_recv(recv, RecvInput.DELIVERED)
            done = SendFrame(node=node, frame=Done(msg=msg_id))
            return [Place(op=recv.op, payload=offer.payload), done, Complete(op=recv.op)]
        if offer.msg.nbytes == 0:
            self._move_recv(recv, RecvInput.DELIVERED)
            return [SendFrame(node=node, frame=Done(msg=msg_id)), Complete(op=recv.op)]
        self._land(recv, node, msg_id)
        return [SendFrame(node=node, frame=Cts(msg=msg_id))]

    def _on_rts(self, node: int, frame: Rts) -> list[Action]:
        """An RTS: one that answers this node's RTR, or one to match."""
        if frame.rtr:
            return self._on_answer(node, frame)
        return self._offered(node, frame.msg, self.messages.of(frame))

    def _offered(
        self, node: int, msg_id: int, msg: Message, payload: bytearray | None = None
    ) -> list[Action]:
        """Message ``msg_id`` of ``node``, announced by an RTS or an EAGER that answers no RTR
        (``payload``: an EAGER's bytes, if the pool holds them), meets its receive or waits.

        Raises:
            RemoteProtocolError: ``node`` reused the id of a message still under way here.
        """
        if msg_id in self._remote.get(node, ()) or self._landing.expects(node, msg_id):
            raise RemoteProtocolError(f"node {node} reused the id of message {msg_id}")
        entry = self.routes.lookup(msg.job, msg.dst)
        if entry is None or entry.node != self.node:
            self._release(node, payload)
            text = f"rank {msg.dst} of job {msg.job!r} is not connected to node {self.node}"
            return [refuse(node, msg_id, ErrorCode.NO_SUCH_RANK, text)]
        offer = Remote(node=node, msg_id=msg_id, msg=msg, payload=payload)
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
            return [refuse(node, msg_id, ErrorCode.LIMIT, text)]
        offer.slot = self._arrived.push(msg.key, offer)
        add(self._offers_to, (msg.job, msg.dst), offer)
        self._remote.setdefault(node, {})[msg_id] = offer
        return []

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
                actions.append(refuse(offer.node, offer.msg_id, ErrorCode.RECEIVER_LEFT, reason))
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

    # -- helpers ------------------------------------------------------------------------------
    def _check_new(self, op: int) -> None:
        if op in self._sends or op in self._recvs:  # (``holds``, without its call)
            raise LocalProtocolError(f"operation {op} is already in the engine")

    def _waited(self) -> str:
        return f"{self.route_timeout:g}s (route_timeout); is it running?"
