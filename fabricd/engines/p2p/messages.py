"""The point-to-point engine's vocabulary: what a message is, the actions the engine returns
beyond the shared ones, its statistics, and the wire form of its announcements and refusals.

Rules: data and pure functions only, no state (but :class:`Messages`, a bounded cache of equal
values, which no decision reads).  Every other module of the engine
(:mod:`~fabricd.engines.p2p.matching` and the pieces it is built from) and the daemon's p2p
service speak these words, so they live apart from any of them; a service or a test can import
them without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from fabricd.engines.actions import Complete, Notice, SendFrame
from fabricd.engines.stalls import Stalled
from fabricd.frames.p2p import Done, Eager, Rtr, Rts
from fabricd.wire import Kind

if TYPE_CHECKING:
    from fabricd.errors import ErrorCode

Key = tuple[str, int, int, int]  #: (job, src, dst, tag): what matches

#: the control frames :meth:`~fabricd.engines.p2p.matching.Messaging.on_frame` takes (DATA and
#: EAGER carry a payload: they go to ``payload_buffer`` and ``data_arrived``)
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
    #: (job, src, dst, tag): what matches; built once, as every input of the engine reads it
    #: several times (as a property it cost a call and a tuple each time)
    key: Key = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.job, self.src, self.dst, self.tag))


#: the most distinct messages :class:`Messages` keeps (it starts afresh beyond that)
MESSAGES_KEPT: Final = 128


class Messages:
    """Equal messages as one shared :class:`Message`, so that a pair of ranks that exchange
    messages of the same key, size and dtype over and over builds each only once.

    Why: a frozen dataclass of seven fields costs about 1.2 us to build, against about 0.1 us
    to find an equal one here, and the point-to-point path built one per request and per EAGER.
    A message is an immutable value, so sharing an equal one changes nothing a caller can see.
    Bounded: beyond :data:`MESSAGES_KEPT` distinct messages (tags may be step numbers) the cache
    starts afresh, so each call is O(1) amortised and it holds at most about 45 KB, about 80 KB
    with job names of 200 characters each decoded afresh (operations that ended must leave no
    memory behind: ``tests/unit/test_p2p_cost.py``).
    """

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, int, int, int, str], Message] = {}

    def get(self, job: str, src: int, dst: int, tag: int, nbytes: int, dtype: str) -> Message:
        """The message of these fields."""
        fields = (job, src, dst, tag, nbytes, dtype)
        msg = self._known.get(fields)
        if msg is None:
            if len(self._known) >= MESSAGES_KEPT:
                self._known = {}
            msg = Message(job=job, src=src, dst=dst, tag=tag, nbytes=nbytes, dtype=dtype)
            self._known[fields] = msg
        return msg

    def of(self, frame: Rts | Eager | Rtr) -> Message:
        """The message an RTS, EAGER or RTR describes."""
        return self.get(frame.job, frame.src, frame.dst, frame.tag, frame.nbytes, frame.dtype)


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


def mismatch(offer: Message, want: Message) -> str | None:
    """Why message ``offer`` does not fit receive ``want`` (``None``: it does), in words both
    ranks are told."""
    if offer.nbytes == want.nbytes and offer.dtype == want.dtype:
        return None
    return (
        f"message does not fit its receive: rank {offer.src} sent {offer.nbytes} B of "
        f"{offer.dtype}, rank {want.dst} posted {want.nbytes} B of {want.dtype} "
        f"(job {offer.job!r}, tag {offer.tag}); use the same shape and dtype on both sides"
    )


def rts(msg_id: int, msg: Message, rtr: int) -> Rts:
    """The RTS that announces message ``msg_id`` (naming ``rtr``, the RTR it answers, if not 0)."""
    return Rts(**announced(msg_id, msg), rtr=rtr)


def announced(msg_id: int, msg: Message) -> dict[str, Any]:
    """What an RTS or EAGER says of message ``msg_id``."""
    return {
        "msg": msg_id,
        "job": msg.job,
        "src": msg.src,
        "dst": msg.dst,
        "tag": msg.tag,
        "nbytes": msg.nbytes,
        "dtype": msg.dtype,
    }


def refuse(node: int, msg_id: int, code: ErrorCode, text: str) -> SendFrame:
    """The DONE that tells ``node`` its message ``msg_id`` failed here."""
    return SendFrame(node=node, frame=Done(msg=msg_id, code=code, error=text))
