"""The hop floor: fabricd's rank-to-rank path with both daemons replaced by do-nothing relays.

A small fabricd message goes rank 0 -> daemon 0 -> daemon 1 -> rank 1: a blocking Unix-socket
client, a uvloop daemon, a TCP connection on 127.0.0.1 with ``TCP_NODELAY`` to the other uvloop
daemon, and its Unix socket to rank 1.  The hop floor is the same chain with each daemon replaced
by a relay that does nothing -- a uvloop process whose two connections write every byte the
other reads, unchanged (:class:`_Side`)::

    this process   --unix-->  relay A  --TCP-->  relay B  --unix-->  far end
    (client 0: blocking,      (uvloop)           (uvloop)            (client 1: blocking,
     poll then recv)                                                  poll then recv)

Same processes, the same kinds of sockets, the same event loop and the same wake-up at every
hop; per hop a relay makes the fewest syscalls that pass bytes on (its loop's wait, a read, a
write) and runs one Python callback, with no framing, matching or bookkeeping.  (A daemon reads
its clients with ``recvmsg`` from a reader callback, since requests may carry fds; for a
message without fds that is the same read.)  Whatever a daemon does per message comes on top of
this floor, so issue 22 sets the small-message targets against it: (g)'s round trip and (h)'s
one-way message, each measured beside its floor in the same run.

Pieces, for the benchmarks that put the floor beside their figures:

* :func:`relay_chain`: starts the two relays in a temporary directory, gives back the two Unix
  socket paths and the relays' pids, and reaps them;
* :func:`far_end`: client 1, a process that follows a fixed plan of messages, answering each;
* :class:`BlockingEnd`: client 0's side: :meth:`~BlockingEnd.round_trip` and
  :meth:`~BlockingEnd.send_acked` ((h)'s windowed 4 KiB with a 1-byte ack per message);
* :func:`hop_floor`: all of it at once; :func:`round_trips`: a batch of timed round trips.

Alone (``python -m bench.hopfloor [--quick]``, or ``--only hopfloor`` in ``python -m bench``) it
measures the floor for 1 B and 4 KiB round trips and 4 KiB one-way messages against the two
clients on one Unix socket with nothing between them (:func:`direct_pair`), and the CPU each
process spends per message.  Every wait is bounded by :data:`bench.ranks.CALL_TIMEOUT`, every
far end follows a fixed plan, and a relay ends when either of its connections does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import select
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.ranks import CALL_TIMEOUT
from bench.report import (
    Column,
    CpuMeter,
    KiB,
    Progress,
    Row,
    Table,
    batch_figures,
    each_call,
    fmt_number,
    fmt_size,
    quiet,
    reap,
    run_alone,
    spawn,
)

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess

#: what the far end does: ``(nbytes, reply, messages)``: ``messages`` times, read a whole
#: ``nbytes`` message and answer with its first ``reply`` bytes (``nbytes``: an echo; 1: an ack)
Plan = list[tuple[int, int, int]]

_POLL_MS = int(CALL_TIMEOUT * 1000)


# -- the relays -------------------------------------------------------------------------------
class _Relay:
    """One relay's two connections (a Unix socket and TCP), whichever comes up first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.paired: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self._sides: list[_Side] = []

    def join(self, side: _Side) -> None:
        """A connection is up: once both are, each writes what the other reads."""
        self._sides.append(side)
        if len(self._sides) == 2:
            first, second = self._sides
            first.attach(second.transport)
            second.attach(first.transport)
            self.paired.set_result(None)

    def end(self) -> None:
        """Either connection ended: close the other (after what it still has to write)."""
        for side in self._sides:
            side.transport.close()
        if not self.ended.done():
            self.ended.set_result(None)


class _Side(asyncio.Protocol):
    """One connection of a relay: every byte it reads, the other connection writes.

    No flow control: the benchmarks keep at most a window of small messages in flight, so what
    a relay holds is bounded by them.
    """

    def __init__(self, relay: _Relay) -> None:
        self._relay = relay
        self.transport: asyncio.Transport
        self._peer: asyncio.Transport | None = None
        self._held: list[bytes] = []  #: read before the other connection came up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock.family == socket.AF_INET:  # as fabricd's links: small frames leave at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._relay.join(self)

    def attach(self, peer: asyncio.Transport) -> None:
        self._peer = peer
        if self._held:
            peer.writelines(self._held)
            self._held.clear()

    def data_received(self, data: bytes) -> None:
        if self._peer is None:
            self._held.append(data)
        else:
            self._peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._relay.end()


def relay(conn: Connection, path: str, port: int | None) -> None:
    """A relay process: a Unix-socket server at ``path`` and a TCP connection on 127.0.0.1 --
    listening on a free port (``port`` None: relay A) or to relay A's ``port`` (relay B).

    Sends the TCP port through ``conn`` once both ends can connect; returns when either
    connection ends.

    Raises:
        TimeoutError: the two connections were not both up within ``CALL_TIMEOUT``.
    """
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        joined = _Relay(loop)
        listening = []
        if port is None:
            server = await loop.create_server(lambda: _Side(joined), "127.0.0.1", 0)
            listening.append(server)
            tcp_port = server.sockets[0].getsockname()[1]
        else:
            await loop.create_connection(lambda: _Side(joined), "127.0.0.1", port)
            tcp_port = port
        listening.append(await loop.create_unix_server(lambda: _Side(joined), path))
        conn.send(tcp_port)
        async with asyncio.timeout(CALL_TIMEOUT):
            await joined.paired
        for server in listening:
            server.close()
        await joined.ended

    uvloop.run(serve())


@dataclass(frozen=True, slots=True)
class Chain:
    """Two relays up: client 0 connects to ``near`` (relay A), client 1 to ``far`` (relay B)."""

    near: str
    far: str
    pids: dict[str, int]  #: "relay A", "relay B"


@contextlib.contextmanager
def relay_chain() -> Iterator[Chain]:
    """Start relay A and relay B, their Unix sockets in a temporary directory; reap both after
    the block, once its clients have closed their connections (terminate them if it raised).

    Raises:
        RuntimeError: a relay did not start within 60 s, or failed.
    """
    spawning = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fabricd-hopfloor-") as directory:
        paths = [os.path.join(directory, name) for name in ("a.sock", "b.sock")]
        relays: list[SpawnProcess] = []
        try:
            port = None
            for path in paths:
                parent, child = spawning.Pipe()
                relays.append(spawn(relay, child, path, port))
                if not parent.poll(60):
                    raise RuntimeError("a hop-floor relay did not start")
                port = parent.recv()
            pids = {"relay A": _pid(relays[0]), "relay B": _pid(relays[1])}
            yield Chain(near=paths[0], far=paths[1], pids=pids)
        except BaseException:
            for process in relays:
                process.terminate()
            raise
        for process in relays:
            reap(process)


def _pid(process: SpawnProcess) -> int:
    assert process.pid is not None
    return process.pid


# -- the clients ------------------------------------------------------------------------------
class BlockingEnd:
    """A client's end: a blocking Unix socket read with ``poll()`` then ``recv``, as fabricd's
    client library reads its daemon's socket (:mod:`fabricd.client.connection`)."""

    def __init__(self, sock: socket.socket, capacity: int) -> None:
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._buffer = memoryview(bytearray(capacity))  #: what it reads: the largest message

    @classmethod
    def connect(cls, path: str, capacity: int) -> BlockingEnd:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock, capacity)

    def close(self) -> None:
        self._sock.close()

    def round_trip(self, payload: bytes) -> None:
        """Send ``payload`` and read as many bytes back (the far end echoes it)."""
        self._sock.sendall(payload)
        self._read_into(self._buffer[: len(payload)])

    def send_acked(self, view: memoryview, messages: int, window: int) -> float:
        """Send ``messages`` copies of ``view``, at most ``window`` unacknowledged (the far end
        acks each with 1 byte), as (h)'s raw sender does; return the seconds until the last ack."""
        start = time.perf_counter()
        acked = 0
        for sent in range(1, messages + 1):
            self._sock.sendall(view)
            while sent - acked >= window and sent < messages:
                acked += self._recv_into(self._buffer[: sent - acked])
        while acked < messages:
            acked += self._recv_into(self._buffer[: messages - acked])
        return time.perf_counter() - start

    def answer(self, nbytes: int, reply: int) -> None:
        """Read one whole ``nbytes`` message and send back its first ``reply`` bytes."""
        message = self._buffer[:nbytes]
        self._read_into(message)
        self._sock.sendall(message[:reply])

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            got += self._recv_into(view[got:])

    def _recv_into(self, view: memoryview) -> int:
        """Wait for bytes, then read what is there (at most ``len(view)``)."""
        if not self._poller.poll(_POLL_MS):
            raise TimeoutError(f"nothing arrived in {CALL_TIMEOUT:g} s")
        read = self._sock.recv_into(view)
        if not read:
            raise ConnectionError("the other end closed early")
        return read


def far_end(path: str, plan: Plan) -> None:
    """Client 1 (rank 1's place): connect to ``path`` and follow ``plan`` (see :data:`Plan`)."""
    with contextlib.closing(BlockingEnd.connect(path, _capacity(plan))) as end:
        for nbytes, reply, messages in plan:
            for _ in range(messages):
                end.answer(nbytes, reply)


@dataclass(frozen=True, slots=True)
class Route:
    """A route between this process and client 1 up: this process's end of it and the pid of
    every process on it, by role."""

    end: BlockingEnd
    pids: dict[str, int]  #: "client 0" (this process), "relay A", "relay B", "client 1"


@contextlib.contextmanager
def hop_floor(plan: Plan) -> Iterator[Route]:
    """The relay chain with client 1 following ``plan`` at its far end; this process must make
    exactly the plan's messages.  Everything is reaped after the block (terminated if it raised).

    Raises:
        RuntimeError: a helper did not start or failed.
    """
    with relay_chain() as chain:
        client = spawn(far_end, chain.far, plan)
        try:
            with contextlib.closing(BlockingEnd.connect(chain.near, _capacity(plan))) as end:
                yield Route(end, {"client 0": os.getpid(), **chain.pids, "client 1": _pid(client)})
        except BaseException:
            client.terminate()
            raise
        reap(client)


@contextlib.contextmanager
def direct_pair(plan: Plan) -> Iterator[Route]:
    """The baseline of the floor: client 1 connected straight to this process, one Unix socket
    and nothing between (one hop each way where the floor has three)."""
    with (
        tempfile.TemporaryDirectory(prefix="fabricd-hopfloor-") as directory,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server,
    ):
        path = os.path.join(directory, "direct.sock")
        server.bind(path)
        server.listen(1)
        server.settimeout(CALL_TIMEOUT)
        client = spawn(far_end, path, plan)
        try:
            sock, _ = server.accept()  # blocking, as a client's socket: reads wait in poll()
            with contextlib.closing(BlockingEnd(sock, _capacity(plan))) as end:
                yield Route(end, {"client 0": os.getpid(), "client 1": _pid(client)})
        except BaseException:
            client.terminate()
            raise
        reap(client)


def _capacity(plan: Plan) -> int:
    return max([nbytes for nbytes, _, _ in plan] + [1])


def round_trips(nbytes: int, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` round trips of ``nbytes`` through a fresh hop floor, after
    a warm-up of a fifth as many (for a benchmark that wants the floor of one small figure)."""
    warm = rounds // 5 + 1
    with hop_floor([(nbytes, nbytes, warm + rounds)]) as floor:
        one = functools.partial(floor.end.round_trip, b"\x5a" * nbytes)
        each_call(one, warm)
        return each_call(one, rounds)


# -- alone: the floor against the direct pair -------------------------------------------------
ROUND_TRIP_SIZES = [1, 4 * KiB]
ONE_WAY_SIZE = 4 * KiB
WINDOWS = [1, 8]

#: one batch of a case on an end: seconds per message, of each round trip or of the whole batch
Sample = Callable[[BlockingEnd, int], list[float]]


@dataclass(frozen=True, slots=True)
class _Case:
    """One row of the table alone: what the far end does, and how this process times it."""

    label: str
    nbytes: int
    reply: int  #: the far end's answer: the message back (a round trip) or a 1-byte ack
    sample: Sample

    @property
    def round_trip(self) -> bool:
        return self.reply == self.nbytes


def _ping(nbytes: int) -> Sample:
    payload = b"\x5a" * nbytes
    return lambda end, n: each_call(functools.partial(end.round_trip, payload), n)


def _one_way(window: int) -> Sample:
    view = memoryview(bytes(ONE_WAY_SIZE))
    return lambda end, n: [end.send_acked(view, n, window) / n]


CASES = [
    *(_Case(f"{fmt_size(n)} round trip", n, n, _ping(n)) for n in ROUND_TRIP_SIZES),
    *(
        _Case(f"{fmt_size(ONE_WAY_SIZE)} one way, window {w}", ONE_WAY_SIZE, 1, _one_way(w))
        for w in WINDOWS
    ),
]


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Each case in batches, the direct pair and the floor alternating; one row per case."""
    batches, per_batch = (3, 100) if quick else (10, 500)
    plan = [(case.nbytes, case.reply, (batches + 1) * per_batch) for case in CASES]
    table = Table(
        name="hopfloor",
        title="the hop floor: client -unix-> relay -TCP-> relay -unix-> client through two "
        "do-nothing uvloop relays, against the two clients on one Unix socket, microseconds "
        "per message",
        columns=[
            Column("direct_median", "direct median"),
            Column("floor_median", "floor median"),
            Column("floor_p99", "floor p99"),
            Column("floor_low", "floor batch low"),
            Column("floor_high", "floor batch high"),
            Column("cpu_relay", "CPU us per relay"),
            Column("cpu_all", "CPU us, 4 processes"),
        ],
        ratio="hop floor median / direct pair median (what two relays add; lower is better)",
        settings={"batches": batches, "messages_per_batch": per_batch},
    )
    progress("starting the two relays and the two far ends")
    with hop_floor(plan) as floor, direct_pair(plan) as direct:
        for case in CASES:
            row = _row(case, floor, direct.end, batches, per_batch)
            table.rows.append(row)
            progress(
                f"{case.label}: direct {fmt_number(row.figures['direct_median'])} us, floor "
                f"{fmt_number(row.figures['floor_median'])} us, ratio {fmt_number(row.ratio)}x"
            )
    table.notes += [
        f"{batches} batches of {per_batch} messages each side, alternating, after a warm-up "
        "batch; a round trip's median and p99 are of single round trips, a one-way row's median "
        "of its batches (each the batch's time / its messages); batch low/high: the lowest and "
        "highest batch median",
        "one way: at most W messages unacknowledged, the far end acks each with 1 byte, as (h); "
        "CPU: each process's CPU time over the floor's batches, per message (4 processes: both "
        "clients and both relays); a relay's is what one do-nothing hop costs",
    ]
    return table


def _row(case: _Case, floor: Route, direct: BlockingEnd, batches: int, per_batch: int) -> Row:
    """Time ``case`` on the direct pair and on the floor, batches alternating."""
    meter = CpuMeter(floor.pids)
    case.sample(direct, per_batch)  # warm-ups
    case.sample(floor.end, per_batch)
    direct_batches, floor_batches = [], []
    for _ in range(batches):
        direct_batches.append(case.sample(direct, per_batch))
        with meter.counting():
            floor_batches.append(case.sample(floor.end, per_batch))
    figures = batch_figures("floor", floor_batches)
    if not case.round_trip:  # of a few batches: the slowest, as "floor batch high" says
        del figures["floor_p99"]
    figures["direct_median"] = batch_figures("direct", direct_batches)["direct_median"]
    cpu = meter.per(batches * per_batch)
    figures["cpu_relay"] = (cpu["relay A"] + cpu["relay B"]) / 2
    figures["cpu_all"] = cpu["all"]
    ratio = figures["floor_median"] / figures["direct_median"]
    return Row(case.label, case.nbytes, figures, ratio)


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("hopfloor", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
