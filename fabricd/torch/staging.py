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
  shards) reuses a few arrays instead of mapping one per size.  A daemon keeps every named
  collective of a job (at most ``max_collectives_per_job``), so the sizes a collective runs
  over are bounded too: up to :data:`SMALL_BYTES` the whole class, beyond it the count
  rounded up to a sixteenth of its class (:func:`span_for`; at most 1/16 more bytes).  For a
  reduction the elements past the tensor are reduced and dropped; for a broadcast or a
  gather they are carried and dropped.
* *Slots.*  A named collective's arrays come from a ring of :data:`SLOTS` per (dtype, class),
  used round robin in the order the calls come, which is the same order on every rank (torch
  requires it): the k-th call of a class takes slot ``k mod SLOTS`` and, if that slot's last
  call is still in flight, waits for it.  The slot is in the collective's name, so two calls
  in flight never share a collective either, and every rank names them alike.  What names
  no collective (point-to-point messages, a gather's own part) takes any free array of its
  class, made when none is: a receive posted early must never make a later send wait for
  its array (the rings are kept apart from these, so rank-local traffic never shifts a
  collective's name).
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

from fabricd.dtypes import BFLOAT16
from fabricd.errors import Timeout, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from fabricd.client import Client

#: the smallest staging class, in elements
MIN_CLASS: Final = 256
#: up to this many bytes a collective runs over its whole staging class (module docstring)
SMALL_BYTES: Final = 64 * 1024
#: staging arrays per (dtype, class) of named collectives: calls of one class in flight at once
SLOTS: Final = 8
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
    into a parameter as gloo does), or a UsageError if it is not dense or not on the CPU."""
    if not tensor.is_contiguous():
        raise UsageError(f"the fabricd backend's {what} takes contiguous tensors here")
    if tensor.device.type != "cpu":
        raise UsageError(
            f"the fabricd backend's {what} takes CPU tensors, not {tensor.device}: use "
            "another backend for them (the hook fabricd.torch.register moves CUDA buckets)"
        )
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
    """One staging array and whether a call in flight holds it."""

    array: np.ndarray[Any, Any]
    name: str
    key: tuple[str, int, str] = ("", 0, "")  #: its pool (an anonymous one) or ring
    free: threading.Event = field(default_factory=threading.Event)


class Staging:
    """One process group's staging arrays (module docstring), on its client ``fab``."""

    def __init__(self, fab: Client, prefix: str) -> None:
        self.fab = fab
        self.prefix = prefix
        self._rings: dict[tuple[str, int, str], list[Slot]] = {}
        self._calls: dict[tuple[str, int, str], int] = {}  #: calls per ring so far
        self._pools: dict[tuple[str, int, str], list[Slot]] = {}  #: anonymous, free ones
        self._made: dict[tuple[str, int, str], int] = {}  #: arrays made per pool
        self._lock = threading.Lock()

    def take_named(
        self, dtype: str, count: int, timeout: float, ring: str = ""
    ) -> tuple[Slot, int]:
        """A slot of a named collective's ring, whose array holds at least ``count`` elements
        of ``dtype``, and the span the collective runs over (:func:`span_for`).  The k-th
        call of a (dtype, class) takes slot ``k mod SLOTS``, the same on every rank (calls
        come in the same order everywhere), waiting for its previous call if still in
        flight; ``ring``: a ring of its own, of one slot (a partial allreduce's collective
        must keep its name: a rank that missed rounds joins the same one later).  Its name
        goes into the collective's name.

        Raises:
            fabricd.Timeout: the slot's last call did not finish within ``timeout``.
        """
        capacity = size_class(count)
        key = ("named:" + dtype, capacity, ring)
        with self._lock:
            calls = self._calls.get(key, 0)
            self._calls[key] = calls + 1
            slots = self._rings.setdefault(key, [])
            index = calls % (SLOTS if not ring else 1)
            if index == len(slots):
                name = f"{self.prefix}:{dtype}:{capacity}:{ring or index}"
                slots.append(self._make(name, capacity, dtype, key))
            slot = slots[index]
        if not slot.free.wait(timeout):
            raise Timeout(f"staging array {slot.name} stayed busy for {timeout} s")
        slot.free.clear()
        return slot, span_for(count, slot.array.itemsize)

    def take_any(self, dtype: str, count: int) -> Slot:
        """A free staging array of at least ``count`` elements (made if none is free): for
        what names no collective (point-to-point messages, a gather's own part)."""
        capacity = size_class(count)
        key = ("any:" + dtype, capacity, "")
        with self._lock:
            free = self._pools.setdefault(key, [])
            if free:
                slot = free.pop()
            else:
                made = self._made.get(key, 0)
                self._made[key] = made + 1
                slot = self._make(
                    f"{self.prefix}:any:{dtype}:{capacity}:{made}", capacity, dtype, key
                )
        slot.free.clear()
        return slot

    def release(self, slot: Slot) -> None:
        """``slot``'s call is done: the next may take it."""
        if slot.key[0].startswith("any:"):
            with self._lock:
                self._pools[slot.key].append(slot)
        slot.free.set()

    def _make(self, name: str, capacity: int, dtype: str, key: tuple[str, int, str]) -> Slot:
        slot = Slot(self.fab.array(name, (capacity,), dtype), name, key)
        slot.free.set()
        return slot


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
