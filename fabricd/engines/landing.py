"""Where the payload of every incoming message lands: the one table of (node, msg) -> region.

Rules: this module knows which bytes of which message go where and how many have come.
Whether a message is wanted is the point-to-point engine's decision (it registers a receive's
region here when it sends the CTS); reading sockets is the daemon's.

Theory of operation: a remote message is *expected* from the moment its receive matched the
RTS, before the CTS leaves, so every DATA chunk of it has a place to land before it can arrive.
The sender streams the chunks in order on one data link, so each one must continue exactly
where the previous one stopped and stay within the message; one that does not is a protocol
error, and the daemon closes that link.  :meth:`Landing.payload_buffer` hands the transport a
view of the receiver's region, so the kernel writes socket -> shared memory with no copy in
user space.

Two kinds of bytes are read and dropped (:meth:`Landing.payload_buffer` returns ``None``, and
the transport reads them through its small read buffer, allocating nothing for them): those of
a message that is *discarded* (its receiver left mid-transfer; the bytes are still counted, so
the transfer ends and the sender hears DONE) and those of a message the sender *cancelled*
(DATA it had sent before its CANCEL, which travels on the other link, may still arrive).  The
last :data:`CANCELLED_KEPT` messages of each node cancelled after their CTS are remembered for
that (a CANCEL of a message that had no CTS, or whose DATA all came, has none under way).  DATA of
any other message is one this daemon never asked for (no CTS): a protocol error, so a peer can
make the daemon neither allocate nor keep anything with DATA it sends unasked.

A CANCEL that comes while a chunk is still being written into the region (:meth:`Landing.
filling`: a large chunk lands over several reads, and the control link is read in between)
takes effect once that chunk is in: answering the receive earlier let its client reuse the
region while the rest of the chunk still landed there.

Ids: a message is known by the sender's id when a CTS asked for it, and by the *negative* of
the receiver's RTR number when an RTR did (:mod:`fabricd.engines.p2p.matching`): its DATA carries
that
number, and may arrive before the RTS that names the message.  Such an entry is registered
*unarmed* when the RTR leaves, and is not counted among the transfers under way
(:meth:`Landing.__len__`, which a drain waits on) until the sender's answer arms it: an RTR the
sender drops is never answered.

Layout: ``{node: {msg: entry}}``, so a peer's reset forgets its messages in O(its messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fabricd.errors import LocalProtocolError, RemoteProtocolError

#: cancelled messages remembered per node, whose late DATA is dropped rather than refused
CANCELLED_KEPT: Final = 1024


@dataclass(slots=True, eq=False)
class _Entry:
    """One message being received.

    Invariants: ``0 <= received <= nbytes``; ``op`` and ``region`` are both ``None`` (discarded)
    or both set, and then ``region.nbytes == nbytes``.
    """

    op: int | None  #: the receive it fills
    region: memoryview | None  #: a writable byte view; ``None``: count the bytes, drop them
    nbytes: int
    received: int = 0
    #: a chunk's view of ``region`` was handed out and its bytes are still being written there
    filling: bool = False
    armed: bool = True  #: counted in ``len()`` (an RTR's entry: once the sender answered it)


class Landing:
    """The incoming messages of one daemon, by sending node and message id."""

    def __init__(self) -> None:
        self._entries: dict[int, dict[int, _Entry]] = {}
        #: per node, the last CANCELLED_KEPT messages it cancelled, oldest first
        self._cancelled: dict[int, dict[int, None]] = {}
        self._count = 0
        #: payload bytes of expected messages that arrived (discarded ones included)
        self.bytes = 0

    def __len__(self) -> int:
        """Messages whose bytes are still coming (unarmed RTR entries aside)."""
        return self._count

    def expects(self, node: int, msg: int) -> bool:
        """Whether message ``msg`` from ``node`` is expected (discarded ones included)."""
        return self._entry(node, msg) is not None

    def received(self, node: int, msg: int) -> int | None:
        """Bytes of message ``msg`` from ``node`` that arrived so far (``None``: not expected)."""
        entry = self._entry(node, msg)
        return None if entry is None else entry.received

    def expect(
        self, node: int, msg: int, op: int, region: memoryview, *, armed: bool = True
    ) -> None:
        """The DATA of message ``msg`` from ``node`` fills receive ``op``'s ``region``
        (``armed=False``: an RTR's entry, not counted until :meth:`arm`).

        Raises:
            LocalProtocolError: the message is already expected, or ``region`` is read-only or
                empty (a zero-byte message has no DATA); a bug in the caller.
        """
        if self.expects(node, msg):
            raise LocalProtocolError(f"message {msg} from node {node} is already expected")
        if region.readonly or not region.nbytes:
            raise LocalProtocolError(f"receive {op} has no writable bytes for message {msg}")
        view = region.cast("B") if region.format != "B" or region.ndim != 1 else region
        entry = _Entry(op=op, region=view, nbytes=view.nbytes, armed=armed)
        self._entries.setdefault(node, {})[msg] = entry
        self._count += armed

    def arm(self, node: int, msg: int) -> None:
        """Count (``node``, ``msg``) among the transfers under way from now on."""
        entry = self._entry(node, msg)
        if entry is not None and not entry.armed:
            entry.armed = True
            self._count += 1

    def discard(self, node: int, msg: int) -> None:
        """The receiver of (``node``, ``msg``) left: keep counting its bytes, write them nowhere."""
        entry = self._entry(node, msg)
        if entry is not None:
            entry.op = entry.region = None

    def forget(self, node: int, msg: int) -> int | None:
        """No more DATA of (``node``, ``msg``) will be counted; return the receive it filled.

        ``None``: the message was not expected, or was discarded.
        """
        messages = self._entries.get(node)
        if messages is None or msg not in messages:
            return None
        entry = messages.pop(msg)
        if not messages:
            del self._entries[node]
        self._count -= entry.armed
        return entry.op

    def cancel(self, node: int, msg: int) -> int | None:
        """``node`` cancelled ``msg``: :meth:`forget` it, and drop its DATA still under way.

        Only a message that is expected can have DATA under way (DATA follows a CTS, and a
        message leaves this table only once complete, cancelled or reset), so only those are
        remembered: CANCELs of messages refused or never matched, which a client leaving with
        many sends causes by the thousand, must not push out the one whose late DATA is still
        coming (that DATA would then reset a healthy peer).

        Returns the receive it filled, as :meth:`forget` does.
        """
        if not self.expects(node, msg):
            return None
        cancelled = self._cancelled.setdefault(node, {})
        cancelled[msg] = None
        if len(cancelled) > CANCELLED_KEPT:
            del cancelled[next(iter(cancelled))]
        return self.forget(node, msg)

    def forget_node(self, node: int) -> list[int]:
        """The links to ``node`` were reset: forget its messages; return the receives they filled
        (discarded ones excepted)."""
        self._cancelled.pop(node, None)
        messages = self._entries.pop(node, {})
        self._count -= sum(entry.armed for entry in messages.values())
        return [entry.op for entry in messages.values() if entry.op is not None]

    def payload_buffer(self, node: int, msg: int, off: int, length: int) -> memoryview | None:
        """Where the ``length`` bytes of the DATA chunk of ``msg`` at ``off`` from ``node`` land;
        ``None``: read them and drop them (a discarded or cancelled message).

        Raises:
            RemoteProtocolError: the message was never asked for (or is complete), or the chunk
                does not continue it exactly where the last one stopped, or runs past its end;
                close the link it came on.
        """
        entry = self._entry(node, msg)
        if entry is None:
            if msg in self._cancelled.get(node, ()):
                return None
            what = f"message {msg}" if msg >= 0 else f"the message answering RTR {-msg}"
            raise RemoteProtocolError(
                f"DATA of {what}, which this node never asked node {node} for "
                "(no CTS or RTR), or which is complete"
            )
        if off != entry.received or off + length > entry.nbytes:
            raise RemoteProtocolError(
                f"DATA chunk [{off}, {off + length}) of message {msg} does not continue "
                f"at {entry.received} of {entry.nbytes} B"
            )
        if entry.region is None:
            return None
        entry.filling = True
        return entry.region[off : off + length]

    def filling(self, node: int, msg: int) -> bool:
        """Whether a chunk of (``node``, ``msg``) is being written into its receive's region now
        (between :meth:`payload_buffer` and :meth:`arrived`): until it is in, the receive must
        not be answered, or its client would reuse the region while the chunk still lands."""
        entry = self._entry(node, msg)
        return entry is not None and entry.filling and entry.op is not None

    def arrived(self, node: int, msg: int, length: int) -> bool:
        """A chunk of ``length`` bytes of (``node``, ``msg``) was written where
        :meth:`payload_buffer` said; return whether the message is now complete.

        Once it is, the caller :meth:`forget`\\ s it (to learn which receive it filled).
        """
        entry = self._entry(node, msg)
        if entry is None:
            return False
        entry.filling = False
        entry.received += length
        self.bytes += length
        return entry.received >= entry.nbytes

    def _entry(self, node: int, msg: int) -> _Entry | None:
        messages = self._entries.get(node)
        return None if messages is None else messages.get(msg)
