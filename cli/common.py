"""What every ``fabricctl`` command shares: the consoles, the ``--socket`` and ``--json``
options, the connection to the daemon, and how figures, sizes and durations print.

One place for them, so every command reads and prints alike (DESIGN §9: people by default,
``--json`` for scripts).
"""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

from fabricd.client import Client, connect
from fabricd.errors import DaemonUnavailable, FabricError
from fabricd.ipc import socket_candidates

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator


#: the width of a console whose output is not a terminal: wide enough that no path, address or
#: line of a table is folded (a path cannot be longer than 4096 bytes)
UNFOLDED = 4096


class _Console(Console):
    """A console that folds nothing when its output is not a terminal and ``COLUMNS`` does not
    say a width.

    rich takes the width from whichever of stdin, stdout and stderr is a terminal, else 80
    columns: ``fabricctl local-cluster > log`` folded socket paths mid-word at the terminal's
    width, and a path folded onto two lines cannot be pasted.  Output read by people on a
    terminal is still folded to fit it.
    """

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and "COLUMNS" not in self._environ:
            return ConsoleDimensions(UNFOLDED, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


console = _Console(emoji=False)
errors = _Console(stderr=True, emoji=False)

json_option = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
socket_option = click.option(
    "--socket",
    "socket_path",
    envvar="FABRICD_SOCKET",
    metavar="PATH",
    help=(
        "the daemon's socket (default: $FABRICD_SOCKET, else the first that answers of "
        "a Slurm job's own, $XDG_RUNTIME_DIR/fabricd/fabricd.sock and /run/fabricd/fabricd.sock)"
    ),
)


@contextmanager
def connected(socket_path: str | None) -> Iterator[Client]:
    """A connection to the daemon at ``socket_path`` (None: see :func:`find_daemon`); one that
    cannot be made ends the command with its reason and exit status 1."""
    try:
        with find_daemon(socket_path) as client:
            yield client
    except FabricError as exc:
        errors.print(f"[red]fabricctl:[/] {escape(str(exc))}")
        sys.exit(1)


def find_daemon(socket_path: str | None) -> Client:
    """A connection to the daemon at ``socket_path``, else (nothing named a socket) the one a
    client finds at the default sockets, else node 0 of this user's one running local cluster.

    The choice: the default sockets come first, as for every client (a training script
    without ``FABRICD_SOCKET`` reaches the same daemon, and ``fabricctl`` must show that one);
    a local cluster is only looked for when nothing answers there, where before ``status``
    advised starting a cluster that was running (``top --all`` found it).  With several local
    clusters running, which one is meant is the user's to say.

    Raises:
        DaemonUnavailable: nothing answers, or several local clusters run (the message lists
            them and how to name one).
    """
    if socket_path is not None or os.environ.get("FABRICD_SOCKET"):
        return connect(socket_path=socket_path)
    try:
        return connect()
    except DaemonUnavailable as exc:
        from fabricd.daemon.launcher import cluster_name, running_clusters

        clusters = running_clusters()
        if not clusters:
            raise
        if len(clusters) > 1:
            listed = "".join(
                f"\n  cluster {cluster_name(sockets[0])}: node 0 at {sockets[0]}"
                for sockets in clusters
            )
            raise DaemonUnavailable(
                f"no daemon answers at {' or '.join(socket_candidates())}, and "
                f"{len(clusters)} local clusters of yours run: name a socket with --socket or "
                f"FABRICD_SOCKET{listed}"
            ) from exc
        socket = clusters[0][0]
        errors.print(
            f"fabricctl: no daemon answers at {escape(' or '.join(socket_candidates()))}: "
            f"node 0 of local cluster {cluster_name(socket)} ({escape(socket)})",
            soft_wrap=True,
        )
        return connect(socket_path=socket)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True))


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


STATE_STYLE = {"up": "green", "suspect": "yellow", "down": "red", "connecting": "dim"}


def folding_table(title: str, columns: Collection[str], right: Collection[str] = ()) -> Table:
    """A table whose cells fold onto more lines where the console is narrow, never cut short.

    rich's default cuts a cell with an ellipsis; an address or a path cut short is useless.
    Cells are given as :class:`~rich.text.Text`, so that no ``[...]`` in a value (an IPv6
    address, a job name) is taken for markup.
    """
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold", justify="right" if column in right else "left")
    return table


def plural(n: int, one: str, many: str) -> str:
    """``1 daemon``, ``3 daemons``."""
    return f"{n} {one if n == 1 else many}"


def figure(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures, never in exponent form: 0.0123, 1.23, 123.

    A fixed number of decimals prints a small ratio as 0.00, which says nothing.
    """
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
