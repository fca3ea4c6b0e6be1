"""The registry of peer frame kinds: which view reads each kind (:func:`parse`), and the
unions the node and the services name (:data:`PeerFrame`, :data:`PayloadFrame`,
:data:`MessageFrame`).

Its own module, not the package's ``__init__``, so that importing one capability's frames or
the shared limits (the client reads :mod:`~fabricd.frames.fields`) does not load every kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.ako import Part
from fabricd.frames.collectives import Coll
from fabricd.frames.link import Bye, Heartbeat
from fabricd.frames.membership import Announce
from fabricd.frames.monitor import Report
from fabricd.frames.p2p import Cancel, Cts, Data, Done, Eager, Rtr, Rts, Write
from fabricd.frames.ps import (
    Gather,
    Grant,
    Join,
    Opened,
    Plan,
    Pull,
    Pulled,
    Push,
    Pushed,
    Ready,
    Replicate,
    Replicated,
)
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
    | Opened
    | Report
    | Ready
    | Grant
    | Gather
    | Plan
    | Part
)
#: the frames whose payload is a point-to-point message's bytes (DATA, and EAGER on control)
MessageFrame = Data | Eager
#: the frames whose payload a service places (a collective's COLL, a stochastic reduce's
#: UPDATE and a parameter server's PUSH, PULLED and REPLICATE on the data channel too)
PayloadFrame = Data | Eager | Coll | Update | Push | Pulled | Replicate | Part

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
        Opened,
        Report,
        Ready,
        Grant,
        Gather,
        Plan,
        Part,
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
