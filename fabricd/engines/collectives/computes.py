"""The compute operations of a collective's schedule, on numpy arrays in place: the functions
:mod:`~fabricd.engines.collectives.algorithms` names (``sum``, ``max``, ``min``, ``copy``,
``div``).

Split from :mod:`~fabricd.engines.collectives.persistent` (which finds the arrays a compute
names and runs it here) to keep that module within its size budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fabricd.dtypes import is_float
from fabricd.engines.collectives.landing import same
from fabricd.engines.collectives.spec import REDUCE


def compute(
    fn: str, out: np.ndarray[Any, Any], inputs: list[np.ndarray[Any, Any]], size: int
) -> None:
    """``out = fn(*inputs)``; ``div`` divides by ``size``, the collective's ranks (floor
    division for integer dtypes)."""
    match fn:
        case "copy":
            if not same(out, inputs[0]):  # in place, an allgather landed where it goes
                np.copyto(out, inputs[0])
        case "div":
            divide(inputs[0], size, out)
        case _:
            REDUCE[fn](inputs[0], inputs[1], out=out)


def divide(array: np.ndarray[Any, Any], size: int, out: np.ndarray[Any, Any]) -> None:
    """``out = array / size``, floored for integer dtypes (an ``avg``'s last step; bfloat16
    divides in float32 and rounds once, like its sums)."""
    if is_float(out.dtype):
        np.divide(array, size, out=out)
    else:
        np.floor_divide(array, size, out=out)
