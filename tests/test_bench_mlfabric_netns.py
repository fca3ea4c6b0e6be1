"""``bench/mlfabric_netns.py`` where it cannot run, and its table (no daemons: the experiment
itself is tests/network/test_mlfabric.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from bench import mlfabric_netns
from bench.mlfabric_netns import ModeResult, Settings, tabulate

if TYPE_CHECKING:
    import pytest


def test_without_namespaces_it_prints_one_line_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mlfabric_netns, "why_not", lambda: "network namespace tests need root")
    table = mlfabric_netns.run(quick=True)
    assert table.render() == "mlfabric-netns: skipped: network namespace tests need root"
    assert table.rows == []


def _result(mode: str, applied: int, push_bytes: int, delays: list[int]) -> ModeResult:
    server: dict[str, Any] = {
        "applied": applied,
        "push_bytes": push_bytes,
        "delays": delays,
        "delay_sum": 3 * applied,
        "dropped_scheduled": 1,
        "aggregates": 0,
        "aggregates_refused": 0,
        "pushes": applied,
        "resent": 0,
    }
    return ModeResult(mode, 10.0, 6, applied + 2, applied, 2, (), server, True, applied)


def test_the_table_compares_each_mode_with_arrival() -> None:
    delays = [0, 0, 0, 5, 5, 0, 0, 0, 0, 0, 0]
    results = [_result("arrival", 30, 30 << 20, delays), _result("mlfabric", 60, 30 << 20, delays)]
    table = tabulate(results, Settings())
    arrival, scheduled = table.rows
    assert arrival.ratio == 1.0
    assert scheduled.ratio == 2.0  # twice the pushes applied in the same time
    assert scheduled.figures["per_iteration"] == 1.0  # 10 s x 6 workers / 60 applied
    assert scheduled.figures["largest"] == 8.0  # the highest non-empty bucket's bound
    assert np.isclose(table.extras[0].figures["mlfabric"], 2.0)
    assert "yes, every mode" in table.notes[0]
