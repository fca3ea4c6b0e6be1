"""What the parameter-server node engine keeps of a model, and what it returns.

Rules: plain data: :class:`Model` (one model as one daemon knows it: its spec, the shards
served there, the local workers, each shard's epoch) and the actions of
:class:`~fabricd.engines.ps.node.PSNode`.  The shared vocabulary of
:mod:`fabricd.engines.actions` has no payload, no result and no client event, so the engine
adds :class:`SendData` (a frame and its payload on the data link), :class:`CallDone` (a
worker's call answered or failed), :class:`EpochMoved` (``ps_epoch``), :class:`StepShard` (the
update callback's buffer and event), :class:`Disagreed` (the model was opened two ways: its
shards' processes hear it) and :class:`Log` (a line at a level, optionally rate limited: a
peer's stray frames must not flood the log).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.engines.actions import Complete, SendFrame
from fabricd.engines.ps.routing import partner, serving

if TYPE_CHECKING:
    from fabricd.engines.actions import Failure
    from fabricd.engines.ps.server import ShardServer
    from fabricd.engines.ps.shard_actions import Step
    from fabricd.engines.ps.worker import Worker
    from fabricd.frames import registry
    from fabricd.wire import Meta

Array = np.ndarray[Any, Any]
Key = tuple[str, str]  #: (job, model name)


# -- actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SendData:
    """Send ``frame`` and ``payload`` to ``node`` on the data link."""

    node: int
    frame: registry.PeerFrame
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CallDone:
    """Local worker ``rank``'s push or pull of ``key`` is answered: ``result``, or
    ``failure`` (the service answers the call if one is open)."""

    key: Key
    rank: int
    result: Meta | None = None
    failure: Failure | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochMoved:
    """Tell local worker ``rank``'s client that ``shard`` is served by ``server`` at
    ``epoch`` (``ps_epoch``)."""

    key: Key
    rank: int
    shard: int
    epoch: int
    server: int
    reason: str
    #: bounded replication: ``server`` may be behind the model the worker saw (within the
    #: divergence bound); its cache is pulled whole again
    rollback: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StepShard:
    """Hand the shard's process the update callback's ``step`` (its buffer, then ``ps_step``)."""

    key: Key
    shard: int
    step: Step


@dataclass(frozen=True, slots=True, kw_only=True)
class Disagreed:
    """``key`` was opened two ways (``message`` names both specs): the processes serving its
    shards here hear it (``ps_disagreed``; their workers' calls fail by :class:`CallDone`)."""

    key: Key
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Log:
    """A line for the operator at ``level``; with ``topic``, rate limited by it."""

    level: int
    message: str
    topic: str | None = None


Action = SendFrame | SendData | Complete | CallDone | EpochMoved | StepShard | Disagreed | Log


# -- state --------------------------------------------------------------------------------
@dataclass(slots=True, kw_only=True)
class WorkerSide:
    """A local worker rank of a model, and the array its pull lands in."""

    engine: Worker
    out: Array | None = None


@dataclass(slots=True, kw_only=True)
class Model:
    """One model as this daemon knows it."""

    spec: Meta
    bounds: list[tuple[int, int]]
    workers: tuple[int, ...]
    servers: dict[int, ShardServer] = field(default_factory=dict)  #: local shards
    ranks: dict[int, int] = field(default_factory=dict)  #: their ranks
    local_workers: dict[int, WorkerSide] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)  #: shard -> epoch, as workers see it
    failed: dict[int, str] = field(default_factory=dict)  #: shards nobody serves any more
    #: shards whose local rank, without state, answered its partner's JOIN with its own since
    #: it last asked of itself: it answers one, so two partners without state stop there
    answered: set[int] = field(default_factory=set)
    #: shards opened here as primary at epoch 0 while their partner was there: served only
    #: once the partner answered (with a later epoch's state, this rank came back after a
    #: failover, and serving the initial model would take the workers' versions back)
    tentative: set[int] = field(default_factory=set)
    #: workers this daemon heard are gone while it followed a shard's primary: lost to the
    #: shard if it is promoted (the primary's LOSE entry may have died with it)
    gone: set[int] = field(default_factory=set)
    #: flushes answered once processed: op -> shard -> (its flush's log index, the epoch then)
    flushes: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: the other nodes known to host a rank of the job: told the spec (OPENED) when the model
    #: opened here, when one first hosts a rank of the job, and when its links are back
    peers: set[int] = field(default_factory=set)
    #: why the model is refused here: a peer opened it with another spec (both named)
    disagreed: str | None = None

    def target(self, shard: int) -> int:
        """The rank serving ``shard`` at the epoch this daemon knows."""
        return serving(self.spec, shard, self.epochs.get(shard, 0))

    def partner(self, shard: int, rank: int) -> int | None:
        return partner(self.spec, shard, rank)
