"""The point-to-point facet: MPI-like sends and receives between the ranks of a job.

``fab.send``/``fab.recv`` (and their ``_async`` forms) come here; the daemon's p2p engine
(:mod:`fabricd.engines.p2p.matching`) matches them by (source, destination, tag) and moves the bytes
between the two arrays' segments (docs/protocol.md §3.4).  Every argument is checked before
the request goes out (:mod:`fabricd.client.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from fabricd.client import checks
from fabricd.client.handle import Handle
from fabricd.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

    from fabricd.client.arrays import SharedArrays
    from fabricd.client.connection import Connection
    from fabricd.wire import Meta


#: when a send returns (see :meth:`PointToPoint.send`)
Wait = Literal["delivered", "sent"]
_WAITS: Final = ("delivered", "sent")


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A finished send or receive: the other rank, the tag, and the bytes moved."""

    peer: int
    tag: int
    nbytes: int


class PointToPoint:
    """Sends and receives of arrays made by ``fab.array()``, for a client that joined a job.

    Between a send and its completion the array must not be changed; between a receive and its
    completion it must not be read.
    """

    def __init__(
        self, connection: Connection, arrays: SharedArrays, job: checks.Membership | None
    ) -> None:
        self._connection = connection
        self._arrays = arrays
        self._job = job

    def send(
        self,
        array: np.ndarray[Any, Any],
        to: int,
        tag: int = 0,
        *,
        timeout: float | None = None,
        wait: Wait = "delivered",
    ) -> Completion:
        """Send ``array`` to rank ``to``.

        ``wait="delivered"`` (the default) returns once the receiver has all of it, and raises
        whatever went wrong on the way (a receive of another size, a rank that left).
        ``wait="sent"`` returns as soon as ``array`` may be changed again: for a message of at
        most the daemon's ``eager_limit`` (64 KiB by default) that goes eager, once the daemon
        holds a copy of its bytes, before the receiver has it -- a later failure is then
        reported only to the receiver (MPI_Send's buffered semantics).  A message that does
        not go eager (larger, or the daemon's credit at the receiver's node is used up) is
        never copied, so it returns on delivery either way.
        """
        return self.send_async(array, to, tag, wait=wait).wait(timeout)

    def recv(
        self, array: np.ndarray[Any, Any], src: int, tag: int = 0, *, timeout: float | None = None
    ) -> Completion:
        """Receive from rank ``src`` into ``array`` (same byte size and dtype as sent)."""
        return self.recv_async(array, src, tag).wait(timeout)

    def send_async(
        self, array: np.ndarray[Any, Any], to: int, tag: int = 0, *, wait: Wait = "delivered"
    ) -> Handle[Completion]:
        """Start a send; leave ``array`` unchanged until the handle is done (``wait``: as for
        :meth:`send`).

        Raises:
            UsageError: no job joined, ``to`` or ``tag`` not an int in range, ``array`` not
                (a contiguous slice of) a ``fab.array()``, or ``wait`` not one of
                ``"delivered"``, ``"sent"``.
        """
        if wait not in _WAITS:
            raise UsageError(f"wait must be one of {', '.join(map(repr, _WAITS))}, not {wait!r}")
        return self._transfer("send", array, to, "to", tag, wait)

    def recv_async(self, array: np.ndarray[Any, Any], src: int, tag: int = 0) -> Handle[Completion]:
        """Start a receive; don't read ``array`` until the handle is done.

        Raises:
            UsageError: as for :meth:`send_async`, or ``array`` is read-only.
        """
        return self._transfer("recv", array, src, "src", tag)

    def _transfer(
        self,
        op: str,
        array: np.ndarray[Any, Any],
        peer: object,
        name: str,
        tag: object,
        wait: Wait = "delivered",
    ) -> Handle[Completion]:
        if self._job is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        rank, number = checks.peer(peer, name, self._job), checks.tag(tag)
        seg, offset, dtype = self._arrays.where(array)
        if op == "recv" and not array.flags.writeable:
            raise UsageError("cannot receive into a read-only array")
        fields = {
            "seg": seg,
            "off": offset,
            "nbytes": array.nbytes,
            "dtype": dtype,
            "peer": rank,
            "tag": number,
        }
        if wait != "delivered":
            fields["wait"] = wait
        what = f"{op} {'to' if op == 'send' else 'from'} rank {rank} (tag {number})"

        def completion(reply: Meta) -> Completion:
            return Completion(peer=rank, tag=int(reply["tag"]), nbytes=int(reply["nbytes"]))

        call = self._connection.submit(op, fields, what=what)
        return Handle(self._connection, call, completion)
