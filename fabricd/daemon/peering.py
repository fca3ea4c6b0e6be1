"""Links to the other daemons: dialling, accepting, authenticating, and redialling.

Each pair of nodes shares two links, control and data; the node with the lower id dials both
(control first), the other accepts, so a pair never races to open duplicate connections.  A new
link sees only handshake frames under :data:`HANDSHAKE_LIMITS` until the handshake engine
(:mod:`fabricd.engines.handshake`) accepts it, and is closed if that takes longer than
``handshake_timeout``: an unauthenticated peer gets a few KiB and a few seconds.  Dialling
retries with exponential backoff up to ``reconnect_max_backoff``.

What an authenticated link carries is the daemon's business: this module hands it over
through :class:`PeerEvents` and keeps only the (node, channel) -> link table.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fabricd.engines.handshake import (
    HANDSHAKE_LIMITS,
    Channel,
    Handshake,
    Outgoing,
    PeerIdentity,
    Role,
)
from fabricd.errors import ProtocolError, TransportError

if TYPE_CHECKING:
    from fabricd.transports.base import Link, Listener, Transport
    from fabricd.wire import Frame, FrameHead, Limits

log = logging.getLogger("fabricd.peering")

#: accepted links allowed in their handshake at once; each may hold a few KiB for a few seconds
MAX_PENDING_HANDSHAKES = 256
#: of those, from any one host (peers are other hosts, so a flood from one cannot lock them out)
MAX_PENDING_PER_HOST = 16


class PeerEvents(Protocol):
    """What the daemon does with authenticated links."""

    def link_up(self, link: Link, peer: PeerIdentity) -> bool:
        """An authenticated link; return False to refuse it (a stale incarnation)."""

    def payload_buffer(self, node: int, link: Link, head: FrameHead) -> memoryview | None:
        """Where the payload of a frame from ``node`` should land."""

    def frame_received(self, node: int, link: Link, frame: Frame) -> None:
        """An authenticated frame from ``node``."""

    def link_down(self, node: int, link: Link) -> None:
        """An authenticated link to ``node`` closed."""


@dataclass(slots=True, kw_only=True)
class HandshakeSettings:
    node: int
    incarnation: int
    secret: bytes
    fabric_size: int
    timeout: float
    limits: Limits  #: limits once authenticated


class _PendingSink:
    """Runs the handshake of one link, then hands the link to an :class:`_AuthedSink`."""

    def __init__(self, peering: Peering, link: Link, handshake: Handshake) -> None:
        self.peering = peering
        self.handshake = handshake
        self.done: asyncio.Future[PeerIdentity] = asyncio.get_running_loop().create_future()
        self._timer = asyncio.get_running_loop().call_later(
            peering.settings.timeout, self._expire, link
        )

    def start(self, link: Link) -> None:
        self._send(link, self.handshake.start())

    def stop_timer(self) -> None:
        self._timer.cancel()

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None  # HANDSHAKE_LIMITS allow no payload

    def frame_received(self, link: Link, frame: Frame) -> None:
        try:
            self._send(link, self.handshake.on_frame(frame.kind, frame.meta))
        except ProtocolError as exc:
            log.warning("refused link from %s: %s", link.peer_address, exc)
            self.peering.refused += 1
            self._fail(link, exc)
            return
        peer = self.handshake.peer
        if peer is not None:
            self._timer.cancel()
            if self.peering.adopt(link, peer) and not self.done.done():
                self.done.set_result(peer)
            elif not self.done.done():
                self.done.set_exception(TransportError(f"link refused: {link.close_reason}"))

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        self._timer.cancel()
        if self.done.done():
            return
        reason = link.close_reason or "closed during handshake"
        if reason.startswith("protocol error"):  # junk before authentication
            log.warning("refused link from %s: %s", link.peer_address, reason)
            self.peering.refused += 1
        self.done.set_exception(TransportError(reason))
        self.done.exception()  # retrieved: an accepted link has nobody awaiting it

    def _send(self, link: Link, frames: list[Outgoing]) -> None:
        for out in frames:
            link.send_nowait(out.kind, out.meta)

    def _expire(self, link: Link) -> None:
        log.warning(
            "closing %s: no handshake within %.1fs",
            link.peer_address,
            self.peering.settings.timeout,
        )
        self.peering.refused += 1
        self._fail(link, TransportError("handshake timeout"))

    def _fail(self, link: Link, exc: Exception) -> None:
        """Close the link; whoever dialled it sees a TransportError and retries later."""
        if not self.done.done():
            failure = exc if isinstance(exc, TransportError) else TransportError(str(exc))
            self.done.set_exception(failure)
        self.done.exception()  # retrieved: an accepted link has nobody awaiting it
        link.close(str(exc))


class _RefusedSink:
    """For a link refused on arrival: nothing it sends is looked at."""

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None

    def frame_received(self, link: Link, frame: Frame) -> None:
        pass

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        pass


@dataclass(slots=True)
class _AuthedSink:
    peering: Peering
    node: int

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return self.peering.events.payload_buffer(self.node, link, head)

    def frame_received(self, link: Link, frame: Frame) -> None:
        self.peering.events.frame_received(self.node, link, frame)

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        self.peering.events.link_down(self.node, link)


@dataclass(slots=True)
class _Dialler:
    backoff: float = 0.05
    attempts: int = 0
    last_error: str = ""


async def _first_closed(*links: Link) -> None:
    waiters = [asyncio.ensure_future(link.wait_closed()) for link in links]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Peering:
    """Owns every link to other daemons."""

    def __init__(
        self,
        transport: Transport,
        events: PeerEvents,
        settings: HandshakeSettings,
        addresses: tuple[str, ...],
        max_backoff: float,
    ) -> None:
        self.transport = transport
        self.events = events
        self.settings = settings
        self.addresses = addresses
        self.max_backoff = max_backoff
        self.refused = 0
        self._pending: dict[Link, str] = {}  #: accepted links in their handshake -> their host
        self._flooded: set[str] = set()  #: hosts whose refusal was logged
        self._listener: Listener | None = None
        self._diallers = {n: _Dialler() for n in range(settings.node + 1, len(addresses))}

    async def listen(self, address: str) -> str:
        """Start accepting links; return the bound address."""
        self._listener = await self.transport.listen(address, self._accepted, HANDSHAKE_LIMITS)
        return self._listener.address

    @property
    def pending(self) -> int:
        """Accepted links still in their handshake."""
        return len(self._pending)

    def _accepted(self, link: Link) -> None:
        host = link.peer_address.rpartition(":")[0] or link.peer_address
        from_host = sum(1 for other in self._pending.values() if other == host)
        if from_host >= MAX_PENDING_PER_HOST or self.pending >= MAX_PENDING_HANDSHAKES:
            # a flood of idle connections: refuse the newest; one host cannot starve the others
            link.set_sink(_RefusedSink())
            link.close("too many unauthenticated links")
            self.refused += 1
            if host not in self._flooded:
                log.warning(
                    "refusing links from %s: %d handshakes pending from it, %d in all",
                    host,
                    from_host,
                    self.pending,
                )
                self._flooded.add(host)
            return
        self._flooded.discard(host)
        self._pending[link] = host
        sink = _PendingSink(self, link, self._handshake(Role.ACCEPTOR))
        sink.done.add_done_callback(lambda done: self._handshake_over(link, done))
        link.set_sink(sink)
        sink.start(link)

    def _handshake_over(self, link: Link, done: asyncio.Future[PeerIdentity]) -> None:
        self._pending.pop(link, None)
        if not done.cancelled():
            done.exception()  # retrieved: a refused accepted link has nobody awaiting it

    def _handshake(
        self, role: Role, channel: Channel | None = None, node: int | None = None
    ) -> Handshake:
        s = self.settings
        return Handshake(
            role=role,
            secret=s.secret,
            node=s.node,
            incarnation=s.incarnation,
            nonce=secrets.token_bytes(32),
            fabric_size=s.fabric_size,
            channel=channel,
            expected_node=node,
        )

    def adopt(self, link: Link, peer: PeerIdentity) -> bool:
        """Switch an authenticated link to full limits and give it to the daemon."""
        if not self.events.link_up(link, peer):
            return False
        link.set_limits(self.settings.limits)
        link.set_sink(_AuthedSink(self, peer.node))
        return True

    async def keep_dialled(self, node: int) -> None:
        """Forever: dial ``node``'s control then data channel; when either drops, redial both.

        Dialling the control channel first means the peer knows this incarnation before a data
        link of it arrives.
        """
        state = self._diallers[node]
        while True:
            try:
                control = await self._dial(node, Channel.CONTROL)
                try:
                    data = await self._dial(node, Channel.DATA)
                except BaseException:
                    control.close("data channel could not be opened")
                    raise
            except TransportError as exc:
                state.attempts += 1
                state.last_error = str(exc)
                if state.attempts in (1, 10) or state.attempts % 100 == 0:
                    log.info("dialling node %d failed: %s; retrying", node, exc)
                await asyncio.sleep(state.backoff)
                state.backoff = min(state.backoff * 2, self.max_backoff)
                continue
            state.backoff, state.attempts = 0.05, 0
            await _first_closed(control, data)
            control.close("its data channel closed")
            data.close("its control channel closed")
            await asyncio.sleep(0.05)

    async def _dial(self, node: int, channel: Channel) -> Link:
        link = await self.transport.connect(self.addresses[node], HANDSHAKE_LIMITS)
        sink = _PendingSink(self, link, self._handshake(Role.INITIATOR, channel, node))
        link.set_sink(sink)
        try:
            sink.start(link)
            await sink.done
        except BaseException:
            sink.stop_timer()
            link.close("dial abandoned")
            raise
        return link

    def dial_targets(self) -> list[int]:
        """The nodes this daemon dials (every node with a higher id)."""
        return sorted(self._diallers)

    async def aclose(self) -> None:
        """Stop accepting and drop links still in their handshake."""
        if self._listener is not None:
            await self._listener.aclose()
        for link in list(self._pending):
            link.close("daemon stopping")
