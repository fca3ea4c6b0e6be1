"""The transport contract (transports/base.py), one suite that every transport passes.

Each check is written once as a coroutine and runs on ``tcp`` (127.0.0.1, port 0) under both the
stock asyncio loop and uvloop, and on ``inproc``.  The tests are plain functions that run their
check in a fresh ``asyncio.Runner(loop_factory=...)``: pytest-asyncio 1.x deprecates overriding
its ``event_loop_policy`` fixture (an error under ``filterwarnings = error``) and its
replacement, the ``pytest_asyncio_loop_factories`` hook, must live in a conftest.py.  The runner
also fails the test on any exception the loop could not deliver to anyone.

Real loops, real sockets, real (short) timeouts: a check that would hang is cut by
``asyncio.wait_for`` rather than by the 120 s pytest timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import uvloop

from fabricd.errors import LocalProtocolError, RemoteProtocolError, TransportError
from fabricd.integrity import KEY_SIZE, Opener, Sealer
from fabricd.transports import batch, inproc, tcp
from fabricd.transports.base import split_address
from fabricd.transports.framing import FRAME_BUDGET
from fabricd.transports.inproc import InprocTransport
from fabricd.transports.posted import PostKey, WriteLanded
from fabricd.transports.tcp import TcpTransport
from fabricd.wire import DEFAULT_LIMITS, DISCARD, Discard, Kind, Limits, encode_head

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

    from fabricd.transports.base import Link, Listener, Transport
    from fabricd.wire import Frame, FrameHead

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
CASES = [("tcp", "asyncio"), ("tcp", "uvloop"), ("inproc", "asyncio")]
#: how long any single wait in a check may take before the check fails
PATIENCE = 20.0
MiB = 1 << 20


@pytest.fixture(params=CASES, ids=[f"{t}-{loop}" for t, loop in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


def run(case: tuple[str, str], check: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    """Run ``check(transport)`` on a fresh loop of the case's kind; fail on stray loop errors."""
    kind, loop = case
    stray: list[dict[str, Any]] = []
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.get_loop().set_exception_handler(lambda _, context: stray.append(context))
        runner.run(asyncio.wait_for(check(kind), 3 * PATIENCE))
    assert stray == [], f"the event loop saw unhandled errors: {stray}"


# -- the harness ------------------------------------------------------------------------------
class Sink:
    """A FrameSink that records everything and lets a check wait for it."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.heads: list[FrameHead] = []
        self.lost: list[BaseException | None] = []
        self.supply: Callable[[FrameHead], memoryview | Discard | None] | None = None
        self.fail: Exception | None = None  #: raise this from frame_received
        self._changed = asyncio.Event()

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | Discard | None:
        self.heads.append(head)
        return None if self.supply is None else self.supply(head)

    def frame_received(self, link: Link, frame: Frame) -> None:
        if self.fail is not None:
            raise self.fail
        self.frames.append(frame)
        self._changed.set()

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        self.lost.append(exc)
        self._changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(PATIENCE):
            while not condition():
                self._changed.clear()
                await self._changed.wait()

    async def frames_count(self, n: int) -> list[Frame]:
        await self.until(lambda: len(self.frames) >= n)
        return self.frames

    async def closed(self) -> None:
        await self.until(lambda: bool(self.lost))


@dataclass
class Pair:
    client: Link
    server: Link
    client_sink: Sink
    server_sink: Sink


@dataclass
class Net:
    """One transport with one listener, and every link it opened (closed at the end)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    limits: Limits = DEFAULT_LIMITS
    transport: Transport = field(init=False)
    listener: Listener = field(init=False)
    accepted: asyncio.Queue[tuple[Link, Sink]] = field(init=False)
    links: list[Link] = field(default_factory=list)

    async def start(self) -> None:
        self.transport = TcpTransport() if self.kind == "tcp" else InprocTransport(**self.options)
        self.accepted = asyncio.Queue()
        address = "127.0.0.1:0" if self.kind == "tcp" else "server"
        self.listener = await self.transport.listen(address, self._on_link, self.limits)

    def _on_link(self, link: Link) -> None:
        sink = Sink()
        link.set_sink(sink)  # before returning, as the contract asks
        self.links.append(link)
        self.accepted.put_nowait((link, sink))

    async def pair(self) -> Pair:
        client = await self.transport.connect(self.listener.address, self.limits)
        client_sink = Sink()
        client.set_sink(client_sink)
        self.links.append(client)
        async with asyncio.timeout(PATIENCE):
            server, server_sink = await self.accepted.get()
        return Pair(client, server, client_sink, server_sink)

    async def aclose(self) -> None:
        for link in self.links:
            link.close("test over")
        async with asyncio.timeout(PATIENCE):
            for link in self.links:
                await link.wait_closed()
        await self.listener.aclose()


@contextlib.asynccontextmanager
async def network(kind: str, limits: Limits = DEFAULT_LIMITS, **options: Any) -> AsyncIterator[Net]:
    net = Net(kind, options, limits)
    await net.start()
    try:
        yield net
    finally:
        await net.aclose()


def stall_reader(pair: Pair) -> None:
    """Make the server stop reading (tcp: the protocol's transport stops reading the socket)."""
    pair.server._transport.pause_reading()  # type: ignore[attr-defined]


def resume_reader(pair: Pair) -> None:
    pair.server._transport.resume_reading()  # type: ignore[attr-defined]


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def pending(awaitable: Awaitable[None], seconds: float) -> asyncio.Future[None]:
    """Start ``awaitable`` and return it, still running after ``seconds`` (or fail)."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    assert not done, "expected this to block"
    return task


# -- ordering and metadata --------------------------------------------------------------------
async def check_order_and_metadata(kind: str) -> None:
    sizes = [0, 1, 7, 4096, 65_537, 300_000]
    async with network(kind) as net:
        pair = await net.pair()

        async def talk(link: Link, side: str) -> None:
            for i, size in enumerate(itertools.islice(itertools.cycle(sizes), 60)):
                data = pattern(size, i)
                parts = [data[:3], bytearray(data[3:10]), memoryview(data)[10:]]
                meta = {"i": i, "side": side, "blob": b"\x00\xff" * (i % 5), "list": [i, "x"]}
                await link.send(Kind.DATA if size else Kind.HEARTBEAT, meta, parts)

        await asyncio.gather(talk(pair.client, "client"), talk(pair.server, "server"))
        for sink, side in ((pair.server_sink, "client"), (pair.client_sink, "server")):
            frames = await sink.frames_count(60)
            assert [f.meta["i"] for f in frames] == list(range(60))
            for i, frame in enumerate(frames):
                size = sizes[i % len(sizes)]
                assert frame.kind is (Kind.DATA if size else Kind.HEARTBEAT)
                assert frame.meta == {
                    "i": i,
                    "side": side,
                    "blob": b"\x00\xff" * (i % 5),
                    "list": [i, "x"],
                }
                assert bytes(frame.payload) == pattern(size, i)
            # payload_buffer is asked once per frame that has a payload, never for empty ones
            assert [h.meta["i"] for h in sink.heads] == [
                i for i in range(60) if sizes[i % len(sizes)]
            ]


def test_frames_arrive_in_order_with_metadata_both_ways(case: tuple[str, str]) -> None:
    run(case, check_order_and_metadata)


async def check_concurrent_writers(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()

        async def writer(w: int) -> None:
            for n in range(5):
                await pair.client.send(Kind.DATA, {"w": w, "n": n}, [pattern(50_000, w * 10 + n)])

        await asyncio.gather(*(writer(w) for w in range(20)))
        frames = await pair.server_sink.frames_count(100)
        for frame in frames:
            assert bytes(frame.payload) == pattern(50_000, frame.meta["w"] * 10 + frame.meta["n"])
        for w in range(20):
            assert [f.meta["n"] for f in frames if f.meta["w"] == w] == list(range(5))


def test_frames_of_concurrent_writers_never_interleave(case: tuple[str, str]) -> None:
    run(case, check_concurrent_writers)


async def check_addresses(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        assert pair.client.peer_address == net.listener.address
        assert pair.server.peer_address == pair.client.local_address
        assert pair.server.local_address == net.listener.address
        if kind == "tcp":
            host, port = split_address(net.listener.address)
            assert host == "127.0.0.1"  # exactly what was asked for, never all interfaces
            assert port != 0


def test_links_know_both_addresses(case: tuple[str, str]) -> None:
    run(case, check_addresses)


# -- payloads land in place -------------------------------------------------------------------
async def check_large_payload_in_place(kind: str) -> None:
    size = 64 * MiB  # the largest payload DEFAULT_LIMITS allows
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    target = bytearray(size)
    async with network(kind) as net:
        pair = await net.pair()
        pair.server_sink.supply = lambda head: memoryview(target)
        await pair.client.send(Kind.DATA, {"msg": 1, "off": 0}, [memoryview(data)])
        (frame,) = await pair.server_sink.frames_count(1)
        assert frame.payload.obj is target  # the very buffer, not a copy of it
        assert len(frame.payload) == size
        assert np.array_equal(np.frombuffer(target, dtype=np.uint8), data)
        assert [h.payload_len for h in pair.server_sink.heads] == [size]
        assert pair.server_sink.heads[0].meta == {"msg": 1, "off": 0}


def test_a_64_mib_payload_lands_in_the_supplied_buffer(case: tuple[str, str]) -> None:
    run(case, check_large_payload_in_place)


async def check_fresh_buffer(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        offered = bytearray(100_000)
        calls: list[int] = []

        def supply(head: FrameHead) -> memoryview | None:
            calls.append(head.meta["i"])
            return memoryview(offered) if head.meta["i"] == 1 else None

        pair.server_sink.supply = supply
        for i in range(3):
            await pair.client.send(Kind.DATA, {"i": i}, [pattern(100_000, i)])
        frames = await pair.server_sink.frames_count(3)
        assert calls == [0, 1, 2]
        assert [bytes(f.payload) == pattern(100_000, f.meta["i"]) for f in frames] == [True] * 3
        assert frames[1].payload.obj is offered
        assert frames[0].payload.obj is not offered
        assert frames[2].payload.obj is not frames[0].payload.obj  # each gets its own
        assert not frames[0].payload.readonly


def test_payload_buffer_returning_none_gives_a_fresh_buffer(case: tuple[str, str]) -> None:
    run(case, check_fresh_buffer)


async def check_discard(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        sink = pair.server_sink
        sink.supply = lambda head: DISCARD if head.meta["i"] == 1 else None
        await pair.client.send(Kind.DATA, {"i": 0}, [b"before"])
        await pair.client.send(Kind.DATA, {"i": 1}, [bytes(64 * MiB)])
        await pair.client.send(Kind.DATA, {"i": 2}, [b"after"])
        frames = await sink.frames_count(3)
        # the dropped frame arrives without its payload: the decoder never allocated one (it
        # would be this frame's payload), and the stream goes on exactly after it
        assert [(f.meta["i"], bytes(f.payload)) for f in frames] == [
            (0, b"before"),
            (1, b""),
            (2, b"after"),
        ]
        assert sink.lost == []
        assert pair.server.statistics().bytes_received > 64 * MiB  # every byte was read


def test_a_discarded_payload_is_read_and_dropped_unallocated(case: tuple[str, str]) -> None:
    run(case, check_discard)


# -- backpressure -----------------------------------------------------------------------------
async def check_backpressure(kind: str) -> None:
    # inproc has no reader to stall: a long latency and a small window keep the frames in
    # flight instead, and "reading resumes" when they are delivered
    options = {"latency": 0.5, "window": MiB} if kind == "inproc" else {}
    chunk = bytes(MiB)
    async with network(kind, **options) as net:
        pair = await net.pair()
        if kind == "tcp":
            stall_reader(pair)
        for i in range(1024):  # tcp: the kernel's buffers fill first, then the link's
            task = asyncio.ensure_future(pair.client.send(Kind.DATA, {"i": i}, [chunk]))
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done:
                break
        else:
            pytest.fail("send never waited for the peer")
        sent = i + 1
        await asyncio.sleep(0.1)
        assert not task.done()  # still waiting: not a transient pause
        if kind == "tcp":
            resume_reader(pair)
        async with asyncio.timeout(PATIENCE):
            await task
        frames = await pair.server_sink.frames_count(sent)
        assert [f.meta["i"] for f in frames] == list(range(sent))
        assert pair.server_sink.lost == []


def test_send_waits_while_the_peer_does_not_read(case: tuple[str, str]) -> None:
    run(case, check_backpressure)


async def check_send_now(kind: str) -> None:
    # what send_now promises: now, in order with send(), or not at all -- never past a sender
    # that waits out backpressure
    options = {"latency": 0.5, "window": MiB} if kind == "inproc" else {}
    chunk = bytes(MiB)
    async with network(kind, **options) as net:
        pair = await net.pair()
        assert pair.client.send_now(Kind.DATA, {"i": 0}, [b"first"])  # an idle link: at once
        if kind == "tcp":
            stall_reader(pair)
        for i in range(1, 1025):
            task = asyncio.ensure_future(pair.client.send(Kind.DATA, {"i": i}, [chunk]))
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done:
                break
        else:
            pytest.fail("send never waited for the peer")
        assert not pair.client.send_now(Kind.DATA, {"i": -1}, [b"behind a waiting send"])
        if kind == "tcp":
            resume_reader(pair)
        async with asyncio.timeout(PATIENCE):
            await task
        frames = await pair.server_sink.frames_count(i + 1)
        assert [f.meta["i"] for f in frames] == list(range(i + 1))  # the refused one never went
        assert bytes(frames[0].payload) == b"first"
        pair.client.close("test")
        with pytest.raises(TransportError):
            pair.client.send_now(Kind.DATA, {"i": -2}, [b"late"])


def test_send_now_queues_at_once_only_when_nothing_waits(case: tuple[str, str]) -> None:
    run(case, check_send_now)


async def flood(link: Link) -> None:
    """send_nowait until the link refuses."""
    chunk = bytes(64 * 1024)
    for i in range(100_000):
        link.send_nowait(Kind.DATA, {"i": i}, [chunk])
        if i % 64 == 63:
            await asyncio.sleep(0)  # let the loop move bytes into the kernel


async def check_send_nowait_limit(kind: str) -> None:
    options = {"latency": 30.0} if kind == "inproc" else {}
    async with network(kind, **options) as net:
        pair = await net.pair()
        if kind == "tcp":
            stall_reader(pair)
        with pytest.raises(TransportError, match="is closed"):
            await flood(pair.client)
        assert pair.client.closed
        assert "not reading" in (pair.client.close_reason or "")
        # the link is given up, not flushed into a peer that does not read
        async with asyncio.timeout(5):
            await pair.client.wait_closed()
        assert pair.client_sink.lost == [None]
        if kind == "tcp":
            resume_reader(pair)
        await pair.server_sink.closed()
        assert len(pair.server_sink.lost) == 1


def test_send_nowait_gives_up_on_a_peer_that_does_not_read(
    case: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp, "MAX_UNREAD", 512 * 1024)
    monkeypatch.setattr(inproc, "MAX_UNREAD", 512 * 1024)
    run(case, check_send_nowait_limit)


async def check_send_is_not_cut_by_the_nowait_limit(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        for i in range(4):  # each frame alone is past MAX_UNREAD: send's own backpressure rules
            await pair.client.send(Kind.DATA, {"i": i}, [bytes(MiB)])
        frames = await pair.server_sink.frames_count(4)
        assert [f.meta["i"] for f in frames] == [0, 1, 2, 3]
        assert not pair.client.closed


def test_send_is_not_cut_by_the_nowait_limit(
    case: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp, "MAX_UNREAD", 512 * 1024)
    monkeypatch.setattr(inproc, "MAX_UNREAD", 512 * 1024)
    run(case, check_send_is_not_cut_by_the_nowait_limit)


# -- many small frames: the frame budget, and writes held while a read callback runs ----------
async def check_flood_is_delivered_a_budget_at_a_time(kind: str) -> None:
    # a burst far larger than the budget (a flood of CANCELs): every frame arrives, in order,
    # and the loop gets control between batches -- a callback that re-arms itself every loop
    # iteration sees at most two budgets' worth delivered between two of its runs (a
    # renewed budget's leftover, then the next), never the whole burst at once
    count = 20 * FRAME_BUDGET
    async with network(kind) as net:
        pair = await net.pair()
        sink = pair.server_sink
        loop = asyncio.get_running_loop()
        seen: list[int] = []  #: frames delivered so far, once per loop iteration

        def tick() -> None:
            seen.append(len(sink.frames))
            if len(sink.frames) < count and not sink.lost:
                loop.call_soon(tick)

        for i in range(count):  # one go: they reach the peer's socket buffer together
            pair.client.send_nowait(Kind.CANCEL, {"i": i})
        loop.call_soon(tick)
        frames = await sink.frames_count(count)
        assert [f.meta["i"] for f in frames] == list(range(count))  # none lost or reordered
        await sink.until(lambda: len(seen) > 1 and seen[-1] == count)
        steps = [after - before for before, after in itertools.pairwise(seen)]
        assert max(steps) <= 2 * FRAME_BUDGET, f"one loop iteration delivered {max(steps)}"
        assert not sink.lost


def test_a_flood_of_small_frames_is_delivered_a_budget_at_a_time(case: tuple[str, str]) -> None:
    run(case, check_flood_is_delivered_a_budget_at_a_time)


async def check_held_writes_keep_their_order_and_seals(kind: str) -> None:
    # frames queued while a read callback runs (the first at once, the rest when it returns)
    # keep call order whichever method queued them, small or large, and each one's trailer is
    # sealed in that wire order (one out of order would fail the peer's check and close the link)
    big = pattern(MiB, 5)
    async with network(kind) as net:
        pair = await net.pair()
        secure(pair)
        batch.hold()
        try:
            pair.client.send_nowait(Kind.DATA, {"i": 0})
            assert pair.client.send_now(Kind.DATA, {"i": 1}, [b"small"])
            pair.client.send_nowait(Kind.DATA, {"i": 2}, [b"x" * 1000])
            assert pair.client.send_now(Kind.DATA, {"i": 3}, [big])  # large: not held
            pair.client.send_nowait(Kind.CANCEL, {"i": 4})
        finally:
            batch.release()
        await pair.client.send(Kind.DATA, {"i": 5}, [b"after the callback"])
        frames = await pair.server_sink.frames_count(6)
        assert [f.meta["i"] for f in frames] == list(range(6))
        payloads = [bytes(f.payload) for f in frames]
        assert payloads == [b"", b"small", b"x" * 1000, big, b"", b"after the callback"]
        assert pair.server.close_reason is None
        assert pair.client.close_reason is None


def test_frames_held_in_a_read_callback_keep_their_order_and_seals(
    case: tuple[str, str],
) -> None:
    run(case, check_held_writes_keep_their_order_and_seals)


async def check_close_in_a_read_callback_sends_what_it_held(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        batch.hold()
        try:
            pair.client.send_nowait(Kind.BYE, {"last": True})
            pair.client.close("done here")
        finally:
            batch.release()
        frames = await pair.server_sink.frames_count(1)
        assert frames[0].meta == {"last": True}
        await pair.server_sink.closed()


def test_a_close_in_a_read_callback_still_sends_what_it_held(case: tuple[str, str]) -> None:
    if case[0] != "tcp":
        pytest.skip("inproc links drop queued frames on close")
    run(case, check_close_in_a_read_callback_sends_what_it_held)


# -- closing ----------------------------------------------------------------------------------
async def check_close(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        await pair.client.send(Kind.HEARTBEAT, {"last": True})
        await pair.server_sink.frames_count(1)
        pair.client.close("done here")
        pair.client.close("a second reason is ignored")
        assert pair.client.closed
        async with asyncio.timeout(PATIENCE):
            await pair.client.wait_closed()
            await pair.server.wait_closed()
        await asyncio.sleep(0.05)  # room for a duplicate link_lost to show up
        assert pair.client_sink.lost == [None]  # closed on purpose
        assert len(pair.server_sink.lost) == 1
        assert pair.client.close_reason == "done here"
        assert pair.server.close_reason == "closed by peer"
        assert pair.server.closed
        for link in (pair.client, pair.server):
            with pytest.raises(TransportError):
                await link.send(Kind.HEARTBEAT, {})
            with pytest.raises(TransportError):
                link.send_nowait(Kind.HEARTBEAT, {})
        await pair.client.wait_closed()  # again: returns at once


def test_close_is_seen_once_on_both_sides(case: tuple[str, str]) -> None:
    run(case, check_close)


async def check_wait_closed_from_many(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        waiters = [asyncio.ensure_future(pair.server.wait_closed()) for _ in range(3)]
        waiters[0].cancel()  # one waiter giving up does not disturb the others
        pair.server.close("bye")
        async with asyncio.timeout(PATIENCE):
            await asyncio.gather(*waiters[1:])
            await pair.client_sink.closed()
        assert pair.client.closed


def test_wait_closed_serves_every_waiter(case: tuple[str, str]) -> None:
    run(case, check_wait_closed_from_many)


async def check_blocked_send_fails_on_close(kind: str) -> None:
    options = {"latency": 30.0, "window": MiB} if kind == "inproc" else {}
    async with network(kind, **options) as net:
        pair = await net.pair()
        if kind == "tcp":
            stall_reader(pair)
        for i in range(1024):
            task = asyncio.ensure_future(pair.client.send(Kind.DATA, {"i": i}, [bytes(MiB)]))
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done:
                break
        pair.server.close("the reader gives up")  # tcp: unread bytes make this a reset
        with pytest.raises(TransportError):
            async with asyncio.timeout(PATIENCE):
                await task


def test_a_blocked_send_fails_when_the_link_closes(case: tuple[str, str]) -> None:
    run(case, check_blocked_send_fails_on_close)


# -- bad input --------------------------------------------------------------------------------
async def check_limits_and_protocol_errors(kind: str) -> None:
    async with network(kind) as net:
        good, bad = await net.pair(), await net.pair()
        bad.server.set_limits(Limits(max_payload=1000))
        await bad.client.send(Kind.DATA, {"i": 0}, [bytes(1000)])  # within the new limit
        await bad.server_sink.frames_count(1)
        await bad.client.send(Kind.DATA, {"i": 1}, [bytes(1001)])  # the next frame: past it
        await bad.server_sink.closed()
        assert bad.server.close_reason == "protocol error: payload of 1001 B exceeds 1000 B"
        await bad.client_sink.closed()
        assert len(bad.server_sink.frames) == 1

        await good.client.send(Kind.DATA, {"still": "fine"}, [bytes(5000)])  # another link
        (frame,) = await good.server_sink.frames_count(1)
        assert frame.meta == {"still": "fine"}
        assert good.server_sink.lost == []


def test_limits_apply_to_the_next_frame_and_close_only_that_link(case: tuple[str, str]) -> None:
    run(case, check_limits_and_protocol_errors)


async def check_kind_limits(kind: str) -> None:
    handshake_only = Limits(kinds=frozenset({Kind.HELLO, Kind.AUTH}), max_payload=0)
    async with network(kind, limits=handshake_only) as net:
        pair = await net.pair()
        await pair.client.send(Kind.HELLO, {"v": 1})
        await pair.server_sink.frames_count(1)
        with pytest.raises(LocalProtocolError, match="exceeds 0 B"):  # a link sends within
            await pair.client.send(Kind.DATA, {"i": 1}, [b"payload"])  # its own limits too
        for link in (pair.server, pair.client):  # authenticated: everything is allowed now
            link.set_limits(DEFAULT_LIMITS)
        await pair.client.send(Kind.DATA, {"i": 1}, [b"payload"])
        await pair.server_sink.frames_count(2)
        pair.server.set_limits(handshake_only)
        await pair.client.send(Kind.RTS, {"i": 2})
        await pair.server_sink.closed()
        assert pair.server.close_reason == "protocol error: frame kind RTS is not allowed here"


def test_frame_kinds_outside_the_limits_close_the_link(case: tuple[str, str]) -> None:
    run(case, check_kind_limits)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RemoteProtocolError("no such message"), "protocol error: no such message"),
        (KeyError("bug"), "internal error while handling a frame (see the log)"),
    ],
)
def test_a_sink_that_raises_closes_its_link(
    case: tuple[str, str], error: Exception, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def check(kind: str) -> None:
        async with network(kind) as net:
            pair = await net.pair()
            pair.server_sink.fail = error
            await pair.client.send(Kind.HEARTBEAT, {})
            await pair.server_sink.closed()
            assert pair.server.close_reason == reason
            await pair.client_sink.closed()

    run(case, check)
    if isinstance(error, KeyError):
        assert "receiver of" in caplog.text  # logged with its traceback


def test_garbage_on_a_tcp_listener_closes_only_that_connection() -> None:
    async def check(kind: str) -> None:
        async with network(kind) as net:
            good = await net.pair()
            host, port = split_address(net.listener.address)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET / HTTP/1.1\r\nHost: fabricd\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(PATIENCE):
                link, sink = await net.accepted.get()
                await sink.closed()
                assert await reader.read() == b""  # the daemon hung up
            assert (link.close_reason or "").startswith("protocol error: bad magic")
            assert sink.frames == []
            writer.close()
            await writer.wait_closed()

            await good.client.send(Kind.HEARTBEAT, {"n": 1})
            await good.server.send(Kind.HEARTBEAT, {"n": 2})
            assert (await good.server_sink.frames_count(1))[0].meta == {"n": 1}
            assert (await good.client_sink.frames_count(1))[0].meta == {"n": 2}

    for loop in LOOPS:
        run(("tcp", loop), check)


def test_tcp_connect_and_listen_errors_are_transport_errors() -> None:
    async def check(kind: str) -> None:
        transport = TcpTransport()
        async with network(kind) as net:
            with pytest.raises(TransportError, match="cannot listen on"):
                await transport.listen(net.listener.address, lambda link: None, DEFAULT_LIMITS)
        with pytest.raises(TransportError, match="cannot connect to"):
            await transport.connect(net.listener.address, DEFAULT_LIMITS)  # closed by now

    run(("tcp", "asyncio"), check)


def test_a_tcp_host_that_cannot_be_looked_up_fails_the_dial_as_a_transport_error() -> None:
    """An empty label, one over 63 characters (the IDNA codec's UnicodeError) or a NUL
    (ValueError) in a host: the dialler catches TransportError only, and anything else would
    end the daemon's task group, from a static config or etcd alike."""

    async def check(kind: str) -> None:
        transport = TcpTransport()
        for address in ("h..:7450", f"{'a' * 64}:7450", ".:1", "h\x00:7450"):
            with pytest.raises(TransportError, match="cannot connect to"):
                await transport.connect(address, DEFAULT_LIMITS)

    for loop in LOOPS:
        run(("tcp", loop), check)


def test_inproc_connect_and_listen_errors_are_transport_errors() -> None:
    async def check(kind: str) -> None:
        async with network(kind) as net:
            transport = net.transport
            with pytest.raises(TransportError, match="address in use"):
                await transport.listen("server", lambda link: None, DEFAULT_LIMITS)
            with pytest.raises(TransportError, match="nobody listens"):
                await transport.connect("elsewhere", DEFAULT_LIMITS)

    run(("inproc", "asyncio"), check)


# -- statistics -------------------------------------------------------------------------------
async def check_statistics(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        frames = [(Kind.HEARTBEAT, {}, 0), (Kind.DATA, {"msg": 1}, 10_000), (Kind.BYE, {}, 0)]
        for k, meta, size in frames:
            await pair.client.send(k, meta, [bytes(size)] if size else ())
        await pair.server.send(Kind.DATA, {"msg": 2}, [bytes(123)])
        await pair.server_sink.frames_count(3)
        await pair.client_sink.frames_count(1)
        wire = sum(len(encode_head(k, meta, size)) + size for k, meta, size in frames)
        back = len(encode_head(Kind.DATA, {"msg": 2}, 123)) + 123
        client, server = pair.client.statistics(), pair.server.statistics()
        assert (client.frames_sent, client.bytes_sent) == (3, wire)
        assert (server.frames_received, server.bytes_received) == (3, wire)
        assert (server.frames_sent, server.bytes_sent) == (1, back)
        assert (client.frames_received, client.bytes_received) == (1, back)


def test_statistics_count_frames_and_bytes(case: tuple[str, str]) -> None:
    run(case, check_statistics)


async def check_close_gives_up_flushing_to_a_stalled_peer(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        stall_reader(pair)
        for i in range(64):  # far more than the kernel buffers hold: most stays queued
            pair.client.send_nowait(Kind.DATA, {"i": i}, [bytes(256 * 1024)])
        pair.client.close("peer is down")
        async with asyncio.timeout(5):  # CLOSE_GRACE, not forever
            await pair.client.wait_closed()
        assert pair.client_sink.lost == [None]
        assert pair.client.close_reason == "peer is down"


def test_close_gives_up_flushing_to_a_stalled_peer(
    case: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if case[0] != "tcp":
        pytest.skip("inproc links drop queued frames on close; there is no flush to bound")
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 0.2)
    run(case, check_close_gives_up_flushing_to_a_stalled_peer)


def test_inproc_bandwidth_serializes_frames() -> None:
    """Back-to-back frames share the link: n bytes at b B/s take at least n/b (a lower bound)."""

    async def check(kind: str) -> None:
        async with network(kind, bandwidth=10e6, latency=0.01, window=64 * MiB) as net:
            pair = await net.pair()
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i in range(4):
                pair.client.send_nowait(Kind.DATA, {"i": i}, [bytes(256 * 1024)])
            await pair.server_sink.frames_count(4)
            assert loop.time() - start >= 4 * 256 * 1024 / 10e6 + 0.01

    run(("inproc", "asyncio"), check)


# -- sealed links: a client's memory changing under a covered payload ---------------------------
def secure(pair: Pair) -> None:
    """Seal both directions as the handshake would, DATA payloads covered (data_integrity)."""
    up, down = bytes(range(KEY_SIZE)), bytes(range(1, KEY_SIZE + 1))
    pair.client.secure(Sealer(up, cover_data=True), Opener(down, require_data=True))
    pair.server.secure(Sealer(down, cover_data=True), Opener(up, require_data=True))


async def check_sender_reusing_its_buffer(kind: str) -> None:
    size = 48 * MiB  # more than the kernel's buffers hold while the reader is stalled
    source = bytearray(pattern(size, 11))
    original = bytes(source)
    async with network(kind) as net:
        pair = await net.pair()
        secure(pair)
        if kind == "tcp":
            stall_reader(pair)
        assert pair.client.send_now(Kind.DATA, {"msg": 1, "off": 0}, [memoryview(source)])
        source[-MiB:] = bytes(MiB)  # the sending client reuses its buffer before it is sent
        if kind == "tcp":
            resume_reader(pair)
        sink = pair.server_sink
        await sink.until(lambda: bool(sink.frames or sink.lost))
        assert pair.server.close_reason is None  # not "integrity check failed": no reset
        (frame,) = sink.frames
        assert bytes(frame.payload) == original  # the bytes sealed are the bytes sent


def test_a_sender_reusing_its_buffer_under_a_sealed_frame_does_not_fail_the_link(
    case: tuple[str, str],
) -> None:
    run(case, check_sender_reusing_its_buffer)


# -- posted regions: one-hop WRITE frames (transports/posted.py) --------------------------------
class Landed:
    """An ``on_landed`` callback that records completions and lets a check wait for them."""

    def __init__(self) -> None:
        self.writes: list[WriteLanded] = []
        self._changed = asyncio.Event()

    def __call__(self, landed: WriteLanded) -> None:
        self.writes.append(landed)
        self._changed.set()

    async def count(self, n: int) -> list[WriteLanded]:
        async with asyncio.timeout(PATIENCE):
            while len(self.writes) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.writes


SEALINGS = ["plain", "sealed-covered", "sealed-uncovered"]


def seal(pair: Pair, sealing: str) -> None:
    if sealing == "plain":
        return
    cover = sealing == "sealed-covered"
    up, down = bytes(range(KEY_SIZE)), bytes(range(1, KEY_SIZE + 1))
    pair.client.secure(Sealer(up, cover_data=cover), Opener(down, require_data=cover))
    pair.server.secure(Sealer(down, cover_data=cover), Opener(up, require_data=cover))


async def check_writes_land_in_place(kind: str, sealing: str) -> None:
    region = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB
    key = PostKey(epoch=7, slot=3)
    landed = Landed()
    async with network(kind) as net:
        pair = await net.pair()
        seal(pair, sealing)
        pair.server.post(key, region.data, dtype="float32", on_landed=landed)
        source = np.arange(region.size, dtype=np.float32)
        spans = [(0, 4), (4096, 300_000), (1 << 19, 8), (64, 0), ((1 << 20) - 4, 4)]
        for seq, (off, n) in enumerate(spans):
            raw = source.view(np.uint8)[off : off + n]
            await pair.client.write(key, off, [raw[:1].tobytes(), raw.data[1:]], seq)
        writes = await landed.count(len(spans))
        assert writes == [
            WriteLanded(key=key, offset=off, nbytes=n, seq=seq)
            for seq, (off, n) in enumerate(spans)
        ]
        expected = np.zeros_like(region)
        for off, n in spans:
            expected.view(np.uint8)[off : off + n] = source.view(np.uint8)[off : off + n]
        assert np.array_equal(region, expected)  # those bytes, and nothing else
        # WRITE never reaches the sink: no frame, and no payload buffer asked for
        assert (pair.server_sink.frames, pair.server_sink.heads) == ([], [])
        stats = pair.server.statistics()
        assert (stats.writes_landed, stats.writes_refused) == (len(spans), 0)
        assert pair.server.close_reason is None


@pytest.mark.parametrize("sealing", SEALINGS)
def test_a_write_lands_in_the_posted_region_and_is_reported(
    case: tuple[str, str], sealing: str
) -> None:
    run(case, lambda kind: check_writes_land_in_place(kind, sealing))


async def check_refused_writes(kind: str, sealing: str) -> None:
    """Past the end, misaligned, unknown slot, other epoch, retired: each refused before any
    byte is placed, logged, counted, and the link goes on."""
    region = bytearray(b"\xaa" * 4096)
    other = bytearray(64)
    key, marker = PostKey(epoch=1, slot=0), PostKey(epoch=1, slot=1)
    retired = PostKey(epoch=1, slot=2)
    landed, marks = Landed(), Landed()
    async with network(kind) as net:
        pair = await net.pair()
        seal(pair, sealing)
        server = pair.server
        server.post(key, memoryview(region).cast("B").cast("I"), dtype="uint32", on_landed=landed)
        server.post(marker, memoryview(bytearray(1)), on_landed=marks)
        server.post(retired, memoryview(other), on_landed=landed)
        server.retire(retired)
        bad = [
            (key, 4096 - 8, 12),  # 4 B past the end
            (key, 4096, 4),  # starts at the end
            (key, 2**62, 4),  # far past it
            (key, 2, 4),  # not whole uint32 elements
            (key, 0, 6),
            (PostKey(epoch=1, slot=9), 0, 4),  # never posted
            (PostKey(epoch=2, slot=0), 0, 4),  # another epoch
            (retired, 0, 4),
        ]
        for seq, (k, off, n) in enumerate(bad):
            await pair.client.write(k, off, [b"\x55" * n], seq)
        await pair.client.write(marker, 0, [b"m"], 99)  # behind every bad one, on the same link
        await marks.count(1)
        assert region == b"\xaa" * 4096
        assert other == bytes(64)
        assert landed.writes == []
        assert server.statistics().writes_refused == len(bad)
        assert server.close_reason is None  # a refusal is not a protocol error
        await pair.client.write(key, 4092, [b"\x01\x02\x03\x04"], 100)  # the last element fits
        assert [w.seq for w in await landed.count(1)] == [100]
        assert region[-4:] == b"\x01\x02\x03\x04"
        assert region[:-4] == b"\xaa" * 4092


@pytest.mark.parametrize("sealing", ["plain", "sealed-covered"])
def test_refused_writes_never_land_and_keep_the_link(
    case: tuple[str, str], sealing: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fabricd.transport"):
        run(case, lambda kind: check_refused_writes(kind, sealing))
    reasons = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(reasons) == 8
    assert sum("run past the region's 4096 B" in r for r in reasons) == 3
    assert sum("not whole elements of 4 B" in r for r in reasons) == 2
    assert sum("it is not posted" in r for r in reasons) == 2
    assert sum("it was retired" in r for r in reasons) == 1


async def check_concurrent_disjoint_writers(kind: str) -> None:
    """Eight tasks on one link and four on a second link write disjoint 64 KiB ranges of one
    region (posted on each link under its own key): every range lands, whole and once."""
    chunk, per_task = 64 * 1024, 8
    region = np.zeros(12 * per_task * chunk, dtype=np.uint8)
    source = np.frombuffer(pattern(region.size, 5), dtype=np.uint8)
    async with network(kind) as net:
        pairs = [await net.pair(), await net.pair()]
        landed = [Landed(), Landed()]
        keys = [PostKey(epoch=1, slot=0), PostKey(epoch=1, slot=1)]
        for pair, key, done in zip(pairs, keys, landed, strict=True):
            pair.server.post(key, region.data, on_landed=done)

        async def writer(task: int) -> None:
            link = 0 if task < 8 else 1
            for i in range(per_task):
                off = (task * per_task + i) * chunk
                await pairs[link].client.write(
                    keys[link], off, [source[off : off + chunk].tobytes()], seq=off
                )

        await asyncio.gather(*(writer(t) for t in range(12)))
        first, second = await landed[0].count(8 * per_task), await landed[1].count(4 * per_task)
        assert sorted(w.offset for w in first + second) == list(range(0, region.size, chunk))
        assert all(w.seq == w.offset and w.nbytes == chunk for w in first + second)
        assert np.array_equal(region, source)


def test_concurrent_writers_to_disjoint_ranges_all_land(case: tuple[str, str]) -> None:
    run(case, check_concurrent_disjoint_writers)


async def check_retire_and_fence(kind: str) -> None:
    region = bytearray(16)
    old, new = PostKey(epoch=1, slot=0), PostKey(epoch=2, slot=0)
    landed = Landed()
    async with network(kind) as net:
        pair = await net.pair()
        server = pair.server
        server.post(old, memoryview(region), on_landed=landed)
        await pair.client.write(old, 0, [b"1111"], 1)
        await landed.count(1)
        # the posting side's incarnation changes: every key of epoch 1 goes, at once
        server.fence(2)
        with pytest.raises(ValueError, match="retired"):
            server.post(PostKey(epoch=1, slot=5), memoryview(region), on_landed=landed)
        server.post(new, memoryview(region), on_landed=landed)
        await pair.client.write(old, 4, [b"2222"], 2)  # a writer still holding the old key
        await pair.client.write(new, 8, [b"3333"], 3)
        assert [w.seq for w in await landed.count(2)] == [1, 3]
        assert region == b"1111" + bytes(4) + b"3333" + bytes(4)
        server.retire(new)
        server.retire(new)  # twice is harmless
        with pytest.raises(ValueError, match="retired"):
            server.post(new, memoryview(region), on_landed=landed)
        await pair.client.write(new, 12, [b"4444"], 4)
        await pair.client.write(old, 12, [b"5555"], 5)
        await pair.client.send(Kind.HEARTBEAT, {})  # behind both writes
        await pair.server_sink.frames_count(1)
        assert region == b"1111" + bytes(4) + b"3333" + bytes(4)
        assert [w.seq for w in landed.writes] == [1, 3]
        assert server.statistics().writes_refused == 3
        assert server.close_reason is None


def test_retired_and_fenced_keys_never_land(case: tuple[str, str]) -> None:
    run(case, check_retire_and_fence)


async def check_malformed_write_closes_the_link(kind: str) -> None:
    async with network(kind) as net:
        pair = await net.pair()
        pair.server.post(PostKey(epoch=1, slot=0), memoryview(bytearray(8)), on_landed=Landed())
        await pair.client.send(Kind.WRITE, {"epoch": 1, "slot": 0, "off": -1, "seq": 0}, [b"x"])
        await pair.server_sink.closed()
        assert "protocol error" in (pair.server.close_reason or "")
        assert "'off'" in (pair.server.close_reason or "")


def test_a_malformed_write_is_a_protocol_error(case: tuple[str, str]) -> None:
    run(case, check_malformed_write_closes_the_link)


async def check_write_checks(kind: str) -> None:
    async with network(kind, Limits(max_payload=1024)) as net:
        pair = await net.pair()
        key = PostKey(epoch=1, slot=0)
        with pytest.raises(LocalProtocolError, match="exceeds 1024 B"):
            await pair.client.write(key, 0, [bytes(1025)], 0)
        with pytest.raises(ValueError, match="offset -1"):
            await pair.client.write(key, -1, [b"x"], 0)
        with pytest.raises(ValueError, match="writable"):
            pair.server.post(key, memoryview(b"read-only"), on_landed=Landed())
        with pytest.raises(ValueError, match="whole float64"):
            pair.server.post(key, memoryview(bytearray(12)), dtype="float64", on_landed=Landed())
        with pytest.raises(ValueError, match="unknown dtype"):
            pair.server.post(key, memoryview(bytearray(8)), dtype="float128", on_landed=Landed())
        pair.server.post(key, memoryview(bytearray(8)), on_landed=Landed())
        with pytest.raises(ValueError, match="posted already"):
            pair.server.post(key, memoryview(bytearray(8)), on_landed=Landed())
        pair.client.close("done")
        with pytest.raises(TransportError):
            await pair.client.write(key, 0, [b"x"], 0)


def test_write_and_post_refuse_bad_arguments_locally(case: tuple[str, str]) -> None:
    run(case, check_write_checks)


async def check_unsent(kind: str) -> None:
    # unsent() is what an in-place allreduce trusts to complete a call before its
    # acknowledgements: 0 must mean no byte (no view of a caller's buffer) is held any more
    chunk = bytes(MiB)
    async with network(kind) as net:
        pair = await net.pair()
        if kind != "tcp":  # a transport that cannot tell says so, never 0
            assert pair.client.unsent() is None
            return
        assert pair.client.send_now(Kind.DATA, {"i": 0}, [b"small"])
        assert pair.client.unsent() == 0  # an idle socket took it whole, at once
        stall_reader(pair)
        for i in range(1, 1025):
            task = asyncio.ensure_future(pair.client.send(Kind.DATA, {"i": i}, [chunk]))
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done:
                break
        held = pair.client.unsent()
        assert held is not None
        assert held >= MiB  # what the kernel would not take waits in the link, views and all
        resume_reader(pair)
        async with asyncio.timeout(PATIENCE):
            await task
            while pair.client.unsent():
                await asyncio.sleep(0.01)
        await pair.server_sink.frames_count(i + 1)


def test_unsent_says_when_the_link_holds_nothing(case: tuple[str, str]) -> None:
    run(case, check_unsent)
