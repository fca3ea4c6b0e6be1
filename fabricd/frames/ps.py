"""The parameter server's frames: PUSH, PULL, PUSHED, PULLED, REPLICATE, REPLICATED, JOIN,
OPENED, and MLfabric's scheduling and aggregation frames READY, GRANT, GATHER and PLAN."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK, get_bool
from fabricd.wire import Kind, Meta, get_bytes, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Container


#: the most servers (shards) a parameter server's spec lists
MAX_PS_SERVERS: Final = 4096
#: the longest reason or error text a parameter-server frame carries
MAX_PS_REASON: Final = 1024
#: the longest wait a GRANT may ask of a worker, in microseconds (an hour: a plan further out
#: than that is a broken peer's, not a schedule)
MAX_GRANT_WAIT_US: Final = 3_600_000_000
#: the values a spec's ``scheduling`` takes: arrival order, or MLfabric's (§5.1)
SCHEDULINGS: Final = ("arrival", "mlfabric")
#: the fields of a parameter server's spec, every one always present: what every worker and
#: server of the model agrees on (fabricd/daemon/services/ps.py checks what they mean)
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
    "scheduling",
    "aggregation",
    "replication",
    "divergence_bound",
    "distribution",
)
#: the values a spec's ``replication`` takes: the chain's lock step, or MLfabric's bounded
#: divergence (§3.3, §5.3; fabricd/engines/ps/bounded.py)
REPLICATIONS: Final = ("chain", "bounded")
#: the values a spec's ``distribution`` takes: every pull answered by the server, or batched
#: and spread over worker daemons in MLfabric's distribution trees (§10.3;
#: fabricd/engines/ps/distributing.py)
DISTRIBUTIONS: Final = ("direct", "tree")
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
        "scheduling": get_str(spec, "scheduling"),
        "aggregation": get_bool(spec, "aggregation"),
        "replication": get_str(spec, "replication"),
        "divergence_bound": _divergence(spec["divergence_bound"]),
        "distribution": get_str(spec, "distribution"),
    }


def _divergence(value: object) -> list[Any] | None:
    """A spec's ``divergence_bound``: None, or ``[norm, updates]``, a finite float > 0 or None
    and an int >= 1 or None (what they mean is fabricd/engines/ps/bounded.py's to check)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise RemoteProtocolError("field 'divergence_bound' must be nil or [norm, updates]")
    norm, updates = value
    if norm is not None and (type(norm) is not float or not math.isfinite(norm) or norm <= 0):
        raise RemoteProtocolError("a divergence bound's norm must be nil or a finite float > 0")
    if updates is not None and (type(updates) is not int or not 0 < updates < 2**31):
        raise RemoteProtocolError("a divergence bound's updates must be nil or an int >= 1")
    return [norm, updates]


#: the bytes of an order entry's digest of its copy (bounded replication)
DIGEST_SIZE: Final = 8
#: the most updates one aggregate carries (a batch's, at most one per worker rank)
MAX_MEMBERS: Final = 4096
#: the most entries one PLAN carries (a peer link decodes arrays of at most 1024 items, and a
#: PLAN's metadata must fit max_meta: a larger plan goes in several)
MAX_PLAN_ENTRIES: Final = 512
#: one update an aggregate holds: (worker rank, iteration, base version)
Member = tuple[int, int, int]


def _members(meta: Meta, key: str) -> tuple[Member, ...] | None:
    """``meta[key]``: the updates an aggregate holds, 1 to :data:`MAX_MEMBERS` triples of
    (worker rank, iteration, base), distinct workers; ``None`` when the field is absent."""
    if key not in meta:
        return None
    value = meta[key]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_MEMBERS
        or not all(
            isinstance(m, list)
            and len(m) == 3
            and all(type(x) is int and 0 <= x < 2**63 for x in m)
            and m[0] <= MAX_RANK
            for m in value
        )
    ):
        raise RemoteProtocolError(f"field {key!r} must be a list of [worker, iteration, base]")
    members = tuple((m[0], m[1], m[2]) for m in value)
    if len({m[0] for m in members}) != len(members):
        raise RemoteProtocolError(f"field {key!r} names a worker twice")
    return members


def _with_members(meta: Meta, key: str, members: tuple[Member, ...] | None) -> Meta:
    """``meta``, with ``members`` under ``key`` if there are any."""
    if members is not None:
        meta[key] = [list(m) for m in members]
    return meta


def _ps_name(meta: Meta) -> str:
    """The parameter server's name, checked."""
    name = get_str(meta, "name")
    if not 0 < len(name) <= MAX_NAME:
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
    :class:`fabricd.engines.ps.filters.Push`) as the service encodes it.  ``epoch`` is the
    shard's epoch as the worker knows it; ``spec`` says what every rank of the model agrees
    on, so a server that has not been called yet can build its side."""

    KIND: ClassVar[Kind] = Kind.PUSH
    worker: int
    iteration: int
    base: int
    epoch: int
    spec: dict[str, Any]
    #: MLfabric aggregation (§5.2): for the aggregator the sending node was told of in a
    #: GATHER: this push belongs to group ``group`` of ``server``'s shard
    group: int | None = None
    #: an aggregate for ``server``: the sum of these updates (``worker`` is then a rank of
    #: the aggregating node, the sender)
    members: tuple[Member, ...] | None = None
    #: bounded replication: a copy of the push for ``server``, the shard's replica, which
    #: applies it when its primary's order entry says (fabricd/engines/ps/bounded.py)
    copy: bool = False
    #: bounded replication: the epoch ``base`` was read at (a failover's rollback numbers
    #: versions again: a base names a model only with its epoch); ``None``: ``epoch``'s
    base_epoch: int | None = None

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "it": self.iteration,
            "b": self.base,
            "ep": self.epoch,
            "spec": self.spec,
        }
        if self.group is not None:
            meta["grp"] = self.group
        if self.copy:
            meta["cp"] = True
        if self.base_epoch is not None:
            meta["be"] = self.base_epoch
        return _with_members(meta, "in", self.members)

    @classmethod
    def from_meta(cls, meta: Meta) -> Push:
        push = cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            base=get_int(meta, "b"),
            epoch=get_int(meta, "ep"),
            spec=_ps_spec(meta),
            group=get_int(meta, "grp") if "grp" in meta else None,
            members=_members(meta, "in"),
            copy=get_bool(meta, "cp") if "cp" in meta else False,
            base_epoch=get_int(meta, "be") if "be" in meta else None,
        )
        if push.group is not None and push.members is not None:
            raise RemoteProtocolError("a push is for an aggregator or an aggregate, not both")
        if push.copy and (push.group is not None or push.members is not None):
            raise RemoteProtocolError("a replica's copy is one worker's push")
        return push


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull(_ShardFrame):
    """Rank ``worker``, at ``clock``, asks ``server`` for the shard's parameters published
    since model version ``since``, the version its cache holds (control channel, no
    payload); answered by a PULLED once the consistency model allows.  ``direct``: under
    distribution trees, answer it from the server at once, not through a distributor (the
    one it was told of did not deliver)."""

    KIND: ClassVar[Kind] = Kind.PULL
    worker: int
    clock: int
    since: int
    epoch: int
    spec: dict[str, Any]
    direct: bool = False

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "c": self.clock,
            "since": self.since,
            "ep": self.epoch,
            "spec": self.spec,
        }
        if self.direct:
            meta["d"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Pull:
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            clock=get_int(meta, "c"),
            since=get_int(meta, "since"),
            epoch=get_int(meta, "ep"),
            spec=_ps_spec(meta),
            direct=get_bool(meta, "d") if "d" in meta else False,
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
    an index list, a bitmap or dense (fabricd/engines/ps/storage.py); none when ``error``
    says why the pull will never be answered.

    Distribution trees (MLfabric §10.3, fabricd/engines/ps/distributing.py) add three forms:
    ``forward`` (from the server, with the payload): the receiving daemon is a distributor
    and sends the same answer on to each ``(rank, clock)`` listed; ``via`` with
    ``expect_us`` (from the server, no payload): the answer comes from worker rank ``via``'s
    daemon, within ``expect_us`` microseconds, or the pull is sent again straight; ``via``
    alone (from rank ``via``'s daemon, with the payload): the server's answer, forwarded."""

    KIND: ClassVar[Kind] = Kind.PULLED
    worker: int
    clock: int
    version: int
    epoch: int
    error: str | None = None
    forward: tuple[tuple[int, int], ...] = ()
    via: int | None = None
    expect_us: int | None = None

    @property
    def forwarded(self) -> bool:
        """Whether this is a distributor's forwarded answer (sent by rank ``via``'s daemon)."""
        return self.via is not None and self.expect_us is None

    @property
    def sender(self) -> int:
        """The rank whose node sends this frame: ``via`` for a forwarded answer, else the
        server."""
        return self.via if self.via is not None and self.expect_us is None else self.server

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "c": self.clock,
            "ver": self.version,
            "ep": self.epoch,
        }
        if self.forward:
            meta["fw"] = [list(pair) for pair in self.forward]
        if self.via is not None:
            meta["via"] = self.via
        if self.expect_us is not None:
            meta["exp"] = self.expect_us
        return _with_reason(meta, "error", self.error)

    @classmethod
    def from_meta(cls, meta: Meta) -> Pulled:
        pulled = cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            clock=get_int(meta, "c"),
            version=get_int(meta, "ver"),
            epoch=get_int(meta, "ep"),
            error=_reason(meta, "error"),
            forward=_forward(meta),
            via=get_int(meta, "via", hi=MAX_RANK) if "via" in meta else None,
            expect_us=get_int(meta, "exp", hi=MAX_GRANT_WAIT_US) if "exp" in meta else None,
        )
        if pulled.forward and (pulled.via is not None or pulled.error is not None):
            raise RemoteProtocolError("a PULLED to forward is the server's answer itself")
        if pulled.expect_us is not None and (pulled.via is None or pulled.error is not None):
            raise RemoteProtocolError("a PULLED that says when to expect an answer names its via")
        return pulled


def _forward(meta: Meta) -> tuple[tuple[int, int], ...]:
    """A PULLED's ``fw``: 1 to :data:`MAX_MEMBERS` ``[rank, clock]`` pairs, or none."""
    if "fw" not in meta:
        return ()
    value = meta["fw"]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_MEMBERS
        or not all(
            isinstance(pair, list)
            and len(pair) == 2
            and all(type(x) is int for x in pair)
            and 0 <= pair[0] <= MAX_RANK
            and 0 <= pair[1] < 2**63
            for pair in value
        )
    ):
        raise RemoteProtocolError(f"field 'fw' must be a list of 1 to {MAX_MEMBERS} [rank, clock]")
    return tuple((rank, clock) for rank, clock in value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate(_ShardFrame):
    """Entry ``index`` (from 1) of primary ``server``'s log for the shard, for its ``replica``
    (data channel): rank ``worker``'s push of ``iteration`` from version ``base`` (``entry``
    "push", the payload the push's bytes), or rank ``worker`` lost (``entry`` "lose", no
    payload, ``reason`` why), or a flush of the lossless publish mode (``entry`` "flush", no
    payload), or the primary's whole state as of entry ``index`` (``entry``
    "snapshot", from index 0, the payload fabricd/engines/ps/snapshot.py's bytes; ``worker``,
    ``iteration`` and ``base`` are 0) for a replica that joined.  The primary sends its
    entries in log order, so the replica processes them as the primary does
    (fabricd/engines/ps/server.py)."""

    KIND: ClassVar[Kind] = Kind.REPLICATE
    replica: int
    index: int
    entry: str
    worker: int
    iteration: int
    base: int
    reason: str | None = None
    spec: dict[str, Any]
    #: an aggregate's entry: the updates it holds (MLfabric §5.2)
    members: tuple[Member, ...] | None = None
    #: bounded replication: an order entry, without payload: the worker's copy brings it,
    #: and ``digest`` (8 bytes, BLAKE2b of the push's payload) says which bytes it must be
    copied: bool = False
    digest: bytes | None = None

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
        if self.copied:
            meta["cp"] = True
        if self.digest is not None:
            meta["dg"] = self.digest
        return _with_members(_with_reason(meta, "why", self.reason), "in", self.members)

    @classmethod
    def from_meta(cls, meta: Meta) -> Replicate:
        entry = meta.get("entry")
        if entry not in PS_ENTRIES:
            raise RemoteProtocolError(f"field 'entry' must be one of {', '.join(PS_ENTRIES)}")
        frame = cls(
            **cls._fields(meta),
            replica=_rank(meta, "rep"),
            index=get_int(meta, "ix", lo=0 if entry == "snapshot" else 1),
            entry=entry,
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            base=get_int(meta, "b"),
            reason=_reason(meta, "why"),
            spec=_ps_spec(meta),
            members=_members(meta, "in"),
            copied=get_bool(meta, "cp") if "cp" in meta else False,
            digest=get_bytes(meta, "dg") if "dg" in meta else None,
        )
        if frame.digest is not None and (len(frame.digest) != DIGEST_SIZE or not frame.copied):
            raise RemoteProtocolError(f"a digest is {DIGEST_SIZE} bytes, of an order entry")
        if frame.reason is not None and frame.members is not None:
            raise RemoteProtocolError("an entry is an aggregate or a drop, not both")
        if frame.copied and (frame.entry != "push" or frame.reason or frame.members):
            raise RemoteProtocolError("a copied entry is one worker's push")
        return frame


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(_ShardFrame):
    """``replica`` logged and processed entries 1 .. ``index`` of primary ``server``'s log for
    the shard: the primary may process them too (control channel, no payload).  With
    ``need`` (bounded replication), a request instead: send entry ``index`` again whole, its
    worker's copy did not come."""

    KIND: ClassVar[Kind] = Kind.REPLICATED
    replica: int
    index: int
    need: bool = False

    def to_meta(self) -> Meta:
        meta = {**self._meta(), "rep": self.replica, "ix": self.index}
        if self.need:
            meta["nd"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Replicated:
        return cls(
            **cls._fields(meta),
            replica=_rank(meta, "rep"),
            index=get_int(meta, "ix", lo=1),
            need=get_bool(meta, "nd") if "nd" in meta else False,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Join(_ShardFrame):
    """Rank ``replica`` opened the shard (as its server or its replica, at ``epoch`` as far
    as it knows) and asks its partner ``server`` for the shard's state: a partner that serves
    the shard answers with a REPLICATE snapshot and forwards its log from there (control
    channel, no payload; fabricd/engines/ps/server.py)."""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Opened:
    """Rank ``rank`` of ``job`` opened parameter server ``name`` with ``spec`` on the sending
    daemon (control channel, no payload): each daemon of the job compares it with the spec its
    own ranks opened the model with, and a difference fails their calls
    (fabricd/engines/ps/agreement.py).  ``answer``: sent back to a daemon whose OPENED was
    unlike the sender's spec, or by a daemon that refused ``rank``'s open for a spec unlike a
    peer's (``rank`` did not open it): never answered in turn, nor kept as a peer's spec."""

    KIND: ClassVar[Kind] = Kind.OPENED
    job: str
    name: str
    rank: int
    spec: dict[str, Any]
    answer: bool = False

    def to_meta(self) -> Meta:
        meta = {"job": self.job, "name": self.name, "r": self.rank, "spec": self.spec}
        if self.answer:  # written only when set
            meta["ans"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Opened:
        return cls(
            job=get_str(meta, "job"),
            name=_ps_name(meta),
            rank=_rank(meta, "r"),
            spec=_ps_spec(meta),
            answer=get_bool(meta, "ans") if "ans" in meta else False,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(_ShardFrame):
    """Rank ``worker``'s update of ``iteration`` (computed from version ``base``, ``size``
    bytes encoded, of norm ``norm``) is ready to go to the shard ``server`` keeps (control
    channel, no payload): under ``scheduling="mlfabric"`` the server's scheduler answers with a
    GRANT (send it then) or a PUSHED that says it was dropped (MLfabric §4-§5.1: the worker's
    daemon hands the push to the scheduler instead of sending it)."""

    KIND: ClassVar[Kind] = Kind.READY
    worker: int
    iteration: int
    base: int
    epoch: int
    size: int
    norm: float
    spec: dict[str, Any]
    #: joint reservation (fabricd/engines/ps/joint.py), to shard 0's server, the lead: each
    #: shard's part of the update, (shard, encoded bytes, base version) triples
    sizes: tuple[tuple[int, int, int], ...] | None = None
    #: joint reservation, to any other shard's server: the lead plans this update, wait for
    #: its PLAN
    joint: bool = False

    @property
    def largest(self) -> int:
        """The largest part it names: its own, or (``sizes``) another shard's."""
        return max([self.size, *(n for _, n, _ in self.sizes or ())])

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "it": self.iteration,
            "b": self.base,
            "ep": self.epoch,
            "n": self.size,
            "norm": self.norm,
            "spec": self.spec,
        }
        if self.sizes is not None:
            meta["sz"] = [list(part) for part in self.sizes]
        if self.joint:
            meta["j"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Ready:
        norm = meta.get("norm")
        if type(norm) is not float or not math.isfinite(norm) or norm < 0:
            raise RemoteProtocolError("field 'norm' must be a finite float >= 0")
        spec = _ps_spec(meta)
        frame = cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            base=get_int(meta, "b"),
            epoch=get_int(meta, "ep"),
            size=get_int(meta, "n"),
            norm=norm,
            spec=spec,
            sizes=_sizes(meta, "sz", len(spec["servers"])),
            joint=get_bool(meta, "j") if "j" in meta else False,
        )
        if frame.sizes is not None and (frame.joint or frame.shard != 0):
            raise RemoteProtocolError("a READY's sizes go to shard 0's server, the lead, only")
        if frame.joint and frame.shard == 0:
            raise RemoteProtocolError("shard 0's server is the lead: its READY is never 'j'")
        return frame


def _sizes(meta: Meta, key: str, shards: int) -> tuple[tuple[int, int, int], ...] | None:
    """``meta[key]``: 1 to ``shards`` (shard, bytes, base) triples of distinct shards below
    ``shards``, or ``None`` when the field is absent (the bytes' bound is the daemon's to
    check: its max_payload)."""
    if key not in meta:
        return None
    value = meta[key]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= shards
        or not all(
            isinstance(part, list)
            and len(part) == 3
            and all(type(n) is int and 0 <= n < 2**63 for n in part)
            and part[0] < shards
            for part in value
        )
        or len({part[0] for part in value}) != len(value)
    ):
        raise RemoteProtocolError(
            f"field {key!r} must list (shard, bytes, base) of distinct shards of the spec's"
        )
    return tuple((part[0], part[1], part[2]) for part in value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant(_ShardFrame):
    """``server``'s scheduler grants rank ``worker``'s update of ``iteration`` its turn: send
    the PUSH ``wait_us`` microseconds after this frame arrives (control channel, no payload;
    MLfabric §3.1.1's network time sharing, §5.1's transfer schedule)."""

    KIND: ClassVar[Kind] = Kind.GRANT
    worker: int
    iteration: int
    epoch: int
    wait_us: int
    #: MLfabric aggregation (§5.2): send the push to node ``via`` (its aggregator) as a
    #: member of group ``group``, not to ``server``
    via: int | None = None
    group: int | None = None
    #: bounded replication's copy (fabricd/engines/ps/copy_plan.py): microseconds after this
    #: frame arrives that the replica's copy may go (0: with the push, which may be later),
    #: or ``None``: held until a copy grant
    copy_us: int | None = 0
    #: a copy grant: send the held copy ``wait_us`` microseconds after this frame arrives
    copy_only: bool = False

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "w": self.worker,
            "it": self.iteration,
            "ep": self.epoch,
            "wait": self.wait_us,
        }
        if self.via is not None:
            meta |= {"via": self.via, "grp": self.group}
        if self.copy_us is None:
            meta["hold"] = True
        elif self.copy_us:
            meta["cw"] = self.copy_us
        if self.copy_only:
            meta["co"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Grant:
        via = get_int(meta, "via", hi=MAX_RANK) if "via" in meta else None
        return cls(
            **cls._fields(meta),
            worker=_rank(meta, "w"),
            iteration=get_int(meta, "it"),
            epoch=get_int(meta, "ep"),
            wait_us=get_int(meta, "wait", hi=MAX_GRANT_WAIT_US),
            via=via,
            group=None if via is None else get_int(meta, "grp"),
            copy_us=None
            if "hold" in meta and get_bool(meta, "hold")
            else get_int(meta, "cw", hi=MAX_GRANT_WAIT_US)
            if "cw" in meta
            else 0,
            copy_only=get_bool(meta, "co") if "co" in meta else False,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Gather(_ShardFrame):
    """``server``'s scheduler makes the receiving node the aggregator of group ``group``
    (MLfabric §5.2, Alg. 3): sum the PUSHes of ``members`` that come for it and send the sum
    to ``server`` as one aggregate PUSH, ``wait_us`` microseconds after this frame arrives at
    the earliest (its planned start; at once if its members came later), or with the members
    that came once the wait and a grace are over (control channel, no payload)."""

    KIND: ClassVar[Kind] = Kind.GATHER
    epoch: int
    group: int
    members: tuple[Member, ...]
    wait_us: int
    spec: dict[str, Any]

    def to_meta(self) -> Meta:
        meta = {
            **self._meta(),
            "ep": self.epoch,
            "grp": self.group,
            "wait": self.wait_us,
            "spec": self.spec,
        }
        return _with_members(meta, "in", self.members)

    @classmethod
    def from_meta(cls, meta: Meta) -> Gather:
        members = _members(meta, "in")
        if members is None:
            raise RemoteProtocolError("a GATHER names the updates it sums (field 'in')")
        return cls(
            **cls._fields(meta),
            epoch=get_int(meta, "ep"),
            group=get_int(meta, "grp"),
            members=members,
            wait_us=get_int(meta, "wait", hi=MAX_GRANT_WAIT_US),
            spec=_ps_spec(meta),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEntry:
    """One update's part for the receiving shard, as the lead planned it: grant it (send
    ``wait_us`` microseconds after the PLAN came, for ``duration_us``), or drop it
    (``reason``)."""

    worker: int
    iteration: int
    wait_us: int = 0
    duration_us: int = 0
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(_ShardFrame):
    """Rank ``lead`` (shard 0's server) planned these updates jointly with their other parts
    (MLfabric §10.2, eq. 18): ``server``, serving ``shard``, grants or drops its part of each
    as ``entries`` say (control channel, no payload; fabricd/engines/ps/joint.py)."""

    KIND: ClassVar[Kind] = Kind.PLAN
    lead: int
    entries: tuple[PlanEntry, ...]

    def to_meta(self) -> Meta:
        return {
            **self._meta(),
            "lead": self.lead,
            "in": [
                [e.worker, e.iteration, e.wait_us, e.duration_us, e.reason] for e in self.entries
            ],
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Plan:
        value = meta.get("in")
        if not isinstance(value, list) or not 0 < len(value) <= MAX_PLAN_ENTRIES:
            raise RemoteProtocolError(f"a PLAN holds 1 to {MAX_PLAN_ENTRIES} entries (field 'in')")
        entries = []
        for item in value:
            if not isinstance(item, list) or len(item) != 5:
                raise RemoteProtocolError("a PLAN entry is [w, it, wait, duration, why]")
            fields = dict(zip(("w", "it", "wait", "dur"), item[:4], strict=True))
            why = {} if item[4] is None else {"why": item[4]}
            entries.append(
                PlanEntry(
                    worker=_rank(fields, "w"),
                    iteration=get_int(fields, "it"),
                    wait_us=get_int(fields, "wait", hi=MAX_GRANT_WAIT_US),
                    duration_us=get_int(fields, "dur", hi=MAX_GRANT_WAIT_US),
                    reason=_reason(why, "why"),
                )
            )
        if len({(e.worker, e.iteration) for e in entries}) != len(entries):
            raise RemoteProtocolError("a PLAN names each update once")
        return cls(**cls._fields(meta), lead=_rank(meta, "lead"), entries=tuple(entries))
