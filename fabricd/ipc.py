"""The client socket's vocabulary, shared by the client library and the daemon.

Clients talk to their daemon over a Unix stream socket with the same frames as the network
(:mod:`fabricd.wire`): REQUEST frames ``{"id", "op", ...}`` one way, and REPLY frames
``{"id", "ok", ...}`` and EVENT frames ``{"event", ...}`` (news the daemon pushes, at any moment)
the other (docs/protocol.md lists the ops and events).  Frames on this socket carry no payload:
tensor bytes stay in shared memory, and a request that brings segment fds says how many in its
``fds`` field and passes them with SCM_RIGHTS in the same ``sendmsg``.

Where the socket is: a daemon listens where its config says, by default on
:func:`default_socket_path`; a client that is not told (``$FABRICD_SOCKET``, ``socket_path=``)
tries each of :func:`socket_candidates`, the user's own runtime directory and then the system
location, so a user finds both a daemon of their own and the systemd one.

The daemon never hangs up on a client without saying why, when it can: a client refused at
accept, or closed for breaking the protocol, is first sent a closing EVENT
(:func:`closing_frame`), so the client raises the daemon's reason instead of guessing one.

Rules: this module is what both ends agree on, and nothing more; it loads no event loop and
nothing of the daemon, because every training script imports it (tests/unit/test_arrows.py).
The daemon's side of the socket is :mod:`fabricd.daemon.ipc_server`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from fabricd.slurm import job_has_daemon, job_socket_candidates
from fabricd.wire import Kind, Limits, encode_head

if TYPE_CHECKING:
    from fabricd.errors import ErrorCode

#: what the daemon accepts from a client: small requests, never a payload
REQUEST_LIMITS: Final = Limits(max_meta=16 * 1024, max_payload=0, kinds=frozenset({Kind.REQUEST}))
#: what a client accepts from the daemon: replies (status replies can list many peers), events
REPLY_LIMITS: Final = Limits(
    max_meta=4 * 1024 * 1024,
    max_payload=0,
    max_array=65536,
    max_map=4096,
    kinds=frozenset({Kind.REPLY, Kind.EVENT}),
)
#: the event the daemon sends just before it closes a connection: ``code`` and ``error`` say why
CLOSING_EVENT: Final = "closing"
#: the longest ``error`` of a closing event, in characters (a client decodes str up to 4096 B)
MAX_CLOSING_REASON: Final = 1000
#: the longest job name, in characters, that ``hello`` accepts
MAX_JOB_NAME: Final = 200


#: where the system's daemon (systemd's, or one root started) listens; tests point it elsewhere
SYSTEM_SOCKET = "/run/fabricd/fabricd.sock"


def socket_candidates() -> tuple[str, ...]:
    """Where a client looks for its daemon when nothing names the socket, in order.

    Inside a Slurm job (``$SLURM_JOB_ID``), the job's own daemon comes first, the one the
    prolog started (:func:`fabricd.slurm.job_socket`; docs/slurm.md).  Then a non-root user
    with ``$XDG_RUNTIME_DIR`` tries ``$XDG_RUNTIME_DIR/fabricd/fabricd.sock`` (a daemon of
    their own), then :data:`SYSTEM_SOCKET` (the one systemd runs for everybody): looking only in
    the runtime dir would miss the system daemon.  Root has no runtime-dir daemon.

    A job whose prolog started a daemon for it (its directory is there:
    :func:`fabricd.slurm.job_has_daemon`) gets that daemon's socket alone: if it is missing or
    refuses, falling back to the node's daemon would put the job's ranks on another fabric
    (another node list, another secret) without a word, so the client fails naming the job's
    socket instead.
    """
    if job_has_daemon(os.environ):
        return job_socket_candidates(os.environ)
    return job_socket_candidates(os.environ) + _node_candidates()


def _node_candidates() -> tuple[str, ...]:
    """The sockets of the node's daemons: the user's own, then the system's."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if os.geteuid() == 0 or not runtime:
        return (SYSTEM_SOCKET,)
    return (os.path.join(runtime, "fabricd", "fabricd.sock"), SYSTEM_SOCKET)


def default_socket_path() -> str:
    """Where a daemon listens when neither its config nor ``$FABRICD_SOCKET`` names a socket.

    The first of the node's candidates (:func:`socket_candidates` less a Slurm job's socket,
    which only the job's daemon is told to use): root (and systemd) use :data:`SYSTEM_SOCKET`,
    other users their own runtime dir, where their clients look first.
    """
    return _node_candidates()[0]


def closing_frame(code: ErrorCode, reason: str) -> bytes:
    """The closing EVENT ``{"event": "closing", "code": code, "error": reason}``, as bytes.

    The reason is cut to :data:`MAX_CLOSING_REASON` characters: it may quote what the client
    sent, and it must stay within what a client decodes.
    """
    meta = {"event": CLOSING_EVENT, "code": str(code), "error": reason[:MAX_CLOSING_REASON]}
    return encode_head(Kind.EVENT, meta, limits=REPLY_LIMITS)
