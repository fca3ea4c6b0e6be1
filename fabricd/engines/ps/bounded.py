"""Bounded-divergence replication of a parameter-server shard (MLfabric §3.3, §5.3): how far a
primary may run ahead of its replica, and the replica's copies of the workers' pushes.

Rules: under ``replication="bounded"`` the workers' daemons send a *copy* of each push to the
shard's replica themselves, and the primary forwards only the *order* (each log entry without
its payload), so the primary's link carries each update once instead of twice (the chain's
cost, §7.3).  The primary applies an entry at once unless that would take it further from its
replica than the bound allows; the replica applies the entries in the primary's log order as
their copies arrive (§3.3: replicas that apply updates in another order diverge without bound,
eq. 6).  This module holds the two sides' bookkeeping; :class:`~fabricd.engines.ps.server.
ShardServer` drives them.

**The bound** (:class:`DivergenceBound`): ``norm``, MLfabric's ``Div_max`` on
``||w_s - w_r||``, and/or ``updates``, the most updates the primary may have applied that the
replica has not.  The primary knows, for each entry it applied and the replica has not
confirmed, the norm of the update's step size times the pushed update (``||u_j||``: the sgd
rule's ``lr``, an upper bound of AdaDelay's delay-adaptive rate, or 1 for the ``sum`` rule) and
the norm of the momentum step that entry left (``||s_t||``, exact: the rule's own), so the
replica's *history* at the entry it confirmed last is known exactly, and
:func:`fabricd.engines.scheduling.replication.divergence` (eq. 10-11, by the triangle
inequality: the derivation is that module's) bounds the divergence of applying one more.
:meth:`Lead.allows` says whether the next entry may be applied now; if not it waits for the
replica's confirmations, and an update so large that even a replica level with the primary
would break the bound waits until the replica applied it first (chain replication for that
entry: the bound is never broken, §5.3's "the server's transfer waits").

Choices where the paper is silent, and why:

* *Enforced at apply, as well as planned.*  §5.3 plans the replica's transfers so that the
  server's last transfer of a batch waits only when needed (under MLfabric's scheduling the
  shard's grants do: :mod:`fabricd.engines.ps.copy_plan`; without it workers send their copies
  with their pushes); the primary also enforces the bound on what it applies, whatever the
  network did, so a plan the network does not keep cannot break it.
* *Every lead is finite.*  With only a norm bound, small updates could let the primary lead
  by any number of entries, each kept (with its payload) until confirmed; :data:`MAX_LEAD`
  caps the count always.
* *A copy that does not come* (its link was reset, or the replica's table was full) is asked
  for: an order entry whose copy has not arrived within :data:`NEED_AFTER` seconds is asked of
  the primary, which still holds every unconfirmed entry's payload, so the replica never
  waits for ever and the primary never stalls on a lost copy.  An entry asked for again waits
  twice as long each time (up to :data:`NEED_MAX`): on a slow link the whole entry may take
  longer than a second to come, and asking every second would send it again and again.
* *Aggregates and the primary's own entries travel whole*: an aggregate's sum exists only at
  its aggregator and the primary (its members' copies summed again could round otherwise), and
  a lost worker, a flush or a scheduler's drop has no payload to copy.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from fabricd.engines.scheduling.replication import divergence
from fabricd.errors import RemoteProtocolError, UsageError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.engines.ps.shard_actions import Entry

#: the most updates a primary leads its replica by, whatever the bound (each is kept)
MAX_LEAD: Final = 1024
#: the promotions a shard's :class:`Lineage` remembers
MAX_EPOCHS: Final = 64
#: how long a replica waits for a worker's copy before it asks the primary for the entry (s);
#: each later ask for the same entry waits twice as long as the last, up to :data:`NEED_MAX`
NEED_AFTER: Final = 1.0
NEED_MAX: Final = 30.0
#: the most bytes of copies a replica holds that no order entry named yet
MAX_COPY_BYTES: Final = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DivergenceBound:
    """How far a primary may lead its replica: ``norm`` (``Div_max`` on ``||w_s - w_r||``)
    and/or ``updates`` (a count), at least one of them."""

    norm: float | None = None
    updates: int | None = None

    def __post_init__(self) -> None:
        if self.norm is None and self.updates is None:
            raise UsageError("a divergence bound needs a norm, a count of updates, or both")
        if self.norm is not None and (
            isinstance(self.norm, bool)
            or not isinstance(self.norm, int | float)
            or not (math.isfinite(self.norm) and self.norm > 0)
        ):
            raise UsageError(f"a divergence bound's norm is a finite number > 0, not {self.norm!r}")
        if self.updates is not None and (
            isinstance(self.updates, bool)
            or not isinstance(self.updates, int)
            or not 1 <= self.updates <= MAX_LEAD
        ):
            raise UsageError(
                f"a divergence bound's updates is an int of 1 to {MAX_LEAD}, not {self.updates!r}"
            )

    def to_spec(self) -> list[Any]:
        return [self.norm, self.updates]

    @classmethod
    def from_spec(cls, value: object) -> DivergenceBound:
        """The bound a spec's ``divergence_bound`` ``[norm, updates]`` says.

        Raises:
            UsageError: anything else.
        """
        if not isinstance(value, list) or len(value) != 2:
            raise UsageError(f"divergence_bound is [norm, updates], not {value!r}")
        norm, updates = value
        return cls(norm=None if norm is None else norm, updates=updates)


@dataclass(slots=True)
class _Applied:
    index: int
    updates: int  #: the pushes the entry held (0: a lost worker, a flush, a drop)
    norm: float  #: ``||u||`` of its step, before momentum
    step: float  #: ``||s||`` the entry left


class Lineage:
    """Which versions a shard's history kept through its failovers: each bounded promotion
    may roll the model back, and the versions after it are numbered again.  So a push's base
    names a model only with the epoch it was read at: a base read at an earlier epoch is kept
    only up to the least version any later promotion kept (:meth:`lost`).  The last
    :data:`MAX_EPOCHS` promotions are remembered; a base from before them is taken as lost
    unless it is 0 (every model starts there)."""

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}  #: epoch -> the version its promotion kept

    def promoted(self, epoch: int, version: int) -> None:
        self.kept[epoch] = version
        for old in sorted(self.kept)[:-MAX_EPOCHS]:
            del self.kept[old]

    def lost(self, base: int, base_epoch: int | None, epoch: int, version: int) -> str | None:
        """Why a push from version ``base`` read at ``base_epoch`` (``None``: the current
        epoch) was computed from a model this shard no longer has, at ``epoch`` and
        ``version``; ``None``: it was not."""
        kept = version
        if base_epoch is not None and base_epoch < epoch:
            later = [self.kept.get(e) for e in range(base_epoch + 1, epoch + 1)]
            kept = min(kept, *(0 if k is None else k for k in later))
        if base <= kept:
            return None
        return (
            f"computed from version {base}, which the failover to epoch {epoch} rolled back "
            f"(bounded replication; the model is at version {version})"
        )

    def state(self) -> dict[int, int]:
        return dict(self.kept)

    def restore(self, kept: object) -> None:
        """Take a snapshot's record (checked first).

        Raises:
            RemoteProtocolError: a malformed record.
        """
        if not isinstance(kept, dict) or not all(
            type(e) is int and type(v) is int and e >= 0 and v >= 0 for e, v in kept.items()
        ):
            raise RemoteProtocolError("a snapshot's lineage is malformed")
        self.kept = dict(kept)


class Lead:
    """The primary's side: the entries it applied that its replica has not confirmed, and
    whether one more may be applied (module docstring)."""

    def __init__(self, bound: DivergenceBound, momentum: float) -> None:
        self.bound = bound
        self.momentum = momentum
        self._applied: deque[_Applied] = deque()
        self._history = 0.0  #: ``||s||`` at the entry the replica confirmed last
        self.confirmed = 0  #: the last entry the replica confirmed
        self._limit = MAX_LEAD if bound.updates is None else bound.updates

    def allows(self, index: int, updates: int, norm: float) -> bool:
        """Whether entry ``index`` (``updates`` pushes, of step norm ``norm``) may be applied
        now: the replica applied it already, or the lead after it stays within the bound."""
        if index <= self.confirmed or updates == 0:
            return True
        if self.lag + updates > self._limit:
            return False
        if self.bound.norm is None:
            return True
        steps = [a.norm for a in self._applied]
        steps.append(norm)
        return divergence(self._history, steps, self.momentum) <= self.bound.norm

    def applied(self, index: int, updates: int, norm: float, step: float) -> None:
        """The primary applied entry ``index``, leaving a step of norm ``step``."""
        if index <= self.confirmed:
            if index == self.confirmed:
                self._history = step
            return
        self._applied.append(_Applied(index, updates, norm, step))

    def confirm(self, index: int) -> None:
        """The replica applied every entry up to ``index``."""
        if index <= self.confirmed:
            return
        self.confirmed = index
        while self._applied and self._applied[0].index <= index:
            last = self._applied.popleft()
            if last.index == index:
                self._history = last.step

    def reset(self, index: int, history: float) -> None:
        """The replica was given up, or a new one joined from a snapshot of every entry up to
        ``index``, all applied here, the last step's norm ``history``: nothing leads."""
        self._applied.clear()
        self._history = history
        self.confirmed = index

    @property
    def lag(self) -> int:
        """The updates applied here and not yet at the replica."""
        return sum(a.updates for a in self._applied)

    def divergence(self) -> float:
        """The bound on ``||w_s - w_r||`` now."""
        return divergence(self._history, [a.norm for a in self._applied], self.momentum)


class Copies:
    """The replica's side: copies of pushes sent by the workers' daemons, each kept until the
    primary's order entry for it comes, at most :data:`MAX_COPY_BYTES` of them (a copy beyond
    that is dropped and its entry asked of the primary in time)."""

    def __init__(self, max_bytes: int = MAX_COPY_BYTES) -> None:
        self._held: dict[tuple[int, int], tuple[int, bytes | bytearray]] = {}
        self.nbytes = 0
        self.max_bytes = max_bytes

    def add(self, worker: int, iteration: int, base: int, payload: bytes | bytearray) -> bool:
        """Keep ``worker``'s copy of ``iteration``; ``False``: no room (or held already)."""
        key = (worker, iteration)
        if key in self._held:
            return False
        if self.nbytes + len(payload) > self.max_bytes:
            return False
        self._held[key] = (base, payload)
        self.nbytes += len(payload)
        return True

    def take(self, worker: int, iteration: int, base: int) -> bytes | bytearray | None:
        """The copy of ``worker``'s ``iteration`` computed from ``base``, forgotten here; a
        copy of another base (not the push the primary took) is dropped."""
        held = self._held.pop((worker, iteration), None)
        if held is None:
            return None
        self.nbytes -= len(held[1])
        return held[1] if held[0] == base else None

    def forget(self, worker: int, upto: int) -> None:
        """Drop ``worker``'s copies of iterations up to ``upto`` (decided here already)."""
        for key in [k for k in self._held if k[0] == worker and k[1] <= upto]:
            self.nbytes -= len(self._held.pop(key)[1])

    def clear(self) -> None:
        self._held.clear()
        self.nbytes = 0


class ReplicaLog:
    """The replica's side of the log: the entries received from the primary, in order, each
    processed once it has its payload (an order entry's comes with its worker's copy, or whole
    from the primary when asked for), and the copies that came before their entries.  Under
    chain replication every entry comes whole and none waits."""

    def __init__(self, need_after: float = NEED_AFTER) -> None:
        self.need_after = need_after  #: seconds before an entry's copy is given up on
        self.received = 0  #: the last entry received
        self._parked: deque[list[Any]] = deque()  #: [entry, when it is asked for, wait]
        self._copies = Copies()

    def receive(self, entry: Entry, now: float) -> None:
        """The primary's entry ``entry.index`` (the next, or one received already whose
        payload was asked for).

        Raises:
            RemoteProtocolError: the entry skips one.
        """
        if entry.index <= self.received:
            for parked in self._parked:
                if parked[0].index == entry.index and parked[0].copied and not entry.copied:
                    parked[0] = entry
            return
        if entry.index != self.received + 1:
            raise RemoteProtocolError(f"replication entry {entry.index} after {self.received}")
        self.received = entry.index
        if entry.copied:
            payload = self._copies.take(entry.worker, entry.iteration, entry.base)
            if payload is not None and _fits(entry, payload):
                entry = replace(entry, payload=payload, copied=False)
        self._parked.append([entry, now + self.need_after, self.need_after])

    def copy(self, worker: int, iteration: int, base: int, payload: bytes | bytearray) -> None:
        """``worker``'s daemon's copy of its push of ``iteration`` from ``base``: it completes
        the order entry received for it, or waits for one.  A copy whose bytes are not the ones
        the primary took (another base, another digest) completes nothing: the entry is asked
        for whole in time."""
        for parked in self._parked:
            entry = parked[0]
            if entry.copied and (entry.worker, entry.iteration) == (worker, iteration):
                if entry.base == base and _fits(entry, payload):
                    parked[0] = replace(entry, payload=payload, copied=False)
                return
        self._copies.add(worker, iteration, base, payload)

    def ready(self) -> Iterator[Entry]:
        """The entries that may be processed now, in order, each taken from the log; the
        copies they decided are forgotten (a later copy of the worker's is its next push's)."""
        while self._parked and not self._parked[0][0].copied:
            entry: Entry = self._parked.popleft()[0]
            if entry.kind == "lose":
                self._copies.forget(entry.worker, 2**63)
            elif entry.kind == "push":
                for worker, iteration, _ in entry.members or [(entry.worker, entry.iteration, 0)]:
                    self._copies.forget(worker, iteration)
            yield entry

    def waiting(self) -> list[int]:
        """The entries that wait for their workers' copies."""
        return [parked[0].index for parked in self._parked if parked[0].copied]

    def next_deadline(self) -> float | None:
        """When an entry waiting for its copy is asked for (``None``: none waits)."""
        asks = [ask for entry, ask, _ in self._parked if entry.copied]
        return min(asks) if asks else None

    def needs(self, now: float) -> list[int]:
        """The entries to ask the primary for whole, now: their copies did not come within
        :data:`NEED_AFTER` of their arrival, nor their whole entry within twice the last wait
        of the last ask (a slow link is not flooded with the same entry again and again)."""
        out = []
        for parked in self._parked:
            if parked[0].copied and parked[1] <= now:
                parked[2] = min(2 * parked[2], NEED_MAX)
                parked[1] = now + parked[2]
                out.append(parked[0].index)
        return out

    def reset(self, index: int, decided: dict[int, int] | None = None) -> int:
        """Start again after entry ``index``: a snapshot's (``decided``: each worker's last
        iteration it holds; the copies of later ones are kept, they may be its next entries'),
        or a promotion's (every copy dropped).  What waited is dropped: how many entries (a
        promotion's rollback)."""
        dropped = len(self._parked)
        self.received = index
        self._parked.clear()
        if decided is None:
            self._copies.clear()
        for worker, iteration in (decided or {}).items():
            self._copies.forget(worker, iteration)
        return dropped


def copy_digest(payload: bytes | bytearray) -> bytes:
    """The digest an order entry names its copy's bytes by (BLAKE2b, 8 bytes: a copy from
    elsewhere, or encoded again, must not be applied on the replica alone)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def _fits(entry: Entry, payload: bytes | bytearray) -> bool:
    return not entry.digest or copy_digest(payload) == entry.digest
