"""Output for people that stays readable (issue 27, item 3): a stalled operation in a few lines
at 80 columns, the demo's per-mode times, and why a mode missed the target."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from click.testing import CliRunner

from fabricd.cli import common
from fabricd.cli.ctl import main as fabricctl
from fabricd.demo import plot, training
from fabricd.demo.training import DemoResult, Settings, summarize, why_missed

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest

DETAIL = "rank 1 on node 1 has sent nothing to rank 0 with tag 7 (it sent with tags 3, 5)"


def _row(**changes: Any) -> dict[str, Any]:
    """A stall row as the p2p service writes it."""
    row = {
        "node": 0,
        "op": 3,
        "kind": "recv",
        "job": "train-resnet50",
        "rank": 0,
        "peer": 1,
        "tag": 7,
        "nbytes": 4 << 20,
        "dtype": "float32",
        "pending_for": 41.2,
        "waits": "rts",
        "detail": DETAIL,
        "peer_joined": True,
        "peer_posted": False,
        "peer_node": 1,
        "peer_node_state": "up",
        "peer_node_silent_for": 0.012,
        "client_left": False,
        "uid": 1000,
        "owner": 1000,
    }
    return {**row, **changes}


class _Stalls:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __enter__(self) -> _Stalls:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def stalls(self) -> dict[str, Any]:
        return {"node": 0, "stall_after": 30.0, "stalls": self.rows, "left_out": 0}


def _stalls_at_80(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]) -> list[str]:
    monkeypatch.setattr(common, "connect", lambda socket_path=None: _Stalls(rows))
    result = CliRunner().invoke(fabricctl, ["stalls"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return [line.rstrip() for line in result.output.splitlines()]


def test_a_stalled_operation_takes_a_few_lines_at_80_columns(monkeypatch) -> None:
    lines = _stalls_at_80(monkeypatch, [_row()])
    assert lines[0] == "stalled on node 0 (stall_after 30 s): 1"
    assert len(lines) <= 5  # it folded into 20 as a table of ten columns
    assert all(len(line) <= 80 for line in lines)
    assert "recv of rank 0 from rank 1, tag 7, job 'train-resnet50', 4.0 MiB, pending 41.2 s" in (
        lines
    )
    text = " ".join(" ".join(lines).split())
    assert f"waits for rts: {DETAIL}" in text  # folded between words only
    assert "peer node: 1 up, heard 12 ms ago" in text


def test_a_stalled_collective_names_itself_and_its_node(monkeypatch) -> None:
    name = "allreduce:sync:sum:grad"
    row = _row(kind="allreduce", peer="-", tag=name, detail="waits for node 1", peer_node=1)
    row["peer_node_state"] = None
    reduce = _row(kind="stochastic_reduce (barrier)", peer="-", tag="w", peer_node=None)
    lines = _stalls_at_80(monkeypatch, [row, reduce])
    text = " ".join(" ".join(lines).split())
    assert f"allreduce of rank 0, '{name}', job 'train-resnet50', 4.0 MiB, pending 41.2 s" in text
    assert "  peer node: 1" in lines
    assert not lines[-1].startswith("  peer node")  # a reduce has no one peer node
    assert text.endswith(f"waits for rts: {DETAIL}")


# -- the demo -----------------------------------------------------------------------------------
SETTINGS = Settings(nodes=1, ranks_per_node=2, steps=4, noise=1.0, target=1.0)


def _reports(losses: list[float], step_seconds: float) -> list[tuple[int, float, float, int]]:
    """Rank 0's reports of a run: the loss before the first step, then after each."""
    return [(i - 1, i * step_seconds, value, 2) for i, value in enumerate(losses)]


def _fake_run(runs: dict[str, list[tuple[int, float, float, int]]]) -> Callable[..., DemoResult]:
    def run(settings: Settings, modes: list[str], progress: Any = None) -> DemoResult:
        results = []
        for mode in modes:
            for report in runs[mode]:
                if progress is not None:
                    progress(mode, report)
            results.append(summarize(mode, settings.run_of(mode), runs[mode]))
        return DemoResult(settings=settings, modes=results)

    return run


def test_the_demo_shows_each_modes_own_time_and_why_one_missed(monkeypatch, tmp_path) -> None:
    runs = {
        "sync": _reports([9.0, 4.0, 2.0, 1.0, 0.5], step_seconds=3.0),  # 12 s, reached
        # solo runs 1.6x the rounds (7): 1.75 s, still falling
        "solo": _reports([9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.5, 2.0], step_seconds=0.25),
    }
    monkeypatch.setattr(training, "run", _fake_run(runs))
    monkeypatch.setattr(plot, "write_png", lambda result, path: None)
    args = ["demo", "--modes", "sync,solo", "--nodes", "1", "--steps", "4", "--target", "1"]
    result = CliRunner().invoke(fabricctl, [*args, "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    bars = {line.split()[0]: line for line in lines if " steps " in line and "━" in line}
    assert "4/4 steps" in bars["sync"]
    assert "7/7 steps" in bars["solo"]
    assert bars["sync"].rstrip().endswith("12.0 s")
    # solo's own 1.75 s, counted from its start: not the 14 s since the demo started
    assert bars["solo"].rstrip().endswith("1.8 s")
    text = " ".join(result.output.split())
    assert "solo did not reach the target: still falling at the last step (2.5 -> 2" in text
    assert "as fast as sync" not in text  # no headline for a mode that missed
    assert "sync did not reach" not in text


def test_why_a_run_missed_the_target_reads_the_curve() -> None:
    def missed(losses: list[float], active: float = 2.0) -> str:
        result = summarize("solo", SETTINGS, _reports(losses, 1.0))
        assert result.time_to_target is None
        assert result.missed == why_missed(result.history, SETTINGS, result.mean_active)
        return why_missed(result.history, SETTINGS, active)

    assert missed([9.0, 6.0, 4.0, 3.0, 2.0]).startswith("still falling at the last step")
    assert missed([9.0, 3.0, 2.0, 2.0, 2.01]).startswith("levelled off at 2.01")
    level = [(float(i), v) for i, v in enumerate([9.0, 3.0, 2.0, 2.0, 2.01])]
    latest = replace(SETTINGS, late="latest", sync_every=10)
    drifted = why_missed(level, latest, 1.5, skipped=3.0)
    assert drifted.startswith("levelled off at 2.01, above the target 1: each rank skipped 3")
    assert "--sync-every 10" in drifted
    summed = why_missed(level, SETTINGS, 1.5, skipped=3.0)  # late="sum": nothing skipped
    assert summed.startswith("levelled off at 2.01, above the target 1, with this learning rate")
    risen = missed([9.0, 2.0, 1.5, 3.0, 4.0], active=1.5)
    assert risen.startswith("rose from its lowest, 1.5 at 2.0 s, to 4")
    assert "--sync-every 160" in risen  # fewer than every rank fresh: drift is a suspect
    assert "--sync-every" not in missed([9.0, 2.0, 1.5, 3.0, 4.0], active=2.0)
    assert missed([9.0, 20.0, 1e30, float("inf"), float("inf")]).startswith("the loss diverged")
    reached = summarize("sync", SETTINGS, _reports([9.0, 4.0, 2.0, 1.0, 0.5], 1.0))
    assert reached.missed is None
