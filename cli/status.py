"""``fabricctl status`` and ``fabricctl peers``: the daemon's state and its view of the other
daemons, from one ``status`` query.

The engine services' rows (collectives, stochastic reduces, parameter-server shards and
workers) show as tables only where the node has some; a field a daemon leaves out shows "-",
so a daemon of another release never breaks the command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.text import Text

from fabricd.cli.common import (
    STATE_STYLE,
    ago,
    connected,
    console,
    emit_json,
    figure,
    folding_table,
    json_option,
    size,
    socket_option,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.table import Table


@click.command()
@socket_option
@json_option
def status(socket_path: str | None, as_json: bool) -> None:
    """The daemon's state: identity, peers, clients, ranks and counters."""
    with connected(socket_path) as client:
        info = client.status()
    if as_json:
        emit_json(info)
        return
    console.print(
        f"[bold]fabricd node {info['node']}[/] of {info['nodes']} — {info['state']}, "
        f"up {ago(info['uptime'])}\n  peers on {escape(info['address'])} "
        f"({info['transport']}), clients on {escape(info['socket'])}\n"
        f"  incarnation {info['incarnation']}, "
        f"protocol v{info['version']}, {info['pending_ops']} operations pending, "
        f"{info.get('segments', 0)} segments mapping {info.get('mapped_bytes', 0)} B\n"
        f"  metrics {escape(_metrics_line(info))}",
        soft_wrap=True,  # an address or a path folded onto two lines cannot be pasted
    )
    if "membership" in info:  # a daemon of an earlier release has no such line
        console.print(_membership_line(info["membership"]), soft_wrap=True)
    if "eager_pool_bytes" in info:  # a daemon without the eager path has no such line
        console.print(_messages_line(info), soft_wrap=True)
    if info["peers"]:
        console.print(_peer_table(info["peers"]))
    hidden = info.get("hidden", {})  # rows of other users' jobs the daemon withheld
    console.print(
        _rows_table(
            "clients",
            info["clients"],
            ("id", "pid", "uid", "job", "rank", "segments", "mapped_bytes"),
            hidden.get("clients", 0),
        )
    )
    console.print(
        _rows_table(
            "ranks",
            info.get("ranks", []),
            ("job", "rank", "size", "node", "owner"),
            hidden.get("ranks", 0),
        )
    )
    for key, columns in _ENGINE_TABLES:  # shown only where the node has rows of them
        if info.get(key) or hidden.get(key):
            title = key.replace("_", " ")
            console.print(_rows_table(title, info.get(key, []), columns, hidden.get(key, 0)))
    if any(hidden.values()):
        console.print(
            "hidden: rows of other users' jobs (root, the daemon's user and admin_gids see them)"
        )
    counters = ", ".join(f"{k} {v}" for k, v in sorted(info["counters"].items()))
    console.print(f"counters: {counters}")
    dials = sorted((int(n), k) for n, k in info.get("dial_failures", {}).items() if k)
    if dials:
        failures = ", ".join(f"node {n} {k}" for n, k in dials)
        console.print(f"failed dials: {failures}", soft_wrap=True)
    if info.get("services"):
        console.print(f"services: {escape(', '.join(info['services']))}", soft_wrap=True)


def _messages_line(info: dict[str, Any]) -> str:
    """How remote messages travel here: those waiting for their receive, the eager pool's use
    against its bound, and the eager and RTR counters (docs/protocol.md, §3.4).

    The pool and RTR figures are what an operator reads a flood or a misfit ``eager_limit``
    from; the same numbers are in the counters line, but scattered among forty others.
    """
    n = info.get("counters", {})
    pool, limit = info["eager_pool_bytes"], info.get("eager_pool_limit", 0)
    return (
        f"messages: {info.get('unexpected_messages', 0)} waiting for their receive; "
        f"eager pool {size(pool)} held of {size(limit)}\n"
        f"  eager: {n.get('eager_sent', 0)} sent, {n.get('eager_no_credit', 0)} sent as RTS "
        f"(no credit), {n.get('eager_pool_full', 0)} taken as RTS here (pool full); "
        f"RTR: {n.get('rtr_sent', 0)} sent, {n.get('rtr_answered', 0)} answered, "
        f"{n.get('rtr_dropped', 0)} dropped"
    )


def _membership_line(membership: dict[str, Any]) -> Text:
    """Where the node list comes from; from etcd, this node's name and whether etcd answers
    (since when: a fabric cut off from etcd runs on its last view, docs/operations.md)."""
    if membership.get("source") != "etcd":
        return Text(f"membership: {membership.get('source', '-')} (the nodes setting)")
    state = membership.get("state", "-")
    line = Text(f"membership: etcd, {membership.get('name', '-')} in slot ")
    line.append(f"{membership.get('slot', '-')} of {membership.get('max_nodes', '-')}, ")
    line.append(state, style="green" if state == "connected" else "bold red")
    line.append(f" for {ago(membership.get('since', 0.0))}")
    if membership.get("error"):
        line.append(f" ({membership['error']}; running on the last view)")
    line.append(f", {len(membership.get('registered', {})) + 1} nodes registered")
    return line


def _metrics_line(info: dict[str, Any]) -> str:
    """Where the daemon serves its metrics, or why it does not."""
    if info.get("metrics_url"):
        return f"at {info['metrics_url']}"
    return info.get("metrics_error") or "off (metrics_address is empty)"


#: a column of a status table: a field of the row, or (heading, what to show of the row)
Column = str | tuple[str, "Callable[[dict[str, Any]], str]"]


def _saved(sent: str, dense: str) -> Callable[[dict[str, Any]], str]:
    """A cell with the bytes a row's ``sent`` field counts, against its ``dense`` field (what
    they would have been unfiltered, whole models), and the share that saved."""

    def cell(row: dict[str, Any]) -> str:
        if row.get(sent) is None or row.get(dense) is None:
            return "-"
        done, whole = row[sent], row[dense]
        saved = f", {figure(100 * (1 - done / whole))}% saved" if whole else ""
        return f"{size(done)} of {size(whole)}{saved}"

    return cell


def _share(part: str, whole: str, *, complement: bool = False) -> Callable[[dict[str, Any]], str]:
    """A cell with a row's ``part`` field as a percentage of its ``whole`` field (``complement``:
    the rest of it), "-" before there is a whole."""

    def cell(row: dict[str, Any]) -> str:
        if not row.get(whole) or row.get(part) is None:
            return "-"
        share = row[part] / row[whole]
        return f"{figure(100 * (1 - share if complement else share))}%"

    return cell


def _latency(row: dict[str, Any]) -> str:
    """A scheduled shard's mean and largest time from a push's READY to its scheduler's
    decision (MLfabric); "-" for a shard applied in arrival order."""
    scheduler = row.get("scheduler")
    if not isinstance(scheduler, dict):
        return "-"
    return f"{scheduler['latency_mean'] * 1e3:.1f}/{scheduler['latency_max'] * 1e3:.1f} ms"


#: the engine services' status rows ``fabricctl status`` shows as tables, and their columns;
#: the parameter server's byte columns say how much its filters and deltas saved, and its
#: workers' filter columns the share of gradient elements each filter selected for dropping
#: (G-SMP, G-RP) and the share dropped (selected by every filter on)
_ENGINE_TABLES: tuple[tuple[str, tuple[Column, ...]], ...] = (
    (
        "network",
        (
            "node",
            ("up", lambda row: _rate(row, "up")),
            ("down", lambda row: _rate(row, "down")),
            ("rtt", lambda row: ago(row["rtt"]) if row.get("rtt") else "-"),
            "source",
            ("age", lambda row: ago(row.get("age"))),
            ("stale", lambda row: "stale" if row.get("stale") else ""),
        ),
    ),
    (
        "collectives",
        ("job", "name", "what", "algorithm", "round", "nodes", "lost", "waiting", "mean_active"),
    ),
    (
        "stochastic_reduces",
        ("job", "name", "rank", "graph", "sync", "round", "used", "torn", "waiting"),
    ),
    (
        "partial_exchanges",
        (
            "job",
            "name",
            "rank",
            "clock",
            "partitions",
            "slowest",
            ("held", lambda row: "gate" if row.get("held") else ""),
            ("B/round", lambda row: _bytes(row.get("bytes_per_round"))),
            "flushes",
            ("lost", lambda row: ",".join(map(str, row.get("lost", []))) or "-"),
            ("gone", lambda row: ",".join(map(str, row.get("gone", []))) or "-"),
        ),
    ),
    (
        "ps_servers",
        (
            "job",
            "name",
            "shard",
            "role",
            "epoch",
            "consistency",
            "version",
            "applied",
            "pushes",
            ("push bytes", _saved("push_bytes", "push_dense_bytes")),
            ("pull bytes", _saved("pull_bytes", "pull_dense_bytes")),
            ("dropped tau_max", lambda row: _field(row, "dropped_delay")),
            ("dropped lost", lambda row: _field(row, "dropped_lost")),
            ("dropped sched", lambda row: _field(row, "dropped_scheduled")),
            ("sched latency", _latency),
            ("held pulls", lambda row: _field(row, "held_pulls")),
        ),
    ),
    (
        "ps_workers",
        (
            "job",
            "name",
            "rank",
            "clock",
            "versions",
            ("push bytes", _saved("push_bytes", "push_dense_bytes")),
            ("pull bytes", _saved("pull_bytes", "pull_dense_bytes")),
            ("G-SMP", _share("smp_selected", "considered")),
            ("G-RP", _share("rp_selected", "considered")),
            ("dropped", _share("pushed", "considered", complement=True)),
            ("dropped tau_max", lambda row: _field(row, "delay_dropped")),
        ),
    ),
)


def _rate(row: dict[str, Any], key: str) -> str:
    """A bandwidth cell (bytes/s), "-" where the daemon left it out."""
    return "-" if row.get(key) is None else f"{size(row[key])}/s"


def _bytes(value: float | None) -> str:
    """A byte count as a cell: "-" where the daemon left it out."""
    return "-" if value is None else size(round(value))


def _field(row: dict[str, Any], key: str) -> str:
    """A row's field as a cell: "-" where the daemon left it out."""
    return "-" if row.get(key) is None else str(row[key])


def _rows_table(
    title: str, rows: list[dict[str, Any]], columns: tuple[Column, ...], hidden: int = 0
) -> Table:
    """A table of ``rows`` (dicts from the daemon's status); a field it leaves out shows "-".

    The daemon's fields change between releases: a missing one must not break the command.
    ``hidden``: rows of other users' jobs the daemon withheld (the title says so).
    """
    count = f"{len(rows)}, {hidden} hidden" if hidden else f"{len(rows)}"
    table = folding_table(
        f"{title} ({count})", [c if isinstance(c, str) else c[0] for c in columns]
    )
    for row in rows:
        table.add_row(*(Text(_field(row, c) if isinstance(c, str) else c[1](row)) for c in columns))
    return table


@click.command()
@socket_option
@json_option
def peers(socket_path: str | None, as_json: bool) -> None:
    """The other daemons and how this one sees them (up, suspect, down, connecting)."""
    with connected(socket_path) as client:
        rows = client.status()["peers"]
    if as_json:
        emit_json(rows)
    elif not rows:
        console.print("this daemon is a fabric of one: no peers configured")
    else:
        console.print(_peer_table(rows))


def _peer_table(peers: list[dict[str, Any]]) -> Table:
    columns = ("node", "address", "state", "for", "last heard", "links", "sent", "received")
    table = folding_table("peers", columns, right=("sent", "received"))
    for peer in peers:
        style = STATE_STYLE.get(peer["state"], "")
        links = ",".join(ch for ch, up in peer["links"].items() if up) or "-"
        name = f" ({peer['name']})" if peer.get("name") else ""  # membership from etcd
        table.add_row(
            str(peer["node"]) + name,
            Text(peer["address"] or "(left)"),
            Text(peer["state"], style=style),
            ago(peer["state_for"]),
            ago(peer["silent_for"]),
            links,
            size(peer["bytes_sent"]),
            size(peer["bytes_received"]),
        )
    return table
