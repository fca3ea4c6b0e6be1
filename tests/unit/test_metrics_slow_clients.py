"""The metrics endpoint keeps serving scrapes while slow clients hold its connections.

Issue 28's probe blinded monitoring with 40 sockets that each sent a byte every second or so and
never finished their request head: they kept the 16 places busy, newcomers were closed on
arrival, and 2 of 50 scrapes got through.  Here the same attack runs against the real endpoint
over TCP on 127.0.0.1, scaled down five times to keep the test short (a byte every 0.2 s and a
1 s head deadline instead of about 1 s and 5 s), and a closed socket is opened again at its next
byte, as a slowloris does.  Nothing here times the endpoint: a scrape either gets its answer or
is hung up on, and what is counted is which.
"""

from __future__ import annotations

import asyncio
import random
import socket
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon import metrics_http
from fabricd.daemon.metrics import MetricsRegistry, gauge
from fabricd.daemon.metrics_http import MAX_CONNECTIONS, MetricsServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

#: the probe's attack, and its scrapes
SOCKETS = 40
SCRAPES = 50
#: seconds between a slow socket's bytes, and the head deadline, both five times the probe's less
BYTE_EVERY = 0.2
SCALED_TIMEOUT = 1.0
HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


class _Exposition:
    def collect(self):
        yield gauge("fabricd_y", "y.", [({}, 1)])


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    endpoint = MetricsServer(MetricsRegistry([_Exposition()]).exposition)
    await endpoint.start("127.0.0.1:0")
    yield endpoint
    endpoint.close()


def _port(server: MetricsServer) -> int:
    return int(server.address.rpartition(":")[2])


async def _until(done: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):  # a hang guard
        while not done():
            await asyncio.sleep(0.01)


class Slowloris:
    """``sockets`` connections from ``source`` that each send a byte about every ``every``
    seconds (jittered, seeded) and never end their head; one that is closed is opened again at
    its next byte."""

    def __init__(self, port: int, sockets: int, every: float, source: str = "127.0.0.1") -> None:
        self.port, self.sockets, self.every, self.source = port, sockets, every, source
        self.connects = 0
        self.bytes = 0
        self._rng = random.Random(28)
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Slowloris:
        self._tasks = [asyncio.create_task(self._one()) for _ in range(self.sockets)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _pause(self) -> float:
        return self.every * self._rng.uniform(0.5, 1.5)

    async def _one(self) -> None:
        while True:
            await self._hold()
            await asyncio.sleep(self._pause())  # opened again at its next byte

    async def _hold(self) -> None:
        """One connection, held until the endpoint closes it."""
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", self.port, local_addr=(self.source, 0)
            )
        except OSError:
            return
        self.connects += 1
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\n")
            while True:
                try:
                    async with asyncio.timeout(self._pause()):
                        if not await reader.read(4096):
                            return  # closed
                except TimeoutError:
                    writer.write(b"X")  # one more byte of a header line that never ends
                    self.bytes += 1
        except OSError:
            return  # reset
        finally:
            writer.close()


async def _scrape(port: int, source: str = "127.0.0.1", dribble: float = 0.0) -> bytes:
    """A scrape's whole answer (``b""`` when hung up on); ``dribble``: seconds to spread the
    head over, in five pieces (an honest but slow scraper)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError:
        return b""
    try:
        async with asyncio.timeout(30):  # a hang guard: the endpoint answers or hangs up
            if dribble:
                step = -(-len(HEAD) // 5)
                for i in range(0, len(HEAD), step):
                    writer.write(HEAD[i : i + step])
                    await asyncio.sleep(dribble / 5)
            else:
                writer.write(HEAD)
            return await reader.read()
    except OSError:
        return b""
    finally:
        writer.close()


def _served(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.startswith(b"HTTP/1.1 200 ") and b"fabricd_y 1.0" in body


async def test_scrapes_get_through_a_40_socket_slowloris(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT", SCALED_TIMEOUT)
    port = _port(server)
    served = contended = 0
    async with Slowloris(port, SOCKETS, BYTE_EVERY) as attack:
        await _until(lambda: server.connections == MAX_CONNECTIONS)
        for _ in range(SCRAPES):
            contended += server.connections == MAX_CONNECTIONS
            served += _served(await _scrape(port))
            await asyncio.sleep(BYTE_EVERY / 4)
    # the attack was on: every place held as most scrapes began, and the sockets kept coming
    # back (on the old endpoint, past the deadlines; now, past the scrapes that evicted them)
    assert contended >= SCRAPES * 0.8
    assert attack.connects > SOCKETS
    assert attack.bytes > 0
    assert served >= SCRAPES * 0.95, f"{served} of {SCRAPES} scrapes served"


async def test_a_slow_honest_scraper_gets_its_answer(server):
    """Spread over a second, well within the 5 s deadline: no place is wanted, none lost."""
    answer = await _scrape(_port(server), dribble=1.0)
    assert _served(answer)
    assert server.evicted == 0
    assert server.timed_out == 0


async def test_a_slow_scraper_from_another_address_outlasts_a_slowloris(server, monkeypatch):
    """The slowloris from 127.0.0.1 turns every place over while the scraper from 127.0.0.2
    dribbles its head: evictions fall on the address that holds the most.  (Loopback is one
    source group; here each address stands for a host of its own.)"""
    monkeypatch.setattr(metrics_http, "source_group", lambda host: host)
    port = _port(server)
    async with Slowloris(port, SOCKETS, BYTE_EVERY):
        await _until(lambda: server.connections == MAX_CONNECTIONS)
        before = server.evicted
        answer = await _scrape(port, source="127.0.0.2", dribble=1.0)
        evicted = server.evicted - before
    assert _served(answer)
    assert evicted >= MAX_CONNECTIONS  # every place it found held was taken over meanwhile


async def _idle(
    port: int, source: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sent part of a head and waits."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET /metrics HTTP/1.1\r\n")
    return reader, writer


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(10):  # a hang guard
            return await reader.read() == b""
    except ConnectionResetError:
        return True


async def test_a_newcomer_past_the_bound_evicts_the_oldest_idle_connection(server):
    port = _port(server)
    idle = []
    for n in range(MAX_CONNECTIONS):  # one at a time, so their order is known
        idle.append(await _idle(port))
        await _until(lambda n=n: server.connections == n + 1)
    assert _served(await _scrape(port))
    assert server.evicted == 1
    assert await _closed(idle[0][0])
    await _until(lambda: server.connections == MAX_CONNECTIONS - 1)  # the other 15 are held
    reader, writer = idle[1]  # and the next oldest is answered when its head ends
    writer.write(b"Host: x\r\n\r\n")
    assert _served(await reader.read())
    assert server.counters() == {"metrics_evicted": 1, "metrics_timed_out": 0}
    for _, writer in idle:
        writer.close()


async def test_the_address_holding_the_most_loses_a_place_first(server, monkeypatch):
    monkeypatch.setattr(metrics_http, "source_group", lambda host: host)  # (as above)
    port = _port(server)
    reader, writer = await _idle(port, source="127.0.0.2")  # the oldest of all
    await _until(lambda: server.connections == 1)
    idle = []
    for n in range(1, MAX_CONNECTIONS):
        idle.append(await _idle(port))
        await _until(lambda n=n: server.connections == n + 1)
    for n in range(3):  # newcomers from the busy address evict its own connections
        idle.append(await _idle(port))
        await _until(lambda n=n: server.evicted == n + 1)
    assert [await _closed(r) for r, _ in idle[:3]] == [True] * 3
    writer.write(b"Host: x\r\n\r\n")  # the oldest, from elsewhere, was kept
    assert _served(await reader.read())
    for _, w in [(reader, writer), *idle]:
        w.close()


def _stuck_reader(port: int) -> socket.socket:
    """A scraper that asks for a large answer and reads none of it (a tiny receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(HEAD)
    return sock


def _take(sock: socket.socket) -> int:
    """Read what the endpoint sends until it closes; how many bytes that was."""
    sock.settimeout(30)  # a hang guard
    taken = 0
    try:
        while chunk := sock.recv(1 << 20):
            taken += len(chunk)
    except ConnectionResetError:
        pass
    return taken


async def test_answers_being_taken_are_evicted_after_idle_connections(monkeypatch):
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    endpoint = MetricsServer(lambda: b"# x\n" * (1 << 20))  # 4 MiB: more than the kernel holds
    await endpoint.start("127.0.0.1:0")
    port = _port(endpoint)
    whole = len(endpoint.answer(HEAD.rstrip()))
    stuck = []
    try:
        stuck.append(_stuck_reader(port))  # answering, the oldest
        await _until(lambda: endpoint.connections == 1)
        reader, writer = await _idle(port)
        await _until(lambda: endpoint.connections == 2)
        stuck.append(_stuck_reader(port))  # evicts the idle one, though it is younger
        assert await _closed(reader)
        assert endpoint.evicted == 1
        await _until(lambda: endpoint.connections == 2)
        stuck.append(_stuck_reader(port))  # only answers held now: the oldest goes
        await _until(lambda: endpoint.evicted == 2)
        taken = [await asyncio.to_thread(_take, sock) for sock in stuck]
        assert taken[0] < whole  # cut, the rest of its answer dropped
        assert taken[1:] == [whole, whole]  # kept, and answered in full
        writer.close()
    finally:
        endpoint.close()
        for sock in stuck:
            sock.close()


def test_sources_are_the_address_groups_a_host_can_fill_without_privilege() -> None:
    """Any local user may bind any 127/8 address: spreading a slowloris over them must not
    make every connection a source of its own (review of issue 28)."""
    group = metrics_http.source_group
    assert group("127.0.0.1") == group("127.3.2.1") == group("::1") == "loopback"
    assert group("10.1.2.3") == group("10.1.2.200") == "10.1.2.0/24"
    assert group("10.1.3.3") != group("10.1.2.3")
    assert group("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert group("2001:db8::1") == group("2001:db8::ffff") == "2001:db8::/64"
    assert group("not an address") == "not an address"
