"""MLfabric's Table 2 in virtual time (bench/mlfabric.py): the sweep's shape, determinism, the
baselines' arithmetic and the delay bound (structure and exactness only, never speed: the
simulated times are virtual and the tests never assert a wall-clock figure)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from bench import mlfabric, mlfabric_model, mlfabric_net, mlfabric_sim
from bench.mlfabric_model import COMPUTES, problem
from bench.mlfabric_net import GBPS, NETWORKS, Fluid, Trace
from bench.mlfabric_sim import QUANTUM, STRATEGIES, Setting, simulate
from fabricd.engines.ps.consistency import SGD, Coordinator, Sum
from tests.test_bench_smoke import assert_ratios, run_bench, the_table


def _setting(**changes: object) -> Setting:
    data = problem(7)
    base = Setting(
        compute="C2", network="N3", workers=8, seed=7, lr=mlfabric.LR, tau_max=8,
        target=mlfabric.target_of(data, 0.2), horizon=300.0,
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def test_quick_mode_reports_every_strategy_in_all_nine_settings() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "mlfabric")
    table = the_table(result, "mlfabric")
    expected = [
        f"8w {c}-{n} {s}"
        for c in ("C1", "C2", "C3")
        for n in ("N1", "N2", "N3")
        for s in STRATEGIES
    ]
    assert [row["label"] for row in table["rows"]] == expected
    assert_ratios(table)
    for row in table["rows"]:
        if row["label"].endswith("RR-Sync"):
            assert row["ratio"] == 1.0
        assert row["figures"]["to_target"] > 0
        assert f"[mlfabric] {row['label']}: " in progress
    assert table["target_met"] in (True, False)
    labels = [extra["label"] for extra in table["extras"]]
    assert any("MLfabric-A is >= 1.2x" in label for label in labels)
    assert any("server inbound bytes" in label for label in labels)
    for row in table["rows"]:
        sync = row["label"].endswith(("RR-Sync", "Tr-Sync", "MLfabric-S"))
        communication = row["figures"]["communication"]  # NaN, written null, if not sync
        assert (communication is not None and communication > 0) == sync
    extras = {extra["label"]: extra["figures"] for extra in table["extras"]}
    speedup = extras["MLfabric-S: RR-Sync's time to the target / MLfabric-S's"]
    assert sorted(speedup) == sorted(f"8w {c}-{n}" for c in COMPUTES for n in NETWORKS)
    assert all(v > 0 for v in speedup.values())
    assert (
        extras["largest |MLfabric-S's model - RR-Sync's| after as many iterations"]["max"] < 1e-12
    )


@pytest.mark.parametrize("strategy", ["Tr-Sync", "MLfabric-S", "Async", "MLfabric-A+agg"])
def test_a_run_is_the_same_for_the_same_seed(strategy: str) -> None:
    data = problem(7)
    first = simulate(_setting(), data, strategy)
    second = simulate(_setting(), data, strategy)
    assert (first.reached, first.seconds, first.applied) == (
        second.reached,
        second.seconds,
        second.applied,
    )
    assert first.delays == second.delays
    assert first.server_bytes == second.server_bytes
    assert first.final is not None
    assert second.final is not None
    assert np.array_equal(first.final, second.final)
    other = simulate(_setting(seed=8), data, strategy)
    assert other.seconds != first.seconds  # the seed matters


def test_rr_sync_iterations_take_the_slowest_computation_plus_the_ring_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No stragglers and every link at 10 Gbit/s (scaled): each iteration is the slowest
    worker's computation plus 2 (n - 1) / n x M / bottleneck."""
    monkeypatch.setitem(mlfabric_net.NETWORKS, "fixed", (0.0, 0.0, 0.0, 0.0, 1.0))
    monkeypatch.setitem(mlfabric_model.COMPUTES, "none", (0.0, 1.0))
    setting = _setting(compute="none", network="fixed", workers=6)
    outcome = simulate(setting, problem(7), "RR-Sync")
    assert math.isfinite(outcome.reached)
    workers = mlfabric_model.Workers(6, setting.base_compute, (0.0, 1.0), seed=setting.seed)
    ring = 2 * 5 / 6 * setting.model_bytes / (10 * GBPS)
    computing = sum(
        max(workers.draw(w, k)[0] for w in range(6)) for k in range(int(outcome.iterations))
    )
    assert outcome.seconds == pytest.approx(computing + outcome.iterations * ring, rel=1e-12)


@pytest.mark.parametrize("strategy", ["MLfabric-A", "MLfabric-A+agg"])
def test_mlfabric_a_never_applies_an_update_past_the_delay_bound(strategy: str) -> None:
    setting = _setting(tau_max=3)
    outcome = simulate(setting, problem(7), strategy)
    assert outcome.applied > 0
    assert max(outcome.delays) <= setting.tau_max
    assert outcome.dropped_scheduler > 0  # the bound was at work
    assert outcome.applied + outcome.dropped_scheduler + outcome.dropped_server <= outcome.computed


def test_aggregation_gives_the_model_of_its_applied_updates_one_by_one() -> None:
    """The server steps once per aggregate with the members' sum; the same updates applied
    one by one give the same model up to float rounding (the sum's order)."""
    setting = _setting(compute="C1", network="N1", workers=8, base_compute=0.25)
    outcome = simulate(setting, problem(7), "MLfabric-A+agg")
    assert outcome.server_bytes < outcome.delivered * setting.model_bytes  # something grouped
    assert outcome.final is not None
    assert mlfabric.replay_difference(outcome, problem(7).start, SGD(lr=setting.lr)) <= 1e-12


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, str]]:
    """Record each ``Coordinator.push_aggregate`` call: members, version before and after,
    and the first action's kind."""
    calls: list[tuple[int, int, int, str]] = []
    real = Coordinator.push_aggregate

    def push_aggregate(self: Coordinator, members, values, now):  # type: ignore[no-untyped-def]
        before = self.version
        actions = real(self, members, values, now)
        calls.append((len(members), before, self.version, type(actions[0]).__name__))
        return actions

    monkeypatch.setattr(Coordinator, "push_aggregate", push_aggregate)
    return calls


def test_aggregates_are_the_schedulers_groups_applied_through_push_aggregate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's Gather decisions reach the server as aggregates, which the coordinator
    takes whole: one step, the version advancing by the members' count, or every member
    dropped; each update is decided once (applied, or dropped by the scheduler or server)."""
    calls = _recording(monkeypatch)
    setting = _setting(compute="C1", network="N1", base_compute=0.1, server_up_gbps=80.0)
    outcome = simulate(setting, problem(7), "MLfabric-A+agg")
    assert not hasattr(mlfabric_sim, "aggregate")  # no Alg. 3 of its own
    assert len(calls) == outcome.aggregates > 0
    assert sum(n for n, *_ in calls) == outcome.grouped > outcome.aggregates  # groups of 2+
    for members, before, after, kind in calls:
        assert after - before == (members if kind == "Apply" else 0)
    keys = [(w, k) for w, k, _ in outcome.log]
    assert len(keys) == len(set(keys)) == outcome.applied
    decided = outcome.applied + outcome.dropped_scheduler + outcome.dropped_server
    assert outcome.computed - setting.workers <= decided <= outcome.computed
    assert max(outcome.delays) <= setting.tau_max


def test_exact_mode_gives_the_same_model_as_the_updates_one_by_one_bit_for_bit() -> None:
    """Updates on a power-of-two grid under the sum rule: every sum is exact, so the model
    with aggregation is exactly its applied updates applied one by one."""
    setting = _setting(
        compute="C1", network="N1", base_compute=0.1, server_up_gbps=80.0, exact=True
    )
    outcome = simulate(setting, problem(7), "MLfabric-A+agg")
    assert outcome.grouped > outcome.aggregates > 0
    assert outcome.final is not None
    assert all(np.array_equal(v, np.round(v / QUANTUM) * QUANTUM) for *_, v in outcome.log)
    assert mlfabric.replay_difference(outcome, problem(7).start, Sum()) == 0.0
    assert math.isfinite(outcome.reached)  # the sum rule trains as sgd does


def test_the_aggregation_rows_report_bytes_time_and_the_equality() -> None:
    [first, *_] = rows = mlfabric.aggregation_rows(seeds=(7,))
    assert [label for label, _ in rows] == [label for label, *_ in mlfabric.AGGREGATION_ROWS]
    for _, figures in rows:
        assert figures["server_mb_agg"] < figures["server_mb"]
        assert figures["bytes_cut"] > 1.0
        assert 0 < figures["grouped_pct"] <= 100
        assert figures["max_replay_diff"] == 0.0
        assert figures["s_per_it"] > 0
        assert figures["s_per_it_agg"] > 0
    table = mlfabric.tabulate([], quick=True, aggregation=[first])
    assert any("batches hold several updates" in extra.label for extra in table.extras)


def test_the_fluid_network_shares_a_link_fairly_and_follows_rate_changes() -> None:
    trace = Trace([0, 1, 2], (0.0, 0.0, 0.0, 0.0, 1.0), seed=1, fixed={0: 10 * GBPS})
    fluid = Fluid(trace)
    ends: list[float] = []
    fluid.start(1, 0, 10 * GBPS * 1.0, ends.append)  # 1 s alone
    fluid.start(2, 0, 10 * GBPS * 1.0, ends.append)  # sharing the server's downlink
    for _ in range(10):
        if len(ends) == 2:
            break
        fluid.advance(fluid.next_time())
    assert ends == [pytest.approx(2.0), pytest.approx(2.0)]
    assert fluid.received[0] == pytest.approx(20 * GBPS)
    fluid.start(1, 1, 5.0, ends.append)  # to itself: no link, at once
    assert ends[-1] == fluid.now
    asymmetric = Trace([0, 1], (0.0, 0.0, 0.0, 0.0, 1.0), seed=1, fixed={0: (8.0, 2.0)})
    assert (asymmetric.rate(0, 3.0, up=True), asymmetric.rate(0, 3.0, up=False)) == (8.0, 2.0)


def test_fabricctl_bench_mlfabric_prints_the_table_as_json() -> None:
    from click.testing import CliRunner

    from fabricd.cli.bench import bench as bench_group

    result = CliRunner().invoke(bench_group, ["mlfabric", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    [table] = json.loads(result.output)["benchmarks"]
    assert table["name"] == "mlfabric"
    assert len(table["rows"]) == 9 * len(STRATEGIES)


@pytest.mark.parametrize("network", ["N1", "N3"])
def test_mlfabric_s_applies_every_update_once_and_its_model_is_rr_syncs(network: str) -> None:
    """MLfabric-S moves the same contributions as the ring, by other paths, and the model steps
    with the sum that reached the root along them: every worker's update of every iteration
    reaches it exactly once (the root's own locally), and in exact mode the model is RR-Sync's
    bit for bit, iteration for iteration (only the time differs)."""
    data = problem(7)
    setting = _setting(compute="C1", network=network, exact=True, horizon=120.0)
    ring = simulate(setting, data, "RR-Sync")
    mls = simulate(setting, data, "MLfabric-S")
    assert mls.iterations == ring.iterations > 1
    keys = [(w, k) for w, k, _ in mls.log]
    n, iterations = setting.workers, int(mls.iterations)
    assert sorted(keys) == [(w, k) for w in range(n) for k in range(iterations)]
    assert mls.delivered == iterations * (n - 1)  # the root's own is local
    assert mls.applied == iterations * n
    assert ring.final is not None
    assert mls.final is not None
    np.testing.assert_array_equal(mls.final, ring.final)
    # the same: the start plus every logged contribution (all on the 2^-30 grid)
    assert all(np.array_equal(v, np.round(v / QUANTUM) * QUANTUM) for *_, v in mls.log)
    np.testing.assert_array_equal(mls.final, data.start + sum(v for *_, v in mls.log))
    assert mls.aggregates > 0
    assert mls.grouped >= 2 * mls.aggregates  # a group of one is sent straight


def test_mlfabric_s_under_sgd_matches_rr_sync_up_to_rounding() -> None:
    """Under the ``sgd`` rule the root's sum is the ring's up to the addition order."""
    data = problem(7)
    setting = _setting(compute="C2", network="N2", horizon=120.0)
    ring = simulate(setting, data, "RR-Sync")
    mls = simulate(setting, data, "MLfabric-S")
    assert mls.iterations == ring.iterations > 1
    assert ring.final is not None
    assert mls.final is not None
    np.testing.assert_allclose(mls.final, ring.final, rtol=0, atol=1e-12)


def test_mlfabric_s_groups_updates_at_aggregators_under_stragglers() -> None:
    """C2 (a worker slowed 4x now and then): the updates ready first are summed at other
    workers' hosts while the straggler computes, so the root takes fewer model sizes than
    contributions."""
    data = problem(7)
    setting = _setting(compute="C2", network="N1", horizon=200.0)
    mls = simulate(setting, data, "MLfabric-S")
    assert mls.grouped > 0
    assert mls.aggregates > 0
    assert mls.grouped > mls.aggregates  # groups of two or more
    assert mls.server_bytes < mls.delivered * setting.model_bytes
    assert 0 < mls.reduced < mls.communication < mls.seconds
