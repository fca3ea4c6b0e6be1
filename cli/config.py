"""``fabricctl config show``: each effective setting and where it came from (default, file,
environment, flag), from the running daemon or for a daemon started now.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import click
from rich.markup import escape
from rich.text import Text

from fabricd.cli.common import (
    connected,
    console,
    emit_json,
    errors,
    folding_table,
    json_option,
    socket_option,
)
from fabricd.cli.daemon import config_flags, load_from_cli
from fabricd.errors import FabricError


@click.group()
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
        with connected(socket_path) as client:
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
        emit_json(described)
        return
    table = folding_table(f"effective configuration ({escape(origin)})", ("key", "value", "source"))
    for key, entry in described.items():
        source = entry["source"]
        table.add_row(
            key,
            Text(json.dumps(entry["value"])),
            Text(source, style="dim" if source == "default" else ""),
        )
    console.print(table)
