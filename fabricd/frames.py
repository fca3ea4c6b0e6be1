"""Typed views of the peer frames' metadata, read and written at the wire boundary.

Rules: this module is the one place that knows which fields each peer frame kind carries and
what values they may hold (docs/protocol.md, "Frame kinds").  Engines take and return these
views, never raw ``dict`` metadata; the node parses a frame once, when it arrives
(:func:`parse`), and encodes it once, when it leaves (:meth:`to_meta`).

Every view is a frozen, slotted dataclass with the frame kind as ``KIND``.  :func:`parse`
raises :class:`~fabricd.errors.RemoteProtocolError` for a field that is missing or of the wrong
type or range, so a malformed frame is refused before any engine sees it, and the link that
sent it is closed.

The handshake's HELLO and AUTH have views too (:class:`Hello`, :class:`Auth`), read by their own
:func:`parse_handshake`: they are exchanged before a link is trusted, and an authenticated peer
that sends one again is refused by :func:`parse` like any other kind it may not send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.wire import MAX_TAG, PROTOCOL_VERSION, Kind, Meta, get_bytes, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Container

#: the largest rank or job size a frame carries
MAX_RANK: Final = 2**31
#: the largest uid a frame carries (uid_t is 32 bits; 2**32 - 1 is the kernel's "no uid")
MAX_UID: Final = 2**32 - 2
#: the size of a handshake nonce: fresh random bytes, one from each side
NONCE_SIZE: Final = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Liveness on the control channel; carries nothing."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Heartbeat:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """The sender is draining and will close its links."""

    KIND: ClassVar[Kind] = Kind.BYE

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Bye:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """``rank`` of ``job`` (of ``size`` ranks) now lives (``present``) or no longer lives there.

    ``owner`` is the uid of the job's owner as the sender knows it (the uid of the client that
    opened the job, not necessarily of the rank's own client, which a ``job_groups`` grant may
    have let in): every daemon enforces one owner per job (docs/architecture.md, "Jobs and
    their owners").
    """

    KIND: ClassVar[Kind] = Kind.ANNOUNCE
    job: str
    rank: int
    size: int
    present: bool
    owner: int

    def to_meta(self) -> Meta:
        return {
            "job": self.job,
            "rank": self.rank,
            "size": self.size,
            "present": self.present,
            "owner": self.owner,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Announce:
        return cls(
            job=get_str(meta, "job"),
            rank=get_int(meta, "rank", hi=MAX_RANK),
            size=get_int(meta, "size", lo=1, hi=MAX_RANK),
            present=meta.get("present") is True,
            owner=get_int(meta, "owner", hi=MAX_UID),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Described:
    """What RTS, EAGER and RTR say of a message: its key (job, src, dst, tag), size and dtype."""

    job: str
    src: int
    dst: int
    tag: int
    nbytes: int
    dtype: str

    def _described(self) -> Meta:
        return {
            "job": self.job,
            "src": self.src,
            "dst": self.dst,
            "tag": self.tag,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Rts(_Described):
    """Request to send message ``msg``: what it is, so the receiver can match it.

    ``rtr``: the receiver's RTR this send answers (0: none).  Such an RTS is already matched:
    its DATA, which carries the same ``rtr``, may arrive before it on the data channel.
    """

    KIND: ClassVar[Kind] = Kind.RTS
    msg: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        meta = {"msg": self.msg, **self._described()}
        if self.rtr:
            meta["rtr"] = self.rtr
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Rts:
        return cls(**_message_fields(meta), rtr=_optional_int(meta, "rtr"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Eager(_Described):
    """Message ``msg`` whole: what :class:`Rts` says of it, and its ``nbytes`` bytes as the
    frame's payload (control channel).  Sent only within the receiver's credit; a receiver
    whose pool is full drops the payload and treats the frame as an RTS (docs/protocol.md)."""

    KIND: ClassVar[Kind] = Kind.EAGER
    msg: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg, **self._described()}

    @classmethod
    def from_meta(cls, meta: Meta) -> Eager:
        return cls(**_message_fields(meta))

    def rts(self) -> Rts:
        """The RTS this frame stands for once its payload is dropped."""
        return Rts(msg=self.msg, **self._described())


@dataclass(frozen=True, slots=True, kw_only=True)
class Rtr(_Described):
    """Ready to receive: a receive for (``job``, ``src``, ``dst``, ``tag``) of ``nbytes`` of
    ``dtype`` is posted, and its region is ready under the receiver's number ``rtr``.  The
    sender's next send of that key may stream at once (its RTS and DATA carry ``rtr``), unless a
    send of the key is still unanswered there: then the RTR is dropped (the crossing rule)."""

    KIND: ClassVar[Kind] = Kind.RTR
    rtr: int

    def to_meta(self) -> Meta:
        return {"rtr": self.rtr, **self._described()}

    @classmethod
    def from_meta(cls, meta: Meta) -> Rtr:
        fields = _message_fields(meta, id_field="rtr")
        if not fields["rtr"]:
            raise RemoteProtocolError("an RTR numbered 0")
        return cls(**fields)


def _optional_int(meta: Meta, key: str) -> int:
    """``meta[key]`` as :func:`get_int` reads it, or 0 when the field is absent."""
    return get_int(meta, key) if key in meta else 0


def _message_fields(meta: Meta, id_field: str = "msg") -> dict[str, Any]:
    """The fields that describe a message, checked (RTS, EAGER and RTR carry them)."""
    return {
        id_field: get_int(meta, id_field),
        "job": get_str(meta, "job"),
        "src": get_int(meta, "src", hi=MAX_RANK),
        "dst": get_int(meta, "dst", hi=MAX_RANK),
        "tag": get_int(meta, "tag", hi=MAX_TAG + 1),
        "nbytes": get_int(meta, "nbytes"),
        "dtype": get_str(meta, "dtype"),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Cts:
    """Clear to send message ``msg``: its receive is posted and its region ready."""

    KIND: ClassVar[Kind] = Kind.CTS
    msg: int

    def to_meta(self) -> Meta:
        return {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cts:
        return cls(msg=get_int(meta, "msg"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Data:
    """One chunk of message ``msg``'s payload, starting at byte ``off`` (data channel);
    ``rtr``: the receiver's RTR the message answers (0: it had a CTS)."""

    KIND: ClassVar[Kind] = Kind.DATA
    msg: int
    off: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        if self.rtr:
            return {"msg": self.msg, "off": self.off, "rtr": self.rtr}
        return {"msg": self.msg, "off": self.off}

    @classmethod
    def from_meta(cls, meta: Meta) -> Data:
        msg, off = get_int(meta, "msg"), get_int(meta, "off")
        return cls(msg=msg, off=off, rtr=_optional_int(meta, "rtr"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """The receiver has all of message ``msg``, or (with ``code``) refused it."""

    KIND: ClassVar[Kind] = Kind.DONE
    msg: int
    code: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if (self.code is None) != (self.error is None):
            raise ValueError("a DONE carries both code and error, or neither")

    def to_meta(self) -> Meta:
        if self.code is None:
            return {"msg": self.msg}
        return {"msg": self.msg, "code": self.code, "error": self.error}

    @classmethod
    def from_meta(cls, meta: Meta) -> Done:
        msg = get_int(meta, "msg")
        if "code" not in meta:
            return cls(msg=msg)
        return cls(msg=msg, code=get_str(meta, "code"), error=get_str(meta, "error"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """The sender withdraws message ``msg`` (which answered RTR ``rtr``, if not 0); no (more)
    DATA of it will come."""

    KIND: ClassVar[Kind] = Kind.CANCEL
    msg: int
    rtr: int = 0

    def to_meta(self) -> Meta:
        return {"msg": self.msg, "rtr": self.rtr} if self.rtr else {"msg": self.msg}

    @classmethod
    def from_meta(cls, meta: Meta) -> Cancel:
        return cls(msg=get_int(meta, "msg"), rtr=_optional_int(meta, "rtr"))


#: the largest posted-region slot number a WRITE carries
MAX_SLOT: Final = 2**32 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One-hop write of the payload into the region the receiver posted under (``epoch``,
    ``slot``), starting at byte ``off``; ``seq`` is the writer's number for it, handed back to
    the receiver with the completion (transports/posted.py).  The payload's length is the
    frame's ``payload_len``: the header carries it, so the bounds are checked before any byte.

    The transport handles WRITE itself (it never reaches a sink): a malformed one is a protocol
    error, a well-formed one to a key the receiver does not hold is refused and dropped.
    """

    KIND: ClassVar[Kind] = Kind.WRITE
    epoch: int
    slot: int
    off: int
    seq: int

    def to_meta(self) -> Meta:
        return {"epoch": self.epoch, "slot": self.slot, "off": self.off, "seq": self.seq}

    @classmethod
    def from_meta(cls, meta: Meta) -> Write:
        return cls(
            epoch=get_int(meta, "epoch"),
            slot=get_int(meta, "slot", hi=MAX_SLOT),
            off=get_int(meta, "off"),
            seq=get_int(meta, "seq"),
        )


#: the longest collective name a frame carries
MAX_COLLECTIVE_NAME: Final = 200
#: the most lost nodes a collective frame lists
MAX_LOST: Final = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class Coll:
    """Message ``tag`` of round ``round`` of collective ``name`` of ``job`` (data channel):
    ``payload`` bytes at byte ``off`` of the slot the receiving node allocated for it when it
    built the same schedule (fabricd/engines/persistent.py).  ``lost`` and ``base`` say the
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
        if not 0 < len(name) <= MAX_COLLECTIVE_NAME:
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


#: the longest edge list a stochastic reduce's spec may carry (``graph = "edges"``)
MAX_SPEC_EDGES: Final = 4096
#: the fields of a stochastic reduce's spec, every one always present: what every call of the
#: reduce agrees on
GRAPH_SPEC_FIELDS: Final = ("graph", "n", "degree", "seed", "edges", "sync", "dtype", "nbytes")


def _graph_spec(meta: Meta) -> dict[str, Any]:
    """A stochastic reduce's spec, each field of its type and range: a peer's spec reaches
    the graph generators and the reducer's allocations, which must never see another type."""
    spec = meta.get("spec")
    # str(): a bytes key (msgpack allows them) never equals a field's name, nor sorts with one
    if not isinstance(spec, dict) or sorted(map(str, spec)) != sorted(GRAPH_SPEC_FIELDS):
        raise RemoteProtocolError(f"field 'spec' must be a map of {', '.join(GRAPH_SPEC_FIELDS)}")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _GraphFrame:
    """The fields every stochastic-reduce frame has: whose reduce, between which ranks, which
    round (fabricd/engines/notify_ack.py)."""

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
        if not 0 < len(name) <= MAX_COLLECTIVE_NAME:
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
    step ``tag - 2`` of round ``round``'s barrier (control channel, no payload)."""

    KIND: ClassVar[Kind] = Kind.NOTIFY
    tag: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {**self._meta(), "t": self.tag, "spec": self.spec}

    @classmethod
    def from_meta(cls, meta: Meta) -> Notify:
        return cls(**cls._fields(meta), tag=get_int(meta, "t", hi=MAX_TAG), spec=_graph_spec(meta))


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


#: the most servers (shards) a parameter server's spec lists
MAX_PS_SERVERS: Final = 4096
#: the longest reason or error text a parameter-server frame carries
MAX_PS_REASON: Final = 1024
#: the fields of a parameter server's spec, every one always present: what every worker and
#: server of the model agrees on (fabricd/daemon/ps_service.py checks what they mean)
PS_SPEC_FIELDS: Final = (
    "n",
    "size",
    "dtype",
    "servers",
    "replicas",
    "consistency",
    "staleness",
    "delay_bound",
    "chunk",
)
#: the kinds of entry a shard's replication log holds: a worker's push, or a lost worker
PS_ENTRIES: Final = ("push", "lose", "flush", "snapshot")


def _ranks(spec: dict[str, Any], key: str, lengths: Container[int], what: str) -> list[int]:
    """``spec[key]`` as a list of ranks whose length is in ``lengths`` (``what`` says which)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or len(value) not in lengths
        or not all(type(rank) is int and 0 <= rank <= MAX_RANK for rank in value)
    ):
        raise RemoteProtocolError(f"a spec's {key} must be a list of {what}")
    return value


def _ps_spec(meta: Meta) -> dict[str, Any]:
    """A parameter server's spec, each field of its type and range (a peer's spec sizes the
    service's allocations, which must never see another type); what the values mean, a job
    size or a consistency model the service takes, is the service's to check."""
    spec = meta.get("spec")
    # str(): a bytes key (msgpack allows them) never equals a field's name, nor sorts with one
    if not isinstance(spec, dict) or sorted(map(str, spec)) != sorted(PS_SPEC_FIELDS):
        raise RemoteProtocolError(f"field 'spec' must be a map of {', '.join(PS_SPEC_FIELDS)}")
    servers = _ranks(spec, "servers", range(1, MAX_PS_SERVERS + 1), f"1 to {MAX_PS_SERVERS} ranks")
    delay_bound = spec["delay_bound"]
    return {
        "n": get_int(spec, "n", lo=1, hi=MAX_RANK),
        "size": get_int(spec, "size", lo=1),
        "dtype": get_str(spec, "dtype"),
        "servers": servers,
        "replicas": _ranks(spec, "replicas", (0, len(servers)), "ranks, none or one per server"),
        "consistency": get_str(spec, "consistency"),
        "staleness": get_int(spec, "staleness"),
        "delay_bound": None if delay_bound is None else get_int(spec, "delay_bound"),
        "chunk": get_int(spec, "chunk", lo=1),
    }


def _ps_name(meta: Meta) -> str:
    """The parameter server's name, checked."""
    name = get_str(meta, "name")
    if not 0 < len(name) <= MAX_COLLECTIVE_NAME:
        raise RemoteProtocolError(f"parameter server name of {len(name)} characters")
    return name


def _rank(meta: Meta, key: str) -> int:
    """``meta[key]`` as a rank."""
    return get_int(meta, key, hi=MAX_RANK)


def _reason(meta: Meta, key: str) -> str | None:
    """``meta[key]``, a text of at most :data:`MAX_PS_REASON` characters, or None when the field
    is absent (it is written only when set: a nil is refused)."""
    if key not in meta:
        return None
    text = get_str(meta, key)
    if len(text) > MAX_PS_REASON:
        raise RemoteProtocolError(f"field {key!r} of {len(text)} characters")
    return text


def _with_reason(meta: Meta, key: str, text: str | None) -> Meta:
    """``meta``, with ``text`` under ``key`` if it is set."""
    if text is not None:
        meta[key] = text
    return meta


@dataclass(frozen=True, slots=True, kw_only=True)
class _ShardFrame:
    """The fields every parameter-server frame has: whose model (``job``, ``name``), which shard
    of it, and its server's rank (its primary for REPLICATE and REPLICATED)."""

    job: str
    name: str
    shard: int
    server: int

    def _meta(self) -> Meta:
        return {"job": self.job, "name": self.name, "sh": self.shard, "srv": self.server}

    @staticmethod
    def _fields(meta: Meta) -> dict[str, Any]:
        return {
            "job": get_str(meta, "job"),
            "name": _ps_name(meta),
            "shard": _rank(meta, "sh"),
            "server": _rank(meta, "srv"),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Push(_ShardFrame):
    """Rank ``worker``'s update of ``iteration``, computed from model version ``base``, for the
    shard ``server`` keeps (data channel): the payload is the shard's filtered update (a
    :class:`fabricd.engines.ps_filters.Push`) as the service encodes it.  ``epoch`` is the
    shard's epoch as the worker knows it; ``spec`` says what every rank of the model agrees
    on, so a server that has not been called yet can build its side."""

    KIND: ClassVar[Kind] = Kind.PUSH
    worker: int
    iteration: int
    base: int
    epoch: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {
            **self._meta(),
            "w": self.worker,
            "it": self.iteration,
            "b": self.base,
            "ep": self.epoch,
            "spec": self.spec,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Push:
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            base=get_int(meta, "b"),
            epoch=get_int(meta, "ep"),
            spec=_ps_spec(meta),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull(_ShardFrame):
    """Rank ``worker``, at ``clock``, asks ``server`` for the shard's parameters published
    since model version ``since``, the version its cache holds (control channel, no
    payload); answered by a PULLED once the consistency model allows."""

    KIND: ClassVar[Kind] = Kind.PULL
    worker: int
    clock: int
    since: int
    epoch: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {
            **self._meta(),
            "w": self.worker,
            "c": self.clock,
            "since": self.since,
            "ep": self.epoch,
            "spec": self.spec,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Pull:
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            clock=get_int(meta, "c"),
            since=get_int(meta, "since"),
            epoch=get_int(meta, "ep"),
            spec=_ps_spec(meta),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Pushed(_ShardFrame):
    """``server`` processed rank ``worker``'s push of ``iteration``: applied it, the model
    reaching ``version``, or dropped it, ``dropped`` saying why and ``version`` the model's
    then (control channel, no payload)."""

    KIND: ClassVar[Kind] = Kind.PUSHED
    worker: int
    iteration: int
    version: int
    epoch: int
    dropped: str | None = None

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "it": self.iteration,
            "ver": self.version,
            "ep": self.epoch,
        }
        return _with_reason(meta, "drop", self.dropped)

    @classmethod
    def from_meta(cls, meta: Meta) -> Pushed:
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            version=get_int(meta, "ver"),
            epoch=get_int(meta, "ep"),
            dropped=_reason(meta, "drop"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Pulled(_ShardFrame):
    """``server``'s answer to rank ``worker``'s pull at ``clock`` (data channel): the payload
    is the shard's parameters changed since the pull's version, the model at ``version``, as
    an index list, a bitmap or dense (fabricd/engines/ps_storage.py); none when ``error``
    says why the pull will never be answered."""

    KIND: ClassVar[Kind] = Kind.PULLED
    worker: int
    clock: int
    version: int
    epoch: int
    error: str | None = None

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "c": self.clock,
            "ver": self.version,
            "ep": self.epoch,
        }
        return _with_reason(meta, "error", self.error)

    @classmethod
    def from_meta(cls, meta: Meta) -> Pulled:
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            clock=get_int(meta, "c"),
            version=get_int(meta, "ver"),
            epoch=get_int(meta, "ep"),
            error=_reason(meta, "error"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate(_ShardFrame):
    """Entry ``index`` (from 1) of primary ``server``'s log for the shard, for its ``replica``
    (data channel): rank ``worker``'s push of ``iteration`` from version ``base`` (``entry``
    "push", the payload the push's bytes), or rank ``worker`` lost (``entry`` "lose", no
    payload, ``reason`` why), or a flush of the lossless publish mode (``entry`` "flush", no
    payload), or the primary's whole state as of entry ``index`` (``entry``
    "snapshot", from index 0, the payload fabricd/engines/ps_snapshot.py's bytes; ``worker``,
    ``iteration`` and ``base`` are 0) for a replica that joined.  The primary sends its
    entries in log order, so the replica processes them as the primary does
    (fabricd/engines/ps_server.py)."""

    KIND: ClassVar[Kind] = Kind.REPLICATE
    replica: int
    index: int
    entry: str
    worker: int
    iteration: int
    base: int
    reason: str | None = None
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "rep": self.replica,
            "ix": self.index,
            "entry": self.entry,
            "w": self.worker,
            "it": self.iteration,
            "b": self.base,
            "spec": self.spec,
        }
        return _with_reason(meta, "why", self.reason)

    @classmethod
    def from_meta(cls, meta: Meta) -> Replicate:
        entry = meta.get("entry")
        if entry not in PS_ENTRIES:
            raise RemoteProtocolError(f"field 'entry' must be one of {', '.join(PS_ENTRIES)}")
        return cls(
            **cls._fields(meta),
            replica=_rank(meta, "rep"),
            index=get_int(meta, "ix", lo=0 if entry == "snapshot" else 1),
            entry=entry,
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            base=get_int(meta, "b"),
            reason=_reason(meta, "why"),
            spec=_ps_spec(meta),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(_ShardFrame):
    """``replica`` logged and processed entries 1 .. ``index`` of primary ``server``'s log for
    the shard: the primary may process them too (control channel, no payload)."""

    KIND: ClassVar[Kind] = Kind.REPLICATED
    replica: int
    index: int

    def to_meta(self) -> Meta:
        return {**self._meta(), "rep": self.replica, "ix": self.index}

    @classmethod
    def from_meta(cls, meta: Meta) -> Replicated:
        return cls(**cls._fields(meta), replica=_rank(meta, "rep"), index=get_int(meta, "ix", lo=1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Join(_ShardFrame):
    """Rank ``replica`` opened the shard (as its server or its replica, at ``epoch`` as far
    as it knows) and asks its partner ``server`` for the shard's state: a partner that serves
    the shard answers with a REPLICATE snapshot and forwards its log from there (control
    channel, no payload; fabricd/engines/ps_server.py)."""

    KIND: ClassVar[Kind] = Kind.JOIN
    replica: int
    epoch: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        return {**self._meta(), "rep": self.replica, "ep": self.epoch, "spec": self.spec}

    @classmethod
    def from_meta(cls, meta: Meta) -> Join:
        return cls(
            **cls._fields(meta),
            replica=_rank(meta, "rep"),
            epoch=get_int(meta, "ep"),
            spec=_ps_spec(meta),
        )


#: every frame an authenticated peer may send
PeerFrame = (
    Heartbeat
    | Bye
    | Announce
    | Rts
    | Cts
    | Data
    | Done
    | Cancel
    | Write
    | Eager
    | Rtr
    | Coll
    | Update
    | Notify
    | Ack
    | Push
    | Pull
    | Pushed
    | Pulled
    | Replicate
    | Replicated
    | Join
)
#: the frames whose payload is a point-to-point message's bytes (DATA, and EAGER on control)
MessageFrame = Data | Eager
#: the frames whose payload a service places (a collective's COLL, a stochastic reduce's
#: UPDATE and a parameter server's PUSH, PULLED and REPLICATE on the data channel too)
PayloadFrame = Data | Eager | Coll | Update | Push | Pulled | Replicate

_BY_KIND: Final[dict[Kind, type[PeerFrame]]] = {
    cls.KIND: cls
    for cls in (
        Heartbeat,
        Bye,
        Announce,
        Rts,
        Cts,
        Data,
        Done,
        Cancel,
        Write,
        Eager,
        Rtr,
        Coll,
        Update,
        Notify,
        Ack,
        Push,
        Pull,
        Pushed,
        Pulled,
        Replicate,
        Replicated,
        Join,
    )
}
#: the kinds :func:`parse` reads
PEER_KINDS: Final = frozenset(_BY_KIND)


def parse(kind: Kind, meta: Meta) -> PeerFrame:
    """The typed view of a peer frame's metadata.

    Raises:
        RemoteProtocolError: not a peer frame kind, or a field is missing or out of range;
            close the link that sent it.
    """
    view = _BY_KIND.get(kind)
    if view is None:
        raise RemoteProtocolError(f"{kind.name} is not a frame a peer may send")
    return view.from_meta(meta)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first handshake frame each way: who the sender is, and its nonce.

    The initiator names the ``channel`` it opens; the acceptor answers with ``mac``, its proof of
    the shared secret (:mod:`fabricd.engines.handshake` computes and checks it).  ``node`` is
    only known to be a node id here: whether it lies in this fabric is the handshake's to check.
    """

    KIND: ClassVar[Kind] = Kind.HELLO
    version: int = PROTOCOL_VERSION
    node: int
    incarnation: int
    nonce: bytes
    channel: str | None = None
    mac: bytes | None = None
    #: whether the sender seals DATA payloads (``data_integrity = "mac"``): both ends must agree
    sealed_data: bool = False

    def to_meta(self) -> Meta:
        meta: Meta = {
            "v": self.version,
            "node": self.node,
            "inc": self.incarnation,
            "nonce": self.nonce,
            "sealed_data": self.sealed_data,
        }
        if self.channel is not None:
            meta["channel"] = self.channel
        if self.mac is not None:
            meta["mac"] = self.mac
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Hello:
        # the version first: a peer of another release may lay out its other fields otherwise,
        # and its operator should read that the releases differ, not which field is wrong
        version = get_int(meta, "v")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"peer speaks protocol {version}, this daemon {PROTOCOL_VERSION}; "
                "run the same fabricd release on every node"
            )
        node = get_int(meta, "node")
        incarnation = get_int(meta, "inc")
        nonce = get_bytes(meta, "nonce")
        if len(nonce) != NONCE_SIZE:
            raise RemoteProtocolError(
                f"handshake nonce has the wrong size ({len(nonce)} B, not {NONCE_SIZE} B)"
            )
        return cls(
            version=version,
            node=node,
            incarnation=incarnation,
            nonce=nonce,
            channel=get_str(meta, "channel") if "channel" in meta else None,
            mac=get_bytes(meta, "mac") if "mac" in meta else None,
            sealed_data=_get_bool(meta, "sealed_data"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    """The initiator's proof of the shared secret, the handshake's third and last frame."""

    KIND: ClassVar[Kind] = Kind.AUTH
    mac: bytes

    def to_meta(self) -> Meta:
        return {"mac": self.mac}

    @classmethod
    def from_meta(cls, meta: Meta) -> Auth:
        return cls(mac=get_bytes(meta, "mac"))


#: every frame of the handshake, the only frames a link may carry before it is authenticated
HandshakeFrame = Hello | Auth

_HANDSHAKE_BY_KIND: Final[dict[Kind, type[HandshakeFrame]]] = {Hello.KIND: Hello, Auth.KIND: Auth}
#: the kinds :func:`parse_handshake` reads
HANDSHAKE_KINDS: Final = frozenset(_HANDSHAKE_BY_KIND)


def parse_handshake(kind: Kind, meta: Meta) -> HandshakeFrame:
    """The typed view of a handshake frame's metadata.

    Raises:
        RemoteProtocolError: not a handshake frame kind, the peer speaks another protocol
            version, or a field is missing or out of range; close the link that sent it.
    """
    view = _HANDSHAKE_BY_KIND.get(kind)
    if view is None:
        raise RemoteProtocolError(f"{kind.name} is not a handshake frame")
    return view.from_meta(meta)


def _get_bool(meta: Meta, key: str) -> bool:
    """Return ``meta[key]`` as a bool, or raise RemoteProtocolError."""
    value = meta.get(key)
    if type(value) is not bool:
        raise RemoteProtocolError(f"field {key!r} must be true or false")
    return value
