"""fabricctl and fabricd as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from fabricd.cli.ctl import main as fabricctl
from fabricd.client import connect
from tests.integration.processes import wait_exited
from tests.integration.scrape import scrape

if TYPE_CHECKING:
    from collections.abc import Iterator

CTL = [sys.executable, "-m", "fabricd.cli.ctl"]


def _ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CTL, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _hangup_stops() -> None:
    """Run in a launcher before exec: SIGHUP as a terminal would deliver it.

    Under ``nohup`` the test runner would pass on an ignored SIGHUP, which local-cluster
    honours; the tests of SIGHUP need it not ignored.
    """
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _tables(output: str) -> list[dict[str, list[str]]]:
    """The rich tables in ``output``: for each, every column's cells, folded lines joined.

    A row starts at a line whose first cell is not empty; the lines under it that are empty
    there continue it (cells that rich folded onto more lines).
    """
    tables: list[dict[str, list[str]]] = []
    headers: list[list[str]] = []
    rows: list[list[str]] = []
    for line in [*output.splitlines(), "┏"]:
        line = line.strip()
        if line.startswith("┏"):
            if headers:
                names = [
                    "".join(part.strip() for part in column)
                    for column in zip(*headers, strict=True)
                ]
                tables.append({name: [row[i] for row in rows] for i, name in enumerate(names)})
            headers, rows = [], []
        elif line.startswith("┃"):
            headers.append(line.split("┃")[1:-1])
        elif line.startswith("│"):
            cells = [cell.strip() for cell in line.split("│")[1:-1]]
            if cells[0] or not rows:
                rows.append(cells)
            else:
                rows[-1] = [done + more for done, more in zip(rows[-1], cells, strict=True)]
    return tables


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: Unix socket paths hold at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def test_a_narrow_console_folds_config_values_and_cuts_none(tmp_path):
    path = tmp_path / "f.toml"
    nodes = ["127.0.0.1:7000", "[fd00:1234::1]:7001"]
    path.write_text(f'nodes = {json.dumps(nodes)}\nsecret_file = "/etc/fabricd/secret"\n')
    result = _ctl("config", "show", "--config", str(path), env={"COLUMNS": "40"})
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    (table,) = _tables(result.stdout)
    row = table["key"].index("nodes")
    assert table["value"][row] == json.dumps(nodes).replace(" ", "")


def test_commands_without_a_daemon_fail_with_advice(tmp_path):
    result = CliRunner().invoke(fabricctl, ["status", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1
    assert "no fabricd daemon answers" in result.output


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_local_cluster_serves_status_and_stops_cleanly(stop_signal):
    cluster = subprocess.Popen(
        [*CTL, "local-cluster", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_hangup_stops,
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
        for command in ("status", "peers"):  # an address is folded, never cut
            narrow = _ctl(command, "--socket", sockets[0], env={"COLUMNS": "40"})
            assert narrow.returncode == 0, narrow.stderr
            assert "…" not in narrow.stdout
            assert _tables(narrow.stdout)[0]["address"] == [nodes[1]["address"]]
        cluster.send_signal(stop_signal)
        assert cluster.wait(30) == 0
        assert not Path(sockets[0]).parent.exists(), "local-cluster must leave nothing behind"
        for node in nodes:
            with pytest.raises(ProcessLookupError):
                os.kill(node["pid"], 0)
    finally:
        cluster.kill()
        cluster.communicate()


def test_sighup_stops_a_local_cluster_and_says_how_each_daemon_exited():
    cluster = subprocess.Popen(
        [*CTL, "local-cluster", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_hangup_stops,
    )
    try:
        assert cluster.stdout is not None
        announced = ""
        while "stops every daemon" not in announced:
            line = cluster.stdout.readline()
            assert line, f"local-cluster ended before announcing its nodes: {announced}"
            announced += line
        cluster.send_signal(signal.SIGHUP)
        output, errors = cluster.communicate(timeout=60)
        assert cluster.returncode == 0, errors
        assert "stopped 2 daemons: node 0 exit 0, node 1 exit 0" in output
    finally:
        cluster.kill()
        cluster.communicate()


def _launch(nodes: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CTL, "local-cluster", str(nodes), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _announced(launcher: subprocess.Popen[str], nodes: int) -> list[dict]:
    """The node lines a ``local-cluster --json`` prints once its fabric is up."""
    assert launcher.stdout is not None
    lines = [launcher.stdout.readline() for _ in range(nodes)]
    if not all(lines):
        launcher.kill()
        pytest.fail(f"local-cluster ended before announcing its nodes:\n{launcher.stderr.read()}")
    return [json.loads(line) for line in lines]


def test_a_killed_local_cluster_leaves_no_daemon_and_its_files_go_next_time(short_tmp):
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    first = _launch(2, env)
    try:
        first_nodes = _announced(first, 2)
        first_directory = Path(first_nodes[0]["socket"]).parent
        assert first_directory.parent == short_tmp
        first.kill()
        first.communicate(timeout=30)
        assert wait_exited([node["pid"] for node in first_nodes]) == []
        assert first_directory.is_dir()  # nothing of the launcher ran to remove it
        second = _launch(1, env)
        try:
            second_nodes = _announced(second, 1)
            assert not first_directory.exists(), "the next local-cluster removes it"
            second_directory = Path(second_nodes[0]["socket"]).parent
            second.kill()
            second.communicate(timeout=30)
            assert wait_exited([second_nodes[0]["pid"]]) == []
        finally:
            second.kill()
            second.communicate()
        clean = _ctl("local-cluster", "--clean", env={"TMPDIR": str(short_tmp)})
        assert clean.returncode == 0, clean.stderr
        assert str(second_directory) in clean.stdout
        assert list(short_tmp.iterdir()) == []
    finally:
        first.kill()
        first.communicate()


def test_demo_verifies_the_ring_and_reports_json():
    result = _ctl("demo", "--ring", "--nodes", "3", "--size-mib", "4", "--laps", "2", "--json")
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


def test_status_shows_the_clients_and_ranks_of_a_running_job(make_cluster):
    cluster = make_cluster(2)
    sockets = [node.socket_path for node in cluster.nodes]
    with (
        connect(job="status-job", rank=0, size=2, socket_path=sockets[0]) as first,
        connect(job="status-job", rank=1, size=2, socket_path=sockets[1]),
    ):
        first.array("grad", (16,), "float32")
        deadline = time.monotonic() + 30
        while len(first.status()["ranks"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 1 joined on node 1: node 0 hears of it a moment later
        human = _ctl("status", "--socket", sockets[0], env={"COLUMNS": "200"})
    assert human.returncode == 0, human.stderr
    clients, ranks = _tables(human.stdout)[1:3]
    assert clients["pid"] == [str(os.getpid())]
    assert (clients["job"], clients["rank"], clients["segments"]) == (["status-job"], ["0"], ["1"])
    assert sorted(zip(ranks["job"], ranks["rank"], ranks["node"], strict=True)) == [
        ("status-job", "0", "0"),
        ("status-job", "1", "1"),
    ]


@pytest.mark.parametrize("again", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_second_stop_signal_does_not_cut_a_local_clusters_stop_short(short_tmp, again):
    """^C^C: the second signal arrives while the daemons drain; the stop still finishes."""
    launcher = subprocess.Popen(
        [*CTL, "local-cluster", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(short_tmp)},
        preexec_fn=_hangup_stops,
    )
    try:
        nodes = _announced(launcher, 2)
        pids = [node["pid"] for node in nodes]
        os.kill(pids[1], signal.SIGSTOP)  # a slow drain: the stop waits for this daemon
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        launcher.send_signal(again)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGCONT)
        _, errors = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, errors
        assert "Traceback" not in errors
        assert wait_exited(pids) == []
        assert list(short_tmp.iterdir()) == [], "the stop removes the temporary directory"
    finally:
        launcher.kill()
        launcher.communicate()


def _send_and_receive(sockets: list[str], count: int) -> None:
    """Rank 0 on node 0 sends ``count`` messages of 4 KiB to rank 1 on node 1."""

    def receive() -> None:
        with connect(job="top-job", rank=1, size=2, socket_path=sockets[1]) as fab:
            array = fab.array("in", (1024,), "float32")
            for _ in range(count):
                fab.recv(array, src=0, timeout=30)

    receiver = threading.Thread(target=receive)
    receiver.start()
    with connect(job="top-job", rank=0, size=2, socket_path=sockets[0]) as fab:
        array = fab.array("out", (1024,), "float32")
        for _ in range(count):
            fab.send(array, to=1, timeout=30)
    receiver.join(60)
    assert not receiver.is_alive()


def test_top_once_json_reports_every_daemon_of_a_live_local_cluster(make_cluster):
    cluster = make_cluster(2)
    sockets = [node.socket_path for node in cluster.nodes]
    _send_and_receive(sockets, 5)
    args = ["top", "--once", "--json", "--interval", "0.2"]
    given = _ctl(*args, "--socket", sockets[0], "--socket", sockets[1])
    assert given.returncode == 0, given.stderr
    daemons = json.loads(given.stdout)["daemons"]
    assert [d["node"] for d in daemons] == [0, 1]
    for daemon, node in zip(daemons, cluster.nodes, strict=True):
        assert daemon["socket"] == node.socket_path
        assert daemon["metrics_url"] == node.metrics_url
        assert daemon["ops_completed"] == 5  # five sends on node 0, five receives on node 1
        assert daemon["pending_ops"] == 0
        assert daemon["clients"] == 0
        ((peer),) = daemon["peers"]
        assert (peer["peer"], peer["state"]) == (1 - node.node, "up")
        assert daemon["ops_per_second"] == 0.0  # nothing moved while top watched
        assert daemon["latency_p50"] is None
    assert daemons[0]["peers"][0]["sent_bytes"] > 5 * 4096
    assert daemons[1]["peers"][0]["received_bytes"] > 5 * 4096
    found = _ctl(*args, "--all")  # every local cluster of this user: this one among them
    assert found.returncode == 0, found.stderr
    seen = {d["socket"] for d in json.loads(found.stdout)["daemons"]}
    assert set(sockets) <= seen
    assert _ctl("top", "--json", "--socket", sockets[0]).returncode == 2  # --json needs --once
    human = _ctl("status", "--socket", sockets[0], env={"COLUMNS": "200"})
    assert f"metrics at {cluster.nodes[0].metrics_url}" in human.stdout


def test_top_refreshes_until_ctrl_c_and_exits_cleanly(make_cluster):
    cluster = make_cluster(1)
    node = cluster.nodes[0]

    def status_requests() -> float:  # read by a scrape, which is no client request itself
        samples = scrape(node.metrics_url)
        return samples.get(("fabricd_client_requests_total", frozenset({("op", "status")})), 0)

    before = status_requests()
    top = subprocess.Popen(
        [*CTL, "top", "--socket", node.socket_path, "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30  # a hang guard: top samples the daemon each refresh
        while status_requests() < before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status_requests() >= before + 5, "top must keep sampling"
        top.send_signal(signal.SIGINT)
        out, err = top.communicate(timeout=30)
    finally:
        top.kill()
    assert top.returncode == 0, err
    assert "Traceback" not in err
    assert "fabricd top" in out


def _status_requests(metrics_url: str) -> float:
    samples = scrape(metrics_url)
    return samples.get(("fabricd_client_requests_total", frozenset({("op", "status")})), 0)


def test_top_exits_when_the_daemon_it_watches_goes_away(make_cluster):
    """A daemon named by --socket (or found as status finds it) must answer: once it is gone,
    top says so and exits 1 instead of drawing an empty table for ever."""
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    top = subprocess.Popen(
        [*CTL, "top", "--socket", node.socket_path, "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30  # a hang guard: wait until top is in its live loop
        while _status_requests(node.metrics_url) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _status_requests(node.metrics_url) >= 2, "top must sample the daemon"
        cluster.kill(0)
        out, err = top.communicate(timeout=30)  # a hang guard
    finally:
        top.kill()
    assert top.returncode == 1, (out, err)
    assert "Traceback" not in err
    assert "fabricctl:" in err
