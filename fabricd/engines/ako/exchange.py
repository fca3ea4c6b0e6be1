"""One rank's partial gradient exchange (Ako §3.1 Alg. 1, §3.3, §4.2-§4.3).

Rules: this module decides, for one rank of one exchange (a job and a name), which part of its
accumulated gradients goes to which peer each round, what a received part does to its model,
when the rank may compute its next gradient (the staleness gate), what it owes a peer it cannot
reach, and when a flush is complete.  It holds the rank's model (an array it is given, in
shared memory: it writes received parts into it) and its accumulation; it never touches a
socket or a clock (``now`` only stamps).  The daemon's service sends what :class:`SendPart`
says and answers the trainer's calls when :class:`Stepped` and :class:`Flushed` come.

Theory of operation.  A rank ``j`` of ``n`` applies its own gradient ``g_t`` at once
(``w -= lr * g_t``, Alg. 1 line 5 with descent's sign) and accumulates its last ``p``
gradients, ``g*_t = g*_{t-1} + g_t - g_{t-p}`` (line 6), range-partitioned into ``p`` parts
(line 7).  At round ``t`` it sends peer ``i`` part ``(i + t) mod p`` of ``g*_t`` (lines 8-10).
Alg. 1 line 9 prints ``k <- i mod p``, which never rotates: a peer would get the same part
every round and never the others.  With the rotation, part ``k`` of ``g_t`` is in ``g*_s`` for
``s = t .. t + p - 1``, and those ``p`` rounds send peer ``i`` the parts ``(i + s) mod p``,
every residue once: each gradient reaches every peer whole, exactly once, within ``p`` rounds
(§4.2 (4): "after the number of synchronisation rounds equals the number of partitions,
complete gradients have been received").  A received part is applied at once to the model's
range it names (``w[lo:hi] -= lr * part``, line 13; the frame says the range, §4.2 (4): "tagged
by the partitioning range", so peers need not agree on ``p``).

Staleness (§3.3).  The rank's clock ``c_j`` counts its rounds; ``s_{j,i}`` is the newest round
of peer ``i`` it has heard of, plus one (line 14 counts received parts; a round number is the
same count, and stays right when frames overtake each other).  A new gradient may be computed
only while ``c_j <= min_i s_{j,i} + p + tau`` (line 3): :meth:`Exchange.step` answers
(:class:`Stepped`) once that holds again, so the trainer blocks on the gate and nothing else.

Choices where the paper is silent, and why:

* *What a part carries, per peer.*  Each peer ``i`` keeps, per part ``k``, the last round
  whose contributions to part ``k`` it was sent (``last``).  In steady state that is
  ``t - p`` and the part sent is ``g*_t``'s, line 6's sum; after a peer came back or a flush it
  is later, and the part is the sum of the window's gradients after it.  Nothing is sent twice
  and nothing is skipped, which is what makes every replica equal after a flush.
* *The accumulation in float64.*  Line 6's running sum adds and subtracts forever: in the
  model's float32 it would drift; float64 keeps it exact for integers and close otherwise.
* *A peer that cannot be reached* (:meth:`Exchange.lose`: its node's links are down) is left
  out of the rotation and the clocks (the survivors never wait for it, §4.3), and what it is
  owed is kept whole: the parts of the window not sent it yet, plus every gradient made
  meanwhile (one array).  When it is back (:meth:`Exchange.back`) it is sent that debt in one
  frame and the rotation goes on.  One gone for good (:meth:`Exchange.gone`) is forgotten.
  §4.3 discards in-flight gradients after a failure: so does a link reset here (the debt
  carries its sender's frame count, so no flush waits for frames lost), but a lost flush
  marker would leave the peer's flush waiting: the last one goes again, with the payload it
  first had (the window's unsent parts, kept per peer until the next flush), applied only by
  a peer that had not had that flush's marker (FIFO: a first that came, came before); the debt
  follows (rounds after it), or is the marker if the open flush's was never sent.
* *A flush after a peer went for good* cannot make the replicas equal by sums alone (the gone
  rank's last parts reached the survivors unevenly): the survivors take the lowest reachable
  rank's model, a SYNC it sends once its own flush is complete, each adopting it once its own
  is complete too (§4.3: a failed worker "catches the model up from a peer"; here the
  survivors do).  Parts a peer sends after its flush wait until this rank's is complete, so
  the model taken never overwrites them.  The SYNC names the ranks it settles (``gone``); the
  next flush syncs again for any that went later.  A rank gone when some survivors completed
  the flush with it and others have it absent: the lowest, if done, sends its model at that
  flush (settling nothing), and a survivor done with it moves its model by the difference
  from its own then (each keeps its model at its last flush).  Limits (docs/ako.md): a round
  of a rank that goes right after a flush can stay in one replica; the survivors must agree
  on who is gone (else a flush can wait for a SYNC that does not come: logged as stalled).
* *A repartition to fewer parts* keeps the gate's old bound for as many rounds as the old
  count: a trainer let go under the old bound stays within it.
* *A flush* (collective) sends each reachable peer everything it is owed in one frame (the
  window's unsent parts), marked with the flush's number and how many frames went to that
  peer, itself included; a rank's flush is complete once every reachable peer's flush marker
  of that number came, with every frame it counted, and no peer is unreachable: a flush waits
  for a lost peer to be back or gone (a step never does).  Afterwards every replica holds
  ``w0 - lr * (every gradient of every rank)`` (float rounding aside).
* *A rank that comes back*, and *a newcomer that dies*: the rejoin handshake and taking
  ranks back (fabricd/engines/ako/rejoin.py, :class:`Rejoin`, which :class:`Exchange` extends).
* *No peers* (one rank): steps apply the rank's own gradient and are never held.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.dtypes import FLOAT_DTYPES
from fabricd.engines.ako.actions import (
    Action,
    Array,
    ExchangeStatistics,
    Flushed,
    Opened,
    SendPart,
    SendSignal,
    Stepped,
)
from fabricd.engines.ako.rejoin import Rejoin
from fabricd.errors import LocalProtocolError, RemoteProtocolError, UsageError
from fabricd.frames.ako import MAX_GONE, MAX_JOINS, Signal

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "MAX_PARTITIONS",
    "Action",
    "Exchange",
    "ExchangeStatistics",
    "Flushed",
    "Opened",
    "SendPart",
    "SendSignal",
    "Stepped",
    "partition_bounds",
]

#: the most partitions an exchange cuts its gradients into
MAX_PARTITIONS: Final = 1 << 16


def partition_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``size`` elements range-partitioned into ``parts`` contiguous ranges, the first
    ``size % parts`` one element longer (§4.2 (3))."""
    base, extra = divmod(size, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + base + (k < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class Exchange(Rejoin):
    """Rank ``rank`` of ``ranks``' exchange of ``model``'s gradients (module docstring).

    Raises:
        UsageError: a model that is not a writeable, contiguous, one-dimensional float array,
            a partition count outside ``[1, min(len(model), MAX_PARTITIONS)]``, a learning rate
            that is not finite and positive, a negative staleness, or a rank not below
            ``ranks``.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: int,
        model: Array,
        partitions: int,
        lr: float,
        staleness: int,
        nonce: int | None = None,
    ) -> None:
        if model.dtype.name not in FLOAT_DTYPES or model.ndim != 1 or not model.size:
            raise UsageError(f"an exchange's model is a 1-d array of {', '.join(FLOAT_DTYPES)}")
        if not model.flags.writeable or not model.flags.c_contiguous:
            raise UsageError("an exchange writes received parts into its model: pass it writeable")
        if not 1 <= partitions <= min(model.size, MAX_PARTITIONS):
            raise UsageError(
                f"partitions must be 1 to {min(model.size, MAX_PARTITIONS)}, not {partitions}"
            )
        if not (np.isfinite(lr) and lr > 0):
            raise UsageError(f"a learning rate is finite and > 0, not {lr}")
        if staleness < 0:
            raise UsageError(f"a staleness bound is >= 0, not {staleness}")
        if not 0 <= rank < ranks:
            raise UsageError(f"rank {rank} is not one of {ranks}")
        #: this incarnation's (the daemon's random draw; ``rank + 1`` for tests that care not)
        self.nonce = rank + 1 if nonce is None else nonce
        if not 0 < self.nonce < 2**63:
            raise UsageError(f"a nonce is from 1 to 2**63 - 1, not {self.nonce}")
        self.rank = rank
        self.model = model
        self.partitions = partitions
        self.lr = float(lr)
        self.staleness = staleness
        self.bounds = partition_bounds(model.size, partitions)
        self.peers = tuple(i for i in range(ranks) if i != rank)
        #: the last ``p`` gradients (row ``t % p`` holds round ``t``'s) and their sum, g*
        self._window = np.zeros((partitions, model.size), dtype=model.dtype)
        self._rounds = np.full(partitions, -1)  #: the round each window row holds
        self._sum: NDArray[np.float64] = np.zeros(model.size)
        #: the window's absolute values summed: a bound on any part it makes (float64)
        self._abs: NDArray[np.float64] = np.zeros(model.size)
        self.clock = 0  #: c_j: rounds made
        self._heard = dict.fromkeys(self.peers, 0)  #: s_{j,i}
        #: per peer and part, the last round whose contributions it was sent
        self._last = {i: np.full(partitions, -1) for i in self.peers}
        self._live = set(self.peers)
        self._owed: dict[int, NDArray[np.float64]] = {}  #: unreachable peers' debt
        self._gone: set[int] = set()
        self._settled: set[int] = set()  #: absent peers a flush already took a model after
        #: frames sent to each peer and applied from each (a SYNC aside); every frame carries
        #: its sender's count, itself included, so a flush marker says how many came before
        self._sent_to = dict.fromkeys(self.peers, 0)
        self._got_from = dict.fromkeys(self.peers, 0)
        self._marked = dict.fromkeys(self.peers, 0)  #: the last flush marked to each peer
        #: the payload of that marker (none: zeros), sent again with it after a reset
        self._marker_parts: dict[int, Array] = {}
        #: repartitioned to fewer parts: the old count bounds the gate until this clock
        self._gate: tuple[int, int] | None = None
        self._markers: dict[int, tuple[int, int]] = {}  #: peer -> (its flush, frames sent)
        #: (from, its flush, its model, the absent ranks it settles)
        self._sync: tuple[int, int, Array, tuple[int, ...]] | None = None
        #: the last SYNC for the flush this rank completed last that it did not take
        self._early: tuple[int, int, Array, tuple[int, ...]] | None = None
        #: the model at this rank's last completed flush (its number, the model, whose SYNC
        #: it took: None, its own), and the peers live then: a SYNC for that flush that comes
        #: after moves the model by the difference
        self._at: tuple[int, Array, int | None] | None = None
        self._at_live: frozenset[int] = frozenset()
        self._later: list[tuple[int, dict[str, Any]]] = []  #: peers' parts after their flush
        self._held: int | None = None  #: a step whose answer waits for the gate
        self._flushes = 0  #: flushes started
        self._flushing = False
        self._bytes_sent = self._bytes_received = 0
        self._init_rejoin()

    # -- the trainer's calls ----------------------------------------------------------------
    def step(self, gradient: Array, now: float) -> list[Action]:
        """The rank's gradient of its next round: applied to its model, accumulated, and a
        part sent to every reachable peer; :class:`Stepped` once the gate allows the next.

        Raises:
            UsageError: ``gradient`` is not the model's dtype and size, holds a NaN or an
                infinity, or would make the model or a part too large for the dtype (the sum
                of the last ``p`` gradients, or a debt); nothing changed.
            LocalProtocolError: the last step or a flush is still open.
        """
        self._check_open("the last step or flush is still open: wait for it")
        flat = gradient.reshape(-1)
        if gradient.dtype != self.model.dtype or flat.size != self.model.size:
            raise UsageError(
                f"this exchange takes {self.model.size} elements of {self.model.dtype}, not "
                f"{flat.size} of {gradient.dtype}"
            )
        if not np.isfinite(flat).all():
            raise UsageError("the gradient holds a NaN or an infinity: the model would too")
        t = self.clock
        row = t % self.partitions
        bound = self._abs + np.abs(flat) - np.abs(self._window[row])
        self._fits(bound, "the sum of the last p gradients")
        for peer, debt in self._owed.items():
            self._fits(np.abs(debt + flat), f"what rank {peer} is owed since it was unreachable")
        with np.errstate(over="ignore"):
            stepped = self.model - (self.lr * flat).astype(self.model.dtype, copy=False)
        if not np.isfinite(stepped).all():
            raise UsageError(
                f"this step would take the model past what {self.model.dtype} holds: scale the "
                "gradients or the learning rate down, or exchange a wider dtype"
            )
        self._abs = bound
        self.model[:] = stepped
        self._sum += flat
        self._sum -= self._window[row]  # g_{t-p}, or zeros before round p (line 6)
        self._window[row] = flat
        self._rounds[row] = t
        for debt in self._owed.values():
            debt += flat
        self.clock = t + 1
        out: list[Action] = [self._part(i, t) for i in sorted(self._live)]
        if self._allowed():
            out.append(Stepped(round=t))
        else:
            self._held = t
        return out

    def flush(self, now: float) -> list[Action]:
        """Send every reachable peer what it is owed, with this flush's marker; :class:`Flushed`
        once every reachable peer's came with all it counted (module docstring).

        Raises:
            LocalProtocolError: a step or a flush is still open.
        """
        self._check_open("the last step or flush is still open: wait for it")
        self._flushes += 1
        self._flushing = True
        can_admit = len(self._gone) <= MAX_GONE
        self._admit = dict(sorted(self._joins.items())[:MAX_JOINS] if can_admit else ())
        joins = self._open_listing()
        self._marks = {k: v for k, v in self._marks.items() if k == self._flushes - 1}
        self._marks[self._flushes] = (self.clock, joins)
        out: list[Action] = []
        self._news = False  # (its markers list every death known)
        for i in sorted(self._live):
            owed = self._unsent(i)
            self._last[i][:] = self.clock - 1
            out.append(self._send(i, None, 0, owed, flush=self._flushes, joins=joins))
        return out + self._progress()

    def repartition(self, partitions: int) -> list[Action]:
        """Cut the accumulation into ``partitions`` from the next round on (``partitions=
        "auto"``: the count eq. 3 gives once the gradient rate was measured).  Every reachable
        peer is first sent what it is owed under the old cut, in one frame, so that nothing
        is sent twice or skipped (an unreachable peer's debt does not depend on the cut).

        Raises:
            UsageError: a count outside ``[1, min(len(model), MAX_PARTITIONS)]``.
            LocalProtocolError: a step or a flush is open.
        """
        self._check_open("a step or flush is still open: repartition between them")
        if not 1 <= partitions <= min(self.model.size, MAX_PARTITIONS):
            raise UsageError(
                f"partitions must be 1 to {min(self.model.size, MAX_PARTITIONS)}, not {partitions}"
            )
        out: list[Action] = [self._send(i, None, 0, self._unsent(i)) for i in sorted(self._live)]
        if partitions < self.partitions:
            self._gate = (self.partitions, self.clock + self.partitions)
        self.partitions = partitions
        self.bounds = partition_bounds(self.model.size, partitions)
        self._window = np.zeros((partitions, self.model.size), dtype=self.model.dtype)
        self._rounds = np.full(partitions, -1)
        self._sum = np.zeros(self.model.size)
        self._abs = np.zeros(self.model.size)
        self._last = {i: np.full(partitions, self.clock - 1) for i in self.peers}
        return out

    # -- a peer's frames --------------------------------------------------------------------
    def received(
        self,
        src: int,
        *,
        round: int | None,
        lo: int,
        payload: Array,
        clock: int,
        epoch: int = 0,
        flush: int | None = None,
        sent: int = 0,
        sync: bool = False,
        back: bool = False,
        nonce: int = 0,
        to: int = 0,
        joins: tuple[tuple[int, int], ...] = (),
        join: bool = False,
        gone: tuple[int, ...] = (),
        unsettled: tuple[int, ...] = (),
        dead: tuple[tuple[int, int], ...] = (),
        final: bool = False,
    ) -> list[Action]:
        """A part from ``src`` (a :class:`SendPart` of its): applied to the model at once;
        its clock heard; a flush marker kept (with the returning ranks it lists); a model to
        adopt kept for the flush.  A part ``src`` sent after its flush while this rank's is
        open waits for it (module docstring); a frame from a rank gone for good, from an
        earlier incarnation of ``src``, or for an earlier one of this rank is dropped; before
        the handshake is done, frames wait for it.

        Raises:
            RemoteProtocolError: ``src`` is not a peer, or the part is not of the model's
                dtype or does not fit in it, or holds a NaN or an infinity (nothing changed).
        """
        if dead and flush is None:  # (a death notice from the dead incarnation's daemon)
            if src not in self._heard or dead != ((src, nonce),) or payload.size or sync:
                raise RemoteProtocolError(f"rank {src} sent a death notice not of itself")
            return self.died(src, nonce)
        self._check_part(src, lo, payload, flush if sync else 0)
        if to and to != self.nonce:
            return []
        fields: dict[str, Any] = {"round": round, "lo": lo, "payload": payload, "clock": clock}
        fields |= {"flush": flush, "sent": sent, "sync": sync, "back": back, "nonce": nonce}
        fields |= {"to": to, "joins": joins, "join": join, "gone": gone, "dead": dead}
        fields |= {"epoch": epoch, "unsettled": unsettled, "final": final}
        if self.phase != "running":
            if sync and join and flush is not None and nonce:
                return self._adopt(src, nonce, payload, clock, flush, (gone, unsettled))
            self._buffered.append((src, fields | {"payload": payload.copy()}))
            return []
        if dead:  # (facts whatever the frame's fate)
            return self._obituaries(dead) + self.received(src, **(fields | {"dead": ()}))
        k = self._flushes
        if join:  # (a join SYNC sent again, or a replacement: the first sender went)
            base = self._base
            if sync and base is not None and flush == self._floor and src > base[0]:
                return self._replace(src, payload, (gone, unsettled))
            return []
        if epoch < self._floor or (epoch == self._floor == flush and flush):
            return []  # (sent before this rank was taken back: its model holds it)
        if src in self._gone:
            self._hold_gone(src, nonce, fields | {"payload": payload.copy()})
            return []
        if nonce and self._nonce_of[src] not in (0, nonce):
            return []  # (a late frame of an earlier incarnation)
        self._nonce_of[src] = self._nonce_of[src] or nonce
        if nonce and self._newcomers.pop(src, None) is not None:
            self._sent_join.discard(src)  # (heard from: its join SYNC came)
        self._heard[src] = max(self._heard[src], clock)
        if sync:
            at = self._at
            if at is not None and flush == at[0] and (at[2] is None or src >= at[2]):
                return self._late_sync(src, payload, gone)
            self._sync = (src, int(flush or 0), payload.copy(), gone)
            return self._progress()
        if self._flushing and (epoch > k or (epoch == k and flush != k)):
            self._later.append((src, fields | {"payload": payload.copy()}))
            return self._progress()
        marked = self._markers.get(src, (0, 0))[0]
        if not (back and flush is not None and marked >= flush):  # (else a marker again,
            view = self.model[lo : lo + payload.size]  # its first came: FIFO, before it)
            view -= (self.lr * payload).astype(self.model.dtype, copy=False)
        self._bytes_received += payload.nbytes
        # a debt after a reset: what was in flight before it may be lost (its count with it)
        self._got_from[src] = max(self._got_from[src] + 1, sent if back else 0)
        out: list[Action] = []
        if flush is not None:
            self._markers[src] = max(self._markers.get(src, (0, 0)), (flush, sent))
            if flush >= marked:
                self._flush_clock[src] = clock
            out += self._relay(src, flush, joins, final)
        return out + self._progress()

    def _late_sync(self, src: int, model: Array, gone: tuple[int, ...]) -> list[Action]:
        """A SYNC for the flush this rank completed last without one (a rank went, for the
        sender, before its flush completed there, or after it completed here): the model
        moves by the difference between that model and this rank's then, keeping what was
        applied since; the ranks the sender settled are settled here too."""
        assert self._at is not None
        self.model += model - self._at[1]
        self._at = (self._at[0], model.copy(), src)
        self._settled |= {i for i in gone if i in self._heard}
        return self._progress()

    def _late(self, peer: int) -> list[Action]:
        """``peer`` went after this rank completed its last flush with it live: if this rank is
        the lowest, it sends every survivor its model at that flush (survivors still in it
        had ``peer`` absent, and wait for one; those done take it by the difference).  It
        settles nothing: ``peer``'s frames after that flush may have reached some ranks only,
        so the next flush takes the lowest's model again.  If the lowest's SYNC of that flush
        settling ``peer`` came before this rank completed it (``peer`` was gone there then),
        it is taken now, as one coming after, and ``peer`` is settled, as it is there."""
        at = self._at
        if at is None or peer not in self._at_live or peer in self._settled:
            return []
        if self._base is not None and at[0] == self._floor:
            return []  # (this rank was taken back at that flush: not one of its ranks)
        # the lowest among that flush's ranks (a rank taken back at it has no model of it)
        lowest = min((self._live & self._at_live) | {self.rank})
        early = self._early
        if early is not None and early[:2] == (lowest, at[0]) and peer in early[3]:
            return self._late_sync(early[0], early[2], early[3])
        if self.phase != "running" or lowest != self.rank:
            return []
        return [self._send(i, None, 0, at[1], flush=at[0], sync=True) for i in sorted(self._live)]

    def _check_part(self, src: int, lo: int, payload: Array, sync_flush: int | None) -> None:
        if src not in self._heard:
            raise RemoteProtocolError(f"rank {src} is not a peer of rank {self.rank}")
        if payload.dtype != self.model.dtype or payload.ndim != 1:
            raise RemoteProtocolError(f"a part of {payload.dtype}, not {self.model.dtype}")
        if lo < 0 or lo + payload.size > self.model.size or not payload.size:
            raise RemoteProtocolError(
                f"a part of {payload.size} elements from {lo} in a model of {self.model.size}"
            )
        if not np.isfinite(payload).all():
            raise RemoteProtocolError(f"rank {src} sent a part holding a NaN or an infinity")
        if sync_flush is None or (sync_flush and (lo or payload.size != self.model.size)):
            raise RemoteProtocolError(f"rank {src} sent a SYNC that is not a whole model")

    # -- peers lost and back ----------------------------------------------------------------
    def lose(self, peer: int) -> list[Action]:
        """``peer`` cannot be reached: out of the rotation and the clocks (a step waiting
        only for it goes on; a flush waits for it to be back or gone), its debt kept."""
        if peer in self._gone:  # (if it is taken back meanwhile, it is owed, not live)
            self._away.add(peer)
        if peer not in self._live:
            return []
        self._live.discard(peer)
        self._owed[peer] = self._unsent(peer)
        return self._progress()

    def back(self, peer: int) -> list[Action]:
        """``peer`` is reachable again: it is sent its debt, and is in the rotation again."""
        self._away.discard(peer)
        debt = self._owed.pop(peer, None)
        if debt is None or peer in self._gone:
            return []
        self._live.add(peer)
        if self.phase != "running":  # (nothing made yet: nothing owed)
            return self.hello_again(peer)
        self._last[peer][:] = self.clock - 1
        out: list[Action] = []
        if peer in self._sent_join and peer in self._newcomers:  # (it may have been lost)
            out.append(self._newcomers[peer])
        # the last marker may have been lost with the link: again, alone, as it was (the debt
        # holds rounds after it); if the open flush's was not sent, the debt is its marker
        marked = self._marked[peer]
        if marked in self._marks:
            out.append(self._marker_again(peer, marked))
        if not self._flushing or marked < self._flushes:  # (else nothing made since: none)
            missed = self._flushes if self._flushing else None
            joins = self._marks[self._flushes][1] if missed is not None else ()
            out.append(self._send(peer, None, 0, debt, flush=missed, back=True, joins=joins))
        return out + self._progress()

    def _marker_again(self, peer: int, flush: int) -> SendPart:
        """``flush``'s marker for ``peer`` again, as it was (its clock, the ranks it listed and
        its payload: what the window owed ``peer`` then, one zero if nothing), with the dead
        incarnations known now; a receiver that had it applies nothing of it again."""
        clock, joins = self._marks[flush]
        payload = self._marker_parts.get(peer, np.zeros(1))
        final = flush in self._fixed or not (self._flushing and flush == self._flushes)
        marker = self._send(
            peer, None, 0, payload, flush=flush, back=True, joins=joins, final=final
        )
        return replace(marker, clock=clock, epoch=flush)

    def gone(self, peer: int) -> list[Action]:
        """``peer`` is gone for good: forgotten, its debt dropped (the replicas may differ)."""
        if peer not in self._heard or peer in self._gone:
            return []
        self._gone.add(peer)
        self._live.discard(peer)
        self._owed.pop(peer, None)
        self._markers.pop(peer, None)
        self._marker_parts.pop(peer, None)
        self._unanswered.discard(peer)
        self._newcomers.pop(peer, None)
        self._sent_join.discard(peer)
        out = self._sync_newcomers() if self.phase == "running" else []
        return out + self._late(peer) + self._answered() + self._progress()

    # -- what it holds ----------------------------------------------------------------------
    def statistics(self) -> ExchangeStatistics:
        return ExchangeStatistics(
            clock=self.clock,
            partitions=self.partitions,
            slowest=self.slowest,
            held=self._held is not None,
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            parts_sent=sum(self._sent_to.values()),
            parts_received=sum(self._got_from.values()),
            flushes=self._flushes,
            lost=tuple(sorted(set(self._owed))),
            gone=tuple(sorted(self._gone)),
            phase=self.phase,
        )

    # -- inside -----------------------------------------------------------------------------
    def _part(self, peer: int, t: int) -> SendPart:
        """Round ``t``'s part for ``peer``: part ``(peer + t) mod p`` of what it is owed."""
        k = (peer + t) % self.partitions
        lo, hi = self.bounds[k]
        last = int(self._last[peer][k])
        if last == t - self.partitions:
            values = self._sum[lo:hi]  # g*_t's part, line 6's window
        else:  # (a peer back, or after a flush: the window's rounds after ``last``)
            rows = np.flatnonzero(self._rounds > last)
            values = self._window[rows, lo:hi].sum(axis=0, dtype=np.float64)
        self._last[peer][k] = t
        return self._send(peer, t, lo, values)

    def _send(
        self,
        peer: int,
        t: int | None,
        lo: int,
        values: Array,
        flush: int | None = None,
        sync: bool = False,
        back: bool = False,
        joins: tuple[tuple[int, int], ...] = (),
        join: bool = False,
        gone: tuple[int, ...] = (),
        final: bool = False,
    ) -> SendPart:
        payload = values.astype(self.model.dtype)  # (a copy: the window moves on)
        self._bytes_sent += payload.nbytes
        if not sync:
            self._sent_to[peer] += 1
        # (a final listing of an earlier flush than the last marked leaves that one's alone)
        if flush is not None and not sync and flush >= self._marked[peer]:
            if self._marked[peer] != flush:  # (its first marker of that flush: kept)
                self._marker_parts.pop(peer, None)
                if payload.any():
                    self._marker_parts[peer] = payload
            self._marked[peer] = flush
        return SendPart(
            dst=peer,
            round=t,
            lo=lo,
            payload=payload,
            clock=self.clock,
            epoch=self._flushes,
            flush=flush,
            sent=self._sent_to[peer],
            sync=sync,
            back=back,
            nonce=self.nonce,
            to=self._nonce_of[peer],
            joins=joins,
            join=join,
            gone=gone,
            dead=tuple(self._obits) if flush is not None and not sync else (),
            final=final,
        )

    def _signal(self, peer: int, signal: Signal, to: int | None = None) -> SendSignal:
        to = self._nonce_of[peer] if to is None else to
        return SendSignal(dst=peer, signal=signal, nonce=self.nonce, to=to)

    def _check_open(self, busy: str) -> None:
        if self.phase != "running":
            raise LocalProtocolError("the exchange is not open yet: its open call answers first")
        if self._held is not None or self._flushing:
            raise LocalProtocolError(busy)

    def _unsent(self, peer: int) -> NDArray[np.float64]:
        """What ``peer`` has not been sent of the window: per part, the rounds after its
        ``last`` (the whole model's length)."""
        owed = np.zeros(self.model.size)
        for k, (lo, hi) in enumerate(self.bounds):
            rows = np.flatnonzero(self._rounds > self._last[peer][k])
            if rows.size:
                owed[lo:hi] = self._window[rows, lo:hi].sum(axis=0, dtype=np.float64)
        return owed

    def _fits(self, magnitudes: NDArray[np.float64], what: str) -> None:
        """Raise UsageError if values this large do not fit in the model's dtype: the part
        would be an infinity, which its receiver refuses."""
        largest = float(magnitudes.max(initial=0.0))
        limit = float(np.finfo(self.model.dtype).max)
        if largest > limit:
            raise UsageError(
                f"{what} would reach {largest:.3g}, past what {self.model.dtype} holds "
                f"({limit:.3g}): scale the gradients down, or exchange a wider dtype"
            )

    @property
    def lost(self) -> frozenset[int]:
        """The peers this rank keeps a debt for (unreachable, not gone)."""
        return frozenset(self._owed)

    @property
    def gone_peers(self) -> frozenset[int]:
        """The peers gone for good (until one is taken back)."""
        return frozenset(self._gone)

    @property
    def unanswered(self) -> frozenset[int]:
        """The peers whose answer to this rank's HELLO has not come."""
        return frozenset(self._unanswered)

    @property
    def slowest(self) -> int | None:
        """The least clock heard of a reachable peer (``None``: none)."""
        return min((self._heard[i] for i in self._live), default=None)

    @property
    def bound(self) -> int:
        """How many rounds past the slowest reachable peer the gate lets this rank be:
        ``p + tau``, with the ``p`` it cut into before a repartition to fewer parts until
        that many rounds have passed (a trainer let go under the old bound stays within it)."""
        p = self.partitions
        if self._gate is not None and self.clock < self._gate[1]:
            p = max(p, self._gate[0])
        return p + self.staleness

    def _allowed(self) -> bool:
        """Alg. 1 line 3: ``c_j <= min_i s_{j,i} + p + tau`` over the reachable peers."""
        slowest = self.slowest
        return slowest is None or self.clock <= slowest + self.bound

    def _progress(self) -> list[Action]:
        """A held step the gate now allows, and a flush now complete."""
        out: list[Action] = []
        if self._held is not None and self._allowed():
            out.append(Stepped(round=self._held))
            self._held = None
        if (
            self._flushing
            and not self._owed  # (a peer lost: the flush waits until it is back or gone)
            and all(
                self._markers.get(i, (0, 0))[0] >= self._flushes
                and self._got_from[i] >= self._markers[i][1]
                for i in self._live
            )
            and self._agreed()
        ):
            out += self._complete()
        return out

    def _complete(self) -> list[Action]:
        """This rank's flush has every part sent before every reachable peer's: done, or
        (a peer absent) done once the lowest reachable rank's model is here (module
        docstring)."""
        absent = [i for i in self._gone if i not in self._settled]
        lowest = min(self._live | {self.rank})
        out: list[Action] = []
        took: int | None = None
        if absent and lowest == self.rank:
            model = self.model.copy()
            settles = tuple(sorted(absent)[:MAX_GONE])
            for i in sorted(self._live):
                out.append(
                    self._send(i, None, 0, model, flush=self._flushes, sync=True, gone=settles)
                )
            self._settled.update(settles)
        elif absent:
            sync = self._sync
            if sync is None or sync[0] != lowest or sync[1] < self._flushes:
                return []
            self.model[:] = sync[2]
            self._settled.update(i for i in sync[3] if i in self._heard)
            took = lowest
        # (a SYNC of this flush not taken: its sender had a rank gone that is live here; if
        # it goes here and that sender is then the lowest, its model is taken late)
        sync = self._sync
        self._early = sync if sync is not None and sync[1] == self._flushes else None
        self._sync = None
        self._flushing = False
        self._strange = 0
        self._base = None
        self._at = (self._flushes, self.model.copy(), took)
        self._at_live = frozenset(self._live)
        out.append(Flushed(flush=self._flushes, synced_from=lowest if absent else None))
        heard = self._joins_heard.pop(self._flushes, {})
        admitted = self._admit | {
            i: n for i, n in heard.items() if i not in self._admit or not self.is_dead(i, n)
        }
        for k in [k for k in self._joins_heard if k <= self._flushes]:
            del self._joins_heard[k]
        self._listings_done()
        # (one that died is not taken back, but unsettled, as where it was, then went)
        left = {i for i, n in admitted.items() if self.is_dead(i, n)}
        self._settled -= left
        out += self._take_back({i: n for i, n in admitted.items() if i not in left}, lowest)
        later, self._later = self._later, []
        for src, fields in later:
            out += self.received(src, **fields)
        return out
