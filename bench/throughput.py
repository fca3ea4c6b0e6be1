"""(b) Daemon-to-daemon throughput over TCP against a raw uvloop socket pair.

fabricd: ``LocalCluster(2)`` on loopback; rank 0 (this process, a client of node 0) sends each
message to rank 1 (another process, a client of node 1) with ``fab.send``, which returns once
rank 1 has all of it.  The bytes go rank 0's segment -> daemon 0 -> TCP -> daemon 1 -> rank 1's
segment, as DATA frames of ``chunk_size`` behind an RTS/CTS rendezvous.

Baseline: two processes and one TCP connection on 127.0.0.1, both on uvloop.  The sender (this
process) writes each message as one memoryview with ``transport.writelines``, waits until the
write buffer drains and for the receiver's 1-byte ack; the receiver reads with a
``BufferedProtocol`` straight into a preallocated buffer and acks each complete message.  Both
sides therefore measure *message-complete* throughput, one message in flight at a time, from
the same source array (rank 0's segment) into the same kind of memory (a memfd mapping).

Samples alternate -- a raw sample, then a fabricd sample, for each size -- so that both see the
same background noise.  Throughput is the message bytes moved per second (frame headers and the
1-byte acks are not counted); the figure is the median over samples.

Run alone: ``python -m bench.throughput [--quick] [--chunk-size 1MiB,4MiB,16MiB]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import ranks
from bench.report import (
    Column,
    Extra,
    KiB,
    MiB,
    Progress,
    Table,
    fmt_number,
    fmt_size,
    median,
    messages_per_sample,
    parse_size,
    quiet,
    reap,
    spawn,
    stderr_progress,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
#: the size from which the 0.8x target applies
TARGET_FROM = 4 * MiB
TARGET_RATIO = 0.8
#: messages in flight per side for the streaming figure (osu_bw uses 64; 4 already hides the
#: per-message round trips at >= 1 MiB on loopback)
WINDOW = 4


class _AckProtocol(asyncio.Protocol):
    """The raw sender's end: counts 1-byte acks and tracks write-buffer pressure."""

    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.acks = 0
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.acks += len(data)  # one byte per message
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()
        if not self.lost.done():
            self.lost.set_result(None)


class RawSender:
    """This process's end of the raw baseline, on a uvloop loop kept between samples."""

    def __init__(self, port: int) -> None:
        import uvloop

        self._runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        self._transport, self._protocol = self._runner.run(self._connect(port))

    async def _connect(self, port: int) -> tuple[asyncio.Transport, _AckProtocol]:
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_connection(_AckProtocol, "127.0.0.1", port)
        # the same write-buffer marks as fabricd's TCP links
        transport.set_write_buffer_limits(high=8 * MiB, low=2 * MiB)
        return transport, protocol

    def send(self, view: memoryview, messages: int, window: int = 1) -> float:
        """Send ``messages`` copies of ``view`` with at most ``window`` unacked; return seconds."""
        return self._runner.run(self._send(view, messages, window))

    async def _send(self, view: memoryview, messages: int, window: int) -> float:
        loop = asyncio.get_running_loop()
        protocol, transport = self._protocol, self._transport
        base = protocol.acks
        start = time.perf_counter()
        async with asyncio.timeout(ranks.CALL_TIMEOUT):
            for sent in range(1, messages + 1):
                transport.writelines([view])
                await protocol.writable.wait()
                while sent - (protocol.acks - base) >= window and sent < messages:
                    protocol.waiter = loop.create_future()
                    await protocol.waiter
            while protocol.acks - base < messages:
                protocol.waiter = loop.create_future()
                await protocol.waiter
        return time.perf_counter() - start

    def close(self) -> None:
        self._transport.close()
        self._runner.run(asyncio.wait_for(asyncio.shield(self._protocol.lost), 5))
        self._runner.close()


def _fabric_sample(fab: Any, view: Any, messages: int, window: int) -> float:
    """Send ``messages`` copies of ``view`` with at most ``window`` in flight; return seconds."""
    start = time.perf_counter()
    ranks.send_windowed(fab, view, messages, window)
    return time.perf_counter() - start


def plan(sizes: Sequence[int], samples: int, budget: int, cap: int) -> list[tuple[int, int]]:
    """(size, messages per sample) for each size; the same plan drives both ends."""
    return [(n, messages_per_sample(n, budget, cap)) for n in sizes]


def run(
    quick: bool = False,
    progress: Progress = quiet,
    *,
    settings: dict[str, Any] | None = None,
    sizes: Sequence[int] | None = None,
    window: int = 1,
) -> Table:
    """Measure every size; ``settings`` are extra daemon config keys (e.g. ``chunk_size``).

    ``window`` is how many messages each side keeps in flight (osu_bw style): 1 measures
    message-complete throughput, where every message pays the fixed cost of its round trips;
    more overlaps those costs with other messages' bytes, which is what a stream of gradients
    or activations sees.
    """
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    sizes = list(sizes or (QUICK_SIZES if quick else SIZES))
    samples = 3 if quick else 9
    budget, cap = (32 * MiB, 30) if quick else (256 * MiB, 200)
    cases = plan(sizes, samples, budget, cap)
    per_side = [(n, 1 + samples * k) for n, k in cases]  # one warm-up message per size
    capacity = max(sizes)
    settings = dict(settings or {})
    chunk = int(settings.get("chunk_size", 4 * MiB))
    table = Table(
        name="throughput" if window == 1 else f"throughput-window{window}",
        title=f"(b) daemon-to-daemon throughput over TCP on loopback, GB/s (1e9 B/s), "
        f"{window} message{'s' if window > 1 else ''} in flight",
        columns=[
            Column("raw", "raw uvloop pair GB/s"),
            Column("fabricd", "fabricd GB/s"),
            Column("messages", "msgs/sample", 0),
        ],
        ratio="fabricd / raw pair (higher is better)",
        target=f"ratio >= {TARGET_RATIO} for sizes >= {fmt_size(TARGET_FROM)}",
        settings={"chunk_size": chunk, "samples": samples, "window": window, **settings},
    )
    job = f"bench-{uuid.uuid4().hex[:8]}"
    progress(f"starting 2 daemons (chunk_size {fmt_size(chunk)}) and the receiving processes")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    raw_peer = spawn(ranks.raw_receiver, child, per_side)
    with LocalCluster(2, settings=settings) as cluster:
        cluster.wait_connected()
        fab_peer = spawn(ranks.fabric_receiver, cluster.nodes[1].socket_path, job, per_side, window)
        with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
            source = fab.array("bench-send", (capacity,), "uint8")
            source[:] = np.arange(capacity, dtype=np.uint64).astype(np.uint8)
            if not parent.poll(60):
                raise RuntimeError("the raw receiver did not start")
            raw = RawSender(parent.recv())
            try:
                for nbytes, messages in cases:
                    view = source[:nbytes]
                    raw.send(view.data, 1)
                    fab.send(view, to=1, timeout=ranks.CALL_TIMEOUT)
                    raw_times, fab_times = [], []
                    for _ in range(samples):
                        raw_times.append(raw.send(view.data, messages, window))
                        fab_times.append(_fabric_sample(fab, view, messages, window))
                    moved = nbytes * messages
                    raw_rate = moved / median(raw_times) / 1e9
                    fab_rate = moved / median(fab_times) / 1e9
                    ratio = fab_rate / raw_rate
                    table.add(
                        fmt_size(nbytes),
                        nbytes,
                        ratio,
                        raw=raw_rate,
                        fabricd=fab_rate,
                        messages=messages,
                    )
                    progress(
                        f"{fmt_size(nbytes)}: raw {fmt_number(raw_rate)} GB/s, "
                        f"fabricd {fmt_number(fab_rate)} GB/s, ratio {fmt_number(ratio)}x"
                    )
            finally:
                raw.close()
        reap(fab_peer)
    reap(raw_peer)
    smallest = table.rows[0]
    per_message = {  # at the smallest size this is the fixed cost of one message, in us
        side: smallest.nbytes / (smallest.figures[side] * 1e9) * 1e6 for side in ("raw", "fabricd")
    }
    table.extras.append(
        Extra(
            label=f"time per {smallest.label} message (about the fixed cost of any message)",
            figures=per_message,
            unit="us",
        )
    )
    judged = [r.ratio for r in table.rows if r.nbytes >= TARGET_FROM]
    table.target_met = all(r >= TARGET_RATIO for r in judged) if judged else None
    eager = int(settings.get("eager_limit", 64 * KiB))
    table.notes.append(
        f"{window} message(s) in flight per side; a fabricd message of at most "
        f"{fmt_size(eager)} (eager_limit) is one EAGER frame and a DONE, a larger one an RTR "
        f"(or an RTS/CTS when the send comes first), DATA frames of {fmt_size(chunk)} and a "
        "DONE; each raw message is one write and a 1-byte ack"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument(
        "--chunk-size",
        default="",
        help="comma-separated chunk sizes to compare (e.g. 1MiB,4MiB,16MiB); default: config's",
    )
    parser.add_argument(
        "--eager-limit",
        default="",
        help="comma-separated eager limits to compare (e.g. 0,1MiB: where eager stops paying)",
    )
    parser.add_argument("--sizes", default="", help="comma-separated message sizes")
    parser.add_argument("--window", type=int, default=1, help="messages in flight per side")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s] or None
    chunks = [parse_size(c) for c in args.chunk_size.split(",") if c]
    eagers = [parse_size(e) for e in args.eager_limit.split(",") if e]
    runs: list[dict[str, Any]] = [{"chunk_size": c} for c in chunks] or [{}]
    if eagers:
        runs = [{**r, "eager_limit": e} for r in runs for e in eagers]
    for settings in runs:
        table = run(
            args.quick,
            stderr_progress("throughput"),
            settings=settings,
            sizes=sizes,
            window=args.window,
        )
        print(table.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
