"""Fixtures for tests that run real daemons as subprocesses on loopback."""

from __future__ import annotations

import multiprocessing
from typing import TYPE_CHECKING, Any

import pytest

from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """Start local clusters (RELIABILITY liveness: D = 1 s); all are stopped at teardown."""
    started: list[LocalCluster] = []

    def make(size: int, **settings: Any) -> LocalCluster:
        cluster = LocalCluster(size, settings={**FAST_LIVENESS, **settings})
        started.append(cluster)
        cluster.start()
        cluster.wait_connected()
        return cluster

    yield make
    for cluster in started:
        cluster.stop()


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
