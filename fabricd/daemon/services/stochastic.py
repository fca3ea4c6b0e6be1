"""The stochastic service: ``stochastic_reduce`` requests and UPDATE, NOTIFY and ACK frames.

Drives :mod:`fabricd.engines.stochastic.notify_ack`: one
:class:`~fabricd.engines.stochastic.notify_ack.Reducer`
per (job, name, local rank), built by the rank's first call or by the first peer frame for it,
and kept round after round.  A request names the reduce, its graph (a kind of
:mod:`fabricd.engines.stochastic.graphs` over the job's ranks, with its degree, seed or edge list),
its
sync mode and the caller's array (a view of its segment); the engine reads the model from the
array and writes the average into it, and the service answers ``{round, inputs, in_degree,
torn, stale}``.

The data plane: a rank's update travels to each out-neighbour as one UPDATE frame on the data
link (the posted-buffer path: it lands in the slot the receiving rank keeps for that sender,
named by (job, name, src, dst); no key is exchanged), NOTIFY and ACK as control frames on the
control link (ASAP's two channels, so an ACK never waits behind a model).  Between two ranks
of one node the service copies the update into the slot itself.  Under ``barrier`` and
``async`` at most one update per edge waits in this daemon's queue: a newer one is not sent
while it does (``updates_skipped``), so a slow link cannot pile models up.

Membership: a call waits (up to ``route_timeout``, then fails with ``no_such_rank``) until
every rank of its job is known, so that its frames can be routed.  A rank that leaves (or
that membership says is gone after its node's links were reset: ``RankGone``) is lost to
every reducer of its job here: under ``notify-ack`` its
neighbours' calls fail with ``peer_failed``, under ``barrier`` everybody's, under ``async``
nobody's (the engine's docstring); a local rank that leaves ends its own reducers too (a
trainer that takes its place calls them under another name, or under ``async`` afresh).  The
job's clients hear ``rank_left`` events.  A job gone from the fabric frees its reducers.

Bounds: a model travels whole in one frame, so at most ``max_payload`` less 16 bytes; a job has
at most ``max_collectives_per_job`` reduce names on a node (built by its calls or its peers'
frames); a peer's spec is checked field by field, over the job's own size, before anything is
built from it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import OperationStats, counter, gauge
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.daemon.services.jobs import (
    Groups,
    OpenCall,
    OpenCalls,
    WaitingForRanks,
    refuse_while_draining,
)
from fabricd.daemon.services.senders import Gate, Sender, earliest
from fabricd.daemon.services.stochastic_status import reducer_row, stall_row
from fabricd.daemon.stalls import call_line
from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.actions import Failure
from fabricd.engines.membership import RankBack, RankGone, RankJoined, RankLeft, RankSuspected
from fabricd.engines.stochastic import graphs
from fabricd.engines.stochastic.notify_ack import (
    ACK,
    OVERHEAD,
    SYNCS,
    UPDATE,
    Failed,
    Reduced,
    Reducer,
    SendSignal,
    SendUpdate,
    Sync,
    update_size,
)
from fabricd.errors import ErrorCode, OperationFailed, RemoteProtocolError, UsageError
from fabricd.frames import stochastic as stochastic_frames
from fabricd.frames.fields import MAX_NAME
from fabricd.frames.stochastic import BROKEN, MAX_SPEC_EDGES, describe
from fabricd.wire import Kind, Meta, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.services.senders import Waiting
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.budget import Charge
    from fabricd.engines.membership import Membership, RankEvent, Suspicion
    from fabricd.engines.stochastic.notify_ack import Action
    from fabricd.frames import registry

log = logging.getLogger("fabricd.stochastic")
remote_log = RateLimitedLog(log)
stall_log = RateLimitedLog(log)  #: stalled calls: each once, but a job's may stall at once

Key = tuple[str, str]  #: (job, reduce name)
RankKey = tuple[str, str, int]  #: (job, reduce name, rank)


@dataclass(slots=True, kw_only=True)
class _Waiting:
    """A call that waits for every rank of its job to be known (plain fields: see
    :class:`~fabricd.daemon.services.jobs.Waits`)."""

    session: ClientSession
    request_id: int
    spec: Meta
    region: tuple[int, int]  #: its array's (seg, off); its bytes are the spec's
    name: str
    deadline: float


class StochasticService(BaseService):
    """Stochastic reduce over communication graphs, with NOTIFY-ACK, barrier or async sync."""

    name = "stochastic"
    kinds = frozenset({Kind.UPDATE, Kind.NOTIFY, Kind.ACK})
    ops = frozenset({"stochastic_reduce"})

    def __init__(self, host: Host, *, membership: Membership) -> None:
        self.host = host
        self.membership = membership
        self.reducers: dict[RankKey, Reducer] = {}
        self._reducers_of: Groups[str, RankKey] = (
            Groups()
        )  #: so a rank's news touches its job's only
        self._names: Groups[str, Key] = Groups()  #: the reduces (keys of ``_specs``) of each job
        self._charges: dict[RankKey, Charge] = {}  #: what each reducer holds, on the budget
        self._specs: dict[Key, Meta] = {}  #: each reduce's spec, as calls and frames carry it
        self._graphs: dict[Key, graphs.Graph] = {}
        self._broken: dict[Key, str] = {}  #: reduces whose ranks called them unlike each other
        self._split: dict[Key, tuple[Meta, Meta]] = {}  #: ... and the two ways they called them
        self.operations = OperationStats(self.name, kinds=list(SYNCS))
        self._open: OpenCalls[RankKey] = OpenCalls(host, self.operations)
        self._waiting: WaitingForRanks[_Waiting] = WaitingForRanks(
            host, membership, "stochastic reduce calls", lambda w: f"stochastic reduce {w.name!r}"
        )
        self._sessions: dict[str, set[ClientSession]] = {}  #: clients that called, per job
        self._queued: dict[tuple[str, str, int, int], int] = {}  #: updates queued per edge
        #: UPDATE frames whose payload is landing, by (node, job, name, src, dst, round), and
        #: the reducer whose slot takes it
        self._landing: dict[tuple[int, str, str, int, int, int], Reducer] = {}
        self._frames = DataQueues(host, Kind.UPDATE, sent=self._count_sent)
        self._counters = {
            "update_bytes_sent": 0,
            "updates_skipped": 0,  #: barrier, async: the edge's last update was still queued
            #: for a rank not here, a reduce called otherwise, or from a node its sender rank
            #: is not on (those also count in frames_refused_not_member: see self._gate)
            "graph_frames_dropped": 0,
            "stalls_reported": 0,  #: calls logged once as open past stall_after
        }
        #: frames only from the node their sender rank is on: refused, or waiting for it
        self._gate = Gate(
            host, membership, remote_log, self._counters, "graph_frames_dropped", self._replay
        )

    def _count_sent(self, nbytes: int) -> None:
        self._counters["update_bytes_sent"] += nbytes

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> None:
        refuse_while_draining(self.host)
        session = request.session
        if session.job is None:
            raise UsageError("connect with a job (fabricd.connect(job=...)) before reducing")
        spec, array, name = self._parse(request)
        key = (session.job, name, session.rank)
        if key in self._open or self._waiting.has(session, name):
            raise UsageError(
                f"rank {session.rank} already has a call of stochastic reduce {name!r} open: "
                "wait for it before the next"
            )
        waiting = _Waiting(
            session=session,
            request_id=request.id,
            spec=spec,
            region=(get_int(request.meta, "seg"), get_int(request.meta, "off")),
            name=name,
            deadline=now + self.host.config.route_timeout,
        )
        if not self._try(waiting, now, array):
            self._waiting.add(waiting)  # its array is viewed again when it runs

    def _parse(self, request: Request) -> tuple[Meta, np.ndarray[Any, Any], str]:
        meta, session = request.meta, request.session
        name = get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"a stochastic reduce name has 1 to {MAX_NAME} characters")
        dtype, sync = get_str(meta, "dtype"), get_str(meta, "sync")
        if dtype not in DTYPES:
            raise UsageError(f"dtype {dtype!r}: a stochastic reduce averages {', '.join(DTYPES)}")
        if sync not in SYNCS:
            raise UsageError(f"sync {sync!r}: one of {', '.join(SYNCS)}")
        nbytes = get_int(meta, "nbytes")
        if nbytes == 0 or nbytes % np.dtype(dtype).itemsize:
            raise UsageError(f"{nbytes} B is not a whole number (> 0) of {dtype} elements")
        too_big = self._too_big(nbytes)
        if too_big is not None:
            raise OperationFailed(too_big, code=ErrorCode.LIMIT)
        edges = meta.get("edges")
        if edges is not None and (not isinstance(edges, list) or len(edges) > MAX_SPEC_EDGES):
            raise UsageError(f"edges: a list of at most {MAX_SPEC_EDGES} [src, dst] pairs")
        degree = meta.get("degree")
        spec = {
            "graph": get_str(meta, "graph"),
            "n": session.size,
            "degree": None if degree is None else get_int(meta, "degree"),
            "seed": get_int(meta, "seed"),
            "edges": edges,
            "sync": sync,
            "dtype": dtype,
            "nbytes": nbytes,
        }
        region = session.segment(get_int(meta, "seg")).view(get_int(meta, "off"), nbytes)
        return spec, np.frombuffer(region, dtype=dtype), name

    def _try(
        self, waiting: _Waiting, now: float, array: np.ndarray[Any, Any] | None = None
    ) -> bool:
        """Hand the call to its reducer, once every rank of its job is known if the reducer is
        new; ``False``: it must wait for them.  ``array``: the call's, if viewed already.

        Raises:
            UsageError: its segment is gone (detached while the call waited).
        """
        session = waiting.session
        job = str(session.job)
        key = (job, waiting.name)
        reducer = self.reducers.get((*key, session.rank))
        # after its first call a rank gone is lost to the reducer; before, it may be late
        known = reducer is not None and reducer.calls > 0
        if not known and self.membership.known(job) < session.size:
            return False
        if array is None:
            seg, off = waiting.region
            region = session.segment(seg).view(off, waiting.spec["nbytes"])
            array = np.frombuffer(region, dtype=waiting.spec["dtype"])
        reducer = self._reducer(key, session.rank, waiting.spec)
        if reducer is None:
            raise UsageError(self._broken[key])
        call = OpenCall(
            session=session,
            request=waiting.request_id,
            kind=reducer.sync.value,
            name=waiting.name,
            started=now,
            nbytes=array.nbytes,
        )
        self._open.open((*key, session.rank), call)
        self._sessions.setdefault(job, set()).add(session)
        self._perform(key, session.rank, reducer.call(array, now))
        return True

    def _reducer(self, key: Key, rank: int, spec: Meta) -> Reducer | None:
        """``rank``'s reducer of ``key``, built if it is new; ``None``: the reduce is broken
        (its ranks called it unlike each other; ``self._broken`` says how).

        Raises:
            UsageError: the spec's graph cannot be built.
            OperationFailed: a new name past ``max_collectives_per_job`` (``limit``), or slots
                that do not fit in memory (``resources``).
        """
        if key in self._broken:
            return None
        known = self._specs.get(key)
        if known is not None and known != spec:
            self._break(key, known, spec)
            return None
        reducer = self.reducers.get((*key, rank))
        if reducer is not None:
            return reducer
        if known is None:
            names = self._names.count(key[0])
            if names >= self.host.config.max_collectives_per_job:
                raise OperationFailed(
                    f"job {key[0]!r} has {names} stochastic reduces on node "
                    f"{self.host.config.node_id}, the most max_collectives_per_job allows; "
                    "reuse names (a reduce is persistent: call it again every round) or raise "
                    "the setting",
                    code=ErrorCode.LIMIT,
                )
        graph = self._graphs[key] if known is not None else graphs.from_spec(spec)  # (says why)
        charge = self._charge(
            key, rank, spec, len(graph.in_neighbours[rank]) + len(graph.out_neighbours[rank])
        )
        try:
            reducer = Reducer(
                rank=rank,
                graph=graph,
                sync=Sync(spec["sync"]),
                dtype=spec["dtype"],
                nbytes=spec["nbytes"],
            )
        except MemoryError:  # a slot per in-neighbour, each the model's size
            charge.release()
            raise OperationFailed(
                f"no memory for the {len(graph.in_neighbours[rank])} slots of "
                f"{spec['nbytes']} B of rank {rank}'s stochastic reduce {key[1]!r}",
                code=ErrorCode.RESOURCES,
            ) from None
        # kept only now: a spec refused above leaves nothing behind to break the reduce later
        self._specs[key], self._graphs[key] = spec, graph
        self._names.add(key[0], key)
        self.reducers[(*key, rank)] = reducer
        self._reducers_of.add(key[0], (*key, rank))
        self._charges[(*key, rank)] = charge
        return reducer

    def _charge(self, key: Key, rank: int, spec: Meta, edges: int) -> Charge:
        """Charge a reducer's slots to the job's byte budget before they are made: one update
        per in-neighbour, its own, and one per out-neighbour (async and barrier rounds stage a
        fresh update while frames queued to a slow neighbour still hold the last one).

        Raises:
            OperationFailed: code ``limit``: the job or its owner's uid would go over its budget.
        """
        job, name = key
        owner = self.membership.owner(job)
        nbytes = (edges + 1) * update_size(spec["nbytes"])
        what = f"rank {rank}'s stochastic reduce {name!r} of job {job!r}"
        return self.host.budget.charge(-1 if owner is None else owner, job, nbytes, what)

    def _drop(self, rank_key: RankKey) -> Reducer:
        """Take a reducer out, giving its bytes back to the budget."""
        self._charges.pop(rank_key).release()
        self._reducers_of.discard(rank_key[0], rank_key)
        return self.reducers.pop(rank_key)

    def _too_big(self, nbytes: int) -> str | None:
        """Why a model of ``nbytes`` is refused, if it is: an UPDATE is never chunked, and one
        its link refused would leave the receiver waiting for it for ever."""
        limit = self.host.config.max_payload
        if nbytes + OVERHEAD <= limit:
            return None
        return (
            f"a stochastic reduce sends its model whole in one frame: {nbytes} B (and "
            f"{OVERHEAD} B of versions) is more than max_payload ({limit} B) allows; reduce a "
            "smaller array, or several under names of their own"
        )

    def _break(self, key: Key, first: Meta, second: Meta) -> None:
        """The ranks of ``key`` called it two ways, ``first`` and ``second`` (here, or as a
        member's BROKEN NOTIFY says): it can never run; every open and later call here fails,
        naming both, and every member node hears it (:meth:`_tell`), or the ranks of nodes
        that never saw the other spec would wait for ever (issue 28, item 2).  A broken
        reduce is told once per node: a node that hears it breaks it and tells the others,
        but one already broken does nothing, so the news never loops."""
        if key in self._broken:
            return
        if (
            key not in self._specs
            and self._names.count(key[0]) >= self.host.config.max_collectives_per_job
        ):
            return  # (a name never called here past the bound: nothing here waits for it)
        message = (
            f"stochastic reduce {key[1]!r} of job {key[0]!r} was called in two ways (one call "
            f"said {describe(first)}, another {describe(second)}): every rank must call it "
            "with the same graph, sync, dtype and size (or use another name)"
        )
        log.warning("%s", message)
        self._broken[key], self._split[key] = message, (first, second)
        self._names.add(key[0], key)  # (forgotten with the job)
        for rank_key in [k for k in self._reducers_of.of(key[0]) if k[1] == key[1]]:
            self._drop(rank_key).close(message)
            self._open.fail(rank_key, Failure(code=ErrorCode.USAGE, message=message))
        self._tell(key)

    def _tell(self, key: Key, pair: tuple[int, int, int] | None = None) -> None:
        """Send a BROKEN NOTIFY with both specs of broken ``key`` as ``pair`` says (to node,
        from local rank, to rank), or from a local rank to a rank on every other member node
        (each of the job's ranks known here: O(ranks), once per reduce).  It comes from a
        local rank of the job, so that the receiver takes it as a member's."""
        job, name = key
        me = self.host.config.node_id
        pairs = [] if pair is None else [pair]
        if pair is None:
            size = self.membership.job_size(job) or 0
            known = [e for r in range(size) if (e := self.membership.lookup(job, r)) is not None]
            src = next((e.rank for e in known if e.node == me), None)
            pairs = [] if src is None else [(e.node, src, e.rank) for e in known if e.node != me]
        first, second = self._split[key]
        for node, src, dst in {p[0]: p for p in pairs}.values():  # (one per node)
            self.host.send(
                node,
                stochastic_frames.Notify(
                    job=job,
                    name=name,
                    src=src,
                    dst=dst,
                    round=0,
                    tag=BROKEN,
                    spec=first,
                    other=second,
                ),
            )

    # -- peers ------------------------------------------------------------------------------
    def payload_buffer(
        self, node: int, frame: registry.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, stochastic_frames.Update)
        verdict = self._gate.judge(node, frame.job, frame.src)
        if verdict is Sender.NOT_YET:
            return self._gate.hold(node, frame.job, frame.src, frame, length)
        reducer = None if verdict is Sender.STRANGER else self._for_frame(node, frame, frame.spec)
        if reducer is None:
            return None
        view = reducer.landing(frame.src, frame.round, length)
        if view is not None:
            self._landing[_landing_key(node, frame)] = reducer
        return view

    def on_data(self, node: int, frame: registry.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, stochastic_frames.Update)
        reducer = self._landing.pop(_landing_key(node, frame), None)
        if reducer is None:  # dropped (its bytes were read and discarded), or held
            self._gate.landed(node, frame, now)
            return
        if self.reducers.get((frame.job, frame.name, frame.dst)) is reducer:
            key = (frame.job, frame.name)
            self._perform(key, frame.dst, reducer.landed(frame.src, frame.round, now))

    def on_frame(self, node: int, frame: registry.PeerFrame, now: float) -> None:
        assert isinstance(frame, stochastic_frames.Notify | stochastic_frames.Ack)
        verdict = self._gate.judge(node, frame.job, frame.src)
        if verdict is Sender.NOT_YET:
            self._gate.hold(node, frame.job, frame.src, frame, 0)
            return
        if verdict is Sender.STRANGER:
            return
        if isinstance(frame, stochastic_frames.Notify):
            if frame.tag == ACK:
                raise RemoteProtocolError("a NOTIFY with the ACK's tag")
            if frame.tag == BROKEN:
                assert frame.other is not None  # (the frame layer checked it)
                if verdict is Sender.MEMBER:  # else no rank of the job is here to tell
                    self._break((frame.job, frame.name), frame.spec, frame.other)
                return
            reducer = self._for_frame(node, frame, frame.spec)
            tag = frame.tag
        else:
            assert isinstance(frame, stochastic_frames.Ack)
            reducer = self.reducers.get((frame.job, frame.name, frame.dst))
            tag = ACK
            if (frame.job, frame.name) in self._split:  # (a rank that only ACKs hears it too)
                self._tell((frame.job, frame.name), (node, frame.dst, frame.src))
        if reducer is not None:
            actions = reducer.message(frame.src, tag, frame.round, now)
            self._perform((frame.job, frame.name), frame.dst, actions)

    def _replay(self, held: Waiting, now: float) -> None:
        """A frame that waited for its sender rank's announcement, as if it came now."""
        frame = held.frame
        if isinstance(frame, stochastic_frames.Update):
            assert held.payload is not None
            view = self.payload_buffer(held.node, frame, len(held.payload))
            if view is not None:
                view[:] = held.payload
            self.on_data(held.node, frame, len(held.payload), now)
        else:
            self.on_frame(held.node, frame, now)

    def _for_frame(
        self, node: int, frame: stochastic_frames.Update | stochastic_frames.Notify, spec: Meta
    ) -> Reducer | None:
        """The reducer a peer's frame is for, built from its spec if its rank has not called
        yet; ``None`` (the frame is dropped and counted): its rank is not here, or the reduce
        was called otherwise."""
        entry = self.membership.lookup(frame.job, frame.dst)
        if entry is None or entry.node != self.host.config.node_id:
            self._counters["graph_frames_dropped"] += 1
            remote_log.warning(
                "stray", "node %d sent a frame for rank %d, not here", node, frame.dst
            )
            return None
        key = (frame.job, frame.name)
        reducer = self.reducers.get((*key, frame.dst))
        if reducer is not None and spec == self._specs.get(key):
            return reducer
        # the frame layer checked the fields' types; these checks the service's own call makes
        size = self.membership.job_size(frame.job)
        if spec["n"] != size:
            raise RemoteProtocolError(
                f"a stochastic reduce spec over {spec['n']} ranks, job of {size}"
            )
        if spec["sync"] not in SYNCS or spec["dtype"] not in DTYPES:
            raise RemoteProtocolError(
                f"a stochastic reduce spec of {spec['sync']!r}, {spec['dtype']!r}"
            )
        too_big = self._too_big(spec["nbytes"])
        if too_big is not None:
            raise RemoteProtocolError(too_big)
        broken = key in self._split
        try:
            reducer = self._reducer(key, frame.dst, spec)
        except OperationFailed as exc:  # a limit here: this tenant's, not the link's fault
            self._counters["graph_frames_dropped"] += 1
            remote_log.warning("limit", "a peer's frame cannot build %r here: %s", key, exc)
            return None
        except UsageError as exc:  # a graph that cannot be
            raise RemoteProtocolError(f"stochastic reduce spec: {exc}") from exc
        if reducer is None:
            self._counters["graph_frames_dropped"] += 1
            if broken:  # before: the sender's node hears it (if it broke now, it was told)
                self._tell(key, (node, frame.dst, frame.src))
        return reducer

    def peer_down(self, node: int, reason: str, now: float) -> None:
        """Frames queued for ``node`` go with its links; its ranks' departure (membership's
        news, :meth:`on_rank_event`) is what fails the reduces that need them."""
        self._frames.drop(node)
        self._landing = {k: r for k, r in self._landing.items() if k[0] != node}
        self._gate.drop_node(node)

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        """A rank that left is lost to its job's reducers at once if its trainer went; one lost
        with its node's links only once membership says it is gone (:meth:`on_suspicion`).
        The job's clients hear ``rank_left`` either way."""
        job, rank = event.entry.job, event.entry.rank
        if isinstance(event, RankLeft):
            if not event.lost:
                self._lose(job, rank, event.reason, now)
                if event.entry.node == self.host.config.node_id:
                    self._left_here(job, rank, event.reason)
            for session in self._sessions.get(job, ()):
                self.host.push(
                    session, "rank_left", {"job": job, "rank": rank, "reason": event.reason}
                )
            if self.membership.job_size(job) is None:  # (its suspects cannot use them)
                self._forget_job(job)
            return
        assert isinstance(event, RankJoined)
        for rank_key in self._reducers_of.of(job):
            self.reducers[rank_key].rejoined(rank)
        self._waiting.retry(job, lambda item: self._try(item, now))
        self._gate.release(job, rank, now)
        if self._split and event.entry.node != self.host.config.node_id:
            for key in [k for k in self._names.of(job) if k in self._split]:
                self._tell(key)  # its node may not know yet (it was not known when it broke)

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        """A rank lost with its node's links: its reducers' partners wait for it
        (suspected), send it again what the reset may have lost (back, the same daemon:
        :meth:`~fabricd.engines.stochastic.notify_ack.Reducer.resume`), or lose it (gone)."""
        match event:
            case RankSuspected(entry=entry):
                for rank_key in self._reducers_of.of(entry.job):
                    self.reducers[rank_key].interrupted(entry.rank)
            case RankBack(entry=entry):
                for rank_key in self._reducers_of.of(entry.job):
                    reducer = self.reducers.get(rank_key)
                    if reducer is not None:
                        self._perform(rank_key[:2], rank_key[2], reducer.resume(entry.rank))
            case RankGone(entry=entry, reason=reason):
                self._lose(entry.job, entry.rank, reason, now)
                if self.membership.job_size(entry.job) is None:
                    self._forget_job(entry.job)

    def _left_here(self, job: str, rank: int, reason: str) -> None:
        """Local rank ``rank`` left: its neighbours dropped it for good, so its reducers end
        too, or a trainer that takes its place would call them and wait for ever.  Under
        ``async`` the reducer goes (nobody dropped it: a new trainer starts it afresh, its
        versions from 1 again, as the neighbours expect); otherwise every later call fails,
        saying why."""
        for rank_key in [k for k in self._reducers_of.of(job) if k[2] == rank]:
            reducer = self.reducers[rank_key]
            if reducer.sync is Sync.ASYNC:
                self._drop(rank_key)
            else:
                reducer.close(
                    f"rank {rank} left job {job!r} ({reason}) after calling stochastic reduce "
                    f"{rank_key[1]!r}, and its {reducer.sync.value} partners dropped it: a "
                    "trainer that takes its place must call the reduce under another name"
                )

    def _lose(self, job: str, rank: int, reason: str, now: float) -> None:
        for rank_key in self._reducers_of.of(job):
            reducer = self.reducers.get(rank_key)
            if reducer is not None:
                self._perform(rank_key[:2], rank_key[2], reducer.lose(rank, reason, now))

    def _forget_job(self, job: str) -> None:
        """No rank of ``job`` is known any more: its reducers go, so that a later job of that
        name starts afresh.  A reducer is a local rank's, and no local rank of the job is left,
        so none is of use even while a remote rank of it is suspected: membership ends those
        suspicions (``RankGone``) at the latest when a claim brings the name back."""
        failure = Failure(code=ErrorCode.PEER_FAILED, message=f"job {job!r} ended")
        for rank_key in self._reducers_of.of(job):
            self._drop(rank_key).close(failure.message)
            self._open.fail(rank_key, failure)
        for key in self._names.of(job):  # a broken reduce was called: its spec is kept too
            self._names.discard(job, key)
            for table in (self._specs, self._graphs, self._broken, self._split):
                table.pop(key, None)
        self._sessions.pop(job, None)

    # -- sending ----------------------------------------------------------------------------
    def _perform(self, key: Key, rank: int, actions: list[Action]) -> None:
        """Carry out ``rank``'s actions, and those of local ranks they reach, in order."""
        work = deque([(rank, actions)])
        while work:
            src, todo = work.popleft()
            for action in todo:
                if isinstance(action, Reduced):
                    self._reply((*key, src), action)
                elif isinstance(action, Failed):
                    failure = Failure(
                        code=ErrorCode.PEER_FAILED, message=action.message, rank=action.rank
                    )
                    self._open.fail((*key, src), failure)
                else:
                    work.extend(self._send(key, src, action))

    def _send(
        self, key: Key, src: int, action: SendUpdate | SendSignal
    ) -> list[tuple[int, list[Action]]]:
        """Send ``action`` from rank ``src``; returns a local receiver's actions."""
        job, name = key
        entry = self.membership.lookup(job, action.dst)
        if entry is None:
            return []  # it left: membership's news loses it
        here = self.host.now()
        if entry.node == self.host.config.node_id:
            target = self.reducers.get((*key, action.dst))
            if target is None:
                target = self._reducer(key, action.dst, self._specs[key])
                if target is None:
                    return []
            if isinstance(action, SendSignal):
                return [(action.dst, target.message(src, action.tag, action.round, here))]
            slot = target.landing(src, action.round, len(action.payload))
            if slot is None:
                return []
            slot[:] = action.payload
            actions = target.landed(src, action.round, here)
            if action.notify:
                actions += target.message(src, UPDATE, action.round, here)
            return [(action.dst, actions)]
        spec = self._specs[key]
        fields: dict[str, Any] = {
            "job": job,
            "name": name,
            "src": src,
            "dst": action.dst,
            "round": action.round,
        }
        if isinstance(action, SendSignal):
            frame: registry.PeerFrame = (
                stochastic_frames.Ack(**fields)
                if action.tag == ACK
                else stochastic_frames.Notify(**fields, tag=action.tag, spec=spec)
            )
            self.host.send(entry.node, frame)
            return []
        edge = (job, name, src, action.dst)
        if not action.notify and self._queued.get(edge):
            self._counters["updates_skipped"] += 1
            return []
        meta = stochastic_frames.Update(**fields, spec=spec).to_meta()
        self._queued[edge] = self._queued.get(edge, 0) + 1
        if self._frames.send(entry.node, meta, action.payload, self._left(edge)):
            self._left(edge)(True)
        if action.notify:
            self.host.send(entry.node, stochastic_frames.Notify(**fields, tag=UPDATE, spec=spec))
        return []

    def _left(self, edge: tuple[str, str, int, int]) -> Callable[[bool], None]:
        def left(_: bool) -> None:
            count = self._queued.get(edge, 0) - 1
            if count > 0:
                self._queued[edge] = count
            else:
                self._queued.pop(edge, None)

        return left

    def _reply(self, rank_key: RankKey, done: Reduced) -> None:
        reducer = self.reducers[rank_key]
        result = {
            "round": done.round,
            "inputs": done.inputs,
            "in_degree": len(reducer.sources),
            "torn": done.torn,
            "stale": done.stale,
        }
        self._open.reply(rank_key, result)

    # -- clients, time, the drain -----------------------------------------------------------
    def client_gone(self, session: ClientSession, now: float) -> None:
        """A trainer that left abandons its open call (its rank's departure, membership's
        news, tells its neighbours)."""
        self._waiting.client_gone(session)
        if session.job is not None and session.job in self._sessions:
            self._sessions[session.job].discard(session)
            if not self._sessions[session.job]:
                del self._sessions[session.job]
        for rank_key, _ in self._open.abandon(session):
            reducer = self.reducers[rank_key]
            # its array goes with the client: the round cannot finish; a new trainer of the
            # rank must use another name (its neighbours' rounds wait for it, or failed)
            reducer.close(f"rank {rank_key[2]}'s trainer left during a call")

    def next_deadline(self) -> float | None:
        waiting, gate = self._waiting.next_deadline(), self._gate.next_deadline()
        return earliest(waiting, gate, self._open.next_stall())

    def on_timer(self, now: float) -> None:
        self._waiting.expire(now)
        self._gate.expire(now)
        self._log_stalls(now)

    def shutdown(self, failure: Failure) -> None:
        for rank_key in [rank_key for rank_key, _ in self._open.items()]:
            self._open.fail(rank_key, failure)
        self._waiting.shutdown(failure)

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Calls open longer than ``stall_after``, oldest first, saying whose NOTIFY, ACK or
        barrier step their round waits for."""
        # (keep reads whose it is: the row's)
        return self._open.stall_rows(now, lambda k: self._stall_row(k, now), keep, limit)

    def _stall_row(self, rank_key: RankKey, now: float) -> Meta | None:
        reducer, call = self.reducers.get(rank_key), self._open.get(rank_key)
        if reducer is None or call is None:
            return None
        owner, node = self.membership.owner(rank_key[0]), self.host.config.node_id
        return stall_row(rank_key, owner, node, reducer, call, now)

    def _log_stalls(self, now: float) -> None:
        """One log line for each call that became stalled, from its stall row."""
        for rank_key, _ in self._open.stalled(now):
            if (row := self._stall_row(rank_key, now)) is not None:
                self._counters["stalls_reported"] += 1
                stall_log.warning("stalled call", "%s", call_line(row))

    # -- status and metrics -----------------------------------------------------------------
    def statistics(self) -> Meta:
        rows = []
        for (job, name, rank), reducer in sorted(self.reducers.items()):
            rows.append(reducer_row(job, self.membership.owner(job), name, rank, reducer))
        return {
            "stochastic_reduces": rows,
            "counters": {
                **self._counters,
                "reduces": sum(row["reduces"] for row in rows),
                "reduce_calls_waiting_for_ranks": len(self._waiting),
            },
        }

    def client_statistics(self, session: ClientSession) -> Meta:
        return {"reduce_calls": self._open.count(session)}

    def metrics(self) -> Iterable[Metric]:
        """Totals over this node's reducers (no job or name labels: their number has no
        bound); per-reducer figures are in the status rows."""
        yield from self.operations.families(pending=len(self._open))
        labels = {"service": self.name}
        stats = [r.statistics() for r in self.reducers.values()]
        yield counter(
            "fabricd_reduce_inputs_used",
            "In-neighbour updates averaged by stochastic reduces on this node",
            [(labels, sum(k * n for s in stats for k, n in enumerate(s.used)))],
        )
        yield counter(
            "fabricd_reduce_inputs_rejected",
            "Updates not averaged: torn or of another round (barrier, async)",
            [(labels, sum(s.torn + s.stale for s in stats))],
        )
        yield counter(
            "fabricd_reduce_update_bytes_sent",
            "Bytes of UPDATE frames sent to peers",
            [(labels, self._counters["update_bytes_sent"])],
        )
        yield gauge(
            "fabricd_reducers",
            "Stochastic reducers (rank, name) on this node",
            [(labels, len(stats))],
        )


def _landing_key(node: int, frame: stochastic_frames.Update) -> tuple[int, str, str, int, int, int]:
    return (node, frame.job, frame.name, frame.src, frame.dst, frame.round)
