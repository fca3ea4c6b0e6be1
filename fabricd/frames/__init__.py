"""Typed views of the peer frames' metadata, read and written at the wire boundary.

Rules: this package is the one place that knows which fields each peer frame kind carries and
what values they may hold (docs/protocol.md, "Frame kinds").  Engines take and return these
views, never raw ``dict`` metadata; the node parses a frame once, when it arrives
(:func:`parse`), and encodes it once, when it leaves (:meth:`to_meta`).

Every view is a frozen, slotted dataclass with the frame kind as ``KIND``.  :func:`parse`
raises :class:`~fabricd.errors.RemoteProtocolError` for a field that is missing or of the wrong
type or range, so a malformed frame is refused before any engine sees it, and the link that
sent it is closed.

The handshake's HELLO and AUTH have views too (:class:`Hello`, :class:`Auth`), read by their own
:func:`parse_handshake`: they are exchanged before a link is trusted, and an authenticated peer
that sends one again is refused by :func:`parse` like any other kind it may not send.

One module per capability (``link``, ``membership``, ``p2p``, ``collectives``, ``stochastic``,
``ps``) and the shared field readers (``fields``); this module is the registry of every kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.collectives import Coll
from fabricd.frames.link import Bye, Heartbeat
from fabricd.frames.membership import Announce
from fabricd.frames.p2p import Cancel, Cts, Data, Done, Eager, Rtr, Rts, Write
from fabricd.frames.ps import Join, Pull, Pulled, Push, Pushed, Replicate, Replicated
from fabricd.frames.stochastic import Ack, Notify, Update

if TYPE_CHECKING:
    from fabricd.wire import Kind, Meta

#: every frame an authenticated peer may send
PeerFrame = (
    Heartbeat
    | Bye
    | Announce
    | Rts
    | Cts
    | Data
    | Done
    | Cancel
    | Write
    | Eager
    | Rtr
    | Coll
    | Update
    | Notify
    | Ack
    | Push
    | Pull
    | Pushed
    | Pulled
    | Replicate
    | Replicated
    | Join
)
#: the frames whose payload is a point-to-point message's bytes (DATA, and EAGER on control)
MessageFrame = Data | Eager
#: the frames whose payload a service places (a collective's COLL, a stochastic reduce's
#: UPDATE and a parameter server's PUSH, PULLED and REPLICATE on the data channel too)
PayloadFrame = Data | Eager | Coll | Update | Push | Pulled | Replicate

_BY_KIND: Final[dict[Kind, type[PeerFrame]]] = {
    cls.KIND: cls
    for cls in (
        Heartbeat,
        Bye,
        Announce,
        Rts,
        Cts,
        Data,
        Done,
        Cancel,
        Write,
        Eager,
        Rtr,
        Coll,
        Update,
        Notify,
        Ack,
        Push,
        Pull,
        Pushed,
        Pulled,
        Replicate,
        Replicated,
        Join,
    )
}
#: the kinds :func:`parse` reads
PEER_KINDS: Final = frozenset(_BY_KIND)


def parse(kind: Kind, meta: Meta) -> PeerFrame:
    """The typed view of a peer frame's metadata.

    Raises:
        RemoteProtocolError: not a peer frame kind, or a field is missing or out of range;
            close the link that sent it.
    """
    view = _BY_KIND.get(kind)
    if view is None:
        raise RemoteProtocolError(f"{kind.name} is not a frame a peer may send")
    return view.from_meta(meta)
