"""The point-to-point service: ``send`` and ``recv`` requests, rendezvous frames, and bytes.

Drives :mod:`fabricd.engines.p2p.matching`.  Each request becomes an operation of the engine; the
service keeps, per operation, the client region its bytes come from or land in and the request
to answer, and performs what the engine decides: control frames to peers, a small message
whole as an EAGER frame on the control link (its bytes copied out of the segment), streaming a
send's region as DATA on the data link, a segment-to-segment copy for ranks on this node, an
eager message from the pool into its receive, and the reply when an operation completes.
Incoming DATA and EAGER payloads land where the engine says (its landing table,
:mod:`fabricd.engines.landing`, straight in the receiver's segment; or the eager pool).

Completion: a send is answered when its receiver has every byte, or, asked with ``wait="sent"``,
as soon as the daemon no longer needs the client's bytes: an eager send once its copy is made
(the copy, not the segment, then serves a fallback to rendezvous); larger sends are not copied
and are answered on delivery either way.  Such an early send stays in the engine until its
DONE, counted against its job but no longer its client.

A client that leaves takes its unmatched operations with it; a transfer already moving runs to
its end from the daemon's own mapping of the segment, and its result is dropped.

Bounds: a client may have ``max_ops_per_client`` operations pending, all clients of a job
``max_ops_per_job`` on this daemon (a transfer whose client left counts until it ends); the
next request fails with code ``limit`` naming the setting, and each refusal is counted.  Its
tables give back their memory the way the engine's do: once more operations ended than twice
the number still pending, they are rebuilt (amortised O(1) per operation).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.daemon.datapath import copy, stream
from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import OperationStats, counter, gauge
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.jobs import refuse_while_draining
from fabricd.daemon.sessions import parse_transfer
from fabricd.daemon.stalls import line, report
from fabricd.engines.actions import Complete, Failure, Notice, SendFrame
from fabricd.engines.counts import count_down
from fabricd.engines.p2p.matching import Messaging
from fabricd.engines.p2p.messages import CopyLocal, Place, SendEager, StreamData
from fabricd.engines.stalls import Stalled
from fabricd.errors import (
    ErrorCode,
    LocalProtocolError,
    OperationFailed,
    TransportError,
    UsageError,
)
from fabricd.frames import p2p as p2p_frames
from fabricd.wire import Kind, Meta

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.link.peers import PeerInfo
    from fabricd.engines.membership import RankEvent, Routes
    from fabricd.engines.p2p.messages import Action, Message
    from fabricd.frames import registry

log = logging.getLogger("fabricd.p2p")
#: transfers that failed for want of memory, fds or threads: a client that keeps asking while
#: the system is short must not flood the journal
short_log = RateLimitedLog(log)
#: stalled operations: each is reported once, but a whole job can stall at once
stall_log = RateLimitedLog(log)
#: the frames this service claims, as tuples: ``isinstance`` with a ``X | Y`` union built in the
#: call cost 0.35 us on every frame, against 0.09 us with a tuple built once
_CONTROL_FRAMES: Final = (
    p2p_frames.Rts,
    p2p_frames.Cts,
    p2p_frames.Done,
    p2p_frames.Cancel,
    p2p_frames.Rtr,
)
_PAYLOAD_FRAMES: Final = (p2p_frames.Data, p2p_frames.Eager)


@dataclass(slots=True, kw_only=True)
class _Transfer:
    """A send or receive a client asked for: what, from/into which bytes, which request."""

    request: int
    message: Message
    region: memoryview
    session: ClientSession | None  #: ``None`` once the client left; its bytes may still move
    kind: str  #: the request's op: ``send`` or ``recv``
    started: float  #: when the request arrived (the loop's clock), for its latency
    early: bool = False  #: a send asked with ``wait="sent"``: answered once its bytes are copied


class P2PService(BaseService):
    """MPI-style point-to-point messages between ranks."""

    name = "p2p"
    kinds = frozenset({Kind.RTS, Kind.CTS, Kind.DONE, Kind.CANCEL, Kind.DATA, Kind.EAGER, Kind.RTR})
    ops = frozenset({"send", "recv"})

    def __init__(
        self,
        host: Host,
        *,
        routes: Routes,
        peers: Callable[[float], Iterable[PeerInfo]] | None = None,
        owners: Callable[[str], int | None] | None = None,
    ) -> None:
        """``peers``: the peers engine's view of the other nodes (for stall reports: is the
        peer rank's node up); ``owners``: a job's owner (stall rows carry it)."""
        self.host = host
        cfg = host.config
        self.engine = Messaging(
            node=cfg.node_id,
            routes=routes,
            route_timeout=cfg.route_timeout,
            max_unmatched_rts_per_peer=cfg.max_unmatched_rts_per_peer,
            stall_after=cfg.stall_after,
            eager_limit=cfg.eager_limit,
            eager_credit=cfg.eager_credit,
            receiver_initiated=cfg.receiver_initiated,
        )
        self._peers = peers
        self._owners = owners
        self._ops: dict[int, _Transfer] = {}  #: every operation the engine may still act on
        #: operations by kind and their latency, for the metrics (fabricd/daemon/metrics.py)
        self.operations = OperationStats(self.name, kinds=sorted(self.ops))
        self._by_session: dict[ClientSession, set[int]] = {}
        self._by_job: dict[str, int] = {}  #: operations in ``_ops`` per job
        self._ended = 0  #: operations that left ``_ops`` since its tables were rebuilt
        self._refused = {"ops_refused_client_limit": 0, "ops_refused_job_limit": 0}
        self._op_ids = itertools.count(1)
        self._copies: set[asyncio.Task[None]] = set()  #: local copies under way
        self._counters = {
            "bytes_sent": 0,
            "bytes_copied": 0,
            "ops_completed": 0,
            "ops_failed": 0,
            "copies_failed": 0,  #: local copies that could not run (no thread, no memory)
            "sent_then_failed": 0,  #: wait="sent" sends answered, then refused by the receiver
        }

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> None:
        refuse_while_draining(self.host)
        session, kind = request.session, request.op
        is_send = kind == "send"
        message, region = parse_transfer(
            session, request.meta, is_send=is_send, messages=self.engine.messages
        )
        early = _early(request.meta, is_send)
        job = message.job
        held = self._by_session.get(session)
        self._admit(0 if held is None else len(held), job)
        op = next(self._op_ids)
        self._ops[op] = _Transfer(
            request=request.id,
            message=message,
            region=region,
            session=session,
            kind=kind,
            started=now,
            early=early,
        )
        self.operations.started(kind)
        if held is None:
            self._by_session[session] = {op}
        else:
            held.add(op)
        by_job = self._by_job
        by_job[job] = by_job.get(job, 0) + 1
        if is_send:
            self._perform(self.engine.post_send(op, message, now))
        else:
            self._perform(self.engine.post_recv(op, message, region, now))

    def client_gone(self, session: ClientSession, now: float) -> None:
        ops = self._by_session.pop(session, set())
        self._perform(self.engine.abandon(ops))
        for op in ops:
            transfer = self._ops.get(op)
            if transfer is None:  # completed by what was just performed
                continue
            self.operations.abandoned(transfer.kind)
            if self.engine.holds(op):  # a transfer under way keeps its region, not its client
                transfer.session = None
            else:
                self._forget(op)

    def _admit(self, held: int, job: str) -> None:
        """Refuse a new operation of a client with ``held`` pending beyond
        ``max_ops_per_client``, or of ``job`` beyond ``max_ops_per_job``.

        Raises:
            OperationFailed: code ``limit``, naming the limit and its setting (counted).
        """
        cfg = self.host.config
        if held >= cfg.max_ops_per_client:
            self._refused["ops_refused_client_limit"] += 1
            raise OperationFailed(
                f"this client has {held} operations pending, the most max_ops_per_client "
                "allows; wait for some to finish (or raise max_ops_per_client in the daemon's "
                "config)",
                code=ErrorCode.LIMIT,
            )
        held = self._by_job.get(job, 0)
        if held >= cfg.max_ops_per_job:
            self._refused["ops_refused_job_limit"] += 1
            raise OperationFailed(
                f"job {job!r} has {held} operations pending on node {cfg.node_id}, the most "
                "max_ops_per_job allows; wait for some to finish (or raise max_ops_per_job in "
                "the daemon's config)",
                code=ErrorCode.LIMIT,
            )

    def _forget(self, op: int) -> _Transfer | None:
        """Take ``op`` out of ``_ops`` and its job's count; rebuild the tables when many left.

        A Python dict or set never returns the memory of deleted entries: a client that had
        10^5 operations pending would otherwise leave ~10 MB behind.  Rebuilding costs
        O(operations pending) once more than twice that many ended: amortised O(1).
        """
        transfer = self._ops.pop(op, None)
        if transfer is None:
            return None
        count_down(self._by_job, transfer.message.job)
        self._ended += 1
        if self._ended > 2 * len(self._ops) + 1024:
            self._ops = dict(self._ops)
            self._by_session = {session: set(ops) for session, ops in self._by_session.items()}
            self._ended = 0
        return transfer

    # -- peers ------------------------------------------------------------------------------
    def on_frame(self, node: int, frame: registry.PeerFrame, now: float) -> None:
        assert isinstance(frame, _CONTROL_FRAMES)
        self._perform(self.engine.on_frame(node, frame, now))

    def payload_buffer(
        self, node: int, frame: registry.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, _PAYLOAD_FRAMES)  # the kinds this service claims
        return self.engine.payload_buffer(node, frame, length)

    def on_data(self, node: int, frame: registry.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, _PAYLOAD_FRAMES)
        self._perform(self.engine.data_arrived(node, frame, length, now))

    def peer_down(self, node: int, reason: str, now: float) -> None:
        self._perform(self.engine.peer_down(node, reason))

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        self._perform(self.engine.on_rank_event(event, now))

    # -- time and the drain -----------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return self.engine.next_deadline()

    def on_timer(self, now: float) -> None:
        self._perform(self.engine.on_timer(now))

    def in_flight(self) -> int:
        return self.engine.transfers()

    async def settle(self) -> None:
        if self._copies:
            await asyncio.wait(self._copies)

    def shutdown(self, failure: Failure) -> None:
        ops = [op for ops in self._by_session.values() for op in ops]
        self._perform(self.engine.abandon(ops))
        for op in ops:
            self._complete(op, failure)

    def statistics(self) -> Meta:
        stats = self.engine.statistics()
        cfg = self.host.config
        return {
            "pending_ops": self.engine.pending(),
            "unexpected_messages": stats.unexpected,  # sends, RTS and EAGER waiting for a receive
            "eager_pool_bytes": stats.eager_pool_bytes,  # eager payloads held for their receive
            "eager_pool_limit": cfg.eager_credit * max(len(cfg.nodes) - 1, 0),
            "counters": {
                **self._counters,
                **self._refused,
                "bytes_received": stats.bytes_received,
                "rts_refused_peer_limit": stats.refused_rts,
                "stalls_reported": stats.stalls_reported,
                "eager_sent": stats.eager_sent,
                "eager_no_credit": stats.eager_no_credit,
                "eager_pool_full": stats.eager_pool_full,
                "rtr_sent": stats.rtr_sent,
                "rtr_answered": stats.rtr_answered,
                "rtr_dropped": stats.rtr_dropped,
            },
        }

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Every operation pending longer than ``stall_after``, with what it waits for (those
        ``keep`` accepts, at most ``limit``: see :meth:`BaseService.stalls`)."""
        peers = self._peer_table(now)
        chosen = None if keep is None else (lambda op, job: keep(self._whose(op, job)))
        found = self.engine.stalls(now, chosen, limit)
        return [self._report(stall, peers) for stall in found]

    def _peer_table(self, now: float) -> dict[int, PeerInfo]:
        return {} if self._peers is None else {info.node: info for info in self._peers(now)}

    def _whose(self, op: int, job: str) -> Meta:
        """Whose operation ``op`` of ``job`` is: the fields of its row that access reads."""
        transfer = self._ops.get(op)
        session = None if transfer is None else transfer.session
        uid = None if session is None else session.conn.credentials.uid
        owner = None if self._owners is None else self._owners(job)
        return {"job": job, "owner": owner, "uid": uid}

    def _report(self, stall: Stalled, peers: dict[int, PeerInfo]) -> Meta:
        whose = self._whose(stall.op, stall.msg.job)
        return report(stall, peers, uid=whose["uid"], owner=whose["owner"])

    def client_statistics(self, session: ClientSession) -> Meta:
        return {"ops": len(self._by_session.get(session, ()))}

    def metrics(self) -> Iterable[Metric]:
        labels = {"service": self.name}
        self.operations.set_stalled(self.engine.stalled(self.host.now()))
        yield from self.operations.families(self.engine.pending())
        moved = (
            ("sent", self._counters["bytes_sent"]),
            ("received", self.engine.statistics().bytes_received),
            ("copied", self._counters["bytes_copied"]),
        )
        for direction, nbytes in moved:
            yield counter(
                f"fabricd_message_{direction}_bytes",
                f"Message payload bytes {direction} (to peers, from peers, between local ranks).",
                [(labels, nbytes)],
            )
        # the eager and RTR counters are in fabricd_status_counters; the pool is a level
        pool = self.statistics()
        yield gauge(
            "fabricd_eager_pool_bytes",
            "Bytes of eager messages held for their receive, from all peers.",
            [(labels, pool["eager_pool_bytes"])],
        )
        yield gauge(
            "fabricd_eager_pool_limit_bytes",
            "The most the eager pool may hold: eager_credit for each peer.",
            [(labels, pool["eager_pool_limit"])],
        )
        yield gauge(
            "fabricd_unexpected_messages",
            "Messages from peers (sends, RTS, EAGER) waiting for their receive, now.",
            [(labels, pool["unexpected_messages"])],
        )

    # -- performing the engine's actions ----------------------------------------------------
    def _perform(self, actions: Iterable[Action]) -> None:
        # wait="sent" replies go after every action: a reply may find its client gone (a failed
        # write closes the connection) and the client's other operations abandoned within it,
        # while an action of one of them (an EAGER the engine already counts as sent) is still
        # to be performed here.  The list and the try/finally that keep them are built only once
        # such a send turns up: most batches have none.
        todo = iter(actions)
        parted = self._perform_each(todo)
        if parted is None:
            return
        early = [parted]
        try:
            while (parted := self._perform_each(todo)) is not None:
                early.append(parted)
        finally:  # a send parted from its client is answered whatever came after it
            for session, transfer in early:
                self._answered(session, transfer, None)

    def _perform_each(self, todo: Iterator[Action]) -> tuple[ClientSession, _Transfer] | None:
        """Perform the actions of ``todo`` in order, up to one that parts a ``wait="sent"`` send
        from its client: return that client and send, for the caller to answer once the rest
        are performed (``None``: ``todo`` is done).  The cases go most frequent first."""
        for action in todo:
            match action:
                case Complete(op=op, failure=failure):
                    self._complete(op, failure)
                case SendFrame(node=node, frame=frame):
                    self.host.send(node, frame)
                case SendEager(node=node, op=op, frame=frame):
                    # a copy: the pool, not the segment, holds the bytes from here on
                    transfer = self._ops[op]
                    payload = bytes(transfer.region)
                    self.host.send(node, frame, [payload])
                    self._counters["bytes_sent"] += len(payload)
                    if transfer.early:
                        transfer.region = memoryview(payload)  # what a fallback (CTS) streams
                        session = self._answer_early(op, transfer)
                        if session is not None:
                            return session, transfer
                case Place(op=op, payload=payload):
                    _bytes_of(self._ops[op].region)[:] = payload
                case StreamData(node=node, msg=msg, op=op, rtr=rtr):
                    region = self._ops[op].region
                    if not self._send_at_once(node, msg, region, rtr):
                        self.host.spawn(self._stream(node, msg, region, rtr))
                case CopyLocal(src_op=src, dst_op=dst):
                    source, target = self._ops[src].region, self._ops[dst].region
                    task = self.host.spawn(self._copy(src, dst, source, target))
                    self._copies.add(task)
                    task.add_done_callback(self._copies.discard)
                case Notice(message=message):
                    log.warning("%s", message)
                case Stalled():
                    row = self._report(action, self._peer_table(self.host.now()))
                    stall_log.warning("stalled operation", "%s", line(row))
        return None

    def _send_at_once(self, node: int, msg: int, region: memoryview, rtr: int) -> bool:
        """Send a one-chunk message's DATA now if its link can take it without a wait.

        Saves a task and a loop iteration per small message; anything larger, or a link under
        backpressure, goes through :meth:`_stream`.  A failure fails this message only, as in
        :meth:`_stream`: it runs in the handler of the peer's CTS, where anything raised would
        close the control link and reset the peer.
        """
        link = self.host.data_link(node)
        if link is None or len(region) > self.host.config.chunk_size:
            return False
        try:
            chunk = p2p_frames.Data(msg=msg, off=0, rtr=rtr)
            if not link.send_now(Kind.DATA, chunk.to_meta(), [region]):
                return False
        except (TransportError, LocalProtocolError) as exc:
            self._perform(self.engine.stream_failed(msg, f"sending to node {node} failed: {exc}"))
            return True
        except Exception as exc:  # MemoryError, OSError: this message fails, the link stays
            code, reason = _trouble(exc, f"sending message {msg} to node {node}")
            self._perform(self.engine.stream_failed(msg, reason, code))
            return True
        self._counters["bytes_sent"] += len(region)
        return True

    async def _stream(self, node: int, msg: int, region: memoryview, rtr: int) -> None:
        # The region is held from the moment the stream is spawned: the operation may finish
        # (a DONE, a drain) while this task waits, and then no longer be in self._ops.
        # Whatever it raises fails this message only: nothing reaches the daemon's task group.
        link = self.host.data_link(node)
        try:
            if link is None:
                raise TransportError(f"no data link to node {node}")
            await stream(link, msg, region, self.host.config.chunk_size, rtr)
            self._counters["bytes_sent"] += len(region)
        except (TransportError, LocalProtocolError) as exc:
            reason = f"sending to node {node} failed: {exc}"
            self._settle(lambda: self.engine.stream_failed(msg, reason))
        except Exception as exc:  # MemoryError, OSError, RuntimeError: this message fails
            code, reason = _trouble(exc, f"sending message {msg} to node {node}")
            self._settle(lambda: self.engine.stream_failed(msg, reason, code))
        self.host.rearm()

    async def _copy(self, src: int, dst: int, source: memoryview, target: memoryview) -> None:
        # Whatever the copy raises fails these two operations only (a worker thread that cannot
        # start, MemoryError): nothing reaches the daemon's task group.
        try:
            await copy(target, source)
        except OperationFailed as exc:  # no worker thread (code resources)
            self._counters["copies_failed"] += 1
            short_log.log(logging.WARNING, "copy", "p2p: copy %d -> %d failed: %s", src, dst, exc)
            code, reason = ErrorCode.RESOURCES, str(exc)
            self._settle(lambda: self.engine.copy_failed(src, dst, code, reason))
        except Exception as exc:  # MemoryError, OSError, RuntimeError: these two fail
            self._counters["copies_failed"] += 1
            code, reason = _trouble(exc, f"copying operation {src} into {dst}")
            self._settle(lambda: self.engine.copy_failed(src, dst, code, reason))
        else:
            self._counters["bytes_copied"] += len(source)
            self._settle(lambda: self.engine.copied(src, dst))
        self.host.rearm()

    def _settle(self, report: Callable[[], Iterable[Action]]) -> None:
        """Tell the engine how a stream or copy task ended and perform what it decides.

        Runs in a task of the daemon's task group, where an exception would stop the daemon:
        an engine that refuses the report (a bug) is logged, and the daemon goes on.
        """
        try:
            self._perform(report())
        except Exception:
            log.exception("p2p: reporting the end of a transfer failed (a bug); going on")

    def _answer_early(self, op: int, transfer: _Transfer) -> ClientSession | None:
        """Part a ``wait="sent"`` send from its client, whom the caller answers (the session
        returned; ``None``: answered already, or the client left): its bytes are copied; the
        engine keeps it until its DONE, but its client may reuse the array and post more."""
        session = transfer.session
        if session is None:
            return None
        transfer.session = None  # its end, later, answers nobody
        held = self._by_session.get(session)
        if held is not None:
            held.discard(op)
        return session

    def _complete(self, op: int, failure: Failure | None) -> None:
        transfer = self._forget(op)
        if transfer is None:
            return
        session = transfer.session
        if session is None:
            if transfer.early and failure is not None:  # only the receiver hears of it
                self._counters["sent_then_failed"] += 1
            return
        held = self._by_session.get(session)
        if held is not None:
            held.discard(op)
        self._answered(session, transfer, failure)

    def _answered(
        self, session: ClientSession, transfer: _Transfer, failure: Failure | None
    ) -> None:
        """Reply to ``transfer``'s request, and count it."""
        message = transfer.message
        latency = self.host.now() - transfer.started
        code = None if failure is None else str(failure.code)
        self.operations.ended(transfer.kind, message.nbytes, latency, code)
        if failure is not None:
            self._counters["ops_failed"] += 1
            self.host.fail(session, transfer.request, failure)
            return
        self._counters["ops_completed"] += 1
        result: Meta = {"nbytes": message.nbytes, "src": message.src, "tag": message.tag}
        self.host.reply(session, transfer.request, result)


def _early(meta: Meta, is_send: bool) -> bool:
    """Whether a request asks to be answered once its bytes are copied (``wait="sent"``).

    Raises:
        UsageError: ``wait`` is not ``"delivered"`` or ``"sent"``, or is given to a receive.
    """
    wait = meta.get("wait", "delivered")
    if wait != "delivered" and wait != "sent":
        raise UsageError(f"wait must be 'delivered' or 'sent', not {wait!r}")
    if wait == "sent" and not is_send:
        raise UsageError("wait applies to sends only")
    return bool(wait == "sent")


def _bytes_of(region: memoryview) -> memoryview:
    """``region`` as a flat view of bytes (a client's region may carry its dtype's format)."""
    return region if region.format == "B" and region.ndim == 1 else region.cast("B")


def _trouble(exc: Exception, what: str) -> tuple[ErrorCode, str]:
    """The code and message a transfer fails with when ``what`` raised ``exc``.

    MemoryError and OSError are the system running short (code ``resources``); anything else
    is a bug in the daemon (``internal``), logged with its traceback.
    """
    if isinstance(exc, MemoryError | OSError):
        short_log.log(logging.WARNING, "short", "p2p: %s failed: %r", what, exc)
        return ErrorCode.RESOURCES, f"the daemon ran short while {what}: {exc!r}; retry later"
    log.error("p2p: %s failed (a bug)", what, exc_info=exc)
    return ErrorCode.INTERNAL, "internal error in the daemon (see its log)"
