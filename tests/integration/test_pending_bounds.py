"""Pending operations are bounded per client, per job, and per peer node: real clients see why.

Two in-process daemons (inproc.py) with real client sockets and shared memory; the clients are
the real library in worker threads.  Each bound is set small, a client goes past it, and the
client raises ``OperationFailed`` with code ``limit`` and a message naming the setting, while
the daemon's status counts the refusal.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import fabricd

from .inproc import fabric

WAIT = 10.0  #: hang guard only


def _post_past(
    socket_path: str, count: int, op: str, ready: threading.Event, hold: threading.Event
):
    """Rank 0 posts ``count`` operations with rank 1; return what each raised.  Sets ``ready``
    once they are known, then stays connected until ``hold`` (leaving abandons what waits)."""
    outcomes: list[str] = []
    with fabricd.connect(job="j", rank=0, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (4,), "float32")
        start = fab.p2p.send_async if op == "send" else fab.p2p.recv_async
        handles = [start(array, 1, tag) for tag in range(count)]
        for handle in handles:
            try:
                handle.wait(0.5)
            except fabricd.Timeout:
                outcomes.append("pending")
            except fabricd.OperationFailed as exc:
                outcomes.append(f"{exc.code}: {exc}")
        ready.set()
        hold.wait(WAIT)
    return outcomes


async def _outcomes_and_status(fab, node: int, op: str) -> tuple[list[str], dict]:
    """Run :func:`_post_past` on node 0 for 3 operations; node ``node``'s status meanwhile."""
    ready, hold = threading.Event(), threading.Event()
    task = asyncio.create_task(asyncio.to_thread(_post_past, fab.socket(0), 3, op, ready, hold))
    try:
        assert await asyncio.to_thread(ready.wait, WAIT)
        status = fab.daemons[node].status()
    finally:
        hold.set()
    return await task, status


def _hold_rank(socket_path: str, rank: int, joined: threading.Event, hold: threading.Event):
    with fabricd.connect(job="j", rank=rank, size=2, socket_path=socket_path) as fab:
        fab.array("y", (4,), "float32")
        joined.set()
        hold.wait(WAIT)


@pytest.mark.parametrize(
    ("setting", "counter"),
    [
        ("max_ops_per_client", "ops_refused_client_limit"),
        ("max_ops_per_job", "ops_refused_job_limit"),
    ],
)
async def test_a_client_past_its_bound_is_told_the_limit_and_the_setting(
    tmp_path, setting, counter
):
    async with fabric(tmp_path, **{setting: 2}) as fab:
        outcomes, status = await _outcomes_and_status(fab, 0, "recv")
        assert outcomes[:2] == ["pending", "pending"]
        assert outcomes[2].startswith("limit: ")
        assert setting in outcomes[2]
        assert status["counters"][counter] == 1


async def test_a_peer_past_max_unmatched_rts_per_peer_fails_the_send_with_the_limit(tmp_path):
    async with fabric(tmp_path, max_unmatched_rts_per_peer=2) as fab:
        hold, joined = threading.Event(), threading.Event()
        receiver = asyncio.create_task(
            asyncio.to_thread(_hold_rank, fab.socket(1), 1, joined, hold)
        )
        try:
            assert await asyncio.to_thread(joined.wait, WAIT)
            await fab.until(
                lambda: fab.daemons[0].service("membership").engine.lookup("j", 1) is not None
            )
            outcomes, status = await _outcomes_and_status(fab, 1, "send")
        finally:
            hold.set()
            await receiver
        assert outcomes[:2] == ["pending", "pending"]
        assert outcomes[2].startswith("limit: ")
        assert "max_unmatched_rts_per_peer" in outcomes[2]
        assert status["counters"]["rts_refused_peer_limit"] == 1
