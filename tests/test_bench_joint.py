"""The joint-reservation benchmark (bench/joint.py) runs in quick mode: joint plans apply
every update to the whole model, and at least as many whole updates per batch as independent
per-server ordering (structure and accounting only, never speed: tests/test_bench_smoke.py)."""

from __future__ import annotations

from bench import joint
from tests.test_bench_smoke import run_bench, the_table


def test_quick_mode_reports_partial_updates_of_independent_ordering() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "joint")
    table = the_table(result, "joint")
    assert len(table["rows"]) == len(joint.QUICK_WORKERS)
    for row in table["rows"]:
        f = row["figures"]
        assert 0.0 <= row["ratio"] < 1.0  # a share of the applied updates
        assert f["spread_joint"] == 1.0  # every server applies the same updates
        assert f["whole_joint"] >= f["whole_ind"]
        assert f"[joint] {row['label']}: " in progress


def test_joint_plans_never_apply_part_of_an_update() -> None:
    figures = joint.compare(8, 5, seed=1)
    assert figures["spread_joint"] == 1.0
    assert figures["partial_ind"] > 0.0  # the setting does split updates when independent
