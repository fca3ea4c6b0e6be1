"""Operator logs: one line per event, JSON on request."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from fabricd.daemon import logs


@pytest.fixture(autouse=True)
def _restore_logging():
    """logs.setup configures the process-wide 'fabricd' logger; put it back afterwards."""
    root = logging.getLogger("fabricd")
    saved = (root.handlers[:], root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


def test_json_logs_are_one_object_per_line(capsys):
    logs.setup("info", "json", node=3)
    log = logging.getLogger("fabricd.test")
    log.info("node %d: %s", 1, "up")
    log.debug("not shown at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "node 1: up"
    assert (first["level"], first["logger"], first["node"]) == ("info", "fabricd.test", 3)
    assert first["ts"].endswith("Z")
    assert "ValueError: boom" in second["exc"]


def test_text_logs_name_the_node(capsys):
    logs.setup("warning", "text", node=7)
    logging.getLogger("fabricd.x").warning("peer %s down", "n2")
    line = capsys.readouterr().err.strip()
    assert "WARNING" in line
    assert "node7 fabricd.x: peer n2 down" in line


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_remote_lines_past_the_burst_are_counted_and_summarised(caplog):
    clock = Clock()
    limited = logs.RateLimitedLog(
        logging.getLogger("fabricd.test"), interval=1.0, burst=3, clock=clock
    )
    with caplog.at_level(logging.INFO, logger="fabricd.test"):
        written = [
            limited.warning("refused link", "refused link from %s", f"h{i}") for i in range(1000)
        ]
        assert written == [True] * 3 + [False] * 997
        assert limited.warning("other", "another kind") is True  # keys are apart
        clock.now = 1.0
        assert limited.warning("refused link", "refused link from %s", "again") is True
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6  # 3 + the other key + the summary + the new interval's first
    assert lines[:3] == ["refused link from h0", "refused link from h1", "refused link from h2"]
    assert lines[4] == (
        "refused link: 997 more such lines in 1.0s were left out; the last: refused link from h999"
    )
    assert limited.left_out == 997


def test_flush_summarises_an_interval_that_ended(caplog):
    clock = Clock()
    limited = logs.RateLimitedLog(logging.getLogger("fabricd.test"), burst=0, clock=clock)
    with caplog.at_level(logging.INFO, logger="fabricd.test"):
        limited.log(logging.INFO, "k", "x %d", 1)
        limited.flush()
        assert caplog.records == []  # the interval has not ended
        clock.now = 5.0
        limited.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "k: 1 more such lines in 1.0s were left out; the last: x 1"
    ]


async def test_with_a_loop_the_summary_comes_when_the_interval_ends(caplog):
    limited = logs.RateLimitedLog(logging.getLogger("fabricd.test"), interval=0.05, burst=1)
    with caplog.at_level(logging.INFO, logger="fabricd.test"):
        for i in range(50):
            limited.warning("flood", "line %d", i)
        async with asyncio.timeout(10):  # a hang guard
            while len(caplog.records) < 2:
                await asyncio.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == [
        "line 0",
        "flood: 49 more such lines in 0.1s were left out; the last: line 49",
    ]


def test_limits_must_make_sense():
    with pytest.raises(ValueError, match="interval"):
        logs.RateLimitedLog(logging.getLogger("fabricd.test"), interval=0.0)


def test_a_timer_left_in_an_ended_loop_does_not_stop_later_summaries(caplog):
    # the module-level logs outlive event loops (in-process daemons one after another, a test
    # loop per test): a summary timer that was pending when its loop ended kept the log from
    # ever arming another, so later floods got their summary only if the same kind recurred
    limited = logs.RateLimitedLog(logging.getLogger("fabricd.test"), interval=0.05, burst=0)

    async def flood(key: str) -> None:
        limited.warning(key, "line of %s", key)

    asyncio.run(flood("first"))  # its loop ends with the summary timer still pending

    async def second() -> None:
        await flood("second")
        async with asyncio.timeout(10):  # a hang guard
            while not any("second:" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO, logger="fabricd.test"):
        asyncio.run(second())
    assert "second: 1 more such lines in 0.1s were left out; the last: line of second" in [
        r.getMessage() for r in caplog.records
    ]


def test_tracebacks_of_a_repeated_bug_are_limited_like_any_line(caplog):
    # a client can repeat the request that trips a daemon bug: one traceback each would flood
    clock = Clock()
    limited = logs.RateLimitedLog(
        logging.getLogger("fabricd.test"), interval=1.0, burst=2, clock=clock
    )
    with caplog.at_level(logging.INFO, logger="fabricd.test"):
        for i in range(50):
            try:
                raise RuntimeError(f"bug {i}")
            except RuntimeError:
                limited.log(logging.ERROR, "request failed", "request %d failed", i, exc_info=True)
        limited.flush(everything=True)
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert [str(r.exc_info[1]) for r in with_traceback if r.exc_info] == ["bug 0", "bug 1"]
    assert "48 more such lines" in caplog.records[-1].getMessage()  # the rest, counted
