"""The hyperplane benchmark runs and reports a speedup over sync for every delay (structure
only, never speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import hyperplane
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def test_hyperplane_reports_solo_and_majority_against_sync_for_every_delay() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "hyperplane")
    table = the_table(result, "hyperplane")
    assert [row["label"] for row in table["rows"]] == [
        f"{d:g} ms" for d in hyperplane.QUICK_DELAYS_MS
    ]
    assert_ratios(table)
    for row in table["rows"]:
        figures = row["figures"]
        assert row["ratio"] == pytest.approx(figures["solo"] / figures["sync"])
        assert figures["majority_speedup"] == pytest.approx(figures["majority"] / figures["sync"])
        for mode in ("sync", "solo", "majority"):
            assert figures[mode] > 0
            assert figures[f"{mode}_loss"] > 0
    assert table["target_met"] in (True, False)
    for delay in hyperplane.QUICK_DELAYS_MS:  # one progress line per run
        for mode in ("sync", "solo", "majority"):
            assert f"[hyperplane] {delay:g} ms, {mode}: " in progress
