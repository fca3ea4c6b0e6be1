"""An attacker on the path between two daemons (RELIABILITY S4; issue 7, item 5).

Two in-process daemons (:mod:`tests.integration.inproc`) whose links run through
:class:`TapNet`: every byte one daemon sends passes through a tap before the other decodes it,
as it would through a proxy on the network, and each test gives the tap one trick to play on
the encoded stream.  The attacker knows the wire format but not the secret.  Each trick must be
refused: the link closes, the peer is reset and counted as an integrity failure, the pair comes
back with fresh keys, and nothing the trick carried was applied (no rank that is not there, no
corrupted message reported received).  On the code before frames were sealed, every one of
these tricks was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

import fabricd
from fabricd.integrity import TRAILER_SIZE
from fabricd.transports.inproc import InprocLink, InprocTransport
from fabricd.wire import HEADER_SIZE, Kind, encode

from .inproc import Fabric
from .ranks import Step, run_plan

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from fabricd.daemon.node import Daemon
    from fabricd.wire import Limits


class TapLink(InprocLink):
    """An in-process link whose received bytes pass through its network's tap first."""

    net: TapNet
    dialled: bool  #: this end belongs to the node that dialled (node 0)
    channel: str

    def _receive(self, data: bytes) -> None:
        trick = self.net.trick
        for chunk in [data] if trick is None else trick(self, data):
            if self.closed:
                return
            super()._receive(chunk)


class TapNet(InprocTransport):
    """The in-process network with an attacker on it; one inproc delivery is one frame."""

    def __init__(self) -> None:
        super().__init__()
        self.trick: Callable[[TapLink, bytes], list[bytes]] | None = None
        self._dials = itertools.count()

    async def connect(self, address: str, limits: Limits, *, source: str = "") -> InprocLink:
        on_link, server_limits = self.listeners[address]
        # node 0 dials both links of the pair, control first (architecture.md, "Peers")
        channel = "control" if next(self._dials) % 2 == 0 else "data"
        ends = []
        for local, peer, lim, dialled in (
            (f"tap-{channel}", address, limits, True),
            (address, f"tap-{channel}", server_limits, False),
        ):
            end = TapLink(local, peer, lim, self)
            end.net, end.dialled, end.channel = self, dialled, channel
            ends.append(end)
        client, server = ends
        client.peer, server.peer = server, client
        on_link(server)
        await asyncio.sleep(0)
        return client


@contextlib.asynccontextmanager
async def tapped(tmp_path: Path, **extra: Any) -> AsyncIterator[tuple[Fabric, TapNet]]:
    """Both daemons up over a :class:`TapNet` whose tap plays no trick yet."""
    # long liveness timeouts: a frame the tap holds back must not look like silence
    fab = Fabric(tmp_path, suspect_after=5.0, down_after=20.0, **extra)
    net = TapNet()
    fab.net = net
    for node in (0, 1):
        await fab.start(node)
    try:
        await fab.until(fab.up)
        yield fab, net
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)


def frame_kind(frame: bytes) -> Kind:
    return Kind(frame[5])


def node0_to_node1_control(link: TapLink) -> bool:
    return link.channel == "control" and not link.dialled


def present(d: Daemon, job: str, rank: int) -> bool:
    """Whether ``d`` believes ``rank`` of ``job`` lives on the other node."""
    entries = d.service("membership").engine.entries()  # type: ignore[attr-defined]
    return any(e.job == job and e.rank == rank and e.node != d.config.node_id for e in entries)


def counter(d: Daemon, name: str) -> int:
    value: int = d.peering.statistics()["counters"][name]
    return value


async def refused_and_back(fab: Fabric, node: int) -> None:
    """The trick closed a link of ``node`` for integrity once, and the pair came back up."""
    d = fab.daemons[node]
    await fab.until(lambda: counter(d, "integrity_failures") >= 1)
    assert counter(d, "peer_resets") >= 1
    await fab.until(fab.up)
    assert counter(d, "integrity_failures") == 1


def join_and_leave(socket_path: str, job: str) -> None:
    """A client joins ``job`` as rank 0 of 2 on node 0 and leaves: node 1 hears two ANNOUNCEs."""
    with fabricd.connect(job=job, rank=0, size=2, socket_path=socket_path):
        pass


# -- control frames -------------------------------------------------------------------------
async def test_an_injected_announce_is_refused_and_no_fake_rank_appears(tmp_path: Path) -> None:
    forged = encode(
        Kind.ANNOUNCE, {"job": "fake", "rank": 7, "size": 8, "present": True, "owner": 0}
    )
    injected: list[bytes] = []

    def inject(link: TapLink, frame: bytes) -> list[bytes]:
        if node0_to_node1_control(link) and not injected:
            injected.append(forged)
            return [forged, frame]  # ahead of the next real frame (a heartbeat)
        return [frame]

    async with tapped(tmp_path) as (fab, net):
        net.trick = inject
        await refused_and_back(fab, 1)
        assert injected
        assert not present(fab.daemons[1], "fake", 7)


async def test_a_replayed_announce_is_refused_and_the_rank_that_left_stays_gone(
    tmp_path: Path,
) -> None:
    """The attacker records rank 0's ANNOUNCE (present) and plays it again after it left."""
    captured: list[bytes] = []

    def replay(link: TapLink, frame: bytes) -> list[bytes]:
        if not node0_to_node1_control(link) or frame_kind(frame) is not Kind.ANNOUNCE:
            return [frame]
        if not captured:
            captured.append(frame)  # the join
            return [frame]
        if len(captured) == 1:
            captured.append(frame)  # the leave, then the join again
            return [frame, captured[0]]
        return [frame]

    async with tapped(tmp_path) as (fab, net):
        net.trick = replay
        await asyncio.to_thread(join_and_leave, fab.socket(0), "j")
        await refused_and_back(fab, 1)
        assert len(captured) == 2
        assert not present(fab.daemons[1], "j", 0)


async def test_reordered_announces_are_refused_and_the_rank_that_left_stays_gone(
    tmp_path: Path,
) -> None:
    """The attacker holds rank 0's join back until its leave went past."""
    held: list[bytes] = []

    def reorder(link: TapLink, frame: bytes) -> list[bytes]:
        if not node0_to_node1_control(link) or frame_kind(frame) is not Kind.ANNOUNCE:
            return [frame]
        if not held:
            held.append(frame)  # the join: hold it
            return []
        if len(held) == 1:
            held.append(frame)  # the leave, then the join
            return [frame, held[0]]
        return [frame]

    async with tapped(tmp_path) as (fab, net):
        net.trick = reorder
        await asyncio.to_thread(join_and_leave, fab.socket(0), "j")
        await refused_and_back(fab, 1)
        assert len(held) == 2
        assert not present(fab.daemons[1], "j", 0)


async def test_a_flipped_mac_bit_is_refused(tmp_path: Path) -> None:
    flipped: list[Kind] = []

    def flip_mac(link: TapLink, frame: bytes) -> list[bytes]:
        if node0_to_node1_control(link) and not flipped:
            flipped.append(frame_kind(frame))
            tampered = bytearray(frame)
            tampered[-1] ^= 0x01  # the MAC's last bit; everything else intact
            return [bytes(tampered)]
        return [frame]

    async with tapped(tmp_path) as (fab, net):
        net.trick = flip_mac
        await refused_and_back(fab, 1)
        assert flipped


# -- DATA -----------------------------------------------------------------------------------
def recv_from_rank1(socket_path: str) -> str:
    with fabricd.connect(job="j", rank=0, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (1 << 16,), "int32")
        try:
            fab.recv(array, src=1, timeout=20)
        except fabricd.FabricError as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return "ok" if (array == np.arange(1 << 16)).all() else "ok, but wrong bytes"


def send_to_rank0(socket_path: str) -> str:
    with fabricd.connect(job="j", rank=1, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (1 << 16,), "int32")
        array[:] = np.arange(1 << 16)
        try:
            fab.send(array, to=0, timeout=20)
        except fabricd.FabricError as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return "ok"


def flip_first_data_byte(flipped: list[int]) -> Callable[[TapLink, bytes], list[bytes]]:
    """Flip one payload byte of the first DATA frame node 1 sends node 0."""

    def flip(link: TapLink, frame: bytes) -> list[bytes]:
        if link.channel != "data" or not link.dialled or flipped:
            return [frame]
        assert frame_kind(frame) is Kind.DATA
        meta_len = int.from_bytes(frame[8:12], "big")
        at = HEADER_SIZE + meta_len + 1000
        assert at < len(frame) - TRAILER_SIZE
        tampered = bytearray(frame)
        tampered[at] ^= 0x01
        flipped.append(at)
        return [bytes(tampered)]

    return flip


async def move_one_message(fab: Fabric) -> tuple[str, str]:
    receiver = asyncio.create_task(asyncio.to_thread(recv_from_rank1, fab.socket(0)))
    sent = await asyncio.to_thread(send_to_rank0, fab.socket(1))
    return await receiver, sent


async def test_a_flipped_data_byte_fails_the_receive_with_data_integrity(tmp_path: Path) -> None:
    flipped: list[int] = []
    async with tapped(tmp_path, data_integrity="mac") as (fab, net):
        net.trick = flip_first_data_byte(flipped)
        received, sent = await move_one_message(fab)
        assert flipped
        assert received.startswith("failed: "), received  # never "ok" with other bytes
        assert sent.startswith("failed: "), sent  # the sender never hears DONE either
        await refused_and_back(fab, 0)
        net.trick = None
        assert await move_one_message(fab) == ("ok", "ok")  # the pair works again


async def test_without_data_integrity_a_flipped_data_byte_is_not_noticed(tmp_path: Path) -> None:
    """What data_integrity = "mac" buys (docs/operations.md, "Threat model")."""
    flipped: list[int] = []
    async with tapped(tmp_path, data_integrity="none") as (fab, net):
        net.trick = flip_first_data_byte(flipped)
        assert await move_one_message(fab) == ("ok, but wrong bytes", "ok")
        assert counter(fab.daemons[0], "integrity_failures") == 0


# -- real daemons over TCP ------------------------------------------------------------------
def test_messages_over_tcp_arrive_whole_with_data_integrity(make_cluster, spawn):
    """Real daemon processes over loopback TCP with every DATA payload covered: sizes around
    the chunk and read-buffer boundaries, both directions, bit-exact, and no check fails (the
    sender's split write of payload then trailer, the receiver's 1 MiB hashing buffer)."""
    cluster = make_cluster(2, data_integrity="mac", chunk_size=1 << 20)
    sizes = [0, 1, 4095, 65_536 + 7, (1 << 20) - 1, (1 << 20) + 1, 5 * (1 << 20) + 3]
    plans: dict[int, list[Step]] = {0: [], 1: []}
    for tag, n in enumerate(sizes):
        src, dst = tag % 2, 1 - tag % 2
        plans[src].append(("send", dst, tag, "uint8", n))
        plans[dst].append(("recv", src, tag, "uint8", n))
    ranks = [spawn(run_plan, cluster.nodes[r].socket_path, "mac", r, 2, plans[r]) for r in (0, 1)]
    for r, process in enumerate(ranks):
        process.join(120)
        assert process.exitcode == 0, f"rank {r} failed:\n" + cluster.nodes[r].log_tail()
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as control:
            status = control.status()
        assert status["counters"]["integrity_failures"] == 0
        assert status["counters"]["peer_resets"] == 0
