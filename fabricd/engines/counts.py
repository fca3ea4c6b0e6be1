"""Counts kept in a dict by key, with no entry for a key whose count is zero.

Engines and services count things per job, per client, per uid or per node so that a limit
check is one lookup; a key whose count reaches zero is deleted, or every job or client that
ever existed would keep an entry for good.
"""

from __future__ import annotations

from typing import TypeVar

_K = TypeVar("_K")


def count_down(counts: dict[_K, int], key: _K, by: int = 1) -> None:
    """Take ``by`` from ``counts[key]`` (which must be there), deleting the entry at zero."""
    left = counts[key] - by
    if left:
        counts[key] = left
    else:
        del counts[key]
