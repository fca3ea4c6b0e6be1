"""The network monitor across real daemons on loopback: a node's configured figures reach the
other daemons' status in MONITOR reports, and a report with bad figures is refused without
touching the link it came on or anything else (MLfabric §4, §7)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster
from fabricd.wire import Kind

from .test_peer_fuzz import TARGET, _peer, _pretend_node_zero, _real_peer_untouched, _session

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.timeout(120)

#: node 2's configured figures, bytes/s
UP, DOWN = 5_000_000.0, 7_000_000.0
#: a fast t_lag for the test (the default is the paper's 0.2 s)
INTERVAL = 0.05


def _status(cluster: LocalCluster, node: int) -> dict[str, Any]:
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as control:
        return control.status()


def _network_row(cluster: LocalCluster, node: int, about: int) -> dict[str, Any]:
    return next(r for r in _status(cluster, node)["network"] if r["node"] == about)


def _until(check: Callable[[], bool], what: str) -> None:
    guard = time.monotonic() + 30  # a hang guard, never a measurement
    while not check():
        assert time.monotonic() < guard, f"never happened: {what}"
        time.sleep(INTERVAL)


@pytest.fixture
def configured(tmp_path) -> Iterator[LocalCluster]:
    env = {"FABRICD_LINK_UP_BPS": str(UP), "FABRICD_LINK_DOWN_BPS": str(DOWN)}
    cluster = LocalCluster(
        3,
        settings={**FAST_LIVENESS, "monitor_interval": INTERVAL},
        log_dir=tmp_path,
        node_env={2: env},
    )
    cluster.start()
    try:
        cluster.wait_connected()
        yield cluster
    finally:
        cluster.stop()


def test_configured_figures_reach_every_other_daemon(configured: LocalCluster) -> None:
    def seen_everywhere() -> bool:
        rows = [_network_row(configured, node, 2) for node in (0, 1)]
        return all((r["up"], r["down"], r["source"]) == (UP, DOWN, "configured") for r in rows)

    _until(seen_everywhere, "node 2's configured figures in nodes 0 and 1's status")
    row = _network_row(configured, 0, 2)
    assert not row["stale"]
    assert 0 <= row["age"] < 60
    own = _network_row(configured, 2, 2)
    assert (own["up"], own["down"], own["source"]) == (UP, DOWN, "configured")
    counters = _status(configured, 0)["counters"]
    assert counters["monitor_reports_received"] > 0
    assert counters["monitor_reports_refused"] == 0
    # and node 0's own figures reach node 2, whatever their source
    _until(lambda: _network_row(configured, 2, 0)["age"] is not None, "node 0's figures")


def test_a_report_with_bad_figures_is_refused_and_the_link_stays(make_cluster) -> None:
    cluster, secret, real = _pretend_node_zero(make_cluster, monitor_interval=INTERVAL)
    peer = _session(cluster, secret)
    good = {"up": 1e6, "down": 2e6, "rtt": 1e-4, "age": 0.0, "src": "configured"}
    peer.send(Kind.MONITOR, good)
    _until(lambda: _network_row(cluster, TARGET, 0)["up"] == 1e6, "the pretend node's report")
    incarnation = _peer(_status(cluster, TARGET), 0)["incarnation"]
    for bad in ({"up": -1.0}, {"down": float("nan")}, {"src": "guessed"}, {"paths": [[9, 1.0]]}):
        peer.send(Kind.MONITOR, {**good, "up": 3e6, **bad})
    _until(
        lambda: _status(cluster, TARGET)["counters"]["monitor_reports_refused"] == 4,
        "four refusals",
    )
    status = _status(cluster, TARGET)
    row = next(r for r in status["network"] if r["node"] == 0)
    assert (row["up"], row["down"], row["source"]) == (1e6, 2e6, "configured")  # unchanged
    after = _peer(status, 0)
    assert (after["state"], after["incarnation"]) == ("up", incarnation)  # no reset
    assert after["links"] == {"control": True, "data": True}
    peer.send(Kind.MONITOR, {**good, "up": 4e6})  # the link still carries reports
    _until(lambda: _network_row(cluster, TARGET, 0)["up"] == 4e6, "a good report after them")
    log = cluster.nodes[TARGET].log_path.read_text(errors="replace")
    assert "refused a MONITOR report from node 0" in log
    peer.close()
    _real_peer_untouched(cluster, real)
