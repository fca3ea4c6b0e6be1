"""The daemon's local copy off the event loop (:func:`fabricd.daemon.datapath.copy`)."""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fabricd.daemon import datapath
from fabricd.errors import OperationFailed

SIZE = datapath.THREAD_COPY_MIN


async def test_a_copy_whose_thread_cannot_start_lets_go_of_both_segments(monkeypatch) -> None:
    # ThreadPoolExecutor.submit queues the work item before it fails to start a thread, and
    # the item waits there until some later thread takes it.  Holding the two arrays meanwhile
    # kept both mappings exported: mmap could not close them, so their address space and fds
    # stayed taken (uncounted once detached) however many copies failed that way.
    source, target = mmap.mmap(-1, SIZE), mmap.mmap(-1, SIZE)
    source[:4] = b"abcd"

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    copiers = ThreadPoolExecutor()  # no idle worker: the copy must start a thread
    monkeypatch.setattr(datapath, "_copiers", copiers)
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with (
        memoryview(source) as src,
        memoryview(target) as dst,
        pytest.raises(OperationFailed) as failed,
    ):
        await datapath.copy(dst, src)
    assert failed.value.code == "resources"
    del failed  # its traceback holds copy()'s frame, and so the arrays
    assert copiers._work_queue.qsize() == 1  # the item is still queued ...
    source.close()  # ... yet holds neither mapping (BufferError before)
    target.close()
    monkeypatch.undo()
    copiers.submit(int).result(timeout=30)  # a thread starts, runs the dropped item: no copy
    copiers.shutdown()


async def test_a_copy_whose_thread_start_raises_anything_is_never_run_later(monkeypatch) -> None:
    # submit queues the item before it starts a thread, and starting one can fail with
    # MemoryError as well as RuntimeError: the copy failed (its receive too), yet the queued
    # item ran once a thread came, writing into a receive already failed and maybe reused
    source, target = bytearray(b"x" * SIZE), bytearray(SIZE)

    def no_memory(self: threading.Thread) -> None:
        raise MemoryError

    copiers = ThreadPoolExecutor()
    monkeypatch.setattr(datapath, "_copiers", copiers)
    monkeypatch.setattr(threading.Thread, "start", no_memory)
    with pytest.raises(OperationFailed) as failed:
        await datapath.copy(memoryview(target), memoryview(source))
    assert failed.value.code == "resources"
    monkeypatch.undo()
    copiers.submit(int).result(timeout=30)  # a thread starts and takes the queued item first
    copiers.shutdown(wait=True)
    assert not any(target)
