"""Stochastic reduce frames only from the node their sender rank is on; any single hostile or
disagreeing frame leaves no member's call hanging (issue 28, item 2).

Real :class:`StochasticService` instances, one per node, joined by a fake wire that keeps each
link's order (control and data links apart, as TCP does) and delivers the links' frames in an
order hypothesis draws.  Each rank calls a notify-ack or barrier reduce twice, the second call
once the first is answered, as a training loop does.  Into that traffic goes one frame a member
would not send: from a node that hosts no rank of the job, as a rank of another node or of
none (refused, counted, nothing built: the calls complete as if it never came), or from a
member with another spec (every member breaks the reduce, and every call not already complete
fails with ``usage`` naming both specs).  Either way, once the wire is quiet every call of every
rank is answered.  Before, the disagreement broke the reduce only on the node that saw it, and
the others' second calls waited for ever; a stranger's frame as a rank of no node built a
reducer, or broke it with its spec.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.stochastic import StochasticService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.actions import Failure
from fabricd.engines.membership import RankEntry, RankJoined
from fabricd.engines.stochastic.notify_ack import BARRIER, UPDATE
from fabricd.errors import FabricError
from fabricd.frames import stochastic as stochastic_frames
from tests.unit.test_collective_service_review import FakeHost, Link, Segment, Table

if TYPE_CHECKING:
    from fabricd.frames import registry
    from fabricd.wire import Kind, Meta

JOB, NAME = "j", "model"
NODES = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4")
STRANGER = 3  #: a node of the fabric that hosts no rank of the job
COUNT = 4  #: float64 elements every rank calls with
CALLS = 2  #: calls each rank makes, one after the other


class Wire:
    """Frames sent, per link (from, to, "control" or "data"), each link in order."""

    def __init__(self) -> None:
        self.links: dict[tuple[int, int, str], deque[Any]] = {}

    def put(self, src: int, dst: int, channel: str, item: Any, *, first: bool = False) -> None:
        queue = self.links.setdefault((src, dst, channel), deque())
        if first:
            queue.appendleft(item)
        else:
            queue.append(item)

    def take(self, pick: int) -> tuple[tuple[int, int, str], Any] | None:
        busy = sorted(k for k, q in self.links.items() if q)
        if not busy:
            return None
        key = busy[pick % len(busy)]
        return key, self.links[key].popleft()


@dataclass
class Host(FakeHost):
    """The fake host, its control frames and data links on the wire."""

    wire: Wire = field(default_factory=Wire)

    def send(self, node: int, frame: registry.PeerFrame, payload: Any = ()) -> None:
        self.wire.put(self.config.node_id, node, "control", frame)


def data_link(wire: Wire, src: int, dst: int) -> Link:
    link = Link()
    link.writable = True

    def send_now(kind: Kind, meta: Meta, payload: list[memoryview]) -> bool:
        wire.put(src, dst, "data", (meta, b"".join(bytes(p) for p in payload)))
        return True

    link.send_now = send_now  # type: ignore[method-assign]
    return link


def spec(members: int, sync: str, count: int) -> dict[str, Any]:
    fields = {"graph": "ring", "n": members, "degree": None, "seed": 0, "edges": None}
    return fields | {"sync": sync, "dtype": "float64", "nbytes": 8 * count}


@dataclass
class Rank:
    session: ClientSession
    answers: list[Any] = field(default_factory=list)  #: each call's result or failure

    @property
    def done(self) -> bool:
        return len(self.answers) == CALLS or any(isinstance(a, Failure) for a in self.answers)


class Fabric:
    """``members`` nodes with a rank each (rank r on node r), and the stranger's node.  Each
    node has its own rank table: with ``announce``, a node knows the other nodes' ranks only
    once their ANNOUNCE, on the control link, is delivered (an UPDATE on the data link may
    come first); without, every node knows every rank from the start."""

    def __init__(self, members: int, sync: str, *, announce: bool = False) -> None:
        self.wire, self.sync = Wire(), sync
        self.tables = [Table() for _ in NODES]
        self.hosts = [
            Host(Config(node_id=n, nodes=NODES), wire=self.wire) for n in range(len(NODES))
        ]
        for node, host in enumerate(self.hosts):
            for peer in range(len(NODES)):
                if peer != node:
                    host.links[peer] = data_link(self.wire, node, peer)
        self.services = [
            StochasticService(host, membership=table)  # type: ignore[arg-type]
            for host, table in zip(self.hosts, self.tables, strict=True)
        ]
        for entry in Table().join(JOB, members, tuple(range(members)), owner=1000):
            for node in range(len(NODES)):
                if node == entry.node or not announce:
                    self.joined(node, entry)
                else:
                    self.wire.put(entry.node, node, "control", entry)
        self.ranks = []
        for rank in range(members):
            session = ClientSession(conn=None, job=JOB, rank=rank, size=members)  # type: ignore[arg-type]
            session.segments[1] = Segment([float(rank + 1)] * COUNT)  # type: ignore[assignment]
            self.ranks.append(Rank(session))

    def joined(self, node: int, entry: RankEntry) -> None:
        """What membership tells node ``node`` of a rank announced to it."""
        table = self.tables[node]
        table.entries[entry.job, entry.rank] = entry
        table.owners[entry.job] = 1000
        self.services[node].on_rank_event(RankJoined(entry=entry), 0.0)

    def call(self, rank: int) -> None:
        """Rank ``rank``'s next call (a refusal is its answer)."""
        state = self.ranks[rank]
        rid = 100 * rank + len(state.answers)
        meta = {"name": NAME, "seg": 1, "off": 0, "nbytes": 8 * COUNT, "dtype": "float64"}
        meta |= {"graph": "ring", "degree": None, "seed": 0, "edges": None, "sync": self.sync}
        request = Request(session=state.session, id=rid, op="stochastic_reduce", meta=meta, fds=[])
        try:
            self.services[rank].on_request(request, 0.0)
        except FabricError as exc:
            self.hosts[rank].answered[rid] = Failure(code=exc.code, message=str(exc))

    def collect(self) -> bool:
        """Record answers; a rank answered well calls again.  ``True``: something changed."""
        changed = False
        for rank, state in enumerate(self.ranks):
            rid = 100 * rank + len(state.answers)
            answer = self.hosts[rank].answered.pop(rid, None)
            if answer is not None:
                state.answers.append(answer)
                changed = True
                if not state.done:
                    self.call(rank)
        return changed

    def deliver(self, src: int, dst: int, channel: str, item: Any) -> None:
        svc = self.services[dst]
        if isinstance(item, RankEntry):
            self.joined(dst, item)
            return
        if channel == "control":
            svc.on_frame(src, item, 0.0)
            return
        meta, data = item
        frame = stochastic_frames.Update.from_meta(meta)
        view = svc.payload_buffer(src, frame, len(data))
        if view is not None:  # None: read and dropped, as the node does
            view[:] = data
        svc.on_data(src, frame, len(data), 0.0)


@settings(max_examples=200, deadline=None)
@given(
    members=st.integers(2, 3),
    sync=st.sampled_from(["notify-ack", "barrier"]),
    announce=st.booleans(),
    hostile=st.sampled_from(["stranger", "disagreeing", "none"]),
    as_rank=st.sampled_from(["in-neighbour", "outside the job"]),
    kind=st.sampled_from(["UPDATE", "NOTIFY"]),
    count=st.integers(1, 6),
    at=st.integers(0, 30),
    order=st.lists(st.integers(0, 1000), max_size=300),
)
def test_one_bad_frame_leaves_no_call_hanging(
    members: int,
    sync: str,
    announce: bool,
    hostile: str,
    as_rank: str,
    kind: str,
    count: int,
    at: int,
    order: list[int],
) -> None:
    fabric = Fabric(members, sync, announce=announce)
    for rank in range(members):
        fabric.call(rank)
    src_rank = members - 1  # rank 0's in-neighbour on the ring, on node members - 1
    if hostile == "stranger" and as_rank == "outside the job":
        src_rank = members + 4
    sender = STRANGER if hostile == "stranger" else members - 1
    bad_count = count if hostile == "stranger" or count != COUNT else COUNT + 1
    fields = {"job": JOB, "name": NAME, "src": src_rank, "dst": 0, "round": 0}
    bad_spec = spec(members, sync, bad_count)
    if kind == "NOTIFY":
        # a NOTIFY the schedule takes (an update's, or the barrier's first step): only its
        # spec is bad (one no schedule takes is a protocol error, which resets the link)
        tag = UPDATE if sync == "notify-ack" else BARRIER
        bad: tuple[str, Any] = (
            "control",
            stochastic_frames.Notify(**fields, tag=tag, spec=bad_spec),
        )
    else:
        update = stochastic_frames.Update(**fields, spec=bad_spec)
        bad = ("data", (update.to_meta(), b"\0" * (8 * bad_count + 16)))
    picks = iter(order)
    for step in range(20_000):
        if step == at and hostile != "none":
            # ahead of what the member's link holds: it may be the first thing node 0 hears
            fabric.wire.put(sender, 0, bad[0], bad[1], first=True)
        fabric.collect()
        taken = fabric.wire.take(next(picks, 0))
        if taken is None:
            if step < at and hostile != "none":
                continue  # (quiet before the bad frame: it still comes)
            if not fabric.collect():
                break
            continue
        (src, dst, channel), item = taken
        fabric.deliver(src, dst, channel, item)
    else:
        raise AssertionError("the wire never went quiet")
    answers = {rank: state.answers for rank, state in enumerate(fabric.ranks)}
    assert all(state.done for state in fabric.ranks), f"a call hangs: {answers}"
    failures = [a for state in fabric.ranks for a in state.answers if isinstance(a, Failure)]
    if hostile == "disagreeing":  # (calls complete before it came stay so)
        for failure in failures:
            assert failure.code == "usage", failure
            assert f"{8 * COUNT} B of float64" in failure.message, failure
            assert f"{8 * bad_count} B of float64" in failure.message, failure
        for rank in range(members):  # and every member knows: no later call waits for another
            assert (JOB, NAME) in fabric.services[rank]._broken, rank
    else:  # a stranger's frame changes nothing: every call of every rank completes
        assert not failures, answers
        if hostile == "stranger":
            counters = fabric.services[0].statistics()["counters"]
            assert counters["frames_refused_not_member"] == 1
            assert {k[2] for k in fabric.services[0].reducers} == {0}  # nothing built for it
            assert not fabric.services[STRANGER].reducers
        if sync == "notify-ack":  # each round averages the rank with its in-neighbour
            first = [state.answers[0] for state in fabric.ranks]
            assert all(a["inputs"] == 1 for a in first), first
            x = np.arange(1.0, members + 1)
            for _ in range(CALLS):
                x = (x + np.roll(x, 1)) / 2
            for rank, state in enumerate(fabric.ranks):
                values = state.session.segments[1].array  # type: ignore[attr-defined]
                np.testing.assert_allclose(values, x[rank])
