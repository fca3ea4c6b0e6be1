"""Ako's partial gradient exchange frame, PART (Ako §3.1, §4.2 (4)-(5))."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK, get_bool
from fabricd.wire import Kind, Meta, get_int, get_str

#: the fields of an exchange's spec, every one always present: what every rank of the
#: exchange agrees on (its partition count is each rank's own: a part names its range)
EXCHANGE_SPEC_FIELDS: Final = ("n", "size", "dtype", "lr", "staleness")
#: the most returning ranks one flush marker lists (a frame's arrays are bounded): more
#: wait for the next flush
MAX_JOINS: Final = 256
#: the most gone ranks a SYNC for a returning rank lists: a job that lost more for good takes
#: no rank back (its open waits, logged as stalled)
MAX_GONE: Final = 1000
#: the most dead incarnations (rank, nonce) one flush marker lists: the latest learned
MAX_DEAD_LISTED: Final = 256


class Signal(enum.Enum):
    """The rejoin handshake's signals (module docstring): carried with no payload."""

    HELLO = "hello"  #: the sender opened the exchange
    FRESH = "fresh"  #: to a HELLO: you are a member, go on
    JOIN = "join"  #: to a HELLO: you were gone; the survivors take you back at a flush


def exchange_spec(meta: Meta) -> dict[str, Any]:
    """An exchange's spec (field ``spec``), each field of its type and range (what the values
    mean is the service's to check)."""
    spec = meta.get("spec")
    # str(): a bytes key (msgpack allows them) never equals a field's name, nor sorts with one
    if not isinstance(spec, dict) or sorted(map(str, spec)) != sorted(EXCHANGE_SPEC_FIELDS):
        raise RemoteProtocolError(
            f"field 'spec' must be a map of {', '.join(EXCHANGE_SPEC_FIELDS)}"
        )
    lr = spec["lr"]
    if type(lr) is not float or not math.isfinite(lr) or lr <= 0:
        raise RemoteProtocolError("an exchange's lr is a finite float > 0")
    return {
        "n": get_int(spec, "n", lo=1, hi=MAX_RANK),
        "size": get_int(spec, "size", lo=1),
        "dtype": get_str(spec, "dtype"),
        "lr": lr,
        "staleness": get_int(spec, "staleness", hi=2**31 - 1),
    }


def describe(spec: dict[str, Any]) -> str:
    """A spec in words, as a failure names it."""
    return (
        f"{spec['size']} elements of {spec['dtype']} over {spec['n']} ranks, lr {spec['lr']}, "
        f"staleness {spec['staleness']}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """Rank ``src``'s part for rank ``dst`` of exchange ``name`` (data channel): the payload
    is values of the model's dtype for its elements from ``lo``, to be applied at once.
    ``round``: the sender's round it belongs to, or ``None`` for what ``dst`` was owed (after
    a loss, a repartition or a flush); ``clock``: the sender's rounds made; ``epoch``: its
    flushes started; ``sent``: the frames it sent ``dst``, this one included (a SYNC aside);
    ``flush``: the number of the sender's flush this frame ends for ``dst``; ``sync``: the
    sender's whole model, for ``dst`` to take at the end of flush ``flush`` (a rank went);
    ``back``: a debt after ``dst`` was unreachable (frames before it may be lost);
    ``nonce``: the sender exchange's, and ``to``, the one it knows ``dst`` by (0: none yet);
    ``signal``: a rejoin handshake's HELLO, FRESH or JOIN, with no payload; ``joins``: on a
    flush marker, the returning ranks (rank, nonce) taken back when that flush completes;
    ``join``: a SYNC for a rank taken back, with ``gone``, the sender's gone ranks a flush
    settled, and ``unsettled``, those none settled yet; ``dead``: on a flush marker, the
    incarnations (rank, nonce) the sender knows left or were superseded, or (no ``flush``, no
    payload) a death notice: the sender's own, from its daemon (:attr:`notice`); ``final``:
    on a flush marker, its ``joins`` are those a survivor completed that flush with
    (fabricd/engines/ako/rejoin.py).  ``spec`` says
    what every rank agrees on, so a node whose rank has not opened the exchange yet can hold
    the frame for it."""

    KIND: ClassVar[Kind] = Kind.PART
    job: str
    name: str
    src: int
    dst: int
    round: int | None
    lo: int
    clock: int
    spec: dict[str, Any]
    epoch: int = 0
    flush: int | None = None
    sent: int = 0
    sync: bool = False
    #: a debt after ``dst`` was unreachable: frames ``src`` sent before it may be lost
    back: bool = False
    nonce: int = 0
    to: int = 0
    signal: Signal | None = None
    joins: tuple[tuple[int, int], ...] = ()
    join: bool = False
    gone: tuple[int, ...] = ()
    unsettled: tuple[int, ...] = ()
    dead: tuple[tuple[int, int], ...] = ()
    final: bool = False

    def to_meta(self) -> Meta:
        meta: Meta = {
            "job": self.job,
            "name": self.name,
            "src": self.src,
            "dst": self.dst,
            "lo": self.lo,
            "c": self.clock,
            "e": self.epoch,
            "n": self.sent,
            "spec": self.spec,
        }
        if self.round is not None:
            meta["r"] = self.round
        if self.flush is not None:
            meta["fl"] = self.flush
        if self.sync:
            meta["sy"] = True
        if self.back:
            meta["bk"] = True
        if self.nonce:
            meta["i"] = self.nonce
        if self.to:
            meta["to"] = self.to
        if self.signal is not None:
            meta["sg"] = self.signal.value
        if self.joins:
            meta["jn"] = [list(pair) for pair in self.joins]
        if self.join:
            meta["jo"] = True
        if self.join or self.gone:
            meta["gn"] = list(self.gone)
        if self.unsettled:
            meta["us"] = list(self.unsettled)
        if self.dead:
            meta["dd"] = [list(pair) for pair in self.dead]
        if self.final:
            meta["fi"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Part:
        name = get_str(meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise RemoteProtocolError(f"an exchange name of {len(name)} characters")
        flush = get_int(meta, "fl", lo=1) if "fl" in meta else None
        frame = cls(
            job=get_str(meta, "job"),
            name=name,
            src=get_int(meta, "src", hi=MAX_RANK),
            dst=get_int(meta, "dst", hi=MAX_RANK),
            round=get_int(meta, "r") if "r" in meta else None,
            lo=get_int(meta, "lo"),
            clock=get_int(meta, "c"),
            spec=exchange_spec(meta),
            epoch=get_int(meta, "e"),
            flush=flush,
            sent=get_int(meta, "n"),
            sync=get_bool(meta, "sy") if "sy" in meta else False,
            back=get_bool(meta, "bk") if "bk" in meta else False,
            nonce=get_int(meta, "i", lo=1) if "i" in meta else 0,
            to=get_int(meta, "to", lo=1) if "to" in meta else 0,
            signal=_signal(meta),
            joins=_pairs(meta, "jn", MAX_JOINS),
            join=get_bool(meta, "jo") if "jo" in meta else False,
            gone=_ranks(meta, "gn", MAX_GONE),
            unsettled=_ranks(meta, "us", MAX_GONE),
            dead=_pairs(meta, "dd", MAX_DEAD_LISTED),
            final=get_bool(meta, "fi") if "fi" in meta else False,
        )
        if frame.src == frame.dst:
            raise RemoteProtocolError("a PART from a rank to itself")
        if frame.sync and (frame.flush is None or frame.round is not None or frame.lo):
            raise RemoteProtocolError("a SYNC part is a whole model, at the end of a flush")
        if (frame.join or frame.unsettled) and not (frame.sync and frame.join):
            raise RemoteProtocolError("a returning rank is sent a SYNC, whole")
        if frame.final and (frame.flush is None or frame.sync or not frame.back):
            raise RemoteProtocolError("only a flush marker sent again has a final listing")
        if frame.signal not in (None, Signal.FRESH) and not frame.nonce:
            raise RemoteProtocolError("a HELLO or a JOIN names its sender's nonce")
        if frame.notice and (
            frame.sync or frame.signal is not None or frame.dead != ((frame.src, frame.nonce),)
        ):
            raise RemoteProtocolError("a death notice (dd without fl) names its sender alone")
        return frame

    @property
    def notice(self) -> bool:
        """A death notice: ``dead`` without ``flush`` (and no payload), its sender's daemon
        saying the sender's incarnation (``nonce``) died: its trainer left, or its open failed
        (fabricd/engines/ako/rejoin.py, ``died``)."""
        return bool(self.dead) and self.flush is None


def _signal(meta: Meta) -> Signal | None:
    if "sg" not in meta:
        return None
    value = get_str(meta, "sg")
    try:
        return Signal(value)
    except ValueError:
        raise RemoteProtocolError(f"no handshake signal {value!r}") from None


def _ranks(meta: Meta, key: str, most: int) -> tuple[int, ...]:
    values = meta.get(key, [])
    if not isinstance(values, list) or len(values) > most:
        raise RemoteProtocolError(f"field {key!r} is a list of at most {most} ranks")
    return tuple(get_int({"r": v}, "r", hi=MAX_RANK) for v in values)


def _pairs(meta: Meta, key: str, most: int) -> tuple[tuple[int, int], ...]:
    """Field ``key``: at most ``most`` ``[rank, nonce]`` pairs (returning or dead ranks)."""
    pairs = meta.get(key, [])
    if not isinstance(pairs, list) or len(pairs) > most:
        raise RemoteProtocolError(f"field {key!r} lists at most {most} [rank, nonce] pairs")
    joins = []
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise RemoteProtocolError(f"field {key!r} holds [rank, nonce] pairs")
        rank, nonce = pair
        joins.append((get_int({"r": rank}, "r", hi=MAX_RANK), get_int({"n": nonce}, "n", lo=1)))
    return tuple(joins)
