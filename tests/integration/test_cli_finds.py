"""fabricctl finds a user's local cluster, tells local clusters apart, and prints whole paths
where the output is not a terminal (issue 27, items 2 and 3).

Every launcher here runs with its own ``TMPDIR``, so the clusters of other users of the machine
(or of other tests) are not found, and with no daemon at the default sockets.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from typing import TYPE_CHECKING

import pytest

from fabricd import ipc
from fabricd.daemon.launcher import cluster_name
from tests.integration.test_cli import CTL, short_tmp

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["short_tmp"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def alone(short_tmp: Path) -> dict[str, str]:
    """An environment with no daemon at the default sockets and ``short_tmp`` as TMPDIR, no
    ``FABRICD_SOCKET`` and no ``COLUMNS``; stdout is never a terminal here (a pipe)."""
    if os.path.exists(ipc.SYSTEM_SOCKET):
        pytest.skip(f"a system daemon may answer at {ipc.SYSTEM_SOCKET}")
    env = {k: v for k, v in os.environ.items() if k not in ("FABRICD_SOCKET", "COLUMNS")}
    runtime = short_tmp / "runtime"
    runtime.mkdir()
    return {**env, "TMPDIR": str(short_tmp), "XDG_RUNTIME_DIR": str(runtime)}


def _ctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CTL, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


class _Launched:
    """``fabricctl local-cluster N`` (its output for people, into a pipe) until stopped."""

    def __init__(self, nodes: int, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [*CTL, "local-cluster", str(nodes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        self.announced = ""
        while "stops every daemon" not in self.announced:
            line = self.process.stdout.readline()
            if not line:
                self.process.kill()
                pytest.fail(f"local-cluster ended before announcing: {self.announced}")
            self.announced += line
        found = re.findall(r"FABRICD_SOCKET=(\S+) RANK=(\d+) WORLD_SIZE=(\d+) ", self.announced)
        assert [(int(r), int(w)) for _, r, w in found] == [(n, nodes) for n in range(nodes)]
        self.sockets = [path for path, _, _ in found]
        self.name = cluster_name(self.sockets[0])

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=60)


@pytest.fixture
def launch(alone: dict[str, str]) -> Iterator[type[_Launched]]:
    started: list[_Launched] = []

    class Tracked(_Launched):
        def __init__(self, nodes: int, env: dict[str, str] = alone) -> None:
            super().__init__(nodes, env)
            started.append(self)

    yield Tracked
    for launched in started:
        launched.process.kill()
        launched.process.communicate()


def test_local_cluster_piped_prints_every_path_whole_and_each_nodes_client_line(launch) -> None:
    cluster = launch(3)
    assert cluster.name is not None
    assert f"local cluster {cluster.name}: 3 nodes" in cluster.announced
    lines = cluster.announced.splitlines()
    for node, socket in enumerate(cluster.sockets):
        # its table row holds the path whole (it was folded mid-word at 80 columns)
        assert any(line.startswith(f"│ {node} ") and socket in line for line in lines), lines
        line = f"FABRICD_SOCKET={socket} RANK={node} WORLD_SIZE=3 python train.py"
        assert line in cluster.announced
    cluster.stop()
    assert cluster.process.returncode == 0


def test_status_without_a_socket_finds_the_one_local_cluster(launch, alone) -> None:
    cluster = launch(2)
    found = _ctl(alone, "status", "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["socket"] == cluster.sockets[0]
    assert f"node 0 of local cluster {cluster.name}" in found.stderr
    # a socket named is the only one tried, whatever runs
    named = {**alone, "FABRICD_SOCKET": cluster.sockets[1]}
    assert json.loads(_ctl(named, "status", "--json").stdout)["node"] == 1


def test_with_two_local_clusters_status_asks_which_and_top_all_says_whose_rows(
    launch, alone
) -> None:
    clusters = [launch(2), launch(1)]
    ambiguous = _ctl(alone, "status")
    assert ambiguous.returncode == 1
    for cluster in clusters:
        assert f"cluster {cluster.name}: node 0 at {cluster.sockets[0]}" in ambiguous.stderr
    assert "--socket or FABRICD_SOCKET" in ambiguous.stderr
    watched = _ctl(alone, "top", "--all", "--once", "--interval", "0.1", "--json")
    assert watched.returncode == 0, watched.stderr
    rows = [(d["cluster"], d["node"]) for d in json.loads(watched.stdout)["daemons"]]
    expected = [(c.name, n) for c in clusters for n in range(len(c.sockets))]
    assert sorted(rows) == sorted(expected)
    table = _ctl(alone, "top", "--all", "--once", "--interval", "0.1")
    assert table.returncode == 0, table.stderr
    header = next(line for line in table.stdout.splitlines() if "node" in line)
    assert header.split("┃")[1].strip() == "cluster"
    for cluster in clusters:
        rows_of = [line for line in table.stdout.splitlines() if f"│ {cluster.name} " in line]
        assert len(rows_of) == len(cluster.sockets)


def test_an_unanswered_fabricd_socket_is_not_advised_to_be_set(alone) -> None:
    missing = str(alone["TMPDIR"]) + "/none.sock"
    failed = _ctl({**alone, "FABRICD_SOCKET": missing}, "status")
    assert failed.returncode == 1
    assert "FABRICD_SOCKET names this socket" in " ".join(failed.stderr.split())
    assert "set FABRICD_SOCKET" not in " ".join(failed.stderr.split())


def test_nothing_running_says_how_to_start_a_daemon(alone) -> None:
    failed = _ctl(alone, "status")
    assert failed.returncode == 1
    text = " ".join(failed.stderr.split())
    assert "fabricctl local-cluster 1" in text
    assert "set FABRICD_SOCKET (or --socket) to use another socket" in text
