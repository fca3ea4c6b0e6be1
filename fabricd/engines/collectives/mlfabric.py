"""MLfabric-S as an allreduce (MLfabric §6): ``fab.allreduce(..., algorithm="mlfabric")``.

Rules: this module decides, for one sync allreduce on one node, the messages of each round of
MLfabric's synchronous algorithm: who is the round's *root*, what each node tells it, where
each node's contribution goes, which nodes sum whose contributions, and when the round ends.
The local ranks' calls (their contribution to the node's, abandons, departures, failures) are
:class:`~fabricd.engines.collectives.persistent.Collective`'s, whose sync path this class
keeps; only the round runs differently: no static schedule, a plan the root makes as the
nodes become ready.  No socket, no clock: ``now`` and the monitor's figures come in,
:class:`Transmit` and :class:`Deliver` go out.

Theory of operation (§6: "the workers' updates for an iteration are batched when they become
ready ... aggregation here starts with a *list* of updates ... The next batch may use a
different aggregation topology"; the issue's form: push to a random root, then get from it).

* **A root per round** (:func:`root_of`): a hash of (job, name, round) over the member nodes,
  the same at every node with no message, so the load of summing and sending the result moves
  round to round, as a parameter server's would if it moved.
* **READY.**  A node whose local ranks all called (its contribution is whole) tells the root
  (tag :data:`READY`, no bytes).  The root's own contribution is ready when its ranks called.
* **Batches.**  The root gathers READYs for ``interval`` seconds from the first (the
  parameter server's ``schedule_interval``, §7's 100 ms), or until every other node is
  ready, whichever comes first (waiting longer could only delay), then plans the batch:
  the nodes in the order they became ready
  (:func:`~fabricd.engines.scheduling.ordering.in_list_order`), then Alg. 3
  (:func:`~fabricd.engines.scheduling.aggregation.aggregate`) over the monitor's figures, the
  aggregators being every other member node, ready or not (§7.2: "MLfabric-S reduces the idle
  time by eagerly aggregating available worker updates"; a straggler's daemon is idle while
  its trainer computes), in a rotation that moves one node a round.  Later batches of a round
  plan on the timelines the earlier ones left (advanced to now).
* **GRANT and GATHER.**  Each planned node is told where its contribution goes (:data:`GRANT`:
  the root, or an aggregator); each aggregator is told its group (:data:`GATHER`: a group
  number and its members).  A member sends its contribution (:data:`PART`) at once: the plan
  orders the transfers on the timelines, but senders are not paced to its planned starts
  (the parameter server's grants are; here a round's transfers are few and TCP shares the
  links).  An aggregator sums its group's parts as they come (one that comes before its GATHER
  waits for it) and forwards the sum (:data:`SUM` + group) to the root.  A node may be its own
  group's aggregator: its part is summed locally.
* **RESULT.**  The root reduces every part and sum into the round's total with its own
  contribution; once every member node is in exactly once, an ``avg`` is divided by the job's
  size and the total goes to every other node (:data:`RESULT`): every rank gets the root's bits.
* **Checks**, each before a byte is allocated for the message.  The root takes a PART only from
  a node it granted the root, a SUM only from the aggregator of a group it planned, each once;
  a GRANT, a GATHER or a RESULT comes only from the round's root (a GATHER's members in no
  other group of the round); an aggregator takes a PART only from a member of one of its
  groups (or holds it until the GATHER, one per sender and round); a message's frames come in
  order.  Anything else, or a message of a round other than this node's current or next, is a
  protocol error.  A one-member group is granted straight: a relay is never faster on a star
  network.
* **Rounds overlap by one.**  A node that got round ``r``'s RESULT may be ready for ``r + 1``
  while its root, or an aggregator, still waits for ``r``'s RESULT: their messages of ``r + 1``
  are kept by round.  Nothing of ``r + 2`` can come: it needs this node's part of ``r + 1``.
* **Faults.**  As every sync collective: a member node lost breaks it (its calls fail; a sum
  cannot be taken apart, nor a round run again); a reset of a member's links breaks it while a
  round is under way or a call waits.

Cost: two more messages per node and round than a direct push (READY, GRANT; a GATHER per
group) and a wait of up to ``interval`` when a node is not the last ready; MLfabric-S pays that
to move the aggregation onto idle links.  Every message of a round is one frame (the service
splits larger ones).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np

from fabricd.engines.collectives.computes import divide
from fabricd.engines.collectives.landing import raw
from fabricd.engines.collectives.persistent import Collective
from fabricd.engines.collectives.spec import NOTICE, REDUCE, Spec, Transmit
from fabricd.engines.monitor.table import DEFAULT_BPS
from fabricd.engines.scheduling.aggregation import aggregate
from fabricd.engines.scheduling.ordering import Update, in_list_order
from fabricd.engines.scheduling.timelines import Network
from fabricd.errors import RemoteProtocolError, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from fabricd.engines.collectives.ledger import Note
    from fabricd.engines.collectives.spec import Action

#: message tags (a round's messages; NOTICE, the view-only frame, is the spec's)
READY: Final = 1
GRANT: Final = 2
GATHER: Final = 3
PART: Final = 4
RESULT: Final = 5
#: a group's sum: ``SUM + group``
SUM: Final = 16
#: the most groups a root plans in one round (a group number fits in a tag)
MAX_GROUPS: Final = 1 << 20
#: bytes of one number in a GRANT or GATHER
_INT: Final = np.dtype("<i8")
#: the most member nodes: a GATHER (a group number and its members) is one frame, and the
#: least ``chunk_size`` is 4096 bytes
MAX_NODES: Final = 4096 // _INT.itemsize - 1


def root_of(job: str, name: str, round: int, members: tuple[int, ...]) -> int:
    """The root node of ``round``: drawn from ``members`` by a hash of (job, name, round)."""
    digest = hashlib.blake2b(f"{job}\0{name}\0{round}\0mlfabric".encode(), digest_size=8)
    return members[int.from_bytes(digest.digest(), "little") % len(members)]


@dataclass(slots=True)
class _Inbound:
    """A message being received: its bytes, and how many came."""

    array: np.ndarray[Any, Any]
    got: int = 0


@dataclass(slots=True)
class _Group:
    """A group this node sums (an aggregator's) or planned (the root's)."""

    aggregator: int
    members: frozenset[int]
    got: set[int] = field(default_factory=set)
    total: np.ndarray[Any, Any] | None = None


@dataclass(slots=True)
class _Round:
    """What this node knows of one round."""

    root: int
    #: root: nodes whose READY came and are not planned yet, in order; when the batch is due
    batch: list[int] = field(default_factory=list)
    due: float | None = None
    network: Network | None = None  #: root: the timelines the round's batches left
    granted: dict[int, int] = field(default_factory=dict)  #: root: node -> where its part goes
    planned: dict[int, _Group] = field(default_factory=dict)  #: root: group -> its plan
    covered: set[int] = field(default_factory=set)  #: root: member nodes in the total
    total: np.ndarray[Any, Any] | None = None  #: root: the parts and sums reduced so far
    gathers: dict[int, _Group] = field(default_factory=dict)  #: aggregator: group -> its sum
    early: dict[int, np.ndarray[Any, Any]] = field(default_factory=dict)  #: parts before GATHER
    grant: int | None = None  #: where this node's part goes, once told
    inbound: dict[tuple[int, int], _Inbound] = field(default_factory=dict)  #: (node, tag)
    groups: int = 0  #: root: groups planned


class MlfabricCollective(Collective):
    """A sync allreduce run as MLfabric-S (module docstring).

    Args:
        interval: seconds the root gathers READYs into a batch.
        figures: the monitor's (up, down) bytes/s of the nodes it has figures for.
        The others: :class:`~fabricd.engines.collectives.persistent.Collective`'s.
    """

    def __init__(
        self,
        spec: Spec,
        *,
        job: str,
        name: str,
        node: int,
        ranks: tuple[int, ...],
        live: frozenset[int],
        interval: float,
        figures: Callable[[], Mapping[int, tuple[float, float]]],
        majority_wait: float = 2.0,
    ) -> None:
        if not spec.mlfabric:
            raise ValueError(f"{spec.describe()} is not an mlfabric allreduce")
        if len(set(ranks)) > MAX_NODES:
            raise UsageError(f"algorithm 'mlfabric' runs over at most {MAX_NODES} nodes")
        self.interval = interval
        self._figures = figures
        self._round = 0
        self._rounds: dict[int, _Round] = {}
        super().__init__(
            spec,
            job=job,
            name=name,
            node=node,
            ranks=ranks,
            live=live,
            majority_wait=majority_wait,
        )
        self._nbytes = self.data.nbytes

    # -- the round ---------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """The current round (not ended)."""
        return self._round

    def _build(self, first_round: int) -> None:
        members = self.members
        self.members_now = members
        self.view = (tuple(sorted(self.lost)), first_round)
        self.index = {node: i for i, node in enumerate(members)}
        self._answered: set[int] = set()
        self._round = first_round

    def _state(self, round: int) -> _Round:
        state = self._rounds.get(round)
        if state is None:
            state = _Round(root=root_of(self.job, self.name, round, self.members_now))
            self._rounds[round] = state
        return state

    def _activate_sync(self, now: float) -> None:
        """Every local rank gave to the current round: the node's contribution is whole."""
        self._activated = self.round
        state = self._state(self.round)
        if state.root == self.node:
            state.covered.add(self.node)
            self._add(state, self.data)
            self._finish(state, now)
        else:
            self._send(state.root, READY, b"")

    def _send(
        self, node: int, tag: int, payload: bytes | np.ndarray[Any, Any], round: int | None = None
    ) -> None:
        """Message ``tag`` of ``round`` (the current one by default) to ``node``."""
        view = raw(payload) if isinstance(payload, np.ndarray) else memoryview(payload)
        self._out.append(
            Transmit(
                node=node,
                round=self.round if round is None else round,
                tag=tag,
                payload=view,
                lost=(),
                base=self.base,
            )
        )

    # -- the root ----------------------------------------------------------------------------
    def _on_ready(self, state: _Round, round: int, node: int, now: float) -> None:
        if node in state.granted or node in state.batch:
            raise RemoteProtocolError(f"node {node} was ready twice in round {round}")
        state.batch.append(node)
        others = len(self.members_now) - 1
        if len(state.granted) + len(state.batch) == others:
            self._plan(state, round, now)  # every other node is ready: nothing to wait for
        elif state.due is None:
            state.due = now + self.interval

    def _plan(self, state: _Round, round: int, now: float) -> None:
        """Grant the batch (Alg. 3 over its list, module docstring)."""
        batch, state.batch, state.due = state.batch, [], None
        network = self._network(state, now)
        updates = [Update(key=n, host=n, version=0, size=float(self._nbytes)) for n in batch]
        listed = in_list_order(updates, network, server=state.root)
        others = [n for n in self.members_now if n != state.root]
        turn = round % len(others)
        aggregators = others[turn:] + others[:turn]
        plan = aggregate(listed.planned, network, server=state.root, aggregators=aggregators)
        state.network = plan.network if plan.network is not None else listed.network
        grouped: set[int] = set()
        for group in plan.groups:  # (the root is no aggregator: it is the server)
            members = frozenset(cast("int", p.update.key) for p in group.members)
            if len(members) == 1:
                continue  # one member: a relay, never faster than straight on a star network
            number = state.groups
            state.groups += 1
            state.planned[number] = _Group(aggregator=group.aggregator, members=members)
            header = np.array([number, *sorted(members)], _INT)
            self._send(group.aggregator, GATHER, header, round)
            for member in members:
                state.granted[member] = group.aggregator
                self._send(member, GRANT, np.array([group.aggregator], _INT), round)
            grouped |= members
        for node in batch:
            if node not in grouped:
                state.granted[node] = state.root
                self._send(node, GRANT, np.array([state.root], _INT), round)

    def _network(self, state: _Round, now: float) -> Network:
        """The timelines a batch plans on: the round's earlier batches' (advanced to now), or
        the monitor's figures of the member nodes (an unknown node at the monitor's figure
        for unknown)."""
        if state.network is not None:
            state.network.advance(now)
            return state.network
        up: dict[int, float] = {}
        down: dict[int, float] = {}
        table = self._figures()
        for node in self.members_now:
            up[node], down[node] = table.get(node, (DEFAULT_BPS, DEFAULT_BPS))
        return Network(up, down, now=now)

    def _add(self, state: _Round, values: np.ndarray[Any, Any]) -> None:
        if state.total is None:
            state.total = np.array(values, copy=True)
        else:
            REDUCE[self.spec.op](state.total, values, out=state.total)

    def _finish(self, state: _Round, now: float) -> None:
        """Root: once every member node is in, the round's result goes to every other node."""
        if len(state.covered) < len(self.members_now) or self._activated != self.round:
            return
        total = state.total
        assert total is not None
        if self.spec.op == "avg" and len(self.members_now) > 1:  # (alone: _ended divides)
            divide(total, self.size, total)
        for node in self.members_now:
            if node != self.node:
                self._send(node, RESULT, total)
        self._end(total, now)

    def _end(self, result: np.ndarray[Any, Any], now: float) -> None:
        round = self.round
        np.copyto(self.data, result)
        del self._rounds[round]
        self._round = round + 1
        self._ended(round, now)
        self._perform([], now)  # the next round, if every local rank gave to it already

    # -- peers -------------------------------------------------------------------------------
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
        land: a buffer of the message's own (data messages: the tensor's bytes; a GRANT or
        GATHER: one frame).

        Raises:
            RemoteProtocolError: a message this node takes no bytes of, or too many.
        """
        if not self._peer(node, lost, base) or self.broken is not None:
            return None
        state = self._at(node, round)
        inbound = state.inbound.get((node, tag))
        if inbound is None:
            self._expects(state, round, node, tag)  # before anything is allocated for it
            if tag in (GRANT, GATHER):
                if offset or nbytes % _INT.itemsize:
                    raise RemoteProtocolError(f"a GRANT or GATHER from node {node} is one frame")
                inbound = _Inbound(np.empty(nbytes // _INT.itemsize, _INT))
            else:
                inbound = _Inbound(np.empty_like(self.data))
            state.inbound[node, tag] = inbound
        view = raw(inbound.array)
        # a message's frames come in order on one link: each begins where the last ended
        if offset + nbytes > len(view) or offset != inbound.got:
            raise RemoteProtocolError(
                f"{nbytes} B at {offset} of message tag {tag} from node {node}: it holds "
                f"{len(view)} B"
            )
        return view[offset : offset + nbytes]

    def _expects(self, state: _Round, round: int, node: int, tag: int) -> None:
        """Raise unless a message ``tag`` of ``round`` from ``node`` may carry bytes here: a
        GRANT or GATHER from the root, a RESULT from the root of this node's round, a SUM
        at the root from the aggregator of a group it planned, a PART at the root from a node
        it granted itself, or (one per sender and round) at another node.

        Raises:
            RemoteProtocolError: anything else, before a byte is allocated for it.
        """
        root = state.root == self.node
        group = state.planned.get(tag - SUM) if tag >= SUM else None
        if tag in (GRANT, GATHER, RESULT):
            ok = node == state.root and (tag != RESULT or round == self._activated)
        elif tag == PART:
            ok = not root or state.granted.get(node) == self.node
        else:
            ok = root and tag != NOTICE and group is not None and group.aggregator == node
        if not ok:
            raise RemoteProtocolError(
                f"message tag {tag} of round {round} from node {node}: not one this node takes"
            )

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
        :meth:`landing` said (or, a message of no bytes, came).  A NOTICE (a peer's view,
        or its word that the ranks' specs disagree) changes nothing here: a sync collective
        breaks on a loss or a disagreement by itself."""
        if not self._peer(node, lost, base) or self.broken is not None or tag == NOTICE:
            return self._flush()
        state = self._at(node, round)
        if tag == READY:
            if state.root != self.node or nbytes:
                raise RemoteProtocolError(f"a READY from node {node} for a round it is not root of")
            self._on_ready(state, round, node, now)
            return self._flush()
        inbound = state.inbound.get((node, tag))
        if inbound is None and not nbytes and not self._nbytes and tag not in (GRANT, GATHER):
            self._expects(state, round, node, tag)
            inbound = _Inbound(np.empty_like(self.data))  # an empty tensor's: no frame landed
        if inbound is None:
            self.counters.frames_dropped += 1  # (landing() dropped it)
            return self._flush()
        inbound.got += nbytes
        if inbound.got < inbound.array.nbytes:
            return self._flush()
        state.inbound.pop((node, tag), None)
        self._message(state, round, node, tag, inbound.array, now)
        return self._flush()

    def _peer(self, node: int, lost: tuple[int, ...], base: int) -> bool:
        """Whether a frame from ``node`` is one to take (a node this one lost is told so)."""
        if node in self.lost:
            if node not in self._told:
                self._told.add(node)
                self._out.append(self._notice(node))
            return False
        if self.node in lost:
            self._break(
                "peer_failed",
                f"node {node} counts this node lost, so {self.name!r} of job {self.job!r} "
                "cannot go on; its calls here fail",
            )
            return False
        return node in self.index

    def _at(self, node: int, round: int) -> _Round:
        if not self.round <= round <= self.round + 1:
            raise RemoteProtocolError(
                f"message of round {round} from node {node}: this node is in round {self.round}"
            )
        return self._state(round)

    def _message(
        self,
        state: _Round,
        round: int,
        node: int,
        tag: int,
        array: np.ndarray[Any, Any],
        now: float,
    ) -> None:
        if tag == GRANT:
            self._granted(state, round, node, array, now)
        elif tag == GATHER:
            self._gather(state, round, node, array, now)
        elif tag == PART:
            self._part(state, round, node, array, now)
        elif tag == RESULT:
            if node != state.root or round != self.round or self._activated != round:
                raise RemoteProtocolError(f"a RESULT of round {round} from node {node}")
            self._end(array, now)
        else:
            self._sum(state, node, tag - SUM, array, now)

    def _granted(
        self, state: _Round, round: int, node: int, array: np.ndarray[Any, Any], now: float
    ) -> None:
        """Where this node's part goes: send it (to itself: its own group's sum)."""
        if (
            node != state.root
            or array.size != 1
            or state.grant is not None
            or round != self._activated
        ):
            raise RemoteProtocolError(f"a GRANT of round {round} from node {node}")
        dest = int(array[0])
        if dest not in self.index:
            raise RemoteProtocolError(f"a GRANT to node {dest}, no member of {self.name!r}")
        state.grant = dest
        if dest == self.node:
            self._part(state, round, self.node, self.data, now)
        else:
            self._send(dest, PART, self.data)

    def _gather(
        self, state: _Round, round: int, node: int, array: np.ndarray[Any, Any], now: float
    ) -> None:
        members = frozenset(int(m) for m in array[1:])
        if (
            node != state.root
            or array.size < 2
            or not 0 <= int(array[0]) < MAX_GROUPS
            or int(array[0]) in state.gathers
            or not members <= self.index.keys()
            or state.root in members
            or len(members) != array.size - 1
            or any(members & g.members for g in state.gathers.values())
        ):
            raise RemoteProtocolError(f"a GATHER of round {round} from node {node}")
        group = _Group(aggregator=self.node, members=members)
        state.gathers[int(array[0])] = group
        for member in sorted(members & state.early.keys()):
            self._part(state, round, member, state.early.pop(member), now)

    def _part(
        self, state: _Round, round: int, node: int, array: np.ndarray[Any, Any], now: float
    ) -> None:
        """A node's contribution: the root's (granted to it) or a group's member's."""
        if state.root == self.node:
            if state.granted.get(node) != self.node or node in state.covered:
                raise RemoteProtocolError(f"a part of round {round} from node {node}")
            state.covered.add(node)
            self._add(state, array)
            self._finish(state, now)
            return
        number = next((g for g, grp in state.gathers.items() if node in grp.members), None)
        if number is None:
            if node in state.early:
                raise RemoteProtocolError(f"node {node} sent its part of round {round} twice")
            state.early[node] = array if node != self.node else array.copy()
            return
        group = state.gathers[number]
        if node in group.got:
            raise RemoteProtocolError(f"node {node} sent its part of round {round} twice")
        group.got.add(node)
        if group.total is None:
            group.total = np.array(array, copy=True)
        else:
            REDUCE[self.spec.op](group.total, array, out=group.total)
        if group.got == group.members:
            self._send(state.root, SUM + number, group.total, round)

    def _sum(
        self, state: _Round, node: int, number: int, array: np.ndarray[Any, Any], now: float
    ) -> None:
        group = state.planned.get(number)
        if state.root != self.node or group is None or group.aggregator != node:
            raise RemoteProtocolError(f"a sum of group {number} from node {node}")
        del state.planned[number]
        if group.members & state.covered:
            raise RemoteProtocolError(f"group {number} from node {node} counts a node twice")
        state.covered |= group.members
        self._add(state, array)
        self._finish(state, now)

    # -- timers and faults -------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must run: a batch due at the root, or a departed rank's."""
        due = [d for s in self._rounds.values() if (d := s.due) is not None]
        other = super().next_deadline()
        if other is not None:
            due.append(other)
        return min(due, default=None)

    def on_timer(self, now: float) -> list[Action]:
        """Plan the batches that are due, then what :class:`Collective` times."""
        if self.broken is None:
            for round, state in sorted(self._rounds.items()):
                if state.due is not None and now >= state.due:
                    self._plan(state, round, now)
        return super().on_timer(now)  # (its answer carries what the plans sent)

    def interrupted(self, node: int, reason: str) -> list[Action]:
        """A member's links were reset: messages of a round under way may be lost, and a
        round cannot be run again (its parts are in sums), so a round under way, or a call
        waiting, breaks the collective; between rounds it waits (as every sync one does)."""
        busy = (
            bool(self._calls)
            or self._activated is not None  # (its calls may have been abandoned, data kept)
            or any(
                s.batch
                or s.granted
                or s.gathers
                or s.early
                or s.inbound
                or s.grant is not None
                or s.total is not None
                for s in self._rounds.values()
            )
        )
        if node in self.members and self.broken is None and busy:
            self._out += self.lose(node, reason, 0.0)
        return self._flush()

    def _break(self, code: str, message: str, node: int | None = None) -> None:
        super()._break(code, message, node)
        self._rounds.clear()

    # -- what status shows -------------------------------------------------------------------
    def waits(self) -> tuple[str, str, int | None]:
        """What the current round waits for (a stall report's words)."""
        round = self.round
        if self.broken is not None:
            return "broken", self.broken[1], None
        if self._activated != round:
            missing = sorted(self.local - self._given)
            return "ranks", f"round {round} starts once local ranks {missing} call it", None
        state = self._state(round)
        if state.root == self.node:
            missing = sorted(set(self.members_now) - state.covered)
            return "messages", f"round {round} (root here) waits for nodes {missing}", missing[0]
        if state.grant is None:
            return "messages", f"round {round} waits for its root, node {state.root}", state.root
        return (
            "messages",
            f"round {round} sent its part to node {state.grant}; it waits for the result "
            f"from its root, node {state.root}",
            state.root,
        )

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        """Every array the collective holds now (what the byte budget bounds)."""
        held: list[np.ndarray[Any, Any]] = [self.data, self.result]
        for state in self._rounds.values():
            held += [i.array for i in state.inbound.values()]
            held += list(state.early.values())
            held += [g.total for g in state.gathers.values() if g.total is not None]
            if state.total is not None:
                held.append(state.total)
        return tuple(held)
