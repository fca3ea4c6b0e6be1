"""Keyed deadlines in a heap: what every engine uses to say when it must next be woken.

Rules: nothing but the bookkeeping of "key K is due at time t"; engines decide what a due key
means.

Theory of operation: a binary heap of ``(at, seq, key)`` with lazy deletion.  Setting a key
again or cancelling it leaves the old entry in the heap; :meth:`Deadlines.next` and
:meth:`Deadlines.pop_due` skip entries that no longer match the key's current deadline.  So
:meth:`set` and :meth:`cancel` cost O(log n) and O(1), :meth:`next` is amortised O(1), and the
cost of a frame never grows with the number of operations that merely wait.  Stale entries are
compacted away once they outnumber live ones, so memory stays O(live keys).

A deadline of ``0.0`` is a deadline like any other (a virtual clock starts there).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """Deadlines by key; at most one per key."""

    def __init__(self) -> None:
        self._at: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def get(self, key: K) -> float | None:
        """When ``key`` is due, or ``None``."""
        return self._at.get(key)

    def set(self, key: K, at: float) -> None:
        """Make ``key`` due at ``at`` (replacing any earlier deadline of it)."""
        self._at[key] = at
        heapq.heappush(self._heap, (at, next(self._seq), key))
        if len(self._heap) > 2 * len(self._at) + 64:
            self._compact()

    def cancel(self, key: K) -> None:
        """Forget ``key``'s deadline, if it has one."""
        self._at.pop(key, None)

    def next(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing is due ever."""
        heap = self._heap
        while heap:
            at, _, key = heap[0]
            if self._at.get(key) == at:
                return at
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float) -> list[K]:
        """Remove and return every key due at or before ``now``, earliest first."""
        due: list[K] = []
        while (at := self.next()) is not None and at <= now:
            _, _, key = heapq.heappop(self._heap)
            del self._at[key]
            due.append(key)
        return due

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if self._at.get(entry[2]) == entry[0]]
        heapq.heapify(self._heap)
