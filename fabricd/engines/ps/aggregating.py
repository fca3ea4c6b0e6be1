"""MLfabric aggregation (§3.2, §5.2) as :class:`~fabricd.engines.ps.node.PSNode` moves it:
a shard's GATHER to the aggregator node, a member's push to it, the sum on to the server, and
a member's push sent straight to the server when the server has not acknowledged it in time.

Rules: functions of the node whose state they read and change (split out of ``node.py`` for
the house's size limit, as :mod:`fabricd.engines.ps.failover` is); the aggregator's own
bookkeeping is :mod:`fabricd.engines.ps.gathering`'s, the server's exactly-once rule
:meth:`~fabricd.engines.ps.server.ShardServer.push_aggregate`'s.

* A GATHER counts only from the node its server rank lives on (as any server's frame), and a
  member's push only from the node its worker lives on.  A node that holds no worker of the
  model cannot forward (an aggregate counts from the node of the worker rank that sends it,
  :func:`fabricd.engines.ps.messages.aggregate`): its groups are dropped, and their members come
  straight from their workers' daemons after their wait.
* A worker's daemon that sent a push to an aggregator waits :func:`direct_after` for the
  server's acknowledgement, then sends it straight to the server (:meth:`Worker.direct`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fabricd.engines.ps import messages

if TYPE_CHECKING:
    from fabricd.engines.ps.gathering import GroupKey, Summed
    from fabricd.engines.ps.models import Key, Model
    from fabricd.engines.ps.node import PSNode
    from fabricd.frames import ps as ps_frames

#: the least a member's worker waits for the server past its push's planned start
DIRECT_AFTER_MIN = 1.0


def direct_after(interval: float) -> float:
    """Seconds a push sent to an aggregator waits for the server's acknowledgement before it
    goes straight to the server: ten scheduling intervals, at least a second (a group waits
    half that for a missing member, :class:`~fabricd.engines.ps.gathering.Gathering`'s grace,
    so a healthy aggregate, or a partial one, comes first)."""
    return max(DIRECT_AFTER_MIN, 10 * interval)


def _group(model_key: Key, frame: ps_frames.Push | ps_frames.Gather, group: int) -> GroupKey:
    return (model_key, frame.shard, frame.server, frame.epoch, group)


def _model(node: PSNode, frame: ps_frames.Push | ps_frames.Gather) -> tuple[Key, Model] | None:
    """The model a GATHER or a member's push is for, here; ``None`` (dropped, counted) when
    it is not open here with that spec, has no worker here, or the frame names a shard or
    a server rank other than the one serving it at the epoch this node knows."""
    key = (frame.job, frame.name)
    model = node.models.get(key)
    if (
        model is None
        or model.spec != frame.spec
        or not model.local_workers
        or not 0 <= frame.shard < len(model.bounds)
        or frame.server != model.target(frame.shard)
        or frame.epoch != model.epochs.get(frame.shard, 0)
    ):
        node.counters["ps_frames_dropped"] += 1
        return None
    return key, model


def at_gather(node: PSNode, sender: int, frame: ps_frames.Gather, now: float) -> None:
    """A shard's scheduler made this node the aggregator of a group."""
    if not node._sent_by(sender, frame.job, frame.server):
        return
    found = _model(node, frame)
    if found is None:
        return
    key, model = found
    lo, hi = model.bounds[frame.shard]
    group = _group(key, frame, frame.group)
    wait, dtype = frame.wait_us / 1e6, np.dtype(model.spec["dtype"])
    forward(node, node.gathering.plan(group, frame.members, wait, now, size=hi - lo, dtype=dtype))


def at_member(node: PSNode, sender: int, frame: ps_frames.Push, payload: bytes, now: float) -> None:
    """A worker's push for a group this node aggregates (or will, once its GATHER comes)."""
    assert frame.group is not None
    if not node._from(sender, frame.job, frame.worker):
        return
    found = _model(node, frame)
    if found is None:
        return
    key, _ = found
    group = _group(key, frame, frame.group)
    summed = node.gathering.push(group, frame.worker, frame.iteration, frame.base, payload, now)
    forward(node, summed)


def forward(node: PSNode, summed: list[Summed]) -> None:
    """Send each complete (or timed-out) group's sum to its server, from a worker rank of
    this node (module docstring)."""
    for one in summed:
        key = one.group[0]
        model = node.models.get(key)
        if model is None or not model.local_workers:
            node.counters["ps_frames_dropped"] += 1
            continue
        sender = min(model.local_workers)
        frame, payload = messages.aggregate(key, model.spec, sender, one)
        node._send(key[0], frame.server, frame, payload)
