"""``fabricctl local-cluster N``: N daemons on loopback for development, until a stop signal,
then a clean stop (DESIGN §9).

The signal handling is the subtle part: the first SIGTERM, SIGINT or SIGHUP stops the cluster,
later ones must not cut the drain short (the daemons would die with the launcher, and its
directory would stay behind).
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.text import Text

from fabricd.cli.common import console, emit_json, errors, folding_table, json_option, plural
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from types import FrameType


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


@click.command("local-cluster")
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
            emit_json({"removed": [str(path) for path in removed]})
        else:
            console.print(
                f"removed {plural(len(removed), 'directory', 'directories')} left by killed "
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
                f"stopped {plural(len(statuses), 'daemon', 'daemons')}: "
                + ", ".join(
                    f"node {node} {_exit_description(status)}"
                    for node, status in sorted(statuses.items())
                )
            )


def _announce_cluster(cluster: Any, as_json: bool) -> None:
    from fabricd.daemon.launcher import cluster_name

    name = cluster_name(cluster.directory)
    if as_json:
        for node in cluster.nodes:
            emit_json(
                {
                    "node": node.node,
                    "cluster": name,
                    "socket": node.socket_path,
                    "address": node.address,
                    "pid": node.pid,
                    "log": str(node.log_path),
                    "metrics_url": node.metrics_url,
                }
            )
        sys.stdout.flush()
        return
    size = len(cluster.nodes)
    table = folding_table(
        f"local cluster {name}: {size} nodes (config {escape(str(cluster.config_path))})",
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
    # every node's line, whole: a path folded onto two lines cannot be pasted
    console.print(
        "watch them with:  [bold]fabricctl top --all[/]\n"
        "connect a client to a node with its socket; one rank per node:",
        soft_wrap=True,
    )
    for node in cluster.nodes:
        console.print(
            f"  [bold]FABRICD_SOCKET={escape(node.socket_path)} RANK={node.node} "
            f"WORLD_SIZE={size} python train.py[/]",
            soft_wrap=True,
        )
    console.print(
        "Ctrl-C (or SIGTERM, or closing the terminal) stops every daemon and removes the "
        "temporary files.",
        soft_wrap=True,
    )
