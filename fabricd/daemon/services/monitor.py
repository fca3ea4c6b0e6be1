"""The network monitor's service: reads this node's links every ``monitor_interval``, reports
the node's figures to its peers in MONITOR frames, and keeps every node's figures for
whoever schedules (MLfabric §4, §7).

Drives :mod:`fabricd.engines.monitor.table`.  On each tick it gathers, per peer that has
links, the byte counters of both links and their TCP_INFO (``Link.path_info``,
:mod:`fabricd.transports.tcpinfo`; absent where a transport has none), hands them to the
engine, and broadcasts the report the engine returns.  A MONITOR frame goes to the engine; one
it refuses is logged (rate-limited) and counted as ``monitor_reports_refused``, and nothing
else happens: the peer's links stay up and its previous figures stay.

The node builds this service itself, beside peering, because :meth:`Host.network` reads it:
a scheduler on any daemon finds every node's figures there, whichever services run.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import gauge
from fabricd.daemon.service import BaseService
from fabricd.engines.monitor.table import Monitor, PathSample, PeerReading, Settings
from fabricd.frames.monitor import Report
from fabricd.wire import Kind, Meta

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host
    from fabricd.engines.link.handshake import Channel
    from fabricd.engines.monitor.table import LinkFigures
    from fabricd.frames.registry import PeerFrame
    from fabricd.transports.base import Link

log = logging.getLogger("fabricd.monitor")
#: peers' reports cause these lines: rate-limited
remote_log = RateLimitedLog(log)


class MonitorService(BaseService):
    """Every node's up/down bandwidth and RTT (see the module docstring).

    Args:
        host: the node.
        links: every current link by (node, channel) (the node's table, read at each tick).
    """

    name = "monitor"
    kinds = frozenset({Kind.MONITOR})

    def __init__(self, host: Host, links: Callable[[], Mapping[tuple[int, Channel], Link]]) -> None:
        cfg = host.config
        self.host = host
        self._links = links
        settings = Settings(
            node=cfg.node_id,
            nodes=len(cfg.nodes),
            interval=cfg.monitor_interval,
            up=cfg.link_up_bps or None,
            down=cfg.link_down_bps or None,
        )
        self.engine = Monitor(settings, host.now())

    def network(self, now: float) -> dict[int, LinkFigures]:
        """Every node's figures, this node's included (:meth:`Monitor.network`)."""
        return self.engine.network(now)

    # -- the node's hooks -------------------------------------------------------------------
    def on_frame(self, node: int, frame: PeerFrame, now: float) -> None:
        assert isinstance(frame, Report)
        problem = self.engine.on_report(node, frame, now)
        if problem is not None:
            remote_log.warning(
                "refused report", "refused a MONITOR report from node %d: %s", node, problem
            )

    def next_deadline(self) -> float | None:
        return self.engine.next_deadline()

    def on_timer(self, now: float) -> None:
        self.engine.read(self._readings(), now)
        for action in self.engine.on_timer(now):
            self.host.broadcast(action.frame)

    def _readings(self) -> list[PeerReading]:
        """What each peer's current links show now: bytes moved, TCP_INFO."""
        by_node: dict[int, list[tuple[Channel, Link]]] = {}
        for (node, channel), link in self._links().items():
            by_node.setdefault(node, []).append((channel, link))
        readings = []
        for node, links in by_node.items():
            sent = received = 0
            paths: dict[str, PathSample] = {}
            for channel, link in links:
                stats = link.statistics()
                sent, received = sent + stats.bytes_sent, received + stats.bytes_received
                info = link.path_info()
                if info is not None:
                    paths[str(channel)] = PathSample(
                        rtt=info.rtt,
                        rate=info.delivery_rate,
                        app_limited=info.app_limited,
                        acked=info.bytes_acked,
                    )
            readings.append(PeerReading(node=node, sent=sent, received=received, paths=paths))
        return readings

    # -- status and metrics -----------------------------------------------------------------
    def rows(self, now: float) -> list[Meta]:
        """One row per node: ``node``, ``up``, ``down``, ``rtt``, ``age`` (``None``: never
        heard from), ``source``, ``stale``."""
        return [
            {
                "node": node,
                "up": figures.up,
                "down": figures.down,
                "rtt": figures.rtt,
                "age": None if math.isinf(figures.age) else figures.age,
                "source": figures.source,
                "stale": self.engine.stale(figures),
            }
            for node, figures in self.network(now).items()
        ]

    def statistics(self) -> Meta:
        stats = self.engine.statistics()
        return {
            "network": self.rows(self.host.now()),
            "monitor_interval": self.engine.settings.interval,
            "monitor_cadence": self.engine.settings.cadence,
            "counters": {
                "monitor_readings": stats.readings,
                "monitor_reports_sent": stats.reports_sent,
                "monitor_reports_received": stats.reports_received,
                "monitor_reports_refused": stats.reports_refused,
            },
        }

    def metrics(self) -> Iterable[Metric]:
        now = self.host.now()
        table = self.network(now)
        yield gauge(
            "fabricd_link_up_bytes_per_second",
            "Available uplink bandwidth of each node, as this node's network monitor knows it",
            [({"node": str(n)}, f.up) for n, f in table.items()],
        )
        yield gauge(
            "fabricd_link_down_bytes_per_second",
            "Available downlink bandwidth of each node, as this node's network monitor knows it",
            [({"node": str(n)}, f.down) for n, f in table.items()],
        )
        yield gauge(
            "fabricd_link_rtt_seconds",
            "Typical round trip of each node to its peers (0: unknown)",
            [({"node": str(n)}, f.rtt) for n, f in table.items()],
        )
        yield gauge(
            "fabricd_link_figures_age_seconds",
            "How old each node's figures are (+Inf: never heard from)",
            [({"node": str(n)}, f.age) for n, f in table.items()],
        )
        yield gauge(
            "fabricd_link_figures_stale",
            "1 where a node's figures are stale (older than 3 reports' time, monitor_cadence)",
            [({"node": str(n)}, float(self.engine.stale(f))) for n, f in table.items()],
        )
