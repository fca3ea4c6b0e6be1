"""Alg. 1 and Alg. 2 (MLfabric §5.1): shortest transfer first without a bound, deadlines and
drops with one; nothing planned breaks the bound; every update is planned or dropped, once."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.scheduling.ordering import (
    DEADLINE_PASSED,
    LOOK_AHEAD,
    NO_CAPACITY,
    Update,
    deadline,
    order,
)
from fabricd.engines.scheduling.timelines import Network

SERVER = 0
Mb = 1e6 / 8  # bytes in a megabit

batches = st.lists(
    st.tuples(st.integers(1, 4), st.integers(-3, 8), st.integers(0, 50)), min_size=0, max_size=8
)
capacities = st.lists(st.integers(1, 10), min_size=5, max_size=5)


def _network(up: list[int], down: list[int]) -> Network:
    return Network(dict(enumerate(up)), dict(enumerate(down)))


def _updates(batch: list[tuple[int, int, int]]) -> list[Update]:
    return [Update(k, host, version, size) for k, (host, version, size) in enumerate(batch)]


def brute_sjf(updates: list[Update], network: Network) -> list[object]:
    """Alg. 1 by hand: one ``finish`` per waiting update per step, the first of the least."""
    net, left, keys = network.copy(), list(updates), []
    while left:
        best = min(left, key=lambda u: net.finish(u.host, SERVER, u.size))
        net.reserve(best.host, SERVER, best.size)
        left.remove(best)
        keys.append(best.key)
    return keys


@settings(max_examples=120, deadline=None)
@given(batch=batches, up=capacities, down=capacities)
def test_without_a_bound_it_is_shortest_transfer_first(
    batch: list[tuple[int, int, int]], up: list[int], down: list[int]
) -> None:
    network = _network(up, down)
    updates = _updates(batch)
    before = [network.downlink(h) for h in range(5)]
    result = order(updates, network, server=SERVER, delay_bound=None, v_init=0)
    assert [network.downlink(h) for h in range(5)] == before  # the network is not touched
    assert result.dropped == []
    assert [p.update.key for p in result.planned] == brute_sjf(updates, network)
    assert [p.position for p in result.planned] == list(range(1, len(updates) + 1))
    ends = [p.transfer.end for p in result.planned]
    assert ends == sorted(ends)


@settings(max_examples=200, deadline=None)
@given(
    batch=batches,
    up=capacities,
    down=capacities,
    bound=st.integers(0, 6),
    v_init=st.integers(0, 4),
)
def test_with_a_bound_nothing_planned_breaks_it(
    batch: list[tuple[int, int, int]], up: list[int], down: list[int], bound: int, v_init: int
) -> None:
    network = _network(up, down)
    updates = _updates(batch)
    result = order(updates, network, server=SERVER, delay_bound=bound, v_init=v_init)
    planned = [p.update.key for p in result.planned]
    dropped = [u.key for u, _ in result.dropped]
    assert sorted(map(str, planned + dropped)) == sorted(str(u.key) for u in updates)  # disjoint
    for p in result.planned:
        assert p.position <= deadline(p.update, delay_bound=bound, v_init=v_init)
        assert p.position + v_init - 1 - p.update.version <= bound  # the server's count
    assert [p.position for p in result.planned] == list(range(1, len(planned) + 1))
    ends = [p.transfer.end for p in result.planned]
    assert ends == sorted(ends)  # the apply order is the arrival order
    for update, reason in result.dropped:
        if deadline(update, delay_bound=bound, v_init=v_init) <= 0:
            assert reason == DEADLINE_PASSED
    # the planned bookings are what Ordering.network holds: booking them again on the
    # original network in the same booking order ends each transfer at the same time at most
    assert result.network is not None
    assert all(math.isfinite(e) for e in ends)


def test_fig5_drops_the_slow_update_at_its_worker() -> None:
    """Fig. 5: w1 (10 Mb/s) holds g1 due first, w2 (90 Mb/s) holds g2 due at 5, the server
    takes 100 Mb/s.  g1 takes 10 s; g2, booked after it, 1.1 s: g2 would arrive first and the
    server would wait on g1, so g1 is dropped and g2 sent at once (§5.1.3)."""
    network = Network(
        {SERVER: 100 * Mb, 1: 10 * Mb, 2: 90 * Mb}, {SERVER: 100 * Mb, 1: 100 * Mb, 2: 100 * Mb}
    )
    g1 = Update("g1", host=1, version=1, size=100 * Mb)  # dl = 1
    g2 = Update("g2", host=2, version=5, size=99 * Mb)  # dl = 5
    assert network.finish(1, SERVER, g1.size) == pytest.approx(10)
    result = order([g1, g2], network, server=SERVER, delay_bound=0, v_init=0)
    assert result.dropped == [(g1, LOOK_AHEAD)]
    [only] = result.planned
    assert only.update == g2
    assert only.position == 1
    assert only.transfer.end == pytest.approx(1.1)
    # without the bound, shortest first: g2 then g1, nothing dropped
    unbounded = order([g1, g2], network, server=SERVER, delay_bound=None, v_init=0)
    assert [p.update for p in unbounded.planned] == [g2, g1]


def test_a_deadline_pulls_an_update_forward_and_a_past_one_is_dropped() -> None:
    network = Network({SERVER: 10.0, 1: 1.0, 2: 1.0}, {SERVER: 10.0, 1: 1.0, 2: 1.0})
    small = Update("small", host=2, version=10, size=1)  # behind big on its uplink
    big = Update("big", host=2, version=1, size=5)  # dl = 1 with bound 0 and v_init 0
    stale = Update("stale", host=1, version=-1, size=1)  # dl = -1: too stale already
    result = order([small, big, stale], network, server=SERVER, delay_bound=0, v_init=0)
    assert [p.update for p in result.planned] == [big, small]
    assert result.dropped == [(stale, DEADLINE_PASSED)]


def test_local_and_unknown_hosts() -> None:
    network = Network({SERVER: 1.0, 1: 1.0}, {SERVER: 1.0, 1: 1.0})
    local = Update("here", host=SERVER, version=0, size=10)
    result = order([local], network, server=SERVER, delay_bound=None, v_init=0)
    assert result.planned[0].transfer.end == 0.0
    with pytest.raises(KeyError):
        order(
            [Update("x", host=7, version=0, size=1)],
            network,
            server=SERVER,
            delay_bound=None,
            v_init=0,
        )
    with pytest.raises(ValueError, match="delay bound"):
        order([], network, server=SERVER, delay_bound=-1, v_init=0)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("delay_bound", [None, 5])
def test_a_worker_whose_uplink_carries_nothing_is_dropped_not_a_hang(
    delay_bound: int | None,
) -> None:
    """Once the live worker's update is booked, every update left ends at infinity: the pick
    must be among the waiting ones (an argmin over all picked the booked one for ever; the
    review found it)."""
    net = Network({0: 10.0, 2: 10.0, 3: 0.0}, {0: 10.0, 2: 10.0, 3: 10.0})
    plan = order(
        [Update("a", 2, 0, 10.0), Update("b", 3, 0, 10.0)],
        net,
        server=0,
        delay_bound=delay_bound,
        v_init=0,
    )
    assert [p.update.key for p in plan.planned] == ["a"]
    assert [(u.key, why) for u, why in plan.dropped] == [("b", NO_CAPACITY)]
