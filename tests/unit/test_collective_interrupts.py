"""A call whose client stops waiting (Ctrl-C, an exit) on the persistent collective engine, with
the fake clock of test_persistent's simulated fabric (issue 27, item 5).

The rule (persistent.py, "A call whose client stops waiting"): a sync call is *kept* once its
node activated the round (its data may be in the peers' reductions), and its rank's next call
-- a restarted trainer's first -- is for the next round and is told so (``kept``), in its
result or in a failure's message; before that it is *withdrawn* (nothing of it left the node)
and the other local calls wait on.  Partial modes keep every call's data.

Before, a kept call was said nowhere: the restarted rank's first call came back for "round 1"
with nothing saying why, and its failure named a round that made no sense to it; and a
withdrawn one failed the node's other calls.
"""

from __future__ import annotations

from random import Random

import numpy as np
import pytest

from fabricd.engines.collectives.persistent import Spec
from tests.unit.test_persistent import GRACE, Fabric

BOTH = frozenset({0, 1})


def _leave(fab: Fabric, rank: int, live: frozenset[int]) -> None:
    """``rank`` left the job: every node hears it (membership), with the sync grace."""
    for node, coll in fab.colls.items():
        fab.perform(node, coll.rank_gone(rank, live, fab.tick(), grace=GRACE))


def _back(fab: Fabric) -> None:
    for coll in fab.colls.values():
        coll.rank_back(frozenset(range(coll.size)))


@pytest.mark.parametrize("ring", [False, True], ids=["doubling", "ring_in_place"])
@pytest.mark.parametrize("restart_before_peer", [False, True])
def test_a_sync_call_abandoned_once_its_node_started_the_round_is_kept_and_said(
    ring: bool, restart_before_peer: bool
) -> None:
    """The issue's finding, on the engine: rank 1 (alone on node 1) calls, so node 1 starts the
    round and sends its data; its client is interrupted.  Rank 0's round counts that data
    (active 2), and the restarted rank 1's first call -- made before or after rank 0 called --
    is for round 1 and says round 0 kept its previous call; rank 0 is told nothing of it."""
    spec = Spec(kind="allreduce", count=4, dtype="float32", ring=ring)
    fab = Fabric(spec, (0, 1), Random(1))
    assert fab.colls[1].inplace is ring
    fab.call(1, 1, np.full(4, 10.0, "float32"))
    fab.perform(1, fab.colls[1].abandon(1))  # Ctrl-C: its client is gone
    _leave(fab, 1, frozenset({0}))
    first = np.ones(4, "float32")
    restarted = np.full(4, 100.0, "float32")
    if restart_before_peer:
        _back(fab)
        fab.call(1, 3, restarted)
    fab.call(0, 2, first)
    fab.drain()
    assert fab.delivered[2].round == 0
    assert fab.delivered[2].active == 2
    assert (first == 11.0).all()  # rank 1's interrupted data is in round 0: kept
    assert fab.delivered[2].kept is None
    if not restart_before_peer:
        _back(fab)
        fab.call(1, 3, restarted)
    second = np.ones(4, "float32")
    fab.call(0, 4, second)
    fab.drain()
    assert not fab.failed
    assert (fab.delivered[3].round, fab.delivered[3].kept) == (1, 0)
    assert (fab.delivered[4].round, fab.delivered[4].kept) == (1, None)
    assert (restarted == 101.0).all()
    assert (second == 101.0).all()


def test_a_restarted_ranks_failure_names_its_round_and_why_it_is_that_round() -> None:
    """Rank 1's call was kept in round 0; rank 0 then leaves for good.  The restarted rank 1's
    first call cannot complete: its failure names round 1 and says that round 0 kept its
    previous call (before, "round 1 cannot complete" and nothing else)."""
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 1), Random(0))
    fab.call(1, 1, np.ones(2, "float32"))
    fab.perform(1, fab.colls[1].abandon(1))
    _leave(fab, 1, frozenset({0}))
    fab.call(0, 2, np.ones(2, "float32"))
    fab.drain()
    _back(fab)
    _leave(fab, 0, frozenset({1}))
    fab.call(1, 3, np.ones(2, "float32"))
    coll = fab.colls[1]
    deadline = coll.next_deadline()
    assert deadline is not None
    fab.perform(1, coll.on_timer(deadline))
    message = fab.failed[3].message
    assert fab.failed[3].code == "peer_failed"
    assert "round 1 cannot complete" in message
    assert "previous call was kept in round 0" in message


@pytest.mark.parametrize("op", ["sum", "max"])
def test_a_sync_call_abandoned_before_its_node_started_the_round_is_withdrawn(op: str) -> None:
    """Ranks 0, 1 and 2 share node 0; rank 0 gave and its client left before rank 2 called, so
    nothing of its data left the node: it is withdrawn (its gift, 100, is in no result, max
    included, which no subtraction could undo), rank 1's call waits on instead of failing
    (before, it failed at once), and the restarted rank 0 gives to round 0 again, told of no
    kept call."""
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32", op=op), (0, 0, 0, 1), Random(0))
    fab.call(0, 1, np.full(2, 100.0, "float32"))
    fab.call(1, 2, np.ones(2, "float32"))  # rank 2 has not called: round 0 has not started
    fab.perform(0, fab.colls[0].abandon(1))
    assert not fab.failed
    arrays = {r: np.full(2, float(r + 1), "float32") for r in (0, 2, 3)}
    for rank, array in arrays.items():
        fab.call(rank, 10 + rank, array)
    fab.drain()
    assert not fab.failed
    expected = 1.0 + 1.0 + 3.0 + 4.0 if op == "sum" else 4.0
    assert all((a == expected).all() for a in arrays.values())
    assert all(fab.delivered[t].round == 0 for t in (2, 10, 12, 13))
    assert fab.delivered[10].kept is None


def test_a_withdrawn_ranks_round_fails_after_the_grace_if_it_never_comes_back() -> None:
    """Withdrawn, the rank that left is waited for as any rank that left: the other local
    calls fail once the grace has passed, not before."""
    fab = Fabric(Spec(kind="allreduce", count=2, dtype="float32"), (0, 0, 0, 1), Random(0))
    fab.call(0, 1, np.ones(2, "float32"))
    fab.call(1, 2, np.ones(2, "float32"))
    fab.perform(0, fab.colls[0].abandon(1))
    _leave(fab, 0, frozenset({1, 2, 3}))
    coll = fab.colls[0]
    deadline = coll.next_deadline()
    assert deadline is not None
    fab.perform(0, coll.on_timer(deadline - 1.0))
    assert not fab.failed
    fab.perform(0, coll.on_timer(deadline))
    assert fab.failed[2].code == "peer_failed"


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_an_abandoned_partial_call_is_counted_once_and_its_restart_is_told(mode: str) -> None:
    """Partial modes keep every call's data: rank 1's abandoned gift is in exactly one round's
    result or still waits at its node (conservation), and the restarted rank's first call names
    the round of the kept one."""
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode=mode)
    fab = Fabric(spec, (0, 1), Random(2))
    fab.call(1, 1, np.array([0, 1, 0], "int64"))
    fab.perform(1, fab.colls[1].abandon(1))
    _leave(fab, 1, frozenset({0}))
    fab.call(0, 2, np.array([1, 0, 0], "int64"))
    fab.drain()
    _back(fab)
    fab.call(1, 3, np.array([0, 0, 1], "int64"))
    fab.call(0, 4, np.zeros(3, "int64"))
    fab.drain()
    histories = [c.history for c in fab.colls.values()]
    for round, result in histories[0].items():  # each round the same at every node
        assert all(np.array_equal(h[round], result) for h in histories)
    counted = sum(histories[0].values(), np.zeros(3, "int64"))
    waiting = sum((c.conservation() for c in fab.colls.values()), np.zeros(3, "int64"))
    np.testing.assert_array_equal(counted + waiting, [1, 1, 1])
    assert fab.delivered[3].kept == 0
    assert fab.delivered[4].kept is None
