"""The wire form of one push: a :class:`~fabricd.engines.ps.filters.Push` as the bytes a PUSH
frame carries, and back.

Rules: the worker's daemon encodes what its gradient filter let through; the server's daemon
decodes it into a dense update of the shard's size (0 where nothing was pushed) before the
update rule sees it.  A malformed push (a header that lies, indices out of order or range, a
value of a dtype the model does not hold exactly, a NaN or an infinity) raises
:class:`~fabricd.errors.RemoteProtocolError` before anything is allocated from it: the
worker's daemon broke the protocol.

Layout (little-endian)::

    u8  kind        0 dense, 1 sparse
    u8  itemsize    bytes per value: 2 (float16, G-LNP), 4 or 8
    u16 reserved    0
    u32 reserved    0
    u64 size        elements of the whole (shard's) gradient
    u64 count       values that follow: ``size`` when dense
    [u32 or u64 indices]   sparse only, strictly ascending, each < size (u64 past 2**32)
    values          ``count`` floats of ``itemsize`` bytes
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from fabricd.engines.ps.filters import Push

Array = np.ndarray[Any, Any]

#: the header of an encoded push (module docstring)
HEADER: Final = struct.Struct("<BBHIQQ")
DENSE: Final = 0
SPARSE: Final = 1
_VALUES: Final[dict[int, np.dtype[Any]]] = {
    2: np.dtype("<f2"),
    4: np.dtype("<f4"),
    8: np.dtype("<f8"),
}


def _index_dtype(size: int) -> np.dtype[Any]:
    return np.dtype("<u4" if size <= 2**32 else "<u8")


def encoded_size(push: Push) -> int:
    """Bytes of :func:`encode`'s output for ``push``."""
    indices = 0 if push.indices is None else push.values.size * _index_dtype(push.size).itemsize
    return HEADER.size + indices + push.values.nbytes


def encode(push: Push) -> bytearray:
    """``push`` as a PUSH frame's payload."""
    item = push.values.dtype.itemsize
    kind = DENSE if push.indices is None else SPARSE
    out = bytearray(encoded_size(push))
    HEADER.pack_into(out, 0, kind, item, 0, 0, push.size, push.values.size)
    offset = HEADER.size
    if push.indices is not None:
        index = _index_dtype(push.size)
        np.frombuffer(out, index, push.indices.size, offset)[:] = push.indices
        offset += index.itemsize * push.indices.size
    np.frombuffer(out, _VALUES[item], push.values.size, offset)[:] = push.values
    return out


def decode(data: bytes | bytearray | memoryview, size: int, dtype: np.dtype[Any]) -> Array:
    """The dense update (``size`` elements of ``dtype``, 0 where nothing was pushed) that an
    encoded push holds.

    Raises:
        RemoteProtocolError: the push is malformed, is for a gradient of another size, holds
            values ``dtype`` would round, or a value that is not finite.
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise _refuse(f"{len(view)} B is shorter than its header")
    kind, item, reserved, reserved2, whole, count = HEADER.unpack_from(view, 0)
    if reserved or reserved2:
        raise _refuse("reserved header fields are not 0")
    if whole != size:
        raise _refuse(f"an update of {whole} elements for a shard of {size}")
    values_dtype = _VALUES.get(item)
    if values_dtype is None or not np.can_cast(values_dtype, dtype, "safe"):
        raise _refuse(f"values of {item} B for a model of {dtype}")
    if kind == DENSE:
        indices_bytes, index = 0, None
        if count != size:
            raise _refuse(f"a dense update of {count} values for {size} elements")
    elif kind == SPARSE:
        if count > size:
            raise _refuse(f"a sparse update of {count} values for {size} elements")
        index = _index_dtype(size)
        indices_bytes = count * index.itemsize
    else:
        raise _refuse(f"unknown kind {kind}")
    if len(view) != HEADER.size + indices_bytes + count * item:
        raise _refuse(f"{len(view)} B for {count} values of {item} B (kind {kind})")
    values = np.frombuffer(view, values_dtype, count, HEADER.size + indices_bytes)
    if not np.isfinite(values).all():
        raise _refuse("a value that is not finite")
    if index is None:
        dense: Array = values.astype(dtype)
        return dense
    indices = np.frombuffer(view, index, count, HEADER.size)
    if count and (int(indices[-1]) >= size or np.any(indices[1:] <= indices[:-1])):
        raise _refuse("indices that are not strictly ascending below the size")
    out = np.zeros(size, dtype)
    out[indices] = values
    return out


def _refuse(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed push: {message}")
