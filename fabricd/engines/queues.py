"""First-in, first-out queues by key, from which an item can also leave out of turn.

Rules: bookkeeping only.  What a key or an item means is the caller's (the point-to-point
engine keeps its posted receives and its unmatched messages here, keyed by job, source,
destination and tag).

Theory of operation: one deque of :class:`Slot` objects per key.  :meth:`KeyedQueues.push`
returns the item's slot; :meth:`KeyedQueues.remove` empties the slot in O(1) instead of
searching the deque, and :meth:`KeyedQueues.first` drops empty slots at the head as it meets
them.  A queue whose empty slots outnumber its items is compacted, and a queue with no item left
is deleted; the table of queues is rebuilt once more queues were deleted from it than twice
the number left (a Python dict never returns the memory of deleted entries: 10^5 receives on
distinct tags would otherwise keep ~5 MB after they ended).  So memory stays O(items) and every
call is amortised O(1): an operation whose client left costs nothing to withdraw from the middle
of a long queue.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Slot(Generic[K, T]):
    """An item's place in the queue of ``key``; ``item`` is ``None`` once it left."""

    __slots__ = ("item", "key")

    def __init__(self, key: K, item: T) -> None:
        self.key = key
        self.item: T | None = item


@dataclass(slots=True, eq=False)
class _Queue(Generic[K, T]):
    slots: collections.deque[Slot[K, T]] = field(default_factory=collections.deque)
    live: int = 0  #: slots that still hold an item


class KeyedQueues(Generic[K, T]):
    """FIFO queues of items by key, with removal from anywhere."""

    def __init__(self) -> None:
        self._queues: dict[K, _Queue[K, T]] = {}
        self._items = 0
        self._deleted = 0  #: queues deleted from ``_queues`` since it was last rebuilt

    def __len__(self) -> int:
        """Items in all queues."""
        return self._items

    def push(self, key: K, item: T) -> Slot[K, T]:
        """Queue ``item`` last under ``key``; keep the slot to :meth:`remove` it later."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        slot = Slot(key, item)
        queue.slots.append(slot)
        queue.live += 1
        self._items += 1
        return slot

    def first(self, key: K) -> T | None:
        """The oldest item queued under ``key`` (it stays queued), or ``None``."""
        queue = self._queues.get(key)
        if queue is None:
            return None
        slots = queue.slots
        while (item := slots[0].item) is None:  # a live queue holds a live slot
            slots.popleft()
        return item

    def remove(self, slot: Slot[K, T]) -> None:
        """Take ``slot``'s item out of its queue; nothing if it already left."""
        if slot.item is None:
            return
        slot.item = None
        self._items -= 1
        queue = self._queues[slot.key]
        queue.live -= 1
        if not queue.live:
            del self._queues[slot.key]
            self._deleted += 1
            if self._deleted > 2 * len(self._queues) + 64:
                self._queues = dict(self._queues)
                self._deleted = 0
        elif len(queue.slots) > 2 * queue.live + 8:
            queue.slots = collections.deque(s for s in queue.slots if s.item is not None)
