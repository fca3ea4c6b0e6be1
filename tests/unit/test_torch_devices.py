"""The ``fabricd`` process group's device logic (fabricd/torch/devices.py, issue 30, item 1),
without a GPU and without a daemon: which tensors a call takes, which copy path a staging
array gets (page-locked for a CUDA call, registered off the caller's thread, pageable when
registration fails, unregistered at close, also when close races a registration, runs on the
page-locking thread itself, or runs at interpreter exit), and which device is current where
the group's threads touch CUDA.

The CUDA runtime here is a stand-in (:class:`FakeCuda`, put in torch's place): it records what
each call was and which device was current in which thread, and moves no data.  These tests
show that the code makes those calls in that order with that device current; they do not
show that a GPU does what the stand-in assumes (a stream context, an event, a DMA):
tests/integration/test_torch_backend_devices.py runs the copies where torch sees a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pytest
import torch

import fabricd
from fabricd.errors import UsageError
from fabricd.torch import backend, devices
from fabricd.torch.backend import FabricdProcessGroup
from fabricd.torch.devices import CPU, CopyStreams, PageLocker, device_of, future_for
from fabricd.torch.staging import Staging

if TYPE_CHECKING:
    from collections.abc import Iterator

CUDA = torch.device("cuda", 0)  # (a device object: made without a GPU, never used as one)
CUDA1 = torch.device("cuda", 1)
PIN = "fabricd-torch-pin"  # (the page-locking thread's name prefix)


class NoDaemon:
    """A client that must not be reached: a refused call takes no staging array."""

    def __init__(self) -> None:
        self.arrays: list[str] = []
        self.closed = False

    def array(self, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray[Any, Any]:
        self.arrays.append(name)
        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        self.closed = True


class Done:
    """A daemon operation already answered."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class OneRank(NoDaemon):
    """A client for a group of one rank: an allreduce is answered at once, its array (the
    sum over one rank) left as it is."""

    def allreduce_async(self, array: Any, op: str, mode: str, name: str) -> Done:
        return Done()


class Ran(NamedTuple):
    """One call into the stand-in CUDA runtime."""

    what: str  #: register, unregister, stream (made current), sync, set_result
    device: int  #: the device current in the calling thread
    thread: str
    arg: Any = None  #: register/unregister: the address; stream, sync: the stream's device


class FakeStream:
    """A stream of the stand-in: its device, and its ``synchronize`` recorded."""

    def __init__(self, cuda: FakeCuda, device: int) -> None:
        self.cuda, self.device = cuda, device

    def synchronize(self) -> None:
        self.cuda.note("sync", self.device)


class FakeCuda:
    """The CUDA runtime as these tests see it: cudaHostRegister and cudaHostUnregister (each
    call's address and thread, and the error code ``fail_with``, 0: success), and, once
    :meth:`install`-ed in torch's place, each thread's current device (0 until it sets one,
    as CUDA's), streams, stream contexts and the CUDA-aware future, each use recorded in
    :attr:`ran` with the device current then."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.ran: list[Ran] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def registered(self) -> list[Ran]:
        return [r for r in self.ran if r.what == "register"]

    @property
    def unregistered(self) -> list[Ran]:
        return [r for r in self.ran if r.what == "unregister"]

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def note(self, what: str, arg: Any = None) -> None:
        with self._lock:
            self.ran.append(Ran(what, self.current(), threading.current_thread().name, arg))

    def register(self, ptr: int, nbytes: int) -> int:
        self.note("register", ptr)
        return self.fail_with

    def unregister(self, ptr: int) -> int:
        self.note("unregister", ptr)
        return 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Put the stand-in in torch's place (``cudart``, devices, streams, futures)."""
        cuda = self

        class Cudart:
            def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
                return cuda.register(ptr, nbytes)

            def cudaHostUnregister(self, ptr: int) -> int:
                return cuda.unregister(ptr)

        class Future(torch.futures.Future):  # type: ignore[type-arg]
            """A plain future that records the device current when it is set."""

            def __init__(self, *, devices: list[torch.device] | None = None) -> None:
                super().__init__()
                self.devices = devices

            def set_result(self, result: Any) -> None:
                cuda.note("set_result")
                super().set_result(result)

        monkeypatch.setattr(torch.cuda, "cudart", Cudart)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(torch.cuda, "device", self._device)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream(self, device.index))
        monkeypatch.setattr(torch.cuda, "stream", self._stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d: FakeStream(self, d.index))
        monkeypatch.setattr(torch.futures, "Future", Future)

    def _set_device(self, device: torch.device) -> None:
        self._local.device = device.index

    @contextlib.contextmanager
    def _device(self, device: torch.device) -> Iterator[None]:
        before = self.current()
        self._local.device = device.index
        try:
            yield
        finally:
            self._local.device = before

    @contextlib.contextmanager
    def _stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        self.note("stream", stream.device)
        yield stream


@pytest.fixture
def group() -> Any:
    made = FabricdProcessGroup(NoDaemon(), 0, 2, 10.0, "devices-test")  # type: ignore[arg-type]
    yield made
    made.shutdown()


def test_one_device_is_the_call_s_device() -> None:
    assert device_of([torch.ones(2), torch.zeros(3)], "allreduce") == CPU
    assert device_of([], "barrier") == CPU


def test_tensors_on_two_devices_are_refused_naming_the_operation() -> None:
    with pytest.raises(UsageError, match=r"all_gather_single takes tensors on one device.*cpu"):
        device_of([torch.ones(2), torch.ones(2, device="meta")], "all_gather_single")


def test_a_device_other_than_cpu_or_cuda_is_refused() -> None:
    with pytest.raises(UsageError, match=r"broadcast takes CPU or CUDA tensors, not meta"):
        device_of([torch.ones(2, device="meta")], "broadcast")


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("allreduce", lambda g, m, c: g.allreduce([m])),
        ("reduce", lambda g, m, c: g.reduce([m])),
        ("broadcast", lambda g, m, c: g.broadcast([m])),
        ("allgather", lambda g, m, c: g.allgather([[c, c]], [m])),
        ("all_gather_single", lambda g, m, c: g.all_gather_single(torch.ones(4), m)),
        ("allgather_coalesced", lambda g, m, c: g.allgather_coalesced([[c], [c]], [m])),
        ("gather", lambda g, m, c: g.gather([[c, c]], [m])),
        ("reduce_scatter", lambda g, m, c: g.reduce_scatter([c], [[m, m]])),
        ("reduce_scatter_single", lambda g, m, c: g.reduce_scatter_single(c, m)),
        ("alltoall", lambda g, m, c: g.alltoall([c, c], [m, m])),
        ("all_to_all_single", lambda g, m, c: g.all_to_all_single(c, m, None, None)),
        ("scatter", lambda g, m, c: g.scatter([c], [[m, m]])),
        ("send", lambda g, m, c: g.send([m], 1, 0)),
        ("recv", lambda g, m, c: g.recv([m], 1, 0)),
    ],
)
def test_every_operation_refuses_other_devices_before_staging(
    group: Any, what: str, call: Any
) -> None:
    """A meta tensor (alone, or beside a CPU one) is refused by the operation's name, before
    it takes a staging array (the client is never reached)."""
    meta = torch.ones(2, device="meta")
    with pytest.raises(UsageError, match=rf"backend's {what} takes"):
        call(group, meta, torch.ones(2))
    assert group.fab.arrays == []


def test_a_cpu_call_s_staging_array_is_not_page_locked() -> None:
    cuda = FakeCuda()
    staging = Staging(NoDaemon(), "t", PageLocker(cuda.register, cuda.unregister))  # type: ignore[arg-type]
    slot = staging.for_device(staging.take("float32", 100), CPU)
    assert slot.locked is None
    staging.close()
    assert cuda.registered == []
    assert cuda.unregistered == []


def test_a_cuda_call_page_locks_its_staging_array_once_off_the_caller_s_thread() -> None:
    cuda = FakeCuda()
    staging = Staging(NoDaemon(), "t", PageLocker(cuda.register, cuda.unregister))  # type: ignore[arg-type]
    slot = staging.for_device(staging.take("float32", 100), CUDA)
    assert slot.locked is True
    ptr = slot.array.ctypes.data
    assert [r.arg for r in cuda.registered] == [ptr]
    assert cuda.registered[0].thread.startswith(PIN)
    staging.release(slot)
    again = staging.for_device(staging.take("float32", 100), CUDA)  # (the same warm array)
    assert again is slot
    assert len(cuda.registered) == 1
    staging.close()
    assert [r.arg for r in cuda.unregistered] == [ptr]
    assert cuda.unregistered[0].thread.startswith(PIN)
    assert slot.locked is False  # (pageable again)


def test_a_failed_registration_falls_back_to_pageable_copies_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cuda = FakeCuda(fail_with=712)  # (cudaErrorHostMemoryAlreadyRegistered)
    staging = Staging(NoDaemon(), "t", PageLocker(cuda.register, cuda.unregister))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="fabricd.torch.devices"):
        first = staging.for_device(staging.take("float32", 100), CUDA)
        second = staging.for_device(staging.take("int64", 100), CUDA)
    assert first.locked is False
    assert second.locked is False
    assert len(cuda.registered) == 2
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1
    assert "712" in warnings[0].getMessage()
    staging.close()
    assert cuda.unregistered == []  # (nothing was registered)


def test_a_cpu_call_s_future_is_a_plain_one() -> None:
    future = future_for(CPU)
    future.set_result([torch.ones(1)])
    assert torch.equal(future.wait()[0], torch.ones(1))  # type: ignore[index]


def test_a_cpu_call_s_output_copies_get_no_stream() -> None:
    streams = CopyStreams()
    with streams.on(CPU) as stream:
        assert stream is None
    assert streams._streams == {}


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """The stand-in CUDA runtime, in torch's place."""
    made = FakeCuda()
    made.install(monkeypatch)
    return made


@pytest.mark.parametrize("waited_by", ["work", "future"])
def test_a_cuda_1_group_s_call_touches_cuda_with_device_1_current(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, waited_by: str
) -> None:
    """A call of a group on cuda:1 (its tensors taken for cuda:1 ones: the stand-in moves no
    data) in a caller whose current device is 0: its staging array is page-locked on the
    page-locking thread with device 1 current, the caller's stream of device 1 is
    synchronised before the daemon gets the array, the output copies enter the group's copy
    stream of device 1 and synchronise it with device 1 current, the CUDA-aware future (of
    device 1) is set with device 1 current, whichever thread finishes the call (a caller in
    ``Work.wait`` or the group's thread, which races it; with ``get_future().wait()`` the
    group's thread and a notifier), and shutting the group down unregisters the
    array on the page-locking thread with device 1 current."""
    monkeypatch.setattr(backend, "device_of", lambda tensors, what: CUDA1)
    group = FabricdProcessGroup(OneRank(), 0, 1, 10.0, "devices-test")  # type: ignore[arg-type]
    tensor = torch.arange(6, dtype=torch.float32)
    work = group.allreduce([tensor])
    if waited_by == "work":
        work.wait()
    else:
        work.get_future().wait()
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32))
    assert work.get_future().devices == [CUDA1]
    slot = group._staging._locked[0]
    group.shutdown()
    assert group.fab.closed
    caller = threading.current_thread().name
    steps = [(r.what, r.device, r.arg) for r in cuda.ran]
    assert steps == [
        ("register", 1, slot.array.ctypes.data),
        ("sync", 0, 1),  # (ready: the caller's stream of device 1)
        ("stream", 1, 1),
        ("sync", 1, 1),  # (settle: the copy stream's copies)
        ("set_result", 1, None),
        ("unregister", 1, slot.array.ctypes.data),
    ]
    assert cuda.ran[0].thread.startswith(PIN)
    assert cuda.ran[1].thread == caller
    if waited_by == "future":  # (Work.wait's caller and the group's thread race for it)
        assert cuda.ran[2].thread.startswith("fabricd-torch-")  # a group's thread, which
        assert cuda.ran[4].thread == cuda.ran[2].thread  # completes the future itself
    assert cuda.ran[5].thread.startswith(PIN)
    assert slot.locked is False


EXIT_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    from fabricd.torch.backend import FabricdProcessGroup
    from fabricd.torch.devices import PageLocker

    class NoDaemon:
        def array(self, name, shape, dtype):
            return np.zeros(shape, dtype=dtype)

        def close(self):
            print("client closed", flush=True)

    def unregister(ptr):
        print("unregistered", flush=True)
        return 0

    group = FabricdProcessGroup(NoDaemon(), 0, 2, 10.0, "exit-test")
    group._staging.locker = PageLocker(lambda ptr, nbytes: 0, unregister)
    group._staging.for_device(group._staging.take("float32", 10), torch.device("cuda", 0))
    # (the script ends without destroy_process_group, as most training scripts do)
    """
)


def test_a_group_left_at_interpreter_exit_unregisters_and_closes_its_client() -> None:
    """Python shuts its thread pools down before exit-time cleanup (the group's finalizer):
    the arrays are unregistered all the same, and the client closed, without a traceback."""
    root = os.path.dirname(os.path.dirname(fabricd.__file__))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unregistered", "client", "closed"], done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_close_racing_a_registration_leaves_nothing_registered() -> None:
    """A registration still running when close() takes the list is undone once it returns;
    the lock() in flight says not locked, and a lock() after close registers nothing and
    starts no thread."""
    started, go = threading.Event(), threading.Event()
    cuda = FakeCuda()

    def register(ptr: int, nbytes: int) -> int:
        started.set()
        go.wait(10)
        return cuda.register(ptr, nbytes)

    locker = PageLocker(register, cuda.unregister)
    array = np.zeros(16)
    answers: list[bool] = []
    locking = threading.Thread(
        target=lambda: answers.append(locker.lock(array.ctypes.data, array.nbytes))
    )
    locking.start()
    assert started.wait(10)
    closing = threading.Thread(target=locker.close)
    closing.start()
    for _ in range(10_000):  # (until close has begun: then the registration returns)
        if locker._closed:
            break
        time.sleep(0.001)
    go.set()
    locking.join(10)
    closing.join(10)
    assert not locking.is_alive()
    assert not closing.is_alive()
    assert answers == [False]
    assert [r.arg for r in cuda.registered] == [array.ctypes.data]
    assert [r.arg for r in cuda.unregistered] == [array.ctypes.data]
    assert locker.lock(array.ctypes.data, array.nbytes) is False
    assert len(cuda.registered) == 1
    assert locker._thread is None


def test_close_on_the_page_locking_thread_itself_runs_there() -> None:
    """The group's cleanup run on the page-locking thread (the garbage collector may run it
    anywhere) unregisters there, instead of waiting for its own single worker."""
    cuda = FakeCuda()
    locker = PageLocker(cuda.register, cuda.unregister)
    first, second = np.zeros(16), np.zeros(16)
    assert locker.lock(first.ctypes.data, first.nbytes)

    def register_then_close(ptr: int, nbytes: int) -> int:
        locker.close()
        return cuda.register(ptr, nbytes)

    locker._register = register_then_close
    assert locker.lock(second.ctypes.data, second.nbytes) is False  # (closed meanwhile)
    assert [r.arg for r in cuda.unregistered] == [first.ctypes.data, second.ctypes.data]
    assert all(r.thread.startswith(PIN) for r in cuda.ran)


def test_a_registration_that_does_not_return_in_time_is_pageable_and_undone_at_close(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller waits for a registration at most LOCKER_WAIT seconds (then its copies go
    through pageable memory); one that returns later is unregistered at close."""
    monkeypatch.setattr(devices, "LOCKER_WAIT", 0.01)
    go = threading.Event()
    cuda = FakeCuda()

    def register(ptr: int, nbytes: int) -> int:
        go.wait(10)
        return cuda.register(ptr, nbytes)

    locker = PageLocker(register, cuda.unregister)
    array = np.zeros(16)
    with caplog.at_level(logging.WARNING, logger="fabricd.torch.devices"):
        assert locker.lock(array.ctypes.data, array.nbytes) is False
    assert any("did not return" in r.getMessage() for r in caplog.records)
    go.set()
    monkeypatch.setattr(devices, "LOCKER_WAIT", 10.0)
    locker.close()
    assert [r.arg for r in cuda.registered] == [array.ctypes.data]
    assert [r.arg for r in cuda.unregistered] == [array.ctypes.data]
