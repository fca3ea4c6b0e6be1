"""The ranks of the collective benchmarks, one process each, for fabricd and its baselines.

Three *backends* give a rank the same three things -- a float32 buffer, a sum allreduce on a
prefix of it, a barrier -- so that one timing loop measures them all alike:

* :class:`FabricdRank`: a client of a fabricd daemon (``fab.array``, ``fab.allreduce``);
* :class:`GlooRank`: torch.distributed with the gloo backend, rendezvous over TCP on 127.0.0.1;
* :class:`MpiRank`: mpi4py's ``Allreduce`` on ``MPI.COMM_WORLD`` (run under ``mpirun``).

Two bodies run on any backend: :func:`allreduce_body` (bandwidth and latency per size) and
:func:`skew_body` (eager-SGD §6.1's linearly skewed loop); a third, :func:`algorithms_body`,
on fabricd only (its allreduce algorithms, interleaved).  fabricd and gloo ranks are spawned
by :func:`run_spawned`, each reporting its figures through a pipe; MPI ranks are started by
``mpirun`` through :func:`run_mpi`, and rank 0 gathers everyone's figures and prints them as
JSON (``python -m bench.collective_ranks BODY SPEC``).  Every loop is bounded, and every call
has a timeout: a broken collective ends the benchmark with an error, never a hang.

A *spec* is a JSON-able dict, the same for every rank of a run but ``rank`` (and, for fabricd,
``socket_path``); the bodies read:

* ``backend`` (``"fabricd"``, ``"gloo"``, ``"mpi"``), ``rank``, ``size``, ``capacity`` (bytes);
* fabricd: ``socket_path``, ``job``; gloo: ``port``;
* allreduce: ``plan`` (``[[nbytes, calls per sample], ...]``), ``samples``, ``warmup``;
* skew: ``nbytes``, ``modes``, ``iterations``, ``skew_ms``;
* algorithms: as allreduce, and ``algorithms`` (``fab.allreduce``'s ``algorithm=`` values).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from multiprocessing.connection import Connection

    from fabricd.client.collectives import AllreduceAlgorithm, Mode

#: a collective call that takes longer than this means the benchmark is broken, not slow
CALL_TIMEOUT = 120.0
ROOT = Path(__file__).resolve().parent.parent

Spec = dict[str, Any]


class Rank(Protocol):
    """One rank of a backend: a float32 buffer of ``capacity`` bytes and two collectives."""

    rank: int
    size: int

    def view(self, nbytes: int) -> Any:
        """The buffer's first ``nbytes`` (what an allreduce of that size reduces)."""

    def fill(self, view: Any, value: float) -> None:
        """Set every element of ``view``."""

    def check(self, view: Any, value: float) -> None:
        """Raise unless every element of ``view`` equals ``value``."""

    def allreduce(self, view: Any, mode: str, name: str) -> tuple[int, int]:
        """Sum ``view`` over every rank in place; return (round, active ranks).

        Only fabricd has rounds and partial modes; the baselines return (-1, size) for sync.
        """

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def close(self) -> None:
        """Leave the job."""


class _NumpyChecks:
    """``fill`` and ``check`` for the backends whose buffer is a numpy array."""

    def fill(self, view: Any, value: float) -> None:
        view[:] = value

    def check(self, view: Any, value: float) -> None:
        if not np.all(view == value):
            bad = int(np.flatnonzero(view != value)[0])
            raise RuntimeError(f"allreduce gave {view[bad]} at element {bad}, expected {value}")


class FabricdRank(_NumpyChecks):
    """A rank that is a client of the fabricd daemon at ``spec["socket_path"]``."""

    def __init__(self, spec: Spec) -> None:
        import fabricd

        self.rank, self.size = int(spec["rank"]), int(spec["size"])
        self._fab = fabricd.connect(
            job=spec["job"], rank=self.rank, size=self.size, socket_path=spec["socket_path"]
        )
        self._buffer = self._fab.array("bench-collective", (spec["capacity"] // 4,), "float32")
        self._buffer[:] = 0  # fault the pages in before anything is timed
        self._cell = self._fab.array("bench-max", (1,), "int64")

    def view(self, nbytes: int) -> Any:
        return self._buffer[: nbytes // 4]

    def allreduce(self, view: Any, mode: str, name: str) -> tuple[int, int]:
        result = self._fab.allreduce(
            view, "sum", cast("Mode", mode), name=name, timeout=CALL_TIMEOUT
        )
        return result.round, result.active

    def allreduce_by(self, view: Any, algorithm: str, name: str) -> None:
        """A sync sum allreduce by ``algorithm`` (``"auto"``, ``"ring"``, ``"tree"``...)."""
        how = cast("AllreduceAlgorithm", algorithm)
        self._fab.allreduce(view, "sum", name=name, timeout=CALL_TIMEOUT, algorithm=how)

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` of any rank (a sync allreduce ``max``, outside any timing)."""
        self._cell[0] = value
        self._fab.allreduce(self._cell, "max", "sync", name="bench-max", timeout=CALL_TIMEOUT)
        return int(self._cell[0])

    def barrier(self) -> None:
        self._fab.barrier(name="bench-barrier", timeout=CALL_TIMEOUT)

    def close(self) -> None:
        self._fab.close()


class GlooRank:
    """A rank of torch.distributed's gloo backend (rendezvous at ``127.0.0.1:spec["port"]``)."""

    def __init__(self, spec: Spec) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one core's worth per rank, as every other backend here
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        self.rank, self.size = int(spec["rank"]), int(spec["size"])
        self._dist = dist
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=CALL_TIMEOUT),
        )
        self._buffer = torch.zeros(spec["capacity"] // 4, dtype=torch.float32)

    def view(self, nbytes: int) -> Any:
        return self._buffer[: nbytes // 4]

    def fill(self, view: Any, value: float) -> None:
        view.fill_(value)

    def check(self, view: Any, value: float) -> None:
        _NumpyChecks().check(view.numpy(), value)

    def allreduce(self, view: Any, mode: str, name: str) -> tuple[int, int]:
        self._dist.all_reduce(view)
        return -1, self.size

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        self._dist.destroy_process_group()


class MpiRank(_NumpyChecks):
    """A rank of ``MPI.COMM_WORLD`` (mpi4py; the process was started by ``mpirun``)."""

    def __init__(self, spec: Spec) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        if self.size != spec["size"]:
            raise RuntimeError(f"mpirun started {self.size} ranks, the spec says {spec['size']}")
        self._buffer = np.zeros(spec["capacity"] // 4, dtype=np.float32)

    def view(self, nbytes: int) -> Any:
        return self._buffer[: nbytes // 4]

    def allreduce(self, view: Any, mode: str, name: str) -> tuple[int, int]:
        self._comm.Allreduce(self._mpi.IN_PLACE, view, op=self._mpi.SUM)
        return -1, self.size

    def barrier(self) -> None:
        self._comm.Barrier()

    def close(self) -> None:
        """MPI finalises when the process ends."""


BACKENDS: dict[str, Callable[[Spec], Rank]] = {
    "fabricd": FabricdRank,
    "gloo": GlooRank,
    "mpi": MpiRank,
}


# -- the bodies -------------------------------------------------------------------------------
def allreduce_body(rank: Rank, spec: Spec) -> dict[str, Any]:
    """Time sync allreduces of every planned size; return ``{"times": [[s/call per sample]]}``.

    Per size: a first call on ones, checked (every element must be ``size``), then zeros, so
    that the timed sums never overflow; ``warmup`` more calls; then ``samples`` samples, each a
    barrier and ``calls`` back-to-back allreduces timed at this rank.
    """
    times: list[list[float]] = []
    for nbytes, calls in spec["plan"]:
        view = rank.view(nbytes)
        name = f"bench-allreduce-{nbytes}"
        rank.fill(view, 1.0)
        rank.allreduce(view, "sync", name)
        rank.check(view, float(rank.size))
        rank.fill(view, 0.0)
        for _ in range(spec["warmup"]):
            rank.allreduce(view, "sync", name)
        samples = []
        for _ in range(spec["samples"]):
            rank.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                rank.allreduce(view, "sync", name)
            samples.append((time.perf_counter() - start) / calls)
        times.append(samples)
    return {"times": times}


def algorithms_body(rank: Rank, spec: Spec) -> dict[str, Any]:
    """Time fabricd's sync allreduce by each of ``spec["algorithms"]`` at every planned size;
    return ``{"times": [[[s/call per sample] per algorithm] per size]}``.

    As :func:`allreduce_body` (a checked first call, warm-up, samples after a barrier), each
    algorithm a collective of its own name, its samples interleaved with the others' (sample
    ``k`` of every algorithm, then sample ``k + 1``) so that a slow patch of the shared
    machine falls on all of them alike.
    """
    assert isinstance(rank, FabricdRank), "algorithms are fabricd's"
    algorithms = spec["algorithms"]
    times: list[list[list[float]]] = []
    for nbytes, calls in spec["plan"]:
        view = rank.view(nbytes)
        names = {a: f"bench-{a}-{nbytes}" for a in algorithms}
        for algorithm, name in names.items():
            rank.fill(view, 1.0)
            rank.allreduce_by(view, algorithm, name)
            rank.check(view, float(rank.size))
            rank.fill(view, 0.0)
            for _ in range(spec["warmup"]):
                rank.allreduce_by(view, algorithm, name)
        samples: list[list[float]] = [[] for _ in algorithms]
        for _ in range(spec["samples"]):
            for i, (algorithm, name) in enumerate(names.items()):
                rank.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    rank.allreduce_by(view, algorithm, name)
                samples[i].append((time.perf_counter() - start) / calls)
        times.append(samples)
    return {"times": times}


def skew_body(rank: Rank, spec: Spec) -> dict[str, Any]:
    """eager-SGD §6.1 (Fig. 8): rank ``i`` sleeps ``i * skew_ms`` before each call.

    Returns, per mode, this rank's call latencies (seconds) and the (round, active) of each
    call.  A baseline (gloo, MPI) makes ``iterations`` calls.  A fabricd rank runs until it has
    seen ``iterations`` rounds past the warm-up: in a partial mode the rounds go at the pace of
    the fastest rank (solo) or of each round's initiator (majority), so a slow rank makes fewer
    calls, each returning the latest round's result.  Counting rounds rather than calls is also
    what lets every rank stop: a rank stopped after a fixed number of calls could be the
    majority initiator of a round the others still wait for.
    """
    view = rank.view(spec["nbytes"])
    delay = rank.rank * spec["skew_ms"] / 1000
    out: dict[str, Any] = {}
    for mode in spec["modes"]:
        name = f"bench-skew-{mode}"
        rank.barrier()
        seen, _ = rank.allreduce(view, mode, name)  # warm-up: builds a persistent schedule
        rank.fill(view, 0.0)
        rank.barrier()
        last = -1
        if isinstance(rank, FabricdRank):
            last = rank.max_over_ranks(seen) + spec["iterations"]
        latencies: list[float] = []
        rounds: list[tuple[int, int]] = []
        calls = 0
        while (seen < last) if last >= 0 else (calls < spec["iterations"]):
            time.sleep(delay)
            start = time.perf_counter()
            seen, active = rank.allreduce(view, mode, name)
            latencies.append(time.perf_counter() - start)
            rounds.append((seen, active))
            calls += 1
        rank.barrier()
        out[mode] = {"latencies": latencies, "rounds": rounds}
    return out


BODIES: dict[str, Callable[[Rank, Spec], dict[str, Any]]] = {
    "allreduce": allreduce_body,
    "skew": skew_body,
    "algorithms": algorithms_body,
}


def spawned_rank(conn: Connection, body: str, spec: Spec) -> None:
    """A spawned rank (fabricd, gloo): run ``body``, send its figures through ``conn``, and
    leave the job only when the parent says so.

    Leaving waits for every rank's figures (:func:`run_spawned` says ``"leave"`` once it has
    them all): a rank that left as soon as its own last collective returned could leave while
    a slower rank's daemon was still finishing that round, and the daemon fails a sync round
    that a rank of the job leaves during.
    """
    rank = BACKENDS[spec["backend"]](spec)
    try:
        conn.send(BODIES[body](rank, spec))
        if conn.poll(CALL_TIMEOUT):
            conn.recv()
    finally:
        rank.close()
        conn.close()


# -- starting ranks ---------------------------------------------------------------------------
def run_spawned(body: str, specs: Sequence[Spec], timeout: float) -> list[dict[str, Any]]:
    """Run one process per spec (spawn), each :func:`spawned_rank`; return their figures.

    Raises:
        RuntimeError: a rank exited without its figures, or the run outlived ``timeout``.
    """
    context = multiprocessing.get_context("spawn")
    ranks = []
    for spec in specs:
        conn, child = context.Pipe()
        process = context.Process(target=spawned_rank, args=(child, body, spec), daemon=True)
        process.start()
        child.close()
        ranks.append((process, conn))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for index, (process, conn) in enumerate(ranks):
            while not conn.poll(0.2):  # true on figures, and on EOF when the rank died
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {index} did not finish within {timeout:.0f} s")
            try:
                results.append(conn.recv())
            except EOFError:
                process.join(5)
                raise RuntimeError(
                    f"rank {index} exited with status {process.exitcode} before reporting "
                    "(its traceback is above)"
                ) from None
        for _, conn in ranks:
            conn.send("leave")
        for process, _ in ranks:
            process.join(max(1.0, deadline - time.monotonic()))
    finally:
        for process, conn in ranks:
            if process.is_alive():
                process.terminate()
                process.join(5)
            conn.close()
    return results


def mpirun_command(size: int) -> list[str]:
    """``mpirun`` for ``size`` ranks on this machine: shared memory between them and nothing
    else (``btl self,vader``), the launcher's own channel on loopback, no CPU binding (fabricd
    and gloo ranks are not bound either), more ranks than CPUs allowed."""
    return [
        "mpirun",
        "--oversubscribe",
        "--bind-to",
        "none",
        *("--mca", "btl", "self,vader"),
        *("--mca", "oob_tcp_if_include", "lo"),
        *("-np", str(size)),
    ]


def run_mpi(body: str, spec: Spec, timeout: float) -> list[dict[str, Any]]:
    """Run ``body`` on ``spec["size"]`` MPI ranks under ``mpirun``; return their figures.

    Raises:
        RuntimeError: mpirun failed or outlived ``timeout`` (then its process group is killed).
    """
    command = [
        *mpirun_command(spec["size"]),
        *(sys.executable, "-m", "bench.collective_ranks", body, json.dumps(spec)),
    ]
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if os.geteuid() == 0:  # OpenMPI refuses root unless told twice
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills mpirun and its ranks
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(f"mpirun did not finish within {timeout:.0f} s") from None
    if process.returncode != 0:
        raise RuntimeError(f"mpirun exited with {process.returncode}: {err.strip()[-2000:]}")
    results: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return results


def _mpi_main(argv: Sequence[str]) -> int:
    """``python -m bench.collective_ranks BODY SPEC`` under mpirun: rank 0 prints every rank's
    figures as one JSON line."""
    body, spec = argv[0], json.loads(argv[1])
    rank = MpiRank({**spec, "rank": -1})
    result = BODIES[body](rank, spec)
    gathered = rank._comm.gather(result, root=0)
    if rank.rank == 0:
        print(json.dumps(gathered), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_main(sys.argv[1:]))
