"""Ako's benchmark (bench/ako.py) runs in quick mode and its parts measure what they say
(structure and accounting only, never speed: tests/test_bench_smoke.py)."""

from __future__ import annotations

from bench import ako, ako_model
from tests.test_bench_smoke import run_bench, the_table


def test_quick_mode_times_ako_all_to_all_and_allreduce() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "ako")
    table = the_table(result, "ako")
    assert len(table["rows"]) == len(ako.QUICK_WORKERS)
    for row in table["rows"]:
        f = row["figures"]
        assert f["p"] == ako.auto_partitions(row["nbytes"])
        # a round sends each of the n - 1 peers one of the p parts
        parts = (row["nbytes"] - 1) * ako_model.PARAMETERS * 8 / f["p"]
        assert 0.99 * parts <= f["ako_bytes"] <= 1.01 * parts
        assert f["all_to_all_bytes"] > f["ako_bytes"]
        assert f"[ako] {row['label']}: " in progress


def test_every_run_trains_the_model_and_ako_sends_a_flat_share() -> None:
    problem = ako_model.problem(1)
    runs = {n: ako.exchange(n, ako.auto_partitions(n), problem, rounds=5) for n in (4, 16)}
    assert max(r.bytes_per_round for r in runs.values()) <= 1.1 * min(
        r.bytes_per_round for r in runs.values()
    )
    assert all(r.rounds == 5 for r in runs.values())
    done = ako.exchange(4, ako.auto_partitions(4), problem)
    assert done.seconds is not None
    assert done.accuracy >= ako_model.TARGET
    sync = ako.allreduce(4, problem)
    assert sync.seconds is not None
    assert sync.accuracy >= ako_model.TARGET
