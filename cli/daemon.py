"""``fabricd``: run the daemon of this node.

Every config key is also a flag (``--node-id``, ``--nodes``, ``--socket``, ...); flags win over
the environment (``FABRICD_<KEY>``), which wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from fabricd.daemon import config as config_module
from fabricd.errors import ConfigError

_TYPES: dict[str, Any] = {"int": click.INT, "float": click.FLOAT, "str": click.STRING}


def config_flags(func: Any, exclude: tuple[str, ...] = ()) -> Any:
    """Add one ``--<key>`` option per config key (lists take comma-separated values)."""
    for f in reversed(dataclasses.fields(config_module.Config)):
        if f.name in exclude:
            continue
        kind = str(f.type)
        param_type = _TYPES.get(kind, click.STRING)
        hint = "comma-separated" if kind.startswith("tuple") else kind
        option = click.option(
            f"--{f.name.replace('_', '-')}",
            f.name,
            type=param_type,
            default=None,
            help=f"config key {f.name} ({hint})",
        )
        func = option(func)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(exists=True, dir_okay=False),
        envvar="FABRICD_CONFIG",
        help="TOML config file (also $FABRICD_CONFIG)",
    )(func)


def load_from_cli(config_path: str | None, flags: dict[str, Any]) -> config_module.Loaded:
    given = {key: value for key, value in flags.items() if value is not None}
    return config_module.load(config_path, flags=given)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_flags
@click.option(
    "--no-dump",
    is_flag=True,
    help="make the process undumpable (no core, no ptrace by its uid): a Slurm job's daemon",
)
def main(config_path: str | None, no_dump: bool, **flags: Any) -> None:
    """Run the fabricd daemon of this node (SIGTERM drains and exits 0)."""
    from fabricd.daemon.main import EXIT_CONFIG, run

    if no_dump:
        from fabricd.daemon.slurm_job import forbid_dumps

        forbid_dumps()

    try:
        loaded = load_from_cli(config_path, flags)
    except ConfigError as exc:
        click.echo(f"fabricd: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    sys.exit(run(loaded))


if __name__ == "__main__":
    main()
