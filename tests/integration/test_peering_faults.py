"""Peer links when something goes wrong inside the daemon: the pair must still come back.

Two in-process daemons (:mod:`tests.integration.inproc`); each test breaks one step of
admitting, resetting or closing links, and checks that no dial is left waiting forever, no
service is left untold and nothing is started after the daemon stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

import numpy as np

import fabricd
from fabricd.daemon.config import load
from fabricd.daemon.node import Daemon, default_services
from fabricd.daemon.service import BaseService
from fabricd.engines.link.handshake import HANDSHAKE_LIMITS, Channel
from fabricd.transports.inproc import InprocLink, InprocTransport
from fabricd.transports.tcp import TcpTransport

from .inproc import Fabric, fabric, write_secret

if TYPE_CHECKING:
    from pathlib import Path

    import pytest

    from fabricd.daemon.service import Host
    from fabricd.wire import Limits


class Recorder(BaseService):
    """Records the peer news every service gets."""

    name = "recorder"

    def __init__(self, host: Host) -> None:
        self.downs: list[tuple[int, str]] = []

    def peer_down(self, node: int, reason: str, now: float) -> None:
        self.downs.append((node, reason))


def with_recorder(daemon: Daemon) -> list[BaseService]:
    return [Recorder(daemon), *default_services(daemon)]


async def test_a_failure_while_admitting_a_dialled_link_fails_the_dial_and_it_is_retried(
    tmp_path: Path,
) -> None:
    fab = Fabric(tmp_path)
    d0 = await fab.start(0)  # node 0 dials node 1
    greet = d0.peer_up
    broke: list[int] = []

    def peer_up_breaks_once(node: int) -> None:
        if not broke:
            broke.append(node)
            raise RuntimeError("a bug while greeting the peer")
        greet(node)

    d0.peer_up = peer_up_breaks_once  # type: ignore[method-assign]
    await fab.start(1)
    try:
        await fab.until(lambda: bool(broke))
        await fab.until(fab.up, 5)  # the dial that broke must not wait forever
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)


async def test_a_peer_that_goes_down_is_reset_once(tmp_path: Path) -> None:
    async with fabric(tmp_path, {0: with_recorder}) as fab:
        recorder = fab.daemons[0].service("recorder")
        assert isinstance(recorder, Recorder)
        fab.daemons[1].send = lambda node, frame: None  # type: ignore[method-assign]  # silent
        await fab.until(lambda: (1, "down") in recorder.downs)
        await asyncio.sleep(0.05)
        assert recorder.downs == [(1, "down")]  # every service hears of it once
        assert fab.daemons[0].peering.engine.statistics().resets == 1
        del fab.daemons[1].send


async def test_a_reset_does_not_hear_its_own_links_closing_as_news(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fabricd.peering")
    async with fabric(tmp_path) as fab:
        fab.daemons[1].send = lambda node, frame: None  # type: ignore[method-assign]  # silent
        await fab.until(lambda: fab.daemons[0].peering.engine.statistics().resets == 1)
        del fab.daemons[1].send
    # node 0 closed both links itself: the peer closing the other end in answer is no loss
    assert "link to node 1 lost" not in caplog.text


class HangsUpAtOnce(InprocTransport):
    """Every dialled link is closed by the far end before the dialler can say HELLO on it."""

    async def connect(self, address: str, limits: Limits, *, source: str = "") -> InprocLink:
        link = await super().connect(address, limits)
        link.peer.close("too many unauthenticated links")  # type: ignore[union-attr]
        return link


async def test_a_link_closed_before_its_handshake_starts_leaves_no_handshake_behind(
    tmp_path: Path,
) -> None:
    fab = Fabric(tmp_path)
    fab.net = HangsUpAtOnce()
    d0 = await fab.start(0)
    await fab.start(1)
    try:
        engine = d0.peering.engine
        await fab.until(lambda: engine.statistics().dial_attempts[1] >= 3)
        assert engine.statistics().handshakes_pending == 0  # not until handshake_timeout
        assert not d0.peering._pending
        assert engine.statistics().handshakes_refused == 0  # no handshake ever began
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)


async def test_nothing_is_dialled_or_accepted_once_peering_has_closed(tmp_path: Path) -> None:
    fab = Fabric(tmp_path, reconnect_max_backoff=0.05)
    d0 = await fab.start(0)  # node 1 never starts: node 0 dials it every 50 ms
    await fab.until(lambda: "node0:1" in fab.net.listeners)
    accept = fab.net.listeners["node0:1"]
    engine = d0.peering.engine
    close = d0.peering.aclose
    late: list[InprocLink] = []
    dials: list[int] = []

    async def aclose_then_linger() -> None:
        await close()
        # the loop runs on until run() returns: a dial due now must not start, and a
        # connection the listener took just before it closed must not begin a handshake
        fab.net.listeners["node0:1"] = accept
        late.append(await fab.net.connect("node0:1", HANDSHAKE_LIMITS))
        del fab.net.listeners["node0:1"]
        dials.append(engine.statistics().dial_attempts[1])
        await asyncio.sleep(0.3)
        dials.append(engine.statistics().dial_attempts[1])

    d0.peering.aclose = aclose_then_linger  # type: ignore[method-assign]
    await fab.until(lambda: engine.statistics().dial_attempts[1] >= 2)
    await fab.stop(0)
    assert dials[0] == dials[1], "dialled after peering closed"
    assert late[0].closed, "a link accepted after peering closed is still open after the stop"
    assert not d0.peering._pending


def _recv_from_rank1(socket_path: str) -> str:
    with fabricd.connect(job="j", rank=0, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (8,), "int32")
        try:
            fab.recv(array, src=1, timeout=20)
        except fabricd.FabricError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok" if list(array) == list(range(8)) else f"wrong bytes {array}"


def _send_to_rank0(socket_path: str) -> str:
    with fabricd.connect(job="j", rank=1, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (8,), "int32")
        array[:] = np.arange(8)
        try:
            fab.send(array, to=0, timeout=20)
        except fabricd.FabricError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"


async def test_a_send_posted_before_the_pair_is_up_waits_for_its_data_link(tmp_path: Path) -> None:
    async with fabric(tmp_path, suspect_after=3.0, down_after=10.0) as fab:
        receiver = asyncio.create_task(asyncio.to_thread(_recv_from_rank1, fab.socket(0)))
        await fab.until(lambda: fab.daemons[0].service("p2p").engine.pending() == 1)
        await fab.stop(1)
        await fab.start(1)  # node 0 redials it after a backoff
        await fab.until(lambda: os.path.exists(fab.socket(1)))
        # rank 1 posts its send while the pair is still down: it waits for rank 0's route,
        # which node 0 announces once the pair is up, and must then find a data link to use
        assert await asyncio.to_thread(_send_to_rank0, fab.socket(1)) == "ok"
        assert await receiver == "ok"


class SlowDataLinks(InprocTransport):
    """The second link of every dial, its data link, takes ``delay`` seconds to connect."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.dialled = 0

    async def connect(self, address: str, limits: Limits, *, source: str = "") -> InprocLink:
        self.dialled += 1
        if self.dialled % 2 == 0:
            await asyncio.sleep(self.delay)
        return await super().connect(address, limits)


async def test_a_rank_that_joins_before_its_peer_is_up_is_announced_only_once_it_is(
    tmp_path: Path,
) -> None:
    fab = Fabric(tmp_path)
    fab.net = SlowDataLinks(1.0)
    d0, d1 = await fab.start(0), await fab.start(1)
    try:
        await fab.until(lambda: (0, Channel.CONTROL) in d1.links)
        assert (0, Channel.DATA) not in d1.links
        # rank 0 joins node 0 while node 1 has only a control link: were it announced now,
        # rank 1's send would be matched at once and find no data link to stream on
        receiver = asyncio.create_task(asyncio.to_thread(_recv_from_rank1, fab.socket(0)))
        await fab.until(lambda: d0.service("p2p").engine.pending() == 1)
        assert (0, Channel.DATA) not in d1.links
        assert await asyncio.to_thread(_send_to_rank0, fab.socket(1)) == "ok"
        assert await receiver == "ok"
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)


async def test_a_dial_into_silence_gives_up_after_the_handshake_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A listener whose accept queue is full drops further SYNs, as a partition does: the
    # kernel alone would retry such a connect for minutes, and a healed link would wait for it
    caplog.set_level(logging.INFO, logger="fabricd.peering")
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:  # the first fills the queue; the others wait in SYN_SENT
            filler.setblocking(False)
            filler.connect_ex(hole.getsockname())
        secret = write_secret(tmp_path)
        flags = {
            "node_id": 0,
            "nodes": ("127.0.0.1:0", f"127.0.0.1:{hole.getsockname()[1]}"),
            "socket": str(tmp_path / "n0.sock"),
            "secret_file": str(secret),
            "handshake_timeout": 0.2,
            "reconnect_max_backoff": 0.1,
        }
        daemon = Daemon(load(None, environ={}, flags=flags), transport=TcpTransport())
        task = asyncio.create_task(daemon.run())
        try:
            async with asyncio.timeout(30):  # a hang guard only
                while caplog.text.count("no answer within 0.2s (handshake_timeout)") < 2:
                    await asyncio.sleep(0.05)
        finally:
            daemon.stop()
            await asyncio.wait_for(task, 15)
            for filler in fillers:
                filler.close()
    assert "retrying in" in caplog.text  # each silent dial failed and was retried


async def test_dialled_links_leave_from_this_nodes_configured_address(tmp_path: Path) -> None:
    # node 0 is configured as 127.0.0.2; its peer admits links only from configured hosts, so
    # a link from the kernel's default source for 127.0.0.1 (127.0.0.1) would be refused
    secret = write_secret(tmp_path)
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    nodes = (f"127.0.0.2:{ports[0]}", f"127.0.0.1:{ports[1]}")
    daemons = []
    for node in range(2):
        flags = {
            "node_id": node,
            "nodes": nodes,
            "socket": str(tmp_path / f"n{node}.sock"),
            "secret_file": str(secret),
        }
        daemons.append(Daemon(load(None, environ={}, flags=flags), transport=TcpTransport()))
    tasks = [asyncio.create_task(d.run()) for d in daemons]
    try:
        async with asyncio.timeout(30):  # a hang guard only
            while not all(len(d.links) == 2 for d in daemons):
                await asyncio.sleep(0.05)
        ends = {link.local_address.rpartition(":")[0] for (_, _), link in daemons[0].links.items()}
        assert ends == {"127.0.0.2"}
        assert daemons[1].status()["counters"]["refused_unknown_hosts"] == 0
    finally:
        for d in daemons:
            d.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
