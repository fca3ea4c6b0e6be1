"""The process group's completer (``fabricd/torch/completion.py``) on fake daemon handles: no
daemon, no cluster.  A review of its leader and followers found these (each a test here):
16 callbacks waiting at once for other calls hung the group, ``close()`` with a call still
open waited 5 s per thread, and ``Work.wait(timeout)`` raised for a call that had finished
when an earlier callback of its future was slow, and waited twice its timeout.
"""

from __future__ import annotations

import datetime
import threading
import time
import types
from typing import Any

import pytest
import torch

from fabricd.errors import Timeout
from fabricd.torch import completion
from fabricd.torch.completion import Call, Completer, Work

pytestmark = pytest.mark.timeout(120)

HANG_GUARD = 60.0  #: seconds a test waits for what must happen before it calls it a hang


class FakeHandle:
    """A daemon operation the test finishes by hand (``finished.set()``)."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self.finished.wait(timeout):
            raise Timeout("a slice passed")


def call_of(completer: Completer, what: str) -> tuple[Call, FakeHandle]:
    """A started call on ``completer``, whose operation finishes when the test says."""
    handle = FakeHandle()
    call = Call(
        what=what,
        handles=[handle],  # type: ignore[list-item]
        finish=lambda: what,
        slots=[],
        release=lambda slot: None,
        deadline=time.monotonic() + 600,
    )
    completer.add(call)
    return call, handle


@pytest.mark.parametrize("callbacks", [1, 16, 24])
def test_callbacks_that_wait_for_other_calls_never_leave_the_group_without_a_leader(
    callbacks: int,
) -> None:
    """Each outer call's callback waits for an inner call (torch's PowerSGD hook does), and
    the inner calls finish only once every outer callback runs: however many wait at once, a
    thread is left to lead and finish the inner ones."""
    completer = Completer()
    inner = [call_of(completer, f"inner {i}") for i in range(callbacks)]
    outer = [call_of(completer, f"outer {i}") for i in range(callbacks)]
    running = threading.Semaphore(0)

    def waiting_for(i: int) -> Any:
        def callback(_: torch.futures.Future[Any]) -> Any:
            running.release()
            return inner[i][0].future.wait()

        return callback

    chained = [call.future.then(waiting_for(i)) for i, (call, _) in enumerate(outer)]
    for _, handle in outer:
        handle.finished.set()
    for _ in range(callbacks):
        assert running.acquire(timeout=HANG_GUARD)
    for _, handle in inner:
        handle.finished.set()
    done = threading.Event()
    torch.futures.collect_all(chained).add_done_callback(lambda _: done.set())
    assert done.wait(HANG_GUARD), "the group was left with no thread to lead"
    assert [f.value() for f in chained] == [f"inner {i}" for i in range(callbacks)]
    completer.close()


def test_close_with_a_call_open_waits_once_for_all_the_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call still open (an unmatched receive) keeps the threads until the client closes:
    ``close()`` gives them one deadline in all, not one each (16 threads: 80 s)."""
    monkeypatch.setattr(completion, "CLOSE_WAIT", 0.5)
    completer = Completer()
    release = threading.Event()
    calls = [call_of(completer, f"call {i}") for i in range(6)]
    busy = threading.Semaphore(0)

    def blocking(_: torch.futures.Future[Any]) -> None:
        busy.release()
        release.wait(HANG_GUARD)

    for call, _ in calls:
        call.future.then(blocking)
    for _, handle in calls:
        handle.finished.set()
    for _ in calls:  # (every thread busy in a callback: the pool grew to one more)
        assert busy.acquire(timeout=HANG_GUARD)
    release.set()
    call_of(completer, "unmatched receive")
    joins: list[float] = []
    real_join = threading.Thread.join

    def join(thread: threading.Thread, timeout: float | None = None) -> None:
        joins.append(-1.0 if timeout is None else timeout)
        real_join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", join)
    completer.close()
    assert len(joins) >= 2
    assert all(0 <= t <= 0.5 for t in joins)
    assert sum(joins[1:]) < 0.5  # (the first join used up the one deadline)


def test_wait_with_a_timeout_is_not_fooled_by_an_earlier_slow_callback() -> None:
    """The call finishes while ``wait(timeout)`` waits, but a callback registered before
    ``wait`` blocks: the future is done, so ``wait`` returns instead of raising."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    work = Work(future)
    release = threading.Event()
    future.then(lambda _: release.wait(HANG_GUARD))
    timer = threading.Timer(0.05, lambda: future.set_result(1))
    timer.start()
    try:
        assert work.wait(datetime.timedelta(seconds=1.0))
    finally:
        release.set()
        timer.join()


def test_wait_with_a_timeout_waits_that_long_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unmatched receive: ``wait(timeout)`` spends its timeout waiting for the daemon and
    then has none left for the future (it waited twice its timeout).  On a fake clock."""
    clock = {"now": 1000.0}
    spent: list[float] = []
    waited: list[float] = []

    class Daemon:  # (the completer's part: time passes, no answer)
        def finish_here(self, call: Call, timeout: float) -> None:
            spent.append(timeout)
            clock["now"] += timeout

    class Event:
        def wait(self, timeout: float | None = None) -> bool:
            waited.append(-1.0 if timeout is None else timeout)
            return False

        def set(self) -> None:
            pass

    monkeypatch.setattr(completion, "time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    monkeypatch.setattr(completion, "threading", types.SimpleNamespace(Event=Event))
    future: torch.futures.Future[Any] = torch.futures.Future()
    call = Call(
        what="recv", handles=[], finish=lambda: None, slots=[], release=lambda s: None, deadline=0
    )
    work = Work(future, call, Daemon())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="did not finish within"):
        work.wait(datetime.timedelta(seconds=1.0))
    assert spent == [1.0]
    assert waited == [0.0]
