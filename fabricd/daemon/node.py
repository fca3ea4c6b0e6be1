"""The daemon of one node: wires the engines to the transport and to the client socket.

This is the I/O shell of STYLE §11: every decision is an engine's (peer liveness in
:mod:`~fabricd.engines.peers`, matching and failure in :mod:`~fabricd.engines.p2p`,
authentication in :mod:`~fabricd.engines.handshake`); this module feeds them events with the
loop's clock and performs the actions they return, then re-arms the one engine timer.

Life cycle: :meth:`Daemon.run` binds the peer listener and the client socket, starts dialling,
tells systemd READY=1 and pings its watchdog from the loop.  :meth:`Daemon.stop` (SIGTERM)
starts a drain: new clients and new operations are refused, transfers under way finish (up to
``drain_timeout``), whatever is left fails with code ``daemon_stopping``, peers get BYE, and
``run`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

from fabricd.daemon.datapath import Inbound, copy, stream
from fabricd.daemon.peering import HandshakeSettings, Peering
from fabricd.daemon.sdnotify import Notifier
from fabricd.daemon.sessions import (
    ClientSession,
    Transfer,
    parse_hello,
    parse_transfer,
    request_id,
)
from fabricd.engines import p2p, peers
from fabricd.engines.handshake import Channel, PeerIdentity
from fabricd.engines.p2p import Messaging
from fabricd.engines.peers import Incarnation, PeerState, PeerTable, Timeouts
from fabricd.engines.routing import RankTable
from fabricd.errors import (
    FabricError,
    LocalProtocolError,
    OperationFailed,
    ProtocolError,
    TransportError,
    UsageError,
)
from fabricd.ipc import IpcConnection, IpcServer
from fabricd.shm import Segment
from fabricd.transports.tcp import TcpTransport
from fabricd.transports.verbs import device as verbs_device
from fabricd.wire import PROTOCOL_VERSION, Frame, FrameHead, Kind, Limits, Meta, get_int, get_str

if TYPE_CHECKING:
    from fabricd.daemon.config import Loaded
    from fabricd.transports.base import Link, Transport

log = logging.getLogger("fabricd.daemon")

_MESSAGING_KINDS = frozenset({Kind.ANNOUNCE, Kind.RTS, Kind.CTS, Kind.DONE, Kind.CANCEL})
#: what an authenticated peer may send: no handshake frames again, no client frames
_PEER_KINDS = frozenset(k for k in Kind if k < Kind.REQUEST) - {Kind.HELLO, Kind.AUTH}

Handler = Callable[[ClientSession, Meta, list[int]], dict[str, Any] | None]


class Daemon:
    """One node's daemon.  Build it, ``await run()``, call ``stop()`` to drain and end."""

    def __init__(self, loaded: Loaded, *, transport: Transport | None = None) -> None:
        cfg = loaded.config
        self.loaded = loaded
        self.config = cfg
        self.incarnation = time.time_ns()  # grows across restarts: peers fence older ones
        self.started = time.time()
        self.loop = asyncio.get_running_loop()
        self.peers = PeerTable(
            node=cfg.node_id,
            nodes=len(cfg.nodes),
            now=self.loop.time(),
            timeouts=Timeouts(
                heartbeat_interval=cfg.heartbeat_interval,
                suspect_after=cfg.suspect_after,
                down_after=cfg.down_after,
            ),
        )
        self.messaging = Messaging(
            node=cfg.node_id, routes=RankTable(cfg.node_id), route_timeout=cfg.route_timeout
        )
        limits = Limits(max_meta=cfg.max_meta, max_payload=cfg.max_payload, kinds=_PEER_KINDS)
        settings = HandshakeSettings(
            node=cfg.node_id,
            incarnation=self.incarnation,
            secret=cfg.read_secret(),
            fabric_size=len(cfg.nodes),
            timeout=cfg.handshake_timeout,
            limits=limits,
        )
        self.transport = transport or _default_transport()
        self.peering = Peering(self.transport, self, settings, cfg.nodes, cfg.reconnect_max_backoff)
        self.ipc = IpcServer(
            cfg.socket,
            self,
            allowed_uids=cfg.allowed_uids,
            allowed_gids=cfg.allowed_gids,
            max_clients=cfg.max_clients,
        )
        self.notifier = Notifier.from_environ()
        self.control: dict[int, Link] = {}
        self.data: dict[int, Link] = {}
        self.inbound = Inbound()
        self.sessions: dict[int, ClientSession] = {}
        self.ops: dict[int, Transfer] = {}  #: every operation the engine may still act on
        self.counters: Counter[str] = Counter()
        self.address = cfg.listen_address
        self.draining = False
        self._op_ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due: float | None = None
        self._stopping = asyncio.Event()
        self._idle = asyncio.Event()  #: set while draining once no transfer is under way
        self._tasks: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()  #: streams and copies under way
        self._copies: set[asyncio.Task[None]] = set()  #: of those, the local copies
        self._leaving: set[int] = set()  #: peers that said BYE: their links closing is no news
        self._stopped = False
        self._requests: dict[str, Handler] = {
            "hello": self._hello,
            "attach": self._attach,
            "detach": self._detach,
            "send": self._send,
            "recv": self._recv,
            "status": self._status,
            "config": self._config,
        }

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
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            background = [
                tasks.create_task(self.peering.keep_dialled(node))
                for node in self.peering.dial_targets()
            ]
            if self.notifier is not None and self.notifier.watchdog_interval():
                background.append(tasks.create_task(self._watchdog(self.notifier)))
            self._rearm()
            log.info(
                "node %d of %d serving: peers on %s (%s), clients on %s, incarnation %d",
                self.config.node_id,
                len(self.config.nodes),
                self.address,
                self.transport.name,
                self.config.socket,
                self.incarnation,
            )
            if self.notifier is not None:
                self.notifier.ready(f"serving node {self.config.node_id}")
            await self._stopping.wait()
            await self._drain()
            for task in background:
                task.cancel()

    def stop(self) -> None:
        """Begin a graceful stop (idempotent; safe from a signal handler)."""
        if not self._stopping.is_set():
            log.info(
                "stopping: draining transfers under way (up to %.1fs)", self.config.drain_timeout
            )
            if self.notifier is not None:
                self.notifier.stopping()
            self._stopping.set()

    async def _drain(self) -> None:
        self.draining = True
        self.ipc.stop_accepting()
        if self.messaging.transfers():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.drain_timeout):
                    await self._idle.wait()
        if self._copies:  # a copy's thread cannot be stopped: let it end before we fail it
            await asyncio.wait(self._copies)
        for session in list(self.sessions.values()):
            ops = list(session.ops)
            self._perform(self.messaging.abandon(ops))
            for op in ops:
                self._reply_failure(op, "daemon_stopping", "the daemon is stopping; retry later")
        for task in self._spawned:  # what is still moving was just failed: stop moving it
            task.cancel()
        for link in self.control.values():
            with contextlib.suppress(TransportError):
                link.send_nowait(Kind.BYE, {})
        await self.peering.aclose()

    def _close_everything(self) -> None:
        self._stopped = True  # closing our own links is no news, and no timer is armed again
        if self._timer is not None:
            self._timer.cancel()
        for link in [*self.control.values(), *self.data.values()]:
            link.close("daemon stopped")
        self.ipc.close()
        if self.notifier is not None:
            self.notifier.close()
        log.info("stopped")

    async def _watchdog(self, notifier: Notifier) -> None:
        interval = notifier.watchdog_interval() or 1.0
        while True:
            notifier.watchdog()  # from the loop, so a stalled loop stops the pings
            await asyncio.sleep(interval)

    # -- the engines' timer -----------------------------------------------------------------
    def _rearm(self) -> None:
        if self._stopped:
            return
        deadlines = [d for d in (self.peers.next_deadline(), self.messaging.next_deadline()) if d]
        due = min(deadlines, default=None)
        if self._timer is not None:
            if self._timer_due == due:  # the usual case after a frame: nothing moved
                return
            self._timer.cancel()
            self._timer = None
        if due is not None:  # (uvloop's timer handles have no when(): keep the time here)
            self._timer, self._timer_due = self.loop.call_at(due, self._on_timer), due

    def _on_timer(self) -> None:
        self._timer = None
        now = self.loop.time()
        self._perform(self.peers.on_timer(now))
        self._perform(self.messaging.on_timer(now))
        self._rearm()

    # -- performing actions -----------------------------------------------------------------
    def _perform(self, actions: Iterable[peers.Action | p2p.Action]) -> None:
        for action in actions:
            match action:
                case peers.SendHeartbeat(node=node):
                    self._send_control(node, Kind.HEARTBEAT, {})
                case p2p.SendFrame(node=node, kind=kind, meta=meta):
                    self._send_control(node, kind, meta)
                case p2p.Broadcast(kind=kind, meta=meta):
                    for node in list(self.control):
                        self._send_control(node, kind, meta)
                case peers.StateChanged():
                    self._peer_state_changed(action)
                case peers.PeerRestarted(node=node):  # link_up already reset what it had
                    log.warning(
                        "node %d restarted (incarnation %d -> %d)",
                        node,
                        action.old_incarnation,
                        action.new_incarnation,
                    )
                case p2p.StreamData(node=node, msg=msg, op=op):
                    self._spawn(self._stream(node, msg, self.ops[op].region))
                case p2p.ExpectData(node=node, msg=msg, op=op):
                    self.inbound.expect(node, msg, self.ops[op].region)
                case p2p.DiscardData(node=node, msg=msg):
                    self.inbound.discard(node, msg)
                case p2p.ForgetData(node=node, msg=msg):
                    self.inbound.forget(node, msg)
                case p2p.CopyLocal(src_op=src, dst_op=dst):
                    copying = self._copy(src, dst, self.ops[src].region, self.ops[dst].region)
                    self._copies.add(self._spawn(copying))
                case p2p.Complete(op=op, failure=failure):
                    self._complete(op, failure)
                case p2p.Notice(message=message):
                    log.warning("%s", message)
        if self.draining and not self.messaging.transfers():
            self._idle.set()

    def _send_control(self, node: int, kind: Kind, meta: Meta) -> None:
        link = self.control.get(node)
        if link is None:
            log.debug("no control link to node %d: dropped %s", node, kind.name)
            return
        try:
            link.send_nowait(kind, meta)
        except TransportError as exc:
            log.debug("dropped %s to node %d: %s", kind.name, node, exc)
        except LocalProtocolError as exc:  # over this node's own limits: a config mismatch
            log.error("cannot send %s to node %d: %s", kind.name, node, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tasks is not None
        task = self._tasks.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(self._copies.discard)
        return task

    def _peer_state_changed(self, change: peers.StateChanged) -> None:
        level = (
            logging.WARNING if change.new in (PeerState.DOWN, PeerState.SUSPECT) else logging.INFO
        )
        log.log(
            level,
            "node %d: %s -> %s (%s)",
            change.node,
            change.old.value,
            change.new.value,
            change.reason,
        )
        if change.new is PeerState.DOWN:
            self._reset_peer(change.node, "down")

    def _reset_peer(self, node: int, reason: str) -> None:
        """Forget everything exchanged with ``node``: its links, ranks and transfers.

        TCP cannot say which frames the peer processed before a link broke, so every
        operation with a rank on that node fails (architecture.md, "Reset rule").
        """
        for table in (self.control, self.data):
            link = table.pop(node, None)
            if link is not None:
                link.close(f"node {node} {reason}")
        self.inbound.forget_node(node)
        self._perform(self.messaging.peer_down(node, reason))

    async def _stream(self, node: int, msg: int, region: memoryview) -> None:
        # The region is held from the moment the stream is spawned: the operation may finish
        # (a DONE, a drain) while this task waits, and then no longer be in self.ops.
        link = self.data.get(node)
        try:
            if link is None:
                raise TransportError(f"no data link to node {node}")
            await stream(link, msg, region, self.config.chunk_size)
            self.counters["bytes_sent"] += len(region)
        except (TransportError, LocalProtocolError) as exc:
            self._perform(
                self.messaging.stream_failed(msg, f"sending to node {node} failed: {exc}")
            )
            self._rearm()

    async def _copy(self, src: int, dst: int, source: memoryview, target: memoryview) -> None:
        await copy(target, source)
        self.counters["bytes_copied"] += len(source)
        self._perform(self.messaging.copied(src, dst))

    def _complete(self, op: int, failure: p2p.Failure | None) -> None:
        transfer = self.ops.pop(op, None)
        if transfer is None or transfer.session is None:
            return
        session, request, message = transfer.session, transfer.request, transfer.message
        session.ops.discard(op)
        if failure is not None:
            self.counters["ops_failed"] += 1
            reply: Meta = {
                "id": request,
                "ok": False,
                "code": failure.code,
                "error": failure.message,
            }
            reply.update(rank=failure.rank, node=failure.node)
            session.conn.reply(reply)
            return
        self.counters["ops_completed"] += 1
        session.conn.reply(
            {
                "id": request,
                "ok": True,
                "nbytes": message.nbytes,
                "src": message.src,
                "tag": message.tag,
            }
        )

    def _reply_failure(self, op: int, code: str, text: str) -> None:
        self._complete(op, p2p.Failure(code=code, message=text))

    # -- peers (PeerEvents) -----------------------------------------------------------------
    def link_up(self, link: Link, peer: PeerIdentity) -> bool:
        node = peer.node
        verdict = self.peers.check_incarnation(node, peer.incarnation)
        if verdict is Incarnation.STALE:
            log.warning(
                "refused %s link from node %d: incarnation %d is dead",
                peer.channel,
                node,
                peer.incarnation,
            )
            link.close("stale incarnation")
            return False
        if peer.channel is Channel.DATA:
            control = self.control.get(node)
            if control is None or verdict is not Incarnation.SAME:
                link.close("data channel opened before the control channel")
                return False
            if node in self.data:  # a second data link: what moved on the first is unknown
                self._reset_peer(node, "reconnected (second data link)")
                link.close("a data link to this node was already up")
                return False
            self.data[node] = link
            return True
        self._leaving.discard(node)
        if node in self.control or node in self.data or verdict is Incarnation.NEWER:
            # a replaced link, or a new incarnation: nothing exchanged before can be trusted
            self._reset_peer(node, "reconnected" if verdict is Incarnation.SAME else "restarted")
        self.control[node] = link
        self._perform(self.peers.on_established(node, peer.incarnation, self.loop.time()))
        for meta in self.messaging.announcements():  # the peer forgot our ranks in its reset
            self._send_control(node, Kind.ANNOUNCE, meta)
        self._rearm()
        return True

    def link_down(self, node: int, link: Link) -> None:
        if self._stopped:
            return
        current = {Channel.CONTROL: self.control.get(node), Channel.DATA: self.data.get(node)}
        for channel, mine in current.items():
            if link is mine:  # losing either link resets the peer: see _reset_peer
                level = logging.INFO if node in self._leaving else logging.WARNING  # said BYE
                log.log(level, "%s link to node %d lost: %s", channel, node, link.close_reason)
                self._reset_peer(node, f"unreachable ({channel} link lost)")
                self._perform(self.peers.on_link_lost(node, self.loop.time()))
        self._rearm()

    def payload_buffer(self, node: int, link: Link, head: FrameHead) -> memoryview | None:
        if link is not self.data.get(node):  # checked before a byte lands in a client's region
            raise ProtocolError(
                f"{head.kind.name} payload on a link that is not node {node}'s data link"
            )
        return self.inbound.payload_buffer(node, head)

    def frame_received(self, node: int, link: Link, frame: Frame) -> None:
        if link is not self.control.get(node) and link is not self.data.get(node):
            link.close("frame on a link that is no longer current")  # fenced: a dead incarnation
            return
        if (frame.kind is Kind.DATA) != (link is self.data.get(node)):
            raise ProtocolError(f"{frame.kind.name} on the wrong channel from node {node}")
        now = self.loop.time()
        self._perform(self.peers.on_heard(node, now))
        if frame.kind is Kind.DATA:
            msg = self.inbound.chunk_arrived(node, frame)
            if msg is not None:
                self._perform(self.messaging.data_complete(node, msg))
        elif frame.kind in _MESSAGING_KINDS:
            self._perform(self.messaging.on_frame(node, frame.kind, frame.meta, now))
        elif frame.kind is Kind.BYE:
            log.info("node %d is stopping", node)
            self._leaving.add(node)
        elif frame.kind is not Kind.HEARTBEAT:
            raise ProtocolError(f"unexpected {frame.kind.name} from node {node}")
        self._rearm()

    # -- clients (RequestHandler) -----------------------------------------------------------
    def client_request(self, conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
        session = self.sessions.setdefault(conn.id, ClientSession(conn))
        rid = 0
        try:
            rid = request_id(meta)
            handler = self._requests.get(get_str(meta, "op"))
            if handler is None:
                raise UsageError(f"unknown request {meta.get('op')!r}")
            result = handler(session, meta, fds)
            if result is not None:
                conn.reply({"id": rid, "ok": True, **result})
        except ProtocolError as exc:
            conn.close(f"protocol error: {exc}")
        except OperationFailed as exc:
            conn.reply_error(rid, exc.code, str(exc))
        except FabricError as exc:
            conn.reply_error(rid, "usage", str(exc))
        except Exception:  # a daemon bug: this request fails, the daemon and client go on
            log.exception("request %r of client %d failed", meta.get("op"), conn.id)
            conn.reply_error(rid, "internal", "internal error in the daemon (see its log)")
        finally:
            for fd in fds:
                _close_quietly(fd)
        self._rearm()

    def client_gone(self, conn: IpcConnection) -> None:
        session = self.sessions.pop(conn.id, None)
        if session is None:
            return
        ops = list(session.ops)
        if session.job is not None:
            log.info(
                "rank %d of job %r left (client %d: %s); %d operations dropped",
                session.rank,
                session.job,
                conn.id,
                conn.close_reason,
                len(ops),
            )
            actions = self.messaging.detach(session.job, session.rank, ops, self.loop.time())
        else:
            actions = self.messaging.abandon(ops)
        self._perform(actions)
        for op in ops:
            transfer = self.ops.get(op)
            if transfer is None:  # completed by what _perform just did
                continue
            if self.messaging.holds(op):  # a transfer under way keeps its region, not its client
                transfer.session = None
            else:
                del self.ops[op]
        for segment in session.segments.values():
            segment.close()
        self._rearm()

    def _hello(self, session: ClientSession, meta: Meta, fds: list[int]) -> dict[str, Any]:
        if session.job is not None:
            raise UsageError("this connection already joined a job")
        claim = parse_hello(meta)
        if claim is not None:
            if self.draining:
                raise OperationFailed("the daemon is stopping; retry later", code="daemon_stopping")
            job, rank, size = claim
            self._perform(self.messaging.attach(job, rank, size, self.loop.time()))
            session.job, session.rank, session.size = job, rank, size
            creds = session.conn.credentials
            log.info(
                "client %d (pid %d, uid %d) joined job %r as rank %d of %d",
                session.conn.id,
                creds.pid,
                creds.uid,
                job,
                rank,
                size,
            )
        return {
            "node": self.config.node_id,
            "nodes": len(self.config.nodes),
            "incarnation": self.incarnation,
            "version": PROTOCOL_VERSION,
        }

    def _attach(self, session: ClientSession, meta: Meta, fds: list[int]) -> dict[str, Any]:
        seg, size = get_int(meta, "seg"), get_int(meta, "size", lo=1)
        if len(fds) != 1:
            raise UsageError("attach needs exactly one segment fd")
        if seg in session.segments:
            raise UsageError(f"segment {seg} is already attached")
        if len(session.segments) >= self.config.max_segments_per_client:
            raise UsageError(
                f"over max_segments_per_client ({self.config.max_segments_per_client})"
            )
        session.segments[seg] = Segment.adopt(fds.pop(), size)
        return {}

    def _detach(self, session: ClientSession, meta: Meta, fds: list[int]) -> dict[str, Any]:
        segment = session.segments.pop(get_int(meta, "seg"), None)
        if segment is not None:
            segment.close()
        return {}

    def _send(self, session: ClientSession, meta: Meta, fds: list[int]) -> None:
        self._start_transfer(session, meta, is_send=True)

    def _recv(self, session: ClientSession, meta: Meta, fds: list[int]) -> None:
        self._start_transfer(session, meta, is_send=False)

    def _start_transfer(self, session: ClientSession, meta: Meta, *, is_send: bool) -> None:
        if self.draining:
            raise OperationFailed("the daemon is stopping; retry later", code="daemon_stopping")
        op = next(self._op_ids)
        transfer = parse_transfer(session, meta, is_send=is_send)
        self.ops[op] = transfer
        session.ops.add(op)
        post = self.messaging.post_send if is_send else self.messaging.post_recv
        self._perform(post(op, transfer.message, self.loop.time()))

    def _status(self, session: ClientSession, meta: Meta, fds: list[int]) -> dict[str, Any]:
        return self.status()

    def _config(self, session: ClientSession, meta: Meta, fds: list[int]) -> dict[str, Any]:
        return {"config": self.loaded.describe()}

    def status(self) -> dict[str, Any]:
        """Everything ``fabricctl status`` and ``fabricctl peers`` show, JSON-ready."""
        now = self.loop.time()
        peer_rows = []
        for info in self.peers.peers(now):
            links = {
                ch.value: table.get(info.node)
                for ch, table in ((Channel.CONTROL, self.control), (Channel.DATA, self.data))
            }
            stats = [link.statistics() for link in links.values() if link is not None]
            peer_rows.append(
                {
                    "node": info.node,
                    "address": self.config.nodes[info.node],
                    "state": info.state.value,
                    "incarnation": info.incarnation,
                    "silent_for": info.silent_for,
                    "state_for": info.state_for,
                    "links": {ch: link is not None for ch, link in links.items()},
                    "bytes_sent": sum(s.bytes_sent for s in stats),
                    "bytes_received": sum(s.bytes_received for s in stats),
                }
            )
        return {
            "node": self.config.node_id,
            "nodes": len(self.config.nodes),
            "address": self.address,
            "socket": self.config.socket,
            "transport": self.transport.name,
            "incarnation": self.incarnation,
            "uptime": time.time() - self.started,
            "version": PROTOCOL_VERSION,
            "state": "draining" if self.draining else "serving",
            "peers": peer_rows,
            "clients": [s.describe() for s in self.sessions.values()],
            "ranks": [dataclasses.asdict(e) for e in self.messaging.routes.entries()],
            "pending_ops": self.messaging.pending(),
            "counters": {
                **self.counters,
                "bytes_received": self.inbound.bytes,
                "refused_links": self.peering.refused,
                "refused_clients": self.ipc.refused,
            },
        }


def _default_transport() -> Transport:
    """TCP, with one log line saying why not verbs (DESIGN §5)."""
    found = verbs_device.probe()
    if found.devices:
        log.info("transport: tcp (%s found, but this release has no verbs link yet)", found.reason)
    else:
        log.info("transport: tcp (%s)", found.reason)
    return TcpTransport()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
