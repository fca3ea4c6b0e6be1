"""``fabricctl``: control and watch fabricd.

Each command parses its arguments, calls one function of the client library or the daemon
package, and prints the result for humans (rich tables) or, with ``--json``, for scripts.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fabricd.cli.daemon import config_flags, load_from_cli
from fabricd.cli.daemon import main as daemon_main
from fabricd.client import Client, connect
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

console = Console()
errors = Console(stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
socket_option = click.option(
    "--socket",
    "socket_path",
    envvar="FABRICD_SOCKET",
    metavar="PATH",
    help="the daemon's socket (default: $FABRICD_SOCKET, then the system default)",
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


def _peer_table(peers: list[dict[str, Any]]) -> Table:
    table = Table(title="peers")
    for column in ("node", "address", "state", "for", "last heard", "links", "sent", "received"):
        table.add_column(column, justify="right" if column in ("sent", "received") else "left")
    for peer in peers:
        style = _STATE_STYLE.get(peer["state"], "")
        links = ",".join(ch for ch, up in peer["links"].items() if up) or "-"
        table.add_row(
            str(peer["node"]),
            peer["address"],
            f"[{style}]{peer['state']}[/]",
            _ago(peer["state_for"]),
            _ago(peer["silent_for"]),
            links,
            _size(peer["bytes_sent"]),
            _size(peer["bytes_received"]),
        )
    return table


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
        f"up {_ago(info['uptime'])}\n  peers on {info['address']} ({info['transport']}), "
        f"clients on {info['socket']}\n  incarnation {info['incarnation']}, "
        f"protocol v{info['version']}, {info['pending_ops']} operations pending"
    )
    if info["peers"]:
        console.print(_peer_table(info["peers"]))
    clients = Table(title=f"clients ({len(info['clients'])})")
    for column in ("id", "pid", "uid", "job", "rank", "segments", "ops"):
        clients.add_column(column)
    for c in info["clients"]:
        clients.add_row(
            *(
                str(c[k]) if c[k] is not None else "-"
                for k in ("id", "pid", "uid", "job", "rank", "segments", "ops")
            )
        )
    console.print(clients)
    counters = ", ".join(f"{k} {v}" for k, v in sorted(info["counters"].items()))
    console.print(f"counters: {counters}")


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
            errors.print(f"[red]fabricctl:[/] {exc}")
            sys.exit(1)
        origin = config_path or "defaults, environment and flags"
    if as_json:
        _emit_json(described)
        return
    table = Table(title=f"effective configuration ({origin})")
    for column in ("key", "value", "source"):
        table.add_column(column)
    for key, entry in described.items():
        source = entry["source"]
        table.add_row(
            key, json.dumps(entry["value"]), f"[dim]{source}[/]" if source == "default" else source
        )
    console.print(table)


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


@main.command("local-cluster")
@click.argument("nodes", type=click.IntRange(1, 64))
@click.option("--log-dir", type=click.Path(file_okay=False), help="keep daemon logs here")
@click.option(
    "--fast-liveness/--default-liveness",
    default=True,
    show_default=True,
    help="detect dead peers within 1 s (development) or use the config defaults",
)
@json_option
def local_cluster(nodes: int, log_dir: str | None, fast_liveness: bool, as_json: bool) -> None:
    """Start NODES daemons on loopback until Ctrl-C or SIGTERM, then stop them cleanly."""
    from pathlib import Path

    from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster

    cluster = LocalCluster(
        nodes,
        settings=dict(FAST_LIVENESS) if fast_liveness else {},
        log_dir=Path(log_dir) if log_dir else None,
    )
    # both, explicitly: a shell that starts us in the background sets SIGINT to ignored
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.start()
        cluster.wait_connected()
        _announce_cluster(cluster, as_json)
        while True:
            for node in cluster.nodes:
                assert node.process is not None
                if node.process.poll() is not None:
                    raise FabricError(
                        f"node {node.node} exited (status {node.process.returncode}):\n"
                        + node.log_tail()
                    )
            time.sleep(0.2)
    except _Stop:
        pass
    except FabricError as exc:
        errors.print(f"[red]fabricctl:[/] {exc}")
        cluster.stop()
        sys.exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    statuses = cluster.stop()
    if not as_json:
        console.print(
            f"stopped {len(statuses)} daemons (exit statuses "
            f"{sorted({-1 if s is None else s for s in statuses.values()})})"
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
                }
            )
        sys.stdout.flush()
        return
    table = Table(
        title=f"local fabric of {len(cluster.nodes)} nodes (config {cluster.config_path})"
    )
    for column in ("node", "address", "pid", "socket"):
        table.add_column(column)
    for node in cluster.nodes:
        table.add_row(str(node.node), node.address, str(node.pid), node.socket_path)
    console.print(table)
    console.print(
        "connect a client to node N with:  "
        f"[bold]FABRICD_SOCKET={cluster.nodes[0].socket_path} RANK=0 WORLD_SIZE=…[/] "
        "[bold]python train.py[/]\n"
        "Ctrl-C (or SIGTERM) stops every daemon and removes the temporary files."
    )


@main.command()
@click.option("--nodes", type=click.IntRange(2, 16), default=4, show_default=True)
@click.option(
    "--size-mib",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="tensor size in MiB",
)
@click.option("--laps", type=click.IntRange(1, 1000), default=5, show_default=True)
@json_option
def demo(nodes: int, size_mib: int, laps: int, as_json: bool) -> None:
    """Pass a float32 tensor around a ring of local daemons and verify every byte."""
    from fabricd import demo as ring

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
        errors.print(f"[red]demo failed:[/] {exc}")
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
        ("time", f"{result.seconds:.2f} s moving data"),
        ("ring throughput", f"{result.ring_gbps:.2f} GB/s"),
        ("memcpy baseline", f"{result.memcpy_gbps:.2f} GB/s (same run)"),
        ("ratio", f"{result.ratio:.2f}x memcpy"),
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
            rate = f"{lap * lap_bytes / seconds / 1e9:.2f} GB/s" if seconds else ""
            progress.update(task, completed=lap, rate=rate)

        return body(update)


if __name__ == "__main__":
    main()
