"""The service contract, in real daemons: a new engine plugs in without touching the node.

A test service claims a frame kind and a request op, pushes an event to its client, and keeps
a deadline; it is added through ``Daemon(services=...)`` alone, and must receive its frames,
requests and timer ticks.  Claims that overlap refuse to start; a frame nobody claims closes
the link that brought it, with the reason in the log.  A service that raises (a bug) is logged
and skipped: the other services still get their ticks and news, and nothing reaches the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from fabricd.daemon.config import load
from fabricd.daemon.node import Daemon, default_services
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.membership import MembershipService
from fabricd.frames import p2p as p2p_frames
from fabricd.frames import registry
from fabricd.wire import Kind

from .inproc import NODES, fabric, write_secret

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from fabricd.daemon.service import Host, Request
    from fabricd.engines.membership import RankEvent, Suspicion
    from fabricd.wire import Meta


class Echo(BaseService):
    """Sends a CANCEL frame to a peer on request, records what reaches it, ticks once."""

    name = "echo"
    kinds = frozenset({Kind.CANCEL})
    ops = frozenset({"echo"})

    def __init__(self, host: Host) -> None:
        self.host = host
        self.frames: list[tuple[int, registry.PeerFrame]] = []
        self.requests: list[Meta] = []
        self.ticks: list[float] = []
        self.due: float | None = host.now() + 0.05

    def on_request(self, request: Request, now: float) -> Meta:
        self.requests.append(request.meta)
        self.host.send(request.meta["to"], p2p_frames.Cancel(msg=request.meta["msg"]))
        self.host.push(request.session, "echoed", {"msg": request.meta["msg"]})
        return {"sent": True}

    def on_frame(self, node: int, frame: registry.PeerFrame, now: float) -> None:
        self.frames.append((node, frame))

    def next_deadline(self) -> float | None:
        return self.due

    def on_timer(self, now: float) -> None:
        self.ticks.append(now)
        self.due = None


def with_echo(daemon: Daemon) -> list[BaseService]:
    return [MembershipService(daemon), Echo(daemon)]


async def test_a_new_service_gets_its_frames_requests_and_timer_ticks(tmp_path: Path) -> None:
    async with fabric(tmp_path, {0: with_echo, 1: with_echo}) as fab:
        echoes = [fab.daemons[n].service("echo") for n in (0, 1)]
        await fab.until(lambda: all(e.ticks for e in echoes))

        def client() -> tuple[Meta, list[fabricd.Event]]:
            with fabricd.connect(socket_path=fab.socket(0)) as control:
                reply = control._call("echo", to=1, msg=42)
                return reply, control.poll(timeout=5.0)

        reply, events = await asyncio.to_thread(client)
        assert reply["sent"] is True
        assert [(e.name, e.fields) for e in events] == [("echoed", {"msg": 42})]
        await fab.until(lambda: bool(echoes[1].frames))
        assert echoes[1].frames == [(0, p2p_frames.Cancel(msg=42))]
        assert echoes[0].requests[0]["op"] == "echo"
        assert [len(e.ticks) for e in echoes] == [1, 1]  # ticked once each, then no deadline
        status = fab.daemons[0].status()
        assert status["services"] == ["peering", "monitor", "membership", "echo"]


async def test_two_services_claiming_one_kind_refuse_to_start(tmp_path: Path) -> None:
    secret = write_secret(tmp_path)
    flags = {
        "node_id": 0,
        "nodes": NODES,
        "socket": str(tmp_path / "s"),
        "secret_file": str(secret),
    }

    def twice(daemon: Daemon) -> list[BaseService]:
        return [*default_services(daemon), Echo(daemon)]  # p2p claims CANCEL already

    with pytest.raises(ValueError, match="'p2p' and 'echo' both claim CANCEL frames"):
        Daemon(load(None, environ={}, flags=flags), services=twice)


def _send_to_rank1(socket_path: str) -> str:
    with fabricd.connect(job="j", rank=0, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (4,), "float32")
        array[:] = np.arange(4)
        try:
            fab.send(array, to=1, timeout=20)
        except fabricd.FabricError as exc:
            return type(exc).__name__
        return "ok"


def _hold_rank1(socket_path: str, ready: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
    with fabricd.connect(job="j", rank=1, size=2, socket_path=socket_path) as fab:
        fab.array("x", (4,), "float32")
        loop.call_soon_threadsafe(ready.set)
        fab.poll(timeout=3.0)  # stay joined while the send is tried


async def test_a_frame_no_service_claims_closes_its_link_with_a_logged_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def membership_only(daemon: Daemon) -> list[BaseService]:
        return [MembershipService(daemon)]  # node 1 runs no point-to-point service

    caplog.set_level(logging.WARNING)
    async with fabric(tmp_path, {1: membership_only}) as fab:
        ready = asyncio.Event()
        holder = asyncio.create_task(
            asyncio.to_thread(_hold_rank1, fab.socket(1), ready, asyncio.get_running_loop())
        )
        await asyncio.wait_for(ready.wait(), 10)
        p2p = fab.daemons[0].service("p2p")
        await fab.until(lambda: p2p.engine.routes.lookup("j", 1) is not None)
        outcome = await asyncio.to_thread(_send_to_rank1, fab.socket(0))
        # the message (small: an EAGER) reset the pair: the send is told, not left hanging
        assert outcome == "PeerFailed"
        await holder
    assert "no service handles EAGER frames" in caplog.text


class Breaks(BaseService):
    """Raises from ``hook`` every time (a bug in a service); records its timer ticks."""

    def __init__(self, name: str, hook: str, due: float | None = None) -> None:
        self.name, self.hook, self.due = name, hook, due
        self.ticks: list[float] = []

    def _maybe_break(self, hook: str) -> None:
        if hook == self.hook:
            raise RuntimeError(f"a bug in {self.name}.{hook}")

    def next_deadline(self) -> float | None:
        return self.due

    def on_timer(self, now: float) -> None:
        self.ticks.append(now)
        self.due = None
        self._maybe_break("on_timer")

    def peer_down(self, node: int, reason: str, now: float) -> None:
        self._maybe_break("peer_down")


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, object]]]:
    """What reaches the event loop's exception handler (a callback that raised) meanwhile."""
    loop = asyncio.get_running_loop()
    escaped: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: escaped.append(context))
    try:
        yield escaped
    finally:
        loop.set_exception_handler(None)


async def test_a_service_failing_in_its_timer_does_not_stop_the_others_or_the_loop(
    tmp_path: Path,
) -> None:
    def ticking(daemon: Daemon) -> list[BaseService]:
        due = daemon.now() + 0.05  # both due at once; the first one to run raises
        return [Breaks("broken", "on_timer", due), Breaks("sound", "none", due)]

    with loop_errors() as escaped:
        async with fabric(tmp_path, {0: ticking}) as fab:
            broken, sound = (fab.daemons[0].service(n) for n in ("broken", "sound"))
            assert isinstance(broken, Breaks)
            assert isinstance(sound, Breaks)
            await fab.until(lambda: bool(broken.ticks and sound.ticks))
            assert sound.ticks == broken.ticks  # in the same tick, not whenever a frame re-arms
    assert not escaped, f"reached the event loop: {escaped}"


def _recv_from_rank1(socket_path: str, timeout: float) -> str:
    with fabricd.connect(job="j", rank=0, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (4,), "float32")
        try:
            fab.recv(array, src=1, timeout=timeout)
        except fabricd.FabricError as exc:
            return type(exc).__name__
        return "ok"


async def test_a_service_failing_in_peer_down_does_not_keep_the_others_from_hearing_it(
    tmp_path: Path,
) -> None:
    def broken_first(daemon: Daemon) -> list[BaseService]:
        return [Breaks("broken", "peer_down"), *default_services(daemon)]

    with loop_errors() as escaped:
        async with fabric(tmp_path, {0: broken_first}) as fab:
            d0, d1 = fab.daemons[0], fab.daemons[1]
            ready = asyncio.Event()
            holder = asyncio.create_task(
                asyncio.to_thread(_hold_rank1, fab.socket(1), ready, asyncio.get_running_loop())
            )
            await asyncio.wait_for(ready.wait(), 10)
            await fab.until(lambda: d0.service("membership").engine.lookup("j", 1) is not None)
            receiver = asyncio.create_task(asyncio.to_thread(_recv_from_rank1, fab.socket(0), 8.0))
            await fab.until(lambda: d0.service("p2p").engine.pending() == 1)
            d1.send = lambda node, frame: None  # type: ignore[method-assign]  # 1 falls silent
            assert await receiver == "PeerFailed"  # told when node 1 went down, not timed out
            del d1.send
            await holder
    assert not escaped, f"reached the event loop: {escaped}"


class Hears(BaseService):
    """Records membership's news as the last service hears it: the rank table's changes and
    the verdicts on a node whose links were reset."""

    name = "hears"

    def __init__(self) -> None:
        self.news: list[str] = []

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        self.news.append(type(event).__name__)

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        self.news.append(type(event).__name__)


async def test_membership_news_of_a_reset_node_reaches_every_service(tmp_path: Path) -> None:
    """Rank 1's node loses its data link: the rank is suspected, then back with its node (the
    same daemon), and each service, in order up to the last, hears every step of it."""

    def hears_last(daemon: Daemon) -> list[BaseService]:
        return [*default_services(daemon), Hears()]

    async with fabric(tmp_path, {0: hears_last}) as fab:
        d0 = fab.daemons[0]
        hears = d0.service("hears")
        assert isinstance(hears, Hears)
        ready = asyncio.Event()
        holder = asyncio.create_task(
            asyncio.to_thread(_hold_rank1, fab.socket(1), ready, asyncio.get_running_loop())
        )
        await asyncio.wait_for(ready.wait(), 10)
        await fab.until(lambda: hears.news == ["RankJoined"])
        d0.data_link(1).close("cut for the test")
        await fab.until(lambda: len(hears.news) == 6)
        assert hears.news == [
            "RankJoined",
            "RankLeft",
            "RankSuspected",
            "NodeBack",
            "RankBack",
            "RankJoined",
        ]
        await holder
