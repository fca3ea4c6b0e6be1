"""Ako's partial gradient exchange frame, PART (Ako §3.1, §4.2 (4)-(5))."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import MAX_NAME, MAX_RANK, get_bool
from fabricd.wire import Kind, Meta, get_int, get_str

#: the fields of an exchange's spec, every one always present: what every rank of the
#: exchange agrees on (its partition count is each rank's own: a part names its range)
EXCHANGE_SPEC_FIELDS: Final = ("n", "size", "dtype", "lr", "staleness")


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
    ``back``: a debt after ``dst`` was unreachable (frames before it may be lost)
    (fabricd/engines/ako/exchange.py).  ``spec`` says
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
        )
        if frame.src == frame.dst:
            raise RemoteProtocolError("a PART from a rank to itself")
        if frame.sync and (frame.flush is None or frame.round is not None or frame.lo):
            raise RemoteProtocolError("a SYNC part is a whole model, at the end of a flush")
        return frame
