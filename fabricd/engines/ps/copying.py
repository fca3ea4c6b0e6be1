"""A worker daemon's copies of its pushes for a shard's replica, under bounded replication
(MLfabric §3.3, §5.3): sent with the push, or when the shard's scheduler planned them
(:mod:`fabricd.engines.ps.copy_plan`).

Rules: the worker's daemon sends the replica (the partner of the rank serving the shard) a
copy of each push it sends straight to the server.  Without a plan the copy goes with the
push.  A GRANT with ``copy_us`` says when the copy may go (that long after the GRANT came);
one with ``hold`` says it is punted: the daemon holds it until a copy GRANT (``copy_only``)
says when, or :func:`~fabricd.engines.ps.copy_plan.hold_after` seconds after the push at the
latest, when it goes unplanned (a plan lost with a failover never strands a copy).  Held copies
are bounded in bytes as held frames are (``HELD_PAYLOADS`` x ``max_payload``): past that the
next due goes at once.  No copy is sent while the partner is not known (gone: a replica that
joins later gets the entries whole).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fabricd.engines.deadlines import Deadlines
from fabricd.engines.ps.copy_plan import hold_after
from fabricd.frames import ps as ps_frames

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key, Model
    from fabricd.engines.ps.node import PSNode
    from fabricd.frames import registry

#: one push's copy: (model, worker rank, shard, iteration)
CopyKey = tuple["Key", int, int, int]


class HeldCopies:
    """The copies this daemon's workers hold back, and when each may go."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        #: a grant's word on a copy whose push has not gone yet: when it may go (None: held)
        self._planned: dict[CopyKey, float | None] = {}
        self._forget: Deadlines[CopyKey] = Deadlines()  #: plans whose push never went
        self._held: dict[CopyKey, tuple[int, ps_frames.Push, bytes]] = {}  #: (to, frame, data)
        self._due: Deadlines[CopyKey] = Deadlines()

    def plan(self, copy: CopyKey, at: float | None, now: float, hold: float) -> None:
        """A grant says ``copy`` may go at ``at`` (``None``: held until told)."""
        if copy in self._held:
            self._due.set(copy, now + hold if at is None else at)
            return
        self._planned[copy] = at
        self._forget.set(copy, now + 2 * hold)

    def hold(self, copy: CopyKey, to: int, frame: ps_frames.Push, data: bytes, at: float) -> None:
        self._held[copy] = (to, frame, data)
        self.nbytes += len(data)
        self._due.set(copy, at)

    def planned(self, copy: CopyKey) -> tuple[bool, float | None]:
        """Whether a grant planned ``copy``, and when it may go (taken: asked once)."""
        self._forget.cancel(copy)
        if copy not in self._planned:
            return False, None
        return True, self._planned.pop(copy)

    def due(self, now: float) -> list[tuple[int, ps_frames.Push, bytes]]:
        """The held copies whose time came, and (past the byte bound) the next due, until
        what is left is within it."""
        for copy in self._forget.pop_due(now):
            self._planned.pop(copy, None)
        copies = self._due.pop_due(now)
        over = self.nbytes - sum(len(self._held[c][2]) for c in copies) - self.max_bytes
        while over > 0 and (at := self._due.next()) is not None:
            [copy] = self._due.pop_due(at, limit=1)
            copies.append(copy)
            over -= len(self._held[copy][2])
        out = []
        for copy in copies:
            to, frame, data = self._held.pop(copy)
            self.nbytes -= len(data)
            out.append((to, frame, data))
        return out

    def next(self) -> float | None:
        due = [d for d in (self._due.next(), self._forget.next()) if d is not None]
        return min(due, default=None)

    def __len__(self) -> int:
        return len(self._held)


def granted(node: PSNode, key: Key, grant: ps_frames.Grant, now: float) -> None:
    """A grant's word on its push's copy: with it, later (``copy_us``), or held (``hold``);
    or a copy grant for a held one."""
    at = None if grant.copy_us is None else now + grant.copy_us / 1e6
    if grant.copy_only:
        at = now + grant.wait_us / 1e6
    hold = hold_after(node.schedule_interval)
    at = None if at is None else min(at, now + hold)  # (never held past the window)
    node.copies.plan((key, grant.worker, grant.shard, grant.iteration), at, now, hold)
    send_due(node, now)


def send(
    node: PSNode, job: str, model: Model, to: int, push: registry.PeerFrame, data: bytes
) -> None:
    """Send the shard's replica (the partner of ``to``, the rank serving it) a copy of
    ``push``, now or when planned (module docstring)."""
    assert isinstance(push, ps_frames.Push)
    other = model.partner(push.shard, to)
    if other is None or (
        node.ranks.lookup(job, other) is None and (job, other) not in node.suspects
    ):
        return
    copy = dataclasses.replace(push, server=other, group=None, copy=True)
    planned = ((job, push.name), push.worker, push.shard, push.iteration)
    told, at = node.copies.planned(planned)
    if not told or (at is not None and at <= node._now):
        node._send(job, other, copy, data)
        return
    hold = hold_after(node.schedule_interval)
    at = None if at is None else min(at, node._now + hold)  # (never held past the window)
    node.counters["ps_copies_held"] += 1
    node.copies.hold(
        planned,
        other,
        copy,
        data,
        node._now + hold if at is None else at,
    )
    send_due(node, node._now)


def send_due(node: PSNode, now: float) -> None:
    """Send every held copy whose time came."""
    for to, copy, data in node.copies.due(now):
        node._send(copy.job, to, copy, data)
