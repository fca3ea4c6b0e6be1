"""The transport contract: byte movers between daemons that know frames, never engines.

A :class:`Transport` listens and connects; each connection is a :class:`Link`, one reliable,
ordered stream of frames (:mod:`fabricd.wire`) to one peer.  The daemon opens two links per
peer pair, a control channel and a bulk data channel (ASAP §5), and tells them apart in its
handshake; the transport does not care which is which.

Receiving is push-based, through a :class:`FrameSink` the upper layer installs:

1. ``payload_buffer(link, head)`` is called once a frame's header and metadata have arrived and
   *before* any payload byte is read.  Returning a writable view of exactly ``head.payload_len``
   bytes makes the payload land there in place (the TCP transport lets the kernel write into it
   directly); returning ``None`` makes the link allocate a buffer of its own; returning
   :data:`~fabricd.wire.DISCARD` makes it read the payload through its small read buffer and
   drop it, allocating nothing (``frame_received`` then gets an empty payload).
2. ``frame_received(link, frame)`` is called with the whole frame.
3. ``link_lost(link, exc)`` is called exactly once when the link closes for any reason.

A link delivers at most ``FRAME_BUDGET`` frames (transports/framing.py) before the event loop
goes round once, reading nothing meanwhile: a flood of small frames cannot hold the loop, and
none is lost or reordered by the pause.

Failure semantics, the same on every transport:

* A frame that breaks the wire rules, or a sink that raises a ``ProtocolError``, closes the link
  with a logged reason; other links are untouched.
* :meth:`Link.send` hands the whole frame to the transport or raises ``TransportError``; it
  returns once the frame is queued and the queue is under the link's high-water mark
  (backpressure).  A transport may reference queued payload buffers instead of copying them
  (TCP does; inproc copies): the caller must keep them unchanged until the peer has
  acknowledged the data at a higher level.  A
  cancelled ``send`` may or may not have queued its frame.
* One writer at a time per frame: a frame's header and payload are queued together, so frames of
  concurrent senders never interleave.
* Frames leave in the order they were queued, whichever of ``send``, ``send_now`` and
  ``send_nowait`` queued them.  While a read callback runs, a transport may hold the frames
  after the first until it returns and write them together (transports/batch.py); outside one
  a frame is handed to the kernel at once.
* After ``close``, sends raise ``TransportError``; frames already queued may still go out, for
  a short grace period at most: a peer that stopped reading cannot keep a closed link (and its
  queued bytes) alive, so ``link_lost`` always follows ``close``.

Posted regions, one frame and one hop (transports/posted.py has the rules in full):

* The receiving side calls :meth:`Link.post` with a :class:`~fabricd.transports.posted.PostKey`
  ``(epoch, slot)``, a writable region, its dtype and an ``on_landed`` callback, and tells the
  peer the key by some message of its own.  The peer calls :meth:`Link.write` with the key, a
  byte offset, the payload and a sequence number: one WRITE frame, no RTS, no CTS.
* The receiving link checks key, bounds and element alignment from the frame's header, before
  any payload byte is read: a refused write is logged, counted (``writes_refused``) and
  dropped unallocated, and never lands anywhere; the link stays open.  An accepted one lands
  straight in the region (in place, as a payload buffer does) and ``on_landed`` gets
  ``(key, offset, nbytes, seq)`` once it is whole and, on a sealed link, authenticated.
  WRITE frames never reach the sink.
* :meth:`Link.retire` withdraws a key (no byte lands after it returns, even of a write arriving
  right then); :meth:`Link.fence` withdraws every key of older epochs, so a write meant for an
  old incarnation never lands.  A lost link drops all its posts, reporting nothing.
* Posts are per link (a verbs memory region is per protection domain; the rkey handed to one
  peer plays the role of the key here).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.frames.p2p import Write
from fabricd.wire import Kind

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.integrity import Opener, Sealer
    from fabricd.transports.posted import PostKey, WriteLanded
    from fabricd.transports.tcpinfo import PathInfo
    from fabricd.wire import Discard, Frame, FrameHead, Limits

Buffer = bytes | bytearray | memoryview

#: bytes a peer may leave unread on a link before ``send_nowait`` gives up on it (F10)
MAX_UNREAD: Final = 64 * 1024 * 1024


class FrameSink(Protocol):
    """What a link delivers received frames to (see the module docstring)."""

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | Discard | None:
        """Return where ``head``'s payload should land, ``None`` for a fresh buffer, or
        ``DISCARD`` to drop it unallocated."""

    def frame_received(self, link: Link, frame: Frame) -> None:
        """Take a whole frame."""

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        """The link closed; ``exc`` says why (``None``: closed on purpose)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStatistics:
    """Counters of one link, for status output and metrics."""

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    writes_landed: int = 0  #: WRITE frames placed in a posted region and reported
    writes_refused: int = 0  #: WRITE frames refused (unknown, retired, fenced, out of bounds)


class Link(abc.ABC):
    """One ordered, reliable stream of frames to one peer."""

    def __init__(self, peer_address: str) -> None:
        self.peer_address = peer_address
        self.close_reason: str | None = None

    @abc.abstractmethod
    def set_sink(self, sink: FrameSink) -> None:
        """Deliver received frames to ``sink`` from now on."""

    @abc.abstractmethod
    def set_limits(self, limits: Limits) -> None:
        """Apply new decoder limits to frames not yet started (e.g. once authenticated)."""

    @abc.abstractmethod
    def secure(self, sealer: Sealer, opener: Opener) -> None:
        """Seal every frame sent from now on with ``sealer``, and check every frame received
        from now on with ``opener`` (once authenticated: fabricd/integrity.py).

        Frames that fail the check close the link like any other protocol error.
        """

    @abc.abstractmethod
    async def send(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        """Queue one frame whose payload is the concatenation of ``payload``.

        Raises:
            TransportError: the link is closed; reconnect.
            LocalProtocolError: the frame exceeds this link's limits (``set_limits``); both
                ends of a link are configured alike, so the peer would refuse it too.
        """

    @abc.abstractmethod
    def send_nowait(
        self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()
    ) -> None:
        """Queue one small frame without waiting for backpressure (control frames).

        A peer that stops reading cannot make this grow without bound: past
        ``MAX_UNREAD`` queued bytes the link is closed with a logged reason.

        Raises:
            TransportError: the link is closed; reconnect.
        """

    def send_now(self, kind: Kind, meta: dict[str, object], payload: Sequence[Buffer] = ()) -> bool:
        """Queue one frame at once if that needs no wait, and say whether it did.

        ``True``: the frame is queued, as :meth:`send` would have queued it (no sender is
        waiting out backpressure, so the frame goes behind nothing that waits).  ``False``:
        nothing was queued; :meth:`send` it.  A small message then leaves in the same loop
        iteration that decided to send it, without a task.  This default never sends now.

        Raises:
            TransportError: the link is closed; reconnect.
            LocalProtocolError: the frame exceeds this link's limits.
        """
        return False

    @abc.abstractmethod
    def post(
        self,
        key: PostKey,
        region: memoryview,
        *,
        dtype: str = "uint8",
        on_landed: Callable[[WriteLanded], None],
    ) -> None:
        """Accept WRITE frames from the peer into ``region`` under ``key`` until retired.

        ``on_landed`` is called, from the link's receive path, once per write that is wholly
        in place.  The caller keeps ``region`` alive and its size unchanged until it retires
        the key or the link is lost.

        Raises:
            ValueError: ``key`` is posted, was retired or is fenced; ``dtype`` is unknown;
                ``region`` is read-only, not C-contiguous or not whole elements.
        """

    @abc.abstractmethod
    def retire(self, key: PostKey) -> None:
        """Stop accepting writes under ``key``: once this returns no byte lands in its region,
        not even the rest of a write that is arriving now (its completion is never reported).
        A key not posted is ignored."""

    @abc.abstractmethod
    def fence(self, epoch: int) -> None:
        """Retire every key of an epoch below ``epoch`` and refuse to post below it again (the
        poster's incarnation changed: nothing a writer cached from before may land)."""

    async def write(self, key: PostKey, offset: int, payload: Sequence[Buffer], seq: int) -> None:
        """Write ``payload`` (its parts concatenated) at byte ``offset`` of the region the peer
        posted as ``key``: one WRITE frame, sent like :meth:`send` (same backpressure, same
        rule on keeping the payload buffers unchanged).  ``seq`` comes back to the peer in
        its completion.  Nothing comes back here: a refused write is logged and counted on
        the receiving side; the protocol above decides what a missing completion means.

        Raises:
            TransportError: the link is closed.
            LocalProtocolError: the payload exceeds the link's ``max_payload``.
            ValueError: ``offset`` or ``seq`` is negative or too large for the wire.
        """
        if not 0 <= offset < 2**63 or not 0 <= seq < 2**63:
            raise ValueError(f"offset {offset} and seq {seq} must be in [0, 2**63)")
        meta = Write(epoch=key.epoch, slot=key.slot, off=offset, seq=seq).to_meta()
        await self.send(Kind.WRITE, meta, payload)

    @abc.abstractmethod
    def close(self, reason: str) -> None:
        """Close the link; ``reason`` is logged and kept in :attr:`close_reason`."""

    @abc.abstractmethod
    async def wait_closed(self) -> None:
        """Return once the link is fully closed and ``link_lost`` was delivered."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` was called or the connection was lost."""

    @property
    @abc.abstractmethod
    def local_address(self) -> str:
        """This side's address of the link, as ``host:port`` or a name."""

    @abc.abstractmethod
    def statistics(self) -> LinkStatistics:
        """Counters since the link opened."""

    def unsent(self) -> int | None:
        """Bytes of queued frames this link still holds, payload views included (``0``: the
        kernel, or the peer, has every byte queued so far, and the link keeps no view of a
        caller's buffer); ``None``: this transport cannot tell."""
        return None

    def path_info(self) -> PathInfo | None:
        """What the kernel knows of this link's path now (round-trip time, delivery rate, bytes
        acknowledged: :mod:`fabricd.transports.tcpinfo`); ``None``: this transport, platform or
        kernel cannot tell.  The network monitor reads it every ``monitor_interval``."""
        return None


class Listener(abc.ABC):
    """An open listening endpoint."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The bound address, as ``host:port`` (the real port when 0 was asked for)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop accepting; links already accepted stay open."""


class Transport(abc.ABC):
    """Opens links.  ``limits`` are the decoder limits a new link starts with."""

    name: str
    #: whether an accepted link's ``peer_address`` is the network ``host:port`` it came from
    #: (the peering service admits only configured nodes' hosts); in-process links carry a
    #: name instead, and every peer shares one process
    network: bool = True

    @abc.abstractmethod
    async def listen(
        self, address: str, on_link: Callable[[Link], None], limits: Limits
    ) -> Listener:
        """Accept links at ``address``; ``on_link`` must install a sink before returning.

        Raises:
            TransportError: the address cannot be bound.
        """

    @abc.abstractmethod
    async def connect(self, address: str, limits: Limits, *, source: str = "") -> Link:
        """Open a link to ``address``.  Install a sink on it before awaiting anything else.

        ``source``: the host the link should leave from (this node's configured address, which
        is what the peer admits links from); a transport without addresses ignores it.

        Raises:
            TransportError: nobody accepts there (the caller retries with backoff).
        """


def split_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``) into its parts.

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_address(host: str, port: int) -> str:
    """The inverse of :func:`split_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
