"""Fixtures for the network fault tests: daemons in network namespaces joined by a bridge.

Every test here needs root, ``ip`` and ``tc``, and a kernel that allows namespaces, veth pairs
and ``tbf``; where any is missing the whole directory is skipped with one line saying which.
Each test gets its own net (:class:`~tests.network.netns.TestNet`), torn down at teardown
whatever happened; the namespaces of earlier runs that died are removed first.
"""

from __future__ import annotations

import functools
import signal
from typing import TYPE_CHECKING, Any

import pytest

from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster
from fabricd.daemon.launcher import remove_leftovers as remove_cluster_leftovers
from tests.network.cluster import MakeNetCluster, NetCluster
from tests.network.netns import TestNet, remove_leftovers, unavailable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@functools.cache
def _why_not() -> str | None:
    why = unavailable()
    if why is None:
        remove_leftovers()  # namespaces of runs that died
        remove_cluster_leftovers()  # and their clusters' directories
    return why


@pytest.fixture(autouse=True)
def _network_namespaces() -> None:
    """Skip every test of this directory, with the reason, where namespaces cannot be made."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def make_net_cluster(tmp_path: Path) -> Iterator[MakeNetCluster]:
    """Start daemons in namespaces (fast liveness, D = 1 s unless overridden), one per node;
    ``node_env`` gives single nodes ``FABRICD_<KEY>`` overrides (their own link figures).

    Teardown continues stopped daemons, stops every cluster, deletes every net, and then fails
    the test if a daemon logged a traceback.
    """
    made: list[tuple[TestNet, LocalCluster]] = []

    def make(
        size: int, node_env: dict[int, dict[str, str]] | None = None, **settings: Any
    ) -> NetCluster:
        net = TestNet(size)
        cluster = LocalCluster(
            size,
            settings={**FAST_LIVENESS, **settings},
            log_dir=tmp_path / f"cluster{len(made)}",
            node_env=node_env or {},
            hosts=[net.address(node) for node in range(size)],
            wrappers={node: net.wrapper(node) for node in range(size)},
        )
        made.append((net, cluster))
        net.start()
        cluster.start()
        cluster.wait_connected()
        return NetCluster(net, cluster)

    try:
        yield make
    finally:
        for net, cluster in made:
            for node in range(len(cluster.nodes)):
                cluster.kill(node, signal.SIGCONT)  # a stopped daemon cannot drain
            try:
                cluster.stop()
            finally:
                net.stop()
    for _, cluster in made:
        for process in cluster.nodes:
            log = process.log_path.read_text(errors="replace")
            assert "Traceback" not in log, f"node {process.node} logged a traceback:\n{log}"
