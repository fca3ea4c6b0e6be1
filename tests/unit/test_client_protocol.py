"""The client in layers: the sans-IO protocol, and the connection's thread hand-off and events.

The protocol is driven with bytes only: hypothesis makes replies and events in any order and
cuts the stream anywhere.  The connection runs against a fake daemon on a socketpair
(:mod:`tests.unit.fakedaemon`), with threads where the hand-off is what is tested.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fakedaemon import FakeDaemon
from hypothesis import given
from hypothesis import strategies as st

import fabricd
from fabricd.client import connection as connection_module
from fabricd.client import protocol as protocol_module
from fabricd.client.protocol import ClientProtocol, Event, Reply, State
from fabricd.errors import ErrorCode, error_for
from fabricd.ipc import closing_frame
from fabricd.wire import PROTOCOL_VERSION, Kind, encode

# -- the protocol, sans IO --------------------------------------------------------------------

values = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=20))
fields = st.dictionaries(
    # not the keys the frames themselves use: a field named "ok" would overwrite the reply's own
    st.text(min_size=1, max_size=8).filter(lambda k: k not in ("event", "id", "ok")),
    values,
    max_size=4,
)
event_names = st.text(min_size=1, max_size=12).filter(lambda name: name != "closing")
codes = st.sampled_from([*ErrorCode, "a-code-from-a-newer-daemon"])


@st.composite
def failures(draw: st.DrawFn) -> dict[str, Any]:
    failure = {"code": draw(codes), "error": draw(st.text(max_size=40))}
    if draw(st.booleans()):
        failure.update(rank=draw(st.none() | st.integers(0, 9)), node=draw(st.integers(0, 9)))
    return failure


@st.composite
def conversations(draw: st.DrawFn, *, answered: bool = True) -> tuple[int, list[Any]]:
    """``n`` requests and what the daemon sends back: replies (to all of them if ``answered``,
    else to some), in any order, mixed with events anywhere."""
    n = draw(st.integers(0, 8))
    ids = draw(st.permutations(range(1, n + 1)))
    if not answered:
        ids = ids[: draw(st.integers(0, n))]
    items: list[Any] = []
    for rid in ids:
        meta = {"id": rid, "ok": True, **draw(fields)}
        if draw(st.booleans()):
            meta = {"id": rid, "ok": False, **draw(failures())}
        items.append(Reply(id=rid, ok=meta["ok"], meta=meta))
    for _ in range(draw(st.integers(0, 6))):
        event = Event(name=draw(event_names), fields=draw(fields))
        items.insert(draw(st.integers(0, len(items))), event)
    return n, items


def _encoded(item: Reply | Event) -> bytes:
    if isinstance(item, Reply):
        return encode(Kind.REPLY, item.meta)
    return encode(Kind.EVENT, {"event": item.name, **item.fields})


def _feed(protocol: ClientProtocol, stream: bytes, cuts: list[int]) -> list[Reply | Event]:
    """Feed ``stream`` cut at ``cuts``; everything the protocol returned, in order."""
    out: list[Reply | Event] = []
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    for start, end in itertools.pairwise(bounds):
        out += protocol.receive_data(stream[start:end])
    return out


def _requested(n: int) -> ClientProtocol:
    protocol = ClientProtocol()
    for i in range(n):
        rid, frame = protocol.request("op", {"i": i})
        assert rid == i + 1
        assert frame.startswith(b"FBRC" + bytes([PROTOCOL_VERSION, Kind.REQUEST]))
    return protocol


@given(conversations(), st.lists(st.integers(0, 10_000), max_size=12))
def test_replies_and_events_come_out_in_order_however_they_are_cut(conversation, cuts):
    n, items = conversation
    protocol = _requested(n)
    out = _feed(protocol, b"".join(_encoded(item) for item in items), cuts)
    assert out == items
    assert protocol.pending == frozenset()
    assert protocol.state is State.OPEN


@given(
    conversations(answered=False),
    st.lists(st.integers(0, 10_000), max_size=12),
    codes,
    st.text(max_size=40),
)
def test_after_a_closing_event_every_unanswered_request_fails_with_its_reason(
    conversation, cuts, code, reason
):
    n, items = conversation
    protocol = _requested(n)
    closing = Event(name="closing", fields={"code": code, "error": reason})
    stream = b"".join(_encoded(item) for item in [*items, closing])
    assert _feed(protocol, stream, cuts) == [*items, closing]
    assert protocol.state is State.CLOSING
    assert protocol.closing == closing
    expected, said = type(error_for(code, reason)), "connection: " + re.escape(reason) + r"\Z"
    with pytest.raises(expected, match=said):
        protocol.request("op", {})  # the daemon is hanging up: nothing more goes out
    unanswered = protocol.pending
    failed = protocol.connection_lost("the daemon closed the connection")
    assert {reply.id for reply in failed} == unanswered
    for reply in failed:
        assert reply.meta["code"] == code
        with pytest.raises(expected, match=said):
            reply.result("op")
    with pytest.raises(expected, match=said):
        protocol.request("op", {})
    assert protocol.connection_lost("again") == []


@given(conversations(answered=False), st.binary(min_size=1, max_size=40))
def test_garbage_ends_the_connection_after_what_came_before_it(conversation, junk):
    n, items = conversation
    protocol = _requested(n)
    out = protocol.receive_data(b"".join(_encoded(item) for item in items) + b"\x00" + junk)
    assert out[: len(items)] == items
    failed = out[len(items) :]
    assert all(isinstance(reply, Reply) and not reply.ok for reply in failed)
    assert {reply.id for reply in failed if isinstance(reply, Reply)} == (
        set(range(1, n + 1)) - {item.id for item in items if isinstance(item, Reply)}
    )
    assert protocol.state is State.CLOSED
    assert protocol.receive_data(b"more") == []  # nothing after the end counts
    with pytest.raises(fabricd.DaemonUnavailable, match="sent something unreadable"):
        protocol.request("op", {})


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([encode(Kind.REPLY, {"id": 7, "ok": True})], "request 7, which is not pending"),
        ([encode(Kind.REPLY, {"id": 1, "ok": True})] * 2, "request 1, which is not pending"),
        ([encode(Kind.REPLY, {"id": True, "ok": True})], "request True"),
        ([encode(Kind.REPLY, {"id": 1, "ok": 1})], "no boolean 'ok'"),
        ([encode(Kind.EVENT, {"name": "x"})], "an event without a name"),
        ([encode(Kind.EVENT, {"event": "closing", "code": 5})], "needs a str 'code'"),
        ([encode(Kind.REQUEST, {"id": 1, "op": "x"})], "REQUEST is not allowed"),
        ([encode(Kind.EVENT, {"event": "x"}, b"payload")], "payload"),
    ],
)
def test_a_daemon_that_breaks_the_rules_is_unreadable(frames, why):
    protocol = _requested(2)
    out = protocol.receive_data(b"".join(frames))
    failed = [item for item in out if isinstance(item, Reply) and not item.ok]
    assert failed
    assert failed[-1].meta["code"] == "daemon_gone"
    assert why in failed[-1].meta["error"]
    assert "unreadable" in failed[-1].meta["error"]
    assert protocol.state is State.CLOSED


def test_after_the_closing_event_nothing_more_may_come_and_its_reason_stays():
    protocol = _requested(1)
    stream = closing_frame(ErrorCode.PROTOCOL, "bad fds") + encode(Kind.REPLY, {"id": 1, "ok": 1})
    out = protocol.receive_data(stream)
    assert out[0] == Event(name="closing", fields={"code": "protocol", "error": "bad fds"})
    assert out[1] == Reply(
        id=1,
        ok=False,
        meta={
            "id": 1,
            "ok": False,
            "code": "protocol",
            "error": "the daemon closed the connection: bad fds",
        },
    )
    assert protocol.state is State.CLOSED


def test_a_failed_reply_raises_the_error_its_code_stands_for():
    def result(**meta: Any) -> dict[str, Any]:
        return Reply(id=1, ok=meta["ok"], meta={"id": 1, **meta}).result("send to rank 1")

    assert result(ok=True, nbytes=4) == {"id": 1, "ok": True, "nbytes": 4}
    with pytest.raises(fabricd.PeerFailed, match="send to rank 1: node 2 is down") as lost:
        result(ok=False, code="peer_failed", error="node 2 is down", rank=1, node=2)
    assert (lost.value.rank, lost.value.node) == (1, 2)
    with pytest.raises(fabricd.UsageError, match="bad"):
        result(ok=False, code="mismatch", error="bad")
    with pytest.raises(fabricd.DaemonUnavailable, match="refused"):
        result(ok=False, code="refused", error="refused")
    with pytest.raises(fabricd.OperationFailed) as newer:
        result(ok=False, code="from-the-future", error="?")
    assert newer.value.code == "from-the-future"
    with pytest.raises(fabricd.OperationFailed) as bare:
        result(ok=False)
    assert bare.value.code == "failed"


def test_the_protocol_module_does_no_io():
    tree = ast.parse(Path(protocol_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "fabricd" in imported  # the walk saw the imports
    assert imported.isdisjoint({"socket", "select", "selectors", "threading", "time", "asyncio"})


# -- the connection: events and the thread hand-off -------------------------------------------


@pytest.fixture
def daemons():
    """Make fake daemons; each is stopped (and its thread joined) at teardown."""
    made: list[FakeDaemon] = []

    def make(script: Any = None) -> FakeDaemon:
        made.append(FakeDaemon(script) if script is not None else FakeDaemon())
        return made[-1]

    yield make
    for daemon in made:
        daemon.stop()


def test_events_that_come_while_a_thread_waits_are_kept_for_poll(daemons):
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        daemon.push("tick", n=1)
        daemon.push("tick", n=2)
        daemon.reply(request, answer=42)

    conn = daemons(script).connection()
    assert conn.poll() == []
    reply = conn.wait(conn.submit("status", {}), timeout=5)
    assert reply.meta["answer"] == 42
    assert conn.poll() == [Event(name="tick", fields={"n": 1}), Event(name="tick", fields={"n": 2})]
    assert conn.poll() == []


def test_poll_gets_an_event_read_by_a_thread_that_waits_for_a_reply(daemons):
    blocked: list[dict[str, Any]] = []

    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "block":
            blocked.append(request)
            return
        daemon.push("news", turn=request["turn"])  # then free the blocked waiter
        daemon.reply(blocked.pop(), freed=request["turn"])

    conn = daemons(script).connection()
    for turn in range(30):  # threads meet in a different order each time
        call = conn.submit("block", {})
        waiter = threading.Thread(target=conn.wait, args=(call, 10))
        waiter.start()
        conn.submit("kick", {"turn": turn})
        assert conn.poll(timeout=10) == [Event(name="news", fields={"turn": turn})]
        waiter.join(10)
        assert call.reply is not None
        assert call.reply.meta["freed"] == turn


def test_every_thread_gets_its_own_reply_in_any_order(daemons):
    threads = 8
    arrived: list[dict[str, Any]] = []

    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        arrived.append(request)
        if len(arrived) == threads:  # answer last first, with an event before each reply
            for waiting in reversed(arrived):
                daemon.push("before", n=waiting["n"])
                daemon.reply(waiting, n=waiting["n"])

    conn = daemons(script).connection()
    got: dict[int, int] = {}

    def ask(n: int) -> None:
        got[n] = conn.wait(conn.submit("op", {"n": n}), timeout=10).meta["n"]

    workers = [threading.Thread(target=ask, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    assert got == {n: n for n in range(threads)}
    events = conn.poll()
    assert [e.fields["n"] for e in events] == [r["n"] for r in reversed(arrived)]


@pytest.mark.parametrize("gil", [True, False], ids=["gil", "no-gil"])
def test_threads_that_wait_without_a_time_limit_each_get_their_reply(daemons, monkeypatch, gil):
    # the reader sits in recv() with no timeout; the others sleep on the condition, counted,
    # and each reply the reader takes must wake them (without a GIL it always notifies)
    monkeypatch.setattr(connection_module, "_GIL", gil)
    threads = 4
    arrived: list[dict[str, Any]] = []

    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        arrived.append(request)
        if len(arrived) == threads:  # one reply at a time, last first
            for waiting in reversed(arrived):
                time.sleep(0.01)
                daemon.reply(waiting, n=waiting["n"])

    conn = daemons(script).connection()
    got: dict[int, int] = {}

    def ask(n: int) -> None:
        got[n] = conn.wait(conn.submit("op", {"n": n}), timeout=None).meta["n"]

    for _ in range(5):
        arrived.clear()
        got.clear()
        workers = [threading.Thread(target=ask, args=(n,)) for n in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(10)
        assert got == {n: n for n in range(threads)}
    assert conn._waiting == 0


def test_a_thread_with_a_time_limit_is_not_held_by_a_reader_without_one(daemons):
    held: list[dict[str, Any]] = []
    daemon = daemons(lambda daemon, request: held.append(request))
    conn = daemon.connection()
    forever = conn.submit("forever", {})
    reader = threading.Thread(target=conn.wait, args=(forever, None))
    reader.start()
    deadline = time.monotonic() + 10
    while not conn._read_lock.locked() and time.monotonic() < deadline:
        time.sleep(0.001)  # the reader is in recv() now (or about to be)
    short = conn.submit("short", {})
    start = time.monotonic()
    with pytest.raises(fabricd.Timeout, match=re.escape("short did not finish within 0.1s")):
        conn.wait(short, timeout=0.1)
    assert 0.09 <= time.monotonic() - start < 5
    while len(held) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    daemon.reply(held[1], n=2)
    assert conn.wait(short, timeout=10).meta["n"] == 2  # taken by the reader, or by this wait
    daemon.reply(held[0], n=1)
    reader.join(10)
    assert not reader.is_alive()
    assert forever.reply is not None
    assert forever.reply.meta["n"] == 1


def test_a_default_socket_timeout_does_not_limit_a_wait_without_one(daemons):
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        threading.Timer(0.2, daemon.reply, args=(request,), kwargs={"late": True}).start()

    socket.setdefaulttimeout(0.05)  # the socket below is made with it
    try:
        conn = daemons(script).connection()
    finally:
        socket.setdefaulttimeout(None)
    assert conn.wait(conn.submit("slow", {}), timeout=None).meta["late"] is True


def test_the_closing_event_is_what_every_pending_call_and_poll_raise(daemons):
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "last":
            daemon.send(closing_frame(ErrorCode.DAEMON_STOPPING, "draining for an upgrade"))
            daemon.hang_up()

    conn = daemons(script).connection()
    first = conn.submit("first", {})
    conn.submit("last", {})
    with pytest.raises(fabricd.OperationFailed, match="draining for an upgrade") as stopped:
        conn.wait(first, timeout=10).result("first")
    assert stopped.value.code == "daemon_stopping"
    assert conn.closed
    assert conn.poll() == [
        Event(
            name="closing", fields={"code": "daemon_stopping", "error": "draining for an upgrade"}
        )
    ]
    with pytest.raises(fabricd.OperationFailed, match="draining for an upgrade"):
        conn.poll(timeout=None)  # no wait for events that cannot come
    with pytest.raises(fabricd.OperationFailed, match="draining for an upgrade"):
        conn.submit("again", {})


def test_a_reason_sent_before_the_daemon_hung_up_survives_a_failed_send(daemons):
    daemon = daemons(lambda daemon, request: None)
    daemon.send(closing_frame(ErrorCode.REFUSED, "uid 1000 may not use this daemon"))
    daemon.hang_up()
    conn = daemon.connection()
    call = conn.submit("hello", {})  # the daemon is gone: the send itself fails
    assert conn._broken is not None
    with pytest.raises(fabricd.DaemonUnavailable, match="uid 1000 may not use this daemon"):
        conn.wait(call, timeout=10).result("hello")


def test_garbage_from_the_daemon_fails_every_pending_call(daemons):
    conn = daemons(
        lambda daemon, request: daemon.send(b"HTTP/1.1 400 Bad Request\r\n")
    ).connection()
    with pytest.raises(fabricd.DaemonUnavailable, match="sent something unreadable: bad magic"):
        conn.wait(conn.submit("status", {}), timeout=10).result("status")
    assert conn.closed


def test_a_silent_hang_up_names_the_socket(daemons):
    conn = daemons(lambda daemon, request: daemon.hang_up()).connection()
    with pytest.raises(fabricd.DaemonUnavailable, match=r"fake\.sock") as gone:
        conn.wait(conn.submit("status", {}), timeout=10).result("status")
    assert conn.closing is None
    assert "is the daemon running?" in str(gone.value)


def test_close_fails_a_waiting_thread_and_a_poller_and_releases_the_fd(daemons):
    conn = daemons(lambda daemon, request: None).connection()
    call = conn.submit("never", {})
    outcomes: list[str] = []

    def wait_forever() -> None:
        try:
            conn.wait(call, timeout=None).result("never")
        except fabricd.DaemonUnavailable as exc:
            outcomes.append(str(exc))

    def poll_forever() -> None:
        try:
            conn.poll(timeout=None)
        except fabricd.DaemonUnavailable as exc:
            outcomes.append(str(exc))

    workers = [threading.Thread(target=wait_forever), threading.Thread(target=poll_forever)]
    for worker in workers:
        worker.start()
    conn.close()
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()
    assert len(outcomes) == 2
    assert all("the client was closed" in outcome for outcome in outcomes)
    assert conn._sock.fileno() == -1


def test_past_the_bound_the_oldest_events_are_dropped_and_counted(daemons, monkeypatch):
    monkeypatch.setattr(connection_module, "MAX_QUEUED_EVENTS", 3)

    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        for n in range(5):
            daemon.push("e", n=n)
        daemon.reply(request)

    conn = daemons(script).connection()
    conn.wait(conn.submit("status", {}), timeout=10)
    assert [event.fields["n"] for event in conn.poll()] == [2, 3, 4]
    assert conn.events_dropped == 2


def test_poll_with_a_timeout_and_nothing_to_get_returns_empty_in_time(daemons):
    conn = daemons(lambda daemon, request: None).connection()
    start = time.monotonic()
    assert conn.poll(timeout=0.05) == []
    assert 0.04 <= time.monotonic() - start < 5


def test_a_client_gets_events_through_poll(daemons):
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "status":
            daemon.push("peer_down", node=3)
        daemon.reply(request, node=0, nodes=1, state="serving")

    with daemons(script).client() as fab:
        assert fab.status()["state"] == "serving"
        assert fab.poll() == [Event(name="peer_down", fields={"node": 3})]
        assert fab.events_dropped == 0
    assert fab.closed
    with pytest.raises(fabricd.DaemonUnavailable, match="the client was closed"):
        fab.poll()


def test_an_infinite_timeout_waits_and_one_that_is_no_number_is_refused(daemons):
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        daemon.push("tick", n=request["n"])
        daemon.reply(request, n=request["n"])

    conn = daemons(script).connection()
    first = conn.submit("status", {"n": 1})
    assert conn.wait(first, timeout=math.inf).meta["n"] == 1  # as long as it takes
    assert conn.poll(timeout=math.inf) == [Event(name="tick", fields={"n": 1})]
    second = conn.submit("status", {"n": 2})
    assert conn.poll(timeout=np.float64(math.inf)) == [Event(name="tick", fields={"n": 2})]
    assert conn.wait(second, timeout=np.float64(5)).meta["n"] == 2
    for wrong, shown in ((math.nan, "nan"), ("5", "str '5'"), (True, "a bool"), ([1], "list")):
        with pytest.raises(fabricd.UsageError, match=f"timeout must be .*, not {shown}"):
            conn.wait(conn.submit("status", {"n": 3}), timeout=wrong)  # type: ignore[arg-type]
        with pytest.raises(fabricd.UsageError, match=f"timeout must be .*, not {shown}"):
            conn.poll(timeout=wrong)  # type: ignore[arg-type]
    with pytest.raises(fabricd.Timeout):  # a negative timeout is no wait at all
        conn.wait(conn.submit("block", {"n": 4}), timeout=-math.inf)
