"""The demo's job end to end: ranks in processes on local daemons, each allreduce mode.

Small: 2 nodes x 2 ranks, a 32-dimensional hyperplane, a few 20 ms steps with a straggler a few
milliseconds late.  Nothing here is about speed: the checks are that every mode learns and that
what the demo reports adds up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fabricd.demo.plot import available
from fabricd.demo.training import MODES, Settings, run_mode

SMALL = Settings(
    nodes=2, ranks_per_node=2, dim=32, batch=64, steps=20, compute_ms=20, delay_ms=5, sync_every=6
)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_learns_the_hyperplane(make_cluster, mode):
    cluster = make_cluster(SMALL.nodes)
    result = run_mode(cluster, SMALL, mode)
    assert result.mode == mode
    assert result.steps == SMALL.rounds(mode)
    assert result.final_loss < result.initial_loss / 4
    assert result.history[0][0] == 0.0
    times = [seconds for seconds, _ in result.history]
    assert times == sorted(times)
    assert result.seconds == times[-1]
    assert result.rounds_per_s == pytest.approx(SMALL.rounds(mode) / result.seconds)
    # a round's fresh contributions: every rank under sync, at least the initiator otherwise;
    # each round counts once, from every rank's tally
    if mode == "sync":
        # every round waits for every rank's step, which sleeps out its emulated device time
        assert result.seconds >= SMALL.steps * SMALL.compute_ms / 1000
        assert result.mean_active == SMALL.ranks
        assert result.gradients_per_s == pytest.approx(result.rounds_per_s)
        assert result.unseen_rounds == 0
        assert result.skipped_results == 0
    else:
        assert 1 <= result.mean_active <= SMALL.ranks
        assert 0 < result.gradients_per_s <= result.rounds_per_s
        assert 0 <= result.skipped_results < result.steps
    if result.time_to_target is not None:
        assert 0 < result.time_to_target <= result.seconds


def test_fabricctl_demo_reports_every_mode_as_json(tmp_path):
    plot = tmp_path / "loss.png" if available() else None  # the demo extra draws it
    args = ["--nodes", "2", "--ranks-per-node", "1", "--dim", "16", "--batch", "32"]
    args += ["--steps", "6", "--compute-ms", "5", "--delay-ms", "2", "--modes", "sync,solo"]
    args += ["--imbalance", "severe", "--json"]
    args += ["--plot", str(plot)] if plot else []
    done = subprocess.run(
        [sys.executable, "-m", "fabricd.cli.ctl", "demo", *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [m["mode"] for m in report["modes"]] == ["sync", "solo"]
    assert report["ranks"] == 2
    assert report["settings"]["steps"] == 6
    assert report["settings"]["compute_ms"] == 5
    assert report["settings"]["imbalance"] == "severe"
    assert [mode["steps"] for mode in report["modes"]] == [6, 10]  # solo: 1.6x, rounded up
    for mode in report["modes"]:
        assert mode["gradients_per_s"] > 0
        assert mode["rounds_per_s"] > 0
        assert mode["final_loss"] < mode["initial_loss"]
        assert len(mode["history"]) >= 7  # before the first step, then at least once a round
    if plot is None:
        assert report["plot"] is None
    else:
        assert report["plot"] == str(plot)
        assert plot.read_bytes().startswith(b"\x89PNG")
