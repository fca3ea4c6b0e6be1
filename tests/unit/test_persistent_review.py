"""Review of the persistent collective engine: each test shows one bug the review found, since
fixed; they stay as regression tests.

The simulated fabric is test_persistent's; :class:`Fab` adds delivery link by link, which the
reproductions need to hold one message back.
"""

from __future__ import annotations

from random import Random

import numpy as np

from fabricd.engines.collectives.persistent import Spec, Transmit, initiator
from tests.unit.test_persistent import GRACE, JOB, NAME, Fabric, Recording


class Fab(Fabric):
    """test_persistent's fabric, with delivery link by link."""

    def deliver_from(self, src: int, dst: int) -> None:
        """Deliver the oldest message on link ``src`` -> ``dst``."""
        self.deliver(src, dst, self.links[src, dst].popleft())

    def drain_except(self, *held: tuple[int, int]) -> None:
        """Deliver everything but the messages on the ``held`` links, until nothing moves."""
        for _ in range(100_000):
            ready = [p for p, q in self.links.items() if q and p not in held]
            if not ready:
                return
            self.deliver_from(*self.rng.choice(ready))
        raise AssertionError("messages never stopped")


def test_majority_round_whose_initiator_is_on_an_excluded_node_still_starts() -> None:
    """Node 2 goes down and comes back (d36f5d2: it is told it was counted lost, its calls
    fail).  Membership sees its rank again, so ``live`` holds rank 2; the survivors' view
    excludes node 2 for good, yet ``initiator`` may draw rank 2, whose calls can never start
    a survivors' round: ranks 0 and 1 wait forever."""
    placement = (0, 1, 2)
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="majority")
    fab = Fab(spec, placement, Random(0))
    assert initiator(JOB, NAME, 0, 3, frozenset({0, 1, 2})) == 2  # round 0 is rank 2's
    fab.kill(2)
    fab.down.discard(2)  # node 2 restarts, its rank rejoins the job
    for node in (0, 1):
        fab.colls[node].rank_back(frozenset({0, 1, 2}))
    fab.colls[2] = Recording(spec, job=JOB, name=NAME, node=2, ranks=placement, live=frozenset())
    fab.call(2, 3, np.array([0, 0, 1], "int64"))
    fab.drain()
    assert 3 in fab.failed  # rank 2 is told: it is out
    fab.call(0, 1, np.array([1, 0, 0], "int64"))
    fab.call(1, 2, np.array([0, 1, 0], "int64"))
    fab.drain()
    assert {1, 2} <= set(fab.delivered), fab.colls[0].waits()


def test_included_and_active_are_right_for_a_round_restarted_by_a_view_change() -> None:
    """After the first round (every rank's), rank 0's solo call starts round 1 (the snapshot
    takes its gift); node 2 dies before the round ends; the round restarts among nodes 0 and 1
    with the snapshot back in the accumulator, and its result holds rank 0's gift.
    ``_restart`` cleared ``included`` and ``_take_snapshot`` overwrote the restored active
    count with ``len(_fresh)`` (empty)."""
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="solo")
    fab = Fab(spec, (0, 1, 2), Random(0))
    for rank in range(3):
        fab.call(rank, 10 + rank, np.zeros(3, "int64"))
    fab.drain()
    assert len(fab.delivered) == 3
    mine = np.array([1, 0, 0], "int64")
    fab.call(0, 1, mine)
    fab.kill(2)
    fab.drain()
    done = fab.delivered[1]
    assert done.round == 1
    np.testing.assert_array_equal(mine, [1, 0, 0])  # its gift is in the result it got ...
    assert (done.included, done.active) == (True, 1)  # ... so it is included, and active


def test_a_solo_call_completes_when_the_survivors_noticed_a_failure_a_round_apart() -> None:
    """Recursive doubling over 3 nodes: node 0 folds into node 1, which sends it the result.
    Node 1 ends round 0 while that result is still on the link to node 0.  Node 2 dies:
    node 0 restarts round 0 among {0, 1} (base 0), node 1 round 1 (base 1).  Node 1 drops
    node 0's base-0 frames without a word and, with no call of its own, never sends a base-1
    frame: node 0's call of rank 0, which started a solo round, waits forever."""
    spec = Spec(kind="allreduce", count=3, dtype="int64", mode="solo")
    fab = Fab(spec, (0, 1, 2), Random(0))
    for rank in range(3):
        fab.call(rank, rank + 1, np.eye(3, dtype="int64")[rank])
    fab.drain_except((1, 0))
    assert fab.colls[1].counters.rounds == 1
    assert fab.colls[0].counters.rounds == 0
    fab.kill(2)
    assert (fab.colls[0].base, fab.colls[1].base) == (0, 1)
    fab.drain()
    assert 1 in fab.delivered, fab.colls[0].waits()


def test_a_payload_queued_to_a_node_lost_by_adoption_is_never_overwritten() -> None:
    """Ring over 3 nodes, solo.  Node 1 ends round 0 with its last allgather message to node
    2 still queued (a slow link; the view points into round 0's tensor).  Node 0 counts node
    2 down; node 1 adopts that view from node 0's frame, its link to node 2 still up.  Nodes
    0 and 1 run rounds 1 and 2: round 2's snapshot writes round 0's tensor at node 1.  Node
    2, which nobody has told yet, then lands the queued bytes and delivers round 0."""
    spec = Spec(kind="allreduce", count=6, dtype="int64", mode="solo", ring=True)
    fab = Fab(spec, (0, 1, 2), Random(0))
    gifts = [np.arange(6, dtype="int64") * 0 + 10 ** (2 * r) for r in range(3)]
    for rank in range(3):
        fab.call(rank, rank + 1, gifts[rank].copy())
    # everything moves but node 1's last message of round 0 to node 2 (its highest tag)
    last = max(op.tag for op in fab.colls[1].executor.schedule.ops if op.peer == 2)
    for _ in range(10_000):
        ready = [p for p, q in fab.links.items() if q and not (p == (1, 2) and q[0].tag == last)]
        if not ready:
            break
        fab.deliver_from(*fab.rng.choice(ready))
    assert fab.colls[1].counters.rounds == 1
    assert fab.colls[2].counters.rounds == 0
    queued: list[tuple[Transmit, bytes]] = [(m, bytes(m.payload)) for m in fab.links[1, 2]]
    assert queued
    fab.drain_except((1, 2))
    fab.down.add(2)  # node 0 only: node 1 learns it from node 0's frames
    fab.perform(0, fab.colls[0].lose(2, "node 2 went down", fab.tick()))
    for token in (10, 11):
        fab.call(0, token, np.zeros(6, "int64"))
        fab.drain_except((1, 2))
    assert fab.colls[1].lost == {2}
    assert fab.colls[1].counters.rounds == 3
    overwritten = [m.tag for m, sent in queued if bytes(m.payload) != sent]
    while fab.links[1, 2]:  # the slow link delivers at last: node 2 ends round 0
        fab.deliver_from(1, 2)
    assert fab.colls[2].counters.rounds == 1
    assert 3 in fab.delivered  # rank 2's call: round 0's result, as nodes 0 and 1 had it
    np.testing.assert_array_equal(fab.colls[2].history[0], fab.colls[0].history[0])
    assert not overwritten, f"payloads of tags {overwritten} changed while queued"


def test_a_sync_call_made_after_a_remote_rank_left_fails_after_the_grace() -> None:
    """Rank 1 (node 1) leaves between rounds, when node 0 has no call open, so rank_gone
    sets no deadline; rank 0's next call can never complete (rank 1 never comes back) and
    nothing ever fails it: next_deadline() stays None."""
    spec = Spec(kind="allreduce", count=2, dtype="float32")
    fab = Fab(spec, (0, 1), Random(0))
    coll = fab.colls[0]
    fab.perform(0, coll.rank_gone(1, frozenset({0}), fab.tick(), grace=GRACE))
    fab.call(0, 1, np.ones(2, "float32"))
    fab.drain()
    deadline = coll.next_deadline()
    assert deadline is not None
    fab.perform(0, coll.on_timer(deadline))
    assert 1 in fab.failed


def test_a_node_that_comes_back_twice_is_told_twice() -> None:
    """Node 2 dies and comes back: the survivors tell it, its call fails.  Its daemon dies
    again and comes back with a fresh collective (a flaky node): the survivors' ``lose``
    returns early for a node already lost and ``_told`` still holds node 2, so the new
    incarnation's frames are dropped without a word and its call neither completes nor
    fails."""
    placement = (0, 1, 2)
    spec = Spec(kind="allreduce", count=2, dtype="float32", mode="solo")
    fab = Fab(spec, placement, Random(0))
    fab.kill(2)
    fab.down.discard(2)
    live = frozenset(range(3))
    for token in (98, 99):  # two incarnations of node 2's daemon
        if token == 99:
            fab.kill(2)
            fab.down.discard(2)
        fab.colls[2] = Recording(spec, job=JOB, name=NAME, node=2, ranks=placement, live=live)
        fab.call(2, token, np.ones(2, "float32"))
        fab.drain()
        assert token in fab.failed, f"call {token} of incarnation {token - 97} waits"
