"""The receive half every transport shares: decode frames and hand them to the sink.

Keeping this in one place means every transport enforces the same limits, closes on the same
errors and asks the sink for payload buffers at the same moment (transports/base.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabricd.errors import ProtocolError
from fabricd.wire import NEED_DATA, Decoder, Frame, Limits

if TYPE_CHECKING:
    from fabricd.transports.base import FrameSink, Link

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

    :meth:`process` runs the decoder until it needs data and returns an error message if the
    link must be closed (a malformed frame, or a sink that rejected one).
    """

    def __init__(self, link: Link, limits: Limits) -> None:
        self.link = link
        self.decoder = Decoder(limits)
        self.sink: FrameSink = _NullSink()
        self.frames = 0
        self.bytes = 0

    def process(self) -> str | None:
        """Deliver every complete event; return why the link must close, or ``None``."""
        try:
            while not self.link.closed:
                event = self.decoder.next_event()
                if event is NEED_DATA:
                    return None
                if isinstance(event, Frame):
                    self.frames += 1
                    self.sink.frame_received(self.link, event)
                elif event.payload_len:
                    buffer = self.sink.payload_buffer(self.link, event)
                    if buffer is not None:
                        self.decoder.set_payload_buffer(buffer)
        except ProtocolError as exc:
            return f"protocol error: {exc}"
        except Exception:
            log.exception("receiver of %s failed", self.link.peer_address)
            return "internal error while handling a frame (see the log)"
        return None
