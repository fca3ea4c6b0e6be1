"""Rank 0 of the ring demo, against an in-memory ring: what its clock counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fabricd.demo.ring import READY_TAG, DemoFailed, lead


class FakeClock:
    """Time that passes only when the fake ring says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRing:
    """Rank 0's client on a ring whose other ranks add one each, taking a second per call.

    Each other rank takes ``join_seconds`` to say it is ready, which the demo must not count.
    """

    def __init__(self, size: int, clock: FakeClock, join_seconds: float) -> None:
        self.size = size
        self.clock = clock
        self.join_seconds = join_seconds
        self.ready_from: list[int] = []
        self.in_flight: np.ndarray[Any, Any] | None = None

    def array(self, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray[Any, Any]:
        return np.zeros(shape, dtype=dtype)

    def send(self, array: np.ndarray[Any, Any], to: int, tag: int = 0, *, timeout: float) -> None:
        assert len(self.ready_from) == self.size - 1, "sent before every rank was ready"
        self.in_flight = array.copy()
        self.clock.now += 1.0

    def recv(self, array: np.ndarray[Any, Any], src: int, tag: int = 0, *, timeout: float) -> None:
        if tag == READY_TAG:
            self.ready_from.append(src)
            self.clock.now += self.join_seconds
            return
        assert self.in_flight is not None
        array[:] = self.in_flight + (self.size - 1)
        self.clock.now += 1.0


def test_the_clock_starts_when_every_rank_is_ready():
    clock = FakeClock()
    ring = FakeRing(size=4, clock=clock, join_seconds=100.0)
    laps: list[tuple[int, float]] = []
    seconds, checksum = lead(
        ring, count=1000, laps=3, progress=lambda *a: laps.append(a), clock=clock
    )
    assert sorted(ring.ready_from) == [1, 2, 3]
    assert seconds == 6.0  # a send and a receive per lap; the 300 s of joining are not in it
    assert laps == [(1, 2.0), (2, 4.0), (3, 6.0)]
    assert len(checksum) == 16


def test_a_wrong_element_fails_the_demo():
    clock = FakeClock()
    ring = FakeRing(size=3, clock=clock, join_seconds=0.0)
    original = ring.recv

    def corrupting(array, src, tag=0, *, timeout):
        original(array, src, tag, timeout=timeout)
        if tag != READY_TAG:
            array[7] += 1

    ring.recv = corrupting
    with pytest.raises(DemoFailed, match="element 7"):
        lead(ring, count=100, laps=1, clock=clock)
