"""The element types fabricd moves, by their numpy names, and their sizes in bytes.

Both sides of the client socket use this list: the client to refuse an array it cannot send,
the daemon to check that a request's byte count is a whole number of elements.

bfloat16 is ``ml_dtypes.bfloat16``, the numpy type JAX and TensorFlow use (``jnp.bfloat16`` is
it): numpy has none of its own.  Importing this module registers the name with numpy, so
``np.dtype("bfloat16")`` works in the client and in the daemon.  Its arrays add, take maxima and
divide element by element in float32, rounding each result to bfloat16 to nearest, ties to
even: what ``torch.bfloat16`` arithmetic does on the CPU, so a reduction's every step is
computed in float32 and rounded once (docs/torch.md, "bfloat16").
"""

from __future__ import annotations

from typing import Any, Final

import ml_dtypes
import numpy as np

#: bfloat16 as a numpy dtype (its ``kind`` is ``"V"``, not ``"f"``: :func:`is_float` knows it)
BFLOAT16: Final = np.dtype(ml_dtypes.bfloat16)

ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
#: the floating-point types: what a stochastic reduce averages and a parameter server holds
#: (not bfloat16: those engines' filters, norms and updates are written for numpy's floats)
FLOAT_DTYPES: Final = ("float16", "float32", "float64")
#: the types a collective reduces (a client may name these; sums of the integers are exact)
REDUCE_DTYPES: Final = (*FLOAT_DTYPES, "bfloat16", "int32", "int64")


def is_float(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` divides as a float (an ``avg``'s last step) rather than floored."""
    return dtype.kind == "f" or dtype == BFLOAT16


#: the largest count each float type holds with every integer below it: 2 to the power of its
#: significand's bits (the integers hold any count a job has)
_EXACT: Final = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24, "float64": 2**53}


def exact_count(dtype: str) -> int:
    """The most ranks a partial allreduce of ``dtype`` counts exactly: its active count travels
    as one more element of the array (engines/collectives/persistent.py)."""
    return _EXACT.get(dtype, 2**63 - 1)
