"""``fab.allreduce(..., algorithm=...)`` between real daemons on loopback: every algorithm
gives the same sum, status names what runs, and ranks that ask for different algorithms
under one name all fail, naming both.

Four daemons, seven ranks (two on three of the nodes: each node's ranks reduce through shared
memory first), integer-valued data so that every algorithm's sum is exact and comparable bit
for bit.  ``ring_from_bytes`` is 64 KiB, so that under ``"auto"`` the small array runs
recursive doubling and the large one the direct exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import WAIT, ranks, reference, wait_or_explain

if TYPE_CHECKING:
    from fabricd.client import Client

pytestmark = pytest.mark.timeout(240)

PLACEMENT = (0, 1, 2, 3, 0, 1, 2)
SETTINGS = {"ring_from_bytes": 65536}
SMALL, LARGE = 1031, 40_000  #: float64 elements: 8 KiB, 320 KiB
#: the algorithm status names for each asked-for one, by array
RUNS = {
    "ring": "ring",
    "doubling": "recursive doubling",
    "tree": "binary tree",
    "mlfabric": "mlfabric",
}
AUTO = {SMALL: "recursive doubling", LARGE: "direct exchange"}


def rows_of(fab: Client, name: str) -> list[dict[str, Any]]:
    return [row for row in fab.status()["collectives"] if row["name"] == name]


def test_every_algorithm_gives_the_same_sum_and_status_names_it(make_cluster) -> None:
    cluster = make_cluster(4, **SETTINGS)
    rng = np.random.default_rng(7)
    size = len(PLACEMENT)
    with ranks(cluster, PLACEMENT, "algorithms") as fabs:
        for count in (SMALL, LARGE):
            runs = {"auto": AUTO[count], **RUNS}
            arrays = [f.array(f"x{count}", (count,), "float64") for f in fabs]
            results: dict[tuple[str, str], np.ndarray[Any, Any]] = {}
            inputs = [rng.integers(-50, 50, count).astype("float64") for _ in fabs]
            for op in ("sum", "avg"):
                for algorithm in runs:
                    name = f"{algorithm}-{op}-{count}"
                    for _ in range(2):  # a second round reuses the persistent schedule
                        for a, x in zip(arrays, inputs, strict=True):
                            a[:] = x
                        handles = [
                            f.allreduce_async(a, op, name=name, algorithm=algorithm)  # type: ignore[arg-type]
                            for f, a in zip(fabs, arrays, strict=True)
                        ]
                        done = [wait_or_explain(h, fabs) for h in handles]
                        assert all(r.included and r.active == size for r in done)
                        np.testing.assert_allclose(arrays[0], reference(inputs, op), rtol=1e-12)
                        assert all(np.array_equal(arrays[0], a) for a in arrays)
                    results[algorithm, op] = arrays[0].copy()
                    for fab in (fabs[0], fabs[3]):  # the tree's root's node and a leaf's
                        (row,) = rows_of(fab, name)
                        assert row["algorithm"] == runs[algorithm]
                        assert (algorithm == "auto") == ("algorithm" not in row["what"])
            for op in ("sum", "avg"):
                for algorithm in runs:
                    np.testing.assert_array_equal(results[algorithm, op], results["auto", op])


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_a_partial_tree_allreduce_loses_and_doubles_no_gift(make_cluster, mode: str) -> None:
    """Solo and majority over the tree: every rank gives a one-hot gift per step, then rounds
    of zeros drain what waited; with ``late="sum"`` a rank applies each gift at most once, and
    the ranks that got the last round applied every gift exactly once."""
    cluster = make_cluster(4)
    size, steps, drain = len(PLACEMENT), 4, 4
    with ranks(cluster, PLACEMENT, f"tree-{mode}") as fabs:
        arrays = [f.array("g", (size * steps,), "float64") for f in fabs]
        given = np.zeros(size * steps, "int64")
        applied = [np.zeros_like(given) for _ in fabs]
        last = [-1] * size
        for step in range(steps + drain):
            for r, a in enumerate(arrays):
                a[:] = 0
                if step < steps:
                    a[r * steps + step] = 1
                    given[r * steps + step] += 1
            handles = [
                f.allreduce_async(a, "sum", mode, algorithm="tree")  # type: ignore[arg-type]
                for f, a in zip(fabs, arrays, strict=True)
            ]
            for r, handle in enumerate(handles):
                last[r] = wait_or_explain(handle, fabs).round
                applied[r] += np.rint(arrays[r]).astype("int64")
        (row,) = rows_of(fabs[0], f"allreduce:{mode}:sum:g")
        assert row["algorithm"] == "binary tree"
    assert max(a.max() for a in applied) <= 1, "a rank applied a gift twice"
    if row["rounds"] == max(last) + 1:  # (else a round ended after every last call)
        for r in range(size):
            if last[r] == max(last):
                np.testing.assert_array_equal(applied[r], given)


def test_ranks_that_ask_for_different_algorithms_all_fail_naming_both(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 0), "algorithm-mismatch") as fabs:
        arrays = [f.array("g", (10,), "float32") for f in fabs]
        asked = ("tree", "tree", "ring")
        handles = [
            f.allreduce_async(a, name="grad", algorithm=algo)  # type: ignore[arg-type]
            for f, a, algo in zip(fabs, arrays, asked, strict=True)
        ]
        for handle in handles:
            with pytest.raises(fabricd.UsageError) as failed:
                handle.wait(timeout=WAIT)
            assert "algorithm tree" in str(failed.value)
            assert "algorithm ring" in str(failed.value)
