"""What one rank's partial gradient exchange (:mod:`fabricd.engines.ako.exchange`) tells
its driver to do, and what it shows of itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from fabricd.frames.ako import Signal

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class SendPart:
    """Send rank ``dst`` ``payload`` (values of the model's dtype) for the model's elements
    from ``lo``: round ``round``'s part, or (``round`` ``None``) what ``dst`` was owed (a
    catch-up or a flush).  ``clock`` is the sender's clock; ``flush``, the number of a flush
    this frame ends for ``dst``, after ``sent`` round frames to it."""

    dst: int
    round: int | None
    lo: int
    payload: Array
    clock: int
    epoch: int = 0  #: the sender's flushes started when it sent this
    flush: int | None = None
    sent: int = 0  #: frames the sender sent ``dst`` (this one included; a SYNC aside)
    sync: bool = False  #: the sender's whole model: adopt it (a flush after a loss)
    back: bool = False  #: a debt after ``dst`` was unreachable: frames before it may be lost
    nonce: int = 0  #: the sender's
    to: int = 0  #: ``dst``'s nonce as the sender knows it (0: none heard yet)
    #: returning ranks (rank, nonce) the survivors take back when this flush completes
    joins: tuple[tuple[int, int], ...] = ()
    join: bool = False  #: a SYNC for a rank taken back: ``gone`` are the sender's gone ranks
    gone: tuple[int, ...] = ()
    #: on a join SYNC: the sender's gone ranks no flush settled yet (``gone`` are settled)
    unsettled: tuple[int, ...] = ()
    #: on a flush marker: incarnations (rank, nonce) the sender knows left or were superseded
    dead: tuple[tuple[int, int], ...] = ()
    #: on a flush marker: its ``joins`` are final, those a survivor completed that flush with
    final: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SendSignal:
    """Send rank ``dst`` a signal of the rejoin handshake (no payload)."""

    dst: int
    signal: Signal
    nonce: int  #: the sender's
    to: int  #: ``dst``'s, as the sender knows it (0: none heard yet)


@dataclass(frozen=True, slots=True, kw_only=True)
class Opened:
    """The handshake is done: the open is answered.  ``joined_from``: the rank was taken
    back, with that survivor's model (and its clock and flush count)."""

    joined_from: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stepped:
    """The step of round ``round`` is done: the gate lets the next gradient be computed."""

    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Flushed:
    """Flush number ``flush`` is complete: every part sent before it, by every reachable
    rank, is applied here; or (``synced_from``) a peer was absent and this rank took that
    reachable rank's model, as every survivor did."""

    flush: int
    synced_from: int | None = None


Action = SendPart | SendSignal | Opened | Stepped | Flushed
Phase = Literal["hello", "joining", "running"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeStatistics:
    """What ``fabricctl status`` and the metrics show of one rank's exchange."""

    clock: int  #: rounds made
    partitions: int
    slowest: int | None  #: the least clock heard of a reachable peer (None: none)
    held: bool  #: a step waits for the staleness gate
    bytes_sent: int
    bytes_received: int
    parts_sent: int
    parts_received: int
    flushes: int
    lost: tuple[int, ...]
    gone: tuple[int, ...]
    phase: Phase = "running"  #: "hello"/"joining": the open waits for answers/to be taken back
