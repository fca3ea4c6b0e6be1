"""What fabricctl prints for people: figures, exit statuses, the demo's table."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from fabricd.cli import common
from fabricd.cli.common import figure
from fabricd.cli.ctl import main as fabricctl
from fabricd.cli.local_cluster import _exit_description
from fabricd.demo import ring


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.012345, "0.0123"),
        (0.000456, "0.000456"),
        (0.5, "0.500"),
        (2.345, "2.35"),
        (12.34, "12.3"),
        (123.4, "123"),
        (98765.4, "98765"),
        (0.0, "0"),
    ],
)
def test_figures_keep_three_significant_digits_without_an_exponent(value, shown):
    assert figure(value) == shown


@pytest.mark.parametrize(
    ("status", "shown"),
    [(0, "exit 0"), (3, "exit 3"), (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM")],
)
def test_exit_statuses_say_how_a_process_ended(status, shown):
    assert _exit_description(status) == shown


def test_the_demo_prints_small_rates_and_ratios_with_their_digits(monkeypatch):
    def slow_ring(nodes, nbytes, laps, progress=None, settings=None):
        if progress is not None:
            progress(1, 2.0)
        return ring.DemoResult(
            nodes=nodes,
            nbytes=nbytes,
            laps=laps,
            hops=nodes * laps,
            seconds=8.0,
            ring_gbps=0.0419,
            memcpy_gbps=3.41,
            ratio=0.0123,
            verified=True,
            checksum="0123456789abcdef",
        )

    monkeypatch.setattr(ring, "run", slow_ring)
    result = CliRunner().invoke(
        fabricctl, ["demo", "--ring", "--nodes", "2", "--size-mib", "1", "--laps", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "0.0123x memcpy" in result.output
    assert "0.0419 GB/s" in result.output
    assert "3.41 GB/s (same run)" in result.output
    assert "8.00 s moving data, from when every rank was ready" in result.output
    assert "0.00x" not in result.output


def _status_with_eager_use() -> dict[str, Any]:
    """A status as a daemon of two nodes answers it, with eager and RTR traffic counted."""
    return {
        "node": 0,
        "nodes": 2,
        "state": "serving",
        "uptime": 12.0,
        "address": "127.0.0.1:7000",
        "transport": "tcp",
        "socket": "/run/fabricd/fabricd.sock",
        "incarnation": 1,
        "version": 3,
        "pending_ops": 2,
        "unexpected_messages": 1,
        "eager_pool_bytes": 3 * 1024,
        "eager_pool_limit": 4 * 1024 * 1024,
        "peers": [],
        "clients": [],
        "ranks": [],
        "metrics_url": "",
        "counters": {
            "eager_sent": 7,
            "eager_no_credit": 2,
            "eager_pool_full": 1,
            "rtr_sent": 5,
            "rtr_answered": 4,
            "rtr_dropped": 3,
        },
    }


class _FakeClient:
    def __init__(self, status: dict[str, Any]) -> None:
        self._status = status

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return self._status


def test_status_shows_the_eager_pool_against_its_bound_and_the_eager_and_rtr_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "messages: 1 waiting for their receive; eager pool 3.0 KiB held of 4.0 MiB" in (
        result.output
    )
    assert "eager: 7 sent, 2 sent as RTS (no credit), 1 taken as RTS here (pool full)" in (
        result.output
    )
    assert "RTR: 5 sent, 4 answered, 3 dropped" in result.output


def test_status_json_carries_the_eager_pool_and_its_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert (shown["eager_pool_bytes"], shown["eager_pool_limit"]) == (3072, 4 * 1024 * 1024)
    names = ("eager_sent", "eager_no_credit", "eager_pool_full", "rtr_sent", "rtr_answered")
    assert all(name in shown["counters"] for name in (*names, "rtr_dropped"))


def test_status_of_a_daemon_without_the_eager_path_has_no_messages_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    older = _status_with_eager_use()
    del older["eager_pool_bytes"], older["eager_pool_limit"]
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(older))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "eager pool" not in result.output


def test_status_lists_the_collectives_with_their_round_and_participation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    status["collectives"] = [
        {
            "job": "train",
            "owner": 1000,
            "name": "allreduce:solo:avg:grad",
            "what": "solo allreduce avg of 8192 float32 (late sum), algorithm tree",
            "algorithm": "binary tree",
            "round": 41,
            "nodes": [0, 1, 2],
            "lost": [3],
            "waiting": 1,
            "mean_active": 5.5,
        }
    ]
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "collectives (1)" in result.output
    assert "allreduce:solo:avg:grad" in result.output
    assert "[0, 1, 2]" in result.output
    assert "5.5" in result.output
    assert "binary tree" in result.output
    quiet = _status_with_eager_use()  # none: no table
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(quiet))
    assert "collectives" not in CliRunner().invoke(fabricctl, ["status"]).output


def test_status_shows_the_parameter_server_tables_with_bytes_saved_and_filter_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    status["ps_workers"] = [
        {
            "job": "train",
            "owner": 1000,
            "name": "model",
            "rank": 1,
            "clock": 4,
            "versions": [8],
            "push_bytes": 1024,
            "push_dense_bytes": 4096,
            "pull_bytes": 512,
            "pull_dense_bytes": 4096,
            "considered": 4000,
            "pushed": 1000,
            "smp_selected": 2000,
            "rp_selected": 2000,
            "delay_dropped": 2,
        },
        # a worker that pushed nothing yet, from a daemon that leaves out the byte fields
        {"job": "train", "owner": 1000, "name": "model", "rank": 2, "considered": 0},
    ]
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "ps workers (2)" in result.output
    assert "ps servers" not in result.output  # no shard served here: no table
    assert "1.0 KiB of 4.0 KiB, 75.0% saved" in result.output
    assert "512 B of 4.0 KiB, 87.5% saved" in result.output
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in result.output.splitlines()
        if line.startswith("│ train")
    ]
    assert [row[2] for row in rows] == ["1", "2"]
    assert rows[0][-4:] == ["50.0%", "50.0%", "75.0%", "2"]
    assert rows[1][3:] == ["-"] * 8  # every missing or undefined figure shows "-"


def test_status_lists_the_partial_exchanges_with_their_clock_and_bytes_per_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    status["partial_exchanges"] = [
        {
            "job": "train",
            "owner": 1000,
            "name": "w",
            "rank": 3,
            "clock": 240,
            "partitions": 21,
            "slowest": 238,
            "held": True,
            "bytes_per_round": 9627.0,
            "flushes": 1,
            "lost": [5],
            "gone": [],
        },
        {"job": "train", "owner": 1000, "name": "w", "rank": 4},  # fields left out: "-"
    ]
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "partial exchanges (2)" in result.output
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in result.output.splitlines()
        if line.startswith("│ train")
    ]
    assert rows[0][2:] == ["3", "240", "21", "238", "gate", "9.4 KiB", "1", "5", "-"]
    assert rows[1][3:] == ["-", "-", "-", "", "-", "-", "-", "-"]


def test_status_says_where_membership_comes_from_and_whether_etcd_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    status = _status_with_eager_use()
    status["peers"] = [
        {
            "node": 3,
            "name": "gpu-13",
            "address": "",
            "state": "suspect",
            "state_for": 1.0,
            "silent_for": 1.0,
            "links": {"control": False, "data": False},
            "bytes_sent": 0,
            "bytes_received": 0,
        }
    ]
    status["membership"] = {
        "source": "etcd",
        "state": "unreachable",
        "since": 12.0,
        "error": "no answer within 3.33s",
        "name": "gpu-11",
        "slot": 0,
        "max_nodes": 64,
        "registered": {"gpu-13": 3},
    }
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _FakeClient(status))
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "membership: etcd, gpu-11 in slot 0 of 64, unreachable for 12.0 s" in result.output
    assert "(no answer within 3.33s; running on the last view), 2 nodes registered" in (
        result.output
    )
    assert "3 (gpu-13)" in result.output
    assert "(left)" in result.output
    status["membership"] = {"source": "static"}
    result = CliRunner().invoke(fabricctl, ["status"], env={"COLUMNS": "200"})
    assert "membership: static (the nodes setting)" in result.output
