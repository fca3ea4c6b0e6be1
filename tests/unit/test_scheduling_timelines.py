"""Residual-capacity timelines (MLfabric Fig. 4b, 4c) against a brute-force reference: time cut
in steps of 1/128 s, each link's residual capacity an array, each transfer sent step by step at
the lower of its two links' rates.  ``finish`` must agree with it, bookings must never take a
link below zero, and a booking must take exactly its size off both links."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.scheduling.timelines import Network, Timeline

STEP = 1 / 128
HORIZON = 400.0
STEPS = int(HORIZON / STEP)


class Reference:
    """The brute-force network: a residual-rate array per link over ``STEPS`` steps."""

    def __init__(self, up: dict[int, float], down: dict[int, float]) -> None:
        self.up = {h: np.full(STEPS, float(c)) for h, c in up.items()}
        self.down = {h: np.full(STEPS, float(c)) for h, c in down.items()}

    def send(self, src: int, dst: int, size: float, start: float, book: bool) -> float:
        """When ``size`` bytes from ``start`` end (``inf``: not within the horizon)."""
        k = round(start / STEP)
        left = size
        if src == dst or size <= 0:
            return start
        while k < STEPS:
            rate = min(self.up[src][k], self.down[dst][k])
            done = min(left, rate * STEP)
            if book:  # the step's average rate: what the continuous booking takes there
                self.up[src][k] -= done / STEP
                self.down[dst][k] -= done / STEP
            if rate > 0 and left <= rate * STEP:
                return float(k * STEP + left / rate)
            left -= done
            k += 1
        return math.inf


hosts = st.integers(0, 3)
bookings = st.lists(
    st.tuples(hosts, hosts, st.integers(1, 40), st.integers(0, 20)), min_size=0, max_size=5
)
capacities = st.lists(st.integers(0, 6), min_size=4, max_size=4)


def _integral(timeline: Timeline, until: float) -> float:
    """Bytes the timeline offers from its first breakpoint to ``until``."""
    edges = [*timeline.times, until]
    return math.fsum(
        r * max(0.0, min(b, until) - a)
        for a, b, r in zip(edges, edges[1:], timeline.rates, strict=False)
    )


@settings(max_examples=150, deadline=None)
@given(up=capacities, down=capacities, booked=bookings, query=bookings)
def test_finish_and_reserve_agree_with_the_stepped_reference(
    up: list[int],
    down: list[int],
    booked: list[tuple[int, int, int, int]],
    query: list[tuple[int, int, int, int]],
) -> None:
    net = Network(dict(enumerate(up)), dict(enumerate(down)))
    ref = Reference(dict(enumerate(up)), dict(enumerate(down)))
    for count, (src, dst, size, start) in enumerate(booked + query, start=1):
        expected = ref.send(src, dst, size, start, book=False)
        got = net.finish(src, dst, size, start=start)
        tolerance = 2 * STEP * count
        if expected == math.inf:
            assert got > HORIZON - tolerance
            continue
        assert got == pytest.approx(expected, abs=tolerance)
        before_up, before_down = net.uplink(src), net.downlink(dst)
        transfer = net.reserve(src, dst, size, start=start)
        ref.send(src, dst, size, start, book=True)
        assert transfer.end == got
        assert transfer.start >= start
        if src == dst:
            assert transfer.profile == ()
            continue
        assert transfer.sent == pytest.approx(size)
        for after in (net.uplink(src), net.downlink(dst)):
            assert min(after.rates) >= 0
        horizon = transfer.end + 1
        taken_up = _integral(before_up, horizon) - _integral(net.uplink(src), horizon)
        taken_down = _integral(before_down, horizon) - _integral(net.downlink(dst), horizon)
        assert taken_up == pytest.approx(size, rel=1e-6)
        assert taken_down == pytest.approx(size, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(up=capacities, down=capacities, booked=bookings, query=bookings)
def test_finish_many_is_finish_for_each(
    up: list[int],
    down: list[int],
    booked: list[tuple[int, int, int, int]],
    query: list[tuple[int, int, int, int]],
) -> None:
    net = Network(dict(enumerate(up)), dict(enumerate(down)))
    for src, dst, size, start in booked:
        if net.finish(src, dst, size, start=start) < math.inf:
            net.reserve(src, dst, size, start=start)
    for dst in range(4):
        srcs = [q[0] for q in query]
        sizes = [q[2] for q in query]
        got = net.finish_many(srcs, dst, sizes, start=3)
        want = [net.finish(s, dst, z, start=3) for s, z in zip(srcs, sizes, strict=True)]
        assert got.tolist() == pytest.approx(want, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(up=capacities, down=capacities, booked=bookings)
def test_release_gives_back_what_reserve_took(
    up: list[int], down: list[int], booked: list[tuple[int, int, int, int]]
) -> None:
    net = Network(dict(enumerate(up)), dict(enumerate(down)))
    before = net.copy()
    transfers = [
        net.reserve(s, d, z, start=t)
        for s, d, z, t in booked
        if net.finish(s, d, z, start=t) < math.inf
    ]
    for transfer in reversed(transfers):
        net.release(transfer)
    for host in range(4):
        for link in ("uplink", "downlink"):
            assert getattr(net, link)(host).rates == pytest.approx(
                getattr(before, link)(host).rates
            )


def test_fig4_example_and_the_shared_core() -> None:
    """A 30-unit update over a link that gives 2, then 6 after t = 3 (Fig. 4b's shape) ends
    when its 30 units are in: 3 * 2 + 4 * 6 = 30 at t = 7, as the figure's t_en = 7."""
    shaped = Network({2: 6.0, 1: 6.0, 0: 8.0}, {2: 8.0, 1: 8.0, 0: 8.0})
    shaped.reserve(1, 0, 18)  # 6 of the downlink's 8 for 3 s leaves 2, then 8
    assert shaped.downlink(0).rates == pytest.approx((2.0, 8.0))
    transfer = shaped.reserve(2, 0, 30)
    assert transfer.end == pytest.approx(7)  # 2 * 3 + 6 * 4
    assert [x for piece in transfer.profile for x in piece] == pytest.approx([0, 3, 2, 3, 7, 6])
    assert shaped.uplink(1).rates == pytest.approx((0.0, 6.0))
    assert shaped.downlink(0).times == pytest.approx((0.0, 3.0, 7.0))
    assert shaped.downlink(0).rates == pytest.approx((0.0, 2.0, 8.0))


def test_local_zero_and_never() -> None:
    net = Network({0: 5.0, 1: 0.0}, {0: 5.0, 1: 5.0}, now=2.0)
    assert net.finish(0, 0, 100) == 2.0  # a host to itself crosses no link
    assert net.finish(0, 1, 0, start=4) == 4.0
    assert net.finish(1, 0, 1) == math.inf
    with pytest.raises(ValueError, match="never ends"):
        net.reserve(1, 0, 1)
    with pytest.raises(ValueError, match="hosts differ"):
        Network({0: 1.0}, {1: 1.0})


def test_copies_are_independent_and_advance_forgets_the_past() -> None:
    net = Network({0: 4.0, 1: 4.0}, {0: 4.0, 1: 4.0})
    twin = net.copy()
    net.reserve(1, 0, 8)
    assert twin.finish(1, 0, 8) == 2.0
    assert net.finish(1, 0, 8) == 4.0
    net.advance(3.0)
    assert net.now == 3.0
    assert net.downlink(0).times[0] == 3.0
    assert net.finish(1, 0, 8) == 5.0
