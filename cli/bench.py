"""``fabricctl bench allreduce|skew|consistency|svm|ps|mlfabric|ako``: the collective,
stochastic-reduce and parameter-server benchmarks and MLfabric's and Ako's virtual-time
experiments, for users (DESIGN §9).

Each command runs one benchmark of the repository's ``bench/`` folder (docs/performance.md
explains them) on daemons it starts on loopback, shows its progress, and prints its table: the
figures through fabricd, through the baselines installed here (torch.distributed's gloo,
mpi4py over OpenMPI: the ``bench`` extra), and their ratios.  With ``--json`` it prints the
machine-readable result (the same document as ``python -m bench --json``) and nothing else.

The benchmarks are not part of the installed package, so these commands run from a checkout
of fabricd: its ``bench/`` folder is found next to this one.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable
from rich.text import Text

from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

console = Console(emoji=False)
errors = Console(stderr=True, emoji=False)


def _bench(name: str) -> ModuleType:
    """``bench.<name>`` from the checkout this command belongs to.

    Raises:
        click.ClickException: there is no ``bench/`` folder (fabricd was installed, not checked
            out).
    """
    root = Path(__file__).resolve().parent.parent  # cli/ is a folder of the repository
    if (root / "bench" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"bench.{name}")
    except ImportError as exc:
        raise click.ClickException(
            f"the benchmarks live in the bench/ folder of a fabricd checkout, not in the "
            f"installed package ({exc}); run fabricctl from a checkout"
        ) from None


def _numbers(text: str, convert: Callable[[str], int]) -> list[int] | None:
    """``"2,4,8"`` -> ``[2, 4, 8]``; ``""`` -> ``None`` (the benchmark's default)."""
    try:
        return [convert(part) for part in text.split(",") if part.strip()] or None
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: {exc}") from None


def _baselines(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip() and part != "none"]
    unknown = sorted(set(chosen) - {"gloo", "mpi"})
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {', '.join(unknown)}: gloo, mpi or none")
    return chosen


json_option = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
quick_option = click.option("--quick", is_flag=True, help="a small smoke run (seconds)")
baselines_option = click.option(
    "--baselines",
    default="gloo,mpi",
    show_default=True,
    help="comma-separated: gloo, mpi, or none (each is skipped, with a note, when absent)",
)


@click.group()
def bench() -> None:
    """Benchmark fabricd's collectives (against gloo and MPI), stochastic reduce and parameter
    server on local daemons."""


@bench.command()
@click.option("--sizes", default="", help="comma-separated sizes [default: 4KiB to 64MiB]")
@click.option("--ranks", default="", help="comma-separated rank counts [default: 2,4,8]")
@click.option("--per-node", default="", help="comma-separated ranks per node [default: 1,2,4]")
@click.option("--samples", type=click.IntRange(1, 100), default=None, help="samples per size")
@click.option(
    "--tree",
    is_flag=True,
    help="instead: Tr-Sync (the binary-tree allreduce) vs the ring, --ranks daemons of one rank",
)
@baselines_option
@quick_option
@json_option
def allreduce(
    sizes: str,
    ranks: str,
    per_node: str,
    samples: int | None,
    tree: bool,
    baselines: str,
    quick: bool,
    as_json: bool,
) -> None:
    """Allreduce bandwidth and latency: fabricd sync vs gloo and MPI, by size and layout."""
    module = _bench("allreduce")
    report = _bench("report")
    chosen = _baselines(baselines)
    chosen_sizes = _numbers(sizes, report.parse_size)
    counts = _numbers(ranks, int)
    if tree:
        nodes = counts or (module.QUICK_TREE_NODES if quick else module.TREE_NODES)
        cases = len(nodes) * len(
            chosen_sizes or (module.QUICK_TREE_SIZES if quick else module.TREE_SIZES)
        )
        _show(
            lambda progress: module.run_tree(
                quick, progress, sizes=chosen_sizes, nodes=counts, samples=samples
            ),
            cases,
            as_json,
        )
        return
    layouts_per_node = _numbers(per_node, int)
    layouts = module.layouts(
        counts or (module.QUICK_RANKS if quick else module.RANKS),
        layouts_per_node or (module.QUICK_PER_NODE if quick else module.PER_NODE),
    )
    rows = len(layouts) * len(chosen_sizes or (module.QUICK_SIZES if quick else module.SIZES))
    _show(
        lambda progress: module.run(
            quick,
            progress,
            sizes=chosen_sizes,
            ranks=counts,
            per_node=layouts_per_node,
            baselines=chosen,
            samples=samples,
        ),
        rows,
        as_json,
    )


@bench.command()
@click.option("--ranks", default="", help="comma-separated rank counts [default: 8,16,32]")
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--iterations", type=click.IntRange(1, 10_000), default=None, help="[64]")
@click.option("--skew-ms", type=click.FloatRange(0, 1000), default=1.0, show_default=True)
@click.option("--size", "nbytes", default="4KiB", show_default=True, help="bytes per allreduce")
@baselines_option
@quick_option
@json_option
def skew(
    ranks: str,
    nodes: int,
    iterations: int | None,
    skew_ms: float,
    nbytes: str,
    baselines: str,
    quick: bool,
    as_json: bool,
) -> None:
    """eager-SGD's skew benchmark: sync, solo and majority latency vs MPI and gloo."""
    module = _bench("skew")
    report = _bench("report")
    [size] = _numbers(nbytes, report.parse_size) or [module.NBYTES]
    chosen = _baselines(baselines)
    counts = _numbers(ranks, int)
    present = [b for b in chosen if _bench("allreduce").missing(b) is None]
    rows = len(counts or (module.QUICK_RANKS if quick else module.RANKS)) * (
        len(module.MODES) + len(present)
    )
    _show(
        lambda progress: module.run(
            quick,
            progress,
            ranks=counts,
            nodes=nodes,
            iterations=iterations,
            skew_ms=skew_ms,
            nbytes=size,
            baselines=chosen,
        ),
        rows,
        as_json,
    )


@bench.command()
@click.option("--ranks", type=click.IntRange(2, 64), default=None, help="[8]")
@click.option("--nodes", type=click.IntRange(1, 64), default=None, help="[4]")
@click.option("--rounds", type=click.IntRange(1, 100_000), default=None, help="[200]")
@click.option("--jitter-ms", type=click.FloatRange(0, 10_000), default=5.0, show_default=True)
@click.option("--size", "nbytes", default="", help="bytes of the model [default: 1MiB]")
@quick_option
@json_option
def consistency(
    ranks: int | None,
    nodes: int | None,
    rounds: int | None,
    jitter_ms: float,
    nbytes: str,
    quick: bool,
    as_json: bool,
) -> None:
    """ASAP Fig. 8: how many reduces of an all-to-all graph used all their inputs, whole and
    of their round, under notify-ack, barrier and async."""
    module = _bench("consistency")
    report = _bench("report")
    sizes = _numbers(nbytes, report.parse_size)
    size = sizes[0] if sizes else None
    _show(
        lambda progress: module.run(
            quick,
            progress,
            ranks=ranks,
            nodes=nodes,
            rounds=rounds,
            jitter_ms=jitter_ms,
            nbytes=size,
        ),
        3,
        as_json,
    )


@bench.command()
@quick_option
@json_option
def svm(quick: bool, as_json: bool) -> None:
    """ASAP's SVM: bytes per rank to a test accuracy over all-to-all, expander and chain
    graphs (and the expander with a barrier), with a plot."""
    module = _bench("svm")
    _show(lambda progress: module.run(quick, progress), 4, as_json)


@bench.command()
@quick_option
@json_option
def ps(quick: bool, as_json: bool) -> None:
    """TDF's logistic regression through the parameter server: push and pull traffic cut by
    the filters and the accuracy change, under BSP, SSP(4) and SSP(8)."""
    module = _bench("ps_logreg")
    _show(lambda progress: module.run(quick, progress), len(module.cases(quick)), as_json)


@bench.command()
@quick_option
@json_option
def mlfabric(quick: bool, as_json: bool) -> None:
    """MLfabric's Table 2 in virtual time: MLfabric-A (fabricd's scheduler, aggregation and
    delay bound) against RR-Sync, Tr-Sync and Async under compute stragglers C1-C3 and network
    conditions N1-N3, in seconds to a target loss; server bytes with and without aggregation."""
    module = _bench("mlfabric")
    rows = len(module.STRATEGIES) * 9 * len(module.QUICK_WORKERS if quick else module.WORKERS)
    _show(lambda progress: module.run(quick, progress), rows, as_json)


@bench.command()
@quick_option
@json_option
def ako(quick: bool, as_json: bool) -> None:
    """Ako's partial gradient exchange in virtual time over the engines: time to a target
    accuracy against all-to-all exchange (p = 1) and a sync allreduce, bytes a rank sends per
    round from 4 to 64 ranks, and time to the target against p."""
    module = _bench("ako")
    workers = module.QUICK_WORKERS if quick else module.WORKERS
    rows = len(workers) if quick else len(workers) + len(module.WIDE) + len(module.SWEEP) + 1
    _show(lambda progress: module.run(quick, progress), rows, as_json)


def _show(body: Callable[[Callable[[str], None]], Any], rows: int, as_json: bool) -> None:
    """Run ``body(progress)`` behind a progress bar (a row is done at each line with a ratio),
    then print its table; with ``as_json``, only the JSON document."""
    report = _bench("report")
    try:
        if as_json:
            table = body(report.quiet)
            click.echo(report.dump_json([table], report.machine()))
            return
        columns = (
            SpinnerColumn(),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} rows"),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("starting", total=rows)

            def update(line: str) -> None:
                progress.update(task, description=escape(line))
                if ", ratio " in line:
                    progress.advance(task)
                else:
                    console.print(Text(line, style="dim"))

            table = body(update)
    except (FabricError, RuntimeError, ValueError) as exc:
        errors.print(f"[red]benchmark failed:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    console.print(_rich_table(table, report))


def _rich_table(table: Any, report: ModuleType) -> Group:
    """A :class:`bench.report.Table` as a rich table, then its ratio, target and notes (lines
    below it, not a caption: a caption folds at the table's width)."""
    out = RichTable(title=table.title)
    out.add_column("case")
    for column in table.columns:
        out.add_column(column.heading, justify="right")
    out.add_column("ratio", justify="right", style="bold")
    for row in table.rows:
        cells = [report.fmt_number(row.figures.get(c.key), c.digits) for c in table.columns]
        ratio = report.fmt_number(row.ratio)
        out.add_row(Text(row.label), *cells, ratio if ratio == "-" else ratio + "x")
    verdict = {True: "met", False: "MISSED", None: "not measured"}[table.target_met]
    caption = [f"ratio = {table.ratio}"]
    if table.target is not None:
        caption.append(f"target: {table.target}: {verdict}")
    caption += [f"note: {note}" for note in table.notes]
    return Group(out, Text("\n".join(caption)))
