"""A secret rotated across real daemons on loopback while a collective runs (issue "Beyond one
host", item 4; docs/operations.md, "Rotating the secret").

Nodes 0 and 1 run an allreduce job, round after round, in a thread of this test; node 2 plays
the node that lags behind.  Every node reads its own secret file, which the test rewrites and
then signals the daemon with SIGHUP, as ``systemctl reload`` does:

1. all three on S1;
2. node 1, then node 0, hold S1 and S2 (older first); node 2, restarted on S1 only, still
   links to both (they accept its older secret and say so in their log);
3. node 1, then node 0, drop S1; node 2, restarted on S1 only again, is refused with a log
   line that says why, and links once it is given S2 and reloads.

The link between nodes 0 and 1 never drops and the job completes rounds after every step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

pytestmark = pytest.mark.timeout(180)

S1 = "s1-" + "1" * 40
S2 = "s2-" + "2" * 40
#: how long a step may take before the test gives up and shows the logs (not a figure)
PATIENCE = 60.0


def write_secret(path: Path, *secrets: str) -> None:
    """Replace ``path`` atomically with ``secrets``, one per line, 0600 from its first byte,
    as an operator should (docs/operations.md): the daemon never reads half a file."""
    fresh = path.with_suffix(".new")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(secrets) + "\n")
    os.replace(fresh, path)


class Rounds(threading.Thread):
    """Allreduce rounds of a job of two ranks, on nodes 0 and 1, until stopped; each result
    is checked against the sum it must be."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.done = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        sockets = [self.cluster.nodes[n].socket_path for n in (0, 1)]
        try:
            fabs = [
                fabricd.connect(job="rotate", rank=r, size=2, socket_path=s)
                for r, s in enumerate(sockets)
            ]
            grads = [fab.array("g", (4096,), "float32") for fab in fabs]
            while not self._halt.is_set():
                for rank, g in enumerate(grads):
                    g[:] = rank + 1 + self.done
                handles = [fab.allreduce_async(g) for fab, g in zip(fabs, grads, strict=True)]
                for handle in handles:
                    handle.wait(timeout=PATIENCE)
                for g in grads:
                    assert np.all(g == 3 + 2 * self.done), g[:4]
                self.done += 1
            for fab in fabs:
                fab.close()
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(PATIENCE)


def log_of(cluster: LocalCluster, node: int) -> str:
    return cluster.nodes[node].log_path.read_text(errors="replace")


def wait_for(cluster: LocalCluster, what: str, condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds; on giving up, fail with every daemon's log."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- node {n.node}\n{n.log_tail(40)}" for n in cluster.nodes)
            pytest.fail(f"waited in vain for {what}\n{logs}")
        time.sleep(0.05)


def peer_states(cluster: LocalCluster, node: int) -> dict[int, str]:
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as control:
        return {p["node"]: p["state"] for p in control.status()["peers"]}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three daemons on S1, each reading its own secret file; no traceback in any log."""
    files = {n: tmp_path / f"secret{n}" for n in range(3)}
    for path in files.values():
        write_secret(path, S1)
    started = LocalCluster(
        3,
        settings=FAST_LIVENESS,
        log_dir=tmp_path / "logs",
        node_env={n: {"FABRICD_SECRET_FILE": str(path)} for n, path in files.items()},
    )
    started.start()
    try:
        started.wait_connected()
        yield started
    finally:
        started.stop()
    for node in started.nodes:
        assert "Traceback" not in log_of(started, node.node)


def refused(log: str) -> bool:
    """Whether ``log`` has a line refusing a link because the peer holds another secret."""
    return any(
        "refused link" in line and "does not hold the same secret" in line
        for line in log.splitlines()
    )


class Rotation:
    """The operator's hands: rewrite a node's secret file, reload it, restart a node."""

    def __init__(self, cluster: LocalCluster, rounds: Rounds, files: dict[int, Path]) -> None:
        self.cluster = cluster
        self.rounds = rounds
        self.files = files

    def hold(self, node: int, *secrets: str) -> None:
        """Give ``node`` these secrets and reload it (SIGHUP); wait until it says it holds
        them and the job has completed a round since."""
        line = f"reload: {len(secrets)} secret(s) from secret_file {self.files[node]}"
        before = log_of(self.cluster, node).count(line)
        write_secret(self.files[node], *secrets)
        self.cluster.kill(node, signal.SIGHUP)
        wait_for(
            self.cluster,
            f"node {node} to reload",
            lambda: log_of(self.cluster, node).count(line) > before,
        )
        self.progress()

    def progress(self) -> None:
        """The job completes at least one more round."""
        before = self.rounds.done
        wait_for(
            self.cluster,
            "another allreduce round",
            lambda: self.rounds.done > before or self.rounds.error is not None,
        )
        assert self.rounds.error is None, self.rounds.error

    def restart(self, node: int, *secrets: str) -> None:
        """Kill ``node`` and start it again holding ``secrets`` (a new incarnation)."""
        write_secret(self.files[node], *secrets)
        self.cluster.kill(node)
        process = self.cluster.nodes[node].process
        assert process is not None
        process.wait(PATIENCE)
        self.cluster.restart(node)


def test_a_rolling_rotation_never_drops_the_link_and_refuses_a_node_left_behind(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    files = {n: tmp_path / f"secret{n}" for n in range(3)}
    rounds = Rounds(cluster)
    rounds.start()
    op = Rotation(cluster, rounds, files)
    try:
        op.progress()
        # step 1: node 1, then node 0, accept S2 besides S1 (and prefer it)
        op.hold(1, S1, S2)
        op.hold(0, S1, S2)
        # a node still on S1 alone links to both: each accepts and proves its older secret
        op.restart(2, S1)
        wait_for(
            cluster, "node 2 to link on S1", lambda: set(peer_states(cluster, 2).values()) == {"up"}
        )
        for node in (0, 1):
            assert "authenticated with this node's older secret" in log_of(cluster, node)
        op.progress()
        # step 2: node 1, then node 0, drop S1
        op.hold(1, S2)
        op.hold(0, S2)
        # node 2, restarted on S1 only, is refused, and the refusal says why
        since = {node: len(log_of(cluster, node)) for node in (0, 1)}
        op.restart(2, S1)
        for node in (0, 1):
            wait_for(
                cluster,
                f"node {node} to refuse node 2",
                lambda n=node: refused(log_of(cluster, n)[since[n] :]),
            )
        assert peer_states(cluster, 2) == {0: "connecting", 1: "connecting"}
        op.progress()
        # given S2 and a reload, node 2 links at its next dial, with no restart
        write_secret(files[2], S2)
        cluster.kill(2, signal.SIGHUP)
        wait_for(
            cluster, "node 2 to link on S2", lambda: set(peer_states(cluster, 2).values()) == {"up"}
        )
        op.progress()
    finally:
        rounds.stop()
    assert rounds.error is None, rounds.error
    # the job's link between nodes 0 and 1 never dropped, nor did either see the other restart
    for node, other in ((0, 1), (1, 0)):
        log = log_of(cluster, node)
        assert f"link to node {other} lost" not in log, log
        assert f"node {other}: up ->" not in log, log
