"""Where a ``fabricd`` process group call's tensors live, and how their data reach the daemon:
CPU tensors as they are, CUDA tensors through page-locked staging arrays.

The daemon works on host shared memory (the staging arrays of :mod:`fabricd.torch.staging`).
A call copies its tensors into them with ``copy_`` and out of them with ``copy_``, the same
lines for both devices: for a CPU tensor a memory copy, for a CUDA tensor a device-to-host
copy on the way in and a host-to-device one on the way out -- one copy each way.  Choices,
and why:

* *Page-locked staging arrays, not a pinned bounce buffer.*  A copy between the device and
  pageable memory is staged by the driver through pinned buffers of its own, in pieces; into
  page-locked memory it is one DMA.  The DDP hook (:mod:`fabricd.torch.hook`) goes through a
  pinned tensor of torch's (device -> pinned -> the array: two copies each way).  Here the
  staging array itself is page-locked (``cudaHostRegister``, which torch 2.13 exposes as
  ``torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)``; torch's own checkpoint stager
  registers shared memory the same way), so the DMA lands in the memory the daemon reads:
  one copy each way.  A staging array is registered the first time a CUDA call takes it and
  stays registered while it lives (arrays are reused from call to call, so a loop pays the
  registration once, not per call), and unregistered when the group shuts down.
  Registration is *portable* (flag 1): the pages count as pinned for every device.
* *Registration off the caller's thread.*  A failed CUDA runtime call leaves its error as the
  thread's "last error", which torch reads after its next kernel launch and raises there, far
  from the cause.  So registering and unregistering run on a thread of their own
  (:class:`PageLocker`), and a failure is kept there: that array's copies go through pageable
  memory (correct, slower), and the group says so once in its log.
* *Synchronised, not stream-ordered.*  The copies are blocking (``non_blocking=False``).  The
  input copies run on the caller's current stream, after the producer's work on it; before
  the daemon is handed the arrays, that stream is synchronised (:func:`ready`), so the device
  work the call itself added (a contiguous copy of a strided tensor, a concatenation) is done,
  and no earlier work still uses an output's memory (the caching allocator hands out memory in
  stream order) when the output copies write it from another thread.  The output copies run
  in the thread that finishes the call, on a stream of the group's own per device
  (:class:`CopyStreams`: on the caller's stream, or on the default stream, which work queued
  after the call also fills, they would wait for that work), which is synchronised before the
  call's future is set (:func:`settle`, for the device-to-device copies some calls add), so
  the values are on the device before ``wait()`` returns.  The future of a CUDA call is a
  CUDA-aware ``torch.futures.Future(devices=[device])`` (:func:`future_for`), as NCCL's are:
  ``wait()`` and ``then`` callbacks see the values on their current streams.
* *One device per call.*  A call's tensors must all be on one device (``UsageError`` naming
  the operation otherwise); CPU and CUDA are the devices taken (``UsageError`` for others).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any, Final

import torch

from fabricd.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

#: the device types a call's tensors may be on
DEVICE_TYPES: Final = ("cpu", "cuda")
#: cudaHostRegisterPortable: the pages count as pinned for every CUDA context
PORTABLE: Final = 1
CPU: Final = torch.device("cpu")


def device_of(tensors: Iterable[torch.Tensor], what: str) -> torch.device:
    """The one device ``tensors`` (all of call ``what``'s) are on; the CPU if there are none.

    Raises:
        UsageError: tensors on different devices, or on a device other than CPU or CUDA.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        named = ", ".join(sorted(str(d) for d in devices))
        raise UsageError(
            f"the fabricd backend's {what} takes tensors on one device, not on {named}: "
            "move them to one first"
        )
    device = devices.pop() if devices else CPU
    if device.type not in DEVICE_TYPES:
        raise UsageError(
            f"the fabricd backend's {what} takes CPU or CUDA tensors, not {device} ones"
        )
    return device


def ready(device: torch.device) -> None:
    """The caller's work on ``device`` is done (its current stream synchronised): what a call
    does before its tensors are copied in (module docstring).  Nothing for the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def settle(device: torch.device) -> None:
    """The copies this thread made on ``device`` are done: what finishing a call does before
    its future is set.  Nothing for the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def future_for(device: torch.device) -> torch.futures.Future[object]:
    """A call's future: CUDA-aware for a CUDA call (module docstring), a plain one else."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


class CopyStreams:
    """A process group's streams for the output copies of its CUDA calls, one per device,
    made at the first call on it (module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def on(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The copy stream of ``device`` made current (nothing for the CPU)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
        return torch.cuda.stream(stream)


def cuda_register(ptr: int, nbytes: int) -> int:
    """``cudaHostRegister(ptr, nbytes, portable)``: 0, or the CUDA error's code (torch
    leaves ``cudart`` untyped)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return int(cudart.cudaHostRegister(ptr, nbytes, PORTABLE))


def cuda_unregister(ptr: int) -> int:
    """``cudaHostUnregister(ptr)``: 0, or the CUDA error's code."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return int(cudart.cudaHostUnregister(ptr))


class PageLocker:
    """Page-locks host memory for CUDA copies (module docstring), on a thread of its own.

    ``register`` and ``unregister`` are the CUDA calls (:func:`cuda_register`,
    :func:`cuda_unregister`; a test gives its own).
    """

    def __init__(
        self,
        register: Callable[[int, int], int] = cuda_register,
        unregister: Callable[[int], int] = cuda_unregister,
    ) -> None:
        self._register, self._unregister = register, unregister
        self._locked: list[int] = []  #: the addresses registered, to unregister at close
        self._lock = threading.Lock()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._warned = False

    def lock(self, ptr: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` at ``ptr``; whether it is (else copies go through pageable
        memory: correct, slower; said once in the log)."""
        error = self._on_thread(functools.partial(self._register, ptr, nbytes))
        if error == 0:
            with self._lock:
                self._locked.append(ptr)
            return True
        if not self._warned:
            self._warned = True
            log.warning(
                "fabricd backend: cudaHostRegister of a staging array failed (CUDA error "
                "%d); its CUDA copies go through pageable memory, slower",
                error,
            )
        return False

    def close(self) -> None:
        """Unregister everything registered (before the memory is unmapped)."""
        with self._lock:
            locked, self._locked = self._locked, []
        for ptr in locked:
            self._on_thread(functools.partial(self._unregister, ptr))
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _on_thread(self, call: Callable[[], int]) -> int:
        with self._lock:
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="fabricd-torch-pin"
                )
            thread = self._thread
        return thread.submit(call).result()
