"""``fabricctl stalls``: the operations pending longer than ``stall_after``, and what each
waits for (the daemon's stall rows, joined with the peer node's liveness).
"""

from __future__ import annotations

from typing import Any

import click
from rich.padding import Padding
from rich.text import Text

from fabricd.cli.common import ago, connected, console, emit_json, json_option, size, socket_option


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
    count = f"{len(rows)}, {hidden} hidden" if hidden else f"{len(rows)}"
    console.print(f"stalled on node {info['node']} ({after}): {count}")
    for row in rows:
        for line in _stall_lines(row):
            console.print(line)
    if left_out := info.get("left_out", 0):
        console.print(f"and {left_out} more, pending for less long: not listed")


def _stall_lines(row: dict[str, Any]) -> list[Text | Padding]:
    """One stalled operation for people: a line saying what is pending, whose and for how
    long, then, indented, what it waits for and how the peer's node is.

    The choice: lines, not a table.  As a table of ten columns, one operation folded into about
    twenty lines at 80 columns, the explanation a few characters a line; as lines, it takes
    three or four, and each folds between words.
    """
    what = Text(f"{row['kind']} of rank {row['rank']}")
    if row["peer"] == "-":  # a collective or a reduce: named by its tag, no one peer rank
        what.append(f", {row['tag']!r}")
    else:
        way = "to" if row["kind"] == "send" else "from"
        what.append(f" {way} rank {row['peer']}, tag {row['tag']}")
    what.append(f", job {row['job']!r}, {size(row['nbytes'])}, pending {ago(row['pending_for'])}")
    if row.get("client_left"):
        what.append(" (its client left)")
    lines: list[Text | Padding] = [what]
    lines.append(
        Padding(Text(f"waits for {row['waits']}: {row['detail']}"), (0, 0, 0, 2), expand=False)
    )
    if row["peer"] != "-" or row.get("peer_node") is not None:
        lines.append(Padding(Text(f"peer node: {_peer_node(row)}"), (0, 0, 0, 2), expand=False))
    return lines


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
