"""``fabricctl top``: a live view of one or more daemons, refreshed until Ctrl-C.

Two status samples an interval apart make the rates and latencies
(:func:`fabricd.client.top.view`); this module only connects, samples and draws.  Daemons found
with ``--all`` may stop while we watch and are left out; those named with ``--socket`` must
answer.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from fabricd.cli.common import (
    STATE_STYLE,
    ago,
    connected,
    console,
    emit_json,
    errors,
    figure,
    folding_table,
    json_option,
    size,
)
from fabricd.client import Client, connect
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from rich.table import Table


@click.command()
@click.option(
    "--socket",
    "socket_paths",
    multiple=True,
    metavar="PATH",
    help="a daemon's socket; repeat to watch several (default: as for status)",
)
@click.option("--all", "every", is_flag=True, help="every daemon of this user's local clusters")
@click.option(
    "--interval",
    type=click.FloatRange(0.05, 60),
    default=1.0,
    show_default=True,
    help="seconds between refreshes",
)
@click.option("--once", is_flag=True, help="sample twice, --interval apart, print, and exit")
@json_option
def top(
    socket_paths: tuple[str, ...], every: bool, interval: float, once: bool, as_json: bool
) -> None:
    """Live view of daemons: per-peer throughput, operations per second, p50/p99 latency,
    pending operations and clients.  Ctrl-C ends it.

    Rates are over the last refresh; latencies are of the operations completed in it.
    """
    from fabricd.client.top import view
    from fabricd.daemon.launcher import running_clusters

    if as_json and not once:
        raise click.UsageError("--json prints one sample: add --once")
    paths: list[str | None] = list(socket_paths)
    if every:
        paths += [path for cluster in running_clusters() for path in cluster]
        if not paths:
            errors.print("[red]fabricctl:[/] no local cluster of yours is running")
            sys.exit(1)
    paths = paths or [None]  # the daemon status would find
    # the first ones (--socket, or the one status would find) must answer; --all's may go
    required = len(socket_paths) or int(paths == [None])
    with _clients(paths, optional=len(socket_paths)) as clients:
        try:
            if once:
                views = _with_clusters(_sample_views(clients, interval, view, required))
                if as_json:
                    emit_json({"daemons": views})
                else:
                    console.print(_top_table(views))
                return
            with Live(console=console, auto_refresh=False) as live:
                previous = _statuses(clients, required)
                while True:
                    time.sleep(interval)
                    current = _statuses(clients, required)
                    if all(status is None for status in current):
                        raise FabricError("no daemon answers any more")
                    pairs = zip(previous, current, strict=True)
                    views = _with_clusters([view(b, a, interval) for b, a in pairs if a])
                    live.update(_top_table(views), refresh=True)
                    previous = current
        except KeyboardInterrupt:
            return
        except FabricError as exc:
            errors.print(f"[red]fabricctl:[/] {escape(str(exc))}", soft_wrap=True)
            sys.exit(1)


@contextmanager
def _clients(paths: list[str | None], optional: int) -> Iterator[list[Client]]:
    """A connection to each daemon, all closed at the end.

    The daemons from ``paths[optional:]`` (found by ``--all``) may be stopping while we look:
    one that does not answer is left out with a note; one named by ``--socket`` must answer.
    """
    with ExitStack() as stack:
        clients = []
        for i, path in enumerate(paths):
            if i < optional or path is None:
                clients.append(stack.enter_context(connected(path)))
                continue
            try:
                clients.append(stack.enter_context(connect(socket_path=path)))
            except FabricError as exc:
                errors.print(f"left out {escape(path)}: {escape(str(exc))}", soft_wrap=True)
        if not clients:
            errors.print("[red]fabricctl:[/] no daemon answers")
            sys.exit(1)
        yield clients


def _statuses(clients: list[Client], required: int) -> list[dict[str, Any] | None]:
    """Each daemon's status; None for one that stopped answering (a cluster stopping).

    Raises:
        FabricError: one of the first ``required`` (named by ``--socket``) does not answer.
    """
    statuses: list[dict[str, Any] | None] = []
    for i, client in enumerate(clients):
        try:
            statuses.append(client.status())
        except FabricError:
            if i < required:
                raise
            statuses.append(None)
    return statuses


def _sample_views(
    clients: list[Client], interval: float, view: Callable[..., dict[str, Any]], required: int
) -> list[dict[str, Any]]:
    before = _statuses(clients, required)
    started = time.monotonic()
    time.sleep(interval)
    after = _statuses(clients, required)
    seconds = time.monotonic() - started
    views = [view(b, a, seconds) for b, a in zip(before, after, strict=True) if a is not None]
    if not views:
        raise FabricError("no daemon answered")
    return views


def _with_clusters(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``views``, each with the local cluster its daemon belongs to (``cluster``: the name
    ``local-cluster`` printed, None for a daemon of no local cluster): ``--all`` shows every
    local cluster of the user, and each numbers its nodes from 0."""
    from fabricd.daemon.launcher import cluster_name

    return [{**v, "cluster": cluster_name(v["socket"]) if v.get("socket") else None} for v in views]


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e6:.0f} µs" if value < 1e-3 else ago(value)


def _available(rate: float | None) -> str:
    """A peer's available bandwidth one way, as the network monitor knows it."""
    return "-" if rate is None else size(rate) + "/s"


def _top_table(views: list[dict[str, Any]]) -> Table:
    columns: tuple[str, ...] = ("node", "clients", "pending", "ops/s", "p50", "p99", "peer")
    columns += ("sent/s", "recv/s", "peer up", "peer down")
    clustered = any(v.get("cluster") for v in views)
    if clustered:  # which local cluster a row is of: each numbers its nodes from 0
        columns = ("cluster", *columns)
    right = {
        "clients",
        "pending",
        "ops/s",
        "p50",
        "p99",
        "sent/s",
        "recv/s",
        "peer up",
        "peer down",
    }
    table = folding_table("fabricd top", columns, right=right)
    fabric = None
    for v in views:
        # daemons of one fabric share their socket's directory (local clusters): a line
        # between fabrics
        if fabric is not None and os.path.dirname(v.get("socket", "")) != fabric:
            table.add_section()
        fabric = os.path.dirname(v.get("socket", ""))
        node = str(v["node"]) if v["state"] == "serving" else f"{v['node']} {v['state']}"
        cells = [node, str(v["clients"]), str(v["pending_ops"]), figure(v["ops_per_second"])]
        if clustered:
            cells.insert(0, v.get("cluster") or "-")
        cells += [_seconds(v["latency_p50"]), _seconds(v["latency_p99"])]
        for i, peer in enumerate(v["peers"] or [None]):
            row = cells if i == 0 else [""] * len(cells)
            if peer is None:
                table.add_row(*row, "-", "-", "-", "-", "-")
                continue
            table.add_row(
                *row,
                Text(f"{peer['peer']} {peer['state']}", style=STATE_STYLE.get(peer["state"], "")),
                size(peer["sent_bytes_per_second"]) + "/s",
                size(peer["received_bytes_per_second"]) + "/s",
                _available(peer.get("up_available")),
                _available(peer.get("down_available")),
            )
    return table
