"""The daemon's side of the client socket, with a stand-in handler instead of the daemon.

An :class:`~fabricd.daemon.ipc_server.IpcServer` runs on the test's event loop; real client
connections (:class:`fabricd.client.connection.Connection`) talk to it from a worker thread, as
a training process would from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

import fabricd
from fabricd import ipc
from fabricd.client.connection import Connection
from fabricd.client.protocol import Event
from fabricd.daemon import ipc_server
from fabricd.daemon.ipc_server import IpcConnection, IpcServer
from fabricd.errors import ConfigError, LocalProtocolError
from fabricd.ipc import REPLY_LIMITS
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, encode_head

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from fabricd.wire import Meta


class Handler:
    """Answers ``news`` with an event and a reply, ``hold`` never, and hangs up on ``bad``."""

    def __init__(self) -> None:
        self.gone: list[str | None] = []

    def client_request(self, conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
        for fd in fds:  # the handler owns them
            os.close(fd)
        if meta["op"] == "news":
            conn.push("news", {"n": meta["n"]})
            conn.reply({"id": meta["id"], "ok": True})
        elif meta["op"] == "bad":
            conn.close("protocol error: field 'x' must be an integer")

    def client_gone(self, conn: IpcConnection) -> None:
        self.gone.append(conn.close_reason)


def _call(path: str, op: str, **fields: Any) -> tuple[Meta, list[Event]]:
    """In a thread: connect, send one request, and return its reply and the events seen."""
    conn = Connection.open([path])
    try:
        reply = conn.wait(conn.submit(op, fields), timeout=10).result(op)
        return reply, conn.poll()
    finally:
        conn.close()


@pytest.fixture
async def server(tmp_path: Path):
    server = IpcServer(str(tmp_path / "d.sock"), Handler())
    server.start()
    yield server
    server.close()


async def test_pushed_events_reach_the_client_beside_the_replies(server):
    reply, events = await asyncio.to_thread(_call, server.path, "news", n=7)
    assert reply["ok"] is True
    assert events == [Event(name="news", fields={"n": 7})]


async def test_replies_to_requests_read_together_leave_in_order_before_a_closing_event(server):
    # the replies and events of one read callback are held and sent together when it returns;
    # a close in the same callback sends them first, then the closing event
    def exchange() -> list[Meta]:
        with _raw(server.path) as sock:
            sock.sendall(b"".join(_request("news", rid, n=rid) for rid in range(50)))
            sock.sendall(_request("bad", 50))
            return _read_until_closed(sock)

    metas = await asyncio.to_thread(exchange)
    expected: list[Meta] = []
    for rid in range(50):
        expected += [{"event": "news", "n": rid}, {"id": rid, "ok": True}]
    assert metas[:100] == expected
    assert metas[100]["event"] == ipc.CLOSING_EVENT
    assert len(metas) == 101


async def test_a_client_closed_for_a_bad_request_is_told_why(server):
    with pytest.raises(fabricd.DaemonUnavailable) as closed:
        await asyncio.to_thread(_call, server.path, "bad")
    assert "closed the connection: protocol error: field 'x' must be an integer" in str(
        closed.value
    )
    assert server.handler.gone == ["protocol error: field 'x' must be an integer"]


async def test_a_client_over_max_clients_is_told_why_at_accept(server):
    server.max_clients = 0
    with pytest.raises(fabricd.DaemonUnavailable, match=r"already serves max_clients \(0\)"):
        await asyncio.to_thread(_call, server.path, "news", n=1)
    assert server.refused == 1


async def test_a_stopping_daemon_tells_its_clients(server):
    conn = await asyncio.to_thread(Connection.open, [server.path])
    call = await asyncio.to_thread(conn.submit, "hold", {})
    while not server.connections:  # the request is in before the daemon stops
        await asyncio.sleep(0.01)
    server.close()
    reply = await asyncio.to_thread(conn.wait, call, 10)
    with pytest.raises(fabricd.OperationFailed, match="daemon stopping") as stopped:
        reply.result("hold")
    assert stopped.value.code == "daemon_stopping"
    conn.close()


async def test_push_refuses_what_only_close_may_send(server):
    conn = await asyncio.to_thread(Connection.open, [server.path])
    try:
        while not server.connections:
            await asyncio.sleep(0.01)
        daemon_side = next(iter(server.connections.values()))
        with pytest.raises(LocalProtocolError):
            daemon_side.push("closing", {"code": "protocol", "error": "x"})
        with pytest.raises(LocalProtocolError):
            daemon_side.push("news", {"event": "other"})
    finally:
        conn.close()


# -- slots are not held for free -----------------------------------------------------------
def _raw(path: str) -> socket.socket:
    """A bare connection that sends nothing unless told (a blocking socket; use in a thread)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)  # blocking, so a full backlog waits (with a timeout it fails EAGAIN)
    sock.settimeout(30)  # a hang guard only: every wait below ends by the daemon's doing
    return sock


def _request(op: str, rid: int = 1, **fields: Any) -> bytes:
    return encode_head(Kind.REQUEST, {"id": rid, "op": op, **fields})


def _read_until_closed(sock: socket.socket) -> list[Meta]:
    """Every frame the daemon sends until it hangs up (the last is its closing event)."""
    decoder, metas = Decoder(REPLY_LIMITS), []
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            decoder.feed(data)
            metas += _frames(decoder)
    return metas


def _frames(decoder: Decoder) -> list[Meta]:
    """The metadata of every whole frame the decoder holds."""
    metas = []
    while (event := decoder.next_event()) is not NEED_DATA:
        if isinstance(event, Frame):
            metas.append(event.meta)
    return metas


def _read_reply(sock: socket.socket) -> Meta:
    decoder = Decoder(REPLY_LIMITS)
    while True:
        decoder.feed(sock.recv(65536))
        for meta in _frames(decoder):
            if "id" in meta:
                return meta


@contextlib.asynccontextmanager
async def _server(tmp_path: Path, **settings: Any) -> AsyncIterator[IpcServer]:
    server = IpcServer(str(tmp_path / "d.sock"), Handler(), **settings)
    server.start()
    try:
        yield server
    finally:
        server.close()


async def test_a_connection_that_sends_no_request_is_closed_after_client_hello_timeout(tmp_path):
    async with _server(tmp_path, hello_timeout=0.2) as server:
        sock = await asyncio.to_thread(_raw, server.path)
        frames = await asyncio.to_thread(_read_until_closed, sock)
        sock.close()
        assert [m["event"] for m in frames] == ["closing"]
        assert frames[0]["code"] == "protocol"
        assert "no request within client_hello_timeout (0.2 s)" in frames[0]["error"]
        assert server.connections == {}
        assert server.counters()["clients_timed_out"] == 1
        assert server.handler.gone == [frames[0]["error"]]


@pytest.mark.parametrize("cut", ["header", "half"])
async def test_half_a_frame_then_silence_is_closed_but_an_idle_client_is_not(tmp_path, cut):
    async with _server(tmp_path, hello_timeout=0.3, frame_timeout=0.3) as server:
        idle = await asyncio.to_thread(_raw, server.path)
        await asyncio.to_thread(idle.sendall, _request("news", n=1))
        assert (await asyncio.to_thread(_read_reply, idle))["ok"] is True
        stuck = await asyncio.to_thread(_raw, server.path)
        await asyncio.to_thread(stuck.sendall, _request("news", n=2))
        assert (await asyncio.to_thread(_read_reply, stuck))["ok"] is True
        frame = _request("news", 2, n=3, padding="x" * 100)
        await asyncio.to_thread(stuck.sendall, frame[: 12 if cut == "header" else len(frame) // 2])
        frames = await asyncio.to_thread(_read_until_closed, stuck)
        stuck.close()
        assert frames[-1]["event"] == "closing"
        assert "a frame was left unfinished for client_frame_timeout (0.3 s)" in frames[-1]["error"]
        # the idle client has been idle longer than both timeouts, and it is still served
        assert len(server.connections) == 1
        await asyncio.to_thread(idle.sendall, _request("news", 2, n=4))
        assert (await asyncio.to_thread(_read_reply, idle))["ok"] is True
        idle.close()
        assert server.counters()["clients_timed_out"] == 1


async def test_a_client_that_keeps_sending_frames_is_never_cut_off_mid_stream(tmp_path):
    """A frame's deadline runs from its own start: a stream of frames where every read ends
    in the middle of one is not mistaken for one frame left unfinished."""
    async with _server(tmp_path, frame_timeout=0.2) as server:
        sock = await asyncio.to_thread(_raw, server.path)
        frames = [_request("news", i, n=i, pad="x" * 9) for i in range(1, 41)]
        assert {len(f) for f in frames} == {50}
        stream = b"".join(frames)
        # 37 B pieces, 10 ms apart: the first whole frame boundary a read ends on is after
        # 50 pieces (1850 B), far more than 0.2 s after the stream began
        for i in range(0, len(stream), 37):
            sock.sendall(stream[i : i + 37])
            await asyncio.sleep(0.01)  # lets the daemon read each piece on its own

        def replies() -> int:
            decoder, seen = Decoder(REPLY_LIMITS), 0
            while seen < 40:
                decoder.feed(sock.recv(65536))
                seen += sum(meta.get("ok") is True for meta in _frames(decoder))
            return seen

        assert await asyncio.to_thread(replies) == 40
        assert server.counters()["clients_timed_out"] == 0
        sock.close()


async def test_idle_connections_do_not_lock_out_a_real_client_once_they_time_out(tmp_path):
    async with _server(tmp_path, max_clients=8, hello_timeout=0.5) as server:
        flood = await asyncio.to_thread(lambda: [_raw(server.path) for _ in range(500)])
        reasons = []
        while True:  # a real client: refused while the slots are taken, admitted after
            try:
                reply, _ = await asyncio.to_thread(_call, server.path, "news", n=1)
                break
            except fabricd.DaemonUnavailable as exc:
                reasons.append(str(exc))
                await asyncio.sleep(0.05)
        assert reply["ok"] is True
        for reason in reasons:  # refused for the slots, never told its uid is the problem
            assert "already serves max_clients (8) clients" in reason, reason
            assert "uid" not in reason
        closings = [await asyncio.to_thread(_read_until_closed, s) for s in flood]
        for s in flood:
            s.close()
        errors = [frames[-1]["error"] for frames in closings]
        timed_out = [e for e in errors if "client_hello_timeout" in e]
        assert len(timed_out) >= 8
        assert all("client_hello_timeout" in e or "max_clients" in e for e in errors)
        counters = server.counters()
        assert counters["clients_timed_out"] == len(timed_out)
        assert counters["refused_clients_max_clients"] == 500 - len(timed_out) + len(reasons)


class _Listening:
    """The server's listening socket, whose ``accept`` fails with ``error`` ``fail`` times."""

    def __init__(self, sock: socket.socket, fail: int, error: int) -> None:
        self.sock, self.fail, self.error = sock, fail, error
        self.attempts: list[float] = []  #: the loop's time of each accept

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, Any]:
        self.attempts.append(asyncio.get_running_loop().time())
        if len(self.attempts) <= self.fail:
            raise OSError(self.error, os.strerror(self.error))
        return self.sock.accept()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("error", [errno.EMFILE, errno.ENOBUFS], ids=["EMFILE", "ENOBUFS"])
async def test_accept_backs_off_when_out_of_resources_and_serves_once_they_return(tmp_path, error):
    async with _server(tmp_path) as server:
        if server._spare is not None:  # no spare fd to refuse with: the server must wait
            os.close(server._spare)
            server._spare = None
        listening = _Listening(server._sock, fail=4, error=error)  # type: ignore[arg-type]
        server._sock = listening  # type: ignore[assignment]
        reply, _ = await asyncio.to_thread(_call, server.path, "news", n=1)
        assert reply["ok"] is True
        assert len(listening.attempts) == 5  # four failures, one success: no spinning
        counters = server.counters()
        assert counters["accept_errors"] == 4
        assert counters["accept_pauses"] == 4
        gaps = [b - a for a, b in zip(listening.attempts, listening.attempts[1:], strict=False)]
        for i, gap in enumerate(gaps):  # each pause at least as long as announced, growing
            assert gap >= ipc_server.ACCEPT_PAUSE_MIN * 2**i * 0.99, gaps


async def test_at_the_fd_limit_a_queued_client_is_told_why_with_the_spare_fd(tmp_path):
    async with _server(tmp_path) as server:
        assert server._spare is not None
        listening = _Listening(server._sock, fail=1, error=errno.EMFILE)  # type: ignore[arg-type]
        server._sock = listening  # type: ignore[assignment]
        with pytest.raises(fabricd.DaemonUnavailable, match="file descriptors it may open") as no:
            await asyncio.to_thread(_call, server.path, "news", n=1)
        assert "LimitNOFILE" in str(no.value)
        assert server._spare is not None  # taken back for the next time
        counters = server.counters()
        assert (counters["refused_clients_no_fds"], counters["accept_pauses"]) == (1, 0)
        reply, _ = await asyncio.to_thread(_call, server.path, "news", n=2)  # fds are back
        assert reply["ok"] is True


async def test_a_spare_fd_lost_at_a_shortage_is_taken_again_once_fds_return(tmp_path):
    # the spare cannot always be had back (ENFILE: another process took the file it freed);
    # it was never opened again, so every later shortage paused instead of telling the client
    async with _server(tmp_path) as server:
        assert server._spare is not None
        os.close(server._spare)
        server._spare = None
        reply, _ = await asyncio.to_thread(_call, server.path, "news", n=1)  # fds are back
        assert reply["ok"] is True
        assert server._spare is not None
        listening = _Listening(server._sock, fail=1, error=errno.EMFILE)  # type: ignore[arg-type]
        server._sock = listening  # type: ignore[assignment]
        with pytest.raises(fabricd.DaemonUnavailable, match="file descriptors it may open"):
            await asyncio.to_thread(_call, server.path, "news", n=2)
        counters = server.counters()
        assert (counters["refused_clients_no_fds"], counters["accept_pauses"]) == (1, 0)


async def test_clients_queued_when_the_daemon_stops_are_told_it_is_stopping(tmp_path):
    async with _server(tmp_path) as server:
        queued = [_raw(server.path) for _ in range(3)]  # in the backlog: not accepted yet
        server.stop_accepting()
        for sock in queued:
            frames = await asyncio.to_thread(_read_until_closed, sock)
            sock.close()
            assert [(m["event"], m["code"]) for m in frames] == [("closing", "daemon_stopping")]
            assert "the daemon is stopping" in frames[0]["error"]
        assert server.counters()["refused_clients_stopping"] == 3


async def test_the_socket_directory_is_0750_whatever_the_umask(tmp_path):
    path = tmp_path / "made" / "by" / "fabricd" / "d.sock"
    old = os.umask(0)
    try:
        server = IpcServer(str(path), Handler())
        server.start()
    finally:
        os.umask(old)
    try:
        for directory in (path.parent, path.parent.parent, path.parent.parent.parent):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o750, directory
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    finally:
        server.close()


@pytest.mark.parametrize("mode", [0o1777, 0o770])
async def test_a_socket_directory_another_user_may_write_is_refused(tmp_path, mode):
    # whoever may write the directory may replace the socket (and take other users' clients,
    # with their segments) or, between bind and chmod, swap in a symlink for root to chmod
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    server = IpcServer(str(shared / "d.sock"), Handler())
    with pytest.raises(ConfigError, match="other users may write") as refused:
        server.start()
    assert str(shared) in str(refused.value)
    assert not (shared / "d.sock").exists()


def _pipe_fds(n: int) -> list[int]:
    """``n`` fds to pass (the ends of ``n / 2`` pipes; ``n`` even)."""
    fds: list[int] = []
    for _ in range(n // 2):
        fds += os.pipe()
    return fds


@pytest.mark.parametrize("announced", [0, 1])
async def test_fds_no_request_claims_are_not_kept(tmp_path, announced):
    # a frame's fds come with its first byte (one sendmsg), so once every whole frame took
    # its own, fds left while no frame is under way belong to nothing: they were kept (up to
    # 16 per connection, for as long as the client kept sending), past the daemon's fd budget
    async with _server(tmp_path) as server:
        sock = await asyncio.to_thread(_raw, server.path)
        await asyncio.to_thread(sock.sendall, _request("news", n=1))
        assert (await asyncio.to_thread(_read_reply, sock))["ok"] is True
        fds = _pipe_fds(4)
        extra = _request("news", 2, n=2, **({"fds": announced} if announced else {}))
        socket.send_fds(sock, [extra], fds)
        for fd in fds:
            os.close(fd)
        frames = await asyncio.to_thread(_read_until_closed, sock)
        sock.close()
        assert frames[-1]["event"] == "closing"
        assert (
            f"{4 - announced} fds arrived with no request that announces them"
            in (frames[-1]["error"])
        )
        assert server.connections == {}


async def test_the_fds_of_a_frame_still_arriving_are_kept_for_it(tmp_path):
    async with _server(tmp_path) as server:
        sock = await asyncio.to_thread(_raw, server.path)
        frame = _request("news", n=1, fds=2)
        fds = _pipe_fds(2)
        socket.send_fds(sock, [frame[:10]], fds)  # the frame's first bytes, with its fds
        for fd in fds:
            os.close(fd)
        await asyncio.sleep(0.1)
        assert len(server.connections) == 1
        await asyncio.to_thread(sock.sendall, frame[10:])
        assert (await asyncio.to_thread(_read_reply, sock))["ok"] is True
        sock.close()


@pytest.mark.parametrize("owed", ["hello", "frame"])
async def test_a_deadline_run_before_the_bytes_waiting_for_it_are_read_cuts_nobody(tmp_path, owed):
    # libuv (uvloop) runs due timers before it polls: after the loop was busy elsewhere for
    # as long as the deadline, the deadline ran first and cut a client whose bytes had come
    async with _server(tmp_path, hello_timeout=30, frame_timeout=30) as server:
        sock = await asyncio.to_thread(_raw, server.path)
        while not server.connections:
            await asyncio.sleep(0.01)
        conn = next(iter(server.connections.values()))
        frame = _request("news", 2, n=2)
        if owed == "frame":  # the hello was answered; a frame is under way
            sock.sendall(_request("news", n=1))
            assert (await asyncio.to_thread(_read_reply, sock))["ok"] is True
            sock.sendall(frame[:10])
            while conn._timer is None:
                await asyncio.sleep(0.01)
            sock.sendall(frame[10:])
        else:
            sock.sendall(frame)
        assert conn._timer is not None
        conn._timer.cancel()
        conn._time_out("the deadline")  # as the loop would, before reading
        assert not conn.closed
        assert server.counters()["clients_timed_out"] == 0
        assert (await asyncio.to_thread(_read_reply, sock))["ok"] is True
        sock.sendall(b"FB")  # a byte of the next frame, then silence: that still times out
        await asyncio.sleep(0.1)
        assert conn._timer is not None
        conn._timer.cancel()
        conn._time_out("the deadline")
        assert conn.closed
        sock.close()


async def test_a_failed_write_disconnects_the_client_once_the_writer_has_returned(server):
    # A reply is often written amid a service's work (a batch of engine actions); a failed write
    # that released the client's session at once abandoned its other operations while actions
    # for them were still to be performed.  Now nothing more is written to it at once, and it is
    # let go one loop iteration later, after the writer returned.
    seen: list[tuple[int, bool]] = []

    class Refusing:
        """The client's socket, but every send fails as if it had hung up."""

        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def send(self, data: object) -> int:
            raise OSError(errno.EPIPE, "Broken pipe")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.sock, name)

    handler = server.handler

    def failing(conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
        conn._sock = Refusing(conn._sock)  # type: ignore[assignment]
        conn.reply({"id": meta["id"], "ok": True})  # the write fails
        seen.append((len(handler.gone), conn.closed))  # not let go inside the writer
        conn.reply({"id": meta["id"], "ok": True})  # nothing more is written
        seen.append((len(handler.gone), conn.closed))

    handler.client_request = failing
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(server.path)
        client.sendall(encode_head(Kind.REQUEST, {"id": 1, "op": "anything"}))
        async with asyncio.timeout(10):
            while not handler.gone:
                await asyncio.sleep(0.01)
    finally:
        client.close()
    assert seen == [(0, False), (0, False)]
    assert handler.gone == ["write failed: Broken pipe"]


def test_peer_groups_are_this_processs_own_over_a_socketpair():
    """What the kernel reports for a peer in this very process: its own supplementary groups
    (none, for many test runners; the next test sets some)."""
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        creds = ipc_server.peer_credentials(left)
    assert creds.uid == os.geteuid()
    assert creds.groups == frozenset(os.getgroups())


@pytest.mark.skipif(os.geteuid() != 0, reason="setting a child's groups needs root")
@pytest.mark.parametrize(
    ("groups", "seen"),
    [
        ([4242, 4243], {4242, 4243}),
        # 300, more than _MAX_GROUPS: Python's getsockopt gets ERANGE, and libc's reads them
        # all (they were once dropped, refusing a peer admitted only by its 300th group)
        (list(range(5000, 5300)), set(range(5000, 5300))),
    ],
)
def test_a_peers_supplementary_groups_are_read(tmp_path, groups, seen):
    """SO_PEERGROUPS of another process: how a training user in the daemon's group (a pod's
    supplementalGroups) is admitted.  A 4096-byte getsockopt once made this always empty."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    listener.settimeout(30)
    script = "import socket,sys; c=socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); c.recv(1)"
    child = subprocess.Popen([sys.executable, "-c", script, path], extra_groups=groups)
    try:
        conn, _ = listener.accept()
        with conn:
            creds = ipc_server.peer_credentials(conn)
    finally:
        listener.close()
        child.wait(timeout=30)
    assert creds.pid == child.pid
    assert creds.groups == seen
    assert creds.allowed(set(), {4243}) is (4243 in seen)
    assert creds.allowed(set(), {groups[-1]})
