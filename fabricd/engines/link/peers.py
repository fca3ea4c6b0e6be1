"""Peer links and liveness: dialling, handshake limits, link admission, heartbeats, fencing.

Rules: this module makes every decision about the links to other daemons — which node to dial
and when to dial it again, which authenticated link to admit, refuse or reset, when a peer is
up, suspect or down, and when to send a heartbeat — and is the daemon's one entry point for
them, the handshake limits of :mod:`fabricd.engines.link.gate` included.  It never touches a link
and never reads a clock: the daemon reports what happened (with ``now``) and performs the
returned actions in order.

Theory of operation.  Each pair of nodes shares two links, control and data (ASAP §5).  The
node with the lower id dials both, control first, so the peer knows the dialler's incarnation
before a data link of it arrives, and a pair never races to open duplicate connections.

*Handshakes.*  A new link is unauthenticated until the handshake engine
(:mod:`fabricd.engines.link.handshake`) accepts it;
:class:`~fabricd.engines.link.gate.HandshakeGate`
caps how many accepted links may wait for that and closes any that takes longer than
``handshake_timeout``; only the hosts of configured nodes that dial this one get its slots.

*Admission.*  An authenticated link carries the peer's incarnation (a number that grows with
each daemon start).  It is compared with the newest incarnation seen from that node: SAME,
NEWER (the peer restarted, or it is the first one seen: FIRST), or STALE (older, while the peer
is not down: a dead process's link).  Once the peer is DOWN any other incarnation is its new
life, so a clock that stepped back across a restart cannot lock a node out for good (under
membership from etcd, "Names" below: a name or registered incarnation the view does not have
is refused first, and a link of another name than the last admitted, or of the registered
incarnation, is NEWER, never ordered by clock).  Links are ruled on as follows (*links* are
those admitted now; a data link is only ever up beside a control link of the same
incarnation)::

    channel  incarnation  links          ruling: actions, in order
    any      STALE        any            RefuseLink
    control  FIRST        none           AdmitLink, StateChanged
    control  SAME         none           AdmitLink, StateChanged
    control  SAME         control[+data] ResetPeer("reconnected"), AdmitLink, …
    control  NEWER        any            ResetPeer("restarted"), AdmitLink, PeerRestarted, …
    data     any          none           RefuseLink (data channel before the control channel)
    data     NEWER        control[+data] RefuseLink (another incarnation than the control link)
    data     SAME         control        AdmitLink, PeerUp (and the dial of the node succeeded)
    data     SAME         control+data   RefuseLink, ResetPeer("reconnected (second data link)")

A peer is greeted (:class:`PeerUp`) once both links are admitted, not with its control link: a
greeting starts rendezvous (membership ANNOUNCEs ranks, a waiting send is matched), and the
bytes they move go on the data link.

*Resets.*  TCP cannot say which frames the peer processed before a link broke, so losing
either link, replacing one, a dial that failed after its control link was admitted, or the
peer going down resets the peer (architecture.md, "Reset rule"): :class:`ResetPeer` tells the
daemon to close both links and fail everything exchanged with the node, and the table marks
both channels down at once.

*Liveness.*  Every authenticated frame counts as a heartbeat; an explicit HEARTBEAT goes out
every ``heartbeat_interval`` while the control link is up.  A peer is *suspect* after
``suspect_after`` seconds of silence or as soon as a reset takes its control link, and *down*
after ``down_after`` seconds of silence (the failure-detection bound D)::

    CONNECTING --established--> UP        UP/SUSPECT --heard--> UP
    UP --link_lost/silent--> SUSPECT      UP/SUSPECT --silent for down_after--> DOWN
    SUSPECT/DOWN --established--> UP      (DOWN also resets the peer)

*Dialling.*  Each node this one dials has a dialler; a :class:`Dial` asks the daemon to open
the control link and then the data link, and the dial is under way until the daemon reports it
failed or its data link is admitted — never two at once.  Failed dials back off from
:data:`FIRST_BACKOFF`, doubling up to ``max_backoff``; a dial that succeeded resets the backoff,
and a peer reset while connected is redialled :data:`FIRST_BACKOFF` later::

    STOPPED --start--> DIALLING --failed--> WAITING (next Dial at now + backoff; backoff x 2)
    WAITING --due--> DIALLING --data admitted--> CONNECTED (backoff back to FIRST_BACKOFF)
    WAITING --data admitted--> CONNECTED       CONNECTED --reset--> WAITING (now + FIRST_BACKOFF)

A node with no address (a free slot under membership from etcd, :mod:`fabricd.engines.roster`)
is *absent*: any move of its dialler but to CONNECTED lands in STOPPED instead, and
:meth:`PeerTable.set_present` starts it (or brings a waiting dial forward) once it has one.

*Names* (membership from etcd, ``named``).  A node id is then a slot that names hold in turn,
and every HELLO carries the sender's name.  :meth:`PeerTable.set_holder` tells the table
which name this node's view of etcd has in each slot, and the incarnation its registration
carries.  Before the admission table, a link is refused unless its name is the slot's holder
in the view and, when the registration carries one, its incarnation is the registered one.
The refusal fences nothing: a view that is stale (cut off from etcd, a watch behind) refuses
the new holder for now, the dialler retries, and once the view has it the same HELLO is
admitted (a waiting dial of that node is brought forward; the daemon asks
:meth:`PeerTable.on_hello` of every HELLO before answering it, the acceptor of the dialler's
and the dialler of the acceptor's, so a dialler refused sees a failed dial and backs off, and
an acceptor refused never admits a link the dialler then closes, nor resets its peer for it;
counted as refused links); the old holder's late links stay refused, as its
name or incarnation is no longer the view's.  Incarnations are compared by
equality with the registered one, never ordered, so clocks that disagree between nodes do
not matter; only a link of the name admitted last is ordered by start time (its SAME or
NEWER), and only when the registration carries no incarnation.  When the view gives the slot
to another name, or registers another incarnation of its name, the links admitted before
are reset and the peer is down: one id never means two nodes.  A slot that goes free keeps
its links (the liveness rules decide them).  Without ``named`` (a static list) names are not
looked at.

Anything not listed in a table keeps the state.  Timers live in a
:class:`~fabricd.engines.deadlines.Deadlines` heap (and the gate's own).  Silence is checked
lazily: a frame only stores ``now``, and the silence deadline, which may fire early, re-arms
itself from the last frame heard; so a frame costs O(1) and the timer wakes at most once per
``suspect_after`` per peer beyond its heartbeats.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from fabricd.engines.actions import Notice, SendFrame
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.link.gate import (
    SPARE_SLOTS,
    CloseHandshake,
    GateStatistics,
    HandshakeGate,
    RefuseHandshake,
    host_slots,
)
from fabricd.engines.link.handshake import Channel
from fabricd.frames.link import Heartbeat

if TYPE_CHECKING:
    from collections.abc import Mapping

#: the first wait after a failed dial, and the pause before redialling a peer that was reset
FIRST_BACKOFF: Final = 0.05

_HEARTBEAT: Final = Heartbeat()


class PeerState(enum.Enum):
    CONNECTING = "connecting"  #: never authenticated yet
    UP = "up"  #: heard from within suspect_after
    SUSPECT = "suspect"  #: silent for suspect_after, or its control link went down
    DOWN = "down"  #: silent for down_after: its operations have failed


class _Input(enum.Enum):
    ESTABLISHED = enum.auto()  #: a control link was admitted
    HEARD = enum.auto()  #: any frame arrived
    LINK_LOST = enum.auto()  #: a reset took the control link down
    SILENT = enum.auto()  #: nothing heard for suspect_after
    DEAD = enum.auto()  #: nothing heard for down_after


#: read on every frame heard: a module constant is cheaper than the enum attribute
_UP: Final = PeerState.UP

_TRANSITIONS: dict[tuple[PeerState, _Input], PeerState] = {
    (PeerState.CONNECTING, _Input.ESTABLISHED): PeerState.UP,
    (PeerState.UP, _Input.ESTABLISHED): PeerState.UP,
    (PeerState.SUSPECT, _Input.ESTABLISHED): PeerState.UP,
    (PeerState.DOWN, _Input.ESTABLISHED): PeerState.UP,
    (PeerState.UP, _Input.HEARD): PeerState.UP,
    (PeerState.SUSPECT, _Input.HEARD): PeerState.UP,
    (PeerState.UP, _Input.LINK_LOST): PeerState.SUSPECT,
    (PeerState.UP, _Input.SILENT): PeerState.SUSPECT,
    (PeerState.UP, _Input.DEAD): PeerState.DOWN,
    (PeerState.SUSPECT, _Input.DEAD): PeerState.DOWN,
}


class _Verdict(enum.Enum):
    """How a link's incarnation compares with the newest one seen from its node."""

    FIRST = enum.auto()  #: none seen yet
    SAME = enum.auto()
    NEWER = enum.auto()  #: the peer restarted (or came back as any other one after DOWN)
    STALE = enum.auto()  #: older, and the peer is not down: a dead process's link


class _Links(enum.Enum):
    """Which links of a peer are admitted (a data link never without its control link)."""

    NONE = enum.auto()
    CONTROL = enum.auto()
    BOTH = enum.auto()


class _Ruling(enum.Enum):
    """What to do with an authenticated link whose incarnation is not STALE."""

    ADMIT = enum.auto()
    RECONNECT = enum.auto()  #: reset the peer ("reconnected"), then admit
    RESTART = enum.auto()  #: reset the peer ("restarted"), then admit
    EARLY = enum.auto()  #: refuse: a data link before the control link
    OTHER = enum.auto()  #: refuse: a data link of another incarnation than the control link
    SECOND = enum.auto()  #: refuse, and reset the peer: what moved on the first one is unknown


_C, _D = Channel.CONTROL, Channel.DATA
_ADMISSION: dict[tuple[Channel, _Verdict, _Links], _Ruling] = {
    (_C, _Verdict.FIRST, _Links.NONE): _Ruling.ADMIT,
    (_C, _Verdict.SAME, _Links.NONE): _Ruling.ADMIT,
    (_C, _Verdict.SAME, _Links.CONTROL): _Ruling.RECONNECT,
    (_C, _Verdict.SAME, _Links.BOTH): _Ruling.RECONNECT,
    (_C, _Verdict.NEWER, _Links.NONE): _Ruling.RESTART,
    (_C, _Verdict.NEWER, _Links.CONTROL): _Ruling.RESTART,
    (_C, _Verdict.NEWER, _Links.BOTH): _Ruling.RESTART,
    (_D, _Verdict.FIRST, _Links.NONE): _Ruling.EARLY,
    (_D, _Verdict.SAME, _Links.NONE): _Ruling.EARLY,
    (_D, _Verdict.NEWER, _Links.NONE): _Ruling.EARLY,
    (_D, _Verdict.SAME, _Links.CONTROL): _Ruling.ADMIT,
    (_D, _Verdict.SAME, _Links.BOTH): _Ruling.SECOND,
    (_D, _Verdict.NEWER, _Links.CONTROL): _Ruling.OTHER,
    (_D, _Verdict.NEWER, _Links.BOTH): _Ruling.OTHER,
}


class _Dial(enum.Enum):
    STOPPED = enum.auto()  #: start() has not run yet, or the node is absent: no dial
    WAITING = enum.auto()  #: the next Dial is due at the node's DIAL deadline
    DIALLING = enum.auto()  #: a Dial is under way, until it fails or its data link is admitted
    CONNECTED = enum.auto()  #: the data link is admitted


class _DialInput(enum.Enum):
    START = enum.auto()  #: start() ran
    DUE = enum.auto()  #: the DIAL deadline passed
    FAILED = enum.auto()  #: the daemon reported the dial failed
    ADMITTED = enum.auto()  #: the node's data link was admitted
    RESET = enum.auto()  #: the peer was reset: its links are down


_DIAL_TRANSITIONS: dict[tuple[_Dial, _DialInput], _Dial] = {
    (_Dial.STOPPED, _DialInput.START): _Dial.DIALLING,
    (_Dial.WAITING, _DialInput.DUE): _Dial.DIALLING,
    (_Dial.DIALLING, _DialInput.FAILED): _Dial.WAITING,
    (_Dial.DIALLING, _DialInput.ADMITTED): _Dial.CONNECTED,
    (_Dial.WAITING, _DialInput.ADMITTED): _Dial.CONNECTED,
    (_Dial.CONNECTED, _DialInput.RESET): _Dial.WAITING,
}


class _Timer(enum.IntEnum):
    """What a deadline is for; on_timer handles due ones in this order."""

    SILENCE = 0  #: keyed by node: check how long the peer has been silent
    BEAT = 1  #: keyed by node: send a heartbeat
    DIAL = 2  #: keyed by node: dial it again


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Liveness settings, in seconds."""

    heartbeat_interval: float
    suspect_after: float
    down_after: float

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.suspect_after <= self.down_after:
            raise ValueError("need 0 < heartbeat_interval < suspect_after <= down_after")


# -- actions ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StateChanged:
    """The peer moved from ``old`` to ``new`` (log it: warning for SUSPECT and DOWN)."""

    node: int
    old: PeerState
    new: PeerState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRestarted:
    """The peer is a new incarnation; the :class:`ResetPeer` before it dropped the old one."""

    node: int
    old_incarnation: int
    new_incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerUp:
    """Both links of ``node`` are admitted: services may greet it (e.g. ANNOUNCE ranks)."""

    node: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmitLink:
    """Keep the link just authenticated as ``node``'s current link of ``channel``."""

    node: int
    channel: Channel


@dataclass(frozen=True, slots=True, kw_only=True)
class RefuseLink:
    """Close the link just authenticated (do not store it) and log ``reason``."""

    node: int
    channel: Channel
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetPeer:
    """Close both current links of ``node`` and tell every service it is gone.

    ``expected`` says the peer announced it was leaving (BYE): log it as news, not a warning.
    """

    node: int
    reason: str
    expected: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Dial:
    """Open ``node``'s control link, then its data link; report a failure of either."""

    node: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DialRetry:
    """Dialling ``node`` failed ``attempts`` times in a row; the next try is in ``retry_in``.

    Returned at the 1st, 10th and every 100th failure, so a dead peer does not flood the log.
    """

    node: int
    attempts: int
    error: str
    retry_in: float


Action = (
    SendFrame
    | StateChanged
    | PeerRestarted
    | PeerUp
    | AdmitLink
    | RefuseLink
    | ResetPeer
    | Dial
    | DialRetry
    | RefuseHandshake
    | CloseHandshake
    | Notice
)


# -- status -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """A peer as ``fabricctl peers`` shows it."""

    node: int
    state: PeerState
    incarnation: int | None
    silent_for: float | None
    state_for: float
    links: frozenset[Channel]  #: the channels whose link is admitted now


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerStatistics:
    """Counters for ``fabricctl status`` and the exporter."""

    links_up: int  #: admitted links now
    handshakes_pending: int  #: links in their handshake now, accepted or dialled
    handshakes_refused: int  #: refused on arrival, evicted, past the deadline, or failed
    gate: GateStatistics  #: the handshake gate's counters (hosts refused, links evicted)
    #: authenticated but refused: stale, early, or a second one; or, under ``named``, refused
    #: on its HELLO, before authentication, by :meth:`PeerTable.on_hello`
    links_refused: int
    resets: int  #: ResetPeer actions returned
    dial_attempts: dict[int, int]  #: per dialled node: failed dials since the last success


@dataclass(slots=True)
class _Peer:
    state: PeerState = PeerState.CONNECTING
    incarnation: int | None = None  #: the newest admitted
    last_heard: float = 0.0
    since: float = 0.0
    links: set[Channel] = field(default_factory=set)
    leaving: bool = False  #: it said BYE: its links closing is expected
    name: str = ""  #: the name the newest admitted incarnation sent
    #: named only: the name the view of etcd has in this slot ("": free), and the
    #: incarnation its registration carries (None: it carries none)
    holder: str = ""
    registered: int | None = None


@dataclass(slots=True)
class _Dialler:
    backoff: float
    state: _Dial = _Dial.STOPPED
    attempts: int = 0  #: failed dials since the last success


def _links(peer: _Peer) -> _Links:
    if Channel.DATA in peer.links:
        return _Links.BOTH
    return _Links.CONTROL if peer.links else _Links.NONE


class PeerTable:
    """Every other node of the fabric: its links, its liveness, and the dialling of it.

    Args:
        node, nodes: this node's id and the fabric size; every other id is a peer.
        timeouts: liveness settings.
        now: the current time (peers are CONNECTING since then).
        handshake_timeout: seconds a link may stay unauthenticated.
        max_backoff: the longest wait between two dials of one node.
        hosts: every node's addresses (the hosts its links may come from); only the hosts of
            nodes that dial this one may begin a handshake here (:mod:`fabricd.engines.link.gate`).
        spare_slots: handshake slots per such host beyond one per node on it.
        absent: nodes with no address yet (a free slot of membership from etcd): never
            dialled until :meth:`set_present` says they are there.
        named: membership from etcd: a link is admitted only from the name (and registered
            incarnation) :meth:`set_holder` gave its slot (module docstring, "Names").
    """

    def __init__(
        self,
        *,
        node: int,
        nodes: int,
        timeouts: Timeouts,
        now: float,
        handshake_timeout: float = 2.0,
        max_backoff: float = 5.0,
        hosts: Mapping[int, frozenset[str]] | None = None,
        spare_slots: int = SPARE_SLOTS,
        absent: frozenset[int] = frozenset(),
        named: bool = False,
    ) -> None:
        if not max_backoff > 0:
            raise ValueError("max_backoff must be more than 0 seconds")
        self.node = node
        self.timeouts = timeouts
        self.max_backoff = max_backoff
        self._spare_slots = spare_slots
        self._gate = HandshakeGate(
            timeout=handshake_timeout, slots=host_slots(node, hosts or {}, spare_slots)
        )
        self._first_backoff = min(FIRST_BACKOFF, max_backoff)
        self._peers = {n: _Peer(since=now) for n in range(nodes) if n != node}
        self._diallers = {n: _Dialler(self._first_backoff) for n in range(node + 1, nodes)}
        self._deadlines: Deadlines[tuple[_Timer, int]] = Deadlines()
        self._links_refused = 0
        self._resets = 0
        self._absent = set(absent)
        self._named = named
        self._started = False

    # -- queries ------------------------------------------------------------------------------
    def state(self, node: int) -> PeerState:
        return self._peers[node].state

    def incarnation(self, node: int) -> int | None:
        """The newest incarnation admitted for ``node`` (None before its first link, or for a
        node that is no peer), in O(1): :meth:`peers` builds a row for every peer."""
        peer = self._peers.get(node)
        return None if peer is None else peer.incarnation

    def dial_targets(self) -> list[int]:
        """The nodes this node dials: every node with a higher id."""
        return sorted(self._diallers)

    def not_in_view(self, node: int, name: str, incarnation: int) -> str:
        """Why ``name``'s ``incarnation`` does not hold ``node`` in this node's view of etcd
        (``""``: it does, or the table is not ``named``).  Refused, not fenced: the view may be
        the one behind.  The peering service also asks it (:meth:`on_hello`) of every HELLO
        before answering it: refused only after AUTH, the dial would look like a success to
        the acceptor's dialler, which dials again at once, and an acceptor would admit a link
        the dialler then closes, and reset its peer for it."""
        if not self._named:
            return ""
        peer = self._peers[node]
        if not peer.holder or name != peer.holder:  # (a free slot: no name, "" included)
            held = f"held by {peer.holder!r}" if peer.holder else "free"
            return (
                f"{name!r} does not hold node id {node} in this node's view of etcd ({held}); "
                "refused until the view has it"
            )
        if peer.registered is not None and incarnation != peer.registered:
            return (
                f"incarnation {incarnation} of {name!r} is not the one registered in etcd "
                f"({peer.registered}); refused until the view has it"
            )
        return ""

    def on_hello(self, node: int, name: str, incarnation: int) -> str:
        """:meth:`not_in_view` of a link's HELLO, asked before the HELLO is answered (or, by
        the dialler, before it sends AUTH); a refusal is counted as a refused link, as one
        ruled after authentication is (``links_refused``), not as a failed handshake."""
        why = self.not_in_view(node, name, incarnation)
        if why:
            self._links_refused += 1
        return why

    def peers(self, now: float) -> list[PeerInfo]:
        return [
            PeerInfo(
                node=node,
                state=peer.state,
                incarnation=peer.incarnation,
                silent_for=None if peer.state is PeerState.CONNECTING else now - peer.last_heard,
                state_for=now - peer.since,
                links=frozenset(peer.links),
            )
            for node, peer in sorted(self._peers.items())
        ]

    def statistics(self) -> PeerStatistics:
        return PeerStatistics(
            links_up=sum(len(peer.links) for peer in self._peers.values()),
            handshakes_pending=self._gate.pending,
            handshakes_refused=self._gate.refused,
            gate=self._gate.statistics(),
            links_refused=self._links_refused,
            resets=self._resets,
            dial_attempts={node: d.attempts for node, d in sorted(self._diallers.items())},
        )

    # -- dialling -----------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        """Begin dialling: a :class:`Dial` for every dial target present, at once."""
        self._started = True
        return [a for node in self._diallers for a in self._dial(node, _DialInput.START, now)]

    def set_present(self, node: int, present: bool, now: float) -> list[Action]:
        """``node`` has an address now (``present``), or no longer has one.

        A node that arrives is dialled at once if this node dials it (a dial waiting for its
        backoff is brought forward); one that goes is dialled no more, but links it has up stay
        until the liveness rules take them (a node whose registration went may still be up).
        """
        if not present:
            self._absent.add(node)
            return []
        self._absent.discard(node)
        dialler = self._diallers.get(node)
        if dialler is None or not self._started:
            return []
        if dialler.state is _Dial.WAITING:
            self._bring_forward(node, now)
            return []
        return self._dial(node, _DialInput.START, now) if dialler.state is _Dial.STOPPED else []

    def set_holder(self, node: int, name: str, incarnation: int | None, now: float) -> list[Action]:
        """This node's view of etcd has ``name`` (``""``: nobody) in ``node``'s slot, its
        registration carrying ``incarnation`` (``None``: none); only that name (and that
        incarnation) is admitted from now on (module docstring, "Names").

        Links admitted from another name, or another incarnation than the registered one, are
        closed (a reset; the peer is down): one id never means two nodes.  A slot that goes
        free keeps its links.  A dial of ``node`` waiting for its backoff is brought forward:
        it may have been refused while the view lagged.
        """
        peer = self._peers[node]
        peer.holder, peer.registered = name, incarnation
        if not name:
            return []
        actions: list[Action] = []
        other = peer.name != name or incarnation not in (None, peer.incarnation)
        if peer.links and other:
            reason = (
                f"its id went to {name!r}"
                if peer.name != name
                else f"{name!r} registered again as incarnation {incarnation}"
            )
            actions = self._reset(node, reason, now) + self._move(node, _Input.DEAD, now, reason)
        dialler = self._diallers.get(node)
        if dialler is not None and dialler.state is _Dial.WAITING and node not in self._absent:
            self._bring_forward(node, now)
        return actions

    def on_dial_failed(self, node: int, error: str, now: float) -> list[Action]:
        """The dial of ``node`` under way failed (``error`` says why); it is retried later.

        A control link the dial already opened is useless without its data link, so a peer
        with a link still admitted is reset.  A failure reported when no dial is under way
        changes nothing.
        """
        if self._diallers[node].state is not _Dial.DIALLING:
            return []
        actions: list[Action] = []
        if self._peers[node].links:
            reason = f"dial failed: {error}"
            actions += self._reset(node, reason, now)
            actions += self._move(node, _Input.LINK_LOST, now, reason)
        return actions + self._dial(node, _DialInput.FAILED, now, error)

    # -- authenticated links ------------------------------------------------------------------
    def on_link_authenticated(
        self, node: int, channel: Channel, incarnation: int, now: float, name: str = ""
    ) -> list[Action]:
        """A link passed its handshake as ``node``'s ``channel`` of ``incarnation``, sent by
        the node called ``name``.

        Returns the ruling of the admission table (module docstring), in the order to perform
        it; the link is kept only if the actions contain an :class:`AdmitLink`.  Under
        ``named`` a name or incarnation the view does not have in that slot is refused first.
        """
        peer = self._peers[node]
        if why := self.not_in_view(node, name, incarnation):
            return [self._refuse(node, channel, why)]
        verdict = self._verdict(peer, incarnation, name)
        if verdict is _Verdict.STALE:
            return [self._refuse(node, channel, f"incarnation {incarnation} is dead")]
        match _ADMISSION[channel, verdict, _links(peer)]:
            case _Ruling.EARLY:
                reason = "data channel opened before the control channel"
                return [self._refuse(node, channel, reason)]
            case _Ruling.OTHER:
                reason = f"data link of incarnation {incarnation}, control of {peer.incarnation}"
                return [self._refuse(node, channel, reason)]
            case _Ruling.SECOND:
                reason = "reconnected (second data link)"
                refused = self._refuse(node, channel, "a data link to this node was already up")
                return [
                    refused,
                    *self._reset(node, reason, now),
                    *self._move(node, _Input.LINK_LOST, now, reason),
                ]
            case _Ruling.ADMIT if channel is Channel.DATA:
                peer.links.add(channel)
                admitted: list[Action] = [AdmitLink(node=node, channel=channel)]
                if node in self._diallers:
                    admitted += self._dial(node, _DialInput.ADMITTED, now)
                return [*admitted, PeerUp(node=node)]
            case ruling:
                return self._admit_control(node, incarnation, name, ruling, now)

    def on_link_closed(self, node: int, channel: Channel, now: float) -> list[Action]:
        """``node``'s current (admitted) link of ``channel`` closed: the peer is reset.

        Call it only for the current link: one closed after a :class:`ResetPeer` or a
        :class:`RefuseLink` is no news.  A channel that is not up changes nothing.
        """
        peer = self._peers[node]
        if channel not in peer.links:
            return []
        reason = f"unreachable ({channel} link lost)"
        return self._reset(node, reason, now) + self._move(node, _Input.LINK_LOST, now, reason)

    def on_heard(self, node: int, now: float) -> list[Action]:
        """Any authenticated frame from ``node`` arrived."""
        peer = self._peers[node]
        state = peer.state
        if state is _UP:  # the usual case, on every frame: (UP, HEARD) keeps the state, and
            peer.last_heard = now  # the silence deadline re-arms itself from this lazily
            return []
        if state is PeerState.CONNECTING or state is PeerState.DOWN:
            return []
        peer.last_heard = now
        return self._move(node, _Input.HEARD, now, "heard from it again")

    def on_bye(self, node: int) -> None:
        """``node`` said BYE: the reset when its links close is expected (until it is back)."""
        self._peers[node].leaving = True

    # -- unauthenticated links ----------------------------------------------------------------
    def on_handshake_started(
        self, link_id: int, host: str, now: float, *, accepted: bool = True
    ) -> list[Action]:
        """A link from (or to) ``host`` begins its handshake; ``link_id`` is the daemon's name
        for it until :meth:`on_handshake_over`.

        An ``accepted`` link from a host that is no configured node's is refused at once
        (:class:`RefuseHandshake`); one from a host whose slots are full evicts that host's
        oldest pending link (:class:`CloseHandshake`); any link in its handshake gets
        :class:`CloseHandshake` when ``handshake_timeout`` has passed.

        Raises:
            ValueError: ``link_id`` is already in its handshake (a daemon bug).
        """
        return [*self._gate.on_started(link_id, host, now, accepted=accepted)]

    def set_hosts(self, hosts: Mapping[int, frozenset[str]]) -> None:
        """Every node's addresses, anew (a name that did not resolve at start now does): the
        hosts of nodes that dial this one get their handshake slots from now on."""
        self._gate.set_slots(host_slots(self.node, hosts, self._spare_slots))

    def on_handshake_over(self, link_id: int, *, failed: bool = False) -> None:
        """``link_id`` authenticated, or ``failed`` (counted as refused); its slot is free.

        A link that is no longer in its handshake (closed at its deadline, refused) is ignored.
        """
        self._gate.on_over(link_id, failed=failed)

    # -- the timer ----------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run (it may find nothing to do: see the header)."""
        mine, gate = self._deadlines.next(), self._gate.next_deadline()
        if mine is None or gate is None:
            return gate if mine is None else mine
        return min(mine, gate)

    def on_timer(self, now: float) -> list[Action]:
        """Check silent peers, send heartbeats, redial, and close overdue handshakes."""
        actions: list[Action] = []
        for timer, key in sorted(self._deadlines.pop_due(now), key=lambda due: due[0]):
            match timer:
                case _Timer.SILENCE:
                    actions += self._check_silence(key, now)
                case _Timer.BEAT if Channel.CONTROL in self._peers[key].links:
                    self._deadlines.set((timer, key), now + self.timeouts.heartbeat_interval)
                    actions.append(SendFrame(node=key, frame=_HEARTBEAT))
                case _Timer.DIAL:
                    actions += self._dial(key, _DialInput.DUE, now)
        return actions + self._gate.on_timer(now)

    # -- internals ----------------------------------------------------------------------------
    def _verdict(self, peer: _Peer, incarnation: int, name: str) -> _Verdict:
        known = peer.incarnation
        if known is None:
            return _Verdict.FIRST
        same_node = not self._named or name == peer.name  # (a static list: names not looked at)
        if incarnation == known and same_node:
            return _Verdict.SAME
        if not same_node or (self._named and peer.registered is not None):
            return _Verdict.NEWER  # another node, or the one etcd registered: never by clock
        if incarnation > known or peer.state is PeerState.DOWN:
            return _Verdict.NEWER
        return _Verdict.STALE

    def _admit_control(
        self, node: int, incarnation: int, name: str, ruling: _Ruling, now: float
    ) -> list[Action]:
        peer = self._peers[node]
        peer.leaving = False
        actions: list[Action] = []
        if ruling is not _Ruling.ADMIT:  # nothing exchanged before can be trusted
            reason = "reconnected" if ruling is _Ruling.RECONNECT else "restarted"
            actions += self._reset(node, reason, now)
        peer.links.add(Channel.CONTROL)
        actions.append(AdmitLink(node=node, channel=Channel.CONTROL))
        if peer.incarnation is not None and incarnation != peer.incarnation:
            actions.append(
                PeerRestarted(
                    node=node, old_incarnation=peer.incarnation, new_incarnation=incarnation
                )
            )
        peer.incarnation, peer.name = incarnation, name
        peer.last_heard = now
        self._deadlines.set((_Timer.BEAT, node), now)  # the first heartbeat goes out at once
        actions += self._move(node, _Input.ESTABLISHED, now, "authenticated")
        return actions

    def _bring_forward(self, node: int, now: float) -> None:
        """The waiting dial of ``node`` is due now, its backoff back to the first."""
        self._diallers[node].backoff = self._first_backoff
        self._deadlines.set((_Timer.DIAL, node), now)

    def _refuse(self, node: int, channel: Channel, reason: str) -> RefuseLink:
        self._links_refused += 1
        return RefuseLink(node=node, channel=channel, reason=reason)

    def _reset(self, node: int, reason: str, now: float) -> list[Action]:
        """Both links of ``node`` go down; a connected dialler redials."""
        peer = self._peers[node]
        peer.links.clear()
        self._deadlines.cancel((_Timer.BEAT, node))
        self._resets += 1
        actions: list[Action] = [ResetPeer(node=node, reason=reason, expected=peer.leaving)]
        if node in self._diallers:
            actions += self._dial(node, _DialInput.RESET, now)
        return actions

    def _check_silence(self, node: int, now: float) -> list[Action]:
        peer = self._peers[node]
        silent = f"silent for {now - peer.last_heard:.2f}s"
        # compare with the very sums the deadlines were set to: (t + d) - t can round below d,
        # and a timer that fires on time must not find the peer a hair short of its bound
        if now >= peer.last_heard + self.timeouts.down_after:
            return self._move(node, _Input.DEAD, now, silent) + self._reset(node, "down", now)
        if now >= peer.last_heard + self.timeouts.suspect_after:
            return self._move(node, _Input.SILENT, now, silent)
        self._arm_silence(node)  # woken early: frames arrived since it was set
        return []

    def _arm_silence(self, node: int) -> None:
        peer = self._peers[node]
        key = (_Timer.SILENCE, node)
        if peer.state is PeerState.UP:
            self._deadlines.set(key, peer.last_heard + self.timeouts.suspect_after)
        elif peer.state is PeerState.SUSPECT:
            self._deadlines.set(key, peer.last_heard + self.timeouts.down_after)
        else:
            self._deadlines.cancel(key)

    def _move(self, node: int, event: _Input, now: float, reason: str) -> list[Action]:
        peer = self._peers[node]
        new = _TRANSITIONS.get((peer.state, event), peer.state)
        if new is peer.state:
            return []
        old, peer.state, peer.since = peer.state, new, now
        self._arm_silence(node)
        return [StateChanged(node=node, old=old, new=new, reason=reason)]

    def _dial(self, node: int, event: _DialInput, now: float, error: str = "") -> list[Action]:
        dialler = self._diallers[node]
        new = _DIAL_TRANSITIONS.get((dialler.state, event))
        if new is None:
            return []
        if node in self._absent and new is not _Dial.CONNECTED:  # no address: wait for one
            dialler.state = _Dial.STOPPED
            self._deadlines.cancel((_Timer.DIAL, node))
            return []
        dialler.state = new
        key = (_Timer.DIAL, node)
        match event:
            case _DialInput.START | _DialInput.DUE:
                return [Dial(node=node)]
            case _DialInput.FAILED:
                dialler.attempts += 1
                wait, dialler.backoff = dialler.backoff, min(dialler.backoff * 2, self.max_backoff)
                self._deadlines.set(key, now + wait)
                n = dialler.attempts
                if n in (1, 10) or n % 100 == 0:
                    return [DialRetry(node=node, attempts=n, error=error, retry_in=wait)]
            case _DialInput.ADMITTED:
                self._deadlines.cancel(key)
                dialler.backoff, dialler.attempts = self._first_backoff, 0
            case _DialInput.RESET:
                self._deadlines.set(key, now + self._first_backoff)
        return []
