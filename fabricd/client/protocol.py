"""The client's side of the client socket, sans-IO: requests out, replies and events in.

:class:`ClientProtocol` knows the frames and the rules of docs/protocol.md §4 and nothing of
sockets, threads or time: the connection (:mod:`fabricd.client.connection`) hands it every byte
it reads and sends the bytes it returns, so every ordering of replies and events can be tested
without a daemon (tests/unit/test_client_protocol.py).

Rules:

* every request gets exactly one :class:`Reply`: the daemon's, or, once the connection has
  ended, a failed one made here (code ``daemon_gone``, or the daemon's code and reason when it
  said why it closed);
* replies and EVENT frames may come interleaved in any order and cut anywhere;
* anything the daemon sends that breaks these rules (an unknown request id, a reply without
  ``ok``, an event without a name, a frame after the closing event) ends the connection as
  unreadable.

States::

    OPEN ──closing event──► CLOSING ──connection_lost──► CLOSED
      └──────────────connection_lost / unreadable input─────┘

In CLOSING the daemon has said why it hangs up: no request may go out, and the reason becomes
the failure of every request still waiting.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabricd.errors import ErrorCode, FabricError, RemoteProtocolError, error_for
from fabricd.ipc import CLOSING_EVENT, REPLY_LIMITS, REQUEST_LIMITS
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, Meta, encode_head

if TYPE_CHECKING:
    from collections.abc import Mapping


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """The answer to one request: ``ok`` and the op's fields, or a failure ``code`` and ``error``.

    ``meta`` is the whole REPLY metadata (``id`` and ``ok`` included).
    """

    id: int
    ok: bool
    meta: Meta

    def result(self, what: str) -> Meta:
        """The reply's fields, or raise the error its code stands for (:func:`errors.error_for`).

        ``what`` names the operation at the start of the message ("send to rank 1 (tag 0)").
        """
        if self.ok:
            return self.meta
        rank, node = self.meta.get("rank"), self.meta.get("node")
        raise error_for(
            str(self.meta.get("code", ErrorCode.FAILED)),
            f"{what}: {self.meta.get('error', 'failed')}",
            rank=rank if type(rank) is int else None,
            node=node if type(node) is int else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """News the daemon pushed (an EVENT frame): its name and its other fields.

    ``closing`` is the one event every daemon sends: it comes just before the daemon closes the
    connection, with ``code`` (docs/protocol.md, "Error codes") and ``error`` (why).
    """

    name: str
    fields: Meta


class State(enum.Enum):
    """Where a :class:`ClientProtocol` is."""

    OPEN = enum.auto()  #: requests go out; replies and events come in
    CLOSING = enum.auto()  #: the daemon said why it closes; it hangs up next
    CLOSED = enum.auto()  #: the connection ended; every request has its reply


class ClientProtocol:
    """One connection's protocol state: request ids, what is pending, and how it ended.

    Args:
        peer: how messages name the other side, e.g. ``"the daemon on /run/fabricd/fabricd.sock"``.
    """

    def __init__(self, peer: str = "the daemon") -> None:
        self.state = State.OPEN
        self.closing: Event | None = None  #: the daemon's closing event, once it came
        self._peer = peer
        self._decoder = Decoder(REPLY_LIMITS, heads=False)  # replies and events carry no payload
        self._ids = itertools.count(1)
        self._pending: set[int] = set()
        self._end: tuple[str, str] = (ErrorCode.DAEMON_GONE, "")  #: code and reason, once CLOSED

    @property
    def pending(self) -> frozenset[int]:
        """The ids of the requests still waiting for their reply."""
        return frozenset(self._pending)

    def request(self, op: str, fields: Mapping[str, object], *, fds: int = 0) -> tuple[int, bytes]:
        """Encode a REQUEST for ``op``; returns its id (its reply carries the same) and the frame.

        ``fds`` is the number of file descriptors that go with the frame (SCM_RIGHTS).

        Raises:
            FabricError: the connection is closing or closed: the error its end stands for
                (``DaemonUnavailable``, or the daemon's reason).  Connect again.
            LocalProtocolError: the fields exceed the request limits (a fabricd bug).
        """
        if self.state is not State.OPEN:
            raise self.failure(op)
        rid = next(self._ids)
        meta = {"id": rid, "op": op, "fds": fds, **fields}
        frame = encode_head(Kind.REQUEST, meta, limits=REQUEST_LIMITS)
        self._pending.add(rid)
        return rid, frame

    def receive_data(self, data: bytes) -> list[Reply | Event]:
        """Take bytes read from the socket; returns the replies and events they complete, in order.

        Unreadable input ends the connection here: what came before it is returned, followed by
        a failed reply for every pending request, and the state is CLOSED (the caller then
        closes the socket).  Bytes that come after the end are ignored.
        """
        if self.state is State.CLOSED:
            return []
        out: list[Reply | Event] = []
        decoder = self._decoder
        try:
            decoder.feed(data)
            while (item := decoder.next_event()) is not NEED_DATA:
                if isinstance(item, Frame):
                    out.append(self._frame(item))
                    if not decoder.buffered:  # between frames with nothing left: NEED_DATA next
                        break
        except RemoteProtocolError as exc:
            out += self.connection_lost(f"{self._peer} sent something unreadable: {exc}")
        return out

    def connection_lost(self, why: str) -> list[Reply]:
        """The connection ended: returns a failed reply for every pending request.

        The failure is the daemon's own code and reason when it sent a closing event, else
        ``daemon_gone`` with ``why``.  Calling it again returns nothing.
        """
        if self.state is State.CLOSED:
            return []
        if self.closing is None:
            self._end = (ErrorCode.DAEMON_GONE, why)
        else:
            code, error = self.closing.fields["code"], self.closing.fields["error"]
            self._end = (code, f"{self._peer} closed the connection: {error}")
        self.state = State.CLOSED
        code, message = self._end
        failed = [
            Reply(id=rid, ok=False, meta={"id": rid, "ok": False, "code": code, "error": message})
            for rid in sorted(self._pending)
        ]
        self._pending.clear()
        return failed

    def failure(self, what: str) -> FabricError:
        """The error an operation ``what`` meets on this connection once it is closing or closed."""
        if self.state is State.CLOSING and self.closing is not None:
            code, error = self.closing.fields["code"], self.closing.fields["error"]
            return error_for(code, f"{what}: {self._peer} is closing the connection: {error}")
        code, message = self._end
        return error_for(code, f"{what}: {message}")

    def _frame(self, frame: Frame) -> Reply | Event:
        if self.state is not State.OPEN:
            raise RemoteProtocolError(f"a {frame.kind.name} frame after the closing event")
        if frame.kind is Kind.REPLY:
            return self._reply(frame.meta)
        return self._event(frame.meta)

    def _reply(self, meta: Meta) -> Reply:
        rid, ok = meta.get("id"), meta.get("ok")
        if type(rid) is not int or rid not in self._pending:
            raise RemoteProtocolError(f"a reply to request {rid!r}, which is not pending")
        if type(ok) is not bool:
            raise RemoteProtocolError(f"reply {rid} has no boolean 'ok'")
        self._pending.discard(rid)
        return Reply(id=rid, ok=ok, meta=meta)

    def _event(self, meta: Meta) -> Event:
        name = meta.get("event")
        if not isinstance(name, str) or not name:
            raise RemoteProtocolError("an event without a name ('event' must be a non-empty str)")
        event = Event(name=name, fields={k: v for k, v in meta.items() if k != "event"})
        if name == CLOSING_EVENT:
            if not isinstance(meta.get("code"), str) or not isinstance(meta.get("error"), str):
                raise RemoteProtocolError("a closing event needs a str 'code' and 'error'")
            self.closing, self.state = event, State.CLOSING
        return event
