"""A local cluster whose daemons each run in their own network namespace of a test net."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from fabricd.daemon.launcher import LocalCluster
    from tests.network.netns import TestNet


@dataclass(frozen=True, slots=True)
class NetCluster:
    """Daemon ``i`` of ``cluster`` runs in namespace ``i`` of ``net`` and listens on its address."""

    net: TestNet
    cluster: LocalCluster

    def socket(self, node: int) -> str:
        """Node ``node``'s client socket (a path: reachable from any network namespace)."""
        return self.cluster.nodes[node].socket_path

    def pid(self, node: int) -> int:
        """Node ``node``'s daemon process (``ip netns exec`` execs it: the same pid)."""
        return self.cluster.nodes[node].pid


#: the ``make_net_cluster`` fixture: ``make(size, node_env=None, **settings)`` starts a
#: connected cluster
MakeNetCluster: TypeAlias = Callable[..., NetCluster]
