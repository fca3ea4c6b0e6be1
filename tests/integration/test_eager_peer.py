"""What a peer can make a daemon hold through the eager path and RTRs, and what a peer that
vanishes leaves behind (issue 8; RELIABILITY F10 for the eager pool, F2 for the new states).

Three real daemons on loopback, as in test_peer_fuzz.py: node 0 is killed and the test plays
it with the shared secret (:mod:`tests.integration.peer_client`), so its frames reach the
target's engine; node 1 is the target's real peer and must be served throughout.  Liveness is
slow here, so only a link the test closes takes the pretend node down.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

import fabricd
from fabricd.wire import NEED_DATA, Frame, Kind

from .peer_client import PATIENCE
from .test_peer_fuzz import _peer, _pretend_node_zero, _rss, _session, _status

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Iterator

    from fabricd.daemon.launcher import LocalCluster

    from .peer_client import PeerSession

MiB: Final = 1 << 20
KiB: Final = 1 << 10
TARGET: Final = 2
#: a silent pretend node must not be taken down while a test looks elsewhere
SLOW_LIVENESS: Final = {"suspect_after": 30.0, "down_after": 60.0}
EAGER_CREDIT: Final = 1 * MiB
MAX_UNMATCHED: Final = 64  #: max_unmatched_rts_per_peer, low so the flood reaches it


class Inbox:
    """The frames the target sends the pretend node on its control link, kept until taken:
    a test waits for one frame and must not lose the others that came first."""

    def __init__(self, peer: PeerSession) -> None:
        self.link = peer.control
        self.kept: list[Frame] = []

    def take(
        self, kind: Kind, match: Callable[[dict[str, Any]], bool] = lambda meta: True
    ) -> Frame:
        """The first frame of ``kind`` whose metadata ``match`` accepts (a hang guard waits)."""
        self.link.sock.settimeout(PATIENCE)
        while True:
            for i, frame in enumerate(self.kept):
                if frame.kind is kind and match(frame.meta):
                    return self.kept.pop(i)
            self._read()

    def all(self, kind: Kind, count: int) -> list[Frame]:
        """``count`` frames of ``kind``, in the order they came (a hang guard waits)."""
        self.link.sock.settimeout(PATIENCE)
        while len([f for f in self.kept if f.kind is kind]) < count:
            self._read()
        taken = [f for f in self.kept if f.kind is kind][:count]
        self.kept = [f for f in self.kept if not any(f is t for t in taken)]
        return taken

    def _read(self) -> None:
        data = self.link.sock.recv(65536)
        if not data:
            raise ConnectionError("the target closed the pretend node's control link")
        self.link.decoder.feed(data)
        while (event := self.link.decoder.next_event()) is not NEED_DATA:
            if isinstance(event, Frame):
                # the payload is a view of the decoder's buffer: keep a copy
                payload = memoryview(bytes(event.payload))
                self.kept.append(
                    Frame(kind=event.kind, flags=event.flags, meta=event.meta, payload=payload)
                )


def closed(sock: socket.socket) -> bool:
    """Read until the target closes ``sock``; False if it is still open after PATIENCE.

    (:func:`~tests.integration.peer_client.closed_by_peer` waits as long as frames keep coming,
    and an authenticated link keeps getting the target's heartbeats.)
    """
    guard = time.monotonic() + PATIENCE  # a hang guard
    sock.settimeout(PATIENCE)
    try:
        while sock.recv(65536):
            if time.monotonic() > guard:
                return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


@pytest.fixture
def pretend() -> Iterator[Callable[[LocalCluster, bytes], PeerSession]]:
    """Open sessions of the pretend node 0 to the target; each is closed at teardown too, so a
    failed assertion leaves no socket open."""
    opened: list[PeerSession] = []

    def open_session(cluster: LocalCluster, secret: bytes) -> PeerSession:
        opened.append(_session(cluster, secret))
        return opened[-1]

    yield open_session
    for session in opened:
        session.close()


def _of_message(msg: int) -> Callable[[dict[str, Any]], bool]:
    """What :meth:`Inbox.take` matches to find a frame about message ``msg``."""
    return lambda meta: meta.get("msg") == msg


def _announce(peer: PeerSession, job: str, size: int) -> None:
    """The pretend node hosts rank 0 of ``job``."""
    meta = {"job": job, "rank": 0, "size": size, "present": True, "owner": os.getuid()}
    peer.send(Kind.ANNOUNCE, meta)


def _knows(cluster: LocalCluster, job: str, rank: int, node: int) -> None:
    """Wait until the target's rank table has ``rank`` of ``job`` on ``node``."""
    guard = time.monotonic() + PATIENCE  # a hang guard
    while not [
        r
        for r in _status(cluster, TARGET)["ranks"]
        if (r["job"], r["rank"], r["node"]) == (job, rank, node)
    ]:
        assert time.monotonic() < guard, f"rank {rank} of {job} never showed on node {node}"
        time.sleep(0.02)


def _until(cluster: LocalCluster, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The target's status once ``ready`` accepts it (a hang guard waits)."""
    guard = time.monotonic() + PATIENCE
    while not ready(status := _status(cluster, TARGET)):
        assert time.monotonic() < guard, f"the target never got there: {status}"
        time.sleep(0.02)
    return status


def _about(job: str, tag: int, nbytes: int, *, src: int = 0, dst: int = 1) -> dict[str, object]:
    """The fields that say which message (or receive) a frame is about."""
    return {"job": job, "src": src, "dst": dst, "tag": tag, "nbytes": nbytes, "dtype": "uint8"}


def _eager(msg: int, job: str, tag: int, nbytes: int) -> dict[str, object]:
    """An EAGER's (or an RTS's) metadata: message ``msg`` from rank 0 to rank 1."""
    return {"msg": msg, **_about(job, tag, nbytes)}


def _rtr(rtr: int, job: str, tag: int, nbytes: int) -> dict[str, object]:
    """An RTR's metadata: rank 0 is ready for rank 1's message."""
    return {"rtr": rtr, **_about(job, tag, nbytes, src=1, dst=0)}


def _bytes_of(msg: int, nbytes: int) -> bytes:
    """The payload the pretend node sends as message ``msg``: each one different."""
    return bytes((msg + i) % 251 for i in range(251)) * (nbytes // 251) + bytes(nbytes % 251)


@contextlib.contextmanager
def _other_pair(cluster: LocalCluster) -> Iterator[Callable[[int], None]]:
    """A job with rank 0 on node 1 and rank 1 on the target; yields ``exchange(n)``, which sends
    one message each way and checks it (the target serving others while a peer misbehaves)."""
    with (
        fabricd.connect(job="other", rank=0, size=2, socket_path=cluster.nodes[1].socket_path) as a,
        fabricd.connect(
            job="other", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
        ) as b,
    ):
        x, y = a.array("x", (4096,), "uint8"), b.array("y", (4096,), "uint8")

        def exchange(n: int) -> None:
            x[:] = n % 256
            sent = a.send_async(x, to=1, tag=n)
            b.recv(y, src=0, tag=n, timeout=PATIENCE)
            sent.wait(timeout=PATIENCE)
            assert (y == n % 256).all()
            y[:] = (n + 1) % 256
            back = b.send_async(y, to=0, tag=n)
            a.recv(x, src=1, tag=n, timeout=PATIENCE)
            back.wait(timeout=PATIENCE)
            assert (x == (n + 1) % 256).all()

        yield exchange


# -- F10: a flood of unexpected eager messages -------------------------------------------------
FLOOD: Final = 1024  #: EAGER frames of 64 KiB: 64 MiB against a 1 MiB pool
BURST: Final = 128


def test_an_eager_flood_is_held_to_the_pool_and_the_rest_become_rts_or_are_refused(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
) -> None:
    cluster, secret, _ = _pretend_node_zero(
        make_cluster,
        eager_credit=EAGER_CREDIT,
        max_unmatched_rts_per_peer=MAX_UNMATCHED,
        **SLOW_LIVENESS,
    )
    nbytes = 64 * KiB  # the eager limit: each one alone fits the credit
    pooled = EAGER_CREDIT // nbytes
    pid = cluster.nodes[TARGET].pid
    peer = pretend(cluster, secret)
    inbox = Inbox(peer)
    _announce(peer, "flood", 2)
    with (
        fabricd.connect(
            job="flood", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
        ) as rank1,
        _other_pair(cluster) as exchange,
    ):
        _knows(cluster, "flood", 0, 0)
        exchange(0)  # allocator pools warm before the RSS is read
        before = _rss(pid)
        for burst in range(FLOOD // BURST):  # no receive posted, the credit ignored
            for msg in range(burst * BURST + 1, (burst + 1) * BURST + 1):
                peer.send(Kind.EAGER, _eager(msg, "flood", 0, nbytes), _bytes_of(msg, nbytes))
            exchange(burst + 1)  # the others are served between the bursts
        refused = inbox.all(Kind.DONE, FLOOD - MAX_UNMATCHED)  # every refusal is said
        assert {f.meta.get("code") for f in refused} == {"limit"}
        assert [f.meta["msg"] for f in refused] == list(range(MAX_UNMATCHED + 1, FLOOD + 1))
        assert "max_unmatched_rts_per_peer" in refused[0].meta["error"]
        status = _status(cluster, TARGET)
        assert status["eager_pool_bytes"] == pooled * nbytes <= EAGER_CREDIT
        assert status["unexpected_messages"] == MAX_UNMATCHED  # held: pooled, or as an RTS
        assert status["counters"]["eager_pool_full"] == MAX_UNMATCHED - pooled
        assert status["counters"]["rts_refused_peer_limit"] == FLOOD - MAX_UNMATCHED
        assert _rss(pid) - before < EAGER_CREDIT + 16 * MiB  # the pool, not the 64 MiB sent

        # nothing held was dropped: the pooled ones land from the pool, the next gets a CTS
        array = rank1.array("got", (nbytes,), "uint8")
        for msg in range(1, pooled + 1):
            rank1.recv(array, src=0, timeout=PATIENCE)
            assert array.tobytes() == _bytes_of(msg, nbytes)
            assert "code" not in inbox.take(Kind.DONE, _of_message(msg)).meta
        assert _status(cluster, TARGET)["eager_pool_bytes"] == 0
        waiting = rank1.recv_async(array, src=0)
        assert inbox.take(Kind.CTS).meta["msg"] == pooled + 1  # its payload was dropped unread
        peer.send(
            Kind.DATA, {"msg": pooled + 1, "off": 0}, _bytes_of(pooled + 1, nbytes), data=True
        )
        waiting.wait(timeout=PATIENCE)
        assert array.tobytes() == _bytes_of(pooled + 1, nbytes)
        exchange(FLOOD)
    peer.close()
    _until(cluster, lambda s: s["unexpected_messages"] == 0 and s["pending_ops"] == 0)


def _payload_mismatch(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
    declared: int,
    carried: int,
) -> tuple[LocalCluster, int]:
    """An EAGER of ``declared`` bytes that carries ``carried``: returns the cluster and the
    target's RSS growth meanwhile, once the link is closed."""
    cluster, secret, _ = _pretend_node_zero(make_cluster, **SLOW_LIVENESS)
    pid = cluster.nodes[TARGET].pid
    peer = pretend(cluster, secret)
    _announce(peer, "lying", 2)
    with fabricd.connect(
        job="lying", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
    ):
        _knows(cluster, "lying", 0, 0)
        before = _rss(pid)
        control = peer.control
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            control.sock.sendall(control.head(Kind.EAGER, _eager(1, "lying", 0, declared), carried))
            for at in range(0, carried, MiB):
                control.sock.sendall(bytes(min(MiB, carried - at)))
            control.sock.sendall(control.trailer(Kind.EAGER))
        assert closed(control.sock), "an EAGER that lies about its size was taken"
        assert closed(peer.data.sock)  # the reset takes both links
        grew = _rss(pid) - before
    return cluster, grew


@pytest.mark.parametrize(
    ("declared", "carried"),
    # no-payload: a header that says 64 KiB and no payload at all, which the daemon's framing
    # hands over without asking where a payload lands
    [(16, 64 * MiB), (64 * KiB, 10), (64 * KiB, 0)],
    ids=["longer", "shorter", "no-payload"],
)
def test_an_eager_whose_payload_is_not_its_nbytes_closes_the_link_unread(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
    declared: int,
    carried: int,
) -> None:
    cluster, grew = _payload_mismatch(make_cluster, pretend, declared, carried)
    assert grew < 16 * MiB  # closed at the header: no buffer of either size
    log = cluster.nodes[TARGET].log_path.read_text(errors="replace")
    assert f"says {declared} B and carries {carried}" in log
    assert _peer(_status(cluster, TARGET), 1)["state"] == "up"


def test_an_rtr_flood_past_max_unmatched_rts_per_peer_is_dropped_and_counted(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
) -> None:
    cluster, secret, _ = _pretend_node_zero(
        make_cluster, max_unmatched_rts_per_peer=MAX_UNMATCHED, **SLOW_LIVENESS
    )
    peer = pretend(cluster, secret)
    inbox = Inbox(peer)
    _announce(peer, "asks", 2)
    nbytes = 128 * KiB  # above the eager limit, as an RTR's receive is
    extra = 100
    with (
        fabricd.connect(
            job="asks", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
        ) as rank1,
        _other_pair(cluster) as exchange,
    ):
        _knows(cluster, "asks", 0, 0)
        for rtr in range(1, MAX_UNMATCHED + extra + 1):  # one per tag: each a key of its own
            peer.send(Kind.RTR, _rtr(rtr, "asks", rtr, nbytes))
        status = _until(cluster, lambda s: s["counters"]["rtr_dropped"] >= extra)
        exchange(1)
        assert status["counters"]["rtr_dropped"] == extra
        assert _peer(status, 0)["state"] == "up"  # refused quietly, not a protocol error
        array = rank1.array("x", (nbytes,), "uint8")
        kept = rank1.send_async(array, to=0, tag=1)  # its RTR is held: it streams at once
        assert inbox.take(Kind.RTS, lambda m: m["tag"] == 1).meta.get("rtr") == 1
        dropped = rank1.send_async(array, to=0, tag=MAX_UNMATCHED + 1)  # comes as a plain RTS
        assert "rtr" not in inbox.take(Kind.RTS, lambda m: m["tag"] == MAX_UNMATCHED + 1).meta
        peer.close()  # neither is answered: both fail when the pretend node goes
        for handle in (kept, dropped):
            with pytest.raises(fabricd.PeerFailed):
                handle.wait(timeout=PATIENCE)
        exchange(2)
    _until(cluster, lambda s: s["pending_ops"] == 0)


# -- F2: a peer that vanishes while messages are in each new state ----------------------------
def test_a_vanished_peer_fails_each_eager_and_rtr_state_once_and_leaks_nothing(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
) -> None:
    cluster, secret, _ = _pretend_node_zero(make_cluster, **SLOW_LIVENESS)
    peer = pretend(cluster, secret)
    inbox = Inbox(peer)
    _announce(peer, "f2", 3)
    target, other = cluster.nodes[TARGET].socket_path, cluster.nodes[1].socket_path
    big = 4 * MiB  # above the eager limit
    huge = 32 * MiB  # a stream that no socket buffer holds whole: it stops midway
    with (
        fabricd.connect(job="f2", rank=1, size=3, socket_path=target) as rank1,
        fabricd.connect(job="f2", rank=2, size=3, socket_path=other) as rank2,
    ):
        _knows(cluster, "f2", 0, 0)
        _knows(cluster, "f2", 2, 1)
        before = _status(cluster, TARGET)["counters"]
        small = rank1.array("small", (1024,), "uint8")
        # EAGER: sent whole to the pretend node, which never answers
        eager = rank1.send_async(small, to=0, tag=1)
        assert inbox.take(Kind.EAGER, lambda m: m["tag"] == 1).meta["nbytes"] == 1024
        # RTR out: a large receive posted first, unanswered
        outstanding = rank1.array("outstanding", (big,), "uint8")
        asked = rank1.recv_async(outstanding, src=0, tag=3)
        assert inbox.take(Kind.RTR, lambda m: m["tag"] == 3).meta["nbytes"] == big
        # mid-RTR stream, receiving: the RTS answering the RTR and a quarter of the bytes came
        landing = rank1.array("landing", (big,), "uint8")
        streaming_in = rank1.recv_async(landing, src=0, tag=4)
        rtr = inbox.take(Kind.RTR, lambda m: m["tag"] == 4).meta["rtr"]
        peer.send(Kind.DATA, {"msg": 2, "off": 0, "rtr": rtr}, bytes(big // 4), data=True)
        peer.send(Kind.RTS, {**_eager(2, "f2", 4, big), "rtr": rtr})
        # (for the sending stream below) the pretend node is ready for rank 1's message
        peer.send(Kind.RTR, _rtr(7, "f2", 5, huge))
        # pooled: the pretend node's message, whose receive is not posted; once it is in,
        # so is every control frame before it
        peer.send(Kind.EAGER, _eager(1, "f2", 2, 1024), _bytes_of(1, 1024))
        _until(
            cluster,
            lambda s: s["eager_pool_bytes"] == 1024 and _peer(s, 0)["bytes_received"] >= big // 4,
        )
        # mid-RTR stream, sending: the RTR is answered at once, and none of the DATA is read
        outgoing = rank1.array("outgoing", (huge,), "uint8")
        streaming_out = rank1.send_async(outgoing, to=0, tag=5)
        assert inbox.take(Kind.RTS, lambda m: m["tag"] == 5).meta["rtr"] == 7
        # and what has nothing to do with node 0: a receive from rank 2, a send to it
        local_in = rank1.array("from2", (64,), "uint8")
        from2 = rank1.recv_async(local_in, src=2, tag=9)
        to2 = rank1.send_async(small, to=2, tag=9)
        # EAGER landing: half of a small message's frame is in its posted receive
        half_in = rank1.array("half", (32 * KiB,), "uint8")
        half = rank1.recv_async(half_in, src=0, tag=6)
        status = _until(cluster, lambda s: s["pending_ops"] == 7)
        control = peer.control
        control.sock.sendall(control.head(Kind.EAGER, _eager(3, "f2", 6, 32 * KiB), 32 * KiB))
        control.sock.sendall(bytes(16 * KiB))
        received = _peer(status, 0)["bytes_received"]
        status = _until(cluster, lambda s: _peer(s, 0)["bytes_received"] >= received + 16 * KiB)
        # every frame was taken as meant: none closed a link, two RTRs out, one answered
        assert _peer(status, 0)["links"] == {"control": True, "data": True}
        counters = status["counters"]
        assert counters["rtr_sent"] - before["rtr_sent"] == 2
        assert counters["rtr_answered"] - before["rtr_answered"] == 1

        peer.close()  # the pretend node vanishes: both links reset
        failed = [eager, asked, streaming_in, streaming_out, half]
        for handle in failed:
            with pytest.raises(fabricd.PeerFailed) as lost:
                handle.wait(timeout=PATIENCE)
            assert lost.value.code == "peer_failed"
        sent_by_2 = rank2.array("for1", (64,), "uint8")
        sent_by_2[:] = 42
        rank2.send(sent_by_2, to=1, tag=9, timeout=PATIENCE)
        from2.wait(timeout=PATIENCE)
        assert (local_in == 42).all()
        rank2.recv(rank2.array("from1", (1024,), "uint8"), src=1, tag=9, timeout=PATIENCE)
        to2.wait(timeout=PATIENCE)
        after = _until(cluster, lambda s: s["pending_ops"] == 0)
    assert after["eager_pool_bytes"] == 0
    assert after["unexpected_messages"] == 0
    counters = after["counters"]
    assert counters["ops_failed"] - before["ops_failed"] == len(failed)  # once each
    assert counters["ops_completed"] - before["ops_completed"] == 2  # the rest went on


def test_a_vanished_peer_frees_the_pool_even_mid_frame_and_its_messages_never_land(
    make_cluster: Callable[..., LocalCluster],
    pretend: Callable[[LocalCluster, bytes], PeerSession],
) -> None:
    cluster, secret, _ = _pretend_node_zero(make_cluster, **SLOW_LIVENESS)
    peer = pretend(cluster, secret)
    _announce(peer, "gone", 2)
    nbytes = 32 * KiB
    with fabricd.connect(
        job="gone", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
    ) as rank1:
        _knows(cluster, "gone", 0, 0)
        peer.send(Kind.EAGER, _eager(1, "gone", 0, nbytes), _bytes_of(1, nbytes))  # pooled
        control = peer.control  # and half of another, its pool room taken when its head came
        control.sock.sendall(control.head(Kind.EAGER, _eager(2, "gone", 0, nbytes), nbytes))
        control.sock.sendall(_bytes_of(2, nbytes)[: nbytes // 2])
        _until(cluster, lambda s: s["eager_pool_bytes"] == 2 * nbytes)
        peer.close()
        _until(cluster, lambda s: s["eager_pool_bytes"] == 0 and s["unexpected_messages"] == 0)
        # the node comes back as a new incarnation: only what it sends now is received
        again = pretend(cluster, secret)
        _announce(again, "gone", 2)
        array = rank1.array("got", (nbytes,), "uint8")
        received = rank1.recv_async(array, src=0)
        again.send(Kind.EAGER, _eager(1, "gone", 0, nbytes), _bytes_of(3, nbytes))
        received.wait(timeout=PATIENCE)
        assert array.tobytes() == _bytes_of(3, nbytes)
        status = _until(cluster, lambda s: s["pending_ops"] == 0)
        assert (status["eager_pool_bytes"], status["unexpected_messages"]) == (0, 0)
        again.close()
