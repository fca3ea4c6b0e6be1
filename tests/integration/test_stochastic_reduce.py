"""Stochastic reduce between real daemons on loopback (issue 11): every sync mode and graph
kind, with several ranks per node (local and remote edges), against the averaging matrix, and
failures: a killed node or a departed trainer fails the neighbours that need it, never hangs;
async goes on.

Ranks are clients in this process, one connection each; every call is started with the
``_async`` form and then waited for, so one thread plays all ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.engines.stochastic import graphs
from tests.integration.test_collectives import ranks
from tests.integration.test_collectives import wait_or_explain as collectives_wait

if TYPE_CHECKING:
    from fabricd.client import Client, ReduceResult

pytestmark = pytest.mark.timeout(240)

#: rank -> node: 5 ranks on 3 nodes, so a graph has edges within a node and between nodes
PLACEMENT = (0, 1, 2, 0, 1)
WAIT = 60.0
COUNT = 1000


def wait_or_explain(handle: Any, fabs: list[Client]) -> Any:
    """``handle.wait``, or a report of every daemon's reducers and stalled calls."""
    return collectives_wait(handle, fabs, rows="stochastic_reduces")


def round_of(
    fabs: list[Client], arrays: list[np.ndarray[Any, Any]], graph: str, sync: str, **kw: Any
) -> list[ReduceResult]:
    handles = [
        f.stochastic_reduce_async(a, graph, sync, **kw)  # type: ignore[arg-type]
        for f, a in zip(fabs, arrays, strict=True)
    ]
    return [wait_or_explain(h, fabs) for h in handles]


KINDS = [
    ("all-to-all", {}),
    ("star", {}),
    ("chain", {}),
    ("ring", {}),
    ("expander", {}),
    ("regular", {"degree": 2, "seed": 7}),
    ("edges", {"edges": [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 3)]}),
]


@pytest.mark.parametrize(("kind", "options"), KINDS, ids=[k for k, _ in KINDS])
def test_notify_ack_equals_the_averaging_matrix_every_round(
    make_cluster, kind: str, options: dict[str, Any]
) -> None:
    cluster = make_cluster(3)
    size = len(PLACEMENT)
    graph = graphs.build(kind, size, **options)
    matrix = graph.averaging_matrix()
    rng = np.random.default_rng(1)
    with ranks(cluster, PLACEMENT, f"na-{kind}") as fabs:
        arrays = [f.array("w", (COUNT,), "float64") for f in fabs]
        models = rng.standard_normal((size, COUNT))
        for rnd in range(3):
            for a, m in zip(arrays, models, strict=True):
                a[:] = m
            results = round_of(fabs, arrays, kind, "notify-ack", **options)
            models = matrix @ models
            for r, (a, res) in enumerate(zip(arrays, results, strict=True)):
                assert res.round == rnd
                assert res.inputs == res.in_degree == graph.in_degrees[r]
                assert (res.torn, res.stale) == (0, 0)
                np.testing.assert_allclose(a, models[r], rtol=1e-12, atol=1e-12)
            models = models + 1.0  # a training step between rounds
        rows = fabs[0].status()["stochastic_reduces"]
        assert {row["rank"] for row in rows} == {0, 3}  # node 0's two ranks
        assert all(row["reduces"] == 3 and row["sync"] == "notify-ack" for row in rows)


@pytest.mark.parametrize("sync", ["barrier", "async"])
@pytest.mark.parametrize(("kind", "options"), KINDS, ids=[k for k, _ in KINDS])
def test_barrier_and_async_average_only_whole_updates(
    make_cluster, sync: str, kind: str, options: dict[str, Any]
) -> None:
    """Each rank's model is a constant vector, so an average of whole updates is one too; the
    counts add up to the in-degree, and the average lies within the models given."""
    cluster = make_cluster(3)
    size = len(PLACEMENT)
    graph = graphs.build(kind, size, **options)
    with ranks(cluster, PLACEMENT, f"{sync}-{kind}") as fabs:
        arrays = [f.array("w", (COUNT,), "float32") for f in fabs]
        for rnd in range(6):
            given = [float(10 * r + rnd) for r in range(size)]
            for a, value in zip(arrays, given, strict=True):
                a[:] = value
            results = round_of(fabs, arrays, kind, sync, **options)
            for r, (a, res) in enumerate(zip(arrays, results, strict=True)):
                assert res.round == rnd
                assert res.in_degree == graph.in_degrees[r]
                assert res.inputs + res.torn + res.stale == res.in_degree
                assert np.all(a == a[0])  # never half of one update and half of another
                assert min(given) - 1 <= a[0] <= max(given) + 1


def test_a_call_unlike_the_first_is_refused_and_bad_graphs_are_named(make_cluster) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "usage") as fabs:
        a = fabs[0].array("w", (8,), "float32")
        with pytest.raises(fabricd.UsageError, match="regular graph needs a degree"):
            fabs[0].stochastic_reduce(a, "regular", timeout=WAIT)
        with pytest.raises(fabricd.UsageError, match="sync must be one of"):
            fabs[0].stochastic_reduce(a, "ring", "bsp", timeout=WAIT)  # type: ignore[arg-type]
        with pytest.raises(fabricd.UsageError, match="edges are"):
            fabs[0].stochastic_reduce(a, "edges", edges=[(0, "1")], timeout=WAIT)  # type: ignore[list-item]
        with pytest.raises(fabricd.UsageError, match=r"not a node of|outside"):
            fabs[0].stochastic_reduce(a, "edges", edges=[(0, 1), (1, 5)], timeout=WAIT)
        i = fabs[0].array("i", (8,), "int32")
        with pytest.raises(fabricd.UsageError, match="averages float16"):
            fabs[0].stochastic_reduce(i, "ring", timeout=WAIT)
        first = fabs[0].stochastic.stochastic_reduce_async(a, "ring", name="r")
        b = fabs[1].array("w", (8,), "float32")
        with pytest.raises(fabricd.UsageError, match="called in two ways"):
            fabs[1].stochastic_reduce(b, "chain", name="r", timeout=WAIT)
        with pytest.raises(fabricd.UsageError, match="called in two ways"):
            first.wait(timeout=WAIT)


def test_a_killed_node_fails_notify_ack_neighbours_and_async_goes_on(make_cluster) -> None:
    """F1: node 2 (rank 2) dies while its out-neighbour waits for its NOTIFY: the waiting
    rank raises PeerFailed naming rank 2, within the peer timeout; under async the survivors'
    calls keep completing."""
    cluster = make_cluster(3)
    with ranks(cluster, PLACEMENT, "killed") as fabs:
        arrays = [f.array("w", (COUNT,), "float32") for f in fabs]
        round_of(fabs, arrays, "ring", "notify-ack")
        round_of(fabs, arrays, "ring", "async")
        # ring: 2 -> 3; rank 3 (node 0) waits for rank 2's update of round 1
        waiting = fabs[3].stochastic.stochastic_reduce_async(arrays[3], "ring")
        cluster.kill(2)
        with pytest.raises(fabricd.PeerFailed, match="rank 2"):
            waiting.wait(timeout=WAIT)
        survivors = [r for r, n in enumerate(PLACEMENT) if n != 2]
        for _ in range(3):
            handles = [
                fabs[r].stochastic.stochastic_reduce_async(arrays[r], "ring", "async")
                for r in survivors
            ]
            for h in handles:
                res = wait_or_explain(h, fabs)
                assert res.inputs <= res.in_degree


def test_a_trainer_that_leaves_fails_its_barrier_partners(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 0), "left") as fabs:
        arrays = [f.array("w", (16,), "float64") for f in fabs]
        round_of(fabs, arrays, "all-to-all", "barrier")
        waiting = [
            fabs[r].stochastic.stochastic_reduce_async(arrays[r], "all-to-all", "barrier")
            for r in (0, 1)
        ]
        fabs[2].close()
        for handle in waiting:
            with pytest.raises(fabricd.PeerFailed, match="rank 2 was lost"):
                handle.wait(timeout=WAIT)
