"""Exactly once across a view change: the snapshots of partial rounds this node abandoned, kept
until the surviving member nodes say whether one of them ended that round.

Split from :mod:`~fabricd.engines.collectives.persistent` ("Failures of a member node"), which
drives it.  Sans-IO and array-agnostic: a snapshot is whatever the engine keeps.

The problem (issue 23, RELIABILITY F1).  A partial round ``r`` runs in a *view* (the member
nodes lost so far, and the round the view began with).  When a member dies mid-round, a
survivor may have ended round ``r`` -- it had every member's message, so its result counts
every member's snapshot -- while another survivor had not, and abandons the round.  Putting
the abandoned snapshot back into the accumulator (at least once) counted it twice whenever
some survivor had ended the round; dropping it (at most once) loses it whenever none had.

The rule.  An abandoned snapshot of round ``r`` of view ``v`` is *held* here.  Each node, when
it leaves a view, notes the last round it ended in it, and every NOTICE it sends (it sends one
to every member at each view change, before any frame of its new view) carries those notes.
The held snapshot is *dropped* (it was counted) once a member of the current view said it
ended a round ``>= r`` in ``v``; it is *restored* into the accumulator (it waits for a later
round) once every other member of the current view is in a view it cannot leave for ``v`` --
views only grow: more nodes lost, a higher base -- and said it ended no round ``>= r`` in
``v``.  Why it is exact: a node ends round ``r`` of ``v`` only while in ``v``, so a node past
``v`` has said all it ever will about ``v``; and a round ended anywhere counted every member's
snapshot of it, so one word of "ended" suffices.  A member that dies before it speaks leaves
the view, and its word is no longer needed (its results died with it: the survivors' results
count each contribution once).  Liveness: every survivor leaves ``v`` (views converge on the
union of losses and the highest base) and says so at once, in a NOTICE that precedes any frame
of its new view on the link (a node's word is taken from its NOTICEs only); a node holding a
snapshot starts no round until it is settled, so after a failure a call may wait those
NOTICEs' round trip, or ``down_after`` for a member whose links were reset.

Two failures.  A snapshot dropped on the word of the nodes that ended its round is lost to the
survivors if all of those nodes die before any survivor got that round's result: exactly once
for one failure at a time, at most once for such a second failure (the review of issue 23
built it; keeping dropped snapshots until their enders are safe would cost a tensor each).

Bounds: :data:`MAX_VIEWS` views remembered per node and :data:`MAX_HELD` snapshots held (a
snapshot of nothing given is not held); past them the oldest held snapshot is restored (at
least once, as before this rule), which takes that many view changes, each abandoning a round
that had data, before the first settles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

#: a view: the lost member nodes (sorted) and the round it began with
View = tuple[tuple[int, ...], int]
#: what a NOTICE says of the views its sender left: (lost, base, last round ended there)
Note = tuple[tuple[int, ...], int, int]

#: views whose last ended round a node remembers and says
MAX_VIEWS: Final = 32
#: abandoned snapshots held at once
MAX_HELD: Final = 2


def may_become(w: View, v: View) -> bool:
    """Whether a node in view ``w`` may yet be in view ``v`` (views only grow)."""
    return set(w[0]) <= set(v[0]) and w[1] <= v[1]


@dataclass(slots=True)
class Held:
    """An abandoned round's snapshot (``data``: the engine's) and the local ranks in it."""

    view: View
    round: int
    data: Any
    ranks: set[int]


@dataclass(slots=True)
class Ledger:
    """This node's notes on the views it left, what its peers said of theirs, and the
    snapshots held until those words settle them."""

    left: dict[View, int] = field(default_factory=dict)  #: view left -> last round ended there
    held: list[Held] = field(default_factory=list)
    #: node -> (its latest view, what it said of the views it left)
    words: dict[int, tuple[View, dict[View, int]]] = field(default_factory=dict)

    def leave(self, view: View, last: int) -> None:
        """This node leaves ``view``, the last round it ended there being ``last`` (-1: none)."""
        self.left[view] = last
        while len(self.left) > MAX_VIEWS:
            del self.left[next(iter(self.left))]

    def hold(self, held: Held) -> list[Held]:
        """Hold an abandoned snapshot; returns those to restore at once to keep the bound."""
        self.held.append(held)
        over = max(0, len(self.held) - MAX_HELD)
        spill, self.held = self.held[:over], self.held[over:]
        return spill

    def notes(self) -> tuple[Note, ...]:
        return tuple((lost, base, last) for (lost, base), last in self.left.items())

    def heard(self, node: int, view: View, notes: tuple[Note, ...]) -> None:
        """A frame from ``node`` in ``view``, saying ``notes`` (a NOTICE's; others say none)."""
        _, said = self.words.get(node, (view, {}))
        for lost, base, last in notes:
            said[(lost, base)] = last
        while len(said) > MAX_VIEWS:
            del said[next(iter(said))]
        self.words[node] = (view, said)

    def settle(self, others: tuple[int, ...]) -> tuple[list[Held], int]:
        """Settle what the words of ``others`` (the current view's members but this node)
        allow: returns the snapshots to restore, and how many were dropped as counted."""
        restore: list[Held] = []
        dropped = 0
        for held in list(self.held):
            verdict = self._verdict(held, others)
            if verdict is not None:
                self.held.remove(held)
                if verdict:
                    dropped += 1
                else:
                    restore.append(held)
        return restore, dropped

    def _verdict(self, held: Held, others: tuple[int, ...]) -> bool | None:
        """``True``: a member ended the round (counted); ``False``: none did nor will;
        ``None``: not known yet."""
        final = True
        for node in others:
            word = self.words.get(node)
            if word is None:
                final = False
                continue
            view, said = word
            if said.get(held.view, -1) >= held.round:
                return True
            if may_become(view, held.view):
                final = False
        return False if final else None

    def forget(self, node: int) -> None:
        self.words.pop(node, None)
