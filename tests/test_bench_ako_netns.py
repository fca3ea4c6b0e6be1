"""``bench/ako_netns.py`` (a2): where namespaces are unavailable it prints one line and runs
nothing; where they are, its quick run trains on real daemons in shaped namespaces and Ako
sends fewer bytes per round than all-to-all exchange (the daemons' own counters: exact, not a
speed)."""

from __future__ import annotations

import math

import pytest

from bench import ako_model, ako_netns
from tests.test_bench_smoke import run_bench, the_table

pytestmark = pytest.mark.timeout(300)


def test_without_namespaces_it_prints_one_line_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ako_netns, "why_not", lambda: "network namespace tests need root")
    table = ako_netns.run(quick=True)
    assert table.render() == "ako-netns: skipped: network namespace tests need root"
    assert table.rows == []


@pytest.mark.skipif(ako_netns.why_not() is not None, reason="no network namespaces here")
def test_quick_mode_trains_and_ako_sends_a_share_of_all_to_all() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "ako-netns")
    table = the_table(result, "ako-netns")
    assert [row["label"] for row in table["rows"]] == [
        f"{n} ranks" for n in ako_netns.QUICK_WORKERS
    ]
    for row in table["rows"]:
        f = row["figures"]
        ranks = row["nbytes"]
        model_bytes = ako_model.PARAMETERS * 4
        # p = 1 sends every peer the whole window each round; Ako a part of it
        assert f["all_to_all_bytes"] >= (ranks - 1) * model_bytes
        assert f["ako_bytes"] < f["all_to_all_bytes"]
        assert 1 <= f["p"] <= ako_model.PARAMETERS
        assert f["ako_rounds"] >= 1
        assert math.isnan(row["ratio"]) or row["ratio"] > 0
        assert f"[ako-netns] {row['label']}: " in progress
