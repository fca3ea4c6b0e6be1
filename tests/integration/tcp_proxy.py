"""A real TCP proxy on 127.0.0.1 between two real daemon processes, for the tests that play
the wire: an attacker (:mod:`tests.integration.test_proxy_attacks`) or a faulty network
(:mod:`tests.integration.test_notify_ack_faults`).

Node 0 dials node 1, and its config says node 1 is at the proxy's port (a per-node
``FABRICD_NODES`` override; node 1 itself keeps the cluster's config and listens where it
says), so both of the pair's links, control and data, pass through :class:`Proxy`.  The proxy
dials node 1 from 127.0.0.1, a configured host, so node 1 admits it.  It knows the frame
layout (docs/protocol.md) but not the secret: it forwards whole frames, each through a
:attr:`Proxy.trick` if a test set one, may hold frames back (:attr:`Proxy.delay`, each stream
keeping its order, as TCP does) and resets connections when told (:meth:`Proxy.reset`).

Timeouts here are hang guards only.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from fabricd.daemon.launcher import FAST_LIVENESS, LocalCluster, _free_port
from fabricd.integrity import FLAG_SEALED, TRAILER_SIZE
from fabricd.wire import HEADER_SIZE, Kind

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

#: the fixed frame header (fabricd/wire.py): magic, version, kind, flags, meta_len, payload_len
HEADER = struct.Struct(">4sBBHIQ")
#: how long anything here may take before the test calls it a hang
GUARD = 30.0


@dataclass(eq=False)
class Relay:
    """One TCP connection node 0 opened, spliced to one the proxy opened to node 1."""

    channel: str = ""  #: "control" or "data", from node 0's HELLO
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    #: forward only the first half of the next frame, then reset (:meth:`Proxy.reset`)
    cut: bool = False

    @property
    def live(self) -> bool:
        return any(not w.transport.is_closing() for w in self.writers)


class Proxy:
    """A frame-aware TCP forwarder on 127.0.0.1, run by an event loop on its own thread.

    It listens at once (so node 0 may dial before node 1 is known) and holds each connection
    until :attr:`upstream` is set.  Every frame either way passes through :attr:`trick`, then
    waits :attr:`delay` seconds (the frames behind it in its stream wait too).
    """

    def __init__(self) -> None:
        #: (the relay, the node the frame goes to, the frame) -> what to forward instead
        self.trick: Callable[[Relay, int, bytes], list[bytes]] | None = None
        #: how long to hold the next frame back (called on the proxy's thread, once a frame)
        self.delay: Callable[[], float] | None = None
        self.upstream = ""  #: node 1's real address
        self.relays: list[Relay] = []
        self.errors: list[Exception] = []  #: what tricks raised
        self.resets = 0  #: times :meth:`reset` found connections open and reset them
        self.cut_frames: list[Kind] = []  #: the frames a reset cut short, by kind
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(GUARD)

    def reset(self, channel: str | None = None, *, cut: bool = False) -> None:
        """Reset the open connections (only ``channel``'s, if given) from any thread: at once,
        or with ``cut`` inside the next frame each carries, which arrives only in part."""
        self._loop.call_soon_threadsafe(self._reset, channel, cut)

    def _reset(self, channel: str | None, cut: bool) -> None:
        chosen = [r for r in self.relays if r.live and channel in (None, r.channel)]
        for relay in chosen:
            if cut:
                relay.cut = True
            else:
                self._abort(relay)
        if chosen and not cut:
            self.resets += 1

    @staticmethod
    def _abort(relay: Relay) -> None:
        for writer in relay.writers:
            writer.transport.abort()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, r0: asyncio.StreamReader, w0: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        relay = Relay(writers=[w0])
        self.relays.append(relay)
        try:
            while not self.upstream:
                await asyncio.sleep(0.01)
            host, port = self.upstream.rsplit(":", 1)
            r1, w1 = await asyncio.open_connection(host, int(port))
            relay.writers.append(w1)
            pumps = [
                asyncio.create_task(self._pump(relay, r0, w1, towards=1)),
                asyncio.create_task(self._pump(relay, r1, w0, towards=0)),
            ]
            # either side closing (a daemon refusing a frame, say) closes both
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except OSError:
            pass
        finally:
            for writer in relay.writers:
                writer.transport.abort()
            self._tasks.discard(task)

    async def _pump(
        self, relay: Relay, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, towards: int
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                frame = await read_frame(reader)
                if not relay.channel and towards == 1 and frame[5] == Kind.HELLO:
                    relay.channel = meta_of(frame)["channel"]
                trick = self.trick
                try:
                    forward = [frame] if trick is None else trick(relay, towards, frame)
                except Exception as exc:  # a broken trick fails the test, not just the link
                    self.errors.append(exc)
                    raise
                delay = self.delay
                if delay is not None:
                    await asyncio.sleep(delay())
                if relay.cut:
                    writer.write(frame[: len(frame) // 2])
                    await writer.drain()
                    self.cut_frames.append(kind_of(frame))
                    self.resets += 1
                    self._abort(relay)
                    return
                for out in forward:
                    writer.write(out)
                await writer.drain()

    def open_connections(self) -> int:
        """How many TCP connections the proxy holds now (both sides counted)."""
        return sum(not w.transport.is_closing() for r in self.relays for w in r.writers)

    def close(self) -> None:
        """Close the listener and every connection; stop the thread."""

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(GUARD)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(GUARD)
        self._loop.close()


class ProxiedPairs:
    """Start pairs of daemon processes whose links pass through a :class:`Proxy` (a fixture's
    body: :meth:`make` for the test, :meth:`close` at teardown)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.made: list[tuple[LocalCluster, Proxy]] = []

    def make(self, **settings: Any) -> tuple[LocalCluster, Proxy]:
        """A connected pair with these config settings (on top of fast liveness)."""
        proxy = Proxy()
        proxy.start()
        # node 0's own entry is a port it binds; its entry for node 1 is the proxy
        node0 = f"127.0.0.1:{_free_port()}"
        cluster = LocalCluster(
            2,
            settings={**FAST_LIVENESS, **settings},
            log_dir=self.log_dir / f"cluster{len(self.made)}",
            node_env={0: {"FABRICD_NODES": f"{node0},127.0.0.1:{proxy.port}"}},
        )
        self.made.append((cluster, proxy))
        cluster.start()
        proxy.upstream = cluster.nodes[1].address
        cluster.wait_connected(GUARD)
        assert proxy.relays, "the pair did not connect through the proxy"
        return cluster, proxy

    def close(self) -> None:
        """Stop every pair; the proxies hold no connection after, no trick failed, and no
        daemon logged a traceback."""
        for cluster, proxy in self.made:
            cluster.stop()
            proxy.close()
            assert proxy.open_connections() == 0
            assert not proxy.errors, f"a trick failed: {proxy.errors!r}"
        for cluster, _ in self.made:
            for node in cluster.nodes:
                log = node.log_path.read_text(errors="replace")
                assert "Traceback" not in log, f"node {node.node} logged a traceback:\n{log}"


# -- the frame layout -----------------------------------------------------------------------
async def read_frame(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(HEADER_SIZE)
    _, _, _, flags, meta_len, payload_len = HEADER.unpack(header)
    rest = meta_len + payload_len + (TRAILER_SIZE if flags & FLAG_SEALED else 0)
    return header + await reader.readexactly(rest)


def kind_of(frame: bytes) -> Kind:
    return Kind(frame[5])


def flags_of(frame: bytes) -> int:
    flags: int = HEADER.unpack_from(frame)[3]
    return flags


def meta_of(frame: bytes) -> dict[str, Any]:
    meta_len = HEADER.unpack_from(frame)[4]
    meta: dict[str, Any] = msgpack.unpackb(frame[HEADER_SIZE : HEADER_SIZE + meta_len])
    return meta


def seq_of(frame: bytes) -> int:
    seq: int = struct.unpack_from(">Q", frame, len(frame) - TRAILER_SIZE)[0]
    return seq


class Nemesis:
    """Resets a :class:`Proxy`'s connections every 0.3 to ``longest`` s, in one of four ways
    (both links, the control or the data link, or one of them in the middle of a frame), from
    a seeded schedule, until stopped."""

    def __init__(self, proxy: Proxy, seed: int, *, longest: float) -> None:
        self.proxy = proxy
        self.longest = longest
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)

    def __enter__(self) -> Nemesis:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(GUARD)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.3, self.longest)):
            how = self.rng.choice(["both", "control", "data", "cut"])
            if how == "cut":
                self.proxy.reset(self.rng.choice(["control", "data"]), cut=True)
            else:
                self.proxy.reset(None if how == "both" else how)
