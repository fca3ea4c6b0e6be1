"""Native allgather and reduce-scatter between real daemons on loopback (issue 30, item 1): 3
daemons with 2 ranks each, every reduce op against numpy, an uneven and interleaved placement,
and the bytes a node sends: ``(nodes - 1) / nodes`` of the array, once, not an allreduce's.

Ranks are clients in this process; every call is started with the ``_async`` form and then
waited for, so one thread plays all ranks.
"""

from __future__ import annotations

from random import Random
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import ranks, reference, wait_or_explain

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import Client
    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.timeout(240)

#: rank -> node: 3 daemons, 2 ranks each; then uneven and interleaved
THREE_BY_TWO = (0, 0, 1, 1, 2, 2)
PLACEMENTS = [THREE_BY_TWO, (0, 1, 2, 0, 1, 2), (2, 0, 1, 1, 0)]


def allgather(
    fabs: list[Client], inputs: list[np.ndarray[Any, Any]], outputs: list[np.ndarray[Any, Any]]
) -> None:
    handles = [f.allgather_async(x, y) for f, x, y in zip(fabs, inputs, outputs, strict=True)]
    for handle in handles:
        wait_or_explain(handle, fabs)


def draw(rng: Random, n: int, dtype: str) -> np.ndarray[Any, Any]:
    return np.array([rng.randint(-9, 9) for _ in range(n)], dtype)


def arrays(
    fabs: list[Client], name: str, n: int, dtype: str, values: list[Any]
) -> list[np.ndarray[Any, Any]]:
    """One ``fab.array`` a rank, rank ``r``'s holding ``values[r]``."""
    made = [fab.array(name, (n,), dtype) for fab in fabs]
    for array, value in zip(made, values, strict=True):
        array[:] = value
    return made


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_allgather_and_reduce_scatter_equal_numpy(
    make_cluster: Callable[..., LocalCluster], placement: tuple[int, ...]
) -> None:
    cluster = make_cluster(3)
    size, k, rng = len(placement), 7, Random(3)
    with ranks(cluster, placement, "gather") as fabs:
        for dtype in ["float32", "int64"]:
            inputs = arrays(fabs, f"in{dtype}", k, dtype, [draw(rng, k, dtype) for _ in fabs])
            outputs = arrays(fabs, f"out{dtype}", size * k, dtype, [-1] * size)
            allgather(fabs, inputs, outputs)
            want = np.concatenate(inputs)
            for output in outputs:
                np.testing.assert_array_equal(output, want)
            for op in ["sum", "avg", "max", "min"]:
                big = arrays(
                    fabs,
                    f"rs{dtype}{op}",
                    size * k,
                    dtype,
                    [draw(rng, size * k, dtype) for _ in fabs],
                )
                small = arrays(fabs, f"rso{dtype}{op}", k, dtype, [-1] * size)
                calls = zip(fabs, big, small, strict=True)
                handles = [f.reduce_scatter_async(x, y, op) for f, x, y in calls]
                results = [wait_or_explain(h, fabs) for h in handles]
                assert {(r.round, r.active) for r in results} == {(0, size)}
                for rank, output in enumerate(small):
                    blocks = [x[rank * k : (rank + 1) * k] for x in big]
                    np.testing.assert_array_equal(output, reference(blocks, op))


def sent(fabs: list[Client], placement: tuple[int, ...]) -> list[int]:
    """Each daemon's ``bytes_sent``: message and collective payload bytes to peers."""
    first = {node: placement.index(node) for node in sorted(set(placement))}
    return [fabs[rank].status()["counters"]["bytes_sent"] for rank in first.values()]


def test_reduce_scatter_sends_a_ring_phase_not_an_allreduce(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """3 nodes, 2 ranks each, 1 MiB float32 inputs: each node sends 2/3 of it for a
    reduce-scatter (and for an allgather of the 1/6 MiB blocks), 4/3 of it for an allreduce
    of the same array, the zero-padded emulation a backend would otherwise run."""
    cluster = make_cluster(3)
    size, k = 6, 2**18 // 6
    n = size * k
    with ranks(cluster, THREE_BY_TWO, "bytes") as fabs:
        before = sent(fabs, THREE_BY_TWO)
        big = arrays(fabs, "big", n, "float32", list(range(size)))
        small = arrays(fabs, "small", k, "float32", [-1] * size)
        handles = [f.reduce_scatter_async(x, y) for f, x, y in zip(fabs, big, small, strict=True)]
        for handle in handles:
            wait_or_explain(handle, fabs)
        assert all((y == 15).all() for y in small)
        after = sent(fabs, THREE_BY_TWO)
        tensor = n * 4
        moved = [b - a for a, b in zip(before, after, strict=True)]
        assert moved == [tensor * 2 // 3] * 3, moved
        allgather(fabs, small, big)
        gathered = [b - a for a, b in zip(after, sent(fabs, THREE_BY_TWO), strict=True)]
        assert gathered == [tensor * 2 // 3] * 3, gathered
        assert all((x == 15).all() for x in big)
        before = sent(fabs, THREE_BY_TWO)
        handles = [f.allreduce_async(x, algorithm="ring") for f, x in zip(fabs, big, strict=True)]
        for handle in handles:
            wait_or_explain(handle, fabs)
        reduced = [b - a for a, b in zip(before, sent(fabs, THREE_BY_TWO), strict=True)]
        assert all(m >= 2 * tensor * 2 // 3 for m in reduced), reduced


def test_calls_that_do_not_fit_are_refused_with_the_reason(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "usage") as fabs:
        fab = fabs[0]
        x, y = fab.array("x", (4,), "float32"), fab.array("y", (8,), "float32")
        wrong = fab.array("w", (7,), "float32")
        ints = fab.array("i", (8,), "int32")
        with pytest.raises(fabricd.UsageError, match="k and size"):
            fab.allgather_async(x, wrong)
        with pytest.raises(fabricd.UsageError, match="one dtype"):
            fab.allgather_async(x, ints)
        with pytest.raises(fabricd.UsageError, match="size \\* k and k"):
            fab.reduce_scatter_async(wrong, x)
        with pytest.raises(fabricd.UsageError, match="op must be"):
            fab.reduce_scatter_async(y, x, "prod")  # type: ignore[arg-type]
        with pytest.raises(fabricd.UsageError, match="1-d"):
            fab.allgather_async(x.reshape(2, 2), y)
        first = fab.reduce_scatter_async(y, x, "max", name="rs")
        other = fabs[1]
        y1, x1 = other.array("y", (8,), "float32"), other.array("x", (4,), "float32")
        with pytest.raises(fabricd.UsageError, match="reduce_scatter max"):
            other.reduce_scatter(y1, x1, "sum", name="rs", timeout=30)
        with pytest.raises(fabricd.UsageError):
            first.wait(timeout=30)
