"""Operator logs: one line per event, JSON on request."""

from __future__ import annotations

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
