"""Membership: which node hosts which rank of which job, and the news when that changes.

Rules: this module keeps the fabric-wide rank table as this daemon knows it, says what to
ANNOUNCE and to whom, reports every change as a :class:`RankJoined` or :class:`RankLeft`
event, and decides what became of the ranks of a node whose links were reset (the
:data:`Suspicion` events).  What a change means for messages is not its business: the service
hands the events to every engine that cares (the point-to-point engine fails what waited for a
rank that left).

Theory of operation: a client that connects to its daemon claims ``(job, rank)`` for the job's
``size`` (:meth:`Membership.attach`); the daemon records the claim and broadcasts an ANNOUNCE,
and tells a peer that comes up about every local rank (:meth:`Membership.peer_up`).  A client
that leaves takes its rank with it (:meth:`Membership.detach`, an ANNOUNCE with ``present``
false: the rank left cleanly); a node that goes down or restarts takes all its ranks
(:meth:`Membership.peer_down`: they are *lost*, and whatever was on its way to them with it).
All ranks of a job must agree on its size, and a rank is hosted by exactly one client; a second
claim is refused with a message that says where the first one lives.  Between daemons the first
claim wins: a conflicting announcement is ignored with a :class:`Notice` for the operator, but
kept while its node stands by it, and it takes effect once the claim that won is released (the
rank leaves, its node goes down, or the job it disagreed with on size is gone).  A rank that
restarts on another node sends its departure and its arrival on different links, so a third
daemon may hear the arrival first; without this it would never see the rank again.

Jobs have owners (:mod:`fabricd.engines.ownership`): the uid of the client that opened the job
first on the fabric.  A local client of another uid may join only through a ``job_groups``
grant, else :meth:`Membership.attach` raises :class:`~fabricd.errors.PermissionDenied` (and
counts it).  Every ANNOUNCE carries the owner, and a peer's claim for a job this daemon knows
under another owner is a conflict like a size that disagrees: ignored with a notice, retried
once the job is gone.  A job is released, its name free for any user again, when its last
rank known to this daemon is gone: the last local rank left and no peer announced one, or the
nodes that hosted the rest went down.

A peer holds at most ``max_ranks_per_peer`` claims in the table, known and ignored together (and
so at most that many jobs): an ANNOUNCE of a new rank beyond it raises
:class:`~fabricd.errors.RemoteProtocolError`, so the daemon closes the link and resets the
peer, whose ranks are then forgotten.  A daemon hosts one rank per client, so a peer within its
``max_clients`` never reaches a bound at least that large.

Suspicion.  A reset of a node's links loses what was in flight, but not necessarily the node:
a link that flaps under load comes back, the same daemon, within ``down_after``.  So the ranks
of a reset node leave the table at once (:class:`RankLeft`, ``lost``: nothing can be routed to
them, what was on its way is lost) and are *suspected* (:class:`RankSuspected`) until the
verdict: :class:`RankBack` when the rank is announced again from the same node by the same
daemon (the incarnation the peers engine admitted, which the service passes in), or
:class:`RankGone` when ``down_after`` passes first, or the rank comes back from a new
incarnation or another node.  The node itself gets a verdict too, when its links come back
(:meth:`Membership.peer_up`): :class:`NodeBack` from the same daemon within ``down_after``,
else :class:`NodeGone` (also when ``down_after`` passes with its links still down); a node
back as a new daemon takes its suspected ranks with it at once.  Services
that run over a job's nodes (collectives) act on the node's verdict, those that run over its
ranks on the rank's: a rank's verdict comes with its announcement, after the node's links are
up, and a rank that never comes back (its trainer left during the reset) is gone at its
deadline although its node came back.  A node's suspicion starts with its first reset and is
not prolonged by another before its links come back.  When a rank's suspicion runs out and its
job has no known rank left, the job is over here: the job's other suspicions end with it
(:class:`RankGone` each), so that a later job of that name never loses ranks it does not have;
so do they when a claim brings the job back into the table before then (a local client, an
announcement, a claim retried), unless the claim is one of its suspected ranks back: every
service sees the old job end before the new one's :class:`RankJoined`.
Deadlines live in one :class:`~fabricd.engines.deadlines.Deadlines` heap
(:meth:`Membership.next_deadline`, :meth:`Membership.on_timer`).

Every lookup, claim and release is O(1) while no claim is ignored, and O(ignored claims of the
job) otherwise; :meth:`Membership.peer_down` is O(ranks of that node + ignored claims), and a
claim or deadline that ends a job's suspicions O(suspected ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

from fabricd.engines.actions import Broadcast, Notice, SendFrame
from fabricd.engines.counts import count_down
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.ownership import Ownership, User
from fabricd.errors import PermissionDenied, RemoteProtocolError, UsageError
from fabricd.frames.membership import Announce

RankKey = tuple[str, int]  #: (job, rank)
#: claims (known and ignored) one peer may hold in the table
MAX_RANKS_PER_PEER: Final = 4096
#: seconds a reset node may take to come back the same daemon (the config's default)
DOWN_AFTER: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEntry:
    """Where one rank lives."""

    job: str
    rank: int
    size: int
    node: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankJoined:
    """``entry``'s rank is now reachable on ``entry.node``."""

    entry: RankEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLeft:
    """``entry``'s rank is gone.

    ``reason`` is a sentence that names the rank (or its node) and says why; it is the message
    of every operation the departure fails.  ``lost``: its node went down or restarted, so
    messages already on their way to it are lost too; false: the rank left cleanly, and its
    daemon answers what was sent to it.
    """

    entry: RankEntry
    reason: str
    lost: bool


#: what other engines hear from membership of the rank table (through the service)
RankEvent = RankJoined | RankLeft


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSuspected:
    """``entry``'s node's links were reset (``reason`` names the node and says how): the
    :class:`RankLeft` just before this took the rank out of the table, but the same daemon may
    bring it back within ``down_after``; :class:`RankBack` or :class:`RankGone` follows."""

    entry: RankEntry
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RankBack:
    """A suspected rank was announced again by the same daemon on the same node (``entry``):
    only what was in flight at the reset was lost; send it again.  Comes just before the
    :class:`RankJoined` that puts it back in the table."""

    entry: RankEntry


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGone:
    """A suspected rank (``entry``, where it was) is gone for good: ``down_after`` passed, its
    job ended here, or it came back from a new incarnation or another node (``reason`` says
    which).  In the last case it comes just before the :class:`RankJoined` of the new rank."""

    entry: RankEntry
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeBack:
    """``node``'s links are up again, the same daemon, within ``down_after`` of their reset."""

    node: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGone:
    """``node`` is gone for good: its links were reset (``reason``) and did not come back
    within ``down_after``, or came back from a new incarnation (``reason`` ends "it
    restarted")."""

    node: int
    reason: str


#: what other engines hear from membership about ranks and nodes whose links were reset
Suspicion = RankSuspected | RankBack | RankGone | NodeBack | NodeGone


class Routes(Protocol):
    """What an engine that only reads the rank table needs of it (:class:`Membership` has it)."""

    def lookup(self, job: str, rank: int, /) -> RankEntry | None: ...


Action = SendFrame | Broadcast | Notice | RankJoined | RankLeft | Suspicion


@dataclass(frozen=True, slots=True, kw_only=True)
class _Suspect:
    """A rank lost with its node's links: where it was, and who it was."""

    entry: RankEntry
    incarnation: int | None  #: its daemon's, when its links were reset
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipStatistics:
    """What ``fabricctl status`` shows of the rank table."""

    ranks: int  #: ranks known fabric-wide
    local_ranks: int  #: ranks whose client is connected to this daemon
    jobs: int  #: jobs with at least one known rank
    refused_joins: int  #: local claims refused because the job belongs to another user
    refused_announcements: int  #: peers' claims past max_ranks_per_peer (each reset the peer)


class Membership:
    """The fabric-wide view of (job, rank) -> node, as daemon ``node`` knows it.

    ``down_after``: seconds a node whose links were reset may take to come back, the same
    daemon, before it and its ranks are gone for good.
    """

    def __init__(
        self,
        node: int,
        ownership: Ownership | None = None,
        *,
        max_ranks_per_peer: int = MAX_RANKS_PER_PEER,
        down_after: float = DOWN_AFTER,
    ) -> None:
        if max_ranks_per_peer < 1:
            raise ValueError("max_ranks_per_peer must be at least 1")
        if not down_after > 0:
            raise ValueError("down_after must be more than 0 seconds")
        self.node = node
        self.ownership = ownership or Ownership()
        self.max_ranks_per_peer = max_ranks_per_peer
        self.down_after = down_after
        #: nodes whose links were reset and are not back: (incarnation then, why)
        self._reset: dict[int, tuple[int | None, str]] = {}
        self._suspects: dict[RankKey, _Suspect] = {}
        self._suspects_per_job: dict[str, int] = {}
        #: a node (its verdict) or a suspected rank is due then
        self._deadlines: Deadlines[int | RankKey] = Deadlines()
        #: the incarnation each peer last announced from, for claims retried later
        self._incarnations: dict[int, int | None] = {}
        self._entries: dict[RankKey, RankEntry] = {}
        self._by_node: dict[int, dict[RankKey, RankEntry]] = {}
        self._sizes: dict[str, int] = {}  #: job -> its size, while it has a known rank
        self._owners: dict[str, int] = {}  #: job -> its owner's uid, while it has a known rank
        self._counts: dict[str, int] = {}  #: job -> how many of its ranks are known
        #: claims peers made that conflicted with the table, by (job, rank) then node, oldest
        #: first, with the owner each named: each is retried when what it conflicted with is
        #: released
        self._ignored: dict[RankKey, dict[int, tuple[RankEntry, int]]] = {}
        self._ignored_by_node: dict[int, int] = {}  #: how many ignored claims each node holds
        self._refused_joins = 0
        self._refused_announcements = 0

    # -- local clients ----------------------------------------------------------------------
    def attach(self, job: str, rank: int, size: int, *, user: User) -> list[Action]:
        """A local client of ``user`` claims ``rank`` of ``job`` (of ``size`` ranks).

        A job nobody holds becomes ``user``'s; a job another uid owns takes ``user`` only if
        :meth:`Ownership.may_join` says so, checked before anything else, so a refused user
        learns nothing of the job's ranks or size.

        Returns: the ANNOUNCE for every peer and the :class:`RankJoined` event.

        Raises:
            PermissionDenied: the job belongs to another uid and no grant lets ``user`` in.
            UsageError: the rank is outside the job, hosted elsewhere or already connected here,
                or the size disagrees with the job's; refuse the client with the message.
        """
        owner = self._owners.get(job, user.uid)
        if not self.ownership.may_join(user, job, owner):
            self._refused_joins += 1
            raise PermissionDenied(self.ownership.refusal(user, job, owner))
        new_job = job not in self._sizes
        entry = self._claim(job, rank, size, self.node, owner)
        joined = self._joined(entry, new_job=new_job)
        return [Broadcast(frame=_announce(entry, owner, present=True)), *joined]

    def detach(self, job: str, rank: int, reason: str) -> list[Action]:
        """The local client of ``rank`` of ``job`` left.

        ``reason`` is the :attr:`RankLeft.reason`: a sentence that names the rank and says why
        it left, such as ``"rank 3 of job 'x' disconnected"``.

        Returns: the ANNOUNCE (``present`` false) and :class:`RankLeft` (not lost), or nothing
        when this daemon does not host the rank.
        """
        owner = self._owners.get(job, -1)
        entry = self._release(job, rank, self.node)
        if entry is None:
            return []
        return [
            Broadcast(frame=_announce(entry, owner, present=False)),
            RankLeft(entry=entry, reason=reason, lost=False),
            *self._retry(entry),
        ]

    # -- peers ------------------------------------------------------------------------------
    def on_announce(
        self, node: int, frame: Announce, incarnation: int | None = None
    ) -> list[Action]:
        """Peer ``node`` (of ``incarnation``, the one its links were admitted with) announced
        that one of its ranks arrived or left.

        Returns: :class:`RankJoined` or :class:`RankLeft` when the table changed (a suspected
        rank's verdict before its :class:`RankJoined`), nothing for a repeated announcement, a
        :class:`Notice` for a claim that conflicts with the table (its size or its owner
        disagrees with the job's, or the rank is hosted elsewhere; it is kept, and takes effect
        once what it conflicts with is released).
        """
        self._incarnations[node] = incarnation
        key = (frame.job, frame.rank)
        self._unignore(key, node)
        if not frame.present:
            entry = self._release(frame.job, frame.rank, node)
            if entry is None:
                return []
            text = f"rank {frame.rank} of job {frame.job!r} on node {node} disconnected"
            return [RankLeft(entry=entry, reason=text, lost=False), *self._retry(entry)]
        claim = RankEntry(job=frame.job, rank=frame.rank, size=frame.size, node=node)
        if self._entries.get(key) == claim and self._owners.get(frame.job) == frame.owner:
            return []
        self._check_room(node, key)
        new_job = frame.job not in self._sizes
        try:
            entry = self._claim(frame.job, frame.rank, frame.size, node, frame.owner)
        except UsageError as exc:
            if 0 <= frame.rank < frame.size:  # it may hold once the table changes
                self._ignored.setdefault(key, {})[node] = (claim, frame.owner)
                self._ignored_by_node[node] = self._ignored_by_node.get(node, 0) + 1
            return [Notice(message=f"ignored announcement from node {node}: {exc}")]
        return self._joined(entry, incarnation, new_job=new_job)

    def peer_up(self, node: int, incarnation: int | None = None) -> list[Action]:
        """``node``'s links are up (admitted for ``incarnation``): it must hear about every
        local rank, and if its links were reset, it is back (:class:`NodeBack`, the same
        daemon) or gone (:class:`NodeGone`, a new one)."""
        actions: list[Action] = [
            SendFrame(node=node, frame=_announce(e, self._owners[e.job], present=True))
            for e in self.local()
        ]
        reset = self._reset.pop(node, None)
        if reset is not None:
            self._deadlines.cancel(node)
            known, reason = reset
            if incarnation != known:  # a new daemon: the old one died, with its ranks
                actions.append(NodeGone(node=node, reason=f"{reason}; it restarted"))
                ranks = [key for key, s in self._suspects.items() if s.entry.node == node]
                for suspect in map(self._end, ranks):
                    why = f"{suspect.reason}; it restarted"
                    actions.append(RankGone(entry=suspect.entry, reason=why))
            else:
                actions.append(NodeBack(node=node))
        return actions

    def peer_down(
        self, node: int, reason: str, now: float, incarnation: int | None = None
    ) -> list[Action]:
        """``node``'s links were reset (``reason`` says why; ``incarnation``: its daemon's, as
        admitted): its ranks are lost, and suspected until ``down_after`` from ``now``."""
        if node not in self._reset:  # a flapping link does not prolong the first reset's time
            self._reset[node] = (incarnation, reason)
            self._deadlines.set(node, now + self.down_after)
        gone = sorted(self._by_node.pop(node, {}).values(), key=_order)
        for entry in gone:
            self._forget(entry)
        for key in [key for key, claims in self._ignored.items() if node in claims]:
            self._unignore(key, node)
        text = f"node {node} is {reason}"
        for entry in gone:  # all of them suspected before anyone hears of the first
            self._suspect(entry, incarnation, text, now)
        actions: list[Action] = []
        for entry in gone:
            actions += [
                RankLeft(entry=entry, reason=text, lost=True),
                RankSuspected(entry=entry, reason=text),
            ]
        for entry in gone:
            actions += self._retry(entry)
        return actions

    # -- suspicion --------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run: a reset node's or a suspected rank's time."""
        return self._deadlines.next()

    def on_timer(self, now: float) -> list[Action]:
        """Nodes and ranks not back within ``down_after`` of their reset are gone."""
        actions: list[Action] = []
        for key in self._deadlines.pop_due(now):
            if isinstance(key, int):
                _, reason = self._reset.pop(key)
                actions.append(NodeGone(node=key, reason=reason))
            elif key in self._suspects:  # (not ended with its job earlier in this loop)
                suspect = self._end(key)
                actions.append(RankGone(entry=suspect.entry, reason=suspect.reason))
                if key[0] not in self._sizes:  # no rank of its job is known: the job is over
                    actions += self._end_job(key[0])
        return actions

    def suspected(self, job: str, rank: int) -> bool:
        """Whether ``rank`` of ``job`` was lost with its node's links and may come back."""
        return (job, rank) in self._suspects

    def suspected_on(self, job: str, rank: int) -> int | None:
        """The node ``rank`` of ``job`` was on when it was lost with that node's links, while
        it is suspected: its frames sent again after the reset may overtake its announcement."""
        suspect = self._suspects.get((job, rank))
        return None if suspect is None else suspect.entry.node

    def has_suspects(self, job: str) -> bool:
        """Whether any rank of ``job`` is suspected."""
        return job in self._suspects_per_job

    def _suspect(self, entry: RankEntry, incarnation: int | None, reason: str, now: float) -> None:
        key = (entry.job, entry.rank)
        self._suspects[key] = _Suspect(entry=entry, incarnation=incarnation, reason=reason)
        self._suspects_per_job[entry.job] = self._suspects_per_job.get(entry.job, 0) + 1
        self._deadlines.set(key, now + self.down_after)

    def _end(self, key: RankKey) -> _Suspect:
        """The suspicion of ``key`` ends (the caller says how)."""
        suspect = self._suspects.pop(key)
        self._deadlines.cancel(key)
        count_down(self._suspects_per_job, key[0])
        return suspect

    def _end_job(self, job: str, why: str = "") -> list[Action]:
        """``job`` is over here: its ranks' suspicions end (``why`` is added to their reason)."""
        if job not in self._suspects_per_job:
            return []
        keys = [key for key in self._suspects if key[0] == job]
        return [RankGone(entry=s.entry, reason=s.reason + why) for s in map(self._end, keys)]

    def _joined(
        self, entry: RankEntry, incarnation: int | None = None, *, new_job: bool = False
    ) -> list[Action]:
        """``entry`` is in the table: :class:`RankJoined`, after its verdict if it was
        suspected (back only from the same node and daemon; a rank claimed here, or from a
        new incarnation, is a new one).

        ``new_job``: the claim brought its job back into the table (no rank of it was known).
        Unless it is a suspected rank back, the job that had the name is over here: its
        lingering suspicions end first (:class:`RankGone` each), so that every service sees
        the old job end before the new one starts, and the new job never loses ranks it does
        not have when their deadlines come.
        """
        key = (entry.job, entry.rank)
        suspect = self._suspects.get(key)
        back = (
            suspect is not None
            and entry.node == suspect.entry.node
            and incarnation == suspect.incarnation
        )
        actions: list[Action] = []
        if suspect is not None:
            self._end(key)
            why = f"{suspect.reason}; it came back restarted"
            actions.append(
                RankBack(entry=entry) if back else RankGone(entry=suspect.entry, reason=why)
            )
        if new_job and not back:
            actions += self._end_job(entry.job, f"; job {entry.job!r} ended here and began again")
        actions.append(RankJoined(entry=entry))
        return actions

    # -- queries ----------------------------------------------------------------------------
    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self._entries.get((job, rank))

    def job_size(self, job: str) -> int | None:
        """The size every rank of ``job`` agreed on, while any of them is known."""
        return self._sizes.get(job)

    def owner(self, job: str) -> int | None:
        """The uid that owns ``job``, while any of its ranks is known."""
        return self._owners.get(job)

    def known(self, job: str) -> int:
        """How many ranks of ``job`` are known (all of them once this is its size): O(1), so
        a rank's arrival can say whether its job is whole without looking at every rank."""
        return self._counts.get(job, 0)

    def local(self) -> list[RankEntry]:
        """The ranks this node hosts, by job then rank."""
        return sorted(self._by_node.get(self.node, {}).values(), key=_order)

    def entries(self) -> list[RankEntry]:
        """Every known rank, by job then rank."""
        return sorted(self._entries.values(), key=_order)

    def statistics(self) -> MembershipStatistics:
        return MembershipStatistics(
            ranks=len(self._entries),
            local_ranks=len(self._by_node.get(self.node, {})),
            jobs=len(self._sizes),
            refused_joins=self._refused_joins,
            refused_announcements=self._refused_announcements,
        )

    # -- the table --------------------------------------------------------------------------
    def _claim(self, job: str, rank: int, size: int, node: int, owner: int) -> RankEntry:
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} is outside job {job!r} of size {size}")
        known = self._sizes.get(job)
        if known is not None and known != size:
            raise UsageError(
                f"job {job!r} has size {known} on this fabric, not {size}; "
                "start every rank with the same WORLD_SIZE"
            )
        known_owner = self._owners.get(job)
        if known_owner is not None and known_owner != owner:
            raise UsageError(
                f"job {job!r} belongs to uid {known_owner} on this fabric, not uid {owner}; "
                "two users opened it at once on different nodes: one of them must rename it"
            )
        current = self._entries.get((job, rank))
        if current is not None and current.node != node:
            raise UsageError(
                f"rank {rank} of job {job!r} is already running on node {current.node}"
            )
        if current is not None and node == self.node:
            raise UsageError(f"rank {rank} of job {job!r} is already connected to this daemon")
        entry = RankEntry(job=job, rank=rank, size=size, node=node)
        if current is None:
            self._sizes[job] = size
            self._owners[job] = owner
            self._counts[job] = self._counts.get(job, 0) + 1
        self._entries[job, rank] = entry
        self._by_node.setdefault(node, {})[job, rank] = entry
        return entry

    def _release(self, job: str, rank: int, node: int) -> RankEntry | None:
        """Forget ``rank`` of ``job`` if ``node`` hosts it; return what was removed."""
        entry = self._entries.get((job, rank))
        if entry is None or entry.node != node:
            return None
        hosted = self._by_node[node]
        del hosted[job, rank]
        if not hosted:
            del self._by_node[node]
        self._forget(entry)
        return entry

    def _retry(self, released: RankEntry) -> list[Action]:
        """``released`` left the table: the ignored claims it stood in the way of may hold now.

        Those for its rank, and, once its job has no known rank left (so any size may start
        it again), every ignored claim of the job; the oldest claim of a rank wins.
        """
        if not self._ignored:
            return []
        job = released.job
        if job in self._sizes:
            keys = [(job, released.rank)]
        else:
            keys = [key for key in self._ignored if key[0] == job]
        joined: list[Action] = []
        for key in keys:
            for node, (claim, owner) in list(self._ignored.get(key, {}).items()):
                new_job = claim.job not in self._sizes
                try:
                    entry = self._claim(claim.job, claim.rank, claim.size, node, owner)
                except UsageError:
                    continue
                self._unignore(key, node)
                joined += self._joined(entry, self._incarnations.get(node), new_job=new_job)
        return joined

    def _unignore(self, key: RankKey, node: int) -> None:
        claims = self._ignored.get(key)
        if claims is not None:
            if claims.pop(node, None) is not None:
                count_down(self._ignored_by_node, node)
            if not claims:
                del self._ignored[key]

    def _check_room(self, node: int, key: RankKey) -> None:
        """Raise RemoteProtocolError if ``node`` claiming ``key`` passes max_ranks_per_peer.

        Called after ``key``'s ignored claim by ``node`` (if any) was dropped, so a claim that
        replaces one the node already holds is not new.
        """
        held = len(self._by_node.get(node, ())) + self._ignored_by_node.get(node, 0)
        if held < self.max_ranks_per_peer or key in self._by_node.get(node, ()):
            return
        self._refused_announcements += 1
        raise RemoteProtocolError(
            f"node {node} announced more than max_ranks_per_peer ({self.max_ranks_per_peer}) "
            f"ranks; its link is reset (raise max_ranks_per_peer on node {self.node} if its "
            "clients really hold that many)"
        )

    def _forget(self, entry: RankEntry) -> None:
        """Drop ``entry`` from the table and its job's count (not from ``_by_node``)."""
        del self._entries[entry.job, entry.rank]
        self._counts[entry.job] -= 1
        if not self._counts[entry.job]:
            del self._counts[entry.job], self._sizes[entry.job], self._owners[entry.job]


def _order(entry: RankEntry) -> RankKey:
    return (entry.job, entry.rank)


def _announce(entry: RankEntry, owner: int, *, present: bool) -> Announce:
    return Announce(job=entry.job, rank=entry.rank, size=entry.size, present=present, owner=owner)
