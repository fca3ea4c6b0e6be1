"""Writes held while a read callback runs (transports/batch.py): when flushes run, and in what
order."""

from __future__ import annotations

from fabricd.transports import batch


def test_outside_a_held_span_nothing_is_deferred() -> None:
    ran: list[str] = []
    assert not batch.defer(lambda: ran.append("a"))
    assert ran == []  # the caller writes at once instead


def test_flushes_run_once_each_in_the_order_first_deferred_when_the_outer_span_ends() -> None:
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def second() -> None:
        ran.append("second")

    batch.hold()
    try:
        assert batch.defer(second)
        batch.hold()  # a read callback inside another (a sink that reads, a test)
        try:
            assert batch.defer(first)
            assert batch.defer(second)  # deferred again: still once, still where it was
        finally:
            batch.release()
        assert ran == []  # the inner span's end flushes nothing
    finally:
        batch.release()
    assert ran == ["second", "first"]
    assert not batch.defer(first)  # the span is over


def test_a_flush_that_sends_writes_at_once() -> None:
    # a flush runs after the span: what it queues in turn is not held for a span that is gone
    ran: list[str] = []

    def flush() -> None:
        ran.append("flush")
        assert not batch.defer(lambda: ran.append("late"))

    batch.hold()
    try:
        batch.defer(flush)
    finally:
        batch.release()
    assert ran == ["flush"]
