"""Receiver-initiated rendezvous (RTR): a receive posted before its message asks the sender's
node to stream the message as soon as it is sent, and the rules that keep MPI's order while
RTRs and messages cross.

Rules: this module decides when an RTR goes out, which send takes a waiting RTR, what an RTS
that answers one does, and when RTRs are dropped or voided.  Sender-first rendezvous (RTS, CTS,
DATA) and matching are :mod:`~fabricd.engines.p2p.matching`'s; the tables are
:mod:`~fabricd.engines.p2p.tables`'.

Theory of operation (docs/protocol.md §3.4): a receive larger than ``eager_limit`` posted
before its message sends an RTR {rtr, key, nbytes, dtype} to the source's node, its region
registered (unarmed) in the landing table under ``-rtr``.  The next send of the key streams at
once: RTS{rtr} ahead of DATA{rtr} on the control channel, so no later send's RTS can overtake
it, while its DATA may arrive first.  Crossing: a sender with a send of the key unanswered (RTS
or EAGER state) drops an RTR, and a receiver that matches a message answering no RTR voids
every RTR of the key still out (``_void_rtrs``) and sends none while a posted receive of the
key has none (``_no_rtr``); a sender that drops an RTR for want of room drops every later one
of its key until a send of it goes plain (``_rtrs_lost``).  So the i-th send of a key always
meets the i-th receive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.actions import Complete, SendFrame
from fabricd.engines.p2p.indexes import add, bump, discard
from fabricd.engines.p2p.messages import StreamData, mismatch, refuse, rts
from fabricd.engines.p2p.operations import QueuedRtr, RecvInput, SendInput
from fabricd.engines.p2p.tables import Tables
from fabricd.errors import ErrorCode, RemoteProtocolError
from fabricd.frames.p2p import Done, Rtr

if TYPE_CHECKING:
    from fabricd.engines.p2p.messages import Action, Key
    from fabricd.engines.p2p.operations import Recv, Send
    from fabricd.frames.p2p import Rts


class Rendezvous(Tables):
    """The receiver-initiated rendezvous of the point-to-point engine: RTRs sent, kept, taken,
    answered, dropped and voided."""

    def _land(self, recv: Recv, node: int, msg_id: int) -> None:
        """Message ``msg_id`` of ``node`` lands in ``recv``'s region from now on."""
        self._void_rtrs(recv.msg.key)
        assert recv.region is not None  # a POSTED receive keeps its region
        self._landing.expect(node, msg_id, recv.op, recv.region)
        recv.source = (node, msg_id)
        self._move_recv(recv, RecvInput.MATCHED_AWAY)

    def _answer_rtr(self, send: Send, queued: QueuedRtr) -> list[Action]:
        """``send`` takes the receiver's waiting RTR: its RTS names the RTR and goes ahead of
        its DATA on the control channel (so a later send's RTS cannot overtake it), and its
        DATA, which carries the RTR too, follows at once.  A send that does not fit the
        receive only announces itself: the receiver fails both, in order."""
        send.rtr = queued.rtr
        announce = SendFrame(node=send.node, frame=rts(send.msg_id, send.msg, send.rtr))
        if mismatch(send.msg, queued.msg) is not None:
            self._announce(send, SendInput.ROUTED_AWAY)  # its DONE brings the mismatch
            return [announce]
        self._announce(send, SendInput.MET_RTR)
        self._counts["rtr_answered"] += 1
        stream = StreamData(node=send.node, msg=send.msg_id, op=send.op, rtr=queued.rtr)
        return [announce, stream]

    def _on_answer(self, node: int, frame: Rts) -> list[Action]:
        """The RTS of a message that answers this node's RTR ``frame.rtr`` (its DATA may be in
        already): the receive is matched; it ends when every byte is in."""
        recv = self._rtrs.get(frame.rtr)
        if recv is None or recv.source[0] != node:
            text = "the receive this message answered is gone: its rank left"
            return [refuse(node, frame.msg, ErrorCode.RECEIVER_LEFT, text)]
        if self._posted.first(recv.msg.key) is not recv:
            raise RemoteProtocolError(f"node {node} answered RTR {frame.rtr} out of turn")
        problem = mismatch(self.messages.of(frame), recv.msg)
        if problem is not None:
            failed = self._fail_recv(recv, ErrorCode.MISMATCH, problem, None, recv.msg.src)
            return [refuse(node, frame.msg, ErrorCode.MISMATCH, problem), *failed]
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
        msg = self.messages.of(frame)
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
        add(self._rtrs_in_by, node, queued)
        add(self._rtrs_in_for, (msg.job, msg.src), queued)
        add(self._rtrs_in_for, (msg.job, msg.dst), queued)
        return []

    def _unqueue_rtr(self, queued: QueuedRtr) -> None:
        """A waiting RTR leaves: a send took it, or its node or rank is gone."""
        if queued.slot is not None:
            self._rtrs_in.remove(queued.slot)
            queued.slot = None
        msg = queued.msg
        discard(self._rtrs_in_by, queued.node, queued)
        discard(self._rtrs_in_for, (msg.job, msg.src), queued)
        discard(self._rtrs_in_for, (msg.job, msg.dst), queued)

    def _send_rtr(self, recv: Recv, node: int) -> list[Action]:
        """Ask ``node`` to stream ``recv``'s message as soon as it is sent: its region is
        registered now (unarmed) under the RTR's number, for DATA that may beat its RTS."""
        rtr = next(self._rtr_ids)
        assert recv.region is not None  # a POSTED receive keeps its region
        self._landing.expect(node, -rtr, recv.op, recv.region, armed=False)
        recv.rtr, recv.source = rtr, (node, -rtr)
        bump(self._no_rtr, recv.msg.key, -1)
        self._rtrs[rtr] = recv
        self._rtr_top[node] = rtr
        add(self._rtrs_by_key, recv.msg.key, recv)
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
        bump(self._no_rtr, recv.msg.key, 1)


def _lost_keys(limit: int) -> int:
    """The most keys per node whose RTR was dropped for room that are remembered (4x the room,
    and some); one more is a protocol error."""
    return 4 * limit + 1024
