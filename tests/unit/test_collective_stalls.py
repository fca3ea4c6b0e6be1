"""A collective call pending past ``stall_after`` writes one log line, from its stall row
(issue 23, item 4; issue 27: a collective pending 40 s wrote none).

The collective service on a fake host with a time the test chooses: two ranks that call
different names each get a row and exactly one line, naming the name the other rank waits in
(on one node) or what came from the other node (on two); a call answered in time, or whose
client left, writes nothing.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.services import collectives
from fabricd.daemon.services.collectives import CollectiveService
from fabricd.daemon.stalls import call_line
from fabricd.engines.membership import RankJoined
from tests.unit.test_collective_service_review import (
    JOB,
    NAME,
    FakeHost,
    Table,
    call,
    client,
    join,
    service,
)
from tests.unit.test_members_only import NODES, Wire, deliver

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.daemon.sessions import ClientSession
    from fabricd.wire import Meta

AFTER = 2.0  #: stall_after


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The stall lines the service writes (its rate limit fresh: no other test's lines count)."""
    monkeypatch.setattr(collectives, "stall_log", RateLimitedLog(collectives.log))
    caplog.set_level(logging.WARNING, logger="fabricd.collectives")
    written: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("stalled:"):
                written.append(record.getMessage())

    handler = Keep()
    collectives.log.addHandler(handler)
    yield written
    collectives.log.removeHandler(handler)


def rank(number: int, size: int = 2) -> ClientSession:
    session = client(number, size, [1.0, 2.0])
    credentials = SimpleNamespace(uid=1000, gid=1000, pid=1, groups=frozenset())
    session.conn = SimpleNamespace(id=number, credentials=credentials)  # type: ignore[assignment]
    return session


def tick_until(svc: CollectiveService, end: float) -> None:
    """Run the service's timer whenever it asks, up to ``end`` (as the node does)."""
    for _ in range(100):
        due = svc.next_deadline()
        if due is None or due > end:
            return
        svc.on_timer(due)
    raise AssertionError("the timer kept asking to run")


def test_two_ranks_on_one_node_calling_different_names_are_each_logged_once(
    lines: list[str],
) -> None:
    table = Table()
    svc, _ = service(table, stall_after=AFTER)
    join(svc, table, 2, (0, 0))
    call(svc, rank(0), 1)  # 'grad'
    call(svc, rank(1), 2, name="grads")
    tick_until(svc, AFTER - 0.1)
    assert lines == []
    tick_until(svc, 100 * AFTER)
    assert svc.next_deadline() is None  # nothing more to report: the timer sleeps
    rows = {row["tag"]: row for row in svc.stalls(100 * AFTER)}
    grad, grads = rows[NAME], rows["grads"]
    assert (grad["rank"], grad["waits"], grad["not_called"], grad["other_names"]) == (
        0,
        "ranks",
        [1],
        ["grads"],
    )
    assert (grads["rank"], grads["not_called"], grads["other_names"]) == (1, [0], [NAME])
    assert "rank 1 has not called 'grad'; it waits in 'grads'" in grad["detail"]
    assert "rank 0 has not called 'grads'; it waits in 'grad'" in grads["detail"]
    assert len(lines) == 2
    for line in lines:
        row = grad if "'grad'," in line else grads
        assert line == call_line(row | {"pending_for": AFTER})  # the row's words, at AFTER
    [line] = [line for line in lines if "'grad'," in line]
    assert line.startswith(f"stalled: allreduce of rank 0, 'grad', job {JOB!r}, 16 B float64")
    assert "waits for ranks: sync allreduce sum of 2 float64 'grad': round 0 starts" in line
    assert svc.statistics()["counters"]["stalls_reported"] == 2


def test_a_call_answered_in_time_or_abandoned_writes_nothing(lines: list[str]) -> None:
    table = Table()
    svc, host = service(table, stall_after=AFTER)
    join(svc, table, 2, (0, 0))
    first, second = rank(0), rank(1)
    call(svc, first, 1)
    call(svc, second, 2)  # the round completes: both answered
    assert set(host.answered) == {1, 2}
    call(svc, first, 3, name="other")
    svc.client_gone(first, 0.0)  # its call is abandoned, unanswered
    tick_until(svc, 10 * AFTER)
    assert lines == []
    assert svc.next_deadline() is None
    assert svc.statistics()["counters"]["stalls_reported"] == 0


def test_a_call_logged_once_is_not_logged_again_however_long_it_waits(lines: list[str]) -> None:
    table = Table()
    svc, _ = service(table, stall_after=AFTER)
    join(svc, table, 2, (0, 0))
    call(svc, rank(0), 1)
    for now in (AFTER, 2 * AFTER, 10 * AFTER, 1000 * AFTER):
        svc.on_timer(now)
    assert len(lines) == 1
    assert "rank 1 has not called 'grad' (no collective call open)" in lines[0]


def two_nodes() -> tuple[list[CollectiveService], Wire]:
    """Rank 0 on node 0, rank 1 on node 1, each daemon's service on one fake wire."""
    table, wire = Table(), Wire()
    services = []
    for node in (0, 1):
        host = FakeHost(Config(node_id=node, nodes=NODES, stall_after=AFTER))
        host.links = {peer: wire.link(node, peer) for peer in range(len(NODES)) if peer != node}
        services.append(CollectiveService(host, membership=table))  # type: ignore[arg-type]
    for entry in table.join(JOB, 2, (0, 1), owner=1000):
        for svc in services:
            svc.on_rank_event(RankJoined(entry=entry), 0.0)
    return services, wire


def test_ranks_on_two_nodes_calling_different_names_say_what_each_node_knows(
    lines: list[str],
) -> None:
    services, wire = two_nodes()
    call(services[0], rank(0), 1)  # 'grad'
    call(services[1], rank(1), 2, name="grads")
    for _ in range(100):  # every frame delivered: each node builds the other's name
        if not wire.frames:
            break
        src, dst, meta, data = wire.frames.pop(0)
        deliver(services, src, dst, meta, data)
    assert not wire.frames
    rows: list[Meta] = []
    for svc in services:
        tick_until(svc, 10 * AFTER)
        rows += svc.stalls(10 * AFTER)
    grad, grads = rows
    assert (grad["tag"], grad["waits"], grad["peer_node"], grad["other_names"]) == (
        NAME,
        "messages",
        1,
        ["grads"],
    )
    assert "rank 1 is on node 1, whose calls this node cannot see" in grad["detail"]
    assert "no rank on this node has called 'grads', which peer nodes run" in grad["detail"]
    assert (grads["tag"], grads["peer_node"], grads["other_names"]) == ("grads", 0, [NAME])
    node0, node1 = lines
    assert node0.startswith("stalled: allreduce of rank 0, 'grad',")
    assert node0.endswith(grad["detail"])
    assert node1.startswith("stalled: allreduce of rank 1, 'grads',")
    assert "no rank on this node has called 'grad', which peer nodes run" in node1
