"""Review of the collective service with real daemons: a job that ends and a later job of the
same name (the way a trainer is re-run), and what status and metrics show of a job.  Each test
shows a bug the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import ranks

if TYPE_CHECKING:
    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0


def wait_gone(cluster: LocalCluster, job: str) -> None:
    """Wait (bounded) until no daemon of ``cluster`` knows a rank of ``job``."""
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as watcher:
            deadline = time.monotonic() + WAIT
            while any(row["job"] == job for row in watcher.status()["ranks"]):
                assert time.monotonic() < deadline, f"node {node.node} still knows job {job!r}"
                time.sleep(0.05)


def test_a_rerun_with_another_size_is_not_refused(make_cluster: Any) -> None:
    cluster = make_cluster(2)
    for count in (4, 8):  # the default name, allreduce:sync:sum:g, is the same both times
        with ranks(cluster, (0, 1), "rerun") as fabs:
            arrays = [f.array("g", (count,), "float64") for f in fabs]
            for r, a in enumerate(arrays):
                a[:] = r + 1
            handles = [
                f.allreduce_async(a, "sum", "sync") for f, a in zip(fabs, arrays, strict=True)
            ]
            for handle in handles:
                handle.wait(timeout=WAIT)  # the second run: "... is a sync allreduce of 4"
            assert all(np.array_equal(a, np.full(count, 3.0)) for a in arrays)
        wait_gone(cluster, "rerun")


def test_a_later_job_of_the_same_name_sees_none_of_the_old_data(make_cluster: Any) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "shared") as fabs:
        arrays = [f.array("g", (4,), "float64") for f in fabs]
        first = [f.allreduce_async(a, "sum", "solo") for f, a in zip(fabs, arrays, strict=True)]
        for handle in first:  # the first round is every rank's
            handle.wait(timeout=WAIT)
        arrays[0][:], arrays[1][:] = 0.0, 7.0
        fabs[0].allreduce(arrays[0], "sum", "solo")  # one node: round 1 ends in this call
        fabs[1].allreduce(arrays[1], "sum", "solo")  # behind: [7] waits for round 2
    wait_gone(cluster, "shared")
    with ranks(cluster, (0, 0), "shared") as fabs:
        mine, other = (f.array("g", (4,), "float64") for f in fabs)
        mine[:], other[:] = 1.0, 0.0
        calls = [fabs[0].allreduce_async(mine, "sum", "solo")]
        calls.append(fabs[1].allreduce_async(other, "sum", "solo"))
        for handle in calls:
            handle.wait(timeout=WAIT)
        assert np.array_equal(mine, np.full(4, 1.0)), "the old job's 7s are in this result"


def test_no_metric_label_carries_a_job_or_collective_name(make_cluster: Any) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0,), "secret-job") as fabs:
        mine = fabs[0].array("secret-weights", (4,), "float64")
        fabs[0].allreduce(mine, "sum", "sync", timeout=WAIT)
        with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as other:
            metrics = other.status()["metrics"]
    labelled = {
        (name, value)
        for name, samples in metrics.items()
        for sample in samples
        for value in sample["labels"].values()
        if "secret" in str(value)
    }
    assert labelled == set()
