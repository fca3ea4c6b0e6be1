"""``fabricctl stalls``: the operations pending longer than ``stall_after``, and what each
waits for (the daemon's stall rows, joined with the peer node's liveness).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.text import Text

from fabricd.cli.common import (
    ago,
    connected,
    console,
    emit_json,
    folding_table,
    json_option,
    size,
    socket_option,
)

if TYPE_CHECKING:
    from rich.table import Table


@click.command()
@socket_option
@json_option
def stalls(socket_path: str | None, as_json: bool) -> None:
    """Operations pending longer than stall_after, and what each waits for."""
    with connected(socket_path) as client:
        info = client.stalls()
    if as_json:
        emit_json(info)
        return
    rows, hidden = info["stalls"], info.get("hidden", {}).get("stalls", 0)
    after = f"stall_after {info['stall_after']:g} s"
    if not rows and not hidden:
        console.print(f"node {info['node']}: no operation pending longer than {after}")
        return
    console.print(_stall_table(rows, f"stalled on node {info['node']} ({after})", hidden))
    if left_out := info.get("left_out", 0):
        console.print(f"and {left_out} more, pending for less long: not listed")


def _stall_table(rows: list[dict[str, Any]], title: str, hidden: int = 0) -> Table:
    count = f"{len(rows)}, {hidden} hidden" if hidden else f"{len(rows)}"
    columns = ("job", "rank", "op", "peer", "tag", "size", "pending", "waits", "peer node")
    table = folding_table(f"{title}: {count}", (*columns, "what it waits for"), right=("size",))
    for row in rows:
        table.add_row(
            Text(row["job"]),
            str(row["rank"]),
            row["kind"],
            str(row["peer"]),
            str(row["tag"]),
            size(row["nbytes"]),
            ago(row["pending_for"]),
            row["waits"],
            Text(_peer_node(row)),
            Text(row["detail"]),
        )
    return table


def _peer_node(row: dict[str, Any]) -> str:
    """Where the peer rank of a stalled operation lives, and how its node is."""
    node, state = row.get("peer_node"), row.get("peer_node_state")
    if node is None or not row.get("peer_joined"):
        return "not joined"
    if state == "local":
        return "this node"
    if state is None:
        return str(node)
    return f"{node} {state}, heard {ago(row.get('peer_node_silent_for'))} ago"
