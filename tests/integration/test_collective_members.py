"""One node cannot hang another job's collective (issue 28, item 2), on real daemons.

* A node that hosts no rank of a job sends frames of that job's collective: they are refused
  and counted before anything is built for them, its links stay up, and the job's own
  collective runs as if nothing had come.  Before, the first such frame built the collective
  from the stranger's spec, the job's next call there broke it, and the other member's call
  hung with no error.
* Ranks that call one name with different specs all fail with ``usage`` naming both, on two
  nodes and on three, where the one node that differs is heard by the other two -- before, one
  of them waited until its timeout.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.wire import Kind

from .test_eager_peer import SLOW_LIVENESS
from .test_peer_fuzz import TARGET, _peer, _pretend_node_zero, _session, _status

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from fabricd.client import Fabric as Client
    from fabricd.daemon.launcher import LocalCluster

WAIT = 30.0


@contextlib.contextmanager
def _ranks(cluster: LocalCluster, placement: tuple[int, ...], job: str) -> Iterator[list[Client]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                fabricd.connect(
                    job=job, rank=r, size=len(placement), socket_path=cluster.nodes[n].socket_path
                )
            )
            for r, n in enumerate(placement)
        ]


def _outcome(call: Callable[[], Any]) -> str:
    try:
        call()
    except fabricd.FabricError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_a_stranger_nodes_frames_are_refused_and_the_job_runs_on(make_cluster) -> None:
    cluster, secret, real = _pretend_node_zero(make_cluster, **SLOW_LIVENESS)
    with _ranks(cluster, (1, TARGET), "victim") as fabs:
        stranger = _session(cluster, secret)
        try:
            spec = {"kind": "allreduce", "count": 9, "dtype": "float32", "op": "sum"}
            spec |= {"mode": "sync", "root": 0, "ring": False, "direct": False}
            for round in range(16):  # frames of rounds to come, each of another name
                meta = {"job": "victim", "name": f"g{round % 4}", "r": round, "t": 0}
                meta |= {"off": 0, "lost": [], "b": 0, "spec": spec}
                stranger.send(Kind.COLL, meta, np.ones(9, np.float32).tobytes(), data=True)
            status: dict[str, Any] = {}
            for _ in range(200):  # frames on a link arrive in order: wait for the last
                status = _status(cluster, TARGET)
                if status["counters"]["frames_refused_not_member"] == 16:
                    break
                time.sleep(0.05)
            assert status["counters"]["frames_refused_not_member"] == 16
            assert status["collectives"] == []  # nothing built for them
            assert status["held_bytes"] == []
            assert _peer(status, 0)["state"] == "up"  # refused, not a reason to reset the node
            arrays = [f.array("a", (8,), "float32") for f in fabs]
            for r, array in enumerate(arrays):
                array[:] = r + 1
            handles = [f.allreduce_async(a, name="g0") for f, a in zip(fabs, arrays, strict=True)]
            for handle in handles:
                handle.wait(WAIT)
            for array in arrays:
                np.testing.assert_array_equal(array, np.full(8, 3.0, np.float32))
        finally:
            stranger.close()
    assert _peer(_status(cluster, TARGET), 1)["incarnation"] == real["incarnation"]


@pytest.mark.parametrize("placement", [(0, 1), (0, 1, 2)])
def test_ranks_that_call_a_name_unlike_each_other_all_fail_naming_both(
    make_cluster, placement: tuple[int, ...]
) -> None:
    """The last rank calls with 9 elements, the others with 8: every call fails with a
    UsageError (code usage) naming both, none waits for its timeout."""
    cluster = make_cluster(len(placement))
    with _ranks(cluster, placement, "mixed") as fabs:
        counts = [8] * (len(fabs) - 1) + [9]
        arrays = [f.array("a", (n,), "float32") for f, n in zip(fabs, counts, strict=True)]
        handles = [f.allreduce_async(a, name="g") for f, a in zip(fabs, arrays, strict=True)]
        started = time.monotonic()
        outcomes = [_outcome(lambda h=h: h.wait(WAIT)) for h in handles]
        assert time.monotonic() - started < WAIT / 2  # nobody waited for a timeout
    for outcome in outcomes:
        assert outcome.startswith("UsageError: "), outcomes
        assert "of 8 float32" in outcome, outcome
        assert "of 9 float32" in outcome, outcome
