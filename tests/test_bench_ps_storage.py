"""The timed parameter storage benchmark reports every chunk size against a version per parameter
(structure and exact byte counts only, never speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import ps_storage
from fabricd.engines.ps.storage import Encoding
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def test_changes_are_the_share_asked_scattered_or_in_runs() -> None:
    rng = np.random.default_rng(0)
    count = 100_000
    scattered = ps_storage.changed(rng, count, 0.01, "random")
    assert np.count_nonzero(scattered) == count // 100
    runs = ps_storage.changed(rng, count, 0.10, "in runs")
    assert 0 < np.count_nonzero(runs) <= count // 10  # overlapping runs change fewer
    edges = np.flatnonzero(np.diff(runs.astype(np.int8)) == 1)  # where a stretch of runs starts
    assert edges.size <= count // 10 // ps_storage.RUN


def test_reports_every_case_with_the_per_parameter_baseline_first() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "ps-storage")
    table = the_table(result, "ps-storage")
    labels = [
        f"{fraction:.0%} {pattern}, chunk {chunk}"
        for fraction in ps_storage.FRACTIONS
        for pattern in ps_storage.PATTERNS
        for chunk in ps_storage.CHUNKS
    ]
    assert [row["label"] for row in table["rows"]] == labels
    assert_ratios(table)
    count = ps_storage.QUICK_PARAMETERS
    assert table["settings"]["parameters"] == count
    per_case = len(ps_storage.CHUNKS)
    for start in range(0, len(labels), per_case):
        baseline = table["rows"][start]["figures"]
        for row in table["rows"][start : start + per_case]:
            figures = row["figures"]
            chunk = figures["chunk"]
            assert row["nbytes"] == 4 * count
            assert row["ratio"] == pytest.approx(baseline["kb1"] / figures["kb1"])
            assert figures["ratio4"] == pytest.approx(baseline["kb4"] / figures["kb4"])
            assert figures["versions_kb"] == pytest.approx(-(-count // chunk) * 8 / 1e3)
            for behind in ps_storage.BEHIND:
                assert figures[f"enc{behind}"] in {int(e) for e in Encoding}
                assert 0 < figures[f"kb{behind}"] <= (40 + 4 * count) / 1e3  # at most dense
                assert figures[f"build{behind}_ms"] > 0
            assert figures["kb1"] <= figures["kb4"]  # four rounds carry at least what one does
            assert figures["apply_ms"] > 0
        assert table["rows"][start]["ratio"] == 1.0
    for label in labels:  # one progress line per case
        assert f"[ps-storage] {label}: 1 behind " in progress
