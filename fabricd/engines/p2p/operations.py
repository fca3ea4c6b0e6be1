"""The life of one point-to-point operation: its states, and the inputs that move it.

Rules: data only.  What states a send and a receive pass through and which input takes each
state to which (transitions are data, as in the peers engine), and the record the engine keeps
of each operation.  Where an operation is filed in each state, and what a move causes, is
:mod:`fabricd.engines.p2p.tables`' business.

Theory of operation (besides the arrows below, FAILED takes every live state but COPY to
CLOSED, and ABANDONED every live state -- except that a transfer whose bytes are moving, STREAM
or COPY, stays where it is and runs to its end when its client leaves).  A copy ends only by
the daemon's own report, COPIED or COPY_FAILED, so nothing a peer does can close an operation
whose segment a worker thread may still be writing::

    send  ROUTE --routed_here--> QUEUED --matched--> COPY --copied, copy_failed--> CLOSED
          ROUTE --routed_away--> RTS --cts--> STREAM --done--> CLOSED
                                 RTS --done (refused, or zero bytes)--> CLOSED
          ROUTE --sent_eager--> EAGER --done--> CLOSED
                                EAGER --cts (the receiver's pool was full)--> STREAM
          ROUTE --met_rtr--> STREAM  (an RTR of the receiver's was waiting: RTS and DATA at once)

    recv  POSTED --matched_here--> COPY --copied, copy_failed--> CLOSED
          POSTED --matched_away--> LANDING --delivered--> CLOSED
          POSTED --delivered (a zero-byte remote message, an eager one from the pool, or
                             one whose RTR was answered and whose bytes are all in)--> CLOSED

A receive POSTED with an RTR out is still POSTED: any RTS or EAGER that arrives first takes it
(the crossing rule, :mod:`fabricd.engines.p2p.rendezvous`); the RTS that answers its RTR moves it
to LANDING (or straight to CLOSED when its DATA all came first).

An input missing from a table is a bug in fabricd, never a peer's doing (the engine checks a
peer's frames before it moves anything): the operation goes to BROKEN and leaves the engine, and
:class:`~fabricd.errors.LocalProtocolError` is raised.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fabricd.engines.p2p.messages import Key, Message
    from fabricd.engines.queues import Slot


class _Member(enum.Enum):
    """An enum whose members hash by identity.

    Each state move looks ``(state, input)`` up in a transition table, on every frame; Enum's
    own ``__hash__`` hashes the member's name in Python and showed in profiles of the
    small-message path.  Members are singletons compared by identity, so identity hashing is
    consistent with equality.
    """

    __hash__ = object.__hash__


class SendState(_Member):
    ROUTE = "route"  #: waiting for the destination rank to join (a route deadline runs)
    QUEUED = "queued"  #: the destination is local: waiting in ``_arrived`` for its receive
    RTS = "rts"  #: announced to the destination's daemon, waiting for CTS (or DONE)
    EAGER = "eager"  #: sent whole, within the peer's credit: waiting for DONE (or CTS)
    STREAM = "stream"  #: CTS came: the daemon streams the bytes, waiting for DONE
    COPY = "copy"  #: met its receive on this node: the daemon copies
    CLOSED = "closed"  #: finished, failed or abandoned: gone from the engine
    BROKEN = "broken"  #: took an input its state does not accept (a bug): gone from the engine


class SendInput(_Member):
    ROUTED_HERE = enum.auto()  #: the destination rank is on this node
    ROUTED_AWAY = enum.auto()  #: the destination rank is on another node: send the RTS
    SENT_EAGER = enum.auto()  #: ... and the message fits the eager limit and the credit
    MET_RTR = enum.auto()  #: ... and the receiver's RTR for it was waiting: stream at once
    MATCHED = enum.auto()  #: a receive on this node took it
    CTS = enum.auto()  #: the receiver is ready
    DONE = enum.auto()  #: the receiver's DONE, with or without an error
    COPIED = enum.auto()  #: the daemon copied it into its receive
    COPY_FAILED = enum.auto()  #: the daemon could not copy it (no thread, no memory)
    FAILED = enum.auto()  #: failed here: route timeout, rank lost, stream failed, mismatch
    ABANDONED = enum.auto()  #: its client left


SEND_TRANSITIONS: Final[dict[tuple[SendState, SendInput], SendState]] = {
    (SendState.ROUTE, SendInput.ROUTED_HERE): SendState.QUEUED,
    (SendState.ROUTE, SendInput.ROUTED_AWAY): SendState.RTS,
    (SendState.ROUTE, SendInput.SENT_EAGER): SendState.EAGER,
    (SendState.ROUTE, SendInput.MET_RTR): SendState.STREAM,
    (SendState.ROUTE, SendInput.FAILED): SendState.CLOSED,
    (SendState.ROUTE, SendInput.ABANDONED): SendState.CLOSED,
    (SendState.QUEUED, SendInput.MATCHED): SendState.COPY,
    (SendState.QUEUED, SendInput.FAILED): SendState.CLOSED,
    (SendState.QUEUED, SendInput.ABANDONED): SendState.CLOSED,
    (SendState.RTS, SendInput.CTS): SendState.STREAM,
    (SendState.RTS, SendInput.DONE): SendState.CLOSED,
    (SendState.RTS, SendInput.FAILED): SendState.CLOSED,
    (SendState.RTS, SendInput.ABANDONED): SendState.CLOSED,  # and CANCEL it
    (SendState.EAGER, SendInput.DONE): SendState.CLOSED,
    (SendState.EAGER, SendInput.CTS): SendState.STREAM,  # its payload was dropped: stream it
    (SendState.EAGER, SendInput.FAILED): SendState.CLOSED,
    (SendState.EAGER, SendInput.ABANDONED): SendState.CLOSED,  # and CANCEL it
    (SendState.STREAM, SendInput.DONE): SendState.CLOSED,
    (SendState.STREAM, SendInput.FAILED): SendState.CLOSED,
    (SendState.STREAM, SendInput.ABANDONED): SendState.STREAM,  # the bytes are moving: finish
    (SendState.COPY, SendInput.COPIED): SendState.CLOSED,
    (SendState.COPY, SendInput.COPY_FAILED): SendState.CLOSED,
    (SendState.COPY, SendInput.ABANDONED): SendState.COPY,  # the daemon still maps the segment
}


class RecvState(_Member):
    POSTED = "posted"  #: waiting in ``_posted`` for its message (a route deadline may run)
    LANDING = "landing"  #: took a remote RTS: CTS sent, its bytes land in its region
    COPY = "copy"  #: took a local send: the daemon copies
    CLOSED = "closed"  #: finished, failed or abandoned: gone from the engine
    BROKEN = "broken"  #: took an input its state does not accept (a bug): gone from the engine


class RecvInput(_Member):
    MATCHED_AWAY = enum.auto()  #: an RTS of a message with bytes took it
    MATCHED_HERE = enum.auto()  #: a send on this node took it
    DELIVERED = enum.auto()  #: every byte arrived (at once, for a zero-byte remote message)
    COPIED = enum.auto()  #: the daemon copied its send's bytes in
    COPY_FAILED = enum.auto()  #: the daemon could not copy them (no thread, no memory)
    FAILED = enum.auto()  #: route timeout, rank lost, sender cancelled, mismatch
    ABANDONED = enum.auto()  #: its client left


RECV_TRANSITIONS: Final[dict[tuple[RecvState, RecvInput], RecvState]] = {
    (RecvState.POSTED, RecvInput.MATCHED_AWAY): RecvState.LANDING,
    (RecvState.POSTED, RecvInput.MATCHED_HERE): RecvState.COPY,
    (RecvState.POSTED, RecvInput.DELIVERED): RecvState.CLOSED,
    (RecvState.POSTED, RecvInput.FAILED): RecvState.CLOSED,
    (RecvState.POSTED, RecvInput.ABANDONED): RecvState.CLOSED,
    (RecvState.LANDING, RecvInput.DELIVERED): RecvState.CLOSED,
    (RecvState.LANDING, RecvInput.FAILED): RecvState.CLOSED,
    (RecvState.LANDING, RecvInput.ABANDONED): RecvState.CLOSED,  # its bytes land nowhere
    (RecvState.COPY, RecvInput.COPIED): RecvState.CLOSED,
    (RecvState.COPY, RecvInput.COPY_FAILED): RecvState.CLOSED,
    (RecvState.COPY, RecvInput.ABANDONED): RecvState.COPY,  # the daemon still maps the segment
}

#: the states an operation never leaves: it is gone from the engine
TERMINAL: Final = frozenset(
    {SendState.CLOSED, SendState.BROKEN, RecvState.CLOSED, RecvState.BROKEN}
)


@dataclass(slots=True, eq=False)
class Send:
    """A send and where the engine filed it (compared and hashed by identity)."""

    op: int
    msg: Message
    posted: float = 0.0  #: when its client posted it (how long it has been pending)
    state: SendState = SendState.ROUTE
    slot: Slot[Key, Send | Remote] | None = None  #: QUEUED: its place in ``_arrived``
    node: int = -1  #: RTS/EAGER/STREAM: the destination's node
    msg_id: int = -1  #: RTS/EAGER/STREAM: the id its frames carry
    rtr: int = 0  #: the receiver's RTR it answered (0: none): its DATA and CANCEL carry it


@dataclass(slots=True, eq=False)
class Recv:
    """A receive and where the engine filed it (compared and hashed by identity)."""

    op: int
    msg: Message
    region: memoryview | None  #: POSTED: where a remote message will land
    posted: float = 0.0  #: when its client posted it (how long it has been pending)
    state: RecvState = RecvState.POSTED
    slot: Slot[Key, Recv] | None = None  #: POSTED: its place in ``_posted``
    source: tuple[int, int] = (-1, -1)  #: LANDING: the (node, landing id) filling it
    rtr: int = 0  #: POSTED: the RTR it sent to its source's node ``source[0]`` (0: none)
    rtr_done: int = 0  #: POSTED with an RTR: its bytes are all in, from this message id


@dataclass(slots=True, eq=False)
class Remote:
    """An RTS or EAGER that arrived before its receive was posted (compared and hashed by
    identity)."""

    node: int
    msg_id: int
    msg: Message
    slot: Slot[Key, Send | Remote] | None = None
    #: an EAGER's bytes, held in the node's pool until the receive is posted (``None``: an RTS)
    payload: bytearray | None = None


@dataclass(slots=True, eq=False)
class QueuedRtr:
    """An RTR a receiver's node sent here, waiting for the send it asks for (compared and
    hashed by identity)."""

    node: int
    rtr: int
    msg: Message
    slot: Slot[Key, QueuedRtr] | None = None
