"""A shard's state for a snapshot, and taking one (split from ``server.py`` for the house's size
limit): what a primary sends a replica that joins late or comes back, and how the replica takes
it, every part checked before any is taken.  The bytes are :mod:`fabricd.engines.ps.snapshot`'s.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from fabricd.engines.ps import snapshot as ps_snapshot
from fabricd.engines.ps.bounded import Lineage
from fabricd.engines.ps.consistency import restore_rule, rule_state
from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from fabricd.engines.ps.server import ShardServer


def capture(server: ShardServer) -> dict[str, Any]:
    """Everything a replica needs to go on from ``server``'s processed entries."""
    counts = [server._pushes, server._resent, server._push_bytes, server._pulls, server._pull_bytes]
    return {
        "epoch": server.epoch,
        "last": {w: list(record) for w, record in server._last.items()},
        "counts": counts,
        "coordinator": server.coordinator.state(),
        "rule": rule_state(server.rule),
        "filter": server.filter.state(),
        "store": server.store.state(),
        "lineage": server._lineage.state(),
    }


def take(server: ShardServer, state: dict[str, Any]) -> None:
    """Take ``state`` into ``server``, every part checked before any is taken (but the parts'
    own ``restore``, each of which checks before it changes anything, in an order that leaves
    nothing half done: the checks that can fail come first).

    Raises:
        RemoteProtocolError: a part is malformed, or of another model; nothing changed.
    """
    last = ps_snapshot.field(state, "last", dict)
    records: dict[int, tuple[int, int, str | None]] = {}
    for worker, record in last.items():
        if (
            type(worker) is not int
            or worker not in server.coordinator.workers
            or not isinstance(record, list)
            or len(record) != 3
            or not all(type(x) is int for x in record[:2])
            or not (record[2] is None or isinstance(record[2], str))
        ):
            raise RemoteProtocolError("a snapshot's acknowledgement records are malformed")
        records[worker] = (record[0], record[1], record[2])
    counts = ps_snapshot.field(state, "counts", list)
    if len(counts) != 5 or not all(type(c) is int and c >= 0 for c in counts):
        raise RemoteProtocolError("snapshot shard counters of another shape")
    parts = {
        name: ps_snapshot.field(state, name, dict)
        for name in ("coordinator", "rule", "filter", "store")
    }
    lineage = Lineage()
    lineage.restore(ps_snapshot.field(state, "lineage", dict))
    # each restore checks its part before it changes anything; a later one that fails
    # would leave the earlier ones taken, so every part is tried on a copy first
    trial = type(server).__new__(type(server))
    trial.coordinator = copy.deepcopy(server.coordinator)
    trial.filter = copy.deepcopy(server.filter)
    trial.store = copy.deepcopy(server.store)
    trial.coordinator.restore(parts["coordinator"], size=server.size, dtype=server.dtype)
    restore_rule(copy.deepcopy(server.rule), parts["rule"], server.filter.model)
    trial.filter.restore(parts["filter"])
    trial.store.restore(parts["store"])
    if trial.coordinator.version != trial.store.version:
        raise RemoteProtocolError(
            f"a snapshot whose model is at version {trial.store.version} and its "
            f"consistency at {trial.coordinator.version}"
        )
    server.coordinator, server.filter = trial.coordinator, trial.filter
    server.store = trial.store
    restore_rule(server.rule, parts["rule"], server.filter.model)
    server._lineage = lineage
    server._last = records
    server._waiting = {}
    (server._pushes, server._resent, server._push_bytes, server._pulls, server._pull_bytes) = counts


def follow(server: ShardServer, epoch: int, index: int) -> None:
    """``server`` took a snapshot of ``epoch`` as of entry ``index``: it follows the primary
    that sent it from there, with nothing of its own in flight."""
    server.primary = server.replicated = server.synced = server._join_pending = False
    server.has_state = True
    server.epoch = epoch
    server._index = server._applied_upto = index
    server._log.reset(index, {w: record[0] for w, record in server._last.items()})
    server._norms.clear()
    server._unreplicated.clear()
    server._actions.clear()
    if server.trees is not None:  # (a primary that came back: its workers pull again)
        server.trees.clear()
    server._confirm = None
    if server._stepping is not None:  # its answer is for a model the snapshot replaced
        server._voided.append(server._stepping.version)
    server._stepping = None
