"""``fabricctl status`` and the metrics endpoint tell the same numbers (issue 27, item 1).

Two real daemons on loopback run a known workload of every service: messages (one between
nodes, one between ranks of a node), collectives (some failing), stochastic reduces and a
parameter server.  Then every number in each daemon's ``status`` is found in what its metrics
export, with the same value: the counters under ``fabricd_status_counters_total`` and, where a
series of its own counts the same thing, in that series too (so a counter that lies in both
places, as ``bytes_sent`` did, is caught); the per-job rows through the totals the series keep.
A number that no series exports is listed in :data:`NOT_EXPORTED` with the reason, so a new
number in ``status`` fails this test until someone decides where it is exported.

The numbers are compared with ``status["metrics"]``, the snapshot of the endpoint's samples the
daemon takes in the same call (so nothing moves between the two readings), and that snapshot
with a scrape of the endpoint for every sample compared that the workload alone moves.
"""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.scrape import scrape
from tests.integration.test_collectives import WAIT, ranks

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.client import Client

pytestmark = pytest.mark.timeout(240)

#: rank 0 on node 0, ranks 1 and 2 on node 1
PLACEMENT = (0, 1, 1)
SENT = (1 << 20) + 3  #: bytes rank 0 sends rank 1 (node 0 to node 1)
COPIED = 5000  #: bytes rank 1 sends rank 2 (both on node 1: a copy)
FAILED = 5  #: collectives ranks 1 and 2 call unlike each other (each fails one operation)

#: status numbers no series exports, by path (``[]``: every row of a list, ``*``: every key of a
#: map), and why
NOT_EXPORTED: dict[str, str] = {
    "monitor_interval": "a setting (fabricctl config show), not a figure of the daemon's work",
    "monitor_cadence": "monitor_interval as the fabric's size stretches it: a setting too",
    **dict.fromkeys(
        ("id", "clients[].id", "clients[].pid", "clients[].uid", "clients[].rank"),
        "a client's identity: no series carries a uid, pid or anything a client chose "
        "(operations.md, Metrics); the request id is the reply's, not a number of the daemon",
    ),
    **dict.fromkeys(
        (
            "clients[].owner",
            "ranks[].rank",
            "ranks[].size",
            "ranks[].node",
            "ranks[].owner",
            *(
                f"collectives[].{k}"
                for k in ("owner", "round", "nodes[]", "lost[]", "calls", "included", "late")
            ),
            *(
                f"collectives[].{k}"
                for k in ("settled", "unled", "counted_elsewhere", "waiting", "mean_active")
            ),
            *(
                f"stochastic_reduces[].{k}"
                for k in ("owner", "rank", "round", "in_degree", "out_degree", "notifies")
            ),
            *(
                f"stochastic_reduces[].{k}"
                for k in ("acks", "duplicates", "resent", "waiting[]", "broken")
            ),
            *(
                f"ps_servers[].{k}"
                for k in ("owner", "shard", "epoch", "version", "complete", "applied", "held_pulls")
            ),
            *(
                f"ps_servers[].{k}"
                for k in ("live_workers", "pushes", "resent", "push_bytes", "push_dense_bytes")
            ),
            *(
                f"ps_servers[].{k}"
                for k in ("pulls", "pull_bytes", "pull_dense_bytes", "logged", "unreplicated")
            ),
            *(
                f"ps_servers[].{k}"
                for k in ("aggregates", "aggregates_refused", "lag", "divergence")
            ),
            *(f"ps_servers[].trees.{k}" for k in ("batches", "pulls", "forwarded", "server_bytes")),
            *(
                f"ps_workers[].{k}"
                for k in ("owner", "rank", "clock", "versions[]", "epochs[]", "pushes", "pulls")
            ),
            *(f"ps_workers[].{k}" for k in ("glnp_clipped", "server_dropped", "resent")),
        ),
        "per job, collective, reducer or model: no series names a job or anything a client "
        "chose (their number has no bound); the totals the series keep are checked below",
    ),
}


# -- the workload ------------------------------------------------------------------------------
def _messages(fabs: list[Client]) -> None:
    out, into = fabs[0].array("out", (SENT,), "uint8"), fabs[1].array("in", (SENT,), "uint8")
    out[...] = np.arange(SENT, dtype=np.uint64).astype(np.uint8)
    received = fabs[1].recv_async(into, src=0)
    fabs[0].send(out, to=1, timeout=WAIT)
    received.wait(WAIT)
    assert np.array_equal(into, out)
    here, there = fabs[1].array("here", (COPIED,), "uint8"), fabs[2].array("c", (COPIED,), "uint8")
    here[...] = 7
    copied = fabs[2].recv_async(there, src=1)
    fabs[1].send(here, to=2, timeout=WAIT)
    copied.wait(WAIT)
    assert (there == 7).all()


def together(fabs: list[Client], call: str, arrays: list[Any], *args: Any, **kw: Any) -> list[Any]:
    handles = [getattr(f, call)(a, *args, **kw) for f, a in zip(fabs, arrays, strict=True)]
    return [h.wait(WAIT) for h in handles]


def _collectives(fabs: list[Client]) -> None:
    grads = [f.array("g", (1000,), "float32") for f in fabs]
    for g in grads:
        g[...] = 1
    for _ in range(2):
        together(fabs, "allreduce_async", grads)
    together(fabs, "broadcast_async", grads, 0)
    handles = [f.barrier_async() for f in fabs]
    for h in handles:
        h.wait(WAIT)


def failing_collectives(a: Client, b: Client, count: int) -> None:
    """``count`` collectives two ranks of one node call unlike each other: of each pair, the
    call that opened the collective fails (one failed operation), the other is refused."""
    for i in range(count):
        x, y = a.array(f"bad{i}", (10,), "float32"), b.array(f"bad{i}", (20,), "float32")
        handles = [a.allreduce_async(x, name=f"bad{i}"), b.allreduce_async(y, name=f"bad{i}")]
        for handle in handles:
            with pytest.raises(fabricd.UsageError, match="every rank must call it alike"):
                handle.wait(WAIT)


def _reduces(fabs: list[Client]) -> None:
    models = [f.array("w", (1000,), "float32") for f in fabs]
    for _ in range(2):
        together(fabs, "stochastic_reduce_async", models, "ring")


def _parameter_server(fabs: list[Client]) -> None:
    pss = [
        f.parameter_server("m", (100,), "float64", "server" if r == 0 else "worker", servers=[0])
        for r, f in enumerate(fabs)
    ]
    for rank in (1, 2):
        update = fabs[rank].array("u", (100,), "float64")
        update[...] = rank
        pss[rank].push(update, timeout=WAIT)
        pss[rank].pull(fabs[rank].array("model", (100,), "float64"), timeout=WAIT)


# -- reading what the metrics export -----------------------------------------------------------
Key = tuple[str, frozenset[tuple[str, str]]]


class Exported:
    """The samples of ``status["metrics"]``, and which of them a check read."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.samples: dict[Key, float] = {
            (name, frozenset(row["labels"].items())): row["value"]
            for name, rows in status["metrics"].items()
            for row in rows
        }
        self.read: set[Key] = set()

    def one(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no sample {name}{labels}"
        self.read.add(key)
        return self.samples[key]

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 when
        there are none: a family labelled by error code, say, has no sample before the first)."""
        keys = [k for k in self.samples if k[0] == name and labels.items() <= dict(k[1]).items()]
        self.read.update(keys)
        return sum(self.samples[k] for k in keys)

    def labels(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for n, labels in self.samples if n == name]


def numbers(value: Any, path: str = "") -> Iterator[str]:
    """The path of every number in ``value`` (``[]`` for a list's rows, ``*`` for a map's
    numbered keys)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int | float):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            name = "*" if re.fullmatch(r"\d+", key) else key
            yield from numbers(item, f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for item in value:
            yield from numbers(item, f"{path}[]")


# -- the checks --------------------------------------------------------------------------------
def _identity(status: dict[str, Any], m: Exported, asked: tuple[float, float]) -> set[str]:
    (info,) = m.labels("fabricd_info")
    assert info["node"] == str(status["node"])
    assert info["version"] == str(status["version"])
    assert len(m.labels("fabricd_peer_up")) + 1 == status["nodes"]
    assert m.one("fabricd_incarnation") == status["incarnation"]
    # the daemon read its clock for uptime while the request was under way
    now = m.one("fabricd_start_time_seconds") + status["uptime"]
    assert asked[0] <= now <= asked[1]
    return {"node", "version", "nodes", "incarnation", "uptime"}


def _peers(status: dict[str, Any], m: Exported, took: float) -> set[str]:
    for row in status["peers"]:
        peer = str(row["node"])
        assert m.one("fabricd_peer_incarnation", peer=peer) == row["incarnation"]
        assert m.total("fabricd_peer_sent_bytes_total", peer=peer) == row["bytes_sent"]
        assert m.total("fabricd_peer_received_bytes_total", peer=peer) == row["bytes_received"]
        # the snapshot is read after the rows, within the same request
        for name, field in (("silent", "silent_for"), ("state", "state_for")):
            exported = m.one(f"fabricd_peer_{name}_seconds", peer=peer)
            assert 0 <= exported - row[field] <= took
    for peer, failures in status["dial_failures"].items():
        assert m.one("fabricd_peer_dial_failures", peer=peer) == failures
    fields = ("node", "incarnation", "bytes_sent", "bytes_received", "silent_for", "state_for")
    return {f"peers[].{f}" for f in fields} | {"dial_failures.*"}


#: status counters that a series of their own counts too: (series, labels)
COUNTED_TWICE: dict[str, tuple[str, dict[str, str]]] = {
    "bytes_received": ("fabricd_message_received_bytes_total", {"service": "p2p"}),
    "bytes_copied": ("fabricd_message_copied_bytes_total", {"service": "p2p"}),
    "update_bytes_sent": ("fabricd_reduce_update_bytes_sent_total", {"service": "stochastic"}),
    "rounds": ("fabricd_collective_rounds_total", {"service": "collectives"}),
    "ops_completed": ("fabricd_operations_completed_total", {}),
    "ops_failed": ("fabricd_operations_failed_total", {}),
    "refused_clients": ("fabricd_clients_refused_total", {}),
    "integrity_failures": ("fabricd_integrity_failures_total", {}),
    "peer_resets": ("fabricd_peer_resets_total", {}),
    "refused_unknown_hosts": ("fabricd_handshake_failures_total", {"reason": "unknown_host"}),
    "handshakes_evicted": ("fabricd_handshake_failures_total", {"reason": "evicted"}),
}


def _counters(status: dict[str, Any], m: Exported) -> set[str]:
    counters = status["counters"]
    for name, value in counters.items():
        assert m.one("fabricd_status_counters_total", counter=name) == value, name
        if name in COUNTED_TWICE:
            series, labels = COUNTED_TWICE[name]
            assert m.total(series, **labels) == value, name
        for prefix, series in (
            ("refused_clients_", "fabricd_clients_refused_total"),
            ("attach_refused_", "fabricd_attach_refused_total"),
        ):
            if name.startswith(prefix):
                assert m.one(series, reason=name.removeprefix(prefix)) == value, name
    # bytes_sent: every payload byte sent to peers, messages' and collectives' alike
    assert counters["bytes_sent"] >= m.one("fabricd_message_sent_bytes_total", service="p2p")
    return {f"counters.{name}" for name in counters}


def _levels(status: dict[str, Any], m: Exported) -> set[str]:
    """The top-level gauges, and the client rows' numbers as totals."""
    p2p = {"service": "p2p"}
    assert m.one("fabricd_segments") == status["segments"]
    assert m.one("fabricd_mapped_bytes") == status["mapped_bytes"]
    assert m.one("fabricd_operations_pending", **p2p) == status["pending_ops"]
    assert m.one("fabricd_unexpected_messages", **p2p) == status["unexpected_messages"]
    assert m.one("fabricd_eager_pool_bytes", **p2p) == status["eager_pool_bytes"]
    assert m.one("fabricd_eager_pool_limit_bytes", **p2p) == status["eager_pool_limit"]
    clients = status["clients"]  # all but the one that asked, which attached nothing
    assert m.one("fabricd_clients") == len(clients) + 1
    totals = {
        "segments": ("fabricd_segments", {}),
        "mapped_bytes": ("fabricd_mapped_bytes", {}),
        "ops": ("fabricd_operations_pending", p2p),
        "collective_calls": ("fabricd_collective_calls_open", {"service": "collectives"}),
        "reduce_calls": ("fabricd_operations_pending", {"service": "stochastic"}),
        "ps_calls": ("fabricd_operations_pending", {"service": "ps"}),
        "exchange_calls": ("fabricd_operations_pending", {"service": "ako"}),
    }
    for field, (series, labels) in totals.items():
        assert m.one(series, **labels) == sum(c[field] for c in clients), field
    held = {str(row["uid"]): row["bytes"] for row in status["held_bytes"]}
    assert held, "the workload holds nothing: the check would be vacuous"
    assert {
        r["uid"]: m.one("fabricd_held_bytes", uid=r["uid"]) for r in m.labels("fabricd_held_bytes")
    } == held
    for per in ("uid", "job"):
        limit = m.one("fabricd_held_bytes_limit", per=per)
        assert limit == status[f"max_held_bytes_per_{per}"]
    top = ("segments", "mapped_bytes", "pending_ops", "unexpected_messages")
    top += ("eager_pool_bytes", "eager_pool_limit", "held_bytes[].uid", "held_bytes[].bytes")
    top += ("max_held_bytes_per_uid", "max_held_bytes_per_job")
    return set(top) | {f"clients[].{f}" for f in totals}


def _rows(status: dict[str, Any], m: Exported) -> set[str]:
    """The per-job rows, through the totals the series keep of them."""
    colls, reducers = status["collectives"], status["stochastic_reduces"]
    service = {"service": "collectives"}
    assert m.one("fabricd_collectives", **service) == len(colls)
    assert m.one("fabricd_collective_rounds_total", **service) == sum(c["rounds"] for c in colls)
    active = m.one("fabricd_collective_active_ranks_total", **service)
    assert active == pytest.approx(sum(c["rounds"] * (c["mean_active"] or 0) for c in colls))
    service = {"service": "stochastic"}
    assert m.one("fabricd_reducers", **service) == len(reducers)
    assert m.one("fabricd_reduce_inputs_used_total", **service) == sum(
        k * n for r in reducers for k, n in enumerate(r["used"])
    )
    rejected = sum(r["torn"] + r["stale"] for r in reducers)
    assert m.one("fabricd_reduce_inputs_rejected_total", **service) == rejected
    assert status["counters"]["reduces"] == sum(r["reduces"] for r in reducers)
    checked = {"collectives[].rounds", "collectives[].mean_active"}
    checked |= {f"stochastic_reduces[].{f}" for f in ("used[]", "torn", "stale", "reduces")}
    return checked | _ps_rows(status, m)


def _network(status: dict[str, Any], m: Exported) -> set[str]:
    """The network monitor's rows, one gauge per figure and node (the age read a moment
    apart: the statistics and the series each ask the clock)."""
    for row in status["network"]:
        node = str(row["node"])
        assert m.one("fabricd_link_up_bytes_per_second", node=node) == row["up"]
        assert m.one("fabricd_link_down_bytes_per_second", node=node) == row["down"]
        assert m.one("fabricd_link_rtt_seconds", node=node) == row["rtt"]
        age = m.one("fabricd_link_figures_age_seconds", node=node)
        assert age == (math.inf if row["age"] is None else pytest.approx(row["age"], abs=5.0))
        assert m.one("fabricd_link_figures_stale", node=node) == float(row["stale"])
    return {f"network[].{f}" for f in ("node", "up", "down", "rtt", "age")}


def _ps_rows(status: dict[str, Any], m: Exported) -> set[str]:
    ps = {"service": "ps"}
    servers = [s for s in status["ps_servers"] if s["role"] == "primary"]
    workers = status["ps_workers"]
    for role in ("primary", "replica"):
        count = sum(1 for s in status["ps_servers"] if s["role"] == role)
        assert m.one("fabricd_ps_shards", role=role, **ps) == count

    def summed(rows: list[dict[str, Any]], field: str) -> int:
        return sum(row[field] for row in rows)

    for filtered, suffix in (("yes", ""), ("no", "_dense")):
        for way in ("push", "pull"):
            exported = m.one(f"fabricd_ps_{way}_bytes_total", filtered=filtered, **ps)
            assert exported == summed(workers, f"{way}{suffix}_bytes")
    selected = "fabricd_ps_gradients_selected_total"
    assert m.one(selected, filter="considered", **ps) == summed(workers, "considered")
    assert m.one(selected, filter="gsmp", **ps) == summed(workers, "smp_selected")
    assert m.one(selected, filter="grp", **ps) == summed(workers, "rp_selected")
    assert m.one(selected, filter="dropped", **ps) == summed(workers, "considered") - summed(
        workers, "pushed"
    )
    dropped = "fabricd_ps_updates_dropped_total"
    assert m.one(dropped, reason="delay_worker", **ps) == summed(workers, "delay_dropped")
    assert m.one(dropped, reason="delay_server", **ps) == summed(servers, "dropped_delay")
    assert m.one(dropped, reason="lost", **ps) == summed(servers, "dropped_lost")
    assert m.one(dropped, reason="scheduled", **ps) == summed(servers, "dropped_scheduled")
    published = "fabricd_ps_parameters_published_total"
    assert m.one(published, what="published", **ps) == summed(servers, "published")
    assert m.one(published, what="considered", **ps) == summed(servers, "considered")
    assert m.one("fabricd_ps_update_delay_sum", **ps) == summed(servers, "delay_sum")
    applied = sum(sum(s["delays"]) for s in servers)
    assert m.one("fabricd_ps_update_delay_count", **ps) == applied
    worker = ("push_bytes", "push_dense_bytes", "pull_bytes", "pull_dense_bytes", "considered")
    worker += ("smp_selected", "rp_selected", "pushed", "delay_dropped")
    server = ("dropped_delay", "dropped_lost", "dropped_scheduled", "published", "considered")
    server += ("delay_sum", "delays[]")
    return {f"ps_workers[].{f}" for f in worker} | {f"ps_servers[].{f}" for f in server}


#: samples that move by themselves (heartbeats, the clock), left out of the scrape comparison
MOVING = re.compile(
    r"fabricd_peer_(sent|received)_|fabricd_peer_(silent|state)_seconds|fabricd_link_"
)


def _monitor_counter(labels: frozenset[tuple[str, str]]) -> bool:
    """A status counter of the network monitor: its readings and reports go on every
    ``monitor_interval`` by themselves."""
    return dict(labels).get("counter", "").startswith("monitor_")


def _check_node(socket_path: str) -> dict[str, Any]:
    with fabricd.connect(socket_path=socket_path) as asker:
        wall, started = time.time(), time.monotonic()
        status = asker.status()
        took, asked = time.monotonic() - started, (wall, time.time())
        scraped = scrape(status["metrics_url"])  # while the asker is still a client
    m = Exported(status)
    checked = _identity(status, m, asked) | _peers(status, m, took) | _counters(status, m)
    checked |= _levels(status, m) | _rows(status, m) | _network(status, m)
    found = set(numbers({k: v for k, v in status.items() if k != "metrics"}))
    unchecked = found - checked - NOT_EXPORTED.keys()
    assert not unchecked, f"status numbers no check finds in the metrics: {sorted(unchecked)}"
    # the endpoint serves what the snapshot says, for everything the workload alone moves
    for key in sorted(m.read):
        if not MOVING.match(key[0]) and not _monitor_counter(key[1]):
            assert scraped[key] == float(m.samples[key]), key  # the text format carries floats
    return status


def test_every_number_in_status_is_exported_with_the_same_value(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, PLACEMENT, "known") as fabs:
        _messages(fabs)
        _collectives(fabs)
        failing_collectives(fabs[1], fabs[2], FAILED)
        _reduces(fabs)
        _parameter_server(fabs)
        statuses = [_check_node(node.socket_path) for node in cluster.nodes]
    # and the workload is what the numbers say
    sender, receiver = (s["counters"] for s in statuses)
    assert receiver["bytes_received"] == SENT
    assert receiver["bytes_copied"] == COPIED
    assert sender["bytes_sent"] > SENT  # the message and the collectives' frames
    assert receiver["ops_failed"] == FAILED
    assert sender["ops_failed"] == 0
    assert sender["rounds"] == receiver["rounds"] == 4  # two allreduces, a broadcast, a barrier
    assert sender["reduces"] == 2
    assert receiver["reduces"] == 4  # two ranks there


def _counted(socket_path: str) -> dict[str, int]:
    with fabricd.connect(socket_path=socket_path) as asker:
        counters: dict[str, int] = asker.status()["counters"]
    exported = scrape_counters(socket_path)
    # nothing moves them between the two readings, but the network monitor's own ticks
    steady = {k: v for k, v in counters.items() if not k.startswith("monitor_")}
    assert {k: v for k, v in exported.items() if not k.startswith("monitor_")} == steady
    return counters


def scrape_counters(socket_path: str) -> dict[str, int]:
    with fabricd.connect(socket_path=socket_path) as asker:
        url = asker.status()["metrics_url"]
    return {
        dict(labels)["counter"]: int(value)
        for (name, labels), value in scrape(url).items()
        if name == "fabricd_status_counters_total"
    }


def test_a_counter_two_services_keep_is_their_sum(make_cluster) -> None:
    """``bytes_sent`` is counted by the messages and by the collectives: a 1 MiB message after a
    collective adds exactly its size (the collectives' count replaced the messages' before,
    and status said 0 after a 40 MiB transfer); ``ops_failed`` counts failed collectives."""
    cluster = make_cluster(2)
    sockets = [node.socket_path for node in cluster.nodes]
    with ranks(cluster, PLACEMENT, "summed") as fabs:
        together(fabs, "allreduce_async", [f.array("g", (1000,), "float32") for f in fabs])
        collective = _counted(sockets[0])["bytes_sent"]
        assert collective > 0  # the allreduce's frames
        out, into = fabs[0].array("out", (SENT,), "uint8"), fabs[1].array("in", (SENT,), "uint8")
        received = fabs[1].recv_async(into, src=0)
        fabs[0].send(out, to=1, timeout=WAIT)
        received.wait(WAIT)
        assert _counted(sockets[0])["bytes_sent"] == collective + SENT
        before = _counted(sockets[1])
        failing_collectives(fabs[1], fabs[2], FAILED)
        after = _counted(sockets[1])
    assert after["ops_failed"] - before["ops_failed"] == FAILED
    assert after["ops_completed"] == before["ops_completed"]
