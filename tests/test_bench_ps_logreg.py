"""The parameter-server LR benchmark (TDF §IV on real daemons): its table's cuts and ratios are
the daemons' byte counts against each model's unfiltered job (structure and arithmetic only,
never speed: see tests/test_bench_smoke.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from bench import ps_logreg
from fabricd.demo.logreg_fabric import Case, CaseResult
from tests.test_bench_smoke import assert_ratios, run_bench, the_table

MIB = float(1 << 20)


def _result(case: Case, push: int, pull: int, accuracy: float, seconds: float) -> CaseResult:
    return CaseResult(
        case=case,
        push_bytes=push,
        push_dense_bytes=1000,
        pull_bytes=pull,
        pull_dense_bytes=1000,
        pushes=10,
        pulls=10,
        considered=100,
        pushed=100,
        applied=10,
        version=10,
        delays=(6, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        delay_sum=2 + 4,
        dropped_worker=0,
        dropped_server=0,
        accuracy=accuracy,
        log_loss=0.5,
        seconds=seconds,
    )


def test_cuts_ratios_and_the_target_come_from_each_models_baseline() -> None:
    bsp, ssp = Case(consistency="bsp"), Case(consistency="ssp", staleness=4)
    tdf = ps_logreg.FILTERS["tdf"]
    results = [
        _result(bsp, 1000, 1000, 0.700, 10.0),
        _result(replace(bsp, filters=tdf, label="tdf"), 200, 100, 0.697, 12.0),
        _result(ssp, 2000, 1000, 0.710, 8.0),
        _result(replace(ssp, filters=tdf, label="tdf"), 100, 300, 0.700, 4.0),
    ]
    table = ps_logreg.tabulate(ps_logreg.settings(quick=True), results)
    rows = {row.label: row for row in table.rows}
    assert list(rows) == ["bsp, unfiltered", "bsp, tdf", "ssp4, unfiltered", "ssp4, tdf"]
    assert rows["bsp, unfiltered"].ratio == 1.0
    assert rows["bsp, tdf"].ratio == pytest.approx(2000 / 300)
    assert rows["bsp, tdf"].figures["push_cut"] == pytest.approx(80.0)
    assert rows["bsp, tdf"].figures["pull_cut"] == pytest.approx(90.0)
    assert rows["bsp, tdf"].figures["accuracy_change"] == pytest.approx(-0.3)
    assert rows["bsp, tdf"].figures["time_ratio"] == pytest.approx(1.2)
    assert rows["ssp4, tdf"].ratio == pytest.approx(3000 / 400)  # against ssp4's own baseline
    assert rows["ssp4, tdf"].figures["push_cut"] == pytest.approx(95.0)
    assert rows["ssp4, tdf"].figures["pull_cut"] == pytest.approx(70.0)
    assert rows["ssp4, tdf"].figures["time_ratio"] == pytest.approx(0.5)
    assert rows["ssp4, tdf"].figures["mean_delay"] == pytest.approx(0.6)
    assert rows["ssp4, tdf"].figures["max_delay"] == 2  # bucket (1, 2]
    assert table.target_met is False  # ssp4's pull cut is 70 % < 77 %


def test_each_model_gets_a_baseline_then_every_filter_setting() -> None:
    labels = [(c.model, c.label) for c in ps_logreg.cases()]
    assert labels[:5] == [("bsp", "unfiltered")] + [("bsp", f) for f in ps_logreg.FILTERS]
    assert [m for m, label in labels if label == "unfiltered"] == ["bsp", "ssp4", "ssp8"]
    quick = [(c.model, c.label) for c in ps_logreg.cases(quick=True)]
    assert quick == [
        (model, label)
        for model in ("bsp", "ssp4")
        for label in ("unfiltered", *ps_logreg.QUICK_FILTERS)
    ]


@pytest.mark.slow
def test_ps_logreg_reports_the_daemons_byte_counts_and_ratios_from_them() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "ps-logreg")
    table = the_table(result, "ps-logreg")
    settings = ps_logreg.settings(quick=True)
    cases = ps_logreg.cases(quick=True)
    assert [row["label"] for row in table["rows"]] == [f"{c.model}, {c.label}" for c in cases]
    assert_ratios(table)
    steps = settings.workers * settings.iterations
    model_bytes = settings.features * 4
    baseline: dict[str, Any] = {}
    for case, row in zip(cases, table["rows"], strict=True):
        f = row["figures"]
        base = baseline.setdefault(case.model, f)
        # every push and pull counted once by the workers' daemons, each against a dense one
        # (the model and a message header)
        assert (f["pushes"], f["pulls"], f["applied"]) == (steps, steps, steps)
        for dense in (f["push_dense_bytes"], f["pull_dense_bytes"]):
            assert steps * model_bytes <= dense < steps * (model_bytes + 1024)
        assert (f["push_dense_bytes"], f["pull_dense_bytes"]) == (
            base["push_dense_bytes"],
            base["pull_dense_bytes"],
        )
        # the cuts and the ratio are these counts against the same model's unfiltered job
        assert f["push_cut"] == pytest.approx(100 * (1 - f["push_bytes"] / base["push_bytes"]))
        assert f["pull_cut"] == pytest.approx(100 * (1 - f["pull_bytes"] / base["pull_bytes"]))
        assert f["push_mib"] == pytest.approx(f["push_bytes"] / MIB)
        total = base["push_bytes"] + base["pull_bytes"]
        assert row["ratio"] == pytest.approx(total / (f["push_bytes"] + f["pull_bytes"]))
        assert 0 < f["accuracy"] <= 100
        assert f["dropped"] == 0  # no delay bound under BSP or SSP
        if case.model == "bsp":
            assert (f["mean_delay"], f["max_delay"]) == (0, 0)
        if case.label == "unfiltered":  # dense both ways
            assert row["ratio"] == 1.0
            assert f["push_bytes"] == f["push_dense_bytes"]
            assert f["pull_bytes"] == f["pull_dense_bytes"]
        else:  # the data are sparse: every filter setting moves less, both ways
            assert f["push_bytes"] < base["push_bytes"]
            assert f["pull_bytes"] < base["pull_bytes"]
        assert f"[ps-logreg] {row['label']}: push -" in progress
    assert table["target_met"] in (True, False)
    assert [e["label"] for e in table["extras"]][:2] == [
        "TDF §IV, its LR against no filters: traffic cut",
        "TDF §IV: accuracy cost",
    ]


def test_fabricctl_bench_ps_prints_the_table_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from fabricd.cli.bench import bench as bench_group

    bsp = Case(consistency="bsp")
    results = [
        _result(bsp, 1000, 1000, 0.7, 1.0),
        _result(replace(bsp, label="tdf"), 100, 100, 0.7, 1.0),
    ]

    def run(quick: bool, progress: Any) -> Any:
        assert quick
        return ps_logreg.tabulate(ps_logreg.settings(quick), results)

    monkeypatch.setattr(ps_logreg, "run", run)
    result = CliRunner().invoke(bench_group, ["ps", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    [table] = json.loads(result.output)["benchmarks"]
    assert table["name"] == "ps-logreg"
    assert [row["ratio"] for row in table["rows"]] == [1.0, 10.0]
