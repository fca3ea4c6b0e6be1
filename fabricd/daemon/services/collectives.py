"""The collective service: ``collective`` requests and COLL frames, for persistent schedules.

Drives one :class:`~fabricd.engines.collectives.persistent.Collective` per (job, name) on this
node, built by the first call or peer frame of that name and kept round after round (eager-SGD
§4.1, §4.3).  A request names the collective, its kind, the caller's array (a view of its
segment), op and mode; the engine reads the contribution from the array and writes the result
into it; the service answers ``{round, included, active}``.

Every message of a round is one COLL frame on the data link (more only past ``chunk_size``),
landing in the slot the receiving node allocated for the same schedule: the posted-buffer path,
no RTS, CTS or RTR.  Frames to one peer leave in order: at once while the link takes them, else
from a queue one task drains.  Frames a node refuses (``refusals.py``) never reset its links.

Membership: a collective runs over the nodes that host the job's ranks, built once every rank
is known here.  A call made earlier waits (up to ``route_timeout``, then ``no_such_rank``); a
peer's frame that comes earlier is held, within bounds, until it can be placed.  A member node
that goes down fails a sync collective's calls and breaks it; solo and majority go on among the
survivors.  A member whose links were reset is down only once membership says so (``NodeGone``;
back in time, ``NodeBack``, it runs on).  A rank that leaves fails sync calls (``rank_left``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import OperationStats
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.collective_requests import parse, view
from fabricd.daemon.services.collectives_status import (
    SCANNED,
    collective_row,
    families,
    stall_row,
)
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.daemon.services.held_frames import HeldFrames
from fabricd.daemon.services.jobs import (
    Groups,
    OpenCall,
    OpenCalls,
    Shared,
    WaitingForRanks,
    refuse_while_draining,
)
from fabricd.daemon.services.refusals import OverLimit, Refused, Stranger
from fabricd.daemon.stalls import call_line
from fabricd.dtypes import ITEMSIZE
from fabricd.engines.actions import Failure
from fabricd.engines.collectives.mlfabric import MlfabricCollective
from fabricd.engines.collectives.persistent import (
    NOTICE,
    Collective,
    Deliver,
    Fail,
    Settle,
    Spec,
    Transmit,
)
from fabricd.engines.collectives.spec import GATHERS, KINDS, chosen, held_bytes, in_place
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.membership import NodeBack, NodeGone, RankJoined, RankLeft
from fabricd.errors import (
    ErrorCode,
    OperationFailed,
    RemoteProtocolError,
    UsageError,
)
from fabricd.frames import collectives as collectives_frames
from fabricd.wire import Kind, Meta

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import numpy as np
    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.services.held_frames import Held
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.budget import Charge
    from fabricd.engines.collectives.persistent import Action
    from fabricd.engines.membership import Membership, RankEvent, Suspicion
    from fabricd.frames import registry

log = logging.getLogger("fabricd.collectives")
remote_log = RateLimitedLog(log)
#: stalled calls: each is logged once, but a whole job's can stall at once
stall_log = RateLimitedLog(log)

#: peers' frames held for collectives not built here yet (their job's ranks not all known)
MAX_HELD_BYTES: Final = 64 * 1024 * 1024
MAX_HELD_FRAMES: Final = 4096

Key = tuple[str, str]  #: (job, collective name)
#: a call's array and its output (an allgather's or reduce-scatter's), once viewed
_Arrays = tuple["np.ndarray[Any, Any] | None", "np.ndarray[Any, Any] | None"]


@dataclass(slots=True, kw_only=True)
class _Waiting:
    """A call that waits for every rank of its job to be known (plain fields: see
    :class:`~fabricd.daemon.services.jobs.Waits`)."""

    session: ClientSession
    request_id: int
    spec: Spec
    #: where its arrays are: (seg, off, nbytes) of its array (none: a barrier), then its output
    regions: tuple[tuple[int, int, int], ...]
    name: str
    deadline: float


class CollectiveService(BaseService):
    """Persistent collectives: sync, solo and majority allreduce, broadcast, barrier."""

    name = "collectives"
    kinds = frozenset({Kind.COLL})
    ops = frozenset({"collective"})

    def __init__(self, host: Host, *, membership: Membership) -> None:
        self.host = host
        self.membership = membership
        self.collectives: dict[Key, Collective] = {}
        self._specs: dict[Key, Meta] = {}  #: each collective's spec as its frames carry it
        #: each job's placement once all its ranks were known: a peer's frame builds from it
        #: after a rank left (a partial first round waits for nothing from such a node)
        self._placements: dict[str, list[int]] = {}
        self._charges: dict[Key, Charge] = {}  #: what each collective holds, on the budget
        #: collectives a peer's frame could not build here (a limit), and why, until the job ends
        self._over_limit: dict[Key, str] = {}
        self.operations = OperationStats(self.name, kinds=list(KINDS))
        self._open: OpenCalls[int] = OpenCalls(host, self.operations)  #: by token
        self._sessions: dict[str, set[ClientSession]] = {}  #: clients that called, per job
        self._waiting: WaitingForRanks[_Waiting] = WaitingForRanks(
            host, membership, "collective calls", lambda w: f"{w.spec.describe()} {w.name!r}"
        )
        self._by_job: Groups[str, Key] = Groups()  #: the collectives of each job
        self._due: Deadlines[Key] = Deadlines()  #: the collectives' deadlines (a sync round's)
        self._held = HeldFrames()  #: peers' frames for collectives not built yet
        self._shared: Shared[Spec] = Shared()  #: the specs waiting calls share
        self._tokens = 0
        self._frames = DataQueues(host, Kind.COLL, sent=self._count_sent)
        self._counters = {
            "bytes_sent": 0,
            "frames_held": 0,
            "frames_dropped": 0,  #: held past the bound, or for a collective that cannot be built
            "frames_refused_not_member": 0,  #: from a node that hosts no rank of the job
            "frames_refused_limit": 0,  #: for a collective a limit kept from being built here
            "rounds": 0,
            "stalls_reported": 0,  #: calls logged once as open past stall_after
        }

    def _count_sent(self, nbytes: int) -> None:
        self._counters["bytes_sent"] += nbytes

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> None:
        refuse_while_draining(self.host)
        session = request.session
        if session.job is None:
            raise UsageError("connect with a job (fabricd.connect(job=...)) before collectives")
        parsed = parse(request.meta, session)
        waiting = _Waiting(
            session=session,
            request_id=request.id,
            spec=self._shared.one(parsed.spec),
            regions=parsed.regions,
            name=parsed.name,
            deadline=now + self.host.config.route_timeout,
        )
        if not self._try(waiting, now, (parsed.array, parsed.output)):
            self._waiting.add(waiting)  # its array is viewed again when it runs

    def _try(self, waiting: _Waiting, now: float, arrays: _Arrays = (None, None)) -> bool:
        """Hand the call to its collective, building it if every rank is known; ``False``:
        it must wait for the job's ranks.  ``arrays``: the call's and its output, if viewed
        already.

        Raises:
            UsageError: its segment is gone (detached while the call waited).
        """
        session = waiting.session
        assert session.job is not None
        key = (session.job, waiting.name)
        coll = self.collectives.get(key)
        if coll is None and key in self._over_limit:
            raise OperationFailed(self._over_limit[key], code=ErrorCode.LIMIT)
        ranks = self._ranks(session.job, session.size) if coll is None else None
        if coll is None and ranks is None:
            return False
        if arrays[0] is None and waiting.regions:
            views = [view(session, where, waiting.spec.dtype) for where in waiting.regions]
            arrays = (views[0], views[1] if len(views) > 1 else None)
        array, output = arrays
        if coll is None:
            assert ranks is not None
            coll = self._build(key, waiting.spec, ranks, now, choose=True)
        elif not coll.spec.same_call(waiting.spec):
            message = (
                f"collective {waiting.name!r} of job {session.job!r} is a "
                f"{coll.spec.describe(waiting.spec)}; rank {session.rank} called it as a "
                f"{waiting.spec.describe(coll.spec)}: every rank must "
                "call it alike (or use another name)"
            )
            self._disagree(key, coll, waiting.spec, message)
            raise UsageError(message)
        self._tokens += 1
        token = self._tokens
        actions = coll.call(session.rank, token, array, now, output)
        nbytes = 0 if array is None else array.nbytes
        call = OpenCall(
            session=session,
            request=waiting.request_id,
            kind=waiting.spec.kind,
            name=waiting.name,
            started=now,
            nbytes=nbytes,
        )
        self._open.open(token, call)
        self._sessions.setdefault(session.job, set()).add(session)
        self._perform(key, actions)
        return True

    def _disagree(self, key: Key, coll: Collective, spec: Spec, message: str) -> None:
        """``key`` was called (here, or by a peer whose frame says so) as ``spec``, unlike the
        collective here: it breaks here, and every member gets two NOTICE frames, one with each
        spec, so whichever side a member is on one disagrees with its own and breaks it there
        too, naming both (one NOTICE would leave the nodes that run the other spec waiting).
        A broken collective sends no more: the news spreads once per node, never in a loop."""
        if coll.broken is not None:
            return
        self._perform(key, coll.break_with(ErrorCode.USAGE, message))
        chose = {"ring": coll.spec.ring, "direct": coll.spec.direct}  # (for an "auto" spec)
        disagreeing = {**spec.to_meta(), **(chose if spec.algorithm == "auto" else {})}
        lost = tuple(sorted(coll.lost))
        notice = Transmit(
            node=-1, round=0, tag=NOTICE, payload=memoryview(b""), lost=lost, base=coll.base
        )
        for node in coll.members:
            if node != coll.node:
                self._transmit(key, replace(notice, node=node), spec=disagreeing)
                self._transmit(key, replace(notice, node=node))

    def _ranks(self, job: str, size: int) -> tuple[int, ...] | None:
        """The node of every rank of ``job``, or ``None`` while one is unknown."""
        nodes = []
        for rank in range(size):
            entry = self.membership.lookup(job, rank)
            if entry is None:
                return None
            nodes.append(entry.node)
        return tuple(nodes)

    def _placement(self, job: str, size: int) -> tuple[int, ...] | None:
        """The node of every rank of ``job``, a rank that left on the node it was last known
        on if the job was ever whole here with ``size`` ranks; ``None`` while one is unknown."""
        known = self._placements.get(job)
        if known is not None and len(known) != size:  # (another job of that name, another size)
            known = None
        nodes = []
        for rank in range(size):
            entry = self.membership.lookup(job, rank)
            if entry is not None:
                nodes.append(entry.node)
            elif known is not None:
                nodes.append(known[rank])
            else:
                return None
        return tuple(nodes)

    def _live(self, job: str, size: int) -> frozenset[int]:
        return frozenset(r for r in range(size) if self.membership.lookup(job, r) is not None)

    def _build(
        self, key: Key, spec: Spec, ranks: tuple[int, ...], now: float, *, choose: bool
    ) -> Collective:
        """Build ``key``'s collective (``choose``: pick its algorithm here, for a local call;
        else it is the peer's, from its frame) and place what was held for it."""
        job, name = key
        held = self._by_job.count(job)
        if held >= self.host.config.max_collectives_per_job:
            raise OperationFailed(
                f"job {job!r} has {held} collectives on node {self.host.config.node_id}, the "
                "most max_collectives_per_job allows; reuse names (a collective is persistent: "
                "call it again every step) or raise the setting",
                code=ErrorCode.LIMIT,
            )
        if choose:
            spec = chosen(spec, len(set(ranks)), ring_from_bytes=self.host.config.ring_from_bytes)
        charge = self._charge(key, spec, ranks)
        try:
            coll = self._new(spec, job, name, ranks)
        except BaseException:
            charge.release()
            raise
        self._charges[key] = charge
        self.collectives[key] = coll
        self._by_job.add(job, key)
        self._specs[key] = coll.spec.to_meta()
        for node in coll.initial:  # a member already lost to this daemon
            if node != coll.node and self.host.data_link(node) is None:
                log.info("collective %r of job %r: node %d is not up", name, job, node)
        self._replay(key, now)
        return coll

    def _new(self, spec: Spec, job: str, name: str, ranks: tuple[int, ...]) -> Collective:
        """A collective of ``spec``: MLfabric-S's plans on this daemon's network monitor."""
        config = self.host.config
        kw: Meta = {"job": job, "name": name, "node": config.node_id, "ranks": ranks}
        kw |= {"live": self._live(job, len(ranks)), "majority_wait": config.majority_wait}
        if not spec.mlfabric:
            return Collective(spec, **kw)
        figures = self._bandwidth
        return MlfabricCollective(spec, interval=config.schedule_interval, figures=figures, **kw)

    def _bandwidth(self) -> dict[int, tuple[float, float]]:
        """The monitor's (up, down) bytes/s of every node it has figures for."""
        return {n: (f.up, f.down) for n, f in self.host.network(self.host.now()).items()}

    def _charge(self, key: Key, spec: Spec, ranks: tuple[int, ...]) -> Charge:
        """Charge the most ``key``'s collective will hold to its job's byte budget, before it
        is built (:func:`~fabricd.engines.collectives.spec.held_bytes`).

        Raises:
            OperationFailed: code ``limit``: the job or its owner's uid would go over its budget.
        """
        job, name = key
        node = self.host.config.node_id
        inplace = Collective.IN_PLACE and in_place(spec, ranks, node)
        local = ranks.count(node)
        nbytes = held_bytes(spec, len(set(ranks)), inplace=inplace, local=local, size=len(ranks))
        owner = self.membership.owner(job)
        what = f"{spec.describe()} {name!r} of job {job!r}"
        return self.host.budget.charge(-1 if owner is None else owner, job, nbytes, what)

    # -- peers ------------------------------------------------------------------------------
    def payload_buffer(
        self, node: int, frame: registry.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, collectives_frames.Coll)
        try:
            coll = self._collective(frame, node)
        except Refused:
            return None  # read and dropped; on_data refuses the frame and counts it
        if coll is None:
            return memoryview(self._hold(node, frame, length).payload)
        key = (frame.job, frame.name)
        view = coll.landing(
            node,
            frame.tag,
            frame.round,
            frame.off,
            length,
            frame.lost,
            frame.base,
            self.host.now(),
        )
        self._track(key)  # a newer view adopted may have moved its deadline
        if view is None:  # an older view's, or a broken collective's: read and dropped
            self._counters["frames_dropped"] += 1
        return view

    def on_data(self, node: int, frame: registry.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, collectives_frames.Coll)
        key = (frame.job, frame.name)
        if self._held.landed(frame) is not None:  # its payload landed in the hold
            if key in self.collectives:  # built meanwhile: place it now
                self._replay(key, now)
            return
        try:
            coll = self._collective(frame, node)
        except Refused as exc:
            self._counters[exc.counter] += 1
            remote_log.warning("refused", "%s", exc)
            return
        if coll is None:
            self._hold(node, frame, 0, whole=True)
            return
        self._perform(
            key,
            coll.arrived(
                node, frame.tag, frame.round, length, frame.lost, frame.base, now, frame.notes
            ),
        )

    def _collective(self, frame: collectives_frames.Coll, node: int) -> Collective | None:
        """The collective a peer's frame is for, built from its spec if every rank of its job
        is known here; ``None``: not yet (the frame is held).

        Raises:
            Stranger: ``node`` hosts no rank of the job (as far as every rank of it is known
                here): the frame is refused before anything is built or allocated for it.
            RemoteProtocolError: its spec is malformed.
        """
        key = (frame.job, frame.name)
        coll = self.collectives.get(key)
        if coll is not None and node not in coll.initial:
            raise Stranger(node, frame)
        if coll is None and key in self._over_limit:
            raise OverLimit(self._over_limit[key])
        if coll is not None and frame.spec == self._specs[key]:
            return coll  # every frame of a round: no need to parse the spec again
        spec = Spec.from_meta(frame.spec)
        if coll is not None:
            if coll.spec != spec and coll.broken is None:  # the ranks' calls disagree
                message = (
                    f"node {node} runs {frame.name!r} of job {frame.job!r} as a "
                    f"{spec.describe(coll.spec)}, this node as a {coll.spec.describe(spec)}: "
                    "every rank must call a collective alike (and every daemon have one "
                    "ring_from_bytes)"
                )
                self._disagree(key, coll, spec, message)
            return coll
        size = self.membership.job_size(frame.job)
        ranks = self._placement(frame.job, size) if size is not None else None
        if ranks is not None and node not in ranks:
            raise Stranger(node, frame)
        if ranks is None or self.host.config.node_id not in ranks:
            return None
        nbytes = spec.count * ITEMSIZE[spec.dtype] * (len(ranks) if spec.kind in GATHERS else 1)
        if nbytes > self.host.config.max_mapped_bytes_per_client:
            raise RemoteProtocolError(
                f"node {node} asks for a collective of {nbytes} B, more than any client here "
                "may map (max_mapped_bytes_per_client)"
            )
        try:
            return self._build(key, spec, ranks, self.host.now(), choose=False)
        except OperationFailed as exc:  # at a limit here: this tenant's, not the link's fault
            self._refuse_to_build(key, frame, ranks, str(exc))
            raise OverLimit(str(exc)) from None
        except UsageError as exc:  # a bad root
            raise RemoteProtocolError(str(exc)) from None
        except (MemoryError, ValueError) as exc:  # its buffers do not fit in this process
            raise RemoteProtocolError(f"cannot build {frame.name!r} here: {exc!r}") from None

    def _refuse_to_build(
        self, key: Key, frame: collectives_frames.Coll, ranks: tuple[int, ...], why: str
    ) -> None:
        """A peer's frame would build ``key`` past a limit here: remember it until the job ends
        (later frames are dropped, local calls fail with ``limit``) and send every other member
        a NOTICE naming it lost, which breaks the collective there (its calls fail with
        ``peer_failed``; this node's log says why) instead of waiting for this node for ever."""
        log.warning("collective %r of job %r cannot be built here: %s", key[1], key[0], why)
        self._over_limit[key] = why
        empty = memoryview(b"")
        for node in sorted(set(ranks) - {self.host.config.node_id}):
            notice = Transmit(node=node, round=0, tag=NOTICE, payload=empty, lost=(node,), base=0)
            self._transmit(key, notice, spec=frame.spec)

    def _hold(
        self, node: int, frame: collectives_frames.Coll, length: int, *, whole: bool = False
    ) -> Held:
        """Keep a frame (and its payload) until its collective can be built here.

        Raises:
            RemoteProtocolError: the hold is full: the peer sends far ahead of this node's
                membership (its link is closed, which the peer sees as this node's failure).
        """
        held = self._held
        if held.bytes + length > MAX_HELD_BYTES or held.count >= MAX_HELD_FRAMES:
            self._counters["frames_dropped"] += 1
            raise RemoteProtocolError(
                f"node {node} sent more collective frames for unknown jobs than this node holds"
            )
        self._counters["frames_held"] += 1
        expires = self.host.now() + self.host.config.route_timeout
        return held.hold(node, frame, length, expires, whole=whole)

    def _replay(self, key: Key, now: float) -> None:
        """Place the frames held for ``key`` whose payload is in, now that it is built, in
        the order they came; a frame still landing waits for its on_data.  A frame that does
        not fit (its spec disagrees: the collective breaks here, naming both) is dropped and
        counted; the others are still placed."""
        for item in self._held.ready(key):
            frame, n = item.frame, len(item.payload)
            try:
                coll = self._collective(frame, item.node)  # checks its spec against ours
                assert coll is not None  # built: that is why it replays
                if n:
                    view = coll.landing(
                        item.node, frame.tag, frame.round, frame.off, n, frame.lost, frame.base, now
                    )
                    if view is None:
                        self._counters["frames_dropped"] += 1
                        continue
                    view[:] = item.payload
                actions = coll.arrived(
                    item.node, frame.tag, frame.round, n, frame.lost, frame.base, now, frame.notes
                )
            except Refused as exc:
                self._counters[exc.counter] += 1
                remote_log.warning("refused", "%s", exc)
                continue
            except RemoteProtocolError as exc:
                self._counters["frames_dropped"] += 1
                remote_log.warning(
                    "held", "dropping a frame node %d sent for %r: %s", item.node, key, exc
                )
                continue
            self._perform(key, actions)
        self._track(key)

    def peer_down(self, node: int, reason: str, now: float) -> None:
        """``node``'s links were reset: frames in flight are lost.  It is counted down (a view
        change, or a broken sync collective) only once membership says it is gone
        (:meth:`on_suspicion`): a link that flaps under load must not split a collective."""
        self._frames.drop(node)  # the old link's frames go with it
        for key, coll in list(self.collectives.items()):
            self._perform(key, coll.interrupted(node, reason))
        for key in self._held.drop_node(node):
            if key in self.collectives:  # the frames behind a dead node's, still landing
                self._replay(key, now)

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        """A member node whose links were reset is back, the same daemon (the collective runs
        on from the next round), or gone (a view change, or a broken sync collective)."""
        match event:
            case NodeBack(node=node):
                for key, coll in list(self.collectives.items()):
                    self._perform(key, coll.resume(node, now))
            case NodeGone(node=node, reason=reason):
                for key, coll in list(self.collectives.items()):
                    self._perform(key, coll.lose(node, reason, now))

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        job = event.entry.job
        if isinstance(event, RankLeft):
            grace = self.host.config.suspect_after
            for key in self._by_job.of(job):
                coll = self.collectives[key]
                live = self._live(job, coll.size)
                self._perform(key, coll.rank_gone(event.entry.rank, live, now, grace=grace))
            self._tell(job, "rank_left", {"rank": event.entry.rank, "reason": event.reason})
            if self.membership.job_size(job) is None:
                self._forget_job(job)
            return
        assert isinstance(event, RankJoined)
        for key in self._by_job.of(job):
            self.collectives[key].rank_back(self._live(job, self.collectives[key].size))
            self._track(key)
        self._waiting.retry(job, lambda item: self._try(item, now))
        whole = self.membership.known(job) >= (self.membership.job_size(job) or 2**62)  # O(1)
        known = self._placements.get(job)
        entry = event.entry
        if known is not None and entry.rank < len(known):  # a rank back, maybe elsewhere
            known[entry.rank] = entry.node
        elif whole:  # (once a job: O(size))
            placement = self._ranks(job, self.membership.job_size(job) or 0)
            if placement is not None:
                self._placements[job] = list(placement)
        for key in self._held.keys_of(job) if whole else ():
            while (first := self._held.first(key)) is not None:
                try:
                    self._collective(first.frame, first.node)  # builds and replays if it can
                except Stranger as exc:  # its frames go; a member's behind them may build
                    self._counters[exc.counter] += self._held.drop_from(key, first.node)
                    remote_log.warning("refused", "%s", exc)
                    continue
                except (Refused, RemoteProtocolError) as exc:
                    remote_log.warning("held", "dropping held frames of %r: %s", key, exc)
                    self._drop_held(key)
                break

    def _forget_job(self, job: str) -> None:
        """``job`` is gone from the fabric (no rank of it is known any more): its collectives,
        held frames and sessions go, so a later job of that name starts afresh."""
        failure = Failure(code=ErrorCode.PEER_FAILED, message=f"job {job!r} ended")
        self._placements.pop(job, None)
        for token in self._open.of_job(job):
            self._open.fail(token, failure)
        for key in self._by_job.of(job):
            coll = self.collectives.pop(key)
            self._by_job.discard(job, key)
            self._due.cancel(key)
            del self._specs[key]
            self._charges.pop(key).release()
            log.info(
                "collective %r of job %r: the job ended after %d rounds",
                key[1],
                job,
                coll.counters.rounds,
            )
        for key in self._held.keys_of(job):
            self._drop_held(key)
        for key in [k for k in self._over_limit if k[0] == job]:
            del self._over_limit[key]
        self._sessions.pop(job, None)

    def _drop_held(self, key: Key) -> None:
        self._counters["frames_dropped"] += self._held.drop(key)

    def _tell(self, job: str, event: str, fields: Meta) -> None:
        """Push ``event`` to every client of ``job`` here that made a collective call."""
        for session in self._sessions.get(job, ()):
            self.host.push(session, event, {"job": job, **fields})

    # -- sending ----------------------------------------------------------------------------
    def _perform(self, key: Key, actions: Iterable[Action]) -> None:
        for action in actions:
            match action:
                case Transmit():
                    self._transmit(key, action)
                case Deliver():  # round, included, active, and kept (an abandoned call's)
                    self._open.reply(action.token, action.reply())
                case Fail(token=token, code=code, message=message):
                    self._open.fail(token, Failure(code=code, message=message))
                case Settle(round=round, nodes=nodes) if all(map(self._flushed, nodes)):
                    self._perform(key, self.collectives[key].sent(round, self.host.now()))
        self._track(key)

    def _track(self, key: Key) -> None:
        """Keep ``key``'s deadline in the heap as its collective's says (after every input to
        it), so the timer asks only the collectives that are due."""
        coll = self.collectives.get(key)
        due = None if coll is None else coll.next_deadline()
        if due is None:
            self._due.cancel(key)
        elif self._due.get(key) != due:
            self._due.set(key, due)

    def _flushed(self, node: int) -> bool:
        """Whether nothing of this service's frames to ``node`` is held in this process: none
        queued here, and the link's transport holds no bytes (so no view of a rank's array
        that an in-place round sent from); unknown counts as held."""
        link = self.host.data_link(node)
        return not self._frames.pending(node) and link is not None and link.unsent() == 0

    def _transmit(self, key: Key, t: Transmit, *, spec: Meta | None = None) -> None:
        """Send ``t`` as COLL frames (one, or ``chunk_size`` pieces), saying the collective's
        spec, or ``spec``."""
        spec = self._specs[key] if spec is None else spec
        chunk = self.host.config.chunk_size
        payload = memoryview(t.payload)  # slices of it copy nothing
        offsets = range(0, len(payload), chunk) if payload else range(1)
        for off in offsets:
            frame = collectives_frames.Coll(
                job=key[0],
                name=key[1],
                round=t.round,
                tag=t.tag,
                off=off,
                lost=t.lost,
                base=t.base,
                spec=spec,
                notes=t.notes,
            )
            self._frames.send(t.node, frame.to_meta(), payload[off : off + chunk])

    # -- clients, time, the drain -----------------------------------------------------------
    def client_gone(self, session: ClientSession, now: float) -> None:
        self._waiting.client_gone(session)
        if session.job is not None and session.job in self._sessions:
            self._sessions[session.job].discard(session)
            if not self._sessions[session.job]:
                del self._sessions[session.job]
        for token, call in self._open.abandon(session):
            key = (str(session.job), call.name)
            coll = self.collectives.get(key)
            if coll is not None:
                self._perform(key, coll.abandon(token))

    def next_deadline(self) -> float | None:
        """The earliest of four heaps' (asked after every read batch: O(1) amortised)."""
        due = self._waiting.next_deadline()
        for other in (self._due.next(), self._held.next_deadline(), self._open.next_stall()):
            if other is not None and (due is None or other < due):
                due = other
        return due

    def on_timer(self, now: float) -> None:
        for key in self._due.pop_due(now):  # only the collectives that are due
            coll = self.collectives.get(key)
            if coll is not None:
                self._perform(key, coll.on_timer(now))
        for key, dropped in self._held.expire(now):  # its job never completed here
            self._counters["frames_dropped"] += dropped
            remote_log.warning(
                "held", "dropping frames held route_timeout for %r: its job is incomplete", key
            )
        self._waiting.expire(now)
        self._log_stalls(now)

    def shutdown(self, failure: Failure) -> None:
        for token in [token for token, _ in self._open.items()]:
            self._open.fail(token, failure)
        self._waiting.shutdown(failure)

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Collective calls open longer than ``stall_after``, oldest first, saying what their
        round waits for: local ranks that have not called (sync), majority's initiator, or
        messages from which nodes; and which ranks have not called the name, and what else
        they call (:func:`~fabricd.daemon.services.collectives_status.absent`)."""
        after = self.host.config.stall_after
        late = sorted(
            (c.started, token) for token, c in self._open.items() if now - c.started >= after
        )
        rows: list[Meta] = []
        for _, token in late:
            if limit is not None and len(rows) >= limit:
                break
            call = self._open.get(token)
            assert call is not None
            whose = self._whose(call)
            if keep is not None and not keep(whose):
                continue
            row = self._stall_row(token, call, whose, now)
            if row is not None:
                rows.append(row)
        return rows

    def _whose(self, call: OpenCall) -> Meta:
        """Whose call it is: the fields of its row that access reads."""
        job = str(call.session.job)
        uid = call.session.conn.credentials.uid
        return {"job": job, "owner": self.membership.owner(job), "uid": uid}

    def _stall_row(self, token: int, call: OpenCall, whose: Meta, now: float) -> Meta | None:
        """The stall row of open call ``token`` (``None``: its collective is gone)."""
        job = str(whose["job"])
        coll = self.collectives.get((job, call.name))
        if coll is None:
            return None
        calls = self._open.some_of_job(job, SCANNED)
        newest = self._by_job.newest(job, SCANNED)
        peers_only = [key[1] for key in newest if self.collectives[key].counters.calls == 0]
        node = self.host.config.node_id
        return stall_row(whose, node, token, call, coll, now - call.started, calls, peers_only)

    def _log_stalls(self, now: float) -> None:
        """One log line for each call that became stalled (at most a tick's worth: the rest
        stay due), from its stall row, so the log and ``fabricctl stalls`` say the same."""
        for token, call in self._open.stalled(now):
            row = self._stall_row(token, call, self._whose(call), now)
            if row is not None:
                self._counters["stalls_reported"] += 1
                stall_log.warning("stalled call", "%s", call_line(row))

    # -- status and metrics -----------------------------------------------------------------
    def statistics(self) -> Meta:
        owner: Callable[[str], int | None] = self.membership.owner
        rows = [
            collective_row(job, owner(job), name, coll)
            for (job, name), coll in sorted(self.collectives.items())
        ]
        rounds = sum(c.counters.rounds for c in self.collectives.values())
        return {
            "collectives": rows,
            "counters": {
                **self._counters,
                "rounds": rounds,
                "collective_calls_waiting_for_ranks": len(self._waiting),
            },
        }

    def client_statistics(self, session: ClientSession) -> Meta:
        return {"collective_calls": self._open.count(session)}

    def metrics(self) -> Iterable[Metric]:
        """Totals over this node's collectives (:func:`~fabricd.daemon.services.
        collectives_status.families`)."""
        open_calls, held = len(self._open), self._held.bytes
        return families(self.operations, self.collectives.values(), open_calls, held)
