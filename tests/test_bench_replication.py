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
        assert figures["chain_mb"] == pytest.approx(figures["updates"] * replication.SIZE / 1e6)
        assert row["ratio"] == pytest.approx(figures["chain_mb"] / figures["mlfabric_mb"])
        assert figures["lag_max"] <= figures["bound"]  # the count bound holds after each batch
        assert f"[replication] {row['label']}: " in progress


def test_every_update_reaches_the_replica_once_counted() -> None:
    """Chain's bytes are one update's per update; MLfabric's can be fewer (aggregates) but the
    replica gets every update: a run whose replica link is no bottleneck saves little."""
    out = replication.simulate(4, 1, 5.0, seed=1)
    assert out.updates > 0
    assert out.chain_bytes == out.updates * replication.SIZE
    assert 0 < out.replica_bytes <= out.chain_bytes
    tight = replication.simulate(8, 5, 5.0, seed=1, replica_down=0.25)
    assert tight.replica_bytes < tight.chain_bytes  # aggregates at the replica's aggregators
