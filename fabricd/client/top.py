"""What ``fabricctl top`` shows: rates and latencies from two status samples of a daemon.

A daemon's ``status`` carries its metrics (``status["metrics"]``: every sample its Prometheus
endpoint serves, as JSON).  Counters say what happened since the daemon started; a live view
wants what happens now, so :func:`view` takes two samples ``seconds`` apart and turns the
differences into rates (bytes per second per peer, operations per second) and into latency
quantiles of the operations that completed between them.  Pure functions of their inputs: the
CLI samples and draws, the tests feed them dicts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.wire import Meta

#: the families top reads (names in docs/operations.md, "Metrics")
OPS_COMPLETED = "fabricd_operations_completed_total"
OPS_FAILED = "fabricd_operations_failed_total"
LATENCY = "fabricd_operation_latency_seconds_bucket"
SENT = "fabricd_peer_sent_bytes_total"
RECEIVED = "fabricd_peer_received_bytes_total"


def samples(status: Meta, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name`` in ``status["metrics"]``."""
    for row in status.get("metrics", {}).get(name, []):
        yield row["labels"], float(row["value"])


def total(status: Meta, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for have, v in samples(status, name) if labels.items() <= have.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram, as Prometheus's ``histogram_quantile`` estimates it.

    Args:
        buckets: (upper bound, cumulative count) pairs, ascending, +Inf last.

    Returns:
        the estimate (linear within the bucket it falls in; the last finite bound when it
        falls in +Inf), or None when the histogram is empty.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _latency_buckets(before: Meta | None, after: Meta) -> list[tuple[float, float]]:
    """The latency histogram of every kind and size class together, between two samples."""
    counts: dict[float, float] = {}
    for labels, value in samples(after, LATENCY):
        bound = float(labels["le"])
        counts[bound] = counts.get(bound, 0.0) + value
    if before is not None:
        for labels, value in samples(before, LATENCY):
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) - value
    return sorted(counts.items())


def _peer_rates(before: Meta | None, after: Meta, seconds: float) -> list[dict[str, Any]]:
    rows = []
    #: the network monitor's figures by node (a daemon of an older release has none)
    network = {row.get("node"): row for row in after.get("network", []) if isinstance(row, dict)}
    for peer in after.get("peers", []):
        node = str(peer["node"])
        row: dict[str, Any] = {"peer": peer["node"], "state": peer["state"]}
        figures = network.get(peer["node"], {})
        row["up_available"], row["down_available"] = figures.get("up"), figures.get("down")
        for key, name in (("sent", SENT), ("received", RECEIVED)):
            now = total(after, name, peer=node)
            row[f"{key}_bytes"] = now
            then = now if before is None else total(before, name, peer=node)
            row[f"{key}_bytes_per_second"] = (now - then) / seconds if seconds > 0 else 0.0
        rows.append(row)
    return rows


def view(before: Meta | None, after: Meta, seconds: float) -> dict[str, Any]:
    """One daemon as ``fabricctl top`` shows it, JSON-ready.

    Args:
        before: its status ``seconds`` earlier (None: only totals, rates are 0).
        after: its status now.
        seconds: the time between the two.

    Returns:
        node, socket, state, metrics_url, clients, pending operations, completed and failed
        operations per second, p50/p99 latency (seconds) of the operations that completed in
        the interval (None if none did), and per peer its state, bytes and bytes per second
        each way, and the bandwidth its network monitor figures say the peer has available
        each way (``up_available``, ``down_available``; None from a daemon without them).
    """

    def rate(name: str) -> float:
        if before is None or seconds <= 0:
            return 0.0
        return (total(after, name) - total(before, name)) / seconds

    buckets = _latency_buckets(before, after)
    return {
        "node": after["node"],
        "socket": after.get("socket", ""),
        "state": after["state"],
        "metrics_url": after.get("metrics_url", ""),
        "clients": len(after.get("clients", [])),
        "pending_ops": after.get("pending_ops", 0),
        "ops_completed": total(after, OPS_COMPLETED),
        "ops_per_second": rate(OPS_COMPLETED),
        "failed_per_second": rate(OPS_FAILED),
        "latency_p50": quantile(0.5, buckets),
        "latency_p99": quantile(0.99, buckets),
        "interval": seconds,
        "peers": _peer_rates(before, after, seconds),
    }
