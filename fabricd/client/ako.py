"""The partial-exchange facet: Ako's decentralised training with partial gradient exchange
(Ako §3-§4).

``ex = fab.partial_exchange("model", w, partitions="auto", lr=0.05, staleness=2)`` opens an
exchange of the model ``w`` (a 1-d float array made by ``fab.array()``) between the job's
ranks.  ``ex.step(grad)`` applies the rank's own gradient to its model (``w -= lr * grad``)
and hands the daemon a part of its last ``p`` gradients for each peer; the daemon applies the
parts the peers send into ``w`` as they come, so ``w`` changes between steps.  Each gradient
reaches every peer whole within ``p`` rounds; the bytes a rank sends per round are ``(n - 1) /
p`` models, so with ``partitions="auto"`` (eq. 3: ``p`` from the rank's gradient rate and its
node's bandwidth) they stay flat as the job grows.  ``step`` returns once the staleness gate
lets the trainer compute the next gradient: at most ``p + staleness`` rounds ahead of the
slowest reachable peer it heard of.  ``ex.flush()`` (every rank calls it) sends what the
windows still hold and returns once everything every rank sent before is applied everywhere:
then every replica is ``w0 - lr * (every rank's gradients)``.

The daemon's service is :mod:`fabricd.daemon.services.ako`; the algorithm is
:mod:`fabricd.engines.ako.exchange` (docs/ako.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fabricd.client.handle import Handle
from fabricd.dtypes import FLOAT_DTYPES
from fabricd.errors import UsageError
from fabricd.frames.fields import MAX_NAME

if TYPE_CHECKING:
    import numpy as np

    from fabricd.client import checks
    from fabricd.client.arrays import SharedArrays
    from fabricd.client.connection import Connection
    from fabricd.wire import Meta


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What a step returns: its ``round``; the rank's ``clock`` (rounds made); the partition
    count it now uses; and ``slowest``, the least clock heard of a reachable peer (``None``:
    none)."""

    round: int
    clock: int
    partitions: int
    slowest: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushResult:
    """What a flush returns: its number (1, 2, ...); and ``synced_from``: ``None``, or (a
    rank was unreachable or gone, so its last parts reached the survivors unevenly, Ako §4.3)
    the rank whose model every survivor took, this one's included."""

    flush: int
    clock: int
    partitions: int
    synced_from: int | None


class PartialExchange:
    """One rank's handle on a partial exchange (module docstring).  ``model`` is the array it
    was opened on; ``partitions`` the count the rank uses now (``"auto"``: ``n - 1`` while
    it measures its gradient rate over its first steps, then eq. 3's)."""

    def __init__(
        self,
        connection: Connection,
        arrays: SharedArrays,
        *,
        name: str,
        model: np.ndarray[Any, Any],
        reply: Meta,
    ) -> None:
        self._connection = connection
        self._arrays = arrays
        self.name = name
        self.model = model
        self.ranks: int = reply["ranks"]
        self.partitions: int = reply["partitions"]
        self.auto: bool = reply["auto"]
        #: ``None``, or the rank whose model this one took when the survivors took it back
        #: (it had left, and opened the exchange again: Ako §4.3)
        self.joined_from: int | None = reply.get("joined_from")
        #: the rounds and flushes this rank counts from (a rank taken back takes a survivor's)
        self.clock: int = int(reply.get("clock", 0))
        self.flushes: int = int(reply.get("flush", 0))

    def step(self, gradient: np.ndarray[Any, Any], timeout: float | None = None) -> StepResult:
        """Apply ``gradient`` (the model's dtype and size, made by ``fab.array()``) and send
        its parts; returns once the next gradient may be computed.

        Raises:
            UsageError: a gradient of another dtype or size, holding a NaN or an infinity, or
                a step while the last is open.
            PeerFailed: this rank's exchange ended (its trainer's session, the daemon).
            Timeout: ``timeout`` passed; the step is still open: wait on
                :meth:`step_async`'s handle instead.
        """
        return self.step_async(gradient).wait(timeout)

    def step_async(self, gradient: np.ndarray[Any, Any]) -> Handle[StepResult]:
        """Start a step; the gradient is read before the daemon answers anything, so the
        array may be reused once the handle is done."""
        seg, offset, _ = self._arrays.find(gradient)
        if gradient.dtype != self.model.dtype or gradient.size != self.model.size:
            raise UsageError(
                f"partial exchange {self.name!r} takes {self.model.size} elements of "
                f"{self.model.dtype}, not {gradient.size} of {gradient.dtype}"
            )
        request = {
            "name": self.name,
            "seg": seg,
            "off": offset,
            "nbytes": gradient.nbytes,
            "dtype": gradient.dtype.name,
        }
        call = self._connection.submit("ako_step", request, what=f"step of {self.name!r}")
        return Handle(self._connection, call, self._stepped)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Send what the windows still hold; returns once every part every reachable rank
        sent before its flush is applied here (every rank must flush)."""
        return self.flush_async().wait(timeout)

    def flush_async(self) -> Handle[FlushResult]:
        call = self._connection.submit(
            "ako_flush", {"name": self.name}, what=f"flush of {self.name!r}"
        )
        return Handle(self._connection, call, self._flushed)

    def _stepped(self, reply: Meta) -> StepResult:
        self.partitions = int(reply["partitions"])
        slowest = reply["slowest"]
        return StepResult(
            round=int(reply["round"]),
            clock=int(reply["clock"]),
            partitions=self.partitions,
            slowest=None if slowest is None else int(slowest),
        )

    def _flushed(self, reply: Meta) -> FlushResult:
        self.partitions = int(reply["partitions"])
        return FlushResult(
            flush=int(reply["flush"]),
            clock=int(reply["clock"]),
            partitions=self.partitions,
            synced_from=None if reply["synced_from"] is None else int(reply["synced_from"]),
        )


class PartialExchanges:
    """The facet: opens exchanges on arrays made by ``fab.array()``."""

    def __init__(
        self, connection: Connection, arrays: SharedArrays, job: checks.Membership | None
    ) -> None:
        self._connection = connection
        self._arrays = arrays
        self._job = job

    def partial_exchange(
        self,
        name: str,
        model: np.ndarray[Any, Any],
        *,
        partitions: int | Literal["auto"] = "auto",
        lr: float,
        staleness: int = 0,
        timeout: float | None = None,
    ) -> PartialExchange:
        """Open exchange ``name`` of ``model`` (module docstring); returns once every peer's
        daemon answered (a first open), or, for a rank that had left and opens the exchange
        again, once the survivors took it back at their next flush: ``model`` then holds a
        survivor's model and ``joined_from`` names it (every rank's trainer must flush for
        that; a ``timeout`` that passes leaves the open waiting).

        Raises:
            UsageError: a bad argument, or a model that is not a writeable 1-d float array
                made by ``fab.array()``.
            OperationFailed: the model is larger than one frame (``max_payload``), or the
                job's exchanges or bytes are at their bounds.
            NoSuchRank: a peer did not answer within ``route_timeout`` (not started, or its
                node unreachable).
        """
        if self._job is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"an exchange name is a str of 1 to {MAX_NAME} characters")
        if partitions != "auto" and (
            not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1
        ):
            raise UsageError(f'partitions must be "auto" or an int >= 1, not {partitions!r}')
        if (
            isinstance(lr, bool)
            or not isinstance(lr, int | float)
            or not math.isfinite(lr)
            or lr <= 0
        ):
            raise UsageError(f"lr must be a finite number > 0, not {lr!r}")
        if (
            not isinstance(staleness, int)
            or isinstance(staleness, bool)
            or not 0 <= staleness < 2**31
        ):
            raise UsageError(f"staleness must be an int from 0 to 2**31 - 1, not {staleness!r}")
        if model.dtype.name not in FLOAT_DTYPES or model.ndim != 1:
            raise UsageError(f"an exchange's model is a 1-d array of {', '.join(FLOAT_DTYPES)}")
        if not model.flags.writeable:
            raise UsageError("the daemon writes the peers' parts into the model: not read-only")
        seg, offset, _ = self._arrays.find(model)
        request = {
            "name": name,
            "seg": seg,
            "off": offset,
            "nbytes": model.nbytes,
            "dtype": model.dtype.name,
            "partitions": partitions,
            "lr": float(lr),
            "staleness": staleness,
        }
        call = self._connection.submit("ako_open", request, what=f"partial exchange {name!r}")
        reply = Handle(self._connection, call, lambda meta: meta).wait(timeout)
        return PartialExchange(self._connection, self._arrays, name=name, model=model, reply=reply)
