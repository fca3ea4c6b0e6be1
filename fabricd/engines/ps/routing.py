"""Where a parameter-server frame goes, and the frames that cannot go yet: the serving rank
of a shard, and the bounded tables of frames held for a rank or a model.

Rules: this module decides which rank of a shard's pair serves it at an epoch and which
frames a daemon keeps back, for how long and how many; :mod:`fabricd.engines.ps.node` decides
when they are sent, taken or refused.  It reads the rank table but never changes it, and never
reads a clock: deadlines come in as ``now`` arguments and wait in a
:class:`~fabricd.engines.deadlines.Deadlines` heap.

Theory of operation.  A shard is served by one rank of its *pair*: its server at even epochs,
its replica at odd ones (MLfabric §3.3's hot standby: each failover hands the shard to the
other of the two, one epoch later).  Two tables hold frames that cannot be delivered yet:

* :class:`HeldFrames` -- frames for a rank lost with its node's links, or on a node whose
  links are not all up: sent once the rank is known again and they are.
* :class:`EarlyFrames` -- workers' frames for a model not opened here yet: a pull is refused
  once its deadline (``route_timeout``) passed, a push to a rank of its shard's pair waits for
  that rank however long (answered as dropped, it would leave the worker's clock one ahead of
  the coordinator's, and BSP and SSP refuse a push that skips an iteration).

Each table keeps at most :data:`MAX_HELD` frames and :data:`HELD_PAYLOADS` x ``max_payload``
payload bytes: a peer that sends without end costs a bounded amount.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.engines.membership import RankEntry
    from fabricd.frames import ps as ps_frames
    from fabricd.frames import registry
    from fabricd.wire import Meta

#: frames held for ranks, and for models not opened here yet, at most (each table)
MAX_HELD: Final = 1024
#: ... holding at most this many max_payloads of payload bytes in all (each table)
HELD_PAYLOADS: Final = 4

RankKey = tuple[str, int]  #: (job, rank)


class Ranks(Protocol):
    """What the engine reads of the daemon: the rank table (membership's) and whether a
    node's links are all up (this node's always are)."""

    def lookup(self, job: str, rank: int, /) -> RankEntry | None: ...

    def reachable(self, node: int, /) -> bool: ...

    def bandwidth(self, node: int, /) -> tuple[float, float] | None:
        """``node``'s available (up, down) bytes/s as the network monitor last heard, or
        ``None``: unknown (MLfabric's scheduler plans with them, §4)."""
        ...


def serving(spec: Meta, shard: int, epoch: int) -> int:
    """The rank serving ``shard`` at ``epoch``: its server at even epochs, its replica at odd
    ones (each failover hands the shard to the other of the two)."""
    if spec["replicas"] and epoch % 2:
        return int(spec["replicas"][shard])
    return int(spec["servers"][shard])


def pair(spec: Meta, shard: int) -> tuple[int, ...]:
    """The ranks that may serve ``shard``: its server, and its replica if it has one (none
    for a shard the spec does not have: a peer's frame may name one)."""
    ranks = (*spec["servers"][shard : shard + 1], *spec["replicas"][shard : shard + 1])
    return tuple(int(r) for r in ranks)


def partner(spec: Meta, shard: int, rank: int) -> int | None:
    """The other rank of ``shard``'s pair, if it has a replica."""
    ranks = pair(spec, shard)
    if len(ranks) < 2:
        return None
    return ranks[1] if rank == ranks[0] else ranks[0]


def room(held: int, more: int, max_payload: int) -> bool:
    """Whether ``more`` payload bytes fit beside ``held`` in a table of held frames."""
    return held + more <= HELD_PAYLOADS * max_payload


class HeldFrames:
    """Frames for ranks that are not reachable now, in the order they were sent."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._frames: dict[RankKey, list[tuple[registry.PeerFrame, bytes]]] = {}
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    def hold(self, rank: RankKey, frame: registry.PeerFrame, payload: bytes) -> bool:
        """Keep ``frame`` for ``rank``; ``False``: the table is full (the frame is dropped)."""
        if self._count >= MAX_HELD or not room(self._bytes, len(payload), self.max_payload):
            return False
        self._frames.setdefault(rank, []).append((frame, payload))
        self._count += 1
        self._bytes += len(payload)
        return True

    def take(
        self, reached: Callable[[str, int], bool]
    ) -> list[tuple[RankKey, registry.PeerFrame, bytes]]:
        """Remove and return the frames of every rank ``reached`` says is reachable again."""
        taken = []
        for rank in [k for k in self._frames if reached(*k)]:
            taken += [(rank, frame, payload) for frame, payload in self.drop(rank)]
        return taken

    def drop(self, rank: RankKey) -> list[tuple[registry.PeerFrame, bytes]]:
        """Remove and return ``rank``'s frames."""
        held = self._frames.pop(rank, [])
        self._count -= len(held)
        self._bytes -= sum(len(p) for _, p in held)
        return held


@dataclass(slots=True, kw_only=True)
class Early:
    """A worker's frame for a model not opened here yet (``deadline`` ``None``: a push that
    waits for its shard's rank however long)."""

    node: int
    frame: ps_frames.Push | ps_frames.Pull | ps_frames.Ready
    payload: bytes
    deadline: float | None


class EarlyFrames:
    """Workers' frames for models not opened here yet, by model, with their deadlines."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._frames: dict[int, Early] = {}  #: in arrival order
        self._ids = itertools.count()
        self._deadlines: Deadlines[int] = Deadlines()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def why_full(self, server: int, name: str) -> str:
        """Why a frame for rank ``server``'s model ``name``, not open yet, is not held."""
        return (
            f"rank {server} has not opened {name!r} and this daemon holds {len(self)} frames "
            f"({self.nbytes} B) for models not open yet, the most it keeps ({MAX_HELD}, or "
            f"{HELD_PAYLOADS} x max_payload)"
        )

    def has_room(self, more: int) -> bool:
        return len(self._frames) < MAX_HELD and room(self._bytes, more, self.max_payload)

    def holds(self, node: int, frame: ps_frames.Push | ps_frames.Pull | ps_frames.Ready) -> bool:
        """Whether ``frame`` from ``node`` is held already (sent again after a reset)."""
        return any(e.node == node and e.frame == frame for e in self._frames.values())

    def hold(self, early: Early) -> None:
        """Keep ``early`` (the caller checked :meth:`has_room`)."""
        key = next(self._ids)
        self._frames[key] = early
        self._bytes += len(early.payload)
        if early.deadline is not None:
            self._deadlines.set(key, early.deadline)

    def take(self, which: Callable[[Early], bool]) -> list[Early]:
        """Remove and return the frames ``which`` selects, in arrival order."""
        keys = [k for k, e in self._frames.items() if which(e)]
        return [self._remove(k) for k in keys]

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def expired(self, now: float) -> list[Early]:
        """Remove and return the frames whose deadline is ``now`` or earlier."""
        return [self._remove(k) for k in self._deadlines.pop_due(now)]

    def _remove(self, key: int) -> Early:
        early = self._frames.pop(key)
        self._deadlines.cancel(key)
        self._bytes -= len(early.payload)
        return early
