"""The metrics endpoint of real daemons: what a Prometheus scrape sees, and status's copy of it."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fabricd

from .inproc import fabric
from .scrape import Samples, scrape


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def _grew(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = _key(name, **labels)
    return after[key] - before.get(key, 0.0)


def _transfer(sockets: list[str], nbytes: int) -> None:
    """Rank 0 on node 0 sends ``nbytes`` to rank 1 on node 1, which checks them."""
    data = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    failures: list[BaseException] = []

    def receive() -> None:
        try:
            with fabricd.connect(job="metrics", rank=1, size=2, socket_path=sockets[1]) as fab:
                array = fab.array("in", (nbytes,), "uint8")
                fab.recv(array, src=0, timeout=30)
                assert np.array_equal(array, data)
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    with fabricd.connect(job="metrics", rank=0, size=2, socket_path=sockets[0]) as fab:
        array = fab.array("out", (nbytes,), "uint8")
        array[...] = data
        fab.send(array, to=1, timeout=30)
    receiver.join(60)
    assert not receiver.is_alive()
    assert not failures, failures


def test_a_known_transfer_moves_the_counters_by_exactly_its_amounts(make_cluster):
    cluster = make_cluster(2)
    urls = [node.metrics_url for node in cluster.nodes]
    nbytes = (1 << 20) + 3  # one DATA chunk (chunk_size is 4 MiB), in the 1-16MiB class
    before = [scrape(url) for url in urls]
    _transfer([node.socket_path for node in cluster.nodes], nbytes)
    after = [scrape(url) for url in urls]
    p2p = {"service": "p2p"}
    sender, receiver = (0, "1"), (1, "0")  # (node, its peer's label)
    for (node, peer), kind in ((sender, "send"), (receiver, "recv")):
        b, a = before[node], after[node]
        assert _grew(b, a, "fabricd_operations_started_total", kind=kind, **p2p) == 1
        assert _grew(b, a, "fabricd_operations_completed_total", kind=kind, **p2p) == 1
        latency = {"kind": kind, "size": "1-16MiB", **p2p}
        assert _grew(b, a, "fabricd_operation_latency_seconds_count", **latency) == 1
        assert (
            a[_key("fabricd_operation_latency_seconds_bucket", le="+Inf", **latency)]
            == (a[_key("fabricd_operation_latency_seconds_count", **latency)])
        )
        assert not any(name == "fabricd_operations_failed_total" for name, _ in a)
        assert a[_key("fabricd_peer_up", peer=peer)] == 1
    b, a = before[0], after[0]
    assert _grew(b, a, "fabricd_message_sent_bytes_total", **p2p) == nbytes
    assert _grew(b, a, "fabricd_peer_sent_frames_total", peer="1", channel="data") == 1
    framed = _grew(b, a, "fabricd_peer_sent_bytes_total", peer="1", channel="data")
    assert nbytes < framed <= nbytes + 512  # one frame: header, metadata, MAC trailer
    # the receive's RTR (posted first) and the send's RTS race: a CTS, an RTR the send answered,
    # or both (they crossed: the RTR is dropped and the RTS takes the receive)
    cts = _grew(b, a, "fabricd_peer_messages_received_total", kind="CTS")
    rtr = _grew(b, a, "fabricd_peer_messages_received_total", kind="RTR")
    assert (cts, rtr) in ((1, 0), (0, 1), (1, 1))
    assert _grew(b, a, "fabricd_peer_messages_received_total", kind="DONE") == 1
    b, a = before[1], after[1]
    assert _grew(b, a, "fabricd_message_received_bytes_total", **p2p) == nbytes
    assert _grew(b, a, "fabricd_peer_received_frames_total", peer="0", channel="data") == 1
    assert _grew(b, a, "fabricd_peer_received_bytes_total", peer="0", channel="data") == framed
    assert _grew(b, a, "fabricd_peer_messages_received_total", kind="RTS") == 1
    assert _grew(b, a, "fabricd_peer_messages_received_total", kind="DATA") == 1


def test_status_reports_the_endpoint_and_the_same_numbers(make_cluster):
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    with fabricd.connect(socket_path=node.socket_path) as client:
        status = client.status()
    assert status["metrics_url"] == node.metrics_url
    assert "metrics_error" not in status
    scraped = scrape(status["metrics_url"])
    incarnation = status["metrics"]["fabricd_incarnation"][0]["value"]
    assert incarnation == pytest.approx(scraped[_key("fabricd_incarnation")])
    assert incarnation == pytest.approx(status["incarnation"])
    peers = {row["node"]: row for row in status["peers"]}
    peer_incarnation = scraped[_key("fabricd_peer_incarnation", peer="1")]
    assert peer_incarnation == pytest.approx(peers[1]["incarnation"])
    assert scraped[_key("fabricd_loop_lag_seconds_count")] > 0  # heartbeats' timers fired
    # every counter of status is exported under its own name
    for name, value in status["counters"].items():
        exported = scraped[_key("fabricd_status_counters_total", counter=name)]
        assert exported >= value  # a counter only grows between the two reads


def test_endpoint_binds_exactly_the_configured_loopback_address(make_cluster):
    cluster = make_cluster(1)
    host, _, port = cluster.nodes[0].metrics_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        assert conn.getpeername() == (host, int(port))
    other = ("127.0.0.2", int(port))  # the same port on another loopback address: not bound
    with pytest.raises(ConnectionRefusedError), socket.create_connection(other, timeout=10):
        pass


def test_an_empty_metrics_address_serves_nothing(make_cluster):
    cluster = make_cluster(1, metrics_address="")
    with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as client:
        status = client.status()
    assert status["metrics_url"] == ""
    assert status["metrics"]["fabricd_info"]  # status has the numbers all the same


def test_an_address_in_use_costs_the_endpoint_not_the_daemon(make_cluster):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        cluster = make_cluster(1, metrics_address=address)
        with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as client:
            status = client.status()
    assert status["metrics_url"] == ""
    assert "cannot bind metrics_address " + address in status["metrics_error"]
    assert status["state"] == "serving"


# -- in-process daemons: a reset link's counters are kept -------------------------------------
def _sample(daemon: Any, name: str, **labels: str) -> float:
    for row in daemon.metrics.snapshot().get(name, []):
        if row["labels"] == labels:
            return float(row["value"])
    return 0.0


async def test_per_peer_counters_never_go_back_when_links_are_reset(tmp_path):
    async with fabric(tmp_path) as fab:
        d0 = fab.daemons[0]
        labels = {"peer": "1", "channel": "control"}
        await fab.until(lambda: _sample(d0, "fabricd_peer_sent_frames_total", **labels) > 3)
        before = _sample(d0, "fabricd_peer_sent_frames_total", **labels)
        for (node, _channel), link in list(d0.links.items()):
            if node == 1:
                link.close("cut for the test")
        await fab.until(lambda: _sample(d0, "fabricd_peer_resets_total") >= 1)
        await fab.until(fab.up)
        assert _sample(d0, "fabricd_peer_sent_frames_total", **labels) >= before
        scraped = await asyncio.to_thread(scrape, d0.metrics_server.url)
        assert scraped[_key("fabricd_peer_resets_total")] >= 1
        assert scraped[_key("fabricd_peer_sent_frames_total", **labels)] >= before


def test_every_family_served_is_documented(make_cluster):
    cluster = make_cluster(2)
    _transfer([node.socket_path for node in cluster.nodes], 100)  # every family has samples
    with urllib.request.urlopen(cluster.nodes[0].metrics_url, timeout=10) as answer:
        families = list(text_string_to_metric_families(answer.read().decode()))
    documented = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    names = [f.name + ("_total" if f.type == "counter" else "") for f in families]
    assert len(names) > 20
    missing = [name for name in names if f"`{name}`" not in documented]
    assert not missing, f"docs/operations.md, Metrics, does not list {missing}"
