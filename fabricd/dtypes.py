"""The element types fabricd moves, by their numpy names, and their sizes in bytes.

Both sides of the client socket use this list: the client to refuse an array it cannot send,
the daemon to check that a request's byte count is a whole number of elements.
"""

from __future__ import annotations

from typing import Final

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
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
#: the floating-point types: what a stochastic reduce averages and a parameter server holds
FLOAT_DTYPES: Final = ("float16", "float32", "float64")
#: the types a collective reduces (a client may name these; sums of the integers are exact)
REDUCE_DTYPES: Final = (*FLOAT_DTYPES, "int32", "int64")
