"""Where the ``fabricd`` process group puts a tensor while the daemons move it: fabricd arrays
(shared memory the daemon reads and writes), and the element type each op uses.

A tensor that torch hands the process group lives in torch's memory, not in a segment the
daemon has mapped, so it is copied into a staging array before the call and out after it: one
copy each way, the bound the issue sets (a tensor made by ``torch.from_numpy(fab.array(...))``
needs none through the client's own calls; the DDP hook in :mod:`fabricd.torch.hook` stages
its buckets the same way).

Choices, and why:

* *Size classes.*  A staging array holds a power of two of elements (at least
  :data:`MIN_CLASS`), so a job whose tensors vary in size (``all_gather_object``, FSDP's
  shards) reuses a few arrays instead of mapping one per size.  Up to :data:`SMALL_BYTES`,
  the collective itself runs over the whole class (for a reduction the elements past the
  tensor are summed and dropped; for a broadcast or a gather they are carried and dropped):
  a daemon keeps every named collective of a job (at most ``max_collectives_per_job``), and
  a job whose small tensors take many sizes would otherwise name a new one per size.  Larger
  tensors run over exactly their elements (their sizes are few: DDP's buckets, FSDP's flat
  parameters).
* *Slots.*  Each (dtype, class) has :data:`SLOTS` arrays, used round robin in the order the
  calls come, which is the same order on every rank (torch requires it): the k-th call of a
  class takes slot ``k mod SLOTS`` and, if that slot's last call is still in flight, waits for
  it.  The slot is in the collective's name, so two calls in flight never share a collective
  either, and every rank names them alike.
* *Element types.*  The daemons reduce float16/32/64 and int32/64.  bfloat16 is reduced in
  float32 (numpy has no bfloat16; the sum of bfloat16 values rounded once at the end is what
  gloo gives, or closer); int8, uint8, int16 and bool in int64, cast back with torch's own
  wrap-around (bool: nonzero is True); complex as pairs of floats (sum and average only).
  Anything only moved (broadcast, gathers, scatters, all-to-all, send and receive) travels as
  its raw bytes, whatever its dtype.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

from fabricd.errors import Timeout, UsageError

if TYPE_CHECKING:
    import numpy as np

    from fabricd.client import Client

#: the smallest staging class, in elements
MIN_CLASS: Final = 256
#: up to this many bytes a collective runs over its whole staging class (module docstring)
SMALL_BYTES: Final = 64 * 1024
#: staging arrays per (dtype, class): calls of one class in flight at once
SLOTS: Final = 8

#: the dtype the daemons reduce a torch dtype in
REDUCED_AS: Final[dict[torch.dtype, str]] = {
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bfloat16: "float32",
    torch.int8: "int64",
    torch.uint8: "int64",
    torch.int16: "int64",
    torch.bool: "int64",
}
#: complex dtypes, reduced (sum, average) as their real and imaginary parts
COMPLEX_AS: Final[dict[torch.dtype, str]] = {
    torch.complex64: "float32",
    torch.complex128: "float64",
}


def reduce_dtype(dtype: torch.dtype, what: str) -> str:
    """The fabricd dtype ``what`` (an operation, for the error) reduces ``dtype`` in.

    Raises:
        UsageError: a dtype the daemons cannot reduce, even widened.
    """
    name = REDUCED_AS.get(dtype) or COMPLEX_AS.get(dtype)
    if name is None:
        kinds = ", ".join(str(t).removeprefix("torch.") for t in [*REDUCED_AS, *COMPLEX_AS])
        raise UsageError(f"the fabricd backend's {what} reduces {kinds}, not {dtype}")
    return name


def flat_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` as one dimension (the same memory), or a UsageError if it is not dense."""
    if not tensor.is_contiguous():
        raise UsageError(f"the fabricd backend's {what} takes contiguous tensors")
    if tensor.device.type != "cpu":
        raise UsageError(
            f"the fabricd backend's {what} takes CPU tensors, not {tensor.device} (register "
            "the tensors' device as another backend's, e.g. init_process_group("
            '"cpu:fabricd,cuda:nccl"))'
        )
    return tensor.reshape(-1)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes, as a uint8 tensor over the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def size_class(count: int) -> int:
    """The staging class of ``count`` elements: the next power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(count - 1, 0).bit_length())


@dataclass(slots=True)
class Slot:
    """One staging array and whether a call in flight holds it."""

    array: np.ndarray[Any, Any]
    name: str
    free: threading.Event = field(default_factory=threading.Event)


class Staging:
    """One process group's staging arrays (module docstring), on its client ``fab``."""

    def __init__(self, fab: Client, prefix: str) -> None:
        self.fab = fab
        self.prefix = prefix
        self._slots: dict[tuple[str, int, str], list[Slot]] = {}
        self._calls: dict[tuple[str, int, str], int] = {}  #: calls per (dtype, class, ring)
        self._lock = threading.Lock()

    def take(self, dtype: str, count: int, timeout: float, ring: str = "") -> tuple[Slot, int]:
        """A slot whose array holds at least ``count`` elements of ``dtype``, and how many of
        them the collective runs over (module docstring); the caller releases it with
        :meth:`release` once its call is done.  ``ring``: a set of slots of its own, of one
        slot (a partial allreduce's collective must keep its name from call to call: a rank
        that missed rounds joins the same collective later).

        Raises:
            fabricd.Timeout: the slot's last call did not finish within ``timeout``.
        """
        capacity = size_class(count)
        key = (dtype, capacity, ring)
        with self._lock:
            calls = self._calls.get(key, 0)
            self._calls[key] = calls + 1
            slots = self._slots.setdefault(key, [])
            index = calls % (SLOTS if not ring else 1)
            if index == len(slots):
                name = f"{self.prefix}:{dtype}:{capacity}:{ring or index}"
                slot = Slot(self.fab.array(name, (capacity,), dtype), name)
                slot.free.set()
                slots.append(slot)
            slot = slots[index]
        if not slot.free.wait(timeout):
            raise Timeout(f"staging array {slot.name} stayed busy for {timeout} s")
        slot.free.clear()
        itemsize = slot.array.itemsize
        span = capacity if count * itemsize <= SMALL_BYTES else count
        return slot, span

    @staticmethod
    def release(slot: Slot) -> None:
        slot.free.set()
