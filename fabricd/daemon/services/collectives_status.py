"""What the collective service shows of its collectives: a status row per collective, a stall
row per call open longer than ``stall_after``, and the service's Prometheus series.

Split from :mod:`~fabricd.daemon.services.collectives` (as ``stochastic_status.py`` from
``stochastic.py``): the service picks the collectives and calls, these say what a row holds.
Nothing here changes the engine or the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.daemon.metrics import counter, gauge
from fabricd.engines.collectives.algorithms import Algorithm

if TYPE_CHECKING:
    from collections.abc import Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.metrics import OperationStats
    from fabricd.daemon.services.jobs import OpenCall
    from fabricd.engines.collectives.persistent import Collective, Spec
    from fabricd.wire import Meta


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
        "mean_active": round(c.sum_active / c.rounds, 2) if c.rounds else None,
        "broken": coll.broken[1] if coll.broken else None,
    }


def stall_row(
    whose: Meta, node: int, token: int, call: OpenCall, coll: Collective, late: float
) -> Meta:
    """Call ``token``, open ``late`` seconds: what its collective's round waits for."""
    waits, detail, peer_node = coll.waits()
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
    chosen = Algorithm.RING if spec.ring else Algorithm.RECURSIVE_DOUBLING
    name: str = (Algorithm.DIRECT if spec.direct else chosen).value
    return name
