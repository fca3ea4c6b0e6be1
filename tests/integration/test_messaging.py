"""Point-to-point messages between ranks of real daemons on loopback (issue 2's integration set)."""

from __future__ import annotations

import numpy as np
import pytest

import fabricd
from fabricd.dtypes import ITEMSIZE
from tests.integration.ranks import Step, payload, run_plan

NODES = 3
SIZE = 6  # rank r lives on node r % 3: every pair of nodes, and pairs on the same node


def _plans(messages: list[tuple[int, int, int, str, int]]) -> dict[int, list[Step]]:
    """Split a globally ordered message list into per-rank plans (deadlock-free in that order)."""
    plans: dict[int, list[Step]] = {r: [] for r in range(SIZE)}
    for src, dst, tag, dtype, count in messages:
        plans[src].append(("send", dst, tag, dtype, count))
        plans[dst].append(("recv", src, tag, dtype, count))
    return plans


def _run(make_cluster, spawn, messages, job: str) -> None:
    cluster = make_cluster(NODES)
    plans = _plans(messages)
    ranks = [
        spawn(run_plan, cluster.nodes[r % NODES].socket_path, job, r, SIZE, plans[r])
        for r in range(SIZE)
    ]
    for r, process in enumerate(ranks):
        process.join(120)
        assert process.exitcode == 0, f"rank {r} failed:\n" + cluster.nodes[r % NODES].log_tail()
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as control:
            assert control.status()["pending_ops"] == 0


def test_sizes_between_every_pair_of_nodes_and_on_one_node(make_cluster, spawn):
    sizes = [0, 1, 7, 12_345, 4 * 1024 * 1024 + 3]
    pairs = [(0, 1), (1, 2), (2, 0), (0, 3), (4, 1)]  # (0,3) and (4,1) share a node
    messages = [(s, d, tag, "uint8", n) for tag, n in enumerate(sizes) for s, d in pairs]
    _run(make_cluster, spawn, messages, "sizes")


def test_every_dtype_round_trips_bit_exactly(make_cluster, spawn):
    messages = []
    for tag, dtype in enumerate(ITEMSIZE):
        messages.append((0, 2, tag, dtype, 1001))  # across nodes
        messages.append((5, 2, tag, dtype, 999))  # same node (5 % 3 == 2)
    _run(make_cluster, spawn, messages, "dtypes")


def test_tags_and_order_keep_messages_apart(make_cluster, spawn):
    # several messages on the same (src, dst) with interleaved tags: each lands in its own recv
    messages = [(1, 0, tag % 3, "int32", 100 + tag) for tag in range(9)]
    _run(make_cluster, spawn, messages, "tags")


@pytest.mark.slow
def test_256_mib_across_nodes(make_cluster, spawn):
    mib = 256 * 1024 * 1024
    _run(make_cluster, spawn, [(0, 1, 0, "float32", mib // 4)], "big")


def test_mismatched_sizes_fail_both_sides_with_the_same_message(make_cluster):
    cluster = make_cluster(2)
    with (
        fabricd.connect(job="mm", rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as a,
        fabricd.connect(job="mm", rank=1, size=2, socket_path=cluster.nodes[1].socket_path) as b,
    ):
        sent = a.array("x", (100,), "float32")
        got = b.array("y", (50,), "float32")
        send = a.send_async(sent, to=1)
        with pytest.raises(fabricd.UsageError, match="does not fit its receive") as on_recv:
            b.recv(got, src=0, timeout=10)
        with pytest.raises(fabricd.UsageError, match="does not fit its receive") as on_send:
            send.wait(timeout=10)
        assert "400 B of float32" in str(on_recv.value)
        assert str(on_recv.value).split(": ", 1)[1] == str(on_send.value).split(": ", 1)[1]


def test_payload_helper_is_deterministic():
    assert np.array_equal(payload(0, 1, 2, "float64", 10), payload(0, 1, 2, "float64", 10))
    assert not np.array_equal(payload(0, 1, 2, "uint8", 64), payload(1, 0, 2, "uint8", 64))
