"""A rank interrupted (Ctrl-C) while it waits in a sync allreduce, on real daemons on loopback
(issue 27, item 5).

The rule (fabricd/engines/collectives/persistent.py, "A call whose client stops waiting"): once
the rank's node started the round its data is kept -- the peers' round counts it, and the
restarted rank's first call is for the next round and says so (``Result.kept``, or its
failure's message); before that it is withdrawn and the node's other calls wait on.

Before: the peer got a "successful" round with ``active=2`` and the rank's data in it, and the
restarted rank's first call came back for round 1 with nothing saying why, or failed with a
``PeerFailed`` for "round 1" that made no sense to it; a withdrawn call failed the node's other
calls.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.ranks import allreduce_until_interrupted

from .test_eager_peer import SLOW_LIVENESS

if TYPE_CHECKING:
    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.timeout(120)
WAIT = 30.0
JOB = "interrupted"


def _open_calls(cluster: LocalCluster, node: int, *, not_: int) -> int:
    """Node ``node``'s collective's open calls, once they are not ``not_`` (the interrupt must
    come while the rank waits in its call, not before the daemon has it; the client's going
    must be heard before the test looks at what became of the others)."""
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as control:
        rows: list[Any] = []
        for _ in range(600):
            rows = control.status()["collectives"]
            if rows and rows[0]["waiting"] != not_:
                return int(rows[0]["waiting"])
            time.sleep(0.05)
    raise AssertionError(f"node {node} kept {not_} calls open: {rows}")


def _spawn_rank(spawn, queue, cluster: LocalCluster, node: int, rank: int, size: int) -> Any:
    """Start rank ``rank``'s trainer on ``node``: its allreduce of 10s (:func:`_stop`
    interrupts it)."""
    path = cluster.nodes[node].socket_path
    process = spawn(allreduce_until_interrupted, path, JOB, rank, size, 10.0, queue)
    assert queue.get(timeout=WAIT) == ("calling",)
    return process


def _asleep(pid: int) -> bool:
    """Whether ``pid``'s main thread is blocked (state S): past its request, in the wait."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "S"


def _stop(process: Any, queue: Any) -> list[str]:
    """Ctrl-C the trainer, and return the interrupt's notes once its process is gone.

    The daemon has the call by now (``_open_calls``), but a loaded machine may not yet have
    let the trainer from its request into the wait that gives the interrupt its note: it is
    interrupted once its main thread blocks (in the wait: nothing else blocks after the
    request), or after 5 s regardless."""
    assert process.pid is not None
    for _ in range(500):
        if _asleep(process.pid):
            break
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGINT)  # Ctrl-C
    how, notes = queue.get(timeout=WAIT)
    process.join(WAIT)
    assert how == "interrupted"
    assert process.exitcode == 0
    return notes


def _restart(path: str, rank: int, size: int) -> fabricd.Client:
    """A new client for ``rank`` (its trainer restarted), once the daemon let the old one go."""
    for _ in range(200):
        try:
            return fabricd.connect(job=JOB, rank=rank, size=size, socket_path=path)
        except fabricd.FabricError:
            time.sleep(0.05)
    raise AssertionError(f"rank {rank} could not rejoin")


@pytest.mark.parametrize("peer_leaves", [False, True], ids=["peer_goes_on", "peer_leaves"])
def test_an_interrupted_sync_call_whose_round_started_is_kept_and_the_restart_is_told(
    make_cluster, spawn, queue, peer_leaves: bool
) -> None:
    """Two nodes, one rank each: rank 1 calls (its node starts the round) and is interrupted;
    rank 0 then calls and its round counts rank 1's data (11 = 1 + 10, active 2): kept.  The
    restarted rank 1's first call is for round 1 and says round 0 kept its previous call; with
    rank 0 gone instead, its PeerFailed names round 1 and says why it is round 1."""
    cluster = make_cluster(2)
    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab0:
        process = _spawn_rank(spawn, queue, cluster, 1, 1, 2)
        assert _open_calls(cluster, 1, not_=0) == 1
        notes = _stop(process, queue)
        mine = fab0.array("g", (4,), "float32")
        mine[:] = 1.0
        first = fab0.allreduce(mine, "sum", timeout=WAIT)
        assert (first.round, first.active, first.kept) == (0, 2, None)
        assert (mine == 11.0).all()  # the interrupted rank's data: kept
        with _restart(cluster.nodes[1].socket_path, 1, 2) as back:
            theirs = back.array("g", (4,), "float32")
            theirs[:] = 100.0
            handle = back.allreduce_async(theirs, "sum")
            if peer_leaves:
                fab0.close()
                with pytest.raises(fabricd.PeerFailed) as failed:
                    handle.wait(WAIT)
                message = str(failed.value)
                assert "round 1 cannot complete" in message
                assert "previous call was kept in round 0" in message
                return
            mine[:] = 1.0
            second = fab0.allreduce(mine, "sum", timeout=WAIT)
            again = handle.wait(WAIT)
    assert (again.round, again.kept) == (1, 0)
    assert (second.round, second.kept) == (1, None)
    assert (theirs == 101.0).all()
    assert (mine == 101.0).all()
    # the interrupted process was told its call was not withdrawn (its exception's note)
    assert any("was not withdrawn" in note for note in notes), notes


def test_an_interrupted_sync_call_whose_node_had_not_started_the_round_is_withdrawn(
    make_cluster, spawn, queue
) -> None:
    """Ranks 1, 2 and 3 share node 1: rank 2 calls, rank 1 calls and is interrupted before rank
    3 called, so nothing of rank 1's data left its node: withdrawn.  Rank 2's call waits on
    (before, it failed at once with PeerFailed); the restarted rank 1 and rank 3 call, and the
    round counts each rank's one gift, the interrupted 10s not among them."""
    cluster = make_cluster(2, **SLOW_LIVENESS)  # the grace the rank has to come back
    sock = [n.socket_path for n in cluster.nodes]
    with (
        fabricd.connect(job=JOB, rank=0, size=4, socket_path=sock[0]) as fab0,
        fabricd.connect(job=JOB, rank=2, size=4, socket_path=sock[1]) as fab2,
        fabricd.connect(job=JOB, rank=3, size=4, socket_path=sock[1]) as fab3,
    ):
        process = _spawn_rank(spawn, queue, cluster, 1, 1, 4)
        arrays = {r: f.array("g", (4,), "float32") for r, f in ((0, fab0), (2, fab2), (3, fab3))}
        for rank, array in arrays.items():
            array[:] = float(rank + 1)
        waiting = fab2.allreduce_async(arrays[2], "sum")
        assert _open_calls(cluster, 1, not_=1) == 2
        _stop(process, queue)
        assert _open_calls(cluster, 1, not_=2) == 1  # rank 2's waits on (before: failed, 0)
        assert not waiting.done()
        with _restart(sock[1], 1, 4) as back:
            theirs = back.array("g", (4,), "float32")
            theirs[:] = 2.0
            handles = [
                waiting,
                back.allreduce_async(theirs, "sum"),
                fab3.allreduce_async(arrays[3], "sum"),
                fab0.allreduce_async(arrays[0], "sum"),
            ]
            results = [h.wait(WAIT) for h in handles]
    assert all((r.round, r.kept) == (0, None) for r in results)
    expected = 1.0 + 2.0 + 3.0 + 4.0
    assert all((a == expected).all() for a in [*arrays.values(), theirs])
    assert np.array_equal(arrays[0], theirs)
