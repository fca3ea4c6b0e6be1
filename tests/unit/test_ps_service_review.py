"""Review of the parameter-server service: frames between daemons that never stop, pushes
held for a server that opens late, flushes, failovers to a partner that is away or has no
state, stall rows, a local client's bad fields, and a malformed frame held for a server.

Each daemon's service runs on a fake host whose sends land in one shared queue that the test
delivers in order (a data frame's payload into the buffer the receiving service gives), and
on a fake rank table the test edits, so ranks join and leave as membership would say.  Every
test here shows a bug the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.ps import PSService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.actions import Failure
from fabricd.engines.budget import ByteBudget
from fabricd.engines.membership import (
    RankBack,
    RankEntry,
    RankGone,
    RankJoined,
    RankLeft,
    RankSuspected,
)
from fabricd.engines.ps import routing
from fabricd.engines.ps.consistency import SGD
from fabricd.errors import UsageError
from fabricd.frames import ps as ps_frames
from fabricd.wire import Kind, Meta

if TYPE_CHECKING:
    from fabricd.frames import registry
JOB, NAME, SIZE = "j", "w", 8
#: rank -> node: server 0 and replica 1 on nodes 0 and 1, a worker beside each
NODES = {0: 0, 1: 1, 2: 0, 3: 1}
DATA_FRAMES: dict[Kind, type[ps_frames.Push | ps_frames.Pulled | ps_frames.Replicate]] = {
    Kind.PUSH: ps_frames.Push,
    Kind.PULLED: ps_frames.Pulled,
    Kind.REPLICATE: ps_frames.Replicate,
}


class Table:
    """The rank table membership would hold: ranks join and leave as a test says."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], RankEntry] = {}
        #: ranks lost with their node's links, not back or gone yet (one set for the test's
        #: two nodes: each suspects only the other's ranks)
        self.suspects: set[tuple[str, int]] = set()

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self.entries.get((job, rank))

    def suspected(self, job: str, rank: int) -> bool:
        return (job, rank) in self.suspects

    def suspected_on(self, job: str, rank: int) -> int | None:
        return NODES[rank] if (job, rank) in self.suspects else None

    def job_size(self, job: str) -> int | None:
        return len(NODES) if any(j == job for j, _ in self.entries) else None

    def owner(self, job: str) -> int | None:
        return 1000


def lose_links(service: PSService, table: Table, entry: RankEntry, now: float) -> None:
    """What membership tells a service of a rank whose node's links were reset."""
    table.suspects.add((entry.job, entry.rank))
    service.on_rank_event(RankLeft(entry=entry, reason="links reset", lost=True), now)
    service.on_suspicion(RankSuspected(entry=entry, reason="links reset"), now)


def back(service: PSService, table: Table, entry: RankEntry, now: float) -> None:
    """What membership tells a service of a suspected rank its same daemon announced again."""
    table.suspects.discard((entry.job, entry.rank))
    service.on_suspicion(RankBack(entry=entry), now)
    service.on_rank_event(RankJoined(entry=entry), now)


def gone(service: PSService, table: Table, entry: RankEntry, now: float) -> None:
    """What membership tells a service of a suspected rank not back within down_after."""
    table.suspects.discard((entry.job, entry.rank))
    service.on_suspicion(RankGone(entry=entry, reason="unreachable past down_after"), now)


@dataclass
class Wire:
    """Frames on their way, in the order they were sent: (from, to, frame, payload)."""

    frames: deque[tuple[int, int, registry.PeerFrame, bytes]] = field(default_factory=deque)


class Link:
    """A data link that takes every frame at once, onto the wire."""

    def __init__(self, wire: Wire, src: int, dst: int) -> None:
        self.wire, self.src, self.dst = wire, src, dst

    def send_now(self, kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        frame = DATA_FRAMES[kind].from_meta(meta)
        self.wire.frames.append((self.src, self.dst, frame, b"".join(bytes(p) for p in payload)))
        return True


@dataclass
class FakeHost:
    """What the service asks of the node: sends go onto the wire, answers are recorded."""

    config: Config
    wire: Wire
    budget: ByteBudget = field(default_factory=lambda: ByteBudget(per_uid=1 << 62, per_job=1 << 62))
    draining: bool = False
    answered: dict[int, Any] = field(default_factory=dict)
    pushed: list[tuple[str, Meta]] = field(default_factory=list)
    clock: float = 0.0

    def now(self) -> float:
        return self.clock

    def send(self, node: int, frame: registry.PeerFrame, payload: Any = ()) -> None:
        self.wire.frames.append((self.config.node_id, node, frame, b""))

    def data_link(self, node: int) -> Link | None:
        return Link(self.wire, self.config.node_id, node)

    def reply(self, session: ClientSession, request_id: int, result: Any) -> None:
        self.answered[request_id] = result

    def fail(self, session: ClientSession, request_id: int, failure: Any) -> None:
        self.answered[request_id] = failure

    def push(self, session: ClientSession, event: str, fields: Meta) -> None:
        self.pushed.append((event, fields))

    def rearm(self) -> None:
        pass


class Segment:
    """A client's segment: one float64 array of the model's size."""

    def __init__(self) -> None:
        self.array = np.zeros(SIZE)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.array.data.cast("B")[offset : offset + nbytes]


class Fabric:
    """Two daemons' services (nodes 0 and 1) on one wire and one rank table."""

    def __init__(self, **settings: Any) -> None:
        self.wire = Wire()
        self.table = Table()
        self.hosts: list[FakeHost] = []
        self.services: list[PSService] = []
        for node in (0, 1):
            config = Config(node_id=node, nodes=("127.0.0.1:1", "127.0.0.1:2"), **settings)
            host = FakeHost(config, self.wire)
            self.hosts.append(host)
            self.services.append(PSService(host, membership=self.table))  # type: ignore[arg-type]
        self.sessions: dict[int, ClientSession] = {}
        self.delivered = 0

    def join(self, rank: int) -> ClientSession:
        entry = RankEntry(job=JOB, rank=rank, size=len(NODES), node=NODES[rank])
        self.table.entries[JOB, rank] = entry
        session = ClientSession(
            conn=SimpleNamespace(credentials=SimpleNamespace(uid=1000)),  # type: ignore[arg-type]
            job=JOB,
            rank=rank,
            size=len(NODES),
        )
        session.segments[1] = Segment()  # type: ignore[assignment]
        self.sessions[rank] = session
        for service in self.services:
            service.on_rank_event(RankJoined(entry=entry), 0.0)
        return session

    def leave(self, rank: int) -> None:
        entry = self.table.entries.pop((JOB, rank))
        session = self.sessions.pop(rank)
        self.services[entry.node].client_gone(session, 0.0)
        for service in self.services:
            service.on_rank_event(RankLeft(entry=entry, reason="it left", lost=False), 0.0)

    def request(self, rank: int, rid: int, op: str, **meta: Any) -> Meta | None:
        session = self.sessions[rank]
        service = self.services[NODES[rank]]
        return service.on_request(Request(session=session, id=rid, op=op, meta=meta, fds=[]), 0.0)

    def open(self, rank: int, role: str, rid: int = 1, **spec: Any) -> Meta | None:
        meta = {
            "name": NAME,
            "role": role,
            "size": SIZE,
            "dtype": "float64",
            "servers": [0],
            "replicas": [1],
            "consistency": "bsp",
            "staleness": 0,
            "chunk": 1,
            "scheduling": "arrival",
            "aggregation": False,
            "replication": "chain",
            "divergence_bound": None,
            "distribution": "direct",
            "seed": 0,
            "rule": "sum",
        } | spec
        return self.request(rank, rid, "ps_open", **meta)

    def join_all(self) -> None:
        for rank in NODES:
            self.join(rank)

    def start(self, **spec: Any) -> None:
        """Every rank joins; rank 0 opens the model as its server, 1 as its replica, 2 and 3
        as workers; every frame that causes is delivered."""
        self.join_all()
        for rank, role in enumerate(("server", "replica", "worker", "worker")):
            self.open(rank, role, **spec)
        assert self.deliver(100)

    def array(self, rank: int) -> np.ndarray[Any, Any]:
        return self.sessions[rank].segments[1].array  # type: ignore[attr-defined,no-any-return]

    def call(self, rank: int, rid: int, op: str) -> None:
        """Push rank ``rank``'s array, or pull into it."""
        self.request(rank, rid, op, name=NAME, dtype="float64", nbytes=SIZE * 8, seg=1, off=0)

    def tick(self, now: float) -> None:
        for host, service in zip(self.hosts, self.services, strict=True):
            host.clock = now
            service.on_timer(now)

    def deliver(self, limit: int) -> bool:
        """Deliver frames until none is left (``True``) or ``limit`` were (``False``)."""
        for _ in range(limit):
            if not self.wire.frames:
                return True
            src, dst, frame, payload = self.wire.frames.popleft()
            service = self.services[dst]
            self.delivered += 1
            if frame.KIND in DATA_FRAMES and payload:
                buffer = service.payload_buffer(src, frame, len(payload))  # type: ignore[arg-type]
                if buffer is not None:  # None: refused, read and dropped (as the node does)
                    buffer[:] = payload
                service.on_data(src, frame, len(payload), 0.0)  # type: ignore[arg-type]
            elif frame.KIND in DATA_FRAMES:
                service.on_data(src, frame, 0, 0.0)  # type: ignore[arg-type]
            else:
                service.on_frame(src, frame, 0.0)
        return not self.wire.frames


def test_two_partners_without_the_shards_state_do_not_ask_each_other_for_ever() -> None:
    """Both ranks of a shard went, one after the other (the shard is lost), and came back:
    each opens it without state (its daemon knows the shard was at epoch 2) and asks its
    partner to JOIN.  A rank without state used to answer every JOIN with one of its own, so
    the two daemons sent each other JOINs for ever."""
    fabric = Fabric()
    fabric.start()
    fabric.leave(0)  # the replica takes over at epoch 1
    assert fabric.deliver(100)
    fabric.leave(1)  # nobody is left to serve the shard
    assert fabric.deliver(100)
    fabric.join(0)
    fabric.join(1)
    fabric.open(0, "server")
    fabric.open(1, "replica")
    assert fabric.deliver(100), "the JOINs never stop"
    for service in fabric.services:
        (model,) = service.engine.models.values()
        assert not model.servers[0].has_state


def test_a_push_sent_before_its_server_opened_waits_for_it_past_route_timeout() -> None:
    """A worker pushed before the server's process opened the model, which took longer than
    route_timeout.  The push used to be answered as dropped, so the worker went on to its next
    iteration while the server's BSP coordinator had never seen the first: its next push was a
    protocol error ('skipping 0') and the worker's node's links were closed, again after every
    reset.  Now the push waits for the server, is applied, and the next one too; a pull still
    fails after route_timeout (a pull changes nothing)."""
    fabric = Fabric(route_timeout=5.0)
    fabric.join_all()
    fabric.open(1, "replica")
    fabric.open(2, "worker")
    fabric.open(3, "worker")
    fabric.array(3)[:] = 1.0
    fabric.call(3, 10, "ps_push")
    fabric.call(2, 10, "ps_pull")
    assert fabric.deliver(100)
    fabric.tick(6.0)
    assert fabric.deliver(100)
    assert isinstance(fabric.hosts[0].answered.pop(10), Failure)  # the pull
    assert 10 not in fabric.hosts[1].answered  # the push waits
    fabric.open(0, "server")
    fabric.array(2)[:] = 2.0
    fabric.call(2, 11, "ps_push")
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered.pop(10)["dropped"] == []
    assert fabric.hosts[0].answered.pop(11)["dropped"] == []
    fabric.call(3, 11, "ps_push")
    fabric.call(2, 12, "ps_push")
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered.pop(11)["dropped"] == []
    assert fabric.hosts[0].answered.pop(12)["dropped"] == []
    fabric.call(2, 13, "ps_pull")
    assert fabric.deliver(100)
    assert fabric.hosts[0].answered.pop(13)["version"] == 2
    np.testing.assert_array_equal(fabric.array(2), 6.0)


def test_a_push_waiting_for_its_server_is_dropped_when_its_worker_leaves() -> None:
    """A push that waits for its server holds its payload: it goes when its worker does."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(3, "worker")
    fabric.call(3, 10, "ps_push")
    assert fabric.deliver(100)
    assert fabric.services[0].statistics()["counters"]["ps_early_frames"] == 1
    fabric.leave(3)
    assert fabric.services[0].statistics()["counters"]["ps_early_frames"] == 0


def test_a_flush_is_answered_once_it_is_published() -> None:
    """With a replica, the flush of the lossless publish mode waits for the replica's
    confirmation like any entry; ps_flush used to answer at once, so the pull a script makes
    right after (the bench's final pull) could be answered before the flush was published,
    without the changes it held back."""
    fabric = Fabric()
    fabric.join_all()
    lossless = {"psmp_threshold": 0.5, "lossless_publish": True}
    fabric.array(0)[:] = 100.0
    fabric.open(0, "server", filters=lossless, seg=1, off=0, nbytes=SIZE * 8)
    fabric.open(1, "replica", filters=lossless)
    fabric.open(2, "worker")
    fabric.open(3, "worker")
    assert fabric.deliver(100)
    for rank in (2, 3):
        fabric.array(rank)[:] = 1.0
        fabric.call(rank, 10, "ps_push")
    assert fabric.deliver(100)
    fabric.call(2, 11, "ps_pull")
    assert fabric.deliver(100)
    assert fabric.hosts[0].answered.pop(11)["version"] == 1
    np.testing.assert_array_equal(fabric.array(2), 100.0)  # the changes are held back
    result = fabric.request(0, 20, "ps_flush", name=NAME)
    if result is None:  # answered once published
        assert 20 not in fabric.hosts[0].answered
        assert fabric.deliver(100)
        result = fabric.hosts[0].answered.pop(20)
    assert result == {"flushed": True}
    fabric.call(2, 12, "ps_pull")
    assert fabric.deliver(100)
    assert fabric.hosts[0].answered.pop(12)["version"] == 2
    np.testing.assert_array_equal(fabric.array(2), 102.0)


def test_a_failover_to_a_replica_whose_node_is_briefly_unreachable_waits_for_it() -> None:
    """The server's process ended while node 0 could not reach the replica's node (a link
    reset: the replica's rank is a suspect there, down_after not over).  Node 0 used to fail
    the shard for good ('its partner rank 1 is gone too') although the replica came back a
    moment later and served the shard; its workers' calls failed for ever."""
    fabric = Fabric()
    fabric.start()
    node0, node1 = fabric.services
    # node 0 loses its links to node 1: ranks 1 and 3 are suspects there
    lost = [fabric.table.entries.pop((JOB, rank)) for rank in (1, 3)]
    for entry in lost:
        lose_links(node0, fabric.table, entry, 0.0)
    fabric.call(2, 10, "ps_push")  # BSP: it waits for rank 3's
    # the server's process ends
    server = fabric.table.entries.pop((JOB, 0))
    node0.client_gone(fabric.sessions.pop(0), 0.0)
    node0.on_rank_event(RankLeft(entry=server, reason="it left", lost=False), 0.0)
    fabric.wire.frames = deque(f for f in fabric.wire.frames if f[1] != 1)  # lost with the links
    assert fabric.deliver(100)
    assert 10 not in fabric.hosts[0].answered  # waits for the replica's node
    for entry in lost:  # node 1 is back within down_after: it saw rank 0 leave, and promoted
        fabric.table.entries[JOB, entry.rank] = entry
    node1.on_rank_event(RankLeft(entry=server, reason="it left", lost=False), 0.0)
    for entry in lost:
        back(node0, fabric.table, entry, 1.0)
    fabric.call(3, 10, "ps_push")
    assert fabric.deliver(100)
    assert fabric.hosts[0].answered.pop(10)["epochs"] == [1]
    assert fabric.hosts[1].answered.pop(10)["epochs"] == [1]


def test_a_stall_row_names_the_shards_the_call_waits_for() -> None:
    """A push that two shards' servers must acknowledge, one of which did: its stall row used
    to say it waited for every shard, the one that answered too.  A shard served on the
    row's node says what it waits for itself."""
    fabric = Fabric(stall_after=10.0)
    fabric.join_all()
    spec: dict[str, Any] = {"servers": [0, 1], "replicas": [], "consistency": "async"}
    fabric.open(0, "server", **spec)
    fabric.open(1, "server", **spec)
    fabric.open(2, "worker", **spec)
    assert fabric.deliver(100)
    fabric.call(2, 10, "ps_push")
    fabric.wire.frames.clear()  # shard 1's push is lost (its resend would follow a reset)
    (row,) = fabric.services[0].stalls(11.0)
    assert row["detail"] == "push at clock 1 waits for shard 1 (rank 1)"
    assert row["peer_joined"] is True
    bsp = Fabric(stall_after=10.0)
    bsp.join_all()
    bsp.open(0, "server", replicas=[])
    bsp.open(2, "worker", replicas=[])
    bsp.call(2, 10, "ps_push")
    (row,) = bsp.services[0].stalls(11.0)
    assert row["detail"] == (
        "push at clock 1 waits for shard 0 (rank 0; iteration 0 waits for the pushes of "
        "workers [1, 3])"
    )


def test_a_learning_rate_that_is_not_a_number_is_a_usage_error() -> None:
    """A local client's lr or momentum of another type reached float(): a ValueError or
    TypeError, which the node takes for a bug in the daemon ('internal', a traceback)."""
    fabric = Fabric()
    fabric.join_all()
    for lr, momentum in (("fast", None), ([0.1], None), (0.1, "none"), (True, None)):
        with pytest.raises(UsageError, match="lr and momentum are numbers"):
            fabric.open(0, "server", rule="sgd", lr=lr, momentum=momentum)
    assert fabric.open(0, "server", rule="sgd", lr=1, momentum=0.5) is not None


def test_lr_delay_reaches_the_sgd_rule_and_is_refused_for_another() -> None:
    """``lr_delay``/``lr_t0`` are the sgd rule's (issue 24, item 5): the shard's rule steps
    with them, and a server of another rule, or one sent a value of the wrong type, is
    refused with a UsageError (nothing opened)."""
    fabric = Fabric()
    fabric.join_all()
    for spec, why in (
        ({"rule": "sum", "lr_delay": "adaptive"}, "belong to"),
        ({"rule": "sgd", "lr": 0.1, "lr_delay": 1}, "lr_delay is a name"),
        ({"rule": "sgd", "lr": 0.1, "lr_delay": "fast"}, "one of adaptive"),
        ({"rule": "sgd", "lr": 0.1, "lr_t0": 4.0}, "belongs to lr_delay"),
        ({"rule": "sgd", "lr": 0.1, "lr_delay": "adaptive", "lr_t0": "4"}, "are numbers"),
    ):
        with pytest.raises(UsageError, match=why):
            fabric.open(0, "server", **spec)
    assert fabric.open(0, "server", rule="sgd", lr=0.5, lr_delay="adaptive", lr_t0=4) is not None
    [(_, model)] = fabric.services[0].engine.models.items()
    rule = model.servers[0].rule
    assert isinstance(rule, SGD)
    assert (rule.lr_delay, rule.lr_t0, rule.rate(12, 0)) == ("adaptive", 4.0, 0.25)


def test_a_push_sent_again_while_it_waits_for_its_server_is_held_once() -> None:
    """Each reset of the links sends the push again: a copy held per reset would fill the
    bound on held frames, past which pushes are refused."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(3, "worker", replicas=[], consistency="async")
    fabric.call(3, 10, "ps_push")
    for _ in range(3):
        fabric.services[1].peer_up(0, 0.0)  # sends the push again
        assert fabric.deliver(100)
    assert fabric.services[0].statistics()["counters"]["ps_early_frames"] == 1
    fabric.open(0, "server", replicas=[], consistency="async")
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered.pop(10)["dropped"] == []


def test_a_failover_to_a_replica_without_the_state_fails_the_shard() -> None:
    """The server went before its replica got the shard's state.  The replica's daemon used
    to count a failover, log that the replica served the shard, and move its workers there,
    where a push came back 'dropped' (the state is lost) as if it had been processed; now the
    shard has no server, said once and clearly."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(1, "replica")  # its JOIN finds no server: rank 0 never opens
    fabric.open(3, "worker")
    assert fabric.deliver(100)
    fabric.call(3, 10, "ps_push")  # waits for rank 0 to open
    assert fabric.deliver(100)
    fabric.leave(0)
    assert fabric.deliver(100)
    failure = fabric.hosts[1].answered.pop(10)
    assert isinstance(failure, Failure)
    assert "its partner never got the shard's state" in failure.message
    assert fabric.services[1].statistics()["counters"]["ps_failovers"] == 0


def test_a_failover_to_a_partner_that_is_gone_is_not_counted() -> None:
    fabric = Fabric()
    fabric.join_all()
    fabric.open(0, "server")
    fabric.open(1, "replica")
    fabric.open(2, "worker")
    assert fabric.deliver(100)
    fabric.leave(1)
    fabric.leave(0)
    assert fabric.deliver(100)
    assert fabric.services[0].statistics()["counters"]["ps_failovers"] == 0


def test_a_malformed_frame_held_for_a_server_does_not_fail_its_open() -> None:
    """A peer's push held until its server opened was read only then, in the server's
    ps_open: its protocol error went up from that request, and the node closed the server
    process's connection (the peer that sent it went on).  It is dropped and counted."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(3, "worker", replicas=[], consistency="async")
    spec = fabric.services[1].engine.models[JOB, NAME].spec
    push = ps_frames.Push(
        job=JOB, name=NAME, shard=0, server=0, worker=3, iteration=0, base=0, epoch=0, spec=spec
    )
    fabric.wire.frames.append((1, 0, push, b"not a push"))
    assert fabric.deliver(100)
    dropped = fabric.services[0].statistics()["counters"]["ps_frames_dropped"]
    assert fabric.open(0, "server", replicas=[], consistency="async") is not None
    assert fabric.services[0].statistics()["counters"]["ps_frames_dropped"] == dropped + 1
    fabric.call(3, 10, "ps_push")  # the worker's own push is taken
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered.pop(10)["dropped"] == []


def test_a_partner_back_after_the_primary_gave_it_up_gets_the_state_again() -> None:
    """The replica's node was away longer than down_after: the primary gave its replica up
    and went on alone.  The replica's process lived on and came back with the state it had,
    so it never asks to JOIN; it used to stay behind for good, and a failover then served a
    model without what the primary acknowledged meanwhile (versions back)."""
    fabric = Fabric()
    fabric.start(consistency="async")
    node0, node1 = fabric.services
    lost = [fabric.table.entries.pop((JOB, rank)) for rank in (1, 3)]
    for entry in lost:  # node 0 loses node 1 for longer than down_after
        lose_links(node0, fabric.table, entry, 0.0)
    fabric.tick(node0.host.config.down_after + 1)
    for entry in lost:
        gone(node0, fabric.table, entry, node0.host.config.down_after + 1)
    fabric.wire.frames.clear()
    fabric.array(2)[:] = 1.0
    fabric.call(2, 20, "ps_push")  # acknowledged by the primary alone
    assert fabric.deliver(100)
    assert fabric.hosts[0].answered.pop(20)["versions"] == [1]
    (primary,) = node0.engine.models[JOB, NAME].servers.values()
    (replica,) = node1.engine.models[JOB, NAME].servers.values()
    assert (primary.version, replica.version) == (1, 0)
    for entry in lost:  # node 1 is back: the replica kept its state and does not JOIN
        fabric.table.entries[JOB, entry.rank] = entry
        node0.on_rank_event(RankJoined(entry=entry), 2.0)
    assert fabric.deliver(100)
    assert replica.version == 1  # the primary sent it the state it missed
    fabric.leave(0)  # and a failover now loses nothing
    assert fabric.deliver(100)
    fabric.array(2)[:] = 0.0  # (worker 3 was lost with node 1: rank 2 pulls, afresh)
    fabric.call(2, 21, "ps_pull")
    assert fabric.deliver(100)
    answer = fabric.hosts[0].answered.pop(21)
    assert not isinstance(answer, Failure), answer
    assert (answer["version"], answer["epochs"]) == (1, [1])
    np.testing.assert_array_equal(fabric.array(2), 1.0)


def test_an_entry_that_overtook_its_primarys_announcement_is_sent_again() -> None:
    """After a reset, node 0 learned the replica's rank again first and sent it the entry it
    had not confirmed; the entry overtook rank 0's own announcement at node 1, which dropped
    it (a server's frame counts only from the node its rank is known on).  A replica with the
    state asked for nothing when rank 0 joined, so the primary waited for a confirmation
    that never came, and the push for it (async: no other push moves the shard on)."""
    fabric = Fabric()
    fabric.join_all()
    for rank, role in ((0, "server"), (1, "replica"), (2, "worker"), (3, "worker")):
        fabric.open(rank, role, consistency="async")
    assert fabric.deliver(100)
    node0, node1 = fabric.services
    fabric.array(2)[:] = 1.0
    fabric.call(2, 20, "ps_push")  # entry 1, forwarded to the replica ...
    fabric.wire.frames.clear()  # ... and lost with the links
    for rank in (0, 2):  # node 1 forgets node 0's ranks, node 0 forgets node 1's
        lose_links(node1, fabric.table, fabric.table.entries[JOB, rank], 0.0)
    for rank in (1, 3):
        lose_links(node0, fabric.table, fabric.table.entries[JOB, rank], 0.0)
    node0.peer_up(1, 0.0)
    node1.peer_up(0, 0.0)
    for rank in (1, 3):  # node 1's ranks are announced at node 0 first: entry 1 goes again
        back(node0, fabric.table, fabric.table.entries[JOB, rank], 0.0)
    announced = {rank: fabric.table.entries.pop((JOB, rank)) for rank in (0, 2)}
    assert fabric.deliver(100)  # and reaches node 1 before rank 0's announcement
    assert node1.statistics()["counters"]["ps_frames_dropped"] >= 1
    fabric.table.entries.update({(JOB, r): e for r, e in announced.items()})
    for entry in announced.values():
        back(node1, fabric.table, entry, 0.0)
    assert fabric.deliver(100)
    answer = fabric.hosts[0].answered.pop(20, None)
    assert answer is not None, "the primary waits for a confirmation for ever"
    assert answer["versions"] == [1]
    (replica,) = node1.engine.models[JOB, NAME].servers.values()
    assert replica.version == 1


def test_a_push_past_the_bound_on_held_frames_is_not_answered_as_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon holds frames for models not open yet only so far.  A push past that used to
    be answered as dropped, which the worker took as processed: its next push skipped an
    iteration its server never saw (a protocol error, the worker's node's links closed).  Now
    it is not answered (counted and logged); the worker's push waits, and a pull past the
    bound is refused."""
    monkeypatch.setattr(routing, "MAX_HELD", 0)
    fabric = Fabric()
    fabric.join_all()
    fabric.open(1, "replica")
    fabric.open(3, "worker")
    fabric.array(3)[:] = 1.0
    assert fabric.deliver(100)
    dropped = fabric.services[0].statistics()["counters"]["ps_frames_dropped"]
    fabric.call(3, 10, "ps_push")
    assert fabric.deliver(100)
    assert 10 not in fabric.hosts[1].answered  # not answered: the push is still in flight
    assert fabric.services[0].statistics()["counters"]["ps_frames_dropped"] == dropped + 1
    with pytest.raises(UsageError, match="still open"):
        fabric.call(3, 11, "ps_push")
