"""The wire form of a push (fabricd/engines/ps/push.py): what :func:`encode` writes,
:func:`decode` reads back exactly, and every malformed form is refused with
:class:`RemoteProtocolError` (the worker's daemon broke the protocol)."""

from __future__ import annotations

import struct
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.filters import Push
from fabricd.errors import RemoteProtocolError

Array = np.ndarray[Any, Any]
DTYPES = ("float16", "float32", "float64")
WIDTHS: dict[int, Literal[16, 32, 64]] = {2: 16, 4: 32, 8: 64}


def dense(values: Array) -> Push:
    return Push(size=values.size, pushed=values.size, indices=None, values=values)


def sparse(size: int, indices: list[int], values: Array) -> Push:
    return Push(size=size, pushed=len(indices), indices=np.array(indices, np.uint32), values=values)


@st.composite
def pushes(draw: st.DrawFn) -> tuple[Push, np.dtype[Any]]:
    """A push of values of one dtype and a model dtype that holds them exactly."""
    values_dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    model = np.dtype(draw(st.sampled_from([d for d in DTYPES if np.dtype(d) >= values_dtype])))
    size = draw(st.integers(1, 40))
    finite = st.floats(allow_nan=False, allow_infinity=False, width=WIDTHS[values_dtype.itemsize])
    if draw(st.booleans()):
        values = np.array(draw(st.lists(finite, min_size=size, max_size=size)), values_dtype)
        return dense(values), model
    indices = sorted(draw(st.sets(st.integers(0, size - 1))))
    values = np.array(draw(st.lists(finite, min_size=len(indices), max_size=len(indices))))
    return sparse(size, indices, values.astype(values_dtype)), model


@settings(max_examples=200)
@given(pushes())
def test_round_trip(case: tuple[Push, np.dtype[Any]]) -> None:
    push, model = case
    data = ps_push.encode(push)
    assert len(data) == ps_push.encoded_size(push)
    out = ps_push.decode(data, push.size, model)
    assert out.dtype == model
    assert out.shape == (push.size,)
    np.testing.assert_array_equal(out, push.dense().astype(model))
    assert ps_push.decode(memoryview(bytes(data)), push.size, model).tobytes() == out.tobytes()


def test_layout() -> None:
    """The header and body are laid out as the module docstring says."""
    data = ps_push.encode(sparse(10, [2, 7], np.array([1.5, -2.0], np.float32)))
    assert ps_push.HEADER.unpack_from(data) == (ps_push.SPARSE, 4, 0, 0, 10, 2)
    assert np.frombuffer(data, "<u4", 2, ps_push.HEADER.size).tolist() == [2, 7]
    assert np.frombuffer(data, "<f4", 2, ps_push.HEADER.size + 8).tolist() == [1.5, -2.0]
    empty = ps_push.encode(sparse(3, [], np.zeros(0, np.float16)))
    assert len(empty) == ps_push.HEADER.size
    assert ps_push.decode(empty, 3, np.dtype("float16")).tolist() == [0, 0, 0]


def header(kind: int, item: int, size: int, count: int, r1: int = 0, r2: int = 0) -> bytes:
    return ps_push.HEADER.pack(kind, item, r1, r2, size, count)


def f32(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


def u32(*values: int) -> bytes:
    return np.array(values, "<u4").tobytes()


GOOD_DENSE = header(0, 4, 3, 3) + f32(1, 2, 3)
GOOD_SPARSE = header(1, 4, 3, 2) + u32(0, 2) + f32(1, 2)

MALFORMED = {
    "empty": b"",
    "short header": GOOD_DENSE[: ps_push.HEADER.size - 1],
    "reserved u16": header(0, 4, 3, 3, r1=1) + f32(1, 2, 3),
    "reserved u32": header(0, 4, 3, 3, r2=1 << 31) + f32(1, 2, 3),
    "size lies": header(0, 4, 4, 4) + f32(1, 2, 3, 4),
    "dense count lies": header(0, 4, 3, 2) + f32(1, 2),
    "sparse count over size": header(1, 4, 3, 4) + u32(0, 1, 2, 2) + f32(1, 2, 3, 4),
    "unknown kind": header(2, 4, 3, 3) + f32(1, 2, 3),
    "itemsize 3": header(0, 3, 3, 3) + b"\0" * 9,
    "itemsize 0": header(0, 0, 3, 3),
    "dense one byte short": GOOD_DENSE[:-1],
    "dense one byte long": GOOD_DENSE + b"\0",
    "sparse missing values": header(1, 4, 3, 2) + u32(0, 2),
    "sparse one byte long": GOOD_SPARSE + b"\0",
    "indices unsorted": header(1, 4, 3, 2) + u32(2, 0) + f32(1, 2),
    "indices duplicate": header(1, 4, 3, 2) + u32(1, 1) + f32(1, 2),
    "index out of range": header(1, 4, 3, 2) + u32(0, 3) + f32(1, 2),
    "index far out of range": header(1, 4, 3, 1) + u32(2**32 - 1) + f32(1),
    "dense nan": header(0, 4, 3, 3) + f32(1, float("nan"), 3),
    "dense inf": header(0, 4, 3, 3) + f32(1, 2, float("inf")),
    "sparse -inf": header(1, 4, 3, 2) + u32(0, 2) + f32(1, float("-inf")),
    "float64 for float32": header(0, 8, 3, 3) + np.array([1, 2, 3], "<f8").tobytes(),
    "sparse float64 for float32": header(1, 8, 3, 1) + u32(1) + np.array([1], "<f8").tobytes(),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_refused(name: str) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed push"):
        ps_push.decode(MALFORMED[name], 3, np.dtype("float32"))


def test_good_forms_of_the_malformed_table() -> None:
    """The table's malformations are each one change from these, which decode."""
    assert ps_push.decode(GOOD_DENSE, 3, np.dtype("float32")).tolist() == [1, 2, 3]
    assert ps_push.decode(GOOD_SPARSE, 3, np.dtype("float32")).tolist() == [1, 0, 2]


def test_float16_nan_and_wider_models() -> None:
    """A float16 push is refused for its NaN whatever the model; float16 and float32 values
    are taken into wider models; float32 into float16 is refused (it would round)."""
    nan = header(0, 2, 2, 2) + np.array([1, np.nan], "<f2").tobytes()
    for model in DTYPES:
        with pytest.raises(RemoteProtocolError):
            ps_push.decode(nan, 2, np.dtype(model))
    half = header(0, 2, 2, 2) + np.array([0.5, -3], "<f2").tobytes()
    assert ps_push.decode(half, 2, np.dtype("float64")).tolist() == [0.5, -3]
    with pytest.raises(RemoteProtocolError):
        ps_push.decode(header(0, 4, 2, 2) + f32(1, 2), 2, np.dtype("float16"))


@settings(max_examples=200)
@given(st.binary(max_size=80), st.integers(1, 6))
def test_arbitrary_bytes_decode_or_refuse(data: bytes, size: int) -> None:
    """Any bytes either decode to ``size`` finite float32s or are refused."""
    try:
        out = ps_push.decode(data, size, np.dtype("float32"))
    except RemoteProtocolError:
        return
    assert out.shape == (size,)
    assert np.isfinite(out).all()


@settings(max_examples=100)
@given(pushes(), st.data())
def test_one_flipped_byte_never_passes_silently(
    case: tuple[Push, np.dtype[Any]], data: st.DataObject
) -> None:
    """A corrupted push decodes to an update of the right size or is refused: never an
    exception of another kind, never a value that is not finite."""
    push, model = case
    encoded = ps_push.encode(push)
    at = data.draw(st.integers(0, len(encoded) - 1))
    encoded[at] ^= data.draw(st.integers(1, 255))
    try:
        out = ps_push.decode(encoded, push.size, model)
    except RemoteProtocolError:
        return
    assert out.shape == (push.size,)
    assert np.isfinite(out).all()


def test_header_struct_is_24_bytes() -> None:
    assert ps_push.HEADER.size == struct.calcsize("<BBHIQQ") == 24
