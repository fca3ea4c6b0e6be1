"""(d') Each service's cost of a request, a frame and a timer tick, with few and with many calls
waiting.

Issue 28 found a tenant whose 30,000 calls waited for a rank that never joined stall every other
tenant: the collective service counted a session's waiting calls by scanning them all on each
request, and rebuilt a list of every waiting deadline, held frame and collective after every
read batch.  :mod:`bench.framecost` measures the point-to-point engine alone; this one measures
every service the way the node drives it, on a fake node in this process (no sockets, no
codec): two daemons' services (nodes 0 and 1) wired by hand, each with its own membership
engine, frames handed from one to the other as the node would, and ``next_deadline()`` asked
after every input, as the node asks after every read batch.

On node 0 each service holds N calls that wait, as a hostile tenant's would: collective and
stochastic-reduce calls of a job whose rank 1 never joins (each waits for it, with a deadline;
the collective calls over 1,000 names as the finding's, the reduces one per name); parameter-
server pushes of one worker on N models whose server is on node 1, which never answers them
(each open, waiting for its PUSHED: a worker has one call open per model); point-to-point
sends to a rank that never joins (with route deadlines) and receives on tags nobody sends.
Then, for another job:

* **request that waits** (the hostile tenant's own): one more call of the kind that waits,
  from a client of its own that leaves after each batch (not timed);
* **request**: collectives, rank 0 calls a sync allreduce of a job over both nodes (answered
  by the frame below); stochastic, rank 0 calls an async reduce of such a job (answered at
  once, its update sent to rank 1); parameter server, a worker of another model pushes (sent
  to its server on node 1); point to point, rank 0 posts a 64-byte receive from rank 1.
* **frame**: the peer's answer to that request, from node 1: its COLL frame (the round ends,
  the call is answered), its UPDATE, the server's PUSHED (the push is answered), rank 1's
  EAGER message (the receive is answered).  What node 1 does to make it is not timed.
* **tick**: the node's timer: ``next_deadline()``, then ``on_timer()`` at a time when one
  waiting call (or p2p operation) is due, which fails with ``no_such_rank`` (the parameter
  server's only deadlines are early frames': one PULL for a model not opened on node 0,
  refused).  Adding the due call is not timed.

The figures are microseconds per input with N = 10 and N = 100,000 waiting calls (10,000 with
``--quick``), measured in the same run, batches alternating; ratio = many / few.  1x is flat:
per-session counts and deadline heaps make every input O(1) amortised however many wait.
The node's own share (reading, decoding) is :mod:`bench.framecost`'s and the round-trip
benchmarks'.

Run alone: ``python -m bench.servicecost [--quick]``.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import sys
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from bench.report import Column, Progress, Table, fmt_number, median, quiet, run_alone
from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.collectives import CollectiveService
from fabricd.daemon.services.p2p import P2PService
from fabricd.daemon.services.ps import PSService
from fabricd.daemon.services.stochastic import StochasticService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.actions import Broadcast
from fabricd.engines.budget import ByteBudget
from fabricd.engines.membership import Membership, RankJoined
from fabricd.engines.ownership import User
from fabricd.frames import collectives as collectives_frames
from fabricd.frames import p2p as p2p_frames
from fabricd.frames import ps as ps_frames
from fabricd.frames import stochastic as stochastic_frames
from fabricd.frames.membership import Announce
from fabricd.wire import Kind

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.daemon.service import BaseService
    from fabricd.frames import registry
    from fabricd.wire import Meta

#: waiting calls on node 0: the baseline first
WAITING: Final = (10, 100_000)
QUICK_WAITING: Final = (10, 10_000)
TARGET_RATIO: Final = 2.0
ROUTE_TIMEOUT: Final = 1000.0
#: the waiting calls are made then: their deadlines come after every tick's
LATE: Final = 1e9
NODES: Final = ("127.0.0.1:1", "127.0.0.1:2")
UID: Final = 1000
#: settings the runs need, where the code measured has them (an older tree lacks some)
SETTINGS: Final = {
    "route_timeout": ROUTE_TIMEOUT,
    "max_ops_per_client": 1 << 22,
    "max_ops_per_job": 1 << 22,
    "max_waiting_calls_per_uid": 1 << 22,
    "max_unmatched_rts_per_peer": 1 << 22,
    "max_ranks_per_peer": 1 << 20,
    "max_clients": 256,
}
#: data-link frames, by kind, as their receiver parses them
PAYLOAD_FRAMES: Final[dict[Kind, Any]] = {
    Kind.COLL: collectives_frames.Coll,
    Kind.UPDATE: stochastic_frames.Update,
    Kind.PUSH: ps_frames.Push,
    Kind.PULLED: ps_frames.Pulled,
    Kind.REPLICATE: ps_frames.Replicate,
}


class Segment:
    """A client's segment: bytes the services view."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = bytearray(nbytes)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.buffer)[offset : offset + nbytes]


class Link:
    """A data link that takes every frame at once onto its host's outbox."""

    def __init__(self, outbox: list[tuple[int, Any, bytes]], node: int) -> None:
        self.outbox, self.node = outbox, node

    def send_now(self, kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        frame = PAYLOAD_FRAMES[kind].from_meta(meta)
        self.outbox.append((self.node, frame, b"".join(bytes(p) for p in payload)))
        return True

    def unsent(self) -> int:
        return 0


class Host:
    """What a service asks of its node: sends go to an outbox the bench delivers from."""

    def __init__(self, node: int) -> None:
        known = {f.name for f in dataclasses.fields(Config)}
        settings = {k: v for k, v in SETTINGS.items() if k in known}
        self.config = Config(node_id=node, nodes=NODES, **settings)  # type: ignore[arg-type]
        self.budget = ByteBudget(per_uid=1 << 62, per_job=1 << 62)
        self.draining = False
        self.incarnation = 1
        self.clock = 0.0
        self.outbox: list[tuple[int, Any, bytes]] = []  #: (to node, frame, payload)
        self.answered: dict[int, Any] = {}
        self._links = {n: Link(self.outbox, n) for n in range(len(NODES)) if n != node}

    def now(self) -> float:
        return self.clock

    def send(self, node: int, frame: registry.PeerFrame, payload: Any = ()) -> None:
        self.outbox.append((node, frame, b""))

    def broadcast(self, frame: registry.PeerFrame) -> None:
        pass

    def data_link(self, node: int) -> Link | None:
        return self._links.get(node)

    def reply(self, session: ClientSession, request_id: int, result: Any) -> None:
        self.answered[request_id] = result

    def fail(self, session: ClientSession, request_id: int, failure: Any) -> None:
        self.answered[request_id] = failure

    def push(self, session: ClientSession, event: str, fields: Meta) -> None:
        pass

    def rearm(self) -> None:
        pass

    def take(self) -> list[tuple[int, Any, bytes]]:
        sent, self.outbox[:] = list(self.outbox), []
        return sent


def deliver(service: BaseService, src: int, frame: Any, payload: bytes, now: float) -> None:
    """``frame`` from node ``src`` into ``service``, as the node hands it over."""
    if type(frame) in PAYLOAD_FRAMES.values() or isinstance(frame, p2p_frames.Eager):
        if payload:
            buffer = service.payload_buffer(src, frame, len(payload))
            if buffer is not None:
                buffer[:] = payload
        service.on_data(src, frame, len(payload), now)
    else:
        service.on_frame(src, frame, now)


class Pair:
    """Two nodes' membership engines and one service of each, with the ranks the test joins."""

    def __init__(self, build: Callable[[Host, Membership], BaseService]) -> None:
        self.hosts = [Host(node) for node in (0, 1)]
        self.members = [Membership(node, max_ranks_per_peer=1 << 20) for node in (0, 1)]
        self.services = [build(h, m) for h, m in zip(self.hosts, self.members, strict=True)]
        self.requests = itertools.count(1)

    def join(
        self, job: str, rank: int, size: int, node: int, segment: int = 1 << 12
    ) -> ClientSession:
        """Rank ``rank`` of ``job`` attaches to node ``node``; the other node hears of it."""
        for action in self.members[node].attach(job, rank, size, user=User(uid=UID)):
            if isinstance(action, RankJoined):
                self.services[node].on_rank_event(action, 0.0)
            elif isinstance(action, Broadcast) and isinstance(action.frame, Announce):
                for event in self.members[1 - node].on_announce(node, action.frame):
                    if isinstance(event, RankJoined):
                        self.services[1 - node].on_rank_event(event, 0.0)
        return _session(job, rank, size, segment)

    def request(self, node: int, session: ClientSession, op: str, now: float, **meta: Any) -> int:
        rid = next(self.requests)
        request = Request(session=session, id=rid, op=op, meta=meta, fds=[])
        result = self.services[node].on_request(request, now)
        if result is not None:
            self.hosts[node].answered[rid] = result
        self.services[node].next_deadline()
        return rid

    def flush(self, node: int, now: float = 0.0) -> int:
        """Deliver what ``node`` sent to the other node; returns how many frames."""
        sent = self.hosts[node].take()
        for _, frame, payload in sent:
            deliver(self.services[1 - node], node, frame, payload, now)
            self.services[1 - node].next_deadline()
        return len(sent)

    def tick(self, now: float) -> None:
        """The node's timer on node 0 at ``now``: runs the service if something is due."""
        service = self.services[0]
        self.hosts[0].clock = now
        due = service.next_deadline()
        if due is not None and due <= now:
            service.on_timer(now)
        service.next_deadline()


class Case:
    """One service on two nodes, ``waiting`` calls waiting on node 0; what each input does."""

    name = ""
    pair: Pair

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        self.clock = itertools.count(1)
        self.took = 0.0  #: seconds the last frame took
        self.frame_time = 0.0  #: seconds per frame of the last batch

    def request(self) -> None:
        raise NotImplementedError

    def wait(self) -> bool:
        """A request that must wait, as the hostile tenant's do (from a client of its own, so
        that :meth:`drop` can take them away again); ``False``: none here."""
        return False

    def drop(self) -> None:
        """The client of :meth:`wait` leaves: its calls go (not timed)."""

    def frame(self) -> None:
        raise NotImplementedError

    def prepare_tick(self) -> float:
        """Make one call due (not timed); returns when."""
        raise NotImplementedError

    def tick_at(self, now: float) -> None:
        self.pair.tick(now)

    def check(self) -> None:
        """The last tick failed its call (not timed)."""
        last = self.pair.hosts[0].answered.get(self._due)
        _expect(getattr(last, "code", None) == "no_such_rank", f"the tick did not fail it: {last}")

    _due = 0  #: the request the next tick fails


class Collectives(Case):
    """Calls of job ``ghost`` wait for its rank 1; job ``pair`` runs sync allreduces."""

    name = "collectives"

    def __init__(self, waiting: int) -> None:
        super().__init__(waiting)
        self.pair = pair = Pair(lambda h, m: CollectiveService(h, membership=m))  # type: ignore[arg-type]
        self.ghost = pair.join("ghost", 0, 2, node=0)
        for i in range(waiting):
            pair.request(0, self.ghost, "collective", LATE, **_allreduce(f"n{i % 1000}"))
        self.ranks = [pair.join("pair", r, 2, node=r) for r in (0, 1)]
        self._called: int | None = None
        self.waiter = _session("ghost", 0, 2)

    def request(self) -> None:
        self._called = self.pair.request(0, self.ranks[0], "collective", 0.0, **_allreduce("p"))

    def wait(self) -> bool:
        self.pair.request(0, self.waiter, "collective", LATE, **_allreduce("w"))
        return True

    def drop(self) -> None:
        self.pair.services[0].client_gone(self.waiter, 0.0)

    def frame(self) -> None:
        pair = self.pair
        pair.flush(0)  # node 0's frame to node 1 (not timed)
        pair.request(1, self.ranks[1], "collective", 0.0, **_allreduce("p"))
        (_, frame, payload), *rest = pair.hosts[1].take()
        _expect(not rest, f"one frame, not {rest}")
        started = time.perf_counter()
        deliver(pair.services[0], 1, frame, payload, 0.0)
        pair.services[0].next_deadline()
        self.took = time.perf_counter() - started
        _expect(self._called in pair.hosts[0].answered, "the round did not end")

    def prepare_tick(self) -> float:
        at = float(next(self.clock))
        self._due = self.pair.request(0, self.ghost, "collective", at, **_allreduce("t"))
        return at + ROUTE_TIMEOUT


class Stochastic(Case):
    """Reduces of job ``ghost`` wait for its rank 1; job ``pair`` runs async reduces."""

    name = "stochastic"

    def __init__(self, waiting: int) -> None:
        super().__init__(waiting)
        self.pair = pair = Pair(lambda h, m: StochasticService(h, membership=m))  # type: ignore[arg-type]
        self.ghost = pair.join("ghost", 0, 2, node=0)
        for i in range(waiting):
            pair.request(0, self.ghost, "stochastic_reduce", LATE, **_reduce(f"n{i}"))
        self.ranks = [pair.join("pair", r, 2, node=r) for r in (0, 1)]
        self.waiter = _session("ghost", 0, 2)
        self.names = itertools.count()

    def wait(self) -> bool:  # one call of a name at a time: each its own name
        name = f"w{next(self.names)}"
        self.pair.request(0, self.waiter, "stochastic_reduce", LATE, **_reduce(name))
        return True

    def drop(self) -> None:
        self.pair.services[0].client_gone(self.waiter, 0.0)

    def request(self) -> None:
        rid = self.pair.request(0, self.ranks[0], "stochastic_reduce", 0.0, **_reduce("p"))
        _expect(rid in self.pair.hosts[0].answered, "an async reduce was not answered")
        self.pair.hosts[0].take()  # its update to rank 1: not what is measured

    def frame(self) -> None:
        pair = self.pair
        pair.request(1, self.ranks[1], "stochastic_reduce", 0.0, **_reduce("p"))
        (_, frame, payload), *rest = pair.hosts[1].take()
        _expect(not rest, f"one frame, not {rest}")
        started = time.perf_counter()
        deliver(pair.services[0], 1, frame, payload, 0.0)
        pair.services[0].next_deadline()
        self.took = time.perf_counter() - started

    def prepare_tick(self) -> float:
        at = float(next(self.clock))
        self._due = self.pair.request(0, self.ghost, "stochastic_reduce", at, **_reduce("t"))
        return at + ROUTE_TIMEOUT


class ParameterServer(Case):
    """Job ``ghost``'s worker on node 0 has a push open on each of ``waiting`` models whose
    server (node 1) never answers; model ``live`` has a worker on node 0, its server on node
    1."""

    name = "parameter server"

    def __init__(self, waiting: int) -> None:
        super().__init__(waiting)
        self.pair = pair = Pair(lambda h, m: PSService(h, membership=m))  # type: ignore[arg-type]
        pair.join("ghost", 0, 2, node=1)
        worker = pair.join("ghost", 1, 2, node=0, segment=8)
        for i in range(waiting):
            pair.request(0, worker, "ps_open", 0.0, **_model(f"g{i}", 0, role="worker"))
            pair.request(0, worker, "ps_push", 0.0, **_array(f"g{i}", 1))
            pair.hosts[0].take()  # the push goes nowhere: it waits
        self.server = pair.join("live", 0, 2, node=1)
        self.worker = pair.join("live", 1, 2, node=0, segment=8)
        pair.request(1, self.server, "ps_open", 0.0, **_model("live", 0, role="server"))
        pair.request(0, self.worker, "ps_open", 0.0, **_model("live", 0, role="worker"))
        pair.flush(0)
        pair.flush(1)
        self._pushed: int | None = None
        self.request()
        pushes = [f for _, f, _ in pair.hosts[0].outbox if isinstance(f, ps_frames.Push)]
        self.spec = pushes[0].spec  #: what a worker's frame says of its model
        self.frame()

    def request(self) -> None:
        self._pushed = self.pair.request(0, self.worker, "ps_push", 0.0, **_array("live", 1))

    def frame(self) -> None:
        pair = self.pair
        pair.flush(0)  # the PUSH to the server (not timed)
        sent = pair.hosts[1].take()
        started = time.perf_counter()
        for _, frame, payload in sent:
            deliver(pair.services[0], 1, frame, payload, 0.0)
            pair.services[0].next_deadline()
        self.took = (time.perf_counter() - started) / max(len(sent), 1)
        _expect(self._pushed in pair.hosts[0].answered, "the push was not answered")

    def prepare_tick(self) -> float:
        at = float(next(self.clock))
        early = ps_frames.Pull(
            job="live",
            name=f"absent{at}",
            shard=0,
            server=1,
            worker=0,
            clock=0,
            since=0,
            epoch=0,
            spec=self.spec,
        )
        self.pair.hosts[0].clock = at
        deliver(self.pair.services[0], 1, early, b"", at)
        return at + ROUTE_TIMEOUT

    def tick_at(self, now: float) -> None:
        super().tick_at(now)
        self.pair.hosts[0].take()  # the refusal

    def check(self) -> None:
        service = self.pair.services[0]
        _expect(isinstance(service, PSService), "a parameter-server service")
        _expect(not len(service.engine._early), "the early frame did not expire")  # type: ignore[attr-defined]


class PointToPoint(Case):
    """Operations of rank 0 of job ``ghost`` wait for rank 1 (and receives on tags nobody
    sends); job ``pair``'s rank 0 receives 64-byte messages from rank 1, sent eager."""

    name = "p2p"

    def __init__(self, waiting: int) -> None:
        super().__init__(waiting)
        self.pair = pair = Pair(lambda h, m: P2PService(h, routes=m))  # type: ignore[arg-type]
        self.ghost = pair.join("ghost", 0, 2, node=0)
        self.ranks = [pair.join("pair", r, 2, node=r) for r in (0, 1)]
        for i in range(waiting):
            if i % 2:  # a receive on a tag nobody sends, from a rank that is there
                pair.request(0, self.ranks[0], "recv", LATE, **_message(1, 1_000_000 + i))
            else:  # a send to a rank that never joins: a route deadline
                pair.request(0, self.ghost, "send", LATE, **_message(1, i))
        pair.hosts[0].take()
        self.waiter = _session("ghost", 0, 2)
        self.tags = itertools.count(1)
        self.messages = itertools.count(1)
        self._received: int | None = None
        self._tag = 0

    def wait(self) -> bool:
        self.pair.request(0, self.waiter, "send", LATE, **_message(1, 0))
        return True

    def drop(self) -> None:
        self.pair.services[0].client_gone(self.waiter, 0.0)

    def request(self) -> None:
        self._tag = next(self.tags)
        self._received = self.pair.request(0, self.ranks[0], "recv", 0.0, **_message(1, self._tag))
        self.pair.hosts[0].take()  # an RTR, if one goes: not what is measured

    def frame(self) -> None:
        eager = p2p_frames.Eager(
            job="pair",
            src=1,
            dst=0,
            tag=self._tag,
            nbytes=64,
            dtype="uint8",
            msg=next(self.messages),
        )
        pair = self.pair
        started = time.perf_counter()
        deliver(pair.services[0], 1, eager, bytes(64), 0.0)
        pair.services[0].next_deadline()
        self.took = time.perf_counter() - started
        _expect(self._received in pair.hosts[0].answered, "the receive was not answered")
        pair.hosts[0].take()

    def prepare_tick(self) -> float:
        at = float(next(self.clock))
        self._due = self.pair.request(0, self.ghost, "send", at, **_message(1, 0))
        return at + ROUTE_TIMEOUT

    def tick_at(self, now: float) -> None:
        super().tick_at(now)
        self.pair.hosts[0].take()


def _session(job: str, rank: int, size: int, segment: int = 1 << 12) -> ClientSession:
    """A client of rank ``rank`` of ``job``, with one segment."""
    conn = SimpleNamespace(credentials=SimpleNamespace(uid=os.getuid(), pid=0, gid=0))
    session = ClientSession(conn=conn, job=job, rank=rank, size=size)  # type: ignore[arg-type]
    session.segments[1] = Segment(segment)  # type: ignore[assignment]
    return session


def _allreduce(name: str) -> Meta:
    meta = {"kind": "allreduce", "name": name, "dtype": "float64", "nbytes": 64, "seg": 1}
    return meta | {"off": 0, "reduce": "sum", "mode": "sync"}


def _reduce(name: str) -> Meta:
    meta = {"name": name, "graph": "ring", "seed": 0, "sync": "async", "dtype": "float64"}
    return meta | {"nbytes": 64, "seg": 1, "off": 0}


def _model(name: str, server: int, *, role: str) -> Meta:
    spec = {"name": name, "role": role, "size": 1, "dtype": "float64", "servers": [server]}
    spec |= {"replicas": [], "consistency": "async", "staleness": 0, "chunk": 1, "seed": 0}
    return spec | {"rule": "sum"}


def _array(name: str, count: int) -> Meta:
    return {"name": name, "dtype": "float64", "nbytes": 8 * count, "seg": 1, "off": 0}


def _message(peer: int, tag: int) -> Meta:
    return {"peer": peer, "tag": tag, "dtype": "uint8", "nbytes": 64, "seg": 1, "off": 0}


def _expect(holds: bool, what: str) -> None:
    if not holds:
        raise RuntimeError(what)


CASES: Final = (Collectives, Stochastic, ParameterServer, PointToPoint)


def _time_requests(case: Case, calls: int) -> float:
    """Seconds per request: each request's answer comes with the next frame, so a request is
    timed alone, then its frame is delivered (timed apart)."""
    total = 0.0
    frames = 0.0
    for _ in range(calls):
        started = time.perf_counter()
        case.request()
        total += time.perf_counter() - started
        case.frame()
        frames += case.took
    case.frame_time = frames / calls
    return total / calls


def _time_waits(case: Case, calls: int) -> float | None:
    """Seconds per request that must wait (then its client leaves, not timed)."""
    started = time.perf_counter()
    for _ in range(calls):
        if not case.wait():
            return None
    took = time.perf_counter() - started
    case.drop()
    return took / calls


def _time_ticks(case: Case, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        at = case.prepare_tick()
        started = time.perf_counter()
        case.tick_at(at)
        total += time.perf_counter() - started
        case.check()
    return total / calls


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Time each service's request, frame and tick with each number of waiting calls."""
    waiting = QUICK_WAITING if quick else WAITING
    samples, calls = (5, 100) if quick else (11, 300)
    table = Table(
        name="servicecost",
        title="(d') each service's cost of a request, a frame and a timer tick, microseconds",
        columns=[
            Column("few", f"{waiting[0]} waiting"),
            Column("many", f"{waiting[1]:,} waiting"),
        ],
        ratio=f"time with {waiting[1]:,} waiting / time with {waiting[0]} (1x = flat)",
        target=f"every ratio <= {TARGET_RATIO:g}x",
        settings={"samples": samples, "calls": calls, "waiting": list(waiting)},
    )
    met = True
    for kind in CASES:
        progress(f"{kind.name}: making {' and '.join(map(str, waiting))} calls wait")
        cases = [kind(n) for n in waiting]
        gc.collect()
        gc.freeze()  # as the daemon does at start: a full collection's pause is not measured
        figures: dict[str, list[list[float]]] = {
            what: [[] for _ in cases] for what in ("request", "request that waits", "frame", "tick")
        }
        for case in cases:  # warm-up
            _time_requests(case, calls // 10 + 1)
            _time_waits(case, calls // 10 + 1)
            _time_ticks(case, calls // 10 + 1)
        for _ in range(samples):  # alternate, so every case sees the same background load
            for i, case in enumerate(cases):
                figures["request"][i].append(_time_requests(case, calls))
                figures["frame"][i].append(case.frame_time)
                if (waits := _time_waits(case, calls)) is not None:
                    figures["request that waits"][i].append(waits)
                figures["tick"][i].append(_time_ticks(case, calls))
        for what, times in figures.items():
            if not times[0]:
                continue
            few, many = (median(t) for t in times)
            label = f"{kind.name}: {what}"
            table.add(label, 0, many / few, few=few * 1e6, many=many * 1e6)
            met = met and many / few <= TARGET_RATIO
            progress(
                f"{label}: {fmt_number(few * 1e6)} us, {fmt_number(many * 1e6)} us with "
                f"{waiting[1]:,} waiting, ratio {many / few:.2f}x"
            )
        del cases
        gc.unfreeze()
    table.target_met = met
    table.notes.append(
        "request, frame, tick: the node's next_deadline() after each is included; waiting: "
        "collective calls over 1,000 names and reduces of a job whose rank 1 never joins, "
        "pushes of a worker on as many models whose server never answers, p2p sends to a "
        "rank that never joins and receives on tags nobody sends"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("servicecost", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
