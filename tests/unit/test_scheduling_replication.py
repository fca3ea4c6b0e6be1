"""Bounded-divergence replication (fabricd/engines/scheduling/replication.py, MLfabric §3.3,
§5.3) without sockets: the divergence bound against the update rule run on real vectors, and
the batch planner's promises under hypothesis.

What must hold (issue 25): the bound is never below the true divergence of a server that leads
its replica (eq. 2 with momentum, run on numpy vectors); a batch sends the replica a prefix of
the one order, punts the rest, and at ``T_last`` (the server's delayed last transfer's commit,
when it is delayed) the lead of the replica's planned prefix is within the bound.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.scheduling.ordering import Update
from fabricd.engines.scheduling.replication import Bound, divergence, replicate, stepped
from fabricd.engines.scheduling.timelines import Network

Array = np.ndarray[Any, Any]
MOMENTA = st.sampled_from([0.0, 0.5, 0.9, 0.99])


def run(history: Array, updates: list[Array], momentum: float) -> tuple[Array, Array]:
    """Eq. 2 from ``w = 0`` with last step ``history``: the model and the last step after
    ``updates``."""
    w, step = np.zeros_like(history), history.copy()
    for u in updates:
        step = momentum * step + u
        w = w + step
    return w, step


@settings(max_examples=300, deadline=None)
@given(
    MOMENTA,
    st.integers(0, 12),
    st.integers(0, 6),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
)
def test_the_bound_is_never_below_the_true_divergence(
    momentum: float, replica_has: int, lead: int, dims: int, seed: int
) -> None:
    """A server and a replica apply the same updates in the same order from the same start;
    the server is ``lead`` updates ahead.  The bound from the norms alone (the replica's
    history bounded step by step with :func:`stepped`) is at least ``||w_s - w_r||``."""
    rng = np.random.default_rng(seed)
    h0 = rng.normal(size=dims)
    updates = [rng.normal(size=dims) * rng.uniform(0, 3) for _ in range(replica_has + lead)]
    w_r, step_r = run(h0, updates[:replica_has], momentum)
    w_s, _ = run(h0, updates, momentum)
    history = float(np.linalg.norm(h0))
    for u in updates[:replica_has]:
        history = stepped(history, float(np.linalg.norm(u)), momentum)
    assert history >= np.linalg.norm(step_r) - 1e-9
    norms = [float(np.linalg.norm(u)) for u in updates[replica_has:]]
    bound = divergence(history, norms, momentum)
    assert bound >= np.linalg.norm(w_s - w_r) - 1e-9 * max(1.0, bound)


def test_the_bound_is_eq_7s_and_tight_when_everything_points_one_way() -> None:
    """Two updates ahead: (gamma + gamma^2) h + (1 + gamma) u1 + u2 (eq. 7); with every vector
    along one axis the bound is the divergence itself."""
    g = 0.5
    assert divergence(2.0, [3.0, 5.0], g) == pytest.approx((g + g * g) * 2 + (1 + g) * 3 + 5)
    e = np.array([1.0, 0.0])
    w_s, _ = run(2.0 * e, [3.0 * e, 5.0 * e], g)
    assert divergence(2.0, [3.0, 5.0], g) == pytest.approx(np.linalg.norm(w_s))
    assert divergence(7.0, [], g) == 0.0
    assert divergence(7.0, [1.0, 1.0], 0.0) == 2.0  # no momentum: the sum of the norms


@pytest.mark.parametrize(
    ("history", "steps", "momentum"), [(-1, [], 0.5), (1, [-1], 0.5), (1, [], 1.0)]
)
def test_bad_norms_or_momentum_are_refused(
    history: float, steps: list[float], momentum: float
) -> None:
    with pytest.raises(ValueError, match=r"momentum|norms"):
        divergence(history, steps, momentum)


# -- a batch -----------------------------------------------------------------------------------
SERVER, REPLICA = 0, 1
HOSTS = range(8)


def updates_of(sizes: list[tuple[int, float, float]]) -> list[Update]:
    return [Update(key=k, host=h, version=0, size=s, norm=n) for k, (h, s, n) in enumerate(sizes)]


UPDATE = st.tuples(st.integers(2, 7), st.sampled_from([1.0, 4.0, 16.0]), st.floats(0, 5))
RATES = st.lists(st.sampled_from([1.0, 2.0, 8.0]), min_size=len(HOSTS), max_size=len(HOSTS))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(UPDATE, max_size=8),
    st.lists(UPDATE, max_size=4),
    RATES,
    RATES,
    MOMENTA,
    st.one_of(st.none(), st.floats(0, 30)),
    st.one_of(st.none(), st.integers(0, 6)),
    st.lists(st.integers(2, 7), max_size=2, unique=True),
    st.floats(0, 3),
)
def test_a_batch_sends_a_prefix_and_keeps_the_bound_at_t_last(
    batch_sizes: list[tuple[int, float, float]],
    lag_sizes: list[tuple[int, float, float]],
    up: list[float],
    down: list[float],
    momentum: float,
    norm_bound: float | None,
    count_bound: int | None,
    aggregators: list[int],
    history: float,
) -> None:
    network = Network(dict(zip(HOSTS, up, strict=True)), dict(zip(HOSTS, down, strict=True)))
    lagging = updates_of(lag_sizes)
    fresh = [
        Update(key=100 + k, host=h, version=0, size=s, norm=n)
        for k, (h, s, n) in enumerate(batch_sizes)
    ]
    batch = [(u, 1.0 + i) for i, u in enumerate(fresh)]  # commits at the server, in order
    bound = Bound(norm=norm_bound, updates=count_bound)
    aggregators = aggregators if momentum == 0 else []  # (sums break the bound: below)
    plan = replicate(
        batch,
        lagging,
        network,
        replica=REPLICA,
        aggregators=aggregators,
        history=history,
        momentum=momentum,
        bound=bound,
    )
    order = [*lagging, *fresh]
    m = len(plan.sent)
    assert [p.update for p in plan.sent] == order[:m]
    assert plan.punted == order[m:]
    for group in plan.groups:  # a group sent is whole
        assert all(member in plan.sent for member in group.members)
    h = history
    for u in order[:m]:
        h = stepped(h, u.norm, momentum)
    assert plan.history == pytest.approx(h)
    assert plan.lead == pytest.approx(divergence(h, [u.norm for u in order[m:]], momentum))
    # when each copy reaches the replica: straight, or with its group's forward
    grouped = {id(x): g for g in plan.groups for x in g.members}
    arrives = [
        grouped[id(p)].forward.end if id(p) in grouped else p.transfer.end for p in plan.sent
    ]
    for p in plan.sent:  # a copy sent goes straight to the replica or inside a group sent
        assert p.transfer.dst == REPLICA or id(p) in grouped
    has_prefix = max(arrives, default=network.now)
    t_last = batch[-1][1] if batch else math.inf
    assert not plan.unreachable  # every rate here is > 0
    if plan.delay is not None:
        key, start = plan.delay
        assert key == fresh[-1].key
        assert bound.holds(h, [u.norm for u in order[m:]], momentum)
        assert start == pytest.approx(has_prefix)  # when the replica has the prefix sent
    else:
        # the longest prefix the replica has by T_last (groups whole) went, and the bound holds
        assert has_prefix <= t_last or not batch
        assert not batch or bound.holds(h, [u.norm for u in order[m:]], momentum)
        if m < len(order):
            later = replicate(
                batch,
                lagging,
                network,
                replica=REPLICA,
                aggregators=aggregators,
                history=history,
                momentum=momentum,
                bound=Bound(),
            )
            assert len(later.sent) == m  # without a bound: the same prefix, no longer
    if not batch:
        assert plan.punted == []  # an idle server's replica gets every copy
    if norm_bound is None and count_bound is None:
        assert plan.delay is None


def test_a_tight_bound_delays_the_servers_last_transfer_until_the_replica_caught_up() -> None:
    """Every host 1 B/s: the server commits its three updates by 1.5 s, the replica's copies
    share its one downlink and arrive at 1, 2 and 3 s.  A bound of zero asks the replica to
    have everything when the server has: the server's last transfer waits for it."""
    rates = dict.fromkeys(HOSTS, 1.0)
    network = Network(rates, rates)
    fresh = [Update(key=k, host=2 + k, version=0, size=1.0, norm=1.0) for k in range(3)]
    batch = [(u, 0.5 + 0.5 * i) for i, u in enumerate(fresh)]
    plan = replicate(
        batch,
        [],
        network,
        replica=REPLICA,
        aggregators=[],
        history=0.0,
        momentum=0.0,
        bound=Bound(norm=0.0),
    )
    assert plan.punted == []
    assert plan.delay is not None
    assert plan.delay[0] == 2
    assert plan.delay[1] == pytest.approx(3.0)  # the replica has all three at 3 s
    assert plan.lead == 0.0


def test_a_loose_bound_punts_what_arrives_after_t_last() -> None:
    """The same batch with room for two updates of lead: nothing is delayed; what the replica
    would not have by the server's last commit waits for the next batch."""
    rates = dict.fromkeys(HOSTS, 1.0)
    network = Network(rates, rates)
    fresh = [Update(key=k, host=2 + k, version=0, size=1.0, norm=1.0) for k in range(3)]
    batch = [(u, 0.5 + 0.5 * i) for i, u in enumerate(fresh)]  # the server is done at 1.5 s
    plan = replicate(
        batch,
        [],
        network,
        replica=REPLICA,
        aggregators=[],
        history=0.0,
        momentum=0.0,
        bound=Bound(updates=2),
    )
    assert plan.delay is None
    assert [p.update.key for p in plan.sent] == [0]  # the first copy arrives at 1 s
    assert [u.key for u in plan.punted] == [1, 2]


def test_with_momentum_the_replicas_copies_are_not_summed() -> None:
    """A sum applied as one step is not its members one by one under momentum (the server
    stepping u, u and the replica u + u end 0.9 |u| apart at gamma 0.9): refused."""
    u = np.array([1.0, 0.0])
    apart, _ = run(np.zeros(2), [u, u], 0.9)
    together, _ = run(np.zeros(2), [u + u], 0.9)
    assert np.linalg.norm(apart - together) == pytest.approx(0.9)
    rates = dict.fromkeys(HOSTS, 1.0)
    with pytest.raises(ValueError, match="momentum"):
        replicate(
            [],
            [],
            Network(rates, rates),
            replica=REPLICA,
            aggregators=[2],
            history=0.0,
            momentum=0.9,
            bound=Bound(),
        )


def test_a_replica_no_link_reaches_is_given_up_not_waited_for() -> None:
    """Its downlink at zero, a bound that needs a copy there: no delay for ever (a dead replica
    must not stall its server); the plan says the replica is unreachable."""
    up = dict.fromkeys(HOSTS, 1.0)
    network = Network(up, up | {REPLICA: 0.0})
    fresh = [Update(key=k, host=2 + k, version=0, size=1.0, norm=1.0) for k in range(2)]
    plan = replicate(
        [(u, 1.0) for u in fresh],
        [],
        network,
        replica=REPLICA,
        aggregators=[],
        history=0.0,
        momentum=0.0,
        bound=Bound(norm=1.0),
    )
    assert plan.delay is None
    assert plan.unreachable
    assert plan.sent == []


@pytest.mark.parametrize(
    "bound",
    [{"norm": -1.0}, {"norm": math.nan}, {"updates": -1}],
    ids=["negative norm", "nan", "negative count"],
)
def test_a_bad_bound_is_refused(bound: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Bound(**bound)  # type: ignore[arg-type]


@pytest.mark.parametrize(("history", "steps"), [(math.inf, []), (0.0, [math.inf])])
def test_an_infinite_norm_is_refused(history: float, steps: list[float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        divergence(history, steps, 0.5)


def test_an_idle_servers_copies_go_unless_no_link_reaches_the_replica() -> None:
    up = dict.fromkeys(HOSTS, 1.0)
    lagging = [Update(key=k, host=2 + k, version=0, size=1.0, norm=1.0) for k in range(2)]
    for down, sent in ((1.0, 2), (0.0, 0)):
        network = Network(up, up | {REPLICA: down})
        plan = replicate(
            [],
            lagging,
            network,
            replica=REPLICA,
            aggregators=[],
            history=0.0,
            momentum=0.0,
            bound=Bound(updates=5),
        )
        assert len(plan.sent) == sent
        assert plan.unreachable == (sent == 0)
        assert plan.delay is None
