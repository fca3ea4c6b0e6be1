"""The in-place allreduce of a node's only rank on real daemons (issue 22 items 2 and 3).

Rank processes' arrays are shared memory the daemons map; with ``ring_from_bytes`` low, a
sync allreduce of one rank per node runs in place, round the ring (2 nodes) or by direct
exchange (3 and 4), and a layout mixing nodes of one rank and of two runs both paths in one
collective.  Every round, each rank writes its next input as soon as its call completes:
a daemon that still read the array (a send still queued) or wrote it (a landing) after the
completion would show up in some rank's result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.integration.test_collectives import ranks, reference

#: 64 KiB: every allreduce here large enough for the ring and its direct exchange
SETTINGS = {"ring_from_bytes": 65536}


@pytest.mark.parametrize(
    "placement", [(0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 0, 1, 2)], ids=lambda p: f"{p}"
)
def test_in_place_rounds_equal_numpy_with_ranks_writing_at_once(
    make_cluster: Any, placement: tuple[int, ...]
) -> None:
    cluster = make_cluster(max(placement) + 1, **SETTINGS)
    rng = np.random.default_rng(len(placement))
    with ranks(cluster, placement, f"inplace{len(placement)}") as fabs:
        for dtype, count in (("float32", 300_000), ("int64", 40_001), ("float64", 17_003)):
            arrays = [f.array(f"x-{dtype}", (count,), dtype) for f in fabs]
            for op in ("sum", "avg", "max", "min"):
                inputs = [rng.integers(-50, 50, count).astype(dtype) for _ in fabs]
                for a, x in zip(arrays, inputs, strict=True):
                    a[:] = x
                for _ in range(3):  # the persistent schedule, round after round
                    handles = [
                        f.allreduce_async(a, op, "sync") for f, a in zip(fabs, arrays, strict=True)
                    ]
                    results, following = [], []
                    for a, h in zip(arrays, handles, strict=True):
                        results.append((h.wait(timeout=60.0), a.copy()))
                        nxt = rng.integers(-50, 50, count).astype(dtype)
                        a[:] = nxt  # at once: the daemon must be done with it
                        following.append(nxt)
                    want = reference(inputs, op)
                    for res, got in results:
                        assert res.active == len(placement)
                        np.testing.assert_allclose(
                            got.astype("float64"), want.astype("float64"), rtol=3e-3, atol=1e-3
                        )
                    assert all(np.array_equal(results[0][1], got) for _, got in results)
                    inputs = following
        rows = [
            row
            for f in fabs[:1]
            for row in f.status()["collectives"]
            if ":x-" in row["name"]  # named after the array
        ]
        algorithm = "ring" if max(placement) == 1 else "direct exchange"
        assert {row["algorithm"] for row in rows} == {algorithm}
        assert sum(row["calls"] for row in rows) == 3 * 4 * 3 * placement.count(0)
