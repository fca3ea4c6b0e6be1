"""The point-to-point frames: RTS, EAGER, RTR, CTS, DATA, DONE, CANCEL, and the posted WRITE.

These are the frames of every message a rank sends, so their views are read and written on a
daemon's fastest path: ``from_meta`` checks every field in one expression and names the field
at fault only when that fails (a helper call per field cost 0.2 us of an EAGER's 1.6, most
of the rest is the frozen dataclass's own constructor), and ``to_meta`` builds its map in one
literal (half the 0.28 us of merging in :meth:`_Described._described`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_RANK, optional_int
from fabricd.wire import MAX_TAG, Kind, Meta, get_int, get_str

#: the largest id, offset or size a frame carries (what :func:`~fabricd.wire.get_int` allows)
_MAX_INT: Final = 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _Described:
    """What RTS, EAGER and RTR say of a message: its key (job, src, dst, tag), size and dtype."""

    job: str
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: str

    def _described(self) -> Meta:
        return {
            "job": self.job,
            "src": self.src,
            "dst": self.dst,
            "tag": self.tag,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Rts(_Described):
    """Request to send message ``msg``: what it is, so the receiver can match it.

    ``rtr``: the receiver's RTR this send answers (0: none).  Such an RTS is already matched:
    its DATA, which carries the same ``rtr``, may arrive before it on the data channel.
    """

    KIND: ClassVar[Kind] = Kind.RTS
    msg: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        meta = _offer_meta(self.msg, self)
        if self.rtr:
            meta["rtr"] = self.rtr
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Rts:
        return cls(**_message_fields(meta), rtr=optional_int(meta, "rtr"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Eager(_Described):
    """Message ``msg`` whole: what :class:`Rts` says of it, and its ``nbytes`` bytes as the
    frame's payload (control channel).  Sent only within the receiver's credit; a receiver
    whose pool is full drops the payload and treats the frame as an RTS (docs/protocol.md)."""

    KIND: ClassVar[Kind] = Kind.EAGER
    msg: int

    def to_meta(self) -> Meta:
        return _offer_meta(self.msg, self)

    @classmethod
    def from_meta(cls, meta: Meta) -> Eager:
        return cls(**_message_fields(meta))


@dataclass(frozen=True, slots=True, kw_only=True)
class Rtr(_Described):
    """Ready to receive: a receive for (``job``, ``src``, ``dst``, ``tag``) of ``nbytes`` of
    ``dtype`` is posted, and its region is ready under the receiver's number ``rtr``.  The
    sender's next send of that key may stream at once (its RTS and DATA carry ``rtr``), unless a
    send of the key is still unanswered there: then the RTR is dropped (the crossing rule)."""

    KIND: ClassVar[Kind] = Kind.RTR
    rtr: int

    def to_meta(self) -> Meta:
        return {"rtr": self.rtr, **self._described()}

    @classmethod
    def from_meta(cls, meta: Meta) -> Rtr:
        fields = _message_fields(meta, id_field="rtr")
        if not fields["rtr"]:
            raise RemoteProtocolError("an RTR numbered 0")
        return cls(**fields)


def _offer_meta(msg: int, described: _Described) -> Meta:
    """The metadata of an RTS or EAGER offering message ``msg``: built in one literal (this runs
    for every message sent)."""
    return {
        "msg": msg,
        "job": described.job,
        "src": described.src,
        "dst": described.dst,
        "tag": described.tag,
        "nbytes": described.nbytes,
        "dtype": described.dtype,
    }


def _message_fields(meta: Meta, id_field: str = "msg") -> dict[str, Any]:
    """The fields that describe a message, checked (RTS, EAGER and RTR carry them)."""
    get = meta.get
    ident, src, dst, tag, nbytes = get(id_field), get("src"), get("dst"), get("tag"), get("nbytes")
    job, dtype = get("job"), get("dtype")
    if (
        type(ident) is int
        and type(src) is int
        and type(dst) is int
        and type(tag) is int
        and type(nbytes) is int
        and 0 <= ident <= _MAX_INT
        and 0 <= src <= MAX_RANK
        and 0 <= dst <= MAX_RANK
        and 0 <= tag <= MAX_TAG + 1
        and 0 <= nbytes <= _MAX_INT
        and type(job) is str
        and job
        and type(dtype) is str
        and dtype
    ):
        return {
            id_field: ident,
            "job": job,
            "src": src,
            "dst": dst,
            "tag": tag,
            "nbytes": nbytes,
            "dtype": dtype,
        }
    return _named_fields(meta, id_field)  # raises, naming the first field at fault


def _named_fields(meta: Meta, id_field: str) -> dict[str, Any]:
    """:func:`_message_fields` field by field, in order, so the error names the first field at
    fault (and reads a str subclass, which the one-pass check leaves to it, as a str)."""
    return {
        id_field: get_int(meta, id_field),
        "job": get_str(meta, "job"),
        "src": get_int(meta, "src", hi=MAX_RANK),
        "dst": get_int(meta, "dst", hi=MAX_RANK),
        "tag": get_int(meta, "tag", hi=MAX_TAG + 1),
        "nbytes": get_int(meta, "nbytes"),
        "dtype": get_str(meta, "dtype"),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Cts:
    """Clear to send message ``msg``: its receive is posted and its region ready."""

    KIND: ClassVar[Kind] = Kind.CTS
    msg: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cts:
        msg = meta.get("msg")
        if type(msg) is int and 0 <= msg <= _MAX_INT:
            return cls(msg=msg)
        return cls(msg=get_int(meta, "msg"))  # raises, naming the field


@dataclass(frozen=True, slots=True, kw_only=True)
class Data:
    """One chunk of message ``msg``'s payload, starting at byte ``off`` (data channel);
    ``rtr``: the receiver's RTR the message answers (0: it had a CTS)."""

    KIND: ClassVar[Kind] = Kind.DATA
    msg: int
    off: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        if self.rtr:
            return {"msg": self.msg, "off": self.off, "rtr": self.rtr}
        return {"msg": self.msg, "off": self.off}

    @classmethod
    def from_meta(cls, meta: Meta) -> Data:
        msg, off, rtr = meta.get("msg"), meta.get("off"), meta.get("rtr", 0)
        if (
            type(msg) is int
            and type(off) is int
            and type(rtr) is int
            and 0 <= msg <= _MAX_INT
            and 0 <= off <= _MAX_INT
            and 0 <= rtr <= _MAX_INT
        ):
            return cls(msg=msg, off=off, rtr=rtr)
        msg, off = get_int(meta, "msg"), get_int(meta, "off")  # raise, naming the field
        return cls(msg=msg, off=off, rtr=optional_int(meta, "rtr"))


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
        msg = meta.get("msg")
        if type(msg) is not int or not 0 <= msg <= _MAX_INT:
            msg = get_int(meta, "msg")  # raises, naming the field
        if "code" not in meta:
            return cls(msg=msg)
        return cls(msg=msg, code=get_str(meta, "code"), error=get_str(meta, "error"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """The sender withdraws message ``msg`` (which answered RTR ``rtr``, if not 0); no (more)
    DATA of it will come."""

    KIND: ClassVar[Kind] = Kind.CANCEL
    msg: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        return {"msg": self.msg, "rtr": self.rtr} if self.rtr else {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cancel:
        msg, rtr = meta.get("msg"), meta.get("rtr", 0)
        if type(msg) is int and type(rtr) is int and 0 <= msg <= _MAX_INT and 0 <= rtr <= _MAX_INT:
            return cls(msg=msg, rtr=rtr)
        return cls(msg=get_int(meta, "msg"), rtr=optional_int(meta, "rtr"))  # raises


#: the largest posted-region slot number a WRITE carries
MAX_SLOT: Final = 2**32 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One-hop write of the payload into the region the receiver posted under (``epoch``,
    ``slot``), starting at byte ``off``; ``seq`` is the writer's number for it, handed back to
    the receiver with the completion (transports/posted.py).  The payload's length is the
    frame's ``payload_len``: the header carries it, so the bounds are checked before any byte.

    The transport handles WRITE itself (it never reaches a sink): a malformed one is a protocol
    error, a well-formed one to a key the receiver does not hold is refused and dropped.
    """

    KIND: ClassVar[Kind] = Kind.WRITE
    epoch: int
    slot: int
    off: int
    seq: int

    def to_meta(self) -> Meta:
        return {"epoch": self.epoch, "slot": self.slot, "off": self.off, "seq": self.seq}

    @classmethod
    def from_meta(cls, meta: Meta) -> Write:
        return cls(
            epoch=get_int(meta, "epoch"),
            slot=get_int(meta, "slot", hi=MAX_SLOT),
            off=get_int(meta, "off"),
            seq=get_int(meta, "seq"),
        )
