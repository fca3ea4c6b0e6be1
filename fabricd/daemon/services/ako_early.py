"""PART frames held for ranks that have not opened their partial exchange yet.

A trainer may step before a slower peer opened: its parts for that peer are held on the
peer's node and handed to the exchange when it opens.  What is held is bounded per node: at
most :data:`MAX_EARLY` frames and ``HELD_PAYLOADS`` x ``max_payload`` bytes, each for
``route_timeout`` (the parameter server's early frames have the same bounds).  A rank some
of whose parts were dropped is remembered, with why: its open is refused, since its model
would miss them (:meth:`EarlyParts.missed`); until it opens, leaves, or :data:`MAX_EARLY` later
ranks were remembered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from fabricd.daemon.service import Host
    from fabricd.frames.ako import Part

RankKey = tuple[str, str, int]  #: (job, exchange name, rank)

#: the most PART frames a node holds for ranks that have not opened their exchange yet, and
#: their bytes, in max_payloads
MAX_EARLY: Final = 4096
HELD_PAYLOADS: Final = 4


@dataclass(slots=True)
class _Early:
    frame: Part
    payload: bytes | bytearray


class EarlyParts:
    """One node's held parts, by the (job, name, rank) they wait for (module docstring).

    ``counters``: the service's; every frame dropped counts in its ``part_frames_dropped``.
    """

    def __init__(self, host: Host, counters: dict[str, int]) -> None:
        self.host = host
        self.counters = counters
        self._held: dict[RankKey, list[_Early]] = {}
        self._deadlines: Deadlines[RankKey] = Deadlines()
        self._missed: dict[RankKey, str] = {}
        self.count = self._bytes = 0

    def hold(self, rank_key: RankKey, frame: Part, payload: bytes | bytearray, now: float) -> bool:
        """Keep ``frame`` for ``rank_key``'s open; ``False``: past the bounds, dropped (and
        its rank's open will be refused)."""
        limit = HELD_PAYLOADS * self.host.config.max_payload
        if self.count >= MAX_EARLY or self._bytes + len(payload) > limit:
            self.counters["part_frames_dropped"] += 1
            self._miss(rank_key, "this node held too many parts for ranks not open yet")
            return False
        self._held.setdefault(rank_key, []).append(_Early(frame, payload))
        self.count += 1
        self._bytes += len(payload)
        if self._deadlines.get(rank_key) is None:
            self._deadlines.set(rank_key, now + self.host.config.route_timeout)
        return True

    def missed(self, rank_key: RankKey) -> str | None:
        """Why some of ``rank_key``'s parts were dropped before it opened (``None``: none
        were); asked once, at its open."""
        return self._missed.pop(rank_key, None)

    def take(self, rank_key: RankKey) -> list[tuple[Part, bytes | bytearray]]:
        """The parts held for ``rank_key``, in the order they came (it opened)."""
        held = self._held.pop(rank_key, [])
        self._deadlines.cancel(rank_key)
        self.count -= len(held)
        self._bytes -= sum(len(early.payload) for early in held)
        return [(early.frame, early.payload) for early in held]

    def drop_rank(self, job: str, rank: int) -> None:
        """Rank ``rank`` of ``job`` left: nothing waits for it any more, and what it missed
        does not count against the next trainer of that rank."""
        for rank_key in [k for k in self._held if k[0] == job and k[2] == rank]:
            self.counters["part_frames_dropped"] += len(self.take(rank_key))
        for rank_key in [k for k in self._missed if k[0] == job and k[2] == rank]:
            del self._missed[rank_key]

    def _miss(self, rank_key: RankKey, why: str) -> None:
        self._missed.pop(rank_key, None)
        self._missed[rank_key] = why
        while len(self._missed) > MAX_EARLY:  # (the oldest go first)
            del self._missed[next(iter(self._missed))]

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def expire(self, now: float) -> list[RankKey]:
        """Drop what waited past ``route_timeout``; returns whose (their opens are refused)."""
        due = self._deadlines.pop_due(now)
        for rank_key in due:
            self.counters["part_frames_dropped"] += len(self.take(rank_key))
            self._miss(rank_key, "they were dropped when route_timeout passed")
        return due
