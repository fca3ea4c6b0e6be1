"""Authenticated frames after the handshake: a sealer for what a link sends, an opener for
what it receives.

Rules: this module holds every byte of the per-frame integrity check and nothing else; it does
no I/O, reads no clock and keeps no state beyond its keys and counters.  Transports seal in
their send path and open in their receive path (:mod:`fabricd.wire`'s decoder calls the
opener); the peering service makes the pair from the keys the handshake derived
(:meth:`fabricd.engines.link.handshake.Handshake.session_keys`).

Theory of operation.  Once a link is authenticated, every frame on it, both ways, is sealed::

    header (20 B, flags has SEALED) | meta | payload | trailer: seq (u64) | mac (16 B)

    mac = MAC(key_dir, seq ‖ header ‖ meta [‖ payload if the header's PAYLOAD_MAC flag is set])

* ``key_dir`` is one of two keys the handshake derives from the shared secret, both nonces,
  both nodes and incarnations and the channel: one per link and per direction, so a frame
  cannot be moved to another link, another direction or a later connection.
* ``seq`` counts sealed frames on the link in that direction from 0.  The opener expects the
  next number; a replayed, reordered, dropped-then-resumed or injected frame carries another
  one (or a MAC made with another), so it is rejected, and the link must be closed: the peering
  engine then resets the peer (architecture.md, "Reset rule").  The number rides in the
  trailer, although both sides know it, so a rejection can say "replayed or reordered" apart
  from "altered".
* The MAC is keyed BLAKE2b-128 for every kind but the bulk kinds, DATA and WRITE (fastest for
  small frames: ~0.8 µs for a control frame), and HMAC-SHA256 truncated to 128 bits for those
  two (twice BLAKE2b's bulk rate on CPUs with SHA extensions; bench/integrity.py measures both).
* Control frames always cover their payload.  DATA and WRITE cover their payload only when the
  sender's ``data_integrity`` is ``"mac"``: the header and metadata (message or key, offset)
  are authenticated either way.  A receiver whose own setting is ``"mac"`` refuses DATA and
  WRITE that do not cover it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.wire import Kind

Buffer = bytes | bytearray | memoryview

#: frame flag: a trailer (sequence number and MAC) follows the payload
FLAG_SEALED: Final = 0x0001
#: frame flag: the trailer's MAC covers the payload too
FLAG_PAYLOAD_MAC: Final = 0x0002
#: what follows the payload of a sealed frame
_TRAILER: Final = struct.Struct(">Q16s")
TRAILER_SIZE: Final = _TRAILER.size
_SEQ: Final = struct.Struct(">Q")
#: the key size the handshake derives, per direction
KEY_SIZE: Final = 32
#: the kinds whose payload MAC is optional (and computed with HMAC-SHA256): DATA, WRITE, COLL,
#: UPDATE, PUSH, PULLED, REPLICATE and PART, wire.BULK_KINDS (by number: wire imports this
#: module; a unit test checks they agree)
_BULK_KINDS: Final = frozenset({8, 11, 14, 15, 18, 21, 22, 31})
#: every error this module raises starts with this (the peering service counts them)
FAILURE: Final = "integrity check failed"


class Mac(Protocol):
    """A running MAC: what ``hashlib.blake2b`` and ``hmac.HMAC`` objects share."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...
    def copy(self) -> Mac: ...


class IntegrityError(RemoteProtocolError):
    """A frame after the handshake was replayed, reordered, injected or altered: close the
    link (the peer is then reset)."""


def _prototypes(key: bytes) -> tuple[Mac, Mac]:
    """The keyed MACs of one direction (control, DATA); each frame starts from a copy."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"a session key is {KEY_SIZE} bytes, not {len(key)}")
    return hashlib.blake2b(key=key, digest_size=16), hmac.new(key, digestmod="sha256")


class Sealer:
    """Seals the frames one link sends in one direction.

    Args:
        key: this direction's session key.
        cover_data: whether DATA frames' MACs cover their payload (``data_integrity``).
    """

    def __init__(self, key: bytes, *, cover_data: bool) -> None:
        self._control, self._data = _prototypes(key)
        self.cover_data = cover_data
        self.seq = 0  #: the number the next sealed frame carries

    def flags(self, kind: Kind) -> int:
        """The header flags a frame of ``kind`` must carry (encode its header with them)."""
        if kind not in _BULK_KINDS or self.cover_data:
            return FLAG_SEALED | FLAG_PAYLOAD_MAC
        return FLAG_SEALED

    def seal(self, kind: Kind, head: bytes, payload: Sequence[Buffer]) -> bytes:
        """Return the trailer of the frame whose header and metadata are ``head``.

        Call once per frame, in the order the frames go on the wire; ``head`` must have been
        encoded with :meth:`flags`.
        """
        # one straight path per kind: this runs for every frame a daemon sends (~0.5 us of
        # MAC in ~1 us here, bench/integrity.py; helpers and enum lookups doubled it)
        number = _SEQ.pack(self.seq)
        self.seq += 1
        if kind not in _BULK_KINDS:
            mac = self._control.copy()
            mac.update(number + head)
            for part in payload:
                mac.update(part)
            return number + mac.digest()
        mac = self._data.copy()
        mac.update(number + head)
        if self.cover_data:
            for part in payload:
                mac.update(part)
        return number + mac.digest()[:16]


class Opener:
    """Checks the frames one link receives in one direction.

    Use per frame: :meth:`begin` with the raw header and metadata, :meth:`update` with the
    payload if :meth:`begin` said it is covered, then :meth:`finish` with the trailer.

    Args:
        key: this direction's session key (the peer's sealing key).
        require_data: refuse DATA whose MAC does not cover its payload (``data_integrity``).
    """

    def __init__(self, key: bytes, *, require_data: bool) -> None:
        self._control, self._data = _prototypes(key)
        self.require_data = require_data
        self.seq = 0  #: the number the next frame must carry
        self._mac: Mac | None = None

    def begin(self, kind: Kind, flags: int, header: bytes, meta: bytes) -> bool:
        """Start checking a frame; return whether its payload is covered (feed it to update).

        Raises:
            IntegrityError: the frame is not sealed, or a payload that must be covered is not.
        """
        if flags != FLAG_SEALED | FLAG_PAYLOAD_MAC:
            self._refuse(kind, flags)
        mac = self._control.copy() if kind not in _BULK_KINDS else self._data.copy()
        mac.update(_SEQ.pack(self.seq) + header)
        mac.update(meta)
        self._mac = mac
        return flags == FLAG_SEALED | FLAG_PAYLOAD_MAC

    def _refuse(self, kind: Kind, flags: int) -> None:
        if not flags & FLAG_SEALED:
            raise IntegrityError(f"{FAILURE}: an unsealed {kind.name} frame after the handshake")
        if kind not in _BULK_KINDS or self.require_data:
            raise IntegrityError(
                f"{FAILURE}: a {kind.name} frame whose MAC does not cover its payload (set "
                "data_integrity the same on every node)"
            )

    def update(self, payload: Buffer) -> None:
        """Add payload bytes (all of them, in order, once each)."""
        assert self._mac is not None, "update() outside begin()/finish()"
        self._mac.update(payload)

    def finish(self, trailer: Buffer) -> None:
        """Check the frame's trailer (its first ``TRAILER_SIZE`` bytes); the next frame must
        carry the next number.

        Raises:
            IntegrityError: a replayed, reordered, injected or altered frame; close the link.
        """
        mac, self._mac = self._mac, None
        assert mac is not None, "finish() without begin()"
        seq, tag = _TRAILER.unpack_from(trailer)
        if seq != self.seq:
            raise IntegrityError(
                f"{FAILURE}: frame number {seq} where {self.seq} was due (replayed, reordered "
                "or injected)"
            )
        if not hmac.compare_digest(tag, mac.digest()[:16]):
            raise IntegrityError(f"{FAILURE}: frame {seq} was altered (its MAC does not match)")
        self.seq = seq + 1
