"""TCP transport: asyncio (uvloop in the daemon), zero-copy on both paths where Python allows.

Receive: a ``BufferedProtocol`` whose ``get_buffer`` returns the rest of the current payload's
destination when one is being filled, so the kernel copies socket bytes straight into the
caller's buffer (a shared-memory segment, for instance).  Headers and metadata go through a
64 KiB scratch buffer; payload bytes that arrive in the same read as a header are copied once
from there (at most 64 KiB per frame).

Send: the header and the payload views go to ``transport.writelines``; uvloop hands the views to
``writev`` and keeps a reference to what the kernel did not take yet, so the payload is copied
only by the kernel.  (Stock asyncio on 3.11 joins the buffers first, one extra copy; that is one
reason the daemon runs on uvloop.)

Both channels set ``TCP_NODELAY``: control frames are latency-bound, and the last partial
segment of a bulk transfer should not wait for a delayed ACK either.

The first small frame a read callback queues on a link leaves at once (a lone frame waits for
nothing); the ones after it are held (transports/batch.py) and leave in one ``writelines`` when
the callback returns, so the frames that one read answers take two ``writev`` calls, not one
each.  A link
delivers :data:`~fabricd.transports.framing.FRAME_BUDGET` frames, however many reads they took,
then stops reading (the rest waits in the kernel, not here) until the loop has gone round once,
so a flood of small frames cannot hold the loop (libuv reads a readable socket up to 32 times
in one iteration, so a budget per read would not bound it).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import TYPE_CHECKING, Any, cast

from fabricd.errors import TransportError
from fabricd.transports import batch, tcpinfo
from fabricd.transports.base import (
    MAX_UNREAD,
    Buffer,
    Link,
    Listener,
    Transport,
    join_address,
    split_address,
)
from fabricd.transports.framing import FRAME_BUDGET, FramedLink
from fabricd.wire import HEADER_SIZE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.wire import Kind, Limits

_SCRATCH = 64 * 1024
#: payload tails shorter than this are read through the scratch buffer, saving a syscall
_DIRECT_MIN = 4096
#: write-buffer marks: enough to keep a 10 Gb/s pipe busy between event-loop turns
_HIGH_WATER = 8 * 1024 * 1024
_LOW_WATER = 2 * 1024 * 1024
#: seconds a closed link may spend flushing what is queued before it is aborted
CLOSE_GRACE = 1.0
#: a frame this large (header, metadata and payload) goes out before its trailer is computed
_SPLIT_SEAL = 64 * 1024
#: bytes of small frames a link holds in one read callback before it writes them anyway
_HOLD_MAX = 256 * 1024


class TcpLink(FramedLink, asyncio.BufferedProtocol):
    """One TCP connection carrying frames."""

    def __init__(
        self, peer_address: str, limits: Limits, on_link: Callable[[Link], None] | None = None
    ) -> None:
        super().__init__(peer_address, limits)
        self._on_link = on_link  #: accepted links: the listener's callback, once connected
        self._scratch = _scratch_for(limits)
        self._reading_direct = False
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._send_lock = asyncio.Lock()
        self._abort_timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        #: whether small frames are held now: this read callback already wrote one
        self._holding = False
        #: small frames queued in this read callback after its first, in wire order, and size
        self._held: list[Buffer] = []
        self._held_bytes = 0
        self._budget = FRAME_BUDGET  #: frames it may deliver before the loop goes round
        self._budget_paused = False  #: reading stopped until the budget is renewed
        self._sock: Any = None  #: the transport's socket view, for TCP_INFO (path_info)

    # -- asyncio protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._sock = sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local = join_address(*sock.getsockname()[:2])
            if not self.peer_address:  # accepted: name the link after the remote end
                self.peer_address = join_address(*sock.getpeername()[:2])
        self._transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        if self._on_link is not None:  # now the link knows its peer's address (and may close)
            self._on_link(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._receiver.decoder.payload_target()
        self._reading_direct = target is not None and len(target) >= _DIRECT_MIN
        return target if target is not None and self._reading_direct else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        decoder = self._receiver.decoder
        self._receiver.bytes += nbytes
        if self._reading_direct:
            decoder.payload_written(nbytes)
        else:
            try:
                decoder.feed(self._scratch[:nbytes])
            except Exception as exc:
                self.close(f"protocol error: {exc}")
                return
        self._deliver()

    def _deliver(self) -> None:
        """Deliver what the decoder holds, within the budget, holding the writes it makes.

        A spent budget stops reading and renews itself in the next loop iteration.
        """
        batch.hold()
        try:
            receiver = self._receiver
            reason = receiver.process(self._budget)
            if reason is not None:
                self.close(reason)
                return
            self._budget -= receiver.delivered
            transport = self._transport
            if self._budget or self._is_closed or transport is None:
                return
            if not self._budget_paused:
                self._budget_paused = True
                transport.pause_reading()
            self._loop.call_soon(self._renew_budget)
        finally:
            batch.release()

    def _renew_budget(self) -> None:
        """The loop went round: deliver what is buffered, and read again once it is all out."""
        self._budget = FRAME_BUDGET
        self._deliver()
        transport = self._transport
        if self._budget and self._budget_paused and not self._is_closed and transport is not None:
            self._budget_paused = False
            transport.resume_reading()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._is_closed = True
        self._held.clear()  # the connection is gone: nowhere to write them
        self._held_bytes = 0
        self._writable.set()
        if self.close_reason is None:
            self.close_reason = f"connection lost: {exc}" if exc else "closed by peer"
        self._lost(exc)

    # -- Link -------------------------------------------------------------------------------
    def set_limits(self, limits: Limits) -> None:
        super().set_limits(limits)
        self._scratch = _scratch_for(limits)  # safe: the decoder copied what it was fed

    async def send(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        # One sender at a time queues and waits out the backpressure, so concurrent streams
        # on one link leave at most the high-water mark plus one frame queued; without the
        # lock every waiter woken by resume_writing queued a chunk at once, and enough of them
        # crossed MAX_UNREAD and dropped a healthy link.  Bulk sends are bounded by this
        # backpressure, so the MAX_UNREAD guard (for send_nowait) does not apply to them.
        async with self._send_lock:
            self._queue(kind, meta, payload)
            if not self._writable.is_set():
                await self._writable.wait()
                if self._is_closed:
                    raise TransportError(f"link to {self.peer_address} closed while sending")

    def send_now(self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()) -> bool:
        if self._send_lock.locked() or not self._writable.is_set():
            return False  # a sender waits out backpressure: queue behind it, with send()
        self._queue(kind, meta, payload)
        return True

    def send_nowait(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        transport = self._queue(kind, meta, payload)
        if transport.get_write_buffer_size() > MAX_UNREAD:
            self.close(f"peer is not reading (over {MAX_UNREAD} B unsent)")
            transport.abort()  # close() would flush into the peer that does not read, forever

    def _queue(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer]
    ) -> asyncio.Transport:
        transport = self._transport
        if self._is_closed or transport is None or transport.is_closing():
            raise TransportError(f"link to {self.peer_address} is closed ({self.close_reason})")
        sent = self._bytes_sent
        parts = self._encode(kind, meta, payload)
        # A large frame leaves before its trailer is computed, which is safe because the trailer
        # never reads memory a client may still write: an EAGER's payload is the daemon's own
        # copy, a bulk payload the MAC covers was joined into one copy by _encode, and a bulk
        # payload it does not cover is not hashed at all (the MAC is over the head alone).
        if self._bytes_sent - sent < _SPLIT_SEAL:  # (what _encode counted: head and payload)
            trailer = self._trailer(kind, parts[1:])  # now: trailers are chained in wire order
            if trailer:
                parts.append(trailer)
            if self._holding:  # not the first frame of this read callback: hold it
                self._held += parts
                self._held_bytes += self._bytes_sent - sent
                if self._held_bytes > _HOLD_MAX:
                    self._flush_held()
            else:  # the first (or outside a read callback, the only) one leaves at once
                self._holding = batch.defer(self._flush_held)
                transport.writelines(parts)  # one write
        else:  # the kernel takes what it can of the payload while the daemon hashes it
            self._flush_held()  # what was queued first goes first
            transport.writelines(parts)
            transport.write(self._trailer(kind, parts[1:]))
        return transport

    def unsent(self) -> int | None:
        transport = self._transport
        buffered = transport.get_write_buffer_size() if transport is not None else 0
        return buffered + self._held_bytes

    def path_info(self) -> tcpinfo.PathInfo | None:
        if self._is_closed:
            return None
        return tcpinfo.read(self._sock)

    def _flush_held(self) -> None:
        """Write the frames held in this read callback, in order, as one ``writelines``."""
        self._holding = False
        held = self._held
        if not held:
            return
        self._held, self._held_bytes = [], 0
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.writelines(held)

    def close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        transport = self._transport
        if transport is not None and not transport.is_closing():
            self._flush_held()  # queued before the close: they may still go out
            transport.close()
            if transport.get_write_buffer_size():  # a stalled peer would hold the flush forever
                loop = asyncio.get_running_loop()
                self._abort_timer = loop.call_later(CLOSE_GRACE, transport.abort)
        self._is_closed = True


def _scratch_for(limits: Limits) -> memoryview:
    """A read buffer no larger than the limits need: an unauthenticated link gets 4 KiB."""
    return memoryview(bytearray(min(_SCRATCH, max(4096, HEADER_SIZE + limits.max_meta))))


class TcpListener(Listener):
    """A bound TCP server."""

    def __init__(self, server: asyncio.Server) -> None:
        self._server = server
        self._address = join_address(*server.sockets[0].getsockname()[:2])

    @property
    def address(self) -> str:
        return self._address

    async def aclose(self) -> None:
        # No wait_closed(): from Python 3.12.1 it also waits for every accepted connection,
        # and links outlive their listener by design.  close() stops accepting at once.
        self._server.close()


class TcpTransport(Transport):
    """Links over TCP; addresses are ``host:port``."""

    name = "tcp"

    async def listen(
        self, address: str, on_link: Callable[[Link], None], limits: Limits
    ) -> TcpListener:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()

        def accepted() -> TcpLink:
            return TcpLink("", limits, on_link)

        try:
            server = await loop.create_server(accepted, host, port, reuse_address=True)
        except OSError as exc:
            raise TransportError(f"cannot listen on {address}: {exc.strerror}") from exc
        return TcpListener(server)

    async def connect(self, address: str, limits: Limits, *, source: str = "") -> TcpLink:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        # from the configured address, not whichever one the kernel would pick: peers admit
        # links only from configured hosts, and a multi-homed node would otherwise be refused
        local = (source, 0) if source else None
        try:
            _, link = await loop.create_connection(
                lambda: TcpLink(address, limits), host, port, local_addr=local
            )
        except ValueError as exc:  # a host name that cannot be looked up at all: the IDNA
            # codec's UnicodeError (an empty or 64-character label), a NUL in it; one bad
            # address in nodes or etcd must fail its dial, not the caller (which expects this)
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        except OSError as exc:
            why = exc.strerror or exc
            if local is not None and exc.errno == errno.EADDRNOTAVAIL:
                why = f"{why} (is {source}, this node's address in nodes, one of its own?)"
            raise TransportError(f"cannot connect to {address}: {why}") from exc
        return link
