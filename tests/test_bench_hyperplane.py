"""The hyperplane benchmark runs every case and reports each mode's time to target and its
speedup over sync (structure only, never speed: see tests/test_bench_smoke.py); its
interleaving and the arithmetic of its rows, on made-up runs."""

from __future__ import annotations

import math

import pytest

from bench import hyperplane
from bench.report import Table
from fabricd.demo.training import ModeResult
from tests.test_bench_smoke import run_bench, the_table


def test_hyperplane_reports_time_to_target_against_sync_for_every_case() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "hyperplane")
    table = the_table(result, "hyperplane")
    assert [row["label"] for row in table["rows"]] == [c.label for c in hyperplane.QUICK_CASES]
    for row in table["rows"]:
        figures = row["figures"]
        for mode in ("sync", "solo", "majority"):
            assert figures[f"{mode}_gps"] > 0
            assert figures[f"{mode}_rps"] > 0
            assert figures[f"{mode}_loss"] > 0
        # a partial round holds at most every rank's gradient: sync's rates are equal
        assert figures["sync_gps"] == pytest.approx(figures["sync_rps"])
        assert figures["solo_gps"] <= figures["solo_rps"] * (1 + 1e-9)
        # the ratio is solo's, sync's seconds over solo's (one repetition: no median to take)
        if figures["sync_ttt"] is not None and figures["solo_ttt"] is not None:
            assert row["ratio"] == pytest.approx(figures["sync_ttt"] / figures["solo_ttt"])
        assert figures["paper_solo"] is None  # no paper figure for the quick cases (NaN)
    assert table["target_met"] is None  # the quick cases are not the targets' cases
    for case in hyperplane.QUICK_CASES:  # one progress line per run
        for mode in ("sync", "solo", "majority"):
            assert f"[hyperplane] {case.label}, {mode} 1/1: " in progress


def test_the_modes_take_turns_at_running_first() -> None:
    orders = [hyperplane.order(r) for r in range(hyperplane.REPEATS)]
    assert orders == [
        ("sync", "solo", "majority"),
        ("solo", "majority", "sync"),
        ("majority", "sync", "solo"),
    ]


def _run(mode: str, reached: float | None, gps: float = 1.0) -> ModeResult:
    return ModeResult(
        mode=mode,
        steps=10,
        seconds=40.0,
        time_to_target=reached,
        gradients_per_s=gps,
        rounds_per_s=2 * gps,
        initial_loss=100.0,
        final_loss=3.0,
        mean_active=8.0,
    )


def test_a_row_is_the_median_of_each_repetitions_ratio_against_its_own_sync() -> None:
    runs = {
        "sync": [_run("sync", 30.0), _run("sync", 20.0), _run("sync", 40.0)],
        "solo": [_run("solo", 20.0), _run("solo", 10.0), _run("solo", None)],
        "majority": [_run("majority", 15.0, 3.0), _run("majority", 25.0), _run("majority", 20.0)],
    }
    case = hyperplane.CASES[0]
    row = hyperplane.figures(runs, case)
    # solo: 1.5, 2.0 and 0 (missed) -> 1.5; not sync's median time over solo's (30 / 15)
    assert hyperplane.speedups(runs, "solo") == [1.5, 2.0, 0.0]
    assert row["solo_x"] == pytest.approx(1.5)
    assert row["majority_x"] == pytest.approx(2.0)  # 2.0, 0.8 and 2.0
    assert row["sync_ttt"] == 30.0
    assert row["solo_ttt"] == 15.0  # the median of the runs that reached it
    assert row["majority_gps"] == 1.0
    assert row["paper_solo"] == 1.5
    missed = {"sync": [_run("sync", None)], "solo": [_run("solo", 9.0)]}
    missed["majority"] = [_run("majority", None)]
    empty = hyperplane.figures(missed, case)
    assert math.isnan(empty["sync_ttt"])
    assert math.isnan(empty["solo_x"])  # no sync time: nothing to compare with


def test_the_targets_are_checked_on_their_cases_only() -> None:
    def table(rows: dict[str, tuple[float, float | None, float | None]]) -> Table:
        """Rows as the benchmark adds them, from sync's, solo's and majority's times."""
        out = Table(name="hyperplane", title="", columns=[], ratio="")
        for label, (sync, solo, majority) in rows.items():
            runs = {
                "sync": [_run("sync", sync)],
                "solo": [_run("solo", solo)],
                "majority": [_run("majority", majority)],
            }
            hyperplane.add_row(out, hyperplane.Case(label, "one", 1.0), runs, 0)
        return out

    assert hyperplane.met(table({"20 ms": (30.0, 10.0, 10.0)})) is None
    good = {"200 ms": (70.0, 50.0, 140.0), "400 ms": (72.0, 40.0, 71.0)}  # 1.4x, 1.8x, 1.01x
    assert hyperplane.met(table(good)) is True
    assert hyperplane.met(table({**good, "200 ms": (70.0, 51.0, 10.0)})) is False
    # majority must be faster than sync at 400 ms, not as fast, and a miss counts 0
    assert hyperplane.met(table({"400 ms": (72.0, 40.0, 72.0)})) is False
    missed = table({"400 ms": (72.0, 36.0, None)})
    assert hyperplane.met(missed) is False
    assert missed.rows[0].ratio == pytest.approx(2.0)
    assert missed.notes == ["400 ms: target missed by majority 1/1"]
