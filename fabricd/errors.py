"""The one error hierarchy of fabricd.

Every error a user, a peer or an operator can meet is a :class:`FabricError`.  The kinds below
each come with a defined reaction:

===========================  ====================================================================
kind                         what the caller does
===========================  ====================================================================
``ProtocolError``            a frame broke the wire rules: close the connection that sent it
  ``RemoteProtocolError``    the other side did it; close *that* link only and log why
  ``LocalProtocolError``     we did it: a bug in fabricd, report it
``TransportError``           the link is in an unknown state: drop it and reconnect
``UsageError``               the caller's input is wrong: fix the call (the message says how)
``ConfigError``              the configuration is wrong: fix the file/flag named in the message
``DaemonUnavailable``        no daemon answers on the socket: start one (the message says how)
``PeerFailed``               a rank's node went down or the rank left: the operation cannot finish
``OperationFailed``          the operation was refused or aborted by the daemon (code says why)
  ``PermissionDenied``       the job belongs to another user: pick another job name, or have
                             the operator grant your group the job (``job_groups``)
``Timeout``                  a wait ran out; the operation is still under way: wait again
===========================  ====================================================================

``ProtocolError`` is also a ``ValueError`` so that decoders behave like the standard library's
parsers: a fuzzer feeding junk sees one documented error type and nothing else.
"""

from __future__ import annotations

import enum


class FabricError(Exception):
    """Root of every error fabricd raises on purpose."""


class ProtocolError(FabricError, ValueError):
    """A frame or message broke the wire rules (docs/protocol.md)."""


class RemoteProtocolError(ProtocolError):
    """The other side sent something malformed; close that connection only."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids (a fabricd bug)."""


class TransportError(FabricError):
    """A link failed or was closed; its state is unknown, so it must be recreated."""


class UsageError(FabricError):
    """The caller passed something wrong: a bad shape, dtype, rank or array."""


class ConfigError(FabricError):
    """The configuration (file, environment or flag) is invalid."""


class DaemonUnavailable(FabricError):
    """No fabricd daemon answers on the client socket."""


class OperationFailed(FabricError):
    """The daemon could not carry out an operation.

    Attributes:
        code: a short machine-readable reason (docs/protocol.md lists them).
    """

    def __init__(self, message: str, *, code: str = "failed") -> None:
        super().__init__(message)
        self.code = code


class PeerFailed(OperationFailed):
    """The node that hosts a rank went down, or the rank left, before the operation finished.

    Attributes:
        rank: the rank that was lost, if known.
        node: the node id that was lost, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        node: int | None = None,
        code: str = "peer_failed",
    ) -> None:
        super().__init__(message, code=code)
        self.rank = rank
        self.node = node


class PermissionDenied(OperationFailed):
    """The job belongs to another user, and no ``job_groups`` entry grants one of your groups it.

    Nothing was joined.  Use another job name, or ask the operator to grant a group you are in
    access to the job (docs/operations.md, "Jobs and their owners").
    """

    def __init__(self, message: str, *, code: str = "permission") -> None:
        super().__init__(message, code=code)


class Timeout(FabricError, TimeoutError):
    """A wait ran out of time.  The operation itself goes on; its handle can be waited again."""


class ErrorCode(enum.StrEnum):
    """The machine-readable reason a failed operation carries (docs/protocol.md, "Error codes").

    The daemon puts one in every failure it reports (REPLY ``code``, DONE ``code``); the client
    turns it back into an exception with :func:`error_for`.  A code this release does not know
    (a newer daemon) is kept as a plain string and raises :class:`OperationFailed`.
    """

    USAGE = "usage"  #: the request was wrong; the message says what
    MISMATCH = "mismatch"  #: a send met its receive but sizes or dtypes differ
    PEER_FAILED = "peer_failed"  #: the other rank's node went down, or the rank left
    RECEIVER_LEFT = "receiver_left"  #: the receiving rank left before taking the message
    NO_SUCH_RANK = "no_such_rank"  #: the other rank did not join within route_timeout
    TRANSPORT = "transport"  #: the data link broke while streaming
    DAEMON_STOPPING = "daemon_stopping"  #: the daemon is draining
    LIMIT = "limit"  #: a configured bound was reached; the message names it and its setting
    RESOURCES = "resources"  #: the daemon's system ran out (memory, address space, fds, threads)
    PERMISSION = "permission"  #: the job belongs to another user; job_groups grants access
    INTERNAL = "internal"  #: a bug in the daemon (its log has the traceback)
    PROTOCOL = "protocol"  #: the client broke the protocol; the daemon closes the connection
    REFUSED = "refused"  #: the daemon refused the connection at accept (uid not allowed, full)
    FAILED = "failed"  #: a failure that named no code
    DAEMON_GONE = "daemon_gone"  #: client-side only: the connection to the daemon is gone


def error_for(
    code: str, message: str, *, rank: int | None = None, node: int | None = None
) -> FabricError:
    """The exception a failure with ``code`` raises in the client (the docs/protocol.md table)."""
    if code in (ErrorCode.PEER_FAILED, ErrorCode.RECEIVER_LEFT):
        return PeerFailed(message, rank=rank, node=node, code=code)
    if code in (ErrorCode.USAGE, ErrorCode.MISMATCH):
        return UsageError(message)
    if code == ErrorCode.PERMISSION:
        return PermissionDenied(message)
    if code in (ErrorCode.DAEMON_GONE, ErrorCode.PROTOCOL, ErrorCode.REFUSED):
        return DaemonUnavailable(message)
    return OperationFailed(message, code=code)


def code_of(exc: FabricError) -> ErrorCode | str:
    """The wire code the daemon reports for ``exc`` raised while handling a request."""
    if isinstance(exc, OperationFailed):
        return exc.code
    if isinstance(exc, ProtocolError):
        return ErrorCode.PROTOCOL
    return ErrorCode.USAGE
