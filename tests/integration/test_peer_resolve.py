"""A node whose name did not resolve when a daemon started is admitted once it resolves.

Peers admit links only from the hosts of configured nodes, resolved at start
(``peering_service.node_hosts``).  A resolver that is not up yet when the daemon starts (at
boot, before the network is) left that node without a host, and its links were refused until
the daemon restarted.  Real daemons in this test's event loop on loopback TCP; the resolver
the peering service calls is replaced, so "down" is exact and touches nothing else.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from fabricd.daemon.config import load
from fabricd.daemon.node import Daemon
from fabricd.daemon.services import peering as peering_service
from fabricd.transports.tcp import TcpTransport

from .inproc import write_secret

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def test_a_node_whose_name_resolves_late_is_admitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolver = {"down": True, "calls": 0}

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        resolver["calls"] += 1
        if resolver["down"]:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return socket.getaddrinfo(host, *args, **kwargs)

    shim = SimpleNamespace(getaddrinfo=getaddrinfo, SOCK_STREAM=socket.SOCK_STREAM)
    monkeypatch.setattr(peering_service, "socket", shim)
    secret = write_secret(tmp_path)
    nodes = [f"127.0.0.1:{port}" for port in free_ports(2)]

    def daemon(node: int) -> Daemon:
        flags = {
            "node_id": node,
            "nodes": nodes,
            "socket": str(tmp_path / f"n{node}.sock"),
            "secret_file": str(secret),
            "heartbeat_interval": 0.1,
            "suspect_after": 0.3,
            "down_after": 1.0,
            "reconnect_max_backoff": 0.2,
            "metrics_address": "",
        }
        return Daemon(load(None, environ={}, flags=flags), transport=TcpTransport())

    daemons = [daemon(1)]  # starts while its resolver is down: node 0 has no host here
    resolver["down"] = False
    daemons.insert(0, daemon(0))
    tasks = [asyncio.create_task(d.run()) for d in daemons]

    def up() -> bool:
        return all(all(p.state.value == "up" for p in d.peering.engine.peers(0.0)) for d in daemons)

    try:
        async with asyncio.timeout(20):  # a hang guard: node 0 redials every 0.2 s at most
            while not up():
                await asyncio.sleep(0.02)
        counters = daemons[1].peering.statistics()["counters"]
        assert counters["refused_unknown_hosts"] >= 1  # refused until it resolved
    finally:
        for d in daemons:
            d.stop()
        async with asyncio.timeout(15):
            await asyncio.gather(*tasks)
