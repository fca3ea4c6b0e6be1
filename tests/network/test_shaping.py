"""A shaped link (``tbf``): bulk data keeps to the shaped rate, heartbeats keep their time, and a
slow consumer on it is neither dropped from nor buffered for (RELIABILITY F10).

Two daemons in their own network namespaces; node 0's link is shaped both ways.  The rate check
is a ratio against the rate configured in the same run, never an absolute time; the liveness
check reads the daemons' own peer tables and logs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS
from tests.network.observe import Sampler, anon_bytes, outcomes, pattern, peers

if TYPE_CHECKING:
    from tests.network.cluster import MakeNetCluster

pytestmark = pytest.mark.network

#: the shaped rate of the throughput case, in Mbit/s
RATE_MBIT = 100
#: how far the payload rate may be from the shaped rate (the issue's figure).  Measured: 0.95
#: (TCP/IP and Ethernet headers take ~4 % of what tbf counts), so the check has room both ways
TOLERANCE = 0.15
SUSPECT_AFTER = FAST_LIVENESS["suspect_after"]
#: the sending daemon's own memory may grow by less than this under a slow consumer (F10)
RSS_BOUND = 64 << 20


def test_bulk_data_keeps_to_the_shaped_rate_and_heartbeats_keep_their_time(
    make_net_cluster: MakeNetCluster,
) -> None:
    """100 Mbit/s link: 48 MiB (about 4 s of it) moves at the shaped rate within 15 %.

    Meanwhile both daemons' peer tables, read every 50 ms, show the other node up and heard
    from within ``suspect_after`` (so heartbeats and control frames were never starved behind
    DATA), and neither daemon logged a peer going suspect.
    """
    fabric = make_net_cluster(2)
    fabric.net.shape(0, RATE_MBIT)
    nbytes = 48 << 20
    with (
        fabricd.connect(job="bulk", rank=0, size=2, socket_path=fabric.socket(0)) as sender,
        fabricd.connect(job="bulk", rank=1, size=2, socket_path=fabric.socket(1)) as receiver,
    ):
        source, sink = (
            sender.array("x", (nbytes,), "uint8"),
            receiver.array("y", (nbytes,), "uint8"),
        )
        source[...] = pattern(1, nbytes)
        warm_in, warm_out = (
            receiver.recv_async(sink[:1], src=0),
            sender.send_async(source[:1], to=1),
        )
        assert [o.ended for o in outcomes([warm_in, warm_out], 30)] == ["ok", "ok"]

        def both_tables() -> list[dict[str, object]]:
            return peers(fabric.socket(0)) + peers(fabric.socket(1))

        with Sampler(both_tables) as tables:
            recv = receiver.recv_async(sink, src=0)
            started = time.monotonic()
            send = sender.send_async(source, to=1)
            ended = outcomes([recv, send], 120)
        assert [o.ended for o in ended] == ["ok", "ok"], ended
        seconds = max(o.at for o in ended) - started
        assert np.array_equal(sink, source)

    ratio = nbytes * 8 / seconds / (RATE_MBIT * 1e6)
    print(f"shaped {RATE_MBIT} Mbit/s: payload at {ratio:.3f} of the rate ({seconds:.2f} s)")
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, f"{ratio:.3f} of the shaped rate"
    rows = [row for sample in tables.samples for row in sample]
    assert rows, "the peer tables were read during the transfer"
    assert {row["state"] for row in rows} == {"up"}
    silent = max(float(row["silent_for"]) for row in rows)
    print(f"longest silence seen during the transfer: {silent:.3f} s of {SUSPECT_AFTER} s")
    assert silent < SUSPECT_AFTER
    for node in fabric.cluster.nodes:
        assert "-> suspect" not in node.log_path.read_text(), node.log_tail()


def test_a_slow_consumer_on_a_shaped_link_loses_nothing_and_costs_the_sender_no_memory(
    make_net_cluster: MakeNetCluster,
) -> None:
    """F10: 24 messages of 4 MiB (96 MiB, over the 64 MiB bound) posted at once on a 200 Mbit/s
    link to a receiver that posts one receive at a time and pauses between them.

    Every message arrives intact and in order (same tag: FIFO), every send completes, none
    fails or vanishes; the sending daemon's own memory (RssAnon, sampled throughout) grows by
    less than 64 MiB, because a message waits as a small RTS until its receive is posted.
    """
    fabric = make_net_cluster(2)
    fabric.net.shape(0, 2 * RATE_MBIT)
    count, nbytes = 24, 4 << 20
    daemon = fabric.pid(0)
    with (
        fabricd.connect(job="slow", rank=0, size=2, socket_path=fabric.socket(0)) as sender,
        fabricd.connect(job="slow", rank=1, size=2, socket_path=fabric.socket(1)) as receiver,
    ):
        sources = [sender.array(f"m{i}", (nbytes,), "uint8") for i in range(count)]
        for i, array in enumerate(sources):
            array[...] = pattern(100 + i, nbytes)
        sink = receiver.array("sink", (nbytes,), "uint8")
        warm_in, warm_out = (
            receiver.recv_async(sink[:1], src=0),
            sender.send_async(sources[0][:1], to=1),
        )
        assert [o.ended for o in outcomes([warm_in, warm_out], 30)] == ["ok", "ok"]
        before = anon_bytes(daemon)
        with Sampler(lambda: anon_bytes(daemon)) as memory:
            sends = [sender.send_async(array, to=1, tag=5) for array in sources]
            for i in range(count):
                time.sleep(0.1)  # the slow consumer
                got = outcomes([receiver.recv_async(sink, src=0, tag=5)], 60)[0]
                assert got.ended == "ok", got
                assert np.array_equal(sink, pattern(100 + i, nbytes)), f"message {i} differs"
            sent = outcomes(sends, 60)
        assert [o.ended for o in sent] == ["ok"] * count, sent
        status = sender.status()
    growth = max(memory.samples) - before
    print(f"sending daemon's RssAnon grew by at most {growth / 2**20:.1f} MiB")
    assert growth < RSS_BOUND
    assert status["pending_ops"] == 0
