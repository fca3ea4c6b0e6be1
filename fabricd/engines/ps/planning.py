"""Joint reservation between daemons: the lead's PLANs out, a follower's PLANs in
(:mod:`fabricd.engines.ps.joint` says what they mean; :class:`~fabricd.engines.ps.node.
PSNode` calls these).

Rules: the lead sends each other shard one PLAN per batch, to the rank serving that shard as
this daemon knows it (held, like any frame, while that rank is suspected).  A follower takes a
PLAN only for a shard other than 0 it serves as primary, of a model planned jointly, from the
rank serving shard 0 at the epoch this daemon knows, living on the node it came from (a lead
promoted before this daemon heard of it is not believed: the part is planned alone after the
grace), and only entries for the model's workers with one of Alg. 2's drop reasons; anything
else is dropped and counted.  A PLAN that never comes costs only time: the follower plans the
part alone after its grace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.ps.joint import PartPlanned, joint_for
from fabricd.engines.scheduling.ordering import (
    ARRIVES_LATE,
    DEADLINE_PASSED,
    LOOK_AHEAD,
    NO_CAPACITY,
)
from fabricd.frames import ps as ps_frames

#: the reasons a lead drops an update for (Alg. 2's): a PLAN entry with any other is dropped
REASONS = frozenset({ARRIVES_LATE, DEADLINE_PASSED, LOOK_AHEAD, NO_CAPACITY})

if TYPE_CHECKING:
    from collections.abc import Iterable

    from fabricd.engines.ps.models import Key, Model
    from fabricd.engines.ps.node import PSNode


def servers(engine: PSNode, key: Key, model: Model) -> dict[int, int] | None:
    """The node serving each of ``model``'s shards, as far as this daemon knows, for shard
    0's scheduler, if the model is planned jointly (``None`` otherwise: it plans alone);
    a shard whose rank is not known is left out (its parts are planned alone)."""
    if not joint_for(model.spec):
        return None
    nodes: dict[int, int] = {}
    for shard in range(len(model.bounds)):
        entry = engine.ranks.lookup(key[0], model.target(shard))
        if entry is not None:
            nodes[shard] = entry.node
    return nodes


def send(engine: PSNode, key: Key, model: Model, me: int, parts: Iterable[PartPlanned]) -> None:
    """The lead's decisions for the other shards' parts, one PLAN per shard."""
    by_shard: dict[int, list[ps_frames.PlanEntry]] = {}
    for part in parts:
        by_shard.setdefault(part.shard, []).append(
            ps_frames.PlanEntry(
                worker=part.worker,
                iteration=part.iteration,
                wait_us=round(part.wait * 1e6),
                duration_us=round(part.duration * 1e6),
                reason=part.reason,
            )
        )
    for shard, entries in by_shard.items():
        to = model.target(shard)
        for start in range(0, len(entries), ps_frames.MAX_PLAN_ENTRIES):
            plan = ps_frames.Plan(
                job=key[0],
                name=key[1],
                shard=shard,
                server=to,
                lead=me,
                entries=tuple(entries[start : start + ps_frames.MAX_PLAN_ENTRIES]),
            )
            engine._send(key[0], to, plan)


def at_plan(engine: PSNode, node: int, frame: ps_frames.Plan, now: float) -> None:
    """A PLAN from ``node`` (module docstring): the shard's held parts granted or dropped."""
    key = (frame.job, frame.name)
    model = engine.models.get(key)
    server = None if model is None else model.servers.get(frame.shard)
    if (
        model is None
        or server is None
        or not server.primary
        or frame.shard == 0
        or not joint_for(model.spec)
        or model.ranks.get(frame.shard) != frame.server
        or frame.lead != model.target(0)
    ):
        engine.counters["ps_frames_dropped"] += 1
        return
    if not engine._sent_by(node, frame.job, frame.lead):
        return
    parts = [
        PartPlanned(
            shard=frame.shard,
            worker=e.worker,
            iteration=e.iteration,
            wait=e.wait_us / 1e6,
            duration=e.duration_us / 1e6,
            reason=e.reason,
        )
        for e in frame.entries
        if e.worker in model.workers and (e.reason is None or e.reason in REASONS)
    ]
    engine.counters["ps_frames_dropped"] += len(frame.entries) - len(parts)  # (entries)
    engine._server(key, frame.shard, server.planned(parts, now))
