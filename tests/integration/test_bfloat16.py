"""bfloat16 through real daemons (issue 30, item 3): reductions against torch.bfloat16's own
arithmetic, bit for bit, and every collective that carries a dtype.

A reduction step adds two bfloat16 arrays in float32 and rounds to bfloat16, to nearest, ties
to even (what torch does on the CPU, and gloo between ranks), so over two ranks the daemons'
sum must be torch's ``a + b`` exactly, its special cases included: ties, overflow to
infinity, infinities, NaN, subnormals and signed zeros.  Over more ranks every partial sum is
rounded, in an order the algorithm picks: the result is checked against the exact sum with the
bound that gives (each rounding is off by at most half a unit in the last place).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import pytest

# torch is in the test extra: its bfloat16 arithmetic is the reference
import torch

import fabricd
from tests.integration.test_collectives import ranks, wait_or_explain

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import Client
    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.timeout(240)

BF16 = np.dtype(ml_dtypes.bfloat16)
MAX = float(ml_dtypes.finfo(BF16).max)  #: (2 - 2**-7) * 2**127, an odd significand
#: pairs (rank 0's value, rank 1's value) whose sum is a special case of rounding
SPECIAL = [
    (1.0, 2.0**-8),  # a tie: rounds to the even 1
    (1.0 + 2.0**-7, 2.0**-8),  # a tie: rounds to the even 1 + 2**-6
    (-1.0 - 2.0**-7, -(2.0**-8)),  # the same, negative
    (1.0, 3 * 2.0**-9),  # above the tie: up
    (MAX, 2.0**119),  # max plus half its ulp: a tie, rounded up to the even infinity
    (MAX, MAX),  # overflow
    (-MAX, -MAX),
    (float("inf"), 1.0),
    (float("inf"), float("-inf")),  # NaN
    (float("nan"), 1.0),
    (2.0**-133, 2.0**-133),  # the smallest subnormals
    (2.0**-126, -(2.0**-133)),  # a normal minus a subnormal: a subnormal
    (2.0**-127, 2.0**-127),  # two subnormals make the smallest normal
    (-0.0, -0.0),
    (0.0, -0.0),
    (1e38, 1e-38),
]


def bf16_values(rng: np.random.Generator, n: int, rank: int | None = None) -> np.ndarray:
    """``n`` bfloat16 values over many exponents; rank 0's or 1's half of :data:`SPECIAL` first."""
    scales = 2.0 ** rng.integers(-30, 30, n)
    values = (rng.standard_normal(n) * scales).astype(np.float32).astype(BF16)
    if rank is not None:
        values[: len(SPECIAL)] = [pair[rank] for pair in SPECIAL]
    return values


def as_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)


def assert_same_bits(got: np.ndarray, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit, but any NaN equals any NaN (torch writes 0x7FC0, numpy keeps
    the payload)."""
    mine = got.view(np.uint16)
    theirs = want.view(torch.int16).numpy().view(np.uint16)
    both_nan = np.isnan(got.astype(np.float32)) & torch.isnan(want.float()).numpy()
    differ = np.flatnonzero((mine != theirs) & ~both_nan)
    assert not differ.size, (
        f"{what}: {differ.size} elements differ from torch, first at {differ[:5]}: "
        f"fabricd {got[differ[:5]]}, torch {want[differ[:5]]}"
    )


def start(fabs: list[Client], call: Callable[[Client, int], Any]) -> list[Any]:
    """Every rank's ``call(fab, rank)`` started, then waited for."""
    handles = [call(fab, rank) for rank, fab in enumerate(fabs)]
    return [wait_or_explain(handle, fabs) for handle in handles]


TORCH_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "avg": lambda a, b: (a + b) / 2,
    "max": torch.maximum,
    "min": torch.minimum,
}


@pytest.mark.parametrize("algorithm", ["doubling", "ring", "tree", "mlfabric"])
def test_two_ranks_reduce_as_torch_does_bit_for_bit(
    make_cluster: Callable[..., LocalCluster], algorithm: str
) -> None:
    cluster = make_cluster(2)
    rng = np.random.default_rng(7)
    n = 50_001  # odd: the ring's chunks differ in size
    with ranks(cluster, (0, 1), f"bf16-{algorithm}") as fabs:
        arrays = [fab.array("g", (n,), "bfloat16") for fab in fabs]
        assert all(a.dtype == BF16 for a in arrays)
        for op, fold in TORCH_OPS.items():
            inputs = [bf16_values(rng, n, rank) for rank in range(2)]
            for array, given in zip(arrays, inputs, strict=True):
                array[:] = given
            results = start(
                fabs, lambda fab, r, op=op: fab.allreduce_async(arrays[r], op, algorithm=algorithm)
            )
            assert all(res.active == 2 and res.included for res in results)
            want = fold(as_torch(inputs[0]), as_torch(inputs[1]))
            for rank, array in enumerate(arrays):
                if op in ("max", "min"):  # of 0 and -0 either is right: equal values
                    np.testing.assert_array_equal(array.astype(np.float32), want.float().numpy())
                else:
                    assert_same_bits(array, want, f"{op} {algorithm} rank {rank}")


@pytest.mark.parametrize("algorithm", ["doubling", "ring", "auto", "mlfabric"])
def test_more_ranks_round_each_partial_sum_within_the_bound(
    make_cluster: Callable[..., LocalCluster], algorithm: str
) -> None:
    """Five ranks on three nodes (two reduce on one node first): every rank holds the same
    bits, within (ranks - 1) half-ulps of the partial sums of the exact sum.  ``"auto"``
    runs the direct exchange (3 nodes, past ``ring_from_bytes``)."""
    placement = (0, 1, 2, 0, 1)
    cluster = make_cluster(3, ring_from_bytes=4096)
    rng = np.random.default_rng(11)
    n = 20_000
    with ranks(cluster, placement, f"bf16-5-{algorithm}") as fabs:
        arrays = [fab.array("g", (n,), "bfloat16") for fab in fabs]
        inputs = [bf16_values(rng, n) for _ in fabs]
        for array, given in zip(arrays, inputs, strict=True):
            array[:] = given
        start(fabs, lambda fab, r: fab.allreduce_async(arrays[r], "sum", algorithm=algorithm))
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        # a partial sum is at most the sum of magnitudes; half an ulp is at most 2**-8 of it
        bound = (
            (len(fabs) - 1) * 2.0**-8 * np.sum([np.abs(x.astype(np.float64)) for x in inputs], 0)
        )
        for array in arrays:
            np.testing.assert_array_equal(array.view(np.uint16), arrays[0].view(np.uint16))
            assert np.all(np.abs(array.astype(np.float64) - exact) <= bound + 2.0**-133)


def test_the_other_collectives_carry_bfloat16(make_cluster: Callable[..., LocalCluster]) -> None:
    """reduce_scatter (as torch sums), allgather, broadcast and a message: bfloat16 both ways,
    two bytes an element."""
    cluster = make_cluster(2)
    rng = np.random.default_rng(3)
    k = 1000
    with ranks(cluster, (0, 1), "bf16-others") as fabs:
        big = [fab.array("big", (2 * k,), "bfloat16") for fab in fabs]
        small = [fab.array("small", (k,), "bfloat16") for fab in fabs]
        assert big[0].nbytes == 4 * k
        inputs = [bf16_values(rng, 2 * k) for _ in fabs]
        for array, given in zip(big, inputs, strict=True):
            array[:] = given
        start(fabs, lambda fab, r: fab.reduce_scatter_async(big[r], small[r], "sum"))
        for rank, array in enumerate(small):
            part = slice(rank * k, (rank + 1) * k)
            want = as_torch(inputs[0][part]) + as_torch(inputs[1][part])
            assert_same_bits(array, want, f"reduce_scatter rank {rank}")
        mine = [bf16_values(rng, k, rank) for rank in range(2)]
        for array, given in zip(small, mine, strict=True):
            array[:] = given
        start(fabs, lambda fab, r: fab.allgather_async(small[r], big[r]))
        for array in big:
            np.testing.assert_array_equal(
                array.view(np.uint16), np.concatenate(mine).view(np.uint16)
            )
        small[1][:] = 0
        start(fabs, lambda fab, r: fab.broadcast_async(small[r], root=0))
        np.testing.assert_array_equal(small[1].view(np.uint16), mine[0].view(np.uint16))
        sent = bf16_values(rng, k, 1)
        small[0][:] = sent
        receive = fabs[1].recv_async(small[1], src=0, tag=5)
        fabs[0].send(small[0], to=1, tag=5, timeout=60)
        receive.wait(timeout=60)
        np.testing.assert_array_equal(small[1].view(np.uint16), sent.view(np.uint16))


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_partial_modes_refuse_jobs_their_count_cannot_hold(
    make_cluster: Callable[..., LocalCluster], mode: str
) -> None:
    """A partial allreduce counts its active ranks in one more element of the array: in
    bfloat16 exactly up to 256, so a larger job is told to use float32 (a sync one is not)."""
    cluster = make_cluster(1)
    with contextlib.closing(
        fabricd.connect(job="big", rank=0, size=257, socket_path=cluster.nodes[0].socket_path)
    ) as fab:
        g = fab.array("g", (8,), "bfloat16")
        with pytest.raises(fabricd.UsageError, match=r"exactly up to 256 ranks, not 257"):
            fab.allreduce_async(g, "sum", mode).wait(timeout=60)


@pytest.mark.parametrize("algorithm", ["doubling", "ring"])
def test_bfloat16_sends_half_the_bytes_of_float32(
    make_cluster: Callable[..., LocalCluster], algorithm: str
) -> None:
    """What the daemons send each other for one allreduce of n elements: bfloat16 half of
    float32's, byte for byte (payload counters)."""
    cluster = make_cluster(2)
    n = 100_000
    with ranks(cluster, (0, 1), f"bf16-bytes-{algorithm}") as fabs:
        sent = {}
        for dtype in ("float32", "bfloat16"):
            arrays = [fab.array(f"g-{dtype}", (n,), dtype) for fab in fabs]
            for array in arrays:
                array[:] = 1
            start(fabs, lambda fab, r, a=arrays: fab.allreduce_async(a[r], algorithm=algorithm))
            before = [fab.status()["counters"]["bytes_sent"] for fab in fabs]
            start(fabs, lambda fab, r, a=arrays: fab.allreduce_async(a[r], algorithm=algorithm))
            after = [fab.status()["counters"]["bytes_sent"] for fab in fabs]
            sent[dtype] = [b - a for a, b in zip(before, after, strict=True)]
            assert all(float(x) == 4 for a in arrays for x in a[:3])  # 1 + 1, twice
    assert sent["float32"] == [4 * n, 4 * n]  # (2 nodes: each sends the other its array once)
    assert sent["bfloat16"] == [2 * n, 2 * n]
