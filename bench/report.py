"""Shared helpers of the benchmarks: timing, statistics, tables with a ratio column, machine facts.

Every benchmark returns :class:`Table` objects.  A table has one row per case (usually a message
size); each row carries the figure measured through fabricd, the baseline measured in the same
run, and their ratio, because on a shared two-core machine absolute times are noise while the
ratio of two things measured side by side is not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from multiprocessing.context import SpawnProcess

#: writes one progress line (to stderr, so ``--json`` output stays clean)
Progress = Callable[[str], None]

KiB = 1024
MiB = 1024 * KiB


def stderr_progress(prefix: str) -> Progress:
    """A progress printer that tags each line with ``[prefix]``."""

    def emit(line: str) -> None:
        print(f"[{prefix}] {line}", file=sys.stderr, flush=True)

    return emit


def quiet(line: str) -> None:
    """A progress printer that prints nothing."""


# -- statistics -------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by the nearest-rank method."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def per_call(fn: Callable[[], object], calls: int, samples: int) -> list[float]:
    """Seconds per call of ``fn``: ``samples`` timings of ``calls`` back-to-back calls each."""
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls)
    return out


def each_call(fn: Callable[[], object], calls: int) -> list[float]:
    """Seconds of each of ``calls`` back-to-back calls of ``fn`` (for medians and percentiles of
    single operations, where :func:`per_call` gives means)."""
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def batch_figures(side: str, batches: Sequence[Sequence[float]]) -> dict[str, float]:
    """One side's figures in microseconds from its batches of per-operation seconds: the median
    and 99th percentile of every operation (``{side}_median``, ``{side}_p99``) and the lowest and
    highest batch median (``{side}_low``, ``{side}_high``)."""
    every = [t for batch in batches for t in batch]
    medians = [median(batch) for batch in batches]
    return {
        f"{side}_median": median(every) * 1e6,
        f"{side}_p99": percentile(every, 99) * 1e6,
        f"{side}_low": min(medians) * 1e6,
        f"{side}_high": max(medians) * 1e6,
    }


def messages_per_sample(nbytes: int, budget: int, cap: int) -> int:
    """Messages of ``nbytes`` per timing sample: ``budget`` bytes' worth, at most ``cap``."""
    return max(1, min(cap, budget // max(nbytes, 1)))


# -- formatting -------------------------------------------------------------------------------
def fmt_size(nbytes: int) -> str:
    """``4096`` -> ``"4 KiB"``; sizes that are not a whole unit stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """``"4MiB"``, ``"64 KiB"``, ``"4096"`` -> bytes."""
    raw = text.strip().replace(" ", "")
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB), ("B", 1)):
        if raw.endswith(unit):
            return int(float(raw[: -len(unit)]) * scale)
    return int(raw)


def fmt_number(value: float | None, digits: int = 3) -> str:
    """A figure with ``digits`` significant digits (0: a whole number); ``None``: a dash."""
    if value is None or math.isnan(value):
        return "-"
    if digits == 0:
        return str(round(value))
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f}"


# -- tables -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Column:
    """One column: the row key it shows, its heading, and significant digits (0: integer)."""

    key: str
    heading: str
    digits: int = 3


@dataclass(slots=True)
class Row:
    """One case: a label (the size), its size in bytes, its figures, and the ratio."""

    label: str
    nbytes: int
    figures: dict[str, float]
    ratio: float


@dataclass(slots=True)
class Extra:
    """A figure outside the ratio table (its label says what it is compared with, if anything)."""

    label: str
    figures: dict[str, float]
    unit: str


@dataclass(slots=True)
class Table:
    """The result of one benchmark."""

    name: str
    title: str
    columns: list[Column]
    ratio: str  #: what the ratio is, e.g. "fabricd / raw (higher is better)"
    rows: list[Row] = field(default_factory=list)
    extras: list[Extra] = field(default_factory=list)
    target: str | None = None
    target_met: bool | None = None
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    #: why the benchmark could not run here (e.g. no network namespaces): one line, no rows
    skipped: str | None = None

    def add(self, label: str, nbytes: int, ratio: float, **figures: float) -> Row:
        row = Row(label=label, nbytes=nbytes, figures=figures, ratio=ratio)
        self.rows.append(row)
        return row

    def render(self, *, markdown: bool = False) -> str:
        """The table as aligned text (or a Markdown table), with notes and extras below; one
        line, ``<name>: skipped: <why>``, for a benchmark that could not run."""
        if self.skipped is not None:
            return f"{self.name}: skipped: {self.skipped}"
        headings = ["size", *(c.heading for c in self.columns), "ratio"]
        cells = [
            [
                row.label,
                *(fmt_number(row.figures.get(c.key), c.digits) for c in self.columns),
                fmt_number(row.ratio) + "x",
            ]
            for row in self.rows
        ]
        lines = [f"{self.title}", f"  ratio = {self.ratio}"]
        if markdown:
            lines = [
                "| " + " | ".join(headings) + " |",
                "|" + "|".join("---:" if i else "---" for i in range(len(headings))) + "|",
            ]
            lines += ["| " + " | ".join(r) + " |" for r in cells]
            if self.extras:
                lines.append("")
        else:
            widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headings)]
            lines.append(
                "  " + "  ".join(h.rjust(w) for h, w in zip(headings, widths, strict=True))
            )
            for r in cells:
                lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        for extra in self.extras:
            shown = ", ".join(f"{k} {fmt_number(v)} {extra.unit}" for k, v in extra.figures.items())
            lines.append(f"{'- ' if markdown else '  '}extra figure: {extra.label}: {shown}")
        if self.target is not None and not markdown:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[self.target_met]
            lines.append(f"  target: {self.target}: {verdict}")
        if not markdown:
            lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def dump_json(tables: Sequence[Table], info: dict[str, str]) -> str:
    """The machine-readable form of a run (strict JSON: a NaN or infinity becomes null)."""
    document = {"machine": info, "benchmarks": [t.to_json() for t in tables]}
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# -- the machine ------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    """Generic facts about this machine and software (no host names, no paths)."""
    info = {
        "cpus": str(len(os.sched_getaffinity(0))),
        "cpu_model": _cpu_model(),
        "memory": _memory(),
        "kernel": platform.release(),
        "os": platform.system(),
        "python": platform.python_version(),
    }
    for package in ("uvloop", "numpy", "msgpack"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = "not installed"
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory() -> str:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


# -- helper processes -------------------------------------------------------------------------
def spawn(target: Callable[..., None], *args: Any) -> SpawnProcess:
    """Start ``target(*args)`` in a fresh interpreter (spawn: no forked event loops or locks)."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def reap(process: SpawnProcess, timeout: float = 30.0) -> None:
    """Wait for a helper process; terminate it if it outlives ``timeout``.

    Raises:
        RuntimeError: it failed (non-zero exit status) or had to be terminated.
    """
    process.join(timeout)
    if process.is_alive():
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
        raise RuntimeError(f"benchmark helper {process.name} did not finish in {timeout}s")
    if process.exitcode != 0:
        raise RuntimeError(f"benchmark helper {process.name} exited with {process.exitcode}")


@contextlib.contextmanager
def pinned_helper(
    target: Callable[..., None], *args: Any, cpus: tuple[int, int], what: str
) -> Iterator[Any]:
    """Run ``target(conn, *args)`` in a helper process on ``cpus[1]`` while this process runs on
    ``cpus[0]`` (the same CPU or two); yield the first thing the helper sends on ``conn`` (where
    it listens).  The helper is reaped after the block, terminated if the block raised, and
    this process's CPUs are given back.

    Raises:
        RuntimeError: the helper said nothing within 60 s (``what`` names it), or failed.
    """
    parent, child = multiprocessing.get_context("spawn").Pipe()
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        helper = spawn(target, child, *args)
        try:
            assert helper.pid is not None
            os.sched_setaffinity(helper.pid, {cpus[1]})
            if not parent.poll(60):
                raise RuntimeError(f"{what} did not start")
            yield parent.recv()
        except BaseException:
            helper.terminate()
            raise
        reap(helper)
    finally:
        os.sched_setaffinity(0, saved)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far, in ns precision (``/proc/PID/task/*/schedstat``).

    ``/proc/PID/stat``'s utime and stime count the same time in ticks of 10 ms, too coarse for a
    batch of round trips that a process spends a few milliseconds of CPU on.  A thread that ends
    takes its time with it; the benchmarks' processes keep theirs.
    """
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        path = f"/proc/{pid}/task/{task}/schedstat"
        with contextlib.suppress(FileNotFoundError), open(path) as fh:
            total += int(fh.read().split()[0])
    return total / 1e9


def rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class CpuMeter:
    """The CPU time named processes spend inside chosen stretches of a benchmark.

    Each ``with meter.counting():`` adds what every process ran meanwhile, so interleaved batches
    of two sides can each be charged to their own side's processes.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = dict(pids)
        self.seconds = dict.fromkeys(self._pids, 0.0)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        before = {name: cpu_seconds(pid) for name, pid in self._pids.items()}
        yield
        for name, pid in self._pids.items():
            self.seconds[name] += cpu_seconds(pid) - before[name]

    def per(self, operations: int) -> dict[str, float]:
        """Microseconds of CPU per operation: each process's, and all of them together."""
        figures = {name: seconds / operations * 1e6 for name, seconds in self.seconds.items()}
        figures["all"] = sum(figures.values())
        return figures


def run_alone(
    name: str, doc: str | None, run: Callable[[bool, Progress], Table], argv: Sequence[str] | None
) -> int:
    """``python -m bench.<name> [--quick]``: run one benchmark and print its table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args(argv)
    print(run(args.quick, stderr_progress(name)).render(), flush=True)
    return 0
