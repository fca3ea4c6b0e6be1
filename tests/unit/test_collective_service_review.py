"""Review of the collective service: what it keeps of jobs that are gone, peers' specs, held
frames, the sender task across a link reset, and the work a rank's arrival costs.

The service runs on a fake host (a recorder of what it answers, with data links a test
controls) and a fake rank table the test edits, so ranks join and leave as membership would
say.  Every test here shows a bug the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.collectives import MAX_HELD_FRAMES, CollectiveService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.budget import ByteBudget
from fabricd.engines.collectives.spec import NOTICE
from fabricd.engines.membership import NodeGone, RankEntry, RankJoined, RankLeft
from fabricd.errors import OperationFailed, RemoteProtocolError, TransportError, UsageError
from fabricd.frames import collectives as collectives_frames

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from fabricd.wire import Kind, Meta

JOB, NAME = "j", "grad"


class Table:
    """The rank table membership would hold: ranks join and leave as a test says."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], RankEntry] = {}
        self.owners: dict[str, int] = {}

    def join(self, job: str, size: int, nodes: tuple[int, ...], owner: int) -> list[RankEntry]:
        self.owners[job] = owner
        added = [RankEntry(job=job, rank=r, size=size, node=n) for r, n in enumerate(nodes)]
        for entry in added:
            self.entries[job, entry.rank] = entry
        return added

    def leave(self, job: str) -> list[RankEntry]:
        gone = [e for (j, _), e in self.entries.items() if j == job]
        for entry in gone:
            del self.entries[job, entry.rank]
        self.owners.pop(job, None)
        return gone

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self.entries.get((job, rank))

    def job_size(self, job: str) -> int | None:
        sizes = {e.size for (j, _), e in self.entries.items() if j == job}
        return sizes.pop() if sizes else None

    def owner(self, job: str) -> int | None:
        return self.owners.get(job)

    def known(self, job: str) -> int:
        return sum(1 for j, _ in self.entries if j == job)

    def suspected_on(self, job: str, rank: int) -> int | None:
        return None  # (no test here resets a node's links)


class Link:
    """A data link whose sends a test completes or fails by hand."""

    def __init__(self) -> None:
        self.sent: list[Meta] = []
        self.writable = False  #: send_now takes frames
        self.pending: asyncio.Future[None] | None = None

    def send_now(self, kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        if self.writable:
            self.sent.append(meta)
        return self.writable

    async def send(self, kind: Kind, meta: Meta, payload: list[memoryview]) -> None:
        self.pending = asyncio.get_running_loop().create_future()
        await self.pending
        self.sent.append(meta)


@dataclass
class FakeHost:
    """What the service asks of the node, recorded."""

    config: Config
    budget: ByteBudget = field(default_factory=lambda: ByteBudget(per_uid=1 << 62, per_job=1 << 62))
    draining: bool = False
    links: dict[int, Link] = field(default_factory=dict)
    answered: dict[int, Any] = field(default_factory=dict)
    pushed: list[tuple[str, Meta]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def now(self) -> float:
        return 0.0

    def data_link(self, node: int) -> Link | None:
        return self.links.get(node)

    def reply(self, session: ClientSession, request_id: int, result: Any) -> None:
        self.answered[request_id] = result

    def fail(self, session: ClientSession, request_id: int, failure: Any) -> None:
        self.answered[request_id] = failure

    def push(self, session: ClientSession, event: str, fields: Meta) -> None:
        self.pushed.append((event, fields))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    def rearm(self) -> None:
        pass


class Segment:
    """A client's segment: one float64 array."""

    def __init__(self, values: list[float]) -> None:
        self.array = np.array(values, dtype=np.float64)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.array.data.cast("B")[offset : offset + nbytes]


def service(table: Table, node: int = 0, **settings: Any) -> tuple[CollectiveService, FakeHost]:
    config = Config(node_id=node, nodes=("127.0.0.1:1", "127.0.0.1:2"), **settings)
    host = FakeHost(config)
    return CollectiveService(host, membership=table), host  # type: ignore[arg-type]


def client(rank: int, size: int, values: list[float], job: str = JOB) -> ClientSession:
    session = ClientSession(conn=None, job=job, rank=rank, size=size)  # type: ignore[arg-type]
    session.segments[1] = Segment(values)  # type: ignore[assignment]
    return session


def array(session: ClientSession) -> np.ndarray[Any, Any]:
    return session.segments[1].array  # type: ignore[attr-defined,no-any-return]


def call(svc: CollectiveService, session: ClientSession, rid: int, **fields: Any) -> None:
    nbytes = array(session).nbytes
    meta = {"kind": "allreduce", "name": NAME, "dtype": "float64", "nbytes": nbytes, "seg": 1}
    meta |= {"off": 0, "reduce": "sum", "mode": "sync"} | fields
    svc.on_request(Request(session=session, id=rid, op="collective", meta=meta, fds=[]), 0.0)


def join(svc: CollectiveService, table: Table, size: int, nodes: tuple[int, ...]) -> None:
    for entry in table.join(JOB, size, nodes, owner=1000):
        svc.on_rank_event(RankJoined(entry=entry), 0.0)


def leave(svc: CollectiveService, table: Table) -> None:
    for entry in table.leave(JOB):
        reason = f"rank {entry.rank} of job {JOB!r} disconnected"
        svc.on_rank_event(RankLeft(entry=entry, reason=reason, lost=False), 0.0)


def coll_frame(spec: dict[str, Any], job: str = JOB, name: str = NAME) -> collectives_frames.Coll:
    return collectives_frames.Coll(
        job=job, name=name, round=0, tag=0, off=0, lost=(), base=0, spec=spec
    )


# -- collectives of jobs that are gone --------------------------------------------------------
def test_a_new_job_of_the_same_name_gets_none_of_the_old_jobs_data() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 2, (0, 0))
    old0, old1 = client(0, 2, [0.0, 0.0]), client(1, 2, [7.0, 7.0])
    call(svc, old0, 1, mode="solo")  # one node: round 0 ends in this call
    call(svc, old1, 2, mode="solo")  # behind: the latest result now, its data kept for round 1
    assert host.answered[1]["round"] == 0
    assert host.answered[2]["round"] == 0
    leave(svc, table)  # the whole job ends

    join(svc, table, 2, (0, 0))  # another job of the same name (any owner, later)
    new0 = client(0, 2, [1.0, 1.0])
    call(svc, new0, 3, mode="solo")
    assert np.array_equal(array(new0), [1.0, 1.0]), "the old job's [7, 7] is in this result"


def test_a_restarted_job_can_use_a_name_a_node_failure_broke() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 2, (0, 1))
    first = client(0, 2, [1.0, 2.0])
    call(svc, first, 1)
    svc.peer_down(1, "node 1 went down", 0.0)
    assert host.answered[1].code == "peer_failed"
    leave(svc, table)

    join(svc, table, 2, (0, 1))  # the job restarted on both nodes
    again = client(0, 2, [1.0, 2.0])
    call(svc, again, 2)  # raises UsageError: "... cannot go on (restart the job)"
    assert 2 not in host.answered  # waits for node 1's part, as a first call does


def test_a_rerun_with_another_count_is_not_refused() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 1, (0,))
    call(svc, client(0, 1, [1.0, 2.0]), 1)
    assert host.answered[1]["round"] == 0
    leave(svc, table)

    join(svc, table, 1, (0,))
    call(svc, client(0, 1, [1.0, 2.0, 3.0]), 2)  # UsageError: "... is a sync allreduce of 2"
    assert host.answered[2]["round"] == 0


def test_a_gone_jobs_collectives_are_freed() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, 1, (0,))
    call(svc, client(0, 1, [1.0] * 1024), 1)
    leave(svc, table)
    assert svc.collectives == {}
    assert svc.statistics()["collectives"] == []


def test_a_dead_trainers_sync_gift_is_not_in_a_result() -> None:
    table = Table()
    svc, host = service(table)
    entries = table.join(JOB, 2, (0, 0), owner=1000)
    for entry in entries:
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    dead = client(0, 2, [1.0, 1.0])
    call(svc, dead, 1)  # rank 0 gives [1, 1], waits for rank 1
    # the node's order (services reversed): this service hears of the client first, then
    # membership detaches its rank
    svc.client_gone(dead, 0.0)
    del table.entries[JOB, 0]
    svc.on_rank_event(RankLeft(entry=entries[0], reason="rank 0 died", lost=False), 0.0)
    table.entries[JOB, 0] = entries[0]  # its trainer restarts
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    again, other = client(0, 2, [5.0, 5.0]), client(1, 2, [2.0, 2.0])
    call(svc, again, 2)
    call(svc, other, 3)
    # had membership spoken first, both calls would get [7, 7] in round 0; here rank 1 gets
    # [3, 3] (the dead trainer's [1, 1]) and the restarted rank 0 waits a round behind
    assert np.array_equal(array(other), [7.0, 7.0])
    assert 2 in host.answered


def test_calls_waiting_for_ranks_are_bounded_per_client() -> None:
    table = Table()
    svc, _ = service(table, max_ops_per_client=4)
    entries = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 1]  # rank 1 never comes
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    session = client(0, 2, [1.0])
    for i in range(4):
        call(svc, session, i, name=f"c{i}")  # wait for rank 1
    with pytest.raises(OperationFailed) as refused:
        call(svc, session, 4, name="c4")
    assert refused.value.code == "limit"


def test_a_call_stuck_past_stall_after_is_reported() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 2, (0, 1))
    session = client(0, 2, [1.0, 2.0])
    creds = SimpleNamespace(uid=1000, gid=1000, pid=1, groups=frozenset())
    session.conn = SimpleNamespace(id=1, credentials=creds)  # type: ignore[assignment]
    call(svc, session, 1)  # node 1's rank never calls
    rows = svc.stalls(host.config.stall_after + 1.0)
    assert len(rows) == 1
    assert rows[0]["job"] == JOB
    assert rows[0]["owner"] == 1000
    assert rows[0]["uid"] == 1000


def test_frames_nothing_can_use_are_not_given_a_buffer() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, 2, (0, 1))
    call(svc, client(0, 2, [1.0] * 4), 1)
    svc.peer_down(1, "node 1 went down", 0.0)  # sync: broken
    frame, payload = peer_frame(4)
    assert svc.payload_buffer(1, frame, len(payload)) is None


# -- held frames ------------------------------------------------------------------------------
def test_frames_held_for_a_job_that_left_are_dropped() -> None:
    table = Table()
    svc, _ = service(table)
    spec = {"kind": "barrier", "count": 0, "dtype": "uint8", "op": "sum", "mode": "sync"}
    spec |= {"root": 0, "ring": False}
    entries = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 0]  # rank 0 (here) has not joined yet: node 1's frames wait
    svc.on_rank_event(RankJoined(entry=entries[1]), 0.0)
    for i in range(MAX_HELD_FRAMES):
        svc.on_data(1, coll_frame(spec, name=f"b{i}"), 0, 0.0)
    table.leave(JOB)  # the job is over: nothing can build those collectives any more
    # (membership releases the rank, then tells the services)
    svc.on_rank_event(RankLeft(entry=entries[1], reason="rank 1 left", lost=False), 0.0)
    # another job's frame from the same healthy peer: refused, and node 1's links closed
    svc.on_data(1, coll_frame(spec, job="other"), 0, 0.0)


def peer_frame(count: int) -> tuple[collectives_frames.Coll, bytes]:
    """The first frame node 1 sends node 0 for a sync allreduce of ``count`` float64 of job
    ``j`` (rank 0 on node 0, rank 1 on node 1), made by node 1's own service."""
    table = Table()
    svc, host = service(table, node=1)
    join(svc, table, 2, (0, 1))
    link = host.links[0] = Link()
    link.writable = True
    out: list[tuple[Meta, bytes]] = []

    def send_now(kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        out.append((meta, b"".join(bytes(p) for p in payload)))
        return True

    link.send_now = send_now  # type: ignore[method-assign]
    call(svc, client(1, 2, [1.0] * count), 1)
    meta, payload = out[0]
    frame = collectives_frames.Coll.from_meta(meta)
    return frame, payload


def land(svc: CollectiveService, frame: collectives_frames.Coll, payload: bytes) -> None:
    """Node 1's frame arrives at ``svc`` as the node hands it over: buffer, bytes, data."""
    view = svc.payload_buffer(1, frame, len(payload))
    if view is not None:  # None: read and dropped
        view[:] = payload
    svc.on_data(1, frame, len(payload), 0.0)


def test_a_bad_held_frame_does_not_drop_the_calls_waiting_for_ranks() -> None:
    table = Table()
    svc, host = service(table)
    entries = table.join(JOB, 2, (0, 1), owner=1000)
    table.join("k", 2, (0, 1), owner=1000)
    del table.entries[JOB, 1], table.entries["k", 1]  # node 1's ranks are not known here yet
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    call(svc, client(0, 2, [1.0] * 4), 1)  # waits for rank 1
    call(svc, client(0, 2, [1.0] * 4, job="k"), 2)  # another job's call, waiting too
    frame, payload = peer_frame(8)  # node 1's ranks called with 8 elements: a usage error
    land(svc, frame, payload)  # held
    table.entries[JOB, 1] = entries[1]
    with contextlib.suppress(RemoteProtocolError):  # the node logs it as a bug, goes on
        svc.on_rank_event(RankJoined(entry=entries[1]), 0.0)
    deadline = svc.next_deadline()
    assert deadline is not None, "nothing will ever answer calls 1 and 2"
    svc.on_timer(deadline)
    assert host.answered[1].code == "usage"  # every rank must call a collective alike
    assert host.answered[2].code == "no_such_rank"  # job k's rank 1 never came


def test_held_frames_dropped_at_replay_are_uncounted() -> None:
    table = Table()
    svc, _ = service(table)
    entries = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 0]  # rank 0 (here) has not joined yet: node 1's frames wait
    svc.on_rank_event(RankJoined(entry=entries[1]), 0.0)
    good, bad = peer_frame(4), peer_frame(8)
    for frame, payload in (good, bad, good):
        land(svc, frame, payload)
    table.entries[JOB, 0] = entries[0]
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)  # builds from the first frame
    assert not svc._held
    assert svc._held.bytes == 0  # 32: the third frame's, held by nothing
    assert svc._held.count == 0
    assert svc.statistics()["counters"]["frames_dropped"] == 2


# -- peers' specs -----------------------------------------------------------------------------
def _allreduce_spec(**fields: Any) -> dict[str, Any]:
    spec = {"kind": "allreduce", "count": 4, "dtype": "float64", "op": "sum", "mode": "sync"}
    return spec | {"root": 0, "ring": False} | fields


def test_a_peer_spec_of_absurd_count_is_a_protocol_error() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, 2, (0, 1))
    frame = coll_frame(_allreduce_spec(count=2**62))
    with pytest.raises(RemoteProtocolError):
        svc.payload_buffer(1, frame, 8)


def test_a_peer_broadcast_root_outside_the_job_is_a_protocol_error() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, 2, (0, 1))
    frame = coll_frame(_allreduce_spec(kind="broadcast", root=5))
    with pytest.raises(RemoteProtocolError):
        svc.payload_buffer(1, frame, 32)


# -- the sender task across a link reset ------------------------------------------------------
def test_frames_queued_on_a_new_link_survive_the_old_senders_failure() -> None:
    async def scenario() -> list[Meta]:
        table = Table()
        svc, host = service(table)
        join(svc, table, 2, (0, 1))
        old = host.links[1] = Link()
        call(svc, client(0, 2, [1.0, 2.0]), 1)  # its frame waits behind backpressure
        await asyncio.sleep(0)
        assert old.pending is not None
        svc.peer_down(1, "node 1 reset", 0.0)  # a sync collective breaks: another name next
        new = host.links[1] = Link()
        call(svc, client(0, 2, [1.0, 2.0]), 2, name="again")  # queued on the new link
        old.pending.set_exception(TransportError("link closed while sending"))
        for _ in range(10):
            await asyncio.sleep(0)
            if new.pending is not None and not new.pending.done():
                new.pending.set_result(None)
        for task in host.tasks:
            task.cancel()
        return new.sent

    sent = asyncio.run(scenario())
    assert [m["name"] for m in sent] == ["again"]


# -- held frames behind one still landing -----------------------------------------------------
THREE = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


def solo_frames_after_losing_node_1() -> list[tuple[collectives_frames.Coll, bytes]]:
    """What node 2 sends node 0 for a solo allreduce of 4 float64 of job ``j`` (rank r on
    node r) once it lost node 1: its view says ``lost=[1]``."""
    table = Table()
    host = FakeHost(Config(node_id=2, nodes=THREE))
    svc = CollectiveService(host, membership=table)  # type: ignore[arg-type]
    join(svc, table, 3, (0, 1, 2))
    out: list[tuple[collectives_frames.Coll, bytes]] = []
    for node in (0, 1):
        link = host.links[node] = Link()
        link.writable = True

        def send_now(kind: Kind, meta: Meta, payload: list[memoryview], to: int = node) -> bool:
            if to == 0:
                out.append(
                    (collectives_frames.Coll.from_meta(meta), b"".join(bytes(p) for p in payload))
                )
            return True

        link.send_now = send_now  # type: ignore[method-assign]
    call(svc, client(2, 3, [1.0] * 4), 1, mode="solo")
    out.clear()
    svc.peer_down(1, "node 1 went down", 0.0)
    # not back within down_after: membership counts it gone
    svc.on_suspicion(NodeGone(node=1, reason="node 1 went down"), host.config.down_after)
    # its abandoned round is held until node 0 says it ended no round of the old view (its
    # NOTICE, once it changed view too: ledger.py); then node 2 runs the round again
    assert not [frame for frame, payload in out if payload]
    notice = collectives_frames.Coll(
        job=JOB,
        name=NAME,
        round=0,
        tag=NOTICE,
        off=0,
        lost=(1,),
        base=0,
        spec=svc._specs[JOB, NAME],
        notes=(((), 0, -1),),
    )
    svc.on_data(0, notice, 0, host.config.down_after)
    return [(frame, payload) for frame, payload in out if frame.tag != NOTICE]


def test_frames_held_behind_a_dead_nodes_landing_frame_are_placed() -> None:
    survivors = solo_frames_after_losing_node_1()
    table = Table()
    host = FakeHost(Config(node_id=0, nodes=THREE))
    svc = CollectiveService(host, membership=table)  # type: ignore[arg-type]
    for node in (1, 2):
        host.links[node] = Link()
        host.links[node].writable = True
    entries = table.join(JOB, 3, (0, 1, 2), owner=1000)
    del table.entries[JOB, 0]  # rank 0 (here) joins later: peers' frames are held meanwhile
    for entry in entries[1:]:
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    landing = dataclasses.replace(survivors[-1][0], lost=())
    svc.payload_buffer(1, landing, 40)  # node 1's frame: its bytes are still coming
    for frame, payload in survivors:  # node 2's, whole
        if payload:
            view = svc.payload_buffer(2, frame, len(payload))
            assert view is not None
            view[:] = payload
        svc.on_data(2, frame, len(payload), 0.0)
    table.entries[JOB, 0] = entries[0]
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)  # built; node 1's frame blocks the rest
    svc.peer_down(1, "node 1 went down", 0.0)  # its frame goes: node 2's can be placed now
    call(svc, client(0, 3, [1.0] * 4), 7, mode="solo")
    assert not svc._held
    assert host.answered[7]["round"] == 0


# -- work ------------------------------------------------------------------------------------
class CountingTable(Table):
    """A rank table that counts its lookups, per job."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups: dict[str, int] = {}

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        self.lookups[job] = self.lookups.get(job, 0) + 1
        return super().lookup(job, rank)


def test_a_rank_of_another_job_joining_retries_no_waiting_call() -> None:
    table = CountingTable()
    svc, _ = service(table)
    entries = table.join(JOB, 2, (0, 1), owner=1000)
    del table.entries[JOB, 1]  # rank 1 has not joined: job j's calls wait
    svc.on_rank_event(RankJoined(entry=entries[0]), 0.0)
    session = client(0, 2, [1.0])
    for i in range(100):
        call(svc, session, i, name=f"c{i}")
    table.lookups.clear()
    for entry in table.join("k", 1, (1,), owner=1000):  # another job, on node 1
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    assert table.lookups.get(JOB, 0) == 0  # 200: two lookups for each of j's 100 calls


def test_a_call_unlike_a_collective_built_from_a_peer_fails_there_too() -> None:
    """Node 0 built "grad" from node 1's frame (4 elements); rank 0 then calls it with 8: its
    call fails, and node 1 hears the disagreeing spec, so rank 1's call fails too instead of
    waiting for node 0 for ever (found by the integration test of two disagreeing calls)."""
    table = Table()
    here, host = service(table)
    join(here, table, 2, (0, 1))
    there, far = service(Table(), node=1)
    join(there, there.membership, 2, (0, 1))  # type: ignore[arg-type]
    link = far.links[0] = Link()
    link.writable = True
    sent: list[tuple[Meta, bytes]] = []

    def send_now(kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        sent.append((meta, b"".join(bytes(p) for p in payload)))
        return True

    link.send_now = send_now  # type: ignore[method-assign]
    call(there, client(1, 2, [1.0] * 4), 7)  # rank 1, 4 elements: its frame reaches node 0
    meta, payload = sent[0]
    land(here, collectives_frames.Coll.from_meta(meta), payload)
    back = host.links[1] = Link()
    back.writable = True
    with pytest.raises(UsageError, match="every rank must call it alike"):
        call(here, client(0, 2, [1.0] * 8), 8)
    notices = [collectives_frames.Coll.from_meta(m) for m in back.sent]
    assert notices
    assert notices[0].spec["count"] == 8
    for notice in notices:
        there.on_data(0, notice, 0, 0.0)
    assert far.answered[7].code == "usage"


@pytest.mark.parametrize(
    ("first", "second"),
    [("tree", "auto"), ("auto", "tree"), ("ring", "tree"), ("tree", "doubling"), ("ring", "auto")],
)
def test_a_call_with_another_algorithm_fails_every_rank_naming_both(
    first: str, second: str
) -> None:
    """Rank 1 (node 1) calls "grad" with algorithm ``first``; its frame builds it at node 0;
    rank 0 then asks for ``second``: its call fails with usage naming both, and node 1, told
    by NOTICEs whose specs it must parse (an explicit algorithm keeps its own ring flags),
    fails rank 1's call too."""
    table = Table()
    here, host = service(table)
    join(here, table, 2, (0, 1))
    there, far = service(Table(), node=1)
    join(there, there.membership, 2, (0, 1))  # type: ignore[arg-type]
    link = far.links[0] = Link()
    link.writable = True
    sent: list[tuple[Meta, bytes]] = []

    def send_now(kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        sent.append((meta, b"".join(bytes(p) for p in payload)))
        return True

    link.send_now = send_now  # type: ignore[method-assign]
    call(there, client(1, 2, [1.0] * 4), 7, algorithm=first)
    meta, payload = sent[0]
    assert collectives_frames.Coll.from_meta(meta).spec["algorithm"] == first
    land(here, collectives_frames.Coll.from_meta(meta), payload)
    back = host.links[1] = Link()
    back.writable = True
    with pytest.raises(UsageError, match=f"algorithm {first}.*algorithm {second}"):
        call(here, client(0, 2, [1.0] * 4), 8, algorithm=second)
    notices = [collectives_frames.Coll.from_meta(m) for m in back.sent]
    assert {n.spec["algorithm"] for n in notices} == {first, second}
    for notice in notices:
        there.on_data(0, notice, 0, 0.0)
    assert far.answered[7].code == "usage"
    assert f"algorithm {first}" in far.answered[7].message
    assert f"algorithm {second}" in far.answered[7].message


def test_an_unknown_algorithm_is_refused_before_anything_is_built() -> None:
    table = Table()
    svc, _host = service(table)
    join(svc, table, 2, (0, 1))
    for bad in ("gossip", 3, None):
        with pytest.raises(UsageError, match="algorithm must be one of"):
            call(svc, client(0, 2, [1.0] * 4), 1, algorithm=bad)
    assert not svc.collectives
