"""Which ordered updates go to the server directly and which through an aggregator first
(MLfabric §5.2: Alg. 3, Fig. 6).

Rules: this module takes a batch already in apply order (:mod:`~fabricd.engines.scheduling.
ordering`'s ``planned``, or any list in the order the server should apply it: MLfabric-S, §6,
passes a synchronous round's updates as they come) and splits it into a first stretch sent
straight to the server and groups, each summed at one aggregator and forwarded as one update
(:func:`aggregate`); it books every transfer on a copy of the network as it was *before* the
batch's bookings.  Pure computation; the daemon moves the bytes and sums them.

Theory of operation.  Alg. 3 tries every ``n = 0 .. |U|``: the first ``n`` updates are booked
straight to the server, in order (lines 3-7; the server is then busy until ``t_max``, the last
of them to arrive); the rest, in order, join the first aggregator as long as each arrives there
no later than ``t_max`` (line 10: aggregating a group must not finish later than the groups
before it reach the server, so the server's downlink never lies fallow waiting for an
aggregate); the first that would arrive later closes the group: its aggregate is forwarded to
the server and ``t_max`` moves to that arrival (lines 11-13), and the update is tried at the
next aggregator.  The case whose last arrival ``t_max`` is earliest wins (line 24).  Choices
where the paper is loose:

* ``t_max`` is the latest arrival at the server so far, the maximum over the direct transfers
  and the forwards (line 11 assigns; a forward can arrive before an earlier direct transfer);
* an aggregator's forward starts when its last member has arrived (the aggregate is complete);
  its size is ``aggregate_size(members)``, by default the largest member's (a dense sum);
* a worker on its aggregator's host reaches it over no link: a local transfer that arrives the
  instant it may start and books nothing (:class:`~fabricd.engines.scheduling.timelines.
  Network`);
* a group that cannot take even its first update (with ``n = 0``, ``t_max`` is ``now`` and
  nothing arrives by then) ends aggregation for that case, as do aggregators running out: the
  remaining updates go straight to the server, in order, after the groups' forwards are booked
  (so the constraint holds for every group, and ``n = 0`` with nothing grouped is the all-direct
  case);
* a case whose forward or direct transfer never ends has ``t_max`` infinite;
* ties between cases go to the smallest ``n``, a case that grouped nothing counting as the
  all-direct case ``n = |U|`` it books exactly (its ``first`` says so).

Cost: the first ``n`` bookings are shared between cases (each case starts from a copy of the
network after them, a dictionary copy), and a case stops as soon as its ``t_max`` passes the
best so far, as does the enumeration once the first ``n`` direct transfers alone end later
than the best, and before the updates left over go direct, a case stops if the server's
downlink alone could not take their bytes before the best ``t_max``
(:meth:`~fabricd.engines.scheduling.timelines.Network.inbound`): the answer is the
enumeration's, at a fraction of its ``O(|U|^2)`` bookings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabricd.engines.scheduling.ordering import Planned, Update
from fabricd.engines.scheduling.timelines import Network, Transfer

if TYPE_CHECKING:
    from collections.abc import Sequence

#: the size of an aggregate of these updates, in bytes
AggregateSize = Callable[[list[Update]], float]


def dense_sum(members: list[Update]) -> float:
    """A dense sum's size: the largest member's."""
    return max(u.size for u in members)


@dataclass(frozen=True, slots=True)
class Group:
    """Updates summed at ``aggregator`` (``members``: each with its transfer to the aggregator
    and its apply position) and ``forward``: the aggregate's transfer to the server."""

    aggregator: int
    members: list[Planned]
    forward: Transfer


@dataclass(frozen=True)
class Aggregation:
    """Alg. 3's answer: ``direct`` updates (the first ``first`` of them before any group, the
    rest after the aggregators ran out), the ``groups`` in aggregator order, ``t_max`` (the
    last arrival at the server), and ``network``: the copy with every booking."""

    direct: list[Planned]
    groups: list[Group]
    t_max: float
    first: int = 0
    network: Network | None = field(default=None, compare=False, repr=False)

    @property
    def server_bytes(self) -> float:
        """Bytes that reach the server: direct updates plus forwarded aggregates."""
        return sum(p.transfer.size for p in self.direct) + sum(g.forward.size for g in self.groups)


def aggregate(
    planned: Sequence[Planned],
    network: Network,
    *,
    server: int,
    aggregators: Sequence[int],
    aggregate_size: AggregateSize | None = None,
) -> Aggregation:
    """Alg. 3: the case ``n = 0 .. len(planned)`` with the earliest last arrival ``t_max``.

    ``planned`` is in apply order; ``network`` is the state before the batch's bookings and
    is not changed; ``aggregators`` are the pre-assigned aggregator hosts, group ``i`` using
    ``aggregators[i]``.

    Raises:
        ValueError: the server is one of the aggregators.
        KeyError: an unknown host.
    """
    _check(server, aggregators)
    size_of = aggregate_size or dense_sum
    running = network.copy()
    starts = [running.copy()]  # starts[n]: the network with the first n direct bookings
    direct: list[Planned] = []
    reached = [running.now]  # reached[n]: the last arrival of the first n direct transfers
    for p in planned:
        transfer = _direct(running, p.update, server)
        direct.append(Planned(p.update, transfer, p.position))
        starts.append(running.copy())
        reached.append(max(reached[-1], transfer.end))
    best = Aggregation(direct, [], reached[-1], len(direct), running)
    batch = _Batch(planned, server, aggregators, size_of)
    for n in range(len(planned) if aggregators else 0):
        if _beyond(reached[n], best.t_max, network.now):
            break  # the first n direct transfers alone end later: so do all later cases
        case = batch.case(n, direct[:n], starts[n], reached[n], bound=best.t_max)
        if case is not None and (
            _beyond(best.t_max, case.t_max, network.now)
            or (not _beyond(case.t_max, best.t_max, network.now) and not best.groups)
        ):
            best = case  # a tie goes to the smallest n, the all-direct case counting as |U|
    return best


def _beyond(t: float, bound: float, now: float) -> bool:
    """``t`` is later than ``bound`` by more than rounding: the cuts and the ties compare
    times that different booking orders reach by different float sums.  The margin is taken
    on the durations from ``now`` (an absolute clock, a daemon's seconds since boot, would
    widen it to milliseconds on a machine up for weeks: small transfers' whole length)."""
    return t - now > (bound - now) * (1 + 1e-9) + 1e-12


def det_agg(
    n: int,
    planned: Sequence[Planned],
    network: Network,
    *,
    server: int,
    aggregators: Sequence[int],
    aggregate_size: AggregateSize | None = None,
) -> Aggregation:
    """DetAgg (Alg. 3 lines 1-20): the single case of ``n`` direct updates, from scratch
    (``network`` not changed); :func:`aggregate` returns the best of these."""
    _check(server, aggregators)
    running = network.copy()
    direct = [
        Planned(p.update, _direct(running, p.update, server), p.position) for p in planned[:n]
    ]
    reached = max((p.transfer.end for p in direct), default=running.now)
    batch = _Batch(planned, server, aggregators, aggregate_size or dense_sum)
    case = batch.case(n, direct, running, reached, bound=math.inf)
    assert case is not None  # no bound: never cut short
    return case


def _check(server: int, aggregators: Sequence[int]) -> None:
    if server in aggregators:
        raise ValueError(f"the server {server} cannot be its own aggregator")


def _direct(network: Network, update: Update, server: int) -> Transfer:
    """Book ``update`` straight to the server (a never-ending one ends at ``inf``)."""
    if network.finish(update.host, server, update.size) == math.inf:
        return Transfer(update.host, server, update.size, math.inf, math.inf)
    return network.reserve(update.host, server, update.size)


@dataclass(frozen=True, slots=True)
class _Batch:
    """What every case of one :func:`aggregate` call shares."""

    planned: Sequence[Planned]
    server: int
    aggregators: Sequence[int]
    size_of: AggregateSize

    def case(
        self, n: int, direct: list[Planned], network: Network, t_max: float, *, bound: float
    ) -> Aggregation | None:
        """Lines 8-19 from the network after the first ``n`` direct bookings (``network`` is
        booked further); ``None`` once ``t_max`` passes ``bound`` (it cannot win), or when
        nothing is grouped and ``bound`` is finite (the all-direct case, known already)."""
        groups: list[Group] = []
        members: list[Planned] = []
        i, a = n, 0
        while i < len(self.planned) and a < len(self.aggregators):
            p = self.planned[i]
            host = self.aggregators[a]
            transfer = network.reserve_if(p.update.host, host, p.update.size, by=t_max)
            if transfer is not None:
                members.append(Planned(p.update, transfer, p.position))
                i += 1
                continue
            if not members:
                if not groups and bound < math.inf:
                    return None
                break  # this group cannot start: the rest go direct (module docstring)
            t_max = max(t_max, _close(network, host, members, self.server, self.size_of, groups))
            members, a = [], a + 1
            if _beyond(t_max, bound, network.now):
                return None
        if members:
            host = self.aggregators[a]
            t_max = max(t_max, _close(network, host, members, self.server, self.size_of, groups))
        left = math.fsum(p.update.size for p in self.planned[i:] if p.update.host != self.server)
        if bound < math.inf and _beyond(network.inbound(self.server, left), bound, network.now):
            return None  # the server's downlink alone cannot take the rest in time
        direct = list(direct)
        for p in self.planned[i:]:
            if _beyond(t_max, bound, network.now):
                return None
            transfer = _direct(network, p.update, self.server)
            direct.append(Planned(p.update, transfer, p.position))
            t_max = max(t_max, transfer.end)
        if _beyond(t_max, bound, network.now):
            return None
        return Aggregation(direct, groups, t_max, n if groups else len(direct), network)


def _close(
    network: Network,
    aggregator: int,
    members: list[Planned],
    server: int,
    size_of: AggregateSize,
    groups: list[Group],
) -> float:
    """Forward the group's aggregate to the server once its last member arrived (lines
    11-12); append the group and return the forward's arrival."""
    ready = max(m.transfer.end for m in members)
    size = size_of([m.update for m in members])
    if network.finish(aggregator, server, size, start=ready) == math.inf:
        forward = Transfer(aggregator, server, size, math.inf, math.inf)
    else:
        forward = network.reserve(aggregator, server, size, start=ready)
    groups.append(Group(aggregator, members, forward))
    return forward.end
