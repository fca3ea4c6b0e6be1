"""Unauthenticated links: how many may wait in their handshake, from whom, and for how long.

Rules: this module decides whether a new link may begin its handshake and when one has taken
too long.  It never touches a link: the daemon names each link with an id, reports when its
handshake starts and ends, and performs the returned actions.  The handshake itself is
:mod:`fabricd.engines.handshake`'s; which authenticated link to keep is
:mod:`fabricd.engines.peers`'.

Theory of operation: an unauthenticated peer gets a few KiB (the handshake decoder limits) and
a few seconds.  Every link in its handshake, accepted or dialled, has a deadline
``timeout`` after it started; when it passes, :class:`CloseHandshake`.  Accepted links are
also capped — ``max_pending_per_host`` from one host and ``max_pending`` in all — so a flood of
idle connections from one host can neither exhaust memory nor lock the other hosts (the
peers) out; a link over a cap gets :class:`RefuseHandshake` before it is read.  The first
refusal of a flood comes with a :class:`~fabricd.engines.actions.Notice`; a flood ends when a
link of it is let in again (or, for a host's flood, when nothing of that host is pending), so
the log says it once per flood, not once per connection.  Dialled links count towards no cap:
this node chose to open them.

Each link is in one of three states, and ids are the daemon's::

    (unknown) --started, under the caps--> PENDING --over--> (unknown)
    (unknown) --started, over a cap--> refused          PENDING --deadline--> closed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fabricd.engines.actions import Notice
from fabricd.engines.deadlines import Deadlines

#: accepted links allowed in their handshake at once; each may hold a few KiB for a few seconds
MAX_PENDING_HANDSHAKES: Final = 256
#: of those, from any one host (peers are other hosts, so a flood from one cannot lock them out)
MAX_PENDING_PER_HOST: Final = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class RefuseHandshake:
    """Close a link that has just arrived, unread: too many are in their handshake."""

    link_id: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseHandshake:
    """Close a link that is still unauthenticated after the timeout; log ``reason``."""

    link_id: int
    reason: str


GateAction = RefuseHandshake | CloseHandshake | Notice


@dataclass(frozen=True, slots=True)
class _Pending:
    host: str
    accepted: bool  #: counts towards the caps


class HandshakeGate:
    """The links in their handshake.

    Args:
        timeout: seconds a link may stay unauthenticated.
        max_pending, max_pending_per_host: caps on accepted links in their handshake.
    """

    def __init__(self, *, timeout: float, max_pending: int, max_pending_per_host: int) -> None:
        if not timeout > 0:
            raise ValueError("handshake_timeout must be more than 0 seconds")
        if min(max_pending, max_pending_per_host) < 1:
            raise ValueError("max_pending and max_pending_per_host must be at least 1")
        self.timeout = timeout
        self.max_pending = max_pending
        self.max_pending_per_host = max_pending_per_host
        self._deadlines: Deadlines[int] = Deadlines()
        self._pending: dict[int, _Pending] = {}
        self._from_host: dict[str, int] = {}  #: accepted links pending, per host
        self._accepted = 0  #: accepted links pending, in all
        self._flooded: set[str | None] = set()  #: floods already told (None: the total cap)
        self.refused = 0  #: over a cap, past the deadline, or failed, since the start

    @property
    def pending(self) -> int:
        """Links in their handshake now, accepted or dialled."""
        return len(self._pending)

    def on_started(
        self, link_id: int, host: str, now: float, *, accepted: bool = True
    ) -> list[GateAction]:
        """A link from (or to) ``host`` begins its handshake.

        Raises:
            ValueError: ``link_id`` is already in its handshake (a daemon bug).
        """
        if link_id in self._pending:
            raise ValueError(f"link {link_id} is already in its handshake")
        if accepted:
            from_host = self._from_host.get(host, 0)
            if from_host >= self.max_pending_per_host or self._accepted >= self.max_pending:
                return self._refuse(link_id, host, from_host)
            self._flooded.difference_update((host, None))
            self._from_host[host] = from_host + 1
            self._accepted += 1
        self._pending[link_id] = _Pending(host, accepted)
        self._deadlines.set(link_id, now + self.timeout)
        return []

    def on_over(self, link_id: int, *, failed: bool = False) -> None:
        """``link_id`` authenticated, or ``failed`` (counted as refused); its slot is free.

        A link that is not in its handshake (closed at its deadline, refused) is ignored.
        """
        if self._release(link_id) and failed:
            self.refused += 1

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def on_timer(self, now: float) -> list[GateAction]:
        """Close every link whose deadline has passed."""
        actions: list[GateAction] = []
        reason = f"no handshake within {self.timeout:.1f}s"
        for link_id in self._deadlines.pop_due(now):
            self._release(link_id)
            self.refused += 1
            actions.append(CloseHandshake(link_id=link_id, reason=reason))
        return actions

    def _refuse(self, link_id: int, host: str, from_host: int) -> list[GateAction]:
        self.refused += 1
        actions: list[GateAction] = [
            RefuseHandshake(link_id=link_id, reason="too many unauthenticated links")
        ]
        flood = host if from_host >= self.max_pending_per_host else None
        if flood not in self._flooded:
            self._flooded.add(flood)
            message = (
                f"refusing links from {host}: {from_host} handshakes pending from it, "
                f"{self._accepted} in all"
            )
            actions.append(Notice(message=message))
        return actions

    def _release(self, link_id: int) -> bool:
        """Forget a link's handshake; False if it was not in one."""
        pending = self._pending.pop(link_id, None)
        if pending is None:
            return False
        self._deadlines.cancel(link_id)
        if pending.accepted:
            self._accepted -= 1
            left = self._from_host[pending.host] - 1
            if left:
                self._from_host[pending.host] = left
            else:  # keeps both tables as small as the hosts now in a handshake
                del self._from_host[pending.host]
                self._flooded.discard(pending.host)
        return True
