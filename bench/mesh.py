"""(n) What the full mesh costs each daemon as the fabric grows (issue 26, item 5).

Every pair of daemons shares two links, control and data (:mod:`fabricd.daemon.services.peering`),
so a daemon of an ``n``-node fabric holds ``2 (n - 1)`` TCP connections, heartbeats each peer
every ``heartbeat_interval`` and keeps a peer table row for each.  This benchmark starts ``n``
daemons on loopback (``LocalCluster(n)``, default settings: a heartbeat a second), waits until
every daemon sees every other one up, lets the mesh settle, and measures over a window with no
client traffic at all, per daemon (the median over the daemons):

* *links*: the daemon's established TCP connections (``/proc/PID/fd``, ``/proc/PID/net/tcp``);
* *RSS*: its resident memory, and *RSS/link*, what each link adds to a one-node daemon's RSS
  (measured in the same run, the baseline);
* *idle CPU*: the share of a core it spends doing nothing but keeping the mesh (heartbeats,
  liveness, its timers), from ``/proc/PID/task/*/schedstat``;
* *sent*: the bytes and frames it sends per second (``fabricd_peer_sent_*`` of its metrics).

A fabric larger than :data:`DEFAULT_UP_TO` nodes is run *sparse* (:data:`SPARSE`: a heartbeat
every 4 s, the monitor off): at the defaults, 128 daemons would need about six cores for their
idle traffic alone, and on two cores their heartbeats would arrive late, peers would go
suspect and the figures would measure a saturated machine.  Its links and RSS are the mesh's
whatever the traffic; its traffic and CPU rows are the sparse settings', and the extrapolation
takes traffic and CPU per peer from the largest fabric run at the defaults.

The ratio is the per-daemon RSS against the one-node daemon's. From the largest ``n`` measured
the table extrapolates, linearly per link and per peer, what a daemon of a 1,000-node fabric
would hold: the figures docs/performance.md gives per node.  The machine runs every daemon on
its two cores, so idle CPU is an upper bound (a busy machine delays timers, not adds work); RSS
and traffic do not depend on it.

Run alone: ``python -m bench.mesh [--quick]``.
"""

from __future__ import annotations

import http.client
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from bench.report import Column, Extra, Progress, Table, cpu_seconds, quiet, rss, run_alone

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.daemon.launcher import NodeProcess

SIZES: Final = (8, 32, 128)
QUICK_SIZES: Final = (4, 8)
#: seconds of idle mesh measured, after SETTLE seconds of settling
WINDOW: Final = 20.0
QUICK_WINDOW: Final = 4.0
SETTLE: Final = 3.0
#: the fabric the extrapolation is for
EXTRAPOLATE_TO: Final = 1000
#: the largest fabric run at the default settings; larger ones run with SPARSE
DEFAULT_UP_TO: Final = 64
SPARSE: Final = {
    "heartbeat_interval": 4.0,
    "suspect_after": 30.0,
    "down_after": 120.0,
    "monitor_interval": 0.0,
}
#: a connection's state in /proc/net/tcp: established
ESTABLISHED: Final = "01"
#: seconds a cluster may take to start and to form its mesh (128 daemons on two cores: minutes)
START_WITHIN: Final = 600.0


@dataclass(frozen=True, slots=True)
class Daemon:
    """One daemon's figures over the window (rates per second)."""

    links: int
    rss: int
    cpu: float  #: share of one core
    sent_bytes: float
    sent_frames: float
    heartbeats: float  #: HEARTBEAT frames received
    reports: float  #: MONITOR frames received


def tcp_connections(pid: int) -> int:
    """How many established TCP connections ``pid`` holds (its listeners left out)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # (closed meanwhile)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                next(fh)
                count += sum(
                    1 for line in fh if line.split()[9] in inodes and line.split()[3] == ESTABLISHED
                )
        except FileNotFoundError:
            continue
    return count


#: the metrics this benchmark reads, each summed over its labels
SENT_BYTES: Final = "fabricd_peer_sent_bytes_total"
SENT_FRAMES: Final = "fabricd_peer_sent_frames_total"
HEARTBEATS: Final = 'fabricd_peer_messages_received_total{kind="HEARTBEAT"}'
REPORTS: Final = 'fabricd_peer_messages_received_total{kind="MONITOR"}'
#: tries at a daemon's metrics: on a saturated machine one may miss its 5 s request deadline
SCRAPE_TRIES: Final = 5


def counters(node: NodeProcess) -> dict[str, float]:
    """The daemon's counters so far: bytes and frames it sent its peers (every channel, every
    peer), HEARTBEAT and MONITOR frames it received."""
    for attempt in range(SCRAPE_TRIES):
        try:
            with urllib.request.urlopen(node.metrics_url, timeout=60) as response:
                text = response.read().decode()
            break
        except (OSError, http.client.HTTPException):  # (a daemon too busy to answer in 5 s)
            if attempt == SCRAPE_TRIES - 1:
                raise
            time.sleep(1.0)
    totals = dict.fromkeys((SENT_BYTES, SENT_FRAMES, HEARTBEATS, REPORTS), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for key in totals:
            if name == key or (name.split("{", 1)[0] == key and "{" not in key):
                totals[key] += float(value)
    return totals


def measure(size: int, window: float, progress: Progress) -> list[Daemon]:
    """Start ``size`` daemons, form the mesh, and measure each over ``window`` idle seconds."""
    from fabricd.daemon.launcher import LocalCluster

    started = time.monotonic()
    cluster = LocalCluster(size, settings=dict(SPARSE) if size > DEFAULT_UP_TO else {})
    cluster.start(timeout=START_WITHIN)
    try:
        cluster.wait_connected(timeout=START_WITHIN)
        progress(f"{size} daemons: meshed in {time.monotonic() - started:.0f} s")
        time.sleep(SETTLE)
        before = [(cpu_seconds(n.pid), counters(n)) for n in cluster.nodes]
        began = time.monotonic()
        time.sleep(window)
        after = [(cpu_seconds(n.pid), counters(n)) for n in cluster.nodes]
        elapsed = time.monotonic() - began
        daemons = []
        for node, (cpu0, was), (cpu1, now) in zip(cluster.nodes, before, after, strict=True):

            def rate(key: str, was: dict[str, float] = was, now: dict[str, float] = now) -> float:
                return (now[key] - was[key]) / elapsed

            daemons.append(
                Daemon(
                    links=tcp_connections(node.pid),
                    rss=rss(node.pid),
                    cpu=(cpu1 - cpu0) / elapsed,
                    sent_bytes=rate(SENT_BYTES),
                    sent_frames=rate(SENT_FRAMES),
                    heartbeats=rate(HEARTBEATS),
                    reports=rate(REPORTS),
                )
            )
    finally:
        cluster.stop()
    return daemons


def run(quick: bool = False, progress: Progress = quiet, sizes: Sequence[int] = ()) -> Table:
    """Measure one daemon alone (the baseline), then each size in turn, smallest first."""
    sizes = list(sizes or (QUICK_SIZES if quick else SIZES))
    window = QUICK_WINDOW if quick else WINDOW
    table = Table(
        name="mesh",
        title="(n) the full mesh's cost per daemon, idle (median over the daemons)",
        columns=[
            Column("links", "links", 0),
            Column("rss_mb", "RSS MB"),
            Column("rss_per_link_kb", "RSS/link KB"),
            Column("cpu_pct", "idle CPU %"),
            Column("sent_kb_s", "sent KB/s"),
            Column("frames_s", "frames/s"),
            Column("bytes_per_peer_s", "B/s per peer"),
        ],
        ratio="RSS per daemon / RSS of a one-node daemon (same run)",
        settings={"window_s": window, "sizes": ",".join(map(str, sizes))},
    )
    alone = measure(1, window, progress)[0]
    table.add("1 node", 0, 1.0, links=0, rss_mb=alone.rss / 2**20, cpu_pct=alone.cpu * 100)
    per_link = 0.0
    model: dict[str, float] = {}
    for size in sizes:
        daemons = measure(size, window, progress)
        memory = _median([d.rss for d in daemons])
        links = _median([d.links for d in daemons])
        per_link = (memory - alone.rss) / max(links, 1)
        sparse = size > DEFAULT_UP_TO
        if not sparse:
            model = _per_peer(daemons, alone, size)
        table.add(
            f"{size} nodes" + (" (sparse)" if sparse else ""),
            0,
            memory / alone.rss,
            links=links,
            rss_mb=memory / 2**20,
            rss_per_link_kb=per_link / 1024,
            cpu_pct=_median([d.cpu for d in daemons]) * 100,
            sent_kb_s=_median([d.sent_bytes for d in daemons]) / 1024,
            frames_s=_median([d.sent_frames for d in daemons]),
            bytes_per_peer_s=_median([d.sent_bytes for d in daemons]) / (size - 1),
        )
    if model:
        table.extras.append(_extrapolated(model, alone, per_link, sizes[-1]))
    table.notes.append(
        "links: established TCP connections, two per peer (control and data); idle CPU is an "
        "upper bound on a two-core machine running every daemon"
    )
    return table


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _per_peer(daemons: Sequence[Daemon], alone: Daemon, size: int) -> dict[str, float]:
    """What each peer costs a daemon at the defaults: heartbeats and reports a second, bytes a
    frame, and CPU per frame sent or received."""
    frames = _median([d.sent_frames for d in daemons])
    return {
        "size": size,
        "heartbeats": _median([d.heartbeats for d in daemons]) / (size - 1),
        "reports": _median([d.reports for d in daemons]) / (size - 1),
        "bytes_per_frame": _median([d.sent_bytes for d in daemons]) / max(frames, 1e-9),
        "cpu_per_frame": (_median([d.cpu for d in daemons]) - alone.cpu) / max(2 * frames, 1e-9),
    }


def _extrapolated(model: dict[str, float], alone: Daemon, per_link: float, largest: int) -> Extra:
    """A daemon of an :data:`EXTRAPOLATE_TO`-node fabric at the defaults: a heartbeat per peer
    as measured, reports per peer as measured up to the monitor's budget
    (:data:`~fabricd.engines.monitor.table.REPORT_BUDGET`), and as many received as sent."""
    from fabricd.engines.monitor.table import REPORT_BUDGET

    peers = EXTRAPOLATE_TO - 1
    frames = model["heartbeats"] * peers + min(model["reports"] * peers, REPORT_BUDGET)
    return Extra(
        f"a daemon of a {EXTRAPOLATE_TO}-node fabric at the defaults, extrapolated (RSS per "
        f"link from {largest} nodes, frames and CPU per frame from {model['size']:.0f})",
        {
            "links": 2 * peers,
            "rss_mb": (alone.rss + 2 * peers * per_link) / 2**20,
            "frames_s": frames,
            "sent_kb_s": frames * model["bytes_per_frame"] / 1024,
            "idle_cpu_pct": (alone.cpu + 2 * frames * model["cpu_per_frame"]) * 100,
        },
        "per daemon",
    )


if __name__ == "__main__":
    sys.exit(run_alone("mesh", __doc__, run, sys.argv[1:]))
