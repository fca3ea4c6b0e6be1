"""An attacker on the wire: a real TCP proxy on 127.0.0.1 between two real daemon processes
(RELIABILITY S4; issue 7, item 5).

:mod:`tests.integration.test_frame_integrity` plays the same tricks on an in-process tap; this
is the literal version the review used.  Both of the pair's links pass through
:class:`~tests.integration.tcp_proxy.Proxy`, which knows the frame layout (docs/protocol.md)
but not the secret, and each test gives it one trick: inject a forged ANNOUNCE, replay one,
reorder two frames, flip a DATA payload byte, flip a MAC bit.  Each time the receiving daemon
must close the link (counted in ``integrity_failures``, the peer reset), apply nothing the
trick carried (no fake rank in ``status``, a receive that fails instead of reporting altered
bytes), and the pair must come back through the same proxy and move a clean message intact.

Timeouts here are hang guards only.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.integrity import FLAG_SEALED, KEY_SIZE, TRAILER_SIZE, Sealer
from fabricd.wire import HEADER_SIZE, Kind, encode_head
from tests.integration.tcp_proxy import (
    GUARD,
    HEADER,
    ProxiedPairs,
    Relay,
    flags_of,
    kind_of,
    seq_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from typing import TypeAlias

    from fabricd.daemon.launcher import LocalCluster
    from tests.integration.tcp_proxy import Proxy

    #: the fixture: start a proxied pair with these settings
    MakeProxied: TypeAlias = "Callable[..., tuple[LocalCluster, Proxy]]"


def sealed_control_to_node1(relay: Relay, towards: int, frame: bytes) -> bool:
    """A frame past the handshake on node 0's control link to node 1."""
    return relay.channel == "control" and towards == 1 and bool(flags_of(frame) & FLAG_SEALED)


# -- the cluster ----------------------------------------------------------------------------
@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[MakeProxied]:
    """Two daemon processes whose links pass through a :class:`Proxy`; all stop at teardown,
    the proxy holds no connection after, and no daemon logged a traceback."""
    pairs = ProxiedPairs(tmp_path)
    yield pairs.make
    pairs.close()


def status(cluster: LocalCluster, node: int) -> dict[str, Any]:
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as client:
        answer: dict[str, Any] = client.status()
    return answer


def counter(cluster: LocalCluster, node: int, name: str) -> int:
    value: int = status(cluster, node)["counters"][name]
    return value


def has_rank(cluster: LocalCluster, node: int, job: str, rank: int) -> bool:
    """Whether ``node`` lists ``rank`` of ``job`` as living on the other node."""
    return any(r["job"] == job and r["rank"] == rank for r in status(cluster, node)["ranks"])


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD
    while not condition():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.02)


def refused_and_back(cluster: LocalCluster, node: int) -> None:
    """The trick closed a link of ``node`` for integrity once; the pair came back, and a clean
    message crosses through the proxy both ways."""
    until(lambda: counter(cluster, node, "integrity_failures") >= 1, "no integrity failure")
    assert counter(cluster, node, "peer_resets") >= 1
    cluster.wait_connected(GUARD)
    assert move_one_message(cluster, sender=1) == ("ok", "ok")
    assert move_one_message(cluster, sender=0) == ("ok", "ok")
    assert counter(cluster, node, "integrity_failures") == 1


def join_and_leave(cluster: LocalCluster, job: str) -> None:
    """A client joins ``job`` as rank 0 of 2 on node 0 and leaves: node 1 hears two ANNOUNCEs."""
    with fabricd.connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path):
        pass


# -- messages -------------------------------------------------------------------------------
N = 1 << 16


#: a fresh job per message: a job's ranks that just left may still be listed on the other node
#: (the leave is in flight) when the next message's ranks join under the same name
_JOBS = itertools.count()


def receive(socket_path: str, job: str, rank: int) -> str:
    with fabricd.connect(job=job, rank=rank, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (N,), "int32")
        try:
            fab.recv(array, src=1 - rank, timeout=GUARD)
        except fabricd.FabricError as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return "ok" if (array == np.arange(N)).all() else "ok, but wrong bytes"


def send(socket_path: str, job: str, rank: int) -> str:
    with fabricd.connect(job=job, rank=rank, size=2, socket_path=socket_path) as fab:
        array = fab.array("x", (N,), "int32")
        array[:] = np.arange(N)
        try:
            fab.send(array, to=1 - rank, timeout=GUARD)
        except fabricd.FabricError as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return "ok"


def move_one_message(cluster: LocalCluster, sender: int) -> tuple[str, str]:
    """Rank ``sender`` (on node ``sender``) sends 256 KiB to the other; (received, sent)."""
    receiver, job = 1 - sender, f"m{next(_JOBS)}"
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(receive, cluster.nodes[receiver].socket_path, job, receiver)
        sent = send(cluster.nodes[sender].socket_path, job, sender)
        return received.result(GUARD + 5), sent


# -- control frames -------------------------------------------------------------------------
def test_an_injected_announce_sealed_with_a_wrong_key_is_refused(proxied: MakeProxied) -> None:
    """A forged ANNOUNCE of a fake rank, well formed and carrying the very sequence number
    node 1 expects next, but sealed with a key the attacker made up."""
    cluster, proxy = proxied()
    injected: list[int] = []

    def inject(relay: Relay, towards: int, frame: bytes) -> list[bytes]:
        if injected or not sealed_control_to_node1(relay, towards, frame):
            return [frame]
        sealer = Sealer(os.urandom(KEY_SIZE), cover_data=False)
        sealer.seq = seq_of(frame) + 1
        meta = {"job": "fake", "rank": 7, "size": 8, "present": True, "owner": 0}
        head = encode_head(Kind.ANNOUNCE, meta, flags=sealer.flags(Kind.ANNOUNCE))
        injected.append(sealer.seq)
        return [frame, head + sealer.seal(Kind.ANNOUNCE, head, [])]

    proxy.trick = inject
    until(lambda: bool(injected), "nothing injected")
    refused_and_back(cluster, 1)
    assert not has_rank(cluster, 1, "fake", 7)


def test_a_replayed_announce_is_refused_and_the_rank_that_left_stays_gone(
    proxied: MakeProxied,
) -> None:
    """The attacker records rank 0's join and plays it again right after its leave."""
    cluster, proxy = proxied()
    captured: list[bytes] = []

    def replay(relay: Relay, towards: int, frame: bytes) -> list[bytes]:
        if not sealed_control_to_node1(relay, towards, frame) or kind_of(frame) != Kind.ANNOUNCE:
            return [frame]
        captured.append(frame)
        if len(captured) == 2:
            return [frame, captured[0]]  # the leave, then the join again
        return [frame]

    proxy.trick = replay
    join_and_leave(cluster, "j")
    refused_and_back(cluster, 1)
    assert len(captured) >= 2
    until(lambda: not has_rank(cluster, 1, "j", 0), "the rank that left is still listed")


def test_two_reordered_frames_are_refused_and_the_rank_that_left_stays_gone(
    proxied: MakeProxied,
) -> None:
    """The attacker holds rank 0's join back and sends it after the frame that followed it."""
    cluster, proxy = proxied()
    held: list[bytes] = []
    swapped: list[Kind] = []

    def reorder(relay: Relay, towards: int, frame: bytes) -> list[bytes]:
        if swapped or not sealed_control_to_node1(relay, towards, frame):
            return [frame]
        if not held:
            if kind_of(frame) != Kind.ANNOUNCE:
                return [frame]
            held.append(frame)  # the join: hold it
            return []
        swapped.append(kind_of(frame))
        return [frame, held[0]]

    proxy.trick = reorder
    join_and_leave(cluster, "j")
    refused_and_back(cluster, 1)
    assert held
    assert swapped
    until(lambda: not has_rank(cluster, 1, "j", 0), "the rank that left is still listed")


def test_a_flipped_mac_bit_is_refused(proxied: MakeProxied) -> None:
    cluster, proxy = proxied()
    flipped: list[Kind] = []

    def flip_mac(relay: Relay, towards: int, frame: bytes) -> list[bytes]:
        if flipped or not sealed_control_to_node1(relay, towards, frame):
            return [frame]
        flipped.append(kind_of(frame))
        tampered = bytearray(frame)
        tampered[-1] ^= 0x01  # the MAC's last bit; everything else intact
        return [bytes(tampered)]

    proxy.trick = flip_mac
    until(lambda: bool(flipped), "no frame flipped")
    refused_and_back(cluster, 1)


# -- DATA -----------------------------------------------------------------------------------
def flip_first_data_byte(flipped: list[int]) -> Callable[[Relay, int, bytes], list[bytes]]:
    """Flip one payload byte of the first DATA frame node 1 sends node 0."""

    def flip(relay: Relay, towards: int, frame: bytes) -> list[bytes]:
        if flipped or relay.channel != "data" or towards != 0 or kind_of(frame) != Kind.DATA:
            return [frame]
        at = HEADER_SIZE + HEADER.unpack_from(frame)[4] + 1000  # a payload byte
        assert at < len(frame) - TRAILER_SIZE
        tampered = bytearray(frame)
        tampered[at] ^= 0x01
        flipped.append(at)
        return [bytes(tampered)]

    return flip


def test_a_flipped_data_byte_fails_the_receive_with_data_integrity(proxied: MakeProxied) -> None:
    cluster, proxy = proxied(data_integrity="mac")
    flipped: list[int] = []
    proxy.trick = flip_first_data_byte(flipped)
    received, sent = move_one_message(cluster, sender=1)
    assert flipped
    assert received.startswith("failed: "), received  # never "ok" with other bytes
    assert sent.startswith("failed: "), sent  # the sender never hears DONE either
    refused_and_back(cluster, 0)


def test_without_data_integrity_the_flipped_byte_goes_through(proxied: MakeProxied) -> None:
    """The proxy's flip does reach the receiver: without data_integrity = "mac" (the default)
    the altered bytes are reported received (docs/operations.md, "Threat model")."""
    cluster, proxy = proxied(data_integrity="none")
    flipped: list[int] = []
    proxy.trick = flip_first_data_byte(flipped)
    assert move_one_message(cluster, sender=1) == ("ok, but wrong bytes", "ok")
    assert flipped
    assert counter(cluster, 0, "integrity_failures") == 0
