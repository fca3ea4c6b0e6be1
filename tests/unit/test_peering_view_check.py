"""The peering service's handshake of one link (``_PendingSink``) under membership from etcd:
the view is asked of every HELLO before it is answered, on both sides (docs/protocol.md §3.2).

An acceptor refuses the dialler's HELLO before answering it, so the dialler sees its dial fail
and backs off.  A dialler whose view lags refuses the acceptor's (proven) HELLO before it sends
AUTH, so the acceptor sees an unfinished handshake, not a link it admits and then loses: it
used to reset its peer every backoff for as long as the dialler's view lagged.  Either way the
refusal is counted as a refused link (``fabricd_links_refused_total``), not as a failed
handshake (``fabricd_handshake_failures_total{reason="failed"}``).

Two real :class:`Handshake` engines and a real :class:`PeerTable`; the service and the link
are fakes that record what happens, in order.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.services.peering import PeeringService, _PendingSink
from fabricd.engines.link.handshake import Channel, Handshake, PeerIdentity, Role
from fabricd.engines.link.peers import PeerTable, Timeouts
from fabricd.errors import TransportError
from fabricd.frames.link import NONCE_SIZE
from fabricd.wire import Frame, Kind

if TYPE_CHECKING:
    from fabricd.frames.link import HandshakeFrame, Hello

SECRET = b"s" * 32
TIMEOUTS = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)
LINK = 7  #: the link id of the handshake under test
DIALLER_HOST = "10.0.0.1"


class FakeLink:
    """Records what the sink sends on it and whether it closes it."""

    peer_address = f"{DIALLER_HOST}:1"
    close_reason: str | None = None

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send_nowait(self, kind: int, meta: object) -> None:
        self.log.append(f"sent {Kind(kind).name}")

    def close(self, reason: str) -> None:
        self.log.append(f"closed: {reason}")

    def secure(self, *keys: object) -> None:
        pass


class FakeService:
    """The peering service as the sink sees it, over a real :class:`PeerTable`; its view
    check is the real :meth:`PeeringService.check_view`."""

    def __init__(self, engine: PeerTable, log: list[str]) -> None:
        self.engine = engine
        self.log = log

    def check_view(self, hello: Hello) -> str:
        self.log.append("view asked")
        return PeeringService.check_view(self, hello)  # type: ignore[arg-type]

    def handshake_over(self, link_id: int, *, failed: bool = False) -> None:
        self.engine.on_handshake_over(link_id, failed=failed)

    def authenticated(self, sink: _PendingSink, link: FakeLink, peer: PeerIdentity) -> None:
        self.log.append(f"authenticated {peer.name} {peer.incarnation}")


def initiator(node: int, name: str, expected: int) -> Handshake:
    return Handshake(
        role=Role.INITIATOR,
        secret=SECRET,
        node=node,
        incarnation=1,
        nonce=b"i" * NONCE_SIZE,
        fabric_size=4,
        name=name,
        channel=Channel.CONTROL,
        expected_node=expected,
    )


def acceptor(node: int, name: str, incarnation: int) -> Handshake:
    return Handshake(
        role=Role.ACCEPTOR,
        secret=SECRET,
        node=node,
        incarnation=incarnation,
        nonce=b"a" * NONCE_SIZE,
        fabric_size=4,
        name=name,
    )


def frame(hs: HandshakeFrame) -> Frame:
    return Frame(kind=hs.KIND, flags=0, meta=hs.to_meta(), payload=memoryview(b""))


def dialler_run(registered: int) -> tuple[list[str], PeerTable, _PendingSink]:
    """Node 2 (view: slot 3 is 'c' of incarnation ``registered``) dials node 3, 'c' of
    incarnation 600, and gets its answer to HELLO."""
    log: list[str] = []
    engine = PeerTable(node=2, nodes=4, timeouts=TIMEOUTS, now=0.0, named=True)
    engine.set_holder(3, "c", registered, 0.0)
    engine.on_handshake_started(LINK, "10.0.0.3", 0.0, accepted=False)
    mine, theirs = initiator(2, "b", 3), acceptor(3, "c", 600)
    theirs.start()

    async def run() -> _PendingSink:
        sink = _PendingSink(FakeService(engine, log), LINK, mine)  # type: ignore[arg-type]
        (hello,) = mine.start()
        (answer,) = theirs.on_frame(hello.frame)
        sink.frame_received(FakeLink(log), frame(answer.frame))  # type: ignore[arg-type]
        return sink

    return log, engine, asyncio.run(run())


def test_a_dialler_whose_view_lags_refuses_before_it_sends_auth() -> None:
    """The acceptor restarted (incarnation 600); the dialler's view still has 500.  No AUTH
    goes out: the acceptor never admits the link, so it never resets its peer."""
    log, engine, sink = dialler_run(registered=500)
    assert log[0] == "view asked"
    assert "sent AUTH" not in log
    assert not any(line.startswith("authenticated") for line in log)
    assert "not the one registered in etcd (500)" in log[-1]  # closed with the reason
    with pytest.raises(TransportError):  # the dial fails: the dialler backs off
        sink.done.result()
    counted = engine.statistics()
    assert (counted.links_refused, counted.handshakes_refused) == (1, 0)


def test_a_dialler_whose_view_has_the_peer_asks_it_then_sends_auth() -> None:
    log, engine, _ = dialler_run(registered=600)
    assert log == ["view asked", "sent AUTH", "authenticated c 600"]
    assert engine.statistics().links_refused == 0


def acceptor_run(name: str) -> tuple[list[str], PeerTable, _PendingSink]:
    """Node 3 (view: slot 1 is 'b' of incarnation 1) accepts a link whose HELLO says
    ``name`` of incarnation 1, as node 1."""
    log: list[str] = []
    engine = PeerTable(
        node=3,
        nodes=4,
        timeouts=TIMEOUTS,
        now=0.0,
        named=True,
        hosts={n: frozenset({f"10.0.0.{n}"}) for n in range(4)},
    )
    engine.set_holder(1, "b", 1, 0.0)
    assert engine.on_handshake_started(LINK, DIALLER_HOST, 0.0) == []
    theirs = initiator(1, name, 3)

    async def run() -> _PendingSink:
        sink = _PendingSink(FakeService(engine, log), LINK, acceptor(3, "d", 9))  # type: ignore[arg-type]
        fake = FakeLink(log)
        sink.start(fake)  # type: ignore[arg-type]
        (hello,) = theirs.start()
        sink.frame_received(fake, frame(hello.frame))  # type: ignore[arg-type]
        return sink

    return log, engine, asyncio.run(run())


def test_an_acceptor_asks_the_view_of_a_hello_before_it_answers_it() -> None:
    """(The acceptor's HELLO is its answer: sink.start sends nothing.)"""
    log, engine, sink = acceptor_run("b")
    assert log == ["view asked", "sent HELLO"]
    assert not sink.done.done()  # waiting for AUTH
    assert engine.statistics().links_refused == 0


def test_an_acceptor_refuses_a_hello_not_in_its_view_as_a_refused_link() -> None:
    """Counted in links_refused (fabricd_links_refused_total, as docs/operations.md says), not
    as a failed handshake (wrong secret, malformed, past the deadline)."""
    log, engine, sink = acceptor_run("x")
    assert log[0] == "view asked"
    assert "sent HELLO" not in log
    assert "'x' does not hold node id 1" in log[-1]
    with pytest.raises(TransportError):
        sink.done.result()
    counted = engine.statistics()
    assert (counted.links_refused, counted.handshakes_refused) == (1, 0)
    assert counted.handshakes_pending == 0  # its handshake slot is free
