"""(e) The event-loop stall when a client with many pending operations disconnects.

Two daemons on loopback (``LocalCluster(2)``).  Rank 1 of a job is a client of node 1 that does
nothing; rank 0, a client of node 0 in this process, posts N operations that wait, then closes
its connection.  Two cases:

* *own daemon*: N receives from rank 1, all on one tag (one long queue): node 0 abandons them;
* *remote daemon*: N sends to rank 1: node 1 holds N unmatched RTS, and node 0's CANCELs (one
  per send) reach node 1 after the disconnect, which withdraws them.

While the daemon that cleans up works, a control client asks it for its ``status`` back to
back, from a thread of this process.  A request waits for the event loop, so the longest round
trip after the disconnect, less the median round trip before it, is the longest *stall* of that
daemon's loop.  *Cleanup* is the time from the close until the daemon's status shows nothing
left, and *cleanup CPU* the CPU time the daemon's loop thread ran meanwhile
(``/proc/PID/schedstat``, in ns).  All three are also given per operation.

The ratio is cleanup CPU per operation against the same at the smallest N, measured in the same
run: 1x when the cleanup is O(1) per operation, 10x per 10-fold step for a scan per operation.
CPU time is the figure that holds still on a shared two-core machine: the stall and cleanup are
wall time, which the other daemon, this process and anything else running stretch (and a stall
of a few milliseconds is at the edge of what the probe resolves).  On the remote daemon the
CANCELs arrive over TCP in batches, each handled in one go, so its longest stall is one batch's.

The daemon's resident memory is read before the operations are posted, with all of them
pending, and after the cleanup: what CPython's allocator keeps of freed memory shows in the last.

Run alone: ``python -m bench.disconnect [--quick]``.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from bench.report import (
    Column,
    Extra,
    Progress,
    Table,
    fmt_number,
    median,
    quiet,
    rss,
    run_alone,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fabricd.client import Client

SIZES: Final = (1_000, 10_000, 100_000)
QUICK_SIZES: Final = (200, 2_000)
#: (label, operation rank 0 posts, the node that cleans up, the status field that counts)
CASES: Final = (
    ("own daemon", "recv", 0, "pending_ops"),
    ("remote daemon", "send", 1, "unexpected_messages"),
)
#: a wait longer than this means the benchmark is broken, not slow
WAIT: Final = 300.0


@dataclass(slots=True)
class Probe:
    """Asks one daemon for its status back to back, recording each round trip."""

    control: Client
    field_name: str
    samples: list[tuple[float, float, int]] = field(default_factory=list)  #: (start, rtt, count)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            count = int(self.control.status(timeout=WAIT)[self.field_name])
            self.samples.append((start, time.perf_counter() - start, count))

    def until(self, done: Callable[[int], bool]) -> float:
        """Wait until a status answered after now shows a count that is ``done``."""
        since = time.perf_counter()
        deadline = since + WAIT
        while time.perf_counter() < deadline:
            if any(start >= since and done(count) for start, _, count in self.samples[-5:]):
                return time.perf_counter()
            time.sleep(0.001)
        raise RuntimeError(f"the daemon's {self.field_name} did not settle in {WAIT:g}s")


@dataclass(frozen=True, slots=True)
class Outcome:
    idle: float  #: median status round trip before the close, seconds
    stall: float  #: longest round trip after the close, less ``idle``
    cleanup: float  #: close until a status showed nothing left
    post: float  #: seconds per operation to post them (until the daemon held them all)
    cpu: float  #: CPU seconds the cleaning daemon's loop thread ran from the close to the end
    held: float  #: the cleaning daemon's resident memory growth with everything pending, bytes
    kept: float  #: its resident memory growth once everything was cleaned up, bytes


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid``'s main thread (its event loop), in ns precision (schedstat)."""
    with open(f"/proc/{pid}/schedstat") as fh:
        return int(fh.read().split()[0]) / 1e9


def one_case(
    sockets: Sequence[str], pid: int, op: str, node: int, count_field: str, n: int
) -> Outcome:
    """Post ``n`` operations of kind ``op`` as rank 0, disconnect, watch node ``node`` (whose
    daemon is process ``pid``)."""
    from fabricd.client import connect

    job = f"bench-{uuid.uuid4().hex[:8]}"
    with (
        connect(job=job, rank=1, size=2, socket_path=sockets[1]) as idle_peer,
        connect(socket_path=sockets[node]) as control,
    ):
        idle_peer.array("bench-idle", (1,), "uint8")
        probe = Probe(control, count_field)
        poster = connect(job=job, rank=0, size=2, socket_path=sockets[0])
        try:
            array = poster.array("bench-pending", (1,), "uint8")
            _wait_for_route(sockets[0], job)
            rss_before = rss(pid)
            thread = threading.Thread(target=probe.run, name="bench-probe", daemon=True)
            thread.start()
            start = time.perf_counter()
            post = poster.p2p.send_async if op == "send" else poster.p2p.recv_async
            handles = [post(array, 1, 0) for _ in range(n)]
            posted = probe.until(lambda count: count >= n)
            time.sleep(0.05)  # round trips with everything held: the idle figure
            idle = median([rtt for begin, rtt, _ in probe.samples if begin > posted])
            rss_held = rss(pid)
            cpu = cpu_seconds(pid)
            closed = time.perf_counter()
            poster.close()
            cleaned = probe.until(lambda count: count == 0)
            cpu = cpu_seconds(pid) - cpu
            rss_kept = rss(pid)
        finally:
            poster.close()
            probe.stop.set()
        thread.join(WAIT)
        del handles
    after = [rtt for begin, rtt, _ in probe.samples if begin >= closed - idle]
    return Outcome(
        idle=idle,
        stall=max(0.0, max(after) - idle),
        cleanup=cleaned - closed,
        post=(posted - start) / n,
        cpu=cpu,
        held=rss_held - rss_before,
        kept=rss_kept - rss_before,
    )


def _wait_for_route(socket_path: str, job: str) -> None:
    """Node 0 knows where rank 1 lives (so sends are announced at once, not routed later)."""
    from fabricd.client import connect

    with connect(socket_path=socket_path) as zero:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            ranks = zero.status().get("ranks", [])
            if any(r.get("job") == job and r.get("rank") == 1 for r in ranks):
                return
            time.sleep(0.01)
    raise RuntimeError("node 0 never learned where rank 1 is")


def run(quick: bool = False, progress: Progress = quiet, sizes: Sequence[int] = ()) -> Table:
    """Measure each case in ``CASES`` for each size, smallest first."""
    from fabricd.daemon.launcher import LocalCluster

    sizes = list(sizes or (QUICK_SIZES if quick else SIZES))
    bound = 2 * max(sizes)
    settings = {
        "max_ops_per_client": bound,
        "max_ops_per_job": bound,
        "max_unmatched_rts_per_peer": bound,
        "route_timeout": 600.0,
        "suspect_after": 60.0,
        "down_after": 120.0,
    }
    table = Table(
        name="disconnect",
        title="(e) event-loop stall when a client with N pending operations disconnects",
        columns=[
            Column("pending", "N", 0),
            Column("stall_ms", "stall ms"),
            Column("stall_us", "stall us/op"),
            Column("cleanup_ms", "cleanup ms"),
            Column("cleanup_us", "cleanup us/op"),
            Column("cpu_us", "cleanup CPU us/op"),
            Column("post_us", "post us/op"),
            Column("held_mb", "RSS held MB"),
            Column("kept_mb", "RSS kept MB"),
        ],
        ratio=f"cleanup CPU per operation / the same at N={sizes[0]} (1x = linear)",
        settings={"sizes": sizes, **settings},
    )
    progress(f"starting 2 daemons; sizes {', '.join(map(str, sizes))}")
    with LocalCluster(2, settings=settings) as cluster:
        cluster.wait_connected()
        sockets = [node.socket_path for node in cluster.nodes]
        for label, op, node, count_field in CASES:
            base: float | None = None
            idles = []
            for n in sizes:
                got = one_case(sockets, cluster.nodes[node].pid, op, node, count_field, n)
                per_op = got.cpu / n
                base = base if base is not None else per_op
                ratio = per_op / base if base > 0 else float("nan")
                idles.append(got.idle)
                table.add(
                    f"{label}, {n}",
                    n,
                    ratio,
                    pending=n,
                    stall_ms=got.stall * 1e3,
                    stall_us=got.stall / n * 1e6,
                    cleanup_ms=got.cleanup * 1e3,
                    cleanup_us=got.cleanup / n * 1e6,
                    cpu_us=per_op * 1e6,
                    held_mb=got.held / 1e6,
                    kept_mb=got.kept / 1e6,
                    post_us=got.post * 1e6,
                )
                progress(
                    f"{label}, {n}: stall {fmt_number(got.stall * 1e3)} ms "
                    f"({fmt_number(got.stall / n * 1e6)} us/op), cleanup "
                    f"{fmt_number(got.cleanup * 1e3)} ms, CPU {fmt_number(per_op * 1e6)} "
                    f"us/op, RSS kept {fmt_number(got.kept / 1e6)} MB, ratio {fmt_number(ratio)}x"
                )
            table.extras.append(
                Extra(
                    f"{label}: status round trip before the close",
                    {"median": median(idles) * 1e3},
                    "ms",
                )
            )
    table.notes.append(
        "own daemon: N receives on one tag abandoned at once; remote daemon: N unmatched RTS "
        "withdrawn by the CANCELs of the sender's daemon (their stall is the longest batch)"
    )
    table.notes.append(
        "stall = longest status round trip after the close less the median before it; "
        "cleanup = close until status shows nothing left"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("disconnect", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
