"""The order of a batch of updates to a model split over several servers, each update's parts
reserved on all its servers together (MLfabric §10.2, eq. 18).

Rules: this module decides, for one batch of updates each made of one *component* per server
(the worker's update of that server's key range), which updates are sent, in what order, the
transfer booked for each component, and which updates are dropped (whole) with a reason
(:func:`order_joint`).  Pure computation on a
:class:`~fabricd.engines.scheduling.timelines.Network` copy.

Theory of operation.  §10.2: "all the components of g_i are computed from the same version of
the model and thus, will have the same deadline"; treating the components as independent
updates and ordering each server's shortest first would send a server of small components its
updates first and starve the parts of the model on the others ("some parts of the model being
updated less frequently than others").  So the network for all of an update's components is
reserved together, and Alg. 2 picks, at each position, by the completion time of all its
components,

    t_en(g) = max_j t_en(g^j)                                              (eq. 18)

with the deadline rule, the look-ahead and the drops of :mod:`~fabricd.engines.scheduling.
ordering` applied to whole updates: an update is applied by every server it has a part for,
or by none.

Choices where the paper is silent, and why:

* *Components booked in server order.*  A worker's components share its uplink: ``t_en(g)``
  books them one after another on a copy of the network (the servers in the order the update
  lists them) and takes the last end; the transfers kept are those bookings.  Splitting the
  uplink between components at once would end the last one no earlier.
* *Positions per server.*  An update's deadline is checked at the place it would take at each
  server it has a part for (a server counts only the updates it receives), the latest of them:
  with every update split over every server that is the batch's booking order, and an update
  for one server only is never dropped for the places of updates it shares no server with.
* *Arrival check per server.*  Each server applies the batch's updates as their components
  reach it, so an update's position may differ between servers: an update whose deadline any
  server's arrival order passes is dropped whole (its bookings released), and the check runs
  again (a drop only moves later updates earlier, so it ends within the batch's size).
* *Quadratic and plain.*  Each step books every waiting update's components on a copy:
  ``O(|U|^2 |S|)`` bookings for a batch, no vectorisation: a batch is one scheduling
  interval's updates (tens); the parameter server's shard 0 runs it for a sharded model's
  batch (:mod:`fabricd.engines.ps.joint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fabricd.engines.scheduling.ordering import (
    ARRIVES_LATE,
    DEADLINE_PASSED,
    LOOK_AHEAD,
    NO_CAPACITY,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Mapping, Sequence

    from fabricd.engines.scheduling.timelines import Network, Transfer


@dataclass(frozen=True, slots=True)
class JointUpdate:
    """One worker's update of a split model: on ``host``, computed from version ``version``,
    ``sizes[server]`` bytes for each server it has a part for."""

    key: Hashable
    host: int
    version: int
    sizes: Mapping[int, float]


@dataclass(frozen=True, slots=True)
class JointPlanned:
    """An update that goes: each component's booked transfer, its 1-based position in the
    batch's booking order, and when its last component ends."""

    update: JointUpdate
    transfers: dict[int, Transfer]
    position: int
    end: float


@dataclass(frozen=True)
class JointOrdering:
    """:func:`order_joint`'s answer: ``planned`` in booking order, ``dropped`` with a reason
    each, and ``network``: the copy with the planned bookings."""

    planned: list[JointPlanned]
    dropped: list[tuple[JointUpdate, str]]
    network: Network | None = field(default=None, compare=False, repr=False)


def book(network: Network, update: JointUpdate) -> tuple[float, dict[int, Transfer]]:
    """Book ``update``'s components on ``network`` (changed), one after another in the order
    of ``update.sizes``; ``(t_en(g), transfers)`` (eq. 18's max over components), or
    ``(inf, {})`` and nothing booked when a component never ends."""
    transfers: dict[int, Transfer] = {}
    for server, size in update.sizes.items():
        if network.finish(update.host, server, size) == math.inf:
            for transfer in transfers.values():
                network.release(transfer)
            return math.inf, {}
        transfers[server] = network.reserve(update.host, server, size)
    end = max((t.end for t in transfers.values()), default=network.now)
    return end, transfers


def order_joint(
    updates: Sequence[JointUpdate],
    network: Network,
    *,
    delay_bound: int | None,
    v_init: int,
) -> JointOrdering:
    """Alg. 2 over whole updates by eq. 18 (module docstring); ``delay_bound`` ``None``: Alg.
    1, shortest first.  ``network`` is not changed.

    Raises:
        KeyError: an update's host or server is not one of ``network``'s hosts.
        ValueError: a negative ``delay_bound``, or an update with no component or a negative
            size.
    """
    if delay_bound is not None and delay_bound < 0:
        raise ValueError(f"a delay bound is >= 0, not {delay_bound}")
    for update in updates:
        if not update.sizes or any(s < 0 or math.isnan(s) for s in update.sizes.values()):
            raise ValueError(f"update {update.key!r} needs components of sizes >= 0")
        network.uplink(update.host)
        for server in update.sizes:
            network.downlink(server)
    deadlines = [
        (u.version + delay_bound - v_init) if delay_bound is not None else len(updates) + 1
        for u in updates
    ]
    running = network.copy()
    alive = set(range(len(updates)))
    booked: list[tuple[int, float, dict[int, Transfer]]] = []
    dropped: list[tuple[JointUpdate, str]] = []
    counts: dict[int, int] = {}  #: server -> the updates booked with a part for it
    while alive:
        position = _positions(updates, counts)
        for stale in sorted(j for j in alive if deadlines[j] < position(j)):
            alive.discard(stale)
            dropped.append((updates[stale], DEADLINE_PASSED))
        picked = _pick(updates, running, alive, deadlines, position)
        if picked is None:
            break
        k = picked
        trial = running.copy()
        end, transfers = book(trial, updates[k])
        alive.discard(k)
        if end == math.inf:
            dropped.append((updates[k], NO_CAPACITY))
            continue
        after = counts | {s: counts.get(s, 0) + 1 for s in updates[k].sizes}
        if delay_bound is not None:
            then = _positions(updates, after)
            later = {j for j in alive if deadlines[j] >= then(j)}
            nxt = _pick(updates, trial, later, deadlines, then)
            if nxt is not None and end > book(trial.copy(), updates[nxt])[0]:
                dropped.append((updates[k], LOOK_AHEAD))
                continue
        booked.append((k, end, transfers))
        running, counts = trial, after
    if delay_bound is not None:
        booked = _arrival_check(updates, booked, deadlines, running, dropped)
    planned = [
        JointPlanned(update=updates[k], transfers=transfers, position=p, end=end)
        for p, (k, end, transfers) in enumerate(booked, 1)
    ]
    return JointOrdering(planned=planned, dropped=dropped, network=running)


def _positions(updates: Sequence[JointUpdate], counts: Mapping[int, int]) -> Callable[[int], int]:
    """Where update ``j`` would be applied next: its latest place at any server it has a part
    for (each server counts only the updates it receives)."""
    return lambda j: max(counts.get(s, 0) for s in updates[j].sizes) + 1


def _pick(
    updates: Sequence[JointUpdate],
    network: Network,
    among: set[int],
    deadlines: list[int],
    position: Callable[[int], int],
) -> int | None:
    """ShrtDLine by eq. 18: the update due at its ``position`` whose components all end first,
    else the shortest so; ``None`` when ``among`` is empty."""
    if not among:
        return None
    due = [k for k in among if deadlines[k] == position(k)] or sorted(among)
    return min(due, key=lambda k: (book(network.copy(), updates[k])[0], k))


def _arrival_check(
    updates: Sequence[JointUpdate],
    booked: list[tuple[int, float, dict[int, Transfer]]],
    deadlines: list[int],
    network: Network,
    dropped: list[tuple[JointUpdate, str]],
) -> list[tuple[int, float, dict[int, Transfer]]]:
    """Drop (whole) each booked update whose deadline some server's arrival order passes."""
    while True:
        late = None
        servers = {s for _, _, transfers in booked for s in transfers}
        for server in servers:
            arriving = sorted(
                (transfers[server].end, b)
                for b, (_, _, transfers) in enumerate(booked)
                if server in transfers
            )
            for position, (_, b) in enumerate(arriving, 1):
                if deadlines[booked[b][0]] < position:
                    late = b
                    break
            if late is not None:
                break
        if late is None:
            return booked
        k, _, transfers = booked.pop(late)
        for transfer in transfers.values():
            network.release(transfer)
        dropped.append((updates[k], ARRIVES_LATE))
