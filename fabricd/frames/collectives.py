"""COLL: a persistent collective's schedule frames."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK
from fabricd.wire import MAX_TAG, Kind, Meta, get_int, get_str

#: the most lost nodes a collective frame lists
MAX_LOST: Final = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class Coll:
    """Message ``tag`` of round ``round`` of collective ``name`` of ``job`` (data channel):
    ``payload`` bytes at byte ``off`` of the slot the receiving node allocated for it when it
    built the same schedule (fabricd/engines/collectives/persistent.py).  ``lost`` and ``base`` say
    the
    sender's view (the member nodes it lost, the round that view began with); ``spec`` what
    every call of the collective agrees on, so that a node whose ranks have not called yet can
    build it and take part passively."""

    KIND: ClassVar[Kind] = Kind.COLL
    job: str
    name: str
    round: int
    tag: int
    off: int
    lost: tuple[int, ...]
    base: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {
            "job": self.job,
            "name": self.name,
            "r": self.round,
            "t": self.tag,
            "off": self.off,
            "lost": list(self.lost),
            "b": self.base,
            "spec": self.spec,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Coll:
        job, name = get_str(meta, "job"), get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise RemoteProtocolError(f"collective name of {len(name)} characters")
        lost = meta.get("lost")
        if (
            not isinstance(lost, list)
            or len(lost) > MAX_LOST
            or not all(type(n) is int and 0 <= n < MAX_RANK for n in lost)
        ):
            raise RemoteProtocolError("field 'lost' must be a list of node ids")
        spec = meta.get("spec")
        if not isinstance(spec, dict):
            raise RemoteProtocolError("field 'spec' must be a map")
        return cls(
            job=job,
            name=name,
            round=get_int(meta, "r"),
            tag=get_int(meta, "t", hi=MAX_TAG),
            off=get_int(meta, "off"),
            lost=tuple(lost),
            base=get_int(meta, "b"),
            spec=spec,
        )
