"""Indexes of the point-to-point engine's tables: counts and insertion-ordered sets under a
key, that keep only live keys.

Why a module of its own: the engine files every operation in several such indexes (by key, by
rank, by node) and takes it out of them on every move; a key left behind with nothing under it
would grow the table by one per tag, and tags may be step numbers.  These helpers drop a key
when it empties, and rebuild an index so a dict returns the memory of deleted entries.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")
W = TypeVar("W")


def bump(counts: dict[K, int], key: K, by: int) -> None:
    """Add ``by`` to ``counts[key]``, dropping the key at zero (so the table holds only live
    keys: tags may be step numbers, one of them per step)."""
    value = counts.get(key, 0) + by
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)


def add(index: dict[K, dict[V, None]], key: K, item: V) -> None:
    """File ``item`` under ``key`` in an index of insertion-ordered sets."""
    group = index.get(key)
    if group is None:
        index[key] = {item: None}
    else:  # (``setdefault(key, {})`` built an empty dict on every call)
        group[item] = None


def rebuilt(index: dict[K, dict[V, W]]) -> dict[K, dict[V, W]]:
    """A fresh copy of an index of tables: no memory kept for entries deleted from either."""
    return {key: dict(group) for key, group in index.items()}


def discard(index: dict[K, dict[V, W]], key: K, item: V) -> None:
    """Take ``item`` out of ``index[key]``, and drop the key when nothing is left under it."""
    group = index.get(key)
    if group is not None:
        group.pop(item, None)
        if not group:
            del index[key]
