"""The metrics building blocks, the endpoint and its setting, without a daemon."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fabricd.daemon import metrics_http
from fabricd.daemon.config import Config, load
from fabricd.daemon.metrics import (
    LATENCY_BUCKETS,
    Histogram,
    LinkTotals,
    MetricsRegistry,
    OperationStats,
    counter,
    gauge,
    size_class,
)
from fabricd.daemon.metrics_http import MetricsServer
from fabricd.engines.link.handshake import Channel
from fabricd.errors import ConfigError
from fabricd.transports.base import LinkStatistics


class _Fixed:
    """A collector that yields what it is given."""

    def __init__(self, *families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_size_classes_have_inclusive_upper_bounds():
    assert size_class(0) == "0-4KiB"
    assert size_class(4096) == "0-4KiB"
    assert size_class(4097) == "4-64KiB"
    assert size_class(1 << 20) == "64KiB-1MiB"
    assert size_class((16 << 20) + 1) == "16MiB+"


def test_histogram_counts_each_value_once_in_its_bucket():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        h.observe(value)
    assert h.counts == [2, 1, 1]
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.sum == pytest.approx(7.65)


def test_operations_add_up_and_parse_back():
    ops = OperationStats("p2p", kinds=("recv", "send"))
    for _ in range(3):
        ops.started("send")
    ops.ended("send", 100, 0.0002, None)
    ops.ended("send", 1 << 20, 0.004, None)
    ops.ended("send", 10, 0.0, "peer_failed")
    ops.started("recv")
    ops.abandoned("recv")
    ops.set_stalled(2)
    registry = MetricsRegistry([_Fixed(*ops.families(pending=0))])
    got = _parse(registry.exposition().decode())
    send = frozenset({("service", "p2p"), ("kind", "send")})
    assert got["fabricd_operations_started_total", send] == 3
    assert got["fabricd_operations_completed_total", send] == 2
    failed = send | {("code", "peer_failed")}
    assert got["fabricd_operations_failed_total", failed] == 1
    recv = frozenset({("service", "p2p"), ("kind", "recv")})
    assert got["fabricd_operations_started_total", recv] == 1
    assert got["fabricd_operations_abandoned_total", recv] == 1
    assert got["fabricd_operations_completed_total", recv] == 0  # known kinds start at 0
    assert got["fabricd_stalled_operations", frozenset({("service", "p2p")})] == 2
    small = send | {("size", "0-4KiB")}
    assert got["fabricd_operation_latency_seconds_count", small] == 1
    assert got["fabricd_operation_latency_seconds_bucket", small | {("le", "0.00025")}] == 1
    assert got["fabricd_operation_latency_seconds_bucket", small | {("le", "0.0001")}] == 0
    assert len(LATENCY_BUCKETS) + 1 == sum(
        1 for name, labels in got if name.endswith("_bucket") and labels >= small
    )


def test_link_totals_never_go_back_when_a_link_is_replaced():
    totals = LinkTotals()
    first = LinkStatistics(frames_sent=3, frames_received=2, bytes_sent=300, bytes_received=20)
    key = (1, Channel.DATA)
    assert totals.totals({key: first})[key] == first
    totals.retire(1, Channel.DATA, first)
    fresh = LinkStatistics(frames_sent=1, frames_received=0, bytes_sent=5, bytes_received=0)
    now = totals.totals({key: fresh})[key]
    assert (now.frames_sent, now.bytes_sent, now.bytes_received) == (4, 305, 20)
    assert totals.totals({})[key] == first  # while the peer has no link


def test_snapshot_has_the_numbers_the_exposition_has():
    families = (
        counter("fabricd_x", "x.", [({"peer": "1"}, 5), ({"peer": "2"}, 7)]),
        gauge("fabricd_y", "y.", [({}, 0.5)]),
    )
    registry = MetricsRegistry([_Fixed(*families)])
    snapshot = registry.snapshot()
    assert snapshot["fabricd_x_total"] == [
        {"labels": {"peer": "1"}, "value": 5},
        {"labels": {"peer": "2"}, "value": 7},
    ]
    assert snapshot["fabricd_y"] == [{"labels": {}, "value": 0.5}]
    parsed = _parse(registry.exposition().decode())
    assert parsed["fabricd_x_total", frozenset({("peer", "2")})] == 7


# -- the setting --------------------------------------------------------------------------
def test_metrics_address_defaults_to_loopback():
    host = Config().metrics_address.rpartition(":")[0]
    assert host == "127.0.0.1"


@pytest.mark.parametrize(
    "value", ["", "127.0.0.1:0", "[::1]:9720", "10.0.0.5:9720", "0.0.0.0:9720", "[::]:9720"]
)
def test_metrics_address_accepts_an_ip_and_port_or_nothing(value):
    assert load(None, environ={}, flags={"metrics_address": value}).config.metrics_address == value


@pytest.mark.parametrize(
    "value", ["localhost:9720", "127.0.0.1", ":9720", "127.0.0.1:99999", "http://127.0.0.1:1/"]
)
def test_metrics_address_refuses_what_is_not_ip_and_port(value):
    with pytest.raises(ConfigError, match="metrics_address"):
        load(None, environ={}, flags={"metrics_address": value})


# -- the endpoint -------------------------------------------------------------------------
async def _ask(address: str, request: bytes) -> bytes:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    return answer


@pytest.fixture
async def server():
    registry = MetricsRegistry([_Fixed(gauge("fabricd_y", "y.", [({}, 1)]))])
    endpoint = MetricsServer(registry.exposition)
    await endpoint.start("127.0.0.1:0")
    yield endpoint
    endpoint.close()


async def test_endpoint_serves_the_exposition_on_the_address_asked_for(server):
    host, _, port = server.address.rpartition(":")
    assert host == "127.0.0.1"
    assert int(port) > 0
    assert server.url == f"http://{server.address}/metrics"
    answer = await _ask(server.address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"text/plain; version=0.0.4" in head
    assert _parse(body.decode())["fabricd_y", frozenset()] == 1


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
        (b"junk\r\n\r\n", b"400"),
        (b"HEAD /metrics HTTP/1.0\r\n\r\n", b"200"),
    ],
)
async def test_endpoint_answers_only_what_it_serves(server, request_bytes, status):
    answer = await _ask(server.address, request_bytes)
    assert answer.split()[1] == status
    if request_bytes.startswith(b"HEAD"):
        assert answer.endswith(b"\r\n\r\n")  # the head alone


async def test_endpoint_hangs_up_on_a_request_head_too_long(server):
    answer = await _ask(server.address, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000)
    assert answer == b""


async def test_endpoint_that_cannot_bind_raises_oserror(server):
    other = MetricsServer(lambda: b"")
    with pytest.raises(OSError, match="address already in use"):
        await other.start(server.address)
    assert other.url == ""


async def _stuck_reader(address: str) -> socket.socket:
    """A scraper that asks for a large answer and never reads it (a tiny receive window)."""
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    sock.send(b"GET /metrics HTTP/1.1\r\n\r\n")
    return sock


@pytest.fixture
async def big_server():
    endpoint = MetricsServer(lambda: b"# x\n" * (4 << 20))  # 16 MiB: more than the kernel holds
    await endpoint.start("127.0.0.1:0")
    yield endpoint
    endpoint.close()


async def test_a_scraper_that_never_reads_its_answer_is_cut_off(big_server, monkeypatch):
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT", 0.5)
    sock = await _stuck_reader(big_server.address)
    try:
        async with asyncio.timeout(10):  # a hang guard: cut within REQUEST_TIMEOUT
            while big_server.connections != 1:
                await asyncio.sleep(0.01)
            while big_server.connections:
                await asyncio.sleep(0.05)
    finally:
        sock.close()


async def test_close_hangs_up_on_a_scraper_that_never_reads_its_answer(big_server):
    sock = await _stuck_reader(big_server.address)
    try:
        async with asyncio.timeout(10):
            while big_server.connections != 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the answer is written, and stuck in the transport
            big_server.close()
            while big_server.connections:  # a hang guard: close() lets go of every one
                await asyncio.sleep(0.01)
    finally:
        sock.close()
