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
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.errors import ErrorCode, OperationFailed
from fabricd.frames.p2p import Data
from fabricd.wire import Kind

if TYPE_CHECKING:
    from fabricd.transports.base import Link

#: copies above this size run in a worker thread
THREAD_COPY_MIN: Final = 1 << 20
#: the worker threads of large copies (as many as asyncio's default executor would have);
#: the process's, shared by the daemons an in-process test runs
_copiers = ThreadPoolExecutor(thread_name_prefix="fabricd-copy")


async def stream(link: Link, msg: int, region: memoryview, chunk_size: int, rtr: int = 0) -> None:
    """Send ``region`` as DATA frames of ``msg`` (answering RTR ``rtr``, if not 0), waiting on
    backpressure.

    Raises:
        TransportError: the link closed before every chunk was queued.
    """
    for off in range(0, len(region), chunk_size):
        chunk = Data(msg=msg, off=off, rtr=rtr)
        await link.send(Kind.DATA, chunk.to_meta(), [region[off : off + chunk_size]])


async def copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (equal sizes), off the event loop when large.

    Raises:
        OperationFailed: code ``resources``: no worker thread could be started for a large
            copy (``RuntimeError: can't start new thread``, or ``MemoryError``, when the process
            is out of memory, address space or its thread limit).  Nothing was copied, and
            nothing will be.
    """
    target = np.frombuffer(dst, dtype=np.uint8)
    source = np.frombuffer(src, dtype=np.uint8)
    if len(src) < THREAD_COPY_MIN:
        np.copyto(target, source)
        return
    job = _Copy(asyncio.get_running_loop(), target, source)
    try:
        _copiers.submit(job.run)  # job.finished says when it ran: one wake-up of the loop
    except Exception as exc:  # RuntimeError (no thread), MemoryError: the item may be queued
        if job.drop():
            raise OperationFailed(
                f"the daemon could not start a thread for a {len(src)} B copy "
                f"({exc or type(exc).__name__}); it is short of memory or threads, retry later",
                code=ErrorCode.RESOURCES,
            ) from None
    await job.finished


class _Copy:
    """A large copy handed to the worker threads, which run it at most once.

    When the executor cannot start a worker thread, ``ThreadPoolExecutor.submit`` raises after
    it queued the work item: a thread started later (or a busy one) would still copy into the
    receiver's segment long after its operation failed.  So the item asks, under a lock, whether
    it was dropped before it copies, and :meth:`drop` succeeds only if it has not begun.  A
    dropped item lets go of both arrays at once: queued, it would keep both segments mapped
    (mmap cannot unmap under a view) until some later thread took it.  Its
    own future reports the end, since the executor's one is lost when ``submit`` raises (and
    a second future would wake the loop twice per copy).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        target: np.ndarray[Any, Any],
        source: np.ndarray[Any, Any],
    ) -> None:
        self._loop = loop
        #: let go when dropped: the queued item must not keep both segments mapped
        self._arrays: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = target, source
        self._lock = threading.Lock()
        self._state = "queued"  #: then "running" (a worker took it) or "dropped"
        self.finished: asyncio.Future[None] = loop.create_future()

    def run(self) -> None:
        """In a worker thread: copy, unless dropped; report the end to the loop."""
        with self._lock:
            if self._state == "dropped" or self._arrays is None:
                return
            self._state = "running"
            target, source = self._arrays
            self._arrays = None
        failure: BaseException | None = None
        try:
            np.copyto(target, source)
        except BaseException as exc:  # reported to the awaiting task, never lost in a thread
            failure = exc
        del target, source
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._end, failure)

    def drop(self) -> bool:
        """Make sure the copy never runs; ``False`` if a worker already runs it."""
        with self._lock:
            if self._state == "running":
                return False
            self._state = "dropped"
            self._arrays = None
            return True

    def _end(self, failure: BaseException | None) -> None:
        if self.finished.done():
            return
        if failure is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(failure)
