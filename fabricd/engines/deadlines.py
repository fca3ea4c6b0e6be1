"""Keyed deadlines in a heap: what every engine uses to say when it must next be woken.

Rules: nothing but the bookkeeping of "key K is due at time t"; engines decide what a due key
means.

Theory of operation: a binary heap of ``(at, seq, key)`` with lazy deletion.  Setting a key
again or cancelling it leaves the old entry in the heap; :meth:`Deadlines.next` and
:meth:`Deadlines.pop_due` skip entries that no longer match the key's current deadline.  So
:meth:`set` and :meth:`cancel` cost O(log n) and O(1), :meth:`next` is amortised O(1), and the
cost of a frame never grows with the number of operations that merely wait.  Stale entries are
compacted away once they outnumber live ones, and the table of current deadlines is rebuilt
once more keys left it (cancelled or popped) than twice what it holds: a Python dict never
returns the memory of deleted entries, and 10^5 receives that waited for a rank would otherwise
keep ~5 MB after they ended.  Both rebuilds cost O(live keys) after at least as many removals,
so every call stays amortised O(log n), and memory stays O(live keys).

A deadline of ``0.0`` is a deadline like any other (a virtual clock starts there).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: removals (or stale entries) tolerated beyond twice the live keys before a rebuild: small
#: tables are never rebuilt, large ones once per halving
_SLACK: Final = 64


class Deadlines(Generic[K]):
    """Deadlines by key; at most one per key."""

    def __init__(self) -> None:
        self._at: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._removed = 0  #: keys cancelled or popped since the last rebuild

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
        if len(self._heap) > 2 * len(self._at) + _SLACK:
            self._compact()

    def cancel(self, key: K) -> None:
        """Forget ``key``'s deadline, if it has one."""
        if self._at.pop(key, None) is not None:
            self._left()

    def next(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing is due ever."""
        heap = self._heap
        while heap:
            at, _, key = heap[0]
            if self._at.get(key) == at:
                return at
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float, limit: int | None = None) -> list[K]:
        """Remove and return every key due at or before ``now``, earliest first; at most
        ``limit`` of them (the rest stay due: :meth:`next` says so), so that a caller can
        spread a burst of expiries over several timer ticks."""
        due: list[K] = []
        while (limit is None or len(due) < limit) and (at := self.next()) is not None and at <= now:
            _, _, key = heapq.heappop(self._heap)
            del self._at[key]
            due.append(key)
            self._left()
        return due

    def _left(self) -> None:
        """A key left: once removals outnumber twice what is left, give their memory back."""
        self._removed += 1
        if self._removed > 2 * len(self._at) + _SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries and rebuild the table: O(live keys + stale entries)."""
        self._heap = [entry for entry in self._heap if self._at.get(entry[2]) == entry[0]]
        heapq.heapify(self._heap)
        self._at = dict(self._at)
        self._removed = 0
