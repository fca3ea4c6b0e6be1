"""Parameter-server consistency (fabricd/engines/ps/consistency.py) without sockets: honest
workers whose messages hypothesis delivers in any order, and the update rules.

Each simulated worker loops: push the update of its iteration ``t`` (computed from the version
it pulled last), then pull at clock ``t + 1`` and wait for the reply.  Pushes travel on a FIFO
bulk channel and pulls on a FIFO control channel per worker, as the daemon's two links do, so
a pull may overtake its worker's push.  Hypothesis picks which worker steps, which channel
delivers next, when a worker hears of the server's version (async: its :class:`DelayGate` may
then drop an update at home), and which workers are lost (their messages in flight may still
arrive).  The
test plays the service: it applies every :class:`Apply` to a model with the sum rule and checks
each action against its own record of what was pushed and applied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps.consistency import (
    DELAY_BUCKETS,
    SGD,
    Action,
    Apply,
    Consistency,
    Coordinator,
    Drop,
    DropReason,
    Refused,
    Reply,
    Sum,
    update_rule,
)
from fabricd.engines.ps.delay_gate import DelayGate
from fabricd.errors import RemoteProtocolError, UsageError

ROUNDS = 5  #: iterations each simulated worker runs


def values(worker: int, iteration: int) -> np.ndarray[Any, Any]:
    """Worker ``worker``'s update of ``iteration``: distinct, and sums of them are exact."""
    return np.array([1000.0 * worker + iteration, 1.0])


@dataclass
class Sim:
    """Honest workers, two FIFO channels each, and the service's side of the coordinator."""

    n: int
    consistency: Consistency
    staleness: int = 0
    bound: int | None = None
    coordinator: Coordinator = field(init=False)
    model: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(2))
    version: int = 0
    iteration: list[int] = field(default_factory=list)  #: each worker's next iteration
    base: list[int] = field(default_factory=list)  #: the version each worker pulled last
    waiting: list[bool] = field(default_factory=list)  #: a pull is out
    lost: set[int] = field(default_factory=set)
    bulk: list[deque[tuple[int, int]]] = field(default_factory=list)  #: (iteration, base)
    control: list[deque[tuple[int, int]]] = field(default_factory=list)  #: (clock, since)
    delivered: dict[tuple[int, int], int] = field(default_factory=dict)  #: push -> base
    applied: set[tuple[int, int]] = field(default_factory=set)
    bsp_iterations: int = 0
    server_drops: list[Drop] = field(default_factory=list)
    worker_drops: int = 0
    gates: list[DelayGate] = field(default_factory=list)
    refused: int = 0

    def __post_init__(self) -> None:
        self.coordinator = Coordinator(
            workers=range(self.n),
            consistency=self.consistency,
            staleness=self.staleness,
            delay_bound=self.bound,
        )
        self.iteration = [0] * self.n
        self.base = [0] * self.n
        self.waiting = [False] * self.n
        self.bulk = [deque() for _ in range(self.n)]
        self.control = [deque() for _ in range(self.n)]
        self.gates = [DelayGate(delay_bound=self.bound) for _ in range(self.n)]
        self.delay_sum = 0  #: the applied updates' delays, added up

    def moves(self, losses: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for w in range(self.n):
            if w not in self.lost and not self.waiting[w] and self.iteration[w] < ROUNDS:
                out.append(("step", w))
            if self.bulk[w]:
                out.append(("bulk", w))
            if self.control[w]:
                out.append(("control", w))
            if w not in self.lost and len(self.lost) < losses:
                out.append(("lose", w))
            if self.consistency is Consistency.ASYNC and self.gates[w].newest < self.version:
                out.append(("hear", w))
        return out

    def move(self, kind: str, w: int) -> None:
        if kind == "step":
            t = self.iteration[w]
            gate = self.gates[w]
            if self.consistency is Consistency.ASYNC and gate.check(w, t) is not None:
                self.worker_drops += 1
            else:
                self.bulk[w].append((t, self.base[w]))
            self.control[w].append((t + 1, self.base[w]))
            self.waiting[w] = True
        elif kind == "bulk":
            t, base = self.bulk[w].popleft()
            if w not in self.lost:
                self.delivered[(w, t)] = base
            self.handle(self.coordinator.push(w, t, base, values(w, t), now=0.0))
        elif kind == "control":
            clock, since = self.control[w].popleft()
            self.handle(self.coordinator.pull(w, clock, since, now=0.0))
        elif kind == "hear":  # news of the server's version, e.g. with a push's ack
            self.gates[w].heard(self.version)
        else:
            self.lost.add(w)
            self.handle(self.coordinator.lose(w, "test", now=0.0))

    # -- the service's side ---------------------------------------------------------------
    def handle(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Apply):
                self.check_apply(action)
                self.model += action.combined()
                self.version += 1
                self.applied |= {(u.worker, u.iteration) for u in action.updates}
                self.delay_sum += sum(u.delay for u in action.updates)
            elif isinstance(action, Reply):
                self.check_reply(action)
                self.iteration[action.worker] = action.clock
                self.base[action.worker] = action.version
                self.gates[action.worker].pulled(action.version)
                self.waiting[action.worker] = False
            elif isinstance(action, Drop):
                assert (action.worker, action.iteration) not in self.applied
                if action.reason is DropReason.LOST:
                    assert action.worker in self.lost
                else:
                    assert self.bound is not None
                    assert action.delay > self.bound
                    assert action.delay == self.version - action.base
                self.server_drops.append(action)
            else:
                assert isinstance(action, Refused)
                assert action.worker in self.lost
                self.refused += 1

    def check_apply(self, action: Apply) -> None:
        assert action.version == self.version + 1
        for u in action.updates:
            assert (u.worker, u.iteration) not in self.applied, "applied twice"
            assert self.delivered[(u.worker, u.iteration)] == u.base
            assert u.delay == self.version - u.base
            assert u.iteration == action.iteration
        if self.consistency is Consistency.BSP:
            # iteration t, once, in order, with every push of t that arrived (and no live
            # worker's missing)
            assert action.iteration == self.bsp_iterations
            self.bsp_iterations += 1
            workers = {u.worker for u in action.updates}
            arrived = {w for (w, t) in self.delivered if t == action.iteration}
            assert workers == arrived
            assert set(range(self.n)) - self.lost <= workers
            total = sum(values(w, action.iteration) for w in workers)
            assert np.array_equal(action.combined(), total)
        else:
            assert len(action.updates) == 1
        if self.consistency is Consistency.ASYNC and self.bound is not None:
            assert action.updates[0].delay <= self.bound

    def check_reply(self, reply: Reply) -> None:
        assert reply.worker not in self.lost
        assert reply.version == self.version
        if self.consistency is Consistency.ASYNC:
            assert not reply.held
            return
        # no live worker's update of an iteration below clock - s is missing from the model
        need = reply.clock - self.staleness
        assert reply.complete >= need
        for v in set(range(self.n)) - self.lost:
            assert all((v, t) in self.applied for t in range(need)), (v, need)

    def finish(self) -> None:
        """Nothing left to do: no live worker is stuck, and every update is accounted for."""
        stats = self.coordinator.statistics()
        assert stats.held == 0
        for w in set(range(self.n)) - self.lost:
            assert self.iteration[w] == ROUNDS
            assert not self.waiting[w]
        # every push that arrived from a live worker was applied or (async) dropped, once
        dropped = {(d.worker, d.iteration) for d in self.server_drops}
        assert self.delivered.keys() == self.applied | (dropped & self.delivered.keys())
        assert not self.applied & dropped
        assert stats.applied == len(self.applied)
        by_reason = {r.value: 0 for r in DropReason}
        for d in self.server_drops:
            by_reason[d.reason.value] += 1
        assert dict(stats.dropped) == by_reason
        assert sum(g.dropped for g in self.gates) == self.worker_drops
        assert sum(stats.delays) == stats.applied
        assert stats.delay_sum == self.delay_sum  # the histogram's sum, in versions
        assert stats.version == self.version
        assert stats.refused == self.refused
        expected = sum(values(w, t) for (w, t) in self.applied)
        assert np.array_equal(self.model, expected if self.applied else np.zeros(2))


def run(sim: Sim, data: st.DataObject, losses: int) -> None:
    while moves := sim.moves(losses):
        sim.move(*data.draw(st.sampled_from(moves)))
    sim.finish()


@settings(max_examples=150)
@given(data=st.data(), n=st.integers(1, 4), losses=st.integers(0, 2))
def test_bsp_applies_each_iteration_once_with_every_push(
    data: st.DataObject, n: int, losses: int
) -> None:
    sim = Sim(n=n, consistency=Consistency.BSP)
    run(sim, data, min(losses, n - 1))
    if not sim.lost:
        assert sim.bsp_iterations == ROUNDS


@settings(max_examples=150)
@given(data=st.data(), n=st.integers(1, 4), s=st.integers(0, 3), losses=st.integers(0, 2))
def test_ssp_never_answers_with_a_model_more_than_s_behind(
    data: st.DataObject, n: int, s: int, losses: int
) -> None:
    run(Sim(n=n, consistency=Consistency.SSP, staleness=s), data, min(losses, n - 1))


@settings(max_examples=150)
@given(
    data=st.data(),
    n=st.integers(1, 4),
    bound=st.none() | st.integers(0, 3),
    losses=st.integers(0, 2),
)
def test_async_never_applies_past_the_delay_bound_and_counts_drops(
    data: st.DataObject, n: int, bound: int | None, losses: int
) -> None:
    run(Sim(n=n, consistency=Consistency.ASYNC, bound=bound), data, min(losses, n - 1))


# -- the rules, one scenario at a time ------------------------------------------------------
def test_bsp_holds_pulls_until_the_iteration_is_applied() -> None:
    c = Coordinator(workers=[0, 1], consistency=Consistency.BSP)
    assert c.push(0, 0, 0, values(0, 0), now=0.0) == []
    assert c.pull(0, 1, 0, now=1.0) == []
    assert c.statistics().held == 1
    assert "workers [1]" in c.waiting_for()[0]
    # a pipelining worker may push one iteration ahead, not two
    assert c.push(0, 1, 0, values(0, 1), now=1.0) == []
    actions = c.push(1, 0, 0, values(1, 0), now=2.0)
    assert [type(a) for a in actions] == [Apply, Reply]
    apply, reply = actions
    assert isinstance(apply, Apply)
    assert isinstance(reply, Reply)
    assert (apply.version, apply.iteration, [u.worker for u in apply.updates]) == (1, 0, [0, 1])
    assert (reply.worker, reply.clock, reply.version, reply.held) == (0, 1, 1, True)
    # worker 0's push of iteration 1 was computed from version 0: its delay is 1
    actions = c.push(1, 1, 1, values(1, 1), now=3.0)
    assert isinstance(actions[0], Apply)
    assert [u.delay for u in actions[0].updates] == [1, 0]


def test_ssp_releases_a_held_pull_when_the_slowest_worker_catches_up() -> None:
    c = Coordinator(workers=[0, 1, 2], consistency=Consistency.SSP, staleness=1)
    for t in range(2):
        assert isinstance(c.push(0, t, c.version, values(0, t), now=0.0)[0], Apply)
        if t == 0:
            assert [type(a) for a in c.pull(0, 1, 1, now=0.0)] == [Reply]  # complete 0 >= 1-1
    assert c.pull(0, 2, c.version, now=0.0) == []  # needs iteration 0 of workers 1 and 2
    assert [type(a) for a in c.push(1, 0, 0, values(1, 0), now=0.0)] == [Apply]
    actions = c.push(2, 0, 0, values(2, 0), now=0.0)
    assert [type(a) for a in actions] == [Apply, Reply]
    reply = actions[1]
    assert isinstance(reply, Reply)
    assert (reply.complete, reply.version) == (1, 4)


def test_a_lost_worker_unblocks_bsp_and_keeps_what_it_pushed() -> None:
    c = Coordinator(workers=[0, 1, 2], consistency=Consistency.BSP)
    c.push(0, 0, 0, values(0, 0), now=0.0)
    c.push(2, 0, 0, values(2, 0), now=0.0)
    c.pull(0, 1, 0, now=0.0)
    c.pull(2, 1, 0, now=0.0)
    # worker 2 is lost having pushed iteration 0; worker 1 never pushed yet
    actions = c.lose(2, "node down", now=1.0)
    assert [type(a) for a in actions] == [Refused]
    actions = c.lose(1, "node down", now=1.0)
    assert [type(a) for a in actions] == [Apply, Reply]
    apply = actions[0]
    assert isinstance(apply, Apply)
    assert [u.worker for u in apply.updates] == [0, 2]
    # the survivor goes on alone; a late frame of a lost worker is dropped and counted
    assert isinstance(c.push(0, 1, 1, values(0, 1), now=2.0)[0], Apply)
    late = c.push(1, 0, 0, values(1, 0), now=2.0)
    assert isinstance(late[0], Drop)
    assert late[0].reason is DropReason.LOST
    assert isinstance(c.pull(1, 1, 0, now=2.0)[0], Refused)
    stats = c.statistics()
    assert (stats.live, stats.dropped["lost"], stats.refused) == (1, 1, 2)
    assert c.lose(1, "again", now=3.0) == []


def test_async_drops_past_the_bound_at_the_server_and_counts_by_delay() -> None:
    c = Coordinator(workers=[0, 1], consistency=Consistency.ASYNC, delay_bound=1)
    for t in range(3):
        c.push(0, t, c.version, values(0, t), now=0.0)
    drop = c.push(1, 5, 1, values(1, 5), now=0.0)  # version 3 - base 1 = 2 > 1
    assert isinstance(drop[0], Drop)
    assert drop[0].reason is DropReason.DELAY
    assert "delay 2 > bound 1" in drop[0].message
    assert isinstance(c.push(1, 6, 2, values(1, 6), now=0.0)[0], Apply)  # delay 1
    stats = c.statistics()
    assert stats.dropped == {"delay": 1, "lost": 0, "scheduled": 0}
    assert stats.delays[:3] == (3, 1, 0)
    assert stats.delay_sum == 1  # three updates of delay 0, one of 1; the dropped one not
    assert len(stats.delays) == len(DELAY_BUCKETS) + 1
    # async answers every pull at once
    reply = c.pull(1, 0, 0, now=0.0)[0]
    assert isinstance(reply, Reply)
    assert reply.version == 4
    assert not reply.held


def test_the_delay_gate_drops_at_the_worker_only_what_the_server_would() -> None:
    gate = DelayGate(delay_bound=2)
    gate.pulled(3)
    gate.heard(5)
    assert gate.check(0, 7) is None  # 5 - 3 = 2: the server applies it if nothing newer came
    gate.heard(4)  # older news changes nothing
    gate.heard(6)
    drop = gate.check(0, 7)
    assert drop is not None
    assert (drop.delay, drop.bound, gate.dropped) == (3, 2, 1)
    assert DelayGate(delay_bound=None).check(0, 0) is None


@pytest.mark.parametrize(
    ("consistency", "worker", "iteration", "base", "why"),
    [
        (Consistency.BSP, 9, 0, 0, "not a worker"),
        (Consistency.BSP, 0, 0, 5, "from version 5"),
        (Consistency.BSP, 0, 0, 0, "after pushing 0"),
        (Consistency.BSP, 0, 2, 0, "skipping 1"),
        (Consistency.ASYNC, 0, 0, 0, "after pushing 0"),
    ],
)
def test_bad_pushes_are_protocol_errors_and_change_nothing(
    consistency: Consistency, worker: int, iteration: int, base: int, why: str
) -> None:
    c = Coordinator(workers=[0, 1], consistency=consistency)
    c.push(0, 0, 0, values(0, 0), now=0.0)
    before = c.statistics()
    with pytest.raises(RemoteProtocolError, match=why):
        c.push(worker, iteration, base, values(0, 1), now=0.0)
    assert c.statistics() == before


def test_pushing_too_far_ahead_is_a_protocol_error() -> None:
    bsp = Coordinator(workers=[0, 1], consistency=Consistency.BSP)
    bsp.push(0, 0, 0, values(0, 0), now=0.0)
    bsp.push(0, 1, 0, values(0, 1), now=0.0)
    with pytest.raises(RemoteProtocolError, match="at most 1"):
        bsp.push(0, 2, 0, values(0, 2), now=0.0)
    ssp = Coordinator(workers=[0, 1], consistency=Consistency.SSP, staleness=2)
    for t in range(4):  # up to s + 1 past complete (0)
        ssp.push(0, t, 0, values(0, t), now=0.0)
    with pytest.raises(RemoteProtocolError, match="at most 3"):
        ssp.push(0, 4, 0, values(0, 4), now=0.0)


def test_bad_pulls_are_protocol_errors() -> None:
    c = Coordinator(workers=[0, 1], consistency=Consistency.BSP)
    with pytest.raises(RemoteProtocolError, match="holds version 1"):
        c.pull(0, 0, 1, now=0.0)
    with pytest.raises(RemoteProtocolError, match="clock 2 having pushed 0"):
        c.pull(0, 2, 0, now=0.0)
    assert c.pull(0, 1, 0, now=0.0) == []  # may overtake its push of iteration 0
    with pytest.raises(RemoteProtocolError, match="while its pull is held"):
        c.pull(0, 1, 0, now=0.0)


def test_settings_are_checked() -> None:
    with pytest.raises(UsageError):
        Coordinator(workers=[], consistency=Consistency.BSP)
    with pytest.raises(UsageError, match="belongs to ssp"):
        Coordinator(workers=[0], consistency=Consistency.BSP, staleness=1)
    with pytest.raises(UsageError, match="belongs to async"):
        Coordinator(workers=[0], consistency=Consistency.SSP, delay_bound=3)
    with pytest.raises(UsageError):
        Coordinator(workers=[0], consistency=Consistency.ASYNC, delay_bound=-1)


# -- update rules ---------------------------------------------------------------------------
@settings(max_examples=50)
@given(
    lr=st.floats(1e-3, 1.0),
    momentum=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 8),
)
def test_sgd_is_eq_2_of_mlfabric(lr: float, momentum: float, seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(5)
    grads = rng.standard_normal((steps, 5))
    rule = update_rule("sgd", lr=lr, momentum=momentum)
    model = w0.copy()
    # w_{t+1} = w_t + u_t + gamma (w_t - w_{t-1}), u_t = -lr g_t, w_{-1} = w_0
    prev, cur = w0.copy(), w0.copy()
    for g in grads:
        rule.apply(model, g)
        prev, cur = cur, cur + (-lr * g) + momentum * (cur - prev)
        np.testing.assert_allclose(model, cur, rtol=1e-12, atol=1e-12)


def test_sum_and_callback_rules() -> None:
    model = np.ones(3)
    Sum().apply(model, np.full(3, 2.0))
    assert np.array_equal(model, np.full(3, 3.0))
    seen: list[float] = []

    def halve(w: np.ndarray[Any, Any], u: np.ndarray[Any, Any], /) -> None:
        seen.append(float(u[0]))
        w += u / 2

    update_rule(halve).apply(model, np.full(3, 4.0))
    assert np.array_equal(model, np.full(3, 5.0))
    assert seen == [4.0]
    with pytest.raises(UsageError, match="shape"):
        Sum().apply(model, np.ones(2))


@pytest.mark.parametrize(
    ("rule", "kwargs", "why"),
    [
        ("adam", {}, "one of sum, sgd"),
        (3, {}, "or a callable"),
        ("sgd", {}, "needs lr"),
        ("sgd", {"lr": 0.0}, "lr > 0"),
        ("sgd", {"lr": float("nan")}, "lr > 0"),
        ("sgd", {"lr": 0.1, "momentum": 1.0}, "momentum < 1"),
        ("sgd", {"lr": 0.1, "momentum": -0.1}, "momentum < 1"),
        ("sum", {"lr": 0.1}, "belong to"),
    ],
)
def test_update_rule_settings_are_checked(rule: Any, kwargs: dict[str, float], why: str) -> None:
    with pytest.raises(UsageError, match=why):
        update_rule(rule, **kwargs)


def test_sgd_keeps_its_momentum_to_one_model_shape() -> None:
    rule = SGD(lr=0.5, momentum=0.5)
    rule.apply(np.zeros(2), np.ones(2))
    with pytest.raises(UsageError, match="shape"):
        rule.apply(np.zeros(3), np.ones(3))


def test_combined_leaves_the_pushed_arrays_alone() -> None:
    c = Coordinator(workers=[0, 1], consistency=Consistency.BSP)
    a, b = values(0, 0), values(1, 0)
    c.push(0, 0, 0, a, now=0.0)
    apply = c.push(1, 0, 0, b, now=0.0)[0]
    assert isinstance(apply, Apply)
    assert np.array_equal(apply.combined(), a + b)
    assert np.array_equal(a, values(0, 0))
    assert np.array_equal(b, values(1, 0))
