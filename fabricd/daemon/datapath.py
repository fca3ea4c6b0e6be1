"""Moving message bytes: streaming out of segments, landing in segments, local copies.

Copies, per direction (docs/performance.md measures them):

* send: none in user space.  DATA frames carry views of the sender's segment; uvloop
  ``writev``s them, so the kernel copies segment -> socket buffer.
* receive: none in user space for payload bytes read directly: ``payload_buffer`` returns a view
  of the receiver's segment and the TCP transport lets the kernel write socket -> segment.  Bytes
  that arrive in the same read as a frame header (at most 64 KiB per frame) are copied once from
  the scratch buffer.
* same node: one ``memcpy`` segment -> segment, in a worker thread when it is large, so the event
  loop keeps answering heartbeats during a 256 MiB copy.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from fabricd.errors import RemoteProtocolError
from fabricd.wire import Frame, FrameHead, Kind, get_int

if TYPE_CHECKING:
    from fabricd.transports.base import Link

#: copies above this size run in a worker thread
THREAD_COPY_MIN: Final = 1 << 20


@dataclass(slots=True)
class Expectation:
    """A remote message being received: where it lands and how much has come."""

    region: memoryview | None  #: ``None``: its receiver left; count the bytes and drop them
    nbytes: int
    received: int = 0


class Inbound:
    """DATA frames of every message this daemon is receiving, keyed by (node, msg)."""

    def __init__(self) -> None:
        self._expected: dict[tuple[int, int], Expectation] = {}
        self._bin = bytearray()  #: grows to the largest dropped chunk (at most max_payload)
        self.bytes = 0

    def expect(self, node: int, msg: int, region: memoryview) -> None:
        self._expected[node, msg] = Expectation(region=region, nbytes=len(region))

    def discard(self, node: int, msg: int) -> None:
        """Stop writing message (node, msg) anywhere; its frames are counted and dropped."""
        expectation = self._expected.get((node, msg))
        if expectation is not None:
            expectation.region = None

    def forget(self, node: int, msg: int) -> None:
        """Message (node, msg) was cancelled: none of its DATA will come."""
        self._expected.pop((node, msg), None)

    def forget_node(self, node: int) -> None:
        """The link to ``node`` was reset: nothing more of its messages will come."""
        for key in [k for k in self._expected if k[0] == node]:
            del self._expected[key]

    def payload_buffer(self, node: int, head: FrameHead) -> memoryview | None:
        """Where a DATA chunk lands; checks that it continues its message exactly.

        Raises:
            RemoteProtocolError: a payload on another frame kind, or a chunk out of place.
        """
        if head.kind is not Kind.DATA:
            raise RemoteProtocolError(f"{head.kind.name} frames carry no payload")
        msg, off = get_int(head.meta, "msg"), get_int(head.meta, "off")
        expectation = self._expected.get((node, msg))
        if expectation is None:
            return self._discard(head.payload_len)  # cancelled or its peer reset: dropped
        if off != expectation.received or off + head.payload_len > expectation.nbytes:
            raise RemoteProtocolError(
                f"DATA chunk [{off}, {off + head.payload_len}) of message {msg} does not continue "
                f"at {expectation.received} of {expectation.nbytes} B"
            )
        if expectation.region is None:
            return self._discard(head.payload_len)
        return expectation.region[off : off + head.payload_len]

    def _discard(self, nbytes: int) -> memoryview:
        """Where dropped bytes go: one buffer, reused, instead of a fresh one per chunk."""
        if len(self._bin) < nbytes:
            self._bin = bytearray(nbytes)
        return memoryview(self._bin)[:nbytes]

    def chunk_arrived(self, node: int, frame: Frame) -> int | None:
        """Account a DATA frame; return its message id once the message is complete."""
        msg = get_int(frame.meta, "msg")
        expectation = self._expected.get((node, msg))
        if expectation is None:
            return None
        expectation.received += len(frame.payload)
        self.bytes += len(frame.payload)
        if expectation.received < expectation.nbytes:
            return None
        del self._expected[node, msg]
        return msg


async def stream(link: Link, msg: int, region: memoryview, chunk_size: int) -> None:
    """Send ``region`` as DATA frames of ``msg``, waiting on backpressure.

    Raises:
        TransportError: the link closed before every chunk was queued.
    """
    for off in range(0, len(region), chunk_size):
        await link.send(Kind.DATA, {"msg": msg, "off": off}, [region[off : off + chunk_size]])


async def copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (equal sizes), off the event loop when large."""
    target = np.frombuffer(dst, dtype=np.uint8)
    source = np.frombuffer(src, dtype=np.uint8)
    if len(src) >= THREAD_COPY_MIN:
        await asyncio.to_thread(np.copyto, target, source)
    else:
        np.copyto(target, source)
