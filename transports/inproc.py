"""In-process transport for tests and the simulator: two links joined in memory.

Frames are encoded and decoded exactly as on the wire (the same :class:`Receiver` path as TCP,
including the payload-buffer callback), so a test on ``inproc`` exercises the framing and limits
too.  Optional ``latency`` (seconds) and ``bandwidth`` (bytes/s) delay delivery per link, in
order, on the event loop's clock.  Backpressure: a sender waits while more than ``window``
bytes are in flight on its link.  A link delivers at most ``FRAME_BUDGET`` frames per loop
iteration, as TCP does.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from typing import TYPE_CHECKING

from fabricd.errors import TransportError
from fabricd.transports.base import MAX_UNREAD, Buffer, Link, Listener, Transport
from fabricd.transports.framing import FRAME_BUDGET, FramedLink

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.wire import Kind, Limits


class InprocLink(FramedLink):
    """One end of an in-memory link."""

    def __init__(self, local: str, peer_address: str, limits: Limits, net: InprocTransport) -> None:
        super().__init__(peer_address, limits, local)
        self._net = net
        self.peer: InprocLink | None = None
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._timer: asyncio.Handle | None = None  #: the next delivery, timed or at once
        self._in_flight = 0
        self._writable = asyncio.Event()
        self._writable.set()
        self._last_sent = 0.0

    async def send(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        # bounded by the window, so the MAX_UNREAD guard of send_nowait does not apply: a
        # single max_payload frame is over it, and tripping it here closed the link and then
        # waited forever on the event close() had already set
        self._enqueue(kind, meta, payload)
        if self._in_flight > self._net.window:
            self._writable.clear()
            await self._writable.wait()
            if self._is_closed:
                raise TransportError(f"link to {self.peer_address} closed while sending")

    def send_now(self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()) -> bool:
        if self._in_flight > self._net.window:
            return False  # over the window: send() waits, and so must this frame
        self._enqueue(kind, meta, payload)
        return True

    def send_nowait(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        self._enqueue(kind, meta, payload)
        if self._in_flight > MAX_UNREAD:
            self.close(f"peer is not reading (over {MAX_UNREAD} B unsent)")

    def _enqueue(self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer]) -> None:
        if self._is_closed:
            raise TransportError(f"link to {self.peer_address} is closed ({self.close_reason})")
        parts = self._encode(kind, meta, payload)
        data = b"".join([*parts, self._trailer(kind, parts[1:])])
        loop = asyncio.get_running_loop()
        # frames leave one after another at the link's bandwidth, then travel for latency
        wire_time = len(data) / self._net.bandwidth if self._net.bandwidth else 0.0
        self._last_sent = max(self._last_sent, loop.time()) + wire_time
        due = self._last_sent + self._net.latency
        self._queue.append((due, data))
        self._in_flight += len(data)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        # not once closed: what is queued never goes (``_deliver`` stops at a closed link), and
        # a peer closing its end while ``_deliver`` runs leaves frames queued, which re-armed
        # a delivery that did nothing every loop iteration, for ever
        if self._timer is None and self._queue and not self._is_closed:
            self._timer = loop.call_at(self._queue[0][0], self._deliver)

    def _deliver(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        budget = FRAME_BUDGET
        while self._queue and self._queue[0][0] <= loop.time() and not self._is_closed:
            if not budget:  # a flood: the rest in the next loop iteration
                self._timer = loop.call_soon(self._deliver)
                break
            budget -= 1
            _, data = self._queue.popleft()
            self._in_flight -= len(data)
            if self.peer is not None and not self.peer.closed:
                self.peer._receive(data)
        if self._in_flight <= self._net.window // 2:
            self._writable.set()
        self._arm(loop)

    def _receive(self, data: bytes) -> None:
        self._receiver.bytes += len(data)
        try:
            self._receiver.decoder.feed(data)
        except Exception as exc:
            self.close(f"protocol error: {exc}")
            return
        reason = self._receiver.process()
        if reason is not None:
            self.close(reason)

    def close(self, reason: str) -> None:
        if self._is_closed:
            return
        self.close_reason = reason
        if self._timer is not None:
            self._timer.cancel()
        self._writable.set()
        self._lost(None)
        if self.peer is not None:
            self.peer._lost_peer()

    def _lost_peer(self) -> None:
        if not self._is_closed:
            self.close_reason = "closed by peer"  # as TCP reports an orderly close: exc None
            self._writable.set()
            self._lost(None)


class InprocListener(Listener):
    """A name in an :class:`InprocTransport`'s registry."""

    def __init__(self, net: InprocTransport, address: str) -> None:
        self._net = net
        self._address = address

    @property
    def address(self) -> str:
        return self._address

    async def aclose(self) -> None:
        self._net.listeners.pop(self._address, None)


class InprocTransport(Transport):
    """A private in-memory network; addresses are arbitrary names.

    Args:
        latency: one-way delay of every frame, in seconds.
        bandwidth: bytes per second per link direction (0: unlimited).
        window: bytes in flight per link direction before ``send`` waits.
    """

    name = "inproc"
    network = False  #: peer addresses are names: no host to check

    def __init__(
        self, *, latency: float = 0.0, bandwidth: float = 0.0, window: int = 8 << 20
    ) -> None:
        self.latency = latency
        self.bandwidth = bandwidth
        self.window = window
        self.listeners: dict[str, tuple[Callable[[Link], None], Limits]] = {}
        self._ports = itertools.count(1)

    async def listen(
        self, address: str, on_link: Callable[[Link], None], limits: Limits
    ) -> InprocListener:
        if address in self.listeners:
            raise TransportError(f"cannot listen on {address}: address in use")
        self.listeners[address] = (on_link, limits)
        return InprocListener(self, address)

    async def connect(self, address: str, limits: Limits, *, source: str = "") -> InprocLink:
        try:
            on_link, server_limits = self.listeners[address]
        except KeyError:
            raise TransportError(f"cannot connect to {address}: nobody listens") from None
        local = f"inproc-client-{next(self._ports)}"
        client = InprocLink(local, address, limits, self)
        server = InprocLink(address, local, server_limits, self)
        client.peer, server.peer = server, client
        on_link(server)
        await asyncio.sleep(0)  # like a real connect, let the accepting side run first
        return client
