"""What the ``ps`` service shows of its models: status rows, stall rows (and the log line of
each call that stalls, written once) and metrics.

Reads the :class:`~fabricd.engines.ps.node.PSNode` engine's models and the service's calls;
changes nothing but the totals kept of models gone from this node (counters never go back) and
the calls' stall deadlines (:class:`~fabricd.daemon.services.jobs.StallWatch`, which the
service tells when a call opens and ends).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import Histogram, OperationStats, counter, gauge, histogram
from fabricd.daemon.services.jobs import StallWatch
from fabricd.daemon.stalls import call_line
from fabricd.engines.ps.consistency import DELAY_BUCKETS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.membership import Membership
    from fabricd.engines.ps.models import Key, Model, WorkerSide
    from fabricd.engines.ps.node import PSNode
    from fabricd.engines.ps.scheduler import SchedulerStatistics
    from fabricd.engines.ps.server import ShardServer
    from fabricd.engines.ps.shard_actions import ShardStatistics
    from fabricd.engines.ps.worker import Worker, WorkerStatistics
    from fabricd.wire import Meta

#: stalled calls: each is logged once, but a job's workers may stall at once
stall_log = RateLimitedLog(logging.getLogger("fabricd.ps"))


@dataclass(slots=True, kw_only=True)
class Call:
    """A worker's push or pull the service answers: whom, since when."""

    session: ClientSession
    request: int
    started: float
    op: str


class PSStatus:
    """The rows and series of one node's parameter servers."""

    def __init__(
        self,
        *,
        name: str,
        host: Host,
        membership: Membership,
        engine: PSNode,
        calls: Mapping[tuple[Key, int], Call],
    ) -> None:
        self.name = name
        self.host = host
        self.membership = membership
        self.engine = engine
        self.calls = calls  #: (model, local worker rank) -> its open call (the service's)
        self.operations = OperationStats(name, kinds=["push", "pull"])
        #: what models gone from this node counted, kept so that counters never go back
        self._retired: Counter[str] = Counter()
        self._stalls: StallWatch[tuple[Key, int]] = StallWatch(host.config.stall_after)
        self._stalls_reported = 0  #: calls logged once as open past stall_after

    def retire(self, worker: Worker | None, server: ShardServer | None) -> None:
        """A local worker or shard closed: what it counted stays counted."""
        if worker is not None:
            self._retired += _totals([worker.statistics()], [])
        if server is not None and server.primary:
            self._retired += _totals([], [server.statistics()])

    def opened(self, place: tuple[Key, int], now: float) -> None:
        """A push or pull of local worker ``place`` opened: it counts as stalled (logged
        once) if it is still open ``stall_after`` later."""
        self._stalls.watch(place, now)

    def closed(self, place: tuple[Key, int]) -> None:
        """``place``'s call was answered, or its client left."""
        self._stalls.forget(place)

    def next_stall(self) -> float | None:
        return self._stalls.next_deadline()

    def log_stalls(self, now: float) -> None:
        """One log line for each call that became stalled (at most a tick's worth: the rest
        stay due), from its stall row, so the log and ``fabricctl stalls`` say the same."""
        for key, rank in self._stalls.due(now):
            model, call = self.engine.models.get(key), self.calls.get((key, rank))
            side = None if model is None else model.local_workers.get(rank)
            if model is not None and side is not None and call is not None:
                self._stalls_reported += 1
                row = self._row(key, model, rank, side, call, now)
                stall_log.warning("stalled call", "%s", call_line(row))

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Pushes and pulls open longer than ``stall_after``, saying which shards they wait
        for."""
        after = self.host.config.stall_after
        rows: list[Meta] = []
        for key, model in sorted(self.engine.models.items()):
            for rank, side in sorted(model.local_workers.items()):
                call = self.calls.get((key, rank))
                if call is None or now - call.started < after:
                    continue
                if limit is not None and len(rows) >= limit:
                    return rows
                row = self._row(key, model, rank, side, call, now)
                if keep is None or keep(row):  # (keep reads whose it is)
                    rows.append(row)
        return rows

    def _row(
        self, key: Key, model: Model, rank: int, side: WorkerSide, call: Call, now: float
    ) -> Meta:
        """The stall row of local worker ``rank``'s open ``call``: which shards it waits for."""
        job, name = key
        waiting = side.engine.waiting()
        targets = [model.target(s) for s in waiting]
        # a shard served here says what it waits for itself (its BSP iteration, the
        # replica's confirmation, the update callback of a process not in serve())
        shards = ", ".join(
            f"shard {s} (rank {t}"
            + "".join(f"; {why}" for why in self._local_waits(model, s, t))
            + ")"
            for s, t in zip(waiting, targets, strict=True)
        )
        return {
            "job": job,
            "owner": self.membership.owner(job),
            "uid": call.session.conn.credentials.uid,
            "node": self.host.config.node_id,
            "op": f"{name}@{rank}",
            "kind": f"ps_{call.op} ({model.spec['consistency']})",
            "rank": rank,
            "peer": "-",
            "tag": name,
            "nbytes": side.engine.bounds[-1][1] * side.engine.dtype.itemsize,
            "dtype": str(side.engine.dtype),
            "pending_for": now - call.started,
            "waits": "peer",
            "detail": f"{call.op} at clock {side.engine.iteration} waits for {shards}",
            "peer_joined": all(self.membership.lookup(job, t) is not None for t in targets),
            "peer_node": None,
            "peer_node_state": None,
            "client_left": False,
        }

    @staticmethod
    def _local_waits(model: Model, shard: int, rank: int) -> list[str]:
        """What ``shard`` waits for, if rank ``rank`` serves it here."""
        server = model.servers.get(shard)
        if server is None or model.ranks.get(shard) != rank:
            return []
        return server.waiting_for()

    # -- status and metrics -----------------------------------------------------------------
    def statistics(self, counters: Mapping[str, int]) -> Meta:
        servers, workers = [], []
        for (job, name), model in sorted(self.engine.models.items()):
            owner = self.membership.owner(job)
            for shard, server in sorted(model.servers.items()):
                servers.append(_server_row(job, owner, name, shard, model, server))
            for rank, side in sorted(model.local_workers.items()):
                w = side.engine.statistics()
                workers.append(
                    {
                        "job": job,
                        "owner": owner,
                        "name": name,
                        "rank": rank,
                        "clock": side.engine.iteration,
                        "versions": list(side.engine.versions),
                        "epochs": list(side.engine.epochs),
                        "pushes": w.pushes,
                        "push_bytes": w.push_bytes,
                        "push_dense_bytes": w.push_dense_bytes,
                        "considered": w.considered,
                        "pushed": w.pushed,
                        "smp_selected": w.smp_selected,
                        "rp_selected": w.rp_selected,
                        "glnp_clipped": w.glnp_clipped,
                        "delay_dropped": w.delay_dropped,
                        "server_dropped": w.server_dropped,
                        "pulls": w.pulls,
                        "pull_bytes": w.pull_bytes,
                        "pull_dense_bytes": w.pull_dense_bytes,
                        "resent": w.resent,
                    }
                )
        return {
            "ps_servers": servers,
            "ps_workers": workers,
            "counters": {
                **counters,
                "ps_early_frames": self.engine.early_frames,
                "stalls_reported": self._stalls_reported,
            },
        }

    def metrics(self) -> Iterable[Metric]:
        """Totals over this node's models (no job or model labels: their number has no
        bound); per-model figures are in the status rows."""
        yield from self.operations.families(pending=len(self.calls))
        labels = {"service": self.name}
        workers = [
            s.engine.statistics()
            for m in self.engine.models.values()
            for s in m.local_workers.values()
        ]
        shards = [s.statistics() for m in self.engine.models.values() for s in m.servers.values()]
        # a replica replays its primary's updates: counted once, where they are served from;
        # what models gone from this node counted stays counted (counters never go back)
        t = _totals(workers, [s for s in shards if s.primary]) + self._retired
        yield counter(
            "fabricd_ps_push_bytes",
            "Bytes of pushes sent by this node's workers, as sent (filtered) and as they would "
            "have been unfiltered (dense, headers included)",
            [
                ({**labels, "filtered": "yes"}, t["push"]),
                ({**labels, "filtered": "no"}, t["push_dense"]),
            ],
        )
        yield counter(
            "fabricd_ps_pull_bytes",
            "Bytes of pull answers received by this node's workers, as received (changed "
            "parameters only) and as whole models (headers included)",
            [
                ({**labels, "filtered": "yes"}, t["pull"]),
                ({**labels, "filtered": "no"}, t["pull_dense"]),
            ],
        )
        yield counter(
            "fabricd_ps_gradients_selected",
            "Gradient elements each filter selected for dropping (G-SMP, G-RP), those dropped "
            "(selected by every filter on) and those considered",
            [
                ({**labels, "filter": name}, t[name])
                for name in ("gsmp", "grp", "dropped", "considered")
            ],
        )
        yield counter(
            "fabricd_ps_parameters_published",
            "Parameters the primary servers' P-SMP filters published, and those considered",
            [
                ({**labels, "what": "published"}, t["published"]),
                ({**labels, "what": "considered"}, t["p_considered"]),
            ],
        )
        yield counter(
            "fabricd_ps_updates_dropped",
            "Shard pushes not applied: delay above tau_max at this node's workers "
            "(delay_worker) or its primary servers (delay_server), their worker lost, or "
            "dropped by MLfabric's scheduler before they were sent (scheduled)",
            [
                ({**labels, "reason": reason}, t[reason])
                for reason in ("delay_worker", "delay_server", "lost", "scheduled")
            ],
        )
        yield from _scheduler_metrics(labels, t)
        delays = Histogram(DELAY_BUCKETS)
        for i in range(len(delays.counts)):
            delays.counts[i] += t[f"delay{i}"]
        delays.sum += t["delay_sum"]
        yield histogram(
            "fabricd_ps_update_delay",
            "Updates this node's primary servers applied, by delay (the server's version "
            "minus the version the update was computed from)",
            [(labels, delays)],
        )
        yield gauge(
            "fabricd_ps_shards",
            "Parameter-server shards on this node, by role",
            [
                ({**labels, "role": "primary"}, sum(1 for s in shards if s.primary)),
                ({**labels, "role": "replica"}, sum(1 for s in shards if not s.primary)),
            ],
        )


def _scheduler_metrics(labels: dict[str, str], t: Counter[str]) -> Iterable[Metric]:
    """The series of MLfabric's schedulers on this node's primaries, from :func:`_totals`."""
    yield counter(
        "fabricd_ps_scheduled_updates",
        "Shard pushes MLfabric's schedulers on this node's primaries took (ready), "
        "granted and dropped, and the batches they decided",
        [
            ({**labels, "what": what}, t[f"sched_{what}"])
            for what in ("ready", "granted", "dropped", "batches")
        ],
    )
    yield counter(
        "fabricd_ps_scheduling_latency_seconds",
        "Seconds from a push's READY to its scheduler's decision, summed over decisions "
        "(divide by fabricd_ps_scheduled_updates ready minus waiting for the mean)",
        [(labels, t["sched_latency_us"] / 1e6)],
    )
    yield counter(
        "fabricd_ps_joint_parts",
        "Joint reservation (MLfabric §10.2): parts of other shards' updates this node's shard-0 "
        "primaries planned (planned), and parts its other primaries planned alone because no "
        "PLAN came in time (fell_back)",
        [({**labels, "what": what}, t[f"joint_{what}"]) for what in ("planned", "fell_back")],
    )


def _totals(workers: list[WorkerStatistics], primaries: list[ShardStatistics]) -> Counter[str]:
    """The sums the Prometheus series are made of, over these workers and primary shards."""
    t: Counter[str] = Counter()
    for w in workers:
        t.update(
            push=w.push_bytes,
            push_dense=w.push_dense_bytes,
            pull=w.pull_bytes,
            pull_dense=w.pull_dense_bytes,
            gsmp=w.smp_selected,
            grp=w.rp_selected,
            dropped=w.considered - w.pushed,
            considered=w.considered,
            delay_worker=w.delay_dropped,
        )
    for s in primaries:
        c = s.coordinator
        t.update(
            published=s.published,
            p_considered=s.considered,
            delay_server=c.dropped.get("delay", 0),
            lost=c.dropped.get("lost", 0),
            delay_sum=c.delay_sum,
        )
        t.update({f"delay{i}": n for i, n in enumerate(c.delays)})
        t.update(scheduled=c.dropped.get("scheduled", 0))
        if s.scheduler is not None:
            t.update(
                sched_ready=s.scheduler.ready,
                sched_granted=s.scheduler.granted,
                sched_dropped=sum(s.scheduler.denied.values()),
                sched_batches=s.scheduler.batches,
            )
            t.update(sched_latency_us=round(s.scheduler.latency_sum * 1e6))
            t.update(joint_planned=s.scheduler.joint_planned, joint_fell_back=s.scheduler.fell_back)
    return t


def _server_row(
    job: str, owner: int | None, name: str, shard: int, model: Model, server: ShardServer
) -> Meta:
    """One shard served or followed here, as a status row."""
    s = server.statistics()
    c = s.coordinator
    return {
        "job": job,
        "owner": owner,
        "name": name,
        "shard": shard,
        "role": "primary" if s.primary else "replica",
        "epoch": s.epoch,
        "consistency": model.spec["consistency"],
        "version": s.version,
        "complete": c.complete,
        "applied": c.applied,
        "dropped_delay": c.dropped.get("delay", 0),
        "dropped_lost": c.dropped.get("lost", 0),
        "dropped_scheduled": c.dropped.get("scheduled", 0),
        "scheduling": model.spec["scheduling"],
        "scheduler": _scheduler_row(s.scheduler),
        "aggregates": s.aggregates,
        "aggregates_refused": s.aggregates_refused,
        "delays": list(c.delays),
        "delay_sum": c.delay_sum,
        "held_pulls": c.held,
        "live_workers": c.live,
        "pushes": s.pushes,
        "resent": s.resent,
        "push_bytes": s.push_bytes,
        "push_dense_bytes": s.push_dense_bytes,
        "pulls": s.pulls,
        "pull_bytes": s.pull_bytes,
        "pull_dense_bytes": s.pull_dense_bytes,
        "considered": s.considered,
        "published": s.published,
        "logged": s.logged,
        "unreplicated": s.unreplicated,
        "replication": model.spec["replication"],
        "lag": s.lag,
        "divergence": s.divergence,
        "distribution": model.spec["distribution"],
        "trees": None if s.trees is None else asdict(s.trees),
        "waiting": list(c.waiting),
    }


def _scheduler_row(stats: SchedulerStatistics | None) -> Meta | None:
    """A scheduled shard's scheduler in a status row (``None``: arrival order)."""
    if stats is None:
        return None
    decided = stats.decided
    return {
        "ready": stats.ready,
        "granted": stats.granted,
        "denied": dict(stats.denied),
        "batches": stats.batches,
        "waiting": stats.waiting,
        "outstanding": stats.outstanding,
        "latency_mean": stats.latency_sum / decided if decided else 0.0,
        "latency_max": stats.latency_max,
        "joint": {
            "planned": stats.joint_planned,
            "held": stats.joint_held,
            "fell_back": stats.fell_back,
        },
    }
