"""The point-to-point engine's tables, and the moves that keep them consistent.

Rules: this module holds every table of the engine and the only code that moves an operation
from one state to another (:meth:`Tables._move_send`, :meth:`Tables._move_recv`), files an
announced send, or takes an unmatched message out (:meth:`Tables._unfile`).  What the engine
decides -- matching (:mod:`~fabricd.engines.p2p.matching`), eager credit and pool
(:mod:`~fabricd.engines.p2p.eager`), receiver-initiated rendezvous
(:mod:`~fabricd.engines.p2p.rendezvous`), stall reports (:mod:`~fabricd.engines.p2p.pending`)
-- lives in the classes built on :class:`Tables`, one concept to a module.

Why one object under all of them rather than one per concept: a move takes an operation out of
several indexes at once (a receive leaving POSTED leaves the posted queue, its rank's receives,
the RTR tables and the route deadlines), so the indexes are one consistent whole, and each input
stays O(1) without passing them around.

Each state files the operation in the indexes that state needs, and a move takes it out of
them, so no input scans the operations that merely wait (every input is O(1) amortised,
``bench/framecost.py`` measures it):

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
(:meth:`Tables._shrink`, O(what is left), so amortised O(1) per removal): 10^5 operations
that ended keep no memory behind.  A peer holds at most ``max_unmatched_rts_per_peer``
unmatched RTS here; the next one is refused with a DONE of code ``limit`` (its send fails with a
message that names the setting), so a sender that announces without end costs a bounded amount.
The pool holds at most ``eager_credit`` bytes of a peer's eager messages, and at most
``max_unmatched_rts_per_peer`` of its RTRs wait here.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Final

from fabricd.engines.actions import Complete, Failure
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.landing import Landing
from fabricd.engines.p2p.indexes import add, bump, discard, rebuilt
from fabricd.engines.p2p.messages import Messages
from fabricd.engines.p2p.operations import (
    RECV_TRANSITIONS,
    SEND_TRANSITIONS,
    TERMINAL,
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
from fabricd.errors import ErrorCode, LocalProtocolError

if TYPE_CHECKING:
    from fabricd.engines.membership import RankKey, Routes
    from fabricd.engines.p2p.messages import Action, Key, Message

ANNOUNCED: Final = (SendState.RTS, SendState.EAGER, SendState.STREAM)  #: filed in ``_out``
#: sent, but not yet matched as far as this node knows: an RTR of the key is dropped (crossing)
UNANSWERED: Final = (SendState.RTS, SendState.EAGER)
_MOVING: Final = (SendState.STREAM, SendState.COPY)  #: counted as transfers
#: removals tolerated beyond twice what is left before the tables are rebuilt (small engines
#: are never rebuilt; large ones once per halving)
_SHRINK_SLACK: Final = 1024


class Tables:
    """The tables of one daemon's point-to-point engine, and the moves between states.

    Args:
        node: this daemon's node id.
        routes: where ranks live (read-only; the engine hears of changes through
            :meth:`~fabricd.engines.p2p.matching.Messaging.on_rank_event`).
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
        #: equal messages shared: the engine's own (RTS, EAGER, RTR) and its service's requests'
        self.messages = Messages()
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
        #: per node, the EAGER whose payload is arriving now: (msg, what it says, its pool
        #: buffer or ``None`` when it lands straight in its receive); control frames arrive one
        #: at a time
        self._arriving: dict[int, tuple[int, Message, bytearray | None]] = {}
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

    def _announce(self, send: Send, event: SendInput) -> None:
        """Move ``send`` to the state ``event`` names, and file it by its message id."""
        self._move_send(send, event)
        self._out[send.msg_id] = send
        by_node = self._out_by.get(send.node)
        if by_node is None:
            self._out_by[send.node] = {send.msg_id: send}
        else:
            by_node[send.msg_id] = send
        add(self._out_to, (send.msg.job, send.msg.dst), send)

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
            rank = (msg.job, msg.dst)
            unrouted = self._unrouted.get(rank)
            if unrouted is not None and send in unrouted:  # only these have a route deadline
                self._deadlines.cancel(send.op)
                discard(self._unrouted, rank, send)
        elif old is SendState.QUEUED:
            if send.slot is not None:
                self._arrived.remove(send.slot)
            discard(self._offers_to, (msg.job, msg.dst), send)
        elif old in ANNOUNCED and new not in ANNOUNCED:
            del self._out[send.msg_id]
            discard(self._out_by, send.node, send.msg_id)
            discard(self._out_to, (msg.job, msg.dst), send)
        # A send that answers an RTR (one that does not fit it waits in RTS for its DONE) is
        # matched already: an RTR of its key that comes meanwhile is a later receive's, kept.
        # Dropping it lost that receive's turn: the receiver counts it out, and the next RTR of
        # the key, once this DONE came, was taken ahead of it (answered out of turn).
        unanswered = 0 if send.rtr else (new in UNANSWERED) - (old in UNANSWERED)
        if unanswered:
            bump(self._unanswered, msg.key, unanswered)
        if old is SendState.EAGER:  # answered, refused or withdrawn: its credit is back
            bump(self._credit_used, send.node, -msg.nbytes)
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
            discard(self._recvs_from, (recv.msg.job, recv.msg.src), recv)
            recv.region = None  # the landing table holds it from now on, if anyone does
            if not recv.rtr:
                bump(self._no_rtr, recv.msg.key, -1)
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
        discard(self._offers_to, (offer.msg.job, offer.msg.dst), offer)
        discard(self._remote, offer.node, offer.msg_id)
        self._removal()

    def _release(self, node: int, payload: bytearray | None) -> None:
        """Give back the pool bytes an EAGER of ``node`` held (``None``: it held none)."""
        if payload is not None:
            bump(self._pool_used, node, -len(payload))

    def _unindex_rtr(self, recv: Recv) -> None:
        del self._rtrs[recv.rtr]
        discard(self._rtrs_by_key, recv.msg.key, recv)

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
        self._out_by = rebuilt(self._out_by)
        self._remote = rebuilt(self._remote)
        self._unrouted = rebuilt(self._unrouted)
        self._recvs_from = rebuilt(self._recvs_from)
        self._offers_to = rebuilt(self._offers_to)
        self._out_to = rebuilt(self._out_to)
        self._rtrs = dict(self._rtrs)
        self._rtrs_by_key = rebuilt(self._rtrs_by_key)
        self._no_rtr = dict(self._no_rtr)
        self._unanswered = dict(self._unanswered)
        self._rtrs_in_by = rebuilt(self._rtrs_in_by)
        self._rtrs_in_for = rebuilt(self._rtrs_in_for)
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
