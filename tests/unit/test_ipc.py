"""The daemon's side of the client socket, with a stand-in handler instead of the daemon.

An :class:`~fabricd.ipc.IpcServer` runs on the test's event loop; real client connections
(:class:`fabricd.client.connection.Connection`) talk to it from a worker thread, as a training
process would from outside.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

import fabricd
from fabricd.client.connection import Connection
from fabricd.client.protocol import Event
from fabricd.errors import LocalProtocolError
from fabricd.ipc import IpcConnection, IpcServer

if TYPE_CHECKING:
    from pathlib import Path

    from fabricd.wire import Meta


class Handler:
    """Answers ``news`` with an event and a reply, ``hold`` never, and hangs up on ``bad``."""

    def __init__(self) -> None:
        self.gone: list[str | None] = []

    def client_request(self, conn: IpcConnection, meta: Meta, fds: list[int]) -> None:
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
