"""A parameter-server shard's log entries, the actions its :class:`~fabricd.engines.ps.server.
ShardServer` returns, and its statistics (the shard server's vocabulary, split from
``server.py`` for the house's size limit; that module says what each means).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.ps.joint import PartPlanned
from fabricd.engines.ps.scheduler import CopyGranted, Gather, Granted

if TYPE_CHECKING:
    from fabricd.engines.ps.consistency import CoordinatorStatistics
    from fabricd.engines.ps.distributing import TreeStatistics
    from fabricd.engines.ps.scheduler import SchedulerStatistics

Array = np.ndarray[Any, Any]

PUSH: Final = "push"
LOSE: Final = "lose"
FLUSH: Final = "flush"


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One log entry: a worker's push (its encoded ``payload``) or a lost worker (``reason``),
    numbered from 1 in the order the primary took them."""

    index: int
    kind: str
    worker: int
    iteration: int = 0
    base: int = 0
    payload: bytes | bytearray = b""
    reason: str | None = None
    #: an aggregate's entry (MLfabric §5.2): the (worker, iteration, base) of the updates
    #: whose sum ``payload`` is; ``worker``, ``iteration`` and ``base`` are the first's
    members: tuple[tuple[int, int, int], ...] | None = None
    #: bounded replication: an order entry whose payload the worker's copy brings
    #: (:mod:`fabricd.engines.ps.bounded`); ``payload`` is empty, ``digest`` names the bytes
    copied: bool = False
    digest: bytes = b""

    @property
    def updates(self) -> int:
        """The pushes this entry applies (0: a lost worker, a flush or a drop)."""
        if self.kind != PUSH or self.reason is not None:
            return 0
        return 1 if self.members is None else len(self.members)


# -- actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    """Send ``entry`` to the replica (REPLICATE)."""

    entry: Entry


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """Replica (bounded replication): ask the primary for entry ``index`` whole, its
    worker's copy did not come in time."""

    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Logged:
    """Replica: tell the primary every entry up to ``index`` is logged and processed."""

    index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    """Tell ``worker`` its push of ``iteration`` was processed: applied (the model reached
    ``version``), or not (``dropped`` says why; ``version`` is the model's then)."""

    worker: int
    iteration: int
    version: int
    dropped: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """Answer ``worker``'s pull at ``clock``: ``data`` is the store's reply (the chunks
    changed since its version), the model at ``version``.  ``forward`` (distribution trees):
    the worker's daemon is a distributor and sends the same answer on to each ``(worker,
    clock)`` listed, whose caches are at least as recent as ``data`` is built from."""

    worker: int
    clock: int
    version: int
    data: bytearray
    forward: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """Distribution trees: ``worker``'s pull at ``clock`` is answered at ``version`` by worker
    ``via``'s daemon, planned within ``expect`` seconds; if it has not come by then (or
    ``via``'s daemon is gone), the pull is sent again, to be answered straight."""

    worker: int
    clock: int
    version: int
    via: int
    expect: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Refuse:
    """``worker``'s pull at ``clock`` will never be answered (``reason``)."""

    worker: int
    clock: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """Run the update callback in the server's own process (MLfabric Table 1's
    registerUpdateCallback): step ``model`` (a copy of the values the next version starts
    from) by ``update`` (the :class:`~fabricd.engines.ps.consistency.Apply`'s combined update)
    and hand the result to :meth:`ShardServer.stepped`.  The shard waits for it: pushes and
    pulls that come meanwhile are queued behind it, in order."""

    version: int
    model: Array
    update: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Send the replica that joined the shard's state as of entry ``index`` (``data``,
    :mod:`fabricd.engines.ps.snapshot`); the entries after it follow as :class:`Forward`."""

    index: int
    data: bytes


Action = (
    Forward
    | Logged
    | Need
    | Acked
    | Answer
    | Notice
    | Refuse
    | Step
    | Snapshot
    | Granted
    | CopyGranted
    | Gather
    | PartPlanned
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardStatistics:
    """What ``fabricctl status`` and the metrics show of one shard."""

    epoch: int
    primary: bool
    version: int
    logged: int  #: entries taken (primary) or logged (replica)
    unreplicated: int  #: entries the replica has not confirmed yet
    pushes: int  #: pushes taken (not counting resends)
    resent: int  #: pushes a worker's daemon sent again
    push_bytes: int  #: bytes of the pushes taken (encoded, as they travelled)
    push_dense_bytes: int  #: what they would have been unfiltered (dense, the model's dtype)
    pulls: int  #: pulls answered
    pull_bytes: int  #: bytes of the answers
    pull_dense_bytes: int  #: what a whole-model answer would have been each time
    considered: int  #: parameters the parameter filter looked at
    published: int  #: parameters it published
    coordinator: CoordinatorStatistics
    scheduler: SchedulerStatistics | None = None  #: MLfabric's, for a scheduled shard
    aggregates: int = 0  #: aggregates taken (their members count in ``pushes``)
    aggregates_refused: int = 0  #: aggregates refused: a member was decided already
    lag: int = 0  #: bounded replication: updates applied here, not yet at the replica
    divergence: float = 0.0  #: bounded replication: the bound on ``||w_s - w_r||`` now
    trees: TreeStatistics | None = None  #: distribution trees', for ``distribution="tree"``
