"""Frames of one kind to peers on their data links, in order per peer.

A service that sends bulk frames (a collective's COLL, a stochastic reduce's UPDATE) hands
them here: each goes at once while the peer's link takes it (``Link.send_now``), else into a
queue that one task per peer drains, waiting out backpressure, so the frames to one peer leave
in the order they were given.  A link that fails or is replaced takes its queue with it
(:meth:`DataQueues.drop`, from the service's ``peer_down``): what was queued is lost with the
peer's other frames in flight, and the task never touches a newer link's queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from fabricd.daemon.logs import RateLimitedLog
from fabricd.errors import LocalProtocolError, TransportError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.service import Host
    from fabricd.transports.base import Link
    from fabricd.wire import Kind, Meta

log = logging.getLogger("fabricd.daemon")
remote_log = RateLimitedLog(log)


class DataQueues:
    """In-order sending of ``kind`` frames on peers' data links (module docstring)."""

    def __init__(self, host: Host, kind: Kind, *, sent: Callable[[int], None]) -> None:
        """``sent(n)`` is told the payload bytes of each frame that left."""
        self.host = host
        self.kind = kind
        self._sent = sent
        self._queues: dict[int, deque[tuple[Meta, memoryview, Callable[[bool], None] | None]]] = {}
        self._senders: dict[int, asyncio.Task[None]] = {}

    def send(
        self,
        node: int,
        meta: Meta,
        payload: memoryview,
        left: Callable[[bool], None] | None = None,
    ) -> bool:
        """Send one frame to ``node``; ``True``: it left at once (``left`` is not called),
        ``False``: ``left`` will say what became of it (``True`` once it leaves, ``False``
        if it was dropped: its link went first, or ``node`` has none)."""
        queue = self._queues.get(node)
        if not queue:
            link = self.host.data_link(node)
            if link is None:  # its node is down: the service's peer_down says what it means
                return _dropped(left)
            try:
                if link.send_now(self.kind, meta, [payload] if payload else []):
                    self._sent(len(payload))
                    return True
            except (TransportError, LocalProtocolError) as exc:
                remote_log.warning("send", "%s frame to node %d: %s", self.kind.name, node, exc)
                return _dropped(left)
            queue = self._queues.setdefault(node, deque())
        queue.append((meta, payload, left))
        if node not in self._senders:
            link = self.host.data_link(node)
            if link is None:
                self.drop(node)
                return False
            self._senders[node] = self.host.spawn(self._drain(node, link, queue))
        return False

    def drop(self, node: int) -> None:
        """``node``'s links were reset: what is queued for it is lost (its ``left`` hears so);
        its task ends on its own queue and link."""
        queue = self._queues.pop(node, None)
        self._senders.pop(node, None)
        for _, _, left in queue or ():
            if left is not None:
                left(False)

    def pending(self, node: int) -> int:
        """Frames waiting in ``node``'s queue (not yet handed to its link)."""
        return len(self._queues.get(node, ()))

    def queued(self) -> int:
        """Frames waiting in all queues."""
        return sum(len(q) for q in self._queues.values())

    async def sent_all(self) -> None:
        """Wait until every queue is handed to its link (or dropped): a stopping daemon
        cancels its tasks, and what they still held would be lost, while what a link holds
        goes out as it closes.  (Cancelling the wait leaves the senders alone.)"""
        if self._senders:
            await asyncio.wait(set(self._senders.values()))

    async def _drain(
        self,
        node: int,
        link: Link,
        queue: deque[tuple[Meta, memoryview, Callable[[bool], None] | None]],
    ) -> None:
        me = asyncio.current_task()
        try:
            while queue and self._queues.get(node) is queue:
                meta, payload, left = queue[0]
                await link.send(self.kind, meta, [payload] if payload else [])
                self._sent(len(payload))
                if self._queues.get(node) is not queue:
                    break  # dropped meanwhile: drop() told ``left`` already, once is all
                queue.popleft()
                if left is not None:
                    left(True)
        except (TransportError, LocalProtocolError) as exc:
            remote_log.warning("send", "%s frames to node %d: %s", self.kind.name, node, exc)
            if self._queues.get(node) is queue:
                self.drop(node)
        finally:
            if self._senders.get(node) is me:
                del self._senders[node]


def _dropped(left: Callable[[bool], None] | None) -> bool:
    if left is not None:
        left(False)
    return False
