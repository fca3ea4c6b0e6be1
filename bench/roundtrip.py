"""(g) 1-byte rank-to-rank round trip across two daemons, against a raw two-process ping-pong.

fabricd: ``LocalCluster(2)`` on loopback.  Rank 0 (this process, a client of node 0) sends a
1-byte array to rank 1 (another process, a client of node 1) with ``fab.send`` and then
``fab.recv``\\ s it back; rank 1 receives it and sends it back (:func:`bench.ranks.fabric_echo`).
A round trip crosses three process hops each way (rank 0 -> daemon 0 -> daemon 1 -> rank 1 and
back), plus whatever control frames the protocol needs; four processes share the two CPUs.

Baseline: the simplest thing that moves one byte between two processes and back -- two
processes, one TCP connection on 127.0.0.1 with ``TCP_NODELAY``, *blocking* sockets (no event
loop on either side): this process ``sendall``\\ s the byte and ``recv``\\ s the echo; the other
(:func:`bench.ranks.tcp_echo`) ``recv_into``\\ s it and ``sendall``\\ s it back.  No process is
pinned: like the fabricd processes, the two go where the scheduler puts them.  On a virtual
machine that matters: waking a process on another, idle CPU costs far more than on the same one,
so an extra figure gives the raw ping-pong pinned to two CPUs and to one.

Batches alternate -- a raw batch, then a fabricd batch -- so both see the same background load;
each side gets a warm-up batch first.  Reported: the median and 99th percentile of the single
round trips, and the spread of the batch medians (lowest and highest); ratio = fabricd median /
raw median.  Target (issue 8): at most 4x.

Run alone: ``python -m bench.roundtrip [--quick]``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from bench import ranks
from bench.report import (
    Column,
    Extra,
    Progress,
    Table,
    fmt_number,
    median,
    percentile,
    pinned_helper,
    quiet,
    reap,
    run_alone,
    spawn,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

#: bytes per message, both ways
NBYTES = 1
TARGET_RATIO = 4.0


def _batch(one: Callable[[], None], n: int) -> list[float]:
    """Seconds of each of ``n`` round trips made by ``one``."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        one()
        out.append(time.perf_counter() - start)
    return out


def _raw_round_trip(sock: socket.socket, payload: bytes) -> Callable[[], None]:
    def one() -> None:
        sock.sendall(payload)
        got = 0
        while got < len(payload):
            chunk = sock.recv(len(payload) - got)
            if not chunk:
                raise ConnectionError("the raw echo closed early")
            got += len(chunk)

    return one


def _fabric_round_trip(fab: Any, message: Any) -> Callable[[], None]:
    def one() -> None:
        fab.send(message, to=1, timeout=ranks.CALL_TIMEOUT)
        fab.recv(message, src=1, timeout=ranks.CALL_TIMEOUT)

    return one


def pinnings() -> list[tuple[str, tuple[int, int]]]:
    """Where the pinned raw ping-pongs of the extra figure run: (label, (pinger CPU, echo CPU))."""
    cpus = sorted(os.sched_getaffinity(0))
    rows = [("one CPU", (cpus[0], cpus[0]))]
    if len(cpus) >= 2:
        rows.insert(0, ("two CPUs", (cpus[0], cpus[1])))
    return rows


def _pinned_raw(cpus: tuple[int, int], rounds: int) -> float:
    """Median seconds of ``rounds`` raw round trips with pinger and echo pinned to ``cpus``."""
    with (
        pinned_helper(ranks.tcp_echo, 2 * rounds, NBYTES, cpus=cpus, what="the raw echo") as port,
        socket.create_connection(("127.0.0.1", port), timeout=ranks.CALL_TIMEOUT) as sock,
    ):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        one = _raw_round_trip(sock, b"\x5a" * NBYTES)
        _batch(one, rounds)  # warm-up
        times = _batch(one, rounds)
    return median(times)


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Alternate batches of raw and fabricd round trips; one row."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    batches, per_batch = (3, 100) if quick else (10, 500)
    warm = per_batch // 5 + 1
    rounds = warm + batches * per_batch
    table = Table(
        name="roundtrip",
        title=f"(g) {NBYTES}-byte rank-to-rank round trip across two daemons, against a raw "
        "two-process TCP ping-pong (blocking sockets), microseconds",
        columns=[
            Column("raw_median", "raw median"),
            Column("raw_p99", "raw p99"),
            Column("raw_low", "raw batch low"),
            Column("raw_high", "raw batch high"),
            Column("fabricd_median", "fabricd median"),
            Column("fabricd_p99", "fabricd p99"),
            Column("fabricd_low", "fabricd batch low"),
            Column("fabricd_high", "fabricd batch high"),
        ],
        ratio="fabricd median / raw median (lower is better)",
        target=f"ratio <= {TARGET_RATIO:g}",
        settings={"batches": batches, "round_trips_per_batch": per_batch, "nbytes": NBYTES},
    )
    job = f"bench-{uuid.uuid4().hex[:8]}"
    parent, child = multiprocessing.get_context("spawn").Pipe()
    progress("starting the raw echo, 2 daemons and rank 1")
    raw_peer = spawn(ranks.tcp_echo, child, rounds, NBYTES)
    raw_batches: list[list[float]] = []
    fab_batches: list[list[float]] = []
    try:
        if not parent.poll(60):
            raise RuntimeError("the raw echo did not start")
        port = parent.recv()
        with (
            socket.create_connection(("127.0.0.1", port), timeout=ranks.CALL_TIMEOUT) as sock,
            LocalCluster(2) as cluster,
        ):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cluster.wait_connected()
            fab_peer = spawn(ranks.fabric_echo, cluster.nodes[1].socket_path, job, rounds, NBYTES)
            with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
                message = fab.array("bench-ping", (NBYTES,), "uint8")
                message[:] = 0x5A
                raw_one = _raw_round_trip(sock, bytes(message))
                fab_one = _fabric_round_trip(fab, message)
                _batch(raw_one, warm)
                _batch(fab_one, warm)
                for i in range(batches):
                    raw_batches.append(_batch(raw_one, per_batch))
                    fab_batches.append(_batch(fab_one, per_batch))
                    progress(
                        f"batch {i + 1} of {batches}: raw "
                        f"{fmt_number(median(raw_batches[-1]) * 1e6)} us, fabricd "
                        f"{fmt_number(median(fab_batches[-1]) * 1e6)} us"
                    )
                if int(message[0]) != 0x5A:
                    raise RuntimeError("the fabricd echo returned other bytes than it was sent")
            reap(fab_peer)
    except BaseException:
        raw_peer.terminate()
        raise
    reap(raw_peer)
    figures: dict[str, float] = {}
    for side, per in (("raw", raw_batches), ("fabricd", fab_batches)):
        every = [t for batch in per for t in batch]
        medians = [median(batch) for batch in per]
        figures[f"{side}_median"] = median(every) * 1e6
        figures[f"{side}_p99"] = percentile(every, 99) * 1e6
        figures[f"{side}_low"] = min(medians) * 1e6
        figures[f"{side}_high"] = max(medians) * 1e6
    ratio = figures["fabricd_median"] / figures["raw_median"]
    table.add(f"{NBYTES} B", NBYTES, ratio, **figures)
    table.target_met = ratio <= TARGET_RATIO
    progress(
        f"{NBYTES} B: raw {fmt_number(figures['raw_median'])} us, fabricd "
        f"{fmt_number(figures['fabricd_median'])} us, ratio {fmt_number(ratio)}x"
    )
    pinned = {label: _pinned_raw(cpus, per_batch) * 1e6 for label, cpus in pinnings()}
    table.extras.append(
        Extra(
            label="raw ping-pong median with both processes pinned, measured after the table "
            "(the unpinned raw figure lies between these, by where the scheduler put the two)",
            figures=pinned,
            unit="us",
        )
    )
    progress("raw pinned: " + ", ".join(f"{k} {fmt_number(v)} us" for k, v in pinned.items()))
    table.notes += [
        f"{batches} batches of {per_batch} round trips each side, alternating; batch low/high: "
        "the lowest and highest batch median",
        "the raw ping-pong is one process hop each way; fabricd's is three each way (rank 0, "
        "daemon 0, daemon 1, rank 1), four processes on the same CPUs",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("roundtrip", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
