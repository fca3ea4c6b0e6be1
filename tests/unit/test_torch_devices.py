"""The ``fabricd`` process group's device logic (fabricd/torch/devices.py, issue 30, item 1),
without a GPU and without a daemon: which tensors a call takes, and which copy path a staging
array gets (page-locked for a CUDA call, registered off the caller's thread, pageable when
registration fails, unregistered at close).  The CUDA copies themselves need a GPU:
tests/integration/test_torch_backend_devices.py runs them where torch sees one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch

from fabricd.errors import UsageError
from fabricd.torch.backend import FabricdProcessGroup
from fabricd.torch.devices import CPU, CopyStreams, PageLocker, device_of, future_for
from fabricd.torch.staging import Staging

CUDA = torch.device("cuda", 0)  # (a device object: made without a GPU, never used as one)


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


class FakeCuda:
    """cudaHostRegister and cudaHostUnregister as a test sees them: each call's arguments and
    thread, and the error code ``fail_with`` (0: success)."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.registered: list[tuple[int, int, str]] = []
        self.unregistered: list[tuple[int, str]] = []

    def register(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes, threading.current_thread().name))
        return self.fail_with

    def unregister(self, ptr: int) -> int:
        self.unregistered.append((ptr, threading.current_thread().name))
        return 0


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
    ptr, nbytes = slot.array.ctypes.data, slot.array.nbytes
    assert [(p, n) for p, n, _ in cuda.registered] == [(ptr, nbytes)]
    assert cuda.registered[0][2] != threading.current_thread().name
    assert cuda.registered[0][2].startswith("fabricd-torch-pin")
    staging.release(slot)
    again = staging.for_device(staging.take("float32", 100), CUDA)  # (the same warm array)
    assert again is slot
    assert len(cuda.registered) == 1
    staging.close()
    assert [p for p, _ in cuda.unregistered] == [ptr]
    assert cuda.unregistered[0][1].startswith("fabricd-torch-pin")


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
