"""What one run of the training job measured, in the paper's terms: time to the target loss and
gradients per second per rank, with rounds per second beside them.

Pure arithmetic on what the ranks report (no clock, no fabric), shared by ``make demo``
(:mod:`fabricd.demo.training`) and bench (k) (``bench/hyperplane.py``), so that both measure
every mode the same way:

* **Time to target** (the headline): the seconds, on rank 0's clock from the barrier after
  which every rank starts, until rank 0's *validation* loss (mean squared error on a held-out
  set no batch comes from, evaluated on rank 0's replica after each of its allreduce calls)
  first is at or below the target.  Validation, not training loss: it is what the paper plots
  (eager-SGD Fig. 10), the same held-out set serves every mode, and a replica that partial
  rounds left behind shows there as it is.  The time stamped is when the evaluated model
  existed (after the call, its update and any model average), not when its evaluation ended.
* **Speedup**: sync's time to target over the mode's, both from the same run (higher is
  better; 0 when the mode never reached the target, NaN when sync did not).
* **Gradients per second per rank**: gradients that entered a result, per rank and second.  A
  round's ``Result.active`` is how many ranks' fresh data its sum holds; summed over the
  run's rounds, divided by the ranks and rank 0's seconds.  A sync round holds every rank's
  gradient, so for sync this equals rounds per second; a partial round holds fewer (the
  late rank's joins a later one), so rounds per second overstate a partial mode's work.  A
  rank whose two calls' data one round took counts once there (``active`` counts ranks):
  the figure can only err low.
* **Rounds per second**: the job's allreduce rounds over rank 0's seconds (the former
  headline, kept as a secondary figure).
* **Skipped results**: rounds whose result no call of a rank got, alone or in a sum, averaged
  over the ranks.  Under ``late="latest"`` a partial collective hands a rank that more than
  one round left behind the latest result only (eager-SGD §4.2's receive buffer): a skipped
  round's update never reaches that rank's replica, which drifts from the others until the
  replicas are next averaged.  Under ``late="sum"`` (the default) the rounds a rank missed
  reach it summed in its next call, so it skips none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class Tally:
    """What one rank tells at the end of a run: its allreduce calls, and ``Result.active`` of
    every round whose result one of its calls got."""

    rank: int
    calls: int
    rounds: dict[int, int] = field(default_factory=dict)
    #: rounds whose result reached the rank inside a later call's sum (``late="sum"``)
    summed: frozenset[int] = frozenset()


def time_to_target(history: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time in ``history`` ((seconds, loss), in time order) whose loss is at or
    below ``target``; ``None`` if none is."""
    return next((seconds for seconds, value in history if value <= target), None)


def merge_rounds(tallies: Iterable[Tally]) -> dict[int, int]:
    """``{round: active}`` over every rank's tally: a round counts once, whichever ranks got it
    (each that did got the same result)."""
    rounds: dict[int, int] = {}
    for tally in tallies:
        for round_, active in tally.rounds.items():
            rounds[round_] = max(active, rounds.get(round_, 0))
    return rounds


def unseen(rounds: Mapping[int, int], steps: int) -> int:
    """How many of the run's rounds ``0 .. steps - 1`` no rank's call got (their gradients
    are missing from :func:`gradients_per_second`; a round's starter normally gets it)."""
    return sum(1 for r in range(steps) if r not in rounds)


def skipped(tallies: Sequence[Tally], steps: int) -> float:
    """Rounds ``0 .. steps - 1`` whose result no call of a rank got, averaged over the ranks
    of ``tallies`` (0 for none)."""
    if not tallies:
        return 0.0
    missed = (
        sum(1 for r in range(steps) if r not in t.rounds and r not in t.summed) for t in tallies
    )
    return sum(missed) / len(tallies)


def gradients_per_second(
    rounds: Mapping[int, int], steps: int, ranks: int, seconds: float
) -> float:
    """Gradients in the results of rounds ``0 .. steps - 1`` (``rounds``: ``{round: active}``),
    per rank and second of ``seconds``."""
    if seconds <= 0:
        return math.inf
    entered = sum(active for round_, active in rounds.items() if 0 <= round_ < steps)
    return entered / ranks / seconds


def mean_active(rounds: Mapping[int, int], steps: int) -> float:
    """``Result.active`` averaged over the rounds ``0 .. steps - 1`` that a rank got."""
    counted = [active for round_, active in rounds.items() if 0 <= round_ < steps]
    return sum(counted) / len(counted) if counted else math.nan


def speedup(sync_seconds: float | None, mode_seconds: float | None) -> float:
    """Sync's time to target over a mode's from the same run: higher is better; 0 for a mode
    that never reached it, NaN when sync did not (nothing to compare with)."""
    if sync_seconds is None:
        return math.nan
    if mode_seconds is None:
        return 0.0
    return sync_seconds / mode_seconds if mode_seconds > 0 else math.inf
