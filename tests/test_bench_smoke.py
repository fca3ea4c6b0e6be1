"""The benchmarks run and report a ratio for every case (structure only, never speed).

Each benchmark runs in ``--quick`` mode in a subprocess, as ``make bench`` would run it, with
``--json``; the tests check the shape of what it printed.  No assertion here is about how fast
anything is: on a shared two-core machine that would be a flaky test, and the figures belong in
docs/performance.md, not in CI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import (
    disconnect,
    framecost,
    handoff,
    hopfloor,
    integrity,
    latency,
    mesh,
    rate,
    roundtrip,
    servicecost,
    skew,
    throughput,
)
from bench.report import Column, Table, batch_figures, fmt_size, median, percentile

ROOT = Path(__file__).resolve().parent.parent


def run_bench(*args: str) -> tuple[dict, str]:
    """Run ``python -m bench ARGS`` from the repository root; return (JSON, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout), done.stderr


def the_table(result: dict, name: str) -> dict:
    [table] = [t for t in result["benchmarks"] if t["name"] == name]
    return table


def assert_ratios(table: dict) -> None:
    for row in table["rows"]:
        assert isinstance(row["ratio"], float), row
        assert math.isfinite(row["ratio"]), row
        assert row["ratio"] > 0, row


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "sizes"),
    [("handoff", handoff.QUICK_SIZES), ("throughput", throughput.QUICK_SIZES)],
)
def test_size_sweep_reports_a_ratio_for_every_size(name: str, sizes: list[int]) -> None:
    result, progress = run_bench("--quick", "--json", "--only", name)
    table = the_table(result, name)
    assert [row["nbytes"] for row in table["rows"]] == sizes
    assert_ratios(table)
    for row in table["rows"]:
        assert set(row["figures"]) >= {"baseline" if name == "handoff" else "raw", "fabricd"}
    lines = [line for line in progress.splitlines() if line.startswith(f"[{name}]")]
    for size in sizes:  # one progress line per case
        label = fmt_size(size) if size else "0 B"
        assert any(line.startswith(f"[{name}] {label}:") and "ratio" in line for line in lines)
    assert table["target_met"] in (True, False, None)
    assert result["machine"]["cpus"].isdigit()


@pytest.mark.slow
def test_latency_reports_ratios_and_the_end_to_end_figure() -> None:
    result, _ = run_bench("--quick", "--json", "--only", "latency")
    table = the_table(result, "latency")
    expected = [f"{latency.FRAME_SIZE} B, {where}" for where, _ in latency.placements()]
    assert [row["label"] for row in table["rows"]] == expected
    assert_ratios(table)
    for row in table["rows"]:
        assert set(row["figures"]) >= {"raw_median", "raw_p99", "fabricd_median", "fabricd_p99"}
    [extra] = table["extras"]
    assert set(extra["figures"]) == {"median", "p99"}
    assert all(value > 0 for value in extra["figures"].values())


def test_framecost_reports_the_ratio_against_the_fewest_pending() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "framecost")
    table = the_table(result, "framecost")
    assert [row["label"] for row in table["rows"]] == [f"{n} pending" for n in framecost.PENDING]
    assert_ratios(table)
    assert table["rows"][0]["ratio"] == 1.0  # the baseline is the first row
    for row, pending in zip(table["rows"], framecost.PENDING, strict=True):
        assert row["figures"]["pending"] == pending
        assert row["figures"]["us"] > 0
    assert table["target_met"] in (True, False)
    assert progress.count("[framecost] ") >= len(framecost.PENDING)


def test_framecost_waits_in_every_index_a_frame_could_scan() -> None:
    """A ratio of 1x proves nothing about an index nothing waits in: messages waiting for their
    receive are the commonest thing a busy daemon holds (a send announced before its receive
    is posted), and a scan over them on every receive must show in the figure."""
    pair = framecost.Pair(40)
    for engine in pair.engines:
        stats = engine.statistics()
        assert stats.receives >= 10  # posted receives, some with route deadlines
        assert stats.sends >= 10  # sends waiting for a route, and sends announced (RTS)
        assert stats.unrouted >= 10  # route deadlines
        assert stats.unexpected >= 10  # the peer's announced sends, waiting for a receive
    pair.check()  # and a rendezvous still goes through untouched by them


def test_servicecost_reports_every_services_inputs_against_the_fewest_waiting() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "servicecost")
    table = the_table(result, "servicecost")
    labels = [row["label"] for row in table["rows"]]
    for kind in servicecost.CASES:
        for what in ("request", "frame", "tick"):
            assert f"{kind.name}: {what}" in labels
    assert "collectives: request that waits" in labels  # the finding's own request
    assert_ratios(table)
    for row in table["rows"]:
        assert row["figures"]["few"] > 0
        assert row["figures"]["many"] > 0
    assert table["settings"]["waiting"] == list(servicecost.QUICK_WAITING)
    assert progress.count("[servicecost] ") >= len(table["rows"])


def test_servicecost_makes_the_calls_it_says_wait() -> None:
    """A ratio of 1x proves nothing about calls that do not wait: each service holds them."""
    collectives = servicecost.Collectives(40)
    counters = collectives.pair.services[0].statistics()["counters"]
    assert counters["collective_calls_waiting_for_ranks"] == 40
    stochastic = servicecost.Stochastic(40)
    counters = stochastic.pair.services[0].statistics()["counters"]
    assert counters["reduce_calls_waiting_for_ranks"] == 40
    ps = servicecost.ParameterServer(40)
    assert len(ps.pair.services[0]._calls) == 40 + 0  # type: ignore[attr-defined]
    p2p = servicecost.PointToPoint(40)
    assert p2p.pair.services[0].statistics()["pending_ops"] == 40
    for case in (collectives, stochastic, ps, p2p):  # and the measured inputs go through
        case.request()
        case.frame()
        case.tick_at(case.prepare_tick())
        case.check()


def test_disconnect_reports_the_stall_and_cleanup_for_every_size_and_case() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "disconnect")
    table = the_table(result, "disconnect")
    expected = [f"{label}, {n}" for label, *_ in disconnect.CASES for n in disconnect.QUICK_SIZES]
    assert [row["label"] for row in table["rows"]] == expected
    assert_ratios(table)
    for index, row in enumerate(table["rows"]):
        if index % len(disconnect.QUICK_SIZES) == 0:
            assert row["ratio"] == 1.0  # each case's smallest N is its baseline
        assert row["figures"]["pending"] == row["nbytes"]
        assert set(row["figures"]) >= {"stall_ms", "stall_us", "cleanup_ms", "cpu_us", "kept_mb"}
        assert row["figures"]["cleanup_ms"] > 0
        assert row["figures"]["cpu_us"] > 0
    assert len(table["extras"]) == len(disconnect.CASES)
    assert progress.count("[disconnect] ") >= len(expected)


def test_table_renders_a_ratio_for_every_row() -> None:
    table = Table(name="t", title="a title", columns=[Column("a", "A")], ratio="a / b")
    table.add("4 KiB", 4096, 0.5, a=1.0)
    table.add("1 MiB", 1 << 20, 2.0, a=2.0)
    text = table.render().splitlines()
    assert text[0] == "a title"
    assert text[2].split() == ["size", "A", "ratio"]
    assert text[3].split()[-1] == "0.500x"
    assert text[4].split()[-1] == "2.00x"
    markdown = table.render(markdown=True).splitlines()
    assert markdown[0] == "| size | A | ratio |"
    assert markdown[2].endswith("| 0.500x |")


def test_statistics() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0
    assert batch_figures("x", [[1e-6, 3e-6], [2e-6, 4e-6, 6e-6]]) == pytest.approx(
        {"x_median": 3.0, "x_p99": 6.0, "x_low": 2.0, "x_high": 4.0}
    )


@pytest.mark.slow
def test_integrity_reports_mac_against_none_for_every_size() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "integrity")
    table = the_table(result, "integrity")
    assert [row["nbytes"] for row in table["rows"]] == integrity.QUICK_SIZES
    assert_ratios(table)
    for row in table["rows"]:
        assert {"none", "mac", "none_spread", "mac_spread"} <= row["figures"].keys()
    assert progress.count("[integrity] ") >= len(integrity.QUICK_SIZES)


def test_integrity_frame_reports_sealed_against_unsealed_per_kind() -> None:
    result, _ = run_bench("--quick", "--json", "--only", "integrity-frame")
    table = the_table(result, "integrity-frame")
    assert [row["label"] for row in table["rows"]] == ["HEARTBEAT", "RTS", "DATA head"]
    assert_ratios(table)
    [extra] = table["extras"]
    assert set(extra["figures"]) == {"BLAKE2b-128 keyed", "HMAC-SHA256"}


def test_roundtrip_reports_every_side_the_ratio_to_the_floor_and_the_cpu_per_hop() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "roundtrip")
    table = the_table(result, "roundtrip")
    [row] = table["rows"]
    assert row["nbytes"] == roundtrip.NBYTES == 1
    assert_ratios(table)
    figures = row["figures"]
    for side in roundtrip.SIDES:
        low, high = figures[f"{side}_low"], figures[f"{side}_high"]
        assert 0 < low <= high
        assert figures[f"{side}_p99"] > 0
    assert row["ratio"] == pytest.approx(figures["fabricd_median"] / figures["floor_median"])
    assert figures["vs_raw"] == pytest.approx(figures["fabricd_median"] / figures["raw_median"])
    assert table["target"] == "ratio <= 4"
    assert table["target_met"] in (True, False)
    pinned, *cpu = table["extras"]
    assert list(pinned["figures"]) == [label for label, _ in roundtrip.pinnings()]
    assert all(value > 0 for value in pinned["figures"].values())
    processes = {
        "raw": ["pinger", "echo"],
        "floor": ["client 0", "relay A", "relay B", "client 1"],
        "fabricd": ["rank 0", "daemon 0", "daemon 1", "rank 1"],
    }
    assert len(cpu) == len(processes)
    for extra, (side, names) in zip(cpu, processes.items(), strict=True):
        assert side in extra["label"]
        assert list(extra["figures"]) == [*names, "all"]
        assert all(value > 0 for value in extra["figures"].values())
        assert extra["figures"]["all"] == pytest.approx(sum(extra["figures"][n] for n in names))
    assert progress.count("[roundtrip] batch ") == table["settings"]["batches"]


def test_rate_reports_every_side_and_the_ratio_to_the_floor_for_every_window() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "rate")
    table = the_table(result, "rate")
    labels = [f"4 KiB, window {w}" + (", sent" if wait == "sent" else "") for w, wait in rate.MODES]
    assert [row["label"] for row in table["rows"]] == labels
    assert_ratios(table)
    for row in table["rows"]:
        figures = row["figures"]
        assert row["nbytes"] == rate.NBYTES
        for side in rate.SIDES:
            assert figures[f"{side}_rate"] == pytest.approx(1e6 / figures[f"{side}_us"])
            assert figures[f"{side}_spread"] >= 0
        assert row["ratio"] == pytest.approx(figures["fabricd_us"] / figures["floor_us"])
        assert figures["vs_raw"] == pytest.approx(figures["fabricd_us"] / figures["raw_us"])
        assert figures["messages"] == table["settings"]["messages"]
    assert table["target"] == "ratio <= 3 (every row)"
    assert table["target_met"] in (True, False)
    for label in labels:  # one progress line per case
        assert f"[rate] {label}: " in progress


def test_hopfloor_reports_the_floor_against_the_direct_pair_for_every_case() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "hopfloor")
    table = the_table(result, "hopfloor")
    assert [row["label"] for row in table["rows"]] == [case.label for case in hopfloor.CASES]
    assert_ratios(table)
    for row, case in zip(table["rows"], hopfloor.CASES, strict=True):
        figures = row["figures"]
        assert row["nbytes"] == case.nbytes
        assert row["ratio"] == pytest.approx(figures["floor_median"] / figures["direct_median"])
        assert 0 < figures["floor_low"] <= figures["floor_high"]
        assert ("floor_p99" in figures) == case.round_trip
        assert 0 < figures["cpu_relay"] < figures["cpu_all"]
        assert f"[hopfloor] {case.label}: " in progress
    assert table["target"] is None


def test_hopfloor_runs_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.hopfloor", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("the hop floor: ")
    for case in hopfloor.CASES:
        [line] = [line for line in lines if line.strip().startswith(case.label)]
        assert line.endswith("x")


@pytest.mark.slow
def test_skew_puts_the_hop_floor_of_its_message_beside_its_figures() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "skew")
    table = the_table(result, "skew")
    [extra] = table["extras"]
    assert extra["label"].startswith("hop floor: 4 KiB round trip")
    assert set(extra["figures"]) == {"median", "p99"}
    assert 0 < extra["figures"]["median"] <= extra["figures"]["p99"]
    assert progress.count("hop floor") == len(skew.QUICK_RANKS)


@pytest.mark.slow
def test_mesh_counts_two_links_per_peer_and_extrapolates_to_a_thousand_nodes() -> None:
    result, progress = run_bench("--quick", "--json", "--only", "mesh")
    table = the_table(result, "mesh")
    assert [row["label"] for row in table["rows"]] == ["1 node"] + [
        f"{n} nodes" for n in mesh.QUICK_SIZES
    ]
    assert_ratios(table)
    for size, row in zip(mesh.QUICK_SIZES, table["rows"][1:], strict=True):
        assert row["figures"]["links"] == 2 * (size - 1)  # a full mesh: control and data
        assert row["figures"]["frames_s"] > 0  # (an idle mesh still heartbeats)
    [extra] = table["extras"]
    assert extra["figures"]["links"] == 2 * (mesh.EXTRAPOLATE_TO - 1)
    assert extra["figures"]["frames_s"] > 0
    assert f"[mesh] {mesh.QUICK_SIZES[-1]} daemons: meshed" in progress
