"""Checks of what a caller passes, made before anything is sent to the daemon.

A wrong argument must never reach the wire: msgpack would raise its own TypeError on a numpy
integer, and the daemon hangs up on a request with a float or a bool where an int belongs (a
protocol error).  Each check here takes the value as given and returns it in the one type the
wire carries, or raises :class:`~fabricd.errors.UsageError` naming the argument and what it
accepts.

Integers are taken through ``operator.index``, so numpy integers work; bools (an ``int`` to
Python), floats and strings are refused.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from fabricd.dtypes import ITEMSIZE
from fabricd.errors import UsageError
from fabricd.ipc import MAX_JOB_NAME
from fabricd.wire import MAX_TAG

#: the largest job size the protocol carries (ANNOUNCE ``size``)
MAX_SIZE: Final = MAX_TAG + 1
_SHOWN: Final = 40  #: characters of a refused value quoted in a message


@dataclass(frozen=True, slots=True, kw_only=True)
class Membership:
    """A checked place in a job: ``0 <= rank < size``, a job name of 1..200 characters."""

    job: str
    rank: int
    size: int


def integer(value: object, name: str, accepts: str) -> int:
    """``value`` as an int; ``accepts`` ends the message ("an int in 0..9") if it is none."""
    if isinstance(value, bool | np.bool_):
        raise UsageError(f"{name} must be {accepts}, not a bool ({value})")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # refused below if not an index
    except TypeError:
        raise UsageError(f"{name} must be {accepts}, not {_show(value)}") from None


def membership(job: object, rank: object, size: object) -> Membership:
    """Check a job to join: a name of 1..200 characters, ``0 <= rank < size``."""
    if not isinstance(job, str) or not 1 <= len(job) <= MAX_JOB_NAME:
        shown = f"one of {len(job)} characters" if isinstance(job, str) else _show(job)
        raise UsageError(f"job must be a str of 1..{MAX_JOB_NAME} characters, not {shown}")
    size = integer(size, "size", f"an int in 1..{MAX_SIZE}")
    if not 1 <= size <= MAX_SIZE:
        raise UsageError(f"size {size} is outside 1..{MAX_SIZE}")
    rank = integer(rank, "rank", f"an int in 0..{size - 1}")
    if not 0 <= rank < size:
        raise UsageError(f"rank {rank} is outside a job of size {size}")
    return Membership(job=job, rank=rank, size=size)


def peer(value: object, name: str, job: Membership) -> int:
    """Check the other rank of a send (``to``) or receive (``src``)."""
    if type(value) is int and 0 <= value < job.size:  # the usual case, in one test
        return value
    rank = integer(value, name, f"an int rank in 0..{job.size - 1}")
    if not 0 <= rank < job.size:
        raise UsageError(f"rank {rank} is outside job {job.job!r} of size {job.size}")
    return rank


def tag(value: object) -> int:
    """Check a message tag: an int in 0..2**31-1."""
    if type(value) is int and 0 <= value <= MAX_TAG:  # the usual case, in one test
        return value
    number = integer(value, "tag", f"an int in 0..{MAX_TAG}")
    if not 0 <= number <= MAX_TAG:
        raise UsageError(f"tag {number} is outside 0..{MAX_TAG}")
    return number


def timeout(value: object) -> float | None:
    """Check a timeout in seconds: ``None`` or a real number (``inf`` is returned as ``None``).

    ``None`` and ``inf`` wait as long as it takes; zero or less does not wait at all.
    """
    if value is None:
        return None
    if type(value) is float or type(value) is int:  # the usual cases: no ABC check (0.3 us)
        seconds = float(value)
    elif isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        shown = f"a bool ({value})" if isinstance(value, bool | np.bool_) else _show(value)
        raise UsageError(f"timeout must be None or a number of seconds, not {shown}")
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise UsageError("timeout must be None or a number of seconds, not nan")
    return None if seconds == math.inf else seconds


#: the longest spin a client may ask for: past this a sleep costs less than the core it keeps
MAX_SPIN: Final = 0.01


def spin(value: object) -> float:
    """Check a spin (:func:`fabricd.connect`): seconds in ``0..MAX_SPIN`` (0: never spin)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise UsageError(f"spin must be a number of seconds in 0..{MAX_SPIN:g}, not {_show(value)}")
    seconds = float(value)
    if not 0 <= seconds <= MAX_SPIN:  # (NaN fails this too)
        raise UsageError(f"spin must be a number of seconds in 0..{MAX_SPIN:g}, not {seconds!r}")
    return seconds


def socket_path(value: object) -> str | None:
    """Check a socket path: ``None``, a str, or a path object (``pathlib.Path``, bytes)."""
    if value is None or isinstance(value, str):
        return value
    try:
        return os.fsdecode(value)  # type: ignore[arg-type]  # refused below if not a path
    except TypeError:
        raise UsageError(f"socket_path must be a str or a path, not {_show(value)}") from None


def array_name(value: object) -> str:
    """Check the name of a ``fab.array``: a non-empty str."""
    if not isinstance(value, str) or not value:
        raise UsageError(f"an array's name must be a non-empty str, not {_show(value)}")
    return value


def shape(value: object) -> tuple[int, ...]:
    """Check a shape: an int, or a sequence of ints, none negative."""
    dims: tuple[int, ...]
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__") or _zero_d(value):
        dims = (integer(value, "shape", "an int or a sequence of ints"),)
    else:
        dims = tuple(integer(d, "each dimension of shape", "an int") for d in value)
    if any(d < 0 for d in dims):
        raise UsageError(f"shape {dims} has a negative dimension")
    return dims


def dtype(value: object) -> np.dtype[Any]:
    """Check a dtype: one of :data:`fabricd.dtypes.ITEMSIZE`, by name or as a numpy dtype."""
    dt: np.dtype[Any] | None = None
    if value is not None:  # np.dtype(None) would be float64
        with contextlib.suppress(Exception):  # numpy's parser raises SyntaxError too
            dt = np.dtype(value)  # type: ignore[call-overload]
    if dt is None or dt.name not in ITEMSIZE or not dt.isnative:
        supported = ", ".join(ITEMSIZE)
        raise UsageError(f"dtype {_show(value)} is not supported; use one of {supported}")
    return dt


def _zero_d(value: object) -> bool:
    """Whether ``value`` is a 0-d numpy array: iterable by type, but not by value."""
    return isinstance(value, np.ndarray) and value.ndim == 0


def _show(value: object) -> str:
    """A refused value for a message: its type and a bounded repr."""
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[: _SHOWN - 3] + "..."
    return f"{type(value).__name__} {text}"
