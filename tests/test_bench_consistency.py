"""The consistency benchmark (ASAP Fig. 8) runs every sync mode and NOTIFY-ACK always uses every
input (structure and that one invariant only, never speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import pytest

from bench import consistency
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def test_summary_counts_inputs_per_reduce_and_times_per_rank() -> None:
    fast = {"results": [(0, 3, 3, 0, 0), (1, 1, 3, 1, 1)], "calls": [1.0, 3.0], "elapsed": 4.0}
    slow = {"results": [(0, 2, 3, 0, 1)], "calls": [2.0], "elapsed": 6.0}
    summary = consistency.summarise([fast, slow])
    assert summary.histogram == (0, 1, 1, 1)
    assert (summary.reduces, summary.in_degree, summary.torn, summary.stale) == (3, 3, 1, 2)
    assert summary.share(3) == pytest.approx(1 / 3)
    assert summary.share(1) == 1.0
    assert summary.share(-1) == 1.0
    assert summary.round_seconds == 4.0  # each rank's 2 s and 6 s per round count once
    assert summary.call_seconds == 2.0  # every call counts once


def test_summary_refuses_ranks_of_different_in_degrees() -> None:
    with pytest.raises(ValueError, match="one in-degree"):
        consistency.summarise([{"results": [(0, 1, 1, 0, 0), (0, 2, 2, 0, 0)]}])


@pytest.mark.slow
def test_consistency_reports_every_mode_with_notify_ack_at_every_input() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "consistency")
    table = the_table(result, "consistency")
    assert [row["label"] for row in table["rows"]] == list(consistency.MODES)
    assert_ratios(table)
    degree = consistency.QUICK_RANKS - 1  # all-to-all
    reduces = consistency.QUICK_RANKS * consistency.QUICK_ROUNDS
    for row in table["rows"]:
        figures = row["figures"]
        shares = [figures[f"in{k}"] for k in range(degree + 1)]
        assert sum(shares) == pytest.approx(100)
        assert figures["all"] == pytest.approx(shares[-1])
        assert row["ratio"] == pytest.approx(figures["all"] / 100)  # NOTIFY-ACK's is 100 %
        assert figures["round_ms"] >= figures["call_ms"] > 0
        assert f"[consistency] {row['label']}: all {degree} inputs in " in progress
    assert progress.count(f" of {reduces} reduces, ") == len(consistency.MODES)
    notify = table["rows"][0]["figures"]
    assert notify["all"] == 100.0
    assert (notify["torn"], notify["stale"]) == (0, 0)
    assert table["target_met"] is True
    assert not [note for note in table["notes"] if "the daemons counted" in note]


@pytest.mark.slow
def test_fabricctl_bench_consistency_prints_json_for_scripts() -> None:
    import json

    from click.testing import CliRunner

    from fabricd.cli.bench import bench as bench_group

    result = CliRunner().invoke(
        bench_group, ["consistency", "--quick", "--json", "--rounds", "4", "--size", "4KiB"]
    )
    assert result.exit_code == 0, result.output
    [table] = json.loads(result.output)["benchmarks"]
    rows = {row["label"]: row["figures"] for row in table["rows"]}
    assert set(rows) == set(consistency.MODES)
    assert rows["notify-ack"]["all"] == 100.0
