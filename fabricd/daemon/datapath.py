"""Moving message bytes: streaming out of segments and copying between them.

Where incoming bytes land is the engine's landing table (:mod:`fabricd.engines.landing`); this
module holds the two pieces of work that wait: sending a region as DATA frames, and a large
local copy off the event loop.

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
from typing import TYPE_CHECKING, Final

import numpy as np

from fabricd.frames import Data
from fabricd.wire import Kind

if TYPE_CHECKING:
    from fabricd.transports.base import Link

#: copies above this size run in a worker thread
THREAD_COPY_MIN: Final = 1 << 20


async def stream(link: Link, msg: int, region: memoryview, chunk_size: int) -> None:
    """Send ``region`` as DATA frames of ``msg``, waiting on backpressure.

    Raises:
        TransportError: the link closed before every chunk was queued.
    """
    for off in range(0, len(region), chunk_size):
        chunk = Data(msg=msg, off=off)
        await link.send(Kind.DATA, chunk.to_meta(), [region[off : off + chunk_size]])


async def copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (equal sizes), off the event loop when large."""
    target = np.frombuffer(dst, dtype=np.uint8)
    source = np.frombuffer(src, dtype=np.uint8)
    if len(src) >= THREAD_COPY_MIN:
        await asyncio.to_thread(np.copyto, target, source)
    else:
        np.copyto(target, source)
