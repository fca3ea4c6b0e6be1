"""Review findings on the NOTIFY-ACK engine (fabricd/engines/stochastic/notify_ack.py): each test
is the
smallest case of one bug, driving the reducers by hand (no fabric)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fabricd.engines.stochastic import graphs
from fabricd.engines.stochastic.notify_ack import UPDATE, Action, Reduced, Reducer, SendUpdate, Sync
from fabricd.errors import UsageError


def reducer(rank: int, sync: Sync, nbytes: int = 8) -> Reducer:
    return Reducer(rank=rank, graph=graphs.chain(2), sync=sync, dtype="float64", nbytes=nbytes)


def update_of(actions: list[Action]) -> SendUpdate:
    [update] = [a for a in actions if isinstance(a, SendUpdate)]
    return update


def used(actions: list[Action]) -> int:
    """The inputs the call's reduce used (it is the last action)."""
    reduced = actions[-1]
    assert isinstance(reduced, Reduced)
    return reduced.inputs


def deliver(receiver: Reducer, update: SendUpdate) -> list[Action]:
    """Land ``update`` whole at ``receiver`` (rank 0 to rank 1), then its NOTIFY if it has one."""
    view = receiver.landing(0, update.round, len(update.payload))
    assert view is not None
    view[:] = update.payload
    actions = receiver.landed(0, update.round, 0.0)
    if update.notify:
        actions += receiver.message(0, UPDATE, update.round, 0.0)
    return actions


def test_a_reset_after_the_footers_first_byte_does_not_strand_a_waiting_notify() -> None:
    # the NOTIFY overtook its update; the update then landed up to the first byte of its
    # footer, which already reads "round 0" (version 1 over 0, little-endian): the slot looks
    # whole, but landed() never came before the links reset.  The copy resume() sends must
    # land again, or the NOTIFY waits for a landed() that never comes: the round hangs.
    sender, receiver = reducer(0, Sync.NOTIFY_ACK), reducer(1, Sync.NOTIFY_ACK)
    model = np.zeros(1)
    receiver.call(model, 0.0)
    update = update_of(sender.call(np.full(1, 2.0), 0.0))
    view = receiver.landing(0, 0, len(update.payload))
    assert view is not None
    assert receiver.message(0, UPDATE, 0, 0.0) == []  # held until the update landed
    view[:-7] = update.payload[:-7]
    receiver.interrupted(0)
    sender.interrupted(1)
    actions = deliver(receiver, update_of(sender.resume(1)))
    assert [a for a in actions if isinstance(a, Reduced)] == [
        Reduced(round=0, inputs=1, torn=0, stale=0)
    ]
    np.testing.assert_array_equal(model, [1.0])
    assert receiver.statistics().notifies == 1


def test_async_forgets_a_lost_ranks_last_update_when_it_comes_back_restarted() -> None:
    # the old rank 0's version 3 was used; rank 0 is lost, comes back restarted and counts
    # from version 1 again: its old update must not be used a second time, and its new ones
    # must not be stale until they pass version 3
    old, receiver = reducer(0, Sync.ASYNC), reducer(1, Sync.ASYNC)
    for value in (1.0, 2.0, 3.0):
        deliver(receiver, update_of(old.call(np.full(1, value), 0.0)))
    assert used(receiver.call(np.zeros(1), 0.0)) == 1
    receiver.lose(0, "left", 0.0)
    receiver.rejoined(0)
    assert used(receiver.call(np.zeros(1), 0.0)) == 0
    new = reducer(0, Sync.ASYNC)
    deliver(receiver, update_of(new.call(np.full(1, 8.0), 0.0)))
    model = np.zeros(1)
    assert used(receiver.call(model, 0.0)) == 1
    np.testing.assert_array_equal(model, [4.0])


def test_async_rejoined_of_a_rank_never_lost_uses_nothing_twice() -> None:
    # the stochastic service calls rejoined() on every RankJoined, also when a rank's node came back
    # the same daemon (resume): its versions go on, so what was used stays used
    sender, receiver = reducer(0, Sync.ASYNC), reducer(1, Sync.ASYNC)
    deliver(receiver, update_of(sender.call(np.full(1, 2.0), 0.0)))
    assert used(receiver.call(np.zeros(1), 0.0)) == 1
    receiver.rejoined(0)
    assert used(receiver.call(np.zeros(1), 0.0)) == 0
    deliver(receiver, update_of(sender.call(np.full(1, 4.0), 0.0)))
    assert used(receiver.call(np.zeros(1), 0.0)) == 1


def test_a_non_contiguous_model_is_averaged_in_place() -> None:
    sender, receiver = reducer(0, Sync.ASYNC, 32), reducer(1, Sync.ASYNC, 32)
    values = np.arange(4.0).reshape(2, 2)
    deliver(receiver, update_of(sender.call(values.T, 0.0)))  # Fortran order: (0, 2, 1, 3)
    model = np.full((2, 2), 2.0).T
    receiver.call(model, 0.0)
    np.testing.assert_array_equal(model, (values.T + 2.0) / 2)


@pytest.mark.parametrize("sync", list(Sync))
def test_a_read_only_model_is_refused_by_the_call(sync: Sync) -> None:
    # not later, from the reduce: under notify-ack that runs inside message(), a peer's frame
    model: np.ndarray[Any, Any] = np.zeros(1)
    model.setflags(write=False)
    with pytest.raises(UsageError, match="writeable"):
        reducer(1, sync).call(model, 0.0)


def test_an_update_sent_again_counts_its_notify_as_resent_too() -> None:
    """``resent`` counted an update sent again after a reset as one, but it goes out with its
    NOTIFY (two frames: UPDATE on the data link, NOTIFY on the control link), and a receiver
    that had both drops both, counting two ``duplicates``.  So duplicates could pass resent
    (the fault test's invariant, duplicates <= resent, failed now and then: 147 > 136) though
    every copy was one a resume sent.  Each frame sent again counts now."""
    sender, receiver = reducer(0, Sync.NOTIFY_ACK), reducer(1, Sync.NOTIFY_ACK)
    receiver.call(np.zeros(1), 0.0)
    update = update_of(sender.call(np.full(1, 2.0), 0.0))
    assert update.notify
    deliver(receiver, update)  # reduced; its ACK is lost with the links
    receiver.interrupted(0)
    sender.interrupted(1)
    again = update_of(sender.resume(1))
    assert again.notify
    assert receiver.landing(0, again.round, len(again.payload)) is None  # had it: dropped
    assert receiver.message(0, UPDATE, again.round, 0.0) == []  # and its NOTIFY
    assert receiver.statistics().duplicates == 2
    assert sender.statistics().resent == 2
