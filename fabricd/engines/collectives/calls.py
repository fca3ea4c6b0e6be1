"""A persistent collective's local calls: each call's record, the collective's counters, and
what is kept of ranks that leave -- a sync round's deadline once a rank of the job left during
it, and the abandoned calls whose data a round kept.

Split from :mod:`~fabricd.engines.collectives.persistent`, which drives these and whose module
docstring gives the rules and the reasons ("A call whose client stops waiting", "Sync").
Sans-IO: ``now`` comes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True, kw_only=True)
class Call:
    """A local rank's call, open until its round delivers or it fails."""

    token: int
    rank: int
    array: np.ndarray[Any, Any] | None  #: the rank's array (a view of its segment)
    round: int  #: the round whose result it gets
    included: bool = False  #: a snapshot took its data (cleared if that round is abandoned)
    kept: int | None = None  #: the round that kept its rank's abandoned previous call, if one
    #: allgather, reduce_scatter: where its result goes (``array`` is its input)
    output: np.ndarray[Any, Any] | None = None

    def failed(self, message: str) -> str:
        """``message`` as this call's failure says it: when its rank's previous call was kept
        (a restarted trainer's first call), also why this call was for a later round than the
        trainer may think -- a failure must never name a round that makes no sense to it."""
        if self.kept is None:
            return message
        return (
            f"{message} (rank {self.rank}'s previous call was kept in round {self.kept} after "
            f"its client stopped waiting, so this call was for round {self.round})"
        )


@dataclass(slots=True)
class Counters:
    rounds: int = 0  #: rounds ended here
    calls: int = 0
    included: int = 0  #: calls whose data was in the result they got
    late: int = 0  #: calls answered at once with the latest result (their rank was behind)
    views: int = 0  #: schedule rebuilds after a member node was lost
    frames_dropped: int = 0  #: peers' messages of an older view, dropped
    sum_active: int = 0  #: sum over rounds of ``active`` (its mean is what the demo shows)
    settled: int = 0  #: in place: calls completed before their round's acknowledgements
    unled: int = 0  #: majority rounds started here without their initiator (its wait ended)
    counted_elsewhere: int = 0  #: abandoned snapshots a survivor's ended round had counted


@dataclass(slots=True)
class Departures:
    """What a collective keeps of ranks that left.

    ``doom``: sync, while a rank of the job is gone, the round a local call waits for gets a
    deadline ``grace`` seconds on (one at a time); the round fails then if it has not ended.
    ``kept``: the local ranks whose last call was abandoned and kept, and the round it was for,
    until the rank's next call takes it (and says it).
    """

    grace: float = 0.0  #: seconds a sync round may take to end once a rank left
    #: (round, deadline, rank): a rank of the job left during this round
    doom: tuple[int, float, int] | None = None
    kept: dict[int, int] = field(default_factory=dict)

    def watch(self, round: int, now: float, live: frozenset[int], size: int) -> None:
        """A call waits for ``round`` while a rank of the job is not ``live``: the round gets
        its deadline, unless one is running."""
        if self.doom is None and len(live) < size:
            gone = min(set(range(size)) - live)
            self.doom = (round, now + self.grace, gone)

    def ended(self, round: int) -> None:
        """``round`` ended: a deadline for it (or an earlier one) is moot."""
        if self.doom is not None and self.doom[0] <= round:
            self.doom = None

    def due(self, now: float) -> tuple[int, int] | None:
        """(round, rank) whose deadline has passed by ``now`` (then forgotten), if one."""
        if self.doom is None or now < self.doom[1]:
            return None
        round, _, rank = self.doom
        self.doom = None
        return round, rank

    def deadline(self) -> float | None:
        return self.doom[1] if self.doom is not None else None
