"""Peer liveness: heartbeats, the peer state machine, and incarnation fencing.

Rules: this module decides when a peer is up, suspect or down and when to send a heartbeat.  It
never touches a link; the daemon reports what happened and performs the returned actions.

Theory of operation: every authenticated frame from a peer counts as a heartbeat; an explicit
HEARTBEAT is sent every ``heartbeat_interval`` on the control channel.  A peer is *suspect*
after ``suspect_after`` seconds of silence or as soon as its control link drops, and *down*
after ``down_after`` seconds of silence (the failure-detection bound D of RELIABILITY.md; the
daemon fails every operation that involves a down peer).  A peer that comes back is *up* again;
if it comes back as a new incarnation (it restarted), the old incarnation's state is dead: the
daemon is told to drop it first, and links of the older incarnation are refused for good.

Transitions (anything not listed keeps the state)::

    CONNECTING --established--> UP        UP/SUSPECT --heard--> UP
    UP --link_lost/silent--> SUSPECT      UP/SUSPECT --silent for down_after--> DOWN
    DOWN --established--> UP
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PeerState(enum.Enum):
    CONNECTING = "connecting"  #: never authenticated yet
    UP = "up"  #: heard from within suspect_after
    SUSPECT = "suspect"  #: silent for suspect_after, or its control link dropped
    DOWN = "down"  #: silent for down_after: its operations have failed


class _Input(enum.Enum):
    ESTABLISHED = enum.auto()  #: a control link authenticated
    HEARD = enum.auto()  #: any frame arrived
    LINK_LOST = enum.auto()  #: the control link closed
    SILENT = enum.auto()  #: nothing heard for suspect_after
    DEAD = enum.auto()  #: nothing heard for down_after


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Liveness settings, in seconds."""

    heartbeat_interval: float
    suspect_after: float
    down_after: float

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.suspect_after <= self.down_after:
            raise ValueError("need 0 < heartbeat_interval < suspect_after <= down_after")


class Incarnation(enum.Enum):
    """How a handshake's incarnation compares with the one we know."""

    SAME = "same"
    NEWER = "newer"  #: the peer restarted: drop what belonged to the old one
    STALE = "stale"  #: a dead incarnation: refuse the link


@dataclass(frozen=True, slots=True, kw_only=True)
class SendHeartbeat:
    node: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StateChanged:
    node: int
    old: PeerState
    new: PeerState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRestarted:
    """The peer is a new incarnation: everything of the old one must be dropped."""

    node: int
    old_incarnation: int
    new_incarnation: int


Action = SendHeartbeat | StateChanged | PeerRestarted


@dataclass(slots=True)
class _Peer:
    state: PeerState = PeerState.CONNECTING
    incarnation: int | None = None
    last_heard: float = 0.0
    next_heartbeat: float = 0.0
    since: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """A peer as ``fabricctl peers`` shows it."""

    node: int
    state: PeerState
    incarnation: int | None
    silent_for: float | None
    state_for: float


class PeerTable:
    """The liveness view of every other node of the fabric."""

    def __init__(self, *, node: int, nodes: int, timeouts: Timeouts, now: float) -> None:
        self.node = node
        self.timeouts = timeouts
        self._peers = {n: _Peer(since=now) for n in range(nodes) if n != node}

    def state(self, node: int) -> PeerState:
        return self._peers[node].state

    def check_incarnation(self, node: int, incarnation: int) -> Incarnation:
        """Compare a handshake's incarnation with the newest one seen from ``node``.

        An older incarnation is refused while the peer is alive (a dead process's links must
        not come back), but once the peer is down any other incarnation is its new life: a
        clock that stepped back across a restart must not lock a node out for good.
        """
        peer = self._peers[node]
        known = peer.incarnation
        if known is None or incarnation > known:
            return Incarnation.NEWER
        if incarnation == known:
            return Incarnation.SAME
        return Incarnation.NEWER if peer.state is PeerState.DOWN else Incarnation.STALE

    def on_established(self, node: int, incarnation: int, now: float) -> list[Action]:
        """A control link to ``node`` authenticated as ``incarnation`` (not STALE)."""
        peer = self._peers[node]
        actions: list[Action] = []
        if peer.incarnation is not None and incarnation != peer.incarnation:
            actions.append(
                PeerRestarted(
                    node=node, old_incarnation=peer.incarnation, new_incarnation=incarnation
                )
            )
        peer.incarnation = incarnation
        peer.last_heard = now
        peer.next_heartbeat = now
        return actions + self._move(node, _Input.ESTABLISHED, now, "authenticated")

    def on_heard(self, node: int, now: float) -> list[Action]:
        """Any authenticated frame from ``node`` arrived."""
        peer = self._peers[node]
        if peer.state is PeerState.CONNECTING or peer.state is PeerState.DOWN:
            return []
        peer.last_heard = now
        return self._move(node, _Input.HEARD, now, "heard from it again")

    def on_link_lost(self, node: int, now: float) -> list[Action]:
        """The control link to ``node`` closed."""
        return self._move(node, _Input.LINK_LOST, now, "control link lost")

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run."""
        deadlines = []
        for peer in self._peers.values():
            if peer.state in (PeerState.UP, PeerState.SUSPECT):
                deadlines.append(peer.next_heartbeat)
                deadlines.append(peer.last_heard + self.timeouts.down_after)
                if peer.state is PeerState.UP:
                    deadlines.append(peer.last_heard + self.timeouts.suspect_after)
        return min(deadlines, default=None)

    def on_timer(self, now: float) -> list[Action]:
        """Send due heartbeats and move silent peers to suspect or down."""
        actions: list[Action] = []
        for node, peer in self._peers.items():
            if peer.state not in (PeerState.UP, PeerState.SUSPECT):
                continue
            silent = now - peer.last_heard
            # compare with the very sums next_deadline() returns: (t + d) - t can round below d,
            # and a timer that fires on time must not find the peer a hair short of its bound
            if now >= peer.last_heard + self.timeouts.down_after:
                actions += self._move(node, _Input.DEAD, now, f"silent for {silent:.2f}s")
                continue
            if now >= peer.last_heard + self.timeouts.suspect_after:
                actions += self._move(node, _Input.SILENT, now, f"silent for {silent:.2f}s")
            if now >= peer.next_heartbeat:
                peer.next_heartbeat = now + self.timeouts.heartbeat_interval
                actions.append(SendHeartbeat(node=node))
        return actions

    def peers(self, now: float) -> list[PeerInfo]:
        return [
            PeerInfo(
                node=node,
                state=peer.state,
                incarnation=peer.incarnation,
                silent_for=None if peer.state is PeerState.CONNECTING else now - peer.last_heard,
                state_for=now - peer.since,
            )
            for node, peer in sorted(self._peers.items())
        ]

    def _move(self, node: int, event: _Input, now: float, reason: str) -> list[Action]:
        peer = self._peers[node]
        new = _TRANSITIONS.get((peer.state, event), peer.state)
        if new is peer.state:
            return []
        old, peer.state, peer.since = peer.state, new, now
        return [StateChanged(node=node, old=old, new=new, reason=reason)]
