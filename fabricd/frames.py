"""Typed views of the peer frames' metadata, read and written at the wire boundary.

Rules: this module is the one place that knows which fields each peer frame kind carries and
what values they may hold (docs/protocol.md, "Frame kinds").  Engines take and return these
views, never raw ``dict`` metadata; the node parses a frame once, when it arrives
(:func:`parse`), and encodes it once, when it leaves (:meth:`to_meta`).

Every view is a frozen, slotted dataclass with the frame kind as ``KIND``.  :func:`parse`
raises :class:`~fabricd.errors.RemoteProtocolError` for a field that is missing or of the wrong
type or range, so a malformed frame is refused before any engine sees it, and the link that
sent it is closed.  The handshake's HELLO and AUTH are read by the handshake engine itself:
they are exchanged under other limits, before a link is trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.wire import MAX_TAG, Kind, Meta, get_int, get_str

#: the largest rank or job size a frame carries
MAX_RANK: Final = 2**31


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Liveness on the control channel; carries nothing."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Heartbeat:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """The sender is draining and will close its links."""

    KIND: ClassVar[Kind] = Kind.BYE

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Bye:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """``rank`` of ``job`` (of ``size`` ranks) now lives (``present``) or no longer lives there."""

    KIND: ClassVar[Kind] = Kind.ANNOUNCE
    job: str
    rank: int
    size: int
    present: bool

    def to_meta(self) -> Meta:
        return {"job": self.job, "rank": self.rank, "size": self.size, "present": self.present}

    @classmethod
    def from_meta(cls, meta: Meta) -> Announce:
        return cls(
            job=get_str(meta, "job"),
            rank=get_int(meta, "rank", hi=MAX_RANK),
            size=get_int(meta, "size", lo=1, hi=MAX_RANK),
            present=meta.get("present") is True,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Rts:
    """Request to send message ``msg``: what it is, so the receiver can match it."""

    KIND: ClassVar[Kind] = Kind.RTS
    msg: int
    job: str
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: str

    def to_meta(self) -> Meta:
        return {
            "msg": self.msg,
            "job": self.job,
            "src": self.src,
            "dst": self.dst,
            "tag": self.tag,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Rts:
        return cls(
            msg=get_int(meta, "msg"),
            job=get_str(meta, "job"),
            src=get_int(meta, "src", hi=MAX_RANK),
            dst=get_int(meta, "dst", hi=MAX_RANK),
            tag=get_int(meta, "tag", hi=MAX_TAG + 1),
            nbytes=get_int(meta, "nbytes"),
            dtype=get_str(meta, "dtype"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Cts:
    """Clear to send message ``msg``: its receive is posted and its region ready."""

    KIND: ClassVar[Kind] = Kind.CTS
    msg: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cts:
        return cls(msg=get_int(meta, "msg"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Data:
    """One chunk of message ``msg``'s payload, starting at byte ``off`` (data channel)."""

    KIND: ClassVar[Kind] = Kind.DATA
    msg: int
    off: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg, "off": self.off}

    @classmethod
    def from_meta(cls, meta: Meta) -> Data:
        return cls(msg=get_int(meta, "msg"), off=get_int(meta, "off"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """The receiver has all of message ``msg``, or (with ``code``) refused it."""

    KIND: ClassVar[Kind] = Kind.DONE
    msg: int
    code: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if (self.code is None) != (self.error is None):
            raise ValueError("a DONE carries both code and error, or neither")

    def to_meta(self) -> Meta:
        if self.code is None:
            return {"msg": self.msg}
        return {"msg": self.msg, "code": self.code, "error": self.error}

    @classmethod
    def from_meta(cls, meta: Meta) -> Done:
        msg = get_int(meta, "msg")
        if "code" not in meta:
            return cls(msg=msg)
        return cls(msg=msg, code=get_str(meta, "code"), error=get_str(meta, "error"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """The sender withdraws message ``msg``; no (more) DATA of it will come."""

    KIND: ClassVar[Kind] = Kind.CANCEL
    msg: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cancel:
        return cls(msg=get_int(meta, "msg"))


#: every frame an authenticated peer may send
PeerFrame = Heartbeat | Bye | Announce | Rts | Cts | Data | Done | Cancel

_BY_KIND: Final[dict[Kind, type[PeerFrame]]] = {
    cls.KIND: cls for cls in (Heartbeat, Bye, Announce, Rts, Cts, Data, Done, Cancel)
}
#: the kinds :func:`parse` reads
PEER_KINDS: Final = frozenset(_BY_KIND)


def parse(kind: Kind, meta: Meta) -> PeerFrame:
    """The typed view of a peer frame's metadata.

    Raises:
        RemoteProtocolError: not a peer frame kind, or a field is missing or out of range;
            close the link that sent it.
    """
    view = _BY_KIND.get(kind)
    if view is None:
        raise RemoteProtocolError(f"{kind.name} is not a frame a peer may send")
    return view.from_meta(meta)
