"""The distribution-tree benchmark (bench/distribution.py) runs in quick mode: trees never
make the server send more than answering every pull itself, and the figures are consistent
(structure and accounting only, never speed: tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import distribution
from tests.test_bench_smoke import run_bench, the_table


def test_quick_mode_reports_latency_and_server_bytes_for_each_way() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "distribution")
    table = the_table(result, "distribution")
    rows = table["rows"]
    assert len(rows) == len(distribution.QUICK_WORKERS) * len(distribution.LAGS)
    for row in rows:
        f = row["figures"]
        whole = distribution.WHOLE / 1e6
        assert f["direct_whole_mb"] == pytest.approx(row["nbytes"] * whole)  # one per pull
        assert f["tree_whole_mb"] <= f["direct_whole_mb"]
        assert f["tree_delta_mb"] <= f["tree_whole_mb"] + 1e-9
        assert f["tree_delta_mb"] <= f["direct_delta_mb"] + 1e-9  # a branch: its oldest delta
        for way in distribution.WAYS:
            tag = way.replace(" ", "_")
            assert f[f"{tag}_ms"] > 0
            assert f[f"{tag}_p95"] > 0
        assert row["ratio"] == pytest.approx(f["direct_whole_ms"] / f["tree_whole_ms"])
        assert f"[distribution] {row['label']}: " in progress
