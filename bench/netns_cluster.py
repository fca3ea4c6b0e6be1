"""Daemons in network namespaces with ``tbf``-shaped links, for the benchmarks that need a
network to saturate (bench/mlfabric_netns.py, trees_netns.py, replication_daemons.py's
``replication-netns``): one daemon per namespace, joined by a bridge
(``tests/network/netns.py``'s :class:`TestNet`), each node's link shaped both ways.

Where namespaces or ``tc`` are unavailable (not root, no iproute2, a kernel without them),
:func:`why_not` says why in one line and the benchmark prints it instead of a table.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


def why_not() -> str | None:
    """Why namespaces cannot be used here (one line), or None."""
    try:
        from tests.network.netns import unavailable
    except ImportError as exc:  # an installed fabricd without the repository's tests
        return f"the network test harness is not importable ({exc})"
    return unavailable()


def rates_env(mbit: Sequence[float]) -> dict[int, dict[str, str]]:
    """Each daemon's ``link_up_bps`` / ``link_down_bps`` (bytes/s): its node's shaped rate, so
    MLfabric's scheduler plans with the true figures."""
    env: dict[int, dict[str, str]] = {}
    for node, rate in enumerate(mbit):
        bps = str(rate * 1e6 / 8)
        env[node] = {"FABRICD_LINK_UP_BPS": bps, "FABRICD_LINK_DOWN_BPS": bps}
    return env


@contextlib.contextmanager
def shaped_cluster(
    mbit: Sequence[float], *, configured: bool = True, log_dir: Any = None
) -> Iterator[tuple[list[str], Any]]:
    """One daemon per node, node ``n``'s link shaped to ``mbit[n]`` Mbit/s both ways (the
    daemons told their rates if ``configured``, else they plan with what their network monitor
    measures); yields the client sockets and the net (a :class:`tests.network.netns.TestNet`),
    and stops the daemons and deletes the namespaces on the way out, whatever happened."""
    from fabricd.daemon.launcher import LocalCluster
    from tests.network.netns import TestNet, remove_leftovers

    nodes = len(mbit)
    remove_leftovers()
    net = TestNet(nodes)
    cluster = LocalCluster(
        nodes,
        log_dir=log_dir,
        node_env=rates_env(mbit) if configured else {},
        hosts=[net.address(node) for node in range(nodes)],
        wrappers={node: net.wrapper(node) for node in range(nodes)},
    )
    net.start()
    try:
        cluster.start()
        try:
            cluster.wait_connected()
            for node in range(nodes):
                net.shape(node, mbit[node])
            yield [node.socket_path for node in cluster.nodes], net
        finally:
            cluster.stop()
    finally:
        net.stop()
