"""fabricctl and fabricd as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fabricd.cli.ctl import main as fabricctl

CTL = [sys.executable, "-m", "fabricd.cli.ctl"]


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=60, check=False)


def test_config_show_from_a_file_prints_values_and_sources(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('nodes = ["127.0.0.1:7000"]\nheartbeat_interval = 0.5\n')
    result = CliRunner().invoke(
        fabricctl,
        ["config", "show", "--config", str(path), "--json", "--down-after", "12"],
        env={"FABRICD_SUSPECT_AFTER": "2"},
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["heartbeat_interval"] == {"value": 0.5, "source": str(path)}
    assert shown["suspect_after"] == {"value": 2.0, "source": "env FABRICD_SUSPECT_AFTER"}
    assert shown["down_after"] == {"value": 12.0, "source": "flag"}
    human = CliRunner().invoke(fabricctl, ["config", "show", "--config", str(path)])
    assert "heartbeat_interval" in human.output
    assert str(path) in human.output


def test_commands_without_a_daemon_fail_with_advice(tmp_path):
    result = CliRunner().invoke(fabricctl, ["status", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "no fabricd daemon answers" in result.output


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_local_cluster_serves_status_and_stops_cleanly(stop_signal):
    cluster = subprocess.Popen(
        [*CTL, "local-cluster", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cluster.stdout is not None
        nodes = [json.loads(cluster.stdout.readline()) for _ in range(2)]
        assert [n["node"] for n in nodes] == [0, 1]
        sockets = [n["socket"] for n in nodes]
        status = _ctl("status", "--json", "--socket", sockets[1])
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["node"] == 1
        peers = json.loads(_ctl("peers", "--json", "--socket", sockets[0]).stdout)
        assert [(p["node"], p["state"]) for p in peers] == [(1, "up")]
        shown = json.loads(_ctl("config", "show", "--json", "--socket", sockets[0]).stdout)
        assert shown["heartbeat_interval"]["value"] == 0.1
        assert shown["node_id"]["source"] == "env FABRICD_NODE_ID"
        human = _ctl("status", "--socket", sockets[0])
        assert "peers" in human.stdout
        assert "up" in human.stdout
        cluster.send_signal(stop_signal)
        assert cluster.wait(30) == 0
        assert not Path(sockets[0]).parent.exists(), "local-cluster must leave nothing behind"
        for node in nodes:
            with pytest.raises(ProcessLookupError):
                os.kill(node["pid"], 0)
    finally:
        cluster.kill()
        cluster.communicate()


def test_demo_verifies_the_ring_and_reports_json():
    result = _ctl("demo", "--nodes", "3", "--size-mib", "4", "--laps", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verified"] is True
    assert report["hops"] == 6
    assert report["nbytes"] == 4 * 1024 * 1024
    assert report["ring_gbps"] > 0
    assert report["memcpy_gbps"] > 0


def test_fabricd_help_lists_every_config_key():
    result = subprocess.run(
        [sys.executable, "-m", "fabricd.cli.daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for flag in ("--node-id", "--nodes", "--secret-file", "--heartbeat-interval", "--socket"):
        assert flag in result.stdout


def test_the_pingpong_example_runs_against_a_local_cluster(make_cluster):
    cluster = make_cluster(2)
    example = Path(__file__).parents[2] / "examples" / "pingpong.py"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(example), "--elements", "4096", "--rounds", "3"],
            env={
                **os.environ,
                "FABRICD_SOCKET": cluster.nodes[r].socket_path,
                "RANK": str(r),
                "WORLD_SIZE": "2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=60) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "3 round trips of 16384 B" in outputs[0][0]
    assert "every element checked" in outputs[0][0]
