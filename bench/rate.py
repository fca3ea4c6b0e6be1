"""(h) 4 KiB one-way message rate between two ranks on two daemons, against the hop floor.

fabricd: ``LocalCluster(2)`` on loopback.  Rank 0 (this process, a client of node 0) sends N
4 KiB messages to rank 1 (another process, a client of node 1) with ``fab.send_async``, keeping
at most W open; rank 1 (:func:`bench.ranks.fabric_batch_receiver`) keeps W receives posted, each
into its own array, and once all N are in sends rank 0 a 0-byte message that ends the sample.

Baseline, the hop floor (:mod:`bench.hopfloor`, issue 22): the same path with the daemons
replaced by two do-nothing uvloop relays -- this process's blocking Unix socket, relay A, TCP on
127.0.0.1 with ``TCP_NODELAY``, relay B, a Unix socket to a blocking client.  This process
sends each 4 KiB message with ``sendall`` and keeps at most W unacknowledged; the far client
reads each whole message and acks it with 1 byte.  The ratio is what fabricd's work costs on
top of the hops any daemon per node pays.

Second baseline, kept so earlier runs stay comparable: the raw pair of benchmark (b) -- two
processes, one TCP connection on 127.0.0.1, both on uvloop, ``TCP_NODELAY``; the sender writes
each 4 KiB message with ``transport.writelines`` and keeps at most W unacknowledged; the
receiver reads with a ``BufferedProtocol`` straight into a preallocated memfd buffer and acks
*each* message with 1 byte.

Why this is a fair comparison:

* all three keep at most W messages that the receiver has not confirmed, and each message is
  confirmed on its own: the baselines' 1-byte ack per message against the DONE that ends each
  fabricd send (``send`` returns once the receiver has all of it);
* every sample ends when the sender knows the receiver has all N messages: a baseline's at the
  last ack, the fabricd one at rank 1's end-of-sample message.  That end signal costs fabricd
  one more one-way trip per sample (under 0.5% of a sample of 500 messages), and it keeps the
  figure honest when ``send`` returns before delivery (``wait="sent"``): the sample still lasts
  until rank 1 has every byte;
* samples alternate (raw, hop floor, fabricd) so all three see the same background load, each
  side after a warm-up batch; fabricd and the raw pair send from rank 0's shared-memory array.

Rows: W = 1 (each message waits for the previous one's confirmation: the one-way time plus the
confirmation), W = 8 (a message rate with the round trips overlapped), and W = 8 with fabricd's
sends done once the daemon has a copy (``wait="sent"``; the baselines as at W = 8).  Reported:
messages per second and microseconds per message (sample time / N, median over samples), the
spread ((max - min) / median of the samples), fabricd's time over the raw pair's, and the ratio
fabricd time / hop floor time per message.  Target (issue 22, item 5): at most 3x the hop floor,
judged on every row.

Run alone: ``python -m bench.rate [--quick]``.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import hopfloor, ranks
from bench.report import (
    Column,
    KiB,
    Progress,
    Row,
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
    from collections.abc import Callable, Sequence

NBYTES = 4 * KiB
#: (window, wait) of each row: sends finished on delivery, and on the daemon's copy
MODES = [(1, "delivered"), (8, "delivered"), (8, "sent")]
TARGET_RATIO = 3.0
#: the three sides and their headings, in the order their samples alternate
SIDES = {"raw": "raw", "floor": "hop floor", "fabricd": "fabricd"}


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


def _alternate(
    sides: dict[str, Callable[[int], float]], warm: int, messages: int, samples: int
) -> dict[str, list[float]]:
    """A warm-up sample of each side, then ``samples`` rounds of one sample per side, in turn;
    seconds per message of each sample."""
    for sample in sides.values():
        sample(warm)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(samples):
        for side, sample in sides.items():
            times[side].append(sample(messages) / messages)
    return times


def _table(samples: int, messages: int) -> Table:
    return Table(
        name="rate",
        title=f"(h) {NBYTES // KiB} KiB one-way message rate between ranks on two daemons, "
        "against the hop floor (two do-nothing uvloop relays) and a raw uvloop pair (1-byte "
        "ack per message)",
        columns=[
            *(
                column
                for side, heading in SIDES.items()
                for column in (
                    Column(f"{side}_rate", f"{heading} msgs/s", 0),
                    Column(f"{side}_us", f"{heading} us/msg"),
                    Column(f"{side}_spread", f"{heading} spread"),
                )
            ),
            Column("vs_raw", "fabricd / raw"),
            Column("messages", "msgs/sample", 0),
        ],
        ratio="fabricd time per message / hop floor time per message (lower is better)",
        target=f"ratio <= {TARGET_RATIO:g} (every row)",
        settings={"samples": samples, "messages": messages, "modes": MODES},
    )


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """One row per window: raw, hop-floor and fabricd samples alternating."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    samples, messages = (3, 50) if quick else (9, 500)
    warm = messages // 5 + 1
    batches = [(w, k) for w, _ in MODES for k in [warm] + [messages] * samples]
    table = _table(samples, messages)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    progress("starting the raw receiver, the hop floor, 2 daemons and rank 1")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    total = sum(k for _, k in batches)
    raw_peer = spawn(ranks.raw_receiver, child, [(NBYTES, total)])
    try:
        with (
            hopfloor.hop_floor([(NBYTES, 1, total)]) as floor,
            LocalCluster(2) as cluster,
        ):
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
                        sides: dict[str, Callable[[int], float]] = {
                            "raw": functools.partial(raw.send, source.data, window=window),
                            "floor": functools.partial(
                                floor.end.send_acked, source.data, window=window
                            ),
                            "fabricd": functools.partial(
                                _fabric_sample, fab, source, done, window=window, wait=wait
                            ),
                        }
                        label = f"4 KiB, window {window}" + (", sent" if wait == "sent" else "")
                        _add(table, label, _alternate(sides, warm, messages, samples), messages)
                        progress(_summary(table.rows[-1]))
                finally:
                    raw.close()
            reap(fab_peer)
    except BaseException:
        raw_peer.terminate()
        raise
    reap(raw_peer)
    table.target_met = all(row.ratio <= TARGET_RATIO for row in table.rows)
    table.notes += [
        "window W: at most W messages the receiver has not confirmed, on every side; the "
        "baselines' receivers ack each message with 1 byte, a fabricd send completes on the "
        "receiver's DONE",
        "'sent': fabricd sends with wait=\"sent\" (done once the daemon copied the 4 KiB; at most "
        "W of those open, and eager_credit bytes unanswered at the receiver); the baselines as "
        "in window W",
        "each fabricd sample ends on rank 1's 0-byte end-of-sample message, each baseline sample "
        "on the last ack: all when the receiver has all N",
        "spread = (max - min) / median of the samples; the machine is shared",
    ]
    return table


def _summary(row: Row) -> str:
    """The progress line of one row."""
    times = ", ".join(
        f"{heading} {fmt_number(row.figures[f'{side}_us'])} us/msg"
        for side, heading in SIDES.items()
    )
    return f"{row.label}: {times}, ratio {fmt_number(row.ratio)}x"


def _add(table: Table, label: str, times: dict[str, list[float]], messages: int) -> None:
    """One row from each side's seconds per message."""
    figures: dict[str, float] = {"messages": messages}
    for side in SIDES:
        us = median(times[side]) * 1e6
        figures.update(
            {f"{side}_rate": 1e6 / us, f"{side}_us": us, f"{side}_spread": _spread(times[side])}
        )
    figures["vs_raw"] = figures["fabricd_us"] / figures["raw_us"]
    table.add(label, NBYTES, figures["fabricd_us"] / figures["floor_us"], **figures)


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("rate", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
