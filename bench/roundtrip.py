"""(g) 1-byte rank-to-rank round trip across two daemons, against the hop floor and a raw pair.

fabricd: ``LocalCluster(2)`` on loopback.  Rank 0 (this process, a client of node 0) sends a
1-byte array to rank 1 (another process, a client of node 1) with ``fab.send`` and then
``fab.recv``\\ s it back; rank 1 receives it and sends it back (:func:`bench.ranks.fabric_echo`).
A round trip crosses three process hops each way (rank 0 -> daemon 0 -> daemon 1 -> rank 1 and
back), plus whatever control frames the protocol needs; four processes share the two CPUs.

Baseline, the hop floor (:mod:`bench.hopfloor`, issue 22): the same three hops each way with
the daemons replaced by two do-nothing uvloop relays -- this process's blocking Unix socket,
relay A, TCP on 127.0.0.1 with ``TCP_NODELAY``, relay B, a Unix socket to an echoing client --
so the ratio is what fabricd's work costs on top of the hops any daemon per node pays.

Second baseline, kept so earlier runs stay comparable: the simplest thing that moves one byte
between two processes and back -- two processes, one TCP connection on 127.0.0.1 with
``TCP_NODELAY``, *blocking* sockets (no event loop on either side): this process ``sendall``\\ s
the byte and ``recv``\\ s the echo; the other (:func:`bench.ranks.tcp_echo`) ``recv_into``\\ s it
and ``sendall``\\ s it back.  No process is pinned: like the fabricd processes, the two go where
the scheduler puts them.  On a virtual machine that matters: waking a process on another, idle
CPU costs far more than on the same one, so an extra figure gives the raw ping-pong pinned to
two CPUs and to one.

Batches alternate -- raw, hop floor, fabricd -- so all three see the same background load; each
side gets a warm-up batch first.  Reported: the median and 99th percentile of the single round
trips, and the spread of the batch medians (lowest and highest); ratio = fabricd median / hop
floor median, with fabricd median / raw median beside it.  Target (issue 22, item 5): at most
4x the hop floor.  Extra figures: the CPU time each of the four processes spends per round trip,
on the floor and through fabricd (what each hop costs, beside what it takes in wall time).

Run alone: ``python -m bench.roundtrip [--quick]``.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING, Any

from bench import hopfloor, ranks
from bench.report import (
    Column,
    CpuMeter,
    Extra,
    Progress,
    Table,
    batch_figures,
    each_call,
    fmt_number,
    median,
    pinned_helper,
    quiet,
    reap,
    run_alone,
    spawn,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.daemon.launcher import LocalCluster

#: bytes per message, both ways
NBYTES = 1
TARGET_RATIO = 4.0
#: the three sides and their headings, in the order their batches alternate
SIDES = {"raw": "raw", "floor": "hop floor", "fabricd": "fabricd"}


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
        each_call(one, rounds)  # warm-up
        times = each_call(one, rounds)
    return median(times)


def _fabric_pids(cluster: LocalCluster, echo: int) -> dict[str, int]:
    return {
        "rank 0": os.getpid(),
        "daemon 0": cluster.nodes[0].pid,
        "daemon 1": cluster.nodes[1].pid,
        "rank 1": echo,
    }


def _alternate(
    sides: dict[str, tuple[Callable[[], None], CpuMeter]],
    batches: int,
    per_batch: int,
    progress: Progress,
) -> dict[str, list[list[float]]]:
    """A warm-up batch of each side, then ``batches`` rounds of one batch per side, in turn;
    each side's CPU meter counts its own batches only."""
    for one, _ in sides.values():
        each_call(one, per_batch // 5 + 1)
    timed: dict[str, list[list[float]]] = {side: [] for side in sides}
    for i in range(batches):
        for side, (one, meter) in sides.items():
            with meter.counting():
                timed[side].append(each_call(one, per_batch))
        progress(
            f"batch {i + 1} of {batches}: "
            + ", ".join(
                f"{SIDES[side]} {fmt_number(median(t[-1]) * 1e6)} us" for side, t in timed.items()
            )
        )
    return timed


def _table(batches: int, per_batch: int) -> Table:
    return Table(
        name="roundtrip",
        title=f"(g) {NBYTES}-byte rank-to-rank round trip across two daemons, against the hop "
        "floor (two do-nothing uvloop relays) and a raw two-process TCP ping-pong (blocking "
        "sockets), microseconds",
        columns=[
            *(
                Column(f"{side}_{figure}", f"{side_heading} {heading}")
                for side, side_heading in SIDES.items()
                for figure, heading in (
                    ("median", "median"),
                    ("p99", "p99"),
                    ("low", "batch low"),
                    ("high", "batch high"),
                )
            ),
            Column("vs_raw", "fabricd / raw"),
        ],
        ratio="fabricd median / hop floor median (lower is better)",
        target=f"ratio <= {TARGET_RATIO:g}",
        settings={"batches": batches, "round_trips_per_batch": per_batch, "nbytes": NBYTES},
    )


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Alternate batches of raw, hop-floor and fabricd round trips; one row."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    batches, per_batch = (3, 100) if quick else (10, 500)
    rounds = per_batch // 5 + 1 + batches * per_batch
    table = _table(batches, per_batch)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    parent, child = multiprocessing.get_context("spawn").Pipe()
    progress("starting the raw echo, the hop floor, 2 daemons and rank 1")
    raw_peer = spawn(ranks.tcp_echo, child, rounds, NBYTES)
    try:
        if not parent.poll(60):
            raise RuntimeError("the raw echo did not start")
        port = parent.recv()
        with (
            socket.create_connection(("127.0.0.1", port), timeout=ranks.CALL_TIMEOUT) as sock,
            hopfloor.hop_floor([(NBYTES, NBYTES, rounds)]) as floor,
            LocalCluster(2) as cluster,
        ):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cluster.wait_connected()
            fab_peer = spawn(ranks.fabric_echo, cluster.nodes[1].socket_path, job, rounds, NBYTES)
            with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
                message = fab.array("bench-ping", (NBYTES,), "uint8")
                message[:] = 0x5A
                assert raw_peer.pid is not None
                assert fab_peer.pid is not None
                sides: dict[str, tuple[Callable[[], None], CpuMeter]] = {
                    "raw": (
                        _raw_round_trip(sock, bytes(message)),
                        CpuMeter({"pinger": os.getpid(), "echo": raw_peer.pid}),
                    ),
                    "floor": (
                        functools.partial(floor.end.round_trip, bytes(message)),
                        CpuMeter(floor.pids),
                    ),
                    "fabricd": (
                        _fabric_round_trip(fab, message),
                        CpuMeter(_fabric_pids(cluster, fab_peer.pid)),
                    ),
                }
                timed = _alternate(sides, batches, per_batch, progress)
                if int(message[0]) != 0x5A:
                    raise RuntimeError("the fabricd echo returned other bytes than it was sent")
            reap(fab_peer)
    except BaseException:
        raw_peer.terminate()
        raise
    reap(raw_peer)
    figures: dict[str, float] = {}
    for side in SIDES:
        figures.update(batch_figures(side, timed[side]))
    figures["vs_raw"] = figures["fabricd_median"] / figures["raw_median"]
    ratio = figures["fabricd_median"] / figures["floor_median"]
    table.add(f"{NBYTES} B", NBYTES, ratio, **figures)
    table.target_met = ratio <= TARGET_RATIO
    progress(
        f"{NBYTES} B: raw {fmt_number(figures['raw_median'])} us, hop floor "
        f"{fmt_number(figures['floor_median'])} us, fabricd "
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
    for side, (_, meter) in sides.items():
        table.extras.append(
            Extra(
                label=f"CPU time per round trip by process, {side} (over its own batches)",
                figures=meter.per(batches * per_batch),
                unit="us",
            )
        )
    table.notes += [
        f"{batches} batches of {per_batch} round trips each side, alternating raw, hop floor, "
        "fabricd; batch low/high: the lowest and highest batch median",
        "the raw ping-pong is one process hop each way; the hop floor's and fabricd's are three "
        "each way (client or rank 0, relay or daemon 0, relay or daemon 1, client or rank 1), "
        "four processes on the same CPUs",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("roundtrip", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
