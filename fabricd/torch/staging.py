"""Where the ``fabricd`` process group puts a tensor while the daemons move it: fabricd arrays
(shared memory the daemon reads and writes), and the element type each op uses.

A tensor that torch hands the process group lives in torch's memory, not in a segment the
daemon has mapped, so it is copied into a staging array before the call and out after it: one
copy each way, the bound the issue sets (a tensor made by ``torch.from_numpy(fab.array(...))``
needs none through the client's own calls; the DDP hook in :mod:`fabricd.torch.hook` stages
its buckets the same way).  For a CUDA tensor too: device to a page-locked staging array and
back (:meth:`Staging.for_device`, :mod:`fabricd.torch.devices`).

Choices, and why:

* *Size classes.*  A staging array holds a power of two of elements (at least
  :data:`MIN_CLASS`), so a job whose tensors vary in size (``all_gather_object``, FSDP's
  shards) reuses a few arrays instead of mapping one per size.  A daemon keeps every named
  collective of a job (at most ``max_collectives_per_job``), so the sizes a collective runs
  over are bounded too: up to :data:`SMALL_BYTES` the whole class, beyond it the count
  rounded up to a sixteenth of its class (:func:`span_for`; at most 1/16 more bytes).  For a
  reduction the elements past the tensor are reduced and dropped; for a broadcast or a
  gather they are carried and dropped.
* *Warm arrays.*  A call takes any free array of its (dtype, class), made only when none is
  free, and gives it back when it is done: in a loop the same arrays serve every call, their
  pages already faulted in here and mapped by the daemon.  A fresh array costs both (a 64
  MiB one tens of milliseconds), so arrays are never tied to a collective's name.  Which
  collective a call is, and how two calls of one collective in flight are kept apart, is the
  backend's business (one name per operation, dtype and span: :mod:`fabricd.torch.backend`).
* *Element types.*  The daemons reduce float16/32/64, bfloat16 and int32/64.  bfloat16 is
  staged as bfloat16 (``ml_dtypes.bfloat16`` arrays, which torch sees through
  :func:`tensor_of`): half float32's bytes, each step of a reduction computed in float32 and
  rounded to nearest even, as gloo does.  int8, uint8, int16 and bool are reduced in int64,
  cast back with torch's own wrap-around (bool: nonzero is True); complex as pairs of floats
  (sum and average only).  Anything only moved (broadcast, gathers, scatters, all-to-all,
  send and receive) travels as its raw bytes, whatever its dtype.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch

from fabricd.dtypes import BFLOAT16
from fabricd.errors import UsageError
from fabricd.torch.devices import PageLocker

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from fabricd.client import Client

#: the smallest staging class, in elements
MIN_CLASS: Final = 256
#: up to this many bytes a collective runs over its whole staging class (module docstring)
SMALL_BYTES: Final = 64 * 1024
#: a large collective's span is its count rounded up to a GRANULES-th of its class
GRANULES: Final = 16

#: the dtype the daemons reduce a torch dtype in
REDUCED_AS: Final[dict[torch.dtype, str]] = {
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bfloat16: "bfloat16",
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
    """``tensor`` as one dimension (the same memory, out of autograd's sight: a call writes
    into a parameter as gloo does), or a UsageError if it is not dense.  On the CPU or a CUDA
    device alike: a call checks its tensors' device once (:mod:`fabricd.torch.devices`)."""
    if not tensor.is_contiguous():
        raise UsageError(f"the fabricd backend's {what} takes contiguous tensors here")
    return tensor.detach().reshape(-1)


def dense(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """``tensors``, each a contiguous copy where it is not contiguous, and what writes such
    copies back (a call that changes its tensors: strided ones work as with gloo)."""
    copies = [t if t.is_contiguous() else t.detach().contiguous() for t in tensors]

    def write_back() -> None:
        for tensor, copy in zip(tensors, copies, strict=True):
            if copy is not tensor:
                tensor.detach().copy_(copy)

    return copies, write_back


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes, as a uint8 tensor over the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def size_class(count: int) -> int:
    """The staging class of ``count`` elements: the next power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(count - 1, 0).bit_length())


def span_for(count: int, itemsize: int) -> int:
    """How many elements a collective over ``count`` runs over: the whole class up to
    :data:`SMALL_BYTES`, else ``count`` rounded up to a sixteenth of its class (at most 1/16
    more), so that a job's sizes name a bounded number of collectives."""
    capacity = size_class(count)
    if count * itemsize <= SMALL_BYTES:
        return capacity
    granule = capacity // GRANULES
    return -(-count // granule) * granule


@dataclass(slots=True)
class Slot:
    """One staging array, and the pool it goes back to."""

    array: np.ndarray[Any, Any]
    name: str
    key: tuple[str, int]  #: its pool: (dtype, class)
    locked: bool | None = None  #: page-locked for CUDA copies (None: no CUDA call took it yet)


class Staging:
    """One process group's staging arrays (module docstring), on its client ``fab``."""

    def __init__(self, fab: Client, prefix: str, locker: PageLocker | None = None) -> None:
        self.fab = fab
        self.prefix = prefix
        self.locker = locker  #: page-locks arrays for CUDA calls (made at the first one)
        self._pools: dict[tuple[str, int], list[Slot]] = {}  #: the free ones
        self._made: dict[tuple[str, int], int] = {}  #: arrays made per pool
        self._locked: list[Slot] = []  #: the slots page-locked (pageable again at close)
        self._lock = threading.Lock()

    def take(self, dtype: str, count: int) -> Slot:
        """A free staging array of at least ``count`` elements of ``dtype`` (made if none is
        free), the call's until :meth:`release`."""
        capacity = size_class(count)
        key = (dtype, capacity)
        with self._lock:
            free = self._pools.setdefault(key, [])
            if free:
                return free.pop()
            made = self._made.get(key, 0)
            self._made[key] = made + 1
        name = f"{self.prefix}:{dtype}:{capacity}:{made}"
        return Slot(self.fab.array(name, (capacity,), dtype), name, key)

    def release(self, slot: Slot) -> None:
        """``slot``'s call is done: the next may take it."""
        with self._lock:
            self._pools[slot.key].append(slot)

    def for_device(self, slot: Slot, device: torch.device) -> Slot:
        """``slot``, made ready for copies from and to ``device``: for a CUDA device its
        array page-locked, once, by a thread with ``device`` current (the first CUDA call's:
        :mod:`fabricd.torch.devices`); nothing for the CPU."""
        if device.type != "cuda" or slot.locked is not None:
            return slot
        with self._lock:
            if self.locker is None:
                self.locker = PageLocker(device=device)
            locker = self.locker
        slot.locked = locker.lock(slot.array.ctypes.data, slot.array.nbytes)
        if slot.locked:
            with self._lock:
                self._locked.append(slot)
        return slot

    def close(self) -> None:
        """Unlock the page-locked arrays (before the client unmaps them); their slots say
        so."""
        if self.locker is not None:
            self.locker.close()
        with self._lock:
            locked, self._locked = self._locked, []
        for slot in locked:
            slot.locked = False


def pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``tensors`` one after the other into the start of ``flat``."""
    offset = 0
    for tensor in tensors:
        flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        offset += tensor.numel()


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the start of ``flat`` back into ``tensors``, as :func:`pack` laid them out."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def tensor_of(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """``torch.from_numpy(array)``, the same memory, for bfloat16 too (torch does not know
    ``ml_dtypes.bfloat16``; its bits are torch.bfloat16's)."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(array)


def array_of(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """``tensor.numpy()``, the same memory, for bfloat16 too (then an ``ml_dtypes.bfloat16``
    array)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()
