"""One shard of a parameter-server model on its server, or on that server's replica.

Rules: this module decides, for one shard, what each push, pull, lost worker and replication
acknowledgement leads to, and keeps the shard's whole state: the consistency
(:class:`~fabricd.engines.ps.consistency.Coordinator`), the update rule, the parameter filter
(TDF §III.D) and the timed storage (TDF §III.B).  It never touches a socket: the ``ps`` service
moves the frames its actions name and says which worker was lost and when the replica
answered.  A malformed push or pull, or a replication entry out of order, raises
:class:`~fabricd.errors.RemoteProtocolError` with nothing changed.

Theory of operation.

* A push (one worker's filtered update of one iteration, :mod:`fabricd.engines.ps.push`) is
  checked, decoded, and becomes a log *entry*; so does a lost worker.  Entries are *processed*
  in log order: the coordinator decides, the update rule steps the model for each
  :class:`~fabricd.engines.ps.consistency.Apply`, the parameter filter says what to publish,
  and the store makes it the next version.  Every worker's push is acknowledged
  (:class:`Acked`) once processed: applied (with the version it made), or dropped (why).  A
  pull is answered (:class:`Answer`: the store's reply since the worker's version) when the
  coordinator allows.
* Exactly once: a worker has at most one push in flight per shard (a second before the first
  is acknowledged is a protocol error), so the server knows each worker's next iteration; a
  push of an earlier one is the worker's daemon sending it again after a link reset.  If it
  was processed, the acknowledgement is sent again; if it waits (replication, a BSP
  iteration), its acknowledgement will come.  It is never applied twice.
* Order-preserving replication (MLfabric §4's replicas, "forwards every applied update, in
  order"): with a replica, the primary forwards each entry (:class:`Forward`) and processes it
  only once the replica has logged it and every entry before it (:meth:`replicated`), so
  nothing a worker was told, no acknowledgement and no published version, exists on the
  primary alone.  The replica processes the same entries in the same order through the same
  deterministic steps, so its model, versions and acknowledgement records equal the primary's
  as of the last entry it logged.  When the primary dies the replica is promoted
  (:meth:`promote`, the *epoch* grows by one) and serves the workers, whose daemons send it
  every push not yet acknowledged: one it logged is acknowledged again, one it never saw is
  applied now.  Versions never go back: a version a worker saw was logged by the replica first.
* The update callback (MLfabric Table 1, ``registerUpdateCallback``): with ``rule=None`` the
  server's own process steps the model.  Each :class:`~fabricd.engines.ps.consistency.Apply`
  becomes a :class:`Step` for the service to hand to the process, and the shard carries out
  nothing after it (acknowledgements, answers, later applies) until :meth:`ShardServer.stepped`
  brings the new model: the coordinator's decisions never depend on the model, so they are
  taken at once and queued.  A replica's process runs the same callback on the same steps.
* Cost: a push is O(shard) to decode and apply; a pull O(changed chunks) (the store); the log
  holds at most one entry per worker (one push in flight each) and the lost workers' entries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps import shard_state
from fabricd.engines.ps import snapshot as ps_snapshot
from fabricd.engines.ps.bounded import (
    NEED_AFTER,
    DivergenceBound,
    Lead,
    Lineage,
    ReplicaLog,
    copy_digest,
)
from fabricd.engines.ps.consistency import (
    SGD,
    Apply,
    Consistency,
    Coordinator,
    Drop,
    Refused,
    Reply,
    UpdateRule,
    step_model,
)
from fabricd.engines.ps.filters import LOW_MAX, FilterSettings, ParameterFilter
from fabricd.engines.ps.joint import PartPlanned
from fabricd.engines.ps.scheduler import CopyGranted, Denied, Gather, Granted
from fabricd.engines.ps.shard_actions import (
    FLUSH,
    LOSE,
    PUSH,
    Acked,
    Action,
    Answer,
    Entry,
    Forward,
    Logged,
    Need,
    Refuse,
    ShardStatistics,
    Snapshot,
    Step,
)
from fabricd.engines.ps.storage import HEADER as PULL_HEADER
from fabricd.engines.ps.storage import TimedStore
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.wire import get_int

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from fabricd.engines.ps.distributing import PullBatch
    from fabricd.engines.ps.scheduler import ShardScheduler

Array = np.ndarray[Any, Any]

#: the marker of a flush among the coordinator's actions
_FLUSHED: Final = object()


class ShardServer:
    """One shard's server state (module docstring).

    ``initial``: the shard's starting values (copied), a flat float16/32/64 array.  ``rule``:
    the update rule, or ``None``: the server's process runs it (:class:`Step`).  ``replica``:
    this is the replica (it logs what the primary forwards).  ``replicated``: this is a primary
    with a replica.  ``bound``: bounded-divergence replication (:mod:`fabricd.engines.ps.
    bounded`) instead of the chain's.  The other arguments are the coordinator's and the
    filters'.

    Raises:
        UsageError: a norm bound with an update callback (its steps' norms are unknown).
    """

    def __init__(
        self,
        *,
        initial: Array,
        workers: Iterable[int],
        consistency: Consistency,
        staleness: int = 0,
        delay_bound: int | None = None,
        rule: UpdateRule | None,
        settings: FilterSettings | None = None,
        chunk: int = 1,
        replica: bool = False,
        replicated: bool = False,
        scheduler: ShardScheduler | None = None,
        bound: DivergenceBound | None = None,
        trees: PullBatch | None = None,
        need_after: float = NEED_AFTER,
    ) -> None:
        settings = settings or FilterSettings()
        if bound is not None and consistency is not Consistency.ASYNC:
            raise UsageError(
                "a divergence bound takes consistency async (a rollback would "
                "leave a synchronous iteration waiting for ever)"
            )
        if bound is not None and bound.norm is not None and rule is None:
            raise UsageError(
                "a divergence bound's norm needs update_rule 'sum' or 'sgd' (a callback's "
                "steps are not known here): bound the updates instead"
            )
        self.coordinator = Coordinator(
            workers=workers,
            consistency=consistency,
            staleness=staleness,
            delay_bound=delay_bound,
        )
        self.rule = rule
        #: MLfabric's scheduler of the shard's pushes (``scheduling="mlfabric"``), or ``None``
        self.scheduler = scheduler
        self.trees = trees  #: MLfabric's distribution trees (``distribution="tree"``), or None
        self.filter = ParameterFilter(settings, initial, chunk=chunk)
        published = self.filter.published
        if settings.plnp:  # P-LNP: the store holds what pulls carry, float16 (ps_filters)
            published = np.clip(published, -LOW_MAX, LOW_MAX).astype(np.float16)
        self.store = TimedStore(published, chunk=chunk)
        self.size = initial.size
        self.dtype = initial.dtype
        self.primary = not replica
        #: a primary that waits for its replica's confirmations (it has one, not given up)
        self.replicated = replicated and not replica
        #: the replica has the state and takes forwarded entries (it joined)
        self.synced = False
        #: whether this shard holds the model: a fresh replica has none until a snapshot
        self.has_state = not replica
        self._join_pending = False  #: a replica asked to join while a step was out
        self._confirm: int | None = None  #: replica: the entry to confirm once processed
        self.epoch = 0
        self._index = 0  #: the last entry taken (primary) or logged (replica)
        self._unreplicated: deque[Entry] = deque()  #: forwarded, not yet confirmed
        self._waiting: dict[int, int] = {}  #: worker -> iteration taken, not yet processed
        #: worker -> (iteration, version, dropped) of its last processed push
        self._last: dict[int, tuple[int, int, str | None]] = {}
        self._actions: deque[Any] = deque()  #: the coordinator's, not carried out yet
        self._stepping: Apply | None = None  #: the Apply whose step the process runs now
        #: the versions of steps a snapshot made void while the process ran them
        self._voided: deque[int] = deque()
        self._pushes = self._resent = self._push_bytes = 0
        self._pulls = self._pull_bytes = 0
        self._aggregates = self._aggregates_refused = 0
        #: bounded replication: the primary's lead, and the replica's copies and the entries
        #: received that wait for theirs (with when they started to wait)
        momentum = rule.momentum if isinstance(rule, SGD) else 0.0
        self._lead = None if bound is None else Lead(bound, momentum)
        self._lineage = Lineage()  #: bounded: the versions each promotion kept
        self._log = ReplicaLog(need_after)  #: replica: the entries received, awaiting copies
        self._applied_upto = 0  #: primary: the last entry processed here
        #: bounded replication: the entries received a promotion dropped (their copies lost)
        self.rolled_back = 0
        self._norms: dict[int, float] = {}  #: primary, bounded: entry -> ||u|| of its step

    # -- the primary's inputs -------------------------------------------------------------
    def push(
        self,
        worker: int,
        iteration: int,
        base: int,
        payload: bytes | bytearray,
        now: float,
        base_epoch: int | None = None,
    ) -> list[Action]:
        """Worker ``worker``'s encoded push of ``iteration``, computed from version ``base``
        (read at ``base_epoch``, bounded replication's: ``None``, the shard's epoch).

        Raises:
            RemoteProtocolError: this is a replica, the push is malformed or breaks the
                consistency's rules, or the worker pushed again before its last push was
                acknowledged.
        """
        self._primary_only("a push")
        seen = self._seen(worker, iteration, base, base_epoch)
        if seen is not None:
            return seen
        self.coordinator.check_push(worker, iteration, base)
        values = ps_push.decode(payload, self.size, self.dtype)  # refused now, not when processed
        self._pushes += 1
        self._push_bytes += len(payload)
        self._waiting[worker] = iteration
        return self._take(
            Entry(
                index=self._index + 1,
                kind=PUSH,
                worker=worker,
                iteration=iteration,
                base=base,
                payload=payload,
            ),
            now,
            values,
        )

    def push_aggregate(
        self,
        members: tuple[tuple[int, int, int], ...],
        payload: bytes | bytearray,
        now: float,
        *,
        group: int,
        sender: int,
    ) -> list[Action]:
        """An aggregator's sum of ``members``' pushes (MLfabric §5.2; :mod:`fabricd.engines.ps.
        gathering`): taken as one entry and applied once for all of them, unless any member was
        taken or decided already (its worker's daemon sent it straight here after its wait,
        or an aggregate held it): then the whole aggregate is refused, counted and answered
        with nothing, and the members not decided come straight from their workers' daemons
        in turn.  So each (worker, iteration) is applied exactly once, whichever way it came.
        Only an aggregate the scheduler asked node ``sender`` for, as group ``group``, is taken
        (:meth:`~fabricd.engines.ps.scheduler.ShardScheduler.expects`); any other is refused
        the same way.

        Raises:
            RemoteProtocolError: this is a replica or a shard not scheduled, or a member, or the
                payload, would be refused as a push would.
        """
        self._primary_only("an aggregate")
        if self.scheduler is None or not self.scheduler.aggregation:
            raise RemoteProtocolError("an aggregate for a shard that does not aggregate (MLfabric)")
        coordinator = self.coordinator
        bound, version, live = coordinator.delay_bound, coordinator.version, coordinator.live
        if (
            not self.scheduler.expects(group, sender, members)
            or any(w not in live for w, _, _ in members)
            or (bound is not None and any(version - b > bound for _, _, b in members))
            or (self._lead is not None and any(b > version for _, _, b in members))
        ):
            # (a member lost or too stale: its fellows come straight, each judged alone)
            self._aggregates_refused += 1
            return []
        for worker, iteration, _ in members:
            last = self._last.get(worker)
            if worker in self._waiting or (last is not None and last[0] >= iteration):
                self._aggregates_refused += 1
                return []
        for worker, iteration, base in members:
            self.coordinator.check_push(worker, iteration, base)
        values = ps_push.decode(payload, self.size, self.dtype)  # refused now, not when processed
        self._pushes += len(members)
        self._aggregates += 1
        self._push_bytes += len(payload)
        for worker, iteration, _ in members:
            self._waiting[worker] = iteration
        first = members[0]
        entry = Entry(
            index=self._index + 1,
            kind=PUSH,
            worker=first[0],
            iteration=first[1],
            base=first[2],
            payload=payload,
            members=members,
        )
        return self._take(entry, now, values)

    def ready(
        self,
        worker: int,
        iteration: int,
        base: int,
        size: int,
        norm: float,
        host: int,
        now: float,
        *,
        sizes: tuple[tuple[int, int, int], ...] | None = None,
        joint: bool = False,
    ) -> list[Action]:
        """Worker ``worker`` (on node ``host``) has its push of ``iteration`` ready (MLfabric
        scheduling, :mod:`fabricd.engines.ps.scheduler`): its scheduler plans it (jointly:
        ``sizes`` and ``joint``, :mod:`fabricd.engines.ps.joint`).

        Raises:
            RemoteProtocolError: this is a replica or a shard not scheduled, or the push would
                be refused (:meth:`push`).
        """
        self._primary_only("a ready update")
        if self.scheduler is None:
            raise RemoteProtocolError("a READY for a shard that is not scheduled (MLfabric)")
        seen = self._seen(worker, iteration, base)
        if seen is not None:
            return seen
        self.coordinator.check_push(worker, iteration, base)
        decided = self.scheduler.ready(
            worker, iteration, base, size, norm, host, now, sizes=sizes, joint=joint
        )
        return self._decide(decided, now)

    def planned(self, parts: list[PartPlanned], now: float) -> list[Action]:
        """The joint reservation's lead planned these parts of this shard (a PLAN): granted or
        dropped as it says (:meth:`~fabricd.engines.ps.scheduler.ShardScheduler.planned`)."""
        if not self.primary or self.scheduler is None:
            return []
        return self._decide(self.scheduler.planned(parts, now), now)

    def next_deadline(self) -> float | None:
        """When the scheduler decides its batch, or (a bounded replica) when it asks for an
        entry whose copy did not come; ``None``: neither."""
        if not self.primary:
            return self._log.next_deadline()
        due = [self.scheduler.next_deadline()] if self.scheduler is not None else []
        due += [self.trees.next_deadline()] if self.trees is not None else []
        return min((d for d in due if d is not None), default=None)

    def on_timer(
        self,
        now: float,
        figures: Callable[[int], tuple[float, float] | None],
        replica: int | None = None,
        servers: Mapping[int, int] | None = None,
    ) -> list[Action]:
        """The scheduler's batch, decided: grants go to the workers, drops into the log (an
        entry like a push's, without payload, that says why: replicated and acknowledged like
        any push, so a promoted replica and a worker's resend see it decided).  A bounded
        replica asks for each entry whose copy has not come within :data:`~fabricd.engines.
        ps.bounded.NEED_AFTER` (again after twice as long each time)."""
        if not self.primary:
            return [Need(index=index) for index in self._log.needs(now)]
        out: list[Action] = []
        if self.trees is not None:
            for answer in self.trees.decide(now, self.store, figures, self.coordinator.live):
                if isinstance(answer, Answer):  # (a pull forwarded counts as answered)
                    self._pulls += 1 + len(answer.forward)
                    self._pull_bytes += len(answer.data)
                out.append(answer)
        if self.scheduler is None:
            return out
        # (bounded replication: the copies are planned while the replica, at host ``replica``,
        # follows; not while it joins, nor once it was given up)
        following = replica if self.replicated and self.synced else None
        version = self.coordinator.version
        decisions = self.scheduler.on_timer(now, version, figures, following, servers)
        return out + self._decide(decisions, now)

    def _decide(self, decisions: Sequence[object], now: float) -> list[Action]:
        """The scheduler's decisions as actions: grants (and, the lead's, other shards'
        parts) go out, drops go into the log."""
        out: list[Action] = []
        for decision in decisions:
            if isinstance(decision, Granted | Gather | CopyGranted | PartPlanned):
                out.append(decision)
                continue
            assert isinstance(decision, Denied)
            worker, iteration = decision.worker, decision.iteration
            last = self._last.get(worker)
            if worker in self._waiting or (last is not None and last[0] >= iteration):
                continue  # pushed meanwhile (a resend after a failover): that push decides
            self._waiting[worker] = iteration
            entry = Entry(
                index=self._index + 1,
                kind=PUSH,
                worker=worker,
                iteration=iteration,
                base=decision.base,
                reason=decision.reason,
            )
            out += self._take(entry, now)
        return out

    def _seen(
        self, worker: int, iteration: int, base: int, base_epoch: int | None = None
    ) -> list[Action] | None:
        """What a push (or READY) of ``worker``'s ``iteration`` from ``base`` gets if the shard
        took it already (its acknowledgement again, or nothing while it waits) or it was
        computed from a version a rollback lost (:meth:`_rolled_back`), or ``None``: a new one.

        Raises:
            RemoteProtocolError: the worker pushed again before its last push was acknowledged.
        """
        last = self._last.get(worker)
        waiting = self._waiting.get(worker)
        clock = self.coordinator.clock(worker)
        queued = self._queued(worker)
        if queued is not None and iteration <= queued:
            # decided, its acknowledgement behind the step out (a promoted replica's: the
            # worker's daemon sends it again), or older than that: its answer goes or went
            self._resent += 1
            return []
        if waiting is None and clock and (last is None or last[0] < clock - 1) and queued is None:
            # the coordinator holds the push of clock - 1, not applied yet (a BSP iteration):
            # one a promoted replica logged, or a lost worker's, which _waiting does not name
            waiting = clock - 1
        if (last is not None and iteration <= last[0]) or (
            waiting is not None and iteration <= waiting
        ):
            self._resent += 1
            if last is not None and iteration == last[0]:
                return [Acked(worker=worker, iteration=iteration, version=last[1], dropped=last[2])]
            return []  # still waiting, or older than one acknowledged: its answer went or goes
        if waiting is not None:
            raise RemoteProtocolError(
                f"worker {worker} pushed iteration {iteration} before its iteration {waiting} "
                "was acknowledged"
            )
        return self._rolled_back(worker, iteration, base, base_epoch)

    def _rolled_back(
        self, worker: int, iteration: int, base: int, base_epoch: int | None
    ) -> list[Action] | None:
        """Bounded replication: a push computed from a model a promotion rolled back (its
        base, read at ``base_epoch``: :class:`~fabricd.engines.ps.bounded.Lineage`) is not
        applied, and says why; ``None``: any other push."""
        version = self.coordinator.version
        lost = self._lineage.lost(base, base_epoch, self.epoch, version) if self._lead else None
        if lost is None:
            return None
        self._last[worker] = (iteration, version, lost)
        return [Acked(worker=worker, iteration=iteration, version=version, dropped=lost)]

    def pull(
        self,
        worker: int,
        clock: int,
        since: int,
        now: float,
        *,
        host: int | None = None,
        direct: bool = False,
    ) -> list[Action]:
        """Worker ``worker``'s pull at ``clock``, from node ``host``; its cache holds version
        ``since``.  ``direct`` (distribution trees): answer it now, not through a tree.

        Raises:
            RemoteProtocolError: this is a replica, or the pull breaks the coordinator's rules.
        """
        self._primary_only("a pull")
        if self.trees is not None:
            self.trees.pulled(worker, host, direct=direct)
        if self.coordinator.held(worker) == clock:
            return []  # sent again after a reset: the held one is answered in time
        if self._lead is not None and since > self.coordinator.version:
            since = 0  # a cache of a version a failover rolled back: the whole model
        return self._perform(self.coordinator.pull(worker, clock, since, now), now)

    def flush(self, now: float) -> list[Action]:
        """Publish every parameter whose exact value the lossless publish mode held back
        (:meth:`~fabricd.engines.ps.filters.ParameterFilter.flush`: the end of training, a
        checkpoint), as the next version; through the log, so the replica does the same.

        Raises:
            RemoteProtocolError: this is a replica.
        """
        self._primary_only("a flush")
        return self._take(Entry(index=self._index + 1, kind=FLUSH, worker=0), now)

    def lose(self, worker: int, reason: str, now: float) -> list[Action]:
        """Worker ``worker`` is gone for good (its rank left, or its node is down)."""
        self._primary_only("a lost worker")
        if worker not in self.coordinator.live:
            return []
        return self._take(
            Entry(index=self._index + 1, kind=LOSE, worker=worker, reason=reason), now
        )

    def replicated_upto(self, index: int, now: float) -> list[Action]:
        """The replica logged and processed every entry up to ``index``: process them here.

        Raises:
            RemoteProtocolError: ``index`` names an entry never forwarded.
        """
        if not self.replicated:
            return []  # a confirmation late after the replica was given up
        if index > self._index:
            raise RemoteProtocolError(f"replica confirmed entry {index}; {self._index} were sent")
        if self._lead is not None:
            self._lead.confirm(index)
        out: list[Action] = []
        while self._unreplicated and self._unreplicated[0].index <= index:
            entry = self._unreplicated.popleft()
            if entry.index > self._applied_upto:  # (bounded: the replica applied it first)
                out += self._apply(entry, now)
        return out + self._advance(now)

    def needed(self, index: int) -> list[Action]:
        """Bounded replication: the replica asks for entry ``index`` whole (its worker's copy
        did not come); one confirmed meanwhile is not sent."""
        if not (self.replicated and self.synced):
            return []
        return [Forward(entry=e) for e in self._unreplicated if e.index == index]

    def unconfirmed(self) -> list[Forward]:
        """The entries to send the replica again after its links were reset, in order."""
        if not (self.replicated and self.synced):
            return []
        return [Forward(entry=e) for e in self._unreplicated]

    def joined(self) -> list[Action]:
        """Primary: the replica (new, or back after it died) asks for the shard: send it a
        :class:`Snapshot` of the processed state and then every entry after it, and wait
        for its confirmations from now on.  While an update callback is out, the snapshot
        waits for it (the coordinator is ahead of the model then)."""
        if not self.primary:
            return []
        self.replicated = True
        self._replan()
        if self._actions or self._stepping is not None:
            self._join_pending = True
            return []
        return self._snapshot()

    def _snapshot(self) -> list[Action]:
        self._join_pending = False
        self.synced = True
        processed = self._applied_upto
        # (bounded: the lead is not reset here: a replica that has this epoch's state ignores
        # a snapshot sent again, and stays where its confirmations say)
        out: list[Action] = [Snapshot(index=processed, data=ps_snapshot.encode(self.state()))]
        # (bounded: the entries applied here and not confirmed are in the snapshot, and go
        # again too: they stay until confirmed, for a replica whose snapshot a reset lost)
        return out + [Forward(entry=e) for e in self._unreplicated]

    def replica_lost(self, now: float) -> list[Action]:
        """The replica is gone: go on alone, processing what waited for it, until a replica
        joins again."""
        self.synced = self._join_pending = False
        if not self.replicated:
            return []
        self.replicated = False
        out: list[Action] = []
        while self._unreplicated:
            entry = self._unreplicated.popleft()
            if entry.index > self._applied_upto:
                out += self._apply(entry, now)
        if self._lead is not None:
            self._lead.reset(self._index, self._momentum_norm())
        self._replan()
        return out

    def _replan(self) -> None:
        """Bounded replication's copy plans start afresh (the replica was given up, or joins
        from a snapshot: what was punted for it is moot)."""
        if self.scheduler is not None and self.scheduler.copies is not None:
            self.scheduler.copies = self.scheduler.copies.fresh()

    # -- the replica's inputs -------------------------------------------------------------
    def log(self, entry: Entry, now: float) -> list[Action]:
        """Replica: the primary's entry ``entry.index``: process it, in order, and confirm.
        One logged already (sent again after a reset) is confirmed again, once processed.

        Raises:
            RemoteProtocolError: this is not a replica, or the entry skips one, or is
                malformed.
        """
        if self.primary:
            raise RemoteProtocolError("a replication entry for a shard's primary")
        if not self.has_state:
            return []  # sent before the snapshot this replica asked for: it comes again
        self._check_entry(entry)
        if entry.index <= self._index:
            # confirmed again, unless its confirmation waits for the process's step (then
            # it goes once stepped: not before the entry is processed)
            return [] if self._confirm is not None else [Logged(index=self._index)]
        self._log.receive(entry, now)
        return self._drain(now)

    def _check_entry(self, entry: Entry) -> None:
        """Raise unless ``entry`` is one a primary sends (only its bytes: the primary checked
        the rest against the same state)."""
        if entry.kind == PUSH and (entry.reason is not None or entry.copied):
            if entry.payload:  # a scheduler's drop carries none, nor an order entry
                raise RemoteProtocolError("a dropped or copied push entry with a payload")
            if entry.copied and (entry.reason is not None or entry.members is not None):
                raise RemoteProtocolError("a copied entry is one worker's push")
        elif entry.kind == PUSH:
            ps_push.decode(entry.payload, self.size, self.dtype)
        elif entry.kind not in (LOSE, FLUSH):
            raise RemoteProtocolError(f"replication entry of kind {entry.kind!r}")

    def _drain(self, now: float) -> list[Action]:
        """Replica: process the received entries, in order, while each has its payload."""
        out: list[Action] = []
        for entry in self._log.ready():
            self._pushes += entry.updates
            self._aggregates += entry.members is not None
            self._push_bytes += len(entry.payload)
            self._index = entry.index
            # confirmed once processed: a replica whose process is slow to run the update
            # callback holds its primary back, rather than queueing an update per entry
            self._confirm = entry.index
            out += self._process(entry, now)  # Steps and the confirmation: it answers nobody
        return out

    def copy(
        self, worker: int, iteration: int, base: int, payload: bytes | bytearray, now: float
    ) -> list[Action]:
        """Replica, bounded replication: ``worker``'s daemon's copy of its push of
        ``iteration`` (from ``base``): it completes the primary's order entry for it, or waits
        for it (one that comes before the replica's snapshot is kept for after it).  A copy
        for a push decided here already, or for a primary, is dropped.

        Raises:
            RemoteProtocolError: the copy is malformed (as a push would be).
        """
        if self.primary or self._lead is None:
            return []
        ps_push.decode(payload, self.size, self.dtype)
        last = self._last.get(worker)
        if last is not None and last[0] >= iteration:
            return []
        self._log.copy(worker, iteration, base, payload)
        return self._drain(now)

    def restore(self, index: int, data: bytes | bytearray) -> bool:
        """The primary's :class:`Snapshot` of its state as of entry ``index``: take it and
        follow that primary.  A primary takes one only from a later epoch (it came back
        after its replica took over, and is the replica now).  A replica that has the state
        of the same epoch up to ``index`` or later ignores it (its JOIN arrived twice): taking
        it would take back entries it confirmed, which the primary then never sends again,
        and drop the step its process runs.  ``False``: ignored.

        Raises:
            RemoteProtocolError: a malformed snapshot, or one of another model; nothing
                changed.
        """
        state = ps_snapshot.decode(data)
        epoch = get_int(state, "epoch")
        if self.primary and epoch <= self.epoch:
            return False
        if self.has_state and epoch == self.epoch and index <= self._index:
            return False
        shard_state.take(self, state)
        shard_state.follow(self, epoch, index)
        return True

    def promote(self) -> bool:
        """The primary is gone: this replica serves the shard from now on, one epoch later,
        alone until a replica joins; ``False``: it has no state to serve (it never got its
        snapshot), and the shard is lost."""
        if self.primary:
            return True
        if not self.has_state:
            return False
        self._confirm = None
        self.primary = True
        self.replicated = self.synced = False
        self.epoch += 1
        # bounded replication: entries whose copies never came are lost with the primary
        # (within the bound); the workers' daemons send again what was not acknowledged
        self.rolled_back = self._log.reset(self._index)
        self._lineage.promoted(self.epoch, self.coordinator.version)
        self._applied_upto = self._index
        if self._lead is not None:
            self._lead.reset(self._index, self._momentum_norm())
        if self.scheduler is not None:  # what it planned while it last served is void now
            self.scheduler = self.scheduler.fresh()
        return True

    # -- snapshots ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything a replica needs to go on from the processed entries
        (:mod:`fabricd.engines.ps.shard_state`)."""
        return shard_state.capture(self)

    # -- the update callback --------------------------------------------------------------
    def stepped(self, version: int, model: Array, now: float) -> list[Action]:
        """The server's process ran its update callback for the :class:`Step` of
        ``version``: ``model`` is the new model; publish it and go on.

        Raises:
            UsageError: no step of ``version`` is awaited, or ``model`` is not the shard's
                size and dtype (the step is still awaited).
        """
        apply = self._stepping
        if self._voided and self._voided[0] == version:
            # asked for before a snapshot replaced the state: the process answers in order,
            # so the void answers come before any step asked for since
            self._voided.popleft()
            return []
        if apply is None or apply.version != version:
            awaited = "none" if apply is None else f"version {apply.version}"
            raise UsageError(f"a step of version {version} was not asked for ({awaited} is)")
        if model.dtype != self.dtype or model.size != self.size:
            raise UsageError(
                f"the callback's model must stay {self.size} elements of {self.dtype}, not "
                f"{model.size} of {model.dtype}"
            )
        if not np.isfinite(model).all():
            raise UsageError("the callback's model holds a NaN or an infinity")
        self._stepping = None
        acks = self._publish(apply, model.reshape(-1).copy())
        return (acks if self.primary else []) + self._perform([], now)

    # -- reading --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.store.version

    @property
    def bounded(self) -> bool:
        """Whether the shard is replicated with a divergence bound, not the chain."""
        return self._lead is not None

    def waiting_for(self) -> list[str]:
        """What the shard waits for (stall reports)."""
        out = self.coordinator.waiting_for()
        if self._unreplicated and self._lead is None:
            out.append(f"{len(self._unreplicated)} entries wait for the replica's confirmation")
        elif self._lead is not None and self._index > self._applied_upto and self.primary:
            out.append(
                f"{self._index - self._applied_upto} entries wait for the replica: the "
                f"divergence bound allows no more lead (it confirmed entry {self._lead.confirmed})"
            )
        copies = self._log.waiting()
        if copies:
            out.append(f"entries {copies[:8]} wait for their workers' copies")
        if self._stepping is not None:
            out.append(
                f"version {self._stepping.version} waits for the server process's update "
                "callback (is it in serve()?)"
            )
        return out

    def statistics(self) -> ShardStatistics:
        filtered = self.filter.statistics()
        dense = self.size * self.dtype.itemsize
        return ShardStatistics(
            epoch=self.epoch,
            primary=self.primary,
            version=self.store.version,
            logged=self._index,
            unreplicated=len(self._unreplicated),
            pushes=self._pushes,
            resent=self._resent,
            push_bytes=self._push_bytes,
            push_dense_bytes=self._pushes * (ps_push.HEADER.size + dense),
            pulls=self._pulls,
            pull_bytes=self._pull_bytes,
            pull_dense_bytes=self._pulls * (PULL_HEADER.size + dense),
            considered=filtered.considered,
            published=filtered.published,
            coordinator=self.coordinator.statistics(),
            scheduler=None if self.scheduler is None else self.scheduler.statistics(),
            trees=None if self.trees is None else self.trees.statistics(),
            aggregates=self._aggregates,
            aggregates_refused=self._aggregates_refused,
            lag=0 if self._lead is None else self._lead.lag,
            divergence=0.0 if self._lead is None else self._lead.divergence(),
        )

    # -- internals ------------------------------------------------------------------------
    def _queued(self, worker: int) -> int | None:
        """The latest iteration of ``worker``'s whose push the coordinator decided on but
        that waits behind a step of the update callback (acknowledged once it is carried
        out; the old primary may have acknowledged it already), if any."""
        latest: int | None = None
        for action in (self._stepping, *self._actions):
            if isinstance(action, Apply):
                its = [u.iteration for u in action.updates if u.worker == worker]
            elif isinstance(action, Drop) and action.worker == worker:
                its = [action.iteration]
            else:
                continue
            latest = max([*its, -1 if latest is None else latest]) if its else latest
        return latest

    def _primary_only(self, what: str) -> None:
        if not self.primary:
            raise RemoteProtocolError(f"{what} for a replica (epoch {self.epoch})")

    def _take(self, entry: Entry, now: float, values: Array | None = None) -> list[Action]:
        """Log ``entry`` (``values``: its payload decoded, for a push's or an aggregate's) and
        process what may be processed now."""
        self._index = entry.index
        if not self.replicated:
            return self._apply(entry, now)
        # kept until the replica confirms it (or is given up); chain: processed only then
        self._unreplicated.append(entry)
        if self._lead is None:
            return [Forward(entry=entry)] if self.synced else []
        if entry.updates and entry.members is None:
            # the worker's daemon sends the replica its copy: the order alone goes
            digest = copy_digest(entry.payload)
            order = Forward(entry=replace(entry, payload=b"", copied=True, digest=digest))
        else:
            order = Forward(entry=entry)
        if entry.updates and self._lead.bound.norm is not None:
            assert values is not None  # (a push's or an aggregate's: decoded when taken)
            rate = self.rule.lr if isinstance(self.rule, SGD) else 1.0  # AdaDelay's is less
            self._norms[entry.index] = rate * float(np.linalg.norm(values.astype(np.float64)))
        return ([order] if self.synced else []) + self._advance(now)

    def _advance(self, now: float) -> list[Action]:
        """Bounded replication: apply the entries taken, in order, while the bound allows."""
        lead = self._lead
        if lead is None:
            return []
        out: list[Action] = []
        for entry in list(self._unreplicated):
            if entry.index <= self._applied_upto:
                continue
            if not lead.allows(entry.index, entry.updates, self._norms.get(entry.index, 0.0)):
                break
            out += self._apply(entry, now)
        return out

    def _apply(self, entry: Entry, now: float) -> list[Action]:
        """Process ``entry`` here (the log's next), and tell the lead (while there is a
        replica to lead: alone, a shard leads nobody)."""
        out = self._process(entry, now)
        self._applied_upto = entry.index
        norm = self._norms.pop(entry.index, 0.0)
        if self._lead is not None and self.replicated:
            self._lead.applied(entry.index, entry.updates, norm, self._momentum_norm())
        return out

    def _momentum_norm(self) -> float:
        """``||s||``, the sgd rule's last step, which momentum carries into the next."""
        rule = self.rule
        if not isinstance(rule, SGD) or not rule.momentum or rule.step is None:
            return 0.0
        return float(np.linalg.norm(rule.step.astype(np.float64)))

    def _process(self, entry: Entry, now: float) -> list[Action]:
        if entry.kind == FLUSH:
            self.coordinator.bump()
            return self._perform([_FLUSHED], now)
        if entry.kind == LOSE:
            # the worker's push in waiting, if any, stays so until processed: one taken before
            # this entry is held for its BSP iteration, one taken after it is dropped
            actions = self.coordinator.lose(entry.worker, entry.reason or "lost", now)
            if self.scheduler is not None:
                self.scheduler.lose(entry.worker)
        elif entry.members is not None:  # an aggregate: one sum, applied once for all
            values = ps_push.decode(entry.payload, self.size, self.dtype)
            actions = self.coordinator.push_aggregate(entry.members, values, now)
            self._arrived((w, it) for w, it, _ in entry.members)
        elif entry.reason is not None:  # dropped by the scheduler before it was sent
            actions = self.coordinator.skip(entry.worker, entry.iteration, entry.base, entry.reason)
        else:
            values = ps_push.decode(entry.payload, self.size, self.dtype)
            actions = self.coordinator.push(entry.worker, entry.iteration, entry.base, values, now)
            self._arrived([(entry.worker, entry.iteration)])
        return self._perform(actions, now)

    def _arrived(self, pushes: Iterable[tuple[int, int]]) -> None:
        """BSP: the scheduler forgets the grants of pushes that came (MLfabric-S): a push held
        for its iteration's others uses no link any more, and must not be planned as if it
        did; the rest of the consistencies settle as their pushes are applied or dropped."""
        if self.scheduler is None or self.coordinator.consistency is not Consistency.BSP:
            return
        for worker, iteration in pushes:
            self.scheduler.settled(worker, iteration)

    def _perform(self, actions: list[Any], now: float) -> list[Action]:
        """Queue the coordinator's ``actions`` behind those waiting for a step, and carry out
        what can be now, in order."""
        self._actions.extend(actions)
        out: list[Action] = []
        while self._actions and self._stepping is None:
            action = self._actions.popleft()
            if action is _FLUSHED:
                publish = self.filter.flush()
                self.store.publish(publish.mask, publish.values)
                continue
            self._settle(action)
            if isinstance(action, Apply):
                if self.rule is None:  # the server's process steps the model: wait for it
                    self._stepping = action
                    out.append(
                        Step(
                            version=action.version,
                            model=self.filter.model.copy(),
                            update=np.asarray(action.combined(), self.dtype),
                        )
                    )
                    break
                model = self.filter.model.copy()
                step_model(self.rule, model, action)
                out += self._publish(action, model)
            elif isinstance(action, Drop):
                self._waiting.pop(action.worker, None)
                record = (action.iteration, self.store.version, action.message)
                self._last[action.worker] = record
                out.append(
                    Acked(
                        worker=action.worker,
                        iteration=action.iteration,
                        version=record[1],
                        dropped=record[2],
                    )
                )
            elif isinstance(action, Reply):
                assert action.version == self.store.version
                if self.trees is not None and self.trees.hold(action, now, self.coordinator.live):
                    continue  # answered with its batch's tree
                data = self.store.pull(action.since)
                self._pulls += 1
                self._pull_bytes += len(data)
                out.append(
                    Answer(
                        worker=action.worker, clock=action.clock, version=action.version, data=data
                    )
                )
            else:
                assert isinstance(action, Refused)
                out.append(Refuse(worker=action.worker, clock=action.clock, reason=action.reason))
        quiet = not self._actions and self._stepping is None
        if self._join_pending and quiet:
            out += self._snapshot()
        if self.primary:
            return out
        if self._confirm is not None and quiet:
            out.append(Logged(index=self._confirm))
            self._confirm = None
        # a replica answers nobody (its acknowledgements are kept for after a promotion), but
        # its own process runs the update callback too
        return [a for a in out if isinstance(a, Step | Logged)]

    def _settle(self, action: object) -> None:
        """The scheduler forgets the grants of the pushes ``action`` decided."""
        if self.scheduler is None:
            return
        if isinstance(action, Apply):
            for update in action.updates:
                self.scheduler.settled(update.worker, update.iteration)
        elif isinstance(action, Drop):
            self.scheduler.settled(action.worker, action.iteration)

    def _publish(self, apply: Apply, model: Array) -> list[Action]:
        """``model`` is the update rule's step of ``apply``: filter it, publish it, and
        acknowledge the pushes it held."""
        publish = self.filter.update(model, apply.version)
        version = self.store.publish(publish.mask, publish.values)
        while version < apply.version:  # an aggregate's: one version per update it holds
            version = self.store.publish(np.empty(0, np.intp), publish.values[:0])
        assert version == apply.version
        out: list[Action] = []
        for update in apply.updates:
            self._waiting.pop(update.worker, None)
            self._last[update.worker] = (update.iteration, version, None)
            out.append(
                Acked(
                    worker=update.worker, iteration=update.iteration, version=version, dropped=None
                )
            )
        return out
