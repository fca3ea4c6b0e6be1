"""What the collective service shows of its collectives: a status row per collective, a stall
row per call open longer than ``stall_after`` (its log line is that row's words), and the
service's Prometheus series.

Split from :mod:`~fabricd.daemon.services.collectives` (as ``stochastic_status.py`` from
``stochastic.py``): the service picks the collectives and calls, these say what a row holds.
Nothing here changes the engine or the service.

Theory of operation (stall rows): the engine says what a collective's round waits for
(:meth:`~fabricd.engines.collectives.persistent.Collective.waits`); the service adds what only
it sees, the ranks of the job that have not called the name (:func:`absent`).  The most common
hang is a name that differs between ranks: a rank that waits in ``'grads'`` while the others
call ``'grad'``.  For a rank on this node, the row names the collectives it has calls open in
instead; a rank on another node this node cannot see, so the row says where it is and what
came from there: a collective of the job built here by a peer's frame that no rank here ever
called is a name that only the other side uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.daemon.metrics import counter, gauge
from fabricd.engines.collectives.spec import algorithm as chosen_algorithm

if TYPE_CHECKING:
    from collections.abc import Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.metrics import OperationStats
    from fabricd.daemon.services.jobs import OpenCall
    from fabricd.engines.collectives.persistent import Collective, Spec
    from fabricd.wire import Meta

#: a stall row looks at most this many of the job's open calls here, and of its collectives
#: here (the newest), for the names its ranks use instead: bounded, as the p2p engine's look at
#: the peer's other tags, however many calls and collectives a job has
SCANNED: Final = 64
#: names, and ranks, a stall row says at most
MAX_NAMED: Final = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Absent:
    """What this node knows of the ranks of a job that have not called a collective whose
    round waits for them."""

    not_called: tuple[int, ...] = ()  #: local ranks with no call of the name open
    other_names: tuple[str, ...] = ()  #: the job's names they, or only peers, called instead
    words: str = ""  #: the same in a clause, for the row's detail ("" when there is nothing)


def absent(
    coll: Collective,
    waits: str,
    peer_node: int | None,
    calls: Iterable[OpenCall],
    peers_only: Iterable[str],
) -> Absent:
    """Who of ``coll``'s job has not called it, as far as this node knows.

    Args:
        coll: the collective a call waits in; ``waits`` and ``peer_node``: what its
            :meth:`~fabricd.engines.collectives.persistent.Collective.waits` says.
        calls: open calls of the job's clients on this node (some of them: at most
            :data:`SCANNED`).
        peers_only: names of the job's collectives here that no rank on this node ever called
            (a peer's frame built them).
    """
    name = coll.name
    parts: list[str] = []
    not_called: tuple[int, ...] = ()
    instead: set[str] = set()
    if waits == "ranks" or (waits == "initiator" and peer_node == coll.node):
        calls = list(calls)
        callers = {call.session.rank for call in calls if call.name == name}
        not_called = tuple(sorted(coll.local - callers))
        for rank in not_called[:MAX_NAMED]:
            names = sorted({c.name for c in calls if c.session.rank == rank and c.name != name})
            instead.update(names)
            if names:
                parts.append(f"rank {rank} has not called {name!r}; it waits in {_said(names)}")
            else:
                parts.append(f"rank {rank} has not called {name!r} (no collective call open)")
    elif waits in ("messages", "initiator") and peer_node is not None:
        there = (r for r, node in enumerate(coll.ranks) if node == peer_node)
        ranks = list(itertools.islice(there, MAX_NAMED + 1))
        shown = ", ".join(map(str, ranks[:MAX_NAMED])) + (" ..." if len(ranks) > MAX_NAMED else "")
        who = f"rank {shown} is" if len(ranks) == 1 else f"ranks {shown} are"
        parts.append(f"{who} on node {peer_node}, whose calls this node cannot see")
    if waits != "broken":
        others = sorted(set(peers_only) - {name})[:MAX_NAMED]
        instead.update(others)
        if others:
            it = "it" if len(others) == 1 else "them"
            parts.append(
                f"no rank on this node has called {_said(others)}, which peer nodes run (their "
                f"frames built {it} here)"
            )
    return Absent(
        not_called=not_called,
        other_names=tuple(sorted(instead)[:MAX_NAMED]),
        words="; ".join(parts),
    )


def _said(names: list[str]) -> str:
    return ", ".join(repr(name) for name in names)


def collective_row(job: str, owner: int | None, name: str, coll: Collective) -> Meta:
    """A collective's status row: what it is, its round and members, what it counted."""
    c = coll.counters
    return {
        "job": job,
        "owner": owner,
        "name": name,
        "what": coll.spec.describe(),
        "algorithm": algorithm(coll.spec),
        "round": coll.round,
        "nodes": list(coll.members),
        "lost": sorted(coll.lost),
        "waiting": coll.waiting(),
        "rounds": c.rounds,
        "calls": c.calls,
        "included": c.included,
        "late": c.late,
        "settled": c.settled,
        "unled": c.unled,
        "counted_elsewhere": c.counted_elsewhere,
        "mean_active": round(c.sum_active / c.rounds, 2) if c.rounds else None,
        "broken": coll.broken[1] if coll.broken else None,
    }


def stall_row(
    whose: Meta,
    node: int,
    token: int,
    call: OpenCall,
    coll: Collective,
    late: float,
    calls: Iterable[OpenCall],
    peers_only: Iterable[str],
) -> Meta:
    """Call ``token``, open ``late`` seconds: what its collective's round waits for, and who
    has not called it (:func:`absent`, which ``calls`` and ``peers_only`` are for)."""
    waits, detail, peer_node = coll.waits()
    missing = absent(coll, waits, peer_node, calls, peers_only)
    if missing.words:
        detail = f"{detail}; {missing.words}"
    return {
        **whose,
        "node": node,
        "op": token,
        "kind": call.kind,
        "rank": call.session.rank,
        "peer": "-",
        "tag": call.name,
        "nbytes": call.nbytes,
        "dtype": coll.spec.dtype,
        "pending_for": late,
        "waits": waits,
        "detail": f"{coll.spec.describe()} {call.name!r}: {detail}",
        "peer_joined": True,
        "peer_node": peer_node,
        "peer_node_state": None,
        "not_called": list(missing.not_called),
        "other_names": list(missing.other_names),
        "client_left": False,
    }


def families(
    operations: OperationStats, collectives: Iterable[Collective], open_calls: int, held: int
) -> Iterable[Metric]:
    """The service's series: totals over this node's collectives (``open_calls``: calls
    waiting for their round; ``held``: bytes of peers' frames held for collectives not built
    here yet).  No label names a job or a collective: their number has no bound, and the
    endpoint is not access-controlled; per-collective figures are in the status rows."""
    yield from operations.families(pending=open_calls)
    labels = {"service": operations.service}
    counters = [c.counters for c in collectives]
    yield counter(
        "fabricd_collective_rounds",
        "Rounds of persistent collectives ended on this node",
        [(labels, sum(c.rounds for c in counters))],
    )
    yield counter(
        "fabricd_collective_active_ranks",
        "Sum over rounds of the ranks that contributed fresh data (divide by rounds)",
        [(labels, sum(c.sum_active for c in counters))],
    )
    yield gauge(
        "fabricd_collectives",
        "Persistent collectives on this node",
        [(labels, len(counters))],
    )
    yield gauge(
        "fabricd_collective_calls_open",
        "Collective calls waiting for their round",
        [(labels, open_calls)],
    )
    yield gauge(
        "fabricd_collective_held_bytes",
        "Bytes of peers' frames held for collectives not built here yet",
        [(labels, held)],
    )


def algorithm(spec: Spec) -> str:
    """The allreduce algorithm ``spec`` runs, as status names it."""
    name: str = chosen_algorithm(spec).value
    return name
