"""A worker's side of the delay bound (MLfabric §5.1.3, §7.1): updates "dropped at the worker
for violating delay bounds", before they cost the network anything.

Rules: this module decides, for one worker and one shard, whether an update is worth sending;
the parameter server's own check on arrival is
:class:`~fabricd.engines.ps.consistency.Coordinator`'s (whose module docstring explains the
bound).  No I/O, no clock.
"""

from __future__ import annotations

from fabricd.engines.ps.consistency import Drop, DropReason
from fabricd.errors import UsageError


class DelayGate:
    """A worker's side of the delay bound (MLfabric §5.1.3, §7.1: updates "dropped at the
    worker for violating delay bounds"): whether an update is worth sending at all.

    The worker's daemon says which version the worker computes from (:meth:`pulled`) and every
    server version it hears of (:meth:`heard`: pull replies, push acknowledgements).  The
    server's version only grows, so an update whose base is more than ``delay_bound`` behind
    the newest version heard would be dropped on arrival: :meth:`check` drops it here instead,
    and counts it.  It never drops an update the server would apply.
    """

    def __init__(self, *, delay_bound: int | None) -> None:
        if delay_bound is not None and delay_bound < 0:
            raise UsageError(f"a delay bound is >= 0, not {delay_bound}")
        self.delay_bound = delay_bound
        self.base = 0  #: the version the worker's next update is computed from
        self.newest = 0  #: the newest server version heard of
        self.dropped = 0

    def pulled(self, version: int) -> None:
        """The worker's model is now version ``version`` (its next update's base)."""
        self.base = version
        self.heard(version)

    def heard(self, version: int) -> None:
        """The server's model was at version ``version`` (news may come out of order)."""
        self.newest = max(self.newest, version)

    def check(self, worker: int, iteration: int) -> Drop | None:
        """``None``: send the update of ``iteration``; else a :class:`Drop` (counted)."""
        delay = self.newest - self.base
        if self.delay_bound is None or delay <= self.delay_bound:
            return None
        self.dropped += 1
        return Drop(
            worker=worker,
            iteration=iteration,
            base=self.base,
            delay=delay,
            reason=DropReason.DELAY,
            bound=self.delay_bound,
        )
