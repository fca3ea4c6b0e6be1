"""Logging an operator can read: one line per event, text by default, JSON on request.

Lines that remote input causes (a peer's junk, a flood of connections, a client's bad frame)
go through :class:`RateLimitedLog`, so whoever sends the input cannot make the daemon write
lines as fast as it sends: past a small burst, each interval ends in one summary line with the
count of what it left out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

_TEXT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
#: lines of one key written in full per interval; the rest are counted and summarised
LOG_BURST: Final = 5
#: seconds per interval
LOG_INTERVAL: Final = 1.0


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, node, msg (and exc when there is one)."""

    def __init__(self, node: int) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "node": self.node,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str, fmt: str, node: int) -> None:
    """Send fabricd's logs to stderr (journald picks them up under systemd)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node))
    else:
        formatter = logging.Formatter(_TEXT.replace("%(name)s", f"node{node} %(name)s"))
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger("fabricd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


@dataclass(slots=True)
class _Window:
    start: float
    level: int
    logged: int = 0
    left_out: int = 0
    last: str = ""  #: the last line left out, formatted


class RateLimitedLog:
    """A logger for lines caused by remote input: at most ``burst`` per key per ``interval``.

    Each call names a *key*, a constant string that says what kind of event the line reports
    (never a value from the input: the table of keys must not grow with it).  The first
    ``burst`` lines of a key in an interval are written as usual; the rest are only counted,
    and when the interval ends one summary line says how many were left out and repeats the
    last of them.  With an event loop running, the summary is written when the interval
    ends; without one (tests), at the next call for that key or at :meth:`flush`.

    Args:
        logger: where the lines go.
        interval: seconds per interval.
        burst: lines per key written in full in each interval.
        clock: seconds, monotonic (the event loop's clock in the daemon).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = LOG_INTERVAL,
        burst: int = LOG_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval > 0 or burst < 0:
            raise ValueError("a log interval must be more than 0 s and its burst 0 or more")
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self.clock = clock
        self.left_out = 0  #: lines counted instead of written, since the start
        self._windows: dict[str, _Window] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None  #: the loop _timer is on
        _LIMITED.add(self)

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Write ``msg % args`` at ``level`` unless ``key`` had its burst this interval.

        ``exc_info``: a written line carries the exception being handled, with its traceback
        (a line left out is counted like any other: one traceback per burst, not one per event).
        Returns whether the line was written (``False``: counted for the summary).
        """
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now >= window.start + self.interval:
            if window is not None:
                self._summarise(key, window)
            window = self._windows[key] = _Window(start=now, level=level)
        if window.logged < self.burst:
            window.logged += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        if not self.logger.isEnabledFor(level):
            return False
        window.left_out += 1
        window.level = max(window.level, level)
        window.last = msg % args if args else msg
        self.left_out += 1
        self._schedule(window.start + self.interval - now)
        return False

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args)

    def flush(self, *, everything: bool = False) -> None:
        """Write the summary of every interval that ended (``everything``: of all of them)."""
        self._timer = None
        now = self.clock()
        for key, window in list(self._windows.items()):
            if everything or now >= window.start + self.interval:
                del self._windows[key]
                self._summarise(key, window)
        if self._windows and any(w.left_out for w in self._windows.values()):
            start = min(w.start for w in self._windows.values() if w.left_out)
            self._schedule(start + self.interval - now)

    def close(self) -> None:
        """Write every summary still owed and stop the timer (the daemon is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
        self.flush(everything=True)  # (no window is left, so it arms no timer)

    def _summarise(self, key: str, window: _Window) -> None:
        if window.left_out:
            self.logger.log(
                window.level,
                "%s: %d more such lines in %.1fs were left out; the last: %s",
                key,
                window.left_out,
                self.interval,
                window.last,
            )

    def _schedule(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test): the next call or flush() summarises
            return
        # a timer of another loop (one that ended with it pending: these logs are module-level
        # and outlive loops) will never fire; keeping it would stop every later summary
        if self._timer is not None and self._timer_loop is loop:
            return
        self._timer, self._timer_loop = loop.call_later(max(delay, 0.0), self.flush), loop


_LIMITED: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


def flush_all() -> None:
    """Write every summary that every :class:`RateLimitedLog` still owes (at the daemon's exit,
    so no count of what was left out is lost)."""
    for limited in list(_LIMITED):
        limited.close()
