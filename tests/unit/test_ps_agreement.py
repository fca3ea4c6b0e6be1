"""Every rank of a parameter-server model opens it alike (issue 27, item 6): a rank that opens
it with another spec than a rank of another daemon is refused at its open when its daemon has
heard of the other's, and otherwise fails at its next call; either way the ranks that opened
first fail too, each naming both specs with ``usage``.  Before, the open went through, the
worker's first pull failed as ``peer_failed``, and the server's rank never heard of it.

Two daemons' services (``test_ps_service_review``'s fake hosts, one wire and one rank table)
for what a client sees, and the engine alone (:class:`~fabricd.engines.ps.node.PSNode`, the
fake rank table of ``test_ps_node``) for what is told to whom and what is kept.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import pytest

from fabricd.engines.actions import Failure, SendFrame
from fabricd.engines.ps import agreement
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.models import CallDone, Disagreed
from fabricd.errors import ErrorCode, UsageError
from fabricd.frames import ps as ps_frames
from tests.unit.test_ps_node import KEY, SERVER, WORKER, Table, node, shard, spec
from tests.unit.test_ps_service_review import Fabric

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Action

#: server rank 0 on node 0, no replica: ranks 1 (node 1), 2 (node 0) and 3 (node 1) are workers
LAYOUT = {"servers": [0], "replicas": []}
SERVER_SAYS = "as 8 x float64 on servers [0], bsp by rank 0 (node 0)"


def failure(fabric: Fabric, node: int, rid: int) -> Failure:
    answer = fabric.hosts[node].answered.pop(rid)
    assert isinstance(answer, Failure), answer
    return answer


def disagreed(fabric: Fabric, node: int) -> list[str]:
    """The ``ps_disagreed`` events node ``node`` pushed to its shards' processes."""
    return [str(f["message"]) for e, f in fabric.hosts[node].pushed if e == "ps_disagreed"]


def test_a_worker_opening_with_another_size_than_its_server_is_refused_at_open() -> None:
    """The server opened first and its daemon told the worker's: the worker's open fails,
    naming both specs and what differs, and the server's process and every worker that
    opened alike hear it too (a worker whose open failed would be waited for under BSP)."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(0, "server", **LAYOUT)
    fabric.open(2, "worker", **LAYOUT)  # beside the server, alike
    assert fabric.deliver(100)
    with pytest.raises(UsageError) as refused:
        fabric.open(1, "worker", **LAYOUT, size=16)
    message = str(refused.value)
    assert SERVER_SAYS in message
    assert "as 16 x float64 on servers [0], bsp by rank 1 (node 1)" in message
    assert "they differ in size: every rank must open it alike" in message
    assert fabric.deliver(100)
    assert disagreed(fabric, 0) == [message]  # the server's serve() raises it
    with pytest.raises(UsageError, match="they differ in size"):
        fabric.request(0, 5, "ps_flush", name="w")
    with pytest.raises(UsageError, match="they differ in size"):
        fabric.call(2, 6, "ps_pull")  # the worker that opened alike


def test_a_server_opening_with_another_consistency_than_a_worker_is_refused_at_open() -> None:
    """The worker opened first and pulls (its pull waits for the server): the server's open
    is refused, and the worker's pull fails with ``usage`` naming both, not as
    ``peer_failed`` for a refusal that does not say it is this worker's own spec."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(1, "worker", **LAYOUT, consistency="async")
    fabric.call(1, 10, "ps_pull")
    assert fabric.deliver(100)
    with pytest.raises(UsageError, match="they differ in consistency") as refused:
        fabric.open(0, "server", **LAYOUT)
    assert "as 8 x float64 on servers [0], async by rank 1 (node 1)" in str(refused.value)
    assert fabric.deliver(100)
    pulled = failure(fabric, 1, 10)
    assert (pulled.code, pulled.message) == (ErrorCode.USAGE, str(refused.value))
    with pytest.raises(UsageError, match="they differ in consistency"):
        fabric.call(1, 11, "ps_pull")  # and every later call


def test_opens_that_cross_fail_both_ranks_calls_naming_both() -> None:
    """Each daemon opened before the other's OPENED came: neither open is refused, and both
    find the difference when it arrives.  The worker's pull that follows its OPENED is
    answered with the server's spec rather than a refusal that could overtake it."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(0, "server", **LAYOUT)
    fabric.open(1, "worker", **LAYOUT, consistency="async")
    fabric.call(1, 10, "ps_pull")
    assert fabric.deliver(100)
    pulled = failure(fabric, 1, 10)
    assert pulled.code == ErrorCode.USAGE
    for message in (pulled.message, *disagreed(fabric, 0)):
        assert SERVER_SAYS in message
        assert "as 8 x float64 on servers [0], async by rank 1 (node 1)" in message
        assert "they differ in consistency" in message
    assert len(disagreed(fabric, 0)) == 1
    with pytest.raises(UsageError, match="they differ in consistency"):
        fabric.request(0, 5, "ps_flush", name="w")


def test_ranks_that_open_alike_wait_for_nothing_and_train() -> None:
    """The honest path: each open is answered at once (before any frame between the daemons
    is delivered, the server not open yet), and pushes and pulls go on as before."""
    fabric = Fabric()
    fabric.join_all()
    alike = {**LAYOUT, "consistency": "async"}
    assert fabric.open(1, "worker", **alike) is not None
    assert fabric.open(3, "worker", **alike) is not None
    assert fabric.open(2, "worker", **alike) is not None
    assert fabric.open(0, "server", **alike) is not None
    fabric.array(1)[:] = 1.0
    fabric.call(1, 10, "ps_push")
    assert fabric.deliver(100)
    assert fabric.hosts[1].answered.pop(10)["dropped"] == []
    assert disagreed(fabric, 0) == []
    fabric.call(2, 11, "ps_pull")
    assert fabric.deliver(100)
    np.testing.assert_array_equal(fabric.array(2), 1.0)


def test_a_ranks_spec_is_forgotten_when_it_leaves() -> None:
    """A worker opened with another size and left: the server opens as it says, fine."""
    fabric = Fabric()
    fabric.join_all()
    fabric.open(1, "worker", **LAYOUT, size=16)
    assert fabric.deliver(100)
    assert fabric.services[0].engine.agreement.heard == 1
    fabric.leave(1)
    assert fabric.services[0].engine.agreement.heard == 0
    assert fabric.open(0, "server", **LAYOUT) is not None


# -- the engine ----------------------------------------------------------------------------
def opened(actions: list[Action]) -> list[tuple[int, ps_frames.Opened]]:
    return [
        (a.node, a.frame)
        for a in actions
        if isinstance(a, SendFrame) and isinstance(a.frame, ps_frames.Opened)
    ]


def test_a_daemon_tells_a_node_of_the_model_when_it_first_hosts_a_rank_of_the_job() -> None:
    """A worker opened before the server's rank was known: its daemon tells the server's node
    when the rank joins, once, and again when the node's links are back (a reset may have
    lost it)."""
    table = Table()
    del table.nodes[SERVER]
    daemon = node(WORKER, table)
    daemon.open_worker(
        KEY, spec(False), [(0, 4)], rank=WORKER, settings=FilterSettings(), seed=0, now=0.0
    )
    table.nodes[SERVER] = SERVER
    [(to, frame)] = opened(daemon.rank_joined("j", SERVER, SERVER, 1.0))
    assert (to, frame.rank, frame.spec, frame.answer) == (SERVER, WORKER, spec(False), False)
    assert opened(daemon.rank_joined("j", 5, SERVER, 2.0)) == []  # its node knows already
    assert [to for to, _ in opened(daemon.peer_up(SERVER, 3.0))] == [SERVER]


def test_an_opened_frame_naming_a_rank_of_another_node_is_dropped_and_counted() -> None:
    table = Table()
    daemon = node(SERVER, table)
    shard(daemon, SERVER, replicas=False)
    unlike = {**spec(False), "size": 16}
    frame = ps_frames.Opened(job="j", name="m", rank=WORKER, spec=unlike)
    assert daemon.on_frame(7, frame, b"", 1.0) == []  # rank 2 lives on node 2
    assert daemon.counters["ps_frames_dropped"] == 1
    assert daemon.models[KEY].disagreed is None
    actions = daemon.on_frame(WORKER, frame, b"", 1.0)
    assert [type(a) for a in actions] == [Disagreed, SendFrame]
    [(to, answer)] = opened(actions)
    assert (to, answer.spec, answer.answer) == (WORKER, spec(False), True)
    # an answer is never answered in turn, and a model refused once says so once
    assert daemon.on_frame(WORKER, dataclasses.replace(frame, answer=True), b"", 2.0) == []


def test_a_peers_spec_not_kept_past_the_bound_is_found_when_the_open_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_HEARD a peer's spec is not kept: an open unlike it goes through, and fails
    the worker's calls once the peer answers its OPENED."""
    monkeypatch.setattr(agreement, "MAX_HEARD", 0)
    table = Table()
    daemon = node(WORKER, table)
    unlike = {**spec(False), "size": 16}
    daemon.on_frame(SERVER, ps_frames.Opened(job="j", name="m", rank=SERVER, spec=unlike), b"", 0.0)
    assert daemon.agreement.heard == 0
    actions = daemon.open_worker(
        KEY, spec(False), [(0, 4)], rank=WORKER, settings=FilterSettings(), seed=0, now=1.0
    )
    assert SERVER in [to for to, _ in opened(actions)]
    answer = ps_frames.Opened(job="j", name="m", rank=SERVER, spec=unlike, answer=True)
    actions = daemon.on_frame(SERVER, answer, b"", 2.0)
    [done] = [a for a in actions if isinstance(a, CallDone)]
    assert done.failure is not None
    assert done.failure.code == ErrorCode.USAGE
    assert "they differ in size" in done.failure.message
    assert opened(actions) == []  # an answer is not answered
