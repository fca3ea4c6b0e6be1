"""The daemon's side of the client socket: who may use it, and each client's connection.

The socket's vocabulary (request and reply limits, the closing event, where the socket is) is
:mod:`fabricd.ipc`, which the client library shares; this module is the server that speaks it.

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
The first reply or event a read callback (a client's requests, or a peer's frames) queues for a
client is sent at once; the ones after it are held and leave in one ``send`` when the callback
returns (transports/batch.py).

Nothing a client does holds a slot or the loop for free:

* a connection must send its first request (the client library's ``hello``) within
  ``client_hello_timeout``, and finish every frame it starts within ``client_frame_timeout``, or
  it is closed with a closing EVENT saying which; a client that sent its first request and
  then waits, however long, is never timed out (an idle training process is normal);
* when ``accept`` fails for lack of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM) the connection
  stays queued and the listening socket readable, so accepting again at once would spin.  At
  the fd limit the server closes a spare fd it keeps for this, accepts the queued client with
  it and refuses it with the reason (so a client is told, not left waiting); otherwise, or if
  the spare cannot be had back, it stops accepting for a pause that doubles from
  :data:`ACCEPT_PAUSE_MIN` to :data:`ACCEPT_PAUSE_MAX` while it lasts (a lost spare is taken
  again at the next accept that succeeds);
* every refusal says its own reason (uid not allowed, ``max_clients``, out of file descriptors,
  daemon stopping) and is counted in :meth:`IpcServer.counters`; log lines that clients cause
  go through :class:`~fabricd.daemon.logs.RateLimitedLog` (a burst per kind, then a count).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import os
import resource
import socket
import stat
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.daemon.logs import RateLimitedLog
from fabricd.dirs import make_dirs, unsafe_directory
from fabricd.errors import ConfigError, ErrorCode, LocalProtocolError, ProtocolError
from fabricd.ipc import CLOSING_EVENT, REPLY_LIMITS, REQUEST_LIMITS, closing_frame
from fabricd.transports import batch
from fabricd.wire import HEADER_SIZE, NEED_DATA, Decoder, Frame, Kind, Meta, encode_head

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

#: the client socket's logger: its name, which log lines show, is older than this module
log = logging.getLogger("fabricd.ipc")
#: lines that clients cause (refusals, timeouts, failed accepts): a burst per kind, then counted
remote_log = RateLimitedLog(log)

#: the most fds one request may bring (its ``fds`` field), and the most one message may carry
MAX_FDS_PER_REQUEST: Final = 4
MAX_PENDING_FDS: Final = 16
MAX_OUTBOUND: Final = 8 * 1024 * 1024
#: the listen backlog, and the most queued clients told "stopping" when the daemon stops
_MAX_QUEUED: Final = 128
#: bytes read from one client per read callback: what one client may make the loop handle
#: before the others are read again.  4 KiB is 20 to 40 requests, about 1 ms of work; 64 KiB
#: was 560 waiting collective calls, 11 ms, and another tenant's round trip waited for several
#: such batches (issue 28, item 1: tests/integration/test_tenant_cost.py).  A request is a few
#: hundred bytes and its data travels in shared memory, so the extra reads cost little
_RECV_SIZE: Final = 4 * 1024
#: reads that cover the largest request a client may send (``REQUEST_LIMITS``), and its header
_RESCUE_READS: Final = -(-(REQUEST_LIMITS.max_meta + HEADER_SIZE) // _RECV_SIZE) + 1
_FD_SPACE: Final = socket.CMSG_SPACE(MAX_FDS_PER_REQUEST * struct.calcsize("i"))
#: SO_PEERGROUPS from <asm-generic/socket.h>; the socket module does not name it
_SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
#: the supplementary groups read through Python's getsockopt, which reads at most 1024 bytes and
#: raises for a longer buffer (which left every client without groups when this asked for
#: 4096); a peer in more groups gets ERANGE, and is read again through libc (_peer_groups_libc)
_MAX_GROUPS: Final = 256
#: Linux's NGROUPS_MAX: the most supplementary groups a process can have
_NGROUPS_MAX: Final = 65536
#: ``accept`` errors that leave the connection queued: the daemon or the system lacks something
_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: the first pause of accepting after such an error, in seconds; each next one doubles ...
ACCEPT_PAUSE_MIN: Final = 0.05
#: ... up to this; a successful accept starts again from the first
ACCEPT_PAUSE_MAX: Final = 2.0
#: where the spare fd points: any file that can always be opened
_SPARE_PATH: Final = os.devnull
#: the rate-limited log's key (a constant per kind) for each reason a client is refused
_REFUSED_KEYS: Final = {
    "not_allowed": "clients refused (uid not allowed)",
    "max_clients": "clients refused (max_clients)",
    "max_clients_per_uid": "clients refused (max_clients_per_uid)",
    "stopping": "clients refused (daemon stopping)",
}


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
    training users to a group, which is usually a supplementary one (a Kubernetes pod's
    ``supplementalGroups``: docs/deployment.md).
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError as exc:
        if exc.errno != errno.ERANGE:
            return frozenset()
        raw = _peer_groups_libc(sock.fileno())
    return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def _peer_groups_libc(fd: int) -> bytes:
    """SO_PEERGROUPS of ``fd`` read through libc's getsockopt, with room for
    :data:`_NGROUPS_MAX` groups (a peer in more than Python's getsockopt can hold); b"" when
    that fails too.  Called only for such a peer, so the 256 KiB buffer is rare."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return b""
    buffer = ctypes.create_string_buffer(4 * _NGROUPS_MAX)
    length = ctypes.c_uint32(len(buffer))
    if libc.getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, buffer, ctypes.byref(length)):
        return b""
    return buffer.raw[: length.value]


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
        self._decoder = Decoder(REQUEST_LIMITS, heads=False)  # requests carry no payload
        self._fds: collections.deque[int] = collections.deque()
        self._out = bytearray()
        self._writing = False
        self._holding = False  #: this read callback sent the client something: hold the rest
        self._failed = False  #: a write failed: nothing more is written; it closes next round
        self._first = True  #: no request has come yet
        self.timed_out = False  #: closed for a deadline (client_hello/frame_timeout) it missed
        #: the one deadline a connection has: its first request, then only the frame it is in
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(
            server.hello_timeout,
            self._time_out,
            f"no request within client_hello_timeout ({server.hello_timeout:g} s) of "
            "connecting (a client sends hello first); the daemon closed the connection to free "
            "its slot",
        )
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def reply(self, meta: Meta) -> None:
        """Queue a REPLY frame; disconnects the client if too much is already queued."""
        if self.closed or self._failed:
            return
        self._out += encode_head(Kind.REPLY, meta, limits=REPLY_LIMITS)
        self._send()

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
        if self.closed or self._failed:
            return
        self._out += encode_head(Kind.EVENT, {"event": event, **fields}, limits=REPLY_LIMITS)
        self._send()

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()
        while self._fds:
            os.close(self._fds.popleft())
        self._server.forget(self)

    def _on_readable(self) -> int:
        """Read once and handle every whole request; returns how many there were.

        What the requests send leaves once they are all handled (transports/batch.py).
        """
        batch.hold()
        try:
            return self._read()
        finally:
            batch.release()

    def _read(self) -> int:
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(_RECV_SIZE, _FD_SPACE)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.close(f"read failed: {exc.strerror}", code=None)
            return 0
        self._collect_fds(ancdata)
        if flags & socket.MSG_CTRUNC:
            self.close(f"protocol error: more than {MAX_FDS_PER_REQUEST} fds in one message")
            return 0
        if not data:
            self.close("disconnected", code=None)
            return 0
        try:
            self._decoder.feed(data)
            handled = self._dispatch()
            self._check_fds()
        except ProtocolError as exc:
            self.close(f"protocol error: {exc}")
            return 0
        self._watch(handled)
        return handled

    def _check_fds(self) -> None:
        """Fds may wait only for the one frame still arriving.

        A client sends a request and its fds in one ``sendmsg``, so the fds come with the
        frame's first byte and every whole frame has taken its own by now: what is left belongs
        to the frame under way, or to nothing (kept, they would count against no budget).

        Raises:
            ProtocolError: fds left with no frame under way, or more than one request takes.
        """
        if self.closed or not self._fds:
            return
        if not self._decoder.mid_frame:
            raise ProtocolError(f"{len(self._fds)} fds arrived with no request that announces them")
        if len(self._fds) > MAX_FDS_PER_REQUEST:
            raise ProtocolError(
                f"{len(self._fds)} fds arrived for one request (at most {MAX_FDS_PER_REQUEST})"
            )

    def _watch(self, handled: int) -> None:
        """After a read: a frame left unfinished must be finished within client_frame_timeout.

        The deadline runs from the read that left a frame unfinished, and is dropped (or set
        again) once a frame completes; before the first request the hello deadline holds.
        """
        if self.closed or self._first:
            return
        if handled and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and self._decoder.mid_frame:
            timeout = self._server.frame_timeout
            self._timer = self._loop.call_later(
                timeout,
                self._time_out,
                f"a frame was left unfinished for client_frame_timeout ({timeout:g} s); the "
                "daemon closed the connection",
            )

    def _time_out(self, reason: str) -> None:
        self._timer = None
        # A loop that was busy elsewhere for as long as the deadline may run it before it
        # reads what came meanwhile (libuv, so uvloop, runs due timers before it polls): the
        # client is cut only if what it owed has not arrived.  Reads are _RECV_SIZE at a time,
        # and a request's metadata may be up to 64 KiB: read as many as the largest needs (one
        # that finds nothing costs a system call), never more, so this gives it no more time
        for _ in range(_RESCUE_READS):
            if self._on_readable() or self.closed:
                return
        self.timed_out = True
        self._server.timed_out(self, reason)
        self.close(reason)

    def _collect_fds(self, ancdata: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % struct.calcsize("i")
                self._fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if len(self._fds) > MAX_PENDING_FDS:
            self.close(f"protocol error: more than {MAX_PENDING_FDS} fds without requests")

    def _dispatch(self) -> int:
        """Hand every complete request to the handler; returns how many there were."""
        handled = 0
        while not self.closed:
            event = self._decoder.next_event()
            if event is NEED_DATA:
                break
            if not isinstance(event, Frame):
                continue
            handled += 1
            if self._first:  # the hello deadline is met
                self._first = False
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            wanted = event.meta.get("fds", 0)
            if type(wanted) is not int or not 0 <= wanted <= MAX_FDS_PER_REQUEST:
                raise ProtocolError("field 'fds' must be an integer in [0, 4]")
            if wanted > len(self._fds):
                raise ProtocolError(f"request announced {wanted} fds but fewer arrived")
            fds = [self._fds.popleft() for _ in range(wanted)]
            self._server.handler.client_request(self, event.meta, fds)
        return handled

    def _send(self) -> None:
        """What was just queued: sent at once if it is the first of this read callback, else
        held until the callback returns."""
        if not self._holding:
            self._holding = batch.defer(self._flush_held)
            self._flush()

    def _fail(self, reason: str) -> None:
        """The client cannot be written to: write nothing more, and disconnect it once the code
        that wrote has returned.  A reply is often written amid a service's work (a batch of
        engine actions); disconnecting at once released the client's session right there, and
        abandoned its other operations while actions for them were still to be performed."""
        self._failed = True
        self._out.clear()
        self._loop.call_soon(functools.partial(self.close, reason, code=None))

    def _flush_held(self) -> None:
        self._holding = False
        self._flush()

    def _flush(self) -> None:
        """Send what is queued, without blocking; watch for writability while some is left."""
        if self.closed or self._failed:  # since it was queued (a deferred flush, writability)
            return
        try:
            sent = self._sock.send(self._out) if self._out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._fail(f"write failed: {exc.strerror}")
            return
        del self._out[:sent]
        if len(self._out) > MAX_OUTBOUND:
            self._fail(f"client is not reading its replies ({len(self._out)} B queued)")
        elif self._out and not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._flush)
        elif not self._out and self._writing:
            self._writing = False
            self._loop.remove_writer(self._sock.fileno())


class IpcServer:
    """Listens on the client socket and admits allowed clients.

    Args:
        path: the socket path (absolute).
        handler: the daemon's request handler.
        allowed_uids, allowed_gids: who may connect besides root and the daemon's own uid/gid.
        max_clients: connections beyond this are refused with a logged reason.
        max_clients_per_uid: connections of one uid beyond this are refused, so one user
            cannot take every slot; root and the daemon's own uid (operators) are exempt.
        hello_timeout: seconds a new connection has to send its first request
            (``client_hello_timeout``).
        frame_timeout: seconds a connection may leave a frame unfinished
            (``client_frame_timeout``).
    """

    def __init__(
        self,
        path: str,
        handler: RequestHandler,
        *,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
        max_clients: int = 256,
        max_clients_per_uid: int = 192,
        hello_timeout: float = 10.0,
        frame_timeout: float = 10.0,
    ) -> None:
        if not path.startswith("/"):
            raise ConfigError(f"socket {path!r} must be an absolute path")
        self.path = path
        self.handler = handler
        self.allowed_uids = {0, os.geteuid(), *allowed_uids}
        self.allowed_gids = {os.getegid(), *allowed_gids}
        self.max_clients = max_clients
        self.max_clients_per_uid = max_clients_per_uid
        self._operators = {0, os.geteuid()}
        self.hello_timeout = hello_timeout
        self.frame_timeout = frame_timeout
        self.connections: dict[int, IpcConnection] = {}
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._spare: int | None = None  #: an fd given up at the fd limit to refuse with a reason
        self._paused: asyncio.TimerHandle | None = None  #: set while accepting is paused
        self._next_pause = ACCEPT_PAUSE_MIN
        self.refused = 0  #: clients refused at accept, for any reason
        #: refusals by reason: not_allowed, max_clients, max_clients_per_uid, no_fds, stopping
        self.refused_by: collections.Counter[str] = collections.Counter()
        self.accept_errors = 0  #: accepts that failed for lack of a resource (EMFILE...)
        self.accept_pauses = 0  #: times accepting was paused after such a failure
        self.clients_timed_out = 0  #: closed for client_hello_timeout or client_frame_timeout

    def counters(self) -> dict[str, int]:
        """The client socket's status counters (the node merges them into ``status``)."""
        return {
            "refused_clients": self.refused,
            "refused_clients_not_allowed": self.refused_by["not_allowed"],
            "refused_clients_max_clients": self.refused_by["max_clients"],
            "refused_clients_max_clients_per_uid": self.refused_by["max_clients_per_uid"],
            "refused_clients_no_fds": self.refused_by["no_fds"],
            "refused_clients_stopping": self.refused_by["stopping"],
            "accept_errors": self.accept_errors,
            "accept_pauses": self.accept_pauses,
            "clients_timed_out": self.clients_timed_out,
        }

    def start(self) -> None:
        """Bind (removing a stale socket file), set mode 0660, and accept from the loop.

        The socket's directory, if missing, is created 0750 (and so are its missing parents),
        whatever the umask; one that exists must be writable only by root or the daemon's user.

        Raises:
            ConfigError: another daemon serves this path, it cannot be bound, or its directory
                is unsafe (another user may write it).
        """
        directory = os.path.dirname(self.path)
        try:
            make_dirs(directory, 0o750)
            unsafe = unsafe_directory(directory)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the directory of socket {self.path}: {exc.strerror}"
            ) from None
        if unsafe is not None:  # whoever may write it may replace the socket, or squat it
            raise ConfigError(
                f"socket directory {directory} is unsafe: {unsafe}; another user could put "
                "a socket of their own in this one's place and take other users' clients; "
                "use a directory only root or the daemon's user may write (the default, or "
                "systemd's RuntimeDirectory=)"
            )
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old_umask = os.umask(0o117)  # the socket is created 0660, never briefly wider
            try:
                sock.bind(self.path)
            finally:
                os.umask(old_umask)
            os.chmod(self.path, 0o660)
            sock.listen(_MAX_QUEUED)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on socket {self.path}: {exc.strerror}") from None
        self._sock = sock
        self._spare = _open_spare()
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
        if self._sock is None:
            return
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                self._out_of_resources(exc.errno)
            else:  # this one connection failed (it left the queue): nothing to retry
                remote_log.warning(
                    "failed accepts", "accept on %s failed: %s", self.path, exc.strerror
                )
            return
        self._next_pause = ACCEPT_PAUSE_MIN
        if self._spare is None:  # lost at a shortage (ENFILE): fds are back, take it again
            self._spare = _open_spare()
        conn.setblocking(False)
        try:
            creds = peer_credentials(conn)
        except OSError as exc:  # the kernel cannot say who it is: nobody to admit
            conn.close()
            remote_log.warning(
                "failed accepts", "accept on %s failed: credentials: %s", self.path, exc.strerror
            )
            return
        if not creds.allowed(self.allowed_uids, self.allowed_gids):
            self._refuse(
                conn,
                creds,
                "not_allowed",
                "not in allowed_uids/allowed_gids",
                f"uid {creds.uid} (gid {creds.gid}) may not use this daemon: it admits root, "
                "its own uid and gid, and its allowed_uids/allowed_gids; ask its operator to "
                "add your uid or one of your groups",
            )
            return
        if len(self.connections) >= self.max_clients:
            self._refuse(
                conn,
                creds,
                "max_clients",
                f"max_clients ({self.max_clients}) reached",
                f"the daemon already serves max_clients ({self.max_clients}) clients; try "
                "again when one has left, or raise max_clients in its config",
            )
            return
        if creds.uid not in self._operators and self._clients_of(creds.uid) >= (
            limit := self.max_clients_per_uid
        ):
            self._refuse(
                conn,
                creds,
                "max_clients_per_uid",
                f"max_clients_per_uid ({limit}) reached",
                f"uid {creds.uid} already has max_clients_per_uid ({limit}) connections to "
                "this daemon; close one, or ask its operator to raise max_clients_per_uid",
            )
            return
        cid = next(self._ids)
        self.connections[cid] = IpcConnection(cid, conn, creds, self)
        log.debug("client %d connected: pid=%d uid=%d gid=%d", cid, creds.pid, creds.uid, creds.gid)

    def _clients_of(self, uid: int) -> int:
        """Connections of ``uid`` now (at most ``max_clients``: counted, not indexed)."""
        return sum(1 for c in self.connections.values() if c.credentials.uid == uid)

    def _out_of_resources(self, code: int) -> None:
        """``accept`` failed for lack of ``code``: tell the queued client, or pause accepting.

        The connection is still queued, so the listening socket stays readable: accepting again
        at once would fail again, as fast as the loop turns.
        """
        self.accept_errors += 1
        shortage = _shortage(code)
        if code in (errno.EMFILE, errno.ENFILE) and self._refuse_with_spare(shortage):
            then = "refusing queued clients with that reason"
        else:
            then = f"pausing accepts for {self._pause():g} s"
        remote_log.warning(
            "accepts out of resources",
            "accept on %s failed: %s (%s); %s",
            self.path,
            os.strerror(code),
            shortage,
            then,
        )

    def _refuse_with_spare(self, shortage: str) -> bool:
        """Free the spare fd, accept a queued client with it, refuse it, and take the fd back.

        Returns whether the listening socket may stay watched: the queued client was taken
        (or had gone) and the spare is back.
        """
        if self._spare is None or self._sock is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            conn = None  # the client gave up meanwhile: nothing is queued
        except OSError:
            self._spare = _open_spare()
            return False
        if conn is not None:
            with contextlib.suppress(OSError):
                creds = peer_credentials(conn)
                self._refuse(
                    conn,
                    creds,
                    "no_fds",
                    f"out of file descriptors ({shortage})",
                    f"the daemon cannot take a new client now: {shortage}; try again later, "
                    "and tell its operator (its log says more)",
                )
            conn.close()
        self._spare = _open_spare()
        return self._spare is not None

    def _pause(self) -> float:
        """Stop accepting for the next pause (growing while failures go on); returns it."""
        assert self._sock is not None
        delay = self._next_pause
        self._next_pause = min(delay * 2, ACCEPT_PAUSE_MAX)
        self.accept_pauses += 1
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        self._paused = loop.call_later(delay, self._resume)
        return delay

    def _resume(self) -> None:
        self._paused = None
        if self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_accept)

    def _refuse(
        self, conn: socket.socket, creds: Credentials, kind: str, why: str, reason: str
    ) -> None:
        """Log (rate-limited), count and close a client it does not admit, telling it why first.

        ``kind`` names the counter, ``why`` is for the log, ``reason`` for the client: the
        closing EVENT's ``error``, which names the setting that would change the answer.
        """
        self.refused += 1
        self.refused_by[kind] += 1
        if kind != "no_fds":  # that one is said by the failed accept's line
            remote_log.warning(
                _REFUSED_KEYS[kind],
                "refused client pid=%d uid=%d gid=%d: %s",
                creds.pid,
                creds.uid,
                creds.gid,
                why,
            )
        code = ErrorCode.DAEMON_STOPPING if kind == "stopping" else ErrorCode.REFUSED
        with contextlib.suppress(OSError):  # non-blocking: a full socket just gets no reason
            conn.setblocking(False)
            conn.send(closing_frame(code, reason))
        conn.close()

    def timed_out(self, conn: IpcConnection, reason: str) -> None:
        """Count and log (rate-limited) a connection closed for a deadline it missed."""
        self.clients_timed_out += 1
        creds = conn.credentials
        remote_log.warning(
            "clients timed out",
            "closed client %d (pid %d, uid %d): %s",
            conn.id,
            creds.pid,
            creds.uid,
            reason,
        )

    def forget(self, conn: IpcConnection) -> None:
        if self.connections.pop(conn.id, None) is None:
            return
        reason = conn.close_reason or ""
        pid = conn.credentials.pid
        if conn.timed_out or reason in ("disconnected", "daemon stopping"):  # timeouts: logged
            log.debug("client %d (pid %d) disconnected: %s", conn.id, pid, reason)
        else:  # broke the protocol, stopped reading: as often as clients do it, so rate-limited
            remote_log.warning(
                "clients closed for errors",
                "client %d (pid %d) disconnected: %s",
                conn.id,
                pid,
                reason,
            )
        self.handler.client_gone(conn)

    def stop_accepting(self) -> None:
        """Refuse new clients (remove the socket file); connected ones stay.

        Clients already queued on the socket are told the daemon is stopping, rather than cut
        off without a word when the socket closes.
        """
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        loop.remove_reader(self._sock.fileno())
        self._refuse_queued()
        self._sock.close()
        self._sock = None
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _refuse_queued(self) -> None:
        assert self._sock is not None
        for _ in range(_MAX_QUEUED):
            try:
                conn, _ = self._sock.accept()
            except OSError:  # nothing queued (BlockingIOError), or no fd to take one
                return
            with contextlib.suppress(OSError):
                self._refuse(
                    conn,
                    peer_credentials(conn),
                    "stopping",
                    "daemon stopping",
                    "the daemon is stopping and takes no new clients; connect again once it "
                    "has restarted",
                )
            conn.close()

    def close(self) -> None:
        """Stop accepting, disconnect every client, and remove the socket file."""
        self.stop_accepting()
        for conn in list(self.connections.values()):
            conn.close("daemon stopping", code=ErrorCode.DAEMON_STOPPING)


def _open_spare() -> int | None:
    """An fd to give up at the fd limit (so a queued client can be told why), if one opens."""
    try:
        return os.open(_SPARE_PATH, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _shortage(code: int) -> str:
    """What an ``accept`` error ``code`` says is missing, and the setting that governs it."""
    if code == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (
            f"the daemon has all the {soft} file descriptors it may open in use "
            "(RLIMIT_NOFILE: LimitNOFILE= in its unit)"
        )
    if code == errno.ENFILE:
        return "the system has all its file descriptors in use (sysctl fs.file-max)"
    return "the kernel has no memory for a new socket"
