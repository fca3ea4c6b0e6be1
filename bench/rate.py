"""(h) 4 KiB one-way message rate between two ranks on two daemons, against a raw uvloop pair.

fabricd: ``LocalCluster(2)`` on loopback.  Rank 0 (this process, a client of node 0) sends N
4 KiB messages to rank 1 (another process, a client of node 1) with ``fab.send_async``, keeping
at most W open; rank 1 (:func:`bench.ranks.fabric_batch_receiver`) keeps W receives posted, each
into its own array, and once all N are in sends rank 0 a 0-byte message that ends the sample.

Baseline: the raw pair of benchmark (b) -- two processes, one TCP connection on 127.0.0.1, both
on uvloop, ``TCP_NODELAY``; the sender writes each 4 KiB message with ``transport.writelines``
and keeps at most W unacknowledged; the receiver reads with a ``BufferedProtocol`` straight into
a preallocated memfd buffer and acks *each* message with 1 byte.

Why this is a fair comparison:

* both keep at most W messages that the receiver has not confirmed, and each message is
  confirmed on its own: the raw receiver's 1-byte ack per message against the DONE that ends
  each fabricd send today (``send`` returns once the receiver has all of it);
* both samples end when the sender knows the receiver has all N messages: the raw one at the
  last ack, the fabricd one at rank 1's end-of-sample message.  That end signal costs fabricd
  one more one-way trip per sample (under 0.5% of a sample of 500 messages), and it keeps the
  figure honest if ``send`` ever returns before delivery (eager sends): the sample still lasts
  until rank 1 has every byte;
* both send from rank 0's shared-memory array and land in memfd mappings whose pages were
  touched first; samples alternate (a raw sample, then a fabricd sample) so both see the same
  background load, each side after a warm-up batch.

Rows: W = 1 (each message waits for the previous one's confirmation: the one-way time plus the
confirmation) and W = 8 (a message rate with the round trips overlapped).  Reported: messages
per second and microseconds per message (sample time / N, median over samples), the spread
((max - min) / median of the samples) and the ratio fabricd time / raw time per message.
Target (issue 8): at most 5x, judged on every row.

Run alone: ``python -m bench.rate [--quick]``.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import ranks
from bench.report import (
    Column,
    KiB,
    Progress,
    Table,
    fmt_number,
    median,
    quiet,
    reap,
    run_alone,
    spawn,
)
from bench.throughput import RawSender

if TYPE_CHECKING:
    from collections.abc import Sequence

NBYTES = 4 * KiB
#: (window, wait) of each row: sends finished on delivery, and on the daemon's copy
MODES = [(1, "delivered"), (8, "delivered"), (8, "sent")]
TARGET_RATIO = 5.0


def _spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / median(values)


def _fabric_sample(fab: Any, view: Any, done: Any, messages: int, window: int, wait: str) -> float:
    """Send ``messages`` copies of ``view``, at most ``window`` open, until rank 1 says it has
    them all; return seconds."""
    start = time.perf_counter()
    finished = fab.recv_async(done, src=1, tag=ranks.BATCH_DONE_TAG)
    ranks.send_windowed(fab, view, messages, window, wait)
    finished.wait(ranks.CALL_TIMEOUT)
    return time.perf_counter() - start


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """One row per window: raw and fabricd samples alternating."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    samples, messages = (3, 50) if quick else (9, 500)
    warm = messages // 5 + 1
    batches = [(w, k) for w, _ in MODES for k in [warm] + [messages] * samples]
    table = Table(
        name="rate",
        title=f"(h) {NBYTES // KiB} KiB one-way message rate between ranks on two daemons, "
        "against a raw uvloop pair (1-byte ack per message)",
        columns=[
            Column("raw_rate", "raw msgs/s", 0),
            Column("raw_us", "raw us/msg"),
            Column("raw_spread", "raw spread"),
            Column("fabricd_rate", "fabricd msgs/s", 0),
            Column("fabricd_us", "fabricd us/msg"),
            Column("fabricd_spread", "fabricd spread"),
            Column("messages", "msgs/sample", 0),
        ],
        ratio="fabricd time per message / raw time per message (lower is better)",
        target=f"ratio <= {TARGET_RATIO:g} (every row)",
        settings={"samples": samples, "messages": messages, "modes": MODES},
    )
    job = f"bench-{uuid.uuid4().hex[:8]}"
    progress("starting the raw receiver, 2 daemons and rank 1")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    raw_peer = spawn(ranks.raw_receiver, child, [(NBYTES, sum(k for _, k in batches))])
    try:
        with LocalCluster(2) as cluster:
            cluster.wait_connected()
            fab_peer = spawn(
                ranks.fabric_batch_receiver, cluster.nodes[1].socket_path, job, NBYTES, batches
            )
            with connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path) as fab:
                source = fab.array("bench-send", (NBYTES,), "uint8")
                source[:] = np.arange(NBYTES, dtype=np.uint64).astype(np.uint8)
                done = fab.array("bench-done", (1,), "uint8")[:0]
                if not parent.poll(60):
                    raise RuntimeError("the raw receiver did not start")
                raw = RawSender(parent.recv())
                try:
                    for window, wait in MODES:
                        label = f"4 KiB, window {window}" + (", sent" if wait == "sent" else "")
                        raw.send(source.data, warm, window)
                        _fabric_sample(fab, source, done, warm, window, wait)
                        raw_times, fab_times = [], []
                        for _ in range(samples):
                            raw_times.append(raw.send(source.data, messages, window) / messages)
                            fab_times.append(
                                _fabric_sample(fab, source, done, messages, window, wait) / messages
                            )
                        raw_us, fab_us = median(raw_times) * 1e6, median(fab_times) * 1e6
                        ratio = fab_us / raw_us
                        table.add(
                            label,
                            NBYTES,
                            ratio,
                            raw_rate=1e6 / raw_us,
                            raw_us=raw_us,
                            raw_spread=_spread(raw_times),
                            fabricd_rate=1e6 / fab_us,
                            fabricd_us=fab_us,
                            fabricd_spread=_spread(fab_times),
                            messages=messages,
                        )
                        progress(
                            f"{label}: raw {fmt_number(raw_us)} us/msg, fabricd "
                            f"{fmt_number(fab_us)} us/msg, ratio {fmt_number(ratio)}x"
                        )
                finally:
                    raw.close()
            reap(fab_peer)
    except BaseException:
        raw_peer.terminate()
        raise
    reap(raw_peer)
    table.target_met = all(row.ratio <= TARGET_RATIO for row in table.rows)
    table.notes += [
        "window W: at most W messages the receiver has not confirmed, on both sides; the raw "
        "receiver acks each message with 1 byte, a fabricd send completes on the receiver's DONE",
        "'sent': fabricd sends with wait=\"sent\" (done once the daemon copied the 4 KiB; at most "
        "W of those open, and eager_credit bytes unanswered at the receiver); the raw pair as in "
        "window W",
        "each fabricd sample ends on rank 1's 0-byte end-of-sample message, each raw sample on "
        "the last ack: both when the receiver has all N",
        "spread = (max - min) / median of the samples; the machine is shared",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("rate", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
