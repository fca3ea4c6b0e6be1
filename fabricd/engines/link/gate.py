"""Unauthenticated links: who may begin a handshake, how many at once, and for how long.

Rules: this module decides whether a new link may begin its handshake and when one has taken
too long.  It never touches a link: the daemon names each link with an id, reports when its
handshake starts and ends (with the host it came from), and performs the returned actions.
The handshake itself is :mod:`fabricd.engines.link.handshake`'s; which authenticated link to keep is
:mod:`fabricd.engines.link.peers`'; which hosts are configured nodes is the daemon's configuration.

Theory of operation: membership is static, so only the hosts of configured nodes that dial this
one can have a reason to connect.  An accepted link from any other host is refused on arrival,
before a byte of it is read (:class:`RefuseHandshake`).  Every configured host has its own
slots — as many as the nodes on it that dial this one, plus ``spare`` — so no flood from
elsewhere can take a real peer's slot.  When a host's slots are full, its *oldest* pending link
is closed to make room for the new one (:class:`CloseHandshake`): a host cannot lock its own
nodes out by holding idle links either, and whoever floods from a peer's own host must open
``slots`` links within each of the peer's handshake round trips to keep it out (the threat
model in docs/operations.md says what that means).  Every link in its handshake, accepted or
dialled, has a deadline ``timeout`` after it started; when it passes, :class:`CloseHandshake`.
Dialled links count towards no slot: this node chose to open them.

Each link is in one of three states, and ids are the daemon's::

    (unknown) --started, configured host--> PENDING --over--> (unknown)
    (unknown) --started, other host--> refused     PENDING --deadline, or evicted--> closed

Cost: every input is O(1) (an insertion-ordered table of pending links per host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from collections.abc import Mapping

#: pending-handshake slots each configured host gets beyond one per node on it that dials here
SPARE_SLOTS: Final = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RefuseHandshake:
    """Close a link that has just arrived, unread: its host is no configured node's."""

    link_id: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseHandshake:
    """Close a link still in its handshake (past the timeout, or evicted); log ``reason``."""

    link_id: int
    reason: str


GateAction = RefuseHandshake | CloseHandshake


@dataclass(frozen=True, slots=True)
class _Pending:
    host: str
    accepted: bool  #: holds one of its host's slots


@dataclass(frozen=True, slots=True, kw_only=True)
class GateStatistics:
    """Counters since the start."""

    pending: int  #: links in their handshake now, accepted or dialled
    refused: int  #: refused on arrival, evicted, past the deadline, or failed
    unknown_host: int  #: of those, refused on arrival: not from a configured node's host
    evicted: int  #: of those, closed to make room for a newer link from the same host


class HandshakeGate:
    """The links in their handshake.

    Args:
        timeout: seconds a link may stay unauthenticated.
        slots: accepted links each host may have in their handshake at once; a host that is
            not a key is no configured node's, and its links are refused on arrival.
    """

    def __init__(self, *, timeout: float, slots: Mapping[str, int]) -> None:
        if not timeout > 0:
            raise ValueError("handshake_timeout must be more than 0 seconds")
        self.timeout = timeout
        self.slots: dict[str, int] = {}
        self.set_slots(slots)
        self._deadlines: Deadlines[int] = Deadlines()
        self._pending: dict[int, _Pending] = {}
        #: accepted links pending per host, oldest first (only hosts with one pending)
        self._from_host: dict[str, dict[int, None]] = {}
        self._refused = 0
        self._unknown = 0
        self._evicted = 0

    def set_slots(self, slots: Mapping[str, int]) -> None:
        """Which hosts may begin a handshake from now on, and how many at once (a configured
        name that resolved late).  Links already pending keep their slots until they end."""
        if any(n < 1 for n in slots.values()):
            raise ValueError("every configured host must have at least 1 handshake slot")
        self.slots = dict(slots)

    @property
    def pending(self) -> int:
        """Links in their handshake now, accepted or dialled."""
        return len(self._pending)

    @property
    def refused(self) -> int:
        """Links refused on arrival, evicted, past the deadline or failed, since the start."""
        return self._refused

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            pending=len(self._pending),
            refused=self._refused,
            unknown_host=self._unknown,
            evicted=self._evicted,
        )

    def on_started(
        self, link_id: int, host: str, now: float, *, accepted: bool = True
    ) -> list[GateAction]:
        """A link from (or to) ``host`` begins its handshake.

        Returns :class:`RefuseHandshake` for an accepted link from a host no configured node
        has, and :class:`CloseHandshake` for the oldest pending link of a host whose slots
        were full (the new link takes its slot).

        Raises:
            ValueError: ``link_id`` is already in its handshake (a daemon bug).
        """
        if link_id in self._pending:
            raise ValueError(f"link {link_id} is already in its handshake")
        actions: list[GateAction] = []
        if accepted:
            slots = self.slots.get(host, 0)
            if not slots:
                self._refused += 1
                self._unknown += 1
                reason = f"{host} is not the address of a node in this fabric's nodes list"
                return [RefuseHandshake(link_id=link_id, reason=reason)]
            mine = self._from_host.setdefault(host, {})
            if len(mine) >= slots:
                oldest = next(iter(mine))
                self._release(oldest)
                self._refused += 1
                self._evicted += 1
                reason = (
                    f"replaced by a newer link from {host}: {slots} handshakes may be pending "
                    "from it (one per node there that dials this one, plus spare)"
                )
                actions.append(CloseHandshake(link_id=oldest, reason=reason))
                mine = self._from_host.setdefault(host, {})
            mine[link_id] = None
        self._pending[link_id] = _Pending(host, accepted)
        self._deadlines.set(link_id, now + self.timeout)
        return actions

    def on_over(self, link_id: int, *, failed: bool = False) -> None:
        """``link_id`` authenticated, or ``failed`` (counted as refused); its slot is free.

        A link that is not in its handshake (closed at its deadline, refused) is ignored.
        """
        if self._release(link_id) and failed:
            self._refused += 1

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def on_timer(self, now: float) -> list[GateAction]:
        """Close every link whose deadline has passed."""
        actions: list[GateAction] = []
        reason = f"no handshake within {self.timeout:.1f}s"
        for link_id in self._deadlines.pop_due(now):
            self._release(link_id)
            self._refused += 1
            actions.append(CloseHandshake(link_id=link_id, reason=reason))
        return actions

    def _release(self, link_id: int) -> bool:
        """Forget a link's handshake; False if it was not in one."""
        pending = self._pending.pop(link_id, None)
        if pending is None:
            return False
        self._deadlines.cancel(link_id)
        if pending.accepted:
            mine = self._from_host[pending.host]
            del mine[link_id]
            if not mine:  # keeps the table as small as the hosts now in a handshake
                del self._from_host[pending.host]
        return True


def host_slots(
    node: int, hosts: Mapping[int, frozenset[str]], spare: int = SPARE_SLOTS
) -> dict[str, int]:
    """The slots of every host: one per node on it that dials ``node`` (a lower id), plus
    ``spare``; hosts of no such node get none.

    Args:
        node: this node's id.
        hosts: every node's addresses (a name may resolve to several).
        spare: extra slots per host, for a restarted peer whose old link still waits.
    """
    if spare < 0:
        raise ValueError("handshake_spare_slots must be 0 or more")
    slots: dict[str, int] = {}
    for other, addresses in hosts.items():
        if other < node:
            for host in addresses:
                slots[host] = slots.get(host, spare) + 1
    return slots
