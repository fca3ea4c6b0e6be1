"""The node's own metric families, read from the daemon's counters when it is scraped.

:class:`DaemonCollector` is the one collector a daemon's registry holds.  It reads what the node
owns (links, client sessions, segments, the client socket's refusals, the peers engine's
counters) and asks every service for its own families through
:meth:`~fabricd.daemon.service.Service.metrics`.  It runs on the event loop (the endpoint and
``status`` both call it there), so it reads the live tables without a lock.  The names and their
meaning are listed in docs/operations.md, "Metrics".
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabricd.daemon import status_counters
from fabricd.daemon.metrics import counter, gauge, histogram
from fabricd.engines.link.peers import PeerState
from fabricd.frames.registry import PEER_KINDS
from fabricd.wire import PROTOCOL_VERSION

#: the peer frame kinds, in wire order
PEER_KINDS_SORTED = sorted(PEER_KINDS)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.node import Daemon

log = logging.getLogger("fabricd.metrics")


class DaemonCollector:
    """Builds every family of one daemon at each scrape (a prometheus-client collector)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        yield from self._identity()
        yield from self._peers()
        yield from self._links()
        yield from self._refusals()
        yield from self._clients()
        yield from self._budget()
        yield from self._services()

    def _identity(self) -> Iterator[Metric]:
        d = self.daemon
        labels = {
            "node": str(d.config.node_id),
            "transport": d.transport.name,
            "version": str(PROTOCOL_VERSION),
        }
        yield gauge(
            "fabricd_info",
            "This daemon: its node id, transport and protocol version.",
            [(labels, 1)],
        )
        yield gauge(
            "fabricd_incarnation", "This daemon's incarnation (start, ns).", [({}, d.incarnation)]
        )
        yield gauge(
            "fabricd_start_time_seconds", "When this daemon started (Unix time).", [({}, d.started)]
        )
        stats = d.stats
        yield histogram(
            "fabricd_loop_lag_seconds",
            "How late the event loop's timers fired.",
            [({}, stats.loop_lag)],
        )
        yield counter(
            "fabricd_client_requests",
            "Client requests received, by op.",
            (({"op": op}, n) for op, n in sorted(stats.requests.items())),
        )

    def _peers(self) -> Iterator[Metric]:
        infos = self.daemon.peering.engine.peers(self.daemon.now())
        yield gauge(
            "fabricd_peer_up",
            "1 if the peer is up (both links admitted and heard from), else 0.",
            (({"peer": str(p.node)}, int(p.state is PeerState.UP)) for p in infos),
        )
        yield gauge(
            "fabricd_peer_state",
            "1 for the state each peer is in, 0 for the others.",
            (
                ({"peer": str(p.node), "state": state.value}, int(p.state is state))
                for p in infos
                for state in PeerState
            ),
        )
        yield gauge(
            "fabricd_peer_incarnation",
            "The peer's admitted incarnation (its start, ns); changes when it restarts.",
            (({"peer": str(p.node)}, p.incarnation) for p in infos if p.incarnation is not None),
        )
        yield gauge(
            "fabricd_peer_silent_seconds",
            "Seconds since the peer was last heard from.",
            (({"peer": str(p.node)}, p.silent_for) for p in infos if p.silent_for is not None),
        )
        yield gauge(
            "fabricd_peer_state_seconds",
            "Seconds the peer has been in its current state.",
            (({"peer": str(p.node)}, p.state_for) for p in infos),
        )
        dials = self.daemon.peering.engine.statistics().dial_attempts
        yield gauge(
            "fabricd_peer_dial_failures",
            "Dials of the peer that failed since the last one that succeeded.",
            (({"peer": str(node)}, n) for node, n in sorted(dials.items())),
        )

    def _links(self) -> Iterator[Metric]:
        current = {key: link.statistics() for key, link in self.daemon.links.items()}
        totals = sorted(self.daemon.stats.links.totals(current).items())
        rows = [({"peer": str(node), "channel": ch.value}, s) for (node, ch), s in totals]
        yield counter(
            "fabricd_peer_sent_bytes",
            "Bytes sent to each peer per channel (frames whole), over every link it had.",
            ((labels, s.bytes_sent) for labels, s in rows),
        )
        yield counter(
            "fabricd_peer_received_bytes",
            "Bytes received from each peer per channel, over every link it had.",
            ((labels, s.bytes_received) for labels, s in rows),
        )
        yield counter(
            "fabricd_peer_sent_frames",
            "Frames sent to each peer per channel.",
            ((labels, s.frames_sent) for labels, s in rows),
        )
        yield counter(
            "fabricd_peer_received_frames",
            "Frames received from each peer per channel.",
            ((labels, s.frames_received) for labels, s in rows),
        )
        yield counter(
            "fabricd_peer_messages_received",
            "Authenticated peer frames handed to a service, by kind.",
            (({"kind": k.name}, self.daemon.stats.frames_received[k]) for k in PEER_KINDS_SORTED),
        )

    def _refusals(self) -> Iterator[Metric]:
        peering = self.daemon.peering
        engine = peering.engine.statistics()
        gate = engine.gate
        other = engine.handshakes_refused - gate.unknown_host - gate.evicted
        yield counter(
            "fabricd_handshake_failures",
            "Links closed before their handshake succeeded, by reason: unknown_host (not a "
            "configured node's), evicted (a newer link from the same host needed the slot), "
            "failed (wrong secret, malformed, or past handshake_timeout).",
            [
                ({"reason": "unknown_host"}, gate.unknown_host),
                ({"reason": "evicted"}, gate.evicted),
                ({"reason": "failed"}, other),
            ],
        )
        counters = peering.statistics().get("counters", {})
        yield counter(
            "fabricd_links_refused",
            "Links refused for who they are: authenticated ones (an older incarnation, a data "
            "link before its control link, a second one), and under etcd a name or incarnation "
            "the view does not have (on its HELLO, before authentication, or after).",
            [({}, engine.links_refused)],
        )
        yield counter(
            "fabricd_peer_resets", "Peers reset (both links closed).", [({}, engine.resets)]
        )
        yield counter(
            "fabricd_integrity_failures",
            "Frames whose sequence number or MAC was wrong (the link was closed).",
            [({}, counters.get("integrity_failures", 0))],
        )

    def _clients(self) -> Iterator[Metric]:
        d = self.daemon
        yield gauge("fabricd_clients", "Clients connected now.", [({}, len(d.sessions))])
        ipc = d.ipc.counters()
        prefix = "refused_clients_"
        yield counter(
            "fabricd_clients_refused",
            "Client connections refused, by reason.",
            (
                ({"reason": key.removeprefix(prefix)}, n)
                for key, n in sorted(ipc.items())
                if key.startswith(prefix)
            ),
        )
        gauges = d.segments.gauges()
        yield gauge(
            "fabricd_segments", "Segments clients attached, now.", [({}, gauges["segments"])]
        )
        yield gauge(
            "fabricd_mapped_bytes",
            "Bytes of client segments mapped, now.",
            [({}, gauges["mapped_bytes"])],
        )
        prefix = "attach_refused_"
        yield counter(
            "fabricd_attach_refused",
            "Segment attaches refused at a cap, by the cap.",
            (
                ({"reason": key.removeprefix(prefix)}, n)
                for key, n in sorted(d.segments.counters().items())
                if key.startswith(prefix)
            ),
        )

    def _budget(self) -> Iterator[Metric]:
        budget = self.daemon.budget
        yield gauge(
            "fabricd_held_bytes",
            "Bytes the daemon holds on behalf of each uid's jobs, now.",
            (({"uid": str(uid)}, n) for uid, n in sorted(budget.held_by_uid().items())),
        )
        yield gauge(
            "fabricd_held_bytes_limit",
            "The byte budgets: max_held_bytes_per_uid and max_held_bytes_per_job in force.",
            [({"per": "uid"}, budget.per_uid), ({"per": "job"}, budget.per_job)],
        )

    def _services(self) -> Iterator[Metric]:
        """Each service's own families, and every counter of ``status`` under one family."""
        d = self.daemon
        parts = d.own_counters()
        families: dict[str, Metric] = {}  # two services may add samples to one family
        for service in d.services:
            try:
                for family in service.metrics():
                    known = families.setdefault(family.name, family)
                    if known is not family:
                        known.samples.extend(family.samples)
                parts.append(status_counters.service_counters(service, service.statistics()))
            except Exception:  # a bug in one service must not cost the scrape the rest
                log.exception("service %r failed in metrics (a bug); scrape goes on", service.name)
        yield from families.values()
        every = status_counters.merge(parts)  # summed by name, as status does
        yield counter(
            "fabricd_status_counters",
            "Every counter fabricctl status shows, by its name there (the same numbers).",
            (({"counter": name}, n) for name, n in sorted(every.items())),
        )
