"""The rows the stochastic service shows: one per reducer in ``status``, one per late call in
``fabricctl stalls`` and in the log line it writes once for each (the service picks which;
these say what a row holds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabricd.daemon.services.jobs import OpenCall
    from fabricd.engines.stochastic.notify_ack import Reducer
    from fabricd.wire import Meta


def reducer_row(job: str, owner: int | None, name: str, rank: int, reducer: Reducer) -> Meta:
    """A reducer's status row: its graph, its rounds, what it used and what it waits for."""
    s = reducer.statistics()
    return {
        "job": job,
        "owner": owner,
        "name": name,
        "rank": rank,
        "graph": reducer.graph.kind,
        "sync": reducer.sync.value,
        "in_degree": len(reducer.sources),
        "out_degree": len(reducer.targets),
        "round": s.round,
        "reduces": s.reduces,
        "used": list(s.used),
        "torn": s.torn,
        "stale": s.stale,
        "notifies": s.notifies,
        "acks": s.acks,
        "duplicates": s.duplicates,
        "resent": s.resent,
        "waiting": list(s.waiting),
        "broken": s.broken,
    }


def stall_row(
    rank_key: tuple[str, str, int],
    owner: int | None,
    node: int,
    reducer: Reducer,
    call: OpenCall,
    now: float,
) -> Meta:
    """Rank ``rank_key``'s open ``call`` (of a reduce of a job ``owner`` owns): whose NOTIFY,
    ACK or barrier step its round waits for."""
    job, name, rank = rank_key
    waiting = reducer.waiting_for()
    return {
        "job": job,
        "owner": owner,
        "uid": call.session.conn.credentials.uid,
        "node": node,
        "op": f"{name}@{rank}",
        "kind": f"stochastic_reduce ({reducer.sync.value})",
        "rank": rank,
        "peer": "-",
        "tag": name,
        "nbytes": call.nbytes,
        "dtype": str(reducer.dtype),
        "pending_for": now - call.started,
        "waits": "peer" if waiting else "round",
        "detail": (
            f"round {reducer.executor.round} of {reducer.graph.kind} graph waits "
            f"for {', '.join(waiting[:8]) or 'the round before to end'}"
        ),
        "peer_joined": True,
        "peer_node": None,
        "peer_node_state": None,
        "client_left": False,
    }
