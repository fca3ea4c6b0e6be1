"""Watching processes that are not our children: whether they have exited, waiting until then."""

from __future__ import annotations

import time
from pathlib import Path


def exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (dead; only its parent has yet to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def wait_exited(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait up to ``timeout`` seconds for every pid to exit; return those still running."""
    deadline = time.monotonic() + timeout
    while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if not exited(pid)]
