"""What fabricctl top computes from two status samples: rates and latency quantiles."""

from __future__ import annotations

import pytest

from fabricd.client.top import quantile, view


def _status(completed: int, sent: int, buckets: dict[str, int], **extra) -> dict:
    latency = [
        {"labels": {"service": "p2p", "kind": "send", "size": "0-4KiB", "le": le}, "value": n}
        for le, n in buckets.items()
    ]
    return {
        "node": 0,
        "state": "serving",
        "socket": "/run/x.sock",
        "clients": [{"id": 1}, {"id": 2}],
        "pending_ops": 3,
        "peers": [{"node": 1, "state": "up"}],
        "metrics": {
            "fabricd_operations_completed_total": [
                {"labels": {"service": "p2p", "kind": "send"}, "value": completed},
                {"labels": {"service": "p2p", "kind": "recv"}, "value": 0},
            ],
            "fabricd_peer_sent_bytes_total": [
                {"labels": {"peer": "1", "channel": "control"}, "value": 100},
                {"labels": {"peer": "1", "channel": "data"}, "value": sent},
            ],
            "fabricd_peer_received_bytes_total": [
                {"labels": {"peer": "1", "channel": "control"}, "value": 50},
            ],
            "fabricd_operation_latency_seconds_bucket": latency,
        },
        **extra,
    }


def test_rates_are_the_differences_over_the_interval():
    before = _status(10, 1000, {"0.001": 10, "0.01": 10, "+Inf": 10})
    after = _status(30, 5000, {"0.001": 20, "0.01": 30, "+Inf": 30})
    v = view(before, after, 2.0)
    assert v["ops_per_second"] == 10.0
    assert v["ops_completed"] == 30
    assert v["clients"] == 2
    assert v["pending_ops"] == 3
    assert v["socket"] == "/run/x.sock"
    (peer,) = v["peers"]
    assert peer["sent_bytes_per_second"] == 2000.0
    assert peer["sent_bytes"] == 5100  # both channels
    assert peer["received_bytes_per_second"] == 0.0
    # of the 20 completed in the interval, 10 took <= 1 ms and 10 between 1 and 10 ms
    assert v["latency_p50"] == pytest.approx(0.001)
    assert v["latency_p99"] == pytest.approx(0.001 + 0.009 * 9.8 / 10)


def test_no_operation_in_the_interval_has_no_latency():
    status = _status(10, 1000, {"0.001": 10, "+Inf": 10})
    v = view(status, status, 1.0)
    assert v["latency_p50"] is None
    assert v["ops_per_second"] == 0.0


def test_a_single_sample_gives_totals_and_no_rates():
    v = view(None, _status(10, 1000, {"0.001": 10, "+Inf": 10}), 0.0)
    assert v["ops_per_second"] == 0.0
    assert v["peers"][0]["sent_bytes_per_second"] == 0.0
    assert v["latency_p50"] == pytest.approx(0.0005)


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(1.0, 0), (2.0, 4), (float("inf"), 4)], 1.5),
        (0.99, [(1.0, 1), (float("inf"), 100)], 1.0),  # in +Inf: the last finite bound
        (0.5, [(1.0, 0), (float("inf"), 0)], None),
        (0.5, [], None),
    ],
)
def test_quantile_estimates_like_prometheus(q, buckets, expected):
    assert quantile(q, buckets) == expected
