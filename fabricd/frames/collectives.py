"""COLL: a persistent collective's schedule frames."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK
from fabricd.wire import MAX_TAG, Kind, Meta, get_int, get_str

#: the most lost nodes a collective frame lists
MAX_LOST: Final = 4096
#: the most notes (views its sender left) a NOTICE carries
MAX_NOTES: Final = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Coll:
    """Message ``tag`` of round ``round`` of collective ``name`` of ``job`` (data channel):
    ``payload`` bytes at byte ``off`` of the slot the receiving node allocated for it when it
    built the same schedule (fabricd/engines/collectives/persistent.py).  ``lost`` and ``base`` say
    the
    sender's view (the member nodes it lost, the round that view began with); ``spec`` what
    every call of the collective agrees on, so that a node whose ranks have not called yet can
    build it and take part passively.  ``notes`` (a NOTICE's only): the views its sender left,
    each as (lost, base, the last round it ended there), so that survivors settle the rounds a
    view change abandoned exactly once (fabricd/engines/collectives/ledger.py)."""

    KIND: ClassVar[Kind] = Kind.COLL
    job: str
    name: str
    round: int
    tag: int
    off: int
    lost: tuple[int, ...]
    base: int
    spec: dict[str, Any]
    notes: tuple[tuple[tuple[int, ...], int, int], ...] = ()

    def to_meta(self) -> Meta:
        meta: Meta = {
            "job": self.job,
            "name": self.name,
            "r": self.round,
            "t": self.tag,
            "off": self.off,
            "lost": list(self.lost),
            "b": self.base,
            "spec": self.spec,
        }
        if self.notes:  # written only when there are some
            meta["n"] = [[list(lost), base, last] for lost, base, last in self.notes]
        return meta

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
            notes=_notes(meta.get("n", [])),
        )


def _notes(notes: object) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """A NOTICE's notes: at most :data:`MAX_NOTES` of [lost node ids, base >= 0, last >= -1]."""
    if not isinstance(notes, list) or len(notes) > MAX_NOTES:
        raise RemoteProtocolError(f"field 'n' must be a list of at most {MAX_NOTES} notes")
    out = []
    for note in notes:
        if not (isinstance(note, list) and len(note) == 3 and isinstance(note[0], list)):
            raise RemoteProtocolError("a note must be [lost, base, last]")
        lost, base, last = note
        if len(lost) > MAX_LOST or not all(type(n) is int and 0 <= n < MAX_RANK for n in lost):
            raise RemoteProtocolError("a note's lost nodes must be node ids")
        if type(base) is not int or type(last) is not int or base < 0 or not -1 <= last < 2**63:
            raise RemoteProtocolError("a note's base and last round must be ints")
        out.append((tuple(lost), base, last))
    return tuple(out)
