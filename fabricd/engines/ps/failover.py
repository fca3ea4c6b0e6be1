"""A parameter-server shard's failover, as :class:`~fabricd.engines.ps.node.PSNode` decides it.

Rules: when the rank serving a shard is gone its partner serves the shard from the next epoch
(MLfabric §3.3's hot standby): promoted here if it is local and holds the shard's state, with
the workers gone meanwhile lost to it; a shard with no partner, or whose partner is gone or
never got the state, fails its workers' calls (``peer_failed``).  Split out of ``node.py`` (the
house's size limit) as functions of the node whose state they read and change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabricd.engines.actions import Failure
from fabricd.engines.ps.models import CallDone
from fabricd.errors import ErrorCode

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key
    from fabricd.engines.ps.node import PSNode


def fail_over(node: PSNode, key: Key, shard: int, reason: str, now: float) -> None:
    """The rank serving ``shard`` is gone: its partner serves it from the next epoch (if
    the shard has one; else the shard has no server any more)."""
    model = node.models[key]
    if not model.spec["replicas"]:
        fail_shard(node, key, shard, reason)
        return
    epoch = model.epochs.get(shard, 0) + 1
    model.epochs[shard] = epoch
    successor = model.target(shard)
    # a suspect (its node unreachable) may come back: what is sent it waits for it
    # (_send), and if it is gone for good, rank_gone fails the shard over again
    if node.ranks.lookup(key[0], successor) is None and (key[0], successor) not in node.suspects:
        fail_shard(node, key, shard, f"{reason}, and its partner rank {successor} is gone too")
        return
    server = model.servers.get(shard)
    if server is not None and not promote(node, key, shard, reason, now):
        fail_shard(node, key, shard, f"{reason}, and its partner never got the shard's state")
        return
    node.counters["ps_failovers"] += 1
    node._log(
        logging.WARNING,
        f"parameter server {key[1]!r} shard {shard}: {reason}; rank {successor} serves it "
        f"from epoch {epoch}",
    )
    node._move_workers(key, shard, reason)


def promote(node: PSNode, key: Key, shard: int, reason: str, now: float) -> bool:
    """The local partner of ``shard`` takes over, if it holds the shard's state; workers
    already gone are lost to it.  ``False``: it has none, and the shard is lost."""
    model = node.models[key]
    server = model.servers[shard]
    if server.primary:
        return True
    if not server.promote():
        node._log(
            logging.ERROR,
            f"parameter server {key[1]!r} shard {shard}: {reason}, and this rank never got "
            "the shard's state: the shard is lost",
        )
        return False
    node._log(
        logging.WARNING,
        f"parameter server {key[1]!r} shard {shard}: promoted to primary at epoch "
        f"{server.epoch} ({reason})",
    )
    for worker in model.workers:
        # one this daemon heard is gone is lost (its primary's LOSE entry may have gone
        # with it); a suspect is lost by rank_gone in time, and a worker not known that
        # never pushed may not have started yet
        if worker in model.gone or (
            node.ranks.lookup(key[0], worker) is None
            and (key[0], worker) not in node.suspects
            and server.coordinator.clock(worker) > 0
        ):
            node._server(key, shard, server.lose(worker, "gone at the failover", now))
    return True


def fail_shard(node: PSNode, key: Key, shard: int, reason: str) -> None:
    model = node.models[key]
    model.failed[shard] = reason
    failure = Failure(
        code=ErrorCode.PEER_FAILED,
        message=f"shard {shard} of {key[1]!r} has no server: {reason}",
    )
    for rank in model.local_workers:
        node._out.append(CallDone(key=key, rank=rank, failure=failure))
