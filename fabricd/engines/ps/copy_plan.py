"""When the workers' copies of their updates go to a shard's replica, under bounded
replication with MLfabric's scheduling (MLfabric §3.3, §5.3; the planner is
:func:`fabricd.engines.scheduling.replication.replicate`).

Rules: with ``replication="bounded"`` and ``scheduling="mlfabric"`` (async, no aggregation), a
shard's scheduler plans each batch's copies after its pushes: the copies of the batch's
updates (and those punted from earlier batches) are listed in the server's apply order and
booked toward the replica over the network the pushes left (Alg. 3 as a list, footnote 4), so
the server's transfers go first.  With ``T_last`` the batch's last push's planned end, the
replica will have applied the prefix whose copies arrive by then; if the divergence bound
(eq. 10-11) holds with the server at the batch's end and the replica at that prefix, the
prefix's copies are granted their planned starts and the rest is *punted*: held at their
workers' daemons and planned again with the next batch.  Else the batch's last push waits for
the earliest prefix that satisfies the bound to reach the replica, that prefix's copies go and
the rest is punted (§5.3: "only the last server transfer waits").

Choices where the paper is silent, and why:

* *The plan is advice; the server enforces the bound.*  The server still applies an entry only
  while its lead allows (:mod:`fabricd.engines.ps.bounded`); a network that does not keep the
  plan, or copies granted in an earlier batch and not yet confirmed, cannot break the bound,
  they only make the server wait.  So the planner keeps just what it decided: the copies it
  punted and the bound on the replica's last step after the copies it sent.
* *A punted copy is never held for ever*: its worker's daemon sends it anyway
  :func:`hold_after` seconds after its push, and the planner forgets it then; a replica that
  asks for an entry whole waits longer than that under scheduling, so a punted copy is not
  sent twice (:func:`need_after`).
* *An idle shard sends its punted copies*: a batch with punted copies left is followed by one
  more decision an interval later, even with no update ready (the planner's "empty batch":
  every punted copy goes).
* *Aggregation plans no copies*: a push that goes via an aggregator sends the replica no copy
  (its aggregate's entry travels whole from the primary), so with ``aggregation=True`` the
  copies go with their pushes, as without scheduling.
* *A replica no link reaches* is not waited for: nothing is delayed and its copies go as
  planned (the server's lead then holds it, and its daemon gives a dead replica up).
* *Known inexactness*: copies are booked from now, not from their own push's start, though a
  daemon sends a copy no earlier than its push; so a plan may count on a copy before it can
  leave (the last push's delay then comes out short, or waits for its own copy).  The server's
  hold keeps the bound regardless; the plan only predicts less waiting than happens.  The cure
  is ``replicate`` with each copy's earliest start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.ps.bounded import NEED_AFTER
from fabricd.engines.scheduling.replication import Bound, replicate

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from fabricd.engines.ps.bounded import DivergenceBound
    from fabricd.engines.scheduling.ordering import Planned, Update
    from fabricd.engines.scheduling.timelines import Network

#: the least a punted copy is held at its worker's daemon before it goes anyway (seconds)
HOLD_MIN: Final = 1.0
#: the most punted copies a planner keeps (older ones are sent anyway by their daemons)
MAX_LAGGING: Final = 4096


def hold_after(interval: float) -> float:
    """Seconds a worker's daemon holds a punted copy before it sends it unplanned."""
    return max(HOLD_MIN, 10 * interval)


def need_after(interval: float) -> float:
    """Seconds a scheduled bounded replica waits for a copy before it asks for the entry
    whole: past the longest a punted copy is held."""
    return max(NEED_AFTER, 2 * hold_after(interval))


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyPlan:
    """One batch's copies: ``waits`` (a batch update's key -> seconds until its copy goes, or
    ``None``: punted, held), ``later`` (punted copies of earlier batches that go now: key ->
    seconds), ``delay`` (the batch's last push, and the earliest it may start), or nothing."""

    waits: dict[Hashable, float | None]
    later: dict[Hashable, float]
    delay: tuple[Hashable, float] | None


class CopyPlanner:
    """A shard's copy plans (module docstring): ``bound`` the shard's, ``momentum`` and
    ``rate`` its update rule's (a step is ``rate x`` the update; AdaDelay's rate only falls,
    so the full rate is a bound), ``interval`` its scheduler's."""

    def __init__(
        self, bound: DivergenceBound, *, momentum: float, rate: float, interval: float
    ) -> None:
        self.bound = Bound(norm=bound.norm, updates=bound.updates)
        self.momentum = momentum
        self.rate = rate
        self.hold = hold_after(interval)
        self._lagging: list[tuple[Update, float]] = []  #: punted copies, with when punted
        self._history = 0.0  #: the bound on the replica's last step, as planned

    @property
    def hosts(self) -> list[int]:
        """The hosts of the punted copies (the plan needs their links)."""
        return [u.host for u, _ in self._lagging]

    def fresh(self) -> CopyPlanner:
        """A planner like this one with nothing punted (a promoted shard's)."""
        planner = CopyPlanner.__new__(CopyPlanner)
        planner.bound, planner.momentum, planner.rate = self.bound, self.momentum, self.rate
        planner.hold, planner._lagging, planner._history = self.hold, [], 0.0
        return planner

    @property
    def pending(self) -> bool:
        """Whether punted copies wait for a batch."""
        return bool(self._lagging)

    def plan(
        self, now: float, planned: Sequence[Planned], network: Network, replica: int
    ) -> CopyPlan:
        """The copies of ``planned`` (the batch's pushes, in apply order, booked on
        ``network``) and of the punted ones, toward host ``replica``."""
        self._lagging = [(u, at) for u, at in self._lagging if at + self.hold > now]
        lagging = [u for u, _ in self._lagging]
        batch = [(self._step(p.update), p.transfer.end) for p in planned]
        result = replicate(
            batch,
            lagging,
            network,
            replica=replica,
            aggregators=[],
            history=self._history,
            momentum=self.momentum,
            bound=self.bound,
        )
        self._history = result.history
        starts = {p.update.key: max(0.0, p.transfer.start - now) for p in result.sent}
        ours = {p.update.key for p in planned}
        punted = {u.key for u in result.punted}
        self._lagging = self._punted(result.punted, now)
        return CopyPlan(
            waits={key: None if key in punted else starts.get(key, 0.0) for key in ours},
            later={key: wait for key, wait in starts.items() if key not in ours},
            delay=result.delay,
        )

    def _punted(self, punted: Sequence[Update], now: float) -> list[tuple[Update, float]]:
        when = {u.key: at for u, at in self._lagging}
        kept = [(u, when.get(u.key, now)) for u in punted]
        return kept[-MAX_LAGGING:]

    def _step(self, update: Update) -> Update:
        return dataclasses.replace(update, norm=self.rate * update.norm)

    def forget_worker(self, worker: int) -> None:
        """A lost worker's punted copies need no plan (its daemon is gone with them)."""
        self._lagging = [(u, at) for u, at in self._lagging if u.key[0] != worker]  # type: ignore[index]

    def forget(self, key: Hashable) -> None:
        """A punted copy that needs no plan any more (its update was dropped)."""
        self._lagging = [(u, at) for u, at in self._lagging if u.key != key]
