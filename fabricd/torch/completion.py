"""Finishing the ``fabricd`` process group's calls: their Works, and the thread that completes
them (:mod:`fabricd.torch.backend`).

A call's daemon operations are started in the caller's thread; a thread of the group's then
waits for them, copies the results out and completes the call's future.  Choices, and why:

* *Each call when its own operations are done*, not in the order the calls were made: a
  receive posted early (``irecv``) may wait for a send its peer makes only after later
  collectives, and must not hold those up.  The thread waits on the oldest call's operation
  in short slices (:data:`SLICE` seconds: a reply for that call wakes it at once) and looks at
  the others between slices, so an out-of-order completion waits at most a slice.
* *Calls of one collective, one after the other.*  A daemon takes one call of a named
  collective per rank at a time, and the backend gives every call of one operation, dtype
  and span the same name (a new name costs the daemons a new collective: buffers the size
  of the tensor, faulted in over its first two rounds).  A call made while its name's
  previous call is still under way here is *deferred*: this thread starts it once that one's
  operations are done (its ``after``), and the caller does not wait.
* *Leader and followers* (a pool that grows as needed): one thread at a time
  *leads* (waits for the daemon, starts deferred calls); the one that finds a call done hands
  the lead to another and then completes the call's future itself.  A future's ``then``
  callbacks run where it is completed, and a callback may wait for another call of the group
  (torch's PowerSGD DDP hook does), which the new leader is free to finish.  A thread is
  added only when none waits to lead (all are completing calls, or in callbacks), so there
  is always one to lead, however many callbacks wait at once (a bound of 16 hung the group
  when 16 callbacks waited together).  The reply
  reaches the future in one thread: an earlier build handed every completed call to a
  notifier thread, a second wake-up on the way to DDP, which waits on futures (2 ranks, one
  small bucket a step: 0.87-0.90x gloo's steps/s; docs/performance.md).
* *A call's deadline counts from when it was made* (the group's ``timeout``), not from when
  this thread reached it.  A call that times out breaks the group, as NCCL's does: its
  daemon operation is still open, so a peer arriving late would pair with it, and every later
  call would be shifted by one.  Later calls fail at once, saying so.
* *A thread that waits for a call finishes it* (``Work.wait``): it reads the daemon's reply
  itself, copies the result out and completes the future, instead of waking the leader.  Each
  such hand-off is a wake-up on cores the daemons share; at 4 ranks they were a quarter of a
  4 MiB allgather (docs/performance.md).  Whichever of the two claims a call first finishes
  it.
* :class:`Work`'s ``wait(timeout)`` honours its timeout (a Work torch makes from a future
  ignores it, and returns ``True`` from ``wait()`` even when the future failed).
* *A CUDA call's future is completed with its device current* (:func:`_set`): a CUDA-aware
  future records its events on, and runs its callbacks with, the current device's streams,
  and a thread that never set a device works on device 0.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist

from fabricd.errors import Timeout, UsageError
from fabricd.torch.devices import CPU, on_device

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import datetime
    from collections.abc import Callable

    from fabricd.client.handle import Handle
    from fabricd.torch.staging import Slot

#: seconds the thread waits on the oldest call before it looks at the others again
SLICE: Final = 0.002
#: seconds :meth:`Completer.close` waits for the group's threads, all of them together
CLOSE_WAIT: Final = 5.0


@dataclass(slots=True, eq=False)
class Call:
    """A call in flight: the daemon's operations it waits for, what to do then, its slots;
    a deferred one also what starts its operations, and the call they wait for."""

    what: str
    handles: list[Handle[Any]]
    finish: Callable[[], object]
    slots: list[Slot]
    release: Callable[[Slot], None]
    deadline: float
    future: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)
    device: torch.device = CPU  #: its tensors' device (current when its future is set)
    start: Callable[[], list[Handle[Any]]] | None = None  #: deferred: what starts it
    after: Call | None = None  #: deferred: it starts once this call's operations are done
    failure: BaseException | None = None  #: what its start raised
    claimed: bool = False  #: a thread is finishing it (this group's, or one waiting for it)

    def begin(self) -> None:
        """Start the call's operations (a failure to start fails the call)."""
        if self.start is None:
            return
        try:
            self.handles = self.start()
        except Exception as exc:
            self.failure = exc
        # (only now: until its handles are in place the call is not settled to a caller
        # reading it from another thread)
        self.start = self.after = None


def settled(call: Call) -> bool:
    """Whether ``call``'s operations are over on the daemon: started and each one answered
    (or failed), or the call itself completed."""
    if call.future.done():
        return True
    if call.start is not None:
        return False
    try:
        return all(h.done() for h in call.handles)
    except Exception:  # (a failed reply: answered)
        return True


class Completer:
    """Finishes a process group's calls (module docstring), on threads of its own."""

    def __init__(self) -> None:
        self.broken: str | None = None  #: why the group is broken (a call timed out)
        self._calls: collections.deque[Call] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._lead = threading.Lock()  #: held by the thread that leads
        self._threads: list[threading.Thread] = []
        self._followers = 0  #: threads waiting to lead
        self._spawn()

    def add(self, call: Call) -> None:
        """Finish ``call`` once its operations are done.

        Raises:
            UsageError: the group was shut down, or is broken.
        """
        with self._cond:
            if self._closed:
                raise UsageError("the fabricd process group was shut down")
            if self.broken is not None:
                raise UsageError(self.broken)
            self._calls.append(call)
            self._cond.notify()

    def close(self) -> None:
        """No more calls; wait up to :data:`CLOSE_WAIT` in all for the threads (a call still
        open, such as an unmatched receive, keeps its leader until the client closes and
        fails it: the waits share one deadline, or each thread would add its own)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + CLOSE_WAIT
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))

    def _spawn(self) -> None:
        """A thread more (under ``_cond``, or before any runs)."""
        name = f"fabricd-torch-{len(self._threads)}"
        thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        """Lead until a call is done, hand the lead on, complete that call; again."""
        while True:
            with self._cond:
                self._followers += 1
            with self._lead:
                with self._cond:
                    self._followers -= 1
                call = self._next_done()
                if call is not None:
                    with self._cond:  # someone to lead while this thread completes it
                        if not self._followers and not self._closed:
                            self._spawn()
            if call is None:
                return
            try:
                self._complete(call)
            except Exception:  # (a future that refused its outcome: this thread goes on)
                log.exception("fabricd backend: completing %s failed", call.what)
            finally:
                with self._cond:
                    if call in self._calls:
                        self._calls.remove(call)

    def _next_done(self) -> Call | None:
        """Lead: start deferred calls, and wait until a call is done (claimed, for this
        thread to complete); ``None`` once the group is closed and no call is left."""
        while True:
            with self._cond:
                while not self._calls and not self._closed:
                    self._cond.wait()
                if not self._calls:
                    return None
                pending = list(self._calls)
            for call in pending:
                if call.start is not None and (call.after is None or settled(call.after)):
                    call.begin()
            done = [call for call in pending if self._ready(call)]
            if not done:
                self._wait_a_slice(pending)
                continue
            for call in done:
                if self._claim(call):
                    return call
                with self._cond:  # (a thread that waits for it finishes it)
                    if call in self._calls:
                        self._calls.remove(call)

    def finish_here(self, call: Call, timeout: float) -> None:
        """Finish ``call`` in this thread (one waiting for it) once its operations are done,
        unless it is deferred, fails, takes longer than ``timeout`` (0: its deadline), or
        the group's thread has it already: then that thread finishes it, as any other."""
        if call.start is not None or call.future.done():
            return
        end = min(call.deadline, time.monotonic() + timeout) if timeout > 0 else call.deadline
        try:
            for handle in call.handles:
                handle.wait(max(end - time.monotonic(), 0.0))
        except Exception:  # (a timeout, or a failure: the group's thread reports it)
            return
        if not self._claim(call):
            return
        self._complete(call)
        with self._cond:
            if call in self._calls:
                self._calls.remove(call)

    def _claim(self, call: Call) -> bool:
        with self._cond:
            if call.claimed:
                return False
            call.claimed = True
            return True

    @staticmethod
    def _ready(call: Call) -> bool:
        if time.monotonic() >= call.deadline or call.failure is not None:
            return True
        return call.start is None and settled(call)

    def _wait_a_slice(self, pending: list[Call]) -> None:
        """Wait up to a slice for the oldest started call's next answer (one that comes wakes
        it at once)."""
        for call in pending:
            left = call.deadline - time.monotonic()
            for handle in call.handles:
                try:
                    if not handle.done():
                        handle.wait(max(min(SLICE, left), 0.0))
                        return
                except Exception:  # (Timeout: a slice passed; a failure: _complete reports it)
                    return
        with self._cond:  # (nothing started to wait on: a new call or a slice)
            self._cond.wait(SLICE)

    def _complete(self, call: Call) -> None:
        """Finish ``call`` in this thread: copy its result out, give its slots back, and
        complete its future (its callbacks run here)."""
        try:
            if call.failure is not None:
                raise call.failure
            if call.start is not None:
                raise Timeout(f"{call.what} waited past its timeout for its collective's last call")
            for handle in call.handles:
                handle.wait(max(call.deadline - time.monotonic(), 0.0))
            with torch.no_grad():  # (grad mode is per thread; outputs may require grad)
                value = call.finish()
        except BaseException as exc:  # (the waiter gets it: wait() raises, never hangs)
            if isinstance(exc, Timeout):
                self.broken = (
                    f"the fabricd process group is broken: {call.what} timed out, and its "
                    "peers may still complete it; destroy the group and make a new one"
                )
            for slot in call.slots:
                call.release(slot)
            _set(
                call.device,
                call.future.set_exception,
                RuntimeError(f"fabricd backend: {call.what} failed: {exc}"),
            )
            return
        for slot in call.slots:
            call.release(slot)
        _set(call.device, call.future.set_result, value)


def _set(device: torch.device, complete: Callable[[Any], None], outcome: Any) -> None:
    """``complete(outcome)`` (a future's ``set_result`` or ``set_exception``) with ``device``
    current (module docstring)."""
    with on_device(device):
        complete(outcome)


class Work(dist.Work):
    """A call's ``Work`` (module docstring)."""

    def __init__(
        self,
        future: torch.futures.Future[Any],
        call: Call | None = None,
        completer: Completer | None = None,
    ) -> None:
        super().__init__()
        self._future = future
        self._call, self._completer = call, completer  #: (a call of its own: finished here)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        end = time.monotonic() + seconds  # (one timeout for both waits below)
        if self._call is not None and self._completer is not None:
            self._completer.finish_here(self._call, seconds)
        if seconds > 0 and not self._future.done():
            # (a callback only now, not for every Work: it cost tens of microseconds a call;
            # torch runs it at once if the future is done meanwhile)
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            # (a future is done before its callbacks run, and earlier ones may take long)
            if not done.wait(max(end - time.monotonic(), 0.0)) and not self._future.done():
                raise RuntimeError(f"fabricd backend: the call did not finish within {seconds} s")
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        return self._future.wait()


def all_of(works: list[Any], value: Any) -> Work:
    """One Work for several: done (or failed) once they all are."""
    futures = [work.get_future() for work in works]

    def done(_: torch.futures.Future[Any]) -> Any:
        for future in futures:
            future.wait()  # (raises what failed one)
        return value

    return Work(torch.futures.collect_all(futures).then(done))
