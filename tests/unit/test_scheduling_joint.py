"""Multi-server joint reservation (MLfabric §10.2, eq. 18): an update's components are booked
on all their servers together and picked by the last one's end; with one server it is Alg. 2
itself; an update is planned whole or dropped whole, where ordering each server on its own
applies some updates to part of the model only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.scheduling.joint import JointUpdate, book, order_joint
from fabricd.engines.scheduling.ordering import Update, order
from fabricd.engines.scheduling.timelines import Network

S1, S2 = 5, 6  # the servers' hosts; workers are hosts 0..4

batches = st.lists(
    st.tuples(st.integers(0, 4), st.integers(-3, 8), st.integers(0, 50), st.integers(0, 50)),
    max_size=7,
)
capacities = st.lists(st.integers(1, 10), min_size=7, max_size=7)
bounds = st.one_of(st.none(), st.integers(0, 6))


def network(up: list[int], down: list[int]) -> Network:
    return Network(dict(enumerate(up)), dict(enumerate(down)))


@settings(max_examples=120, deadline=None)
@given(batch=batches, up=capacities, down=capacities, bound=bounds)
def test_one_component_is_alg_2_itself(
    batch: list[tuple[int, int, int, int]], up: list[int], down: list[int], bound: int | None
) -> None:
    net = network(up, down)
    single = [Update(k, h, v, a) for k, (h, v, a, _) in enumerate(batch)]
    joint = [JointUpdate(k, h, v, {S1: a}) for k, (h, v, a, _) in enumerate(batch)]
    alone = order(single, net, server=S1, delay_bound=bound, v_init=2)
    together = order_joint(joint, net, delay_bound=bound, v_init=2)
    assert {p.update.key for p in together.planned} == {p.update.key for p in alone.planned}
    booked = {p.update.key: p.transfers[S1] for p in together.planned}
    assert booked == {p.update.key: p.transfer for p in alone.planned}  # the same bookings
    assert sorted((u.key, why) for u, why in together.dropped) == sorted(
        (u.key, why) for u, why in alone.dropped
    )


@settings(max_examples=120, deadline=None)
@given(batch=batches, up=capacities, down=capacities, bound=bounds)
def test_every_update_is_planned_whole_or_dropped_whole_once(
    batch: list[tuple[int, int, int, int]], up: list[int], down: list[int], bound: int | None
) -> None:
    net = network(up, down)
    updates = [JointUpdate(k, h, v, {S1: a, S2: b}) for k, (h, v, a, b) in enumerate(batch)]
    before = (net.downlink(S1), net.downlink(S2))
    result = order_joint(updates, net, delay_bound=bound, v_init=2)
    assert (net.downlink(S1), net.downlink(S2)) == before  # the network is not touched
    keys = [p.update.key for p in result.planned] + [u.key for u, _ in result.dropped]
    assert len(keys) == len(updates)
    assert set(keys) == set(range(len(updates)))
    for p in result.planned:
        assert set(p.transfers) == {S1, S2}
        assert p.end == max(t.end for t in p.transfers.values())
    for p in result.planned:
        for server, transfer in p.transfers.items():
            assert (transfer.src, transfer.dst) == (p.update.host, server)
            assert transfer.size == p.update.sizes[server]
    if bound is not None:  # every server applies within the bound, in its arrival order
        for server in (S1, S2):
            arriving = sorted(result.planned, key=lambda p: p.transfers[server].end)
            for position, p in enumerate(arriving, 1):
                assert p.update.version + bound - 2 >= position


def test_the_papers_example_independent_orders_apply_parts_joint_applies_wholes() -> None:
    """§10.2: worker 0's part for server 1 is small and for server 2 large, worker 1's the
    other way round; one position each. Ordered per server, each server takes the update
    whose part for it is shortest: worker 0's on server 1 and worker 1's on server 2, each
    update applied to half the model. Joint (eq. 18): the update whose parts all end first,
    worker 1's, goes whole, and worker 0's is dropped whole."""
    net = network([1] * 7, [1] * 7)
    a = JointUpdate("w0", 0, 1, {S1: 1.0, S2: 100.0})
    b = JointUpdate("w1", 1, 1, {S1: 10.0, S2: 10.0})
    per_server = {
        server: {
            p.update.key
            for p in order(
                [Update(u.key, u.host, u.version, u.sizes[server]) for u in (a, b)],
                net,
                server=server,
                delay_bound=0,
                v_init=0,
            ).planned
        }
        for server in (S1, S2)
    }
    assert per_server == {S1: {"w0"}, S2: {"w1"}}  # each update on one server only
    joint = order_joint([a, b], net, delay_bound=0, v_init=0)
    assert [p.update.key for p in joint.planned] == ["w1"]
    assert [u.key for u, _ in joint.dropped] == ["w0"]


def test_eq_18_the_last_component_decides() -> None:
    net = network([1] * 7, [1, 1, 1, 1, 1, 10, 1])  # server 1's downlink fast, server 2's slow
    parts = {S1: 1.0, S2: 5.0}
    end, transfers = book(net.copy(), JointUpdate("g", 0, 0, parts))
    assert end == max(t.end for t in transfers.values())
    assert transfers[S2].end > transfers[S1].end


def test_bad_updates_are_refused() -> None:
    net = network([1] * 7, [1] * 7)
    with pytest.raises(ValueError, match="delay bound"):
        order_joint([], net, delay_bound=-1, v_init=0)
    with pytest.raises(ValueError, match="components"):
        order_joint([JointUpdate("g", 0, 0, {})], net, delay_bound=None, v_init=0)
    with pytest.raises(KeyError):
        order_joint([JointUpdate("g", 0, 0, {99: 1.0})], net, delay_bound=None, v_init=0)


def test_skewed_servers_independent_counts_differ_joint_counts_are_equal() -> None:
    """§10.2's g1/g2: small parts to server 1, large ones to server 2 (whose downlink is the
    slow one); worker 0's uplink is slow.  Ordered per server, server 1 drops worker 0's part
    by the look-ahead (worker 1's small part would end first) while server 2, whose downlink
    serialises both, keeps both: server 1 applies one update, server 2 two, so server 1's
    part of the model is updated less often.  Joint plans give every server the same count."""
    net = Network(
        {0: 1, 1: 10, 2: 10, 3: 10, 4: 10, S1: 10, S2: 10}, {**dict.fromkeys(range(6), 10), S2: 1}
    )
    g1 = JointUpdate("g1", 0, 0, {S1: 1.0, S2: 10.0})
    g2 = JointUpdate("g2", 1, 1, {S1: 1.0, S2: 10.0})
    counts = {
        server: len(
            order(
                [Update(u.key, u.host, u.version, u.sizes[server]) for u in (g1, g2)],
                net,
                server=server,
                delay_bound=1,
                v_init=0,
            ).planned
        )
        for server in (S1, S2)
    }
    assert counts == {S1: 1, S2: 2}
    joint = order_joint([g1, g2], net, delay_bound=1, v_init=0)
    per_server = {s: sum(s in p.transfers for p in joint.planned) for s in (S1, S2)}
    assert per_server[S1] == per_server[S2] == len(joint.planned) >= 1


@settings(max_examples=80, deadline=None)
@given(
    batch=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(-2, 6),
            st.lists(st.integers(0, 40), min_size=4, max_size=4),
        ),
        max_size=6,
    ),
    servers=st.integers(2, 4),
    up=capacities,
    down=capacities,
    bound=bounds,
)
def test_joint_plans_apply_every_part_of_the_model_equally_often(
    batch: list[tuple[int, int, list[int]]],
    servers: int,
    up: list[int],
    down: list[int],
    bound: int | None,
) -> None:
    """2-4 servers (hosts 3..): every server applies the same updates (no part starved), and
    each planned update's last component's end is eq. 18's ``t_en(g)``."""
    net = Network(dict(enumerate(up)), dict(enumerate(down)))
    hosts = range(3, 3 + servers)
    updates = [
        JointUpdate(k, h, v, {s: float(sizes[s - 3]) for s in hosts})
        for k, (h, v, sizes) in enumerate(batch)
    ]
    result = order_joint(updates, net, delay_bound=bound, v_init=1)
    applied = {s: {p.update.key for p in result.planned if s in p.transfers} for s in hosts}
    assert all(keys == applied[3] for keys in applied.values())
    assert len(applied[3]) == len(result.planned)
    for p in result.planned:
        assert p.end == max(t.end for t in p.transfers.values())


def test_an_update_for_one_server_is_placed_among_that_servers_updates_only() -> None:
    """Two updates with a part each for a different server, deadline 1: each server applies
    exactly one, first, so neither is late (a batch-wide position dropped the second; the
    review found it)."""
    net = Network(dict.fromkeys(range(4), 10.0), dict.fromkeys(range(4), 10.0))
    updates = [JointUpdate("a", 0, 0, {2: 10.0}), JointUpdate("b", 1, 0, {3: 10.0})]
    plan = order_joint(updates, net, delay_bound=1, v_init=0)
    assert sorted(p.update.key for p in plan.planned) == ["a", "b"]
    assert plan.dropped == []
