"""The replication benchmark (bench/replication.py) runs in quick mode and reports, per setting,
chain replication's replica bytes against MLfabric's (structure and accounting only, never
speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import replication
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def test_quick_mode_reports_every_setting_with_its_bytes() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "replication")
    table = the_table(result, "replication")
    rows = table["rows"]
    settings = len(replication.QUICK_REPLICA_DOWN) * len(replication.QUICK_WORKERS)
    assert len(rows) == settings * len(replication.QUICK_ITERATIONS)
    assert_ratios(table)
    for row in rows:
        figures = row["figures"]
        # chain forwards one entry per server step: a server aggregate is one
        assert 0 < figures["chain_mb"] <= figures["updates"] * replication.SIZE / 1e6
        assert figures["grouped"] <= figures["copies"]
        assert row["ratio"] == pytest.approx(
            (figures["chain_mb"] / figures["updates"])
            / (figures["mlfabric_mb"] / figures["copies"])
        )
        assert figures["lag_max"] <= figures["bound"]  # the count bound holds after each batch
        assert f"[replication] {row['label']}: " in progress


def test_the_steady_window_counts_what_reached_the_replica() -> None:
    """Bytes into the replica are at most one update's per copy (sums save), and with the
    replica's link a bottleneck some copies travel summed."""
    out = replication.simulate(4, 1, 15.0, seed=1)
    assert out.updates > 0
    assert out.copies > 0
    assert 0 < out.replica_bytes <= out.copies * replication.SIZE
    assert out.chain_bytes <= out.updates * replication.SIZE
    tight = replication.simulate(8, 5, 15.0, seed=1, replica_down=0.25)
    assert tight.grouped > 0
    assert tight.replica_bytes < tight.copies * replication.SIZE
