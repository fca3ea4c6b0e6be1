"""The peering service: links to the other daemons, from the first byte to the last.

Drives :mod:`fabricd.engines.link.peers`, which decides everything: when to dial and redial (with
backoff), how long a link may take to authenticate and how many may try at once, which
authenticated link is admitted, refused, or resets its peer, and when a peer is up, suspect or
down.  This module performs those decisions on real links:

* it listens and dials through the transport, runs each new link's handshake
  (:mod:`fabricd.engines.link.handshake`) under handshake limits (a few KiB, HELLO and AUTH only),
  and closes links the engine refuses or whose handshake deadline passes;
* it hands admitted links to the node (:meth:`LinkOwner.adopt_link`), which keeps the table of
  current links and routes their frames; a reset goes through :meth:`LinkOwner.reset_peer`;
* it claims HEARTBEAT and BYE and sends heartbeats when the engine says so;
* under membership from etcd it takes each node's address as it registers or leaves
  (:meth:`PeeringService.set_address`), and the name and incarnation registered in each slot
  (:meth:`PeeringService.set_holder`), from :mod:`fabricd.daemon.services.roster`: the engine
  admits only those.

Each pair of nodes shares two links, control and data; the node with the lower id dials both
(control first), the other accepts, so a pair never races to open duplicate connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import secrets
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.service import BaseService, Host
from fabricd.engines.actions import Notice, SendFrame
from fabricd.engines.link import peers
from fabricd.engines.link.gate import CloseHandshake, RefuseHandshake
from fabricd.engines.link.handshake import HANDSHAKE_LIMITS, Channel, Handshake, Role
from fabricd.engines.link.peers import PeerState, PeerTable, Timeouts
from fabricd.errors import ProtocolError, TransportError
from fabricd.frames import link as link_frames
from fabricd.integrity import FAILURE, Opener, Sealer
from fabricd.transports.base import split_address
from fabricd.wire import Kind, Meta

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from fabricd.engines.actions import Answer
    from fabricd.engines.link.handshake import PeerIdentity
    from fabricd.frames import registry
    from fabricd.transports.base import Link, Listener, Transport
    from fabricd.wire import Discard, Frame, FrameHead, Limits

log = logging.getLogger("fabricd.peering")
#: lines that peers, or whoever connects to the peer port, cause: rate-limited
remote_log = RateLimitedLog(log)
#: the one host every link of a transport without network addresses (inproc) comes from
_NO_HOST = "(in-process)"
#: seconds between two tries to resolve the names of nodes that have no address yet
RESOLVE_RETRY = 5.0


class LinkOwner(Host, Protocol):
    """The node's side of the links: the table the peering service fills and resets."""

    def adopt_link(self, node: int, channel: Channel, link: Link) -> None:
        """``link`` is now ``node``'s current ``channel`` link."""

    def reset_peer(self, node: int, reason: str) -> None:
        """Close both of ``node``'s links; every service learns the peer is down."""

    def peer_up(self, node: int) -> None:
        """Both of ``node``'s links are admitted."""

    def link(self, node: int, channel: Channel) -> Link | None:
        """``node``'s current ``channel`` link, if it has one."""

    def payload_buffer(self, node: int, link: Link, head: FrameHead) -> memoryview | Discard:
        """Where an authenticated frame's payload lands (``DISCARD``: nowhere)."""

    def frame_received(self, node: int, link: Link, frame: Frame) -> None:
        """An authenticated frame from ``node``."""

    def link_down(self, node: int, link: Link) -> None:
        """An authenticated link to ``node`` closed."""


@dataclass(slots=True, kw_only=True)
class HandshakeSettings:
    """Who this daemon is in a handshake, and the limits a link gets once it is trusted."""

    node: int
    incarnation: int
    #: this node's name, sent in every HELLO (under membership from etcd, its registered one)
    name: str = ""
    #: the shared secrets, the older first: one, or two during a rotation (``()``: one node,
    #: no peers).  Replaced by a reload (SIGHUP); links already up keep their session keys
    secrets: tuple[bytes, ...]
    fabric_size: int
    limits: Limits  #: limits once authenticated
    #: DATA payloads are sealed too (``data_integrity = "mac"``); control frames always are
    data_integrity: bool = False


class _PendingSink:
    """Runs the handshake of one link until the engine admits, refuses or expires it."""

    def __init__(self, service: PeeringService, link_id: int, handshake: Handshake) -> None:
        self.service = service
        self.link_id = link_id
        self.handshake = handshake
        self.done: asyncio.Future[PeerIdentity] = asyncio.get_running_loop().create_future()

    def start(self, link: Link) -> None:
        self._send(link, self.handshake.start())

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None  # HANDSHAKE_LIMITS allow no payload

    def frame_received(self, link: Link, frame: Frame) -> None:
        try:
            view = link_frames.parse_handshake(frame.kind, frame.meta)
            answers = self.handshake.on_frame(view)
            # The view is asked of every HELLO before it is answered: an acceptor's is not
            # proven yet; an initiator's (the acceptor's, proven by its MAC) is refused before
            # AUTH goes out, so that the acceptor sees an unfinished handshake, not a link it
            # admits and then loses (and resets its peer for, every backoff while the view lags)
            if isinstance(view, link_frames.Hello) and (why := self.service.check_view(view)):
                self._refuse(link, why, failed=False)  # the engine counted a refused link
                return
            self._send(link, answers)
        except ProtocolError as exc:
            self._refuse(link, str(exc), failed=True)
            return
        peer = self.handshake.peer
        if peer is not None:
            self.service.authenticated(self, link, peer)

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        reason = link.close_reason or "closed during handshake"
        junk = reason.startswith("protocol error")  # junk before authentication
        self.service.handshake_over(self.link_id, failed=junk)
        if self.done.done():
            return
        if junk:
            remote_log.warning(
                "refused link", "refused link from %s: %s", link.peer_address, reason
            )
        self._settle(TransportError(reason))

    def _refuse(self, link: Link, reason: str, *, failed: bool) -> None:
        """Close ``link`` before it authenticated; ``failed``: count a failed handshake."""
        remote_log.warning("refused link", "refused link from %s: %s", link.peer_address, reason)
        self.service.handshake_over(self.link_id, failed=failed)
        self.fail(link, reason)

    def fail(self, link: Link, reason: str) -> None:
        """Close the link; whoever dialled it sees a TransportError and retries later."""
        self._settle(TransportError(reason))
        link.close(reason)

    def _settle(self, exc: TransportError) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            self.done.exception()  # retrieved: an accepted link has nobody awaiting it

    def _send(self, link: Link, answers: list[Answer]) -> None:
        for answer in answers:
            link.send_nowait(answer.frame.KIND, answer.frame.to_meta())


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
    """An admitted link: everything goes to the node, which routes it to the services."""

    owner: LinkOwner
    node: int

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | Discard:
        return self.owner.payload_buffer(self.node, link, head)

    def frame_received(self, link: Link, frame: Frame) -> None:
        self.owner.frame_received(self.node, link, frame)

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        self.owner.link_down(self.node, link)


class PeeringService(BaseService):
    """Owns the listener, the dials and the handshakes; the node owns the admitted links."""

    name = "peering"
    kinds = frozenset({Kind.HEARTBEAT, Kind.BYE})

    def __init__(self, owner: LinkOwner, transport: Transport, settings: HandshakeSettings) -> None:
        cfg = owner.config
        self.owner = owner
        self.transport = transport
        self.settings = settings
        #: every node's ``host:port`` by id; "" for a node with none (a free slot under
        #: membership from etcd, filled in by :meth:`set_address`)
        self.addresses = list(cfg.nodes)
        #: a node's name for status rows (membership from etcd names them; static lists do not)
        self.name_of: Callable[[int], str] | None = None
        #: where dialled links leave from: this node's host as its peers know it
        self._source = split_address(cfg.nodes[cfg.node_id])[0] if transport.network else ""
        #: every node's addresses (node_hosts); a name that did not resolve has none yet
        self._hosts = node_hosts(cfg.nodes) if transport.network else _one_host(cfg.nodes)
        self.engine = PeerTable(
            node=cfg.node_id,
            nodes=len(cfg.nodes),
            now=owner.now(),
            timeouts=Timeouts(
                heartbeat_interval=cfg.heartbeat_interval,
                suspect_after=cfg.suspect_after,
                down_after=cfg.down_after,
            ),
            handshake_timeout=cfg.handshake_timeout,
            max_backoff=cfg.reconnect_max_backoff,
            hosts=self._hosts,
            spare_slots=cfg.handshake_spare_slots,
            absent=frozenset(n for n, address in enumerate(cfg.nodes) if not address),
            named=cfg.membership == "etcd",
        )
        self._resolving = False  #: a retry of the names that did not resolve is under way
        self._resolved_at = -RESOLVE_RETRY  #: when the last retry began
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Link, _PendingSink]] = {}  #: links in their handshake
        self._listener: Listener | None = None
        self._closed = False  #: aclose() ran: nothing new is dialled or accepted
        self._integrity_failures = 0  #: links closed for a frame that failed its MAC or number

    # -- life cycle -------------------------------------------------------------------------
    async def listen(self, address: str) -> str:
        """Start accepting links; return the bound address."""
        self._listener = await self.transport.listen(address, self._accepted, HANDSHAKE_LIMITS)
        return self._listener.address

    def start(self, now: float) -> None:
        """Begin dialling the peers this node dials."""
        self._perform(self.engine.start(now))

    async def aclose(self) -> None:
        """Stop accepting and dialling, and drop links still in their handshake.

        The loop runs on until the daemon's task group has ended: a dial falling due then, or
        a connection the listener took just before it closed, starts nothing.
        """
        self._closed = True
        if self._listener is not None:
            await self._listener.aclose()
        for link, sink in list(self._pending.values()):
            sink.fail(link, "daemon stopping")

    def set_address(self, node: int, address: str) -> None:
        """``node``'s address is now ``address`` (``""``: it has none): membership from etcd
        saw it register or leave.  A new address is resolved off the loop, then admitted and
        dialled; a node without one is dialled no more and its links are refused on arrival,
        while links it has up stay until the liveness rules take them."""
        if self._closed or self.addresses[node] == address:
            return
        self.addresses[node] = address
        if not address:
            self._hosts[node] = frozenset()
            self.engine.set_hosts(self._hosts)
            self._perform(self.engine.set_present(node, False, self.owner.now()))
            return
        self.owner.spawn(self._adopt_address(node, address))

    def set_holder(self, node: int, name: str, incarnation: int | None) -> None:
        """Membership from etcd has ``name`` (``""``: nobody) in ``node``'s slot, registered
        as ``incarnation`` (``None``: the registration does not say): only that node's links
        are admitted as ``node`` from now on, and links of another that were admitted are
        closed (:meth:`~fabricd.engines.link.peers.PeerTable.set_holder`)."""
        if self._closed:
            return
        due = self.engine.next_deadline()
        actions = self.engine.set_holder(node, name, incarnation, self.owner.now())
        self._perform(actions)
        if actions or self.engine.next_deadline() != due:  # (none while the daemon is built)
            self.owner.rearm()

    async def _adopt_address(self, node: int, address: str) -> None:
        if self.transport.network:  # getaddrinfo blocks: off the loop
            hosts = await asyncio.to_thread(node_hosts, [address])
        else:
            hosts = _one_host([address])
        if self._closed or self.addresses[node] != address:  # changed again meanwhile
            return
        self._hosts[node] = hosts[0]
        self.engine.set_hosts(self._hosts)
        self._perform(self.engine.set_present(node, True, self.owner.now()))
        self.owner.rearm()

    # -- the node's reports -----------------------------------------------------------------
    def heard(self, node: int, now: float) -> None:
        """Any authenticated frame from ``node`` arrived."""
        if actions := self.engine.on_heard(node, now):  # (none for nearly every frame)
            self._perform(actions)

    def link_lost(self, node: int, channel: Channel, link: Link, now: float) -> None:
        """``node``'s current ``channel`` link closed."""
        if (link.close_reason or "").removeprefix("protocol error: ").startswith(FAILURE):
            self._integrity_failures += 1
        actions = self.engine.on_link_closed(node, channel, now)
        said_bye = any(isinstance(a, peers.ResetPeer) and a.expected for a in actions)
        level = logging.INFO if said_bye else logging.WARNING
        remote_log.log(
            level, "link lost", "%s link to node %d lost: %s", channel, node, link.close_reason
        )
        self._perform(actions)

    def on_frame(self, node: int, frame: registry.PeerFrame, now: float) -> None:
        if isinstance(frame, link_frames.Bye):
            log.info("node %d is stopping", node)
            self.engine.on_bye(node)

    def next_deadline(self) -> float | None:
        return self.engine.next_deadline()

    def on_timer(self, now: float) -> None:
        self._perform(self.engine.on_timer(now))

    def statistics(self) -> Meta:
        rows = []
        for info in self.engine.peers(self.owner.now()):
            if not self.addresses[info.node] and info.state is PeerState.CONNECTING:
                continue  # a free slot that never held a node
            links = {ch: self.owner.link(info.node, ch) for ch in Channel}  # up iff admitted
            stats = [link.statistics() for link in links.values() if link is not None]
            rows.append(
                {
                    "node": info.node,
                    **({"name": self.name_of(info.node)} if self.name_of else {}),
                    "address": self.addresses[info.node],
                    "state": info.state.value,
                    "incarnation": info.incarnation,
                    "silent_for": info.silent_for,
                    "state_for": info.state_for,
                    "links": {ch.value: link is not None for ch, link in links.items()},
                    "bytes_sent": sum(s.bytes_sent for s in stats),
                    "bytes_received": sum(s.bytes_received for s in stats),
                }
            )
        engine = self.engine.statistics()
        refused = engine.handshakes_refused + engine.links_refused
        counters = {
            "refused_links": refused,
            "refused_unknown_hosts": engine.gate.unknown_host,
            "handshakes_evicted": engine.gate.evicted,
            "peer_resets": engine.resets,
            "integrity_failures": self._integrity_failures,
            "log_lines_left_out": remote_log.left_out,
        }
        return {
            "peers": rows,
            "counters": counters,
            "dial_failures": {str(n): k for n, k in engine.dial_attempts.items()},
        }

    # -- handshakes -------------------------------------------------------------------------
    def _accepted(self, link: Link) -> None:
        host = peer_host(link.peer_address) if self.transport.network else _NO_HOST
        if self._closed:
            link.set_sink(_RefusedSink())
            link.close("daemon stopping")
            return
        link_id = next(self._ids)
        actions = self.engine.on_handshake_started(link_id, host, self.owner.now(), accepted=True)
        if any(isinstance(a, RefuseHandshake) for a in actions):
            link.set_sink(_RefusedSink())
            self._resolve_again()
        else:
            self._begin(link, link_id, Role.ACCEPTOR)
        self._perform(actions, link=link)
        self.owner.rearm()

    def _resolve_again(self) -> None:
        """A link came from a host no node has: if a node's name did not resolve at start (a
        resolver not up yet at boot), resolve it again, at most once per RESOLVE_RETRY;
        without this, that node's links were refused until this daemon restarted."""
        now = self.owner.now()
        if self._closed or self._resolving or now < self._resolved_at + RESOLVE_RETRY:
            return
        if all(self._hosts.values()):
            return
        self._resolving, self._resolved_at = True, now
        self.owner.spawn(self._resolve())

    async def _resolve(self) -> None:
        try:  # getaddrinfo blocks: off the loop
            fresh = await asyncio.to_thread(node_hosts, self.addresses)
        except Exception as exc:  # no thread to be had: the next stranger tries again
            remote_log.warning("resolve", "cannot resolve the nodes' names again: %s", exc)
            return
        finally:
            self._resolving = False
        # only names that had no address are filled in: those that resolved keep theirs
        hosts = {n: self._hosts[n] or fresh.get(n, frozenset()) for n in self._hosts}
        for node in (n for n in hosts if hosts[n] and not self._hosts[n]):
            log.info("node %d's host now resolves: %s", node, ", ".join(sorted(hosts[node])))
        self._hosts = hosts
        self.engine.set_hosts(hosts)

    def _begin(
        self, link: Link, link_id: int, role: Role, channel: Channel | None = None, node: int = -1
    ) -> _PendingSink:
        s = self.settings
        handshake = Handshake(
            role=role,
            secret=s.secrets[-1] if s.secrets else b"",
            older_secret=s.secrets[0] if len(s.secrets) > 1 else None,
            node=s.node,
            incarnation=s.incarnation,
            nonce=secrets.token_bytes(32),
            fabric_size=s.fabric_size,
            name=s.name,
            channel=channel,
            expected_node=None if node < 0 else node,
            sealed_data=s.data_integrity,
        )
        sink = _PendingSink(self, link_id, handshake)
        self._pending[link_id] = (link, sink)
        link.set_sink(sink)
        try:
            sink.start(link)
        except TransportError:  # closed before its HELLO (its loss went to no sink): forget it
            self.handshake_over(link_id)
            raise
        return sink

    def check_view(self, hello: link_frames.Hello) -> str:
        """Why a link whose HELLO names a node (or incarnation) the view of etcd does not have
        in its slot is refused before that HELLO is answered (``""``: it is not).

        Asked on both sides: the acceptor's dialler then sees its dial fail and backs off (the
        claim is not proven yet, but refusing on it costs only the claimant, and the proven
        one is ruled on again once authenticated); the dialler refuses the acceptor's proven
        HELLO before sending AUTH, so the acceptor never admits a link that is then closed.
        The engine counts the refusal as a refused link, not a failed handshake.
        """
        return self.engine.on_hello(hello.node, hello.name, hello.incarnation)

    def handshake_over(self, link_id: int, *, failed: bool = False) -> None:
        """A link left its handshake (authenticated, refused or closed)."""
        if self._pending.pop(link_id, None) is not None:
            self.engine.on_handshake_over(link_id, failed=failed)
            self.owner.rearm()

    def authenticated(self, sink: _PendingSink, link: Link, peer: PeerIdentity) -> None:
        """``link`` proved it speaks for ``peer``: the engine rules on it."""
        self.handshake_over(sink.link_id)
        # sealed from the next frame either way (before PeerUp's greetings go out on it); a
        # refused link is closed below
        keys = sink.handshake.session_keys()
        data = self.settings.data_integrity
        link.secure(Sealer(keys.send, cover_data=data), Opener(keys.receive, require_data=data))
        now = self.owner.now()
        actions = self.engine.on_link_authenticated(
            peer.node, peer.channel, peer.incarnation, now, peer.name
        )
        admitted = any(isinstance(a, peers.AdmitLink) for a in actions)
        if not admitted:
            reason = next(
                (a.reason for a in actions if isinstance(a, peers.RefuseLink)), "link refused"
            )
            remote_log.warning(
                "refused link",
                "refused %s link from node %d: %s",
                peer.channel,
                peer.node,
                reason,
            )
            sink.fail(link, reason)
        try:
            self._perform(actions, link=link)
        except BaseException:  # the dial waiting on this link must hear of it, or never redial
            sink.fail(link, "internal error while admitting the link (see the log)")
            raise
        if admitted and sink.handshake.used_older_secret:  # how far a rotation has come
            remote_log.log(
                logging.INFO,
                "older secret",
                "%s link to node %d authenticated with this node's older secret: "
                "node %d does not hold the newer one yet",
                peer.channel,
                peer.node,
                peer.node,
            )
        if admitted and not sink.done.done():
            sink.done.set_result(peer)
        self.owner.rearm()

    # -- dialling ---------------------------------------------------------------------------
    async def _dial(self, node: int) -> None:
        """Dial ``node``'s control then data channel; report a failure to the engine."""
        try:
            control = await self._connect(node, Channel.CONTROL)
            try:
                await self._connect(node, Channel.DATA)
            except BaseException:
                control.close("data channel could not be opened")
                raise
        except TransportError as exc:
            self._perform(self.engine.on_dial_failed(node, str(exc), self.owner.now()))
            self.owner.rearm()

    async def _connect(self, node: int, channel: Channel) -> Link:
        address, timeout = self.addresses[node], self.owner.config.handshake_timeout
        if not address:  # it left between the dial and now
            raise TransportError(f"node {node} has no address (not registered)")
        try:  # the kernel would retry a SYN into a partition for minutes; redial instead
            async with asyncio.timeout(timeout):
                link = await self.transport.connect(address, HANDSHAKE_LIMITS, source=self._source)
        except TimeoutError:
            raise TransportError(
                f"cannot connect to {address}: no answer within {timeout:g}s (handshake_timeout)"
            ) from None
        link_id = next(self._ids)
        actions = self.engine.on_handshake_started(
            link_id, self.addresses[node], self.owner.now(), accepted=False
        )
        sink = self._begin(link, link_id, Role.INITIATOR, channel, node)
        self._perform(actions, link=link)
        self.owner.rearm()
        try:
            await sink.done
        except BaseException:
            sink.fail(link, "dial abandoned")
            raise
        return link

    # -- performing the engine's actions ----------------------------------------------------
    def _perform(self, actions: Iterable[peers.Action], *, link: Link | None = None) -> None:
        """Carry out ``actions``; ``link`` is the link they are about, if one is."""
        for action in actions:
            match action:
                case SendFrame(node=node, frame=frame):
                    self.owner.send(node, frame)
                case peers.Dial(node=node) if not self._closed:
                    self.owner.spawn(self._dial(node))
                case peers.DialRetry():
                    log.info(
                        "dialling node %d failed (attempt %d): %s; retrying in %.2fs",
                        action.node,
                        action.attempts,
                        action.error,
                        action.retry_in,
                    )
                case peers.AdmitLink(node=node, channel=channel):
                    assert link is not None
                    link.set_limits(self.settings.limits)
                    link.set_sink(_AuthedSink(self.owner, node))
                    self.owner.adopt_link(node, channel, link)
                case peers.RefuseLink():
                    pass  # closed by authenticated(), which knows the link
                case peers.ResetPeer(node=node, reason=reason):
                    self.owner.reset_peer(node, reason)
                case peers.PeerUp(node=node):
                    self.owner.peer_up(node)
                case RefuseHandshake(reason=reason):
                    assert link is not None
                    remote_log.warning(
                        "refused on arrival",
                        "refused link from %s on arrival: %s",
                        link.peer_address,
                        reason,
                    )
                    link.close(reason)
                case CloseHandshake(link_id=link_id, reason=reason):
                    pending = self._pending.pop(link_id, None)  # the engine freed its slot
                    if pending is not None:
                        remote_log.warning(
                            "handshake closed", "closing %s: %s", pending[0].peer_address, reason
                        )
                        pending[1].fail(pending[0], reason)
                case Notice(message=message):
                    log.warning("%s", message)
                case peers.StateChanged():
                    self._state_changed(action)
                case peers.PeerRestarted(node=node):
                    remote_log.warning(
                        "peer restarted",
                        "node %d restarted (incarnation %d -> %d)",
                        node,
                        action.old_incarnation,
                        action.new_incarnation,
                    )

    def _state_changed(self, change: peers.StateChanged) -> None:
        level = (
            logging.WARNING if change.new in (PeerState.DOWN, PeerState.SUSPECT) else logging.INFO
        )
        remote_log.log(  # a peer that reconnects at will could otherwise write at will
            level,
            "peer state",
            "node %d: %s -> %s (%s)",
            change.node,
            change.old.value,
            change.new.value,
            change.reason,
        )  # (a peer that goes down is reset by the ResetPeer that follows)


def peer_host(address: str) -> str:
    """The host of an accepted link's ``host:port``, as :func:`node_hosts` writes hosts."""
    with contextlib.suppress(ValueError):
        return canonical_host(split_address(address)[0])
    return address  # not host:port: a transport's name for the link


def canonical_host(host: str) -> str:
    """One spelling per IP address (an IPv4 address reaching an IPv6 listener as
    ``::ffff:a.b.c.d`` is that IPv4 address); a name is left as it is."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def node_hosts(nodes: Sequence[str]) -> dict[int, frozenset[str]]:
    """Every node's addresses: the IP addresses its configured host resolves to.

    Names are resolved once, when the daemon starts (a peer whose name later points elsewhere
    is admitted again after a restart); a name that does not resolve is logged, and links
    from that node are refused until it does (the peering service tries it again when a link
    from an unknown host arrives, at most once per :data:`RESOLVE_RETRY`).
    """
    hosts: dict[int, frozenset[str]] = {}
    for node, address in enumerate(nodes):
        if not address:  # a free slot (membership from etcd): no host yet
            hosts[node] = frozenset()
            continue
        host = address  # (said whole if it does not split)
        try:  # (an address from etcd is checked before, but never crash on one)
            host = split_address(address)[0]
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning(
                "node %d's host %s does not resolve (%s): its links are refused until it does",
                node,
                host,
                exc,
            )
            infos = []
        hosts[node] = frozenset(canonical_host(str(info[4][0])) for info in infos)
    return hosts


def _one_host(nodes: Sequence[str]) -> dict[int, frozenset[str]]:
    """Without network addresses every link comes from one host (:data:`_NO_HOST`)."""
    return {node: frozenset({_NO_HOST} if address else ()) for node, address in enumerate(nodes)}
