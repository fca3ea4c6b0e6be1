"""F5 (RELIABILITY.md): the parameter server under a lossy link, between two daemon processes
whose links, control and data, pass through a faulty network
(:class:`~tests.integration.tcp_proxy.Proxy`).

The server (rank 0) is alone on node 0; the 4 workers are on node 1, so every push, pull,
acknowledgement and answer crosses the proxy; with a replica (rank 1, on node 1) the
replication entries and their confirmations cross it too.  The model is ``sum``: worker ``r``'s
push of iteration ``i`` is :func:`update` (integers: every sum is exact in float64), so the
model at each version is known exactly.

The nemesis (a thread with a seeded schedule, as F7's) resets the pair's connections every
0.3 to 2 s, at least as often as the figure's "every 2 s": both links at once, only the
control or only the data link, or inside a frame, which then arrives only in part.  Our
transport is TCP: a frame is never dropped alone, its stream breaks (a frame altered in transit
is found by the frame integrity layer, which closes the link: the same), so the figure's "10 %
frames dropped" are these resets; a reset here drops every frame in flight on the link, and
those queued behind.  One frame in :data:`DELAYED` is held 0 to 50 ms (the figure's delay),
its stream waiting behind it; holding every frame would delay heartbeats past ``down_after``
and turn resets into lost nodes, which is F6's business, not this one's.

Pushes: RELIABILITY names 4 workers x 10^4 pushes.  Through this proxy (Python, in the
test's process) a worker's push and pull, four frames across the proxy and two client calls,
take some milliseconds on a 2-core machine shared by two daemons, the proxy and the ranks, so
the run takes :data:`PUSHES` per worker (in batches of :data:`BATCH`), going on in batches
until the proxy reset the links :data:`MIN_RESETS` times and a parameter-server frame on the
data link was cut, a few thousand pushes in all per case.

Checks, per case: every push returns (a hang fails with every daemon's ``ps_servers``,
``ps_workers`` rows and stalls), and is applied (no ``dropped``); the versions a worker sees
never go back, and each push's version is above every version the worker saw before it; each
model a worker pulled equals the sum of the pushes whose version is at most the pull's (no
update lost, none applied twice, none torn); the final model is the sum of every pushed
update; the server counts each push once and its resends apart (``resent`` > 0: the exactly
once path really ran); with a replica, the replica logged and applied every entry and reached
the primary's version.  There is no push of unknown outcome here: every push returns, so
"applied at most once" is "applied exactly once".

:func:`test_a_parameter_server_frame_lost_with_its_link_is_made_good` is the same without
the nemesis, one fault at a time: the first frame of one parameter-server kind is swallowed and
the links reset behind it, so a lost push, pull, acknowledgement, answer, replication entry or
confirmation must each be made good by what the daemons send again once the pair is back.

Ranks are clients in this process, one connection each; the workers run in threads (one per
worker) so BSP's iterations fill up by themselves.  Timeouts are hang guards only.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pytest

import fabricd
from fabricd.wire import Kind
from tests.integration.tcp_proxy import GUARD, Nemesis
from tests.integration.test_collectives import ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import Client, ParameterServer
    from fabricd.daemon.launcher import LocalCluster
    from tests.integration.tcp_proxy import Proxy

    #: the fixture: start a proxied pair with these settings
    MakeProxied = Callable[..., tuple[LocalCluster, Proxy]]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEED: Final = 5
#: one frame in this many is held back 0 to 50 ms
DELAYED: Final = 10
#: elements of the model
COUNT: Final = 16
#: workers, all on node 1
WORKERS: Final = 4
#: pushes per worker at least
PUSHES: Final = 300
#: pushes per worker in a batch (every worker pushes as many: BSP needs them all)
BATCH: Final = 100
#: batches at most: a run that has not met MIN_RESETS and a cut frame by then fails
MAX_BATCHES: Final = 30
#: resets at least (the run goes on in batches until then)
MIN_RESETS: Final = 10
#: the frames of the parameter server on the data link, one of which must be cut
PS_DATA: Final = frozenset({Kind.PUSH, Kind.PULLED, Kind.REPLICATE})


def update(rank: int, iteration: int) -> np.ndarray[Any, Any]:
    """Worker ``rank``'s push of ``iteration``: integers below 2^20 in magnitude, so every
    sum of a few thousand is exact in float64."""
    rng = np.random.default_rng([SEED, rank, iteration])
    return rng.integers(-(2**20), 2**20, COUNT).astype(np.float64)


def explain(cluster: LocalCluster, proxy: Proxy) -> dict[str, Any]:
    """What every daemon says of its parameter servers, workers, stalled calls and peers,
    and what the proxy did."""
    seen: dict[str, Any] = {"proxy resets": proxy.resets, "cut": [k.name for k in proxy.cut_frames]}
    for node in cluster.nodes:
        with (
            contextlib.suppress(fabricd.FabricError),
            fabricd.connect(socket_path=node.socket_path) as client,
        ):
            status = client.status()
            seen[f"node {node.node}"] = {
                "ps_servers": status["ps_servers"],
                "ps_workers": status["ps_workers"],
                "stalls": client.stalls()["stalls"],
                "peers": status["peers"],
                "counters": status["counters"],
            }
    return seen


def wait(handle: Any, cluster: LocalCluster, proxy: Proxy) -> Any:
    """``handle.wait``, or an AssertionError saying what every daemon says (a hang must be
    readable from the report alone)."""
    try:
        return handle.wait(timeout=GUARD)
    except fabricd.Timeout:
        report = explain(cluster, proxy)
        raise AssertionError(f"{handle.what} hung; {report}") from None


@dataclass(eq=False)
class WorkerRun:
    """One worker's handle and what it saw: its pushes' versions, its pulls' versions and
    models, in call order."""

    rank: int
    ps: ParameterServer
    update: np.ndarray[Any, Any]
    model: np.ndarray[Any, Any]
    pushed: int = 0
    #: ("push" | "pull", version), in call order
    seen: list[tuple[str, int]] = field(default_factory=list)
    #: the version each push made
    push_versions: dict[int, int] = field(default_factory=dict)
    #: (version, the model pulled)
    pulls: list[tuple[int, np.ndarray[Any, Any]]] = field(default_factory=list)

    def batch(self, count: int, cluster: LocalCluster, proxy: Proxy) -> None:
        """Push ``count`` updates, pulling after each."""
        for _ in range(count):
            i = self.pushed
            self.update[:] = update(self.rank, i)
            result = wait(self.ps.push_async(self.update), cluster, proxy)
            assert result.iteration == i
            assert result.dropped == (), f"rank {self.rank} iteration {i}: {result.dropped}"
            (version,) = result.versions
            self.push_versions[i] = version
            self.seen.append(("push", version))
            self.pushed += 1
            version = wait(self.ps.pull_async(self.model), cluster, proxy)
            self.seen.append(("pull", version))
            self.pulls.append((version, self.model.copy()))


def run_batches(runs: list[WorkerRun], cluster: LocalCluster, proxy: Proxy) -> int:
    """Every worker pushes :data:`BATCH` updates in its own thread, batch after batch, until
    :data:`PUSHES` each, :data:`MIN_RESETS` resets and a cut parameter-server frame on the
    data link; the batches run."""
    errors: list[BaseException] = []

    def body(run: WorkerRun) -> None:
        try:
            run.batch(BATCH, cluster, proxy)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    batches = 0
    while (
        runs[0].pushed < PUSHES or proxy.resets < MIN_RESETS or not PS_DATA & set(proxy.cut_frames)
    ):
        assert batches < MAX_BATCHES, f"{batches} batches, still short: {explain(cluster, proxy)}"
        threads = [threading.Thread(target=body, args=(run,), name=f"w{run.rank}") for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            # each call waits GUARD at most: a thread past that is a hang of the test itself
            thread.join(GUARD * BATCH * 2)
            assert not thread.is_alive(), f"{thread.name} never returned"
        if errors:
            raise errors[0]
        batches += 1
    return batches


def check_versions(runs: list[WorkerRun], per_version: int) -> dict[int, np.ndarray[Any, Any]]:
    """The versions each worker saw never go back, and each push's version is above all it
    saw before; ``per_version`` pushes made each version (1 async, every worker's under BSP).
    Returns the model at each version: the sum of the pushes whose version is at most it."""
    for run in runs:
        highest = 0
        for what, version in run.seen:
            if what == "push":
                assert version > highest, f"rank {run.rank}: push version {version} after {highest}"
            else:
                assert version >= highest, f"rank {run.rank}: pulled {version} after {highest}"
            highest = version
    made: dict[int, np.ndarray[Any, Any]] = {}
    counts: dict[int, int] = {}
    for run in runs:
        for i, version in run.push_versions.items():
            made[version] = made.get(version, np.zeros(COUNT)) + update(run.rank, i)
            counts[version] = counts.get(version, 0) + 1
    last = max(counts)
    assert counts == dict.fromkeys(range(1, last + 1), per_version)  # none twice, none missing
    models, total = {0: np.zeros(COUNT)}, np.zeros(COUNT)
    for version in range(1, last + 1):
        total = total + made[version]
        models[version] = total
    for run in runs:
        for version, model in run.pulls:
            np.testing.assert_array_equal(model, models[version], f"rank {run.rank} at {version}")
    return models


def rows(cluster: LocalCluster, what: str) -> list[dict[str, Any]]:
    """Both daemons' ``what`` status rows (``ps_servers``, ``ps_workers``)."""
    found: list[dict[str, Any]] = []
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as client:
            found += client.status()[what]
    return found


def run_f5(
    proxied: MakeProxied, consistency: str, replicated: bool
) -> tuple[list[WorkerRun], LocalCluster, Proxy, list[dict[str, Any]]]:
    """The F5 workload (module docstring); returns the runs, the pair, the proxy and the
    servers' status rows once the nemesis stopped and every worker pulled the final model."""
    cluster, proxy = proxied()
    delays = random.Random(SEED + 1)
    proxy.delay = lambda: delays.uniform(0, 0.05) if delays.randrange(DELAYED) == 0 else 0.0
    replicas = [1] if replicated else []
    placement = (0, *([1] * (len(replicas) + WORKERS)))
    first = 1 + len(replicas)
    started = time.monotonic()
    with ranks(cluster, placement, f"f5-{consistency}-{len(replicas)}") as fabs:
        handles = open_model(fabs, consistency, replicas)
        runs = [
            WorkerRun(
                rank=r,
                ps=handles[r],
                update=fabs[r].array("u", (COUNT,), "float64"),
                model=fabs[r].array("w", (COUNT,), "float64"),
            )
            for r in range(first, first + WORKERS)
        ]
        with Nemesis(proxy, SEED, longest=2.0):
            batches = run_batches(runs, cluster, proxy)
        per_version = 1 if consistency == "async" else WORKERS
        models = check_versions(runs, per_version)
        final = max(models)
        total = sum(
            (update(run.rank, i) for run in runs for i in range(run.pushed)), np.zeros(COUNT)
        )
        np.testing.assert_array_equal(models[final], total)
        for run in runs:  # after the faults: every worker reads the final model
            assert wait(run.ps.pull_async(run.model), cluster, proxy) == final
            np.testing.assert_array_equal(run.model, total)
        servers = rows(cluster, "ps_servers")
        workers = rows(cluster, "ps_workers")
    pushes = sum(run.pushed for run in runs)
    print(
        f"F5 {consistency}{' + replica' if replicated else ''}: {pushes} pushes "
        f"({batches} batches) in {time.monotonic() - started:.1f} s, proxy resets "
        f"{proxy.resets}, cut {sorted(k.name for k in proxy.cut_frames)}, server resent "
        f"{[s['resent'] for s in servers]}, workers resent {[w['resent'] for w in workers]}"
    )
    assert proxy.resets >= MIN_RESETS
    assert sum(w["resent"] for w in workers) > 0
    return runs, cluster, proxy, servers


def open_model(fabs: list[Client], consistency: str, replicas: list[int]) -> dict[int, Any]:
    """Every rank opens the model: rank 0 serves it, ``replicas`` replicate it."""
    handles = {}
    for rank, fab in enumerate(fabs):
        role = "server" if rank == 0 else "replica" if rank in replicas else "worker"
        handles[rank] = fab.parameter_server(
            "f5", (COUNT,), "float64", role, servers=[0], replicas=replicas, consistency=consistency
        )
    return handles


@pytest.mark.parametrize("consistency", ["async", "bsp"])
def test_every_acknowledged_push_is_applied_once_across_resets(
    proxied: MakeProxied, consistency: str
) -> None:
    runs, _, _, servers = run_f5(proxied, consistency, replicated=False)
    pushes = sum(run.pushed for run in runs)
    (row,) = servers
    assert (row["role"], row["epoch"]) == ("primary", 0)
    assert row["pushes"] == row["applied"] == pushes  # each push taken once: resends apart
    assert row["version"] == (pushes if consistency == "async" else pushes // WORKERS)
    assert row["resent"] > 0  # the server recognised pushes it had taken
    assert row["dropped_lost"] == row["dropped_delay"] == 0


def test_the_replica_follows_the_primary_across_resets(proxied: MakeProxied) -> None:
    runs, _, _, servers = run_f5(proxied, "async", replicated=True)
    pushes = sum(run.pushed for run in runs)
    primary, replica = sorted(servers, key=lambda row: row["role"])
    assert (primary["role"], replica["role"]) == ("primary", "replica")
    assert primary["epoch"] == replica["epoch"] == 0
    assert primary["pushes"] == primary["applied"] == pushes
    assert primary["version"] == pushes
    assert primary["unreplicated"] == 0
    # the replica logged and applied every entry the primary took, in the same order
    assert replica["logged"] == primary["logged"] == pushes
    assert (replica["pushes"], replica["applied"], replica["version"]) == (pushes, pushes, pushes)
    assert primary["resent"] > 0


#: the parameter server's frames, by the node each travels to (server 0 on node 0; its replica
#: and the workers on node 1)
TOWARDS: Final = {
    Kind.PUSH: 0,
    Kind.PULL: 0,
    Kind.PUSHED: 1,
    Kind.PULLED: 1,
    Kind.REPLICATE: 1,
    Kind.REPLICATED: 0,
}


@pytest.mark.parametrize("kind", list(TOWARDS), ids=[k.name for k in TOWARDS])
def test_a_parameter_server_frame_lost_with_its_link_is_made_good(
    proxied: MakeProxied, kind: Kind
) -> None:
    """The first ``kind`` frame is swallowed and the links reset: every call still returns,
    and the model is the sum of the pushes, each applied once (module docstring)."""
    cluster, proxy = proxied()
    swallowed: list[Kind] = []

    def swallow(relay: Any, towards: int, frame: bytes) -> list[bytes]:
        if swallowed or frame[5] != kind:
            return [frame]
        assert towards == TOWARDS[kind]
        swallowed.append(kind)
        proxy.reset()  # on the proxy's thread: after this frame, which never arrives
        return []

    proxy.trick = swallow
    with ranks(cluster, (0, 1, 1, 1), f"lost-{kind.name.lower()}") as fabs:
        handles = open_model(fabs, "async", [1])
        runs = [
            WorkerRun(
                rank=r,
                ps=handles[r],
                update=fabs[r].array("u", (COUNT,), "float64"),
                model=fabs[r].array("w", (COUNT,), "float64"),
            )
            for r in (2, 3)
        ]
        for _ in range(3):
            for run in runs:
                run.batch(1, cluster, proxy)
        models = check_versions(runs, per_version=1)
        assert max(models) == 6
        servers = rows(cluster, "ps_servers")
    assert swallowed == [kind]
    assert proxy.resets > 0
    np.testing.assert_array_equal(runs[-1].model, models[6])
    primary, replica = sorted(servers, key=lambda row: row["role"])
    assert primary["pushes"] == primary["applied"] == primary["version"] == 6
    assert (replica["logged"], replica["applied"], replica["version"]) == (6, 6, 6)
