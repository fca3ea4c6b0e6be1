"""Stall reports as the operator reads them: one row per stalled operation, and its log line.

A send or receive's row is built here (:func:`report`); a collective, stochastic-reduce or
parameter-server call's row by its service, and its log line here too (:func:`call_line`).

The point-to-point engine says what a stalled operation waits for
(:class:`~fabricd.engines.stalls.Stalled`); the peers engine knows whether the peer rank's node
is up and when it was last heard from.  Engines never call each other, so the service joins the
two here, into a JSON-ready row (``fabricctl stalls --json``), and the log line is written from
that row, so the log and ``fabricctl stalls`` always say the same.

A row carries ``job``, ``owner`` and the client's ``uid``: the node withholds it from clients
that may not see the job (:mod:`fabricd.daemon.access`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fabricd.engines.link.peers import PeerInfo
    from fabricd.engines.stalls import Stalled
    from fabricd.wire import Meta

#: ``peer_node_state`` of a peer rank on this daemon's own node
LOCAL = "local"


def report(
    stall: Stalled,
    peers: Mapping[int, PeerInfo],
    *,
    uid: int | None,
    owner: int | None,
) -> Meta:
    """The row of ``stall``; ``peers``: the peers engine's view of every other node, by id;
    ``uid``: the client that posted the operation (``None`` once it left)."""
    state: str | None = None
    silent_for: float | None = None
    if stall.peer_node == stall.node:
        state = LOCAL
    elif stall.peer_node is not None and (info := peers.get(stall.peer_node)) is not None:
        state, silent_for = info.state.value, info.silent_for
    msg = stall.msg
    return {
        "node": stall.node,
        "op": stall.op,
        "kind": "send" if stall.send else "recv",
        "job": msg.job,
        "rank": stall.rank,
        "peer": stall.peer,
        "tag": msg.tag,
        "nbytes": msg.nbytes,
        "dtype": msg.dtype,
        "pending_for": stall.pending_for,
        "waits": stall.waits.value,
        "detail": stall.detail(),
        "peer_joined": stall.peer_joined,
        "peer_posted": stall.peer_posted,
        "peer_node": stall.peer_node,
        "peer_node_state": state,
        "peer_node_silent_for": silent_for,
        "other_tags": list(stall.other_tags),
        "received": stall.received,
        "client_left": uid is None,
        "uid": uid,
        "owner": owner,
    }


def line(row: Meta) -> str:
    """The one log line of a stalled operation, from its :func:`report` row."""
    kind, way = ("send", "to") if row["kind"] == "send" else ("recv", "from")
    head = (
        f"stalled: {kind} of rank {row['rank']} {way} rank {row['peer']}, job {row['job']!r}, "
        f"tag {row['tag']}, {row['nbytes']} B {row['dtype']}, pending {row['pending_for']:.1f}s"
    )
    if row["client_left"]:
        head += " (its client left)"
    return f"{head}; waits for {row['waits']}: {row['detail']}; {peer_words(row)}"


def call_line(row: Meta) -> str:
    """The one log line of a stalled collective, stochastic-reduce or parameter-server call,
    from its service's stall row: the words ``fabricctl stalls`` shows (what is pending, whose
    and for how long; what its round waits for)."""
    head = (
        f"stalled: {row['kind']} of rank {row['rank']}, {row['tag']!r}, job {row['job']!r}, "
        f"{row['nbytes']} B {row['dtype']}, pending {row['pending_for']:.1f}s"
    )
    if row["client_left"]:
        head += " (its client left)"
    return f"{head}; waits for {row['waits']}: {row['detail']}"


def peer_words(row: Meta) -> str:
    """Whether the peer rank joined and posted, and how its node is: for the line and tables."""
    peer = f"rank {row['peer']}"
    if not row["peer_joined"]:
        return f"{peer} has not joined"
    posted = "posted its match" if row["peer_posted"] else "has not posted a match"
    node, state = row["peer_node"], row["peer_node_state"]
    if state == LOCAL:
        return f"{peer} {posted}, on this node"
    if state is None:
        return f"{peer} {posted}, on node {node}"
    heard = row["peer_node_silent_for"]
    last = "never heard from" if heard is None else f"last heard {heard:.1f}s ago"
    return f"{peer} {posted}, on node {node}: {state}, {last}"
