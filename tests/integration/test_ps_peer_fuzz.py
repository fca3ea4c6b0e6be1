"""A rogue peer against a daemon that serves a parameter-server shard to real workers (issue
12: "malformed pushes rejected with a clear error and the server keeps serving"; RELIABILITY
Z4 and Z5 for the PUSH, PULL, REPLICATE, REPLICATED and JOIN frames).

Three real daemons on loopback (``test_peer_fuzz``'s set-up): node 0 is killed and the test
plays it, authenticated with the shared secret, as the job's rank 0, a worker of the model.
Node 2 is the target: it serves shard 0 (rank 1; its replica, rank 2, is on node 1) and
follows shard 1 (rank 4 replicates rank 3 of node 1).  Real workers, rank 5 on node 1 and
rank 6 on node 2, push and pull between the rogue's frames, and the model they pull must stay
the exact sum of the pushes acknowledged.

What the daemon must do with each frame: close the rogue's links and log why (a protocol
error), or answer it with a refusal and keep the link (a frame another rank would have sent
in good faith), or drop and count it; never allocate what a header declares past its bounds,
never let one rogue frame reach the real workers, the other shard's pair or node 1's links.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import pytest

import fabricd
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps import snapshot as ps_snapshot
from fabricd.engines.ps.consistency import Consistency, update_rule
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import Entry
from fabricd.frames import ps as ps_frames
from fabricd.wire import Kind

from .test_peer_fuzz import (
    TARGET,
    MiB,
    _closed_saying,
    _log_says,
    _pretend_node_zero,
    _real_peer_untouched,
    _rss,
    _sealed_head,
    _session,
    _status,
)
from .test_ps import wait

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from fabricd.client import ParameterServer
    from fabricd.daemon.launcher import LocalCluster

    from .peer_client import PeerSession

pytestmark = pytest.mark.timeout(300)

JOB = "ps-rogue"
COUNT = 1000
SHARD = COUNT // 2  #: elements of each of the two shards
#: rank -> node: servers 1 (node 2) and 3 (node 1), their replicas 2 (node 1) and 4 (node 2),
#: workers 5 (node 1) and 6 (node 2); rank 0, a worker too, is the rogue on node 0
PLACEMENT = {1: 2, 2: 1, 3: 1, 4: 2, 5: 1, 6: 2}
SIZE = len(PLACEMENT) + 1
WORKERS = (5, 6)
#: the spec every rank opens the model with, as a frame carries it
SPEC: dict[str, Any] = {
    "n": SIZE,
    "size": COUNT,
    "dtype": "float64",
    "servers": [1, 3],
    "replicas": [2, 4],
    "consistency": "async",
    "staleness": 0,
    "delay_bound": None,
    "chunk": 1,
    "scheduling": "arrival",
    "aggregation": False,
    "replication": "chain",
    "divergence_bound": None,
    "distribution": "direct",
}


class _Fabric:
    """The real ranks, and what their workers had acknowledged."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.fabs = {
            rank: fabricd.connect(
                job=JOB, rank=rank, size=SIZE, socket_path=cluster.nodes[node].socket_path
            )
            for rank, node in PLACEMENT.items()
        }
        self.pss: dict[int, ParameterServer] = {}
        for rank, fab in self.fabs.items():
            role = "server" if rank in (1, 3) else "replica" if rank in (2, 4) else "worker"
            self.pss[rank] = fab.parameter_server(
                "m", (COUNT,), "float64", role, servers=[1, 3], replicas=[2, 4], consistency="async"
            )
        self.models = {w: self.fabs[w].array("w", (COUNT,), "float64") for w in WORKERS}
        self.updates = {w: self.fabs[w].array("u", (COUNT,), "float64") for w in WORKERS}
        self.acked = np.zeros(COUNT)
        self.pushes = 0

    def step(self) -> None:
        """Each worker pushes (distinct integers, so the sum is exact) and pulls: the model is
        the sum of every push acknowledged."""
        fabs = list(self.fabs.values())
        for w in WORKERS:
            self.pushes += 1
            self.updates[w][:] = np.arange(COUNT) * w + self.pushes
        handles = [self.pss[w].push_async(self.updates[w]) for w in WORKERS]
        for w, handle in zip(WORKERS, handles, strict=True):
            result = wait(handle, fabs)
            assert not any(result.dropped), result
            self.acked += self.updates[w]
        for w in WORKERS:
            wait(self.pss[w].pull_async(self.models[w]), fabs)
            np.testing.assert_array_equal(self.models[w], self.acked)

    def close(self) -> None:
        for fab in self.fabs.values():
            fab.close()


@contextlib.contextmanager
def _served(make_cluster: Callable[..., LocalCluster]) -> Iterator[tuple[Any, ...]]:
    # slow liveness (the rogue sends no heartbeats): only a frame takes its links down; a
    # short route_timeout: a frame for a shard nobody opens is refused within the test
    cluster, secret, real = _pretend_node_zero(
        make_cluster, suspect_after=30.0, down_after=120.0, route_timeout=1.0
    )
    fabric = _Fabric(cluster)
    try:
        fabric.step()  # both replicas joined and confirm
        yield cluster, secret, real, fabric
    finally:
        fabric.close()


#: the rogue is one daemon that reconnects after each closed session: a new incarnation each
#: time would be a restarted node 0, whose worker rank 0 membership reports gone at once (and
#: the shard logs its loss), which is not what these tests look at
ROGUE_INCARNATION = time.time_ns() + 10**16


def _rogue(cluster: LocalCluster, secret: bytes) -> PeerSession:
    """A session of node 0 that announced rank 0, once the target knows the rank (so what it
    answers rank 0 comes back on these links)."""
    peer = _session(cluster, secret, ROGUE_INCARNATION)
    announce = {"job": JOB, "rank": 0, "size": SIZE, "present": True, "owner": os.getuid()}
    peer.send(Kind.ANNOUNCE, announce)
    guard = time.monotonic() + 20  # a hang guard
    while not [r for r in _status(cluster, TARGET)["ranks"] if (r["job"], r["rank"]) == (JOB, 0)]:
        assert time.monotonic() < guard, "the target never took the rogue's announcement"
        time.sleep(0.02)
    return peer


def _counters(cluster: LocalCluster) -> dict[str, int]:
    return dict(_status(cluster, TARGET)["counters"])


def _shard_rows(cluster: LocalCluster) -> dict[tuple[int, str], tuple[int, int]]:
    """(shard, role) -> (version, entries logged) of every copy of the model, both nodes."""
    rows = {}
    for node in (1, TARGET):
        for row in _status(cluster, node)["ps_servers"]:
            if row["job"] == JOB:
                rows[row["shard"], row["role"]] = (row["version"], row["logged"])
    return rows


def _frame_meta(kind: type, **fields: Any) -> dict[str, Any]:
    common = {"job": JOB, "name": "m", "spec": SPEC}
    meta: dict[str, Any] = kind(**{**common, **fields}).to_meta()
    return meta


def _push_meta(shard: int = 0, worker: int = 0, **fields: Any) -> dict[str, Any]:
    server = SPEC["servers"][shard] if shard < 2 else 1
    base = {"shard": shard, "server": server, "worker": worker, "iteration": 0, "base": 0}
    return _frame_meta(ps_frames.Push, **{**base, "epoch": 0, **fields})


def _pull_meta(shard: int = 0, **fields: Any) -> dict[str, Any]:
    base = {"shard": shard, "server": 1, "worker": 0, "clock": 0, "since": 0, "epoch": 0}
    return _frame_meta(ps_frames.Pull, **{**base, **fields})


def _dense(values: np.ndarray[Any, Any], size: int = SHARD) -> bytes:
    return ps_push.HEADER.pack(0, 8, 0, 0, size, values.size) + values.astype("<f8").tobytes()


def _sparse(indices: list[int], values: list[float], count: int | None = None) -> bytes:
    n = len(indices) if count is None else count
    head = ps_push.HEADER.pack(1, 8, 0, 0, SHARD, n)
    return head + np.asarray(indices, "<u4").tobytes() + np.asarray(values, "<f8").tobytes()


#: (what it is, its payload, what the target's log must say)
_MALFORMED_PUSHES: list[tuple[str, bytes, str]] = [
    ("shorter than its header", bytes(5), "malformed push: 5 B is shorter than its header"),
    (
        "a header that lies about its count",
        ps_push.HEADER.pack(0, 8, 0, 0, SHARD, SHARD) + np.ones(100).tobytes(),
        f"malformed push: {ps_push.HEADER.size + 800} B for {SHARD} values of 8 B (kind 0)",
    ),
    (
        "a sparse header declaring 2**40 values",
        _sparse([1], [1.0], count=2**40),
        f"malformed push: a sparse update of {2**40} values for {SHARD} elements",
    ),
    (
        "an index out of range",
        _sparse([3, SHARD], [1.0, 1.0]),
        "malformed push: indices that are not strictly ascending below the size",
    ),
    (
        "indices out of order",
        _sparse([7, 3], [1.0, 1.0]),
        "malformed push: indices that are not strictly ascending below the size",
    ),
    (
        "a NaN",
        _dense(np.where(np.arange(SHARD) == 3, np.nan, 1.0)),
        "malformed push: a value that is not finite",
    ),
    (
        "an infinity, sparse",
        _sparse([4], [np.inf]),
        "malformed push: a value that is not finite",
    ),
    (
        "an update of the wrong size",
        _dense(np.ones(SHARD - 1), size=SHARD - 1),
        f"malformed push: an update of {SHARD - 1} elements for a shard of {SHARD}",
    ),
    (
        "values of 16 B",
        ps_push.HEADER.pack(0, 16, 0, 0, SHARD, SHARD) + bytes(16 * SHARD),
        "malformed push: values of 16 B for a model of float64",
    ),
    (
        "8 MiB for 500 values",
        ps_push.HEADER.pack(0, 8, 0, 0, SHARD, SHARD) + bytes(8 * MiB),
        f"malformed push: {ps_push.HEADER.size + 8 * MiB} B for {SHARD} values",
    ),
]


def test_malformed_pushes_close_the_rogues_links_and_the_workers_go_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    with _served(make_cluster) as (cluster, secret, real, fabric):
        pid = cluster.nodes[TARGET].pid
        before = _rss(pid)
        rows = _shard_rows(cluster)
        for what, payload, why in _MALFORMED_PUSHES:
            peer = _rogue(cluster, secret)
            send = partial(peer.data.send, Kind.PUSH, _push_meta(), payload)
            _closed_saying(cluster, peer, send, why)
            assert _shard_rows(cluster) == rows, f"{what}: a shard changed"
            fabric.step()
            rows = _shard_rows(cluster)
        # a header declaring 4 GiB: refused at the header, before a byte of it is read
        peer = _rogue(cluster, secret)
        head = _sealed_head(peer.data, Kind.PUSH, _push_meta(), 4 << 30)
        _closed_saying(cluster, peer, lambda: peer.data.sock.sendall(head), "B exceeds")
        fabric.step()
        assert _rss(pid) - before < 32 * MiB  # nothing declared was allocated, nothing kept
        assert cluster.nodes[TARGET].process.poll() is None
        _real_peer_untouched(cluster, real)


def test_pushes_and_pulls_a_server_must_not_take_are_refused_or_dropped_on_a_live_link(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    with _served(make_cluster) as (cluster, secret, real, fabric):
        peer = _rogue(cluster, secret)
        counters = _counters(cluster)
        rows = _shard_rows(cluster)
        # as rank 5, a real worker of node 1: dropped, counted and logged, never applied
        said = _log_says(cluster, "node 0 sent a frame as rank 5, not on it")
        update = _dense(np.full(SHARD, 1e6))
        peer.send(Kind.PUSH, _push_meta(worker=5, iteration=1), update, data=True)
        peer.send(Kind.PULL, _pull_meta(worker=5, clock=1))
        guard = time.monotonic() + 20  # a hang guard
        while _counters(cluster)["ps_frames_dropped"] < counters["ps_frames_dropped"] + 2:
            assert time.monotonic() < guard, "the frames as rank 5 were not dropped"
            time.sleep(0.02)
        assert _log_says(cluster, "node 0 sent a frame as rank 5, not on it") > said
        assert _shard_rows(cluster) == rows
        # a spec unlike the server's: refused with the reason, to rank 0, on a link kept open
        huge = {**SPEC, "size": 2**62, "servers": list(range(1000)), "replicas": []}
        for spec in ({**SPEC, "dtype": "float32"}, huge):
            peer.send(Kind.PUSH, {**_push_meta(), "spec": spec}, update, data=True)
            pushed = ps_frames.Pushed.from_meta(peer.receive(Kind.PUSHED).meta)
            assert (pushed.worker, pushed.iteration, pushed.version) == (0, 0, 0)
            assert pushed.dropped is not None
            assert pushed.dropped.startswith(f"the worker opened it as {spec['size']} x ")
            if spec is not huge:  # (a reason is cut at MAX_PS_REASON characters)
                assert pushed.dropped.endswith(
                    "the server as 1000 x float64 on servers [1, 3] (replicas [2, 4]), async"
                )
            peer.send(Kind.PULL, {**_pull_meta(), "spec": spec})
            pulled = ps_frames.Pulled.from_meta(peer.receive(Kind.PULLED, data=True).meta)
            assert pulled.error == pushed.dropped
            fabric.step()
        # a shard past the spec's: held as if its server had not opened yet, then refused
        early = _counters(cluster)["ps_early_expired"]
        peer.send(Kind.PUSH, _push_meta(shard=9), update, data=True)
        pushed = ps_frames.Pushed.from_meta(peer.receive(Kind.PUSHED).meta)
        assert (pushed.shard, pushed.version) == (9, 0)
        assert "did not open parameter server 'm' within route_timeout" in str(pushed.dropped)
        peer.send(Kind.PULL, _pull_meta(shard=9))
        pulled = ps_frames.Pulled.from_meta(peer.receive(Kind.PULLED, data=True).meta)
        assert "within route_timeout" in str(pulled.error)
        assert _counters(cluster)["ps_early_expired"] == early + 2
        # replication frames for a shard past the spec's: dropped and counted
        dropped = _counters(cluster)["ps_frames_dropped"]
        replicate = {"index": 1, "entry": "lose", "worker": 0, "iteration": 0, "base": 0}
        peer.send(
            Kind.REPLICATE,
            _frame_meta(ps_frames.Replicate, shard=9, server=3, replica=4, **replicate),
            data=True,
        )
        peer.send(
            Kind.REPLICATED,
            {"job": JOB, "name": "m", "sh": 9, "srv": 1, "rep": 2, "ix": 1},
        )
        peer.send(Kind.JOIN, _frame_meta(ps_frames.Join, shard=9, server=1, replica=2, epoch=0))
        guard = time.monotonic() + 20  # a hang guard
        while _counters(cluster)["ps_frames_dropped"] < dropped + 3:
            assert time.monotonic() < guard, "the frames for shard 9 were not dropped"
            time.sleep(0.02)
        row = next(p for p in _status(cluster, TARGET)["peers"] if p["node"] == 0)
        assert (row["state"], row["links"]) == ("up", {"control": True, "data": True})
        fabric.step()
        peer.close()
        _real_peer_untouched(cluster, real)


def _snapshot_state() -> dict[str, Any]:
    """The state a shard of this model would send its replica (as a primary that took
    nothing), for a test to spoil."""
    server = ShardServer(
        initial=np.zeros(SHARD),
        workers=(0, *WORKERS),
        consistency=Consistency.ASYNC,
        rule=update_rule("sum", lr=None, momentum=None),
    )
    return server.state()


def _spoiled(change: Callable[[dict[str, Any]], None]) -> bytes:
    state = _snapshot_state()
    change(state)
    return ps_snapshot.encode(state)


def _coordinator(field: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state["coordinator"][field] = value

    return change


#: (what it is, the REPLICATE's fields, its payload, what the target's log must say); all go
#: to shard 1's replica, rank 4 on the target, as from its primary rank 3
_BAD_REPLICATION: list[tuple[str, dict[str, Any], bytes, str]] = [
    ("a snapshot of junk", {"entry": "snapshot"}, b"\xc1\x00junk", "malformed snapshot"),
    ("a snapshot nested 10^5 deep", {"entry": "snapshot"}, b"\x91" * 100_000, "malformed snap"),
    ("a snapshot that is a list", {"entry": "snapshot"}, b"\x90", "a snapshot is a map"),
    (
        "a snapshot array of dtype object",
        {"entry": "snapshot"},
        msgpack.packb({"store": msgpack.ExtType(1, b"\x0a" + msgpack.packb(["object", [1]]))}),
        "snapshot array of 'object' [1] in 0 B",
    ),
    (
        "a snapshot of another shard size",
        {"entry": "snapshot"},
        _spoiled(lambda s: s["store"].update(model=np.zeros(SHARD + 1))),
        "snapshot array 'model' of float64 (501,), not float64 (500,)",
    ),
    (
        "a snapshot whose workers are not ints",
        {"entry": "snapshot"},
        _spoiled(_coordinator("live", [{"a": 1}])),
        "snapshot workers must be ints",
    ),
    (
        "a snapshot whose counters are not ints",
        {"entry": "snapshot"},
        _spoiled(_coordinator("delays", ["s"] * len(_snapshot_state()["coordinator"]["delays"]))),
        "snapshot counters must be ints >= 0",
    ),
    (
        "an entry out of order",
        {"entry": "lose", "index": 10**6},
        b"",
        f"replication entry {10**6} after",
    ),
]


@pytest.mark.parametrize(
    ("what", "change", "payload", "why"), _BAD_REPLICATION, ids=[c[0] for c in _BAD_REPLICATION]
)
def test_a_bad_replication_entry_is_refused_and_changes_nothing(
    what: str, change: dict[str, Any], payload: bytes, why: str
) -> None:
    """What shard 1's replica does with each bad entry had its primary's node sent it (the
    daemon takes such a frame only from the node its primary rank lives on: below)."""
    replica = ShardServer(
        initial=np.zeros(SHARD),
        workers=(0, *WORKERS),
        consistency=Consistency.ASYNC,
        rule=update_rule("sum", lr=None, momentum=None),
        replica=True,
    )
    assert replica.restore(0, ps_snapshot.encode(_snapshot_state()))
    before = ps_snapshot.encode(replica.state())
    kind, index = change["entry"], change.get("index", 1)
    take: Callable[[], object] = (
        partial(replica.restore, index, payload)
        if kind == "snapshot"
        else partial(replica.log, Entry(index=index, kind=kind, worker=0, payload=payload), 0.0)
    )
    with pytest.raises(fabricd.RemoteProtocolError, match=re.escape(why)):
        take()
    assert ps_snapshot.encode(replica.state()) == before, f"{what}: the replica changed"


def test_replication_frames_from_a_node_their_rank_is_not_on_are_dropped(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Entries, snapshots, confirmations and JOINs claiming another node's server or replica
    rank are dropped and counted before they are read: a rogue cannot forge an entry for a
    replica (a failover would serve an update nobody acknowledged), a confirmation that makes
    a primary acknowledge early, or a snapshot that demotes a primary."""
    with _served(make_cluster) as (cluster, secret, real, fabric):
        pid = cluster.nodes[TARGET].pid
        before = _rss(pid)
        rows = _shard_rows(cluster)
        peer = _rogue(cluster, secret)
        dropped = _counters(cluster)["ps_frames_dropped"]
        fields = {"shard": 1, "server": 3, "replica": 4, "index": 0}
        fields |= {"worker": 0, "iteration": 0, "base": 0}
        for _, change, payload, _ in _BAD_REPLICATION:
            meta = _frame_meta(ps_frames.Replicate, **{**fields, **change})
            peer.data.send(Kind.REPLICATE, meta, payload)
        # the next entry the replica awaits, a well-formed push it would have applied
        index = rows[1, "replica"][1] + 1
        meta = _frame_meta(ps_frames.Replicate, **{**fields, "entry": "push", "index": index})
        peer.data.send(Kind.REPLICATE, meta, _dense(np.full(SHARD, 1e6)))
        # a confirmation of an entry shard 0's primary (rank 1, here) never sent, as rank 2
        peer.send(Kind.REPLICATED, {"job": JOB, "name": "m", "sh": 0, "srv": 1, "rep": 2, "ix": 9})
        # a JOIN of shard 0 as its partner, rank 2, which lives on node 1
        peer.send(Kind.JOIN, _frame_meta(ps_frames.Join, shard=0, server=1, replica=2, epoch=0))
        sent = len(_BAD_REPLICATION) + 3
        guard = time.monotonic() + 20  # a hang guard
        while _counters(cluster)["ps_frames_dropped"] < dropped + sent:
            assert time.monotonic() < guard, "the forged frames were not dropped"
            time.sleep(0.02)
        assert _shard_rows(cluster) == rows
        assert _log_says(cluster, "node 0 sent a frame as server rank 3, which is not on it")
        row = next(p for p in _status(cluster, TARGET)["peers"] if p["node"] == 0)
        assert (row["state"], row["links"]) == ("up", {"control": True, "data": True})
        for _ in range(3):
            fabric.step()
        rows = _shard_rows(cluster)
        for shard in (0, 1):  # each replica holds its primary's model, entry for entry
            assert rows[shard, "primary"] == rows[shard, "replica"]
        assert rows[0, "primary"][0] + rows[1, "primary"][0] == 2 * fabric.pushes
        assert _rss(pid) - before < 32 * MiB
        peer.close()
        _real_peer_untouched(cluster, real)
