"""What the network tests read: operation outcomes, peer states, a daemon's fds and memory.

Outcomes are observed by polling every handle (``done()`` never blocks), so each outcome's time
is when the test saw it: never earlier than the daemon decided it, so a bound checked on it is
checked conservatively.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import fabricd

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.client.handle import Handle


def pattern(seed: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The exact bytes message ``seed`` carries: distinct per message, cheap to make."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one operation ended: ``"ok"`` or the exception's type name, when, and the message
    and error code (``code`` of an ``OperationFailed``)."""

    what: str
    ended: str
    at: float
    message: str = ""
    code: str = ""


def outcomes(handles: Sequence[Handle[Any]], timeout: float) -> list[Outcome]:
    """Wait for every handle (at most ``timeout`` seconds, a hang guard) and say how each ended.

    Raises:
        AssertionError: some operation was still pending after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    found: dict[int, Outcome] = {}
    while len(found) < len(handles):
        for i, handle in enumerate(handles):
            if i in found or not handle.done():
                continue
            now = time.monotonic()
            try:
                handle.wait(0)
                found[i] = Outcome(handle.what, "ok", now)
            except fabricd.FabricError as exc:
                code = str(getattr(exc, "code", ""))
                found[i] = Outcome(handle.what, type(exc).__name__, now, str(exc), code)
        if time.monotonic() > deadline:
            pending = [h.what for i, h in enumerate(handles) if i not in found]
            raise AssertionError(f"still pending after {timeout}s: {pending}")
        time.sleep(0.005)
    return [found[i] for i in range(len(handles))]


def peers(socket_path: str) -> list[dict[str, Any]]:
    """The daemon's peer rows (``fabricctl peers --json`` has the same)."""
    with fabricd.connect(socket_path=socket_path) as control:
        rows: list[dict[str, Any]] = control.status()["peers"]
    return rows


def peer_state(socket_path: str, node: int) -> str:
    return str(next(row["state"] for row in peers(socket_path) if row["node"] == node))


def wait_for(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Poll ``predicate`` until true; return when it was first seen true, or None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def fd_count(pid: int) -> int:
    """How many file descriptors process ``pid`` holds."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_bytes(pid: int) -> int:
    """Process ``pid``'s resident set, in bytes (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def anon_bytes(pid: int) -> int:
    """Process ``pid``'s own memory in use, in bytes (``RssAnon``).

    Unlike ``VmRSS`` this leaves out the clients' shared-memory segments that the daemon maps
    (``RssShmem``): their pages are the clients' arrays, not memory the daemon allocated.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for pid {pid}")


class Sampler:
    """Call ``sample()`` every ``interval`` seconds in a thread, from start until stop.

    A context manager; :attr:`samples` holds what each call returned, in order.  A call that
    raises stops the sampler and the exception is raised again by :meth:`stop`.
    """

    def __init__(self, sample: Callable[[], Any], interval: float = 0.05) -> None:
        self.samples: list[Any] = []
        self._sample = sample
        self._interval = interval
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.samples.append(self._sample())
                self._stop.wait(self._interval)
        except BaseException as exc:  # handed to stop()
            self._error = exc

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self._error is not None:
            raise self._error
