"""The actions every engine returns: one vocabulary between engines and their services.

Rules: an action says *what* must happen (a frame to a peer, a request finished, a line for the
operator); the service that owns the engine decides *how* (which link, which client).  Actions
belong here when more than one engine returns them, or when they address a frame as any engine
would (to a node, to every peer, back on the link an input came from); an action only one engine
needs (streaming a message, dialling a node) lives beside that engine.

Timers are not actions: an engine keeps its deadlines in a :class:`~fabricd.engines.deadlines.
Deadlines` heap and reports the earliest through ``next_deadline()`` (the aioquic
``get_timer``/``handle_timer`` idiom), so arming, moving and cancelling a deadline costs the
engine O(log n) and the daemon one ``call_at``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabricd.errors import ErrorCode
    from fabricd.frames.link import HandshakeFrame
    from fabricd.frames.registry import PeerFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """Why an operation failed: a code from :class:`~fabricd.errors.ErrorCode` and a message.

    ``rank`` and ``node`` name the rank and node that were lost, where one was.
    """

    code: ErrorCode | str
    message: str
    rank: int | None = None
    node: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SendFrame:
    """Send ``frame`` to ``node`` on the control channel (dropped if the node is not up)."""

    node: int
    frame: PeerFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """Send ``frame`` back on the link the engine's input came from.

    For an engine that speaks on a link before it knows which node is on the other end (the
    handshake): there is no trusted node id yet to address a :class:`SendFrame` to.
    """

    frame: HandshakeFrame | PeerFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class Broadcast:
    """Send ``frame`` to every peer that is up (both links admitted); a peer still coming up
    hears the same news when it is greeted."""

    frame: PeerFrame


@dataclass(frozen=True, slots=True, kw_only=True)
class Complete:
    """Operation ``op`` finished; ``failure`` is ``None`` on success."""

    op: int
    failure: Failure | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """Something an operator should read in the log (at warning level)."""

    message: str
