"""F3, gray failure: a daemon stopped with SIGSTOP for 3·D, its links up the whole time.

Only silence shows it: its peer must mark it down within 2·D (D = ``down_after``) and fail every
waiter on it.  After SIGCONT the reset rule (architecture.md) holds on both sides: everything
exchanged before the stop is treated as lost, so a message the stopped side had announced is
failed there and is never delivered later, not even to a receive posted for it after the
rejoin; a fresh message with the same tag arrives instead.  The rejoin keeps the same
incarnation (the process never restarted): fabricd has no membership epoch yet, so F3's
"rejoins at epoch+1" is not asserted; the reset of both links is the fence.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS
from tests.network.observe import outcomes, pattern, peer_state, peers, wait_for

if TYPE_CHECKING:
    from tests.network.cluster import MakeNetCluster

pytestmark = pytest.mark.network

D = FAST_LIVENESS["down_after"]
#: hang guard for the resumed daemon to rejoin (a reset peer is redialled 0.05 s later)
REJOIN_GUARD = 30.0


def _row(socket_path: str, node: int) -> dict[str, object]:
    return next(row for row in peers(socket_path) if row["node"] == node)


def _counter(fab: fabricd.Client, name: str) -> int:
    return int(fab.status()["counters"][name])


def test_a_stopped_daemon_is_marked_down_within_2d_and_fenced_after_it_resumes(
    make_net_cluster: MakeNetCluster,
) -> None:
    fabric = make_net_cluster(2)
    nbytes = 64 << 10
    with (
        fabricd.connect(job="gray", rank=0, size=2, socket_path=fabric.socket(0)) as healthy,
        fabricd.connect(job="gray", rank=1, size=2, socket_path=fabric.socket(1)) as stopped,
    ):
        stale = stopped.array("stale", (nbytes,), "uint8")
        stale[...] = pattern(7, nbytes)
        announced = stopped.send_async(stale, to=0, tag=7)  # its RTS waits on node 0
        waiter = healthy.recv_async(healthy.array("waiting", (16,), "uint8"), src=1, tag=1)
        assert wait_for(lambda: healthy.status()["pending_ops"] >= 1, 10) is not None
        incarnation = _row(fabric.socket(0), 1)["incarnation"]
        resets_before = _counter(healthy, "peer_resets")

        fabric.cluster.kill(1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            failed = outcomes([waiter], 10 * D)[0]
            down = wait_for(lambda: peer_state(fabric.socket(0), 1) == "down", 10 * D)
            assert failed.ended == "PeerFailed", failed
            assert down is not None
            print(
                f"stopped node: waiter failed after {failed.at - stopped_at:.2f} s, "
                f"marked down after {down - stopped_at:.2f} s (D = {D} s)"
            )
            assert failed.at - stopped_at < 2 * D
            assert down - stopped_at < 2 * D
            assert wait_for(lambda: time.monotonic() - stopped_at >= 3 * D, 10 * D)
        finally:
            fabric.cluster.kill(1, signal.SIGCONT)
        resumed = time.monotonic()

        fenced = outcomes([announced], 10 * D)[0]
        assert fenced.ended == "PeerFailed", fenced  # the resumed side reset its links too
        rejoined = wait_for(
            lambda: (
                peer_state(fabric.socket(0), 1) == "up" and peer_state(fabric.socket(1), 0) == "up"
            ),
            REJOIN_GUARD,
        )
        assert rejoined is not None
        print(f"rejoined {rejoined - resumed:.2f} s after SIGCONT")
        assert _row(fabric.socket(0), 1)["incarnation"] == incarnation  # same process, no epoch
        assert _counter(healthy, "peer_resets") > resets_before

        # the stale message is never delivered: a receive for its tag gets the fresh one
        late = healthy.array("late", (nbytes,), "uint8")
        fresh = stopped.array("fresh", (nbytes,), "uint8")
        fresh[...] = pattern(8, nbytes)
        ended = outcomes(
            [healthy.recv_async(late, src=1, tag=7), stopped.send_async(fresh, to=0, tag=7)],
            REJOIN_GUARD,
        )
        assert [o.ended for o in ended] == ["ok", "ok"], ended
        assert np.array_equal(late, fresh)
        assert healthy.status()["pending_ops"] == 0
        assert stopped.status()["pending_ops"] == 0
