"""(c) Small-frame round trip on the control channel, against a raw uvloop ping-pong.

fabricd: a pair of :class:`~fabricd.transports.tcp.TcpLink` on 127.0.0.1 (``TcpTransport``
``listen``/``connect``) under uvloop.  The accepting side's sink echoes every HEARTBEAT frame
with ``send_nowait``; the connecting side sends a HEARTBEAT (``{}`` metadata, as the daemon's
heartbeats) and waits for the echo.  This is the transport's share of every control message:
framing, the incremental decoder, the sink callbacks, ``TCP_NODELAY``.

Baseline: a raw ``asyncio.Protocol`` ping-pong on another TCP connection, of the same byte
count per message (pre-encoded bytes; the echo side writes back what it read), always placed
exactly like the fabricd pair.  Rows:

* one process: pinger and echo in one loop in this process -- the software cost per frame;
* two processes, two CPUs: the echo in another process pinned to another CPU, as a peer daemon;
* two processes, one CPU: both pinned to the same CPU (the scheduler's other choice on a busy
  two-core machine).

Batches alternate between the two so both see the same background load.  Reported: median and
99th percentile of the per-message round trip in microseconds, and their ratios.

Extra figure, without a baseline: the end-to-end round trip of a 0-byte message between two
ranks on two daemons (``LocalCluster(2)``): rank 0 sends, rank 1 (another process) receives and
sends back, rank 0 receives.  That crosses two client sockets and the control channel twice
each way (RTS, DONE), and four processes share the machine's cores.

Run alone: ``python -m bench.latency [--quick]``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING

import uvloop

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
from fabricd.transports.tcp import TcpTransport
from fabricd.wire import DEFAULT_LIMITS, Kind, encode_head

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.transports.base import Link
    from fabricd.wire import Frame, FrameHead

TARGET_RATIO = 1.5
#: bytes of a HEARTBEAT frame as the daemon sends it (empty metadata)
FRAME_SIZE = len(encode_head(Kind.HEARTBEAT, {}))


class _Waiter:
    """Sink of the connecting link: completes the future of the ping in flight."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None

    def frame_received(self, link: Link, frame: Frame) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(ConnectionError("link lost"))


class _RawPing(asyncio.Protocol):
    """Raw client side: completes the ping's future once ``size`` bytes are back."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.got = 0
        self.future: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= self.size and self.future is not None and not self.future.done():
            self.got -= self.size
            self.future.set_result(None)


async def _ping_pong(
    fabricd_address: str, raw_port: int, batches: int, per_batch: int, progress: Progress
) -> tuple[list[float], list[float]]:
    """Seconds per round trip to the echoes at the given addresses: (fabricd, raw)."""
    loop = asyncio.get_running_loop()
    link = await TcpTransport().connect(fabricd_address, DEFAULT_LIMITS)
    waiter = _Waiter()
    link.set_sink(waiter)
    raw_transport, raw = await loop.create_connection(
        lambda: _RawPing(FRAME_SIZE), "127.0.0.1", raw_port
    )
    payload = b"\0" * FRAME_SIZE
    heartbeat = Kind.HEARTBEAT

    async def fabricd_batch(n: int) -> list[float]:
        out = []
        for _ in range(n):
            waiter.future = loop.create_future()
            start = time.perf_counter()
            link.send_nowait(heartbeat, {})
            await waiter.future
            out.append(time.perf_counter() - start)
        return out

    async def raw_batch(n: int) -> list[float]:
        out = []
        for _ in range(n):
            raw.future = loop.create_future()
            start = time.perf_counter()
            raw_transport.write(payload)
            await raw.future
            out.append(time.perf_counter() - start)
        return out

    fab_times: list[float] = []
    raw_times: list[float] = []
    try:
        async with asyncio.timeout(ranks.CALL_TIMEOUT):
            await fabricd_batch(per_batch // 10 + 1)  # warm-ups
            await raw_batch(per_batch // 10 + 1)
            for i in range(batches):
                raw_times += await raw_batch(per_batch)
                fab_times += await fabricd_batch(per_batch)
                progress(f"batch {i + 1} of {batches}")
    finally:
        link.close("benchmark done")
        raw_transport.close()
        await link.wait_closed()
    return fab_times, raw_times


async def _in_one_process(
    batches: int, per_batch: int, progress: Progress
) -> tuple[list[float], list[float]]:
    """Both echoes in this process's loop."""
    loop = asyncio.get_running_loop()
    accepted: list[Link] = []

    def on_link(link: Link) -> None:
        link.set_sink(ranks.FrameEcho())
        accepted.append(link)

    listener = await TcpTransport().listen("127.0.0.1:0", on_link, DEFAULT_LIMITS)
    server = await loop.create_server(ranks.RawEcho, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        return await _ping_pong(listener.address, port, batches, per_batch, progress)
    finally:
        for link in accepted:
            link.close("benchmark done")
        server.close()
        await listener.aclose()


def _in_two_processes(
    batches: int, per_batch: int, progress: Progress, cpus: tuple[int, int]
) -> tuple[list[float], list[float]]:
    """Both echoes in another process with its own uvloop loop; pinger on ``cpus[0]``, echo
    process on ``cpus[1]`` (the same CPU or two)."""
    with pinned_helper(ranks.frame_echo, ranks.CALL_TIMEOUT, cpus=cpus, what="the echo helper") as (
        address,
        port,
    ):
        return uvloop.run(_ping_pong(address, port, batches, per_batch, progress))


def placements() -> list[tuple[str, tuple[int, int] | None]]:
    """The rows of the table: where the pinger and the echo run (``None``: one process)."""
    cpus = sorted(os.sched_getaffinity(0))
    rows: list[tuple[str, tuple[int, int] | None]] = [("one process", None)]
    if len(cpus) >= 2:
        rows.append(("two processes, two CPUs", (cpus[0], cpus[1])))
    rows.append(("two processes, one CPU", (cpus[0], cpus[0])))
    return rows


def _end_to_end(rounds: int) -> list[float]:
    """Seconds per 0-byte rank-to-rank round trip across two daemons."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    job = f"bench-{uuid.uuid4().hex[:8]}"
    warm = max(10, rounds // 10)
    times = []
    with LocalCluster(2) as cluster:
        cluster.wait_connected()
        peer = spawn(ranks.fabric_echo, cluster.nodes[1].socket_path, job, warm + rounds)
        with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
            empty = fab.array("bench-ping", (1,), "uint8")[:0]
            for i in range(warm + rounds):
                start = time.perf_counter()
                fab.send(empty, to=1, timeout=ranks.CALL_TIMEOUT)
                fab.recv(empty, src=1, timeout=ranks.CALL_TIMEOUT)
                if i >= warm:
                    times.append(time.perf_counter() - start)
        reap(peer)
    return times


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Measure the transport round trips (one and two processes) and the end-to-end figure."""
    batches, per_batch, rounds = (3, 300, 200) if quick else (10, 2000, 2000)
    table = Table(
        name="latency",
        title=f"(c) round trip of a {FRAME_SIZE} B control frame on 127.0.0.1, microseconds",
        columns=[
            Column("raw_median", "raw median"),
            Column("raw_p99", "raw p99"),
            Column("fabricd_median", "fabricd median"),
            Column("fabricd_p99", "fabricd p99"),
            Column("p99_ratio", "p99 ratio"),
        ],
        ratio="fabricd median / raw median (lower is better)",
        target=f"median ratio <= {TARGET_RATIO} (every row)",
        settings={"round_trips": batches * per_batch, "frame_bytes": FRAME_SIZE},
    )
    for where, cpus in placements():

        def report(line: str, where: str = where) -> None:
            progress(f"{where}: {line}")

        if cpus is None:
            fab, raw = uvloop.run(_in_one_process(batches, per_batch, report))
        else:
            fab, raw = _in_two_processes(batches, per_batch, report, cpus)
        figures = {
            "raw_median": median(raw) * 1e6,
            "raw_p99": percentile(raw, 99) * 1e6,
            "fabricd_median": median(fab) * 1e6,
            "fabricd_p99": percentile(fab, 99) * 1e6,
        }
        ratio = figures["fabricd_median"] / figures["raw_median"]
        figures["p99_ratio"] = figures["fabricd_p99"] / figures["raw_p99"]
        table.add(f"{FRAME_SIZE} B, {where}", FRAME_SIZE, ratio, **figures)
        progress(
            f"{where}: raw {fmt_number(figures['raw_median'])} us, "
            f"fabricd {fmt_number(figures['fabricd_median'])} us, ratio {fmt_number(ratio)}x"
        )
    table.target_met = all(row.ratio <= TARGET_RATIO for row in table.rows)
    progress(f"end-to-end 0-byte rank round trips across 2 daemons: {rounds}")
    e2e = _end_to_end(rounds)
    table.extras.append(
        Extra(
            label="0-byte rank-to-rank round trip across two daemons, 4 processes (no baseline)",
            figures={"median": median(e2e) * 1e6, "p99": percentile(e2e, 99) * 1e6},
            unit="us",
        )
    )
    progress(f"end-to-end: median {fmt_number(median(e2e) * 1e6)} us")
    table.notes += [
        "one process: pinger and echo share one uvloop loop, so the round trip is the software "
        "cost per frame plus loopback TCP, with no cross-process wake-up",
        "two processes: the echo runs in another process with its own uvloop loop, as a peer "
        "daemon does, pinned to another CPU or to the same one; waking the other process is "
        "part of both figures, and on a virtual machine waking an idle CPU is the larger part",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("latency", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
