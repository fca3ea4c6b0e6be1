"""The daemon of one node: links, client sessions, routing to services, and the one timer.

This is the I/O shell: it decides nothing about any protocol.  Every engine is driven by a
*service* (:mod:`fabricd.daemon.service`) that claims the peer frame kinds and client request
ops it handles; the node routes each authenticated frame, each client request and each timer
tick to the one service that claimed it, and arms one ``call_at`` timer at the earliest of the
services' deadlines.  What the node itself owns:

* **links** — the current control and data link of every peer, by (node, channel); the
  peering service decides which links are admitted and when a peer is reset, the node keeps
  the table, fences frames from links that are no longer current and closes links on a reset;
* **sessions** — one :class:`~fabricd.daemon.sessions.ClientSession` per client connection,
  with the segments it attached (ops ``attach``/``detach``) and the status/config queries;
* **routing** — kind → service and op → service, fixed at start; two services claiming one
  kind or op make the daemon refuse to start, a frame of an unclaimed kind closes its link;
* **the timer** — one, re-armed only when the earliest deadline moved.

Life cycle: :meth:`Daemon.run` binds the peer listener and the client socket, starts the
services, tells systemd READY=1 and pings its watchdog from the loop.  :meth:`Daemon.stop`
(SIGTERM) starts a drain: new clients and new operations are refused, work under way finishes
(up to ``drain_timeout``), whatever is left fails with code ``daemon_stopping``, peers get BYE,
and ``run`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Final, NoReturn

from fabricd.daemon import access, keyring, status_counters
from fabricd.daemon.config import held_bytes_limits
from fabricd.daemon.ipc_server import IpcConnection, IpcServer
from fabricd.daemon.logs import RateLimitedLog, flush_all
from fabricd.daemon.metrics import MetricsRegistry, NodeStats
from fabricd.daemon.metrics_http import MetricsServer
from fabricd.daemon.node_metrics import DaemonCollector
from fabricd.daemon.sdnotify import Notifier
from fabricd.daemon.segments import SegmentLimits, SegmentTable
from fabricd.daemon.service import BaseService, Request, check_claims
from fabricd.daemon.services.ako import AkoService
from fabricd.daemon.services.collectives import CollectiveService
from fabricd.daemon.services.membership import MembershipService
from fabricd.daemon.services.monitor import MonitorService
from fabricd.daemon.services.p2p import P2PService
from fabricd.daemon.services.peering import HandshakeSettings, PeeringService
from fabricd.daemon.services.ps import PSService
from fabricd.daemon.services.stochastic import StochasticService
from fabricd.daemon.sessions import ClientSession, request_id
from fabricd.engines.actions import Failure
from fabricd.engines.budget import ByteBudget
from fabricd.engines.link.handshake import Channel
from fabricd.errors import (
    ConfigError,
    ErrorCode,
    FabricError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
    UsageError,
    code_of,
)
from fabricd.frames import link as link_frames
from fabricd.frames import registry
from fabricd.transports import batch
from fabricd.transports.tcp import TcpTransport
from fabricd.transports.verbs import device as verbs_device
from fabricd.wire import (
    DISCARD,
    PROTOCOL_VERSION,
    Discard,
    Frame,
    FrameHead,
    Kind,
    Limits,
    Meta,
    get_int,
    get_str,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator, Sequence

    from fabricd.daemon.config import Config, Loaded
    from fabricd.daemon.service import Service
    from fabricd.daemon.services.roster import Registration, RosterService
    from fabricd.engines.membership import RankEvent, Suspicion
    from fabricd.engines.monitor.table import LinkFigures
    from fabricd.transports.base import Buffer, Link, Transport

log = logging.getLogger("fabricd.daemon")
#: lines that peers' frames cause: rate-limited
remote_log = RateLimitedLog(log)

#: what an authenticated peer may send: the peer frame kinds, no handshake or client frames.
#: WRITE included: a service posts regions on a peer's link (``Host.data_link(node).post``), and
#: a WRITE to a key nobody posted is refused and counted by the link, never placed
_PEER_LIMIT_KINDS: Final = registry.PEER_KINDS
#: the kinds that carry a payload a service places, and the channel each travels on
_PAYLOAD_CHANNEL: Final = {
    Kind.DATA: Channel.DATA,
    Kind.COLL: Channel.DATA,
    Kind.UPDATE: Channel.DATA,
    Kind.PUSH: Channel.DATA,
    Kind.PULLED: Channel.DATA,
    Kind.REPLICATE: Channel.DATA,
    Kind.PART: Channel.DATA,
    Kind.EAGER: Channel.CONTROL,
}
#: the kinds the data link carries, and only it
_DATA_KINDS: Final = frozenset(
    {Kind.DATA, Kind.COLL, Kind.UPDATE, Kind.PUSH, Kind.PULLED, Kind.REPLICATE, Kind.PART}
)
#: read on every frame: a module constant is cheaper than the enum attribute
_DATA: Final = Channel.DATA
#: requests the node answers itself: they concern the session, not an engine
_NODE_OPS: Final = frozenset({"attach", "detach", "status", "config", "stalls"})
#: the most rows a ``stalls`` reply carries (the oldest; ~300 B each, a reply may be 4 MiB)
MAX_STALL_ROWS: Final = 1000
#: seconds between two samples of the loop's lag when no other timer is due
_LAG_PROBE_INTERVAL: Final = 1.0


def default_services(daemon: Daemon) -> list[Service]:
    """Membership, point-to-point messaging, collectives, stochastic reduce, parameter
    servers and partial gradient exchange: the services every daemon runs."""
    membership = MembershipService(daemon, incarnation=daemon.peering.engine.incarnation)
    p2p = P2PService(
        daemon,
        routes=membership.engine,
        peers=daemon.peering.engine.peers,  # stall reports say whether a peer's node is up
        owners=membership.engine.owner,
    )
    collectives = CollectiveService(daemon, membership=membership.engine)
    stochastic = StochasticService(daemon, membership=membership.engine)
    servers = PSService(daemon, membership=membership.engine)
    exchanges = AkoService(daemon, membership=membership.engine)
    return [membership, p2p, collectives, stochastic, servers, exchanges]


class Daemon:
    """One node's daemon.  Build it, ``await run()``, call ``stop()`` to drain and end.

    Args:
        loaded: the effective configuration (with where each value came from).
        transport: the peer transport; TCP (with one log line saying why not verbs) if omitted.
        services: builds the services besides peering; :func:`default_services` if omitted.
            A test can add a service of its own here without any change to the node.
        registration: this daemon's registration in etcd (``membership = "etcd"``, made by
            :func:`fabricd.daemon.services.roster.register` before the daemon is built): the
            roster service keeps it and the peers' addresses true to etcd.
    """

    def __init__(
        self,
        loaded: Loaded,
        *,
        transport: Transport | None = None,
        services: Callable[[Daemon], Sequence[Service]] = default_services,
        registration: Registration | None = None,
    ) -> None:
        cfg = loaded.config
        self.loaded = loaded
        # grows across restarts; under etcd the one registered (peers admit it by equality)
        self._incarnation = registration.incarnation if registration else time.time_ns()
        self.started = time.time()
        self.loop = asyncio.get_running_loop()
        self.transport = transport or _default_transport()
        # the current links: per channel by node, and each link's (node, channel) — the table is
        # read on every frame, so it is kept as plain int- and identity-keyed dicts
        self._by_channel: dict[Channel, dict[int, Link]] = {ch: {} for ch in Channel}
        self._control = self._by_channel[Channel.CONTROL]
        self._data = self._by_channel[Channel.DATA]
        self._current: dict[Link, tuple[int, Channel]] = {}
        self.sessions: dict[int, ClientSession] = {}
        #: every segment clients attached, with the caps on their count and mapped bytes
        self.segments = SegmentTable(SegmentLimits.from_config(cfg))
        per_uid, per_job = held_bytes_limits(cfg)
        #: what the daemon holds on each tenant's behalf, against its byte budgets
        self.budget = ByteBudget(per_uid=per_uid, per_job=per_job, node=cfg.node_id)
        self.address = cfg.listen_address
        self.peering = PeeringService(self, self.transport, self._handshake(cfg, registration))
        #: the network monitor: built here, not in ``services``, since :meth:`network` reads it
        self.monitor = MonitorService(self, links=lambda: self.links)
        self.roster: RosterService | None = None
        if registration is not None:  # aetcd is an optional extra: imported only for etcd
            from fabricd.daemon.services.roster import RosterService

            self.roster = RosterService(self, self.peering, registration, on_slot_lost=self.stop)
        roster = [self.roster] if self.roster is not None else []
        self.services: list[Service] = [self.peering, *roster, self.monitor, *services(self)]
        check_claims(self.services)
        self._by_kind = {kind: s for s in self.services for kind in s.kinds}
        self._by_op = {op: s for s in self.services for op in s.ops}
        #: the services that may ever have a deadline (read after every frame and request)
        self._timed = [
            s for s in self.services if type(s).next_deadline is not BaseService.next_deadline
        ]
        if clash := _NODE_OPS & self._by_op.keys():
            raise ValueError(f"ops {sorted(clash)} belong to the node, not to a service")
        self.ipc = IpcServer(
            cfg.socket,
            self,
            allowed_uids=cfg.allowed_uids,
            allowed_gids=cfg.allowed_gids,
            max_clients=cfg.max_clients,
            max_clients_per_uid=cfg.max_clients_per_uid,
            hello_timeout=cfg.client_hello_timeout,
            frame_timeout=cfg.client_frame_timeout,
        )
        self._ownership = access.ownership(cfg)  #: who sees which rows of status
        self.notifier = Notifier.from_environ()
        self._draining = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due: float | None = None
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()  #: set while draining once no service has work under way
        self._tasks: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()
        self._stopped = False
        #: per link, the DATA or EAGER frame whose payload is arriving: its metadata, parsed view
        #: and payload length, read once for its landing buffer and used again when the whole
        #: frame is in (its payload may have been dropped: the length is only known here).  Per
        #: link: reads of several links interleave, and a control link's EAGER may be under
        #: way while a data link's DATA begins
        self._chunks: dict[Link, tuple[Meta, registry.PayloadFrame, int]] = {}
        #: what the node counts as it happens; the registry reads it and everything else
        #: when scraped (fabricd/daemon/metrics.py)
        self.stats = NodeStats()
        self._frames_received = self.stats.frames_received  #: (counted on every frame)
        self.metrics = MetricsRegistry([DaemonCollector(self)])
        self.metrics_server = MetricsServer(self.metrics.exposition)
        self._metrics_error = ""

    def _handshake(self, cfg: Config, registration: Registration | None) -> HandshakeSettings:
        """What the peering service proves and checks in every handshake; the name every
        HELLO carries is the one registered in etcd (a static list's ``node_name``, which
        no peer checks)."""
        return HandshakeSettings(
            node=cfg.node_id,
            incarnation=self._incarnation,
            name=registration.name if registration is not None else cfg.node_name,
            secrets=keyring.read_secrets(cfg),
            fabric_size=len(cfg.nodes),
            data_integrity=cfg.data_integrity == "mac",
            limits=Limits(
                max_meta=cfg.max_meta, max_payload=cfg.max_payload, kinds=_PEER_LIMIT_KINDS
            ),
        )

    def service(self, name: str) -> Service:
        """The service called ``name`` (for status tools and tests).

        Raises:
            KeyError: no service of that name runs here.
        """
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(name)

    # -- Host: what services may use --------------------------------------------------------
    @property
    def config(self) -> Config:
        return self.loaded.config

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def now(self) -> float:
        return self.loop.time()

    def network(self, now: float) -> dict[int, LinkFigures]:
        return self.monitor.network(now)

    @property
    def links(self) -> dict[tuple[int, Channel], Link]:
        """Every current link by (node, channel) (a snapshot, for status and tests)."""
        return {key: link for link, key in self._current.items()}

    def send(self, node: int, frame: registry.PeerFrame, payload: Sequence[Buffer] = ()) -> None:
        link = self._control.get(node)
        if link is None:
            log.debug("no control link to node %d: dropped %s", node, frame.KIND.name)
            return
        try:
            link.send_nowait(frame.KIND, frame.to_meta(), payload)
        except TransportError as exc:
            log.debug("dropped %s to node %d: %s", frame.KIND.name, node, exc)
        except LocalProtocolError as exc:  # over this node's own limits: a config mismatch
            log.error("cannot send %s to node %d: %s", frame.KIND.name, node, exc)

    def broadcast(self, frame: registry.PeerFrame) -> None:
        # only to peers that are up, both links admitted: one still opening its data link has
        # not been greeted, and hears what it missed in its greeting (PeerUp)
        for node in list(self._data):
            self.send(node, frame)

    def data_link(self, node: int) -> Link | None:
        return self._data.get(node)

    def reply(self, session: ClientSession, request_id: int, result: Meta) -> None:
        session.conn.reply({"id": request_id, "ok": True, **result})

    def fail(self, session: ClientSession, request_id: int, failure: Failure) -> None:
        reply: Meta = {"id": request_id, "ok": False, "code": str(failure.code)}
        reply.update(error=failure.message, rank=failure.rank, node=failure.node)
        session.conn.reply(reply)

    def push(self, session: ClientSession, event: str, fields: Meta) -> None:
        session.conn.push(event, fields)

    def rank_event(self, event: RankEvent) -> None:
        now = self.now()
        for service in self.services:
            with _bug_in(service, "on_rank_event"):
                service.on_rank_event(event, now)

    def suspicion(self, event: Suspicion) -> None:
        now = self.now()
        for service in self.services:
            with _bug_in(service, "on_suspicion"):
                service.on_suspicion(event, now)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tasks is not None, "spawn before run()"
        task = self._tasks.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    def rearm(self) -> None:
        """Arm the one timer at the earliest deadline of any service.

        Inside a read callback (transports/batch.py) this happens once, when it returns: each
        frame or request of one read may move deadlines, only where they end up matters, and no
        timer can fire in between.  Asking every service for its deadline after each of them
        cost about 2% of the daemon's time with one message at a time, more with many.
        """
        if not batch.defer(self._rearm):
            self._rearm()

    def _rearm(self) -> None:
        if self._draining and not self._in_flight():
            self._idle.set()
        if self._stopped:
            return
        due: float | None = None  # (a loop: a list and min() cost as much as the questions)
        for service in self._timed:
            deadline = service.next_deadline()
            if deadline is not None and (due is None or deadline < due):
                due = deadline
        if self._timer is not None:
            if self._timer_due == due:  # the usual case after a frame: nothing moved
                return
            self._timer.cancel()
            self._timer = None
        if due is not None:  # (uvloop's timer handles have no when(): keep the time here)
            self._timer, self._timer_due = self.loop.call_at(due, self._on_timer), due

    def _on_timer(self) -> None:
        self._timer = None
        now = self.now()
        if self._timer_due is not None:
            self.stats.loop_lag.observe(max(0.0, now - self._timer_due))
        for service in self.services:
            with _bug_in(service, "on_timer"):
                due = service.next_deadline()
                if due is not None and due <= now:
                    service.on_timer(now)
        self.rearm()

    # -- links: what the peering service decides, the node keeps ----------------------------
    def adopt_link(self, node: int, channel: Channel, link: Link) -> None:
        """``link`` is now ``node``'s current link of ``channel`` (admitted by peering)."""
        table = self._by_channel[channel]
        assert node not in table, "peering admits a link only after a reset"
        table[node] = link
        self._current[link] = (node, channel)

    def reset_peer(self, node: int, reason: str) -> None:
        """Close both of ``node``'s links and tell every service the peer is down.

        TCP cannot say which frames the peer processed before a link broke, so everything
        exchanged with it is lost (architecture.md, "Reset rule").
        """
        # both leave the table before either closes: a link may report its loss (or the peer
        # close the other one) from within close(), and neither is news any more
        links = [self._by_channel[channel].pop(node, None) for channel in Channel]
        for channel, link in zip(Channel, links, strict=True):
            if link is not None:
                del self._current[link]
                self.stats.links.retire(node, channel, link.statistics())  # counters only grow
        for link in links:
            if link is not None:
                link.close(f"node {node} {reason}")
        now = self.now()
        for service in self.services:
            with _bug_in(service, "peer_down"):
                service.peer_down(node, reason, now)

    def peer_up(self, node: int) -> None:
        """Both of ``node``'s links are admitted: let every service greet it."""
        now = self.now()
        for service in self.services:
            with _bug_in(service, "peer_up"):
                service.peer_up(node, now)

    def link(self, node: int, channel: Channel) -> Link | None:
        """``node``'s current ``channel`` link, if it has one."""
        return self._by_channel[channel].get(node)

    def current_channel(self, node: int, link: Link) -> Channel | None:
        """Which of ``node``'s current links ``link`` is, if it is one."""
        key = self._current.get(link)
        return key[1] if key is not None and key[0] == node else None

    def payload_buffer(self, node: int, link: Link, head: FrameHead) -> memoryview | Discard:
        # checked before a byte lands in a client's region: DATA on the data link, EAGER (a
        # small message whole) on the control link, nothing else carries a payload
        key = self._current.get(link)  # (current_channel, inline: read for every payload)
        channel = key[1] if key is not None and key[0] == node else None
        if _PAYLOAD_CHANNEL.get(head.kind) is not channel or channel is None:
            raise RemoteProtocolError(
                f"{head.kind.name} payload on a link of node {node} that does not carry it"
            )
        service = self._by_kind.get(head.kind)
        if service is None:
            self._unhandled(node, head.kind)
        chunk = registry.parse(head.kind, head.meta)
        assert isinstance(chunk, registry.PayloadFrame)
        # the whole frame comes next, with this same metadata (and, if dropped, no payload)
        self._chunks[link] = (head.meta, chunk, head.payload_len)
        buffer = service.payload_buffer(node, chunk, head.payload_len)
        return DISCARD if buffer is None else buffer

    def frame_received(self, node: int, link: Link, frame: Frame) -> None:
        # runs for every frame a peer sends: the lookups are inline, not helper calls (each
        # costs ~0.1 us, a tenth of what the node does here per frame)
        key = self._current.get(link)
        if key is None or key[0] != node:
            link.close("frame on a link that is no longer current")  # fenced: a dead incarnation
            return
        kind = frame.kind
        if (kind in _DATA_KINDS) != (key[1] is _DATA):
            raise RemoteProtocolError(f"{kind.name} on the wrong channel from node {node}")
        now = self.loop.time()
        self.peering.heard(node, now)
        self._frames_received[kind] += 1
        service = self._by_kind.get(kind)
        if service is None:
            self._unhandled(node, kind)
        cached = self._chunks.pop(link, None) if self._chunks else None
        if cached is not None and frame.meta is cached[0]:
            service.on_data(node, cached[1], cached[2], now)
        else:  # a frame with no payload: nothing was cached for it
            view = registry.parse(kind, frame.meta)
            if isinstance(view, registry.PayloadFrame):
                service.on_data(node, view, len(frame.payload), now)
            else:
                service.on_frame(node, view, now)
        self.rearm()

    def _unhandled(self, node: int, kind: Kind) -> NoReturn:
        """Refuse a frame of a kind no service claimed (the link that sent it closes)."""
        remote_log.warning(
            "unhandled kind", "node %d sent %s, which no service handles", node, kind.name
        )
        raise RemoteProtocolError(f"no service handles {kind.name} frames")

    def link_down(self, node: int, link: Link) -> None:
        self._chunks.pop(link, None)  # a frame cut off mid-payload
        if self._stopped:
            return
        channel = self.current_channel(node, link)
        if channel is not None:  # a link that is no longer current closing is no news
            self.peering.link_lost(node, channel, link, self.now())
        self.rearm()

    # -- life cycle -------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until :meth:`stop`; returns after the drain.

        Raises:
            TransportError: the peer address cannot be bound.
            ConfigError: the client socket cannot be bound (or another daemon serves it).
        """
        self.address = await self.peering.listen(self.config.listen_address)
        try:
            self.ipc.start()
        except BaseException:
            await self.peering.aclose()
            raise
        try:
            await self._serve()
        finally:
            self._close_everything()

    async def _serve(self) -> None:
        await self._start_metrics()
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            watchdog = None
            if self.notifier is not None and self.notifier.watchdog_interval():
                watchdog = tasks.create_task(self._watchdog(self.notifier))
            lag_probe = tasks.create_task(self._probe_lag())
            self.peering.start(self.now())
            if self.roster is not None:
                self.roster.start()
            self.rearm()
            log.info(
                "node %d of %d serving: peers on %s (%s), clients on %s, incarnation %d",
                self.config.node_id,
                len(self.config.nodes),
                self.address,
                self.transport.name,
                self.config.socket,
                self._incarnation,
            )
            if self.notifier is not None:
                self.notifier.ready(f"serving node {self.config.node_id}")
            await self._stopping.wait()
            await self._drain()
            lag_probe.cancel()
            if watchdog is not None:
                watchdog.cancel()

    async def _start_metrics(self) -> None:
        """Serve the metrics endpoint, unless ``metrics_address`` is empty.

        An address that cannot be bound (in use, not this host's) costs the endpoint, not the
        daemon: the error is logged and in ``status`` (``metrics_error``), and the scraper sees
        the target down.
        """
        address = self.config.metrics_address
        if not address:
            return
        try:
            await self.metrics_server.start(address)
        except OSError as exc:
            self._metrics_error = f"cannot bind metrics_address {address}: {exc.strerror or exc}"
            log.error("%s; serving without the metrics endpoint", self._metrics_error)

    async def _probe_lag(self) -> None:
        """Sample the loop's lag once a second, so an idle daemon's is known too."""
        while True:
            due = self.loop.time() + _LAG_PROBE_INTERVAL
            await asyncio.sleep(_LAG_PROBE_INTERVAL)
            self.stats.loop_lag.observe(max(0.0, self.loop.time() - due))

    def stop(self) -> None:
        """Begin a graceful stop (idempotent; safe from a signal handler)."""
        if not self._stopping.is_set():
            log.info(
                "stopping: draining transfers under way (up to %.1fs)", self.config.drain_timeout
            )
            if self.notifier is not None:
                self.notifier.stopping()
            self._stopping.set()

    def reload_secrets(self) -> None:
        """Read the secret source again (SIGHUP, ``systemctl reload``): the next handshakes
        prove and accept what it holds now, which is how a secret is rotated without
        downtime (docs/operations.md, "Rotating the secret").

        Only the secrets are read again, not the rest of the config.  Links already up keep
        the session keys their handshake gave them.  A source that cannot be read or is
        refused changes nothing: the error is logged and the secrets held are kept, so a
        typo during a rotation never leaves the node unable to link.
        """
        settings = self.peering.settings
        where = keyring.source_name(self.config)
        try:
            found = keyring.read_secrets(self.config)
        except ConfigError as exc:
            held = len(settings.secrets)
            log.error("reload refused, keeping the %d secret(s) held: %s", held, exc)
            return
        settings.secrets = found
        if not found:  # one node, no peers: nothing to authenticate
            log.info("reload: no secret source is configured; nothing to read")
            return
        log.info(
            "reload: %d secret(s) from %s; new links %s",
            len(found),
            where,
            "accept either and prefer the newer" if len(found) > 1 else "use that one only",
        )

    def _in_flight(self) -> int:
        return sum(service.in_flight() for service in self.services)

    async def _drain(self) -> None:
        self._draining = True
        self.ipc.stop_accepting()
        if self._in_flight():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.drain_timeout):
                    await self._idle.wait()
        for service in self.services:  # a copy's thread cannot be stopped: let it end first
            with _bug_in(service, "settle"):
                await service.settle()
        failure = Failure(
            code=ErrorCode.DAEMON_STOPPING, message="the daemon is stopping; retry later"
        )
        for service in reversed(self.services):
            with _bug_in(service, "shutdown"):
                service.shutdown(failure)
        for task in list(self._spawned):  # what is still moving was just failed: stop it
            task.cancel()
        self.broadcast(link_frames.Bye())
        await self.peering.aclose()

    def _close_everything(self) -> None:
        self._stopped = True  # closing our own links is no news, and no timer is armed again
        if self._timer is not None:
            self._timer.cancel()
        for link in list(self._current):
            link.close("daemon stopped")
        self._current.clear()
        for table in self._by_channel.values():
            table.clear()
        self.ipc.close()
        self.metrics_server.close()
        if self.notifier is not None:
            self.notifier.close()
        flush_all()  # the counts of lines left out, up to the last one
        log.info("stopped")

    async def _watchdog(self, notifier: Notifier) -> None:
        interval = notifier.watchdog_interval() or 1.0
        while True:
            notifier.watchdog()  # from the loop, so a stalled loop stops the pings
            await asyncio.sleep(interval)

    # -- clients (RequestHandler) -----------------------------------------------------------
    def client_request(self, conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
        session = self.sessions.get(conn.id)
        if session is None:  # (not setdefault: that builds a session for every request)
            session = self.sessions[conn.id] = ClientSession(conn)
        rid = 0
        try:
            rid = request_id(meta)
            op = get_str(meta, "op")
            request = Request(session=session, id=rid, op=op, meta=meta, fds=fds)
            service = self._by_op.get(op)
            # only ops that exist become labels: a client's junk must not grow the metrics
            self.stats.requests[op if service is not None or op in _NODE_OPS else "unknown"] += 1
            if service is not None:
                result = service.on_request(request, self.now())
            elif op in _NODE_OPS:
                result = self._node_request(request)
            else:
                raise UsageError(f"unknown request {op!r}")
            if result is not None:
                self.reply(session, rid, result)
        except ProtocolError as exc:
            conn.close(f"protocol error: {exc}")
        except FabricError as exc:
            self.fail(session, rid, Failure(code=code_of(exc), message=str(exc)))
        except Exception:  # a daemon bug: this request fails, the daemon and client go on
            # a client can repeat what triggers a bug: one traceback per burst, then a count
            remote_log.log(
                logging.ERROR,
                "request failed",
                "request %r of client %d failed",
                meta.get("op"),
                conn.id,
                exc_info=True,
            )
            failure = Failure(
                code=ErrorCode.INTERNAL, message="internal error in the daemon (see its log)"
            )
            self.fail(session, rid, failure)
        finally:
            for fd in fds:
                _close_quietly(fd)
        self.rearm()

    def client_gone(self, conn: IpcConnection) -> None:
        session = self.sessions.pop(conn.id, None)
        if session is None:
            return
        now = self.now()
        for service in reversed(self.services):  # dependents first: messages before ranks
            with _bug_in(service, "client_gone"):
                service.client_gone(session, now)
        self.segments.release(session)
        self.rearm()

    def _node_request(self, request: Request) -> Meta:
        session, meta = request.session, request.meta
        if request.op == "attach":
            self._attach(session, meta, request.fds)
            return {}
        if request.op == "detach":
            self.segments.detach(session, get_int(meta, "seg"))
            return {}
        if request.op == "status":
            return self.status(asking=session)
        if request.op == "stalls":
            return self.stalls(asking=session)
        return {"config": self.loaded.describe()}

    def _attach(self, session: ClientSession, meta: Meta, fds: list[int]) -> None:
        seg, size = get_int(meta, "seg"), get_int(meta, "size", lo=1)
        if len(fds) != 1:
            raise UsageError("attach needs exactly one segment fd")
        self.segments.attach(session, seg, size, fds.pop())

    def stalls(self, asking: ClientSession | None = None) -> Meta:
        """What ``fabricctl stalls`` shows: the operations of any service pending longer than
        ``stall_after``, oldest first, with what each waits for; ``asking`` sees only the rows
        of jobs it may see (``hidden`` counts the others, as :func:`access.redact` does).

        At most :data:`MAX_STALL_ROWS` rows (``left_out`` counts the rest it may see): a client
        may have tens of thousands of operations pending, and their rows would pass the 4 MiB
        a reply may be (the asking client was cut off for it) and cost the loop seconds.
        """
        now = self.now()
        user = None if asking is None else access.user_of(asking)
        seen = [0, 0]  # rows hidden from the asker, rows it may see

        def keep(row: Meta) -> bool:
            shown = user is None or access.visible(row, user, self._ownership)
            seen[shown] += 1
            return shown

        rows: list[Meta] = []
        for service in self.services:
            rows += service.stalls(now, keep, MAX_STALL_ROWS - len(rows))
        result: Meta = {"node": self.config.node_id, "stall_after": self.config.stall_after}
        result["stalls"] = rows
        result["left_out"] = seen[1] - len(rows)
        if user is not None:
            result["hidden"] = {"stalls": seen[0]} if seen[0] else {}
        return result

    def status(self, asking: ClientSession | None = None) -> Meta:
        """Everything ``fabricctl status`` and ``fabricctl peers`` show, JSON-ready.

        ``asking`` (the client that asked) is left out of the client list, and sees only the
        rows of its own clients and of jobs it may see (:func:`access.redact`).
        """
        status: Meta = {
            "node": self.config.node_id,
            "nodes": len(self.config.nodes),
            "address": self.address,
            "socket": self.config.socket,
            "transport": self.transport.name,
            "incarnation": self._incarnation,
            "uptime": time.time() - self.started,
            "version": PROTOCOL_VERSION,
            "state": "draining" if self._draining else "serving",
            "clients": [self._client_row(s) for s in self.sessions.values() if s is not asking],
            "services": [s.name for s in self.services],
            "metrics_url": self.metrics_server.url,
        }
        if self._metrics_error:
            status["metrics_error"] = self._metrics_error
        parts = self.own_counters()
        status.update(self.segments.gauges())
        status["held_bytes"] = [
            {"uid": uid, "bytes": n} for uid, n in sorted(self.budget.held_by_uid().items())
        ]
        status["max_held_bytes_per_uid"] = self.budget.per_uid
        status["max_held_bytes_per_job"] = self.budget.per_job
        for service in self.services:
            stats = dict(service.statistics())
            parts.append(status_counters.service_counters(service, stats))
            stats.pop("counters", None)
            status.update(stats)
        status.setdefault("membership", {"source": "static"})
        status["counters"] = status_counters.merge(parts)  # summed by name: see its module
        status["metrics"] = self.metrics.snapshot()  # what the endpoint serves, as JSON
        if asking is not None:
            access.redact(status, access.user_of(asking), self._ownership)
        return status

    def own_counters(self) -> list[dict[str, int]]:
        """The node's own parts of the status counters (the services add theirs; merged by
        :mod:`~fabricd.daemon.status_counters`, for ``status`` and the metrics alike)."""
        return [
            self.ipc.counters(),
            self.segments.counters(),
            self.budget_counters(),
            self.metrics_server.counters(),
        ]

    def budget_counters(self) -> dict[str, int]:
        """Charges the byte budgets refused, by the setting that refused them."""
        return {f"refused_{setting}": n for setting, n in self.budget.refused.items()}

    def _client_row(self, session: ClientSession) -> Meta:
        row = session.describe()
        for service in self.services:
            row.update(service.client_statistics(session))
        return row


def _default_transport() -> Transport:
    """TCP, with one log line saying why not verbs."""
    found = verbs_device.probe()
    if found.devices:
        log.info("transport: tcp (%s found, but this release has no verbs link yet)", found.reason)
    else:
        log.info("transport: tcp (%s)", found.reason)
    return TcpTransport()


@contextlib.contextmanager
def _bug_in(service: Service, hook: str) -> Iterator[None]:
    """Log what ``service`` raised from ``hook`` (a bug in it) and go on.

    News, ticks and releases go to every service in turn: one that raises must not keep the
    others from hearing them, stop the daemon's one timer, or reach the transport or the loop.
    """
    try:
        yield
    except Exception:
        log.exception("service %r failed in %s (a bug); the daemon goes on", service.name, hook)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
