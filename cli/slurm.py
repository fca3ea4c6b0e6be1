"""``fabricctl slurm``: fabricd inside Slurm jobs (docs/slurm.md).

* ``prolog`` and ``epilog``: slurmd runs them as root on each node of a job
  (``Prolog=``/``Epilog=`` in slurm.conf); they start and stop the job's own daemon
  (:mod:`fabricd.daemon.slurm_job`).
* ``run -- COMMAND``: the launcher, run by ``srun`` once per rank; it sets ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
  ``FABRICD_SOCKET`` from Slurm's variables, leaving torchrun's as they are, and execs
  ``COMMAND`` (:func:`fabricd.slurm.launch_environment`).
* ``env``: the same variables as ``export`` lines, which is what a Slurm ``TaskProlog``
  prints to set them in every task.
"""

from __future__ import annotations

import os
import shlex
import sys

import click
from rich.markup import escape

from fabricd.cli.common import console, emit_json, errors, json_option
from fabricd.errors import FabricError
from fabricd.slurm import (
    DEFAULT_KEY_FILE,
    job_id_of,
    job_socket_candidates,
    launch_environment,
    stale_rank_warning,
)


@click.group()
def slurm() -> None:
    """fabricd for Slurm jobs: a daemon per job, and each rank's variables."""


@slurm.command()
@click.option(
    "--key-file",
    default=DEFAULT_KEY_FILE,
    show_default=True,
    help="the site's key, the same on every node: each job's secret is derived from it",
)
@click.option(
    "--listen-host",
    default="",
    metavar="ADDRESS",
    help="listen here (e.g. 0.0.0.0) rather than where the node's name resolves",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="seconds to wait for the daemon to listen",
)
def prolog(key_file: str, listen_host: str, timeout: float) -> None:
    """Start this job's daemon on this node (slurm.conf: Prolog=; runs as root)."""
    from fabricd.daemon.slurm_job import start_job_daemon

    try:
        pid = start_job_daemon(
            os.environ, key_file=key_file, listen_host=listen_host, timeout=timeout
        )
    except (FabricError, OSError) as exc:
        errors.print(f"[red]fabricctl slurm prolog:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    console.print(f"fabricd of job {job_id_of(os.environ)} listens (pid {pid})")


@slurm.command()
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="seconds the daemon may drain before it is killed",
)
def epilog(timeout: float) -> None:
    """Stop this job's daemon on this node and remove its files (slurm.conf: Epilog=)."""
    from fabricd.daemon.slurm_job import stop_from_environ

    try:
        stopped = stop_from_environ(os.environ, timeout)
    except (FabricError, OSError) as exc:
        errors.print(f"[red]fabricctl slurm epilog:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    console.print(f"fabricd of job {job_id_of(os.environ)}: {'stopped' if stopped else 'none'}")


def _variables() -> dict[str, str]:
    """What this task's launcher adds to its environment; ends the command on an error."""
    sockets = job_socket_candidates(os.environ)
    warning = stale_rank_warning(os.environ)
    if warning:
        errors.print(f"[yellow]fabricctl slurm:[/] {escape(warning)}", soft_wrap=True)
    try:
        return launch_environment(os.environ, bool(sockets) and os.path.exists(sockets[0]))
    except FabricError as exc:
        errors.print(f"[red]fabricctl slurm:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)


@slurm.command(context_settings={"ignore_unknown_options": True})
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...]) -> None:
    """Run COMMAND as this task's rank: srun fabricctl slurm run -- python train.py."""
    env = {**os.environ, **_variables()}
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        errors.print(f"[red]fabricctl slurm run:[/] {escape(command[0])}: {exc.strerror}")
        sys.exit(127)


@slurm.command("env")
@json_option
def env_(as_json: bool) -> None:
    """Print the variables `run` would set, as export lines (a TaskProlog's output)."""
    variables = _variables()
    if as_json:
        emit_json(variables)
        return
    for name, value in sorted(variables.items()):
        click.echo(f"export {name}={shlex.quote(value)}")
