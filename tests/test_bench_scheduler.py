"""The MLfabric scheduler benchmark runs in quick mode and reports each batch size against the
paper's figure (structure only, never speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import scheduler
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def test_quick_mode_reports_every_size_against_the_paper() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "scheduler")
    table = the_table(result, "scheduler")
    assert [row["nbytes"] for row in table["rows"]] == list(scheduler.QUICK_SIZES)
    assert_ratios(table)
    for row in table["rows"]:
        figures = row["figures"]
        count = row["nbytes"]
        assert figures["paper_ms"] == scheduler.PAPER_MS[count]
        assert row["ratio"] == pytest.approx(figures["ms"] / figures["paper_ms"])
        assert figures["planned"] + figures["dropped"] == count
        assert 0 <= figures["direct"] <= figures["planned"]
        assert f"[scheduler] |U| = {count}: " in progress
    assert table["target_met"] in (True, False)
