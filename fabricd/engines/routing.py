"""Which node hosts which rank of which job.

Rules: this module only keeps the table and says what changed; announcing is the caller's job.

Theory of operation: a client that connects to its daemon claims ``(job, rank)`` for the job's
``size``; the daemon records the claim here and ANNOUNCEs it to every peer, and tells a peer
that comes up about all its local ranks.  A client that leaves, or a node that goes down or
restarts, takes its ranks with it.  All ranks of a job must agree on its size, and a rank is
hosted by exactly one client; a second claim is refused with a message that says where the
first one lives.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabricd.errors import UsageError


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEntry:
    """Where one rank lives."""

    job: str
    rank: int
    size: int
    node: int


class RankTable:
    """The fabric-wide view of (job, rank) -> node, as this daemon knows it."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._entries: dict[tuple[str, int], RankEntry] = {}

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self._entries.get((job, rank))

    def job_size(self, job: str) -> int | None:
        return next((e.size for e in self._entries.values() if e.job == job), None)

    def claim(self, job: str, rank: int, size: int, node: int) -> RankEntry:
        """Record that ``node`` hosts ``rank`` of ``job``.

        Raises:
            UsageError: the rank is out of range, hosted elsewhere, or the size disagrees.
        """
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} is outside job {job!r} of size {size}")
        known = self.job_size(job)
        if known is not None and known != size:
            raise UsageError(
                f"job {job!r} has size {known} on this fabric, not {size}; "
                "start every rank with the same WORLD_SIZE"
            )
        current = self._entries.get((job, rank))
        if current is not None and current.node != node:
            raise UsageError(
                f"rank {rank} of job {job!r} is already running on node {current.node}"
            )
        if current is not None and node == self.node:
            raise UsageError(f"rank {rank} of job {job!r} is already connected to this daemon")
        entry = RankEntry(job=job, rank=rank, size=size, node=node)
        self._entries[job, rank] = entry
        return entry

    def release(self, job: str, rank: int, node: int) -> RankEntry | None:
        """Forget ``rank`` of ``job`` if ``node`` hosts it; return what was removed."""
        entry = self._entries.get((job, rank))
        if entry is None or entry.node != node:
            return None
        del self._entries[job, rank]
        return entry

    def drop_node(self, node: int) -> list[RankEntry]:
        """Forget every rank ``node`` hosted; return them."""
        gone = [e for e in self._entries.values() if e.node == node]
        for entry in gone:
            del self._entries[entry.job, entry.rank]
        return gone

    def local(self) -> list[RankEntry]:
        """The ranks this node hosts (to announce to a peer that comes up)."""
        return [e for e in self._entries.values() if e.node == self.node]

    def entries(self) -> list[RankEntry]:
        return sorted(self._entries.values(), key=lambda e: (e.job, e.rank))
