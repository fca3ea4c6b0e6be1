"""A worker's side of one parameter-server model: its pushes and pulls over the model's shards.

Rules: this module decides, for one worker rank of one model, what each shard is sent and when
a push or a pull is complete.  It keeps the worker's state: one gradient filter per shard (TDF
§III.C, with what it holds back), one delay gate per shard (MLfabric's worker-side τmax drop),
the version of each shard the worker's cache holds, the push of each shard not yet
acknowledged and the pull not yet answered, so that both can be sent again after a link reset
or to a promoted replica (:meth:`Worker.resend`).  The ``ps`` service moves the frames, and
gives :meth:`Worker.pulled` the view of the worker's array (in its shared-memory segment) that
a shard's reply is applied to: the cache *is* the worker's array.

Sharding (MLfabric §10.2, by key range): the model's ``size`` elements are split into
contiguous ranges, one per server (:func:`shard_bounds`: as equal as possible, the first ones a
parameter longer).  A push is split along them, a pull gathered, and versions are per shard:
a pull's version is the least of its shards' (all equal under BSP, where every iteration
publishes once on every shard).

A worker has one push and one pull in flight at a time (the client waits for each): a push is
acknowledged once every shard processed it, a pull complete once every shard answered.

Under ``scheduled`` (``scheduling="mlfabric"``, :mod:`fabricd.engines.ps.scheduler`) a shard's
push is not sent at once: the shard's scheduler is told it is ready (:class:`SendReady`, with
its encoded size and its norm), and it is sent once granted (:meth:`Worker.granted`) or
reported dropped (the scheduler's PUSHED).  The norm is the client's (MLfabric's ``push(update,
norm)``, the whole update's: a bound on each shard's) or, without one, the shard's own L2 norm.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps.delay_gate import DelayGate
from fabricd.engines.ps.filters import FilterSettings, GradientFilter, Push
from fabricd.engines.ps.storage import HEADER as PULL_HEADER
from fabricd.engines.ps.storage import apply_delta
from fabricd.errors import RemoteProtocolError, UsageError

Array = np.ndarray[Any, Any]


def shard_bounds(size: int, shards: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` element ranges of ``shards`` key-range shards of ``size`` elements.

    Raises:
        UsageError: fewer elements than shards, or no shard.
    """
    if shards < 1 or size < shards:
        raise UsageError(f"{size} elements cannot be split over {shards} servers")
    base, extra = divmod(size, shards)
    bounds, lo = [], 0
    for shard in range(shards):
        hi = lo + base + (1 if shard < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def shard_norm(values: Array) -> float:
    """The L2 norm of ``values``, in float64 (a float16 shard's sum of squares overflows its
    own dtype at 65504), at most the largest finite float (a READY carries a finite norm)."""
    norm = float(np.linalg.norm(values.astype(np.float64, copy=False)))
    return norm if math.isfinite(norm) else sys.float_info.max


# -- actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SendPush:
    """Send ``shard`` its part of the push of ``iteration`` (computed from ``base``): to the
    rank serving it, or (MLfabric aggregation) to node ``via`` as a member of ``group``."""

    shard: int
    iteration: int
    base: int
    payload: bytearray
    via: int | None = None
    group: int | None = None
    base_epoch: int = 0  #: the epoch ``base`` was read at (bounded replication's rollbacks)


@dataclass(frozen=True, slots=True, kw_only=True)
class SendPull:
    """Ask ``shard`` for what changed since ``since``, at clock ``clock``; ``direct``: to be
    answered by the server at once (distribution trees: a distributor did not deliver)."""

    shard: int
    clock: int
    since: int
    direct: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PushDone:
    """The push of ``iteration`` was processed by every shard; ``dropped`` says, per shard
    that did not apply it, why (at the worker by the delay gate, or at the server)."""

    iteration: int
    versions: tuple[int, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PullDone:
    """The worker's array holds the model: shard ``i`` at ``versions[i]``."""

    versions: tuple[int, ...]

    @property
    def version(self) -> int:
        return min(self.versions)


@dataclass(frozen=True, slots=True, kw_only=True)
class PullFailed:
    """A shard will never answer the pull (``reason``)."""

    shard: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SendReady:
    """Tell ``shard``'s scheduler the push of ``iteration`` (from ``base``) is ready: ``size``
    bytes encoded, of norm ``norm``."""

    shard: int
    iteration: int
    base: int
    size: int
    norm: float
    #: joint reservation (:mod:`fabricd.engines.ps.joint`), shard 0's: every part's shard,
    #: size and base
    sizes: tuple[tuple[int, int, int], ...] | None = None
    #: joint reservation, another shard's: shard 0's scheduler plans it (PLAN)
    joint: bool = False


Action = SendPush | SendPull | SendReady | PushDone | PullDone | PullFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatistics:
    """Bytes and drops of one worker's pushes and pulls, over all shards."""

    pushes: int
    push_bytes: int  #: encoded, as sent
    push_dense_bytes: int  #: unfiltered: a dense push (header and every element) each time
    considered: int  #: gradient elements the filters looked at
    pushed: int  #: elements they let through
    smp_selected: int
    rp_selected: int
    glnp_clipped: int
    delay_dropped: int  #: shard pushes the delay gate dropped here
    server_dropped: int  #: shard pushes the server did not apply
    pulls: int
    pull_bytes: int
    pull_dense_bytes: int  #: unfiltered: a dense answer (header and every parameter) each time
    resent: int  #: pushes and pulls sent again (link reset, failover)


class Worker:
    """Worker ``worker``'s pushes and pulls of one model of ``size`` elements of ``dtype``
    sharded over ``shards`` servers (module docstring).  ``seed`` seeds G-RP's draws (with
    the worker and shard, so workers draw differently and a rerun draws the same).
    """

    def __init__(
        self,
        *,
        worker: int,
        size: int,
        dtype: str,
        shards: int,
        settings: FilterSettings | None = None,
        delay_bound: int | None = None,
        seed: int = 0,
        scheduled: bool = False,
        synchronous: bool = False,
        joint: bool = False,
    ) -> None:
        settings = settings or FilterSettings()
        self.worker = worker
        self.dtype = np.dtype(dtype)
        self.bounds = shard_bounds(size, shards)
        self.filters = [
            GradientFilter(
                settings,
                size=hi - lo,
                dtype=dtype,
                rng=np.random.default_rng([seed, worker, shard]),
            )
            for shard, (lo, hi) in enumerate(self.bounds)
        ]
        self.gates = [DelayGate(delay_bound=delay_bound) for _ in self.bounds]
        self.iteration = 0  #: the next push's iteration (the worker's clock)
        self.versions = [0] * shards  #: the versions the cache holds
        self.epochs = [0] * shards
        #: the epoch each cached version was read at (a rollback renumbers versions)
        self.read_epochs = [0] * shards
        self._base_epochs: dict[int, int] = {}  #: shard -> the in-flight push's base's epoch
        #: shards whose next pull asks for the whole model (a rollback may have lost the
        #: cache's version: the server may have another model of that number)
        self._whole: set[int] = set()
        self.scheduled = scheduled
        #: BSP (MLfabric-S): an aggregated push's acknowledgement waits for its iteration
        self.synchronous = synchronous
        #: scheduled over several shards: an update's parts are planned together, by shard
        #: 0's scheduler (:mod:`fabricd.engines.ps.joint`)
        self.joint = joint
        self._pushing: dict[int, tuple[int, int, bytearray]] = {}  #: shard -> (it, base, data)
        #: scheduled: shard -> the norm of its push not granted yet (granted ones are sent)
        self._unsent: dict[int, float] = {}
        #: aggregation: shard -> (iteration, aggregator node, group) its grant routes it by
        self._routes: dict[int, tuple[int, int, int]] = {}
        #: BSP aggregation: shard -> the norm of its push sent to an aggregator
        self._norms: dict[int, float] = {}
        self._push_results: dict[int, tuple[int, str | None]] = {}  #: shard -> (version, why)
        self._pull_clock: int | None = None
        self._pulling: set[int] = set()  #: shards whose answer is awaited
        self._pushes = self._push_bytes = self._delay_dropped = self._server_dropped = 0
        self._pulls = self._pull_bytes = self._pull_dense = self._resent = 0
        self._push_dense = 0

    # -- pushes ---------------------------------------------------------------------------
    def push(self, gradient: Array, norm: float | None = None) -> list[Action]:
        """Push ``gradient`` (the whole model's, flat, of the model's dtype) as the next
        iteration; ``norm``: the client's norm of it, if it gave one (module docstring).

        Raises:
            UsageError: a push is still in flight, or the gradient is not the model's size and
                dtype, or holds a NaN or an infinity.  Nothing changed.
        """
        if self._pushing or self._push_results:
            raise UsageError("a push is still in flight: wait for it before the next")
        if gradient.dtype != self.dtype or gradient.size != self.bounds[-1][1]:
            raise UsageError(
                f"this model takes {self.bounds[-1][1]} elements of {self.dtype}, not "
                f"{gradient.size} of {gradient.dtype}"
            )
        if not np.isfinite(gradient).all():
            raise UsageError("the update holds a NaN or an infinity: the model would too")
        iteration = self.iteration
        self.iteration += 1
        self._pushes += 1
        out: list[Action] = []
        readied: list[int] = []
        flat = gradient.reshape(-1)
        for shard, (lo, hi) in enumerate(self.bounds):
            drop = self.gates[shard].check(self.worker, iteration)
            if drop is not None:
                self._delay_dropped += 1
                self._push_results[shard] = (self.versions[shard], drop.message)
                continue
            filtered: Push = self.filters[shard].push(flat[lo:hi], iteration + 1)
            data = ps_push.encode(filtered)
            self._push_bytes += len(data)
            self._push_dense += ps_push.HEADER.size + (hi - lo) * self.dtype.itemsize
            base = self.versions[shard]
            self._pushing[shard] = (iteration, base, data)
            self._base_epochs[shard] = self.read_epochs[shard]
            if not self.scheduled:
                out.append(self._push(shard))
                continue
            mine = norm if norm is not None else shard_norm(flat[lo:hi])
            self._unsent[shard] = mine
            readied.append(shard)
        out += [self._ready(shard) for shard in readied]  # (all known: a joint READY sizes them)
        return out + self._push_done()

    def _since(self, shard: int) -> int:
        """The version a pull of ``shard`` asks for changes since."""
        return 0 if shard in self._whole else self.versions[shard]

    def _push(self, shard: int, via: int | None = None, group: int | None = None) -> SendPush:
        """The in-flight push of ``shard`` (to the server, or to aggregator ``via``)."""
        iteration, base, data = self._pushing[shard]
        return SendPush(
            shard=shard,
            iteration=iteration,
            base=base,
            payload=data,
            via=via,
            group=group,
            base_epoch=self._base_epochs.get(shard, self.epochs[shard]),
        )

    def _ready(self, shard: int) -> SendReady:
        """The READY of ``shard``'s push.  Jointly planned (:mod:`fabricd.engines.ps.joint`)
        while shard 0's part waits for its grant too: shard 0's names the size and base of
        every part that waits, the others say that shard 0's scheduler plans them.  A part
        asked again once shard 0's was granted is planned by its own shard."""
        iteration, base, data = self._pushing[shard]
        norm = self._unsent[shard]
        sizes, joint = None, False
        if self.joint and 0 in self._unsent and len(self._unsent) > 1:
            if shard == 0:
                sizes = tuple(
                    (s, len(self._pushing[s][2]), self._pushing[s][1]) for s in sorted(self._unsent)
                )
            else:
                joint = True
        return SendReady(
            shard=shard,
            iteration=iteration,
            base=base,
            size=len(data),
            norm=norm,
            sizes=sizes,
            joint=joint,
        )

    def awaits_grant(self, shard: int, iteration: int) -> bool:
        """Whether ``shard``'s push of ``iteration`` waits for its scheduler's grant."""
        pending = self._pushing.get(shard)
        return pending is not None and pending[0] == iteration and shard in self._unsent

    def route(self, shard: int, iteration: int, via: int, group: int) -> None:
        """The grant of ``shard``'s push of ``iteration`` sends it to aggregator node ``via``,
        as a member of ``group`` (MLfabric §5.2), when :meth:`granted` comes."""
        if self.awaits_grant(shard, iteration):
            self._routes[shard] = (iteration, via, group)

    def granted(self, shard: int, iteration: int) -> list[Action]:
        """``shard``'s scheduler granted the push of ``iteration`` its turn: send it (the
        caller waited the grant's wait), to the server or to its aggregator.  A grant for no
        push waiting for one is ignored."""
        if not self.awaits_grant(shard, iteration):
            return []
        norm = self._unsent.pop(shard)
        route = self._routes.get(shard)
        via, group = (route[1], route[2]) if route is not None else (None, None)
        if via is not None:
            self._norms[shard] = norm  # (BSP: asked again, if its acknowledgement is slow)
        return [self._push(shard, via, group)]

    def direct(self, shard: int, iteration: int) -> list[Action]:
        """The push of ``iteration`` went to an aggregator and the server has not acknowledged
        it in time (the aggregator died, or the aggregate was refused): send it straight to the
        server now (it applies it once, whichever copy comes first).

        Under BSP an acknowledgement also waits for the iteration's stragglers, so a slow one
        says nothing of the aggregator: the push is made ready again instead (a READY, a few
        bytes).  The shard answers nothing if it holds the push already (inside an aggregate),
        grants it straight to the server if its grant stands (the aggregate never came), or
        plans it anew: the update's bytes cross the server's link once, not twice."""
        pending = self._pushing.get(shard)
        route = self._routes.get(shard)
        if pending is None or route is None or route[0] != iteration or pending[0] != iteration:
            return []  # acknowledged, or sent again straight already: a deadline gone stale
        del self._routes[shard]
        self._resent += 1
        if self.synchronous:
            self._unsent[shard] = self._norms.pop(shard, 0.0)
            return [self._ready(shard)]
        return [self._push(shard)]

    def pushed(self, shard: int, iteration: int, version: int, dropped: str | None) -> list[Action]:
        """``shard`` processed the push of ``iteration`` (the model at ``version``).  One for
        a push not in flight (an acknowledgement sent again) is ignored."""
        pending = self._pushing.get(shard)
        if pending is None or pending[0] != iteration:
            return []
        del self._pushing[shard]
        self._base_epochs.pop(shard, None)
        self._unsent.pop(shard, None)
        self._routes.pop(shard, None)
        self._norms.pop(shard, None)
        self.gates[shard].heard(version)
        if dropped is not None:
            self._server_dropped += 1
        self._push_results[shard] = (version, dropped)
        return self._push_done()

    def _push_done(self) -> list[Action]:
        if self._pushing or len(self._push_results) < len(self.bounds):
            return []
        results = [self._push_results[s] for s in range(len(self.bounds))]
        self._push_results.clear()
        return [
            PushDone(
                iteration=self.iteration - 1,
                versions=tuple(v for v, _ in results),
                dropped=tuple(why for _, why in results if why is not None),
            )
        ]

    # -- pulls ----------------------------------------------------------------------------
    def pull(self, *, fresh: bool = False) -> list[Action]:
        """Pull the model at the worker's clock; ``fresh``: the cache holds nothing (another
        array than last time), so every shard sends everything.

        Raises:
            UsageError: a pull is still in flight.
        """
        if self._pulling:
            raise UsageError("a pull is still in flight: wait for it before the next")
        if fresh:
            self.versions = [0] * len(self.bounds)
        self._pull_clock = self.iteration
        self._pulling = set(range(len(self.bounds)))
        self._pulls += 1
        return [
            SendPull(shard=shard, clock=self.iteration, since=self._since(shard))
            for shard in range(len(self.bounds))
        ]

    def pulled(
        self,
        shard: int,
        clock: int,
        data: bytes | bytearray | memoryview,
        cache: Array,
        *,
        older: bool = False,
    ) -> list[Action]:
        """``shard``'s answer to the pull at ``clock``: apply it to ``cache`` (the worker's
        array, whole).  An answer to no pull in flight is ignored, and so is one built since
        another version than the cache's (sent again for an earlier pull of this clock) unless
        ``older`` says it may be built since an older one (a distribution tree's, taken against
        the server's notice: a reply carries values, not increments, so it fits any cache from
        its base up to its version).

        Raises:
            RemoteProtocolError: the answer is malformed or does not fit the cache's version
                (the cache is untouched).
        """
        if shard not in self._pulling or clock != self._pull_clock:
            return []
        header = PULL_HEADER.unpack_from(data) if len(data) >= PULL_HEADER.size else None
        cached = self._since(shard)
        if header is not None and not (
            header[5] <= cached <= header[6] if older else header[5] == cached
        ):
            return []
        lo, hi = self.bounds[shard]
        version = apply_delta(data, cache.reshape(-1)[lo:hi], cached)
        self._pull_bytes += len(data)
        # unfiltered, the same pull is a dense answer in the model's dtype, header included
        self._pull_dense += PULL_HEADER.size + (hi - lo) * self.dtype.itemsize
        self.versions[shard] = version
        self.read_epochs[shard] = self.epochs[shard]
        self._whole.discard(shard)
        self.gates[shard].pulled(version)
        self._pulling.discard(shard)
        if self._pulling:
            return []
        self._pull_clock = None
        return [PullDone(versions=tuple(self.versions))]

    def awaits_pull(self, shard: int, clock: int) -> bool:
        """Whether ``shard``'s answer to the pull at ``clock`` is still awaited."""
        return shard in self._pulling and clock == self._pull_clock

    def repull(self, shard: int, clock: int) -> list[Action]:
        """Distribution trees: the answer ``shard``'s pull at ``clock`` was to come through
        another worker's daemon did not come: the pull again, to be answered straight (or
        nothing: it was answered meanwhile)."""
        if not self.awaits_pull(shard, clock):
            return []
        self._resent += 1
        return [SendPull(shard=shard, clock=clock, since=self._since(shard), direct=True)]

    def refused(self, shard: int, clock: int, reason: str) -> list[Action]:
        """``shard`` will never answer the pull at ``clock``: the pull fails."""
        if shard not in self._pulling or clock != self._pull_clock:
            return []
        self._pulling.clear()
        self._pull_clock = None
        return [PullFailed(shard=shard, reason=reason)]

    # -- resets and failover --------------------------------------------------------------
    def resend(self, shard: int) -> list[Action]:
        """What ``shard`` must be sent again: its push not acknowledged and its pull not
        answered (after a reset of its server's links, or to the replica that took over)."""
        out: list[Action] = []
        pending = self._pushing.get(shard)
        if pending is not None and shard in self._unsent:
            self._routes.pop(shard, None)  # not granted yet: the scheduler is asked again
            out.append(self._ready(shard))
        elif pending is not None:  # sent: again, straight to the server
            self._routes.pop(shard, None)
            out.append(self._push(shard))
        if shard in self._pulling and self._pull_clock is not None:
            out.append(SendPull(shard=shard, clock=self._pull_clock, since=self._since(shard)))
        self._resent += len(out)
        return out

    def move(self, shard: int, epoch: int, *, forget: bool = False) -> list[Action]:
        """``shard`` is served at ``epoch`` now (its server went and its partner took over,
        or this daemon just learned so): send the new server what is in flight.  ``forget``
        (bounded replication: the new server may be behind what the cache holds): the next
        pull (the one in flight included) is whole, while pushes go on naming the version the
        cache holds with the epoch it was read at, so the server tells a base its rollback
        lost (:class:`~fabricd.engines.ps.bounded.Lineage`)."""
        if epoch <= self.epochs[shard]:
            return []
        self.epochs[shard] = epoch
        if forget:  # (the cache still holds what it held: pushes say so, with its epoch)
            self._whole.add(shard)
        return self.resend(shard)

    def failover(self, shard: int) -> list[Action]:
        """``shard``'s server is gone and its partner serves it, one epoch later."""
        return self.move(shard, self.epochs[shard] + 1)

    def check_frame(self, shard: int) -> None:
        """Raise unless ``shard`` is one of the model's."""
        if not 0 <= shard < len(self.bounds):
            raise RemoteProtocolError(f"shard {shard} of a model of {len(self.bounds)}")

    # -- reading --------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return bool(self._pushing or self._pulling)

    def waiting(self) -> list[int]:
        """The shards whose acknowledgement or answer the push or pull in flight awaits."""
        return sorted(self._pushing.keys() | self._pulling)

    def statistics(self) -> WorkerStatistics:
        stats = [f.statistics() for f in self.filters]
        return WorkerStatistics(
            pushes=self._pushes,
            push_bytes=self._push_bytes,
            push_dense_bytes=self._push_dense,
            considered=sum(s.considered for s in stats),
            pushed=sum(s.pushed for s in stats),
            smp_selected=sum(s.smp_selected for s in stats),
            rp_selected=sum(s.rp_selected for s in stats),
            glnp_clipped=sum(s.glnp_clipped for s in stats),
            delay_dropped=self._delay_dropped,
            server_dropped=self._server_dropped,
            pulls=self._pulls,
            pull_bytes=self._pull_bytes,
            pull_dense_bytes=self._pull_dense,
            resent=self._resent,
        )
