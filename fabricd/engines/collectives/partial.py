"""A partial collective's bookkeeping on one node (eager-SGD's solo and majority allreduce):
what local ranks gave and which round takes it, what each late rank is owed, and when a
majority round stops waiting for its initiator.

Split from :mod:`~fabricd.engines.collectives.persistent`, which drives these and whose module
docstring gives the rules ("Solo and majority").  Sans-IO: ``now`` comes in; the arrays are
numpy, reduced in place.

**Liveness** (issue 23).  Eager-SGD §4.2 starts a majority round when its drawn initiator
calls it.  In a job whose ranks run different numbers of steps, the initiator of some round
may never call it again (it finished and waits in a barrier, or went on to other work), and
every rank waiting in that round waited for ever.  The rule: a majority round also starts at
a node where a call has waited :class:`Patience` for it -- a deadline learned from the
rounds' arrival times (four times the running mean interval between round starts at that
node, at least 10 ms), never longer than the daemon's ``majority_wait`` (2 s by default).
The argument that every call completes: (1) after the first round (which needs every rank's
first call, as a sync round does) and outside a view change (which waits for the survivors'
NOTICEs: ledger.py), a call waits for its round to *start* at most ``patience``
≤ ``majority_wait``: its own node's timer starts the round then, as a solo call would, and
starting a round twice (the initiator came meanwhile, or several nodes' timers ran out) is
what the activation broadcast absorbs anyway (§4.1.1: any node may activate; the others
follow).  (2) A started round *completes* without any further call: every member node takes
part passively as soon as the activation reaches it, with what its ranks gave (or nothing),
so the round needs only the member nodes' daemons, which are up or are lost (a view change
restarts the round among the survivors, and a waiting call starts it again: (1)).  (3) A
call made while a round runs gets that round's result; a call of a rank behind gets what it
missed at once.  So each call completes within ``majority_wait`` plus one round's transfer,
plus a view change's per node failure.  The learned deadline keeps the paper's behaviour
where it matters: a straggler initiator is waited for as long as four usual steps, so the
timer fires only for an initiator that is not coming soon.  (A rank that never makes its
first call holds up the first round as it would a sync one; ``fabricctl stalls`` names it.)

**Every result applied once** (``late="sum"``, the default).  A rank behind gets the sum of
the results it missed (:class:`Owed`), so every replica applies every round's result exactly
once and the replicas stay alike without ``sync_model``.  The review that filed issue 23
found, on the demo's regression with a 200 ms straggler, the paper's ``"latest"`` leaving the
replicas 1.4-1.5 apart and taking 89 rounds to the target loss against 73 with the sum;
bench (k) measures both (docs/performance.md).  Across a node failure the
survivors that were a round behind jump to the others' base and never see the round they
ended (its result was never computed here): there the replicas differ by that round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterable

#: what a rank that missed rounds gets: the sum of every result it missed (each replica
#: applies every round's result once, so the replicas stay alike), or the latest only (the
#: receive buffer of eager-SGD §4.2: a rank two rounds behind skips results)
LATE: Final = ("sum", "latest")

#: a majority round stops waiting for its initiator once a call here waited this many times
#: the collective's usual interval between round starts here ...
PATIENCE: Final = 4.0
#: ... but never less than this (seconds: a loop faster than the clock's grain)
MIN_WAIT: Final = 0.01
#: weight of the newest interval in the running mean of intervals between round starts
SMOOTHING: Final = 0.2


class Contributions:
    """What local ranks gave since the last round's snapshot (the *accumulator*, with the count
    of ranks that gave in its last element), and the snapshot the round in progress took, kept
    until the round ends so that an abandoned round's data goes back (nothing given is lost)."""

    def __init__(self, count: int, dtype: np.dtype[Any], *, partial: bool) -> None:
        self.count = count
        elements = count + 1 if partial else 0  #: (a sync collective holds none)
        self.accumulator = np.zeros(elements, dtype)
        self.snapshot = np.zeros(elements, dtype)
        self.taken = False  #: the current round's snapshot is taken
        self.fresh: set[int] = set()  #: ranks whose data waits in the accumulator
        self.snapped: set[int] = set()  #: the ranks the current round's snapshot took

    def give(self, rank: int, array: np.ndarray[Any, Any]) -> None:
        self.accumulator[: self.count] += array
        self.fresh.add(rank)

    def take(self, into: np.ndarray[Any, Any]) -> None:
        """The round starts here: what waits (and how many ranks gave it) becomes its
        contribution, copied into ``into``; the accumulator starts again from zero."""
        self.accumulator[self.count] = len(self.fresh)
        np.copyto(into, self.accumulator)
        np.copyto(self.snapshot, self.accumulator)
        self.accumulator[:] = 0
        self.snapped, self.fresh = self.fresh, set()
        self.taken = True

    def take_back(self, snapshot: np.ndarray[Any, Any], ranks: set[int]) -> None:
        """An abandoned round's ``snapshot`` (what ``ranks`` gave) waits for a later round."""
        self.accumulator += snapshot
        self.fresh |= ranks

    def ended(self) -> None:
        self.taken = False

    def waiting(self, held: Iterable[np.ndarray[Any, Any]] = ()) -> np.ndarray[Any, Any]:
        """What local ranks gave that no result has counted yet: the accumulator, a round in
        progress's snapshot, and ``held`` (snapshots of abandoned rounds: ledger.py)."""
        waiting = self.accumulator[: self.count].copy()
        if self.taken:
            waiting += self.snapshot[: self.count]
        for snapshot in held:
            waiting += snapshot[: self.count]
        return waiting

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        return self.accumulator, self.snapshot


class Owed:
    """``late="sum"``: the results each local rank missed, summed, until its next call takes
    them.  A rank misses a round when the round ends here with no call of it waiting (it is
    behind, or has not called yet); its next call gets the sum at once, so that every rank
    applies every round's result exactly once.  An array per rank that is behind, made when it
    first misses a round and dropped when its call takes it."""

    def __init__(self, count: int, dtype: np.dtype[Any]) -> None:
        self.count, self.dtype = count, dtype
        self._sums: dict[int, np.ndarray[Any, Any]] = {}
        self._rounds: dict[int, int] = {}

    def missed(self, rank: int, result: np.ndarray[Any, Any]) -> None:
        """``rank`` missed the round whose result (``count`` elements) is ``result``."""
        owed = self._sums.get(rank)
        if owed is None:
            self._sums[rank] = result.copy()
            self._rounds[rank] = 1
        else:
            owed += result
            self._rounds[rank] += 1

    def take(self, rank: int) -> tuple[np.ndarray[Any, Any] | None, int]:
        """What ``rank`` is owed and how many rounds' results it sums (``None``, 0: nothing)."""
        return self._sums.pop(rank, None), self._rounds.pop(rank, 0)

    def owed(self, rank: int) -> np.ndarray[Any, Any] | None:
        """What ``rank`` is owed now (a view; ``None``: nothing), for status and tests."""
        return self._sums.get(rank)

    def forget(self, rank: int) -> None:
        """``rank``'s trainer left: the one that comes back starts where the job is."""
        self._sums.pop(rank, None)
        self._rounds.pop(rank, None)

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        return tuple(self._sums.values())


class Patience:
    """How long a majority round waits for its initiator once a call here waits for it: a
    deadline learned from the rounds' arrival times (:data:`PATIENCE` times the running mean
    of the interval between round starts here, at least :data:`MIN_WAIT`), never past
    ``limit`` (the daemon's ``majority_wait``).  Until two rounds started it is ``limit``."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._interval: float | None = None
        self._last_start: float | None = None
        self.since: float | None = None  #: when a call began waiting for the current round

    def started(self, now: float) -> None:
        """A round started here at ``now``."""
        if self._last_start is not None:
            gap = max(0.0, now - self._last_start)
            self._interval = (
                gap
                if self._interval is None
                else (1 - SMOOTHING) * self._interval + SMOOTHING * gap
            )
        self._last_start = now
        self.since = None

    def wait(self) -> float:
        """Seconds a round waits for its initiator now."""
        if self._interval is None:
            return self.limit
        return min(self.limit, max(MIN_WAIT, PATIENCE * self._interval))

    def waits(self, now: float) -> None:
        """A call here waits for the current round (the first one starts the count)."""
        if self.since is None:
            self.since = now

    def deadline(self) -> float | None:
        return None if self.since is None else self.since + self.wait()
