"""One worker's side of a parameter-server model (fabricd/engines/ps/worker.py) without
sockets: key-range shards, one push and one pull in flight, acknowledgements and answers that
come late, twice or never, the delay gate, resends and failover."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.storage import TimedStore
from fabricd.engines.ps.worker import (
    PullDone,
    PullFailed,
    PushDone,
    SendPull,
    SendPush,
    Worker,
    shard_bounds,
)
from fabricd.errors import RemoteProtocolError, UsageError

Array = np.ndarray[Any, Any]


def worker(size: int = 6, shards: int = 2, **kw: Any) -> Worker:
    return Worker(worker=0, size=size, dtype="float64", shards=shards, **kw)


@settings(max_examples=200)
@given(st.integers(1, 500), st.integers(1, 40))
def test_shard_bounds_cover_the_range_exactly(size: int, shards: int) -> None:
    if shards > size:
        with pytest.raises(UsageError):
            shard_bounds(size, shards)
        return
    bounds = shard_bounds(size, shards)
    assert len(bounds) == shards
    assert bounds[0][0] == 0
    assert bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    lengths = [hi - lo for lo, hi in bounds]
    assert min(lengths) >= 1
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the first ones a parameter longer


def test_shard_bounds_refuses_no_shard() -> None:
    with pytest.raises(UsageError):
        shard_bounds(5, 0)


def test_push_split_over_shards_and_done_once_every_shard_acked() -> None:
    w = worker()
    sends = w.push(np.arange(6, dtype=np.float64))
    assert [type(a) for a in sends] == [SendPush, SendPush]
    for shard, send in enumerate(sends):
        assert isinstance(send, SendPush)
        assert (send.shard, send.iteration, send.base) == (shard, 0, 0)
        lo, hi = w.bounds[shard]
        decoded = ps_push.decode(send.payload, hi - lo, np.dtype("float64"))
        np.testing.assert_array_equal(decoded, np.arange(lo, hi))
    assert w.in_flight
    assert w.pushed(1, 0, 3, None) == []
    assert w.pushed(0, 0, 2, None) == [PushDone(iteration=0, versions=(2, 3), dropped=())]
    assert (w.in_flight, w.iteration) == (False, 1)


def test_second_push_before_the_first_is_acked_is_a_usage_error() -> None:
    w = worker()
    w.push(np.ones(6))
    with pytest.raises(UsageError, match="in flight"):
        w.push(np.ones(6))
    w.pushed(0, 0, 1, None)
    with pytest.raises(UsageError, match="in flight"):  # one shard still waits
        w.push(np.ones(6))
    w.pushed(1, 0, 1, None)
    assert len(w.push(np.ones(6))) == 2


@pytest.mark.parametrize(
    "gradient",
    [np.ones(5), np.ones(7), np.ones(6, np.float32), np.array([1, 2, 3, np.nan, 5, 6.0])],
)
def test_bad_gradient_refused_and_nothing_changes(gradient: Array) -> None:
    w = worker()
    with pytest.raises(UsageError):
        w.push(gradient)
    assert w.iteration == 0
    assert not w.in_flight
    assert len(w.push(np.ones(6))) == 2


def test_acknowledgements_for_pushes_not_in_flight_are_ignored() -> None:
    w = worker()
    assert w.pushed(0, 0, 1, None) == []  # nothing pushed yet
    w.push(np.ones(6))
    assert w.pushed(0, 5, 1, None) == []  # another iteration
    assert w.pushed(0, 0, 1, None) == []
    assert w.pushed(0, 0, 1, None) == []  # the same acknowledgement again
    [done] = w.pushed(1, 0, 1, None)
    assert done == PushDone(iteration=0, versions=(1, 1), dropped=())
    assert w.pushed(1, 0, 1, None) == []  # after the push is done


def test_server_drop_reported_in_push_done() -> None:
    w = worker()
    w.push(np.ones(6))
    w.pushed(0, 0, 4, "worker 0's update of iteration 0 was dropped: delay 3 > bound 1")
    [done] = w.pushed(1, 0, 1, None)
    assert isinstance(done, PushDone)
    assert len(done.dropped) == 1
    assert "delay" in done.dropped[0]
    assert w.statistics().server_dropped == 1


def test_delay_gate_drops_at_the_worker_and_push_done_says_so() -> None:
    """Bound 1: the worker computed from version 0 and heard of version 3 on shard 0: its next
    update would be dropped there, so it is not sent; shard 1 (nothing newer heard) gets it."""
    w = worker(delay_bound=1)
    w.push(np.ones(6))
    w.pushed(0, 0, 3, None)
    w.pushed(1, 0, 1, None)
    actions = w.push(np.ones(6))
    assert [a.shard for a in actions if isinstance(a, SendPush)] == [1]
    [done] = w.pushed(1, 1, 2, None)
    assert isinstance(done, PushDone)
    assert done.versions == (0, 2)
    assert len(done.dropped) == 1
    assert "delay 3 > bound 1" in done.dropped[0]
    assert w.statistics().delay_dropped == 1


def test_delay_gate_dropping_every_shard_finishes_the_push_at_once() -> None:
    w = worker(delay_bound=0)
    w.push(np.ones(6))
    w.pushed(0, 0, 2, None)
    w.pushed(1, 0, 2, None)
    [done] = w.push(np.ones(6))
    assert isinstance(done, PushDone)
    assert done.iteration == 1
    assert len(done.dropped) == 2
    assert not w.in_flight


def store_for(w: Worker, shard: int, values: Array) -> TimedStore:
    lo, hi = w.bounds[shard]
    store = TimedStore(np.zeros(hi - lo), chunk=1)
    store.publish(np.ones(hi - lo, bool), values[lo:hi])
    return store


def test_pull_gathers_every_shard_then_fresh_resets_versions() -> None:
    w = worker()
    model = np.arange(1, 7, dtype=np.float64)
    stores = [store_for(w, s, model) for s in range(2)]
    cache = np.zeros(6)
    pulls = w.pull()
    assert pulls == [SendPull(shard=0, clock=0, since=0), SendPull(shard=1, clock=0, since=0)]
    with pytest.raises(UsageError, match="in flight"):
        w.pull()
    assert w.pulled(1, 0, stores[1].pull(0), cache) == []
    assert w.pulled(1, 0, stores[1].pull(0), cache) == []  # an answer again: ignored
    assert w.pulled(0, 0, stores[0].pull(0), cache) == [PullDone(versions=(1, 1))]
    np.testing.assert_array_equal(cache, model)
    assert [a.since for a in w.pull() if isinstance(a, SendPull)] == [1, 1]
    for s in range(2):
        w.pulled(s, 0, stores[s].pull(1), cache)
    fresh = w.pull(fresh=True)
    assert [a.since for a in fresh if isinstance(a, SendPull)] == [0, 0]
    assert w.versions == [0, 0]
    other = np.zeros(6)
    for s in range(2):
        w.pulled(s, 0, stores[s].pull(0), other)
    np.testing.assert_array_equal(other, model)


def test_an_answer_sent_again_for_an_earlier_pull_of_the_same_clock_is_ignored() -> None:
    w = worker()
    model = np.arange(1, 7, dtype=np.float64)
    stores = [store_for(w, s, model) for s in range(2)]
    cache = np.zeros(6)
    w.pull()
    for s in range(2):
        w.pulled(s, 0, stores[s].pull(0), cache)
    w.pull()  # since 1, at the same clock
    late = [stores[s].pull(1) for s in range(2)]  # its answers, sent twice after a reset
    for s in range(2):
        w.pulled(s, 0, late[s], cache)
    w.pull(fresh=True)  # another array: since 0, still clock 0
    other = np.zeros(6)
    assert w.pulled(0, 0, late[0], other) == []  # built since 1: not this pull's answer
    assert w.pulled(0, 0, stores[0].pull(0), other) == []
    assert w.pulled(1, 0, stores[1].pull(0), other) == [PullDone(versions=(1, 1))]
    np.testing.assert_array_equal(other, model)


def test_malformed_answer_raises_and_leaves_the_cache() -> None:
    w = worker()
    cache = np.full(6, 9.0)
    w.pull()
    with pytest.raises(RemoteProtocolError):
        w.pulled(0, 0, b"junk", cache)
    np.testing.assert_array_equal(cache, np.full(6, 9.0))
    assert w.in_flight  # still waits for a good one


def test_refused_pull_fails_and_later_answers_are_ignored() -> None:
    w = worker()
    stores = [store_for(w, s, np.ones(6)) for s in range(2)]
    cache = np.zeros(6)
    w.pull()
    assert w.refused(1, 5, "wrong clock") == []  # not this pull
    assert w.refused(1, 0, "worker 0 was lost") == [PullFailed(shard=1, reason="worker 0 was lost")]
    assert not w.in_flight
    assert w.pulled(0, 0, stores[0].pull(0), cache) == []
    assert w.refused(0, 0, "again") == []
    np.testing.assert_array_equal(cache, np.zeros(6))


def test_resend_and_failover_send_what_is_in_flight() -> None:
    w = worker()
    assert w.resend(0) == []
    [push0, push1] = w.push(np.ones(6))
    pulls = w.pull()
    assert w.resend(0) == [push0, pulls[0]]
    w.pushed(0, 0, 1, None)
    assert w.resend(0) == [pulls[0]]
    assert w.failover(1) == [push1, pulls[1]]
    assert w.epochs == [0, 1]
    assert w.statistics().resent == 5


def test_check_frame() -> None:
    w = worker(shards=3)
    for shard in range(3):
        w.check_frame(shard)
    for shard in (-1, 3):
        with pytest.raises(RemoteProtocolError):
            w.check_frame(shard)
