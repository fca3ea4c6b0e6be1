"""Stall reports: what an operation pending longer than ``stall_after`` is waiting for.

Rules: data and words only.  The point-to-point engine decides which operations are stalled
and gathers the facts (:meth:`fabricd.engines.p2p.matching.Messaging.stalls`); this module names
what
each one waits for and says it in one sentence.  Whether the peer's *node* is alive is the
peers engine's knowledge: the daemon adds it (engines do not call each other).

Theory of operation: an operation waits for exactly one thing, given by its state and, for a
receive still posted, by where its source rank lives:

=========  ==================================  ===========================================
waits      operation and state                 meaning
=========  ==================================  ===========================================
``join``   send ROUTE, receive POSTED          the peer rank has not joined the job anywhere
``match``  send QUEUED, receive POSTED         the peer rank is on this node and has posted
                                               no matching operation
``rts``    receive POSTED                      the sender is on another node, whose daemon
                                               has sent no RTS for this (source, tag)
``cts``    send RTS                            the RTS went out; the receiver's daemon has
                                               not answered CTS (no matching receive there)
``done``   send STREAM                         CTS came (the receive is posted); the bytes
                                               are being sent, DONE has not come
``data``   receive LANDING                     CTS went out; not every byte has arrived
``copy``   send or receive COPY                both sides are on this node; the copy runs
=========  ==================================  ===========================================

So "has the peer rank posted a matching operation" is ``False`` for the first four and ``True``
for the last three.  Where the peer has posted operations between the same two ranks under
*other* tags, they are named (``other_tags``): a tag that differs on the two sides is the most
common reason a job hangs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fabricd.engines.p2p.messages import Message

#: at most this many other tags are named in a report
MAX_OTHER_TAGS: Final = 8


class Waits(enum.StrEnum):
    """What a stalled operation waits for (the table in the module docstring)."""

    JOIN = "join"
    MATCH = "match"
    RTS = "rts"
    CTS = "cts"
    DONE = "done"
    DATA = "data"
    COPY = "copy"


#: the waits in which the peer rank has posted its matching operation
_PEER_POSTED: Final = frozenset({Waits.DONE, Waits.DATA, Waits.COPY})


@dataclass(frozen=True, slots=True, kw_only=True)
class Stalled:
    """Operation ``op`` has been pending for ``pending_for`` seconds, at least ``stall_after``.

    Returned once per operation by :meth:`~fabricd.engines.p2p.matching.Messaging.on_timer` (the
    daemon logs it) and for every such operation by
    :meth:`~fabricd.engines.p2p.matching.Messaging.stalls` (``fabricctl stalls``).
    """

    op: int
    send: bool  #: a send (else a receive)
    msg: Message
    node: int  #: this daemon's node
    pending_for: float
    waits: Waits
    peer_node: int | None  #: where the peer rank lives (``None``: it has not joined)
    peer_joined: bool  #: whether the peer rank is in the job now
    other_tags: tuple[int, ...] = ()  #: tags the peer posted between the same ranks instead
    received: int | None = None  #: ``data``: bytes of the message that arrived so far

    @property
    def rank(self) -> int:
        """The rank that posted the operation (on this node)."""
        return self.msg.src if self.send else self.msg.dst

    @property
    def peer(self) -> int:
        """The rank the operation needs: the destination of a send, the source of a receive."""
        return self.msg.dst if self.send else self.msg.src

    @property
    def peer_posted(self) -> bool:
        """Whether the peer rank has posted the matching operation (as far as this node knows)."""
        return self.waits in _PEER_POSTED

    def what(self) -> str:
        """The operation: ``recv of rank 0 from rank 1, job 'j', tag 5, 4096 B float32``."""
        msg = self.msg
        kind, way = ("send", "to") if self.send else ("recv", "from")
        return (
            f"{kind} of rank {self.rank} {way} rank {self.peer}, job {msg.job!r}, "
            f"tag {msg.tag}, {msg.nbytes} B {msg.dtype}"
        )

    def detail(self) -> str:
        """What it waits for, in one sentence naming the peer rank and its node."""
        peer, me, tag, nbytes = self.peer, self.rank, self.msg.tag, self.msg.nbytes
        where = "this node" if self.peer_node == self.node else f"node {self.peer_node}"
        match self.waits:
            case Waits.JOIN:
                text = f"rank {peer} has not joined job {self.msg.job!r} on any node"
            case Waits.MATCH if self.send:
                text = f"rank {peer} on this node has posted no recv from rank {me} with tag {tag}"
            case Waits.MATCH:
                text = f"rank {peer} on this node has posted no send to rank {me} with tag {tag}"
            case Waits.RTS:
                text = (
                    f"rank {peer} on {where} has sent nothing to rank {me} with tag {tag} "
                    "(no RTS has arrived)"
                )
            case Waits.CTS:
                text = (
                    f"rank {peer} on {where} has posted no recv from rank {me} with tag {tag} "
                    "(RTS sent, no CTS back)"
                )
            case Waits.DONE:
                text = (
                    f"rank {peer} on {where} posted its recv (CTS came); the {nbytes} B are "
                    "being sent and its DONE has not come"
                )
            case Waits.DATA:
                text = (
                    f"rank {peer} on {where} is sending (CTS sent); {self.received} of "
                    f"{nbytes} B have arrived"
                )
            case Waits.COPY:
                text = (
                    f"rank {peer}'s matching operation is on this node; the copy of {nbytes} B runs"
                )
        return text + self._hint()

    def _hint(self) -> str:
        if not self.other_tags:
            return ""
        tags = ", ".join(str(tag) for tag in self.other_tags)
        if self.send:
            return f"; it has recvs from rank {self.rank} posted with tags {tags}"
        return f"; its sends to rank {self.rank} with tags {tags} wait here for their recvs"


def other_tags(tags: set[int], tag: int) -> tuple[int, ...]:
    """The first :data:`MAX_OTHER_TAGS` of ``tags`` other than ``tag``, in order."""
    return tuple(sorted(tags - {tag})[:MAX_OTHER_TAGS])
