"""``fabricctl demo``: eager-SGD hyperplane regression on local daemons with sync, solo and
majority allreduce (:mod:`fabricd.demo.training`), or with ``--ring`` a tensor passed around a
ring of daemons, every byte verified (:mod:`fabricd.demo.ring`); with progress bars, and a table
at the end whose headline is each mode's time to the target loss against sync's
(:mod:`fabricd.demo.measures`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fabricd.cli.common import console, emit_json, errors, figure, json_option, size
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client.collectives import Mode
    from fabricd.demo.training import DemoResult, ModeResult, Report, Settings


_DEMO = "fabricd-demo.png"


@click.command()
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
    help="how long one random rank sleeps before its allreduce, at every step "
    "(--imbalance severe: the longest of every rank's sleeps)",
)
@click.option(
    "--imbalance",
    type=click.Choice(["one", "severe"]),
    default="one",
    show_default=True,
    help="one rank late per step (eager-SGD §6.2.1), or every rank, by 1/8 to 8/8 of "
    "--delay-ms, shifted each step (§6.2.3)",
)
@click.option(
    "--compute-ms",
    type=click.FloatRange(0, 60_000),
    default=300.0,
    show_default=True,
    help="each rank's step, emulated device time (the paper's P100 step): the rank sleeps "
    "what its real math leaves of it",
)
@click.option(
    "--steps",
    type=click.IntRange(1, 100_000),
    default=50,
    show_default=True,
    help="allreduce rounds of the sync run; solo runs 1.6x and majority 2.8x as many (their "
    "rounds hold fewer fresh gradients)",
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
    default=160,
    show_default=True,
    help="solo, majority: average the replicas every this many steps (the paper: 160)",
)
@click.option(
    "--late",
    type=click.Choice(["sum", "latest"]),
    default="sum",
    show_default=True,
    help="solo, majority: a rank that missed rounds gets the sum of their results, or only "
    "the latest (the paper's receive buffer; try --sync-every 10 with it)",
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
    imbalance: str,
    compute_ms: float,
    steps: int,
    modes: str,
    sync_every: int,
    late: str,
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
    allreduce, one rank late at every step; compare each mode's time to the target loss."""
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
            compute_ms=compute_ms,
            imbalance="severe" if imbalance == "severe" else "one",
            delay_ms=delay_ms,
            target=target,
            sync_every=sync_every,
            late="latest" if late == "latest" else "sum",
        )
        if not as_json:
            console.print(
                f"starting {nodes} daemons on loopback, {ranks_per_node} ranks each; "
                f"{dim}-dimensional hyperplane regression, batch {settings.local_batch} per rank, "
                f"{settings.rounds('sync')}/{settings.rounds('solo')}/"
                f"{settings.rounds('majority')} rounds (sync/solo/majority) of {compute_ms:g} ms "
                "emulated compute a step; "
                f"{settings.lateness}"
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
        emit_json({**result.as_dict(), "plot": str(plot_path) if plot_path else None})
        return
    _print_training(result)
    if plot_path is not None:
        console.print(f"validation loss against time: [bold]{escape(str(plot_path))}[/]")


def _train_with_progress(settings: Settings, modes: list[Mode]) -> DemoResult:
    """Run the demo with a progress bar per mode: steps, rank 0's validation loss, and the
    mode's own time.

    The time is the one rank 0 reports, counted from the mode's start barrier: the clock the
    table's time to target and rates read.  (A bar's elapsed time counted from when the bar
    was drawn, and every bar is drawn at the start: a later mode's time included the modes
    before it.)
    """
    from fabricd.demo import training

    columns = (
        TextColumn("[bold]{task.description:>8}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("validation loss {task.fields[loss]}"),
        TextColumn("{task.fields[seconds]}"),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {
            m: progress.add_task(m, total=settings.rounds(m), loss="-", seconds="waiting")
            for m in modes
        }

        def update(mode: Mode, report: Report) -> None:
            step, seconds, value, _ = report
            # a call that was behind may get a round past the last
            progress.update(
                tasks[mode],
                completed=min(step + 1, settings.rounds(mode)),
                loss=figure(value),
                seconds=f"{seconds:.1f} s",
            )

        return training.run(settings, modes, progress=update)


def _print_training(result: DemoResult) -> None:
    """The table (time to target first, then gradients and rounds per second) and a headline
    line per partial mode: how much sooner than sync it reached the target loss."""
    from fabricd.demo.measures import speedup

    settings = result.settings
    table = Table(
        title=f"hyperplane regression, {settings.dim} dimensions: {settings.ranks} ranks on "
        f"{settings.nodes} daemons, batch {settings.local_batch * settings.ranks}, "
        f"{settings.compute_ms:g} ms compute a step, {settings.lateness}; target validation "
        f"loss {figure(result.target_loss)} ({settings.target:g}x the noise variance)"
    )
    headings = ("mode", "time to target", "vs sync", "gradients/s", "rounds/s", "final loss")
    for heading in (*headings, "active ranks"):
        table.add_column(heading, justify="left" if heading == "mode" else "right")
    sync = next((m for m in result.modes if m.mode == "sync"), None)
    for mode in result.modes:
        reached = mode.time_to_target
        ratio = speedup(sync.time_to_target, reached) if sync else math.nan
        table.add_row(
            mode.mode,
            f"{figure(reached)} s" if reached is not None else "[yellow]not reached[/]",
            f"{figure(ratio)}x" if math.isfinite(ratio) and ratio > 0 else "-",
            figure(mode.gradients_per_s),
            figure(mode.rounds_per_s),
            figure(mode.final_loss),
            f"{figure(mode.mean_active)} of {settings.ranks}",
        )
    console.print(table)
    console.print(
        "time to target: until rank 0's validation loss first reached the target; vs sync: "
        "sync's time over the mode's (higher is better); gradients/s: gradients that entered "
        "a result, per rank; active ranks: those whose fresh gradient a round held"
    )
    for mode in result.modes:
        if sync is not None and mode is not sync:
            line = _headline(sync, mode)
            if line is not None:
                console.print(line)
        if mode.missed is not None:
            console.print(f"[yellow]{mode.mode} did not reach the target:[/] {escape(mode.missed)}")


def _headline(sync: ModeResult, mode: ModeResult) -> str | None:
    """``solo reached the target loss 1.45x as fast as sync (12.1 s against 17.6 s)``, when
    both reached it."""
    if sync.time_to_target is None or mode.time_to_target is None:
        return None
    ratio = sync.time_to_target / mode.time_to_target
    return (
        f"[bold]{mode.mode}[/] reached the target loss [bold]{figure(ratio)}x[/] as fast as "
        f"sync ({figure(mode.time_to_target)} s against {figure(sync.time_to_target)} s)"
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
        emit_json(result.as_dict())
        return
    table = Table(title="ring demo", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("fabric", f"{result.nodes} daemons on loopback, one client each"),
        ("tensor", f"{size(result.nbytes)} float32, {result.laps} laps = {result.hops} hops"),
        ("time", f"{figure(result.seconds)} s moving data, from when every rank was ready"),
        ("ring throughput", f"{figure(result.ring_gbps)} GB/s"),
        ("memcpy baseline", f"{figure(result.memcpy_gbps)} GB/s (same run)"),
        ("ratio", f"{figure(result.ratio)}x memcpy"),
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
            rate = f"{figure(lap * lap_bytes / seconds / 1e9)} GB/s" if seconds else ""
            progress.update(task, completed=lap, rate=rate)

        return body(update)
