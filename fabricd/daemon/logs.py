"""Logging an operator can read: one line per event, text by default, JSON on request."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Final

_TEXT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, node, msg (and exc when there is one)."""

    def __init__(self, node: int) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "node": self.node,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str, fmt: str, node: int) -> None:
    """Send fabricd's logs to stderr (journald picks them up under systemd)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node))
    else:
        formatter = logging.Formatter(_TEXT.replace("%(name)s", f"node{node} %(name)s"))
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger("fabricd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
