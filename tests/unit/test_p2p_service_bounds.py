"""The point-to-point service: bounds on pending operations, and the cost of a client leaving.

The service runs on a fake host (a recorder of what it is told to send and answer), with the
real engine behind it and a rank table both nodes agree on: job ``"j"`` of size 3, ranks 0 and
1 on node 0, rank 2 on node 1.  Work is counted (workcount.py), never timed; memory is measured
with tracemalloc.
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from workcount import WorkCounter

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.p2p import P2PService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.membership import RankEntry
from fabricd.errors import OperationFailed
from fabricd.frames.p2p import Cancel, Data, Done, Eager, Rts

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.frames.registry import PeerFrame
    from fabricd.transports.base import Buffer

JOB = "j"


class Table:
    def __init__(self) -> None:
        self.entries = {
            (JOB, rank): RankEntry(job=JOB, rank=rank, size=3, node=node)
            for rank, node in ((0, 0), (1, 0), (2, 1))
        }

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self.entries.get((job, rank))


@dataclass
class FakeHost:
    """What the service asks of the node, recorded."""

    config: Config
    draining: bool = False
    sent: list[tuple[int, PeerFrame]] = field(default_factory=list)
    answered: list[tuple[int, Any]] = field(default_factory=list)

    def send(self, node: int, frame: PeerFrame, payload: Sequence[Buffer] = ()) -> None:
        self.sent.append((node, frame))

    def reply(self, session: ClientSession, request_id: int, result: Any) -> None:
        self.answered.append((request_id, result))

    def fail(self, session: ClientSession, request_id: int, failure: Any) -> None:
        self.answered.append((request_id, failure))

    def rearm(self) -> None:
        pass

    def now(self) -> float:
        return 0.0  # the service reads it for latencies; nothing here depends on time


class Segment:
    """A client's segment: one byte of it is all any request here names."""

    def __init__(self) -> None:
        self.data = bytearray(1)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.data)[offset : offset + nbytes]


def service(**settings: Any) -> tuple[P2PService, FakeHost]:
    host = FakeHost(Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2"), **settings))
    return P2PService(host, routes=Table()), host  # type: ignore[arg-type]


def client(rank: int) -> ClientSession:
    session = ClientSession(conn=None, job=JOB, rank=rank, size=3)  # type: ignore[arg-type]
    session.segments[1] = Segment()  # type: ignore[assignment]
    return session


def post(svc: P2PService, session: ClientSession, request: int, op: str, peer: int, tag: int):
    meta = {"seg": 1, "off": 0, "nbytes": 1, "dtype": "uint8", "peer": peer, "tag": tag}
    svc.on_request(Request(session=session, id=request, op=op, meta=meta, fds=[]), 0.0)


def post_many(svc: P2PService, session: ClientSession, n: int) -> None:
    """``n`` operations that wait: receives from rank 2 (remote) on one tag, sends to rank 2
    (announced: RTS), receives from rank 1 (here) on tags it never sends."""
    for i in range(n):
        match i % 3:
            case 0:
                post(svc, session, i, "recv", 2, 0)
            case 1:
                post(svc, session, i, "send", 2, 1)
            case _:
                post(svc, session, i, "recv", 1, 1 + i)


# -- bounds -----------------------------------------------------------------------------------
def test_a_client_beyond_max_ops_per_client_is_refused_with_limit() -> None:
    svc, _ = service(max_ops_per_client=3)
    first, second = client(0), client(1)
    post_many(svc, first, 3)
    with pytest.raises(OperationFailed, match="max_ops_per_client") as refused:
        post(svc, first, 99, "recv", 2, 0)
    assert refused.value.code == "limit"
    assert "3 operations pending" in str(refused.value)
    assert svc.statistics()["counters"]["ops_refused_client_limit"] == 1
    post(svc, second, 100, "recv", 2, 0)  # the bound is the client's, not the daemon's
    assert svc.engine.pending() == 4
    svc.client_gone(first, 0.0)
    post_many(svc, first, 3)  # what it held was released


def test_a_job_beyond_max_ops_per_job_is_refused_with_limit() -> None:
    svc, _ = service(max_ops_per_job=4)
    first, second = client(0), client(1)
    post_many(svc, first, 3)
    post(svc, second, 10, "recv", 2, 0)
    with pytest.raises(OperationFailed, match="max_ops_per_job") as refused:
        post(svc, second, 11, "recv", 2, 0)
    assert refused.value.code == "limit"
    assert "job 'j' has 4 operations pending on node 0" in str(refused.value)
    stats = svc.statistics()["counters"]
    assert (stats["ops_refused_job_limit"], stats["ops_refused_client_limit"]) == (1, 0)
    svc.client_gone(first, 0.0)
    post_many(svc, second, 3)  # the job's count went down with the client that left
    assert svc.engine.pending() == 4


def test_operations_that_complete_leave_the_count() -> None:
    svc, host = service(max_ops_per_client=1, eager_limit=0)  # each send has an RTS
    session = client(1)
    for msg in range(1, 6):  # one at a time, each completes before the next: never refused
        post(svc, session, 2 * msg, "recv", 2, 0)
        rts = Rts(msg=msg, job=JOB, src=2, dst=1, tag=0, nbytes=1, dtype="uint8")
        svc.on_frame(1, rts, 0.0)
        data = Data(msg=msg, off=0)
        svc.payload_buffer(1, data, 1)[:] = b"x"
        svc.on_data(1, data, 1, 0.0)
        post(svc, session, 2 * msg + 1, "send", 2, 0)
        [(node, announced)] = host.sent[-1:]
        assert isinstance(announced, Rts)
        svc.on_frame(node, Done(msg=announced.msg), 0.0)
    assert [request for request, _ in host.answered] == list(range(2, 12))
    assert svc.statistics()["counters"]["ops_refused_client_limit"] == 0
    assert svc.engine.pending() == 0


def test_the_counters_are_in_the_statistics_from_the_start() -> None:
    svc, _ = service()
    counters = svc.statistics()["counters"]
    for name in ("ops_refused_client_limit", "ops_refused_job_limit", "rts_refused_peer_limit"):
        assert counters[name] == 0
    for name in ("eager_sent", "eager_no_credit", "eager_pool_full"):
        assert counters[name] == 0
    for name in ("rtr_sent", "rtr_answered", "rtr_dropped"):
        assert counters[name] == 0


def test_the_statistics_show_the_eager_pool_in_use_against_its_bound() -> None:
    """``fabricctl status`` shows these two: the pool is eager_credit for each peer."""
    svc, _ = service(eager_credit=1 << 20)
    stats = svc.statistics()
    assert (stats["eager_pool_bytes"], stats["eager_pool_limit"]) == (0, 1 << 20)  # one peer
    eager = Eager(msg=1, job=JOB, src=2, dst=0, tag=0, nbytes=1, dtype="uint8")
    buffer = svc.payload_buffer(1, eager, 1)
    assert buffer is not None  # no receive posted: the pool holds it
    buffer[:] = b"x"
    svc.on_data(1, eager, 1, 0.0)
    stats = svc.statistics()
    assert (stats["eager_pool_bytes"], stats["unexpected_messages"]) == (1, 1)
    receiver = client(0)
    post(svc, receiver, 1, "recv", 2, 0)  # its receive takes it out of the pool
    stats = svc.statistics()
    assert (stats["eager_pool_bytes"], stats["unexpected_messages"]) == (0, 0)
    assert receiver.segments[1].data == b"x"  # type: ignore[attr-defined]


# -- the cost of leaving ----------------------------------------------------------------------
def test_a_client_leaving_with_n_pending_operations_does_work_in_proportion_to_n(monkeypatch):
    per_op = []
    for n in (1_500, 15_000):
        svc, host = service()
        session = client(0)
        post_many(svc, session, n)
        counter = WorkCounter(monkeypatch)
        with counter.counting():
            svc.client_gone(session, 0.0)
        cancels = [frame for _, frame in host.sent if isinstance(frame, Cancel)]
        assert len(cancels) == n // 3
        assert svc.engine.pending() == 0
        per_op.append(counter.total / n)
    small, large = per_op
    assert large <= 1.3 * small, f"work per operation grew from {small:.1f} to {large:.1f}"


def test_a_client_that_left_with_many_operations_leaves_no_memory_behind() -> None:
    svc, host = service()
    session = client(0)
    post(svc, session, 0, "recv", 2, 0)  # the tables exist before the baseline
    svc.client_gone(session, 0.0)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        post_many(svc, session, 30_000)
        svc.client_gone(session, 0.0)
        host.sent.clear()  # the fake's record of RTS and CANCEL frames, not the daemon's
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert svc.engine.pending() == 0
    assert retained < 128 * 1024
