"""F7 (RELIABILITY.md): NOTIFY-ACK stochastic reduce between two daemon processes whose links,
control and data, pass through a faulty network (:class:`~tests.integration.tcp_proxy.Proxy`).

The nemesis, a thread with a seeded schedule, resets the pair's connections every 0.3 to 1.5 s:
both at once, only the control or only the data link (the daemon resets the peer either way),
or inside a frame, which then arrives only in part (an UPDATE half landed in its slot).  A frame
dropped or altered inside a TCP stream is found by the frame integrity layer, which closes the
link: the same as a reset, so resets are the faults that matter, with delays: one frame in
:data:`DELAYED` is held 0 to 20 ms, its stream waiting behind it, so NOTIFYs on the control link
and their updates on the data link arrive in either order.  Liveness is the test configuration
(``FAST_LIVENESS``: heartbeat 100 ms, down after 1 s); the daemon redials 50 ms after a reset,
so the pair is back, the same daemons, well within ``down_after``: every reset is a resume
(:meth:`~fabricd.engines.stochastic.notify_ack.Reducer.resume`), never a loss.

Round ``i`` of rank ``r`` reduces the model ``r * 1e6 + i + k * 1e8`` (element ``k``), set
afresh before each call: every average is then exactly the one over the in-neighbours' round
``i`` models (integers, exact in float64), so a lost, repeated, stale or torn update shows (the
NATS ordered-consumer check, seq == i), and so does a shifted copy.  At the end each rank's row
in ``status`` must have taken exactly ``rounds * in_degree`` NOTIFYs and ``rounds *
out_degree`` ACKs: each once, none twice, none missing.

Rounds: RELIABILITY names 10^5 notifies between 2 nodes.  Through this proxy (Python, in the
test's process) a round of the two-rank reduce, two NOTIFYs and two ACKs across the proxy plus
two client calls, takes 3 to 5 ms on a 2-core machine shared by two daemons, the proxy and the
ranks, so 10^5 notifies would take 3 minutes or more; :data:`ROUNDS` is what fits in about the
figure's one minute across the three cases instead: 10^4 rounds of 2 ranks (2 * 10^4 NOTIFYs
across the proxy, some 35 s), 1000 of 4 ranks all-to-all (12 NOTIFYs a round, half of them
across) and 1500 of 4 ranks on a ring (2 of its 4 edges across), some 10 s each.  Each case
goes on past its rounds until the proxy has reset the links, and node 0 the peer,
:data:`MIN_RESETS` times each.

Ranks are clients in this process playing all ranks from one thread (the ``_async`` form,
then a wait each).  Timeouts are hang guards only.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pytest

import fabricd
from fabricd.engines.stochastic import graphs
from fabricd.wire import Kind
from tests.integration.tcp_proxy import GUARD, Nemesis
from tests.integration.test_collectives import ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import Client, ReduceResult
    from fabricd.daemon.launcher import LocalCluster
    from tests.integration.tcp_proxy import Proxy

    #: the fixture: start a proxied pair with these settings
    MakeProxied = Callable[..., tuple[LocalCluster, Proxy]]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEED: Final = 7
#: one frame in this many is held back 0 to 20 ms
DELAYED: Final = 50
#: elements of a model
COUNT: Final = 64
#: rounds at least, by (graph, node of each rank): 4 ranks have edges within a node and across
ROUNDS: Final = {
    ("all-to-all", (0, 1)): 10000,
    ("all-to-all", (0, 1, 1, 0)): 1000,
    ("ring", (0, 1, 1, 0)): 1500,
}
#: resets at least, by the proxy and by node 0 (the run goes on past ROUNDS until then)
MIN_RESETS: Final = 10


def model(rank: int, round: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s model of round ``round``: it names both (module docstring)."""
    return rank * 1e6 + round + np.arange(COUNT, dtype=np.float64) * 1e8


def expected(graph: graphs.Graph, rank: int, round: int) -> np.ndarray[Any, Any]:
    """The average of ``rank``'s model with its in-neighbours' of round ``round``."""
    total = model(rank, round)
    for src in graph.in_neighbours[rank]:
        total += model(src, round)
    return total / (1 + len(graph.in_neighbours[rank]))


def explain(fabs: list[Client]) -> dict[int, Any]:
    """What every daemon says of its reducers and stalled calls."""
    seen = {}
    for fab in fabs:
        with contextlib.suppress(fabricd.FabricError):
            status = fab.status()
            seen[status["node"]] = {
                "reduces": status["stochastic_reduces"],
                "stalls": fab.stalls()["stalls"],
                "peers": status["peers"],
            }
    return seen


def one_round(
    fabs: list[Client], arrays: list[np.ndarray[Any, Any]], graph: str
) -> list[ReduceResult]:
    """Every rank's call of the round, started before any is waited for (send-before-wait
    across ranks: one thread plays them all)."""
    handles = [
        f.stochastic.stochastic_reduce_async(a, graph, "notify-ack", name="f7")
        for f, a in zip(fabs, arrays, strict=True)
    ]
    results = []
    for handle in handles:
        try:
            results.append(handle.wait(timeout=GUARD))
        except fabricd.Timeout:
            raise AssertionError(f"{handle.what} hung; the daemons say: {explain(fabs)}") from None
    return results


def rows(cluster: LocalCluster) -> list[dict[str, Any]]:
    """Every rank's status row, from both daemons."""
    found = []
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as client:
            found += client.status()["stochastic_reduces"]
    return found


def peer_resets(cluster: LocalCluster) -> int:
    """How many times node 0 has reset node 1 (both links closed)."""
    with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as client:
        count: int = client.status()["counters"]["peer_resets"]
    return count


@pytest.mark.parametrize(
    ("kind", "placement"), list(ROUNDS), ids=[f"{k}-{len(p)}ranks" for k, p in ROUNDS]
)
def test_each_notify_and_ack_is_taken_once_in_order_across_resets(
    proxied: MakeProxied, kind: str, placement: tuple[int, ...]
) -> None:
    cluster, proxy = proxied()
    delays = random.Random(SEED + 1)
    proxy.delay = lambda: delays.uniform(0, 0.02) if delays.randrange(DELAYED) == 0 else 0.0
    size = len(placement)
    graph = graphs.build(kind, size)
    rounds = 0
    with ranks(cluster, placement, f"f7-{kind}-{size}") as fabs:
        arrays = [f.array("w", (COUNT,), "float64") for f in fabs]
        with Nemesis(proxy, SEED, longest=1.5):
            # on until the proxy reset the links MIN_RESETS times, and node 0 the peer (not
            # one for one: a reset in a handshake fails a dial, and the proxy's two upstream
            # dials race, so node 1 may refuse a data link that came before its control link)
            while (
                rounds < ROUNDS[(kind, placement)]
                or proxy.resets < MIN_RESETS
                or peer_resets(cluster) < MIN_RESETS
            ):
                for r, a in enumerate(arrays):
                    a[:] = model(r, rounds)
                results = one_round(fabs, arrays, kind)
                for r, (a, res) in enumerate(zip(arrays, results, strict=True)):
                    assert res.round == rounds
                    assert res.inputs == res.in_degree == graph.in_degrees[r]
                    assert (res.torn, res.stale) == (0, 0)
                    want = expected(graph, r, rounds)
                    assert np.array_equal(a, want), f"rank {r}, round {rounds}: {a} != {want}"
                rounds += 1
        # the last round's ACKs may still be on their way (or be sent again after a reset)
        deadline = time.monotonic() + GUARD
        while not all(row["acks"] == rounds * row["out_degree"] for row in rows(cluster)):
            assert time.monotonic() < deadline, f"hang guard: the last ACKs: {explain(fabs)}"
            time.sleep(0.02)
        found = rows(cluster)
    assert Kind.UPDATE in proxy.cut_frames  # an update arrived in part at least once
    assert sorted(row["rank"] for row in found) == list(range(size))
    for row in found:
        r = row["rank"]
        assert (row["in_degree"], row["out_degree"]) == (
            graph.in_degrees[r],
            graph.out_degrees[r],
        )
        assert row["broken"] is None
        assert row["reduces"] == rounds
        assert row["used"][row["in_degree"]] == rounds
        assert (row["torn"], row["stale"]) == (0, 0)
        # each NOTIFY and ACK taken exactly once
        assert row["notifies"] == rounds * row["in_degree"]
        assert row["acks"] == rounds * row["out_degree"]
    # resumes sent updates (each with its NOTIFY) and ACKs again, resent counting frames; the
    # receivers dropped those they had (each duplicate is one of them: the proxy never sends
    # a frame twice)
    resent = sum(row["resent"] for row in found)
    duplicates = sum(row["duplicates"] for row in found)
    assert resent > 0
    assert 0 < duplicates <= resent
