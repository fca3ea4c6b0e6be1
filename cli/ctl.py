"""``fabricctl``: control and watch fabricd.

Each command parses its arguments, calls one function of the client library or the daemon
package, and prints the result for humans (rich tables) or, with ``--json``, for scripts.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fabricd.cli.bench import bench as bench_group
from fabricd.cli.daemon import config_flags, load_from_cli
from fabricd.cli.daemon import main as daemon_main
from fabricd.cli.graph import graph as graph_command
from fabricd.client import Client, connect
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator
    from types import FrameType

    from fabricd.client.collectives import Mode
    from fabricd.demo.training import DemoResult, Report, Settings

# no emoji codes: ":1234:" in an IPv6 address or a path must print as written
console = Console(emoji=False)
errors = Console(stderr=True, emoji=False)

json_option = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
socket_option = click.option(
    "--socket",
    "socket_path",
    envvar="FABRICD_SOCKET",
    metavar="PATH",
    help=(
        "the daemon's socket (default: $FABRICD_SOCKET, else the first that answers of "
        "$XDG_RUNTIME_DIR/fabricd/fabricd.sock and /run/fabricd/fabricd.sock)"
    ),
)


@contextmanager
def _client(socket_path: str | None) -> Iterator[Client]:
    try:
        with connect(socket_path=socket_path) as client:
            yield client
    except FabricError as exc:
        errors.print(f"[red]fabricctl:[/] {exc}")
        sys.exit(1)


def _emit_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True))


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


_STATE_STYLE = {"up": "green", "suspect": "yellow", "down": "red", "connecting": "dim"}


def _table(title: str, columns: Collection[str], right: Collection[str] = ()) -> Table:
    """A table whose cells fold onto more lines where the console is narrow, never cut short.

    rich's default cuts a cell with an ellipsis; an address or a path cut short is useless.
    Cells are given as :class:`~rich.text.Text`, so that no ``[...]`` in a value (an IPv6
    address, a job name) is taken for markup.
    """
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column in right else "left")
    return table


def _peer_table(peers: list[dict[str, Any]]) -> Table:
    columns = ("node", "address", "state", "for", "last heard", "links", "sent", "received")
    table = _table("peers", columns, right=("sent", "received"))
    for peer in peers:
        style = _STATE_STYLE.get(peer["state"], "")
        links = ",".join(ch for ch, up in peer["links"].items() if up) or "-"
        table.add_row(
            str(peer["node"]),
            Text(peer["address"]),
            Text(peer["state"], style=style),
            _ago(peer["state_for"]),
            _ago(peer["silent_for"]),
            links,
            _size(peer["bytes_sent"]),
            _size(peer["bytes_received"]),
        )
    return table


def _count(n: int, one: str, many: str) -> str:
    """``1 daemon``, ``3 daemons``."""
    return f"{n} {one if n == 1 else many}"


def _figure(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures, never in exponent form: 0.0123, 1.23, 123.

    A fixed number of decimals prints a small ratio as 0.00, which says nothing.
    """
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fabricd")
def main() -> None:
    """Control and watch the fabricd daemon of this node."""


main.add_command(daemon_main, "daemon")
main.add_command(bench_group, "bench")
main.add_command(graph_command, "graph")


@main.command()
@socket_option
@json_option
def status(socket_path: str | None, as_json: bool) -> None:
    """The daemon's state: identity, peers, clients, ranks and counters."""
    with _client(socket_path) as client:
        info = client.status()
    if as_json:
        _emit_json(info)
        return
    console.print(
        f"[bold]fabricd node {info['node']}[/] of {info['nodes']} — {info['state']}, "
        f"up {_ago(info['uptime'])}\n  peers on {escape(info['address'])} "
        f"({info['transport']}), clients on {escape(info['socket'])}\n"
        f"  incarnation {info['incarnation']}, "
        f"protocol v{info['version']}, {info['pending_ops']} operations pending, "
        f"{info.get('segments', 0)} segments mapping {info.get('mapped_bytes', 0)} B\n"
        f"  metrics {escape(_metrics_line(info))}",
        soft_wrap=True,  # an address or a path folded onto two lines cannot be pasted
    )
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
        f"eager pool {_size(pool)} held of {_size(limit)}\n"
        f"  eager: {n.get('eager_sent', 0)} sent, {n.get('eager_no_credit', 0)} sent as RTS "
        f"(no credit), {n.get('eager_pool_full', 0)} taken as RTS here (pool full); "
        f"RTR: {n.get('rtr_sent', 0)} sent, {n.get('rtr_answered', 0)} answered, "
        f"{n.get('rtr_dropped', 0)} dropped"
    )


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
        saved = f", {_figure(100 * (1 - done / whole))}% saved" if whole else ""
        return f"{_size(done)} of {_size(whole)}{saved}"

    return cell


def _share(part: str, whole: str, *, complement: bool = False) -> Callable[[dict[str, Any]], str]:
    """A cell with a row's ``part`` field as a percentage of its ``whole`` field (``complement``:
    the rest of it), "-" before there is a whole."""

    def cell(row: dict[str, Any]) -> str:
        if not row.get(whole) or row.get(part) is None:
            return "-"
        share = row[part] / row[whole]
        return f"{_figure(100 * (1 - share if complement else share))}%"

    return cell


#: the engine services' status rows ``fabricctl status`` shows as tables, and their columns;
#: the parameter server's byte columns say how much its filters and deltas saved, and its
#: workers' filter columns the share of gradient elements each filter selected for dropping
#: (G-SMP, G-RP) and the share dropped (selected by every filter on)
_ENGINE_TABLES: tuple[tuple[str, tuple[Column, ...]], ...] = (
    ("collectives", ("job", "name", "what", "round", "nodes", "lost", "waiting", "mean_active")),
    (
        "stochastic_reduces",
        ("job", "name", "rank", "graph", "sync", "round", "used", "torn", "waiting"),
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
    table = _table(f"{title} ({count})", [c if isinstance(c, str) else c[0] for c in columns])
    for row in rows:
        table.add_row(*(Text(_field(row, c) if isinstance(c, str) else c[1](row)) for c in columns))
    return table


@main.command()
@socket_option
@json_option
def peers(socket_path: str | None, as_json: bool) -> None:
    """The other daemons and how this one sees them (up, suspect, down, connecting)."""
    with _client(socket_path) as client:
        rows = client.status()["peers"]
    if as_json:
        _emit_json(rows)
    elif not rows:
        console.print("this daemon is a fabric of one: no peers configured")
    else:
        console.print(_peer_table(rows))


@main.command()
@socket_option
@json_option
def stalls(socket_path: str | None, as_json: bool) -> None:
    """Operations pending longer than stall_after, and what each waits for."""
    with _client(socket_path) as client:
        info = client.stalls()
    if as_json:
        _emit_json(info)
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
    table = _table(f"{title}: {count}", (*columns, "what it waits for"), right=("size",))
    for row in rows:
        table.add_row(
            Text(row["job"]),
            str(row["rank"]),
            row["kind"],
            str(row["peer"]),
            str(row["tag"]),
            _size(row["nbytes"]),
            _ago(row["pending_for"]),
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
    return f"{node} {state}, heard {_ago(row.get('peer_node_silent_for'))} ago"


@main.command()
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
                views = _sample_views(clients, interval, view, required)
                if as_json:
                    _emit_json({"daemons": views})
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
                    views = [view(b, a, interval) for b, a in pairs if a is not None]
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
                clients.append(stack.enter_context(_client(path)))
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


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e6:.0f} µs" if value < 1e-3 else _ago(value)


def _top_table(views: list[dict[str, Any]]) -> Table:
    columns = ("node", "clients", "pending", "ops/s", "p50", "p99", "peer", "sent/s", "recv/s")
    table = _table("fabricd top", columns, right=columns[1:6] + columns[7:])
    fabric = None
    for v in views:
        # daemons of one fabric share their socket's directory (local clusters); a line
        # between fabrics, since each numbers its nodes from 0
        if fabric is not None and os.path.dirname(v.get("socket", "")) != fabric:
            table.add_section()
        fabric = os.path.dirname(v.get("socket", ""))
        node = str(v["node"]) if v["state"] == "serving" else f"{v['node']} {v['state']}"
        cells = [node, str(v["clients"]), str(v["pending_ops"]), _figure(v["ops_per_second"])]
        cells += [_seconds(v["latency_p50"]), _seconds(v["latency_p99"])]
        for i, peer in enumerate(v["peers"] or [None]):
            row = cells if i == 0 else [""] * len(cells)
            if peer is None:
                table.add_row(*row, "-", "-", "-")
                continue
            table.add_row(
                *row,
                Text(f"{peer['peer']} {peer['state']}", style=_STATE_STYLE.get(peer["state"], "")),
                _size(peer["sent_bytes_per_second"]) + "/s",
                _size(peer["received_bytes_per_second"]) + "/s",
            )
    return table


@main.group()
def config() -> None:
    """Configuration."""


@config.command("show")
@socket_option
@json_option
@functools.partial(config_flags, exclude=("socket",))
def config_show(
    socket_path: str | None, as_json: bool, config_path: str | None, **flags: Any
) -> None:
    """Each effective setting and where it came from.

    Without --config or setting flags this asks the running daemon (the one at --socket); with
    them it shows what a daemon started now with that file, this environment and those flags
    would use.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    if config_path is None and not given:  # --socket alone: ask that daemon
        with _client(socket_path) as client:
            described = client.config()
        origin = "the running daemon"
    else:
        if socket_path is not None:  # with a file or flags, --socket is the setting itself
            given["socket"] = socket_path
        try:
            described = load_from_cli(config_path, given).describe()
        except FabricError as exc:
            errors.print(f"[red]fabricctl:[/] {escape(str(exc))}", soft_wrap=True)
            sys.exit(1)
        origin = config_path or "defaults, environment and flags"
    if as_json:
        _emit_json(described)
        return
    table = _table(f"effective configuration ({escape(origin)})", ("key", "value", "source"))
    for key, entry in described.items():
        source = entry["source"]
        table.add_row(
            key,
            Text(json.dumps(entry["value"])),
            Text(source, style="dim" if source == "default" else ""),
        )
    console.print(table)


class _Stop(Exception):
    """SIGTERM, SIGINT or SIGHUP arrived."""


class _StopOnce:
    """The stop signals' handler: the first raises :class:`_Stop`, later ones change nothing.

    A second Ctrl-C (or SIGTERM, SIGHUP) while the daemons drain must not cut the stop short:
    the launcher would die of it, its daemons with it (SIGKILL), and its directory would stay.
    """

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.stopping = True
            raise _Stop


def _stop_signals() -> list[signal.Signals]:
    """The signals that stop a local cluster cleanly.

    SIGINT explicitly, because a shell that starts us in the background sets it to ignored.
    SIGHUP (the terminal closed) unless it is ignored: ``nohup`` asks the cluster to outlive
    the terminal.
    """
    stop = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stop.append(signal.SIGHUP)
    return stop


def _exit_description(status: int) -> str:
    """A process's exit status for people: ``exit 0``, ``killed by SIGKILL``."""
    if status >= 0:
        return f"exit {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


@main.command("local-cluster")
@click.argument("nodes", type=click.IntRange(1, 64), required=False)
@click.option("--log-dir", type=click.Path(file_okay=False), help="keep daemon logs here")
@click.option(
    "--fast-liveness/--default-liveness",
    default=True,
    show_default=True,
    help="detect dead peers within 1 s (development) or use the config defaults",
)
@click.option(
    "--clean",
    is_flag=True,
    help="only remove what killed local clusters left in the temporary directory",
)
@json_option
def local_cluster(
    nodes: int | None, log_dir: str | None, fast_liveness: bool, clean: bool, as_json: bool
) -> None:
    """Start NODES daemons on loopback until Ctrl-C, SIGTERM or SIGHUP, then stop them cleanly.

    The daemons die with this command even when it is killed (SIGKILL); its temporary
    directory (secret, sockets, logs) then stays until the next local-cluster, or
    local-cluster --clean, removes it.
    """
    from pathlib import Path

    from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster, remove_leftovers

    if clean:
        if nodes is not None:
            raise click.UsageError("--clean starts no cluster: leave out NODES")
        removed = remove_leftovers()
        if as_json:
            _emit_json({"removed": [str(path) for path in removed]})
        else:
            console.print(
                f"removed {_count(len(removed), 'directory', 'directories')} left by killed "
                "local clusters" + "".join(f"\n  {escape(str(path))}" for path in removed),
                soft_wrap=True,
            )
        return
    if nodes is None:
        raise click.UsageError("missing NODES: how many daemons to start")
    for path in remove_leftovers():
        errors.print(f"removed {escape(str(path))}, left by a killed local cluster", soft_wrap=True)
    cluster = LocalCluster(
        nodes,
        settings=dict(FAST_LIVENESS) if fast_liveness else {},
        log_dir=Path(log_dir) if log_dir else None,
    )
    stop = _StopOnce()
    previous = {sig: signal.signal(sig, stop) for sig in _stop_signals()}
    failure: FabricError | None = None
    try:
        try:
            cluster.start()
            cluster.wait_connected()
            _announce_cluster(cluster, as_json)
            while True:
                for node in cluster.nodes:
                    assert node.process is not None
                    if node.process.poll() is not None:
                        raise FabricError(
                            f"node {node.node} exited "
                            f"({_exit_description(node.process.returncode)}):\n" + node.log_tail()
                        )
                time.sleep(0.2)
        except _Stop:
            pass
        except FabricError as exc:
            failure = exc
    finally:  # whatever ended the wait (an error writing the output too), stop the daemons
        stop.stopping = True
        try:
            statuses = cluster.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if failure is not None:
        errors.print(f"[red]fabricctl:[/] {escape(str(failure))}", soft_wrap=True)
        sys.exit(1)
    if not as_json:
        # after SIGHUP the terminal may be gone; the daemons are stopped either way
        with suppress(OSError):
            console.print(
                f"stopped {_count(len(statuses), 'daemon', 'daemons')}: "
                + ", ".join(
                    f"node {node} {_exit_description(status)}"
                    for node, status in sorted(statuses.items())
                )
            )


def _announce_cluster(cluster: Any, as_json: bool) -> None:
    if as_json:
        for node in cluster.nodes:
            _emit_json(
                {
                    "node": node.node,
                    "socket": node.socket_path,
                    "address": node.address,
                    "pid": node.pid,
                    "log": str(node.log_path),
                    "metrics_url": node.metrics_url,
                }
            )
        sys.stdout.flush()
        return
    table = _table(
        f"local fabric of {len(cluster.nodes)} nodes (config {escape(str(cluster.config_path))})",
        ("node", "address", "pid", "socket", "metrics"),
    )
    for node in cluster.nodes:
        table.add_row(
            str(node.node),
            Text(node.address),
            str(node.pid),
            Text(node.socket_path),
            Text(node.metrics_url or "-"),
        )
    console.print(table)
    console.print(
        "watch them with:  [bold]fabricctl top --all[/]\n"
        "connect a client to node N with:  "
        f"[bold]FABRICD_SOCKET={escape(cluster.nodes[0].socket_path)} RANK=0 WORLD_SIZE=…[/] "
        "[bold]python train.py[/]\n"
        "Ctrl-C (or SIGTERM, or closing the terminal) stops every daemon and removes the "
        "temporary files.",
        soft_wrap=True,  # a path folded onto two lines cannot be pasted
    )


_DEMO = "fabricd-demo.png"


@main.command()
@click.option(
    "--nodes", type=click.IntRange(1, 16), default=4, show_default=True, help="daemons on loopback"
)
@click.option(
    "--ranks-per-node",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="training processes per daemon",
)
@click.option(
    "--delay-ms",
    type=click.FloatRange(0, 10_000),
    default=200.0,
    show_default=True,
    help="how long one random rank sleeps before its allreduce, at every step",
)
@click.option(
    "--steps",
    type=click.IntRange(1, 100_000),
    default=80,
    show_default=True,
    help="allreduce rounds per mode",
)
@click.option(
    "--modes",
    default="sync,solo,majority",
    show_default=True,
    help="the allreduce modes to train with, one run each, comma-separated",
)
@click.option(
    "--sync-every",
    type=click.IntRange(1, 100_000),
    default=10,
    show_default=True,
    help="solo, majority: average the replicas every this many steps",
)
@click.option("--dim", type=click.IntRange(1, 1 << 20), default=8192, show_default=True)
@click.option(
    "--batch",
    type=click.IntRange(2, 1 << 20),
    default=2048,
    show_default=True,
    help="points per step in all, split over the ranks",
)
@click.option(
    "--target",
    type=click.FloatRange(0, min_open=True),
    default=4.0,
    show_default=True,
    help="the validation loss to reach, as a multiple of the noise variance",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"write validation loss against time as a PNG (default without --json: {_DEMO}; "
    "needs matplotlib, the demo extra)",
)
@click.option(
    "--ring",
    is_flag=True,
    help="the ring demo instead: a tensor around the daemons, every byte verified",
)
@click.option(
    "--size-mib",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="--ring: tensor size in MiB",
)
@click.option(
    "--laps", type=click.IntRange(1, 1000), default=5, show_default=True, help="--ring: laps"
)
@json_option
def demo(
    nodes: int,
    ranks_per_node: int,
    delay_ms: float,
    steps: int,
    modes: str,
    sync_every: int,
    dim: int,
    batch: int,
    target: float,
    plot_path: Path | None,
    ring: bool,
    size_mib: int,
    laps: int,
    as_json: bool,
) -> None:
    """Train eager-SGD hyperplane regression on local daemons with sync, solo and majority
    allreduce, one rank late at every step; compare speed and validation loss."""
    if ring:
        _ring_demo(nodes, size_mib, laps, as_json)
        return
    from fabricd.demo import plot, training

    try:
        chosen = training.parse_modes(modes)
    except FabricError as exc:
        raise click.BadParameter(str(exc), param_hint="--modes") from exc
    if plot_path is None and not as_json:
        if plot.available():
            plot_path = Path(_DEMO)
        else:
            errors.print(
                "[yellow]no plot:[/] matplotlib is not installed (pip install 'fabricd[demo]')"
            )
    try:
        settings = training.Settings(
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            dim=dim,
            batch=batch,
            steps=steps,
            delay_ms=delay_ms,
            target=target,
            sync_every=sync_every,
        )
        if not as_json:
            console.print(
                f"starting {nodes} daemons on loopback, {ranks_per_node} ranks each; "
                f"{dim}-dimensional hyperplane regression, batch {settings.local_batch} per rank, "
                f"{steps} steps per mode; one rank {delay_ms:g} ms late at every step"
            )
        if as_json:
            result = training.run(settings, chosen)
        else:
            result = _train_with_progress(settings, chosen)
        if plot_path is not None:
            plot.write_png(result, plot_path)
    except FabricError as exc:
        errors.print(f"[red]demo failed:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    if as_json:
        _emit_json({**result.as_dict(), "plot": str(plot_path) if plot_path else None})
        return
    _print_training(result)
    if plot_path is not None:
        console.print(f"validation loss against time: [bold]{escape(str(plot_path))}[/]")


def _train_with_progress(settings: Settings, modes: list[Mode]) -> DemoResult:
    """Run the demo with a progress bar per mode: steps, and rank 0's validation loss."""
    from fabricd.demo import training

    columns = (
        TextColumn("[bold]{task.description:>8}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("validation loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {m: progress.add_task(m, total=settings.steps, loss="-") for m in modes}

        def update(mode: Mode, report: Report) -> None:
            step, _, value, _ = report
            # a call that was behind may get a round past the last
            progress.update(
                tasks[mode], completed=min(step + 1, settings.steps), loss=_figure(value)
            )

        return training.run(settings, modes, progress=update)


def _print_training(result: DemoResult) -> None:
    settings = result.settings
    table = Table(
        title=f"hyperplane regression, {settings.dim} dimensions: {settings.ranks} ranks on "
        f"{settings.nodes} daemons, batch {settings.local_batch * settings.ranks}, one rank "
        f"{settings.delay_ms:g} ms late per step; target validation loss "
        f"{_figure(result.target_loss)} ({settings.target:g}x the noise variance)"
    )
    for heading in ("mode", "steps/s", "speedup", "time to target", "final loss", "active ranks"):
        table.add_column(heading, justify="left" if heading == "mode" else "right")
    sync = next((m for m in result.modes if m.mode == "sync"), None)
    for mode in result.modes:
        speedup = f"{_figure(mode.steps_per_s / sync.steps_per_s)}x" if sync else "-"
        reached = mode.time_to_target
        table.add_row(
            mode.mode,
            _figure(mode.steps_per_s),
            speedup,
            f"{_figure(reached)} s" if reached is not None else "[yellow]not reached[/]",
            _figure(mode.final_loss),
            f"{_figure(mode.mean_active)} of {settings.ranks}",
        )
    console.print(table)
    console.print(
        "speedup: steps/s over sync's; active ranks: those whose fresh gradient was in the "
        "round, averaged over rank 0's allreduce calls"
    )


def _ring_demo(nodes: int, size_mib: int, laps: int, as_json: bool) -> None:
    """Pass a float32 tensor around a ring of local daemons and verify every byte."""
    from fabricd.demo import ring

    nbytes = size_mib * 1024 * 1024
    if not as_json:
        console.print(f"starting {nodes} daemons on loopback; {size_mib} MiB tensor, {laps} laps")
    try:
        if as_json:
            result = ring.run(nodes, nbytes, laps)
        else:
            result = _run_with_progress(
                lambda p: ring.run(nodes, nbytes, laps, progress=p), laps, nbytes * nodes
            )
    except FabricError as exc:
        errors.print(f"[red]demo failed:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    if as_json:
        _emit_json(result.as_dict())
        return
    table = Table(title="ring demo", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("fabric", f"{result.nodes} daemons on loopback, one client each"),
        ("tensor", f"{_size(result.nbytes)} float32, {result.laps} laps = {result.hops} hops"),
        ("time", f"{_figure(result.seconds)} s moving data, from when every rank was ready"),
        ("ring throughput", f"{_figure(result.ring_gbps)} GB/s"),
        ("memcpy baseline", f"{_figure(result.memcpy_gbps)} GB/s (same run)"),
        ("ratio", f"{_figure(result.ratio)}x memcpy"),
        ("verified", f"[green]every element at every hop; blake2b {result.checksum}[/]"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def _run_with_progress(
    body: Callable[[Callable[[int, float], None]], Any], laps: int, lap_bytes: int
) -> Any:
    columns = (
        TextColumn("[bold]ring"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} laps"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("ring", total=laps, rate="")

        def update(lap: int, seconds: float) -> None:
            rate = f"{_figure(lap * lap_bytes / seconds / 1e9)} GB/s" if seconds else ""
            progress.update(task, completed=lap, rate=rate)

        return body(update)


if __name__ == "__main__":
    main()
