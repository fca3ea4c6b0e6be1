"""Counting the work fabricd's code does, for tests that bound cost without a clock.

:class:`WorkCounter` counts two things while it is active:

* every line of Python executed in files under ``fabricd/`` (``sys.settrace``): a loop written
  in Python, such as a scan of a queue per operation, shows as lines in proportion to its
  length;
* every equality comparison of an operation record (``Send``, ``Recv``, ``Remote``) or a
  ``Message``: a scan done in C (``list.remove``, ``x in deque``) runs no Python line but
  compares each element it passes, and these classes compare by identity only when patched to
  count.

Work per operation is then a ratio of integers: the same inputs give the same counts on any
machine, however loaded, so a test can say "abandoning 10^4 operations does no more work per
operation than abandoning 10^3" and mean it.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fabricd
from fabricd.engines.p2p import messages as p2p
from fabricd.engines.p2p import operations

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

    import pytest

ROOT = str(Path(fabricd.__file__).resolve().parent)


class WorkCounter:
    """Lines of fabricd executed and operation records compared, while :meth:`counting`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lines = 0
        self.compares = 0
        for cls in (operations.Send, operations.Recv, operations.Remote, p2p.Message):
            monkeypatch.setattr(cls, "__eq__", self._comparing(cls.__eq__))
        self._files: dict[str, bool] = {}

    @property
    def total(self) -> int:
        return self.lines + self.compares

    @contextlib.contextmanager
    def counting(self) -> Iterator[WorkCounter]:
        """Count from here to the end of the ``with`` block; counts add up across blocks."""
        previous = sys.gettrace()
        sys.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(previous)

    def _comparing(self, original: Any) -> Any:
        def eq(this: object, other: object) -> Any:
            self.compares += 1
            return original(this, other)

        return eq

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        name = frame.f_code.co_filename
        ours = self._files.get(name)
        if ours is None:
            ours = self._files[name] = str(Path(name).resolve()).startswith(ROOT)
        return self._line if ours else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            self.lines += 1
        return self._line
