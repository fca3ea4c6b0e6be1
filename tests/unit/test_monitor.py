"""The network monitor's engine under a hand-driven clock: the estimator, precedence,
staleness, reports and the reports it refuses (MLfabric §4, §7)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines.actions import Broadcast
from fabricd.engines.monitor.estimator import BUSY_BYTES, Direction, WindowedMax
from fabricd.engines.monitor.table import (
    DEFAULT_BPS,
    REPORT_BUDGET,
    LinkFigures,
    Monitor,
    PathSample,
    PeerReading,
    Settings,
)
from fabricd.frames.monitor import Report

MB = 1e6


def reading(node: int, sent: int, received: int = 0, **paths: PathSample) -> PeerReading:
    return PeerReading(node=node, sent=sent, received=received, paths=paths)


def busy(rate: float, acked: int, rtt: float = 1e-3) -> PathSample:
    return PathSample(rtt=rtt, rate=rate, app_limited=False, acked=acked)


def tick(monitor: Monitor, readings: list[PeerReading], now: float) -> Report:
    """One interval: the links read, then the report the engine sends (at ``now``, or when
    the engine is due if that is later by a rounding)."""
    due = monitor.next_deadline()
    now = max(now, due) if due is not None else now
    monitor.read(readings, now)
    actions = monitor.on_timer(now)
    assert len(actions) == 1
    assert isinstance(actions[0], Broadcast)
    report = actions[0].frame
    assert isinstance(report, Report)
    return report


def report(**fields: object) -> Report:
    base: dict = {"up": 1e8, "down": 2e8, "rtt": 1e-3, "age": 0.0, "source": "measured"}
    return Report(**{**base, **fields})


# -- the estimator -----------------------------------------------------------------------------
def test_the_windowed_max_forgets_samples_older_than_the_window_before_the_newest() -> None:
    best = WindowedMax(window=2.0)
    best.add(100.0, 0.0)
    best.add(50.0, 1.0)
    assert best.value == 100.0
    best.add(40.0, 2.5)  # 100 (t=0) is now out of the window, 50 (t=1) is not
    assert best.value == 50.0
    assert best.value == 50.0  # idle: no new sample, the estimate is held


@given(st.lists(st.tuples(st.floats(0, 1e10), st.floats(0, 1)), min_size=1, max_size=60))
def test_the_windowed_max_is_the_brute_force_max(samples: list[tuple[float, float]]) -> None:
    best = WindowedMax(window=3.0)
    now, seen = 0.0, []
    for value, step in samples:
        now += step
        best.add(value, now)
        seen.append((now, value))
        assert best.value == max(v for t, v in seen if t >= now - 3.0)


def test_available_is_capacity_less_use_but_at_least_a_new_flows_share() -> None:
    way = Direction(window=2.0)
    assert way.available is None  # unknown
    way.sample(100 * MB, 0.0)
    way.measured(use=30 * MB, flows=1)
    assert way.available == pytest.approx(70 * MB)
    way.measured(use=100 * MB, flows=1)  # saturated by one flow: a new one gets half
    assert way.available == pytest.approx(50 * MB)
    way.measured(use=300 * MB, flows=3)  # more than the samples showed: capacity follows use
    assert way.capacity == 300 * MB
    assert way.available == pytest.approx(75 * MB)


# -- precedence --------------------------------------------------------------------------------
def test_a_node_nobody_measured_has_the_default_figures() -> None:
    monitor = Monitor(Settings(node=0, nodes=3), now=0.0)
    table = monitor.network(0.0)
    assert set(table) == {0, 1, 2}
    assert table[0] == LinkFigures(DEFAULT_BPS, DEFAULT_BPS, 0.0, 0.0, "default")
    assert table[1].source == "default"
    assert math.isinf(table[1].age)
    assert monitor.stale(table[1])
    assert not monitor.stale(table[0])


def test_configured_beats_measured_beats_default() -> None:
    monitor = Monitor(Settings(node=0, nodes=2, up=5 * MB), now=0.0)
    tick(monitor, [reading(1, 0, control=busy(80 * MB, 0))], 0.2)
    tick(monitor, [reading(1, BUSY_BYTES, control=busy(80 * MB, BUSY_BYTES))], 0.4)
    own = monitor.network(0.4)[0]
    assert own.up == 5 * MB  # configured, though 80 MB/s was measured
    assert own.down == DEFAULT_BPS  # nothing measured it
    assert own.source == "default"  # the weaker of the two
    measured = Monitor(Settings(node=0, nodes=2), now=0.0)
    tick(measured, [reading(1, 0, control=busy(80 * MB, 0))], 0.2)
    tick(measured, [reading(1, 10, control=busy(80 * MB, 10))], 0.4)
    assert measured.own(0.4).up == pytest.approx(80 * MB - 10 / 0.2)
    both = Monitor(Settings(node=0, nodes=2, up=5 * MB, down=7 * MB), now=0.0)
    assert both.own(0.0) == LinkFigures(5 * MB, 7 * MB, 0.0, 0.0, "configured")


def test_app_limited_samples_of_quiet_links_measure_nothing() -> None:
    monitor = Monitor(Settings(node=0, nodes=2), now=0.0)
    quiet = PathSample(rtt=1e-4, rate=2e3, app_limited=True, acked=0)
    tick(monitor, [reading(1, 0, control=quiet)], 0.2)
    heartbeat = PathSample(rtt=1e-4, rate=2e3, app_limited=True, acked=60)
    report = tick(monitor, [reading(1, 60, control=heartbeat)], 0.4)
    assert (report.up, report.source, report.rtt) == (DEFAULT_BPS, "default", 1e-4)
    # an app-limited sample of a link that moved BUSY_BYTES counts
    bulk = PathSample(rtt=1e-4, rate=9e8, app_limited=True, acked=60 + BUSY_BYTES)
    report = tick(monitor, [reading(1, 60 + BUSY_BYTES, control=bulk)], 0.6)
    assert (report.source, report.up) == ("default", pytest.approx(9e8 - BUSY_BYTES / 0.2))
    assert report.paths == ((1, 9e8),)  # evidence of node 1's downlink


def test_a_peers_path_to_this_node_measures_its_downlink() -> None:
    monitor = Monitor(Settings(node=1, nodes=3), now=0.0)
    assert monitor.on_report(0, report(paths=((1, 40 * MB), (2, 90 * MB))), 0.1) is None
    assert monitor.on_report(2, report(paths=((1, 60 * MB),)), 0.1) is None
    assert monitor.own(0.1).down == 60 * MB  # the largest path into node 1


def test_counters_that_go_back_belong_to_new_links() -> None:
    monitor = Monitor(Settings(node=0, nodes=2), now=0.0)
    tick(monitor, [reading(1, 0, control=busy(50 * MB, 0))], 0.2)
    tick(monitor, [reading(1, 10 * BUSY_BYTES, control=busy(50 * MB, 10 * BUSY_BYTES))], 0.4)
    tick(monitor, [reading(1, 100, control=busy(50 * MB, 100))], 0.6)  # a reset: 100 B new
    assert monitor.own(0.6).up == pytest.approx(50 * MB - 100 / 0.2)


# -- reports and staleness ---------------------------------------------------------------------
def test_reports_go_out_every_interval_and_none_when_off() -> None:
    monitor = Monitor(Settings(node=0, nodes=2, interval=0.2), now=0.0)
    assert monitor.next_deadline() == 0.2
    assert monitor.on_timer(0.1) == []  # not yet due
    tick(monitor, [], 0.2)
    assert monitor.next_deadline() == pytest.approx(0.4)
    tick(monitor, [], 5.0)  # after a stall: the next one an interval on, no burst
    assert monitor.next_deadline() == 5.0
    off = Monitor(Settings(node=0, nodes=2, interval=0.0), now=0.0)
    assert off.next_deadline() is None
    assert off.on_timer(10.0) == []


def test_a_peers_figures_age_and_go_stale_after_three_intervals() -> None:
    monitor = Monitor(Settings(node=0, nodes=2, interval=0.2), now=0.0)
    monitor.on_report(1, report(up=3 * MB, age=0.05, source="configured"), now=1.0)
    fresh = monitor.network(1.1)[1]
    assert fresh == LinkFigures(3 * MB, 2e8, 1e-3, pytest.approx(0.15), "configured")
    assert not monitor.stale(fresh)
    later = monitor.network(1.7)[1]
    assert monitor.stale(later)  # 0.75 s > 3 x 0.2 s
    assert (later.up, later.source) == (3 * MB, "configured")  # the last figures are kept


@given(nodes=st.integers(2, 5000), interval=st.sampled_from([0.05, 0.2, 1.0]))
def test_a_node_sends_at_most_the_report_budget_whatever_the_fabric_s_size(
    nodes: int, interval: float
) -> None:
    monitor = Monitor(Settings(node=0, nodes=nodes, interval=interval), now=0.0)
    due = monitor.next_deadline()
    assert due is not None
    cadence = monitor.settings.cadence
    assert due == cadence >= interval  # never more often than configured
    assert (nodes - 1) / cadence <= REPORT_BUDGET * (1 + 1e-9)  # reports a second, all peers
    if (nodes - 1) / interval <= REPORT_BUDGET:
        assert cadence == interval  # a fabric within the budget: the interval as configured
    tick(monitor, [], due)
    assert monitor.next_deadline() == pytest.approx(2 * cadence)


def test_a_large_fabric_s_figures_go_stale_after_three_of_its_longer_cadences() -> None:
    monitor = Monitor(Settings(node=0, nodes=1001, interval=0.2), now=0.0)
    assert monitor.settings.cadence == pytest.approx(1000 / REPORT_BUDGET)  # 6.25 s
    monitor.on_report(1, report(age=0.0), now=0.0)
    assert not monitor.stale(monitor.network(3 * 6.25 - 0.1)[1])  # two reports missed
    assert monitor.stale(monitor.network(3 * 6.25 + 0.1)[1])


@pytest.mark.parametrize(
    "bad",
    [
        report(up=-1.0),
        report(down=math.nan),
        report(up=math.inf),
        report(down=1e14),
        report(rtt=61.0),
        report(age=-0.1),
        report(source="guessed"),
        report(paths=((7, 1e6),)),
        report(paths=((1, -5.0),)),
    ],
)
def test_a_bad_report_is_refused_and_changes_nothing(bad: Report) -> None:
    monitor = Monitor(Settings(node=0, nodes=3), now=0.0)
    assert monitor.on_report(1, report(up=4 * MB), 0.0) is None
    before = monitor.network(0.1)
    assert monitor.on_report(1, bad, 0.1) is not None
    assert monitor.network(0.1) == before
    stats = monitor.statistics()
    assert (stats.reports_received, stats.reports_refused) == (1, 1)


def test_a_report_from_itself_or_outside_the_fabric_is_refused() -> None:
    monitor = Monitor(Settings(node=0, nodes=2), now=0.0)
    assert monitor.on_report(0, report(), 0.0) is not None
    assert monitor.on_report(2, report(), 0.0) is not None
    assert monitor.statistics().reports_refused == 2


def test_readings_of_nodes_outside_the_fabric_are_ignored() -> None:
    monitor = Monitor(Settings(node=0, nodes=2), now=0.0)
    monitor.read([reading(5, 10**9, control=busy(1e9, 0))], 0.2)
    monitor.read([reading(5, 2 * 10**9, control=busy(1e9, 10**9))], 0.4)
    assert monitor.own(0.4).source == "default"


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="node"):
        Settings(node=2, nodes=2)
    with pytest.raises(ValueError, match="interval"):
        Settings(node=0, nodes=2, interval=-1)
    with pytest.raises(ValueError, match="configured"):
        Settings(node=0, nodes=2, up=0.0)
