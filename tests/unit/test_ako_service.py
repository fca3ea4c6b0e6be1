"""The Ako service (fabricd/daemon/services/ako.py) on a fake host and rank table, without
sockets: the review's findings, each with the behaviour it now has (issue 29)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.ako import AkoService
from fabricd.daemon.services.ako_early import MAX_EARLY
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.budget import ByteBudget
from fabricd.engines.membership import (
    RankBack,
    RankEntry,
    RankGone,
    RankJoined,
    RankLeft,
    RankSuspected,
)
from fabricd.errors import ErrorCode, OperationFailed, UsageError
from fabricd.frames import registry
from fabricd.frames.ako import Part, Signal
from fabricd.wire import Kind
from tests.unit.test_collective_service_review import FakeHost, Link, Table

JOB, NAME = "j", "w"


class Segment:
    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def view(self, off: int, nbytes: int) -> memoryview:
        return self.array.data.cast("B")[off : off + nbytes]


@dataclass
class Host(FakeHost):
    t: float = 0.0
    figures: dict[int, Any] = field(default_factory=dict)

    def now(self) -> float:
        return self.t

    def network(self, now: float) -> dict[int, Any]:
        return self.figures

    def send(self, *args: Any, **kw: Any) -> None:
        pass


def service(nodes: tuple[int, ...], **settings: Any) -> tuple[AkoService, Host, Table]:
    table = Table()
    config = Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2"), **settings)
    host = Host(config)
    svc = AkoService(host, membership=table)
    for entry in table.join(JOB, len(nodes), nodes, owner=1000):
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    return svc, host, table


def client(rank: int, size: int, count: int = 8, dtype: str = "float64") -> ClientSession:
    session = ClientSession(conn=None, job=JOB, rank=rank, size=size)  # type: ignore[arg-type]
    session.segments[1] = Segment(np.zeros(count, dtype=dtype))  # type: ignore[assignment]
    session.segments[2] = Segment(np.zeros(count, dtype=dtype))  # type: ignore[assignment]
    return session


def request(svc: AkoService, session: ClientSession, rid: int, op: str, **meta: Any) -> Any:
    return svc.on_request(
        Request(session=session, id=rid, op=op, meta={"name": NAME, **meta}, fds=[]),
        svc.host.now(),
    )


def open_(
    svc: AkoService, session: ClientSession, rid: int, partitions: Any = 1, lr: float = 1.0
) -> None:
    model = session.segments[1].array  # type: ignore[attr-defined]
    request(
        svc,
        session,
        rid,
        "ako_open",
        seg=1,
        off=0,
        nbytes=model.nbytes,
        dtype=model.dtype.name,
        partitions=partitions,
        lr=lr,
        staleness=0,
    )


def step(svc: AkoService, session: ClientSession, rid: int, value: float) -> None:
    gradient = session.segments[2].array  # type: ignore[attr-defined]
    gradient[:] = value
    request(
        svc,
        session,
        rid,
        "ako_step",
        seg=2,
        off=0,
        nbytes=gradient.nbytes,
        dtype=gradient.dtype.name,
    )


def test_a_debt_is_charged_once_and_given_back_when_the_peer_is_back_or_gone() -> None:
    svc, host, table = service((0, 1))
    s0 = client(0, 2, count=1000)
    open_(svc, s0, 1)
    opened = host.budget.held_by_job()[JOB]
    entry = table.lookup(JOB, 1)
    assert entry is not None
    for _ in range(3):
        svc.on_suspicion(RankSuspected(entry=entry, reason="reset"), 0.0)
        svc.on_suspicion(RankSuspected(entry=entry, reason="again"), 0.0)
        assert host.budget.held_by_job()[JOB] == opened + 8 * 1000
        svc.on_suspicion(RankBack(entry=entry), 0.0)
        assert host.budget.held_by_job()[JOB] == opened
    svc.on_suspicion(RankSuspected(entry=entry, reason="reset"), 0.0)
    svc.on_suspicion(RankGone(entry=entry, reason="down_after"), 0.0)
    assert host.budget.held_by_job()[JOB] == opened


def test_a_rank_whose_early_parts_were_dropped_is_refused_its_open() -> None:
    """Its peers' parts waited for it past route_timeout: its model would miss them, so its
    open fails saying so (its flush would otherwise wait for them for ever)."""
    svc, host, _ = service((0, 0), route_timeout=1.0)
    s0, s1 = client(0, 2), client(1, 2)
    open_(svc, s0, 1)
    step(svc, s0, 10, 1.0)
    host.t = 2.0
    svc.on_timer(2.0)
    with pytest.raises(OperationFailed, match="before it opened"):
        open_(svc, s1, 2)
    assert svc.statistics()["counters"]["parts_held_early"] == 0


def test_a_part_that_cannot_fit_the_model_is_given_no_buffer() -> None:
    svc, _, _ = service((0, 1))
    open_(svc, client(0, 2), 1)
    spec = {"n": 2, "size": 8, "dtype": "float64", "lr": 1.0, "staleness": 0}
    part = Part(job=JOB, name=NAME, src=1, dst=0, round=0, lo=0, clock=1, spec=spec, sent=1)
    frame = registry.parse(Kind.PART, part.to_meta())
    assert isinstance(frame, Part)
    assert svc.payload_buffer(1, frame, 1 << 26) is None
    assert svc.payload_buffer(1, frame, 7) is None  # not whole elements
    buffer = svc.payload_buffer(1, frame, 64)
    assert buffer is not None
    assert len(buffer) == 64


def test_ranks_that_open_a_name_two_ways_fail_their_calls_naming_both() -> None:
    svc, host, _ = service((0, 0))
    s0, s1 = client(0, 2), client(1, 2)
    open_(svc, s0, 1, lr=0.1)
    open_(svc, s1, 2, lr=0.2)  # the HELLOs carry the spec: each open meets the other's
    for session, rid in ((s0, 10), (s1, 20)):
        with pytest.raises(UsageError, match="opened in two ways"):
            step(svc, session, rid, 1.0)
    assert svc.statistics()["counters"]["part_frames_dropped"] >= 1
    assert host.answered[1]["ranks"] == 2  # rank 0 opened first: rank 1's daemon answered
    assert "rank 0 as" in host.answered[2].message  # rank 1's open failed, naming both ways
    assert "lr 0.1" in host.answered[2].message


def test_an_auto_repartition_is_charged_or_not_made() -> None:
    """Eq. 3 asks for many more parts on a slow link: the larger window is charged to the
    budget first, and a budget that cannot hold it keeps the old count."""
    svc, host, _ = service((0, 0))
    host.budget = ByteBudget(per_uid=1 << 62, per_job=4_000_000)
    host.figures = {0: SimpleNamespace(up=1e6)}
    s0, s1 = client(0, 2, 70_000, "float32"), client(1, 2, 70_000, "float32")
    open_(svc, s0, 1, partitions="auto")
    open_(svc, s1, 2)
    for t in range(6):
        host.t = t * 1e-4
        step(svc, s0, 10 + t, 0.5)
        step(svc, s1, 20 + t, 0.5)
    exchange = svc.exchanges[(JOB, NAME, 0)]
    assert exchange.partitions == 1  # eq. 3's count would not fit the job's bytes
    assert host.budget.held_by_job()[JOB] <= 4_000_000


def test_a_step_whose_parts_would_overflow_the_dtype_is_refused_and_the_link_kept() -> None:
    svc, _, _ = service((0, 0))
    s0, s1 = client(0, 2, dtype="float16"), client(1, 2, dtype="float16")
    open_(svc, s0, 1, partitions=2, lr=0.5)
    open_(svc, s1, 2, partitions=2, lr=0.5)
    step(svc, s0, 10, 40_000.0)
    step(svc, s1, 20, 0.0)
    with pytest.raises(UsageError, match="past what float16 holds"):
        step(svc, s0, 11, 40_000.0)  # the last two would sum to 80,000
    step(svc, s0, 12, 8.0)
    step(svc, s1, 21, 0.0)
    assert svc.exchanges[(JOB, NAME, 1)].statistics().parts_received == 2


def test_a_step_that_would_take_the_model_past_its_dtype_is_refused() -> None:
    svc, _, _ = service((0, 0))
    s0, s1 = client(0, 2, dtype="float16"), client(1, 2, dtype="float16")
    open_(svc, s0, 1, partitions=1)
    open_(svc, s1, 2, partitions=1)
    step(svc, s0, 10, 40_000.0)  # the model at -40,000
    step(svc, s1, 20, 0.0)
    with pytest.raises(UsageError, match="take the model past"):
        step(svc, s0, 11, 40_000.0)  # -80,000: past float16's 65,504
    assert np.isfinite(s0.segments[1].array).all()  # type: ignore[attr-defined]


def test_a_step_held_at_the_gate_is_a_stall_that_says_what_it_waits_for() -> None:
    svc, host, _ = service((0, 0), stall_after=1.0)
    s0, s1 = client(0, 2), client(1, 2)
    open_(svc, s0, 1)
    open_(svc, s1, 2)
    step(svc, s0, 10, 1.0)
    step(svc, s0, 11, 1.0)  # rank 1 has not stepped: p = 1, staleness 0 holds this one
    assert 11 not in host.answered
    host.t = 2.0
    [row] = svc.stalls(2.0)
    assert row["kind"] == "partial exchange step"
    assert "staleness gate" in row["detail"]
    assert row["pending_for"] == pytest.approx(2.0)
    step(svc, s1, 20, 1.0)
    assert 11 in host.answered
    assert svc.stalls(2.0) == []


# -- a rank that comes back: the reviews' daemon findings -------------------------------------
SPEC3 = {"n": 3, "size": 8, "dtype": "float64", "lr": 1.0, "staleness": 0}


def _signal(src: int, dst: int, sig: Signal, nonce: int, to: int = 0, n: int = 3) -> Part:
    spec = {**SPEC3, "n": n}
    return Part(
        job=JOB,
        name=NAME,
        src=src,
        dst=dst,
        round=None,
        lo=0,
        clock=0,
        spec=spec,
        nonce=nonce,
        to=to,
        signal=sig,
    )


def _deliver(svc: AkoService, node: int, part: Part, payload: bytes = b"") -> None:
    """As the node does: a buffer for a payload, then the frame."""
    frame = registry.parse(Kind.PART, part.to_meta())
    assert isinstance(frame, Part)
    if payload:
        buffer = svc.payload_buffer(node, frame, len(payload))
        if buffer is not None:
            buffer[:] = payload
    svc.on_data(node, frame, len(payload), svc.host.now())


def _leave(svc: AkoService, table: Table, session: ClientSession, rank: int) -> RankEntry:
    """Rank ``rank``'s trainer leaves: its daemon drops it, membership says it left."""
    svc.client_gone(session, 0.0)
    entry = table.entries.pop((JOB, rank))
    svc.on_rank_event(RankLeft(entry=entry, reason="left", lost=False), 0.0)
    return entry


def _come_back(svc: AkoService, table: Table, entry: RankEntry) -> None:
    table.entries[(JOB, entry.rank)] = entry
    svc.on_rank_event(RankJoined(entry=entry), 0.0)


def _steps_answered(svc: AkoService, sessions: list[ClientSession], first: int) -> bool:
    """Each of ``sessions`` steps three times; whether every step was answered."""
    host = svc.host
    assert isinstance(host, Host)
    for i in range(3):
        for k, session in enumerate(sessions):
            rid = first + 10 * i + k
            step(svc, session, rid, 1.0)
            if rid not in host.answered:
                return False
    return True


def test_a_newcomer_that_leaves_before_it_is_taken_back_does_not_hold_the_survivors() -> None:
    """(A1) Its departure cancels its admission: the survivors' flush does not take it back,
    and their steps go on."""
    svc, host, table = service((0, 0, 0))
    s = [client(r, 3) for r in range(3)]
    for r in range(3):
        open_(svc, s[r], r + 1)
    e2 = _leave(svc, table, s[2], 2)
    _come_back(svc, table, e2)
    s2 = client(2, 3)
    open_(svc, s2, 100)
    assert svc.exchanges[(JOB, NAME, 2)].phase == "joining"
    _leave(svc, table, s2, 2)
    request(svc, s[0], 10, "ako_flush")
    request(svc, s[1], 11, "ako_flush")
    assert 10 in host.answered
    assert 11 in host.answered
    assert 2 in svc.exchanges[(JOB, NAME, 0)].gone_peers
    assert _steps_answered(svc, s[:2], 20)


def test_a_part_for_a_rank_that_left_is_dropped_not_held_for_its_next_trainer() -> None:
    """(A8) A part addressed to the incarnation that left lands after a new trainer of the
    rank connected, before it opened: dropped (it was never the new one's), so its open is
    not refused when route_timeout passes."""
    svc, host, table = service((1, 0), route_timeout=1.0)
    s1 = client(1, 2)
    open_(svc, s1, 1)
    old = svc.exchanges[(JOB, NAME, 1)].nonce
    _deliver(svc, 1, _signal(0, 1, Signal.HELLO, 4242, n=2))
    _deliver(svc, 1, _signal(0, 1, Signal.FRESH, 4242, to=old, n=2))
    assert 1 in host.answered
    _come_back(svc, table, _leave(svc, table, s1, 1))
    spec = {**SPEC3, "n": 2}
    part = Part(
        job=JOB, name=NAME, src=0, dst=1, round=0, lo=0, clock=1, spec=spec, sent=1, nonce=4242
    )
    _deliver(svc, 1, dataclasses.replace(part, to=old), np.ones(8).tobytes())
    assert svc.statistics()["counters"]["parts_held_early"] == 0
    host.t = 2.0
    svc.on_timer(2.0)
    open_(svc, client(1, 2), 2)
    assert svc.exchanges[(JOB, NAME, 1)].phase == "hello"


def test_a_newcomer_unreachable_when_taken_back_is_sent_its_model_when_back() -> None:
    """(A2) Suspected between its HELLO and the flush that takes it back: the join SYNC that
    found no route is sent when it is back, and the survivors' steps go on once it steps."""
    svc, host, table = service((0, 0, 1))
    link = Link()
    link.writable = True
    host.links[1] = link
    s = [client(0, 3), client(1, 3)]
    open_(svc, s[0], 1)
    open_(svc, s[1], 2)
    for r in (0, 1):
        _deliver(svc, 1, _signal(2, r, Signal.FRESH, 500, svc.exchanges[(JOB, NAME, r)].nonce))
    e2 = table.entries.pop((JOB, 2))
    svc.on_rank_event(RankLeft(entry=e2, reason="left", lost=False), 0.0)
    request(svc, s[0], 10, "ako_flush")
    request(svc, s[1], 11, "ako_flush")
    _come_back(svc, table, e2)
    for r in (0, 1):
        _deliver(svc, 1, _signal(2, r, Signal.HELLO, 600))
    table.entries.pop((JOB, 2))  # node 1's links reset: rank 2 is suspected
    svc.on_rank_event(RankLeft(entry=e2, reason="reset", lost=True), 0.0)
    svc.on_suspicion(RankSuspected(entry=e2, reason="reset"), 0.0)
    request(svc, s[0], 12, "ako_flush")
    request(svc, s[1], 13, "ako_flush")
    assert 12 in host.answered
    assert 13 in host.answered
    link.sent.clear()
    table.entries[(JOB, 2)] = e2
    svc.on_suspicion(RankBack(entry=e2), 0.0)
    svc.on_rank_event(RankJoined(entry=e2), 0.0)
    [sync] = [m for m in link.sent if m.get("jo")]
    assert sync["to"] == 600


def test_a_held_hello_is_judged_again_when_its_rank_is_announced() -> None:
    """(B2) A node that does not host rank 2 says HELLO as rank 2 before rank 2 is known:
    held, then refused when rank 2 is announced on another node (it once evicted the real
    rank 2)."""
    svc, _, table = service((0, 1))
    table.entries.pop((JOB, 1))
    table.join(JOB, 3, (0, 1), owner=1000)  # (a job of three: rank 2 not announced yet)
    open_(svc, client(0, 3), 1)
    exchange = svc.exchanges[(JOB, NAME, 0)]
    _deliver(svc, 1, _signal(2, 0, Signal.HELLO, 999))  # (node 1 does not host rank 2)
    entry = RankEntry(job=JOB, rank=2, size=3, node=0)
    table.entries[(JOB, 2)] = entry
    svc.on_rank_event(RankJoined(entry=entry), 0.0)
    assert exchange._nonce_of[2] == 0
    assert not exchange.gone_peers


def test_what_a_rank_missed_before_its_open_goes_when_it_leaves() -> None:
    """(B4) Parts dropped for a rank that never opened: the record goes when the rank
    leaves (a later trainer of it may open), and the records are bounded."""
    svc, host, table = service((0, 1), route_timeout=1.0)
    spec = {**SPEC3, "n": 2}
    for i in range(3):
        part = Part(job=JOB, name=f"n{i}", src=1, dst=0, round=0, lo=0, clock=1, spec=spec, sent=1)
        _deliver(svc, 1, part, np.zeros(8).tobytes())
    host.t = 2.0
    svc.on_timer(2.0)
    s0 = client(0, 2)
    _come_back(svc, table, _leave(svc, table, s0, 0))
    open_(svc, client(0, 2), 1)  # not refused
    assert not svc._early._missed
    for i in range(MAX_EARLY + 10):
        svc._early._miss((JOB, f"m{i}", 0), "dropped")
    assert len(svc._early._missed) == MAX_EARLY


def test_an_open_says_hello_again_to_a_peer_that_did_not_answer() -> None:
    """(B6) Rank 1 restarted on node 1 while rank 0's node still had it elsewhere: its
    HELLO was refused.  The open says HELLO again every route_timeout / 4, so once the table
    is right it is answered."""
    svc, host, _ = service((0, 1), route_timeout=4.0)
    link = Link()
    link.writable = True
    host.links[1] = link
    open_(svc, client(0, 2), 1)
    assert [m["sg"] for m in link.sent] == ["hello"]
    link.sent.clear()
    host.t = 1.0
    svc.on_timer(1.0)
    assert [m["sg"] for m in link.sent] == ["hello"]
    _deliver(svc, 1, _signal(1, 0, Signal.FRESH, 7, svc.exchanges[(JOB, NAME, 0)].nonce, n=2))
    assert 1 in host.answered
    link.sent.clear()
    host.t = 2.0
    svc.on_timer(2.0)
    assert not link.sent


def _notice(src: int, dst: int, nonce: int) -> Part:
    """Rank ``src``'s daemon's death notice of its incarnation ``nonce``, for ``dst``."""
    return Part(
        job=JOB,
        name=NAME,
        src=src,
        dst=dst,
        round=None,
        lo=0,
        clock=0,
        spec=SPEC3,
        nonce=nonce,
        dead=((src, nonce),),
    )


def test_a_closed_exchange_sends_every_peer_its_death_notice() -> None:
    """(The two-failure hang) a trainer that leaves: its daemon tells every peer, on its node
    and on others, that its exchange's incarnation died, naming it."""
    svc, host, _ = service((0, 0, 1))
    link = Link()
    link.writable = True
    host.links[1] = link
    s = [client(r, 3) for r in range(2)]
    for r in range(2):
        open_(svc, s[r], r + 1)
    nonce = svc.exchanges[(JOB, NAME, 1)].nonce
    link.sent.clear()
    svc.client_gone(s[1], 0.0)
    assert [(m["src"], m["dst"], m["dd"], "fl" in m) for m in link.sent] == [
        (1, 2, [[1, nonce]], False)
    ]
    ex0 = svc.exchanges[(JOB, NAME, 0)]
    assert ex0.is_dead(1, nonce)
    assert ex0.gone_peers == {1}


def test_a_death_notice_is_taken_from_a_node_whose_rank_already_left() -> None:
    """The notice of incarnation 77 of rank 2 (on node 1) comes after its departure, when the
    table no longer has rank 2 there: taken all the same (it can only kill the incarnation it
    names); one with a payload is not a notice (it waits for rank 2's announcement as any
    part from a rank not known here)."""
    svc, _, table = service((0, 0, 1))
    s = [client(r, 3) for r in range(2)]
    for r in range(2):
        open_(svc, s[r], r + 1)
    entry = table.entries.pop((JOB, 2))
    svc.on_rank_event(RankLeft(entry=entry, reason="left", lost=False), 0.0)
    _deliver(svc, 1, _notice(2, 0, 77))
    _deliver(svc, 1, _notice(2, 1, 78), np.zeros(8).tobytes())
    assert svc.exchanges[(JOB, NAME, 0)].is_dead(2, 77)
    assert not svc.exchanges[(JOB, NAME, 1)].is_dead(2, 78)


def test_a_death_notice_counts_only_from_its_ranks_node() -> None:
    """(Issue 28's rule) node 1 hosts no rank of the job: its notices as rank 2 are refused
    and counted so, whatever they name.  One with another spec breaks nothing (a PART from
    there is refused before its spec is read; a notice's spec is its sender's word alone);
    one naming rank 2's live nonce leaves it live; sixteen with forged nonces do not push a
    real dead one out of rank 0's bounded list of them."""
    svc, _, _ = service((0, 0, 0))
    s = [client(r, 3) for r in range(3)]
    for r in range(3):
        open_(svc, s[r], r + 1)
    ex0 = svc.exchanges[(JOB, NAME, 0)]
    live = svc.exchanges[(JOB, NAME, 2)].nonce
    other = {**SPEC3, "lr": 2.0}
    _deliver(svc, 1, dataclasses.replace(_notice(2, 0, 12345), spec=other))
    _deliver(svc, 1, _notice(2, 0, live))
    _deliver(svc, 0, _notice(2, 0, 1000))  # (a real one, from rank 2's node)
    for k in range(16):
        _deliver(svc, 1, _notice(2, 0, 5000 + k))
    assert not svc._broken
    assert ex0.gone_peers == set()
    assert not ex0.is_dead(2, live)
    assert ex0.is_dead(2, 1000)
    counters = svc.statistics()["counters"]
    assert counters["frames_refused_not_member"] == 18
    assert counters["death_notices"] == 1


def test_a_death_notice_from_its_ranks_node_with_another_spec_is_dropped() -> None:
    """A notice whose spec differs from the exchange's is dropped, not taken as news of an
    exchange opened two ways: no call fails for it."""
    svc, host, _ = service((0, 0, 1))
    s = [client(r, 3) for r in range(2)]
    for r in range(2):
        open_(svc, s[r], r + 1)
    _deliver(svc, 1, dataclasses.replace(_notice(2, 0, 77), spec={**SPEC3, "lr": 2.0}))
    assert not host.answered  # (the opens wait for rank 2's answer; none failed)
    assert not svc._broken
    assert not svc.exchanges[(JOB, NAME, 0)].is_dead(2, 77)
    assert svc.statistics()["counters"]["part_frames_dropped"] == 1


def test_a_departed_ranks_notice_counts_from_its_last_node_for_route_timeout() -> None:
    """Rank 2 (node 1) left: its notices count from node 1 within ``route_timeout`` of the
    departure (they may come after it), never from another node, and once only."""
    svc, host, table = service((0, 0, 1), route_timeout=1.0)
    s = [client(r, 3) for r in range(2)]
    for r in range(2):
        open_(svc, s[r], r + 1)
    entry = table.entries.pop((JOB, 2))
    svc.on_rank_event(RankLeft(entry=entry, reason="left", lost=False), 0.0)
    ex0 = svc.exchanges[(JOB, NAME, 0)]
    _deliver(svc, 0, _notice(2, 0, 76))  # (this node never hosted rank 2: held, then refused)
    _deliver(svc, 1, _notice(2, 0, 77))
    _deliver(svc, 1, _notice(2, 0, 77))  # (known: not counted again)
    host.t = 1.5
    svc.on_timer(1.5)
    _deliver(svc, 1, _notice(2, 0, 78))  # (too late: held for rank 2's arrival, then refused)
    host.t = 3.0
    svc.on_timer(3.0)
    assert ex0.is_dead(2, 77)
    assert not ex0.is_dead(2, 76)
    assert not ex0.is_dead(2, 78)
    counters = svc.statistics()["counters"]
    assert counters["death_notices"] == 1
    assert counters["frames_refused_not_member"] == 2


def test_a_stopping_daemon_sends_its_death_notices_before_its_links_close() -> None:
    """A clean stop closes every exchange here while the links are up (the node cancels its
    tasks, says BYE and closes the links after ``settle``): each peer on another node gets
    its death notice, behind the frames queued for it before, and the open call fails
    ``daemon_stopping``."""

    async def scenario() -> tuple[list[Any], Any, int]:
        svc, host, _ = service((0, 1))
        link = host.links[1] = Link()  # (not writable: frames queue behind backpressure)
        s0 = client(0, 2)
        open_(svc, s0, 1)  # (its HELLO waits in the queue)
        nonce = svc.exchanges[(JOB, NAME, 0)].nonce
        settle = asyncio.ensure_future(svc.settle())
        for _ in range(20):
            await asyncio.sleep(0)
            if link.pending is not None and not link.pending.done():
                link.pending.set_result(None)
        assert settle.done()
        return link.sent, host.answered[1], nonce

    sent, answer, nonce = asyncio.run(scenario())
    assert [(m.get("sg"), m.get("dd")) for m in sent] == [("hello", None), (None, [[0, nonce]])]
    assert answer.code is ErrorCode.DAEMON_STOPPING


def test_a_stopping_daemon_fails_every_open_call_even_one_a_local_notice_would_answer() -> None:
    # review: ranks 0 and 1 on one node, rank 1's steps held at the staleness gate for rank
    # 0; the stop closed rank 0's exchange first, and its notice, handed to rank 1 at once,
    # let rank 1's step succeed (its peer gone) instead of failing daemon_stopping

    async def scenario() -> dict[int, Any]:
        svc, host, _ = service((0, 0))
        s0, s1 = client(0, 2), client(1, 2)
        open_(svc, s0, 1)
        open_(svc, s1, 2)
        step(svc, s1, 3, 1.0)
        step(svc, s1, 4, 1.0)  # (held: rank 0 has not stepped)
        assert 4 not in host.answered
        await svc.settle()
        return dict(host.answered)

    answered = asyncio.run(scenario())
    assert answered[4].code is ErrorCode.DAEMON_STOPPING


def test_an_open_unanswered_within_route_timeout_fails_and_tells_its_peers() -> None:
    """Rank 1 never answers rank 0's HELLO: at ``route_timeout`` the open fails
    ``no_such_rank``, the exchange closes, and rank 1's node is sent its death notice (a peer
    that took the HELLO late must not take the incarnation back)."""
    svc, host, _ = service((0, 1), route_timeout=1.0)
    link = host.links[1] = Link()
    link.writable = True
    open_(svc, client(0, 2), 1)
    nonce = svc.exchanges[(JOB, NAME, 0)].nonce
    host.t = 1.0
    svc.on_timer(1.0)
    assert host.answered[1].code is ErrorCode.NO_SUCH_RANK
    assert not svc.exchanges
    assert [(m["src"], m["dst"], m.get("sg"), m.get("dd")) for m in link.sent] == [
        (0, 1, "hello", None),
        (0, 1, "hello", None),  # (said again at route_timeout / 4)
        (0, 1, None, [[0, nonce]]),
    ]
