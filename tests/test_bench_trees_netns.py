"""``bench/trees_netns.py`` (s5): where namespaces are unavailable it prints one line and runs
nothing; where they are, its quick run on real daemons in shaped namespaces answers every pull
with the exact model (the bench checks every worker's model against the updates' sum) and the
tree sends fewer bytes from the server than direct answers (the daemons' link counters: exact,
not a speed)."""

from __future__ import annotations

import pytest

from bench import trees_netns
from tests.test_bench_smoke import assert_ratios, run_bench, the_table

pytestmark = pytest.mark.timeout(300)


def test_without_namespaces_it_prints_one_line_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trees_netns, "why_not", lambda: "network namespace tests need root")
    table = trees_netns.run(quick=True)
    assert table.render() == "trees-netns: skipped: network namespace tests need root"
    assert table.rows == []


@pytest.mark.skipif(trees_netns.why_not() is not None, reason="no network namespaces here")
def test_quick_mode_serves_every_pull_and_the_tree_saves_server_bytes() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "trees-netns")
    table = the_table(result, "trees-netns")
    assert [row["label"] for row in table["rows"]] == [
        f"{w} workers" for w in trees_netns.QUICK_WORKERS
    ]
    assert_ratios(table)
    for row in table["rows"]:
        f = row["figures"]
        workers = int(row["label"].split()[0])
        model_mb = row["nbytes"] / 1e6
        # direct: the server sends each worker the whole model; the tree less of it
        assert workers * model_mb <= f["direct_mb"] < 1.2 * workers * model_mb
        assert f["tree_mb"] < f["direct_mb"]
        assert row["ratio"] == pytest.approx(f["direct_ms"] / f["tree_ms"])
        assert f"[trees-netns] {row['label']}: direct/tree" in progress
