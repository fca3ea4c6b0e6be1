"""One shard's MLfabric scheduler: which ready updates are sent to the server, when, and which
are dropped before they cost the network anything (MLfabric §4, §5.1).

Rules: under ``scheduling="mlfabric"`` a worker's daemon does not send a push: it tells the
shard's primary that the update is *ready* (READY: worker, iteration, the version it was
computed from, its encoded size and norm).  The primary's :class:`ShardScheduler` gathers the
ready updates of one scheduling interval into a batch (§7: "we batch requests at the
scheduler every 100 ms"; a batch opens with its first update, so a lone update waits at most
one interval) and orders the batch with Alg. 2 (:func:`fabricd.engines.scheduling.ordering.order`)
over residual-capacity timelines of the star network the monitor reports: shortest transfer
first, deadlines ``dl(g) = v(g) + τmax - v_init`` (eq. 9), and look-ahead drops (§5.1.3).  Each
planned update is *granted*: its worker's daemon sends the push when its transfer's planned
start comes (GRANT carries the wait), so transfers share the server's link in time instead of
at once (§3.1.1); each dropped update is *denied*: the shard logs a drop for it (replicated like
any entry, so a promoted replica knows it too) and its worker's push result says why.

Choices where the paper is silent, and why:

* ``v_init`` (eq. 9: "the version of the model after all updates from previous batches are
  applied") is the shard's version plus the updates granted and not yet processed: those will
  be applied first, unless the server drops them, which only makes a deadline looser than
  planned, never one the server then breaks (the server checks τmax itself on arrival).
* The timelines of a batch start from the monitor's latest figures with the transfers granted
  earlier and not yet processed reserved again, from now, at their whole size: the scheduler
  learns when a push arrived, not how much of it did, so it plans as if nothing of it had
  (conservative: a later batch never counts on capacity an earlier grant still uses).
* A grant whose push never arrives (its worker's daemon died, or the frame was lost with a
  reset and the worker's daemon sends the READY again) stops counting after its planned end
  plus ``max(1 s, 10 intervals)``; a READY sent again for an update granted already is granted
  again at once (its planned start is past).
* MLfabric-S (BSP, ``synchronous=True``; §6): every update of an iteration is needed, so a
  batch is a list in the order its updates became ready, with no deadline and no drop
  (:func:`~fabricd.engines.scheduling.ordering.in_list_order`); grants pace the senders and,
  with aggregation, Alg. 3 groups an iteration's updates at worker daemons as under
  MLfabric-A.  The paper's batch is "the workers' updates for an iteration ... batched when
  they become ready": the same scheduling interval serves, so early updates are planned (and
  aggregated over idle links) while stragglers compute.  A push the server took stops counting
  on the timelines at once (:meth:`ShardScheduler.settled`, called on arrival under BSP): it
  waits for its iteration's others, not for a link.
* A host the monitor has no figures for is planned at :data:`UNKNOWN_BPS` each way, the
  monitor's own figure for "unknown" (100 Gbit/s, :mod:`fabricd.engines.monitor.table`), so an
  unmeasured fabric is scheduled shortest-first by size alone, as one the monitor reports
  "default" for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from fabricd.engines.monitor.table import DEFAULT_BPS
from fabricd.engines.ps.bounded import DivergenceBound
from fabricd.engines.ps.consistency import SGD
from fabricd.engines.ps.copy_plan import CopyPlanner
from fabricd.engines.ps.joint import JointParts, PartPlanned, by_node, fallback_after, joint_for
from fabricd.engines.scheduling.aggregation import Group, aggregate
from fabricd.engines.scheduling.joint import JointUpdate, order_joint
from fabricd.engines.scheduling.ordering import Planned, Update, in_list_order, order
from fabricd.engines.scheduling.timelines import Network
from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable, Mapping

    from fabricd.engines.ps.consistency import UpdateRule
    from fabricd.engines.ps.copy_plan import CopyPlan
    from fabricd.wire import Meta

#: bytes/s a host is planned at, each way, when the monitor has no figures for it
UNKNOWN_BPS = DEFAULT_BPS
#: the least a grant counts towards ``v_init`` and the timelines past its planned end
GRANT_GRACE_MIN = 1.0
#: the furthest ahead a grant's planned end counts (a plan past it is a broken figure's)
MAX_PLAN = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Granted:
    """Tell ``worker`` to send its push of ``iteration`` in ``wait`` seconds: to the server,
    or (aggregation) to node ``via``, as a member of its group ``group``."""

    worker: int
    iteration: int
    wait: float
    via: int | None = None
    group: int | None = None
    #: bounded replication (:mod:`fabricd.engines.ps.copy_plan`): seconds until the replica's
    #: copy goes (0: with the push), or ``None``: held until a :class:`CopyGranted`
    copy_wait: float | None = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyGranted:
    """Tell ``worker``'s daemon to send the replica its held copy of ``iteration`` in
    ``wait`` seconds (a copy an earlier batch punted)."""

    worker: int
    iteration: int
    wait: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Gather:
    """Tell node ``aggregator`` to sum ``members``' pushes (worker, iteration, base each) as
    group ``group`` and forward the sum, ``wait`` seconds from now at the earliest (§5.2)."""

    aggregator: int
    group: int
    members: tuple[tuple[int, int, int], ...]
    wait: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Denied:
    """``worker``'s update of ``iteration`` (computed from ``base``) is dropped: ``reason``."""

    worker: int
    iteration: int
    base: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _Ready:
    worker: int
    iteration: int
    base: int
    size: int
    norm: float
    host: int
    at: float  #: when it came
    #: joint reservation's lead: the size of each part of the update, by shard
    sizes: tuple[tuple[int, int, int], ...] | None = None


@dataclass(slots=True, kw_only=True)
class _Grant:
    ready: _Ready
    dst: int  #: where its push goes: the server's host, or its aggregator's
    start: float  #: the planned start of its transfer
    end: float  #: the planned end of its transfer (it stops counting a grace after it)


@dataclass(slots=True, kw_only=True)
class _Group:
    """A group this shard's scheduler told an aggregator to sum: only its aggregate is taken."""

    aggregator: int
    members: dict[int, tuple[int, int]]  #: worker -> (iteration, base)
    size: float  #: the aggregate's planned bytes
    start: float  #: its forward's planned start
    end: float  #: its forward's planned end (it stops counting a grace after it)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStatistics:
    """What ``fabricctl status`` and the metrics show of one shard's scheduler."""

    ready: int  #: READYs taken (not counting ones sent again)
    granted: int
    denied: dict[str, int]  #: by reason
    batches: int
    waiting: int  #: in the batch being gathered
    outstanding: int  #: granted, not processed yet
    latency_sum: float  #: seconds from READY to decision, summed
    latency_max: float
    decided: int  #: READYs decided (the latency's count)
    #: joint reservation (:mod:`fabricd.engines.ps.joint`): parts of other shards this lead
    #: planned, parts held for a PLAN, and parts planned alone when none came in time
    joint_planned: int = 0
    joint_held: int = 0
    fell_back: int = 0


class ShardScheduler:
    """The scheduler of one shard served at host ``server`` (module docstring).

    Args:
        server: the node the shard's primary lives on.
        delay_bound: async's τmax, or ``None`` (shortest transfer first only, Alg. 1).
        interval: seconds a batch gathers ready updates.
        aggregation: Alg. 3's groups summed at worker daemons (§5.2).
        synchronous: BSP's batches (MLfabric-S, §6): lists, neither ordered nor dropped.
        joint: a sharded model's updates planned jointly (:mod:`fabricd.engines.ps.joint`):
            as the lead, a READY naming every part's size is planned with its other parts;
            as a follower, a jointly planned READY waits for the lead's PLAN.
    """

    def __init__(
        self,
        *,
        server: int,
        delay_bound: int | None,
        interval: float,
        aggregation: bool = False,
        synchronous: bool = False,
        copies: CopyPlanner | None = None,
        joint: bool = False,
    ) -> None:
        if synchronous and delay_bound is not None:
            raise ValueError("a synchronous batch has no delay bound: it drops nothing")
        self.server = server
        self.delay_bound = delay_bound
        self.interval = interval
        self.aggregation = aggregation
        self.synchronous = synchronous
        #: bounded replication's copy plans (async without aggregation), or None
        self.copies = None if synchronous or aggregation else copies
        self.parts = (
            JointParts(fallback_after(interval))
            if joint and not (synchronous or aggregation or copies)
            else None
        )
        self._joint_planned = 0
        #: joint reservation's lead: the other parts' planned transfers, (start, end, src,
        #: dst, bytes) each, on the timelines until their planned end (it hears nothing of them)
        self._others: list[tuple[float, float, int, int, float]] = []
        #: joint reservation's follower: the READYs held for the lead's PLAN
        self._held: dict[tuple[int, int], _Ready] = {}
        self._next_group = 0
        self._batch: dict[tuple[int, int], _Ready] = {}
        self._granted: dict[tuple[int, int], _Grant] = {}
        #: worker -> the iteration it has in the batch or granted (one at a time)
        self._worker: dict[int, int] = {}
        #: the groups told to aggregators whose aggregate has not come (number -> plan)
        self._gathers: dict[int, _Group] = {}
        self._decided = 0  #: READYs decided (granted or denied), for the mean latency
        self._due: float | None = None
        self._ready = self._grants = self._batches = 0
        self._denied: dict[str, int] = {}
        self._latency_sum = self._latency_max = 0.0

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
    ) -> list[Granted | Denied]:
        """``worker`` (on node ``host``) has its update of ``iteration`` ready: it joins the
        batch, or, granted already (a READY sent again), is granted again at once.  Jointly
        planned (``joint``, a follower's) it waits for the lead's PLAN instead, or is decided
        at once by one that came first; ``sizes`` (the lead's): every part's shard, size
        and base.

        Raises:
            RemoteProtocolError: a worker's iteration going back, or ``sizes`` without this
                part's own (shard 0's) of ``size`` bytes.
        """
        key = (worker, iteration)
        if key in self._granted:  # (aggregation: now straight to the server)
            return [Granted(worker=worker, iteration=iteration, wait=0.0)]
        if sizes is not None and {s: (n, b) for s, n, b in sizes}.get(0) != (size, base):
            raise RemoteProtocolError(f"a READY of {size} B whose sizes say {sizes}")
        other = self._worker.get(worker)
        if other is not None and other > iteration:
            raise RemoteProtocolError(
                f"worker {worker} is ready with iteration {iteration} after its iteration {other}"
            )
        if other is not None and other != iteration:
            # a worker has one push at a time: a later one says the earlier one was decided
            # (the shard forgot it: a grant that expired, a restore), so it replaces it
            self._batch.pop((worker, other), None)
            self._granted.pop((worker, other), None)
            self._held.pop((worker, other), None)
            if self.parts is not None:
                self.parts.forget((worker, other))
        if key not in self._batch and (self.parts is None or not self.parts.holds(key)):
            self._ready += 1
            self._worker[worker] = iteration
        ready = _Ready(
            worker=worker,
            iteration=iteration,
            base=base,
            size=size,
            norm=norm,
            host=host,
            at=now,
            sizes=sizes
            if self.parts is not None and sizes is not None and len(sizes) > 1
            else None,
        )
        if joint and self.parts is not None and key not in self._batch:
            self._held[key] = ready
            decision = self.parts.hold(key, now)
            if decision is None:
                return []
            del self._held[key]
            return self._carry_out(ready, decision.wait, decision.duration, decision.reason, now)
        if self._held.pop(key, None) is not None and self.parts is not None:
            self.parts.forget(key)  # asked again plainly (shard 0's part was granted): planned here
        self._batch[key] = ready
        if self._due is None:
            self._due = now + self.interval
        return []

    def planned(self, parts: list[PartPlanned], now: float) -> list[Granted | Denied]:
        """The lead's PLAN for this shard's parts: each held part granted or dropped as it
        says; an entry for a part not heard of yet is kept for its READY, one for a part this
        scheduler decided already is ignored (:class:`~fabricd.engines.ps.joint.JointParts`)."""
        if self.parts is None:
            return []
        out: list[Granted | Denied] = []
        for part in parts:
            key = (part.worker, part.iteration)
            known = key in self._batch or key in self._granted
            if self.parts.planned(part, now, known=known):
                ready = self._held.pop(key)
                out += self._carry_out(ready, part.wait, part.duration, part.reason, now)
        return out

    def _carry_out(
        self, ready: _Ready, wait: float, duration: float, reason: str | None, now: float
    ) -> list[Granted | Denied]:
        """Grant or drop a held part as the lead planned it."""
        self._note_decided([ready], now)
        if reason is not None:
            update = Update(key=(ready.worker, ready.iteration), host=ready.host, version=0, size=0)
            return list(self._deny([(update, reason)], {update.key: ready}))
        wait = min(max(0.0, wait), MAX_PLAN)
        start = now + wait
        self._granted[(ready.worker, ready.iteration)] = _Grant(
            ready=ready, dst=self.server, start=start, end=start + min(max(0.0, duration), MAX_PLAN)
        )
        self._grants += 1
        return [Granted(worker=ready.worker, iteration=ready.iteration, wait=wait)]

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` has work: the batch's end, or (joint) a held part's grace."""
        held = None if self.parts is None else self.parts.next_deadline()
        return min((d for d in (self._due, held) if d is not None), default=None)

    def on_timer(
        self,
        now: float,
        version: int,
        figures: Callable[[int], tuple[float, float] | None],
        replica: int | None = None,
        servers: Mapping[int, int] | None = None,
    ) -> list[Granted | Denied | Gather | CopyGranted | PartPlanned]:
        """Decide the batch if its interval is over: grant what Alg. 2 plans (through the
        aggregators Alg. 3 picks, with ``aggregation``), deny what it drops.  ``version`` is
        the shard's; ``figures`` the monitor's (up, down) per host; ``replica`` the host of
        a bounded replica that follows (its copies are planned too: module copy_plan);
        ``servers`` the node serving each shard (joint reservation's lead: the other parts'
        decisions are returned for their shards, :class:`~fabricd.engines.ps.joint.
        PartPlanned`).  A held part whose PLAN did not come in time joins the batch."""
        self._fall_back(now)
        if self._due is None or now < self._due:
            return []
        self._due = None
        self._expire(now)
        batch, self._batch = list(self._batch.values()), {}
        copies = self.copies if replica is not None else None
        if not batch and (copies is None or not copies.pending):
            return []
        self._batches += 1
        extra = [] if copies is None or replica is None else [replica, *copies.hosts]
        joint = self._joint_servers(batch, servers)
        extra += joint.values()
        network = self._network(now, batch, figures, extra)
        parts: list[PartPlanned] = []
        updates = [
            Update(
                key=(r.worker, r.iteration), host=r.host, version=r.base, size=r.size, norm=r.norm
            )
            for r in batch
        ]
        by_key: dict[Hashable, _Ready] = {(r.worker, r.iteration): r for r in batch}
        copy_plan: CopyPlan | None = None
        if self.synchronous:
            planned_all, groups = self._listed(batch, updates, network)
            dropped: list[tuple[Update, str]] = []
        elif joint:
            planned_all, dropped, parts = self._jointly(now, batch, network, version, joint)
            groups = []
        else:
            plan = order(
                updates,
                network,
                server=self.server,
                # eq. 9 counts a delay from the version after applying; the shard counts it
                # from the version before (consistency.py), one less: its bound is tau_max + 1
                delay_bound=self._bound,
                v_init=version + len(self._granted),
            )
            planned_all, dropped = plan.planned, plan.dropped
            groups = self._groups(plan.planned, network)[0] if self.aggregation else []
            if copies is not None and replica is not None:
                booked = network if plan.network is None else plan.network
                copy_plan = copies.plan(now, plan.planned, booked, replica)
        out: list[Granted | Denied | Gather | CopyGranted | PartPlanned] = []
        grouped = {p.update.key for group in groups for p in group.members}
        for planned in planned_all:
            if planned.update.key not in grouped:
                ready = by_key[planned.update.key]
                out.append(self._grant(ready, planned, now, copies=copy_plan))
        out += self._gathered(groups, by_key, now)
        out += self._deny(dropped, by_key)
        out += parts
        if copy_plan is not None:
            for key, wait in copy_plan.later.items():
                worker, iteration = cast("tuple[int, int]", key)
                out.append(CopyGranted(worker=worker, iteration=iteration, wait=wait))
            if copies is not None and copies.pending and self._due is None:
                self._due = now + self.interval  # punted copies go with the next batch at last
        self._note_decided(batch, now)
        return out

    def _fall_back(self, now: float) -> None:
        """Joint reservation's follower: the held parts whose PLAN did not come in time join
        the batch, decided now."""
        if self.parts is None:
            return
        for late in self.parts.due(now):
            held = self._held.pop(late, None)
            if held is not None:
                self._batch[late] = held
                self._due = now if self._due is None else min(self._due, now)

    def _gathered(
        self, groups: list[Group], by_key: dict[Hashable, _Ready], now: float
    ) -> list[Granted | Gather]:
        """Alg. 3's groups: each member granted its transfer to its aggregator, which is told
        to gather the group (GATHER), and the aggregate expected."""
        out: list[Granted | Gather] = []
        for group in groups:
            number = self._next_group
            self._next_group += 1
            members = []
            for planned in group.members:
                ready = by_key[planned.update.key]
                out.append(self._grant(ready, planned, now, via=group.aggregator, group=number))
                members.append((ready.worker, ready.iteration, ready.base))
            wait = min(max(0.0, group.forward.start - now), MAX_PLAN)
            out.append(
                Gather(aggregator=group.aggregator, group=number, members=tuple(members), wait=wait)
            )
            end = min(group.forward.end, now + MAX_PLAN)
            start = min(group.forward.start, end)
            self.expect(number, group.aggregator, tuple(members), group.forward.size, end, start)
        return out

    def _note_decided(self, decided: list[_Ready], now: float) -> None:
        self._decided += len(decided)
        for ready in decided:
            latency = now - ready.at
            self._latency_sum += latency
            self._latency_max = max(self._latency_max, latency)

    @property
    def _bound(self) -> int | None:
        # eq. 9 counts a delay from the version after applying; the shard counts it from the
        # version before (consistency.py), one less: its bound is tau_max + 1
        return None if self.delay_bound is None else self.delay_bound + 1

    def _joint_servers(
        self, batch: list[_Ready], servers: Mapping[int, int] | None
    ) -> dict[int, int]:
        """The node serving each shard the batch's jointly planned updates have a part for
        (those known: an update with a part for a shard not in ``servers`` is planned
        alone); empty when the batch has none."""
        if self.parts is None or servers is None or not any(r.sizes for r in batch):
            return {}
        shards = {shard for r in batch for shard, *_ in r.sizes or ()}
        return {s: servers[s] for s in shards if s in servers} | {0: self.server}

    def _jointly(
        self,
        now: float,
        batch: list[_Ready],
        network: Network,
        version: int,
        servers: dict[int, int],
    ) -> tuple[list[Planned], list[tuple[Update, str]], list[PartPlanned]]:
        """The lead's batch by :func:`~fabricd.engines.scheduling.joint.order_joint`: this
        shard's parts planned and dropped, and the other shards' decisions (their transfers kept
        for the timelines).  An update's deadline is its stalest part's: each shard's server
        checks the delay bound of its own part on arrival, and a worker's parts may have been
        read at different versions (each shard answered its pull at its own moment); the
        lead counts every shard at its own version (shards that apply the same updates count
        the same versions, apart from what is in flight)."""
        jointly: dict[tuple[int, int], dict[int, int]] = {}
        updates = []
        for ready in batch:
            key = (ready.worker, ready.iteration)
            sizes = {shard: size for shard, size, _ in ready.sizes or ()}
            base = ready.base
            if len(sizes) > 1 and all(shard in servers for shard in sizes):
                jointly[key] = sizes
                base = min(b for *_, b in ready.sizes or ())  # (the stalest part's)
            else:
                sizes = {0: ready.size}  # (a part's server unknown: its follower falls back)
            nodes = by_node(sizes, servers | {0: self.server})
            updates.append(JointUpdate(key=key, host=ready.host, version=base, sizes=nodes))
        plan = order_joint(
            updates, network, delay_bound=self._bound, v_init=version + len(self._granted)
        )
        by_key = {(r.worker, r.iteration): r for r in batch}
        planned: list[Planned] = []
        parts: list[PartPlanned] = []
        for booked in plan.planned:
            ready = by_key[booked.update.key]  # type: ignore[index]
            key = (ready.worker, ready.iteration)
            own = Update(key=key, host=ready.host, version=ready.base, size=ready.size)
            planned.append(Planned(own, booked.transfers[self.server], booked.position))
            for shard in jointly.get(key, {}):
                if shard != 0:
                    t = booked.transfers[servers[shard]]
                    wait = min(max(0.0, t.start - now), MAX_PLAN)
                    duration = min(max(0.0, t.end - t.start), MAX_PLAN)
                    parts.append(self._part(ready, shard, wait=wait, duration=duration))
            self._others += [  # (at its own node, the bytes of other shards served there)
                (t.start, min(t.end, now + MAX_PLAN), ready.host, node, extra)
                for node, t in booked.transfers.items()
                if (extra := t.size - (ready.size if node == self.server else 0)) > 0
            ]
        dropped: list[tuple[Update, str]] = []
        for update, reason in plan.dropped:
            ready = by_key[update.key]  # type: ignore[index]
            key = (ready.worker, ready.iteration)
            dropped.append((Update(key=key, host=ready.host, version=ready.base, size=0), reason))
            parts += [self._part(ready, s, reason=reason) for s in jointly.get(key, {}) if s]
        self._joint_planned += len(parts)
        return planned, dropped, parts

    @staticmethod
    def _part(
        ready: _Ready,
        shard: int,
        *,
        wait: float = 0.0,
        duration: float = 0.0,
        reason: str | None = None,
    ) -> PartPlanned:
        return PartPlanned(
            shard=shard,
            worker=ready.worker,
            iteration=ready.iteration,
            wait=wait,
            duration=duration,
            reason=reason,
        )

    def _deny(
        self, dropped: list[tuple[Update, str]], by_key: dict[Hashable, _Ready]
    ) -> list[Denied]:
        out = []
        for update, reason in dropped:
            ready = by_key[update.key]
            self._worker.pop(ready.worker, None)  # decided: its next push may come
            self._denied[reason] = self._denied.get(reason, 0) + 1
            if self.copies is not None:
                self.copies.forget(update.key)
            out.append(
                Denied(
                    worker=ready.worker,
                    iteration=ready.iteration,
                    base=ready.base,
                    reason=f"dropped by the scheduler: {reason}",
                )
            )
        return out

    def _grant(
        self,
        ready: _Ready,
        planned: Planned,
        now: float,
        *,
        via: int | None = None,
        group: int | None = None,
        copies: CopyPlan | None = None,
    ) -> Granted:
        """Grant ``ready`` its planned transfer (to the server, or to aggregator ``via``), and
        (``copies``) say when its copy goes to the replica; the batch's last push may wait for
        the replica (copy_plan's ``delay``)."""
        start = planned.transfer.start
        copy_wait: float | None = 0.0
        if copies is not None:
            copy_wait = copies.waits.get(planned.update.key, 0.0)
            if copies.delay is not None and copies.delay[0] == planned.update.key:
                start = max(start, copies.delay[1])
        # (a delayed push is planned later by as much: the network it leaves is the batch's)
        end = min(planned.transfer.end + (start - planned.transfer.start), now + MAX_PLAN)
        self._granted[(ready.worker, ready.iteration)] = _Grant(
            ready=ready,
            dst=self.server if via is None else via,
            start=min(start, end),
            end=end,
        )
        self._grants += 1
        return Granted(
            worker=ready.worker,
            iteration=ready.iteration,
            wait=min(max(0.0, start - now), MAX_PLAN),
            via=via,
            group=group,
            copy_wait=copy_wait if copy_wait is None else min(copy_wait, MAX_PLAN),
        )

    def _listed(
        self, batch: list[_Ready], updates: list[Update], network: Network
    ) -> tuple[list[Planned], list[Group]]:
        """A synchronous batch (MLfabric-S, §6): each iteration's updates as a list in the
        order they became ready (:func:`~fabricd.engines.scheduling.ordering.in_list_order`),
        with Alg. 3's groups if aggregating.  A group sums one iteration's updates only (the
        server applies an iteration as one step): a batch holding two iterations (a fast
        worker's next one, ready once the last was complete) plans them one after the other,
        the older first, the second on the network the first's plan left."""
        planned: list[Planned] = []
        groups: list[Group] = []
        for iteration in sorted({r.iteration for r in batch}):
            listed = in_list_order(
                [u for r, u in zip(batch, updates, strict=True) if r.iteration == iteration],
                network,
                server=self.server,
            )
            planned += listed.planned
            # an update no link carries goes straight (its host could forward nothing either)
            finite = [p for p in listed.planned if math.isfinite(p.transfer.end)]
            found, after = self._groups(finite, network) if self.aggregation else ([], None)
            groups += found
            if after is None:
                after = listed.network
            network = network if after is None else after
        return planned, groups

    def _groups(
        self, planned: list[Planned], network: Network
    ) -> tuple[list[Group], Network | None]:
        """Alg. 3 over the batch's planned updates: the groups summed at aggregators, and
        the network with the plan booked (``None`` when there was nothing to plan).  The
        aggregators are the batch's worker hosts but the server's, pre-assigned to groups in
        a rotation that moves by one host each batch (§5.2 pre-assigns them at random: a
        rotation spreads the aggregation load as evenly and keeps the engine without a random
        source); a batch of one update, or with no other host, has none."""
        hosts = sorted({p.update.host for p in planned} - {self.server})
        if len(planned) < 2 or not hosts:
            return [], None
        turn = self._batches % len(hosts)
        hosts = hosts[turn:] + hosts[:turn]
        plan = aggregate(planned, network, server=self.server, aggregators=hosts)
        return plan.groups, plan.network

    def fresh(self) -> ShardScheduler:
        """A scheduler like this one with nothing planned, its counters kept: a promoted
        shard's (what this one planned when the shard last served is void after another rank
        served it)."""
        fresh = ShardScheduler(
            server=self.server,
            delay_bound=self.delay_bound,
            interval=self.interval,
            aggregation=self.aggregation,
            synchronous=self.synchronous,
            copies=None if self.copies is None else self.copies.fresh(),
            joint=self.parts is not None,
        )
        # its counters go on (status and metrics never go back)
        fresh._ready, fresh._grants, fresh._batches = self._ready, self._grants, self._batches
        fresh._denied, fresh._decided = dict(self._denied), self._decided
        fresh._latency_sum, fresh._latency_max = self._latency_sum, self._latency_max
        fresh._joint_planned = self._joint_planned
        if fresh.parts is not None and self.parts is not None:
            fresh.parts.fell_back = self.parts.fell_back
        return fresh

    @property
    def _grace(self) -> float:
        return max(GRANT_GRACE_MIN, 10 * self.interval)

    def expect(
        self,
        group: int,
        aggregator: int,
        members: tuple[tuple[int, int, int], ...],
        size: float,
        end: float,
        start: float | None = None,
    ) -> None:
        """Node ``aggregator`` was told to sum ``members`` as group ``group`` (a GATHER): its
        aggregate, of ``size`` bytes, planned to go from ``start`` and reach the server by
        ``end``, is taken once."""
        self._gathers[group] = _Group(
            aggregator=aggregator,
            members={w: (it, b) for w, it, b in members},
            size=size,
            start=end if start is None else start,
            end=end,
        )

    def expects(self, group: int, sender: int, members: tuple[tuple[int, int, int], ...]) -> bool:
        """Whether an aggregate of ``members`` from node ``sender`` is one this scheduler
        asked for: group ``group``, told to that node, holding those updates (a subset: a
        member may not have come).  Its plan is used up either way it is answered: each group
        forwards once.  Anything else is refused, so a peer cannot apply updates in the name
        of workers of other nodes (nor a stale aggregate after a failover: the promoted
        replica's scheduler planned none)."""
        plan = self._gathers.get(group)
        if plan is None or plan.aggregator != sender:
            return False
        del self._gathers[group]
        return all(plan.members.get(w) == (it, b) for w, it, b in members)

    def settled(self, worker: int, iteration: int) -> None:
        """The shard processed ``worker``'s push of ``iteration`` (applied or dropped)."""
        self._granted.pop((worker, iteration), None)
        self._batch.pop((worker, iteration), None)
        self._held.pop((worker, iteration), None)
        if self.parts is not None:
            self.parts.forget((worker, iteration))
        if self._worker.get(worker) == iteration:
            del self._worker[worker]

    def lose(self, worker: int) -> None:
        """``worker`` is lost to the shard: what it had ready or granted is forgotten."""
        iteration = self._worker.pop(worker, None)
        if iteration is not None:
            self._batch.pop((worker, iteration), None)
            self._granted.pop((worker, iteration), None)
            self._held.pop((worker, iteration), None)
        if self.parts is not None:
            self.parts.forget_worker(worker)
        if self.copies is not None:
            self.copies.forget_worker(worker)

    def _expire(self, now: float) -> None:
        """Forget the grants and groups whose push or aggregate never came in time."""
        gone = now - self._grace
        for key in [k for k, g in self._granted.items() if g.end <= gone]:
            del self._granted[key]
            if self._worker.get(key[0]) == key[1]:
                del self._worker[key[0]]
        for number in [n for n, g in self._gathers.items() if g.end <= gone]:
            del self._gathers[number]

    def _network(
        self,
        now: float,
        batch: list[_Ready],
        figures: Callable[[int], tuple[float, float] | None],
        extra: Iterable[int] = (),
    ) -> Network:
        """The star network's timelines from ``now``: the monitor's figures for the hosts the
        batch, the outstanding grants and ``extra`` use, the outstanding grants reserved
        again."""
        hosts = {self.server, *(r.host for r in batch), *extra}
        hosts |= {g.ready.host for g in self._granted.values()}
        hosts |= {g.dst for g in self._granted.values()}
        hosts |= {b[2] for b in self._others} | {b[3] for b in self._others}
        hosts |= {g.aggregator for g in self._gathers.values()}
        up: dict[int, float] = {}
        down: dict[int, float] = {}
        for host in hosts:
            known = figures(host)
            up[host], down[host] = known if known is not None else (UNKNOWN_BPS, UNKNOWN_BPS)
        network = Network(up, down, now=now)
        # what is planned and not processed yet: the pushes to their destinations (the server,
        # or their aggregator) and the groups' forwards, each from its planned start (or now)
        # for what its plan says is left of it (all of it, once past its planned end)
        booked = [
            (g.start, g.end, g.ready.host, g.dst, float(g.ready.size))
            for g in self._granted.values()
        ]
        booked += [
            (g.start, g.end, g.aggregator, self.server, g.size) for g in self._gathers.values()
        ]
        self._others = [b for b in self._others if now < b[1]]
        booked += self._others
        for start, end, src, dst, size in sorted(booked, key=lambda b: b[1]):
            left = size if now >= end else size * min(1.0, (end - now) / max(end - start, 1e-9))
            network.reserve(src, dst, left, start=max(start, now))
        return network

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            ready=self._ready,
            granted=self._grants,
            denied=dict(self._denied),
            batches=self._batches,
            waiting=len(self._batch),
            outstanding=len(self._granted),
            latency_sum=self._latency_sum,
            latency_max=self._latency_max,
            decided=self._decided,
            joint_planned=self._joint_planned,
            joint_held=len(self._held),
            fell_back=0 if self.parts is None else self.parts.fell_back,
        )


def scheduler_for(
    spec: Meta, rule: UpdateRule | None, node: int, interval: float
) -> ShardScheduler | None:
    """A shard's MLfabric scheduler (``scheduling="mlfabric"``), planning its replica's copies
    too under bounded replication (:mod:`fabricd.engines.ps.copy_plan`), or ``None``."""
    if spec["scheduling"] != "mlfabric":
        return None
    copies = None
    if spec["replication"] == "bounded":
        sgd = rule if isinstance(rule, SGD) else None
        copies = CopyPlanner(
            DivergenceBound.from_spec(spec["divergence_bound"]),
            momentum=0.0 if sgd is None else sgd.momentum,
            rate=1.0 if sgd is None else sgd.lr,
            interval=interval,
        )
    return ShardScheduler(
        server=node,
        delay_bound=spec["delay_bound"],
        interval=interval,
        aggregation=spec["aggregation"],
        synchronous=spec["consistency"] == "bsp",
        copies=copies,
        joint=joint_for(spec),
    )
