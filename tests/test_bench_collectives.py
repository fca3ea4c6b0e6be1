"""The collective benchmarks (allreduce, skew) run and report a ratio per case; structure only.

As in test_bench_smoke.py, nothing here is about speed.  The baselines are optional (the
``bench`` extra and OpenMPI): where one is absent its part is skipped with the reason, and the
benchmark itself must say that it skipped it and go on.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from bench import allreduce, collective_ranks, skew
from bench.report import KiB
from fabricd.cli.bench import bench as bench_group
from tests.test_bench_smoke import run_bench, the_table

GLOO = allreduce.missing("gloo")
MPI = allreduce.missing("mpi")
TINY = [(4 * KiB, 2), (64 * KiB, 1)]  #: (bytes, calls per sample)


def test_layouts_keep_the_per_node_counts_that_divide_the_rank_count() -> None:
    assert allreduce.layouts([2, 4, 8], [1, 2, 4]) == [
        (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4),
    ]  # fmt: skip


def test_a_sample_counts_at_its_slowest_rank() -> None:
    times = [[[1.0, 5.0, 3.0]], [[2.0, 1.0, 4.0]]]  # [rank][size][sample]
    assert allreduce.slowest_rank_medians(times) == [4.0]  # median of 2, 5, 4


def test_skew_averages_latency_per_rank_and_active_ranks_per_round() -> None:
    fast = {"latencies": [1.0, 1.0, 1.0, 1.0], "rounds": [(1, 1), (2, 1), (3, 2), (4, 1)]}
    slow = {"latencies": [3.0], "rounds": [(3, 2)]}  # a late call: round 3's result again
    latency, active, calls = skew.summarise([fast, slow], size=2)
    assert latency == 2.0  # each rank's average counts once, however many calls it made
    assert active == 1.25  # rounds 1..4 once each
    assert calls == 2.5
    baseline = {"latencies": [2.0], "rounds": [(-1, 2)]}
    assert skew.summarise([baseline, baseline], size=2) == (2.0, 2.0, 1.0)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_baseline_reduces_and_reports_a_time_per_size(backend: str) -> None:
    reason = allreduce.missing(backend)
    if reason is not None:
        pytest.skip(reason)
    times = allreduce.measure(backend, 2, 1, TINY, samples=2, warmup=1)  # checks the sums too
    assert len(times) == len(TINY)
    assert all(t > 0 and math.isfinite(t) for t in times)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_skewed_baseline_makes_every_call_with_every_rank_active(backend: str) -> None:
    reason = allreduce.missing(backend)
    if reason is not None:
        pytest.skip(reason)
    spec = {"nbytes": 4 * KiB, "iterations": 3, "skew_ms": 1.0, "modes": ["sync"]}
    [(mode, (latency, active, calls))] = skew.measure(backend, 2, 1, spec).items()
    assert (mode, active, calls) == ("sync", 2.0, 3.0)
    assert latency > 0


def test_mpirun_stays_on_this_machine() -> None:
    command = collective_ranks.mpirun_command(4)
    assert command[command.index("-np") + 1] == "4"
    assert "self,vader" in command  # shared memory only: no network transport
    assert "--oversubscribe" in command


def test_allreduce_tree_compares_the_tree_with_the_ring_at_every_size() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "allreduce-tree")
    table = the_table(result, "allreduce-tree")
    nodes = allreduce.QUICK_TREE_NODES
    assert [row["nbytes"] for row in table["rows"]] == allreduce.QUICK_TREE_SIZES * len(nodes)
    for row in table["rows"]:
        figures = row["figures"]
        assert figures["ring_ms"] > 0
        assert figures["tree_ms"] > 0
        assert figures["mlfabric_ms"] > 0
        assert row["ratio"] == pytest.approx(figures["tree_ms"] / figures["ring_ms"])
        assert figures["mlfabric_vs_ring"] == pytest.approx(
            figures["mlfabric_ms"] / figures["ring_ms"]
        )
        assert f"{row['label']}: ring " in progress


@pytest.mark.slow
def test_allreduce_reports_every_layout_and_size() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "allreduce")
    table = the_table(result, "allreduce")
    layouts = allreduce.layouts(allreduce.QUICK_RANKS, allreduce.QUICK_PER_NODE)
    assert [row["nbytes"] for row in table["rows"]] == allreduce.QUICK_SIZES * len(layouts)
    for row in table["rows"]:
        figures = row["figures"]
        assert figures["fabricd_ms"] > 0
        assert figures["fabricd_mibs"] == pytest.approx(
            row["nbytes"] / (figures["fabricd_ms"] / 1e3) / (1 << 20)
        )
        for baseline, reason in (("gloo", GLOO), ("mpi", MPI)):
            assert (f"{baseline}_ms" in figures) == (reason is None)
        if GLOO is None:
            assert row["ratio"] == pytest.approx(figures["gloo_ms"] / figures["fabricd_ms"])
        else:
            assert row["ratio"] is None  # no gloo, no ratio: JSON has null for NaN
        assert f"{row['label']}: fabricd " in progress
    assert table["target_met"] in ((True, False) if GLOO is None else (None,))
    for reason in (GLOO, MPI):
        if reason is not None:
            assert reason in table["notes"]
            assert reason in progress


@pytest.mark.slow
def test_skew_reports_every_mode_and_baseline_per_rank_count() -> None:
    result, _ = run_bench("--quick", "--json", "--only", "skew")
    table = the_table(result, "skew")
    present = [b for b in ("mpi", "gloo") if allreduce.missing(b) is None]
    names = [f"fabricd {m}" for m in skew.MODES] + [
        {"mpi": "MPI_Allreduce", "gloo": "gloo"}[b] for b in present
    ]
    assert [row["label"] for row in table["rows"]] == [
        f"{p} ranks, {name}" for p in skew.QUICK_RANKS for name in names
    ]
    for row in table["rows"]:
        figures = row["figures"]
        assert figures["ms"] > 0
        assert 1 <= figures["active"] <= skew.QUICK_RANKS[0]
        assert math.isfinite(row["ratio"])
        assert row["ratio"] > 0
        assert figures["vs_sync"] > 0
    sync = table["rows"][0]["figures"]
    assert sync["active"] == skew.QUICK_RANKS[0]  # a sync round has every rank's data
    assert sync["calls"] == skew.QUICK_ITERATIONS


def test_fabricctl_bench_prints_json_for_scripts() -> None:
    result = CliRunner().invoke(
        bench_group,
        [
            *("allreduce", "--json", "--sizes", "4KiB", "--ranks", "2", "--per-node", "2"),
            *("--samples", "1", "--baselines", "none"),
        ],
    )
    assert result.exit_code == 0, result.output
    [table] = json.loads(result.output)["benchmarks"]
    [row] = table["rows"]
    assert row["label"] == "2 ranks, 2/node, 4 KiB"
    assert row["figures"]["fabricd_ms"] > 0


def test_fabricctl_bench_table_shows_every_figure_the_target_and_the_notes() -> None:
    from rich.console import Console

    from bench import report
    from fabricd.cli.bench import _rich_table

    table = report.Table(
        name="t", title="a title", columns=[report.Column("a", "A")], ratio="a / b", target="x"
    )
    table.add("2 ranks, 4 KiB", 4096, 2.5, a=1.25)
    table.add("2 ranks, 64 KiB", 65536, float("nan"), a=3.0)
    table.target_met = False
    table.notes.append("mpi4py not installed: skipped")
    console = Console(width=200, record=True)
    console.print(_rich_table(table, report))
    text = console.export_text()
    assert "2.50x" in text
    assert "1.25" in text
    assert "target: x: MISSED" in text
    assert "mpi4py not installed: skipped" in text
    assert "nanx" not in text
    assert "-x" not in text


def test_fabricctl_bench_refuses_an_unknown_baseline() -> None:
    result = CliRunner().invoke(bench_group, ["skew", "--baselines", "nccl"])
    assert result.exit_code == 2
    assert "unknown baseline(s) nccl" in result.output
