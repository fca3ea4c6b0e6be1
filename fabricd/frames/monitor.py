"""MONITOR: one node's own link figures, reported to its peers every ``monitor_interval``
(MLfabric §4: "a network monitor periodically measures and reports available network
bandwidth to the scheduler"; §7: every t_lag = 0.2 s).

The view checks the frame's *shape* (every field present, of its type, the path list
bounded), as every kind's view does: a peer that breaks it runs broken code, and its links
are closed.  The *values* (a negative or non-finite figure, an unknown source, a path to a
node the fabric has not) are the monitor engine's to judge (:func:`fabricd.engines.monitor.
table.check_report`): such a report is dropped and counted, and nothing else changes, since
the links carry every tenant's traffic and a report is only advice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.wire import Kind, Meta, get_str

#: the most (node, delivery rate) paths one report carries
MAX_PATHS: Final = 64


def get_number(meta: Meta, key: str) -> float:
    """``meta[key]`` as a float (an int or float on the wire, never a bool); any value,
    NaN and infinities included: the engine judges values."""
    value = meta.get(key)
    if type(value) not in (int, float):
        raise RemoteProtocolError(f"field {key!r} must be a number")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The sender's own figures, as its monitor knows them when it sends.

    Attributes:
        up: available uplink bandwidth, bytes/s.
        down: available downlink bandwidth, bytes/s.
        rtt: the sender's typical round trip to its peers, seconds (0: unknown).
        age: how old the figures already were when sent, seconds.
        source: ``"configured"``, ``"measured"`` or ``"default"`` (the weaker of up's and
            down's: docs/mlfabric.md, "The network monitor").
        paths: ``(node, bytes/s)``: the delivery rate the sender's links to ``node`` showed
            while busy since its last report; evidence of ``node``'s downlink.
    """

    KIND: ClassVar[Kind] = Kind.MONITOR
    up: float
    down: float
    rtt: float
    age: float
    source: str
    paths: tuple[tuple[int, float], ...] = ()

    def to_meta(self) -> Meta:
        meta: Meta = {
            "up": self.up,
            "down": self.down,
            "rtt": self.rtt,
            "age": self.age,
            "src": self.source,
        }
        if self.paths:
            meta["paths"] = [[node, rate] for node, rate in self.paths]
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Report:
        return cls(
            up=get_number(meta, "up"),
            down=get_number(meta, "down"),
            rtt=get_number(meta, "rtt"),
            age=get_number(meta, "age"),
            source=get_str(meta, "src"),
            paths=_paths(meta.get("paths", [])),
        )


def _paths(value: object) -> tuple[tuple[int, float], ...]:
    """The ``paths`` list as pairs, refusing any other shape."""
    if not isinstance(value, list) or len(value) > MAX_PATHS:
        raise RemoteProtocolError(f"field 'paths' must be a list of at most {MAX_PATHS} pairs")
    pairs: list[tuple[int, float]] = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or type(item[0]) is not int
            or type(item[1]) not in (int, float)
        ):
            raise RemoteProtocolError("field 'paths' must hold [node, rate] pairs")
        pairs.append((item[0], float(item[1])))
    return tuple(pairs)
