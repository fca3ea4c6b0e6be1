"""The sgd rule's delay-adaptive step size (``lr_delay="adaptive"``; AdaDelay, MLfabric's [31],
§3.1 eq. 3-4, §10.4 eq. 21): ``alpha(t, tau) = lr sqrt(t0 / (t0 + t + tau))``, its values and
shape, how one :class:`Apply` steps with it, its survival through the rule's state, and through
a shard server (fabricd/engines/ps/server.py): a stale update moves the model less than a fresh
one, and a replica, a late-joining replica and a promoted one step exactly as the primary; and a
step size that diverges under delay converges with it (in versions, no clock)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.client.ps import open_request
from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.consistency import (
    SGD,
    Apply,
    Consistency,
    Coordinator,
    Update,
    restore_rule,
    rule_state,
    step_model,
    update_rule,
)
from fabricd.engines.ps.filters import Push
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import Acked, Forward, Snapshot
from fabricd.errors import UsageError

Array = np.ndarray[Any, Any]
SIZE = 3


def adaptive(lr: float = 0.5, momentum: float = 0.0, t0: float | None = None) -> SGD:
    return SGD(lr=lr, momentum=momentum, lr_delay="adaptive", lr_t0=t0)


def apply_of(version: int, *delays: int, scale: float = 1.0) -> Apply:
    """An :class:`Apply` making ``version`` from one update per delay (worker i's values
    ``scale * (i + 1)``)."""
    updates = tuple(
        Update(
            worker=i,
            iteration=0,
            base=version - 1 - d,
            delay=d,
            values=np.full(SIZE, scale * (i + 1)),
        )
        for i, d in enumerate(delays)
    )
    return Apply(version=version, iteration=0, updates=updates)


# -- alpha(t, tau) -----------------------------------------------------------------------------
def test_alpha_values() -> None:
    rule = adaptive(lr=0.5, t0=4.0)
    assert rule.rate(0, 0) == 0.5  # lr stays the initial step size
    assert rule.rate(12, 0) == pytest.approx(0.25)  # halves after 3 t0 versions
    assert rule.rate(8, 4) == rule.rate(12, 0)  # tau versions stale steps as tau versions later
    assert rule.rate(5, 2) == pytest.approx(0.5 * math.sqrt(4 / 11))
    papers = adaptive(lr=2.0)  # t0 = 1: [31]'s count from 1, 1/alpha = c sqrt(t + tau), c = 1/lr
    assert papers.rate(0, 0) == 2.0
    assert papers.rate(3, 0) == pytest.approx(1.0)
    assert papers.rate(1, 2) == pytest.approx(1 / (0.5 * math.sqrt(1 + 1 + 2)))


def test_alpha_is_lr_without_lr_delay() -> None:
    rule = SGD(lr=0.3, momentum=0.5)
    assert {rule.rate(t, tau) for t in range(5) for tau in range(5)} == {0.3}


@given(
    lr=st.floats(1e-4, 10.0),
    t0=st.floats(1e-2, 1e4),
    t=st.integers(0, 10**6),
    tau=st.integers(0, 10**4),
)
def test_alpha_decreases_in_delay_and_version_and_never_exceeds_lr(
    lr: float, t0: float, t: int, tau: int
) -> None:
    rule = adaptive(lr=lr, t0=t0)
    assert 0 < rule.rate(t, tau + 1) < rule.rate(t, tau) <= lr
    assert rule.rate(t + 1, tau) < rule.rate(t, tau)


# -- one Apply's step --------------------------------------------------------------------------
def test_a_stale_update_steps_less_than_a_fresh_one() -> None:
    fresh, stale = np.zeros(SIZE), np.zeros(SIZE)
    adaptive(t0=2.0).apply_updates(fresh, apply_of(6, 0))  # applied to version 5, delay 0
    adaptive(t0=2.0).apply_updates(stale, apply_of(6, 4))  # the same gradient, 4 stale
    np.testing.assert_allclose(fresh, -0.5 * math.sqrt(2 / 7) * np.ones(SIZE))
    np.testing.assert_allclose(stale, -0.5 * math.sqrt(2 / 11) * np.ones(SIZE))
    assert np.linalg.norm(stale) < np.linalg.norm(fresh)


def test_bsp_sum_of_fresh_updates_steps_with_alpha_t_0() -> None:
    """Every push of a BSP iteration has delay 0: the sum steps with alpha(t, 0)."""
    model = np.zeros(SIZE)
    adaptive(t0=1.0).apply_updates(model, apply_of(4, 0, 0, 0))  # t = 3
    np.testing.assert_array_equal(model, -(0.5 * math.sqrt(1 / 4)) * np.full(SIZE, 6.0))


def test_each_update_of_an_apply_gets_its_own_alpha_and_momentum_carries_on() -> None:
    rule = adaptive(lr=0.5, momentum=0.5, t0=1.0)
    model = np.zeros(SIZE)
    rule.apply_updates(model, apply_of(1, 0))  # t = 0: alpha = lr
    np.testing.assert_allclose(model, -0.5)
    rule.apply_updates(model, apply_of(3, 0, 1))  # t = 2: worker 0 fresh, worker 1 1 stale
    alpha0, alpha1 = 0.5 * math.sqrt(1 / 3), 0.5 * math.sqrt(1 / 4)
    step = 0.5 * -0.5 - (alpha0 * 1 + alpha1 * 2)
    np.testing.assert_allclose(model, -0.5 + step)


def test_without_lr_delay_step_model_is_todays_sgd_bit_for_bit() -> None:
    a, b = np.linspace(-1, 1, SIZE), np.linspace(-1, 1, SIZE)
    ra, rb = SGD(lr=0.1, momentum=0.9), SGD(lr=0.1, momentum=0.9)
    for version in range(1, 5):
        action = apply_of(version, 0, version - 1, scale=0.3)
        step_model(ra, a, action)
        rb.apply(b, action.combined())
    np.testing.assert_array_equal(a, b)


def test_state_round_trip_steps_on_identically() -> None:
    """What survives a snapshot (rule_state/restore_rule) is enough: alpha comes from each
    Apply, so a restored rule steps on bit for bit like the one that never stopped."""
    coordinator = Coordinator(workers=[0, 1], consistency=Consistency.ASYNC)
    applies: list[Apply] = []
    for it in range(6):  # worker 1 always computes from version 0's neighbourhood: stale
        for w in (0, 1):
            base = coordinator.version if w == 0 else max(0, coordinator.version - 3)
            [action] = coordinator.push(w, it, base, np.full(SIZE, 1.0 + w + it), now=0.0)
            assert isinstance(action, Apply)
            applies.append(action)
    assert any(u.delay > 0 for a in applies for u in a.updates)
    whole, rule = np.zeros(SIZE), adaptive(momentum=0.7, t0=3.0)
    for action in applies:
        step_model(rule, whole, action)
    half, first = np.zeros(SIZE), adaptive(momentum=0.7, t0=3.0)
    for action in applies[:5]:
        step_model(first, half, action)
    second = update_rule("sgd", lr=0.5, momentum=0.7, lr_delay="adaptive", lr_t0=3.0)
    restore_rule(second, rule_state(first), half)
    for action in applies[5:]:
        step_model(second, half, action)
    np.testing.assert_array_equal(half, whole)


@pytest.mark.parametrize(
    ("rule", "kwargs", "why"),
    [
        ("sgd", {"lr": 0.1, "lr_delay": "fast"}, "one of adaptive"),
        ("sgd", {"lr": 0.1, "lr_t0": 10.0}, "belongs to lr_delay"),
        ("sgd", {"lr": 0.1, "lr_delay": "adaptive", "lr_t0": 0.0}, "finite number > 0"),
        ("sgd", {"lr": 0.1, "lr_delay": "adaptive", "lr_t0": math.inf}, "finite number > 0"),
        ("sum", {"lr_delay": "adaptive"}, 'belong to update_rule="sgd"'),
        ("sum", {"lr_t0": 5.0}, 'belong to update_rule="sgd"'),
        (lambda w, u: None, {"lr_delay": "adaptive"}, 'belong to update_rule="sgd"'),
    ],
)
def test_lr_delay_settings_are_checked(rule: Any, kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(UsageError, match=why):
        update_rule(rule, **kwargs)


# -- convergence under delay ----------------------------------------------------------------
def descend(rule: SGD, *, workers: int = 8, versions: int = 800) -> tuple[float, int]:
    """Async SGD on ``0.5 |w|^2`` in versions, not seconds: the workers take turns, each
    pushing the gradient at the model it pulled after its last push (so ``workers - 1``
    versions stale) and pulling again; ``|w|`` at the end and the largest delay."""
    coordinator = Coordinator(workers=range(workers), consistency=Consistency.ASYNC)
    model = np.array([1.0, -2.0])
    pulled = {w: (model.copy(), 0) for w in range(workers)}
    delays = []
    for k in range(versions):
        worker = k % workers
        grad, base = pulled[worker]
        [action] = coordinator.push(worker, k // workers, base, grad, now=0.0)
        assert isinstance(action, Apply)
        delays.append(action.updates[0].delay)
        step_model(rule, model, action)
        pulled[worker] = (model.copy(), coordinator.version)
    return float(np.linalg.norm(model)), max(delays)


def test_a_step_size_that_diverges_under_delay_converges_when_delay_adaptive() -> None:
    """lr = 0.5 with delay 7 on a quadratic of curvature 1: constant steps blow up
    (``w_{t+1} = w_t - lr w_{t-7}`` is stable only for lr below about 0.2); the adaptive step
    shrinks with ``t + tau`` below that and the model goes to the optimum."""
    constant, delay = descend(SGD(lr=0.5))
    adaptive_end, _ = descend(adaptive(lr=0.5, t0=4.0))
    assert delay == 7
    assert constant > 1e6
    assert adaptive_end < 1e-6


# -- through a shard server --------------------------------------------------------------------
def payload(value: float) -> bytearray:
    array = np.full(SIZE, value)
    return ps_push.encode(Push(size=SIZE, pushed=SIZE, indices=None, values=array))


def server(**kw: Any) -> ShardServer:
    return ShardServer(
        initial=np.zeros(SIZE),
        workers=range(2),
        consistency=Consistency.ASYNC,
        rule=adaptive(momentum=0.25, t0=2.0),
        **kw,
    )


def test_server_moves_the_model_less_for_a_stale_push_than_a_fresh_one() -> None:
    moved = {}
    for base in (1, 0):  # worker 1's push computed from version 1 (fresh) or 0 (1 stale)
        shard = server()
        shard.push(0, 0, 0, payload(1.0), 0.0)
        before = shard.store.model.copy()
        [ack] = shard.push(1, 0, base, payload(1.0), 0.0)
        assert isinstance(ack, Acked)
        assert ack.version == 2
        moved[base] = np.abs(shard.store.model - before).max()
    assert moved[0] < moved[1]
    momentum = 0.25 * 0.5  # the first step was -alpha(0, 0) = -lr
    assert moved[1] == pytest.approx(momentum + 0.5 * math.sqrt(2 / 3))
    assert moved[0] == pytest.approx(momentum + 0.5 * math.sqrt(2 / 4))


#: (worker, iteration, base) pushes, stale ones among them
SCRIPT = [(0, 0, 0), (1, 0, 0), (0, 1, 2), (1, 1, 0), (0, 2, 4), (1, 2, 1), (0, 3, 6), (1, 3, 3)]


def reference() -> Array:
    shard = server()
    for worker, iteration, base in SCRIPT:
        shard.push(worker, iteration, base, payload(1.0 + worker + iteration), 0.0)
    assert shard.version == len(SCRIPT)
    return shard.store.model.copy()


def forward(primary: ShardServer, replica: ShardServer, push: tuple[int, int, int]) -> None:
    worker, iteration, base = push
    [fwd] = primary.push(worker, iteration, base, payload(1.0 + worker + iteration), 0.0)
    assert isinstance(fwd, Forward)
    replica.log(fwd.entry, 0.0)
    primary.replicated_upto(fwd.entry.index, 0.0)


@pytest.mark.parametrize("join_at", [0, 3, 5])
def test_replica_joining_late_and_promoted_steps_exactly_as_the_primary(join_at: int) -> None:
    """The replica joins (a snapshot: the rule's state) after ``join_at`` pushes, follows the
    log, and is promoted for the last two: alpha is the same everywhere, bit for bit."""
    primary, replica = server(replicated=True), server(replica=True)
    for worker, iteration, base in SCRIPT[:join_at]:
        primary.replica_lost(0.0)  # alone before the replica joins
        primary.push(worker, iteration, base, payload(1.0 + worker + iteration), 0.0)
    [snapshot, *rest] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert rest == []
    assert replica.restore(snapshot.index, snapshot.data)
    for push in SCRIPT[join_at:-2]:
        forward(primary, replica, push)
    np.testing.assert_array_equal(replica.store.model, primary.store.model)
    assert replica.promote()
    for worker, iteration, base in SCRIPT[-2:]:
        replica.push(worker, iteration, base, payload(1.0 + worker + iteration), 0.0)
    np.testing.assert_array_equal(replica.store.model, reference())


# -- the client's request ----------------------------------------------------------------------
def request(**kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        name="m",
        shape=(4,),
        dtype=np.dtype("float32"),
        role="server",
        servers=[0],
        replicas=[],
        consistency="async",
        staleness=0,
        delay_bound=None,
        update_rule="sgd",
        lr=0.5,
        momentum=None,
        filters=None,
        chunk=1,
        seed=0,
    )
    return open_request(**(fields | kw))


def test_the_client_sends_lr_delay_and_lr_t0_with_the_sgd_rule() -> None:
    meta = request(lr_delay="adaptive", lr_t0=8)
    assert (meta["rule"], meta["lr"], meta["lr_delay"], meta["lr_t0"]) == (
        "sgd",
        0.5,
        "adaptive",
        8.0,
    )
    assert isinstance(meta["lr_t0"], float)
    plain = request()
    assert (plain["lr_delay"], plain["lr_t0"]) == (None, None)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"update_rule": "sum", "lr": None, "lr_delay": "adaptive"}, "belong to update_rule='sgd'"),
        ({"update_rule": "sum", "lr": None, "lr_t0": 3}, "belong to update_rule='sgd'"),
        ({"update_rule": lambda w, u: None, "lr": None, "lr_delay": "adaptive"}, "not a callback"),
        ({"lr_delay": "fast"}, "lr_delay must be one of"),
        ({"lr_delay": "adaptive", "lr_t0": "8"}, "lr_t0 must be a number"),
        ({"lr_delay": "adaptive", "lr_t0": True}, "lr_t0 must be a number"),
    ],
)
def test_the_client_refuses_lr_delay_before_any_daemon_sees_it(
    kw: dict[str, Any], why: str
) -> None:
    with pytest.raises(UsageError, match=why):
        request(**kw)
