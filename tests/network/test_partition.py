"""Partitions, heals and a flapping link between two daemons in network namespaces (F9's
two-node form).

A partition sets node 1's bridge port down: frames are dropped, no connection is reset, so
only silence tells.  The documented bound (architecture.md, "Reset rule"; RELIABILITY F2) is
that every operation with a rank on a silent node fails with ``PeerFailed`` within
2·``down_after``; every bound below is derived from the cluster's own liveness settings, and
the longer timeouts are hang guards only.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS
from tests.network.observe import (
    Outcome,
    anon_bytes,
    fd_count,
    outcomes,
    pattern,
    peer_state,
    wait_for,
)

if TYPE_CHECKING:
    from tests.network.cluster import MakeNetCluster, NetCluster

pytestmark = pytest.mark.network

D = FAST_LIVENESS["down_after"]
#: a hang guard for reconnecting after a heal: a dial sent into the partition waits for the
#: kernel's next SYN retransmission (1, 2, 4, 8 s apart), then backs off at most 2 s
RECONNECT_GUARD = 30.0


def _both_up(fabric: NetCluster) -> bool:
    return peer_state(fabric.socket(0), 1) == "up" and peer_state(fabric.socket(1), 0) == "up"


def _exchange(
    left: fabricd.Client, right: fabricd.Client, seed: int, nbytes: int, timeout: float = 30.0
) -> None:
    """Rank 0 sends ``nbytes`` to rank 1 and back; both must arrive intact."""
    for sender, receiver, salt in ((left, right, 0), (right, left, 1)):
        source = sender.array(f"out{seed}-{salt}", (nbytes,), "uint8")
        sink = receiver.array(f"in{seed}-{salt}", (nbytes,), "uint8")
        source[...] = pattern(seed * 2 + salt, nbytes)
        peer = 1 - sender.rank
        done = outcomes(
            [
                receiver.recv_async(sink, src=sender.rank, tag=seed),
                sender.send_async(source, to=peer, tag=seed),
            ],
            timeout,
        )
        assert [o.ended for o in done] == ["ok", "ok"], done
        assert np.array_equal(sink, source)


def _partition_with_waiters(
    fabric: NetCluster, left: fabricd.Client, right: fabricd.Client
) -> tuple[float, list[Outcome]]:
    """Post waiters of every kind on both sides, cut node 1 off, return (cut time, outcomes).

    Waiters: receives from the other side on both ranks, sends whose receive is never posted
    (their RTS waits on the other node), and a 32 MiB message moving over a 100 Mbit/s link
    when the cut comes.
    """
    fabric.net.shape(0, 100)
    bulk = 32 << 20
    moving_out = left.array("moving-out", (bulk,), "uint8")
    moving_in = right.array("moving-in", (bulk,), "uint8")
    handles = [
        right.recv_async(moving_in, src=0, tag=50),
        left.send_async(moving_out, to=1, tag=50),
    ]
    for fab, peer in ((left, 1), (right, 0)):
        for tag in range(3):
            handles.append(
                fab.recv_async(fab.array(f"r{tag}", (1024,), "float32"), src=peer, tag=tag)
            )
        handles.append(fab.send_async(fab.array("s", (1024,), "float32"), to=peer, tag=9))
    assert wait_for(lambda: right.status()["pending_ops"] >= 5, 10) is not None
    time.sleep(0.5)  # the bulk message is moving now (it needs ~2.7 s)
    fabric.net.link_down(1)
    return time.monotonic(), outcomes(handles, 10 * D)


def test_a_partition_fails_every_waiter_within_twice_down_after(
    make_net_cluster: MakeNetCluster,
) -> None:
    """Every waiter on both sides gets ``PeerFailed`` within 2·D of the cut; both mark the
    other down; nothing hangs and nothing completes."""
    fabric = make_net_cluster(2)
    with (
        fabricd.connect(job="cut", rank=0, size=2, socket_path=fabric.socket(0)) as left,
        fabricd.connect(job="cut", rank=1, size=2, socket_path=fabric.socket(1)) as right,
    ):
        cut, ended = _partition_with_waiters(fabric, left, right)
        assert {o.ended for o in ended} == {"PeerFailed"}, ended
        latest = max(o.at for o in ended) - cut
        print(f"{len(ended)} waiters failed; the last {latest:.2f} s after the cut (D = {D} s)")
        assert latest < 2 * D, [(o.what, round(o.at - cut, 3)) for o in ended]
        assert peer_state(fabric.socket(0), 1) == "down"
        assert peer_state(fabric.socket(1), 0) == "down"
        assert left.status()["pending_ops"] == 0
        assert right.status()["pending_ops"] == 0


def test_after_a_heal_the_peers_reconnect_and_new_transfers_succeed(
    make_net_cluster: MakeNetCluster,
) -> None:
    """Cut for 3·D (both sides mark the other down), heal: both see the other up again, and
    messages both ways (1 KiB and 8 MiB) arrive intact; the ranks are relearnt by ANNOUNCE."""
    fabric = make_net_cluster(2)
    with (
        fabricd.connect(job="heal", rank=0, size=2, socket_path=fabric.socket(0)) as left,
        fabricd.connect(job="heal", rank=1, size=2, socket_path=fabric.socket(1)) as right,
    ):
        cut, ended = _partition_with_waiters(fabric, left, right)
        assert {o.ended for o in ended} == {"PeerFailed"}, ended
        assert wait_for(lambda: time.monotonic() - cut >= 3 * D, 10 * D)
        healed = time.monotonic()
        fabric.net.link_up(1)
        up = wait_for(lambda: _both_up(fabric), RECONNECT_GUARD)
        assert up is not None, "the peers did not reconnect after the heal"
        print(f"reconnected {up - healed:.2f} s after the heal (cut for {healed - cut:.1f} s)")
        _exchange(left, right, 1, 1024)
        _exchange(left, right, 2, 8 << 20)


def test_after_a_long_cut_the_link_is_back_within_a_dial_deadline_and_a_backoff(
    make_net_cluster: MakeNetCluster,
) -> None:
    """F9's heal after a cut longer than the kernel's first SYN retries (1, 3, 7, 15 s): the
    link is back within a dial deadline (``handshake_timeout``), a backoff
    (``reconnect_max_backoff``) and a heartbeat exchange.  Here a cut port also fails dials
    quickly once the neighbour entry expires, so this passes without the dial deadline too; the
    deadline itself is tested against a listener that drops SYNs
    (tests/integration/test_peering_faults.py)."""
    settings = {"handshake_timeout": 1.0, "reconnect_max_backoff": 0.5}
    fabric = make_net_cluster(2, **settings)
    cut = time.monotonic()
    fabric.net.link_down(1)
    assert wait_for(lambda: peer_state(fabric.socket(0), 1) == "down", 10 * D) is not None
    assert wait_for(lambda: time.monotonic() - cut >= 20.0, 30.0) is not None
    healed = time.monotonic()
    fabric.net.link_up(1)
    up = wait_for(lambda: _both_up(fabric), RECONNECT_GUARD)
    assert up is not None, "the peers did not reconnect after the heal"
    # a dial that started just before the heal ends within handshake_timeout, the next one
    # starts within reconnect_max_backoff; a heartbeat or two then tells both sides
    bound = settings["handshake_timeout"] + settings["reconnect_max_backoff"] + 2 * D
    assert up - healed <= bound, f"reconnected {up - healed:.2f} s after the heal"


def _one_message(
    left: fabricd.Client,
    right: fabricd.Client,
    source: np.ndarray[Any, Any],
    sink: np.ndarray[Any, Any],
    seq: int,
) -> str:
    """Send message ``seq`` from rank 0 to rank 1 in the same two arrays; return how the
    receive ended, after checking every byte of one that completed.

    Allowed endings: ``ok``, ``PeerFailed``, or ``OperationFailed`` with code ``no_such_rank``
    (the peer's ranks were not relearnt within ``route_timeout``); none may hang.
    """
    source[...] = pattern(1000 + seq, len(source))
    sink[...] = 0
    ended = outcomes(
        [right.recv_async(sink, src=0, tag=seq), left.send_async(source, to=1, tag=seq)],
        4 * D + 2 * D,
    )
    for outcome in ended:
        assert outcome.ended in ("ok", "PeerFailed", "OperationFailed"), outcome
        assert outcome.ended != "OperationFailed" or outcome.code == "no_such_rank", outcome
    if ended[0].ended == "ok":
        assert np.array_equal(sink, pattern(1000 + seq, len(source))), f"message {seq} differs"
    return ended[0].ended


#: how long the flapping case flaps: the issue's minute, 15 down/up cycles of 2 s each way (the
#: directory then takes about 90 s on two shared cores)
FLAP_SECONDS = 60.0
FLAP_PERIOD = 2.0


@pytest.mark.slow
@pytest.mark.timeout(FLAP_SECONDS + 120)
def test_a_flapping_link_crashes_nothing_leaks_nothing_and_corrupts_nothing(
    make_net_cluster: MakeNetCluster,
) -> None:
    """Node 1's link goes down and up every 2 s for a minute while 256 KiB messages are sent
    from rank 0 to rank 1 one after another.

    Each message either arrives intact (its bytes checked) or fails with a typed error
    (``PeerFailed``, or ``OperationFailed`` ``no_such_rank`` while the peer's ranks are not yet
    relearnt); none hangs.  Afterwards both daemons are alive, reconnect, carry a message, and
    hold no more fds than before and about the same memory (RssAnon within 32 MiB).
    """
    fabric = make_net_cluster(2, route_timeout=2 * D)
    nbytes = 256 << 10
    stop = threading.Event()
    flips: list[str] = []

    def flap() -> None:
        down = False
        while not stop.wait(FLAP_PERIOD):
            (fabric.net.link_up if down else fabric.net.link_down)(1)
            down = not down
            flips.append("down" if down else "up")
        if down:
            fabric.net.link_up(1)

    with (
        fabricd.connect(job="flap", rank=0, size=2, socket_path=fabric.socket(0)) as left,
        fabricd.connect(job="flap", rank=1, size=2, socket_path=fabric.socket(1)) as right,
    ):
        source, sink = left.array("out", (nbytes,), "uint8"), right.array("in", (nbytes,), "uint8")
        _exchange(left, right, 1, 1024)
        pids = [fabric.pid(0), fabric.pid(1)]
        fds_before = [fd_count(pid) for pid in pids]
        memory_before = [anon_bytes(pid) for pid in pids]
        flapper = threading.Thread(target=flap, name="flapper", daemon=True)
        tally: dict[str, int] = {}
        started = time.monotonic()
        flapper.start()
        try:
            seq = 0
            while time.monotonic() - started < FLAP_SECONDS:
                seq += 1
                got = _one_message(left, right, source, sink, seq)
                tally[got] = tally.get(got, 0) + 1
        finally:
            stop.set()
            flapper.join(10)
        print(f"flapped {flips}; receives: {tally}")
        assert len(flips) >= FLAP_SECONDS / FLAP_PERIOD - 2
        assert tally.get("ok", 0) >= 1
        assert sum(tally.values()) > tally.get("ok", 0)
        for node in fabric.cluster.nodes:
            assert node.process is not None
            assert node.process.poll() is None
        assert wait_for(lambda: _both_up(fabric), RECONNECT_GUARD) is not None
        assert _one_message(left, right, source, sink, seq + 1) == "ok"
        fds_after = [fd_count(pid) for pid in pids]
        memory_after = [anon_bytes(pid) for pid in pids]
    print(
        f"fds {fds_before} -> {fds_after}; RssAnon MiB "
        f"{[m >> 20 for m in memory_before]} -> {[m >> 20 for m in memory_after]}"
    )
    for before, after in zip(fds_before, fds_after, strict=True):
        assert after <= before, (fds_before, fds_after)
    for before, after in zip(memory_before, memory_after, strict=True):
        assert after - before < 32 << 20, (memory_before, memory_after)
