"""The fabricd frame: encoding and an incremental, bounded, sans-IO decoder.

One frame format serves both the client socket and the network (docs/protocol.md)::

    0       4   5   6       8          12                  20
    +-------+---+---+-------+----------+-------------------+----------------+---------+---------+
    | magic |ver|knd| flags | meta_len |    payload_len    | meta (msgpack) | payload | trailer |
    | FBRC  |u8 |u8 | u16   |   u32    |        u64        | meta_len bytes | raw     | 24 B    |
    +-------+---+---+-------+----------+-------------------+----------------+---------+---------+
    all integers big-endian; meta is one msgpack map with str keys; payload is never msgpack;
    the trailer (seq u64, MAC 16 B) follows only frames whose flags have SEALED (integrity.py)

Invariants the decoder keeps:

* every length is checked against :class:`Limits` *before* anything is allocated for it;
* every malformed input raises :class:`~fabricd.errors.RemoteProtocolError` (a ``ValueError``)
  and nothing else; after that the decoder is dead and the connection must be closed;
* the payload can be written straight into a buffer the caller supplies after seeing the
  frame's head (:meth:`Decoder.set_payload_buffer`), and the kernel can write into it directly
  (:meth:`Decoder.payload_target`), so large payloads land in place with no user-space copy
  (but for a payload its frame's MAC covers: that is hashed in the decoder's own buffer first,
  since the caller's buffer may be memory another process writes);
* a payload nobody wants is read and dropped (:meth:`Decoder.discard_payload`): nothing is
  allocated for it, whatever length its header declares;
* once the decoder has an :attr:`Decoder.opener` (a link past its handshake), every frame must
  be sealed, and no :class:`Frame` is returned before its trailer checked out: a frame that was
  replayed, reordered, injected or altered raises
  :class:`~fabricd.integrity.IntegrityError`.  Its head (and, for a DATA frame, its payload
  bytes) may have been handed on before the check: the link is closed and the peer reset, so
  nothing that arrived on it is reported as received.
"""

from __future__ import annotations

import enum
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgpack

from fabricd.errors import LocalProtocolError, RemoteProtocolError
from fabricd.integrity import FLAG_PAYLOAD_MAC, FLAG_SEALED, TRAILER_SIZE

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fabricd.integrity import Opener

MAGIC: Final = b"FBRC"
PROTOCOL_VERSION: Final = 16
_HEADER: Final = struct.Struct(">4sBBHIQ")
HEADER_SIZE: Final = _HEADER.size

Meta = dict[str, Any]


class Kind(enum.IntEnum):
    """What a frame is.  Peer kinds are below 32, client-socket kinds from 32 (protocol.md)."""

    HELLO = 1  #: peer handshake, first frame each way
    AUTH = 2  #: peer handshake, initiator's proof of the secret
    HEARTBEAT = 3  #: liveness on the control channel
    BYE = 4  #: the sender is draining and will close
    ANNOUNCE = 5  #: (job, rank) now lives / no longer lives on the sender's node
    RTS = 6  #: request to send a message (point-to-point rendezvous)
    CTS = 7  #: clear to send: the receive is posted, stream the data
    DATA = 8  #: one chunk of a message payload (data channel)
    DONE = 9  #: the receiver has the whole message (or failed to take it)
    CANCEL = 10  #: the sender withdraws a message it announced
    WRITE = 11  #: one-hop write into a region the receiver posted (transports/posted.py)
    EAGER = 12  #: a small message with its payload, no rendezvous (control channel)
    RTR = 13  #: ready to receive: a posted receive asks its sender to stream at once
    COLL = 14  #: one message of a persistent collective's round, into its slot (data channel)
    UPDATE = 15  #: a rank's model update of a stochastic reduce round, into a slot (data channel)
    NOTIFY = 16  #: an update of a round is out (or a barrier step of one) (control channel)
    ACK = 17  #: a receiver reduced a round's update: its sender may send the next (control)
    PUSH = 18  #: a worker's filtered update of one parameter-server shard (data channel)
    PULL = 19  #: a worker asks a server for a shard's parameters changed since a version (control)
    PUSHED = 20  #: a server applied (or dropped) a push: the model version it made (control)
    PULLED = 21  #: a server's answer to a PULL: the changed parameters (data channel)
    REPLICATE = 22  #: a primary server forwards one log entry to its replica (data channel)
    REPLICATED = 23  #: a replica holds a log entry, and every one before it (control)
    JOIN = 24  #: a server or replica opened a shard: its partner sends a snapshot (control)
    OPENED = 25  #: a rank opened a parameter-server model: its spec, to compare (control)
    MONITOR = 26  #: the sender's own link figures: up, down, RTT (network monitor, control)
    READY = 27  #: a worker's push is ready: the server's scheduler says when to send it (control)
    GRANT = 28  #: a server's scheduler: send that push after a wait (control)
    GATHER = 29  #: a server's scheduler: sum these pushes here and forward the sum (control)
    PLAN = 30  #: shard 0's scheduler: grant or drop these parts of jointly planned updates
    PART = 31  #: a rank's part of its accumulated gradients for a peer (Ako, data channel)
    REQUEST = 32  #: client -> daemon call
    REPLY = 33  #: daemon -> client answer to a REQUEST
    EVENT = 34  #: daemon -> client news nobody asked for in that moment (a pushed event)


#: the kinds whose payload is bulk data, possibly a view of a client's shared memory: their
#: MAC covers the payload only under ``data_integrity = "mac"`` (fabricd/integrity.py).  Not
#: EAGER: its payload is the daemon's own copy of at most eager_limit bytes, always covered
BULK_KINDS: Final = frozenset(
    {
        Kind.DATA,
        Kind.WRITE,
        Kind.COLL,
        Kind.UPDATE,
        Kind.PUSH,
        Kind.PULLED,
        Kind.REPLICATE,
        Kind.PART,
    }
)

#: every kind by its code, for the decoder (``Kind(code)`` costs an exception when unknown)
_KIND_OF: Final[dict[int, Kind]] = {int(kind): kind for kind in Kind}

#: the largest message tag (and rank) the protocol carries
MAX_TAG: Final = 2**31 - 1

#: The flag bits of protocol version 2 (fabricd/integrity.py); a frame with any other is rejected.
KNOWN_FLAGS: Final = FLAG_SEALED | FLAG_PAYLOAD_MAC


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Upper bounds, each checked before anything is allocated for it.

    Attributes:
        max_meta: bytes of msgpack metadata per frame.
        max_payload: bytes of raw payload per frame.
        max_str: bytes of any one msgpack string.
        max_array: items of any one msgpack array.
        max_map: entries of any one msgpack map.
        kinds: the frame kinds accepted; anything else is a protocol error.
    """

    max_meta: int = 64 * 1024
    max_payload: int = 64 * 1024 * 1024
    max_str: int = 4096
    max_array: int = 1024
    max_map: int = 256
    kinds: frozenset[Kind] = frozenset(Kind)

    def __post_init__(self) -> None:
        if min(self.max_meta, self.max_str, self.max_array, self.max_map) < 1:
            raise ValueError("wire limits must be positive")
        if self.max_payload < 0:
            raise ValueError("max_payload must be >= 0")


DEFAULT_LIMITS: Final = Limits()


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameHead:
    """A frame's header and metadata, seen before its payload arrives."""

    kind: Kind
    flags: int
    meta: Meta
    payload_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    """A whole frame.  ``payload`` is the caller's buffer if one was supplied."""

    kind: Kind
    flags: int
    meta: Meta
    payload: memoryview


class NeedData(enum.Enum):
    """Sentinel: the decoder needs more bytes before it can return another event."""

    NEED_DATA = enum.auto()


NEED_DATA: Final = NeedData.NEED_DATA


class Discard(enum.Enum):
    """What a receiver returns for a payload to read and drop (:meth:`Decoder.discard_payload`)."""

    DISCARD = enum.auto()


DISCARD: Final = Discard.DISCARD
_NO_PAYLOAD: Final = memoryview(b"")
_NO_META: Final[Meta] = {}  #: the decoder's metadata between frames (never changed)
#: bytes of a covered payload read at a time into the decoder's own buffer (payload_target)
BOUNCE: Final = 1 << 20


#: metadata larger than this is packed by a packer made for it alone: a kept packer's buffer
#: grows to the largest thing it ever packed and never shrinks (a 4 MiB status reply would stay
#: resident in the daemon for good)
_PACKER_KEEPS: Final = 64 * 1024


class _Packers(threading.local):
    """One msgpack packer per thread: ``msgpack.packb`` makes (and configures) a new one on
    every call, which costs twice what packing a frame's metadata does."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True)  # (a failed pack leaves it empty)

    def pack(self, meta: Mapping[str, object]) -> bytes:
        """``meta`` packed; a packer whose buffer grew past :data:`_PACKER_KEEPS` (or that
        failed, having grown) is replaced by a fresh one."""
        try:
            packed: bytes = self.packer.pack(meta if type(meta) is dict else dict(meta))
        except BaseException:
            self.packer = msgpack.Packer(use_bin_type=True)
            raise
        if len(packed) > _PACKER_KEEPS:
            self.packer = msgpack.Packer(use_bin_type=True)
        return packed


_packers = _Packers()


def encode_head(
    kind: Kind,
    meta: Mapping[str, object],
    payload_len: int = 0,
    *,
    flags: int = 0,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Return the header and metadata of a frame; the payload is sent after it, unchanged.

    Raises:
        LocalProtocolError: the metadata or payload would exceed ``limits`` (a caller bug:
            split the payload into chunks of at most ``limits.max_payload``).
    """
    packed = _packers.pack(meta)
    if len(packed) > limits.max_meta:
        raise LocalProtocolError(f"metadata of {len(packed)} B exceeds {limits.max_meta} B")
    if not 0 <= payload_len <= limits.max_payload:
        raise LocalProtocolError(f"payload of {payload_len} B exceeds {limits.max_payload} B")
    if flags & ~KNOWN_FLAGS:
        raise LocalProtocolError(f"undefined flag bits {flags:#x}")
    header = _HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, flags, len(packed), payload_len)
    return header + packed


def encode(kind: Kind, meta: Mapping[str, object], payload: bytes = b"") -> bytes:
    """Return a whole frame as one bytes object (for small frames and tests)."""
    return encode_head(kind, meta, len(payload)) + payload


class _State(enum.Enum):
    HEADER = enum.auto()  #: waiting for the fixed header
    META = enum.auto()  #: header parsed, waiting for metadata
    PAYLOAD = enum.auto()  #: head returned, filling the payload buffer
    TRAILER = enum.auto()  #: a sealed frame's payload is in, waiting for its trailer
    DEAD = enum.auto()  #: a protocol error happened; nothing more is accepted


class Decoder:
    """Turns a byte stream into :class:`FrameHead` and :class:`Frame` events.

    Feed bytes with :meth:`feed` (or write them straight into :meth:`payload_target` and report
    them with :meth:`payload_written`), then call :meth:`next_event` until it returns
    :data:`NEED_DATA`.  Each frame yields a ``FrameHead`` and then a ``Frame``; between the two
    the caller may supply the payload's destination with :meth:`set_payload_buffer`.  With
    ``heads=False`` a frame without payload yields its ``Frame`` alone (for a stream whose frames
    carry none, like the client socket's, the head is one event and one object per frame for
    nothing).

    Raises (from every method): :class:`RemoteProtocolError` on malformed input.  The decoder
    is then dead; close the connection.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, *, heads: bool = True) -> None:
        self.limits = limits
        self._heads = heads
        self._buf = bytearray()
        self._state = _State.HEADER
        self._kind = Kind.HELLO
        self._flags = 0
        self._meta_len = 0
        self._meta: Meta = _NO_META
        self._payload: memoryview | None = None
        self._payload_len = 0
        self._filled = 0
        self._discard = False  #: the current payload is read and dropped
        #: checks every frame once the link is authenticated (set between frames)
        self.opener: Opener | None = None
        self._header_raw = b""
        self._covered = False  #: the current frame's MAC covers its payload
        #: where a covered payload is read before it is hashed and copied (payload_target)
        self._bounce: memoryview | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that belong to headers or metadata not yet decoded."""
        return len(self._buf)

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame arrived and the rest has not (a header alone counts)."""
        return self._state is not _State.HEADER or bool(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes."""
        self._check_alive()
        view = memoryview(data).cast("B")
        if self._state is _State.PAYLOAD and not self._buf:
            view = view[self._fill_payload(view) :]
        if len(view):
            self._buf += view

    def payload_target(self) -> memoryview | None:
        """Where the next payload bytes may be written directly, if anywhere: the unfilled rest
        of the current payload buffer, or, for a payload its frame's MAC covers, the decoder's
        own read buffer (see below).

        Returns ``None`` unless the decoder is inside a payload with nothing buffered ahead of it.
        After writing ``n`` bytes into the returned view, call :meth:`payload_written`.

        A covered payload never lands in its buffer before it is hashed: that buffer may be a
        client's shared memory, which the client's process can write at any moment, and a MAC
        over what the buffer holds a moment later would fail (and reset the peer) whenever it
        does.  So it is read into a buffer of the decoder's own (:data:`BOUNCE` bytes, made
        once), hashed there, then copied: one copy, next to the MAC.
        """
        if self._state is not _State.PAYLOAD or self._buf or self._discard:
            return None
        if self._covered and self.opener is not None:
            if self._bounce is None:
                self._bounce = memoryview(bytearray(BOUNCE))
            return self._bounce[: min(BOUNCE, self._payload_len - self._filled)]
        payload = self._ensure_payload()
        return payload[self._filled :]

    def payload_written(self, n: int) -> None:
        """Record that ``n`` bytes were written into the view from :meth:`payload_target`."""
        if self._state is not _State.PAYLOAD or not 0 <= n <= self._payload_len - self._filled:
            raise LocalProtocolError("payload_written() without a matching payload_target()")
        if self._covered and self.opener is not None and n:
            # hashed where it landed, in the decoder's own buffer, then copied where it goes
            assert self._bounce is not None, "payload_written() without payload_target()"
            landed = self._bounce[:n]
            self.opener.update(landed)  # even if abandoned since: the MAC covers every byte
            if not self._discard:
                self._ensure_payload()[self._filled : self._filled + n] = landed
        # abandoned since payload_target() (and not covered): the bytes are where the view
        # pointed; the decoder places no more
        self._filled += n

    def set_payload_buffer(self, buffer: memoryview) -> None:
        """Direct the current frame's payload into ``buffer`` (exactly ``payload_len`` bytes).

        Only valid right after :meth:`next_event` returned a :class:`FrameHead`.
        """
        if self._state is not _State.PAYLOAD or self._payload is not None or self._discard:
            raise LocalProtocolError("set_payload_buffer() must follow a FrameHead event")
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        if view.readonly or len(view) != self._payload_len:
            raise LocalProtocolError(
                f"payload buffer must be writable and {self._payload_len} B, got {len(view)} B"
            )
        self._payload = view

    def discard_payload(self) -> None:
        """Read the current frame's payload and drop it, allocating nothing for it.

        The frame is still returned, with an empty ``payload``; its bytes pass through whatever
        the caller feeds (a transport's read buffer), a slice at a time.  Only valid right
        after :meth:`next_event` returned a :class:`FrameHead`.
        """
        if self._state is not _State.PAYLOAD or self._payload is not None or self._discard:
            raise LocalProtocolError("discard_payload() must follow a FrameHead event")
        self._discard = True

    def abandon_payload(self) -> None:
        """Drop the rest of the current frame's payload: no further byte of it is placed in the
        buffer given to :meth:`set_payload_buffer` (bytes already placed stay), and the frame
        comes out with an empty ``payload``, as after :meth:`discard_payload`.

        For a destination withdrawn while its payload arrives (a posted region retired
        mid-write, transports/posted.py).  With only the trailer left it drops the buffer too
        (every byte is in; the decoder must not keep a view of a withdrawn region until the
        trailer comes).  A no-op between frames.
        """
        if self._state is _State.PAYLOAD or self._state is _State.TRAILER:
            self._discard = True
            self._payload = None

    def next_event(self) -> FrameHead | Frame | NeedData:
        """Return the next event, or :data:`NEED_DATA`."""
        state = self._state
        try:
            if state is _State.HEADER:
                if not self._buf or not self._parse_header():  # (the usual end of a read)
                    return NEED_DATA
                state = _State.META
            if state is _State.META:
                if not self._parse_meta():
                    return NEED_DATA
                if self._payload_len or self._heads:
                    return FrameHead(
                        kind=self._kind,
                        flags=self._flags,
                        meta=self._meta,
                        payload_len=self._payload_len,
                    )
                state = _State.PAYLOAD  # nothing to place: the frame follows at once
            if state is _State.PAYLOAD:
                return self._finish_payload()
            if state is _State.TRAILER:
                return self._finish_trailer()
            raise RemoteProtocolError("decoder already failed; the connection must be closed")
        except RemoteProtocolError:
            self._state = _State.DEAD
            raise

    def _check_alive(self) -> None:
        if self._state is _State.DEAD:
            raise RemoteProtocolError("decoder already failed; the connection must be closed")

    def _parse_header(self) -> bool:
        """Decode the fixed header if it is all here (then the metadata comes next)."""
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            if buf and buf[: len(MAGIC)] != MAGIC[: len(buf)]:
                raise RemoteProtocolError("bad magic: not a fabricd frame")
            return False
        magic, version, code, flags, meta_len, payload_len = _HEADER.unpack_from(buf)
        limits = self.limits
        kind = _KIND_OF.get(code)
        # one test for the frame every well-behaved peer sends; the checks below name the fault
        if (
            magic != MAGIC
            or version != PROTOCOL_VERSION
            or kind not in limits.kinds
            or flags & ~KNOWN_FLAGS
            or (flags and self.opener is None)
            or meta_len > limits.max_meta
            or payload_len > limits.max_payload
        ):
            self._reject_header(magic, version, code, flags, meta_len, payload_len)
        assert kind is not None  # (_reject_header raised otherwise)
        self._kind, self._flags, self._meta_len, self._payload_len = (
            kind,
            flags,
            meta_len,
            payload_len,
        )
        if self.opener is not None:
            self._header_raw = bytes(buf[:HEADER_SIZE])
        del buf[:HEADER_SIZE]
        self._state = _State.META
        return True

    def _reject_header(
        self, magic: bytes, version: int, code: int, flags: int, meta_len: int, payload_len: int
    ) -> None:
        """Raise the error that says what is wrong with a header :meth:`_parse_header` refused."""
        if magic != MAGIC:
            raise RemoteProtocolError("bad magic: not a fabricd frame")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"protocol version {version} is not supported (this side speaks "
                f"{PROTOCOL_VERSION}); run the same fabricd release on every node"
            )
        kind = _KIND_OF.get(code)
        if kind is None:
            raise RemoteProtocolError(f"unknown frame kind {code}")
        if kind not in self.limits.kinds:
            raise RemoteProtocolError(f"frame kind {kind.name} is not allowed here")
        if flags & ~KNOWN_FLAGS:
            raise RemoteProtocolError(f"undefined flag bits {flags:#x}")
        if flags and self.opener is None:
            raise RemoteProtocolError("a sealed frame on a link that has no session keys")
        if meta_len > self.limits.max_meta:
            raise RemoteProtocolError(f"metadata of {meta_len} B exceeds {self.limits.max_meta} B")
        raise RemoteProtocolError(f"payload of {payload_len} B exceeds {self.limits.max_payload} B")

    def _parse_meta(self) -> bool:
        """Decode the metadata if it is all here (then the payload comes next)."""
        if len(self._buf) < self._meta_len:
            return False
        raw = bytes(self._buf[: self._meta_len])
        del self._buf[: self._meta_len]
        self._meta = _unpack_meta(raw, self.limits)
        if self.opener is not None:
            self._covered = self.opener.begin(self._kind, self._flags, self._header_raw, raw)
        self._state = _State.PAYLOAD
        self._payload, self._filled, self._discard = None, 0, False
        return True

    def _finish_payload(self) -> Frame | NeedData:
        if self._buf and self._filled < self._payload_len:
            taken = self._fill_payload(memoryview(self._buf))
            del self._buf[:taken]
        if self._filled < self._payload_len:
            return NEED_DATA
        if self.opener is None:
            return self._frame()
        self._state = _State.TRAILER
        return self._finish_trailer()

    def _finish_trailer(self) -> Frame | NeedData:
        if len(self._buf) < TRAILER_SIZE:
            return NEED_DATA
        assert self.opener is not None
        self.opener.finish(self._buf)  # reads the first TRAILER_SIZE bytes
        del self._buf[:TRAILER_SIZE]
        return self._frame()

    def _frame(self) -> Frame:
        payload = _NO_PAYLOAD if self._discard or not self._payload_len else self._ensure_payload()
        frame = Frame(kind=self._kind, flags=self._flags, meta=self._meta, payload=payload)
        self._state, self._payload, self._meta = _State.HEADER, None, _NO_META
        return frame

    def _ensure_payload(self) -> memoryview:
        if self._payload is None:
            self._payload = memoryview(bytearray(self._payload_len))
        return self._payload

    def _fill_payload(self, view: memoryview) -> int:
        n = min(len(view), self._payload_len - self._filled)
        if self._covered and self.opener is not None:
            self.opener.update(view[:n])  # hashed as it passes (and, if dropped, nothing kept)
        if self._discard:
            self._filled += n
            return n
        payload = self._ensure_payload()
        payload[self._filled : self._filled + n] = view[:n]
        self._filled += n
        return n


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack ext type {code} is not allowed (no ext types are defined)")


def _unpack_meta(raw: bytes, limits: Limits) -> Meta:
    try:
        meta = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_meta,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
            max_ext_len=0,
            ext_hook=_reject_ext,  # max_ext_len=0 still lets a zero-length ext 8 through
        )
    except Exception as exc:  # msgpack raises several unrelated types; all mean "malformed"
        reason = str(exc) or type(exc).__name__  # StackError (nesting too deep) has no text
        raise RemoteProtocolError(f"malformed metadata: {reason}") from exc
    # strict_map_key lets only str and (msgpack bin) bytes keys through: refuse the bytes
    if type(meta) is not dict or bytes in map(type, meta):
        raise RemoteProtocolError("metadata must be a map with string keys")
    return meta


def get_int(meta: Meta, key: str, *, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """Return ``meta[key]`` as an int in ``[lo, hi]``, or raise RemoteProtocolError."""
    value = meta.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise RemoteProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}]")
    return value


def get_str(meta: Meta, key: str) -> str:
    """Return ``meta[key]`` as a non-empty str, or raise RemoteProtocolError."""
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise RemoteProtocolError(f"field {key!r} must be a non-empty string")
    return value


def get_bytes(meta: Meta, key: str) -> bytes:
    """Return ``meta[key]`` as bytes, or raise RemoteProtocolError."""
    value = meta.get(key)
    if not isinstance(value, bytes):
        raise RemoteProtocolError(f"field {key!r} must be binary")
    return value
