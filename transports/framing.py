"""What every transport's link shares: decoding frames into the sink, encoding, bookkeeping.

Keeping this in one place means every transport enforces the same limits, closes on the same
errors, asks the sink for payload buffers at the same moment and delivers ``link_lost`` exactly
once (transports/base.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

from fabricd.errors import ProtocolError
from fabricd.transports.base import Link, LinkStatistics
from fabricd.transports.posted import PostedRegions
from fabricd.wire import BULK_KINDS, DISCARD, NEED_DATA, Decoder, Frame, Kind, Limits, encode_head

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.integrity import Opener, Sealer
    from fabricd.transports.base import Buffer, FrameSink
    from fabricd.transports.posted import PostKey, WriteLanded
    from fabricd.wire import Discard

#: read on every frame: a module constant is cheaper than the enum attribute
_WRITE: Final = Kind.WRITE
#: frames a link delivers before it lets the event loop go round once (reading nothing
#: meanwhile): a read that brings a flood of small frames (10^5 CANCELs) is delivered over
#: many loop iterations, not in one callback that holds the loop for seconds while heartbeats,
#: other links and clients wait
FRAME_BUDGET: Final = 256

log = logging.getLogger("fabricd.transport")


class _NullSink:
    """Until the upper layer installs a sink, any frame is a protocol violation."""

    def payload_buffer(self, link: Link, head: object) -> memoryview | None:
        raise ProtocolError("frame arrived before the link had a receiver")

    def frame_received(self, link: Link, frame: Frame) -> None:
        raise ProtocolError("frame arrived before the link had a receiver")

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        pass


class Receiver:
    """Decoder plus sink for one link.

    :meth:`process` runs the decoder until it needs data or has delivered the frames its
    budget allows (the transport calls it again later for the rest, reading nothing more
    meanwhile), and returns an error message if the link must be closed (a malformed frame,
    or a sink that rejected one).  WRITE frames never reach the sink: they land in the link's
    :attr:`posted` regions (transports/posted.py).
    """

    def __init__(self, link: Link, limits: Limits) -> None:
        self.link = link
        self.decoder = Decoder(limits)
        self.sink: FrameSink = _NullSink()
        self.frames = 0
        self.bytes = 0
        self.posted = PostedRegions(link)
        self.delivered = 0  #: frames the last :meth:`process` delivered

    def process(self, budget: int = FRAME_BUDGET) -> str | None:
        """Deliver complete events, at most ``budget`` frames (:attr:`delivered` says how
        many); return why the link must close, or ``None``."""
        self.delivered = 0
        try:
            while self.delivered < budget and not self.link.closed:
                event = self.decoder.next_event()
                if event is NEED_DATA:
                    return None
                if isinstance(event, Frame):
                    self.frames += 1
                    if event.kind is _WRITE:
                        self.posted.end()  # after its trailer: in place and authenticated
                    else:
                        self.sink.frame_received(self.link, event)
                    self.delivered += 1
                    continue
                buffer: memoryview | Discard | None
                if event.kind is _WRITE:
                    buffer = self.posted.begin(event)  # bounds checked before any byte
                elif event.payload_len:
                    buffer = self.sink.payload_buffer(self.link, event)
                else:
                    continue
                if not event.payload_len:
                    continue
                if buffer is DISCARD:
                    self.decoder.discard_payload()
                elif buffer is not None:
                    self.decoder.set_payload_buffer(buffer)
        except ProtocolError as exc:
            return f"protocol error: {exc}"
        except Exception:
            log.exception("receiver of %s failed", self.link.peer_address)
            return "internal error while handling a frame (see the log)"
        return None


class FramedLink(Link):
    """A link's state apart from how its bytes move: receiver, close state, counters.

    Subclasses move bytes; they call :meth:`_encode` to frame what they send and
    :meth:`_lost` once the connection is gone.
    """

    def __init__(self, peer_address: str, limits: Limits, local: str = "") -> None:
        super().__init__(peer_address)
        self._receiver = Receiver(self, limits)
        self._local = local
        self._is_closed = False
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._frames_sent = 0
        self._bytes_sent = 0
        self._sealer: Sealer | None = None  #: seals every frame sent once authenticated
        self._head = b""  #: the header and metadata of the frame being sent

    def set_sink(self, sink: FrameSink) -> None:
        self._receiver.sink = sink

    def set_limits(self, limits: Limits) -> None:
        self._receiver.decoder.limits = limits

    def secure(self, sealer: Sealer, opener: Opener) -> None:
        self._sealer = sealer
        self._receiver.decoder.opener = opener

    def _encode(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer]
    ) -> list[Buffer]:
        """The frame but its trailer, as buffers to send in order (the payload's are not
        copied, but for a sealed frame whose MAC covers them): header and metadata checked
        against this link's limits, then the payload.  Counted.  Call once per frame, in wire
        order, and :meth:`_trailer` right after with the payload parts returned here.

        Both ends of a link are configured alike, so what passes the sender's limits passes
        the receiver's.
        """
        size = 0
        for part in payload:  # (a loop: sum() over a generator costs twice as much per frame)
            size += memoryview(part).nbytes
        sealer = self._sealer
        if sealer is not None and size and kind in BULK_KINDS and sealer.cover_data:
            # a DATA (or WRITE) payload is a view of a client's shared memory, which its process may
            # write at any moment (a send buffer reused too early): the bytes sealed must be
            # the bytes sent, or the receiver's check fails and the peer is reset, so any
            # user of this node could fail every job with that one.  One copy, next to the MAC.
            payload = [b"".join(payload)]
        flags = 0 if sealer is None else sealer.flags(kind)
        head = encode_head(kind, meta, size, flags=flags, limits=self._receiver.decoder.limits)
        self._head = head
        self._frames_sent += 1
        self._bytes_sent += len(head) + size  # with the trailer: what the receiver counts
        return [head, *payload]

    def post(
        self,
        key: PostKey,
        region: memoryview,
        *,
        dtype: str = "uint8",
        on_landed: Callable[[WriteLanded], None],
    ) -> None:
        self._receiver.posted.post(key, region, dtype=dtype, on_landed=on_landed)

    def retire(self, key: PostKey) -> None:
        if self._receiver.posted.retire(key):
            self._receiver.decoder.abandon_payload()  # the rest of it goes nowhere

    def fence(self, epoch: int) -> None:
        if self._receiver.posted.fence(epoch):
            self._receiver.decoder.abandon_payload()

    def _trailer(self, kind: Kind, payload: Sequence[Buffer]) -> bytes:
        """What follows the frame :meth:`_encode` just made (``payload``: the parts it
        returned after the header): its seal once the link is secured, else nothing.  Apart
        from ``_encode`` so that a transport can queue a large payload first and hash it while
        the kernel already sends it."""
        sealer = self._sealer
        if sealer is None:
            return b""
        trailer = sealer.seal(kind, self._head, payload)
        self._bytes_sent += len(trailer)
        return trailer

    def _lost(self, exc: BaseException | None) -> None:
        """The connection is gone: tell the sink, once, and wake ``wait_closed``."""
        if self._closed.done():
            return
        self._is_closed = True
        if self._receiver.posted.clear():  # no write lands or completes on a lost link
            self._receiver.decoder.abandon_payload()  # nor keeps its region mapped
        try:
            self._receiver.sink.link_lost(self, exc)
        finally:
            self._closed.set_result(None)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    @property
    def closed(self) -> bool:
        return self._is_closed

    @property
    def local_address(self) -> str:
        return self._local

    def statistics(self) -> LinkStatistics:
        posted = self._receiver.posted.statistics()
        return LinkStatistics(
            frames_sent=self._frames_sent,
            frames_received=self._receiver.frames,
            bytes_sent=self._bytes_sent,
            bytes_received=self._receiver.bytes,
            writes_landed=posted.writes_landed,
            writes_refused=posted.writes_refused,
        )
