"""The other end of each benchmark, run in its own process (multiprocessing, spawn).

Every helper follows a *plan* fixed before it starts -- a list of ``(nbytes, messages)`` -- and
does exactly that many operations, so it ends by itself; the measuring process follows the same
plan from its side.  Nothing here times anything: the measuring process does.

* :func:`fabric_receiver`: rank 1 of a fabricd job; receives each planned message from rank 0.
* :func:`fabric_echo`: rank 1; sends each message from rank 0 back (0 B by default).
* :func:`fabric_batch_receiver`: rank 1; receives batches of messages with a window of receives
  posted and ends each batch with a 0-byte message back to rank 0.
* :func:`tcp_echo`: the raw two-process ping-pong's far end: blocking TCP sockets.
* :func:`raw_receiver`: the raw TCP baseline's receiver: uvloop, a ``BufferedProtocol`` reading
  straight into one preallocated shared-memory buffer, one 1-byte ack per complete message.
* :func:`unix_echo`: the raw Unix-socket baseline: echoes fixed-size messages back.
* :func:`frame_echo`: the latency benchmark's far end in another process: a fabricd TCP
  listener whose links echo HEARTBEAT frames (:class:`FrameEcho`) and a raw uvloop server that
  echoes bytes (:class:`RawEcho`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from fabricd.transports.base import Link
    from fabricd.wire import Frame, FrameHead

#: a fabricd call that takes longer than this means the benchmark is broken, not slow
CALL_TIMEOUT = 120.0

Plan = list[tuple[int, int]]


def send_windowed(fab: Any, view: Any, messages: int, window: int, wait: str = "delivered") -> None:
    """Rank 0: send ``messages`` copies of ``view`` to rank 1, at most ``window`` unfinished
    (``wait``: when a send finishes, as ``fab.send`` takes it)."""
    import collections

    in_flight: collections.deque[Any] = collections.deque()
    for _ in range(messages):
        if len(in_flight) == window:
            in_flight.popleft().wait(CALL_TIMEOUT)
        in_flight.append(fab.send_async(view, to=1, wait=wait))
    while in_flight:
        in_flight.popleft().wait(CALL_TIMEOUT)


def fabric_receiver(socket_path: str, job: str, plan: Plan, window: int = 1) -> None:
    """Rank 1 of ``job``: receive every planned message from rank 0.

    With ``window`` > 1 that many receives stay posted, each into its own shared array, so the
    sender's next messages never wait for this process to post one (osu_bw style).
    """
    import collections

    import fabricd

    capacity = max([n for n, _ in plan] + [1])
    with fabricd.connect(job=job, rank=1, size=2, socket_path=socket_path) as fab:
        buffers = [fab.array(f"bench-recv{i}", (capacity,), "uint8") for i in range(window)]
        posted: collections.deque[fabricd.Handle[fabricd.Completion]] = collections.deque()
        turn = 0
        for nbytes, messages in plan:
            for _ in range(messages):
                if len(posted) == window:
                    posted.popleft().wait(CALL_TIMEOUT)
                posted.append(fab.recv_async(buffers[turn % window][:nbytes], src=0))
                turn += 1
            while posted:  # the sender waits for a whole size before the next one
                posted.popleft().wait(CALL_TIMEOUT)


def fabric_echo(socket_path: str, job: str, rounds: int, nbytes: int = 0) -> None:
    """Rank 1 of ``job``: ``rounds`` times, receive an ``nbytes`` message from rank 0 and send
    it back (the same array, so the bytes that return are the bytes that came)."""
    import fabricd

    with fabricd.connect(job=job, rank=1, size=2, socket_path=socket_path) as fab:
        message = fab.array("bench-echo", (max(nbytes, 1),), "uint8")[:nbytes]
        for _ in range(rounds):
            fab.recv(message, src=0, timeout=CALL_TIMEOUT)
            fab.send(message, to=0, timeout=CALL_TIMEOUT)


#: the tag of the 0-byte message with which :func:`fabric_batch_receiver` ends each batch
BATCH_DONE_TAG = 1


def fabric_batch_receiver(socket_path: str, job: str, nbytes: int, batches: Plan) -> None:
    """Rank 1 of ``job``: for each ``(window, messages)`` batch, receive ``messages`` messages of
    ``nbytes`` from rank 0 with ``window`` receives kept posted (each into its own array), then
    tell rank 0 with a 0-byte message on :data:`BATCH_DONE_TAG` that all of them are in.

    The message rate ends each sample on that signal, so a sample lasts until the receiver has
    every byte whatever ``send`` waits for.
    """
    import collections

    import fabricd

    with fabricd.connect(job=job, rank=1, size=2, socket_path=socket_path) as fab:
        widest = max([w for w, _ in batches] + [1])
        buffers = [fab.array(f"bench-batch{i}", (max(nbytes, 1),), "uint8") for i in range(widest)]
        views = [b[:nbytes] for b in buffers]
        done = buffers[0][:0]
        posted: collections.deque[fabricd.Handle[fabricd.Completion]] = collections.deque()
        for window, messages in batches:
            for turn in range(messages):
                if len(posted) == window:
                    posted.popleft().wait(CALL_TIMEOUT)
                posted.append(fab.recv_async(views[turn % window], src=0))
            while posted:
                posted.popleft().wait(CALL_TIMEOUT)
            fab.send(done, to=0, tag=BATCH_DONE_TAG, timeout=CALL_TIMEOUT)


class _RawSink(asyncio.BufferedProtocol):
    """Reads each planned message straight into ``buffer``; acks it with one byte."""

    def __init__(self, buffer: memoryview, sizes: list[int], done: asyncio.Future[None]) -> None:
        self._buffer = buffer
        self._sizes = sizes
        self._index = 0
        self._received = 0
        self._done = done
        self._spare = memoryview(bytearray(1))
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._index >= len(self._sizes):  # all planned messages are in: only EOF is due
            return self._spare
        return self._buffer[self._received : self._sizes[self._index]]

    def buffer_updated(self, nbytes: int) -> None:
        if self._index >= len(self._sizes):
            raise RuntimeError("the raw sender sent more bytes than planned")
        self._received += nbytes
        if self._received == self._sizes[self._index]:
            self._index += 1
            self._received = 0
            assert self._transport is not None
            self._transport.write(b"\x01")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)


def raw_receiver(conn: Connection, plan: Plan) -> None:
    """Listen on 127.0.0.1, send the port through ``conn``, receive the plan's messages."""
    import uvloop

    from fabricd.shm import Segment

    sizes = [n for n, messages in plan for _ in range(messages)]
    segment = Segment.create("bench-raw-recv", max([*sizes, 1]))
    target = segment.data()
    np.frombuffer(target, dtype=np.uint8)[:] = 0  # fault the pages in, as the fabricd side's are

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        server = await loop.create_server(lambda: _RawSink(target, sizes, done), "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        try:
            async with asyncio.timeout(len(sizes) * CALL_TIMEOUT):
                await done
        finally:
            server.close()

    try:
        uvloop.run(serve())
    finally:
        target.release()
        segment.close()


def tcp_echo(conn: Connection, rounds: int, nbytes: int) -> None:
    """The raw ping-pong's far end: blocking sockets, one TCP connection on 127.0.0.1 with
    ``TCP_NODELAY``.  Sends its port through ``conn``, accepts one connection and echoes
    ``rounds`` messages of ``nbytes`` (read whole with ``recv_into``, written with ``sendall``).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(CALL_TIMEOUT)
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
    with peer:
        peer.settimeout(CALL_TIMEOUT)
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = memoryview(bytearray(max(nbytes, 1)))[:nbytes]
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                read = peer.recv_into(buffer[got:])
                if not read:
                    raise ConnectionError("the raw pinger closed early")
                got += read
            peer.sendall(buffer)


def unix_echo(path: str, rounds: int, nbytes: int) -> None:
    """Accept one Unix-socket connection at ``path``; echo ``rounds`` messages of ``nbytes``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(CALL_TIMEOUT)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(CALL_TIMEOUT)
            for _ in range(rounds):
                data = b""
                while len(data) < nbytes:
                    chunk = conn.recv(nbytes - len(data))
                    if not chunk:
                        return
                    data += chunk
                conn.sendall(data)
    with contextlib.suppress(OSError):
        os.unlink(path)


class FrameEcho:
    """A fabricd link sink that answers every HEARTBEAT frame with the same frame."""

    def __init__(self, lost: asyncio.Future[None] | None = None) -> None:
        from fabricd.wire import Kind

        self._heartbeat = Kind.HEARTBEAT
        self._lost = lost

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None

    def frame_received(self, link: Link, frame: Frame) -> None:
        if frame.kind is self._heartbeat:
            link.send_nowait(self._heartbeat, frame.meta)

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)


class RawEcho(asyncio.Protocol):
    """A raw uvloop protocol that writes back every byte it reads."""

    def __init__(self, lost: asyncio.Future[None] | None = None) -> None:
        self._lost = lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: asyncio.Transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)


def frame_echo(conn: Connection, seconds: float) -> None:
    """Serve one :class:`FrameEcho` link and one :class:`RawEcho` connection on 127.0.0.1.

    Sends ``(fabricd address, raw port)`` through ``conn`` and returns once both connections
    have closed, or after ``seconds``.
    """
    import uvloop

    async def serve() -> None:
        from fabricd.transports.tcp import TcpTransport
        from fabricd.wire import DEFAULT_LIMITS

        loop = asyncio.get_running_loop()
        frame_lost: asyncio.Future[None] = loop.create_future()
        raw_lost: asyncio.Future[None] = loop.create_future()
        links: list[Link] = []

        def on_link(link: Link) -> None:
            link.set_sink(FrameEcho(frame_lost))
            links.append(link)

        listener = await TcpTransport().listen("127.0.0.1:0", on_link, DEFAULT_LIMITS)
        server = await loop.create_server(lambda: RawEcho(raw_lost), "127.0.0.1", 0)
        conn.send((listener.address, server.sockets[0].getsockname()[1]))
        try:
            async with asyncio.timeout(seconds):
                await asyncio.gather(frame_lost, raw_lost)
        finally:
            for link in links:
                link.close("benchmark done")
            server.close()
            await listener.aclose()

    uvloop.run(serve())
