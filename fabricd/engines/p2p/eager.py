"""Eager messages: a small message travels with its announcement, within a credit at the
sender and into a bounded pool at the receiver.

Rules: this module decides whether a send goes EAGER or as an RTS (the credit), and where an
EAGER's payload lands (its receive, the pool, or nowhere).  What an EAGER then does -- meets
its receive, waits in the pool, is taken as an RTS -- is matching's
(:mod:`~fabricd.engines.p2p.matching`); the credit and pool tables are
:mod:`~fabricd.engines.p2p.tables`'.

Theory of operation (docs/protocol.md §3.4): a message of at most ``eager_limit`` bytes, within
the sender's credit at that peer, goes as one EAGER frame {msg, job, src, dst, tag, nbytes,
dtype} + payload on the control channel.  The receiver lands it straight in the receive if that
is posted, else holds it in its pool for that peer (``eager_credit`` bytes, the credit) until
it is; a pool without room drops the payload and takes the frame as an RTS.  DONE gives the
credit back.  Both ends are configured alike; a peer that overdraws finds its payloads dropped
and its messages taken as RTS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.actions import SendFrame
from fabricd.engines.p2p.indexes import bump
from fabricd.engines.p2p.messages import SendEager, mismatch, rts
from fabricd.engines.p2p.operations import SendInput
from fabricd.engines.p2p.rendezvous import Rendezvous
from fabricd.errors import RemoteProtocolError
from fabricd.frames.p2p import Eager

if TYPE_CHECKING:
    from fabricd.engines.p2p.messages import Action
    from fabricd.engines.p2p.operations import Send


class EagerMessages(Rendezvous):
    """The eager path of the point-to-point engine: the sender's credit per peer, the
    receiver's pool per peer.  (Built on :class:`Rendezvous`: an EAGER that lands in a receive
    voids the receive's RTRs.)"""

    def _announce_remote(self, send: Send, node: int) -> list[Action]:
        """Announce ``send`` to ``node``: as an EAGER frame with its bytes if it is at most
        ``eager_limit`` and the credit there covers it, else as an RTS."""
        msg = send.msg
        used = self._credit_used.get(node, 0)
        if msg.nbytes <= self.eager_limit:
            if used + msg.nbytes <= self.eager_credit:
                bump(self._credit_used, node, msg.nbytes)
                self._announce(send, SendInput.SENT_EAGER)
                self._counts["eager_sent"] += 1
                eager = Eager(
                    msg=send.msg_id,
                    job=msg.job,
                    src=msg.src,
                    dst=msg.dst,
                    tag=msg.tag,
                    nbytes=msg.nbytes,
                    dtype=msg.dtype,
                )
                return [SendEager(node=node, op=send.op, frame=eager)]
            self._counts["eager_no_credit"] += 1
        self._announce(send, SendInput.ROUTED_AWAY)
        return [SendFrame(node=node, frame=rts(send.msg_id, msg, send.rtr))]

    def _eager_buffer(self, node: int, frame: Eager, length: int) -> memoryview | None:
        """Where an EAGER's payload lands: its receive's region if that is posted and fits, a
        buffer of the pool if there is room, else nowhere (the frame is then taken as an RTS
        when it ends: :meth:`~fabricd.engines.p2p.matching.Messaging.data_arrived`)."""
        if length != frame.nbytes:
            raise RemoteProtocolError(
                f"EAGER {frame.msg} from node {node} says {frame.nbytes} B and carries {length}"
            )
        if frame.msg in self._remote.get(node, ()) or self._landing.expects(node, frame.msg):
            raise RemoteProtocolError(f"node {node} reused the id of message {frame.msg}")
        msg = self.messages.of(frame)
        recv = self._posted.first(msg.key)
        if recv is not None:
            if mismatch(msg, recv.msg) is not None:
                return None  # both fail when the frame ends
            self._land(recv, node, frame.msg)
            self._arriving[node] = (frame.msg, msg, None)
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
        bump(self._pool_used, node, length)
        self._arriving[node] = (frame.msg, msg, payload)
        return memoryview(payload)
