"""Bodies of client processes used by the integration tests (run under multiprocessing spawn).

Each function is a whole rank: it connects to its node's daemon, does its part and raises on any
wrong byte, so a non-zero exit status is a failed check.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import fabricd

#: (peer, tag, dtype, count): one message between two ranks, in plan order
Step = tuple[str, int, int, str, int]


def payload(src: int, dst: int, tag: int, dtype: str, count: int) -> np.ndarray[Any, Any]:
    """The exact array rank ``src`` sends to ``dst`` with ``tag``: every element distinct."""
    rng = np.random.default_rng([src, dst, tag, count])
    raw = rng.integers(0, 256, size=count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype)


def run_plan(socket_path: str, job: str, rank: int, size: int, plan: list[Step]) -> None:
    """Carry out ``plan`` in order: ("send"|"recv", peer, tag, dtype, count) steps."""
    with fabricd.connect(job=job, rank=rank, size=size, socket_path=socket_path) as fab:
        for i, (op, peer, tag, dtype, count) in enumerate(plan):
            array = fab.array(f"step{i}", (count,), dtype)
            if op == "send":
                src, dst = rank, peer
                array[...] = payload(src, dst, tag, dtype, count)
                done = fab.send(array, to=peer, tag=tag, timeout=60)
            else:
                src, dst = peer, rank
                done = fab.recv(array, src=peer, tag=tag, timeout=60)
                expected = payload(src, dst, tag, dtype, count)
                if not np.array_equal(array.view(np.uint8), expected.view(np.uint8)):
                    raise AssertionError(f"step {i}: bytes from rank {peer} differ")
            if done.nbytes != count * np.dtype(dtype).itemsize or done.peer != peer:
                raise AssertionError(f"step {i}: completion {done} is wrong")


def recv_expecting_failure(
    socket_path: str, job: str, rank: int, size: int, src: int, result: Any
) -> None:
    """Post a receive that can never complete normally; report how it ended and when."""
    with fabricd.connect(job=job, rank=rank, size=size, socket_path=socket_path) as fab:
        array = fab.array("never", (1024,), "float32")
        handle = fab.recv_async(array, src=src)
        result.put(("posted", time.monotonic()))
        try:
            handle.wait(timeout=30)
            result.put(("completed", time.monotonic()))
        except fabricd.FabricError as exc:
            result.put((type(exc).__name__, time.monotonic(), str(exc)))


def join_and_wait(
    socket_path: str, job: str, rank: int, size: int, seconds: float, joined: Any = None
) -> None:
    """Join a job, hold a shared array, and stay connected for a while."""
    with fabricd.connect(job=job, rank=rank, size=size, socket_path=socket_path) as fab:
        fab.array("held", (4096,), "uint8")
        if joined is not None:
            joined.put(("joined", rank))
        time.sleep(seconds)


def send_forever(
    socket_path: str, job: str, rank: int, size: int, dst: int, mib: int, started: Any
) -> None:
    """Send a big array and signal; the test kills this process mid-send."""
    with fabricd.connect(job=job, rank=rank, size=size, socket_path=socket_path) as fab:
        array = fab.array("big", (mib * 1024 * 1024,), "uint8")
        array[...] = 7
        handle = fab.send_async(array, to=dst)
        started.put(True)
        handle.wait(timeout=60)
        time.sleep(60)


def allreduce_until_interrupted(
    socket_path: str, job: str, rank: int, size: int, value: float, result: Any
) -> None:
    """Call a sync ``fab.allreduce`` of 4 float32 ``value`` and wait in it until the test
    interrupts this process (SIGINT: Ctrl-C), then leave the ``with`` block as a trainer
    does; report ("calling",) before the call, then how it ended and the exception's notes."""
    with fabricd.connect(job=job, rank=rank, size=size, socket_path=socket_path) as fab:
        array = fab.array("g", (4,), "float32")
        array[:] = value
        result.put(("calling",))
        try:
            got = fab.allreduce(array, "sum", timeout=60)
        except KeyboardInterrupt as exc:
            result.put(("interrupted", getattr(exc, "__notes__", [])))
            return
        result.put(("completed", got))
