"""The client socket: where it lives, who may use it, and the daemon's side of it.

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

Access control: the socket file is mode 0660 inside a runtime directory the
operator restricts (0750 under systemd), it is always a filesystem path (abstract sockets have
no permissions), and every connection's SO_PEERCRED uid/gid is checked against the allow-list
before a single byte of it is read; refusals are logged with the peer's pid, uid and gid.

The daemon never hangs up on a client without saying why, when it can: a client refused at
accept, or closed for breaking the protocol, is first sent a closing EVENT
``{"event": "closing", "code", "error"}`` (best effort, without blocking), so the client raises
the daemon's reason instead of guessing one.

The daemon reads with ``recvmsg`` from the event loop's reader callback (asyncio streams cannot
receive fds) and writes replies without blocking; a client that stops reading its replies is
disconnected once ``MAX_OUTBOUND`` bytes are waiting for it, so it cannot make the daemon grow.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.errors import ConfigError, ErrorCode, LocalProtocolError, ProtocolError
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, Limits, Meta, encode_head

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

log = logging.getLogger("fabricd.ipc")

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
MAX_FDS_PER_REQUEST: Final = 4
MAX_PENDING_FDS: Final = 16
MAX_OUTBOUND: Final = 8 * 1024 * 1024
_RECV_SIZE: Final = 64 * 1024
_FD_SPACE: Final = socket.CMSG_SPACE(MAX_FDS_PER_REQUEST * struct.calcsize("i"))
#: SO_PEERGROUPS from <asm-generic/socket.h>; the socket module does not name it
_SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS: Final = 1024


#: where the system's daemon (systemd's, or one root started) listens; tests point it elsewhere
SYSTEM_SOCKET = "/run/fabricd/fabricd.sock"


def socket_candidates() -> tuple[str, ...]:
    """Where a client looks for its daemon when nothing names the socket, in order.

    A non-root user with ``$XDG_RUNTIME_DIR`` first tries ``$XDG_RUNTIME_DIR/fabricd/fabricd.sock``
    (a daemon of their own), then :data:`SYSTEM_SOCKET` (the one systemd runs for everybody):
    looking only in the runtime dir would miss the system daemon.  Root has no runtime-dir daemon.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if os.geteuid() == 0 or not runtime:
        return (SYSTEM_SOCKET,)
    return (os.path.join(runtime, "fabricd", "fabricd.sock"), SYSTEM_SOCKET)


def default_socket_path() -> str:
    """Where a daemon listens when neither its config nor ``$FABRICD_SOCKET`` names a socket.

    The first of :func:`socket_candidates`: root (and systemd) use :data:`SYSTEM_SOCKET`, other
    users their own runtime dir, where their clients look first.
    """
    return socket_candidates()[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Credentials:
    """What the kernel says about the process at the other end (at its connect time)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()  #: supplementary groups, where the kernel tells

    def allowed(self, uids: set[int], gids: set[int]) -> bool:
        """Whether the uid, the primary gid or a supplementary group is on the lists."""
        return self.uid in uids or self.gid in gids or not gids.isdisjoint(self.groups)


def peer_credentials(sock: socket.socket) -> Credentials:
    """Read SO_PEERCRED (and SO_PEERGROUPS) of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Credentials(pid=pid, uid=uid, gid=gid, groups=_peer_groups(sock))


def _peer_groups(sock: socket.socket) -> frozenset[int]:
    """The peer's supplementary groups (Linux >= 4.13); empty where the kernel can't say.

    SO_PEERCRED carries only the primary gid, but operators grant socket access by adding
    training users to a group, which is usually a supplementary one.
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError:
        return frozenset()
    return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


class RequestHandler(Protocol):
    """The daemon's side of client sessions."""

    def client_request(self, conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
        """Handle one request; the handler owns ``fds`` and must reply via ``conn.reply``."""

    def client_gone(self, conn: IpcConnection) -> None:
        """The client disconnected (or was disconnected); release what it held."""


class IpcConnection:
    """One connected client, read and written from the event loop without blocking."""

    def __init__(
        self, cid: int, sock: socket.socket, creds: Credentials, server: IpcServer
    ) -> None:
        self.id = cid
        self.credentials = creds
        self.close_reason: str | None = None
        self._sock = sock
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._decoder = Decoder(REQUEST_LIMITS)
        self._fds: collections.deque[int] = collections.deque()
        self._out = bytearray()
        self._writing = False
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def reply(self, meta: Meta) -> None:
        """Queue a REPLY frame; disconnects the client if too much is already queued."""
        if self.closed:
            return
        self._out += encode_head(Kind.REPLY, meta, limits=REPLY_LIMITS)
        self._flush()

    def reply_error(self, request_id: int, code: str, message: str) -> None:
        self.reply({"id": request_id, "ok": False, "code": code, "error": message})

    def push(self, event: str, fields: Mapping[str, object]) -> None:
        """Queue an EVENT frame ``{"event": event, **fields}`` for the client.

        Events share the replies' outbound bound: a client that reads neither is disconnected
        once ``MAX_OUTBOUND`` bytes wait for it.  The client library queues events for
        ``Client.poll()`` (docs/protocol.md, "Events").

        Raises:
            LocalProtocolError: the event is ``closing`` (:meth:`close` sends that one),
                ``fields`` has an ``event`` key, or it is over the client's limits (a daemon
                bug; nothing is queued).
        """
        if event == CLOSING_EVENT or "event" in fields:
            raise LocalProtocolError(f"cannot push event {event!r} with fields {sorted(fields)}")
        if self.closed:
            return
        self._out += encode_head(Kind.EVENT, {"event": event, **fields}, limits=REPLY_LIMITS)
        self._flush()

    def close(self, reason: str, *, code: ErrorCode | None = ErrorCode.PROTOCOL) -> None:
        """Disconnect the client; its session is released through ``client_gone``.

        With a ``code`` (by default ``protocol``: the client broke the protocol) the client is
        told why first, with a closing EVENT written behind what is still queued for it, without
        blocking and on a best-effort basis: what the socket does not take at once is dropped.
        ``code=None`` closes without a word, for a client that left or cannot be written to.
        """
        if self.closed:
            return
        if code is not None:
            self._out += closing_frame(code, reason)
            with contextlib.suppress(OSError):
                self._sock.send(self._out)
        self.close_reason = reason
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()
        while self._fds:
            os.close(self._fds.popleft())
        self._server.forget(self)

    def _on_readable(self) -> None:
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(_RECV_SIZE, _FD_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(f"read failed: {exc.strerror}", code=None)
            return
        self._collect_fds(ancdata)
        if flags & socket.MSG_CTRUNC:
            self.close(f"protocol error: more than {MAX_FDS_PER_REQUEST} fds in one message")
            return
        if not data:
            self.close("disconnected", code=None)
            return
        try:
            self._decoder.feed(data)
            self._dispatch()
        except ProtocolError as exc:
            self.close(f"protocol error: {exc}")

    def _collect_fds(self, ancdata: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % struct.calcsize("i")
                self._fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if len(self._fds) > MAX_PENDING_FDS:
            self.close(f"protocol error: more than {MAX_PENDING_FDS} fds without requests")

    def _dispatch(self) -> None:
        while not self.closed:
            event = self._decoder.next_event()
            if event is NEED_DATA:
                return
            if not isinstance(event, Frame):
                continue
            wanted = event.meta.get("fds", 0)
            if type(wanted) is not int or not 0 <= wanted <= MAX_FDS_PER_REQUEST:
                raise ProtocolError("field 'fds' must be an integer in [0, 4]")
            if wanted > len(self._fds):
                raise ProtocolError(f"request announced {wanted} fds but fewer arrived")
            fds = [self._fds.popleft() for _ in range(wanted)]
            self._server.handler.client_request(self, event.meta, fds)

    def _flush(self) -> None:
        try:
            sent = self._sock.send(self._out) if self._out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.close(f"write failed: {exc.strerror}", code=None)
            return
        del self._out[:sent]
        if len(self._out) > MAX_OUTBOUND:
            self.close(f"client is not reading its replies ({len(self._out)} B queued)", code=None)
        elif self._out and not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._on_writable)
        elif not self._out and self._writing:
            self._writing = False
            self._loop.remove_writer(self._sock.fileno())

    def _on_writable(self) -> None:
        if not self.closed:
            self._flush()


class IpcServer:
    """Listens on the client socket and admits allowed clients.

    Args:
        path: the socket path (absolute).
        handler: the daemon's request handler.
        allowed_uids, allowed_gids: who may connect besides root and the daemon's own uid/gid.
        max_clients: connections beyond this are refused with a logged reason.
    """

    def __init__(
        self,
        path: str,
        handler: RequestHandler,
        *,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
        max_clients: int = 256,
    ) -> None:
        if not path.startswith("/"):
            raise ConfigError(f"socket {path!r} must be an absolute path")
        self.path = path
        self.handler = handler
        self.allowed_uids = {0, os.geteuid(), *allowed_uids}
        self.allowed_gids = {os.getegid(), *allowed_gids}
        self.max_clients = max_clients
        self.connections: dict[int, IpcConnection] = {}
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self.refused = 0

    def start(self) -> None:
        """Bind (removing a stale socket file), set mode 0660, and accept from the loop.

        Raises:
            ConfigError: another daemon serves this path, or it cannot be bound.
        """
        self._remove_stale()
        os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old_umask = os.umask(0o117)  # the socket is created 0660, never briefly wider
            try:
                sock.bind(self.path)
            finally:
                os.umask(old_umask)
            os.chmod(self.path, 0o660)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on socket {self.path}: {exc.strerror}") from None
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_accept)

    def _remove_stale(self) -> None:
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"socket path {self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except OSError:
            os.unlink(self.path)  # nobody listens: left over from a daemon that died
            return
        finally:
            probe.close()
        raise ConfigError(f"another fabricd already serves {self.path}; stop it first")

    def _on_accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("accept on %s failed: %s", self.path, exc.strerror)
            return
        conn.setblocking(False)
        creds = peer_credentials(conn)
        allowed = creds.allowed(self.allowed_uids, self.allowed_gids)
        if not allowed or len(self.connections) >= self.max_clients:
            self._refuse(conn, creds, allowed=allowed)
            return
        cid = next(self._ids)
        self.connections[cid] = IpcConnection(cid, conn, creds, self)
        log.debug("client %d connected: pid=%d uid=%d gid=%d", cid, creds.pid, creds.uid, creds.gid)

    def _refuse(self, conn: socket.socket, creds: Credentials, *, allowed: bool) -> None:
        """Log, count and close a client it does not admit, telling it why first."""
        why = "not in allowed_uids/allowed_gids" if not allowed else "max_clients reached"
        log.warning("refused client pid=%d uid=%d gid=%d: %s", creds.pid, creds.uid, creds.gid, why)
        self.refused += 1
        if not allowed:
            reason = (
                f"uid {creds.uid} (gid {creds.gid}) may not use this daemon: it admits root, its "
                "own uid and gid, and its allowed_uids/allowed_gids; ask its operator to add "
                "your uid or one of your groups"
            )
        else:
            reason = (
                f"the daemon already serves max_clients ({self.max_clients}) clients; try again "
                "when one has left, or raise max_clients in its config"
            )
        with contextlib.suppress(OSError):  # non-blocking: a full socket just gets no reason
            conn.send(closing_frame(ErrorCode.REFUSED, reason))
        conn.close()

    def forget(self, conn: IpcConnection) -> None:
        if self.connections.pop(conn.id, None) is None:
            return
        reason = conn.close_reason or ""
        level = logging.DEBUG if reason in ("disconnected", "daemon stopping") else logging.WARNING
        log.log(level, "client %d (pid %d) disconnected: %s", conn.id, conn.credentials.pid, reason)
        self.handler.client_gone(conn)

    def stop_accepting(self) -> None:
        """Refuse new clients (remove the socket file); connected ones stay."""
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Stop accepting, disconnect every client, and remove the socket file."""
        self.stop_accepting()
        for conn in list(self.connections.values()):
            conn.close("daemon stopping", code=ErrorCode.DAEMON_STOPPING)


def closing_frame(code: ErrorCode, reason: str) -> bytes:
    """The closing EVENT ``{"event": "closing", "code": code, "error": reason}``, as bytes.

    The reason is cut to :data:`MAX_CLOSING_REASON` characters: it may quote what the client
    sent, and it must stay within what a client decodes.
    """
    meta = {"event": CLOSING_EVENT, "code": str(code), "error": reason[:MAX_CLOSING_REASON]}
    return encode_head(Kind.EVENT, meta, limits=REPLY_LIMITS)
