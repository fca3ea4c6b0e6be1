"""A stochastic-reduce or parameter-server call pending past ``stall_after`` writes one log
line, from its stall row, however long it waits (issue 27: the ``stall_after`` row said every
stalled operation writes one; only sends and receives did).

Each service runs on its review's fake host, with a time the test chooses; the collective
service's stalls are ``test_collective_stalls.py``'s.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.services import ps_status, stochastic
from fabricd.daemon.stalls import call_line
from tests.unit import test_stochastic_service_review as reduces
from tests.unit.test_ps_service_review import Fabric

if TYPE_CHECKING:
    from collections.abc import Iterator

AFTER = 10.0  #: stall_after
LATER = (AFTER - 0.5, AFTER, AFTER + 1, 3 * AFTER, 1000 * AFTER)  #: timer ticks, in order


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The stall lines written (rate limits fresh: no other test's lines count)."""
    written: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("stalled:"):
                written.append(record.getMessage())

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger("fabricd.stochastic"), logging.getLogger("fabricd.ps")]
    monkeypatch.setattr(stochastic, "stall_log", RateLimitedLog(loggers[0]))
    monkeypatch.setattr(ps_status, "stall_log", RateLimitedLog(loggers[1]))
    for logger in loggers:
        logger.addHandler(handler)
        monkeypatch.setattr(logger, "level", logging.WARNING)
    yield written
    for logger in loggers:
        logger.removeHandler(handler)


def tick(service: Any, times: tuple[float, ...]) -> None:
    """Run the service's timer at each of ``times`` it asks for (as the node does)."""
    for now in times:
        due = service.next_deadline()
        if due is not None and due <= now:
            service.on_timer(now)


def test_a_reduce_waiting_for_a_neighbour_is_logged_once(lines: list[str]) -> None:
    table = reduces.Table()
    svc, _ = reduces.service(table, stall_after=AFTER)
    reduces.join(svc, table, (0, 1))
    session = reduces.client(0, 2)
    session.conn = SimpleNamespace(id=1, credentials=SimpleNamespace(uid=1000))  # type: ignore[assignment]
    reduces.call(svc, session, 1)  # rank 1 (node 1) never sends
    assert svc.next_deadline() == AFTER
    tick(svc, LATER)
    assert svc.next_deadline() is None  # logged: nothing more to do
    (row,) = svc.stalls(AFTER)
    assert row["detail"] == "round 0 of ring graph waits for NOTIFY from rank 1, ACK from rank 1"
    assert lines == [call_line(row)]
    assert lines[0].startswith(
        "stalled: stochastic_reduce (notify-ack) of rank 0, 'model', job 'j', 32 B float64"
    )
    assert svc.statistics()["counters"]["stalls_reported"] == 1


def test_a_reduce_answered_in_time_writes_nothing(lines: list[str]) -> None:
    table = reduces.Table()
    svc, _ = reduces.service(table, stall_after=AFTER)
    reduces.join(svc, table, (0, 1))
    session = reduces.client(0, 2)
    reduces.call(svc, session, 1)
    svc.client_gone(session, 1.0)  # its call goes with it
    tick(svc, LATER)
    assert lines == []
    assert svc.next_deadline() is None


def test_a_push_waiting_for_a_shard_is_logged_once(lines: list[str]) -> None:
    fabric = Fabric(stall_after=AFTER)
    fabric.join_all()
    spec: dict[str, Any] = {"servers": [0, 1], "replicas": [], "consistency": "async"}
    fabric.open(0, "server", **spec)
    fabric.open(1, "server", **spec)
    fabric.open(2, "worker", **spec)
    assert fabric.deliver(100)
    fabric.call(2, 10, "ps_push")
    fabric.wire.frames.clear()  # shard 1's push is lost
    node0 = fabric.services[0]
    tick(node0, LATER)
    (row,) = node0.stalls(AFTER)
    assert lines == [call_line(row)]
    assert "push at clock 1 waits for shard 1 (rank 1)" in lines[0]
    assert node0.statistics()["counters"]["stalls_reported"] == 1


def test_a_pull_answered_in_time_writes_nothing(lines: list[str]) -> None:
    fabric = Fabric(stall_after=AFTER)
    fabric.join_all()
    spec: dict[str, Any] = {"servers": [0, 1], "replicas": [], "consistency": "async"}
    fabric.open(0, "server", **spec)
    fabric.open(1, "server", **spec)
    fabric.open(2, "worker", **spec)
    assert fabric.deliver(100)
    fabric.call(2, 10, "ps_pull")
    assert fabric.deliver(100)
    assert 10 in fabric.hosts[0].answered
    for svc in fabric.services:
        tick(svc, LATER)
    assert lines == []
