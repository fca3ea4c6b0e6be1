"""The aggregator's side of MLfabric aggregation (§3.2, §5.2): the groups of pushes one
worker daemon sums and forwards to a shard's server as one update.

Rules: a shard's scheduler that groups updates (Alg. 3, :mod:`fabricd.engines.scheduling.
aggregation`) tells the aggregator node which updates a group holds (GATHER: each member's
worker, iteration and base) and grants each member's worker a push *via* that node.  This
module keeps one node's groups: it sums the members' pushes as they come (decoded dense, in the
model's dtype), and once every member came it hands back a :class:`Summed`: the sum, and the
members it holds, for the server, which applies it once for all of them (exactly once by
(worker, iteration), :mod:`fabricd.engines.ps.server`).

Choices where the paper is silent, and why:

* *A push before its GATHER* (they travel on different links, from different nodes) is held
  as it came (encoded: a sparse push stays small), at most :data:`MAX_EARLY` pushes and
  ``max_bytes`` in all, until its group's GATHER comes or the grace is over; then decoded.
* *Memory*: a group's sum is a dense shard; the groups in progress hold at most ``max_bytes``
  of sums in all (a GATHER past that is refused: its members go straight to the server after
  their wait), like the frames the node holds for routing (``HELD_PAYLOADS x max_payload``).
* *A member that does not come* (its worker's daemon died, or its push went astray): at the
  group's planned forward start plus the grace, the members that came are forwarded without
  it; a group none of whose members came is forgotten.  A member's push that comes after its
  group was forwarded is dropped here (counted): its worker's daemon sends it straight to the
  server when its own wait for an acknowledgement is over, and the server takes it then, or
  acknowledges it again if an aggregate held it already.
* *Nothing here is acknowledged*: a worker hears only from the server.  So an aggregator that
  dies loses nothing: its members' workers send their pushes straight to the server after
  their wait, and the server refuses any aggregate holding a member it already decided
  (:meth:`~fabricd.engines.ps.server.ShardServer.push_aggregate`), so nothing is counted
  twice either.
* The forward goes as soon as its group is complete, not at its planned start: the plan only
  said when it could at the earliest, and sooner makes the model fresher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.deadlines import Deadlines
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.filters import Push
from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key
    from fabricd.frames.ps import Member

Array = np.ndarray[Any, Any]
#: pushes held for a group whose GATHER has not come, on one node
MAX_EARLY: Final = 1024
#: groups one node aggregates at once
MAX_GROUPS: Final = 1024
#: one group: the model and shard, the rank serving it and its epoch, the scheduler's number
GroupKey = tuple["Key", int, int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Summed:
    """Send ``members``' summed update (``payload``, encoded dense) to the server of ``group``."""

    group: GroupKey
    members: tuple[Member, ...]
    payload: bytearray


@dataclass(slots=True, kw_only=True)
class _Group:
    members: dict[int, tuple[int, int]]  #: worker -> (iteration, base)
    size: int  #: elements of the shard
    dtype: np.dtype[Any]
    came: list[Member] = field(default_factory=list)
    total: Array | None = None

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(slots=True, kw_only=True)
class _Early:
    worker: int
    iteration: int
    base: int
    payload: bytes


class Gathering:
    """One node's aggregator groups (module docstring); ``grace``: seconds past a group's
    planned forward start that it waits for a member that has not come; ``max_bytes``: the
    most the groups' sums, and apart the pushes held for a GATHER, may hold."""

    def __init__(self, *, grace: float, max_bytes: int) -> None:
        self.grace = grace
        self.max_bytes = max_bytes
        self._groups: dict[GroupKey, _Group] = {}
        self._group_bytes = 0
        self._early: dict[GroupKey, list[_Early]] = {}
        self._early_count = self._early_bytes = 0
        self._deadlines: Deadlines[GroupKey] = Deadlines()
        self.counters = {"aggregated": 0, "forwarded": 0, "late": 0, "refused": 0}

    def plan(
        self,
        group: GroupKey,
        members: tuple[Member, ...],
        wait: float,
        now: float,
        *,
        size: int,
        dtype: np.dtype[Any],
    ) -> list[Summed]:
        """The scheduler's GATHER: sum ``members``' pushes (of a shard of ``size`` elements
        of ``dtype``) for ``group``, forwarding by the planned start ``now + wait`` plus the
        grace at the latest."""
        state = _Group(members={w: (it, b) for w, it, b in members}, size=size, dtype=dtype)
        if (
            group in self._groups
            or len(self._groups) >= MAX_GROUPS
            or self._group_bytes + state.nbytes > self.max_bytes
        ):
            self.counters["refused"] += 1  # a GATHER sent again, or too many at once
            return []
        self._groups[group] = state
        self._group_bytes += state.nbytes
        self._deadlines.set(group, now + max(0.0, wait) + self.grace)
        held = self._early.pop(group, [])
        self._early_count -= len(held)
        self._early_bytes -= sum(len(e.payload) for e in held)
        for early in held:
            try:
                self._add(state, early.worker, early.iteration, early.base, early.payload)
            except RemoteProtocolError:  # its sender's fault, not the GATHER's: dropped
                self.counters["late"] += 1
        return self._complete(group)

    def push(
        self,
        group: GroupKey,
        worker: int,
        iteration: int,
        base: int,
        payload: bytes | bytearray,
        now: float,
    ) -> list[Summed]:
        """Worker ``worker``'s encoded push of ``iteration`` (from ``base``) for ``group``:
        summed, held until the GATHER comes, or dropped (late, or not a member: counted).

        Raises:
            RemoteProtocolError: the push is malformed (its group is known: it is decoded).
        """
        state = self._groups.get(group)
        if state is None:
            if self._early_count >= MAX_EARLY or self._early_bytes + len(payload) > self.max_bytes:
                self.counters["late"] += 1
                return []
            held = _Early(worker=worker, iteration=iteration, base=base, payload=bytes(payload))
            self._early.setdefault(group, []).append(held)
            self._early_count += 1
            self._early_bytes += len(held.payload)
            if group not in self._deadlines:
                self._deadlines.set(group, now + self.grace)
            return []
        self._add(state, worker, iteration, base, payload)
        return self._complete(group)

    def _add(
        self, state: _Group, worker: int, iteration: int, base: int, payload: bytes | bytearray
    ) -> None:
        if state.members.get(worker) != (iteration, base) or any(
            m[0] == worker for m in state.came
        ):
            self.counters["late"] += 1  # not this group's, or sent twice
            return
        values = ps_push.decode(payload, state.size, state.dtype)
        state.came.append((worker, iteration, base))
        if state.total is None:
            state.total = np.array(values, copy=True)
        else:
            state.total += values
        self.counters["aggregated"] += 1

    def _complete(self, group: GroupKey) -> list[Summed]:
        state = self._groups[group]
        if len(state.came) < len(state.members):
            return []
        return self._forward(group)

    def _forward(self, group: GroupKey) -> list[Summed]:
        state = self._groups.pop(group)
        self._group_bytes -= state.nbytes
        self._deadlines.cancel(group)
        if state.total is None:
            return []
        self.counters["forwarded"] += 1
        total = state.total
        payload = ps_push.encode(
            Push(size=total.size, pushed=total.size, indices=None, values=total)
        )
        return [Summed(group=group, members=tuple(state.came), payload=payload)]

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def on_timer(self, now: float) -> list[Summed]:
        """Groups whose wait is over go with the members that came; pushes held for a GATHER
        that never came are dropped."""
        out: list[Summed] = []
        for group in self._deadlines.pop_due(now):
            if group in self._groups:
                out += self._forward(group)
            else:
                self.counters["late"] += self._drop_early(group)
        return out

    def _drop_early(self, group: GroupKey) -> int:
        dropped = self._early.pop(group, [])
        self._early_count -= len(dropped)
        self._early_bytes -= sum(len(e.payload) for e in dropped)
        return len(dropped)

    def forget(self, key: Key) -> None:
        """The model is closed here: its groups and held pushes go."""
        for group in [g for g in self._groups if g[0] == key]:
            self._group_bytes -= self._groups.pop(group).nbytes
            self._deadlines.cancel(group)
        for group in [g for g in self._early if g[0] == key]:
            self._drop_early(group)
            self._deadlines.cancel(group)

    @property
    def held(self) -> int:
        """Groups in progress and pushes held for a GATHER."""
        return len(self._groups) + self._early_count
