"""Two real daemons in the test's own event loop, joined by the in-process transport.

Real :class:`~fabricd.daemon.node.Daemon` objects with real client sockets and shared memory;
only the peer links are in memory, so a test can cut one link of a pair, restart a daemon as a
new incarnation, or run a daemon with services of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from fabricd.daemon.config import load
from fabricd.daemon.node import Daemon, default_services
from fabricd.transports.inproc import InprocTransport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from pathlib import Path

    from fabricd.daemon.service import Service

NODES = ("node0:1", "node1:1")


def write_secret(directory: Path) -> Path:
    """A shared secret file the daemon accepts (0600, long enough) in ``directory``."""
    secret = directory / "secret"
    secret.write_text("an inproc test secret of some length")
    secret.chmod(0o600)
    return secret


class Fabric:
    """Two daemons on one in-memory network; start, stop and restart them."""

    def __init__(
        self,
        tmp: Path,
        services: dict[int, Callable[[Daemon], Sequence[Service]]] | None = None,
        **settings: Any,
    ) -> None:
        self.tmp = tmp
        self.services = services or {}
        self.net = InprocTransport()
        self.settings = {
            "heartbeat_interval": 0.1,
            "suspect_after": 0.3,
            "down_after": 1.0,
            "chunk_size": 1 << 20,
            "metrics_address": "127.0.0.1:0",  # a free port each: daemons share one host
            **settings,
        }
        write_secret(tmp)
        self.daemons: dict[int, Daemon] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def socket(self, node: int) -> str:
        return str(self.tmp / f"n{node}.sock")

    async def start(self, node: int) -> Daemon:
        flags = {
            "node_id": node,
            "nodes": NODES,
            "socket": self.socket(node),
            "secret_file": str(self.tmp / "secret"),
            **self.settings,
        }
        daemon = Daemon(
            load(None, environ={}, flags=flags),
            transport=self.net,
            services=self.services.get(node, default_services),
        )
        self.daemons[node] = daemon
        self.tasks[node] = asyncio.create_task(daemon.run())
        return daemon

    async def stop(self, node: int) -> None:
        self.daemons[node].stop()
        async with asyncio.timeout(15):
            await self.tasks.pop(node)

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)

    def up(self) -> bool:
        return all(
            all(p.state.value == "up" for p in d.peering.engine.peers(0.0))
            and len([key for key in d.links if key[1] == "data"]) == 1
            for d in self.daemons.values()
        )


@contextlib.asynccontextmanager
async def fabric(
    tmp_path: Path,
    services: dict[int, Callable[[Daemon], Sequence[Service]]] | None = None,
    **settings: Any,
) -> AsyncIterator[Fabric]:
    """Both daemons started and their links up; stopped (drained) on the way out."""
    fab = Fabric(tmp_path, services, **settings)
    for node in range(len(NODES)):
        await fab.start(node)
    try:
        await fab.until(fab.up)
        yield fab
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)
