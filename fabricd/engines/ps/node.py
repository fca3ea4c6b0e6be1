"""One daemon's parameter-server models and every decision about them: where a frame goes,
which frame waits, which epoch a shard is at, who serves it after a rank left, and what is sent
again after a reset or a rank's return.

Rules: :class:`PSNode` owns the models opened on one daemon: per model its spec, the shards
served here (:class:`~fabricd.engines.ps.server.ShardServer`), the local workers
(:class:`~fabricd.engines.ps.worker.Worker`), the epoch of each shard as this daemon knows it,
and the frames held for ranks and models (:mod:`fabricd.engines.ps.routing`).  It takes the
service's inputs (a client's call, a frame from a peer, a rank joined, suspected or gone, a
peer's links back, the clock) with ``now``, and returns actions; it never touches a socket, a
segment's file or a client, and reads the rank table only through
:class:`~fabricd.engines.ps.routing.Ranks`.  Frames between two ranks of this daemon never
leave it: they are handed over inside the engine, in order, before an input returns.

Theory of operation (MLfabric §3.3's hot-standby replication; the exactly-once rules are the
shard server's):

* *Routing.*  A worker's frame for a shard goes to the rank serving it at the epoch this
  daemon knows (:func:`~fabricd.engines.ps.routing.serving`); if that rank is not known at all
  and its partner is, to the partner, which either serves at a later epoch and says so, or
  follows and refuses (the frame goes to the rank when it joins).
* *Holds.*  A frame for a rank that is suspected (its node's links were reset), or on a node
  whose links are not all up, is held until the rank is known and reachable; a worker's frame
  for a model not opened here is held as an early frame (the routing module's bounds).
* *Epochs.*  A shard's epoch grows by one at each failover.  A worker's daemon behind it is
  refused with the later epoch and moves there (:class:`EpochMoved`, resending what is in
  flight); a rank that opens with no state of its own joins its partner (JOIN), which sends it
  the shard's state (a snapshot), and one that opened as primary at epoch 0 while its partner
  was there is *tentative* until the partner answered (it asks again after a reset: it has
  nothing of its own to send).
* *Failover and promotion.*  When the rank serving a shard is gone, its partner serves from the
  next epoch: if it is here, it is promoted (:meth:`ShardServer.promote`), and workers gone
  meanwhile are lost to it (those this daemon heard are gone, whose LOSE entry may have died
  with the primary, and those not known that pushed); a shard with no partner, or whose
  partner is gone or has no state, fails its workers' calls (``peer_failed``).
* *Sending again.*  After a reset TCP cannot say what the peer processed: once a rank is
  reachable again it is sent what was held for it, the pushes and pulls in flight to it, a
  primary's unconfirmed entries (or its whole state, if it went on without the partner), and a
  replica's JOIN.
* *Senders.*  A server's, replica's or partner's frame counts only from the node its rank
  lives on, and a worker's frame naming a rank of another node is never taken as that rank's:
  both are dropped and counted (a rogue node could otherwise forge entries, confirmations or
  acknowledgements).
* *Agreement.*  Every rank opens a model alike: the job's daemons tell each other the spec
  their ranks opened it with (OPENED), and a difference refuses the open or fails the calls
  of every rank that opened it, naming both (:mod:`~fabricd.engines.ps.agreement`).

Suspicion is an input: :meth:`PSNode.rank_suspected`, :meth:`PSNode.rank_joined` (back) and
:meth:`PSNode.rank_gone`; the engine keeps no timer of its own for it (the service decides
when a suspect is gone).  Its only deadlines are the early frames', in the routing module's
:class:`~fabricd.engines.deadlines.Deadlines` heap (:meth:`PSNode.next_deadline`,
:meth:`PSNode.on_timer`).

Actions: the shared :class:`~fabricd.engines.actions.SendFrame` (control link) and
:class:`~fabricd.engines.actions.Complete` (a flush), and this engine's own
(:mod:`fabricd.engines.ps.models` says why each is needed); the frames are built by
:mod:`fabricd.engines.ps.messages`.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from fabricd.engines.actions import Complete, Failure, SendFrame
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.ps import (
    aggregating,
    copying,
    messages,
    partners,
    planning,
    relaying,
    routing,
)
from fabricd.engines.ps.aggregating import direct_after
from fabricd.engines.ps.agreement import Agreement
from fabricd.engines.ps.bounded import NEED_AFTER, DivergenceBound
from fabricd.engines.ps.consistency import Consistency
from fabricd.engines.ps.copy_plan import need_after
from fabricd.engines.ps.distributing import PullBatch
from fabricd.engines.ps.failover import adopt, lose, promote, send_again
from fabricd.engines.ps.gathering import Gathering
from fabricd.engines.ps.joint import PartPlanned, joint_for
from fabricd.engines.ps.models import (
    CallDone,
    Log,
    Model,
    SendData,
    StepShard,
    WorkerSide,
)
from fabricd.engines.ps.routing import Early, EarlyFrames, HeldFrames, pair
from fabricd.engines.ps.scheduler import UNKNOWN_BPS, Gather, scheduler_for
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import Forward, Logged, Need, Snapshot, Step
from fabricd.engines.ps.worker import (
    PullDone,
    PullFailed,
    PushDone,
    SendPull,
    SendPush,
    SendReady,
    Worker,
)
from fabricd.errors import ErrorCode, RemoteProtocolError, UsageError
from fabricd.frames import ps as ps_frames
from fabricd.wire import Kind

if TYPE_CHECKING:
    from fabricd.engines.ps.consistency import UpdateRule
    from fabricd.engines.ps.filters import FilterSettings
    from fabricd.engines.ps.models import Action, Array, Key
    from fabricd.engines.ps.routing import Ranks
    from fabricd.engines.ps.shard_actions import Action as ServerAction
    from fabricd.engines.ps.worker import Action as WorkerAction
    from fabricd.frames import registry
    from fabricd.wire import Meta

#: a worker's frames for the rank serving a shard
ToServer = ps_frames.Push | ps_frames.Pull | ps_frames.Ready
#: the kinds that travel on the data link, with their payload
DATA_KINDS = frozenset({Kind.PUSH, Kind.PULLED, Kind.REPLICATE})


class PSNode:
    """The parameter-server models of the daemon of node ``node`` (module docstring).

    Args:
        node: this daemon's node id.
        ranks: the rank table and the links' state (read only).
        max_payload: the largest payload a frame may carry (bounds the held frames).
        route_timeout: seconds a pull waits for its model's server to open it.
    """

    def __init__(
        self,
        *,
        node: int,
        ranks: Ranks,
        max_payload: int,
        route_timeout: float,
        schedule_interval: float = 0.1,
    ) -> None:
        self.node = node
        self.schedule_interval = schedule_interval
        self.ranks = ranks
        self.max_payload = max_payload
        self.route_timeout = route_timeout
        self.models: dict[Key, Model] = {}
        #: each job's models: a rank's news touches its own job's only (issue 28: a rank of any
        #: job joining walked 10,000 models of another tenant, 37 ms)
        self._jobs: dict[str, set[Key]] = {}
        #: ranks lost with their node's links, not gone yet: what is sent them is held
        self.suspects: set[tuple[str, int]] = set()
        self._early = EarlyFrames(max_payload)
        #: MLfabric: the scheduled shards' batch deadlines, and the granted pushes' starts
        self._ticks: Deadlines[tuple[Key, int]] = Deadlines()
        self._paced: Deadlines[tuple[Key, int, int, int]] = Deadlines()
        #: aggregation: this node's groups, and the pushes sent to an aggregator (their wait
        #: for the server's acknowledgement before they go straight to it)
        # a group waits for a missing member half as long as its members wait for the server:
        # the partial sum comes before they go straight (else it is refused, bytes for nothing)
        self.gathering = Gathering(
            grace=direct_after(schedule_interval) / 2,
            max_bytes=routing.HELD_PAYLOADS * max_payload,
        )
        self._direct: Deadlines[tuple[Key, int, int, int]] = Deadlines()
        self.relays = relaying.Relays()  #: distribution trees: answers a distributor forwards
        #: bounded replication: copies held for the replica until their planned time
        self.copies = copying.HeldCopies(routing.HELD_PAYLOADS * max_payload)
        self._held = HeldFrames(max_payload)
        self._local: deque[tuple[int, registry.PeerFrame, bytes]] = deque()
        self._out: list[Action] = []
        self._now = 0.0  #: the current input's time
        self.counters = {
            "ps_frames_dropped": 0,  #: for a model, shard or worker not here
            "ps_early_expired": 0,
            "ps_failovers": 0,
            "ps_pulls_forwarded": 0,  #: distribution trees: answers forwarded as a distributor
            "ps_pulls_redirected": 0,  #: pulls sent again straight: a distributor's did not come
            "ps_copies_held": 0,  #: bounded replication: copies held for their planned time
        }
        self.agreement = Agreement(node, ranks, self.counters)

    @property
    def early_frames(self) -> int:
        return len(self._early)

    def _begin(self, now: float) -> None:
        self._out, self._now = [], now

    def _done(self) -> list[Action]:
        """Hand over the frames between local ranks, in order, until none is left; then
        return what the input decided.  One refused as malformed is dropped and counted: its
        error must not go up from whatever input flushes, whose peer would be closed."""
        while self._local:
            node, frame, payload = self._local.popleft()
            try:
                self._dispatch(node, frame, payload, self._now)
            except RemoteProtocolError as exc:
                self.counters["ps_frames_dropped"] += 1
                self._log(
                    logging.WARNING,
                    f"a {frame.KIND.name} from node {node} was refused: {exc}",
                    topic="handed over",
                )
        out, self._out = self._out, []
        return out

    def _log(self, level: int, message: str, *, topic: str | None = None) -> None:
        self._out.append(Log(level=level, message=message, topic=topic))

    # -- opening ---------------------------------------------------------------------------
    def model(self, key: Key) -> Model | None:
        return self.models.get(key)

    def _model_for(self, key: Key, spec: Meta, bounds: list[tuple[int, int]]) -> Model:
        model = self.models.get(key)
        if model is None:
            servers, replicas = spec["servers"], spec["replicas"]
            workers = tuple(r for r in range(spec["n"]) if r not in servers and r not in replicas)
            model = Model(spec=spec, bounds=bounds, workers=workers)
        return model

    def open_worker(
        self,
        key: Key,
        spec: Meta,
        bounds: list[tuple[int, int]],
        *,
        rank: int,
        settings: FilterSettings,
        seed: int,
        now: float,
    ) -> list[Action]:
        """Local worker ``rank`` opens the model (the caller checked ``spec``)."""
        self._begin(now)
        model = self._model_for(key, spec, bounds)
        if rank in model.local_workers:
            raise UsageError(f"rank {rank} opened parameter server {key[1]!r} already")
        worker = Worker(
            worker=rank,
            size=spec["size"],
            dtype=spec["dtype"],
            shards=len(bounds),
            settings=settings,
            delay_bound=spec["delay_bound"],
            seed=seed,
            scheduled=spec["scheduling"] == "mlfabric",
            synchronous=spec["consistency"] == "bsp",
            joint=joint_for(spec),
        )
        worker.epochs = [model.epochs.get(shard, 0) for shard in range(len(bounds))]
        model.local_workers[rank] = WorkerSide(engine=worker)
        self._keep(key, model)
        return self._done()

    def open_shard(
        self,
        key: Key,
        spec: Meta,
        bounds: list[tuple[int, int]],
        *,
        rank: int,
        shard: int,
        initial: Array,
        rule: UpdateRule | None,
        settings: FilterSettings,
        now: float,
    ) -> list[Action]:
        """Local rank ``rank`` opens ``shard`` as its server or replica (the caller checked
        ``spec`` and the role): it joins its partner, and frames held for it are taken."""
        self._begin(now)
        model = self._model_for(key, spec, bounds)
        if shard in model.servers:
            raise UsageError(f"shard {shard} of {key[1]!r} is open here already")
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
            replica=rank != int(spec["servers"][shard]) or model.epochs.get(shard, 0) > 0,
            replicated=bool(spec["replicas"]),
            scheduler=scheduler_for(spec, rule, self.node, self.schedule_interval),
            bound=None
            if spec["replication"] != "bounded"
            else DivergenceBound.from_spec(spec["divergence_bound"]),
            trees=PullBatch(
                server=self.node, interval=self.schedule_interval, unknown_bps=UNKNOWN_BPS
            )
            if spec["distribution"] == "tree"
            else None,
            # (longer only where copies are planned, and may be held: copy_plan.py)
            need_after=need_after(self.schedule_interval)
            if spec["scheduling"] == "mlfabric" and not spec["aggregation"]
            else NEED_AFTER,
        )
        model.ranks[shard] = rank
        self._keep(key, model)
        other = model.partner(shard, rank)
        if (
            model.servers[shard].primary
            and other is not None
            and self.ranks.lookup(key[0], other) is not None
        ):
            model.tentative.add(shard)
        self._join(key, shard)
        self._take_early(key)
        return self._done()

    def close_worker(self, key: Key, rank: int) -> Worker | None:
        """Local worker ``rank``'s process left: its side is forgotten (returned)."""
        model = self.models.get(key)
        side = None if model is None else model.local_workers.pop(rank, None)
        self._forget_if_empty(key)
        return None if side is None else side.engine

    def close_shard(self, key: Key, shard: int) -> ShardServer | None:
        """The process serving ``shard`` here left: the shard is forgotten (returned)."""
        model = self.models.get(key)
        if model is None:
            return None
        model.ranks.pop(shard, None)
        model.tentative.discard(shard)  # a rank that opens it again starts afresh
        model.answered.discard(shard)
        server = model.servers.pop(shard, None)
        self._forget_if_empty(key)
        return server

    def _keep(self, key: Key, model: Model) -> None:
        if key not in self.models:  # opened here first: the job's other daemons are told
            self._out += self.agreement.opened_here(key, model)
        self.models[key] = model
        self._jobs.setdefault(key[0], set()).add(key)

    def _forget_if_empty(self, key: Key) -> None:
        model = self.models.get(key)
        if model is not None and not model.local_workers and not model.servers:
            self.gathering.forget(key)
            del self.models[key]
            keys = self._jobs[key[0]]
            keys.discard(key)
            if not keys:
                del self._jobs[key[0]]

    def _of_job(self, job: str | None) -> list[tuple[Key, Model]]:
        """``job``'s models (``None``: every job's), a copy: inputs may close them."""
        if job is None:
            return list(self.models.items())
        return [(key, self.models[key]) for key in self._jobs.get(job, ())]

    def failed(self, key: Key) -> tuple[int, str] | None:
        """A shard of ``key`` nobody serves any more, and why."""
        model = self.models.get(key)
        if model is None or not model.failed:
            return None
        return next(iter(model.failed.items()))

    # -- a worker's calls --------------------------------------------------------------------
    def push(
        self, key: Key, rank: int, update: Array, now: float, norm: float | None = None
    ) -> list[Action]:
        """Local worker ``rank`` pushes ``update`` (refused with ``UsageError`` first);
        ``norm``: the client's norm of it, if it gave one."""
        self._begin(now)
        side = self.models[key].local_workers[rank]
        self._worker(key, side, side.engine.push(update, norm))
        return self._done()

    def pull(self, key: Key, rank: int, out: Array, *, fresh: bool, now: float) -> list[Action]:
        """Local worker ``rank`` pulls into ``out`` (``fresh``: a new array, pulled whole)."""
        self._begin(now)
        side = self.models[key].local_workers[rank]
        actions = side.engine.pull(fresh=fresh)
        side.out = out
        self._worker(key, side, actions)
        return self._done()

    def _worker(self, key: Key, side: WorkerSide, actions: list[WorkerAction]) -> None:
        model = self.models.get(key)
        if model is None:
            return
        job, name = key
        rank = side.engine.worker
        epochs = side.engine.epochs
        for action in actions:
            if isinstance(action, SendPush | SendPull | SendReady):
                to = self._serving(job, model, action.shard)
                epoch = epochs[action.shard]
                frame, payload = messages.to_server(key, model.spec, rank, to, epoch, action)
                if isinstance(action, SendPush) and action.via is not None:
                    self._to_node(action.via, frame, payload)
                    wait = self._now + direct_after(self.schedule_interval)
                    self._direct.set((key, rank, action.shard, action.iteration), wait)
                else:
                    self._send(job, to, frame, payload)
                if (
                    isinstance(action, SendPush)
                    and action.via is None  # (an aggregate travels whole to the replica)
                    and model.spec["replication"] == "bounded"
                ):
                    copying.send(self, job, model, to, frame, payload)
            elif isinstance(action, PushDone | PullDone):
                if isinstance(action, PullDone):
                    side.out = None
                    result: Meta = {"version": action.version}
                else:
                    result = {"iteration": action.iteration, "dropped": list(action.dropped)}
                result["versions"] = list(action.versions)
                result["epochs"] = [epochs[s] for s in range(len(model.bounds))]
                self._out.append(CallDone(key=key, rank=rank, result=result))
            else:
                assert isinstance(action, PullFailed)
                side.out = None
                failure = Failure(
                    code=ErrorCode.PEER_FAILED,
                    message=f"shard {action.shard} of {name!r}: {action.reason}",
                )
                self._out.append(CallDone(key=key, rank=rank, failure=failure))

    def _serving(self, job: str, model: Model, shard: int) -> int:
        """Where a worker here sends ``shard``'s frames (module docstring, *Routing*)."""
        target = model.target(shard)
        if self.ranks.lookup(job, target) is not None or (job, target) in self.suspects:
            return target
        other = model.partner(shard, target)
        if other is not None and self.ranks.lookup(job, other) is not None:
            return other
        return target

    # -- a shard's process -----------------------------------------------------------------
    def stepped(self, key: Key, shard: int, version: int, model: Array, now: float) -> list[Action]:
        """The process serving ``shard`` ran its update callback: ``model`` is the new one."""
        self._begin(now)
        server = self.models[key].servers[shard]
        self._server(key, shard, server.stepped(version, model, now))
        return self._done()

    def flush(self, key: Key, shards: list[int], op: int, now: float) -> tuple[bool, list[Action]]:
        """The process serving ``shards`` flushes them (publishes what the lossless mode held
        back); a replica's follow its primary's.  ``False``: none is primary here, nothing to
        wait for; else :class:`Complete` of ``op`` comes once every flush is processed (with
        a replica, confirmed), or failed if a shard was taken over by its partner first."""
        self._begin(now)
        model = self.models[key]
        waits: dict[int, tuple[int, int]] = {}
        for shard in shards:
            server = model.servers[shard]
            if server.primary:
                waits[shard] = (server.statistics().logged + 1, server.epoch)
                self._server(key, shard, server.flush(now))
        if waits:
            model.flushes[op] = waits
            self._flushed(model)
        return bool(waits), self._done()

    def drop_flush(self, key: Key, op: int) -> None:
        """Forget flush ``op`` (its process left, or the daemon stops)."""
        model = self.models.get(key)
        if model is not None:
            model.flushes.pop(op, None)

    def _flushed(self, model: Model) -> None:
        """Complete the flushes whose shards processed them; fail those whose shard was taken
        over by its partner before (its log went with the state it took)."""
        for op, waits in list(model.flushes.items()):
            for shard, (index, epoch) in list(waits.items()):
                server = model.servers.get(shard)
                if server is None:
                    continue  # closed: its process, the flush's, left
                if server.epoch != epoch or not server.primary:
                    del model.flushes[op]
                    failure = Failure(
                        code=ErrorCode.PEER_FAILED,
                        message=f"shard {shard} was taken over by its partner before the flush "
                        "was published: flush where it is served",
                    )
                    self._out.append(Complete(op=op, failure=failure))
                    break
                stats = server.statistics()
                if stats.logged - stats.unreplicated >= index:
                    del waits[shard]
            else:
                if not waits:
                    del model.flushes[op]
                    self._out.append(Complete(op=op))

    # -- a shard's actions -------------------------------------------------------------------
    def _server(self, key: Key, shard: int, actions: list[ServerAction]) -> None:
        model = self.models.get(key)
        server = None if model is None else model.servers.get(shard)
        if model is None or server is None:
            return
        job = key[0]
        me = model.ranks[shard]
        other = model.partner(shard, me)
        planning.send(self, key, model, me, (a for a in actions if isinstance(a, PartPlanned)))
        for action in actions:
            if isinstance(action, PartPlanned):
                continue  # (sent above, one PLAN per shard)
            if isinstance(action, Forward | Snapshot):
                assert other is not None
                if not self._replicate(key, shard, me, other, action):
                    return  # the entries that followed were processed just now
            elif isinstance(action, Step):
                self._out.append(StepShard(key=key, shard=shard, step=action))
            elif isinstance(action, Gather):
                gather = messages.gather(key, model.spec, shard, me, server.epoch, action)
                self._to_node(action.aggregator, gather)
            elif isinstance(action, Logged | Need):
                assert other is not None
                self._send(job, other, messages.confirmation(key, shard, me, other, action))
            else:
                frame, payload = messages.to_worker(key, shard, me, server, action)
                self._send(job, action.worker, frame, payload)
        if model.flushes:
            self._flushed(model)
        if server.scheduler is not None or server.bounded or server.trees is not None:
            due = server.next_deadline()
            if due is None:
                self._ticks.cancel((key, shard))
            else:
                self._ticks.set((key, shard), due)

    def _replicate(
        self, key: Key, shard: int, me: int, other: int, action: Forward | Snapshot
    ) -> bool:
        """Send the partner an entry or the snapshot; ``False``: a snapshot too large for a
        frame, and the shard goes on unreplicated."""
        if isinstance(action, Snapshot) and len(action.data) > self.max_payload:
            self._log(
                logging.ERROR,
                f"parameter server {key[1]!r} shard {shard}: a snapshot of {len(action.data)} B "
                f"is more than max_payload ({self.max_payload} B) allows: rank {other} "
                "cannot follow this shard, which goes on unreplicated (raise max_payload, "
                "or use more servers)",
            )
            server = self.models[key].servers[shard]
            self._server(key, shard, server.replica_lost(self._now))
            return False
        frame, payload = messages.to_partner(key, self.models[key].spec, shard, me, other, action)
        self._send(key[0], other, frame, payload)
        return True

    def _join(self, key: Key, shard: int) -> None:
        """Ask the shard's partner for its state (it ignores this if it has none to give)."""
        model = self.models[key]
        model.answered.discard(shard)
        rank = model.ranks[shard]
        other = model.partner(shard, rank)
        if other is None:
            return
        epoch = model.servers[shard].epoch
        join = messages.join(key, model.spec, shard, rank, other, epoch)
        self._send(key[0], other, join)

    # -- moving frames -----------------------------------------------------------------------
    def _send(self, job: str, rank: int, frame: registry.PeerFrame, payload: bytes = b"") -> None:
        """Send ``frame`` to rank ``rank``'s node, or hand it over here if the rank is local.
        A rank not known (yet, or any more) gets nothing: what waits for it is sent again
        when it joins, or fails when it is gone.  One suspected, or on a node whose links are
        not all up, gets the frame once it is known and they are: an acknowledgement or an
        answer is sent once, to a worker that will not ask again."""
        entry = self.ranks.lookup(job, rank)
        if entry is None and (job, rank) not in self.suspects:
            return
        if entry is None or (entry.node != self.node and not self.ranks.reachable(entry.node)):
            if not self._held.hold((job, rank), frame, payload):
                self.counters["ps_frames_dropped"] += 1
            return
        self._to_node(entry.node, frame, payload)

    def _to_node(self, node: int, frame: registry.PeerFrame, payload: bytes = b"") -> None:
        """Send ``frame`` to ``node`` itself (an aggregator), or hand it over here; a node
        whose links are not all up gets nothing (the pushes come straight to their server
        after their wait: module aggregating's)."""
        if node == self.node:
            self._local.append((node, frame, payload))
        elif not self.ranks.reachable(node):
            return
        elif frame.KIND in DATA_KINDS:
            self._out.append(SendData(node=node, frame=frame, payload=payload))
        else:
            self._out.append(SendFrame(node=node, frame=frame))

    def on_frame(
        self, node: int, frame: registry.PeerFrame, payload: bytes, now: float
    ) -> list[Action]:
        """A PS frame (with its payload, if it has one) from ``node``.

        Raises:
            RemoteProtocolError: the frame is malformed (the peer is closed).
        """
        self._begin(now)
        self._dispatch(node, frame, payload, now)
        return self._done()

    def _dispatch(self, node: int, frame: registry.PeerFrame, payload: bytes, now: float) -> None:
        if isinstance(frame, ps_frames.Opened):
            self._out += self.agreement.on_opened(node, frame, self.models)
            return
        if isinstance(frame, ps_frames.Push) and frame.group is not None:
            aggregating.at_member(self, node, frame, payload, now)
            return
        if isinstance(frame, ps_frames.Push) and frame.copy:
            if self._from(node, frame.job, frame.worker):
                partners.at_copy(self, frame, payload, now)
            return
        if isinstance(frame, ps_frames.Push | ps_frames.Pull | ps_frames.Ready):
            self._at_server(node, frame, payload, now)
            return
        if isinstance(frame, ps_frames.Gather):
            aggregating.at_gather(self, node, frame, now)
            return
        if isinstance(frame, ps_frames.Plan):
            planning.at_plan(self, node, frame, now)
            return
        if isinstance(frame, ps_frames.Pulled) and frame.forwarded:
            relaying.at_forwarded(self, node, frame, payload, now)  # (a distributor's)
            return
        # a server's, replica's or partner's frame counts only from the node its rank lives
        # on: anything else could forge an entry, a confirmation or an acknowledgement
        assert isinstance(
            frame,
            ps_frames.Pushed
            | ps_frames.Pulled
            | ps_frames.Replicate
            | ps_frames.Replicated
            | ps_frames.Join
            | ps_frames.Grant,
        )
        sender = (
            frame.replica
            if isinstance(frame, ps_frames.Replicated | ps_frames.Join)
            else frame.server
        )
        if not self._sent_by(node, frame.job, sender):
            return
        if isinstance(frame, ps_frames.Pushed | ps_frames.Pulled | ps_frames.Grant):
            self._at_worker(frame, payload, now)
        elif isinstance(frame, ps_frames.Replicate):
            partners.at_replica(self, frame, payload, now)
        elif isinstance(frame, ps_frames.Join):
            partners.at_partner(self, frame)
        else:
            key = (frame.job, frame.name)
            model = self.models.get(key)
            server = None if model is None else model.servers.get(frame.shard)
            if (
                model is None
                or server is None
                or not server.primary
                or model.ranks[frame.shard] != frame.server
                or model.partner(frame.shard, frame.server) != frame.replica
            ):  # (only the shard's partner confirms: any other could clear the bound's lead)
                self.counters["ps_frames_dropped"] += 1
                return
            if frame.need:
                self._server(key, frame.shard, server.needed(frame.index))
            else:
                self._server(key, frame.shard, server.replicated_upto(frame.index, now))

    def may_send(
        self, node: int, frame: ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate
    ) -> bool:
        """Whether ``node`` may be the sender of ``frame`` (the rule :meth:`on_frame` applies,
        changing and counting nothing): asked before a payload is given a buffer, so that a
        frame from a node its sender rank does not live on costs nothing; its :meth:`on_frame`
        then drops it and counts it once."""
        rank = frame.worker if isinstance(frame, ps_frames.Push) else frame.server
        if isinstance(frame, ps_frames.Pulled):
            rank = frame.sender  # (a distributor's, for a forwarded answer)
        entry = self.ranks.lookup(frame.job, rank)
        if isinstance(frame, ps_frames.Push):
            return entry is None or entry.node == node
        return entry is not None and entry.node == node

    def _sent_by(self, node: int, job: str, rank: int) -> bool:
        """Whether rank ``rank`` lives on ``node``, known there: a server's or replica's
        frame from anywhere else is dropped and counted.  One that overtook its rank's
        announcement after a reset is sent again when the rank joins."""
        entry = self.ranks.lookup(job, rank)
        if entry is not None and entry.node == node:
            return True
        self.counters["ps_frames_dropped"] += 1
        message = f"node {node} sent a frame as server rank {rank}, which is not on it"
        self._log(logging.WARNING, message, topic="stray")
        return False

    def _from(self, node: int, job: str, rank: int) -> bool:
        """Whether rank ``rank`` may live on ``node`` (a frame naming a rank of another node
        is dropped and counted, never taken as that rank's)."""
        entry = self.ranks.lookup(job, rank)
        if entry is None or entry.node == node:
            return True
        self.counters["ps_frames_dropped"] += 1
        self._log(
            logging.WARNING, f"node {node} sent a frame as rank {rank}, not on it", topic="stray"
        )
        return False

    def _at_server(self, node: int, frame: ToServer, payload: bytes, now: float) -> None:
        if not self._from(node, frame.job, frame.worker):
            return
        key = (frame.job, frame.name)
        model = self.models.get(key)
        server = None if model is None else model.servers.get(frame.shard)
        if model is None or server is None:
            self._hold(node, frame, payload, now)
            return
        if isinstance(frame, ps_frames.Ready) and frame.largest > self.max_payload:
            raise RemoteProtocolError(f"a READY of {frame.largest} B: a push is one frame's")
        if model.spec != frame.spec:  # the backstop of the agreement (agreement.py)
            if model.disagreed is None:
                self._refuse(key, frame, messages.unlike(frame.spec, model.spec))
            else:  # its daemon hears why from an OPENED (a refusal could overtake it)
                self._out.append(self.agreement.answer(node, key, model))
            return
        if frame.worker not in model.workers:
            raise RemoteProtocolError(f"rank {frame.worker} is not a worker of {frame.name!r}")
        if frame.shard in model.tentative or self._awaits_state(model, frame):
            # this rank waits for its partner's answer or state: the frame is taken once it
            # came (with the shard's epoch, which moves a worker's daemon that did not know it)
            self._hold(node, frame, payload, now)
            return
        if not server.primary and frame.epoch > server.epoch:
            # the worker's daemon saw the primary go before this one did
            promote(self, key, frame.shard, "a worker failed over to it", now)
        if not server.primary or frame.epoch != server.epoch:
            # a worker's daemon behind this rank's epoch (it opened the model after a
            # failover it never heard of) is told the epoch: it moves to the rank serving it
            later = server.epoch if server.has_state and server.epoch > frame.epoch else None
            self._refuse(key, frame, messages.why_not_serving(server, frame.epoch), epoch=later)
            return
        if isinstance(frame, ps_frames.Push) and frame.members is not None:
            group = frame.iteration  # an aggregate's: its group (messages.aggregate)
            actions = server.push_aggregate(frame.members, payload, now, group=group, sender=node)
        elif isinstance(frame, ps_frames.Push):
            actions = server.push(
                frame.worker, frame.iteration, frame.base, payload, now, frame.base_epoch
            )
        elif isinstance(frame, ps_frames.Ready):
            actions = server.ready(
                frame.worker,
                frame.iteration,
                frame.base,
                frame.size,
                frame.norm,
                node,
                now,
                sizes=frame.sizes,
                joint=frame.joint,
            )
        else:
            actions = server.pull(
                frame.worker, frame.clock, frame.since, now, host=node, direct=frame.direct
            )
        self._server(key, frame.shard, actions)

    def _awaits_state(self, model: Model, frame: ToServer) -> bool:
        """Whether the local rank of ``frame``'s shard has no state and its partner, known,
        will send it."""
        other = model.partner(frame.shard, model.ranks[frame.shard])
        return (
            not model.servers[frame.shard].has_state
            and other is not None
            and self.ranks.lookup(frame.job, other) is not None
        )

    def _refuse(
        self,
        key: Key,
        frame: ToServer,
        why: str,
        *,
        epoch: int | None = None,
    ) -> None:
        """Answer ``frame`` with ``why``; ``epoch``: the shard's later epoch, which moves the
        worker's daemon to the rank serving it.  An aggregate is dropped and counted instead:
        it is no push of its sender's, and its members come straight from their workers'
        daemons after their wait."""
        if isinstance(frame, ps_frames.Push) and frame.members is not None:
            self.counters["ps_frames_dropped"] += 1
            return
        self._send(key[0], frame.worker, messages.refusal(key, frame, why, epoch))

    def _at_worker(
        self,
        frame: ps_frames.Pushed | ps_frames.Pulled | ps_frames.Grant,
        payload: bytes,
        now: float,
    ) -> None:
        key = (frame.job, frame.name)
        model = self.models.get(key)
        side = None if model is None else model.local_workers.get(frame.worker)
        if model is None or side is None:
            self.counters["ps_frames_dropped"] += 1
            return
        side.engine.check_frame(frame.shard)
        if frame.epoch > model.epochs.get(frame.shard, 0) and frame.server in pair(
            model.spec, frame.shard
        ):
            # the shard's pair is at a later epoch than this daemon knew: what was refused is
            # sent again to the rank serving it
            adopt(self, key, frame.shard, frame.epoch, "its pair said so")
            return
        if frame.server != model.target(frame.shard):
            self.counters["ps_frames_dropped"] += 1  # from the server before a failover
            return
        if isinstance(frame, ps_frames.Pulled) and frame.forward:
            relaying.forward(self, frame, payload)  # this daemon is a distributor
        actions: list[WorkerAction] = []
        if isinstance(frame, ps_frames.Grant) and (
            frame.copy_only or side.engine.awaits_grant(frame.shard, frame.iteration)
        ):
            copying.granted(self, key, frame, now)  # (when its copy goes: bounded replication)
            if frame.copy_only:
                return  # (a copy grant says nothing of any push: one waiting keeps its time)
        if isinstance(frame, ps_frames.Grant) and not side.engine.awaits_grant(
            frame.shard, frame.iteration
        ):
            pass  # sent again, or for a push that is not waiting for it: nothing kept
        elif isinstance(frame, ps_frames.Grant) and frame.wait_us:
            # sent when its planned start comes (on_timer): the server's link is time-shared
            self._route(side, frame)
            self._paced.set(
                (key, frame.worker, frame.shard, frame.iteration), now + frame.wait_us / 1e6
            )
        elif isinstance(frame, ps_frames.Grant):
            self._route(side, frame)
            actions = side.engine.granted(frame.shard, frame.iteration)
        elif isinstance(frame, ps_frames.Pushed):
            actions = side.engine.pushed(frame.shard, frame.iteration, frame.version, frame.dropped)
        elif frame.error is not None:
            actions = side.engine.refused(frame.shard, frame.clock, frame.error)
        elif frame.expect_us is not None:
            relaying.expect(self, frame, now)  # the answer comes through a distributor
        elif side.out is None:
            actions = []  # an answer nobody waits for (the client left, or sent again)
        else:
            # a tree's answer is a delta from its branch's oldest cache: it may be older
            older = bool(frame.forward) or frame.forwarded
            actions = side.engine.pulled(frame.shard, frame.clock, payload, side.out, older=older)
        self._worker(key, side, actions)

    @staticmethod
    def _route(side: WorkerSide, grant: ps_frames.Grant) -> None:
        if grant.via is not None and grant.group is not None:
            side.engine.route(grant.shard, grant.iteration, grant.via, grant.group)

    def _settle(self, key: Key, shard: int) -> None:
        """``shard`` is no longer tentative here (its partner answered, or is gone): the
        workers' frames held meanwhile are taken now."""
        model = self.models[key]
        if shard in model.tentative:
            model.tentative.discard(shard)
            self._take_early(key)

    # -- early frames ------------------------------------------------------------------------
    def _hold(self, node: int, frame: ToServer, payload: bytes, now: float) -> None:
        if self._early.holds(node, frame):
            return  # sent again after a reset: the one held is taken (or refused) in its place
        waits = isinstance(frame, ps_frames.Push | ps_frames.Ready) and frame.server in pair(
            frame.spec, frame.shard
        )
        if not self._early.has_room(len(payload)):
            self.counters["ps_frames_dropped"] += 1
            why = self._early.why_full(frame.server, frame.name)
            if waits:
                # not answered: a push answered as dropped counts as processed, and the
                # worker's next one would skip an iteration its server never saw; it waits
                # (its stall row says for whom) and is sent again after its links' next reset
                self._log(
                    logging.WARNING, f"a push from node {node} not held: {why}", topic="early"
                )
            else:
                self._refuse((frame.job, frame.name), frame, why)
            return
        # a pull, or a push for a shard or rank its spec does not have, is refused in time
        deadline = None if waits else now + self.route_timeout
        self._early.hold(Early(node=node, frame=frame, payload=payload, deadline=deadline))

    def _take_early(self, key: Key) -> None:
        model = self.models[key]
        for early in self._early.take(
            lambda e: (e.frame.job, e.frame.name) == key and e.frame.shard in model.servers
        ):
            self._local.append((early.node, early.frame, early.payload))

    # -- peers and ranks ---------------------------------------------------------------------
    def peer_up(self, node: int, now: float) -> list[Action]:
        """``node``'s links are up again: send its ranks what may have been lost with the old
        links, and what was held for them; ranks it has not announced again yet get theirs
        when it does (:meth:`rank_joined`)."""
        self._begin(now)
        self._out += self.agreement.peer_up(node, self.models.items())

        def on_node(job: str, rank: int) -> bool:
            entry = self.ranks.lookup(job, rank)
            return entry is not None and entry.node == node

        send_again(self, on_node, rejoin=False)
        relaying.redirect(self, self.relays.through(node=node))  # answers lost in flight
        return self._done()

    def rank_joined(self, job: str, rank: int, node: int, now: float) -> list[Action]:
        """Rank ``rank`` of ``job`` is known on ``node`` (first seen, or back): it is no
        longer suspected,
        and what waits for it goes now, unless its node's links are not all up yet (then
        :meth:`peer_up` sends it).  A peer forgets the ranks of a node it reset, so
        :meth:`peer_up` could not tell it was there."""
        self._begin(now)
        self.suspects.discard((job, rank))
        for _, model in self._of_job(job):
            model.gone.discard(rank)
        self._out += self.agreement.rank_joined(node, self._of_job(job))
        if node == self.node or self.ranks.reachable(node):
            send_again(self, lambda j, r: (j, r) == (job, rank), rejoin=True, job=job)
        return self._done()

    def rank_suspected(self, job: str, rank: int) -> None:
        """Rank ``rank`` of ``job`` was lost with its node's links: what is sent it is held
        until it is back (:meth:`rank_joined`) or gone (:meth:`rank_gone`)."""
        self.suspects.add((job, rank))

    def rank_gone(self, job: str, rank: int, reason: str, now: float) -> list[Action]:
        """Rank ``rank`` of ``job`` is gone for good: lose it as a worker, replace it as a
        server, go on without it as a replica."""
        self._begin(now)
        self.suspects.discard((job, rank))
        self._held.drop((job, rank))
        self.agreement.forget(job, rank)
        # a push for a server that left is sent again to its successor, if any
        gone = self._early.take(
            lambda e: e.frame.job == job and rank in (e.frame.worker, e.frame.server)
        )
        self.counters["ps_frames_dropped"] += len(gone)
        for key, model in self._of_job(job):
            lose(self, key, model, rank, reason, now)
        relaying.redirect(self, self.relays.through(job=job, rank=rank))
        return self._done()

    # -- time --------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        due = (
            self._early.next_deadline(),
            self._ticks.next(),
            self._paced.next(),
            self._direct.next(),
            self.gathering.next_deadline(),
            self.relays.next(),
            self.copies.next(),
        )
        return min((d for d in due if d is not None), default=None)

    def on_timer(self, now: float) -> list[Action]:
        """Decide the scheduled shards' batches that are due, send the granted pushes whose
        start came, and refuse the early frames whose model did not open within
        ``route_timeout``."""
        self._begin(now)
        for key, shard in self._ticks.pop_due(now):
            model = self.models.get(key)
            server = None if model is None else model.servers.get(shard)
            if model is not None and server is not None:
                other = model.partner(shard, model.ranks[shard])
                entry = None if other is None else self.ranks.lookup(key[0], other)
                replica = None if entry is None else entry.node  # (its copies are planned)
                nodes = planning.servers(self, key, model) if shard == 0 else None
                actions = server.on_timer(now, self.ranks.bandwidth, replica, nodes)
                self._server(key, shard, actions)
        for heap, act in ((self._paced, Worker.granted), (self._direct, Worker.direct)):
            for key, rank, shard, iteration in heap.pop_due(now):
                model = self.models.get(key)
                side = None if model is None else model.local_workers.get(rank)
                if side is not None:
                    self._worker(key, side, act(side.engine, shard, iteration))
        aggregating.forward(self, self.gathering.on_timer(now))
        relaying.on_timer(self, now)
        copying.send_due(self, now)
        for early in self._early.expired(now):
            self.counters["ps_early_expired"] += 1
            frame = early.frame
            self._refuse(
                (frame.job, frame.name),
                frame,
                f"rank {frame.server} did not open parameter server {frame.name!r} "
                f"within route_timeout ({self.route_timeout} s)",
            )
        return self._done()
