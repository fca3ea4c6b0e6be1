"""Residual-capacity timelines of a star network, and the transfer arithmetic MLfabric's
scheduler runs on them: ``t_en`` (Fig. 4b) and ``NetUp`` (Fig. 4c).

Rules: this module holds what the network can still carry, per host and direction, from
``now`` on (:class:`Network`), and answers two questions about one transfer: when it would end
(:meth:`Network.finish`, also for many candidates at once: :meth:`Network.finish_many`) and
what is left once it is booked (:meth:`Network.reserve`).  Pure computation: no clock (time is a
float argument), no I/O.  What a transfer is *for* (an update, an aggregate) belongs to
:mod:`~fabricd.engines.scheduling.ordering` and :mod:`~fabricd.engines.scheduling.aggregation`.

Theory of operation (MLfabric §4, §5, §10.1).  The paper's network is a star with a
congestion-free core: a transfer from ``src`` to ``dst`` crosses exactly two links that can be
busy, ``src``'s uplink and ``dst``'s downlink.  Each link's residual capacity is piecewise
constant in time (bytes/s on ``[t_k, t_k+1)``, the last piece for ever).  A transfer that may
start at ``s`` sends, at each instant, as fast as both links allow, ``min(up[src](t),
down[dst](t))`` (the blue region of Fig. 4b); its ``t_en`` is the instant its bytes are all
sent, ``math.inf`` when a link stays at zero for ever first.  Booking it subtracts that rate
from both links over its whole life (Fig. 4c), so later transfers time-share what is left
(§3.1.1: "network time sharing").  Choices where the paper is loose:

* a transfer from a host to itself (a worker on its aggregator's host, §5.2) crosses no link:
  it ends the instant it may start and books nothing;
* a transfer's ``start`` is its ``t_st`` (eq. 14): the first instant it sends at a positive
  rate, which may be later than the instant it was allowed to start;
* residual capacities within ``1e-9`` of a link's full capacity of zero are zero, and
  neighbouring pieces that close are merged (keeping the lower rate, so nothing is booked
  twice).  Without that, ``10 - 1 - ... - 1`` leaves a trickle of ``1e-15`` bytes/s that later
  transfers would wait on, and the timelines would keep a breakpoint per booking for ever;
  with it, a saturated stretch is one piece, and a timeline's length stays near the number of
  transfers that end after its busy stretch (what keeps :meth:`Network.finish_many` cheap).

Timelines are immutable tuples shared between copies until one is changed, so
:meth:`Network.copy` costs a dictionary copy: Alg. 3 copies the network once per case.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from numpy.typing import NDArray

#: a residual rate within this share of the link's capacity of zero (or of its neighbour) is
#: it; a transfer within this share of its size of done at a piece's end is done there (so
#: ``finish`` and ``finish_many`` agree where rounding meets a stretch of zero capacity)
TOLERANCE: Final = 1e-9

#: one piece of a transfer's rate profile: (from, until, bytes/s)
Segment = tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One booked transfer: ``size`` bytes from ``src`` to ``dst``, sent between ``start``
    (its first byte, eq. 14) and ``end`` (``t_en``, eq. 15).  ``profile`` is the rate it was
    booked at, piece by piece (what :meth:`Network.release` gives back); empty for a local or
    empty transfer."""

    src: int
    dst: int
    size: float
    start: float
    end: float
    profile: tuple[Segment, ...] = field(default=(), compare=False, repr=False)

    @property
    def sent(self) -> float:
        """The bytes the profile carries (``size``, up to rounding)."""
        return math.fsum((b - a) * r for a, b, r in self.profile)


@dataclass(frozen=True, slots=True)
class Timeline:
    """One link's residual capacity: ``rates[k]`` bytes/s on ``[times[k], times[k+1])``, the
    last rate for ever.  ``capacity`` is the link's full rate (the tolerance's scale)."""

    times: tuple[float, ...]
    rates: tuple[float, ...]
    capacity: float

    def at(self, t: float) -> float:
        """The residual rate at instant ``t`` (``t`` at or after the first breakpoint)."""
        return self.rates[max(0, bisect_right(self.times, t) - 1)]

    def changed(self, segments: Sequence[Segment], sign: float) -> Timeline:
        """This timeline with ``sign * rate`` added on each segment (-1 books, +1 releases)."""
        points = sorted({*self.times, *(a for a, _, _ in segments), *(b for _, b, _ in segments)})
        tol = TOLERANCE * self.capacity
        times: list[float] = []
        rates: list[float] = []
        k = 0  # the first segment not ended at the point
        i = 0  # the piece of this timeline the point lies in
        for point in points:
            while i + 1 < len(self.times) and self.times[i + 1] <= point:
                i += 1
            while k < len(segments) and segments[k][1] <= point:
                k += 1
            delta = segments[k][2] if k < len(segments) and segments[k][0] <= point else 0.0
            rate = self.rates[i] + sign * delta
            assert rate >= -max(tol, 1e-12), f"booked {delta} B/s over {self.rates[i]} B/s"
            rate = 0.0 if rate < tol else min(rate, self.capacity)
            if rates and abs(rates[-1] - rate) <= tol:
                rates[-1] = min(rates[-1], rate)
                continue
            times.append(point)
            rates.append(rate)
        return Timeline(tuple(times), tuple(rates), self.capacity)

    def since(self, t: float) -> Timeline:
        """The same capacity from ``t`` on (what came before is forgotten)."""
        first = max(0, bisect_right(self.times, t) - 1)
        times = (max(t, self.times[first]), *self.times[first + 1 :])
        return Timeline(times, self.rates[first:], self.capacity)


def plan(up: Timeline, down: Timeline, size: float, start: float) -> tuple[float, list[Segment]]:
    """``t_en`` of ``size`` bytes over ``up`` then ``down`` from ``start``, and the rate profile
    (Fig. 4b): at each instant the lower of the two residual rates."""
    segments: list[Segment] = []
    if size <= 0:
        return start, segments
    i = max(0, bisect_right(up.times, start) - 1)
    j = max(0, bisect_right(down.times, start) - 1)
    t, left = start, size
    while True:
        rate = min(up.rates[i], down.rates[j])
        next_up = up.times[i + 1] if i + 1 < len(up.times) else math.inf
        next_down = down.times[j + 1] if j + 1 < len(down.times) else math.inf
        until = min(next_up, next_down)
        if rate > 0:
            if until == math.inf or rate * (until - t) >= left - size * TOLERANCE:
                end = t + min(left / rate, until - t)
                segments.append((t, end, rate))
                return end, segments
            segments.append((t, until, rate))
            left -= rate * (until - t)
        elif until == math.inf:
            return math.inf, segments
        t = until
        i += next_up == until
        j += next_down == until


#: an uplink that never limits: :meth:`Network.inbound` asks the downlink alone
_UNLIMITED: Final = Timeline((-math.inf,), (math.inf,), math.inf)


class Network:
    """Per-host uplink and downlink residual capacity of a star network, from ``now`` on.

    ``up`` and ``down`` give each host's full capacity in bytes/s (the same hosts in both).
    Methods that take a ``start`` let a transfer begin no earlier than ``max(now, start)``.

    Raises:
        ValueError: a host in one of ``up``/``down`` and not the other, or a negative capacity.
    """

    def __init__(
        self, up: Mapping[int, float], down: Mapping[int, float], *, now: float = 0.0
    ) -> None:
        if set(up) != set(down):
            raise ValueError(f"hosts differ between up {sorted(up)} and down {sorted(down)}")
        if any(c < 0 or math.isnan(c) for c in (*up.values(), *down.values())):
            raise ValueError("capacities are >= 0 bytes/s")
        self.now = float(now)
        shared: dict[float, Timeline] = {}  # equal untouched links: one object (finish_many)

        def fresh(capacity: float) -> Timeline:
            return shared.setdefault(capacity, Timeline((self.now,), (capacity,), capacity))

        self._up = {h: fresh(float(c)) for h, c in up.items()}
        self._down = {h: fresh(float(c)) for h, c in down.items()}

    @property
    def hosts(self) -> list[int]:
        """The hosts, in the order given."""
        return list(self._up)

    def uplink(self, host: int) -> Timeline:
        """``host``'s uplink residual capacity."""
        return self._up[host]

    def downlink(self, host: int) -> Timeline:
        """``host``'s downlink residual capacity."""
        return self._down[host]

    def copy(self) -> Network:
        """An independent network with the same residual capacity (timelines are shared until
        one side books or releases: they are immutable)."""
        twin = Network.__new__(Network)
        twin.now = self.now
        twin._up = dict(self._up)
        twin._down = dict(self._down)
        return twin

    def advance(self, now: float) -> None:
        """Forget capacity before ``now`` (bookings that ended are gone; later ones stay)."""
        self.now = max(self.now, float(now))
        self._up = {h: tl.since(self.now) for h, tl in self._up.items()}
        self._down = {h: tl.since(self.now) for h, tl in self._down.items()}

    def _start(self, start: float | None) -> float:
        return self.now if start is None else max(self.now, float(start))

    def finish(self, src: int, dst: int, size: float, *, start: float | None = None) -> float:
        """``t_en`` (Fig. 4b): when ``size`` bytes from ``src`` to ``dst`` would all be sent,
        starting at ``max(now, start)``; ``math.inf`` if never.  Nothing is booked.

        Raises:
            KeyError: an unknown host.
        """
        return self._plan(src, dst, size, start)[1]

    def inbound(self, dst: int, size: float, *, start: float | None = None) -> float:
        """The earliest instant ``size`` bytes could all have reached ``dst`` from
        ``max(now, start)``, from whatever sources: a lower bound on the last arrival of
        transfers of that many bytes in all (:mod:`~fabricd.engines.scheduling.aggregation`
        cuts a case short with it)."""
        return plan(_UNLIMITED, self._down[dst], size, self._start(start))[0]

    def reserve(self, src: int, dst: int, size: float, *, start: float | None = None) -> Transfer:
        """``NetUp`` (Fig. 4c): book the transfer :meth:`finish` describes on both links.

        Raises:
            KeyError: an unknown host.
            ValueError: the transfer never ends (a link at zero for ever): nothing is booked.
        """
        begin, end, segments = self._plan(src, dst, size, start)
        if end == math.inf:
            raise ValueError(f"{size} B from {src} to {dst} never ends: a link has no capacity")
        return self._book(src, dst, size, begin, end, segments)

    def reserve_if(
        self, src: int, dst: int, size: float, *, by: float, start: float | None = None
    ) -> Transfer | None:
        """:meth:`reserve` if the transfer ends by ``by``; else book nothing and return ``None``
        (Alg. 3 line 10's test and line 17's booking in one pass over the timelines)."""
        begin, end, segments = self._plan(src, dst, size, start)
        if end > by:
            return None
        return self._book(src, dst, size, begin, end, segments)

    def _book(
        self, src: int, dst: int, size: float, begin: float, end: float, segments: list[Segment]
    ) -> Transfer:
        if segments:
            self._up[src] = self._up[src].changed(segments, -1.0)
            self._down[dst] = self._down[dst].changed(segments, -1.0)
        first = segments[0][0] if segments else begin
        return Transfer(src, dst, float(size), first, end, tuple(segments))

    def release(self, transfer: Transfer) -> None:
        """Give back what :meth:`reserve` booked for ``transfer`` (on this network or a copy
        taken before the booking)."""
        if transfer.profile:
            segments = list(transfer.profile)
            self._up[transfer.src] = self._up[transfer.src].changed(segments, 1.0)
            self._down[transfer.dst] = self._down[transfer.dst].changed(segments, 1.0)

    def _plan(
        self, src: int, dst: int, size: float, start: float | None
    ) -> tuple[float, float, list[Segment]]:
        up, down = self._up[src], self._down[dst]  # KeyError first, even for a local transfer
        begin = self._start(start)
        if src == dst:  # crosses no link (module docstring)
            return begin, begin, []
        end, segments = plan(up, down, size, begin)
        return begin, end, segments

    def finish_many(
        self, srcs: Sequence[int], dst: int, sizes: Sequence[float], *, start: float | None = None
    ) -> NDArray[np.float64]:
        """:meth:`finish` of each ``(srcs[k], sizes[k])`` to ``dst``, all at once (numpy).

        The inner loop of Alg. 1 and 2 (§7.4 names it as the part to parallelise).  Sources
        whose uplinks are the same object (every untouched link of one capacity: see
        ``__init__``) share one row; the rows' rates are evaluated on one merged grid of
        breakpoints, cumulated, and each candidate's size is looked up in its row's bytes.
        """
        begin = self._start(start)
        sizes_a = np.asarray(sizes, dtype=np.float64)
        ends = np.full(sizes_a.shape, begin)
        rows: dict[int, int] = {}
        links: list[Timeline] = []
        row_of = np.zeros(sizes_a.shape, dtype=np.intp)
        remote = np.zeros(sizes_a.shape, dtype=bool)
        for k, src in enumerate(srcs):
            link = self._up[src]
            if src != dst and sizes_a[k] > 0:
                remote[k] = True
                row_of[k] = rows.setdefault(id(link), len(links))
                if row_of[k] == len(links):
                    links.append(link)
        ends[remote] = finish_rows(links, self._down[dst], row_of[remote], sizes_a[remote], begin)
        return ends


def finish_rows(
    links: Sequence[Timeline],
    down: Timeline,
    row_of: NDArray[np.intp],
    sizes: NDArray[np.float64],
    begin: float,
) -> NDArray[np.float64]:
    """``t_en`` of ``sizes[k]`` bytes over uplink ``links[row_of[k]]`` then ``down`` from
    ``begin`` (sizes > 0; a caller that keeps its candidates' rows between calls, as
    :func:`~fabricd.engines.scheduling.ordering.order` does, skips the grouping).

    Every row's rate is evaluated on one merged grid of breakpoints, cumulated, and each size
    is found in its row's cumulated bytes by one ``searchsorted``.
    """
    if not len(sizes):
        return np.empty(0)
    grid = np.unique(np.concatenate([[begin], down.times, *(tl.times for tl in links)]))
    grid = grid[grid >= begin]
    rate = np.minimum(_on(links, grid), _on([down], grid))  # (rows, grid)
    cum = np.zeros_like(rate)
    np.cumsum(rate[:, :-1] * np.diff(grid), axis=1, out=cum[:, 1:])
    return _lookup(grid, rate, cum, row_of, sizes)


def _on(links: Sequence[Timeline], grid: NDArray[np.float64]) -> NDArray[np.float64]:
    """Each link's rate at each grid point, one row per link (``grid`` holds every breakpoint
    at or after its first point).  Exact and without a loop over rows: each piece's start is
    found in the grid, and a running count of starts per row indexes the rates."""
    counts = [len(tl.times) for tl in links]
    times = np.fromiter(chain.from_iterable(tl.times for tl in links), np.float64, sum(counts))
    rates = np.fromiter(chain.from_iterable(tl.rates for tl in links), np.float64, sum(counts))
    rows = np.repeat(np.arange(len(links)), counts)
    starts = np.zeros((len(links), grid.size), dtype=np.intp)
    np.add.at(starts, (rows, np.searchsorted(grid, times, side="left")), 1)
    first = np.cumsum(counts) - np.asarray(counts)  # each row's first piece in ``rates``
    index = np.cumsum(starts, axis=1) - 1 + first[:, None]
    out: NDArray[np.float64] = rates[index]
    return out


def _lookup(
    grid: NDArray[np.float64],
    rate: NDArray[np.float64],
    cum: NDArray[np.float64],
    row: NDArray[np.intp],
    size: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Where each ``size`` is reached in its ``row`` of cumulated bytes ``cum`` (one
    ``searchsorted`` over all rows: each row is lifted above the one before it)."""
    height = float(cum[:, -1].max()) + float(size.max()) + 1.0
    lift = np.arange(cum.shape[0], dtype=np.float64) * height
    flat = (cum + lift[:, None]).ravel()
    wanted = size * (1 - TOLERANCE) + lift[row]  # within rounding of a piece's end: done there
    count = np.searchsorted(flat, wanted, side="left") - row * grid.size
    piece = count - 1  # the piece in which the size is reached: cum[piece] < size
    got = rate[row, piece]
    with np.errstate(divide="ignore", invalid="ignore"):
        end = grid[piece] + (size - cum[row, piece]) / got
    last = np.append(grid[1:], math.inf)[piece]
    end = np.minimum(end, last)
    return np.where(got > 0, end, math.inf)
