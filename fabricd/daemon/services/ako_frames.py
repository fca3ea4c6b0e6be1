"""PART frames of the Ako service: built from the engine's actions, checked before their
payload is taken, and handed to the engine (:mod:`fabricd.daemon.services.ako`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.dtypes import FLOAT_DTYPES
from fabricd.engines.ako.exchange import SendPart, SendSignal
from fabricd.frames.ako import Part

if TYPE_CHECKING:
    from fabricd.engines.ako.exchange import Action, Exchange
    from fabricd.wire import Meta


def part_frame(
    job: str, name: str, src: int, action: SendPart | SendSignal, spec: Meta
) -> tuple[Part, bytes]:
    """The PART frame (and its payload's own bytes: queued, it waits) ``action`` sends."""
    if isinstance(action, SendSignal):
        signal = Part(
            job=job,
            name=name,
            src=src,
            dst=action.dst,
            round=None,
            lo=0,
            clock=0,
            spec=spec,
            nonce=action.nonce,
            to=action.to,
            signal=action.signal,
        )
        return signal, b""
    frame = Part(
        job=job,
        name=name,
        src=src,
        dst=action.dst,
        round=action.round,
        lo=action.lo,
        clock=action.clock,
        spec=spec,
        epoch=action.epoch,
        flush=action.flush,
        sent=action.sent,
        sync=action.sync,
        back=action.back,
        nonce=action.nonce,
        to=action.to,
        joins=action.joins,
        join=action.join,
        gone=action.gone,
        unsettled=action.unsettled,
        dead=action.dead,
        final=action.final,
    )
    return frame, action.payload.tobytes()


def received(exchange: Exchange, frame: Part, values: np.ndarray[Any, Any]) -> list[Action]:
    """``frame``'s part (``values``) handed to ``exchange``."""
    return exchange.received(
        frame.src,
        round=frame.round,
        lo=frame.lo,
        payload=values,
        clock=frame.clock,
        epoch=frame.epoch,
        flush=frame.flush,
        sent=frame.sent,
        sync=frame.sync,
        back=frame.back,
        nonce=frame.nonce,
        to=frame.to,
        joins=frame.joins,
        join=frame.join,
        gone=frame.gone,
        unsettled=frame.unsettled,
        dead=frame.dead,
        final=frame.final,
    )


def unfit(frame: Part, length: int) -> str | None:
    """Why a PART of ``length`` payload bytes cannot be a part of the model its spec names
    (checked before a buffer is given it, and before it is held); ``None``: it fits."""
    spec = frame.spec
    if spec["dtype"] not in FLOAT_DTYPES:
        return f"a model of {spec['dtype']!r}"
    itemsize = np.dtype(spec["dtype"]).itemsize
    if frame.src >= spec["n"] or frame.dst >= spec["n"]:
        return f"ranks {frame.src} and {frame.dst} in an exchange of {spec['n']}"
    if frame.signal is not None:
        return None if not length else f"a {frame.signal.value} signal with a payload"
    if frame.notice:
        return None if not length else "a death notice with a payload"
    if not length or length % itemsize or frame.lo + length // itemsize > spec["size"]:
        return f"{length} B from element {frame.lo} in a model of {spec['size']} {spec['dtype']}"
    if frame.sync and length != spec["size"] * itemsize:
        return "a SYNC that is not a whole model"
    return None
