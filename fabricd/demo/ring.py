"""The ring demo (``fabricctl demo --ring``): a tensor around a ring of daemons.

A local fabric of N daemons starts on loopback; one client per node joins job ``ring-demo``.
Every other rank tells rank 0 that it is ready (it has joined and made its tensor), and only then
does rank 0 start the clock: starting processes and joining the job are not data moving.
Rank 0 fills a float32 tensor with a known pattern and sends it to rank 1; every rank receives
from its left neighbour, adds one, sends to its right neighbour and then checks every element
(after forwarding, so checking stays off the ring's critical path), for a number of laps.  The
ring's throughput is printed next to a memcpy baseline measured in the same run, and the tensor
that comes home after the last lap is verified again, element by element and by BLAKE2b
checksum against the expected tensor.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.client import connect
from fabricd.daemon.launcher import LocalCluster
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import Client

JOB = "ring-demo"
#: the tag of the message each rank sends rank 0 once it is ready (the ring uses tag 0)
READY_TAG = 1
#: generous: a lap of 256 MiB on a loaded 2-core machine takes seconds, not minutes
_WAIT = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    """What the demo measured."""

    nodes: int
    nbytes: int
    laps: int
    hops: int
    seconds: float
    ring_gbps: float
    memcpy_gbps: float
    ratio: float
    verified: bool
    checksum: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DemoFailed(FabricError):
    """A rank of the demo failed or a byte came back wrong."""


def pattern(count: int) -> np.ndarray[Any, Any]:
    """The tensor rank 0 starts with: small integers, exact in float32 after many +1s."""
    return (np.arange(count, dtype=np.int64) % 65521).astype(np.float32)


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """The baseline: numpy copy of ``nbytes`` between two arrays, best of ``repeats``."""
    src = np.ones(max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _verify(tensor: np.ndarray[Any, Any], base: np.ndarray[Any, Any], hops: int) -> None:
    if not np.array_equal(tensor - base, np.full_like(base, hops)):
        bad = int(np.flatnonzero(tensor - base != hops)[0])
        raise DemoFailed(
            f"element {bad} is {tensor[bad]} after {hops} increments, expected {base[bad] + hops}"
        )


def ring_worker(socket_path: str, rank: int, size: int, count: int, laps: int) -> None:
    """Body of ranks 1..size-1: receive, verify, add one, forward (a separate process)."""
    base = pattern(count)
    with connect(job=JOB, rank=rank, size=size, socket_path=socket_path) as fab:
        tensor = fab.array("ring", (count,), "float32")
        fab.send(fab.array("ready", (1,), "int32"), to=0, tag=READY_TAG, timeout=_WAIT)
        for lap in range(laps):
            fab.recv(tensor, src=rank - 1, timeout=_WAIT)
            tensor += 1
            fab.send(tensor, to=(rank + 1) % size, timeout=_WAIT)
            _verify(tensor, base, lap * size + rank)  # after forwarding: off the ring's path


def run(
    nodes: int = 4,
    nbytes: int = 64 * 1024 * 1024,
    laps: int = 5,
    progress: Callable[[int, float], None] | None = None,
    settings: dict[str, Any] | None = None,
) -> DemoResult:
    """Start a fabric, run the ring, stop everything; ``progress(lap, seconds)`` per lap.

    Raises:
        DemoFailed: a rank failed, or data came back wrong.
        ClusterError: the daemons did not start.
    """
    if nodes < 2 or laps < 1 or nbytes < 4 or nbytes % 4:
        raise DemoFailed("need >= 2 nodes, >= 1 lap and a whole number of float32 elements")
    count = nbytes // 4
    baseline = memcpy_gbps(nbytes)
    context = multiprocessing.get_context("spawn")
    with LocalCluster(nodes, settings=settings or {}) as cluster:
        cluster.wait_connected()
        workers = [
            context.Process(
                target=ring_worker,
                daemon=True,
                args=(cluster.nodes[r].socket_path, r, nodes, count, laps),
            )
            for r in range(1, nodes)
        ]
        for worker in workers:
            worker.start()
        try:
            with connect(
                job=JOB, rank=0, size=nodes, socket_path=cluster.nodes[0].socket_path
            ) as fab:
                seconds, checksum = lead(fab, count, laps, progress)
        finally:
            for worker in workers:
                worker.join(timeout=_WAIT)
                if worker.is_alive():
                    worker.kill()
        failed = [r for r, w in enumerate(workers, start=1) if w.exitcode != 0]
        if failed:
            raise DemoFailed(
                f"rank {failed[0]} failed (exit status {workers[failed[0] - 1].exitcode})"
            )
    hops = laps * nodes
    ring = nbytes * hops / seconds / 1e9
    return DemoResult(
        nodes=nodes,
        nbytes=nbytes,
        laps=laps,
        hops=hops,
        seconds=seconds,
        ring_gbps=ring,
        memcpy_gbps=baseline,
        ratio=ring / baseline,
        verified=True,
        checksum=checksum,
    )


def lead(
    fab: Client,
    count: int,
    laps: int,
    progress: Callable[[int, float], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, str]:
    """Body of rank 0 (a client of job ``ring-demo``): returns (seconds moving data, checksum).

    The clock runs only while the tensor is on the ring, from when every rank has said it is
    ready: neither joining nor checking counts.
    """
    base = pattern(count)
    size = fab.size
    tensor = fab.array("ring", (count,), "float32")
    tensor[:] = base
    ready = fab.array("ready", (1,), "int32")
    for rank in range(1, size):
        fab.recv(ready, src=rank, tag=READY_TAG, timeout=_WAIT)
    elapsed = 0.0
    for lap in range(laps):
        start = clock()
        fab.send(tensor, to=1, timeout=_WAIT)
        fab.recv(tensor, src=size - 1, timeout=_WAIT)
        elapsed += clock() - start
        _verify(tensor, base, (lap + 1) * size - 1)
        tensor += 1
        if progress is not None:
            progress(lap + 1, elapsed)
    tensor -= 1  # undo the last increment: this is what came home
    expected = base + np.float32(laps * size - 1)
    checksum = hashlib.blake2b(tensor.tobytes()).hexdigest()
    if checksum != hashlib.blake2b(expected.tobytes()).hexdigest():
        raise DemoFailed("checksum of the returned tensor does not match the expected one")
    return elapsed, checksum[:16]
