"""A shard's state as bytes: what a primary sends a replica that joins late or comes back.

Rules: a snapshot is a map of names to ints, floats, strings, None, lists, maps (int or str
keys) and numpy arrays, as each engine's ``state()`` returns it; :func:`encode` turns it into
msgpack, each array an extension (dtype, shape, raw bytes), and :func:`decode` back, refusing
anything else with :class:`~fabricd.errors.RemoteProtocolError`.  The engines' ``restore``
methods check the values (keys, sizes, dtypes) against what the replica opened, so a snapshot
of another model is refused before it replaces anything.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Final

import msgpack
import numpy as np

from fabricd.dtypes import FLOAT_DTYPES
from fabricd.errors import RemoteProtocolError

#: the msgpack extension type of an array
_ARRAY: Final = 1
#: the most dimensions a snapshot's array may have
_MAX_DIMS: Final = 4
#: dtypes a snapshot's arrays may have
_DTYPES: Final = frozenset({*FLOAT_DTYPES, "uint64", "int64", "bool"})
_HEAD: Final = struct.Struct("<B")


def encode(state: dict[str, Any]) -> bytes:
    """``state`` as bytes (module docstring)."""
    data: bytes = msgpack.packb(state, default=_array, use_bin_type=True)
    return data


def _array(value: object) -> msgpack.ExtType:
    if not isinstance(value, np.ndarray) or value.dtype.name not in _DTYPES:
        raise TypeError(f"a snapshot holds no {type(value).__name__}")
    head = msgpack.packb([value.dtype.name, list(value.shape)])
    return msgpack.ExtType(_ARRAY, _HEAD.pack(len(head)) + head + value.tobytes())


def _ext(code: int, data: bytes) -> np.ndarray[Any, Any]:
    if code != _ARRAY or len(data) < 1:
        raise RemoteProtocolError(f"snapshot extension {code}")
    (size,) = _HEAD.unpack_from(data)
    try:
        dtype, shape = msgpack.unpackb(data[1 : 1 + size])
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"snapshot array header: {exc}") from None
    body = data[1 + size :]
    if (
        not isinstance(dtype, str)
        or dtype not in _DTYPES
        or not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
        or len(body) != math.prod(shape) * np.dtype(dtype).itemsize
    ):
        raise RemoteProtocolError(f"snapshot array of {dtype!r} {shape!r} in {len(body)} B")
    dt, dims = np.dtype(dtype), tuple(shape)
    return np.frombuffer(body, dt).reshape(dims).copy()


def decode(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The state :func:`encode` made.

    Raises:
        RemoteProtocolError: not a snapshot.
    """
    try:
        state = msgpack.unpackb(
            bytes(data), ext_hook=_ext, raw=False, strict_map_key=False, use_list=True
        )
    except RemoteProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"malformed snapshot: {exc}") from None
    if not isinstance(state, dict):
        raise RemoteProtocolError("a snapshot is a map")
    _check_values(state)
    return state


def _check_values(value: object) -> None:
    """Refuse a value of a type no engine's state holds (msgpack's own extensions, such as
    its timestamp, decode to other objects).  Iterative: nesting cannot exhaust the stack
    (msgpack bounds its depth anyway)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif item is not None and not isinstance(item, bool | int | float | str | np.ndarray):
            raise RemoteProtocolError(f"a snapshot holds no {type(item).__name__}")


def field(state: dict[Any, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``state[name]``, which must be of ``kind`` (a bool is never an int here)."""
    value = state.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise RemoteProtocolError(f"snapshot field {name!r}: {type(value).__name__}")
    return value


def array(state: dict[Any, Any], name: str, like: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``state[name]``, an array of ``like``'s shape and dtype."""
    value: np.ndarray[Any, Any] = field(state, name, np.ndarray)
    if value.shape != like.shape or value.dtype != like.dtype:
        raise RemoteProtocolError(
            f"snapshot array {name!r} of {value.dtype} {value.shape}, not {like.dtype} {like.shape}"
        )
    return value
