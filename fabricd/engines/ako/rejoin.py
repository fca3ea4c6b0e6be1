"""The rejoin handshake of one rank's partial gradient exchange, and taking ranks back (Ako
§4.3; docs/ako.md tells it whole).

Rules: :class:`Rejoin` is the part of :class:`fabricd.engines.ako.exchange.Exchange` that
decides whom to answer FRESH or JOIN, which returning ranks a flush marker lists, which
incarnations are dead, and what taking a rank back at a flush does; it holds no state of its
own beyond what :meth:`Rejoin._init_rejoin` makes, and reads and writes the exchange's
(declared below for the type checker).  Like the exchange, it never touches a socket or a
clock.

* *A rank that comes back* (§4.3 re-adds a recovered worker to the counters; the issue adds
  that it catches the model up from a peer; docs/ako.md tells it whole).  Every exchange has
  a random ``nonce``, and every frame carries its sender's and its receiver's as known
  (``to``), so frames for or from an earlier incarnation are dropped.  An open
  (:meth:`Exchange.start`) says HELLO to every peer, answered FRESH (a member) or JOIN (the
  peer had it gone, or knew another nonce).  The survivors take a JOIN'd rank back all at
  one flush: those it said HELLO to list it (with its nonce) in their next flush marker,
  every survivor takes back what that flush's markers listed when it completes, and the
  lowest sends it its model (a SYNC marked ``join``, with its clock and gone ranks).  A flush
  is where the survivors' models are equal (or made so by a SYNC): the model holds every
  gradient made before, and every survivor sends the newcomer exactly what it makes after.
  Until then it is gone to them (they never wait for it).  Each keeps the join SYNC until the
  newcomer is heard from: the lowest sends it again on :meth:`Exchange.back`, the next lowest
  its own if the lowest goes (the newcomer moves by the difference).
* *A newcomer that dies* (it leaves, or a newer HELLO supersedes it) before or during the
  flush that lists it: its nonce is dead, never taken back, and a flush whose markers list a
  dead nonce *unsettles* its rank when it completes (the next flush takes the lowest's
  model).  A survivor that took it back, then heard, ends the same: every survivor has one
  view, whatever the order it heard the death in.  A departure (no nonce) is of the
  incarnation pending here, or of the member; if the rank is gone here with none pending, of
  one never heard here (it never opened, or its HELLO here was lost): nothing tells which,
  so it is ignored, never guessed (a guess killed the next, live, incarnation at one survivor
  while another took it back).  The survivors that heard the dead one say so instead: every
  flush marker lists the dead incarnations its sender knows (``dead``), and a death heard
  during an open flush sends that flush's marker again with them, so a survivor that took
  one back (it heard of it only through a marker) loses it, unsettled, before its next flush
  completes, as every survivor does.  A listed nonce never heard here is dead if another is
  pending here (it is older).  Those listings need a survivor that heard the dead one to live
  to list it: when an exchange closes, its daemon also sends every peer a death notice naming
  it (:meth:`Rejoin.death_notices`), taken as a listing is (:meth:`Rejoin.died`), so the
  survivors agree when the only one that heard it died too.
* *The survivors agree on a flush's listing without its lister* (one that heard the HELLO
  can die with its markers half sent: taking back what each got listed would split them).
  A marker relays every listing its sender heard for that flush (``_told``), one heard
  after the open flush's markers went sends them again, and a flush completes only once
  every reachable peer's latest marker of it lists exactly this rank's (``_agreed``), so two
  that complete it while reachable to each other agree.  A marker of a flush this rank
  completed (or whose listing is fixed) listing otherwise is answered *final* (its listing
  is what a survivor completed with), and a rank still in that flush takes it as its own
  (``_fixed``): a listing learned after another survivor completed without it is dropped.
* *A join SYNC* names the gone ranks a flush settled (``gone``) apart from those none did
  yet (``unsettled``, such as one that died during the admitting flush): the newcomer waits
  for the SYNC that settles the latter, as the survivors do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.ako.actions import Action, Array, Opened, Phase, SendPart, SendSignal
from fabricd.errors import LocalProtocolError, RemoteProtocolError
from fabricd.frames.ako import MAX_DEAD_LISTED, MAX_GONE, MAX_JOINS, Signal

if TYPE_CHECKING:
    from collections.abc import Callable

    from numpy.typing import NDArray

__all__ = ["MAX_DEAD", "MAX_STRANGE", "Rejoin"]

#: the most frames held, during a flush, from a gone rank's incarnation not listed yet
MAX_STRANGE: Final = 1024
#: the most nonces kept per peer of incarnations that left or were superseded
MAX_DEAD: Final = 16


class Rejoin:
    """The rejoin handshake and taking ranks back, for :class:`Exchange` (module docstring)."""

    # the exchange's state and calls this part uses (fabricd/engines/ako/exchange.py)
    rank: int
    nonce: int
    peers: tuple[int, ...]
    model: Array
    clock: int
    _heard: dict[int, int]
    _last: dict[int, NDArray[Any]]
    _live: set[int]
    _owed: dict[int, NDArray[np.float64]]
    _gone: set[int]
    _settled: set[int]
    _sent_to: dict[int, int]
    _got_from: dict[int, int]
    _marked: dict[int, int]
    _markers: dict[int, tuple[int, int]]
    _marker_parts: dict[int, Array]
    _at: tuple[int, Array, int | None] | None
    _at_live: frozenset[int]
    _later: list[tuple[int, dict[str, Any]]]
    _flushes: int
    _flushing: bool
    _bytes_sent: int
    received: Callable[..., list[Action]]

    if TYPE_CHECKING:

        def gone(self, peer: int) -> list[Action]: ...
        def _signal(self, peer: int, signal: Signal, to: int | None = None) -> SendSignal: ...
        def _marker_again(self, peer: int, flush: int) -> SendPart: ...
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
        ) -> SendPart: ...

    def _init_rejoin(self) -> None:
        """The state of the rejoin handshake and of taking ranks back (module docstring)."""
        #: the rejoin handshake (module docstring): "running" unless :meth:`start` was called
        self.phase: Phase = "running"
        self._unanswered: set[int] = set()  #: peers whose answer to HELLO has not come
        self._buffered: list[tuple[int, dict[str, Any]]] = []  #: frames before "running"
        self._nonce_of = dict.fromkeys(self.peers, 0)  #: each peer's, once heard (0: not yet)
        self._joins: dict[int, int] = {}  #: returning ranks to list in the next flush marker
        self._admit: dict[int, int] = {}  #: those this rank's open flush listed
        self._joins_heard: dict[int, dict[int, int]] = {}  #: flush -> ranks its markers listed
        self._floor = 0  #: the flush this rank was taken back at: frames from before it go
        #: per peer, nonces of incarnations that left or were superseded: never taken back
        #: (a flush that lists one unsettles its rank instead)
        self._dead: dict[int, deque[int]] = {}
        #: those dead nonces as (rank, nonce), the latest learned last: every flush marker
        #: lists them, so a survivor that took one back (it heard its departure first, when
        #: it could not tell whose it was) learns it died before that survivor's next flush
        self._obits: deque[tuple[int, int]] = deque(maxlen=MAX_DEAD_LISTED)
        self._news = False  #: a nonce died here since the open flush's markers went
        self._taken: dict[int, int] = {}  #: the incarnation of each peer taken back here
        #: ranks taken back and not heard from yet: their join SYNC (this rank's model then)
        self._newcomers: dict[int, SendPart] = {}
        self._sent_join: set[int] = set()  #: newcomers whose join SYNC is this rank's to send
        self._away: set[int] = set()  #: gone peers membership says are unreachable
        self._strange = 0  #: frames held this flush from a gone rank's unlisted incarnation
        #: this rank's last two flushes: its clock and the ranks its markers listed
        self._marks: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}
        self._flush_clock: dict[int, int] = {}  #: the clock each peer's last marker carried
        #: taken back: the model adopted, and from whom, until this rank's next flush
        self._base: tuple[int, Array] | None = None
        #: per flush (the open one, the next), the listing its markers carry: what this rank
        #: lists and every listing its peers' markers of it carried (they relay theirs too)
        self._told: dict[int, set[tuple[int, int]]] = {}
        self._fixed: set[int] = set()  #: flushes whose listing a final marker fixed
        #: per peer, per flush, the listing its latest marker of that flush carried
        self._echo: dict[int, dict[int, frozenset[tuple[int, int]]]] = {}

    # -- the rejoin handshake (module docstring) ----------------------------------------------
    def start(self) -> list[Action]:
        """The exchange opened: say HELLO to every peer; :class:`Opened` once every peer
        answered FRESH (or is gone), or once a survivor's model came (one answered JOIN)."""
        if self.phase != "running" or self.clock or self._flushes:
            raise LocalProtocolError("an exchange starts once, before its first step")
        self.phase = "hello"
        self._unanswered = set(self.peers)
        return [self._signal(i, Signal.HELLO) for i in self.peers] + self._answered()

    def hello_again(self, peer: int) -> list[Action]:
        """``peer`` became reachable: say HELLO again if its answer has not come (the first
        may not have reached it)."""
        if self.phase == "running" or peer not in self._unanswered:
            return []
        return [self._signal(peer, Signal.HELLO)]

    def signal(self, src: int, signal: Signal, *, nonce: int, to: int = 0) -> list[Action]:
        """A signal from ``src`` (of nonce ``nonce``) of the handshake.

        Raises:
            RemoteProtocolError: ``src`` is not a peer, or a nonce of 0.
        """
        if src not in self._heard:
            raise RemoteProtocolError(f"rank {src} is not a peer of rank {self.rank}")
        if not nonce and signal is not Signal.FRESH:  # (FRESH for a rank not open yet has none)
            raise RemoteProtocolError(f"rank {src} sent a {signal.value} without its nonce")
        if to and to != self.nonce:
            return []  # (an answer to an earlier incarnation of this rank)
        if signal is Signal.HELLO:
            return self._hello(src, nonce)
        if self.phase == "running" or src not in self._unanswered:
            return []  # (a late answer)
        self._unanswered.discard(src)
        self._nonce_of[src] = self._nonce_of[src] or nonce
        if signal is Signal.JOIN:
            self.phase = "joining"
        return self._answered()

    def _hello(self, src: int, nonce: int) -> list[Action]:
        if self.is_dead(src, nonce):
            return []  # (a late HELLO of an incarnation that left or was superseded)
        if self.phase == "joining":  # (not a member yet: the survivors' answers decide; the
            self._nonce_of[src] = nonce  # SYNC's gone ranks still apply once it comes)
            return [self._signal(src, Signal.FRESH)]
        out: list[Action] = []
        known = self._nonce_of[src]
        self._away.discard(src)  # (it was heard: reachable, until membership says otherwise)
        self._cancel(src, keep=nonce)  # (an incarnation listed before this one: superseded)
        if self._pending(src) == nonce or src in self._gone or known not in (0, nonce):
            out += self.gone(src)  # (its earlier incarnation, if it was still here)
            self._joins[src] = nonce
            return [*out, self._signal(src, Signal.JOIN, to=nonce)]
        self._nonce_of[src] = nonce
        return [self._signal(src, Signal.FRESH)]

    def _cancel(self, peer: int, keep: int = 0) -> None:
        """Every admission pending for ``peer`` with a nonce other than ``keep`` dies: not
        listed here any more, and a flush that lists it unsettles its rank (module docstring)."""
        for joins in (self._joins, self._admit, *self._joins_heard.values()):
            nonce = joins.get(peer, 0)
            if nonce and nonce != keep:
                self._kill(peer, nonce)
        if peer in self._joins and self._joins[peer] != keep:
            del self._joins[peer]

    def _answered(self) -> list[Action]:
        """Every peer answered FRESH (or is gone): the exchange runs, with the frames it was
        sent meanwhile."""
        if self.phase != "hello" or self._unanswered:
            return []
        return self._run(Opened(), floor=0)

    def _adopt(
        self,
        src: int,
        nonce: int,
        model: Array,
        clock: int,
        flush: int,
        gone: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> list[Action]:
        """Taken back at ``src``'s flush ``flush``: its model, clock and flush count become
        this rank's; its gone ranks (and those gone here) are gone: ``gone``'s first ones
        settled, its second ones (and those gone here) not: a flush's SYNC is due for them."""
        self.model[:] = model
        self._base = (src, model.copy())
        self._at = (flush, model.copy(), src)
        self._settled = {i for i in gone[0] if i in self._heard}
        unsettled = {i for i in gone[1] if i in self._heard}
        self._at_live = frozenset(self.peers) - self._settled - unsettled
        self.clock = clock
        self._flushes = flush
        self._gone |= self._settled | unsettled  # (and those gone here: not settled either)
        for i in self._gone:
            self._owed.pop(i, None)
        self._live = set(self.peers) - self._gone - set(self._owed)
        for i in self.peers:
            self._last[i][:] = clock - 1
            self._heard[i] = clock
            self._sent_to[i] = self._got_from[i] = 0
            self._marked[i] = flush
        self._markers = {}
        self._nonce_of[src] = nonce
        self._unanswered.clear()
        return self._run(Opened(joined_from=src), floor=flush)

    def _replace(
        self, src: int, model: Array, gone: tuple[tuple[int, ...], tuple[int, ...]]
    ) -> list[Action]:
        """A second join SYNC for the flush this rank was taken back at, from a higher rank:
        the first's sender went before the survivors took its model (they took ``src``'s).
        What was applied since stays: the model moves by the two models' difference."""
        assert self._base is not None
        self.model += model - self._base[1]
        self._base = (src, model.copy())
        self._at = (self._floor, model.copy(), src)
        settled = {i for i in gone[0] if i in self._heard}
        self._settled |= settled
        out: list[Action] = []
        for i in sorted((settled | {i for i in gone[1] if i in self._heard}) - self._gone):
            out += self.gone(i)
        return out

    def _run(self, opened: Opened, *, floor: int) -> list[Action]:
        """Start running: the frames sent for this incarnation after the flush it was taken
        back at (``floor``) are applied."""
        self.phase = "running"
        self._floor = floor
        out: list[Action] = [opened]
        buffered, self._buffered = self._buffered, []
        for src, fields in buffered:
            out += self.received(src, **fields)
        return out

    def _pending(self, src: int) -> int:
        """The nonce ``src`` is to be taken back with at a flush (0: none; one that left is
        not)."""
        for joins in (self._admit, *self._joins_heard.values(), self._joins):
            nonce = joins.get(src, 0)
            if nonce and not self.is_dead(src, nonce):
                return nonce
        return 0

    def _take_back(self, admitted: dict[int, int], lowest: int) -> list[Action]:
        """The flush listing ``admitted`` completed: each is a member again, owed what this
        rank makes from now on; the ``lowest`` survivor sends them its model (a join SYNC,
        kept until the newcomer is heard from: sent again if lost, or by the next lowest if
        ``lowest`` goes).  One membership says is unreachable is owed it (lost), not live."""
        # (the ranks no flush settled yet, one that died during this flush among them, are
        # sent apart: the newcomer waits for the SYNC that settles them, as the survivors do)
        absent = sorted(self._gone - admitted.keys())
        gone = (
            tuple([i for i in absent if i in self._settled][:MAX_GONE]),
            tuple([i for i in absent if i not in self._settled][:MAX_GONE]),
        )
        # the newcomer adopts the lowest's clock: the gate hears it at that clock
        clock = self.clock if lowest == self.rank else self._flush_clock.get(lowest, self.clock)
        out: list[Action] = []
        for peer, nonce in sorted(admitted.items()):
            self._cancel(peer, keep=nonce)
            self._joins.pop(peer, None)
            self._gone.discard(peer)
            self._settled.discard(peer)
            if peer in self._away:
                self._owed[peer] = np.zeros(self.model.size)
            else:
                self._live.add(peer)
            self._nonce_of[peer] = self._taken[peer] = nonce
            self._last[peer][:] = self.clock - 1
            self._heard[peer] = min(clock, self.clock)
            self._sent_to[peer] = self._got_from[peer] = 0
            self._marked[peer] = self._flushes
            self._markers.pop(peer, None)
            self._marker_parts.pop(peer, None)
            sync = self._join_sync(peer, nonce, gone, clock)
            self._newcomers[peer] = sync
            if lowest == self.rank:
                self._sent_join.add(peer)
                if peer in self._live:
                    out.append(sync)
        self._admit = {}
        return out

    def _join_sync(
        self, peer: int, nonce: int, gone: tuple[tuple[int, ...], tuple[int, ...]], clock: int
    ) -> SendPart:
        """``peer``'s join SYNC: this rank's model, and the lowest's clock (every survivor
        hears the newcomer there, whichever of them sends it)."""
        model = self.model.copy()
        self._bytes_sent += model.nbytes
        return SendPart(
            dst=peer,
            round=None,
            lo=0,
            payload=model,
            clock=clock,
            epoch=self._flushes,
            flush=self._flushes,
            sent=self._sent_to[peer],
            sync=True,
            nonce=self.nonce,
            to=nonce,
            join=True,
            gone=gone[0],
            unsettled=gone[1],
        )

    def _sync_newcomers(self) -> list[Action]:
        """This rank became the lowest survivor: the newcomers not heard from yet are sent
        its join SYNC (the last lowest may have gone before it sent theirs).  The newcomers
        themselves are not candidates: they have no model to send."""
        if min((self._live - set(self._newcomers)) | {self.rank}) != self.rank:
            return []
        out: list[Action] = []
        for peer, sync in sorted(self._newcomers.items()):
            if peer not in self._sent_join:
                self._sent_join.add(peer)
                if peer in self._live:
                    out.append(sync)
        return out

    def _hold_gone(self, src: int, nonce: int, fields: dict[str, Any]) -> None:
        """A frame from a rank gone here: one of the incarnation to be taken back when this
        flush completes waits for it; so does (bounded) one of an incarnation no marker
        listed here yet (its HELLO here may have been lost: the marker that lists it may
        come later in this flush).  Others are dropped."""
        if not nonce or self.is_dead(src, nonce):
            return
        if self._pending(src) == nonce:
            self._later.append((src, fields))
        elif self._flushing and self._strange < MAX_STRANGE and nonce != self._nonce_of[src]:
            self._strange += 1
            self._later.append((src, fields))

    def _listed(self, flush: int, joins: tuple[tuple[int, int], ...]) -> list[Action]:
        """A flush marker listed returning ranks: taken back when that flush completes (their
        earlier incarnations, if still members here, are gone now: none will flush); one that
        left is not, but its rank is unsettled then (:meth:`left`)."""
        k = self._flushes
        if not (k < flush <= k + 1 or (flush == k and self._flushing)):
            return []  # (a flush this rank completed, or one far ahead: no peer is there)
        out: list[Action] = []
        for peer, nonce in joins:
            if peer not in self._heard:
                continue
            here = self._nonce_of[peer] == nonce or self.is_dead(peer, nonce)
            if peer not in self._gone and here:
                continue  # (taken back here already, or a newer one was: a marker sent again)
            pending = self._pending(peer)
            if pending and nonce != pending and not self.is_dead(peer, nonce):
                self._kill(peer, nonce)  # (never heard here: older than the one pending)
            listed = self._joins_heard.setdefault(flush, {})
            if peer not in listed or not self.is_dead(peer, nonce):
                listed[peer] = nonce
            out += self.gone(peer)
        return out

    def is_dead(self, peer: int, nonce: int) -> bool:
        """``nonce`` is of an incarnation of ``peer`` that left or was superseded."""
        return nonce in self._dead.get(peer, ())

    def _kill(self, peer: int, nonce: int) -> None:
        """``peer``'s incarnation ``nonce`` left or was superseded: never taken back, and
        listed dead in this rank's flush markers."""
        dead = self._dead.setdefault(peer, deque(maxlen=MAX_DEAD))
        if nonce not in dead:
            dead.append(nonce)
            if (peer, nonce) not in self._obits:  # (one evicted from dead, killed again)
                self._obits.append((peer, nonce))
                self._news = True

    def _obituaries(self, dead: tuple[tuple[int, int], ...]) -> list[Action]:
        """A peer's flush marker listed incarnations it knows died: dead here too (a member
        of those is gone, unsettled: the next flush syncs, as at every survivor)."""
        out: list[Action] = []
        for peer, nonce in dead:
            if peer not in self._heard or self.is_dead(peer, nonce):
                continue
            self._kill(peer, nonce)
            if self._joins.get(peer) == nonce:
                del self._joins[peer]
            if self._nonce_of[peer] == nonce and peer not in self._gone:
                out += self.gone(peer)
        self._news = False  # (learned from a marker: its sender lists them to every peer)
        return out

    def _announce(self, dying: int) -> list[Action]:
        """Nonces died here during this rank's open flush, after its markers went: each
        reachable peer but ``dying`` (the rank whose death this is) is sent its marker again,
        listing them (a peer that took one back would wait for it at its next flush for ever,
        module docstring)."""
        news, self._news = self._news, False
        if not news or not self._flushing or self.phase != "running":
            return []
        k = self._flushes
        live = sorted(self._live - {dying})
        return [self._marker_again(i, k) for i in live if self._marked[i] == k]

    def died(self, peer: int, nonce: int) -> list[Action]:
        """``peer``'s incarnation ``nonce`` died: its own daemon says so (a death notice: its
        trainer left, or its open failed).  Unlike a departure, the notice names the
        incarnation, so it counts wherever it was heard or not: dead, never taken back, listed
        in this rank's markers; if it is the member here, it is gone, unsettled.  A flush
        whose markers list it unsettles its rank as for any dead nonce, so every survivor ends
        the same, whatever it heard first (module docstring).  The open flush's marker goes
        again with it only if a marker may have listed it (pending, listed or taken back
        here), as for a departure: an original member no marker listed, no peer can have
        taken back, and the markers are model-sized with ``p > 1``."""
        if self.is_dead(peer, nonce):
            return []
        news = self._news
        self._kill(peer, nonce)
        if not self._admitted_here(peer, nonce):
            self._news = news  # (listed from the next flush's markers on, nothing resent)
        if self._joins.get(peer) == nonce:
            del self._joins[peer]
        member = self._nonce_of[peer] == nonce and peer not in self._gone
        announced = self._announce(peer)  # (before gone(), which may complete the open flush)
        return announced + (self.gone(peer) if member else [])

    def _admitted_here(self, peer: int, nonce: int) -> bool:
        """``peer``'s incarnation ``nonce`` is to be, or was, taken back here: a flush marker
        listed it, or will."""
        lists = (self._joins, self._admit, *self._joins_heard.values())
        return self._taken.get(peer, 0) == nonce or any(j.get(peer) == nonce for j in lists)

    def death_notices(self) -> list[SendPart]:
        """This incarnation is closed (its trainer left, or its open failed): a death notice
        for every peer, naming it (:meth:`died`; its daemon sends them).  A peer that took it
        back through another's marker, having heard of it nothing else, learns it died."""
        empty = self.model[:0].copy()
        return [
            SendPart(
                dst=i,
                round=None,
                lo=0,
                payload=empty,
                clock=self.clock,
                nonce=self.nonce,
                to=self._nonce_of[i],
                dead=((self.rank, self.nonce),),
            )
            for i in self.peers
        ]

    def left(self, peer: int) -> list[Action]:
        """``peer``'s rank left (membership's news): gone for good.  What left is the
        incarnation pending here or the member, else one never heard here, which is not
        known: such a departure is ignored (module docstring)."""
        self._away.discard(peer)
        if peer not in self._heard:
            return []
        if self._pending(peer):
            self._cancel(peer)
        elif peer in self._gone:
            return []  # (never opened, or its HELLO is yet to come: those that heard it tell)
        elif self._taken.get(peer, 0) == self._nonce_of[peer] != 0:
            self._kill(peer, self._nonce_of[peer])  # (its HELLO came before: it is this one)
        # (the markers listing the death go before gone(), which may complete the open flush:
        # after it, nothing would tell a peer that took the incarnation back through a marker)
        announced = self._announce(peer)
        return announced + self.gone(peer)

    # -- agreeing on a flush's listing without its lister (module docstring) ----------------
    def _open_listing(self) -> tuple[tuple[int, int], ...]:
        """The listing of the flush this rank opens: the ranks it takes back (``_admit``) and
        what its peers' markers of it listed so far; a listing fixed already stays, and this
        rank's own are taken back only if it holds them (the others wait for a later flush)."""
        k = self._flushes
        told = self._told.setdefault(k, set())
        if k not in self._fixed:
            told |= set(self._admit.items())
        self._restrict(k, _first(told))
        return tuple(sorted(told))  # (at most MAX_JOINS now)

    def _relay(
        self, src: int, flush: int, joins: tuple[tuple[int, int], ...], final: bool
    ) -> list[Action]:
        """``src``'s marker of ``flush`` listed ``joins``.  For the open or next flush: taken
        into this rank's listing (a new one sends the open flush's markers again, relaying
        it), or, ``final``, made it (a survivor completed the flush with it).  A marker of a
        flush this rank completed, or whose listing is fixed, listing otherwise, is answered
        with this rank's final listing (module docstring)."""
        listing = frozenset(joins)
        k = self._flushes
        if flush <= k + 1:  # (later ones, never pruned, only a broken peer sends)
            self._echo.setdefault(src, {})[flush] = listing
        is_open = self._flushing and flush == k
        if not (is_open or flush == k + 1):
            done = flush in self._marks and listing != set(self._marks[flush][1])
            if final or not done or src not in self._live or flush > k:
                return []
            return [self._final_reply(src, flush)]
        told = self._told.setdefault(flush, set())
        before = frozenset(told)
        if final:
            self._fix(flush, listing)
        elif flush in self._fixed:
            if listing == told or not is_open or self._marked[src] != k:
                return []
            return [self._final_reply(src, flush)]
        else:
            told |= listing
            self._restrict(flush, _first(told))
        out = self._listed(flush, tuple(sorted(listing & told)))
        if is_open and told != before:
            out = self._relisted() + out
        return out

    def _fix(self, flush: int, listing: frozenset[tuple[int, int]]) -> None:
        """A survivor completed ``flush`` with ``listing``: it is this rank's too; a rank it
        does not list is not taken back at that flush (one this rank heard itself stays in
        ``_joins``, for the next)."""
        self._fixed.add(flush)
        self._restrict(flush, listing)

    def _restrict(self, flush: int, listing: frozenset[tuple[int, int]]) -> None:
        """``flush``'s listing is ``listing`` (a final one, or the first :data:`MAX_JOINS` of
        the pairs heard: what a marker carries, so that what survivors compare is what they
        send); a rank heard here and cut stays in ``_joins``, for a later flush."""
        told = self._told.setdefault(flush, set())
        told.clear()
        told |= listing
        heard = self._joins_heard.get(flush, {})
        for peer, nonce in list(heard.items()):
            if (peer, nonce) not in listing:
                del heard[peer]
        if self._flushing and flush == self._flushes:
            self._admit = {i: n for i, n in self._admit.items() if (i, n) in listing}

    def _relisted(self) -> list[Action]:
        """The open flush's listing changed after its markers went: each reachable peer is
        sent its marker again with it (final if fixed)."""
        k = self._flushes
        self._marks[k] = (self._marks[k][0], tuple(sorted(self._told[k])))  # (capped: _restrict)
        return [self._marker_again(i, k) for i in sorted(self._live) if self._marked[i] == k]

    def _final_reply(self, peer: int, flush: int) -> SendPart:
        """``flush``'s final listing for ``peer``, whose marker listed otherwise: a marker
        again with no payload (``peer`` had this rank's first marker of it: FIFO)."""
        clock, joins = self._marks[flush]
        marker = self._send(
            peer, None, 0, np.zeros(1), flush=flush, back=True, joins=joins, final=True
        )
        return replace(marker, clock=clock, epoch=flush)

    def _agreed(self) -> bool:
        """Every reachable peer's latest marker of the open flush listed what this rank's
        listing is: a flush completes only then."""
        k = self._flushes
        told = frozenset(self._told.get(k, ()))
        return all(self._echo.get(i, {}).get(k) == told for i in self._live)

    def _listings_done(self) -> None:
        """This rank completed its open flush: the listings of it and before are forgotten
        (its markers' kept listing answers a late marker)."""
        k = self._flushes
        self._told = {f: v for f, v in self._told.items() if f > k}
        self._fixed = {f for f in self._fixed if f > k}
        for echoes in self._echo.values():
            for f in [f for f in echoes if f <= k]:
                del echoes[f]


def _first(pairs: set[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """The first :data:`MAX_JOINS` of a listing's ``(rank, nonce)`` pairs: what a marker
    carries."""
    return frozenset(sorted(pairs)[:MAX_JOINS])
