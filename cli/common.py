"""What every ``fabricctl`` command shares: the consoles, the ``--socket`` and ``--json``
options, the connection to the daemon, and how figures, sizes and durations print.

One place for them, so every command reads and prints alike (DESIGN §9: people by default,
``--json`` for scripts).
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from fabricd.client import Client, connect
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator


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
def connected(socket_path: str | None) -> Iterator[Client]:
    """A connection to the daemon at ``socket_path``; one that cannot be made ends the command
    with its reason and exit status 1."""
    try:
        with connect(socket_path=socket_path) as client:
            yield client
    except FabricError as exc:
        errors.print(f"[red]fabricctl:[/] {exc}")
        sys.exit(1)


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
