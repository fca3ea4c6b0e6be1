"""The network monitor: every node's available uplink and downlink bandwidth and RTT, as this
node knows them (MLfabric §4, §7).

Rules: the decisions of the monitor live here -- which figure wins, how readings become
figures, when a report goes out, which reports are refused, when figures are stale.  The
service (:mod:`fabricd.daemon.services.monitor`) reads the links and sends the frames.

Theory of operation.  MLfabric's scheduler plans transfers on a *star network*: each host has
an uplink and a downlink capacity, and the core is congestion-free (§4, §5; Fig. 4).  So a
node's figures are its own: ``up`` and ``down`` (bytes/s available now) and ``rtt`` (its
typical round trip to its peers).  Each node measures its own and reports them to every peer
every ``monitor_interval`` (the paper's t_lag, 0.2 s by default; 0 turns reports and sampling
off), so a scheduler on any daemon reads every node's figures from :meth:`Monitor.network`.
That is a report per peer per interval; past 33 nodes the interval stretches so that a node
sends at most :data:`REPORT_BUDGET` reports a second (:attr:`Settings.cadence` says why).

Where a node's own figure comes from, strongest first (the :class:`LinkFigures` ``source``):

1. ``"configured"``: the ``link_up_bps`` / ``link_down_bps`` setting, reported as is (no use
   subtracted: it states what the node's link gives fabricd, e.g. a tc shaping rate);
2. ``"measured"``: TCP_INFO delivery-rate samples of the node's links, through
   :mod:`~fabricd.engines.monitor.estimator` (capacity a windowed maximum of busy samples,
   available = capacity - the node's own use, at least a new flow's fair share).  Uplink
   samples come from the node's own sending links; downlink samples from its peers' reports,
   which carry the delivery rate their busy links *to* it showed (``paths``): the kernel
   measures delivery only at the sending end;
3. ``"default"``: nothing known: :data:`DEFAULT_BPS` (100 Gbit/s), a figure meaning
   *unknown*, chosen large so that a host nobody measured is never taken for the bottleneck.

An entry's ``source`` is the weaker of its up's and down's, so ``"default"`` says at least
one of the two is unknown.  ``rtt`` is the median smoothed RTT of the node's control links
(0.0: unknown).  ``age`` is how old the figures are: for this node, the time since its last
reading; for a peer, the age its report gave plus the time since it arrived (transit ignored);
``math.inf`` for a peer never heard from.

*Stale*: a peer whose figures are older than :data:`STALE_INTERVALS` cadences (it missed
three reports running: down, cut off, its monitor off, or its reports refused).  Its last
figures are kept -- a link's capacity does not change because its reports stopped, and the
default would make a slow host look fast -- and ``stale`` marks them in status and metrics;
:meth:`Monitor.stale` answers it for a scheduler.

Bounds: the table has one entry per node of the static fabric; a report carries at most
:data:`~fabricd.frames.monitor.MAX_PATHS` paths; every figure a report carries must be finite
and within :data:`MAX_BPS`, :data:`MAX_RTT`, :data:`MAX_AGE`, or the report is refused
(dropped and counted, nothing else changes).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from fabricd.engines.actions import Broadcast
from fabricd.engines.monitor.estimator import BUSY_BYTES, Direction
from fabricd.frames.monitor import MAX_PATHS, Report

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

#: what a figure nobody measured or configured is: 100 Gbit/s, meaning *unknown*
DEFAULT_BPS: Final = 12.5e9
#: the largest bandwidth a report may carry: 80 Tbit/s
MAX_BPS: Final = 1e13
#: the largest RTT a report may carry, seconds
MAX_RTT: Final = 60.0
#: the largest age a report may carry, seconds (a day)
MAX_AGE: Final = 86400.0
#: figures older than this many intervals are stale
STALE_INTERVALS: Final = 3
#: the MONITOR reports a node sends per second, to all its peers together, at most: the
#: interval stretches beyond ``monitor_interval`` once the fabric has more than 32 peers per
#: node (:attr:`Settings.cadence`)
REPORT_BUDGET: Final = 160.0
#: the capacity window, in intervals (2 s at the paper's t_lag: the lag §7 found harmless)
WINDOW_INTERVALS: Final = 10
#: where a figure came from, weakest first
SOURCES: Final = ("default", "measured", "configured")


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """One node's figures: available ``up`` and ``down`` bandwidth (bytes/s), ``rtt``
    (seconds), their ``age`` (seconds) and ``source`` (``"configured"``, ``"measured"`` or
    ``"default"``: the module docstring says what each means)."""

    up: float
    down: float
    rtt: float
    age: float
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PathSample:
    """One link's TCP_INFO at a reading: smoothed ``rtt`` (s), the last delivery-rate sample
    (bytes/s), whether it was app-limited, and the bytes acknowledged since the link opened."""

    rtt: float
    rate: float
    app_limited: bool
    acked: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerReading:
    """What this node's links to ``node`` show at a reading: the bytes sent and received over
    them since they opened (both channels), and each link's TCP_INFO by channel name
    (``"control"``, ``"data"``), where the transport has it."""

    node: int
    sent: int
    received: int
    paths: Mapping[str, PathSample] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The monitor's settings: this ``node`` of ``nodes``, the reporting ``interval`` (0:
    off), and the configured own figures (``None``: measure)."""

    node: int
    nodes: int
    interval: float = 0.2
    up: float | None = None
    down: float | None = None

    @property
    def cadence(self) -> float:
        """Seconds between two readings and two reports (0: off): ``interval``, stretched so
        that this node sends at most :data:`REPORT_BUDGET` reports a second in all.

        Every node reports to every peer, so a fabric's report traffic grows as the square of
        its size: at 1,000 nodes and 0.2 s, each daemon would send and receive 5,000 frames a
        second doing nothing else (docs/performance.md, "the mesh").  Past ``REPORT_BUDGET /
        interval + 1`` nodes (33 at 0.2 s) the figures age more between reports instead:
        MLfabric §7 found a lag of up to 2 s harmless, which this keeps up to 321 nodes.  Every
        node of a fabric has the same ``nodes`` and so the same cadence, which staleness
        relies on."""
        if not self.interval:
            return 0.0
        return max(self.interval, (self.nodes - 1) / REPORT_BUDGET)

    def __post_init__(self) -> None:
        if not 0 <= self.node < self.nodes:
            raise ValueError(f"node {self.node} is not in 0..{self.nodes - 1}")
        if not 0 <= self.interval <= MAX_RTT:
            raise ValueError(f"interval must be between 0 and {MAX_RTT} seconds")
        for figure in (self.up, self.down):
            if figure is not None and not 0 < figure <= MAX_BPS:
                raise ValueError(f"a configured figure must be in (0, {MAX_BPS:g}] bytes/s")


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorStatistics:
    """The monitor's counters."""

    readings: int
    reports_sent: int
    reports_received: int
    reports_refused: int


class Monitor:
    """Every node's figures, as this node knows them.  See the module docstring."""

    def __init__(self, settings: Settings, now: float) -> None:
        self.settings = settings
        self.stale_after = STALE_INTERVALS * settings.cadence
        window = WINDOW_INTERVALS * (settings.cadence or 1.0)
        self._up, self._down = Direction(window), Direction(window)
        self._rtt = 0.0
        self._read_at: float | None = None  #: when the links were last read
        #: per peer: (sent, received) at the last reading; per (peer, channel): bytes acked
        self._counted: dict[int, tuple[int, int]] = {}
        self._acked: dict[tuple[int, str], int] = {}
        #: busy delivery rates to each peer since the last report (a report's ``paths``)
        self._paths: dict[int, float] = {}
        #: per peer: its last report accepted, and when it arrived
        self._peers: dict[int, tuple[Report, float]] = {}
        self._due = now + settings.cadence if settings.cadence else None
        self._counts = {"readings": 0, "sent": 0, "received": 0, "refused": 0}

    # -- this node's links ------------------------------------------------------------------
    def read(self, readings: Iterable[PeerReading], now: float) -> None:
        """Take one reading of this node's links to its peers (those up now)."""
        elapsed = now - self._read_at if self._read_at is not None else 0.0
        sent = received = 0
        flows_up = flows_down = 0
        rtts: list[float] = []
        seen: set[int] = set()
        for reading in readings:
            if not 0 <= reading.node < self.settings.nodes or reading.node in seen:
                continue
            seen.add(reading.node)
            out, into = self._delta(reading)
            sent, received = sent + out, received + into
            flows_up += out >= BUSY_BYTES
            flows_down += into >= BUSY_BYTES
            self._sample_paths(reading, now, rtts)
        for node in set(self._counted) - seen:  # links gone: their counters start again
            del self._counted[node]
        self._acked = {key: n for key, n in self._acked.items() if key[0] in seen}
        if elapsed > 0:
            self._up.measured(sent / elapsed, flows_up)
            self._down.measured(received / elapsed, flows_down)
        self._rtt = statistics.median(rtts) if rtts else self._rtt
        self._read_at = now
        self._counts["readings"] += 1

    def _delta(self, reading: PeerReading) -> tuple[int, int]:
        """Bytes sent to and received from ``reading.node`` since the last reading (a counter
        that went back belongs to new links: all of it is new)."""
        before = self._counted.get(reading.node)
        self._counted[reading.node] = (reading.sent, reading.received)
        if before is None:
            return 0, 0  # the first reading of these links: no interval yet
        out = reading.sent - before[0] if reading.sent >= before[0] else reading.sent
        into = reading.received - before[1] if reading.received >= before[1] else reading.received
        return out, into

    def _sample_paths(self, reading: PeerReading, now: float, rtts: list[float]) -> None:
        """Busy delivery-rate samples of ``reading``'s links feed the uplink estimate and the
        next report's ``paths``; the control link's RTT joins ``rtts``."""
        for channel, path in reading.paths.items():
            key = (reading.node, channel)
            before = self._acked.get(key)
            self._acked[key] = path.acked
            if channel == "control" and path.rtt > 0:
                rtts.append(path.rtt)
            acked = path.acked - before if before is not None and path.acked >= before else 0
            if not 0 < path.rate <= MAX_BPS:
                continue  # no sample yet
            if not path.app_limited or acked >= BUSY_BYTES:
                self._up.sample(path.rate, now)
                if len(self._paths) < MAX_PATHS or reading.node in self._paths:
                    self._paths[reading.node] = max(path.rate, self._paths.get(reading.node, 0.0))

    def own(self, now: float) -> LinkFigures:
        """This node's figures now, by precedence (module docstring)."""
        up, up_source = self._figure(self.settings.up, self._up.available)
        down, down_source = self._figure(self.settings.down, self._down.available)
        age = now - self._read_at if self._read_at is not None else 0.0
        return LinkFigures(up, down, self._rtt, max(0.0, age), _weaker(up_source, down_source))

    def _figure(self, configured: float | None, measured: float | None) -> tuple[float, str]:
        if configured is not None:
            return configured, "configured"
        if measured is not None:
            return measured, "measured"
        return DEFAULT_BPS, "default"

    # -- reports ----------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When the next reading and report are due (``None``: the monitor is off)."""
        return self._due

    def on_timer(self, now: float) -> list[Broadcast]:
        """The interval passed: report this node's figures to every peer.  (The service reads
        the links, :meth:`read`, just before.)"""
        if self._due is None or now < self._due:
            return []
        self._due = max(self._due + self.settings.cadence, now)  # no burst after a stall
        own = self.own(now)
        paths = tuple(sorted(self._paths.items()))
        self._paths.clear()
        self._counts["sent"] += 1
        report = Report(
            up=own.up, down=own.down, rtt=own.rtt, age=own.age, source=own.source, paths=paths
        )
        return [Broadcast(frame=report)]

    def on_report(self, node: int, report: Report, now: float) -> str | None:
        """A peer's report: keep it, and take the paths to this node as downlink samples.

        Returns:
            ``None``, or why the report was refused (it changed nothing): log it.
        """
        problem = check_report(node, report, self.settings)
        if problem is not None:
            self._counts["refused"] += 1
            return problem
        self._counts["received"] += 1
        self._peers[node] = (report, now)
        for target, rate in report.paths:
            if target == self.settings.node:
                self._down.sample(rate, now)
        return None

    # -- the table --------------------------------------------------------------------------
    def network(self, now: float) -> dict[int, LinkFigures]:
        """Every node's figures (node id -> figures), this node's included."""
        table: dict[int, LinkFigures] = {}
        for node in range(self.settings.nodes):
            table[node] = self.own(now) if node == self.settings.node else self._peer(node, now)
        return table

    def _peer(self, node: int, now: float) -> LinkFigures:
        heard = self._peers.get(node)
        if heard is None:
            return LinkFigures(DEFAULT_BPS, DEFAULT_BPS, 0.0, math.inf, "default")
        report, at = heard
        age = report.age + max(0.0, now - at)
        return LinkFigures(report.up, report.down, report.rtt, age, report.source)

    def stale(self, figures: LinkFigures) -> bool:
        """Whether ``figures`` are older than :data:`STALE_INTERVALS` reports' time
        (:attr:`Settings.cadence`; with the monitor off, only a peer never heard from is)."""
        if not self.settings.cadence:
            return math.isinf(figures.age)
        return figures.age > self.stale_after

    def statistics(self) -> MonitorStatistics:
        counts = self._counts
        return MonitorStatistics(
            readings=counts["readings"],
            reports_sent=counts["sent"],
            reports_received=counts["received"],
            reports_refused=counts["refused"],
        )


def check_report(node: int, report: Report, settings: Settings) -> str | None:
    """Why ``node``'s ``report`` cannot be taken, or ``None`` when it can."""
    if node == settings.node or not 0 <= node < settings.nodes:
        return f"a report from node {node}, which is not a peer of node {settings.node}"
    for name, value, high in (
        ("up", report.up, MAX_BPS),
        ("down", report.down, MAX_BPS),
        ("rtt", report.rtt, MAX_RTT),
        ("age", report.age, MAX_AGE),
    ):
        if not 0 <= value <= high:  # (NaN fails every comparison)
            return f"{name} {value!r} is not in [0, {high:g}]"
    if report.source not in SOURCES:
        return f"source {report.source[:32]!r} is not one of {', '.join(SOURCES)}"
    for target, rate in report.paths:
        if not 0 <= target < settings.nodes or not 0 <= rate <= MAX_BPS:
            return f"path ({target}, {rate!r}) names no node of the fabric or no rate"
    return None


def _weaker(a: str, b: str) -> str:
    return a if SOURCES.index(a) <= SOURCES.index(b) else b
