"""Model distribution trees (MLfabric §10.3): every puller gets the batch's version exactly
once, from the server or from a puller that had it first; the server's link never sends more
than answering each pull itself; deltas travel from the batch's oldest cached version."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps.scheduler import UNKNOWN_BPS
from fabricd.engines.scheduling.distribution import Puller, direct, distribute
from fabricd.engines.scheduling.timelines import Network

SERVER = 0
VERSION = 10


def network(up: list[int], down: list[int]) -> Network:
    return Network(dict(enumerate(up)), dict(enumerate(down)))


def delta(v: int) -> float:
    return 10.0 * (VERSION - v)


batches = st.lists(st.integers(0, VERSION), min_size=0, max_size=8)
capacities = st.lists(st.integers(1, 20), min_size=9, max_size=9)
ks = st.one_of(st.just("auto"), st.integers(0, 4))


@settings(max_examples=150, deadline=None)
@given(
    cached=batches,
    up=capacities,
    down=capacities,
    k=ks,
    policy=st.sampled_from(["whole", "delta"]),
)
def test_every_puller_gets_the_version_once_through_a_tree(
    cached: list[int], up: list[int], down: list[int], k: object, policy: str
) -> None:
    net = network(up, down)
    pullers = [Puller(key=i, host=i + 1, cached=c) for i, c in enumerate(cached)]
    plan = distribute(
        pullers,
        net,
        server=SERVER,
        version=VERSION,
        whole=100.0,
        delta=delta,
        k=k,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
    )
    assert plan.version == VERSION
    assert sorted(h.puller.key for h in plan.hops) == [p.key for p in pullers]  # once each
    got = {SERVER: net.now}
    for hop in sorted(plan.hops, key=lambda h: h.start):
        assert hop.sender in got  # a tree rooted at the server
        assert hop.start >= got[hop.sender] - 1e-9  # the sender had the model first
        got[hop.puller.host] = hop.end
    senders = {h.sender for h in plan.hops} - {SERVER}
    assert senders <= {d.host for d in plan.distributors}
    assert plan.server_bytes == pytest.approx(sum(h.size for h in plan.hops if h.sender == SERVER))
    alone = direct(
        pullers,
        net,
        server=SERVER,
        version=VERSION,
        whole=100.0,
        delta=delta,
        policy=policy,  # type: ignore[arg-type]
    )
    assert plan.server_bytes <= alone.server_bytes + 1e-9  # never more than direct answers
    if k == "auto":  # k = 0 is the direct answer, one of the plans tried
        assert plan.last <= alone.last + 1e-9
    hops = {h.puller.host: h for h in plan.hops}
    assert [h.puller for h in plan.hops[: len(plan.distributors)]] == plan.distributors[::-1]
    for hop in plan.hops:  # sizes: each puller can apply what it gets
        own = 100.0 if policy == "whole" or not hop.puller.cached else delta(hop.puller.cached)
        if hop.sender == SERVER and hop.puller not in plan.distributors:
            assert hop.size == own
        elif policy == "delta":  # a branch carries the delta from its oldest cache
            root = hop.puller.host if hop.sender == SERVER else hop.sender
            branch = [h.puller for h in plan.hops if root in (h.sender, h.puller.host)]
            assert hop.puller.cached > 0
            assert hop.size == delta(min(p.cached for p in branch))
            assert hops[root].size == hop.size
        else:
            assert hop.size == 100.0


def test_k_zero_is_the_direct_answer_under_both_policies() -> None:
    net = network([3, 1, 2, 5, 1, 1, 4, 2, 1], [1, 2, 1, 3, 1, 2, 1, 1, 1])
    pullers = [Puller(key=i, host=i + 1, cached=c) for i, c in enumerate([0, 3, 9, 1, 0, 7])]
    for policy in ("whole", "delta"):
        common = {"server": SERVER, "version": VERSION, "whole": 100.0, "delta": delta}
        tree = distribute(pullers, net, k=0, policy=policy, **common)  # type: ignore[arg-type]
        alone = direct(pullers, net, policy=policy, **common)  # type: ignore[arg-type]
        assert tree.hops == alone.hops
        assert tree.server_bytes == alone.server_bytes


def test_a_delta_branch_is_sized_by_its_own_oldest_cache() -> None:
    """One stale cache must not make every hop carry its large delta: the server sends the
    others their own small deltas, and a distributor's branch carries its oldest cache's."""
    net = network([1] * 5, [1] * 5)
    pullers = [Puller(key=i, host=i + 1, cached=c) for i, c in enumerate([1, 9, 9, 9])]
    common = {"server": SERVER, "version": VERSION, "whole": 100.0, "delta": delta}
    tree = distribute(pullers, net, policy="delta", **common)  # type: ignore[arg-type]
    alone = direct(pullers, net, policy="delta", **common)  # type: ignore[arg-type]
    assert alone.server_bytes == pytest.approx(120.0)
    assert tree.last <= alone.last
    assert tree.server_bytes <= alone.server_bytes
    assert {h.size for h in tree.hops if h.puller.cached == 9} == {10.0}


def test_all_unknown_rates_plan_a_tree_by_size_alone() -> None:
    """A fabric the monitor has no figures for: every link at the scheduler's UNKNOWN_BPS.
    Equal links: the tree still pays off, and every puller is served once, in finite time."""
    net = Network(dict.fromkeys(range(9), UNKNOWN_BPS), dict.fromkeys(range(9), UNKNOWN_BPS))
    pullers = [Puller(key=i, host=i + 1, cached=VERSION - 1) for i in range(8)]
    tree = distribute(pullers, net, server=SERVER, version=VERSION, whole=1e9)
    alone = direct(pullers, net, server=SERVER, version=VERSION, whole=1e9)
    assert sorted(h.puller.key for h in tree.hops) == list(range(8))
    assert all(math.isfinite(h.end) for h in tree.hops)
    assert tree.distributors
    assert tree.last < alone.last
    assert tree.server_bytes < alone.server_bytes


def test_a_tree_relieves_a_slow_server_link() -> None:
    """Eight pullers, the server's uplink no faster than a worker's: sending the model eight
    times takes eight transfer times; through distributors, fewer."""
    net = network([1] * 9, [1] * 9)
    pullers = [Puller(key=i, host=i + 1, cached=VERSION - 1) for i in range(8)]
    tree = distribute(pullers, net, server=SERVER, version=VERSION, whole=10.0)
    alone = direct(pullers, net, server=SERVER, version=VERSION, whole=10.0)
    assert alone.last == pytest.approx(80.0)
    assert tree.distributors
    assert tree.last < alone.last
    assert tree.server_bytes < alone.server_bytes


def test_no_distributor_is_the_direct_answer_and_one_puller_needs_none() -> None:
    net = network([5] * 9, [1] * 9)
    pullers = [Puller(key=i, host=i + 1, cached=0) for i in range(3)]
    plan = distribute(pullers, net, server=SERVER, version=VERSION, whole=10.0, k=0)
    assert {h.sender for h in plan.hops} == {SERVER}
    one = distribute(pullers[:1], net, server=SERVER, version=VERSION, whole=10.0, k=3)
    assert one.distributors == []
    assert distribute([], net, server=SERVER, version=VERSION, whole=10.0).hops == []


def test_a_link_without_capacity_never_delivers_and_says_so() -> None:
    net = network([1, 1, 1], [1, 0, 1])
    plan = distribute(
        [Puller("a", 1, 0), Puller("b", 2, 0)], net, server=SERVER, version=1, whole=1.0, k=0
    )
    ends = {h.puller.key: h.end for h in plan.hops}
    assert ends["a"] == math.inf
    assert ends["b"] < math.inf


def test_bad_batches_are_refused() -> None:
    net = network([1] * 9, [1] * 9)
    good = [Puller("a", 1, 0)]
    for kw in ({"k": -1}, {"policy": "other"}, {"policy": "delta"}, {"whole": -1.0}):
        with pytest.raises(ValueError):  # noqa: PT011 - each says which
            distribute(good, net, **{"server": SERVER, "version": 1, "whole": 1.0, **kw})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        distribute(good * 2, net, server=SERVER, version=1, whole=1.0)
    with pytest.raises(ValueError, match="caches"):
        distribute([Puller("a", 1, 5)], net, server=SERVER, version=1, whole=1.0)
    with pytest.raises(KeyError):
        distribute([Puller("a", 99, 0)], net, server=SERVER, version=1, whole=1.0)
