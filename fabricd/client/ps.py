"""The parameter-server facet: push updates, pull the model (MLfabric Table 1; TDF §III).

>>> ps = fab.parameter_server("model", (n,), "float32", role="worker", servers=[0],
...                           consistency="ssp", staleness=4)
>>> version = ps.pull(out=w)          # w: the model, only what changed since w's version moves
>>> ps.push(grad)                     # the server applies it with its update rule

Every rank of the job opens the model with the same ``name``, ``shape``, ``dtype``,
``servers``, ``replicas``, ``consistency``, ``staleness``, ``delay_bound`` and ``chunk`` (an
open unlike a rank's open elsewhere is refused, or, if the two crossed, every rank's next call
fails: ``UsageError`` naming both); the
ranks in ``servers`` (one per key-range shard) open it with ``role="server"``, those in
``replicas`` (one per server, optional) with ``role="replica"``, every other rank is a worker.
A server's or replica's state lives in its daemon for as long as its process keeps the
connection: the process opens the model and stays (:meth:`ParameterServer.serve`).

Consistency (:mod:`fabricd.engines.ps.consistency`): ``"bsp"`` (an iteration is applied once
every worker pushed it; a push returns once applied), ``"ssp"`` with ``staleness=s`` (a pull
waits until the model lacks at most the last ``s`` iterations of any worker), ``"async"``
(applied on arrival; with ``delay_bound=tau_max`` an update more than ``tau_max`` versions
stale is dropped, at the worker when it can tell, and counted).

Filters (:class:`~fabricd.engines.ps.filters.FilterSettings`, all off by default): G-SMP, G-RP
and G-LNP on the workers' pushes, P-SMP (TDF's, or the lossless publish mode) and P-LNP on the
servers' pulls.  ``update_rule``: ``"sum"`` (``w += u``) or ``"sgd"`` with ``lr`` and
``momentum`` (the pushed update is a gradient; MLfabric eq. 2), and optionally
``lr_delay="adaptive"`` (with ``lr_t0``): each update's step size
``lr * sqrt(t0 / (t0 + t + tau))`` shrinks with the model's version ``t`` and the update's
delay ``tau`` (AdaDelay, MLfabric §3.1, §10.4; :class:`fabricd.engines.ps.consistency.SGD`).

Failover: with replicas, a server that dies is replaced by its replica; the calls in flight
complete there (nothing acknowledged is lost, versions never go back) and the client gets a
``ps_epoch`` event (:meth:`~fabricd.client.Client.poll`); :attr:`ParameterServer.epochs` says
which shards changed hands.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from fabricd.client import checks
from fabricd.client.handle import Handle
from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.ps.bounded import DivergenceBound
from fabricd.engines.ps.filters import FilterSettings
from fabricd.errors import DaemonUnavailable, UsageError
from fabricd.frames.fields import MAX_NAME
from fabricd.frames.ps import DISTRIBUTIONS, REPLICATIONS, SCHEDULINGS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.client.arrays import SharedArrays
    from fabricd.client.connection import Connection
    from fabricd.engines.ps.consistency import UpdateCallback
    from fabricd.wire import Meta

Role = Literal["worker", "server", "replica"]
Consistency = Literal["async", "bsp", "ssp"]
ROLES: Final = ("worker", "server", "replica")
CONSISTENCIES: Final = ("async", "bsp", "ssp")
#: the sgd rule's step-size schedules (``lr_delay``; the engine's ``LR_DELAYS``)
LR_DELAYS: Final = ("adaptive",)


@dataclass(frozen=True, slots=True, kw_only=True)
class PushResult:
    """What a push returns: its ``iteration`` (the worker's clock before it), each shard's
    model version after processing it, why shards did not apply it (``dropped``: the delay
    bound, at the worker or the server), and each shard's epoch."""

    iteration: int
    versions: tuple[int, ...]
    dropped: tuple[str, ...]
    epochs: tuple[int, ...]


class ParameterServer:
    """One rank's handle on a parameter-server model (module docstring).

    Attributes:
        name, role, shape, dtype: as opened.
        shards: how many servers the model is split over; ``bounds``: each shard's
            ``[lo, hi)`` range of the flattened model.
        epochs: per shard, 0 while its first server serves it, 1 once its replica took over.
    """

    def __init__(
        self,
        connection: Connection,
        arrays: SharedArrays,
        *,
        name: str,
        role: Role,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        reply: Meta,
        callback: UpdateCallback | None = None,
        step: np.ndarray[Any, Any] | None = None,
        servers: dict[str, ParameterServer] | None = None,
    ) -> None:
        """``callback`` and ``step``: a server's update callback and its step buffer;
        ``servers``: the client's models with a callback, by name (:meth:`serve` runs
        theirs)."""
        self._connection = connection
        self._arrays = arrays
        self.name = name
        self.role = role
        self.shape = shape
        self.dtype = dtype
        self.size = int(np.prod(shape))
        self.bounds: list[tuple[int, int]] = [(int(a), int(b)) for a, b in reply["bounds"]]
        self.shards = int(reply["shards"])
        self.epochs: tuple[int, ...] = (0,) * self.shards
        self._staging: np.ndarray[Any, Any] | None = None
        self._callback = callback
        self._step = step
        self._shard = reply.get("shard")
        self._servers = {} if servers is None else servers
        if callback is not None:
            self._servers[name] = self

    # -- worker ---------------------------------------------------------------------------
    def push(
        self,
        update: np.ndarray[Any, Any],
        norm: float | None = None,
        *,
        timeout: float | None = None,
    ) -> PushResult:
        """Push ``update`` (the model's shape and dtype) as this worker's next iteration;
        returns once every shard processed it (under BSP: once the iteration was applied).

        ``norm``: the update's norm (MLfabric's ``push(update, norm)``), checked and carried
        to the shard's scheduler under ``scheduling="mlfabric"`` (the bounded-divergence
        replication of MLfabric §5.3 reads it); ``None``: the daemon computes each shard's.

        Raises:
            UsageError: not a worker, a wrong shape or dtype, a NaN or an infinity, a push
                or pull still open; a rank opened the model with another spec (both named).
            PeerFailed: a shard has no server any more.
        """
        return self.push_async(update, norm).wait(timeout)

    def push_async(
        self, update: np.ndarray[Any, Any], norm: float | None = None
    ) -> Handle[PushResult]:
        """Start a push; ``update`` may be reused once the handle's ``wait()`` returned."""
        self._worker_only("push")
        if norm is not None and (
            isinstance(norm, bool)
            or not isinstance(norm, int | float)
            or not math.isfinite(norm)
            or norm < 0
        ):
            raise UsageError(f"norm is a finite number >= 0 or None, not {norm!r}")
        array = self._shared(update, "update", copy_in=True)
        fields = self._where(array)
        if norm is not None:
            fields["norm"] = float(norm)
        call = self._connection.submit(
            "ps_push", fields, what=f"push to parameter server {self.name!r}"
        )
        return Handle(self._connection, call, self._pushed)

    def pull(self, out: np.ndarray[Any, Any], *, timeout: float | None = None) -> int:
        """Bring ``out`` (the model's shape and dtype) up to date with the model and return
        its version (the least of its shards' versions).  Only what changed since ``out``'s
        last pull travels, when ``out`` is a ``fab.array()``; any other array is filled from
        a shared copy.

        Raises:
            UsageError: not a worker, a wrong shape or dtype, a push or pull still open; a
                rank opened the model with another spec (both named).
            PeerFailed: a shard has no server any more, or refused this worker.
        """
        target = self._shared(out, "out", copy_in=False)
        version = self._pull(target).wait(timeout)
        if target is not out:
            np.copyto(out, target.reshape(out.shape))
        return version

    def pull_async(self, out: np.ndarray[Any, Any]) -> Handle[int]:
        """Start a pull into ``out``, a ``fab.array()`` of the model's shape and dtype, which
        must be left alone until the handle's ``wait()`` returns the version."""
        target = self._shared(out, "out", copy_in=False)
        if target is not out:
            raise UsageError("pull_async writes into out itself: make it with fab.array()")
        return self._pull(target)

    def _pull(self, target: np.ndarray[Any, Any]) -> Handle[int]:
        self._worker_only("pull")
        if not target.flags.writeable:
            raise UsageError("pull writes the model into out: not a read-only array")
        call = self._connection.submit(
            "ps_pull", self._where(target), what=f"pull from parameter server {self.name!r}"
        )
        return Handle(self._connection, call, self._pulled)

    # -- server ---------------------------------------------------------------------------
    def serve(self, duration: float | None = None, *, poll: float = 0.5) -> None:
        """Keep this server or replica serving for ``duration`` seconds (``None``: until the
        connection ends).  The daemon does the work; this process only has to stay, and run
        the update callbacks of the models it opened with one (for every such model of this
        client, whichever ``serve`` runs).  Other events the daemon pushes meanwhile are read
        and dropped.

        Raises:
            UsageError: a rank opened one of this client's models with another spec than
                this process (the daemon's ``ps_disagreed`` event names both): every rank of
                it must open it alike, and the workers' calls fail too.
            DaemonUnavailable: the daemon went away (the shard's state went with it); not
                when this process closed the client, which ends serving.
        """
        if self.role == "worker":
            raise UsageError("serve() is for a server or replica; workers push and pull")
        end = None if duration is None else time.monotonic() + duration
        while end is None or time.monotonic() < end:
            wait = poll if end is None else max(0.0, min(poll, end - time.monotonic()))
            try:
                events = self._connection.poll(wait)
            except DaemonUnavailable:
                if self._connection.closed_here:
                    return  # this process closed the client: serving ends with it
                raise
            for event in events:
                if event.name == "ps_step":
                    self._servers[str(event.fields["name"])]._run_step(event.fields)
                elif event.name == "ps_disagreed":
                    raise UsageError(str(event.fields["message"]))

    def _run_step(self, fields: Meta) -> None:
        """Run the update callback on the daemon's step: the model and the update are in the
        step buffer; the callback changes the model in place, and the daemon reads it back."""
        assert self._callback is not None
        assert self._step is not None
        self._callback(self._step[0], self._step[1])
        call = self._connection.submit(
            "ps_stepped",
            {"name": self.name, "shard": int(fields["shard"]), "version": int(fields["version"])},
            what=f"update callback of parameter server {self.name!r}",
        )
        self._connection.wait(call, 30.0).result("ps_stepped")

    def flush(self, *, timeout: float | None = 30.0) -> bool:
        """Publish what the lossless publish mode held back on this rank's shard (the end of
        training, a checkpoint): the workers' next pulls get the exact model.  Through the
        replication log, so the replica publishes the same.  ``False``: this rank follows its
        partner, which serves the shard (flush there).

        Raises:
            UsageError: called on a worker; a rank opened the model with another spec.
        """
        return self.flush_async().wait(timeout)

    def flush_async(self) -> Handle[bool]:
        """Start a :meth:`flush`; the handle's ``wait()`` returns what ``flush`` returns.

        Raises:
            UsageError: called on a worker.
        """
        if self.role == "worker":
            raise UsageError("flush() is for a server or replica; workers push and pull")
        call = self._connection.submit(
            "ps_flush", {"name": self.name}, what=f"flush of parameter server {self.name!r}"
        )
        return Handle(self._connection, call, _flushed)

    # -- internals ------------------------------------------------------------------------
    def _worker_only(self, what: str) -> None:
        if self.role != "worker":
            raise UsageError(
                f"{what} is for workers; this rank opened {self.name!r} as {self.role}"
            )

    def _shared(self, array: object, what: str, *, copy_in: bool) -> np.ndarray[Any, Any]:
        """``array`` if it is a whole ``fab.array()`` of the model, else a shared staging copy."""
        if not isinstance(array, np.ndarray):
            raise UsageError(f"{what} is a numpy array, not {type(array).__name__}")
        if array.dtype != self.dtype or array.size != self.size:
            raise UsageError(
                f"{what} must hold {self.size} elements of {self.dtype} ({self.shape}), not "
                f"{array.size} of {array.dtype} {array.shape}"
            )
        try:
            self._arrays.locate(array)
            if array.flags.c_contiguous:
                return array
        except UsageError:
            pass
        if self._staging is None:
            self._staging = self._arrays.create(f"ps:{self.name}", (self.size,), self.dtype.name)
        if copy_in:
            np.copyto(self._staging, array.reshape(-1))
        return self._staging

    def _where(self, array: np.ndarray[Any, Any]) -> Meta:
        seg, offset = self._arrays.locate(array)
        return {
            "name": self.name,
            "seg": seg,
            "off": offset,
            "nbytes": array.nbytes,
            "dtype": array.dtype.name,
        }

    def _pushed(self, reply: Meta) -> PushResult:
        self.epochs = tuple(int(e) for e in reply["epochs"])
        return PushResult(
            iteration=int(reply["iteration"]),
            versions=tuple(int(v) for v in reply["versions"]),
            dropped=tuple(str(d) for d in reply["dropped"]),
            epochs=self.epochs,
        )

    def _pulled(self, reply: Meta) -> int:
        self.epochs = tuple(int(e) for e in reply["epochs"])
        return int(reply["version"])


def _flushed(reply: Meta) -> bool:
    return bool(reply["flushed"])


def open_request(
    *,
    name: object,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    role: object,
    servers: Sequence[int],
    replicas: Sequence[int],
    consistency: object,
    staleness: object,
    delay_bound: object,
    update_rule: object,
    lr: object,
    momentum: object,
    filters: FilterSettings | None,
    chunk: object,
    seed: object,
    lr_delay: object = None,
    lr_t0: object = None,
    scheduling: object = "arrival",
    aggregation: object = False,
    replication: object = "chain",
    divergence_bound: object = None,
    distribution: object = "direct",
) -> Meta:
    """The ``ps_open`` request's fields, every argument checked first."""
    bound = _bound(replication, divergence_bound)
    mlfabric = _mlfabric_fields(scheduling, aggregation, distribution)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise UsageError(f"a parameter server name is a str of 1 to {MAX_NAME} chars")
    if role not in ROLES:
        raise UsageError(f"role must be one of {', '.join(map(repr, ROLES))}, not {role!r}")
    if consistency not in CONSISTENCIES:
        raise UsageError(
            f"consistency must be one of {', '.join(map(repr, CONSISTENCIES))}, not {consistency!r}"
        )
    if dtype.name not in DTYPES:
        raise UsageError(f"a parameter server holds {', '.join(DTYPES)}, not {dtype}")
    counts: dict[str, int | None] = {}
    for what, value, low in (
        ("staleness", staleness, 0),
        ("chunk", chunk, 1),
        ("seed", seed, 0),
        ("delay_bound", delay_bound, 0),
    ):
        if value is None and what == "delay_bound":
            counts[what] = None
            continue
        number = checks.integer(value, what, f"an int >= {low}")
        if number < low:
            raise UsageError(f"{what} must be an int >= {low}, not {number}")
        counts[what] = number
    rule = _rule_fields(update_rule, lr=lr, momentum=momentum, lr_delay=lr_delay, lr_t0=lr_t0)
    if filters is not None and not isinstance(filters, FilterSettings):
        raise UsageError("filters must be a fabricd.FilterSettings")
    ranks = []
    for what, seq in (("servers", servers), ("replicas", replicas)):
        if isinstance(seq, str | bytes) or not hasattr(seq, "__iter__"):
            raise UsageError(f"{what} must be a sequence of ranks (ints), not {seq!r}")
        ranks.append([checks.integer(r, f"each of {what}", "an int rank") for r in seq])
    return {
        "name": name,
        "role": role,
        "size": int(np.prod(shape)),
        "dtype": dtype.name,
        "servers": ranks[0],
        "replicas": ranks[1],
        "consistency": consistency,
        **counts,
        **rule,
        "filters": None if filters is None else asdict(filters),
        **mlfabric,
        "replication": replication,
        "divergence_bound": None if bound is None else bound.to_spec(),
    }


def _mlfabric_fields(scheduling: object, aggregation: object, distribution: object) -> Meta:
    """The ``ps_open`` request's MLfabric fields, checked (what goes with what is the
    daemon's to check, ps_requests.py)."""
    if scheduling not in SCHEDULINGS:
        raise UsageError(
            f"scheduling must be one of {', '.join(map(repr, SCHEDULINGS))}, not {scheduling!r}"
        )
    if not isinstance(aggregation, bool):
        raise UsageError(f"aggregation must be True or False, not {aggregation!r}")
    if distribution not in DISTRIBUTIONS:
        raise UsageError(
            f"distribution must be one of {', '.join(map(repr, DISTRIBUTIONS))}, "
            f"not {distribution!r}"
        )
    return {"scheduling": scheduling, "aggregation": aggregation, "distribution": distribution}


def _bound(replication: object, value: object) -> DivergenceBound | None:
    """``replication=`` checked, and ``divergence_bound=``: None, a norm (a number) or a
    :class:`DivergenceBound`."""
    if replication not in REPLICATIONS:
        raise UsageError(
            f"replication must be one of {', '.join(map(repr, REPLICATIONS))}, not {replication!r}"
        )
    if value is None or isinstance(value, DivergenceBound):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(
            f"divergence_bound is a norm (a number) or a DivergenceBound, not {value!r}"
        )
    return DivergenceBound(norm=float(value))


def _rule_fields(update_rule: object, **settings: object) -> Meta:
    """The ``ps_open`` request's update-rule fields, checked: ``rule``, the numbers ``lr``,
    ``momentum`` and ``lr_t0``, and ``lr_delay`` (None or ``"adaptive"``).  ``lr_delay`` and
    ``lr_t0`` are refused with any rule but ``"sgd"`` (on every rank: they are new), ``lr`` and
    ``momentum`` with a callback; the daemon of a server or replica checks the values
    (``lr > 0`` ...) where it makes the rule
    (:func:`fabricd.engines.ps.consistency.update_rule`)."""
    adaptive = sorted(k for k in ("lr_delay", "lr_t0") if settings[k] is not None)
    if callable(update_rule):
        given = sorted(k for k, v in settings.items() if v is not None)
        if given:
            raise UsageError(f"{'= and '.join(given)}= belong to update_rule='sgd', not a callback")
    elif update_rule not in ("sum", "sgd"):
        raise UsageError(f"update_rule must be 'sum', 'sgd' or a callable, not {update_rule!r}")
    elif update_rule != "sgd" and adaptive:
        raise UsageError(f"{'= and '.join(adaptive)}= belong to update_rule='sgd', not 'sum'")
    lr_delay = settings.pop("lr_delay")
    if lr_delay not in (None, *LR_DELAYS):
        raise UsageError(f"lr_delay must be one of {LR_DELAYS} or None, not {lr_delay!r}")
    numbers = {}
    for what, value in settings.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise UsageError(f"{what} must be a number, not {value!r}")
        numbers[what] = None if value is None else float(value)
    rule = "callback" if callable(update_rule) else update_rule
    return {"rule": rule, "lr_delay": lr_delay, **numbers}
