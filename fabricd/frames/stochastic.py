"""A stochastic reduce's UPDATE, NOTIFY and ACK (ASAP §4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK
from fabricd.wire import MAX_TAG, Kind, Meta, get_int, get_str

#: a NOTIFY's tag saying the reduce is broken (ranks called it two ways): the highest, far
#: from any barrier step's
BROKEN: Final = MAX_TAG

#: the longest edge list a stochastic reduce's spec may carry (``graph = "edges"``)
MAX_SPEC_EDGES: Final = 4096
#: the fields of a stochastic reduce's spec, every one always present: what every call of the
#: reduce agrees on
GRAPH_SPEC_FIELDS: Final = ("graph", "n", "degree", "seed", "edges", "sync", "dtype", "nbytes")


def _graph_spec(meta: Meta, key: str = "spec") -> dict[str, Any]:
    """A stochastic reduce's spec (field ``key``), each field of its type and range: a peer's
    spec reaches the graph generators and the reducer's allocations, which must never see
    another type."""
    spec = meta.get(key)
    # str(): a bytes key (msgpack allows them) never equals a field's name, nor sorts with one
    if not isinstance(spec, dict) or sorted(map(str, spec)) != sorted(GRAPH_SPEC_FIELDS):
        raise RemoteProtocolError(f"field {key!r} must be a map of {', '.join(GRAPH_SPEC_FIELDS)}")
    degree, edges = spec["degree"], spec["edges"]
    if edges is not None and (
        not isinstance(edges, list)
        or len(edges) > MAX_SPEC_EDGES
        or not all(
            isinstance(edge, list)
            and len(edge) == 2
            and all(type(x) is int and 0 <= x < MAX_RANK for x in edge)
            for edge in edges
        )
    ):
        raise RemoteProtocolError(
            f"a spec's edges must be a list of at most {MAX_SPEC_EDGES} [src, dst] rank pairs"
        )
    return {
        "graph": get_str(spec, "graph"),
        "n": get_int(spec, "n", lo=1, hi=MAX_RANK),
        "degree": None if degree is None else get_int(spec, "degree", hi=MAX_RANK),
        "seed": get_int(spec, "seed"),
        "edges": edges,
        "sync": get_str(spec, "sync"),
        "dtype": get_str(spec, "dtype"),
        "nbytes": get_int(spec, "nbytes", lo=1),
    }


def describe(spec: dict[str, Any]) -> str:
    """A spec in words, as a failure names it."""
    return (
        f"{spec['sync']} over a {spec['graph']} graph, {spec['nbytes']} B of {spec['dtype']}"
        + (f", degree {spec['degree']}" if spec["degree"] is not None else "")
        + (f", seed {spec['seed']}" if spec["seed"] else "")
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _GraphFrame:
    """The fields every stochastic-reduce frame has: whose reduce, between which ranks, which
    round (fabricd/engines/stochastic/notify_ack.py)."""

    job: str
    name: str
    src: int
    dst: int
    round: int

    def _meta(self) -> Meta:
        return {
            "job": self.job,
            "name": self.name,
            "src": self.src,
            "dst": self.dst,
            "r": self.round,
        }

    @staticmethod
    def _fields(meta: Meta) -> dict[str, Any]:
        name = get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise RemoteProtocolError(f"stochastic reduce name of {len(name)} characters")
        return {
            "job": get_str(meta, "job"),
            "name": name,
            "src": get_int(meta, "src", hi=MAX_RANK),
            "dst": get_int(meta, "dst", hi=MAX_RANK),
            "round": get_int(meta, "r"),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Update(_GraphFrame):
    """Rank ``src``'s model update of ``round`` for rank ``dst`` (data channel): the payload
    is the update, versions included, whole, into ``dst``'s slot for ``src``.  ``spec`` says
    what every call of the reduce agrees on (graph, sync, dtype, bytes), so a node whose rank
    has not called yet can build its side."""

    KIND: ClassVar[Kind] = Kind.UPDATE
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {**self._meta(), "spec": self.spec}

    @classmethod
    def from_meta(cls, meta: Meta) -> Update:
        return cls(**cls._fields(meta), spec=_graph_spec(meta))


@dataclass(frozen=True, slots=True, kw_only=True)
class Notify(_GraphFrame):
    """Rank ``src``'s update of ``round`` for ``dst`` is out (``tag`` 0), or ``src`` reached
    step ``tag - 2`` of round ``round``'s barrier (control channel, no payload); or, with
    ``tag`` :data:`BROKEN`, the reduce was called two ways, ``spec`` and ``other``: it is
    broken on every member node (a node that saw the difference tells each of the others)."""

    KIND: ClassVar[Kind] = Kind.NOTIFY
    tag: int
    spec: dict[str, Any]
    other: dict[str, Any] | None = None  #: the second spec, with ``tag`` BROKEN only

    def to_meta(self) -> Meta:
        meta = {**self._meta(), "t": self.tag, "spec": self.spec}
        return meta if self.other is None else {**meta, "o": self.other}

    @classmethod
    def from_meta(cls, meta: Meta) -> Notify:
        tag = get_int(meta, "t", hi=MAX_TAG)
        if (tag == BROKEN) != ("o" in meta):
            raise RemoteProtocolError("a NOTIFY has a second spec if and only if it is BROKEN")
        other = _graph_spec(meta, "o") if tag == BROKEN else None
        return cls(**cls._fields(meta), tag=tag, spec=_graph_spec(meta), other=other)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack(_GraphFrame):
    """Rank ``src`` reduced rank ``dst``'s update of ``round``: ``dst`` may send the next
    (control channel, no payload)."""

    KIND: ClassVar[Kind] = Kind.ACK

    def to_meta(self) -> Meta:
        return self._meta()

    @classmethod
    def from_meta(cls, meta: Meta) -> Ack:
        return cls(**cls._fields(meta))
