"""One persistent collective on one node: its schedule, buffers, the local ranks' calls, and
the partial-collective bookkeeping of eager-SGD (solo and majority allreduce).

Rules: this module decides, for one collective (a job and a name) on one node, what each local
rank's call contributes, which round's result it gets, what the node sends to which peer node,
and when a call completes.  It holds the collective's buffers (numpy arrays) and performs the
schedule's computes on them in place; it never touches a socket or a clock (``now`` comes in,
:class:`Transmit` and :class:`Deliver` go out).  The daemon's collective service
(``daemon/services/collectives.py``) lands peers' messages where :meth:`Collective.landing` says
and sends what :class:`Transmit` says, one frame per message into a slot the receiving node
allocated when it built the same schedule: no rendezvous.

Theory of operation.

* **Hierarchical.**  The schedule (:mod:`~fabricd.engines.collectives.algorithms`, and
  :mod:`~fabricd.engines.collectives.gather` for allgather and reduce-scatter, sync collectives
  whose node tensor is every rank's block) runs over the job's *nodes*, not its ranks: the
  ranks on one node fold into the node's contribution through shared memory first, and only
  the daemon talks to the network for them, as NCCL and Horovod do within a machine.  The
  node's index in the sorted member nodes is its schedule rank.
* **Sync** (``mode="sync"``; broadcast and barrier are always sync): the node activates round
  ``r`` once every local rank of the job called it; the calls' arrays are reduced into the
  contribution as they come (:data:`REDUCE`), and every call gets round ``r``'s result.
* **Solo and majority** (eager-SGD §4.1, §4.2): the schedule is the allreduce behind the
  activation broadcast of §4.1.1, so any node may start a round.  A call adds its array to the
  node's *accumulator* (sum) and, under solo, starts the current round if it has not started;
  under majority only the call of the round's initiator does (:func:`initiator`: a hash of the
  job, the name and the round, the same at every node with no message).  When round ``r``
  starts here -- by a local call or by a peer's message -- the accumulator becomes the round's
  contribution (the *snapshot*) and is zeroed: a rank that has not called takes part passively
  with what it gave since its last contribution (zeros, or data a round missed).  Calls whose
  data the snapshot took are ``included``; a call that comes after the snapshot still gets
  round ``r``'s result, and its data waits in the accumulator for round ``r + 1``: no
  contribution is ever lost (:meth:`Collective.conservation` checks it).  A rank that comes
  back after rounds ended without it gets what it missed at once: under ``late="sum"`` the
  sum of those results (each replica applies every result once), under ``"latest"`` the
  latest only (eager-SGD §4.2's receive buffer); under majority, if it is the
  current round's initiator, its call also starts that round (else a training loop whose
  initiator answered late would wait a whole step for its next call).  The *first round*
  is every rank's: a node takes part in it (starts it, or follows a peer's start; their
  messages wait) only once each of its live ranks called, so a call unlike another rank's
  fails every rank's before any result (a solo rank alone would have had one).  *Liveness*:
  a majority round also starts at a node whose call waited ``patience`` for the initiator
  (:mod:`~fabricd.engines.collectives.partial` gives the rule and the argument).  A rank's
  ``k``-th call is for round ``k``; a trainer that restarts (its rank left and came back)
  starts at the current round, joining where the job is.  The result says how many ranks
  contributed fresh data (``active``): the count travels with the data as one extra element,
  reduced with it.  ``avg`` divides the sum by the job's size after the round (the paper's
  update), partial modes take ``sum`` and ``avg`` only.
* **A call whose client stops waiting** (Ctrl-C, an exit, a close: :meth:`Collective.abandon`)
  is *kept* once its data may have left this node, and *withdrawn* while it cannot have.  A
  sync round's contribution leaves when the node activates the round (every local rank gave),
  and peers reduce it into theirs as it lands: it cannot be taken back out of their reductions
  (max and min have no inverse, float sums do not subtract exactly), and withdrawing it would
  need every peer's consent every round.  So a call whose round this node activated is kept:
  the round completes with its data everywhere, and its rank's next call (a restarted
  trainer's first) is for the next round and is told which round kept the data (``kept``, in
  its result and in a failure's message).  Before that nothing of it left: the round's
  contribution here is rebuilt from the other local calls, which wait on (for a rank that
  left, up to the grace), and the rank's next call gives to that round again.  Partial modes
  keep every call's data (nothing given is lost): its round's snapshot took it, or the next
  one will; ``kept`` names its round.  Peers count exactly what the rank is told was kept.
* **A reset of a member's links** (:meth:`Collective.interrupted`, then :meth:`Collective.resume`
  if the same daemon comes back): frames in flight are lost; a partial collective runs on from
  the next round number (a view change, below); a sync one survives only between rounds.
* **Failures of a member node** (the service reports them, :meth:`Collective.lose`): a sync
  collective fails its waiting calls and is *broken* (the job lost ranks it needs).  A partial
  one goes on among the survivors, over a schedule rebuilt for them, from a new *view* (the
  lost nodes, and the round it begins with: its *base*).  Each frame says its sender's view; a
  node that changes view tells every member at once (a :data:`NOTICE`, no bytes), and adopts
  a larger loss set or a higher base from any frame (restarting its round, which cannot have
  ended: it needed the sender's messages of the old view).  Views converge on the union of
  losses and the highest base.  The abandoned round's snapshot is held until the survivors
  say whether one of them ended that round (then its result counted it) or none did (then it
  waits for a later round): each contribution counts exactly once in the survivors' results
  (:mod:`~fabricd.engines.collectives.ledger`).  A survivor a round behind, which jumps to the
  others' base, never gets the round they ended: its ranks skip that result (under
  ``late="sum"`` too: this node never had it).  A node that finds itself among a frame's lost
  nodes is excluded: its calls fail.

Buffers: ``data`` (the round's working tensor), ``result`` (the last result), the partial
modes' ``accumulator`` and ``snapshot``, and the landing slots; when each may be written while a
send may still read it is :mod:`~fabricd.engines.collectives.layout`'s "Buffers".
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from fabricd.engines.collectives.calls import Call, Counters, Departures
from fabricd.engines.collectives.computes import compute, divide
from fabricd.engines.collectives.gather import Blocks
from fabricd.engines.collectives.landing import Landing, detach, raw, same
from fabricd.engines.collectives.layout import Layout, schedule_for
from fabricd.engines.collectives.ledger import Held, Ledger, Note
from fabricd.engines.collectives.partial import Contributions, Owed, Patience
from fabricd.engines.collectives.spec import (
    KINDS,
    MODES,
    NOTICE,
    REDUCE,
    Action,
    Deliver,
    Fail,
    Settle,
    Spec,
    Transmit,
    in_place,
    initiator,
)
from fabricd.engines.schedule import (
    Discard,
    Executor,
    Phase,
    RoundEnded,
    RoundStarted,
    StartCompute,
    StartRecv,
    StartSend,
)
from fabricd.errors import ErrorCode, RemoteProtocolError, UsageError

__all__ = ["KINDS", "MODES", "NOTICE", "REDUCE", "Action", "Collective", "Deliver"]
__all__ += ["Fail", "Settle", "Spec", "Transmit", "initiator"]


class Collective:
    """One collective (job, name) on node ``node``; see the module docstring.

    Args:
        spec: what every call agrees on.
        job, name: what it is called (majority's initiator hashes them).
        node: this node.
        ranks: the node of every rank of the job (index: rank), from membership.
        live: the ranks alive now (majority's initiator skips the others).
        majority_wait: the longest a majority round waits for its initiator once a call
            here waits for it (:class:`~fabricd.engines.collectives.partial.Patience`).
    """

    #: whether a node's only rank's sync ring allreduce may run in place (tests compare the
    #: two paths by turning it off)
    IN_PLACE: bool = True

    def __init__(
        self,
        spec: Spec,
        *,
        job: str,
        name: str,
        node: int,
        ranks: tuple[int, ...],
        live: frozenset[int],
        majority_wait: float = 2.0,
    ) -> None:
        spec.check()
        if spec.kind == "broadcast" and not 0 <= spec.root < len(ranks):
            raise UsageError(f"root {spec.root} is not a rank of job {job!r} of {len(ranks)}")
        self.spec = spec
        self.job, self.name, self.node = job, name, node
        self.size = len(ranks)
        self.ranks = ranks
        self.local = frozenset(r for r, n in enumerate(ranks) if n == node)
        if not self.local:
            raise UsageError(f"node {node} hosts no rank of job {job!r}")
        self.live = live
        self.initial = tuple(sorted(set(ranks)))
        self.lost: frozenset[int] = frozenset()
        self._told: set[int] = set()  #: lost nodes whose frames were answered with our view
        self.base = 0  #: the round this view began with
        self.broken: tuple[str, str] | None = None  #: (code, message) once nothing can run
        self.counters = Counters()
        #: allgather, reduce_scatter: every rank's block, in the node's tensor (gather.py)
        self.blocks = Blocks.of(spec, ranks, self.initial)
        #: partial: the active count too; allgather, reduce_scatter: every rank's block
        elements = spec.count + spec.partial if self.blocks is None else self.blocks.elements
        self._elements = elements
        dtype = np.dtype(spec.dtype)
        #: the node's only rank's sync ring allreduce (or allgather) runs in its array (its
        #: output): "In place"
        self.inplace = self.IN_PLACE and in_place(spec, ranks, node)
        #: in place, ``data`` is the round's caller's array and ``result`` the last one's
        self._idle = np.zeros(0, dtype)
        self.data = self._idle if self.inplace else np.zeros(elements, dtype)
        self.result = self._idle if self.inplace else np.zeros(elements, dtype)
        #: partial modes: what local ranks gave since the last snapshot (sync gives into
        #: data), what late ranks are owed, how long a majority round waits for its initiator
        self.given = Contributions(spec.count, dtype, partial=spec.partial)
        self.owed = Owed(spec.count, dtype)
        self.patience = Patience(majority_wait)
        self.ledger = Ledger()  #: abandoned rounds' snapshots, until counted or not: ledger.py
        #: partial: until every live local rank called once, the node takes no part in a
        #: round (its peers' messages wait here): "The first round"
        self._agreed = not spec.partial or not self.local & live
        self._called: set[int] = set()
        self._held: list[tuple[int, int, int]] = []  #: (peer, tag, round) arrived meanwhile
        self._given: set[int] = set()  #: sync: ranks whose call is in ``data``
        self._activated: int | None = None  #: sync: the round activated here, until it ends
        self._left = Departures()  #: a sync round's deadline once a rank left; calls kept
        self._ready = False  #: sync: every local rank gave to the new round: activate it
        self._calls: dict[int, Call] = {}  #: by token
        self._by_rank: dict[int, Call] = {}
        #: the round each local rank's next call is for: its k-th call is for round k (the
        #: paper's rounds), until it leaves; a rank that comes back starts at the current one
        self._due: dict[int, int] = dict.fromkeys(self.local & live, 0)
        self._later: deque[Call] = deque()  #: sync calls for the round after the current one
        self._landings: dict[tuple[int, int], Landing] = {}  #: (recv op, round) -> in progress
        #: in place: failures held until a frame landing in the failed call's array is in
        self._withheld: list[Fail] = []
        #: in place: where each direct recv's message of the current round landed
        self._landed: dict[int, np.ndarray[Any, Any]] = {}
        self._out: list[Action] = []
        self._build(first_round=0)

    # -- the view ---------------------------------------------------------------------------
    @property
    def members(self) -> tuple[int, ...]:
        return tuple(n for n in self.initial if n not in self.lost)

    @property
    def round(self) -> int:
        """The current round (not ended)."""
        return self.executor.round

    def _build(self, first_round: int) -> None:
        members = self.members
        schedule = schedule_for(self.spec, self.ranks, members, self.node)
        self.members_now = members
        self.view = (tuple(sorted(self.lost)), first_round)  #: (lost, base) as it began
        self.index = {node: i for i, node in enumerate(members)}
        self.executor = Executor(schedule, first_round=first_round)
        self.layout = Layout(
            schedule,
            elements=self._elements,
            dtype=self.data.dtype,
            members=members,
            inplace=self.inplace,
            bounds=None if self.blocks is None else self.blocks.bounds,
            early=self.blocks is not None,
        )
        self._landings.clear()
        self._held.clear()  # messages of the first round in the old view: void
        self._answered: set[int] = set()  #: members whose older-view frame was answered
        self._copied = 0  #: in place: the allgather's copies that ran in this round
        self._perform(self.executor.post(0.0), 0.0)

    # -- calls ------------------------------------------------------------------------------
    def call(
        self,
        rank: int,
        token: int,
        array: np.ndarray[Any, Any] | None,
        now: float,
        output: np.ndarray[Any, Any] | None = None,
    ) -> list[Action]:
        """Local ``rank``'s call, answered later by :class:`Deliver` or :class:`Fail` for
        ``token``.  ``array``: its elements (``None`` for a barrier), kept until then;
        ``output``: an allgather's or reduce-scatter's, where its result goes.

        Raises:
            UsageError: the rank is not on this node, has a call of this collective open, or
                the collective is broken (the message says why).
        """
        if rank not in self.local:
            raise UsageError(f"rank {rank} is not on node {self.node}")
        if rank in self._by_rank:
            raise UsageError(
                f"rank {rank} already has a call of {self.name!r} open; wait for it first"
            )
        if self.broken is not None:
            raise UsageError(self.broken[1])
        if self.blocks is not None and output is None:
            raise UsageError(f"a {self.spec.kind} call needs its output array")
        self.counters.calls += 1
        kept = self._left.kept.pop(rank, None)
        call = Call(token=token, rank=rank, array=array, output=output, round=self.round)
        call.kept = kept
        self._calls[token] = call
        self._by_rank[rank] = call
        if self.spec.partial:
            self._call_partial(call, now)
        else:
            self._call_sync(call, now)
        return self._flush()

    def _call_partial(self, call: Call, now: float) -> None:
        assert call.array is not None
        due = self._due.get(call.rank, self.round)
        self.given.give(call.rank, call.array)
        if due < self.round:  # rounds ended without it: what it missed, at once
            self.counters.late += 1
            owed, results = self.owed.take(call.rank)
            self._deliver(call, self.round - 1, owed=owed, results=results)
            if self.spec.mode != "majority":
                return
            # majority: the current round waits for its initiator, who may be this rank; it
            # has arrived, so the round starts (its data, just given, is in it)
        else:
            call.included = not self.given.taken  # the snapshot is taken when the round starts
        if not self._agreed:
            self._called.add(call.rank)
            self._agree(now)
        elif self.executor.phase is Phase.ARMED and self._starts(call.rank):
            self._perform(self.executor.activate(self.round, now), now)
        elif self.executor.phase is Phase.ARMED and call.token in self._calls:
            self.patience.waits(now)  # majority: the round waits for its initiator

    def _agree(self, now: float) -> None:
        """The first round: once every live local rank called (each call checked against the
        collective's spec), this node starts it if a call waits, and takes part in what its
        peers started meanwhile (their messages waited here)."""
        if self._agreed or not (self.local & self.live) <= self._called:
            return
        self._agreed = True
        if self.executor.phase is Phase.ARMED and self._awaited():
            self._perform(self.executor.activate(self.round, now), now)
        held, self._held = self._held, []
        for peer, tag, round in held:
            self._perform(self.executor.arrived(peer, tag, round, now), now)

    def _starts(self, rank: int) -> bool:
        return self._open() and (self.spec.mode == "solo" or self._initiator() == rank)

    def _awaited(self) -> bool:
        """Whether a call here waits for the current round."""
        return any(c.round == self.round for c in self._calls.values())

    def _open(self) -> bool:
        """Whether a round may start here: the first round agreed, no abandoned one held."""
        return self._agreed and not self.ledger.held

    def _initiator(self) -> int:
        """The current round's majority initiator, among the live ranks of the member nodes
        (a rank whose node this view lost may be live again, but cannot start our round)."""
        members = set(self.members)
        live = frozenset(r for r in self.live if self.ranks[r] in members)
        return initiator(self.job, self.name, self.round, self.size, live)

    def _call_sync(self, call: Call, now: float) -> None:
        if call.rank in self._given or self._activated == self.round:
            call.round = self.round + 1  # after a failure: this rank is a round ahead
            self._later.append(call)
            return
        self._give(call)
        self._watch(now)
        if self._given >= self.local:
            self._activate_sync(now)

    def _give(self, call: Call) -> None:
        """Fold a sync call's array into ``data`` (the first one is copied): a sync round
        reads ``data`` only once every local rank gave, and a call made while it runs waits
        for its end (``_later``), so nothing else touches ``data`` meanwhile.  In place, the
        call's array *is* ``data`` for the round: nothing is copied."""
        data, array, own = self.data, call.array, self._own(call)
        if array is not None and own is not None and self.inplace:
            self.data = own
            if self.blocks is not None:  # an allgather: the rank's block, in place
                self.blocks.give(self.data, call.rank, array, op=self.spec.op, first=True)
        elif array is not None and self.blocks is not None:
            self.blocks.give(data, call.rank, array, op=self.spec.op, first=not self._given)
        elif array is not None and self.spec.kind == "allreduce":
            if self._given:
                REDUCE[self.spec.op](data, array, out=data)
            else:
                np.copyto(data, array)
        elif array is not None and self.spec.kind == "broadcast" and call.rank == self.spec.root:
            np.copyto(data, array)
        call.included = True
        self._given.add(call.rank)

    def _activate_sync(self, now: float) -> None:
        self._activated = self.round
        self._perform(self.executor.activate(self.round, now), now)

    def abandon(self, token: int) -> list[Action]:
        """The client of call ``token`` stopped waiting for it (interrupted, exited, closed):
        forget the call, and keep or withdraw its data (the module docstring says which and
        why).  Kept: the round it was for goes on with it, and the rank's next call is told
        (``kept``).  Withdrawn (a sync round not activated here): the round's contribution is
        rebuilt from the other local calls, which wait on.  In place, the round lets go of the
        client's array (its segment is unmapped once no view of it is left): one under way
        goes on in a copy (:meth:`_let_go`)."""
        call = self._calls.get(token)
        if call is None:
            return []
        if call.array is not None and self._own(call) is self.data:
            self._let_go()  # (a frame landing in it meanwhile is copied over when it is in)
        self._forget(call)
        gave = call.rank in self._given and call.round == self.round
        if self.spec.partial or (gave and self._activated == self.round):
            self._left.kept[call.rank] = call.round  # its data is in the round, or waits
        elif gave:
            self._withdraw()
        return self._flush()

    def _withdraw(self) -> None:
        """A sync gift leaves a round not activated here: none of it left this node, so the
        round's contribution is rebuilt from the calls that still gave to it (their arrays are
        theirs until they complete), as if the abandoned call had never come."""
        gave = [c for c in self._calls.values() if c.round == self.round and c.rank in self._given]
        self._given.clear()
        for call in gave:
            self._give(call)

    def rank_gone(
        self, rank: int, live: frozenset[int], now: float, *, grace: float
    ) -> list[Action]:
        """``rank`` of the job left (its trainer exited or its node went down).

        Partial modes go on.  A sync round may still complete: the rank may have given before
        it left (here, or on its node, which this node cannot see), or its trainer may restart
        and call.  So calls here fail only if the round has not ended ``grace`` seconds later
        (:meth:`on_timer`).  A local rank that comes back starts at the current round.
        """
        self.live = live
        self._left.grace = grace
        self._due.pop(rank, None)
        self.owed.forget(rank)
        self._watch(now)
        self._agree(now)
        self._kick(now)
        return self._flush()

    def _watch(self, now: float) -> None:
        """Sync: while a rank of the job is gone, the current round gets a deadline once a
        call waits for it (:meth:`on_timer` fails it if the round has not ended by then)."""
        if self.spec.partial or self._left.doom is not None or len(self.live) == self.size:
            return
        if self._awaited():
            self._left.watch(self.round, now, self.live, self.size)

    def _void(self, why: str) -> None:
        """The current sync round cannot complete: its gifts here are void, its calls fail."""
        message = (
            f"{why}: round {self.round} cannot complete; its result is undefined "
            "(resynchronise the model before going on)"
        )
        for call in [c for c in self._calls.values() if c.round == self.round]:
            self._fail(call.token, ErrorCode.PEER_FAILED, message)
        if self._activated != self.round:
            self._given.clear()

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must run: a rank left during a sync round, or a majority
        round's patience with its initiator ends."""
        if self._unled():
            return self.patience.deadline()
        return self._left.deadline()

    def _unled(self) -> bool:
        """Whether a majority round that has not started has a call here waiting for it."""
        return (
            self.spec.mode == "majority"
            and self._open()
            and self.broken is None
            and self.patience.since is not None
            and self.executor.phase is Phase.ARMED
        )

    def on_timer(self, now: float) -> list[Action]:
        """A majority round whose initiator a call here waited for as long as
        :attr:`patience` says starts here, as solo would ("Liveness").  A sync round still
        open ``grace`` seconds after a rank left (of another node, or of this one, its call
        withdrawn) will not complete: its calls fail."""
        if self._unled():
            deadline = self.patience.deadline()
            assert deadline is not None
            if now >= deadline:
                self.patience.since = None
                if self._awaited():
                    self.counters.unled += 1  # its initiator is not coming (soon): "Liveness"
                    self._perform(self.executor.activate(self.round, now), now)
            return self._flush()
        due = self._left.due(now)
        if due is not None and due[0] == self.round and self.broken is None:
            self._void(f"rank {due[1]} of job {self.job!r} left during {self.name!r}")
        return self._flush()

    def rank_back(self, live: frozenset[int]) -> None:
        """A rank of the job (re)joined: it may initiate majority rounds again; once every rank
        is back, a sync round has no deadline (its trainers can all call it)."""
        self.live = live
        if len(live) == self.size:
            self._left.doom = None

    # -- peers ------------------------------------------------------------------------------
    def landing(
        self,
        node: int,
        tag: int,
        round: int,
        offset: int,
        nbytes: int,
        lost: tuple[int, ...],
        base: int,
        now: float,
    ) -> memoryview | None:
        """Where ``nbytes`` bytes at ``offset`` of message ``tag`` of ``round`` from ``node``
        land; ``None``: drop them (a message of an older view, or of no bytes).  A newer view
        is adopted first, so its message lands.

        Raises:
            RemoteProtocolError: no recv takes the message, or its bytes do not fit its slot.
        """
        if not self._adopt(node, lost, base, now) or self.broken is not None:
            return None
        op = self._recv_op(node, tag)
        if not self.layout.lands(op):
            if nbytes:
                raise RemoteProtocolError(f"message tag {tag} from node {node} carries no bytes")
            return None
        if not self.round <= round <= self.round + 1:
            raise RemoteProtocolError(
                f"message of round {round} from node {node}: this node is in round {self.round}"
            )
        landing = self._landings.get((op, round))
        if landing is None:
            target = self._target(op, round, node)
            landing = Landing(op=op, node=node, view=raw(target), array=target)
            self._landings[op, round] = landing
        if offset + nbytes > len(landing.view):
            raise RemoteProtocolError(
                f"{nbytes} B at {offset} of message tag {tag} from node {node}: its slot holds "
                f"{len(landing.view)} B"
            )
        return landing.hand(offset, nbytes)

    def _target(self, op: int, round: int, node: int) -> np.ndarray[Any, Any]:
        """Where recv ``op``'s message of ``round`` lands: its slot, or (in place) its chunk
        of the round's ``data`` once the round runs here.  An allreduce's message cannot come
        before; an allgather's may (its left neighbour's call came first): it lands in a slot,
        which its ``copy`` reads (the layout's ``early``)."""
        running = round == self._activated and len(self.data) == self._elements
        if op not in self.layout.direct or (not running and op in self.layout.slots):
            return self.layout.slots[op][round % 2]
        if not running:
            raise RemoteProtocolError(
                f"allgather message of round {round} from node {node} came before this node "
                "sent its reduce-scatter share of that round"
            )
        return self._buffer(self.layout.direct[op], round)

    def arrived(
        self,
        node: int,
        tag: int,
        round: int,
        nbytes: int,
        lost: tuple[int, ...],
        base: int,
        now: float,
        notes: tuple[Note, ...] = (),
    ) -> list[Action]:
        """``nbytes`` of message ``tag`` of ``round`` from ``node`` landed where
        :meth:`landing` said (or, a message of no bytes, came); the recv is done once all of
        its slot is in.  ``notes``: a NOTICE's word on the views its sender left."""
        self._mend(node, tag, round)
        if self.spec.partial and tag == NOTICE:  # (only a NOTICE says all it will)
            self.ledger.heard(node, (tuple(sorted(lost)), base), notes)
        adopted = self._adopt(node, lost, base, now)
        if self.ledger.held and self.broken is None:
            self._settle(now)
        if not adopted or self.broken is not None or tag == NOTICE:
            return self._flush()
        op = self._recv_op(node, tag)
        if self.layout.lands(op):
            landing = self._landings.get((op, round))
            if landing is None:  # landing() dropped it, or our view changed since it landed
                self.counters.frames_dropped += 1
                return self._flush()
            landing.got += nbytes
            if landing.got < len(landing.view):
                return self._flush()
            del self._landings[op, round]
            if op in self.layout.direct and not self.layout.slotted(op, landing.array):
                self._landed[op] = landing.array  # what its "copy" reads: the chunk it landed in
        peer = self.index[node]
        if self._agreed:
            self._perform(self.executor.arrived(peer, tag, round, now), now)
        else:  # the first round: this node takes part once its ranks all called
            self._held.append((peer, tag, round))
        return self._flush()

    def _recv_op(self, node: int, tag: int) -> int:
        peer = self.index.get(node)
        op = self.layout.recv_of.get((peer, tag)) if peer is not None else None
        if op is None:
            raise RemoteProtocolError(f"no recv of {self.name!r} takes tag {tag} from node {node}")
        return op

    def _current_view(self, node: int, lost: tuple[int, ...], base: int) -> bool:
        """Whether a frame of view (``lost``, ``base``) from ``node`` belongs to ours."""
        return frozenset(lost) == self.lost and base == self.base and node in self.index

    def _adopt(self, node: int, lost: tuple[int, ...], base: int, now: float) -> bool:
        """Take a peer's view where it is ahead of ours; ``False``: the frame is of an older
        view (or names this node lost) and is dropped."""
        theirs = frozenset(lost)
        if node in self.lost:  # a node this one lost (it restarted, or was thought dead)
            if node not in self._told:  # tell it once per loss: its calls then fail there
                self._told.add(node)
                self._out.append(self._notice(node))
            return False
        if self.broken is not None:
            return False
        if self.node in theirs:
            self._break(
                ErrorCode.PEER_FAILED,
                f"node {node} counts this node lost, so {self.name!r} of job {self.job!r} goes "
                "on without it until the whole job restarts; its calls here fail",
            )
            return False
        if not theirs <= self.lost and self.spec.partial:
            self._lose(theirs | self.lost, now, base=max(base, self.base))
        elif base > self.base and theirs == self.lost and self.spec.partial:
            self._restart(base, now)
        current = self._current_view(node, lost, base)
        if not current and node in self.index and node not in self._answered:
            self._answered.add(node)  # behind: say our view, once (its NOTICE may be lost)
            self._out.append(self._notice(node))
        return current

    def lose(self, node: int, reason: str, now: float) -> list[Action]:
        """Member ``node`` went down (``reason``): see the module docstring."""
        self._told.discard(node)  # lost again (it came back and died): tell it again
        self.ledger.forget(node)
        if node not in self.members or self.broken is not None:
            return self._flush()
        if not self.spec.partial:
            self.lost |= {node}  # a node that comes back is told, and its calls fail there
            self._break(
                ErrorCode.PEER_FAILED,
                f"node {node} went down ({reason}): the {self.spec.describe()} {self.name!r} "
                f"of job {self.job!r} needs "
                f"every node, so it cannot go on (restart the job)",
                node=node,
            )
            return self._flush()
        self._lose(self.lost | {node}, now, base=self.base)
        return self._flush()

    def interrupted(self, node: int, reason: str) -> list[Action]:
        """Member ``node``'s links were reset: frames in flight to and from it are lost, but
        it may come back (:meth:`resume`) before it is counted down (:meth:`lose`).  A sync
        round under way cannot be run again (its gifts were reduced in place), so a sync
        collective with a round under way breaks now; one between rounds, and a partial one,
        wait.  A frame from ``node`` torn by :meth:`_let_go` will not arrive: the failures it
        held are delivered (nothing lands from a link once it is lost)."""
        busy = self._calls or self.executor.phase is Phase.RUNNING
        if node in self.members and self.broken is None and not self.spec.partial and busy:
            self._out += self.lose(node, reason, 0.0)
        for landing in self._landings.values():
            if landing.node == node:
                landing.torn = None
        self._release()
        return self._flush()

    def resume(self, node: int, now: float) -> list[Action]:
        """Member ``node`` is back, the same daemon, after a reset of its links: what was in
        flight is lost, so a partial collective abandons its round (held, as in any view
        change) and every member runs on from the next round number (the view's new base)."""
        if node not in self.members or self.broken is not None or not self.spec.partial:
            return self._flush()
        self._restart(self.round + 1, now)
        return self._flush()

    def _lose(self, lost: frozenset[int], now: float, *, base: int) -> None:
        self.lost = lost
        if len(self.members) == 0 or self.node not in self.members:
            self._break(ErrorCode.PEER_FAILED, f"no member node of {self.name!r} is left")
            return
        self.counters.views += 1
        self._restart(max(base, self.round), now)

    def _restart(self, base: int, now: float) -> None:
        """Abandon the current round and run the view from round ``base``.  The round's
        snapshot is held until the survivors say whether one of them ended it
        (:mod:`~fabricd.engines.collectives.ledger`: counted there, or restored here)."""
        old = self.view
        self.ledger.leave(old, self.round - 1 if self.round > old[1] else -1)
        if self.given.taken and not self.given.snapped:  # nothing given: hold nothing
            self.given.ended()
        if self.given.taken:
            snapshot = self.given.snapshot.copy()
            held = Held(view=old, round=self.round, data=snapshot, ranks=self.given.snapped)
            for spilled in self.ledger.hold(held):
                self.given.take_back(spilled.data, spilled.ranks)
            self.given.ended()
            for call in self._calls.values():
                call.included = False
        self.base = base
        # frames of the abandoned round, and of the round before to a node this view lost
        # (nothing waits for it any more), may still be queued reading these: take others
        self.data = np.zeros_like(self.data)
        self.result = self.result.copy()
        for call in self._calls.values():
            call.round = max(call.round, base)
        current = self.round  # a rank behind keeps its due round: it is owed rounds
        for rank in self.local:  # that ended here, which its next (late) call takes
            if current <= self._due.get(rank, base) < base:
                self._due[rank] = base
        self._build(first_round=base)
        for node in self.members:  # a member a round behind may hear nothing else of it
            if node != self.node:
                self._out.append(self._notice(node))
        self._settle(now)

    def _settle(self, now: float) -> None:
        """Restore the held snapshots no survivor ended the round of, drop those one did; then
        a waiting call may start the round (none does while a snapshot is held, so that it
        joins the first round it may)."""
        others = tuple(n for n in self.members if n != self.node)
        restore, counted = self.ledger.settle(others)
        self.counters.counted_elsewhere += counted
        for held in restore:
            self.given.take_back(held.data, held.ranks)
        self._kick(now)

    def _notice(self, node: int) -> Transmit:
        """A frame that carries only this node's view (:data:`NOTICE` tag, no bytes)."""
        lost = tuple(sorted(self.lost))
        empty = memoryview(b"")
        notes = self.ledger.notes()
        return Transmit(
            node=node, round=0, tag=NOTICE, payload=empty, lost=lost, base=self.base, notes=notes
        )

    def _kick(self, now: float) -> None:
        """A call already waiting for the current round starts it, if it may (solo: any;
        majority: the initiator's, which a view change or a rank's departure may have made
        it): nothing else would."""
        if not self.spec.partial or self.executor.phase is not Phase.ARMED:
            return
        if any(c.round == self.round and self._starts(c.rank) for c in self._calls.values()):
            self._perform(self.executor.activate(self.round, now), now)
        elif self._open() and self._awaited():
            self.patience.waits(now)

    def break_with(self, code: str, message: str) -> list[Action]:
        """Nothing of this collective can run any more (``message`` says why): fail its calls,
        and every later one."""
        self._break(code, message)
        return self._flush()

    def _break(self, code: str, message: str, node: int | None = None) -> None:
        self.broken = (code, message)
        for token in list(self._calls):
            self._fail(token, code, message, node)

    # -- performing the schedule ------------------------------------------------------------
    def _perform(self, actions: list[Any], now: float) -> None:
        self._run(actions, now)
        while self._ready:  # outside the loop: the ended round's actions are all performed
            self._ready = False
            self._activate_sync(now)

    def _run(self, actions: list[Any], now: float) -> None:
        work = deque(actions)
        while work:
            action = work.popleft()
            more: list[Any] = []
            match action:
                case StartSend(op=op, round=round):
                    sched = self.executor.schedule.ops[op]
                    source = self._buffer(sched.buffer, round)
                    self._out.append(
                        Transmit(
                            node=self.members_now[sched.peer],
                            round=round,
                            tag=sched.tag,
                            payload=self._payload(source),
                            lost=tuple(sorted(self.lost)),
                            base=self.base,
                        )
                    )
                    more = self.executor.completed(op, round, now)
                case StartCompute(op=op, round=round):
                    sched = self.executor.schedule.ops[op]
                    inputs = [self._buffer(name, round) for name in sched.inputs]
                    compute(sched.fn, self._buffer(sched.buffer, round), inputs, self.size)
                    self._count_copy(op, round)
                    more = self.executor.completed(op, round, now)
                case RoundStarted():
                    if self.spec.partial:
                        self._take_snapshot()
                        self.patience.started(now)
                case RoundEnded(round=round):
                    self._ended(round, now)
                    if self.inplace:  # delivered: keep no view of the caller's array, nor a
                        self.result = self._idle  # copy of it (a round run on after a failure)
                case StartRecv() | Discard():
                    pass
            work.extendleft(reversed(more))

    def _payload(self, source: np.ndarray[Any, Any]) -> memoryview:
        """What a send hands the transport: a view where nothing writes the bytes before the
        peer has them, a copy where something may (recursive doubling reduces into the very
        tensor it just sent, as soon as the partner's arrives)."""
        if self.spec.doubling:
            return memoryview(source.tobytes())
        return raw(source)

    def _buffer(self, name: str, round: int = 0) -> np.ndarray[Any, Any]:
        return self.layout.buffer(name, round, self.data, self._landed)

    def _count_copy(self, op: int, round: int) -> None:
        """In place, the last of a round's allgather copies makes its result whole: the call
        may complete before the acknowledgements if the service finds nothing of the round
        still queued (:class:`Settle`): one message's latency less a round."""
        if not self.inplace or self.executor.schedule.ops[op].fn != "copy":
            return
        self._copied += 1
        if self._copied == self.layout.copies:
            self._out.append(Settle(round=round, nodes=self.layout.sent_to))

    def sent(self, round: int, now: float) -> list[Action]:
        """Nothing this node sent in ``round`` is held in this process any more (the answer to
        :class:`Settle`): its call completes now, the round ends with the acknowledgements."""
        if round == self.round and self.layout.copies and self._copied == self.layout.copies:
            for call in [c for c in self._calls.values() if c.round <= round]:
                self.counters.settled += 1
                self._deliver(call, round, self.size, copy=False)
        return self._flush()

    def _take_snapshot(self) -> None:
        self.given.take(self.data)
        for call in self._calls.values():  # their data is in it (unless a round abandoned by
            if call.round == self.round:  # a view change holds it: ledger.py)
                call.included = call.rank in self.given.snapped

    def _ended(self, round: int, now: float) -> None:
        if self.inplace:  # the result is where the caller wants it; the next call brings data
            self.data, self.result = self._idle, self.data
            self._landed.clear()
            self._copied = 0
        else:
            self.data, self.result = self.result, self.data
        count = self.spec.count
        active = int(self.result[count]) if self.spec.partial else self.size
        # avg: a sync schedule over several nodes divides once, on the way (its builder's
        # "div"); a partial one, or one node alone, divides the sum here
        if self.spec.op == "avg" and (self.spec.partial or len(self.members_now) == 1):
            part = self.result[: self._elements - self.spec.partial]  # (not the active count)
            divide(part, self.size, part)
        self.given.ended()
        self._given.clear()
        self._activated = None
        self._left.ended(round)  # it ended all the same
        self.counters.rounds += 1
        self.counters.sum_active += active
        for call in [c for c in self._calls.values() if c.round <= round]:
            self._deliver(call, round, active)
        if self.spec.partial and self.spec.late == "sum":
            for rank, due in self._due.items():  # no call of it waited: it missed this one
                if due <= round:
                    self.owed.missed(rank, self.result[:count])
        later, self._later = self._later, deque()
        for call in later:  # sync calls made while this round ran: the next one's
            call.round = self.round
            self._give(call)
        self._watch(now)
        self._ready = bool(self._given) and self._given >= self.local

    def _deliver(
        self,
        call: Call,
        round: int,
        active: int | None = None,
        *,
        copy: bool = True,
        owed: np.ndarray[Any, Any] | None = None,
        results: int = 1,
    ) -> None:
        """Complete ``call`` with round ``round``'s result, or with ``owed``: the sum of the
        ``results`` results its rank missed (``late="sum"``)."""
        result = self.result[: self.spec.count] if owed is None else owed
        array = call.array if copy and self.spec.kind != "barrier" else None
        if self.blocks is not None and call.output is not None and copy:  # its part of it
            self.blocks.take(self.result, call.rank, call.output)
        elif array is not None and not same(array, result):  # in place, it is there already
            np.copyto(array, result)
        if active is None:
            active = int(self.result[self.spec.count]) if self.spec.partial else self.size
        self._due[call.rank] = round + 1
        self.counters.included += call.included
        self._forget(call)
        self._out.append(
            Deliver(
                token=call.token,
                round=round,
                included=call.included,
                active=active,
                kept=call.kept,
                results=max(results, 1),
            )
        )

    def _fail(self, token: int, code: str, message: str, node: int | None = None) -> None:
        call = self._calls.get(token)
        if call is None:
            return
        held = call.array is not None and self._own(call) is self.data and self._let_go()
        self._forget(call)
        fail = Fail(token=token, code=code, message=call.failed(message), node=node)
        (self._withheld if held else self._out).append(fail)

    def _own(self, call: Call) -> np.ndarray[Any, Any] | None:
        """The array ``call``'s round runs in, in place: its output (an allgather's), or its
        array."""
        return call.output if self.blocks is not None else call.array

    def _let_go(self) -> bool:
        """In place, the round's caller is gone (its call failed, or its client left): the
        round no longer holds its array.  One that has not started drops it; one under way
        goes on in a copy of ``data`` (:func:`~fabricd.engines.collectives.landing.detach`
        says how and why).  Returns whether a frame is still landing in the array (the
        caller's failure waits for it: :meth:`_mend`, or its link's reset,
        :meth:`interrupted`)."""
        if self._activated != self.round:  # nothing of the round has run: nothing to keep
            self.data = self._idle
            return False
        old, self.data = self.data, self.data.copy()
        return detach(old, self.data, self._landings.values(), self._landed)

    def _mend(self, node: int, tag: int, round: int) -> None:
        """A frame of ``node``'s message ``tag`` of ``round`` arrived: if :meth:`_let_go` tore
        it, copy its bytes to where its message lands now, and deliver the failures held for
        it once no frame is torn."""
        op = self.layout.recv_of.get((self.index.get(node, -1), tag))
        landing = self._landings.get((op, round)) if op is not None else None
        if landing is not None and landing.torn is not None:
            landing.mend()
            self._release()

    def _release(self) -> None:
        if not any(landing.torn is not None for landing in self._landings.values()):
            self._out += self._withheld
            self._withheld.clear()

    def _forget(self, call: Call) -> None:
        self._calls.pop(call.token, None)
        if self._by_rank.get(call.rank) is call:
            del self._by_rank[call.rank]
        if call in self._later:
            self._later.remove(call)

    def _flush(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    # -- what status shows -------------------------------------------------------------------
    def waiting(self) -> int:
        """Calls open."""
        return len(self._calls)

    def waits(self) -> tuple[str, str, int | None]:
        """What the current round waits for, for a stall report: (``ranks``, ``initiator``
        or ``messages``; a sentence; a node it waits for, if one)."""
        round = self.round
        if self.broken is not None:
            return "broken", self.broken[1], None
        if not self.spec.partial and self._activated != round:
            missing = sorted(self.local - self._given)
            return "ranks", f"round {round} starts once local ranks {missing} call it", None
        if not self._agreed:
            missing = sorted((self.local & self.live) - self._called)
            return (
                "ranks",
                f"round {round} is this node's first: it takes part once local ranks {missing} "
                "called it (every rank's first call is checked against the others')",
                None,
            )
        if self.spec.mode == "majority" and self.executor.phase is Phase.ARMED:
            rank = self._initiator()
            node = self.ranks[rank]
            detail = f"round {round} starts when rank {rank} calls it"
            if self.patience.since is not None:
                detail += f", or {self.patience.wait():.3g} s after a call here began waiting"
            return "initiator", detail, node
        ops = self.executor.schedule.ops
        nodes = sorted({self.members_now[ops[i].peer] for i in self.executor.waiting_recvs()})
        if not nodes:
            return "messages", f"round {round} has not started", None
        return "messages", f"round {round} waits for messages from nodes {nodes}", nodes[0]

    def conservation(self) -> np.ndarray[Any, Any]:
        """What local ranks gave that no result counted yet (partial modes; the engine tests
        check that all ever given equals what results counted plus this)."""
        return self.given.waiting(h.data for h in self.ledger.held)

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        """Every array the collective holds now (what the byte budget bounds)."""
        mine = (self.data, self.result, *self.given.arrays(), *self.owed.arrays())
        return mine + tuple(h.data for h in self.ledger.held) + self.layout.arrays()
