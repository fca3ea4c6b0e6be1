"""Where a ``fabricd`` process group call's tensors live, and how their data reach the daemon:
CPU tensors as they are, CUDA tensors through page-locked staging arrays.

The daemon works on host shared memory (the staging arrays of :mod:`fabricd.torch.staging`).
A call copies its tensors into them with ``copy_`` and out of them with ``copy_``, the same
lines for both devices: for a CPU tensor a memory copy, for a CUDA tensor a device-to-host
copy on the way in and a host-to-device one on the way out -- one copy each way, with
these exceptions (their copies go through a temporary or pageable memory; correct, slower):

* a reduce-scatter whose staging chunk is longer than a rank's part (the span rounding of
  :func:`fabricd.torch.staging.span_for`) copies its input into the strided view
  ``parts[:, :k]``: torch makes a contiguous temporary for a copy across devices into
  strided memory, so the input takes a second copy;
* int8, uint8, int16 and bool reductions are staged as int64: the copy converts, through a
  temporary, each way;
* ``allgather_coalesced`` gathers into a CPU ``rows`` tensor (pageable) and copies the
  outputs from it; product and bitwise reductions gather into a CPU tensor (pageable) and
  reduce there; a reduce-scatter the daemons do not make (product, bitwise, complex) is an
  allreduce of a device copy of the whole input, its part copied on the device;
* an all-to-all's (or a scatter root's) own part goes device -> pageable CPU copy ->
  device;
* strided tensors get a contiguous copy on the device first (and one back for in-place
  calls).

Choices, and why:

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
* *The device made current in every thread of the group's that touches CUDA.*  A thread
  that never sets a device works on device 0, and its first CUDA call makes a context
  there: for a rank on ``cuda:N``, memory on another rank's GPU.  The page-locking thread
  sets the first CUDA call's device when it starts (as torch's DataLoader pin thread does);
  the output copies, and completing a CUDA call's future, run under
  ``torch.cuda.device(device)`` (:func:`on_device`).
* *Registration off the caller's thread.*  A failed CUDA runtime call leaves its error as the
  thread's "last error", which torch reads after its next kernel launch and raises there, far
  from the cause.  So registering and unregistering run on a thread of their own
  (:class:`PageLocker`), and a failure is kept there: that array's copies go through pageable
  memory (correct, slower), and the group says so once in its log.  A caller waits for
  the thread at most :data:`LOCKER_WAIT` seconds (then pageable copies too).  Closing
  unregisters on that thread, or here when this is that thread (the garbage collector may
  run the group's cleanup there) or when Python has already shut thread pools down (at
  interpreter exit, before exit-time cleanup); after close nothing is registered again.
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
from typing import TYPE_CHECKING, Any, Final, TypeVar

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
#: how long a caller waits for the page-locking thread (a registration, or close's unregistering)
LOCKER_WAIT: Final = 60.0

T = TypeVar("T")


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


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made this thread's current CUDA device for the block (nothing for the CPU):
    a thread that never set one works on device 0, and would make a CUDA context there for a
    process on another device."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


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
    """Page-locks host memory for CUDA copies (module docstring), on a thread of its own,
    with ``device`` current there (None: left as it is).

    ``register`` and ``unregister`` are the CUDA calls (:func:`cuda_register`,
    :func:`cuda_unregister`; a test gives its own).  Once :meth:`close` has begun, nothing is
    locked any more and no thread is started: :meth:`lock` answers False (pageable copies),
    and a registration in flight then is undone on the thread as soon as it returns.
    """

    def __init__(
        self,
        register: Callable[[int, int], int] = cuda_register,
        unregister: Callable[[int], int] = cuda_unregister,
        device: torch.device | None = None,
    ) -> None:
        self._register, self._unregister = register, unregister
        self._device = device
        self._locked: list[int] = []  #: the addresses registered, to unregister at close
        self._lock = threading.Lock()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._ident: int | None = None  #: the page-locking thread's
        self._closed = False
        self._warned = False

    def lock(self, ptr: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` at ``ptr``; whether it is (else copies go through pageable
        memory: correct, slower; said once in the log)."""
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="fabricd-torch-pin", initializer=self._started
                )
            thread = self._thread
        try:
            error = self._run(thread, functools.partial(self._register_one, ptr, nbytes))
        except concurrent.futures.TimeoutError:  # (if it ends later, close undoes it)
            self._warn(f"did not return within {LOCKER_WAIT:g} s")
            return False
        except RuntimeError as exc:  # (the pool shut down by close, or its thread failed)
            if not self._closed:
                self._warn(f"could not run: {exc}")
            return False
        if error is None:  # (close came first, and undid it)
            return False
        if error != 0:
            self._warn(f"failed (CUDA error {error})")
        return error == 0

    def close(self) -> None:
        """Unregister everything registered (before the memory is unmapped), on the thread;
        here when this is that thread (the group's cleanup run by the garbage collector
        there would wait for itself) or when its pool is gone (at interpreter exit Python
        shuts thread pools down before exit-time cleanup runs)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is None:  # (nothing was ever locked)
            return
        finished = True
        try:
            self._run(thread, self._unregister_all)
        except concurrent.futures.TimeoutError:
            log.warning(
                "fabricd backend: unregistering the staging arrays did not return within "
                "%g s; the arrays are unmapped anyway",
                LOCKER_WAIT,
            )
            finished = False
        except RuntimeError:  # (at interpreter exit: no pool to run it on)
            with on_device(self._device or CPU):
                self._unregister_all()
        thread.shutdown(wait=finished and threading.get_ident() != self._ident)

    def _run(self, thread: concurrent.futures.ThreadPoolExecutor, work: Callable[[], T]) -> T:
        """``work`` on the page-locking thread (here, if this is it), waited for at most
        :data:`LOCKER_WAIT` seconds."""
        if threading.get_ident() == self._ident:
            return work()
        return thread.submit(work).result(LOCKER_WAIT)

    def _started(self) -> None:
        """The page-locking thread's start: ``device`` made its current one (as torch's
        DataLoader does in its pin-memory thread), so a CUDA context is not made on device 0
        for a process that uses another."""
        self._ident = threading.get_ident()
        if self._device is not None:
            torch.cuda.set_device(self._device)

    def _register_one(self, ptr: int, nbytes: int) -> int | None:
        """Register ``ptr`` and note it; None if close began meanwhile (then undone)."""
        error = self._register(ptr, nbytes)
        if error != 0:
            return error
        with self._lock:
            closed = self._closed
            if not closed:
                self._locked.append(ptr)
        if closed:
            self._unregister(ptr)
            return None
        return 0

    def _unregister_all(self) -> None:
        with self._lock:
            locked, self._locked = self._locked, []
        for ptr in locked:
            self._unregister(ptr)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "fabricd backend: cudaHostRegister of a staging array %s; its CUDA copies "
                "go through pageable memory, slower",
                why,
            )
