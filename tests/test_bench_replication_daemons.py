"""The real-daemon replication benchmark (bench/replication_daemons.py) runs in quick mode:
chain replication carries each update twice over the primary's link, bounded replication once
(the workers' daemons send the replica its copies), and the replica receives an update's worth
either way (bytes from the daemons' link counters; structure and accounting only, never speed:
see tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import replication_daemons
from tests.test_bench_smoke import assert_ratios, run_bench, the_table

pytestmark = pytest.mark.timeout(300)


def test_quick_mode_reports_the_primarys_bytes_for_chain_and_bounded() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "replication-daemons")
    table = the_table(result, "replication-daemons")
    rows = table["rows"]
    assert len(rows) == len(replication_daemons.QUICK_WORKERS)
    assert_ratios(table)
    for row in rows:
        f = row["figures"]
        update = f["update_kb"]
        # every push crosses the primary's link once; the chain forwards it once more
        assert update <= f["none_kb"] < 1.2 * update
        assert f["chain_kb"] >= 1.8 * update
        assert update <= f["bounded_kb"] < 1.2 * update
        # the replica gets each update once either way: a forward or a worker's copy
        for replica in (f["replica_chain_kb"], f["replica_bounded_kb"]):
            assert update <= replica < 1.2 * update
        assert row["ratio"] == pytest.approx(f["chain_kb"] / f["bounded_kb"])
        assert f["sched_t"] > 0  # the scheduled bounded setup ran too (its copies planned)
        assert f"[replication-daemons] {row['label']}: " in progress
