"""bfloat16 in the daemons' reductions and in the torch staging (issue 30, item 3).

The reference is torch.bfloat16's own CPU arithmetic: each operation in float32, rounded to
bfloat16 to nearest, ties to even, a NaN staying a NaN.  A collective's compute step
(:func:`fabricd.engines.collectives.computes.compute`) must give exactly that, for every
bfloat16 value as one operand: ties, overflow to infinity, infinities, NaN, subnormals and
signed zeros included.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from fabricd.client import checks
from fabricd.dtypes import BFLOAT16, ITEMSIZE, REDUCE_DTYPES, exact_count, is_float
from fabricd.engines.collectives.computes import compute
from fabricd.engines.collectives.landing import raw
from fabricd.torch import hook
from fabricd.torch.staging import REDUCED_AS, array_of, tensor_of

#: every bfloat16, by its bits
EVERY = np.arange(2**16, dtype=np.uint16).view(BFLOAT16)


def as_torch(array: np.ndarray[Any, Any]) -> torch.Tensor:
    return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)


def bits(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    return tensor.view(torch.int16).numpy().view(np.uint16)


def assert_torchs(got: np.ndarray[Any, Any], want: torch.Tensor) -> None:
    """Equal bit for bit, any NaN to any NaN (torch writes 0x7FC0, numpy keeps a payload)."""
    nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan, torch.isnan(want.float()).numpy())
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], bits(want)[~nan])


def partners(seed: int) -> np.ndarray[Any, Any]:
    """A bfloat16 partner for each of :data:`EVERY`: random bits (any exponent, NaN too)."""
    return np.random.default_rng(seed).integers(0, 2**16, 2**16, dtype=np.uint16).view(BFLOAT16)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("fn", "fold"), [("sum", torch.add), ("max", torch.maximum), ("min", torch.minimum)]
)
def test_every_bfloat16_reduces_as_torch_does(seed: int, fn: str, fold: Any) -> None:
    other = partners(seed)
    out = np.empty_like(EVERY)
    with np.errstate(all="ignore"):  # inf - inf, overflow, NaN in max: numpy's flags
        compute(fn, out, [EVERY, other], size=2)
    want = fold(as_torch(EVERY), as_torch(other))
    if fn == "sum":
        assert_torchs(out, want)
    else:  # of 0 and -0 either is the maximum: equal values
        np.testing.assert_array_equal(out.astype(np.float32), want.float().numpy())


@pytest.mark.parametrize("size", [2, 3, 5, 7, 256])
def test_an_average_divides_every_bfloat16_as_torch_does(size: int) -> None:
    out = np.empty_like(EVERY)
    with np.errstate(all="ignore"):  # (signalling NaNs, subnormals lost: numpy's flags)
        compute("div", out, [EVERY], size=size)
    assert_torchs(out, as_torch(EVERY) / size)


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (1.0, 2.0**-8, 1.0),  # a tie: to the even significand
        (1.0 + 2.0**-7, 2.0**-8, 1.0 + 2.0**-6),  # a tie: up to the even one
        (1.0, 3 * 2.0**-9, 1.0 + 2.0**-7),  # past the tie: up
        (float(ml_dtypes.finfo(BFLOAT16).max), 2.0**119, float("inf")),  # half an ulp: over
        (float(ml_dtypes.finfo(BFLOAT16).max), 2.0**118, float(ml_dtypes.finfo(BFLOAT16).max)),
        (-3e38, -3e38, float("-inf")),
        (2.0**-133, 2.0**-133, 2.0**-132),  # subnormals add exactly
        (2.0**-127, 2.0**-127, 2.0**-126),  # into the smallest normal
        (2.0**-126, -(2.0**-133), 2.0**-126 - 2.0**-133),  # out of it
        (float("inf"), -1e38, float("inf")),
    ],
)
def test_rounding_to_nearest_even_at_the_edges(a: float, b: float, want: float) -> None:
    out = np.empty(1, BFLOAT16)
    with np.errstate(over="ignore"):
        compute("sum", out, [np.array([a], BFLOAT16), np.array([b], BFLOAT16)], size=2)
    assert float(out[0]) == want
    assert float((torch.tensor([a]).bfloat16() + torch.tensor([b]).bfloat16())[0]) == want


def test_nan_stays_nan_and_signed_zeros_add_as_ieee_says() -> None:
    nan, inf = float("nan"), float("inf")
    a = np.array([nan, inf, -0.0, 0.0, -0.0], BFLOAT16)
    b = np.array([1.0, -inf, -0.0, -0.0, 0.0], BFLOAT16)
    out = np.empty_like(a)
    with np.errstate(invalid="ignore"):
        compute("sum", out, [a, b], size=2)
    assert np.isnan(out[:2].astype(np.float32)).all()
    assert list(out[2:].view(np.uint16)) == [0x8000, 0, 0]  # -0 + -0 = -0; else +0


def test_float32_to_bfloat16_rounds_as_torch_for_any_bits() -> None:
    """The one rounding every step ends with, over random float32 bit patterns."""
    rng = np.random.default_rng(5)
    floats = rng.integers(0, 2**32, 2**20, dtype=np.uint32).view(np.float32)
    with np.errstate(all="ignore"):  # (NaNs and overflows: numpy's flags)
        rounded = floats.astype(BFLOAT16)
    assert_torchs(rounded, torch.from_numpy(floats).bfloat16())


def test_bfloat16_is_a_reduced_type_of_two_bytes() -> None:
    assert ITEMSIZE["bfloat16"] == 2
    assert "bfloat16" in REDUCE_DTYPES
    assert np.dtype("bfloat16") == BFLOAT16  # registered with numpy on import
    assert checks.dtype("bfloat16") == BFLOAT16
    assert checks.dtype(ml_dtypes.bfloat16) == BFLOAT16
    assert is_float(BFLOAT16)
    assert not is_float(np.dtype("int32"))
    assert (exact_count("bfloat16"), exact_count("float16"), exact_count("int64")) == (
        256,
        2048,
        2**63 - 1,
    )


def test_a_bfloat16_arrays_bytes_are_its_memory() -> None:
    """numpy's buffer protocol refuses bfloat16; what a send hands the transport is the same
    memory as bytes."""
    array = np.arange(5, dtype=np.float32).astype(BFLOAT16)
    with pytest.raises(ValueError, match="cannot include dtype"):
        memoryview(array)
    view = raw(array)
    assert (view.format, view.nbytes) == ("B", 10)
    view[0:2] = np.array([7.0], BFLOAT16).view(np.uint8).tobytes()
    assert array[0] == 7


def test_the_torch_staging_carries_bfloat16_as_bfloat16_in_the_same_memory() -> None:
    assert REDUCED_AS[torch.bfloat16] == "bfloat16"
    assert hook._carried(torch.bfloat16) == "bfloat16"  # DDP's buckets: 2 bytes a gradient
    array = np.zeros(4, BFLOAT16)
    tensor = tensor_of(array)
    assert tensor.dtype == torch.bfloat16
    tensor.copy_(torch.tensor([1.5, -2.0, 3.0, 2.0**-130]))
    assert list(array.astype(np.float32)) == [1.5, -2.0, 3.0, 2.0**-130]
    back = array_of(tensor)
    assert back.dtype == BFLOAT16
    assert np.shares_memory(back, array)
    plain = np.zeros(3, np.float32)
    assert tensor_of(plain).dtype == torch.float32
    assert np.shares_memory(array_of(tensor_of(plain)), plain)
