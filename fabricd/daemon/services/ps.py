"""The parameter-server service: ``ps_open``, ``ps_push`` and ``ps_pull`` requests, and the
PUSH, PULL, PUSHED, PULLED, REPLICATE and REPLICATED frames.

Drives :mod:`fabricd.engines.ps.worker` (one :class:`~fabricd.engines.ps.worker.Worker` per
local worker rank of a model) and :mod:`fabricd.engines.ps.server` (one
:class:`~fabricd.engines.ps.server.ShardServer` per local server or replica rank).  A model is
named by (job, name); every rank of the job opens it with the same *spec* (size, dtype, the
server ranks, one per key-range shard, and their replica ranks, consistency, staleness, delay
bound, chunk); the job's other ranks are its workers.

The data plane: a push travels to each shard's server as one PUSH frame on the data link (the
filtered update, :mod:`fabricd.engines.ps.push`), a pull as a PULL on the control link, its
answer as a PULLED on the data link (the changed parameters, :mod:`fabricd.engines.ps.storage`),
applied by the worker's daemon straight into the worker's array (its cache); the ack of a
processed push is a PUSHED on the control link.  A primary forwards each entry to its replica
as a REPLICATE (data) and processes it once the replica's REPLICATED says it is logged.
Between ranks of one node the frames are handed over in memory, in the same order.

Faults: after a reset of a peer's links every unacknowledged push, unanswered pull and
unconfirmed replication entry to it is sent again, and the servers recognise what they took
already (exactly once: ``fabricd.engines.ps.server``).  A server rank that leaves (its process
ended, or its node was down longer than ``down_after``) is replaced by its replica, one epoch
later: local workers send the replica what is in flight, their clients hear ``ps_epoch``; a
shard with no replica fails its workers' calls with ``peer_failed``.  A worker that leaves is
lost to the model's coordinators (BSP and SSP stop waiting for it).  A server's state lives as
long as its process: the shard's process is its owner.

Frames for a model whose server has not opened it yet are held (at most ``_MAX_EARLY``): a
pull for ``route_timeout``, then answered with an error; a push until the server opens it, or
its worker or that server rank is gone (answered as dropped, its worker's clock would run
ahead of the server's).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import Histogram, OperationStats, counter, gauge, histogram
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.actions import Failure
from fabricd.engines.membership import RankJoined, RankLeft
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.consistency import (
    CONSISTENCIES,
    DELAY_BUCKETS,
    Consistency,
    UpdateRule,
    update_rule,
)
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.server import (
    FLUSH,
    LOSE,
    PUSH,
    Acked,
    Answer,
    Entry,
    Forward,
    Logged,
    Refuse,
    ShardServer,
    ShardStatistics,
    Snapshot,
    Step,
)
from fabricd.engines.ps.storage import HEADER as PULL_HEADER
from fabricd.engines.ps.worker import (
    PullDone,
    PullFailed,
    PushDone,
    SendPull,
    SendPush,
    Worker,
    WorkerStatistics,
    shard_bounds,
)
from fabricd.errors import (
    ErrorCode,
    OperationFailed,
    RemoteProtocolError,
    UsageError,
)
from fabricd.frames import ps as ps_frames
from fabricd.frames.fields import MAX_NAME, MAX_RANK
from fabricd.frames.ps import MAX_PS_REASON
from fabricd.wire import Kind, Meta, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd import frames
    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.membership import Membership, RankEvent
    from fabricd.engines.ps.server import Action as ServerAction
    from fabricd.engines.ps.worker import Action as WorkerAction

log = logging.getLogger("fabricd.ps")
remote_log = RateLimitedLog(log)

Key = tuple[str, str]  #: (job, model name)
ROLES: Final = ("worker", "server", "replica")
#: frames held for models not opened here yet, at most
_MAX_EARLY: Final = 1024
#: ... holding at most this many max_payloads of payload bytes in all (each table)
_HELD_PAYLOADS: Final = 4
_MAX_SERVERS: Final = 4096
_FILTER_FIELDS: Final = tuple(FilterSettings.__dataclass_fields__)


@dataclass(slots=True, kw_only=True)
class _Call:
    """A worker's push or pull the engine holds: whom to answer."""

    session: ClientSession
    request: int
    started: float
    op: str


@dataclass(slots=True, kw_only=True)
class _Flush:
    """A server process's ``ps_flush``, answered once each of its shards processed its flush
    entry (with a replica, after the replica's confirmation): a pull after it gets the exact
    model."""

    session: ClientSession
    request: int
    waits: dict[int, tuple[int, int]]  #: shard -> (its flush's log index, the epoch then)


@dataclass(slots=True, kw_only=True)
class _WorkerSide:
    """A local worker rank of a model."""

    session: ClientSession
    engine: Worker
    call: _Call | None = None
    out: np.ndarray[Any, Any] | None = None  #: the pull's target (the cache)
    cache_key: tuple[int, int, int] | None = None  #: (seg, off, nbytes) of the last pull's


@dataclass(slots=True, kw_only=True)
class _Model:
    spec: Meta
    bounds: list[tuple[int, int]]
    workers: tuple[int, ...]
    servers: dict[int, ShardServer] = field(default_factory=dict)  #: local shards
    owners: dict[int, ClientSession] = field(default_factory=dict)  #: their processes
    ranks: dict[int, int] = field(default_factory=dict)  #: their ranks
    local_workers: dict[int, _WorkerSide] = field(default_factory=dict)
    steps: dict[int, np.ndarray[Any, Any]] = field(default_factory=dict)  #: callback buffers
    epochs: dict[int, int] = field(default_factory=dict)  #: shard -> epoch, as workers see it
    failed: dict[int, str] = field(default_factory=dict)  #: shards nobody serves any more
    #: shards whose local rank, without state, answered its partner's JOIN with its own since
    #: it last asked of itself: it answers one, so two partners without state stop there
    answered: set[int] = field(default_factory=set)
    #: shards opened here as primary at epoch 0 while their partner was there: served only
    #: once the partner answered (with a later epoch's state, this rank came back after a
    #: failover, and serving the initial model would take the workers' versions back)
    tentative: set[int] = field(default_factory=set)
    flushes: list[_Flush] = field(default_factory=list)  #: answered once processed

    def target(self, shard: int) -> int:
        """The rank serving ``shard`` now: its server at even epochs, its replica at odd ones
        (each failover hands the shard to the other of the two)."""
        if self.spec["replicas"] and self.epochs.get(shard, 0) % 2:
            return int(self.spec["replicas"][shard])
        return int(self.spec["servers"][shard])

    def rank_of(self, shard: int) -> int:
        """The local rank that opened ``shard`` (server or replica)."""
        return self.ranks[shard]

    def pair(self, shard: int) -> tuple[int, ...]:
        """The ranks that may serve ``shard``: its server, and its replica if it has one."""
        return (
            int(self.spec["servers"][shard]),
            *(int(r) for r in self.spec["replicas"][shard : shard + 1]),
        )

    def partner(self, shard: int, rank: int) -> int | None:
        """The other rank of ``shard``'s pair, if it has a replica."""
        if not self.spec["replicas"]:
            return None
        pair = (int(self.spec["servers"][shard]), int(self.spec["replicas"][shard]))
        return pair[1] if rank == pair[0] else pair[0]


@dataclass(slots=True, kw_only=True)
class _Early:
    """A frame for a model not opened here yet: refused at its ``deadline``, but a push to a
    rank of its shard (``deadline`` None) waits for that rank however long, or until it or the
    push's worker is gone (answered as dropped, it would leave the worker's clock one ahead of
    the coordinator's, and BSP and SSP refuse a push that skips an iteration)."""

    node: int
    frame: ps_frames.Push | ps_frames.Pull
    payload: bytes
    deadline: float | None


class PSService(BaseService):
    """Parameter servers: workers push and pull, servers apply, replicas follow."""

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
        }
    )
    ops = frozenset({"ps_open", "ps_push", "ps_pull", "ps_stepped", "ps_flush"})

    def __init__(self, host: Host, *, membership: Membership) -> None:
        self.host = host
        self.membership = membership
        self.models: dict[Key, _Model] = {}
        self._early: list[_Early] = []
        #: ranks whose node's links were reset: (job, rank) -> when they count as gone
        self._suspects: dict[tuple[str, int], float] = {}
        #: frames for ranks lost with their node's links or on a node whose links are not all
        #: up: sent once the rank is known and they are (at most ``_MAX_EARLY`` in all)
        self._held: dict[tuple[str, int], list[tuple[frames.PeerFrame, bytes]]] = {}
        #: payloads landing: (node, kind, job, name, shard, worker, n) -> buffer
        self._landing: dict[tuple[Any, ...], bytearray] = {}
        self._local: deque[tuple[int, frames.PeerFrame, bytes]] = deque()
        self._flushing = False
        self._queues = {
            kind: DataQueues(host, kind, sent=self._count_sent)
            for kind in (Kind.PUSH, Kind.PULLED, Kind.REPLICATE)
        }
        self.operations = OperationStats(self.name, kinds=["push", "pull"])
        #: what models gone from this node counted, kept so that counters never go back
        self._retired: Counter[str] = Counter()
        self._counters = {
            "ps_bytes_sent": 0,
            "ps_frames_dropped": 0,  #: for a model, shard or worker not here
            "ps_early_expired": 0,
            "ps_failovers": 0,
        }

    def _count_sent(self, nbytes: int) -> None:
        self._counters["ps_bytes_sent"] += nbytes

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> Meta | None:
        if self.host.draining:
            raise OperationFailed(
                "the daemon is stopping; retry later", code=ErrorCode.DAEMON_STOPPING
            )
        session = request.session
        if session.job is None:
            raise UsageError("connect with a job (fabricd.connect(job=...)) first")
        try:
            if request.op == "ps_open":
                return self._open(request, now)
            if request.op == "ps_stepped":
                return self._stepped(request, now)
            if request.op == "ps_flush":
                return self._flush_shards(request, now)
            side = self._side(request)
            if request.op == "ps_push":
                self._push(side, request, now)
            else:
                self._pull(side, request, now)
            return None
        finally:
            self._flush()

    def _open(self, request: Request, now: float) -> Meta:
        meta, session = request.meta, request.session
        job, rank = str(session.job), session.rank
        name = get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"a parameter server name has 1 to {MAX_NAME} characters")
        role = get_str(meta, "role")
        if role not in ROLES:
            raise UsageError(f"role {role!r}: one of {', '.join(ROLES)}")
        spec = _spec(meta, session.size)
        self._check_spec(spec)
        key = (job, name)
        model = self.models.get(key)
        if model is not None and model.spec != spec:
            raise UsageError(
                f"parameter server {name!r} of job {job!r} was opened here as "
                f"{_describe(model.spec)}; this call says {_describe(spec)}: every rank must "
                "open it alike"
            )
        servers, replicas = spec["servers"], spec["replicas"]
        if role == "worker" and (rank in servers or rank in replicas):
            raise UsageError(f"rank {rank} is a server or replica of {name!r}, not a worker")
        if role == "server" and rank not in servers:
            raise UsageError(f"rank {rank} is not one of {name!r}'s servers {servers}")
        if role == "replica" and rank not in replicas:
            raise UsageError(f"rank {rank} is not one of {name!r}'s replicas {replicas}")
        if model is None:
            model = _Model(
                spec=spec,
                bounds=shard_bounds(spec["size"], len(servers)),
                workers=tuple(
                    r for r in range(spec["n"]) if r not in servers and r not in replicas
                ),
            )
        settings = _settings(meta.get("filters"))
        if role == "worker":
            if rank in model.local_workers:
                raise UsageError(f"rank {rank} opened parameter server {name!r} already")
            worker = Worker(
                worker=rank,
                size=spec["size"],
                dtype=spec["dtype"],
                shards=len(servers),
                settings=settings,
                delay_bound=spec["delay_bound"],
                seed=get_int(meta, "seed"),
            )
            worker.epochs = [model.epochs.get(shard, 0) for shard in range(len(servers))]
            model.local_workers[rank] = _WorkerSide(session=session, engine=worker)
            self.models[key] = model
            return {"shards": len(servers), "bounds": [list(b) for b in model.bounds]}
        shard = (servers if role == "server" else replicas).index(rank)
        if shard in model.servers:
            raise UsageError(f"shard {shard} of {name!r} is open here already")
        lo, hi = model.bounds[shard]
        initial = self._initial(request, spec, lo, hi)
        rule_name = get_str(meta, "rule")
        lr, momentum = meta.get("lr"), meta.get("momentum")
        if any(
            isinstance(x, bool) or not isinstance(x, int | float | None) for x in (lr, momentum)
        ):
            raise UsageError(f"lr and momentum are numbers (or none), not {lr!r} and {momentum!r}")
        rule: UpdateRule | None = None
        if rule_name == "callback":  # the process steps the model in its own step buffer
            step = self._step_buffer(request, spec, hi - lo)
        elif rule_name in ("sum", "sgd"):
            step = None
            rule = update_rule(
                rule_name,
                lr=None if lr is None else float(lr),
                momentum=None if momentum is None else float(momentum),
            )
        else:
            raise UsageError(f"update_rule {rule_name!r}: 'sum', 'sgd' or a callback")
        model.servers[shard] = ShardServer(
            initial=initial,
            workers=model.workers,
            consistency=Consistency(spec["consistency"]),
            staleness=spec["staleness"],
            delay_bound=spec["delay_bound"],
            rule=rule,
            settings=settings,
            chunk=spec["chunk"],
            # a rank that opens its shard after a failover (or not as its server) has no state
            # of its own: it joins its partner, which sends it the shard's
            replica=role == "replica" or model.epochs.get(shard, 0) > 0,
            replicated=bool(replicas),
        )
        model.owners[shard] = session
        model.ranks[shard] = rank
        if step is not None:
            model.steps[shard] = step
        self.models[key] = model
        partner = model.partner(shard, rank)
        if (
            model.servers[shard].primary
            and partner is not None
            and self.membership.lookup(job, partner) is not None
        ):
            model.tentative.add(shard)
        self._join(key, shard)
        self._take_early(key, now)
        return {"shards": len(servers), "bounds": [list(b) for b in model.bounds], "shard": shard}

    def _join(self, key: Key, shard: int) -> None:
        """Ask the shard's partner for its state (it ignores this if it has none to give)."""
        model = self.models[key]
        model.answered.discard(shard)
        rank = model.rank_of(shard)
        partner = model.partner(shard, rank)
        if partner is None:
            return
        self._send(
            key[0],
            partner,
            ps_frames.Join(
                job=key[0],
                name=key[1],
                shard=shard,
                server=partner,
                replica=rank,
                epoch=model.servers[shard].epoch,
                spec=model.spec,
            ),
        )

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
        model = self.models.get(key)
        shard = get_int(request.meta, "shard")
        server = None if model is None else model.servers.get(shard)
        if model is None or server is None or model.owners.get(shard) is not session:
            raise UsageError(f"this process serves no shard {shard} of {key[1]!r}")
        buffer = model.steps.get(shard)
        if buffer is None:
            raise UsageError(f"shard {shard} of {key[1]!r} has no update callback")
        actions = server.stepped(get_int(request.meta, "version"), buffer[0].copy(), now)
        self._server(key, shard, actions)
        return {}

    def _flush_shards(self, request: Request, now: float) -> Meta | None:
        """The server process asks its shards to publish what the lossless mode held back;
        a replica's shard follows its primary's (``flushed`` false).  Answered once the
        flushes are processed (:class:`_Flush`); one behind an update callback the process has
        yet to run is published once it has (the process runs it after this call)."""
        session = request.session
        key = (str(session.job), get_str(request.meta, "name"))
        model = self.models.get(key)
        shards = [] if model is None else [s for s, o in model.owners.items() if o is session]
        if model is None or not shards:
            raise UsageError(f"this process serves no shard of {key[1]!r}")
        flush = _Flush(session=session, request=request.id, waits={})
        for shard in shards:
            server = model.servers[shard]
            if server.primary:
                flush.waits[shard] = (server.statistics().logged + 1, server.epoch)
                self._server(key, shard, server.flush(now))
        if not flush.waits:
            return {"flushed": False}
        model.flushes.append(flush)
        self._flushed(model)
        return None

    def _check_spec(self, spec: Meta) -> None:
        servers, replicas, n = spec["servers"], spec["replicas"], spec["n"]
        ranks = [*servers, *replicas]
        if not servers or len(servers) > _MAX_SERVERS:
            raise UsageError(f"a parameter server has 1 to {_MAX_SERVERS} server ranks")
        if replicas and len(replicas) != len(servers):
            raise UsageError("replicas: none, or one rank per server (shard)")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks):
            raise UsageError(f"servers and replicas are distinct ranks of the job's 0..{n - 1}")
        if len(ranks) >= n:
            raise UsageError("a parameter server needs at least one worker rank")
        if spec["dtype"] not in DTYPES:
            raise UsageError(f"dtype {spec['dtype']!r}: one of {', '.join(DTYPES)}")
        if spec["consistency"] not in CONSISTENCIES:
            raise UsageError(
                f"consistency {spec['consistency']!r}: one of {', '.join(CONSISTENCIES)}"
            )
        if spec["staleness"] and spec["consistency"] != "ssp":
            raise UsageError("staleness belongs to consistency='ssp'")
        if spec["delay_bound"] is not None and spec["consistency"] != "async":
            raise UsageError("delay_bound belongs to consistency='async'")
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

    def _side(self, request: Request) -> _WorkerSide:
        session = request.session
        name = get_str(request.meta, "name")
        model = self.models.get((str(session.job), name))
        side = None if model is None else model.local_workers.get(session.rank)
        if side is None or side.session is not session:
            raise UsageError(
                f"open parameter server {name!r} as a worker before pushing or pulling"
            )
        if side.call is not None:
            raise UsageError(f"a {side.call.op} of {name!r} is still open: wait for it first")
        if model is not None and model.failed:
            shard, why = next(iter(model.failed.items()))
            raise OperationFailed(
                f"shard {shard} of {name!r} has no server: {why}", code=ErrorCode.PEER_FAILED
            )
        return side

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

    def _push(self, side: _WorkerSide, request: Request, now: float) -> None:
        key = (str(request.session.job), get_str(request.meta, "name"))
        model = self.models[key]
        update = self._array(request, model.spec, writable=False)
        actions = side.engine.push(update)  # refused (UsageError) before anything is sent
        side.call = _Call(session=request.session, request=request.id, started=now, op="push")
        self.operations.started("push")
        self._worker(key, side, actions)

    def _pull(self, side: _WorkerSide, request: Request, now: float) -> None:
        key = (str(request.session.job), get_str(request.meta, "name"))
        model = self.models[key]
        out = self._array(request, model.spec, writable=True)
        cache_key = (
            get_int(request.meta, "seg"),
            get_int(request.meta, "off"),
            get_int(request.meta, "nbytes"),
        )
        actions = side.engine.pull(fresh=cache_key != side.cache_key)
        side.out, side.cache_key = out, cache_key
        side.call = _Call(session=request.session, request=request.id, started=now, op="pull")
        self.operations.started("pull")
        self._worker(key, side, actions)

    # -- a worker's actions -----------------------------------------------------------------
    def _worker(self, key: Key, side: _WorkerSide, actions: list[WorkerAction]) -> None:
        model = self.models.get(key)
        if model is None:
            return
        job, name = key
        rank = side.engine.worker
        for action in actions:
            if isinstance(action, SendPush | SendPull):
                shard = action.shard
                to = self._serving(job, model, shard)
                fields: dict[str, Any] = {
                    "job": job,
                    "name": name,
                    "shard": shard,
                    "server": to,
                    "worker": rank,
                    "epoch": side.engine.epochs[shard],
                    "spec": model.spec,
                }
                if isinstance(action, SendPush):
                    frame: frames.PeerFrame = ps_frames.Push(
                        **fields, iteration=action.iteration, base=action.base
                    )
                    self._send(job, to, frame, bytes(action.payload))
                else:
                    frame = ps_frames.Pull(**fields, clock=action.clock, since=action.since)
                    self._send(job, to, frame)
            elif isinstance(action, PushDone):
                self._answer(
                    side,
                    None,
                    {
                        "iteration": action.iteration,
                        "versions": list(action.versions),
                        "dropped": list(action.dropped),
                        "epochs": [side.engine.epochs[s] for s in range(len(model.bounds))],
                    },
                )
            elif isinstance(action, PullDone):
                side.out = None
                self._answer(
                    side,
                    None,
                    {
                        "version": action.version,
                        "versions": list(action.versions),
                        "epochs": [side.engine.epochs[s] for s in range(len(model.bounds))],
                    },
                )
            else:
                assert isinstance(action, PullFailed)
                side.out = None
                self._answer(
                    side,
                    Failure(
                        code=ErrorCode.PEER_FAILED,
                        message=f"shard {action.shard} of {name!r}: {action.reason}",
                    ),
                    None,
                )

    def _serving(self, job: str, model: _Model, shard: int) -> int:
        """Where a worker here sends ``shard``'s frames: the rank serving it at the epoch
        this daemon knows; if that rank is not known at all (gone before this daemon heard of
        the model, or not started yet) and its partner is, the partner, which either serves
        at a later epoch and says so, or follows and drops it (the frames go to the rank
        when it joins)."""
        target = model.target(shard)
        if self.membership.lookup(job, target) is not None or (job, target) in self._suspects:
            return target
        partner = model.partner(shard, target)
        if partner is not None and self.membership.lookup(job, partner) is not None:
            return partner
        return target

    def _answer(self, side: _WorkerSide, failure: Failure | None, result: Meta | None) -> None:
        call, side.call = side.call, None
        if call is None:
            return
        seconds = self.host.now() - call.started
        if failure is not None:
            self.operations.ended(call.op, 0, seconds, str(failure.code))
            self.host.fail(call.session, call.request, failure)
            return
        assert result is not None
        self.operations.ended(call.op, side.engine.bounds[-1][1], seconds, None)
        self.host.reply(call.session, call.request, result)

    # -- a shard's actions ------------------------------------------------------------------
    def _server(self, key: Key, shard: int, actions: list[ServerAction]) -> None:
        model = self.models.get(key)
        if model is None:
            return
        job, name = key
        server = model.servers.get(shard)
        if server is None:
            return
        spec = model.spec
        me = model.rank_of(shard)
        partner = model.partner(shard, me)
        #: what every answer to a worker says of where it comes from
        to_worker: dict[str, Any] = {
            "job": job,
            "name": name,
            "shard": shard,
            "server": me,
            "epoch": server.epoch,
        }
        for action in actions:
            if isinstance(action, Forward | Snapshot):
                assert partner is not None
                if isinstance(action, Forward):
                    entry = action.entry
                    index, kind, payload = entry.index, entry.kind, entry.payload
                    fields = (entry.worker, entry.iteration, entry.base, _text(entry.reason))
                else:
                    index, kind, payload = action.index, "snapshot", action.data
                    fields = (0, 0, 0, None)
                    if len(payload) > self.host.config.max_payload:
                        log.error(
                            "parameter server %r shard %d: a snapshot of %d B is more than "
                            "max_payload (%d B) allows: rank %d cannot follow this shard, which "
                            "goes on unreplicated (raise max_payload, or use more servers)",
                            name,
                            shard,
                            len(payload),
                            self.host.config.max_payload,
                            partner,
                        )
                        self._server(key, shard, server.replica_lost(self.host.now()))
                        return  # the entries that followed were processed just now
                frame: frames.PeerFrame = ps_frames.Replicate(
                    job=job,
                    name=name,
                    shard=shard,
                    server=me,
                    replica=partner,
                    index=index,
                    entry=kind,
                    worker=fields[0],
                    iteration=fields[1],
                    base=fields[2],
                    reason=fields[3],
                    spec=spec,
                )
                self._send(job, partner, frame, bytes(payload))
            elif isinstance(action, Step):
                buffer = model.steps[shard]
                buffer[0] = action.model
                buffer[1] = action.update
                self.host.push(
                    model.owners[shard],
                    "ps_step",
                    {"name": name, "shard": shard, "version": action.version},
                )
            elif isinstance(action, Logged):
                assert partner is not None
                self._send(
                    job,
                    partner,
                    ps_frames.Replicated(
                        job=job,
                        name=name,
                        shard=shard,
                        server=partner,
                        replica=me,
                        index=action.index,
                    ),
                )
            elif isinstance(action, Acked):
                answer: frames.PeerFrame = ps_frames.Pushed(
                    **to_worker,
                    worker=action.worker,
                    iteration=action.iteration,
                    version=action.version,
                    dropped=_text(action.dropped),
                )
                self._send(job, action.worker, answer)
            elif isinstance(action, Answer):
                answer = ps_frames.Pulled(
                    **to_worker,
                    worker=action.worker,
                    clock=action.clock,
                    version=action.version,
                    error=None,
                )
                self._send(job, action.worker, answer, bytes(action.data))
            else:
                assert isinstance(action, Refuse)
                answer = ps_frames.Pulled(
                    **to_worker,
                    worker=action.worker,
                    clock=action.clock,
                    version=server.version,
                    error=_text(action.reason),
                )
                self._send(job, action.worker, answer)
        if model.flushes:
            self._flushed(model)

    def _flushed(self, model: _Model) -> None:
        """Answer the flushes whose shards processed them; fail those whose shard was taken
        over by its partner before (its log went with the state it took)."""
        for flush in list(model.flushes):
            for shard, (index, epoch) in list(flush.waits.items()):
                server = model.servers.get(shard)
                if server is None:
                    continue  # closed: its process, the flush's, left (client_gone)
                if server.epoch != epoch or not server.primary:
                    model.flushes.remove(flush)
                    failure = Failure(
                        code=ErrorCode.PEER_FAILED,
                        message=f"shard {shard} was taken over by its partner before the flush "
                        "was published: flush where it is served",
                    )
                    self.host.fail(flush.session, flush.request, failure)
                    break
                stats = server.statistics()
                if stats.logged - stats.unreplicated >= index:
                    del flush.waits[shard]
            else:
                if not flush.waits:
                    model.flushes.remove(flush)
                    self.host.reply(flush.session, flush.request, {"flushed": True})

    # -- moving frames ----------------------------------------------------------------------
    def _send(self, job: str, rank: int, frame: frames.PeerFrame, payload: bytes = b"") -> None:
        """Send ``frame`` to rank ``rank``'s node, or hand it over here if the rank is local.
        A rank not known (yet, or any more) gets nothing: what waits for it is sent again
        when it joins, or fails when it is gone (:meth:`on_rank_event`).  One lost with its
        node's links (a suspect), or on a node whose links are not all up, gets the frame
        once it is known and they are (:meth:`peer_up`, :meth:`on_rank_event`): an
        acknowledgement or an answer is sent once, to a worker that will not ask again."""
        entry = self.membership.lookup(job, rank)
        if entry is None and (job, rank) not in self._suspects:
            return
        if entry is None or (
            entry.node != self.host.config.node_id and self.host.data_link(entry.node) is None
        ):
            held = [p for frames_ in self._held.values() for _, p in frames_]
            if len(held) < _MAX_EARLY and self._room(sum(map(len, held)), len(payload)):
                self._held.setdefault((job, rank), []).append((frame, payload))
            else:
                self._counters["ps_frames_dropped"] += 1
            return
        if entry.node == self.host.config.node_id:
            self._local.append((entry.node, frame, payload))
            return
        if frame.KIND in self._queues:
            self._queues[frame.KIND].send(entry.node, frame.to_meta(), memoryview(payload))
        else:
            self.host.send(entry.node, frame)

    def _flush(self) -> None:
        """Hand over the frames between local ranks, in order, until none is left (and the
        peers' frames held for a model that opened since).  One refused as malformed is
        dropped and counted: its error must not go up from whatever call flushes (a client's
        request, or another peer's frame), whose connection the node would close."""
        if self._flushing:
            return
        self._flushing = True
        try:
            while self._local:
                node, frame, payload = self._local.popleft()
                try:
                    self._dispatch(node, frame, payload, self.host.now())
                except RemoteProtocolError as exc:
                    self._counters["ps_frames_dropped"] += 1
                    remote_log.warning(
                        "handed over",
                        "a %s from node %d was refused: %s",
                        frame.KIND.name,
                        node,
                        exc,
                    )
        finally:
            self._flushing = False

    def payload_buffer(
        self, node: int, frame: frames.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate)
        if length > self.host.config.max_payload:
            raise RemoteProtocolError(f"a {frame.KIND.name} of {length} B")
        buffer = bytearray(length)
        self._landing[_landing_key(node, frame)] = buffer
        return memoryview(buffer)

    def on_data(self, node: int, frame: frames.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate)
        payload = self._landing.pop(_landing_key(node, frame), None)
        data = bytes(payload) if payload is not None else b""
        self._dispatch(node, frame, data, now)
        self._flush()

    def on_frame(self, node: int, frame: frames.PeerFrame, now: float) -> None:
        self._dispatch(node, frame, b"", now)
        self._flush()

    def _dispatch(self, node: int, frame: frames.PeerFrame, payload: bytes, now: float) -> None:
        if isinstance(frame, ps_frames.Push | ps_frames.Pull):
            self._at_server(node, frame, payload, now)
            return
        # a server's, replica's or partner's frame counts only from the node its rank lives
        # on: anything else could forge an entry, a confirmation or an acknowledgement
        assert isinstance(
            frame,
            ps_frames.Pushed
            | ps_frames.Pulled
            | ps_frames.Replicate
            | ps_frames.Replicated
            | ps_frames.Join,
        )
        sender = (
            frame.replica
            if isinstance(frame, ps_frames.Replicated | ps_frames.Join)
            else frame.server
        )
        if not self._sent_by(node, frame.job, sender):
            return
        if isinstance(frame, ps_frames.Pushed | ps_frames.Pulled):
            self._at_worker(node, frame, payload)
        elif isinstance(frame, ps_frames.Replicate):
            self._at_replica(node, frame, payload, now)
        elif isinstance(frame, ps_frames.Join):
            self._at_partner(frame, now)
        else:
            assert isinstance(frame, ps_frames.Replicated)
            key = (frame.job, frame.name)
            model = self.models.get(key)
            server = None if model is None else model.servers.get(frame.shard)
            if server is None or not server.primary:
                self._counters["ps_frames_dropped"] += 1
                return
            self._server(key, frame.shard, server.replicated_upto(frame.index, now))

    def _sent_by(self, node: int, job: str, rank: int) -> bool:
        """Whether rank ``rank`` lives on ``node``, known there: a server's or replica's
        frame from anywhere else is dropped and counted.  One that overtook its rank's
        announcement after a reset is sent again when the rank joins (:meth:`on_rank_event`)."""
        entry = self.membership.lookup(job, rank)
        if entry is not None and entry.node == node:
            return True
        self._counters["ps_frames_dropped"] += 1
        remote_log.warning(
            "stray", "node %d sent a frame as server rank %d, which is not on it", node, rank
        )
        return False

    def _from(self, node: int, job: str, rank: int) -> bool:
        """Whether rank ``rank`` may live on ``node`` (a frame naming a rank of another node
        is dropped and counted, never taken as that rank's)."""
        entry = self.membership.lookup(job, rank)
        if entry is None or entry.node == node:
            return True
        self._counters["ps_frames_dropped"] += 1
        remote_log.warning("stray", "node %d sent a frame as rank %d, not on it", node, rank)
        return False

    def _at_server(
        self, node: int, frame: ps_frames.Push | ps_frames.Pull, payload: bytes, now: float
    ) -> None:
        if not self._from(node, frame.job, frame.worker):
            return
        key = (frame.job, frame.name)
        model = self.models.get(key)
        server = None if model is None else model.servers.get(frame.shard)
        if model is None or server is None:
            self._hold(node, frame, payload, now)
            return
        if model.spec != frame.spec:
            self._refuse(
                key,
                frame,
                f"the worker opened it as {_describe(frame.spec)}, the "
                f"server as {_describe(model.spec)}",
            )
            return
        if frame.worker not in model.workers:
            raise RemoteProtocolError(f"rank {frame.worker} is not a worker of {frame.name!r}")
        if frame.shard in model.tentative:
            self._hold(node, frame, payload, now)  # until the partner answered
            return
        partner = model.partner(frame.shard, model.rank_of(frame.shard))
        if (
            not server.has_state
            and partner is not None
            and self.membership.lookup(frame.job, partner) is not None
        ):
            # this rank waits for its partner's state: the frame is answered once it came
            # (with the shard's epoch, which moves a worker's daemon that did not know it)
            self._hold(node, frame, payload, now)
            return
        if not server.primary and frame.epoch > server.epoch:
            # the worker's daemon saw the primary go before this one did
            self._promote(key, frame.shard, "a worker failed over to it", now)
        if not server.primary or frame.epoch != server.epoch:
            # a worker's daemon behind this rank's epoch (it opened the model after a
            # failover it never heard of) is told the epoch: it moves to the rank serving it
            later = server.epoch if server.has_state and server.epoch > frame.epoch else None
            self._refuse(key, frame, self._why_not_serving(server, frame.epoch), epoch=later)
            return
        if isinstance(frame, ps_frames.Push):
            actions = server.push(frame.worker, frame.iteration, frame.base, payload, now)
        else:
            actions = server.pull(frame.worker, frame.clock, frame.since, now)
        self._server(key, frame.shard, actions)

    @staticmethod
    def _why_not_serving(server: ShardServer, epoch: int) -> str:
        if not server.has_state:
            return (
                "the shard's state is lost: this rank came back (or opened) after its partner "
                "served the shard, and the partner went before sending it the state"
            )
        if epoch > server.epoch:
            return (
                f"the shard's state is lost: its workers are at epoch {epoch}, but this rank "
                f"holds epoch {server.epoch} (it restarted after every copy of the shard went)"
            )
        role = "serves" if server.primary else "follows its partner"
        return (
            f"this rank {role} the shard at epoch {server.epoch}; the worker's daemon is at "
            f"epoch {epoch}"
        )

    def _refuse(
        self,
        key: Key,
        frame: ps_frames.Push | ps_frames.Pull,
        why: str,
        *,
        epoch: int | None = None,
    ) -> None:
        """Answer ``frame`` with ``why`` (a push as not applied, a pull as failed); ``epoch``:
        the shard's later epoch, which moves the worker's daemon to the rank serving it."""
        job, name = key
        common: dict[str, Any] = {
            "job": job,
            "name": name,
            "shard": frame.shard,
            "server": frame.server,
            "worker": frame.worker,
            "epoch": frame.epoch if epoch is None else epoch,
        }
        if isinstance(frame, ps_frames.Push):
            reply: frames.PeerFrame = ps_frames.Pushed(
                **common, iteration=frame.iteration, version=0, dropped=_text(why)
            )
        else:
            reply = ps_frames.Pulled(**common, clock=frame.clock, version=0, error=_text(why))
        self._send(job, frame.worker, reply)

    def _at_worker(
        self, node: int, frame: ps_frames.Pushed | ps_frames.Pulled, payload: bytes
    ) -> None:
        key = (frame.job, frame.name)
        model = self.models.get(key)
        side = None if model is None else model.local_workers.get(frame.worker)
        if model is None or side is None:
            self._counters["ps_frames_dropped"] += 1
            return
        side.engine.check_frame(frame.shard)
        if frame.epoch > model.epochs.get(frame.shard, 0) and frame.server in model.pair(
            frame.shard
        ):
            # the shard's pair is at a later epoch than this daemon knew: what was refused is
            # sent again to the rank serving it
            self._adopt(key, frame.shard, frame.epoch, "its pair said so")
            return
        if frame.server != model.target(frame.shard):
            self._counters["ps_frames_dropped"] += 1  # from the server before a failover
            return
        if isinstance(frame, ps_frames.Pushed):
            actions = side.engine.pushed(frame.shard, frame.iteration, frame.version, frame.dropped)
        elif frame.error is not None:
            actions = side.engine.refused(frame.shard, frame.clock, frame.error)
        elif side.out is None:
            actions = []  # an answer nobody waits for (the client left, or sent again)
        else:
            actions = side.engine.pulled(frame.shard, frame.clock, payload, side.out)
        self._worker(key, side, actions)

    def _at_replica(
        self, node: int, frame: ps_frames.Replicate, payload: bytes, now: float
    ) -> None:
        key = (frame.job, frame.name)
        model = self.models.get(key)
        server = None if model is None else model.servers.get(frame.shard)
        if model is None or server is None or model.spec != frame.spec:
            self._counters["ps_frames_dropped"] += 1
            return
        if frame.entry == "snapshot":
            if server.restore(frame.index, payload):
                log.info(
                    "parameter server %r shard %d: took the state of rank %d at epoch %d",
                    key[1],
                    frame.shard,
                    frame.server,
                    server.epoch,
                )
                self._adopt(key, frame.shard, server.epoch, "its partner's snapshot said so")
            model.tentative.discard(frame.shard)
            self._take_early(key, now)  # workers' frames held while the state was away
            return
        if frame.entry not in (PUSH, LOSE, FLUSH):
            raise RemoteProtocolError(f"replication entry of kind {frame.entry!r}")
        entry = Entry(
            index=frame.index,
            kind=frame.entry,
            worker=frame.worker,
            iteration=frame.iteration,
            base=frame.base,
            payload=payload,
            reason=frame.reason,
        )
        if server.primary:
            self._counters["ps_frames_dropped"] += 1  # promoted: the old primary is gone
            return
        self._server(key, frame.shard, server.log(entry, now))

    def _at_partner(self, frame: ps_frames.Join, now: float) -> None:
        """The shard's partner opened it: send it the state if this rank serves the shard;
        if this rank waits for the state itself, the partner has just opened, so ask it."""
        key = (frame.job, frame.name)
        model = self.models.get(key)
        server = None if model is None else model.servers.get(frame.shard)
        if model is None or server is None or model.spec != frame.spec:
            self._counters["ps_frames_dropped"] += 1
            return
        if model.partner(frame.shard, model.rank_of(frame.shard)) != frame.replica:
            raise RemoteProtocolError(f"rank {frame.replica} is not shard {frame.shard}'s partner")
        if server.primary:
            self._settle(key, frame.shard, now)  # the partner asks: this rank serves
            self._server(key, frame.shard, server.joined())
        elif not server.has_state and frame.shard not in model.answered:
            # once: a partner without state answers this JOIN with its own, and two such
            # partners would otherwise ask each other for ever (the shard is lost)
            self._join(key, frame.shard)
            model.answered.add(frame.shard)

    def _settle(self, key: Key, shard: int, now: float) -> None:
        """``shard`` is no longer tentative here (its partner answered, or is gone): the
        workers' frames held meanwhile are taken now."""
        model = self.models[key]
        if shard in model.tentative:
            model.tentative.discard(shard)
            self._take_early(key, now)

    def _adopt(self, key: Key, shard: int, epoch: int, how: str) -> None:
        """This daemon learned (``how``) that ``shard`` is at ``epoch``: its workers here move
        there, and their clients hear ``ps_epoch``."""
        model = self.models[key]
        if epoch <= model.epochs.get(shard, 0):
            return
        model.epochs[shard] = epoch
        serving = model.target(shard)
        for side in model.local_workers.values():
            self.host.push(
                side.session,
                "ps_epoch",
                {
                    "name": key[1],
                    "shard": shard,
                    "epoch": epoch,
                    "server": serving,
                    "reason": f"the shard is at epoch {epoch} ({how})",
                },
            )
            self._worker(key, side, side.engine.move(shard, epoch))

    # -- early frames -----------------------------------------------------------------------
    def _room(self, held: int, more: int) -> bool:
        """Whether ``more`` payload bytes fit beside ``held`` in a table of held frames."""
        return held + more <= _HELD_PAYLOADS * self.host.config.max_payload

    def _hold(
        self, node: int, frame: ps_frames.Push | ps_frames.Pull, payload: bytes, now: float
    ) -> None:
        if any(e.node == node and e.frame == frame for e in self._early):
            return  # sent again after a reset: the one held is taken (or refused) in its place
        spec, shard = frame.spec, frame.shard
        pair = (*spec["servers"][shard : shard + 1], *spec["replicas"][shard : shard + 1])
        held = sum(len(e.payload) for e in self._early)
        if len(self._early) >= _MAX_EARLY or not self._room(held, len(payload)):
            self._counters["ps_frames_dropped"] += 1
            why = (
                f"rank {frame.server} has not opened {frame.name!r} and this daemon holds "
                f"{len(self._early)} frames ({held} B) for models not open yet, the most it "
                f"keeps ({_MAX_EARLY}, or {_HELD_PAYLOADS} x max_payload)"
            )
            if isinstance(frame, ps_frames.Push) and frame.server in pair:
                # not answered: a push answered as dropped counts as processed, and the
                # worker's next one would skip an iteration its server never saw; it waits
                # (its stall row says for whom) and is sent again after its links' next reset
                remote_log.warning("early", "a push from node %d not held: %s", node, why)
            else:
                self._refuse((frame.job, frame.name), frame, why)
            return
        if isinstance(frame, ps_frames.Push) and frame.server in pair:
            deadline = None  # it waits for its server (_Early)
        else:  # a pull, or a push for a shard or rank its spec does not have: refused in time
            deadline = now + self.host.config.route_timeout
        self._early.append(_Early(node=node, frame=frame, payload=payload, deadline=deadline))

    def _take_early(self, key: Key, now: float) -> None:
        model = self.models[key]
        mine = [
            e
            for e in self._early
            if (e.frame.job, e.frame.name) == key and e.frame.shard in model.servers
        ]
        if not mine:
            return
        self._early = [e for e in self._early if e not in mine]
        for early in mine:
            self._local.append((early.node, early.frame, early.payload))

    # -- peers, ranks, clients ----------------------------------------------------------------
    def peer_up(self, node: int, now: float) -> None:
        """Send ``node``'s ranks again what may have been lost with its old links, and what
        was held for them; ranks it has not announced again yet get theirs when it does
        (:meth:`on_rank_event`)."""
        self._send_again(lambda job, rank: self._node_of(job, rank) == node, rejoin=False)

    def _send_again(self, reached: Callable[[str, int], bool], *, rejoin: bool) -> None:
        """Send the ranks that ``reached`` says are reachable again what was held for them and
        what they may have lost: the workers' pushes and pulls in flight to them, a primary's
        entries to its partner (or its whole state, :meth:`_resync`), a replica's JOIN (if it
        has no state, or always with ``rejoin``: what its primary sent again when it learned
        of this rank may have overtaken the primary's announcement here and been dropped by
        :meth:`_sent_by`; with the state, the snapshot is ignored and the entries after it are
        taken or confirmed again)."""
        for job, rank in [k for k in self._held if reached(*k)]:
            for frame, payload in self._held.pop((job, rank)):
                self._send(job, rank, frame, payload)
        for key, model in list(self.models.items()):
            job = key[0]
            for side in model.local_workers.values():
                for shard in range(len(model.bounds)):
                    if reached(job, model.target(shard)):
                        self._worker(key, side, side.engine.resend(shard))
            for shard, server in model.servers.items():
                partner = model.partner(shard, model.rank_of(shard))
                if partner is None or not reached(job, partner):
                    continue
                if server.primary:
                    self._server(key, shard, self._resync(server))
                elif rejoin or not server.has_state:
                    self._join(key, shard)  # the JOIN may have gone with the old links
        self._flush()

    @staticmethod
    def _resync(server: ShardServer) -> list[ServerAction]:
        """What a primary sends its partner back from a reset or a partition: the entries it
        has not confirmed, or, if the primary gave it up meanwhile (went on alone), its whole
        state: a partner that kept its own (its process lived on) would otherwise stay behind
        for good, and be promoted so if the primary then died."""
        return list(server.unconfirmed()) if server.synced else server.joined()

    def peer_down(self, node: int, reason: str, now: float) -> None:
        for queue in self._queues.values():
            queue.drop(node)
        self._landing = {k: b for k, b in self._landing.items() if k[0] != node}

    def _node_of(self, job: str, rank: int) -> int | None:
        entry = self.membership.lookup(job, rank)
        return None if entry is None else entry.node

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        job, rank = event.entry.job, event.entry.rank
        if isinstance(event, RankJoined):
            self._suspects.pop((job, rank), None)
            node = event.entry.node
            # a rank seen for the first time, or back after its node's links were reset (a
            # peer forgets the ranks of a node it reset, so peer_up could not tell it was
            # there): what waits for it goes now, unless its node's links are not all up yet
            # (then peer_up sends it)
            if node == self.host.config.node_id or self.host.data_link(node) is not None:
                self._send_again(lambda j, r: (j, r) == (job, rank), rejoin=True)
            return
        assert isinstance(event, RankLeft)
        if event.lost and event.entry.node != self.host.config.node_id:
            self._suspects[(job, rank)] = now + self.host.config.down_after
            return
        self._gone(job, rank, event.reason, now)
        self._flush()

    def _gone(self, job: str, rank: int, reason: str, now: float) -> None:
        """Rank ``rank`` of ``job`` is gone for good: lose it as a worker, replace it as a
        server, go on without it as a replica."""
        self._held.pop((job, rank), None)
        gone = [
            e
            for e in self._early
            if e.frame.job == job and rank in (e.frame.worker, e.frame.server)
        ]
        if gone:  # a push for a server that left is sent again to its successor, if any
            self._counters["ps_frames_dropped"] += len(gone)
            self._early = [e for e in self._early if e not in gone]
        for key, model in list(self.models.items()):
            if key[0] != job:
                continue
            spec = model.spec
            if rank in model.workers:
                for shard, server in model.servers.items():
                    if server.primary:
                        self._server(key, shard, server.lose(rank, reason, now))
            for shard, server_rank in enumerate(spec["servers"]):
                pair = (server_rank, *spec["replicas"][shard : shard + 1])
                if rank not in pair:
                    continue
                if rank == model.target(shard):
                    self._failover(key, shard, f"rank {rank} serving it left ({reason})", now)
                    continue
                local = model.servers.get(shard)  # the partner that follows it went
                if local is not None and local.primary:
                    self._settle(key, shard, now)  # nobody can answer for a later epoch
                    self._server(key, shard, local.replica_lost(now))

    def _failover(self, key: Key, shard: int, reason: str, now: float) -> None:
        """The rank serving ``shard`` is gone: its partner serves it from the next epoch (if
        the shard has one; else the shard has no server any more)."""
        model = self.models[key]
        if not model.spec["replicas"]:
            self._fail_shard(key, shard, reason)
            return
        epoch = model.epochs.get(shard, 0) + 1
        model.epochs[shard] = epoch
        successor = model.target(shard)
        # a suspect (its node unreachable, down_after not over) may come back: what is sent it
        # waits for it (_send), and if it is gone for good, _gone fails the shard over again
        if (
            self.membership.lookup(key[0], successor) is None
            and (key[0], successor) not in self._suspects
        ):
            self._fail_shard(key, shard, f"{reason}, and its partner rank {successor} is gone too")
            return
        server = model.servers.get(shard)
        if server is not None and not self._promote(key, shard, reason, now):
            self._fail_shard(key, shard, f"{reason}, and its partner never got the shard's state")
            return
        self._counters["ps_failovers"] += 1
        log.warning(
            "parameter server %r shard %d: %s; rank %d serves it from epoch %d",
            key[1],
            shard,
            reason,
            successor,
            epoch,
        )
        for side in model.local_workers.values():
            self.host.push(
                side.session,
                "ps_epoch",
                {
                    "name": key[1],
                    "shard": shard,
                    "epoch": epoch,
                    "server": successor,
                    "reason": reason,
                },
            )
            self._worker(key, side, side.engine.move(shard, epoch))

    def _promote(self, key: Key, shard: int, reason: str, now: float) -> bool:
        """The local partner of ``shard`` takes over, if it holds the shard's state; workers
        already gone are lost to it.  ``False``: it has none, and the shard is lost."""
        model = self.models[key]
        server = model.servers[shard]
        if server.primary:
            return True
        if not server.promote():
            log.error(
                "parameter server %r shard %d: %s, and this rank never got the shard's state: "
                "the shard is lost",
                key[1],
                shard,
                reason,
            )
            return False
        log.warning(
            "parameter server %r shard %d: promoted to primary at epoch %d (%s)",
            key[1],
            shard,
            server.epoch,
            reason,
        )
        for worker in model.workers:
            # a suspect (its node's links reset, down_after not over) is lost by _gone in time,
            # and a worker that never pushed may not have started yet
            if (
                self.membership.lookup(key[0], worker) is None
                and (key[0], worker) not in self._suspects
                and server.coordinator.clock(worker) > 0
            ):
                self._server(key, shard, server.lose(worker, "gone at the failover", now))
        return True

    def _fail_shard(self, key: Key, shard: int, reason: str) -> None:
        model = self.models[key]
        model.failed[shard] = reason
        failure = Failure(
            code=ErrorCode.PEER_FAILED,
            message=f"shard {shard} of {key[1]!r} has no server: {reason}",
        )
        for side in model.local_workers.values():
            self._answer(side, failure, None)

    def client_gone(self, session: ClientSession, now: float) -> None:
        for key, model in list(self.models.items()):
            for rank in [r for r, s in model.local_workers.items() if s.session is session]:
                side = model.local_workers.pop(rank)
                self._retired += _totals([side.engine.statistics()], [])
                if side.call is not None:
                    self.operations.abandoned(side.call.op)
            model.flushes = [f for f in model.flushes if f.session is not session]
            for shard in [s for s, owner in model.owners.items() if owner is session]:
                del model.owners[shard]
                model.steps.pop(shard, None)
                model.ranks.pop(shard, None)
                server = model.servers.pop(shard)
                if server.primary:
                    self._retired += _totals([], [server.statistics()])
            if not model.local_workers and not model.servers:
                del self.models[key]

    # -- time, the drain --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        deadlines = [e.deadline for e in self._early if e.deadline is not None]
        deadlines += self._suspects.values()
        return min(deadlines, default=None)

    def on_timer(self, now: float) -> None:
        for (job, rank), deadline in list(self._suspects.items()):
            if deadline <= now:
                del self._suspects[(job, rank)]
                self._gone(job, rank, "its node was unreachable longer than down_after", now)
        late = [e for e in self._early if e.deadline is not None and e.deadline <= now]
        self._early = [e for e in self._early if e not in late]
        for early in late:
            self._counters["ps_early_expired"] += 1
            frame = early.frame
            self._refuse(
                (frame.job, frame.name),
                frame,
                f"rank {frame.server} did not open parameter server {frame.name!r} "
                f"within route_timeout ({self.host.config.route_timeout} s)",
            )
        self._flush()

    def shutdown(self, failure: Failure) -> None:
        for model in self.models.values():
            for side in model.local_workers.values():
                self._answer(side, failure, None)
            for flush in model.flushes:
                self.host.fail(flush.session, flush.request, failure)
            model.flushes.clear()

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Pushes and pulls open longer than ``stall_after``, saying which shards they wait
        for."""
        after = self.host.config.stall_after
        rows: list[Meta] = []
        for (job, name), model in sorted(self.models.items()):
            for rank, side in sorted(model.local_workers.items()):
                call = side.call
                if call is None or now - call.started < after:
                    continue
                if limit is not None and len(rows) >= limit:
                    return rows
                whose = {
                    "job": job,
                    "owner": self.membership.owner(job),
                    "uid": call.session.conn.credentials.uid,
                }
                if keep is not None and not keep(whose):
                    continue
                waiting = side.engine.waiting()
                targets = [model.target(s) for s in waiting]
                # a shard served here says what it waits for itself (its BSP iteration, the
                # replica's confirmation, the update callback of a process not in serve())
                shards = ", ".join(
                    f"shard {s} (rank {t}"
                    + "".join(f"; {why}" for why in self._local_waits(model, s, t))
                    + ")"
                    for s, t in zip(waiting, targets, strict=True)
                )
                rows.append(
                    {
                        **whose,
                        "node": self.host.config.node_id,
                        "op": f"{name}@{rank}",
                        "kind": f"ps_{call.op} ({model.spec['consistency']})",
                        "rank": rank,
                        "peer": "-",
                        "tag": name,
                        "nbytes": side.engine.bounds[-1][1] * side.engine.dtype.itemsize,
                        "dtype": str(side.engine.dtype),
                        "pending_for": now - call.started,
                        "waits": "peer",
                        "detail": f"{call.op} at clock {side.engine.iteration} waits for {shards}",
                        "peer_joined": all(
                            self.membership.lookup(job, t) is not None for t in targets
                        ),
                        "peer_node": None,
                        "peer_node_state": None,
                        "client_left": False,
                    }
                )
        return rows

    @staticmethod
    def _local_waits(model: _Model, shard: int, rank: int) -> list[str]:
        """What ``shard`` waits for, if rank ``rank`` serves it here."""
        server = model.servers.get(shard)
        if server is None or model.ranks.get(shard) != rank:
            return []
        return server.waiting_for()

    # -- status and metrics -----------------------------------------------------------------
    def statistics(self) -> Meta:
        servers, workers = [], []
        for (job, name), model in sorted(self.models.items()):
            owner = self.membership.owner(job)
            for shard, server in sorted(model.servers.items()):
                s = server.statistics()
                c = s.coordinator
                servers.append(
                    {
                        "job": job,
                        "owner": owner,
                        "name": name,
                        "shard": shard,
                        "role": "primary" if s.primary else "replica",
                        "epoch": s.epoch,
                        "consistency": model.spec["consistency"],
                        "version": s.version,
                        "complete": c.complete,
                        "applied": c.applied,
                        "dropped_delay": c.dropped.get("delay", 0),
                        "dropped_lost": c.dropped.get("lost", 0),
                        "delays": list(c.delays),
                        "delay_sum": c.delay_sum,
                        "held_pulls": c.held,
                        "live_workers": c.live,
                        "pushes": s.pushes,
                        "resent": s.resent,
                        "push_bytes": s.push_bytes,
                        "push_dense_bytes": s.push_dense_bytes,
                        "pulls": s.pulls,
                        "pull_bytes": s.pull_bytes,
                        "pull_dense_bytes": s.pull_dense_bytes,
                        "considered": s.considered,
                        "published": s.published,
                        "logged": s.logged,
                        "unreplicated": s.unreplicated,
                        "waiting": list(c.waiting),
                    }
                )
            for rank, side in sorted(model.local_workers.items()):
                w = side.engine.statistics()
                workers.append(
                    {
                        "job": job,
                        "owner": owner,
                        "name": name,
                        "rank": rank,
                        "clock": side.engine.iteration,
                        "versions": list(side.engine.versions),
                        "epochs": list(side.engine.epochs),
                        "pushes": w.pushes,
                        "push_bytes": w.push_bytes,
                        "push_dense_bytes": w.push_dense_bytes,
                        "considered": w.considered,
                        "pushed": w.pushed,
                        "smp_selected": w.smp_selected,
                        "rp_selected": w.rp_selected,
                        "glnp_clipped": w.glnp_clipped,
                        "delay_dropped": w.delay_dropped,
                        "server_dropped": w.server_dropped,
                        "pulls": w.pulls,
                        "pull_bytes": w.pull_bytes,
                        "pull_dense_bytes": w.pull_dense_bytes,
                        "resent": w.resent,
                    }
                )
        return {
            "ps_servers": servers,
            "ps_workers": workers,
            "counters": {**self._counters, "ps_early_frames": len(self._early)},
        }

    def client_statistics(self, session: ClientSession) -> Meta:
        return {
            "ps_calls": sum(
                1
                for m in self.models.values()
                for s in m.local_workers.values()
                if s.session is session and s.call is not None
            )
        }

    def metrics(self) -> Iterable[Metric]:
        """Totals over this node's models (no job or model labels: their number has no
        bound); per-model figures are in the status rows."""
        pending = sum(1 for m in self.models.values() for s in m.local_workers.values() if s.call)
        yield from self.operations.families(pending=pending)
        labels = {"service": self.name}
        workers = [
            s.engine.statistics() for m in self.models.values() for s in m.local_workers.values()
        ]
        shards = [s.statistics() for m in self.models.values() for s in m.servers.values()]
        # a replica replays its primary's updates: counted once, where they are served from;
        # what models gone from this node counted stays counted (counters never go back)
        t = _totals(workers, [s for s in shards if s.primary]) + self._retired
        yield counter(
            "fabricd_ps_push_bytes",
            "Bytes of pushes sent by this node's workers, as sent (filtered) and as they would "
            "have been unfiltered (dense, headers included)",
            [
                ({**labels, "filtered": "yes"}, t["push"]),
                ({**labels, "filtered": "no"}, t["push_dense"]),
            ],
        )
        yield counter(
            "fabricd_ps_pull_bytes",
            "Bytes of pull answers received by this node's workers, as received (changed "
            "parameters only) and as whole models (headers included)",
            [
                ({**labels, "filtered": "yes"}, t["pull"]),
                ({**labels, "filtered": "no"}, t["pull_dense"]),
            ],
        )
        yield counter(
            "fabricd_ps_gradients_selected",
            "Gradient elements each filter selected for dropping (G-SMP, G-RP), those dropped "
            "(selected by every filter on) and those considered",
            [
                ({**labels, "filter": name}, t[name])
                for name in ("gsmp", "grp", "dropped", "considered")
            ],
        )
        yield counter(
            "fabricd_ps_parameters_published",
            "Parameters the primary servers' P-SMP filters published, and those considered",
            [
                ({**labels, "what": "published"}, t["published"]),
                ({**labels, "what": "considered"}, t["p_considered"]),
            ],
        )
        yield counter(
            "fabricd_ps_updates_dropped",
            "Shard pushes not applied: delay above tau_max at this node's workers "
            "(delay_worker) or its primary servers (delay_server), or their worker lost",
            [
                ({**labels, "reason": reason}, t[reason])
                for reason in ("delay_worker", "delay_server", "lost")
            ],
        )
        delays = Histogram(DELAY_BUCKETS)
        for i in range(len(delays.counts)):
            delays.counts[i] += t[f"delay{i}"]
        delays.sum += t["delay_sum"]
        yield histogram(
            "fabricd_ps_update_delay",
            "Updates this node's primary servers applied, by delay (the server's version "
            "minus the version the update was computed from)",
            [(labels, delays)],
        )
        yield gauge(
            "fabricd_ps_shards",
            "Parameter-server shards on this node, by role",
            [
                ({**labels, "role": "primary"}, sum(1 for s in shards if s.primary)),
                ({**labels, "role": "replica"}, sum(1 for s in shards if not s.primary)),
            ],
        )


def _totals(workers: list[WorkerStatistics], primaries: list[ShardStatistics]) -> Counter[str]:
    """The sums the Prometheus series are made of, over these workers and primary shards."""
    t: Counter[str] = Counter()
    for w in workers:
        t.update(
            push=w.push_bytes,
            push_dense=w.push_dense_bytes,
            pull=w.pull_bytes,
            pull_dense=w.pull_dense_bytes,
            gsmp=w.smp_selected,
            grp=w.rp_selected,
            dropped=w.considered - w.pushed,
            considered=w.considered,
            delay_worker=w.delay_dropped,
        )
    for s in primaries:
        c = s.coordinator
        t.update(
            published=s.published,
            p_considered=s.considered,
            delay_server=c.dropped.get("delay", 0),
            lost=c.dropped.get("lost", 0),
            delay_sum=c.delay_sum,
        )
        t.update({f"delay{i}": n for i, n in enumerate(c.delays)})
    return t


def _spec(meta: Meta, n: int) -> Meta:
    """The spec every rank of a model opens it with, from a request."""
    servers, replicas = meta.get("servers"), meta.get("replicas", [])
    for what, ranks in (("servers", servers), ("replicas", replicas)):
        if not isinstance(ranks, list) or not all(
            type(r) is int and 0 <= r < MAX_RANK for r in ranks
        ):
            raise UsageError(f"{what}: a list of ranks")
    delay_bound = meta.get("delay_bound")
    return {
        "n": n,
        "size": get_int(meta, "size", lo=1),
        "dtype": get_str(meta, "dtype"),
        "servers": list(servers),  # type: ignore[arg-type]
        "replicas": list(replicas),
        "consistency": get_str(meta, "consistency"),
        "staleness": get_int(meta, "staleness"),
        "delay_bound": None if delay_bound is None else get_int(meta, "delay_bound"),
        "chunk": get_int(meta, "chunk", lo=1),
    }


def _settings(filters: Any) -> FilterSettings:
    if filters is None:
        return FilterSettings()
    if not isinstance(filters, dict) or not set(filters) <= set(_FILTER_FIELDS):
        raise UsageError(f"filters: a map of {', '.join(_FILTER_FIELDS)}")
    return FilterSettings(**filters)


def _text(why: str | None) -> str | None:
    """A reason as a frame carries it: 1 to ``MAX_PS_REASON`` characters (or none)."""
    if why is None:
        return None
    return (why or "no reason given")[:MAX_PS_REASON]


def _describe(spec: Meta) -> str:
    return (
        f"{spec['size']} x {spec['dtype']} on servers {spec['servers']}"
        + (f" (replicas {spec['replicas']})" if spec["replicas"] else "")
        + f", {spec['consistency']}"
        + (f"({spec['staleness']})" if spec["consistency"] == "ssp" else "")
        + (f", tau_max {spec['delay_bound']}" if spec["delay_bound"] is not None else "")
        + (f", chunks of {spec['chunk']}" if spec["chunk"] != 1 else "")
    )


def _landing_key(
    node: int, frame: ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate
) -> tuple[Any, ...]:
    if isinstance(frame, ps_frames.Push):
        return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.worker, frame.iteration)
    if isinstance(frame, ps_frames.Pulled):
        return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.worker, frame.clock)
    return (node, frame.KIND, frame.job, frame.name, frame.shard, frame.index, 0)
