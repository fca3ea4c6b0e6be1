"""(a) Client -> daemon hand-off through shared memory, against memcpy.

With shared memory no array byte crosses the client's socket: a send passes (segment, offset,
length, dtype) and the daemon reads the array where it lies.  So the meaningful hand-off is "the
bytes of one process's array into another process's array, through the daemon": two ranks of a
job on the *same* daemon (``LocalCluster(1)``), rank 0 (this process) sends, rank 1 (another
process) receives, and the daemon copies segment -> segment once (``np.copyto``, in a worker
thread from 1 MiB).  The figure is the time per message seen by rank 0 (``fab.send`` returns
once rank 1 has the bytes), one message at a time.

Baseline: ``np.copyto`` of the same number of bytes between two memfd mappings (the kind of
memory the daemon copies between) in this process, in the same run.  The ratio is fabricd's time
per message over one memcpy; what is left above 1x is the control path (two Unix-socket requests,
two replies, the daemon's matching) plus the hop to a worker thread for large copies.

The 0-byte row is that control path alone -- the cost a client pays to hand off *any* array,
since no bytes cross the socket.  Its baseline is one round trip of a message of the same size
as a send request on a raw Unix socket between two Python processes (blocking sockets).

Run alone: ``python -m bench.handoff [--quick]``.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench import ranks
from bench.report import (
    Column,
    KiB,
    MiB,
    Progress,
    Table,
    fmt_number,
    fmt_size,
    median,
    messages_per_sample,
    per_call,
    quiet,
    reap,
    run_alone,
    spawn,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

SIZES = [0, 4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [0, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]


class _Memcpy:
    """The baseline for a size: ``np.copyto`` between two memfd mappings in this process."""

    def __init__(self, nbytes: int) -> None:
        from fabricd.shm import Segment

        self._segments = [Segment.create(f"bench-memcpy-{i}", nbytes) for i in range(2)]
        self._src, self._dst = (
            np.frombuffer(s.data(), dtype=np.uint8, count=nbytes) for s in self._segments
        )
        self._src[:] = 1
        self._dst[:] = 0  # fault every page in before timing, as the daemon's are after warm-up
        self.what = "memcpy"

    def sample(self, calls: int) -> float:
        """Seconds per copy over ``calls`` back-to-back copies."""
        return per_call(lambda: np.copyto(self._dst, self._src), calls, 1)[0]

    def close(self) -> None:
        del self._src, self._dst
        for segment in self._segments:
            segment.close()


class _UnixEcho:
    """The 0-byte baseline: round trips of ``nbytes`` on a raw Unix socket to another process."""

    def __init__(self, nbytes: int, rounds: int, directory: str) -> None:
        path = str(Path(directory) / "echo.sock")
        self._nbytes = nbytes
        self._message = b"x" * nbytes
        self._helper = spawn(ranks.unix_echo, path, rounds, nbytes)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.what = f"Unix-socket round trip of {nbytes} B"
        deadline = time.monotonic() + 30
        while True:
            try:
                self._sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    self._sock.close()
                    raise RuntimeError("the Unix echo helper did not start") from None
                time.sleep(0.01)
        self._sock.settimeout(ranks.CALL_TIMEOUT)

    def _round_trip(self) -> None:
        self._sock.sendall(self._message)
        got = 0
        while got < self._nbytes:
            chunk = self._sock.recv(self._nbytes - got)
            if not chunk:
                raise RuntimeError("the Unix echo helper hung up")
            got += len(chunk)

    def sample(self, calls: int) -> float:
        """Seconds per round trip over ``calls`` round trips."""
        return per_call(self._round_trip, calls, 1)[0]

    def close(self) -> None:
        self._sock.close()
        reap(self._helper)


def _request_size() -> int:
    """Bytes of a typical send request frame on the client socket."""
    from fabricd.wire import Kind, encode

    fields = {
        "id": 1000,
        "op": "send",
        "fds": 0,
        "seg": 1,
        "off": 0,
        "nbytes": 0,
        "dtype": "uint8",
        "peer": 1,
        "tag": 0,
    }
    return len(encode(Kind.REQUEST, fields))


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Measure every size (``QUICK_SIZES`` with ``quick``)."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    sizes = QUICK_SIZES if quick else SIZES
    samples = 3 if quick else 9
    budget, cap = (32 * MiB, 50) if quick else (256 * MiB, 300)
    copy_budget, copy_cap = 4 * budget, 5000  # a memcpy is quick: time more of them per sample
    cases = [(n, messages_per_sample(n, budget, cap)) for n in sizes]
    per_side = [(n, 1 + samples * k) for n, k in cases]  # one warm-up message per size
    table = Table(
        name="handoff",
        title="(a) hand-off of an array to a rank on the same daemon, microseconds per message",
        columns=[
            Column("baseline", "baseline us"),
            Column("fabricd", "fabricd us"),
            Column("gbps", "fabricd GB/s"),
            Column("messages", "msgs/sample", 0),
        ],
        ratio="fabricd time / baseline time (lower is better; 1x = as fast as one memcpy)",
        settings={"samples": samples},
    )
    job = f"bench-{uuid.uuid4().hex[:8]}"
    progress("starting 1 daemon and the receiving process")
    with (
        tempfile.TemporaryDirectory(prefix="fabricd-bench-") as directory,
        LocalCluster(1) as cluster,
    ):
        peer = spawn(ranks.fabric_receiver, cluster.nodes[0].socket_path, job, per_side)
        with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
            source = fab.array("bench-send", (max(sizes),), "uint8")
            source[:] = 1
            for nbytes, messages in cases:
                view = source[:nbytes]
                calls = messages_per_sample(nbytes, copy_budget, copy_cap)
                baseline: _Memcpy | _UnixEcho = (
                    _Memcpy(nbytes)
                    if nbytes
                    else _UnixEcho(_request_size(), (samples + 1) * calls, directory)
                )
                try:
                    baseline.sample(calls)  # warm-ups
                    fab.send(view, to=1, timeout=ranks.CALL_TIMEOUT)
                    base_times, fab_times = [], []
                    for _ in range(samples):  # alternate, so both see the same background load
                        base_times.append(baseline.sample(calls))
                        start = time.perf_counter()
                        for _ in range(messages):
                            fab.send(view, to=1, timeout=ranks.CALL_TIMEOUT)
                        fab_times.append((time.perf_counter() - start) / messages)
                finally:
                    baseline.close()
                base, took = median(base_times), median(fab_times)
                label = fmt_size(nbytes) if nbytes else "0 B"
                rate = {"gbps": nbytes / took / 1e9} if nbytes else {}
                table.add(
                    label,
                    nbytes,
                    took / base,
                    baseline=base * 1e6,
                    fabricd=took * 1e6,
                    messages=messages,
                    **rate,
                )
                progress(
                    f"{label}: {baseline.what} {fmt_number(base * 1e6)} us, "
                    f"fabricd {fmt_number(took * 1e6)} us, ratio {fmt_number(took / base)}x"
                )
        reap(peer)
    table.notes += [
        "baseline: np.copyto between two memfd mappings in one process; for the 0 B row, one "
        "round trip of a send-request-sized message on a raw Unix socket between two processes",
        "the 0 B row is the control cost of handing off any array: no array bytes cross the socket",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("handoff", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
