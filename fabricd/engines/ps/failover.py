"""A parameter-server shard's failover, a lost rank, and what is sent again to a rank back, as
:class:`~fabricd.engines.ps.node.PSNode` decides them.

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
from fabricd.engines.ps.models import CallDone, EpochMoved
from fabricd.engines.ps.routing import pair
from fabricd.errors import ErrorCode

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.engines.ps.models import Key, Model
    from fabricd.engines.ps.node import PSNode
    from fabricd.engines.ps.server import ShardServer
    from fabricd.engines.ps.shard_actions import Action as ServerAction


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
    move_workers(node, key, shard, reason)


def adopt(node: PSNode, key: Key, shard: int, epoch: int, how: str) -> None:
    """The daemon learned (``how``) that ``shard`` is at ``epoch``: its workers here move
    there, and their clients hear ``ps_epoch``."""
    model = node.models[key]
    if epoch <= model.epochs.get(shard, 0):
        return
    model.epochs[shard] = epoch
    move_workers(node, key, shard, f"the shard is at epoch {epoch} ({how})")


def move_workers(node: PSNode, key: Key, shard: int, reason: str) -> None:
    """Tell every local worker of ``key`` that ``shard`` is at its epoch now, and send what
    each has in flight to the rank serving it."""
    model = node.models[key]
    epoch, server = model.epochs[shard], model.target(shard)
    # bounded replication: the rank serving now may be behind what the workers saw (within
    # the bound): their caches are pulled whole again, and their clients told so
    rollback = model.spec["replication"] == "bounded"
    for rank, side in model.local_workers.items():
        node._out.append(
            EpochMoved(
                key=key,
                rank=rank,
                shard=shard,
                epoch=epoch,
                server=server,
                reason=reason,
                rollback=rollback,
            )
        )
        node._worker(key, side, side.engine.move(shard, epoch, forget=rollback))


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


def lose(node: PSNode, key: Key, model: Model, rank: int, reason: str, now: float) -> None:
    if rank in model.workers:
        model.gone.add(rank)
        for shard, server in model.servers.items():
            if server.primary:
                node._server(key, shard, server.lose(rank, reason, now))
    for shard in range(len(model.bounds)):
        if rank not in pair(model.spec, shard):
            continue
        if rank == model.target(shard):
            fail_over(node, key, shard, f"rank {rank} serving it left ({reason})", now)
            continue
        local = model.servers.get(shard)  # the partner that follows it went
        if local is not None and local.primary:
            node._settle(key, shard)  # nobody can answer for a later epoch
            node._server(key, shard, local.replica_lost(now))


def send_again(
    node: PSNode, reached: Callable[[str, int], bool], *, rejoin: bool, job: str | None = None
) -> None:
    """Send the ranks that ``reached`` says are reachable again what was held for them and
    what they may have lost: the workers' pushes and pulls in flight to them, a primary's
    entries to its partner (or its whole state, :func:`_resync`), a replica's JOIN (if it
    has no state, or always with ``rejoin``: what its primary sent again when it learned
    of this rank may have overtaken the primary's announcement here and been dropped by
    :meth:`_sent_by`; with the state, the snapshot is ignored and the entries after it are
    taken or confirmed again)."""
    for (held_job, rank), frame, payload in node._held.take(reached):
        node._send(held_job, rank, frame, payload)
    for key, model in node._of_job(job):  # ``job``: only its ranks can be reached
        for side in model.local_workers.values():
            for shard in range(len(model.bounds)):
                if reached(key[0], model.target(shard)):
                    node._worker(key, side, side.engine.resend(shard))
        for shard, server in model.servers.items():
            other = model.partner(shard, model.ranks[shard])
            if other is None or not reached(key[0], other):
                continue
            if server.primary and shard not in model.tentative:
                node._server(key, shard, _resync(server))
            elif rejoin or not server.has_state or shard in model.tentative:
                # the JOIN may have gone with the old links (a tentative primary still
                # waits for its partner's answer: it has nothing to send it)
                node._join(key, shard)


def _resync(server: ShardServer) -> list[ServerAction]:
    """What a primary sends its partner back from a reset or a partition: the entries it has
    not confirmed, or, if the primary gave it up meanwhile (went on alone), its whole state: a
    partner that kept its own (its process lived on) would otherwise stay behind for good, and
    be promoted so if the primary then died."""
    return list(server.unconfirmed()) if server.synced else server.joined()
