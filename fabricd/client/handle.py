"""A handle on an operation in progress, the one waiting API of every facet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client.connection import Call, Connection
    from fabricd.wire import Meta

T = TypeVar("T")


class Handle(Generic[T]):
    """An operation in progress.  :meth:`wait` until it is done; waiting again is allowed.

    Any thread may wait on any handle; the one that reads the socket delivers to all of them.
    """

    def __init__(self, connection: Connection, call: Call, result: Callable[[Meta], T]) -> None:
        self._connection = connection
        self._call = call
        self._result = result

    @property
    def request(self) -> int:
        """The request id on the client socket (what the daemon's log and status show)."""
        return self._call.id

    @property
    def what(self) -> str:
        """The operation, as messages name it (e.g. ``send to rank 1 (tag 0)``)."""
        return self._call.what

    def done(self) -> bool:
        """Whether the operation has finished (reads any replies already waiting, never blocks)."""
        return self._connection.ready(self._call)

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finishes and return its result.

        Raises:
            Timeout: ``timeout`` seconds passed; the operation goes on, wait again later.
            PeerFailed: the other rank's node went down or the rank left.
            UsageError: the request was wrong (the message says what).
            OperationFailed: the daemon could not do it (``code`` says why).
            DaemonUnavailable: the daemon went away.
        """
        reply = self._connection.wait(self._call, timeout)
        return self._result(reply.result(self._call.what))
