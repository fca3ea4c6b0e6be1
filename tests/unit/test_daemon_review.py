"""The point-to-point service and the write batching, where a callback re-enters or raises.

The service runs on a fake host (the recorder of test_p2p_service_bounds.py, with the real
engine behind it) whose ``reply`` can do what a client connection does when its write fails:
close the connection, which tells the daemon, at once, that the client is gone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.p2p import P2PService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.membership import RankEntry, RankJoined
from fabricd.errors import RemoteProtocolError
from fabricd.frames.p2p import Cancel, Eager
from fabricd.transports import batch
from fabricd.transports.inproc import InprocTransport
from fabricd.wire import DEFAULT_LIMITS, Kind

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import pytest

    from fabricd.frames.registry import PeerFrame
    from fabricd.transports.base import Buffer, Link
    from fabricd.wire import Frame, FrameHead

JOB = "j"


class Table:
    """Job ``"j"`` of size 3: ranks 0 and 1 on node 0; rank 2 (on node 1) joins later."""

    def __init__(self) -> None:
        self.entries = {
            (JOB, rank): RankEntry(job=JOB, rank=rank, size=3, node=0) for rank in (0, 1)
        }

    def lookup(self, job: str, rank: int) -> RankEntry | None:
        return self.entries.get((job, rank))


@dataclass
class LeavingHost:
    """Records what the service sends and answers; a reply to a client that ``leaves`` closes
    its connection, and the daemon then hears of it within that reply
    (daemon/ipc_server.py ``_flush``)."""

    config: Config
    draining: bool = False
    sent: list[tuple[int, PeerFrame]] = field(default_factory=list)
    answered: list[tuple[int, Any]] = field(default_factory=list)
    leaves: set[ClientSession] = field(default_factory=set)
    gone: Callable[[ClientSession], None] | None = None

    def send(self, node: int, frame: PeerFrame, payload: Sequence[Buffer] = ()) -> None:
        self.sent.append((node, frame))

    def reply(self, session: ClientSession, request_id: int, result: Any) -> None:
        self.answered.append((request_id, result))
        if session in self.leaves and self.gone is not None:
            self.leaves.discard(session)
            self.gone(session)

    def fail(self, session: ClientSession, request_id: int, failure: Any) -> None:
        self.reply(session, request_id, failure)

    def rearm(self) -> None:
        pass

    def now(self) -> float:
        return 0.0


class Segment:
    def __init__(self) -> None:
        self.data = bytearray(16)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.data)[offset : offset + nbytes]


def test_a_client_gone_during_an_early_reply_leaves_the_other_eagers_in_that_batch_sent() -> None:
    # Two wait="sent" sends of one client wait for rank 2 to join; its joining sends both as
    # EAGER.  The first one's early reply finds the client gone (its socket refuses the write)
    # and the daemon forgets the client right then.  Answered in the middle of the actions,
    # that abandoned the second send, already EAGER in the engine, while its SendEager was yet
    # to be performed: KeyError, and every action after it (other clients' EAGERs too) lost.
    cfg = Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2"))
    host = LeavingHost(cfg)
    table = Table()
    svc = P2PService(host, routes=table)  # type: ignore[arg-type]
    host.gone = lambda session: svc.client_gone(session, 0.0)
    leaving = ClientSession(conn=None, job=JOB, rank=0, size=3)  # type: ignore[arg-type]
    staying = ClientSession(conn=None, job=JOB, rank=1, size=3)  # type: ignore[arg-type]
    for session in (leaving, staying):
        session.segments[1] = Segment()  # type: ignore[assignment]
    meta = {"seg": 1, "off": 0, "nbytes": 4, "dtype": "uint8", "peer": 2, "wait": "sent"}
    svc.on_request(Request(session=leaving, id=1, op="send", meta={**meta, "tag": 1}, fds=[]), 0)
    svc.on_request(Request(session=leaving, id=2, op="send", meta={**meta, "tag": 2}, fds=[]), 0)
    svc.on_request(Request(session=staying, id=3, op="send", meta={**meta, "tag": 3}, fds=[]), 0)
    assert host.sent == []  # rank 2 has no node yet
    host.leaves.add(leaving)
    entry = RankEntry(job=JOB, rank=2, size=3, node=1)
    table.entries[(JOB, 2)] = entry
    svc.on_rank_event(RankJoined(entry=entry), 0.0)
    eagers = [frame.tag for _, frame in host.sent if isinstance(frame, Eager)]
    cancels = [frame.msg for _, frame in host.sent if isinstance(frame, Cancel)]
    assert eagers == [1, 2, 3]  # every EAGER the engine decided went out
    assert cancels == []  # each was answered (sent) already: nothing of it is cancelled
    assert sorted(request for request, _ in host.answered) == [1, 2, 3]  # each answered once


def test_a_flush_that_raises_does_not_keep_the_others_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A deferred flush must not raise (batch.py), but one that does (a bug) must not leave the
    # flushes after it pending: their writers would hold every frame they send from then on,
    # outside any read callback too, until some later callback ends.  Nor may it reach the
    # read callback whose span ended (a link's: the loop would close that healthy link).
    ran: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise RuntimeError("a bug")

    def healthy() -> None:
        ran.append("healthy")

    batch.hold()
    assert batch.defer(broken)
    assert batch.defer(healthy)
    batch.release()
    assert ran == ["broken", "healthy"]
    assert "a bug" in caplog.text  # logged
    assert not batch.defer(healthy)  # nothing held: a writer writes at once again


class _Refusing:
    """A sink that refuses every frame (as a peer's node does a malformed one)."""

    def payload_buffer(self, link: Link, head: FrameHead) -> memoryview | None:
        return None

    def frame_received(self, link: Link, frame: Frame) -> None:
        raise RemoteProtocolError("refused")

    def link_lost(self, link: Link, exc: BaseException | None) -> None:
        pass


async def test_an_inproc_link_its_peer_closes_mid_delivery_stops_delivering() -> None:
    # Node 1 refuses the first of two frames node 0 sent at once and closes its end, which
    # closes node 0's end from within the delivery of that frame.  The second frame stayed
    # queued, and the delivery re-armed itself for it on a closed link: every loop iteration
    # ran it again, for ever (a spinning loop in every test whose peer closes a link).
    transport = InprocTransport()
    accepted: list[Link] = []

    def on_link(link: Link) -> None:
        link.set_sink(_Refusing())
        accepted.append(link)

    await transport.listen("node1", on_link, DEFAULT_LIMITS)
    link = await transport.connect("node1", DEFAULT_LIMITS)
    link.set_sink(_Refusing())
    deliveries = 0
    deliver = link._deliver

    def counted() -> None:
        nonlocal deliveries
        deliveries += 1
        deliver()

    link._deliver = counted  # type: ignore[method-assign]
    link.send_nowait(Kind.HEARTBEAT, {})
    link.send_nowait(Kind.HEARTBEAT, {})
    for _ in range(50):  # bounded: far more iterations than two frames need
        await asyncio.sleep(0)
    assert link.closed
    assert accepted[0].closed
    assert deliveries == 1  # the one delivery that met the closed link, and none after it
