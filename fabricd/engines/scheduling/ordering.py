"""The order in which a batch of updates is sent to the server, and which updates are dropped
instead (MLfabric §5.1: Alg. 1 and Alg. 2).

Rules: this module decides, for one batch of updates bound for one server, which are sent, in
what order they reach the server (the order the server applies them), the transfer booked for
each, and which are dropped with a reason (:func:`order`).  Pure computation on a
:class:`~fabricd.engines.scheduling.timelines.Network` copy; where the updates then go through
an aggregator is :mod:`~fabricd.engines.scheduling.aggregation`'s business.

Theory of operation.  Without a delay bound this is Alg. 1, shortest transfer first (§5.1.1):
repeatedly book the update whose transfer would end first given what is already booked (its
``t_en``, Fig. 4b), which emulates shortest-job-first and minimises the average time until an
update is applied.  With a bound ``tau_max`` it is Alg. 2 (§5.1.2, §5.1.3): an update computed
from version ``v(g)`` has the deadline ``dl(g) = v(g) + tau_max - v_init`` (eq. 9), the last
apply position in this batch that keeps its delay within the bound; the update whose deadline
is the position being filled is booked first, else the shortest; and a look-ahead drops the
update just picked if the next one would end before it (Fig. 5: the 10 Mb/s worker's ``g1``
would hold the server's 90 Mb/s back; it is dropped at its worker and ``g2`` goes at once).
Choices where the paper is loose, each for a reason:

* *Position, not loop index.*  Alg. 2's ``i`` counts processed updates, dropped ones
  included; the deadline is about the version an update is applied at, which only booked
  updates advance.  The position filled is therefore ``len(O(U)) + 1``: with ``i`` a drop
  would make every later deadline fire one position early (and an update whose deadline is
  the real position would never be picked for it).
* *Deadline passed.*  Before each pick, every update whose deadline is already behind the
  position (``dl(g) < position``; ``dl(g) <= 0`` from the start) is dropped as
  :data:`DEADLINE_PASSED`: no order could apply it in time.  Several updates with the
  deadline being filled: the one with the shortest ``t_en`` is picked (it holds the server
  back least); the others' deadlines have passed at the next position and they are dropped
  then.  One position serves one update, so no choice keeps more of them.
* *Look-ahead* (Alg. 2 lines 10-11): the next pick is made on the network with the current
  one booked, among updates whose deadline has not passed by then; if it ends strictly before
  the current one, the current one is dropped (:data:`LOOK_AHEAD`) and the position is filled
  again.  A shortest-first pick is never dropped so (booking only lowers capacity).
* *Arrival check.*  The server applies updates as they arrive, in ``t_en`` order, which after
  a deadline pick may differ from the booking order (the look-ahead compares only the next
  update).  So the booked updates are walked in ``t_en`` order (ties: booking order), each
  given the next position, and one whose deadline that position passes is dropped too
  (:data:`ARRIVES_LATE`) and its booking released; a drop only moves later updates earlier,
  so one pass suffices, and nothing the plan keeps would be dropped at the server under it.
* *Never ends.*  An update whose uplink (or the server's downlink) has no capacity for ever is
  dropped (:data:`NO_CAPACITY`) when it is picked.

Eq. 9 counts a delay as the version *after* applying minus ``v(g)``: a kept update's
``position + v_init - 1 - v(g)`` (the server's count in
:mod:`~fabricd.engines.ps.consistency`: its version *before* applying minus the base) is at
most ``tau_max - 1``.  Pass ``tau_max + 1`` to plan to that engine's bound exactly.

Cost: one vectorised ``t_en`` of every waiting update per booking
(:func:`~fabricd.engines.scheduling.timelines.finish_rows`), so ``O(|U|^2)`` numpy work in
``|U|`` Python steps; the rows of updates whose uplinks are alike are shared and kept between
steps (only the booked update's host changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from fabricd.engines.scheduling.timelines import Network, Timeline, Transfer, finish_rows

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from numpy.typing import NDArray

DEADLINE_PASSED: Final = "deadline passed"
LOOK_AHEAD: Final = "finishes after a later update (look-ahead)"
ARRIVES_LATE: Final = "arrives too late: later updates arrive first"
NO_CAPACITY: Final = "never finishes: a link has no capacity"


@dataclass(frozen=True, slots=True)
class Update:
    """One worker's update waiting to go: ``size`` bytes on ``host``, computed from model
    version ``version``; ``norm`` is its norm (§3.3, for replication)."""

    key: Hashable
    host: int
    version: int
    size: float
    norm: float = 0.0


@dataclass(frozen=True, slots=True)
class Planned:
    """An update that goes: its booked ``transfer`` and its 1-based apply ``position``."""

    update: Update
    transfer: Transfer
    position: int


@dataclass(frozen=True)
class Ordering:
    """:func:`order`'s answer: ``planned`` in apply order, ``dropped`` with a reason each (in
    the order they were dropped), and ``network``: the copy with the planned bookings."""

    planned: list[Planned]
    dropped: list[tuple[Update, str]]
    network: Network | None = field(default=None, compare=False, repr=False)


def deadline(update: Update, *, delay_bound: int, v_init: int) -> int:
    """``dl(g)`` (eq. 9): the last apply position in the batch that keeps ``update`` within
    the bound."""
    return update.version + delay_bound - v_init


def order(
    updates: Sequence[Update],
    network: Network,
    *,
    server: int,
    delay_bound: int | None,
    v_init: int,
) -> Ordering:
    """Alg. 1 (``delay_bound`` ``None``) or Alg. 2: the batch's apply order and drops.

    ``network`` is not changed (a copy is booked; it comes back as ``Ordering.network``).

    Raises:
        KeyError: ``server`` or an update's host is not one of ``network``'s hosts.
        ValueError: a negative ``delay_bound``.
    """
    if delay_bound is not None and delay_bound < 0:
        raise ValueError(f"a delay bound is >= 0, not {delay_bound}")
    network.downlink(server)  # KeyError now, not after some work
    pool = _Pool(updates, network.copy(), server, delay_bound, v_init)
    while pool.step():
        pass
    return pool.result()


def in_list_order(updates: Sequence[Update], network: Network, *, server: int) -> Ordering:
    """A synchronous batch (MLfabric §6: "since update ordering does not apply to synchronous
    SGD, aggregation here starts with a *list* of updates"): every update is needed, so none
    is dropped or moved; each is booked straight to the server in the order given, after
    those before it.  An update no link would ever carry is still kept, planned to start
    now and never end: a synchronous step cannot go on without it, so its worker sends it
    at once and the network decides.

    ``network`` is not changed (a copy is booked; it comes back as ``Ordering.network``).

    Raises:
        KeyError: ``server`` or an update's host is not one of ``network``'s hosts.
    """
    network.downlink(server)  # KeyError now, not after some work
    running = network.copy()
    planned: list[Planned] = []
    for position, update in enumerate(updates, 1):
        if running.finish(update.host, server, update.size) == np.inf:
            transfer = Transfer(update.host, server, update.size, running.now, np.inf)
        else:
            transfer = running.reserve(update.host, server, update.size)
        planned.append(Planned(update, transfer, position))
    return Ordering(planned=planned, dropped=[], network=running)


class _Pool:
    """The waiting updates of one :func:`order` call, their current ``t_en`` and the network."""

    def __init__(
        self,
        updates: Sequence[Update],
        network: Network,
        server: int,
        delay_bound: int | None,
        v_init: int,
    ) -> None:
        self.updates = list(updates)
        self.network = network
        self.server = server
        self.bounded = delay_bound is not None
        count = len(self.updates)
        self.sizes = np.array([u.size for u in self.updates], dtype=np.float64)
        self.deadlines = np.array(
            [
                deadline(u, delay_bound=delay_bound, v_init=v_init)
                if delay_bound is not None
                else count + 1
                for u in self.updates
            ],
            dtype=np.int64,
        )
        self.alive = np.ones(count, dtype=bool)
        self.local = np.array([u.host == server for u in self.updates], dtype=bool)
        self.local |= self.sizes <= 0  # both end the instant they may start
        self.booked: list[tuple[int, Transfer]] = []
        self.dropped: list[tuple[Update, str]] = []
        self.by_host: dict[int, list[int]] = {}
        for k, u in enumerate(self.updates):
            network.uplink(u.host)  # KeyError for an unknown host
            self.by_host.setdefault(u.host, []).append(k)
        self.links: list[Timeline] = []
        self.row_of = np.zeros(count, dtype=np.intp)
        rows: dict[int, int] = {}
        for k, u in enumerate(self.updates):
            link = network.uplink(u.host)
            self.row_of[k] = rows.setdefault(id(link), len(self.links))
            if self.row_of[k] == len(self.links):
                self.links.append(link)
        self.ends = self._ends(network, self.links, self.row_of)

    def _ends(
        self, network: Network, links: list[Timeline], row_of: NDArray[np.intp]
    ) -> NDArray[np.float64]:
        """``t_en`` of every waiting update on ``network`` (``inf`` for the others)."""
        ends = np.full(len(self.updates), np.inf)
        ends[self.alive & self.local] = network.now
        remote = self.alive & ~self.local
        ends[remote] = finish_rows(
            links, network.downlink(self.server), row_of[remote], self.sizes[remote], network.now
        )
        return ends

    def _pick(self, position: int, ends: NDArray[np.float64], among: NDArray[np.bool_]) -> int:
        """ShrtDLine (Alg. 2 lines 1-4): the update due at ``position``, else the shortest;
        ``-1`` when ``among`` is empty."""
        if not among.any():
            return -1
        due = among & (self.deadlines == position) if self.bounded else among
        if not due.any():
            due = among
        # among the candidates only: when every one ends at infinity an argmin over the whole
        # array picks index 0, booked or dropped already, and the pool never empties
        candidates = np.flatnonzero(due)
        return int(candidates[np.argmin(ends[candidates])])

    def _drop(self, k: int, reason: str) -> None:
        self.alive[k] = False
        self.dropped.append((self.updates[k], reason))

    def step(self) -> bool:
        """Fill the next position (or drop what cannot fill it); ``False`` when none waits."""
        position = len(self.booked) + 1
        if self.bounded:
            for stale in np.flatnonzero(self.alive & (self.deadlines < position)).tolist():
                self._drop(stale, DEADLINE_PASSED)
        k = self._pick(position, self.ends, self.alive)
        if k < 0:
            return False
        if self.ends[k] == np.inf:
            self._drop(k, NO_CAPACITY)
            return True
        update = self.updates[k]
        trial = self.network.copy()
        transfer = trial.reserve(update.host, self.server, update.size)
        self.alive[k] = False
        links, row_of = self._moved(trial, update.host)
        ends = self._ends(trial, links, row_of)
        if self.bounded:
            nxt = self._pick(position + 1, ends, self.alive & (self.deadlines >= position + 1))
            if nxt >= 0 and transfer.end > ends[nxt]:
                self.dropped.append((update, LOOK_AHEAD))
                self.ends[k] = np.inf
                return True
        self.booked.append((k, transfer))
        self.network, self.links, self.row_of, self.ends = trial, links, row_of, ends
        return True

    def _moved(self, network: Network, host: int) -> tuple[list[Timeline], NDArray[np.intp]]:
        """The rows once ``host``'s uplink changed: its waiting updates get a row of their own
        (the rows no waiting update uses are dropped now and then)."""
        row_of = self.row_of.copy()
        links = [*self.links, network.uplink(host)]
        row_of[self.by_host[host]] = len(links) - 1
        if len(links) > 64:
            used, row_of[self.alive] = np.unique(row_of[self.alive], return_inverse=True)
            links = [links[r] for r in used]
        return links, row_of

    def result(self) -> Ordering:
        """The arrival check (module docstring), positions, and the answer."""
        planned: list[Planned] = []
        arrivals = sorted(range(len(self.booked)), key=lambda b: (self.booked[b][1].end, b))
        for b in arrivals:
            k, transfer = self.booked[b]
            position = len(planned) + 1
            if self.bounded and self.deadlines[k] < position:
                self.dropped.append((self.updates[k], ARRIVES_LATE))
                self.network.release(transfer)
                continue
            planned.append(Planned(self.updates[k], transfer, position))
        return Ordering(planned=planned, dropped=self.dropped, network=self.network)
