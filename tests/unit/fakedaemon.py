"""A fake daemon on the other end of a socketpair, for client tests that need no real daemon.

:class:`FakeDaemon` reads the client's REQUEST frames on a thread of its own (closing any fds
that come with them, as the daemon does with fds it does not keep), records each request, and
hands it to a script that answers with :meth:`FakeDaemon.reply`, :meth:`FakeDaemon.push`,
:meth:`FakeDaemon.send` or :meth:`FakeDaemon.hang_up`.  The default script answers every op
the way a daemon with one node would, so a real :class:`fabricd.Client` can be built on it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

from fabricd.client import Client
from fabricd.client.connection import Connection
from fabricd.ipc import REQUEST_LIMITS
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, Meta, encode

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client.checks import Membership

PATH = "fake.sock"  #: what the client's messages call the socket
_FD_SPACE = socket.CMSG_SPACE(4 * struct.calcsize("i"))


def answer_like_a_daemon(daemon: FakeDaemon, request: Meta) -> None:
    """hello, attach, status: ok; send and recv: done at once, with their tag and size."""
    op = request["op"]
    if op == "hello":
        daemon.reply(request, node=0, nodes=1)
    elif op in ("send", "recv"):
        daemon.reply(request, nbytes=request["nbytes"], tag=request["tag"], src=0)
    else:
        daemon.reply(request)


class FakeDaemon:
    """The daemon's end of a client connection, driven by ``script`` for each request."""

    def __init__(self, script: Callable[[FakeDaemon, Meta], None] = answer_like_a_daemon) -> None:
        self.client_end, self._end = socket.socketpair()
        self.requests: list[Meta] = []
        self._script = script
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def connection(self) -> Connection:
        """A client connection on the client's end."""
        return Connection(self.client_end, PATH)

    def client(self, job: Membership | None = None) -> Client:
        """A :class:`fabricd.Client` on the client's end (it says hello first)."""
        return Client(self.connection(), job, timeout=5)

    def ops(self) -> list[str]:
        """The ops of the requests received so far, in order."""
        return [request["op"] for request in self.requests]

    def send(self, frame: bytes) -> None:
        """Write raw bytes to the client."""
        self._end.sendall(frame)

    def reply(self, request: Meta, **fields: Any) -> None:
        """Answer ``request`` successfully with ``fields``."""
        self.send(encode(Kind.REPLY, {"id": request["id"], "ok": True, **fields}))

    def push(self, name: str, **fields: Any) -> None:
        """Send the client an event."""
        self.send(encode(Kind.EVENT, {"event": name, **fields}))

    def hang_up(self) -> None:
        """Close the daemon's end (the serving thread then ends)."""
        with contextlib.suppress(OSError):
            self._end.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Hang up and wait for the serving thread; release both ends."""
        self.hang_up()
        self._thread.join(10)
        assert not self._thread.is_alive()
        self._end.close()
        self.client_end.close()

    def _serve(self) -> None:
        decoder = Decoder(REQUEST_LIMITS)
        while True:
            try:
                data, ancdata, _, _ = self._end.recvmsg(65536, _FD_SPACE)
            except OSError:
                return
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for fd in struct.unpack(f"{len(payload) // 4}i", payload):
                        os.close(fd)
            if not data:
                return
            decoder.feed(data)
            while (item := decoder.next_event()) is not NEED_DATA:
                if isinstance(item, Frame):
                    self.requests.append(item.meta)
                    try:
                        self._script(self, item.meta)
                    except OSError:
                        return
