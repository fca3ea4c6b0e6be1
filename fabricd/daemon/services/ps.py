"""The parameter-server service: ``ps_open``, ``ps_push``, ``ps_pull``, ``ps_stepped`` and
``ps_flush`` requests, and the PUSH, PULL, PUSHED, PULLED, REPLICATE, REPLICATED, JOIN and
OPENED frames.

Drives :class:`~fabricd.engines.ps.node.PSNode`, which takes every decision (routing to the
serving rank, held and early frames, epochs, failover and promotion, what is sent again): this
service parses and checks requests (the spec, the initial model, the arrays and the update
callback's step buffer in the client's segments, the update rule), lands payloads, and performs
what the engine returns -- data frames through :mod:`~fabricd.daemon.services.data_queues`,
control frames on the control link, replies, ``ps_epoch`` and ``ps_step`` events, log lines.
Status rows, stall rows (and each stalled call's log line) and metrics are
:mod:`~fabricd.daemon.services.ps_status`'s.

A model is named by (job, name); every rank of the job opens it with the same *spec* (size,
dtype, the server ranks, one per key-range shard, and their replica ranks, consistency,
staleness, delay bound, chunk); the job's other ranks are its workers.  An open unlike the
model's open here, or unlike a peer's (:mod:`~fabricd.engines.ps.agreement`: the daemons tell
each other, an open never waits for it), is refused with ``usage`` naming both; one found
later fails every call of the model's ranks here, and its shards' processes hear
``ps_disagreed``.  A server's state lives
as long as its process: the shard's process is its owner, and its leaving closes the shard.

Suspicion is membership's (:meth:`on_suspicion`): a rank lost with its node's links is
*suspected* (:meth:`PSNode.rank_suspected`: what is sent it waits), then back (its
:class:`RankJoined` follows, and :meth:`PSNode.rank_joined` sends what it may have lost) or gone
(:meth:`PSNode.rank_gone`: lost as a worker, replaced as a server).  A rank that left any other
way is gone at once (:meth:`on_rank_event`).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.daemon.services.jobs import Groups
from fabricd.daemon.services.ps_requests import check_spec, settings_of, spec_of
from fabricd.daemon.services.ps_status import Call, PSStatus
from fabricd.daemon.services.senders import Gate, Sender, earliest, sender
from fabricd.engines.actions import Complete, Failure, SendFrame
from fabricd.engines.membership import RankGone, RankJoined, RankSuspected
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.consistency import UpdateRule, update_rule
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.messages import describe
from fabricd.engines.ps.models import (
    CallDone,
    Disagreed,
    EpochMoved,
    Log,
    SendData,
    StepShard,
)
from fabricd.engines.ps.node import PSNode
from fabricd.engines.ps.storage import HEADER as PULL_HEADER
from fabricd.engines.ps.worker import shard_bounds
from fabricd.errors import ErrorCode, OperationFailed, RemoteProtocolError, UsageError
from fabricd.frames import ps as ps_frames
from fabricd.frames.fields import MAX_NAME
from fabricd.wire import Kind, Meta, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.services.senders import Waiting
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.budget import Charge
    from fabricd.engines.membership import Membership, RankEntry, RankEvent, Suspicion
    from fabricd.engines.monitor.table import LinkFigures
    from fabricd.engines.ps.models import Action, Key
    from fabricd.frames import registry

log = logging.getLogger("fabricd.ps")
remote_log = RateLimitedLog(log)

ROLES: Final = ("worker", "server", "replica")
_MAX_SERVERS: Final = 4096
_FILTER_FIELDS: Final = tuple(FilterSettings.__dataclass_fields__)


@dataclass(slots=True, kw_only=True)
class _Flush:
    """A server process's ``ps_flush``, answered once the engine completes it."""

    session: ClientSession
    request: int
    key: Key


class _Ranks:
    """What the engine reads of this daemon: membership's rank table, and whether a node's
    links are all up."""

    def __init__(self, host: Host, membership: Membership) -> None:
        self.host, self.membership = host, membership
        self._figures: tuple[float, dict[int, LinkFigures]] | None = None

    def lookup(self, job: str, rank: int, /) -> RankEntry | None:
        return self.membership.lookup(job, rank)

    def reachable(self, node: int, /) -> bool:
        return node == self.host.config.node_id or self.host.data_link(node) is not None

    def bandwidth(self, node: int, /) -> tuple[float, float] | None:
        """The monitor's (up, down) for ``node`` (a direction it knows nothing of at its own
        figure for unknown); ``None`` for a node it has no row for."""
        now = self.host.now()
        if self._figures is None or self._figures[0] != now:  # one table per timer tick
            self._figures = (now, self.host.network(now))
        figures = self._figures[1].get(node)
        return None if figures is None else (figures.up, figures.down)


#: arrays of the model's size a worker holds (its pulled model, a filter's residual, a push in
#: flight, with its few per-shard versions), and of
#: its shard's size a server or replica holds (parameters, versions, the last published copy
#: and a snapshot for a partner; lossless publishing one more), charged on the byte budget:
#: bounds measured on the engine (tests/unit/test_budget.py)
WORKER_COPIES: Final = 3
SHARD_COPIES: Final = 6


def shard_copies(spec: Meta) -> int:
    """Shard-sized arrays a server or replica of ``spec`` may hold: :data:`SHARD_COPIES`;
    under BSP the pushes it holds until every worker pushed the iteration (at most two per
    worker: a worker may push one iteration past the one not complete yet); with a replica,
    the log entries a primary keeps until its replica confirms them (one per worker)."""
    workers = spec["n"] - len(spec["servers"]) - len(spec["replicas"])
    bsp = 2 * workers if spec["consistency"] == "bsp" else 0
    return SHARD_COPIES + bsp + (workers if spec["replicas"] else 0)


class PSService(BaseService):
    """Parameter servers: workers push and pull, servers apply, replicas follow.  The
    decisions are the :class:`~fabricd.engines.ps.node.PSNode` engine's; this service parses
    requests, lands payloads and performs what the engine returns."""

    name = "ps"
    kinds = frozenset(
        {
            Kind.PUSH,
            Kind.PULL,
            Kind.PUSHED,
            Kind.PULLED,
            Kind.REPLICATE,
            Kind.REPLICATED,
            Kind.JOIN,
            Kind.OPENED,
            Kind.READY,
            Kind.GRANT,
            Kind.GATHER,
            Kind.PLAN,
        }
    )
    ops = frozenset({"ps_open", "ps_push", "ps_pull", "ps_stepped", "ps_flush"})

    def __init__(self, host: Host, *, membership: Membership) -> None:
        self.host = host
        self.membership = membership
        config = host.config
        self.engine = PSNode(
            node=config.node_id,
            ranks=_Ranks(host, membership),
            max_payload=config.max_payload,
            route_timeout=config.route_timeout,
            schedule_interval=config.schedule_interval,
        )
        self._sessions: dict[tuple[Key, int], ClientSession] = {}  #: local workers' clients
        self._calls: dict[tuple[Key, int], Call] = {}  #: their open push or pull
        #: (seg, off, nbytes) of each local worker's last pull: another array is pulled whole
        self._caches: dict[tuple[Key, int], tuple[int, int, int]] = {}
        self._owners: dict[tuple[Key, int], ClientSession] = {}  #: local shards' processes
        self._steps: dict[tuple[Key, int], np.ndarray[Any, Any]] = {}  #: callback buffers
        #: what each local worker and shard holds, on the byte budget
        self._charges: dict[tuple[str, Key, int], Charge] = {}
        self._flushes: dict[int, _Flush] = {}
        #: each client's places (worker, shard) and flushes, so that its requests and its
        #: departure touch only its own, however many the daemon holds
        self._worked: Groups[ClientSession, tuple[Key, int]] = Groups()
        self._served: Groups[ClientSession, tuple[Key, int]] = Groups()
        self._flushing: Groups[ClientSession, int] = Groups()
        self._flush_ids = itertools.count(1)
        #: payloads landing: (node, kind, job, name, shard, worker, n) -> buffer
        self._landing: dict[tuple[Any, ...], bytearray] = {}
        self._queues = {
            kind: DataQueues(host, kind, sent=self._count_sent)
            for kind in (Kind.PUSH, Kind.PULLED, Kind.REPLICATE)
        }
        self._bytes_sent = 0
        #: workers' frames only from the node their rank is on: refused, or waiting for it
        self._gate = Gate(
            host, membership, remote_log, self.engine.counters, "ps_frames_dropped", self._replay
        )
        self.status = PSStatus(
            name=self.name, host=host, membership=membership, engine=self.engine, calls=self._calls
        )
        self.operations = self.status.operations

    def _count_sent(self, nbytes: int) -> None:
        self._bytes_sent += nbytes

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> Meta | None:
        if self.host.draining:
            raise OperationFailed(
                "the daemon is stopping; retry later", code=ErrorCode.DAEMON_STOPPING
            )
        session = request.session
        if session.job is None:
            raise UsageError("connect with a job (fabricd.connect(job=...)) first")
        if request.op == "ps_open":
            return self._open(request, now)
        if request.op == "ps_stepped":
            return self._stepped(request, now)
        if request.op == "ps_flush":
            return self._flush_shards(request, now)
        key = self._side(request)
        if request.op == "ps_push":
            self._push(key, request, now)
        else:
            self._pull(key, request, now)
        return None

    def _open(self, request: Request, now: float) -> Meta:
        meta, session = request.meta, request.session
        job, rank = str(session.job), session.rank
        name = get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"a parameter server name has 1 to {MAX_NAME} characters")
        role = get_str(meta, "role")
        if role not in ROLES:
            raise UsageError(f"role {role!r}: one of {', '.join(ROLES)}")
        spec = spec_of(meta, session.size)
        self._check_spec(spec)
        key = (job, name)
        model = self.engine.model(key)
        if model is not None and model.spec != spec:
            raise UsageError(
                f"parameter server {name!r} of job {job!r} was opened here as "
                f"{describe(model.spec)}; this call says {describe(spec)}: every rank must "
                "open it alike"
            )
        refused, actions = self.engine.agreement.refusal(key, spec, rank, model)
        if refused is not None:  # unlike a peer's open: the job's other daemons are told
            self._perform(actions)
            raise UsageError(refused)
        servers, replicas = spec["servers"], spec["replicas"]
        if role == "worker" and (rank in servers or rank in replicas):
            raise UsageError(f"rank {rank} is a server or replica of {name!r}, not a worker")
        if role == "server" and rank not in servers:
            raise UsageError(f"rank {rank} is not one of {name!r}'s servers {servers}")
        if role == "replica" and rank not in replicas:
            raise UsageError(f"rank {rank} is not one of {name!r}'s replicas {replicas}")
        bounds = shard_bounds(spec["size"], len(servers))
        opened: Meta = {"shards": len(servers), "bounds": [list(b) for b in bounds]}
        settings = settings_of(meta.get("filters"))
        if role == "worker":
            seed = get_int(meta, "seed")
            charge = self._charge(key, spec, spec["size"], WORKER_COPIES, f"rank {rank}'s worker")
            try:
                actions = self.engine.open_worker(
                    key, spec, bounds, rank=rank, settings=settings, seed=seed, now=now
                )
            except BaseException:
                charge.release()
                raise
            self._sessions[key, rank] = session
            self._worked.add(session, (key, rank))
            self._charges["worker", key, rank] = charge
            self._perform(actions)
            return opened
        shard = (servers if role == "server" else replicas).index(rank)
        if model is not None and shard in model.servers:
            raise UsageError(f"shard {shard} of {name!r} is open here already")
        lo, hi = bounds[shard]
        initial = self._initial(request, spec, lo, hi)
        rule, step = self._rule(request, spec, hi - lo)
        charge = self._charge(key, spec, hi - lo, shard_copies(spec), f"shard {shard}")
        self._owners[key, shard] = session
        self._served.add(session, (key, shard))
        self._charges["shard", key, shard] = charge
        if step is not None:
            self._steps[key, shard] = step
        try:
            actions = self.engine.open_shard(
                key,
                spec,
                bounds,
                rank=rank,
                shard=shard,
                initial=initial,
                rule=rule,
                settings=settings,
                now=now,
            )
        except BaseException:  # not open: nothing of it stays, its bytes included
            del self._owners[key, shard]
            self._served.discard(session, (key, shard))
            self._steps.pop((key, shard), None)
            self._charges.pop(("shard", key, shard)).release()
            raise
        self._perform(actions)
        return {**opened, "shard": shard}

    def _charge(self, key: Key, spec: Meta, count: int, copies: int, what: str) -> Charge:
        """Charge ``copies`` arrays of ``count`` elements to the job's byte budget, before the
        engine makes them.

        Raises:
            OperationFailed: code ``limit``: the job or its owner's uid would go over its budget.
        """
        job, name = key
        owner = self.membership.owner(job)
        nbytes = copies * count * np.dtype(spec["dtype"]).itemsize
        what = f"{what} of parameter server {name!r} of job {job!r}"
        return self.host.budget.charge(-1 if owner is None else owner, job, nbytes, what)

    def _rule(
        self, request: Request, spec: Meta, count: int
    ) -> tuple[UpdateRule | None, np.ndarray[Any, Any] | None]:
        """The shard's update rule, or (a callback) the process's step buffer."""
        meta = request.meta
        rule_name = get_str(meta, "rule")
        numbers = {k: meta.get(k) for k in ("lr", "momentum", "lr_t0")}
        if any(
            isinstance(x, bool) or not isinstance(x, int | float | None) for x in numbers.values()
        ):
            raise UsageError(f"lr and momentum are numbers (or none), as is lr_t0; not {numbers}")
        lr_delay = meta.get("lr_delay")
        if not isinstance(lr_delay, str | None):
            raise UsageError(f"lr_delay is a name (or none), not {lr_delay!r}")
        if rule_name == "callback":  # the process steps the model in its own step buffer
            if lr_delay is not None or any(x is not None for x in numbers.values()):
                raise UsageError("lr=, momentum=, lr_delay= and lr_t0= are not a callback's")
            return None, self._step_buffer(request, spec, count)
        if rule_name in ("sum", "sgd"):  # update_rule refuses lr_delay= for another than sgd
            floats = {k: None if x is None else float(x) for k, x in numbers.items()}
            return update_rule(rule_name, lr_delay=lr_delay, **floats), None
        raise UsageError(f"update_rule {rule_name!r}: 'sum', 'sgd' or a callback")

    def _step_buffer(self, request: Request, spec: Meta, count: int) -> np.ndarray[Any, Any]:
        """The callback's buffer in the server process's memory: the model, then the update,
        ``count`` elements each."""
        dtype = np.dtype(spec["dtype"])
        nbytes = 2 * count * dtype.itemsize
        if get_int(request.meta, "step_nbytes") != nbytes:
            raise UsageError(f"the step buffer holds 2 x {count} elements of {dtype}")
        region = request.session.segment(get_int(request.meta, "step_seg")).view(
            get_int(request.meta, "step_off"), nbytes
        )
        return np.frombuffer(region, dtype=dtype).reshape(2, count)

    def _stepped(self, request: Request, now: float) -> Meta:
        """The server process ran its update callback: the new model is in its buffer."""
        session = request.session
        key = (str(session.job), get_str(request.meta, "name"))
        shard = get_int(request.meta, "shard")
        if self._owners.get((key, shard)) is not session:
            raise UsageError(f"this process serves no shard {shard} of {key[1]!r}")
        buffer = self._steps.get((key, shard))
        if buffer is None:
            raise UsageError(f"shard {shard} of {key[1]!r} has no update callback")
        version = get_int(request.meta, "version")
        self._perform(self.engine.stepped(key, shard, version, buffer[0].copy(), now))
        return {}

    def _flush_shards(self, request: Request, now: float) -> Meta | None:
        """The server process asks its shards to publish what the lossless mode held back;
        a replica's shard follows its primary's (``flushed`` false).  Answered once the
        flushes are processed; one behind an update callback the process has yet to run is
        published once it has (the process runs it after this call)."""
        session = request.session
        key = (str(session.job), get_str(request.meta, "name"))
        shards = [s for k, s in self._served.of(session) if k == key]
        if not shards:
            raise UsageError(f"this process serves no shard of {key[1]!r}")
        self._agreed(key)
        op = next(self._flush_ids)
        self._flushes[op] = _Flush(session=session, request=request.id, key=key)
        waits, actions = self.engine.flush(key, shards, op, now)
        if waits:
            self._flushing.add(session, op)
        else:
            del self._flushes[op]
        self._perform(actions)
        return None if waits else {"flushed": False}

    def _check_spec(self, spec: Meta) -> None:
        check_spec(spec)
        servers = spec["servers"]
        if spec["size"] < len(servers) or spec["chunk"] < 1:
            raise UsageError(f"{spec['size']} elements cannot be split over {len(servers)} servers")
        itemsize = np.dtype(spec["dtype"]).itemsize
        largest = -(-spec["size"] // len(servers)) * itemsize
        if largest + max(ps_push.HEADER.size, PULL_HEADER.size) > self.host.config.max_payload:
            raise OperationFailed(
                f"a shard of {largest} B travels whole in one frame, more than max_payload "
                f"({self.host.config.max_payload} B) allows: use more servers",
                code=ErrorCode.LIMIT,
            )

    def _initial(self, request: Request, spec: Meta, lo: int, hi: int) -> np.ndarray[Any, Any]:
        """A server's shard of the initial model: from the caller's array, or zeros."""
        dtype = np.dtype(spec["dtype"])
        seg = request.meta.get("seg")
        if seg is None:
            return np.zeros(hi - lo, dtype)
        nbytes = spec["size"] * dtype.itemsize
        if get_int(request.meta, "nbytes") != nbytes:
            raise UsageError(f"the initial model is {spec['size']} elements of {dtype}")
        region = request.session.segment(get_int(request.meta, "seg")).view(
            get_int(request.meta, "off"), nbytes
        )
        return np.frombuffer(region, dtype=dtype)[lo:hi].copy()

    def _side(self, request: Request) -> Key:
        """The model a local worker's push or pull is for, checked."""
        session = request.session
        name = get_str(request.meta, "name")
        key = (str(session.job), name)
        if self._sessions.get((key, session.rank)) is not session:
            raise UsageError(
                f"open parameter server {name!r} as a worker before pushing or pulling"
            )
        call = self._calls.get((key, session.rank))
        if call is not None:
            raise UsageError(f"a {call.op} of {name!r} is still open: wait for it first")
        self._agreed(key)
        failed = self.engine.failed(key)
        if failed is not None:
            shard, why = failed
            raise OperationFailed(
                f"shard {shard} of {name!r} has no server: {why}", code=ErrorCode.PEER_FAILED
            )
        return key

    def _agreed(self, key: Key) -> None:
        """Raises UsageError: ``key`` was opened two ways (both named)."""
        model = self.engine.model(key)
        if model is not None and model.disagreed is not None:
            raise UsageError(model.disagreed)

    def _array(self, request: Request, spec: Meta, writable: bool) -> np.ndarray[Any, Any]:
        meta = request.meta
        dtype = np.dtype(spec["dtype"])
        if get_str(meta, "dtype") != dtype.name or get_int(meta, "nbytes") != (
            spec["size"] * dtype.itemsize
        ):
            raise UsageError(
                f"this parameter server holds {spec['size']} elements of {dtype}, not "
                f"{get_int(meta, 'nbytes')} B of {get_str(meta, 'dtype')}"
            )
        region = request.session.segment(get_int(meta, "seg")).view(
            get_int(meta, "off"), get_int(meta, "nbytes")
        )
        return np.frombuffer(region, dtype=dtype)

    def _push(self, key: Key, request: Request, now: float) -> None:
        model = self.engine.models[key]
        update = self._array(request, model.spec, writable=False)
        rank = request.session.rank
        norm = request.meta.get("norm")
        if norm is not None and (type(norm) is not float or not 0 <= norm < math.inf):
            raise UsageError(f"norm is a finite number >= 0 or None, not {norm!r}")
        # refused before anything is sent
        actions = self.engine.push(key, rank, update, now, norm)
        self._calls[key, rank] = Call(
            session=request.session, request=request.id, started=now, op="push"
        )
        self.status.opened((key, rank), now)
        self.operations.started("push")
        self._perform(actions)

    def _pull(self, key: Key, request: Request, now: float) -> None:
        model = self.engine.models[key]
        out = self._array(request, model.spec, writable=True)
        rank = request.session.rank
        cache = (
            get_int(request.meta, "seg"),
            get_int(request.meta, "off"),
            get_int(request.meta, "nbytes"),
        )
        fresh = cache != self._caches.get((key, rank))
        actions = self.engine.pull(key, rank, out, fresh=fresh, now=now)
        self._caches[key, rank] = cache
        self._calls[key, rank] = Call(
            session=request.session, request=request.id, started=now, op="pull"
        )
        self.status.opened((key, rank), now)
        self.operations.started("pull")
        self._perform(actions)

    # -- performing the engine's actions ----------------------------------------------------
    def _perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendData):
                frame = action.frame
                queue = self._queues[frame.KIND]
                queue.send(action.node, frame.to_meta(), memoryview(action.payload))
            elif isinstance(action, SendFrame):
                self.host.send(action.node, action.frame)
            elif isinstance(action, CallDone):
                self._answer(action.key, action.rank, action.failure, action.result)
            elif isinstance(action, EpochMoved):
                session = self._sessions.get((action.key, action.rank))
                if session is not None:
                    fields = {
                        "name": action.key[1],
                        "shard": action.shard,
                        "epoch": action.epoch,
                        "server": action.server,
                        "reason": action.reason,
                        "rollback": action.rollback,
                    }
                    self.host.push(session, "ps_epoch", fields)
            elif isinstance(action, StepShard):
                self._step(action)
            elif isinstance(action, Disagreed):
                self._disagreed(action)
            elif isinstance(action, Complete):
                flush = self._flushes.pop(action.op, None)
                if flush is None:
                    continue
                self._flushing.discard(flush.session, action.op)
                if action.failure is not None:
                    self.host.fail(flush.session, flush.request, action.failure)
                else:
                    self.host.reply(flush.session, flush.request, {"flushed": True})
            else:
                assert isinstance(action, Log)
                if action.topic is not None:
                    remote_log.warning(action.topic, "%s", action.message)
                else:
                    log.log(action.level, "%s", action.message)

    def _disagreed(self, action: Disagreed) -> None:
        """The model was opened two ways: said in the log, and to the processes of its shards
        here (``ps_disagreed``: their ``serve()`` raises it; the workers' calls fail)."""
        log.warning("%s", action.message)
        model = self.engine.model(action.key)
        for shard in [] if model is None else model.servers:
            owner = self._owners.get((action.key, shard))
            if owner is not None:
                fields = {"name": action.key[1], "message": action.message}
                self.host.push(owner, "ps_disagreed", fields)

    def _step(self, action: StepShard) -> None:
        """Hand the shard's process the update callback's step: its buffer, then an event."""
        place = (action.key, action.shard)
        buffer = self._steps[place]
        buffer[0] = action.step.model
        buffer[1] = action.step.update
        fields = {"name": action.key[1], "shard": action.shard, "version": action.step.version}
        self.host.push(self._owners[place], "ps_step", fields)

    def _answer(self, key: Key, rank: int, failure: Failure | None, result: Meta | None) -> None:
        call = self._calls.pop((key, rank), None)
        if call is None:
            return
        self.status.closed((key, rank))
        seconds = self.host.now() - call.started
        if failure is not None:
            self.operations.ended(call.op, 0, seconds, str(failure.code))
            self.host.fail(call.session, call.request, failure)
            return
        assert result is not None
        size = self.engine.models[key].spec["size"]
        self.operations.ended(call.op, size, seconds, None)
        self.host.reply(call.session, call.request, result)

    # -- frames -----------------------------------------------------------------------------
    def payload_buffer(
        self, node: int, frame: registry.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate)
        if length > self.host.config.max_payload:
            raise RemoteProtocolError(f"a {frame.KIND.name} of {length} B")
        if isinstance(frame, ps_frames.Push):  # (on_data counts what is refused)
            verdict = sender(self.membership, node, frame.job, frame.worker)
            if verdict is Sender.NOT_YET:
                return self._gate.hold(node, frame.job, frame.worker, frame, length)
            if verdict is not Sender.MEMBER:
                return None
        if not self.engine.may_send(node, frame):  # read and dropped; on_data counts it
            return None
        buffer = bytearray(length)
        self._landing[_landing_key(node, frame)] = buffer
        return memoryview(buffer)

    def on_data(self, node: int, frame: registry.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate)
        payload = self._landing.pop(_landing_key(node, frame), None)
        if payload is None and self._gate.landed(node, frame, now):
            return  # waits for its worker's announcement
        self.on_frame(node, frame, now, b"" if payload is None else bytes(payload))

    def on_frame(self, node: int, frame: registry.PeerFrame, now: float, data: bytes = b"") -> None:
        """A peer's frame (``data``: its payload), for the engine if its sender is a member.

        A worker's PUSH or PULL counts only from the node its worker rank lives on; one from
        anywhere else, or of a job none of whose ranks is known here, is refused and counted
        before anything is allocated or held for it (issue 28, item 2: such pushes were held
        as early frames, for ever, for any job name), and one whose worker is not announced
        yet waits for it (:mod:`~fabricd.daemon.services.senders`).  A server's or
        replica's frame the engine judges by its own stricter rule (its rank must be known
        on that node; one that overtook its announcement is sent again): a stranger's is
        counted here too."""
        if isinstance(frame, ps_frames.Push | ps_frames.Pull | ps_frames.Ready):
            verdict = self._gate.judge(node, frame.job, frame.worker)
            if verdict is Sender.NOT_YET:  # (a push whose rank left while it landed, too)
                view = self._gate.hold(node, frame.job, frame.worker, frame, len(data))
                if view is not None:
                    view[:] = data
                    self._gate.landed(node, frame, now)
                return
            if verdict is Sender.NO_JOB:  # nothing here serves it (and a stranger's job
                self.engine.counters["ps_frames_dropped"] += 1  # names must hold nothing)
            if verdict is not Sender.MEMBER:
                return
        else:
            assert isinstance(
                frame,
                ps_frames.Pushed
                | ps_frames.Pulled
                | ps_frames.Replicate
                | ps_frames.Replicated
                | ps_frames.Join
                | ps_frames.Opened
                | ps_frames.Grant
                | ps_frames.Gather
                | ps_frames.Plan,
            )
            if isinstance(frame, ps_frames.Opened):
                rank = frame.rank
            elif isinstance(frame, ps_frames.Replicated | ps_frames.Join):
                rank = frame.replica
            elif isinstance(frame, ps_frames.Pulled):
                rank = frame.sender  # (a distributor's, for a forwarded answer)
            elif isinstance(frame, ps_frames.Plan):
                rank = frame.lead
            else:
                rank = frame.server
            if sender(self.membership, node, frame.job, rank) is Sender.STRANGER:
                self.engine.counters["frames_refused_not_member"] += 1
        self._perform(self.engine.on_frame(node, frame, data, now))

    def _replay(self, held: Waiting, now: float) -> None:
        """A worker's frame that waited for its rank's announcement, as if it came now."""
        frame = held.frame
        if isinstance(frame, ps_frames.Push) and held.payload is not None:
            view = self.payload_buffer(held.node, frame, len(held.payload))
            if view is not None:
                view[:] = held.payload
            self.on_data(held.node, frame, len(held.payload), now)
        else:
            self.on_frame(held.node, frame, now)

    # -- peers, ranks, clients ----------------------------------------------------------------
    def peer_up(self, node: int, now: float) -> None:
        self._perform(self.engine.peer_up(node, now))

    def peer_down(self, node: int, reason: str, now: float) -> None:
        for queue in self._queues.values():
            queue.drop(node)
        self._landing = {k: b for k, b in self._landing.items() if k[0] != node}
        self._gate.drop_node(node)

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        job, rank = event.entry.job, event.entry.rank
        if isinstance(event, RankJoined):
            self._perform(self.engine.rank_joined(job, rank, event.entry.node, now))
            self._gate.release(job, rank, now)
        elif not self.membership.suspected(job, rank):  # else on_suspicion decides
            self._perform(self.engine.rank_gone(job, rank, event.reason, now))

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        """A rank lost with its node's links waits (suspected) or is gone; one back is
        sent what it may have lost by the :class:`RankJoined` that follows."""
        match event:
            case RankSuspected(entry=entry):
                self.engine.rank_suspected(entry.job, entry.rank)
            case RankGone(entry=entry, reason=reason):
                self._perform(self.engine.rank_gone(entry.job, entry.rank, reason, now))

    def client_gone(self, session: ClientSession, now: float) -> None:
        for place in self._worked.pop(session):
            del self._sessions[place]
            self._caches.pop(place, None)
            call = self._calls.pop(place, None)
            if call is not None:
                self.status.closed(place)
                self.operations.abandoned(call.op)
            self.status.retire(self.engine.close_worker(*place), None)
            self._charges.pop(("worker", *place)).release()
        for op in self._flushing.pop(session):
            self.engine.drop_flush(self._flushes.pop(op).key, op)
        for place in self._served.pop(session):
            del self._owners[place]
            self._steps.pop(place, None)
            self.status.retire(None, self.engine.close_shard(*place))
            self._charges.pop(("shard", *place)).release()

    # -- time, the drain --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        engine, gate = self.engine.next_deadline(), self._gate.next_deadline()
        return earliest(engine, gate, self.status.next_stall())

    def on_timer(self, now: float) -> None:
        self._perform(self.engine.on_timer(now))
        self._gate.expire(now)
        self.status.log_stalls(now)

    def shutdown(self, failure: Failure) -> None:
        for key, rank in list(self._calls):
            self._answer(key, rank, failure, None)
        for op, flush in list(self._flushes.items()):
            self.engine.drop_flush(flush.key, op)
            self.host.fail(flush.session, flush.request, failure)
            self._flushing.discard(flush.session, op)
        self._flushes.clear()

    # -- status and metrics -----------------------------------------------------------------
    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Pushes and pulls open longer than ``stall_after``, saying which shards they wait
        for."""
        return self.status.stalls(now, keep, limit)

    def statistics(self) -> Meta:
        counters = {"ps_bytes_sent": self._bytes_sent, **self.engine.counters}
        return self.status.statistics(counters)

    def client_statistics(self, session: ClientSession) -> Meta:
        """Its open pushes and pulls, from its own places (a status row must not walk every
        client's calls)."""
        return {"ps_calls": sum(1 for place in self._worked.of(session) if place in self._calls)}

    def metrics(self) -> Iterable[Metric]:
        return self.status.metrics()


def _landing_key(
    node: int, frame: ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate
) -> tuple[Any, ...]:
    if isinstance(frame, ps_frames.Push):
        return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.worker, frame.iteration)
    if isinstance(frame, ps_frames.Pulled):
        return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.worker, frame.clock)
    return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.index, 0)
