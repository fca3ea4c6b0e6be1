"""The Ako service (fabricd/daemon/services/ako.py) on a fake host and rank table, without
sockets: the review's findings, each with the behaviour it now has (issue 29)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.ako import AkoService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.budget import ByteBudget
from fabricd.engines.membership import RankBack, RankGone, RankJoined, RankSuspected
from fabricd.errors import OperationFailed, UsageError
from fabricd.frames import registry
from fabricd.frames.ako import Part
from fabricd.wire import Kind
from tests.unit.test_collective_service_review import FakeHost, Table

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
