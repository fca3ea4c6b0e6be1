"""``bench/mlfabric_netns.py`` where it cannot run, its table and monitor notes, and
``bench/netns_shift.py``'s moving slowdown on a fake net (no daemons: the experiment itself is
tests/network/test_mlfabric.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import mlfabric_netns
from bench.mlfabric_netns import RING, SHIFT, ModeResult, Settings, monitor_notes, tabulate
from bench.netns_shift import Sample, Shift

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


def _rows(up_mbit: dict[int, float], source: str = "measured") -> list[dict[str, Any]]:
    return [
        {"node": node, "up": mbit * 1e6 / 8, "down": mbit * 1e6 / 8, "source": source}
        for node, mbit in up_mbit.items()
    ]


def test_rr_sync_has_no_server_figures_and_every_row_is_set_against_it() -> None:
    delays = [0, 0, 0, 5, 5, 0, 0, 0, 0, 0, 0]
    ring = ModeResult(RING, 10.0, 6, 60, 60, 0, (), None, True, 10)
    results = [_result("bsp", 30, 30 << 20, delays), ring]
    table = tabulate(results, Settings())
    bsp, rr = table.rows
    assert rr.ratio == 2.0  # BSP's 2 s per iteration over RR-Sync's 1 s
    assert np.isnan(rr.figures["kib"])
    assert "rr-sync" not in table.extras[0].figures  # no server: no inbound bytes
    assert table.extras[1].figures == {"bsp": 0.5, "rr-sync": 1.0}
    assert bsp.ratio == 1.0


def test_the_monitor_notes_set_measured_rates_beside_the_true_ones() -> None:
    true = {3: 10.0, 1: 100.0, 2: 100.0}
    samples = (
        Sample(1.0, true, _rows({0: 100.0, 1: 90.0, 2: 50.0, 3: 20.0})),
        Sample(2.0, true, _rows({0: 100.0, 1: 90.0, 2: 50.0, 3: 20.0}, "default")),
    )
    result = replace(_result("mlfabric+agg", 30, 30 << 20, [0] * 11), condition=SHIFT)
    notes = monitor_notes([replace(result, samples=samples)])
    assert notes[0].startswith("monitor (shift: mlfabric+agg)")
    assert "1s: n1 90/90 (100), n2 50/50 (100), n3 20/20 (10)" in notes[0]
    assert "n3 20/20 (10) [default]" in notes[0]
    assert "the slowed host: up median 2.00 (2.00-2.00), down median 2.00" in notes[1]
    assert "2 figures (up and down) not yet measured" in notes[1]  # the default one
    assert "the other hosts: up median 0.70 (0.50-0.90)" in notes[2]


class _FakeNet:
    def __init__(self) -> None:
        self.rates: dict[int, float] = {}
        self.changes = 0

    def set_rate(self, node: int, mbit: float) -> None:
        self.rates[node] = mbit
        self.changes += 1


def test_a_shift_moves_the_slowdown_in_order_and_samples_before_each_move() -> None:
    net = _FakeNet()
    shift = Shift(net, (3, 1, 2), 100.0, 10.0, 0.04, observe=lambda: [], every=0.02)
    assert [shift.slow_host(at) for at in (0.0, 0.05, 0.09, 0.13)] == [3, 1, 2, 3]
    with shift:
        assert net.rates == {3: 10.0, 1: 100.0, 2: 100.0}  # the first host slowed at once
        for _ in range(500):  # bounded: at most 5 s of polling
            if len(shift.samples) >= 4:
                break
            time.sleep(0.01)
    assert not shift.errors
    assert len(shift.samples) >= 4
    # each sample names the rates in force when it was taken, before that tick's move
    assert shift.samples[0].true == {3: 10.0, 1: 100.0, 2: 100.0}
    assert shift.samples[2].true == {3: 100.0, 1: 10.0, 2: 100.0}
    assert net.changes >= 3 * 2
