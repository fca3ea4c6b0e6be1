"""One node cannot hang or feed another job's stochastic reduce or parameter server (issue 28,
item 2), on real daemons.

* A node that hosts no rank of a job sends UPDATE and NOTIFY frames of its reduce, as a rank
  of another node and as a rank outside the job, with another spec: refused and counted, no
  reducer built, its links stay up, and the job's reduce runs as if nothing had come.  Before,
  the frame as a rank of no node built the reducer from the stranger's spec (then a protocol
  error reset the stranger's links).
* The same node pushes and pulls as a worker of another node, as a worker not announced (it
  waits for the announcement, then is refused at ``route_timeout``), and for a job with no
  rank here: nothing applied, nothing held as an early frame, each counted.  Before, the push
  as the unannounced worker was applied to the shard, and the one for a job not here held for
  ever.
* Ranks that call one reduce with different sizes all fail with ``usage`` naming both, on two
  nodes and on three -- before, on a ring of three, the rank between the two that saw the
  difference completed its first call and then waited for ever on its second.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from fabricd.frames import stochastic as stochastic_frames
from fabricd.wire import Kind

from .test_collective_members import WAIT, _outcome, _ranks
from .test_eager_peer import SLOW_LIVENESS
from .test_peer_fuzz import TARGET, _peer, _pretend_node_zero, _session, _status
from .test_ps_peer_fuzz import (
    SHARD,
    _counters,
    _dense,
    _pull_meta,
    _push_meta,
    _served,
    _shard_rows,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.launcher import LocalCluster


def _wait_for(check: Callable[[], bool], what: str) -> None:
    guard = time.monotonic() + WAIT  # a hang guard
    while not check():
        assert time.monotonic() < guard, what
        time.sleep(0.05)


def test_a_stranger_nodes_reduce_frames_are_refused_and_the_reduce_runs_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster, secret, real = _pretend_node_zero(make_cluster, **SLOW_LIVENESS)
    with _ranks(cluster, (1, TARGET), "victim") as fabs:
        stranger = _session(cluster, secret)
        try:
            spec = {"graph": "ring", "n": 2, "degree": None, "seed": 0, "edges": None}
            spec |= {"sync": "notify-ack", "dtype": "float32", "nbytes": 36}  # 9, not 8
            for src in (0, 7):  # rank 0 lives on node 1; the job has no rank 7
                fields = {"job": "victim", "name": "g", "src": src, "dst": 1, "round": 0}
                update = stochastic_frames.Update(**fields, spec=spec).to_meta()
                stranger.send(Kind.UPDATE, update, np.ones(9 + 4, np.float32).tobytes(), data=True)
                notify = stochastic_frames.Notify(**fields, tag=0, spec=spec).to_meta()
                stranger.send(Kind.NOTIFY, notify)

            def refused() -> bool:
                return _status(cluster, TARGET)["counters"]["frames_refused_not_member"] == 4

            _wait_for(refused, "the stranger's frames were not refused")
            status = _status(cluster, TARGET)
            assert status["stochastic_reduces"] == []  # nothing built for them
            assert _peer(status, 0)["state"] == "up"  # refused, not a reason to reset it
            arrays = [f.array("a", (8,), "float32") for f in fabs]
            for r, array in enumerate(arrays):
                array[:] = r + 1
            handles = [
                f.stochastic_reduce_async(a, "ring", name="g")
                for f, a in zip(fabs, arrays, strict=True)
            ]
            for handle in handles:
                assert handle.wait(WAIT).inputs == 1
            for array in arrays:
                np.testing.assert_array_equal(array, np.full(8, 1.5, np.float32))
        finally:
            stranger.close()
    assert _peer(_status(cluster, TARGET), 1)["incarnation"] == real["incarnation"]


def test_a_stranger_nodes_pushes_and_pulls_are_refused_and_nothing_is_held(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    with _served(make_cluster) as (cluster, secret, _, fabric):
        peer = _session(cluster, secret)  # node 0 announced no rank: it hosts none of the job
        try:
            counters, rows = _counters(cluster), _shard_rows(cluster)
            update = _dense(np.full(SHARD, 1e6))
            for worker in (5, 0):  # a worker of node 1; one not announced anywhere
                peer.send(Kind.PUSH, _push_meta(worker=worker, iteration=1), update, data=True)
                peer.send(Kind.PULL, _pull_meta(worker=worker, clock=1))
            peer.send(Kind.PUSH, {**_push_meta(worker=0), "job": "not-here"}, update, data=True)

            def refused() -> bool:  # rank 0's wait route_timeout (1 s), then are refused
                now = _counters(cluster)
                return now["frames_refused_not_member"] == counters["frames_refused_not_member"] + 4

            _wait_for(refused, "the stranger's pushes and pulls were not refused")
            after = _counters(cluster)
            assert after["ps_frames_dropped"] == counters["ps_frames_dropped"] + 5
            assert after["ps_early_frames"] == 0  # nothing held for the job not here
            assert _shard_rows(cluster) == rows  # nothing applied
            assert _peer(_status(cluster, TARGET), 0)["state"] == "up"
            fabric.step()  # the model's own workers go on, exact
        finally:
            peer.close()


@pytest.mark.parametrize("placement", [(0, 1), (0, 1, 2)])
def test_ranks_that_call_a_reduce_unlike_each_other_all_fail_naming_both(
    make_cluster: Callable[..., LocalCluster], placement: tuple[int, ...]
) -> None:
    """The last rank reduces 9 elements, the others 8, twice each as a training loop would
    (the second call once the first is answered) on a ring: every rank ends with a
    UsageError naming both sizes, and none waits for its timeout."""
    cluster = make_cluster(len(placement))
    with _ranks(cluster, placement, "mixed") as fabs:
        counts = [8] * (len(fabs) - 1) + [9]
        arrays = [f.array("a", (n,), "float32") for f, n in zip(fabs, counts, strict=True)]
        outcomes: list[str] = ["ok"] * len(fabs)
        started = time.monotonic()
        for _ in range(2):
            handles: list[Any] = [
                f.stochastic_reduce_async(a, "ring", name="g") if outcome == "ok" else None
                for f, a, outcome in zip(fabs, arrays, outcomes, strict=True)
            ]
            for r, handle in enumerate(handles):
                if handle is not None:
                    outcomes[r] = _outcome(lambda h=handle: h.wait(WAIT))
        assert time.monotonic() - started < WAIT / 2  # nobody waited for a timeout
    for outcome in outcomes:
        assert outcome.startswith("UsageError: "), outcomes
        assert "32 B of float32" in outcome, outcome
        assert "36 B of float32" in outcome, outcome
