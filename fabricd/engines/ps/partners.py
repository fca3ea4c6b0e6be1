"""A shard's partner frames at the rank that receives them, as
:class:`~fabricd.engines.ps.node.PSNode` decides: a primary's REPLICATE at its replica (an
entry logged and processed in order, or a snapshot taken), a worker's copy of a push at the
replica (bounded replication), and a partner's JOIN (answered with the shard's state by a rank
that serves it).  Functions of the node whose state they read and
change, split out of ``node.py`` for the house's size limit (as :mod:`fabricd.engines.ps.
failover` is); MLfabric §3.3's hot standby.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabricd.engines.ps.failover import adopt
from fabricd.engines.ps.shard_actions import FLUSH, LOSE, PUSH, Entry
from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key, Model
    from fabricd.engines.ps.node import PSNode
    from fabricd.engines.ps.server import ShardServer
    from fabricd.frames import ps as ps_frames


def _partner_shard(
    node: PSNode, frame: ps_frames.Replicate | ps_frames.Join
) -> tuple[Key, Model, ShardServer] | None:
    """The shard here that a partner's frame names, or ``None`` (counted as dropped)
    when it is not open here, or open with another spec."""
    key = (frame.job, frame.name)
    model = node.models.get(key)
    server = None if model is None else model.servers.get(frame.shard)
    if model is None or server is None or model.spec != frame.spec:
        node.counters["ps_frames_dropped"] += 1
        return None
    return key, model, server


def at_replica(node: PSNode, frame: ps_frames.Replicate, payload: bytes, now: float) -> None:
    """The shard's partner's entry or snapshot: taken only from the rank that is this rank's
    partner for the shard (any other rank of the job could forge a log, or demote a primary
    with a snapshot of a later epoch)."""
    found = _partner_shard(node, frame)
    if found is None:
        return
    key, model, server = found
    if model.partner(frame.shard, model.ranks[frame.shard]) != frame.server:
        node.counters["ps_frames_dropped"] += 1
        return
    if frame.entry == "snapshot":
        if server.restore(frame.index, payload):
            node._log(
                logging.INFO,
                f"parameter server {key[1]!r} shard {frame.shard}: took the state of rank "
                f"{frame.server} at epoch {server.epoch}",
            )
            adopt(node, key, frame.shard, server.epoch, "its partner's snapshot said so")
        model.tentative.discard(frame.shard)
        node._take_early(key)  # workers' frames held while the state was away
        return
    if frame.entry not in (PUSH, LOSE, FLUSH):
        raise RemoteProtocolError(f"replication entry of kind {frame.entry!r}")
    entry = Entry(
        index=frame.index,
        kind=frame.entry,
        worker=frame.worker,
        iteration=frame.iteration,
        base=frame.base,
        payload=payload,
        reason=frame.reason,
        members=frame.members,
        copied=frame.copied,
        digest=frame.digest or b"",
    )
    if server.primary:
        node.counters["ps_frames_dropped"] += 1  # promoted: the old primary is gone
        return
    node._server(key, frame.shard, server.log(entry, now))


def at_copy(node: PSNode, frame: ps_frames.Push, payload: bytes, now: float) -> None:
    """A worker's daemon's copy of a push for the shard's replica here (bounded replication):
    taken at the epoch the replica follows; anything else is dropped and counted (a copy for
    a rank promoted meanwhile, or from a worker behind the epoch, is no entry of the log)."""
    key = (frame.job, frame.name)
    model = node.models.get(key)
    server = None if model is None else model.servers.get(frame.shard)
    if (
        model is None
        or server is None
        or model.spec != frame.spec
        or server.primary
        or frame.epoch != server.epoch
        or frame.worker not in model.workers
    ):
        node.counters["ps_frames_dropped"] += 1
        return
    node._server(
        key, frame.shard, server.copy(frame.worker, frame.iteration, frame.base, payload, now)
    )


def at_partner(node: PSNode, frame: ps_frames.Join) -> None:
    """The shard's partner opened it: send it the state if this rank serves the shard;
    if this rank waits for the state itself, the partner has just opened, so ask it."""
    found = _partner_shard(node, frame)
    if found is None:
        return
    key, model, server = found
    if model.partner(frame.shard, model.ranks[frame.shard]) != frame.replica:
        raise RemoteProtocolError(f"rank {frame.replica} is not shard {frame.shard}'s partner")
    if server.primary:
        node._settle(key, frame.shard)  # the partner asks: this rank serves
        node._server(key, frame.shard, server.joined())
    elif not server.has_state and frame.shard not in model.answered:
        # once: a partner without state answers this JOIN with its own, and two such
        # partners would otherwise ask each other for ever (the shard is lost)
        node._join(key, frame.shard)
        model.answered.add(frame.shard)
