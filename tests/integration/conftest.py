"""Fixtures for tests that run real daemons as subprocesses on loopback."""

from __future__ import annotations

import multiprocessing
from typing import TYPE_CHECKING, Any

import pytest

from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster
from tests.integration.tcp_proxy import ProxiedPairs

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.integration.tcp_proxy import Proxy


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Start local clusters (fast liveness: a peer is down after D = 1 s); all stop at teardown.

    Teardown also fails the test if any daemon logged a traceback: a bug that a daemon
    survived (an exception in a callback, say) must not pass unnoticed.
    """
    started: list[LocalCluster] = []

    def make(size: int, **settings: Any) -> LocalCluster:
        log_dir = tmp_path / f"cluster{len(started)}"
        cluster = LocalCluster(size, settings={**FAST_LIVENESS, **settings}, log_dir=log_dir)
        started.append(cluster)
        cluster.start()
        cluster.wait_connected()
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
    for cluster in started:
        for node in cluster.nodes:
            log = node.log_path.read_text(errors="replace")
            assert "Traceback" not in log, f"node {node.node} logged a traceback:\n{log}"


@pytest.fixture
def spawn() -> Iterator[Callable[..., multiprocessing.process.BaseProcess]]:
    """Start client processes (spawn, so no state leaks from pytest); killed at teardown."""
    context = multiprocessing.get_context("spawn")
    processes: list[multiprocessing.process.BaseProcess] = []

    def start(target: Callable[..., None], *args: Any) -> multiprocessing.process.BaseProcess:
        process = context.Process(target=target, args=args, daemon=True)
        process.start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(5)


@pytest.fixture
def queue() -> Any:
    return multiprocessing.get_context("spawn").Queue()


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[Callable[..., tuple[LocalCluster, Proxy]]]:
    """Two daemon processes whose links pass through a fault proxy
    (:class:`~tests.integration.tcp_proxy.Proxy`), stopped at teardown."""
    pairs = ProxiedPairs(tmp_path)
    yield pairs.make
    pairs.close()
