"""What an authenticated (or would-be) peer can make a running daemon hold, and RELIABILITY Z5:
malformed sessions against a live daemon's peer port.

Three real daemons on loopback.  Node 0 is killed and the test plays it: it knows the shared
secret, so its links pass the handshake and reach everything behind it.  Node 2 is the target;
node 1 is its real peer, which must stay up throughout.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from fabricd.wire import HEADER_SIZE, MAGIC, PROTOCOL_VERSION, Kind, encode, encode_head

from .peer_client import (
    PeerSession,
    SealedLink,
    authenticate,
    closed_by_peer,
    connect,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from socket import socket

    from fabricd.daemon.launcher import LocalCluster

MiB = 1 << 20
TARGET = 2
#: Z5 asks for 10^4 sessions; FABRICD_FUZZ_SESSIONS sets another count
SESSIONS = int(os.environ.get("FABRICD_FUZZ_SESSIONS", "10000"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _status(cluster: LocalCluster, node: int) -> dict:
    with fabricd.connect(socket_path=cluster.nodes[node].socket_path) as control:
        return control.status()


def _peer(status: dict, node: int) -> dict:
    return next(p for p in status["peers"] if p["node"] == node)


def _pretend_node_zero(make_cluster: Callable[..., LocalCluster], **settings: object) -> tuple:
    cluster = make_cluster(3, **settings)
    cluster.kill(0)
    cluster.nodes[0].process.wait(30)
    assert cluster.directory is not None
    secret = cluster.secret
    real = _peer(_status(cluster, TARGET), 1)
    return cluster, secret, real


def _session(cluster: LocalCluster, secret: bytes, incarnation: int | None = None) -> PeerSession:
    """A session of pretend node 0; a new incarnation unless ``incarnation`` is given."""
    return PeerSession(
        cluster.nodes[TARGET].address,
        secret=secret,
        node=0,
        dialled=TARGET,
        fabric_size=3,
        incarnation=incarnation,
    )


def _real_peer_untouched(cluster: LocalCluster, before: dict) -> None:
    """Node 2's link to node 1 never dropped, and a message still crosses it."""
    after = _peer(_status(cluster, TARGET), 1)
    assert after["state"] == "up"
    assert after["incarnation"] == before["incarnation"]
    assert _peer(_status(cluster, 1), TARGET)["state"] == "up"
    with (
        fabricd.connect(job="after", rank=0, size=2, socket_path=cluster.nodes[1].socket_path) as a,
        fabricd.connect(
            job="after", rank=1, size=2, socket_path=cluster.nodes[TARGET].socket_path
        ) as b,
    ):
        x, y = a.array("x", (64,), "float64"), b.array("y", (64,), "float64")
        x[:] = np.arange(64)
        pending = a.send_async(x, to=1)
        b.recv(y, src=0, timeout=20)
        pending.wait(timeout=20)
        assert (y == np.arange(64)).all()


# -- stray payloads ----------------------------------------------------------------------------
def _closed_saying(
    cluster: LocalCluster,
    peer: PeerSession,
    send: Callable[[], object],
    why: str,
    what: str = "the target",
) -> None:
    """``send`` makes the target close both of ``peer``'s links, logging ``why``."""
    said = _log_says(cluster, why)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        send()
    guard = time.monotonic() + 20  # a hang guard
    while _log_says(cluster, why) == said:
        assert time.monotonic() < guard, f"{what}: the log never said {why!r}"
        time.sleep(0.02)
    for sock in (peer.control.sock, peer.data.sock):  # the reset takes both links
        sock.settimeout(20)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(65536):  # (heartbeats sent before the reset)
                pass
    peer.close()


def test_data_nobody_asked_for_closes_the_link_before_its_payload_is_read(make_cluster):
    cluster, secret, real = _pretend_node_zero(make_cluster)
    pid = cluster.nodes[TARGET].pid
    before = _rss(pid)
    for msg in range(1, 5):
        peer = _session(cluster, secret)
        data = peer.data
        try:
            data.sock.sendall(data.head(Kind.DATA, {"msg": msg, "off": 0}, 64 * MiB))  # unasked
            for _ in range(64):
                data.sock.sendall(bytes(MiB))
            data.sock.sendall(data.trailer(Kind.DATA))
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed at the head: the payload was never read
        assert closed_by_peer(data.sock)
        assert closed_by_peer(peer.control.sock)  # the reset takes both links
        peer.close()
    assert _rss(pid) - before < 16 * MiB  # no 64 MiB buffer was allocated for any of them
    log = cluster.nodes[TARGET].log_path.read_text(errors="replace")
    assert "which this node never asked node 0 for" in log
    _real_peer_untouched(cluster, real)


def _recv_fails(socket_path: str, nbytes: int) -> str:
    with fabricd.connect(job="cancelled", rank=1, size=2, socket_path=socket_path) as fab:
        array = fab.array("y", (nbytes,), "uint8")
        try:
            fab.recv(array, src=0, timeout=30)
        except fabricd.FabricError as exc:
            return str(getattr(exc, "code", type(exc).__name__))
        return "received"


def test_late_data_of_a_cancelled_message_is_read_into_scratch_and_dropped(
    make_cluster, spawn, queue
):
    cluster, secret, real = _pretend_node_zero(make_cluster)
    pid = cluster.nodes[TARGET].pid
    peer = _session(cluster, secret)
    owner = os.getuid()
    peer.send(
        Kind.ANNOUNCE, {"job": "cancelled", "rank": 0, "size": 2, "present": True, "owner": owner}
    )
    nbytes = 64 * MiB
    receiver = spawn(_recv_in_child, cluster.nodes[TARGET].socket_path, nbytes, queue)
    status = _status(cluster, TARGET)
    while not [r for r in status["ranks"] if r["job"] == "cancelled" and r["rank"] == 1]:
        assert receiver.is_alive()
        status = _status(cluster, TARGET)
    rts = {"msg": 7, "job": "cancelled", "src": 0, "dst": 1, "tag": 0, "nbytes": nbytes}
    peer.send(Kind.RTS, {**rts, "dtype": "uint8"})
    msg = peer.receive(Kind.CTS).meta["msg"]  # once the receive is posted
    assert msg == 7
    before = _rss(pid)
    peer.send(Kind.CANCEL, {"msg": msg})
    peer.send(Kind.DATA, {"msg": msg, "off": 0}, bytes(nbytes), data=True)  # sent before it knew
    assert queue.get(timeout=30) == "peer_failed"
    receiver.join(30)
    guard = time.monotonic() + 30  # a hang guard
    while _peer(_status(cluster, TARGET), 0)["bytes_received"] < nbytes:  # all of it was read
        assert time.monotonic() < guard, "the DATA sent after the CANCEL was never read"
        time.sleep(0.05)
    row = _peer(_status(cluster, TARGET), 0)
    assert (row["state"], row["links"]) == ("up", {"control": True, "data": True})  # no reset
    assert _rss(pid) - before < 16 * MiB  # read through the read buffer, not a 64 MiB one
    peer.close()
    _real_peer_untouched(cluster, real)


def _recv_in_child(socket_path: str, nbytes: int, queue) -> None:
    queue.put(_recv_fails(socket_path, nbytes))


# -- announcements ------------------------------------------------------------------------------
def test_an_announce_flood_resets_the_peer_at_max_ranks_per_peer(make_cluster):
    cluster, secret, real = _pretend_node_zero(make_cluster, max_clients=16, max_ranks_per_peer=100)
    peer = _session(cluster, secret)
    sent = 0
    try:
        for rank in range(20_000):
            meta = {"job": "flood", "rank": rank, "size": 2**31 - 1, "present": True, "owner": 0}
            peer.send(Kind.ANNOUNCE, meta)
            sent += 1
    except (BrokenPipeError, ConnectionResetError):
        pass  # reset at the bound: the rest never arrived
    assert closed_by_peer(peer.control.sock)
    peer.close()
    status = _status(cluster, TARGET)
    assert status["counters"]["refused_announcements"] == 1
    assert not [r for r in status["ranks"] if r["node"] == 0]  # forgotten with the reset
    log = cluster.nodes[TARGET].log_path.read_text(errors="replace")
    assert "announced more than max_ranks_per_peer (100)" in log
    _real_peer_untouched(cluster, real)


# -- RELIABILITY Z1 and Z4 for EAGER and RTR --------------------------------------------------
_ABOUT = {"job": "j", "src": 0, "dst": 1, "tag": 0, "dtype": "uint8"}  #: what a message is
_EAGER = {"msg": 1, **_ABOUT, "nbytes": 8}
_RTR = {"rtr": 1, **_ABOUT, "nbytes": 1 << 20}


def _sealed_head(link: SealedLink, kind: Kind, meta: dict[str, object], payload_len: int) -> bytes:
    """A sealed frame's head that declares ``payload_len`` bytes, past what encode_head allows
    to be written (the daemon must refuse it at the header, before reading any of it)."""
    head = bytearray(link.head(kind, meta, 0))
    head[12:HEADER_SIZE] = payload_len.to_bytes(8, "big")
    return bytes(head)


#: (what it is, the link it goes on, its bytes, what the daemon's log must say of it)
_MALFORMED: list[tuple[str, str, Callable[[SealedLink], bytes], str]] = [
    (
        "EAGER without nbytes",
        "control",
        lambda link: link.frame(Kind.EAGER, {k: v for k, v in _EAGER.items() if k != "nbytes"}),
        "field 'nbytes' must be an integer",
    ),
    (
        "EAGER with a job that is no string",
        "control",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "job": 5}, bytes(8)),
        "field 'job' must be a non-empty string",
    ),
    (
        "EAGER with a tag that is no int",
        "control",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "tag": "t"}, bytes(8)),
        "field 'tag' must be an integer",
    ),
    (
        "EAGER of negative nbytes",
        "control",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "nbytes": -8}, bytes(8)),
        "field 'nbytes' must be an integer",
    ),
    (
        "EAGER of 2**64 - 1 bytes",
        "control",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "nbytes": 2**64 - 1}, bytes(8)),
        "field 'nbytes' must be an integer",
    ),
    (
        "EAGER of 2**63 - 1 bytes carrying 8",
        "control",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "nbytes": 2**63 - 1}, bytes(8)),
        f"says {2**63 - 1} B and carries 8",
    ),
    (
        "EAGER declaring 4 GiB",
        "control",
        lambda link: _sealed_head(link, Kind.EAGER, {**_EAGER, "nbytes": 4 << 30}, 4 << 30),
        f"payload of {4 << 30} B exceeds",
    ),
    (
        "EAGER on the data link",
        "data",
        lambda link: link.frame(Kind.EAGER, _EAGER, bytes(8)),
        "EAGER payload on a link of node 0 that does not carry it",
    ),
    (
        "EAGER of no bytes on the data link",
        "data",
        lambda link: link.frame(Kind.EAGER, {**_EAGER, "nbytes": 0}),
        "EAGER on the wrong channel from node 0",
    ),
    (
        "RTR numbered 0",
        "control",
        lambda link: link.frame(Kind.RTR, {**_RTR, "rtr": 0}),
        "RTR numbered 0",
    ),
    (
        "RTR without a job",
        "control",
        lambda link: link.frame(Kind.RTR, {"rtr": 1, "nbytes": 1}),
        "field 'job' must be a non-empty string",
    ),
    (
        "RTR numbered by a string",
        "control",
        lambda link: link.frame(Kind.RTR, {**_RTR, "rtr": "x"}),
        "field 'rtr' must be an integer",
    ),
    (
        "RTR of negative nbytes",
        "control",
        lambda link: link.frame(Kind.RTR, {**_RTR, "nbytes": -1}),
        "field 'nbytes' must be an integer",
    ),
    (
        "RTR of 2**64 - 1 bytes",
        "control",
        lambda link: link.frame(Kind.RTR, {**_RTR, "nbytes": 2**64 - 1}),
        "field 'nbytes' must be an integer",
    ),
    (
        "RTR with a payload",
        "control",
        lambda link: link.frame(Kind.RTR, _RTR, b"p"),
        "RTR payload on a link of node 0 that does not carry it",
    ),
    (
        "RTR on the data link",
        "data",
        lambda link: link.frame(Kind.RTR, _RTR),
        "RTR on the wrong channel from node 0",
    ),
    (
        "DATA answering an RTR never sent",
        "data",
        lambda link: link.frame(Kind.DATA, {"msg": 1, "off": 0, "rtr": 99}, bytes(8)),
        "which this node never asked node 0 for",
    ),
    (
        "DATA with an rtr that is no int",
        "data",
        lambda link: link.frame(Kind.DATA, {"msg": 1, "off": 0, "rtr": "x"}, bytes(8)),
        "field 'rtr' must be an integer",
    ),
]


def _log_says(cluster: LocalCluster, text: str) -> int:
    """How many times the target's log has said ``text`` so far."""
    return cluster.nodes[TARGET].log_path.read_text(errors="replace").count(text)


def test_malformed_eager_and_rtr_frames_close_only_that_peers_links_and_say_why(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # slow liveness: only the links a frame breaks take the pretend node down
    cluster, secret, real = _pretend_node_zero(make_cluster, suspect_after=30.0, down_after=60.0)
    pid = cluster.nodes[TARGET].pid
    before = _rss(pid)
    for what, channel, make, reason in _MALFORMED:
        peer = _session(cluster, secret)
        link = peer.data if channel == "data" else peer.control
        # past a burst, the line comes as a summary
        _closed_saying(cluster, peer, partial(link.sock.sendall, make(link)), reason, what)
    assert cluster.nodes[TARGET].process.poll() is None
    assert _rss(pid) - before < 16 * MiB  # nothing declared was allocated
    _real_peer_untouched(cluster, real)


# -- RELIABILITY Z5 -----------------------------------------------------------------------------
def _junk(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(1, 600))


def _bad_header(rng: random.Random) -> bytes:
    kind = rng.choice([Kind.HELLO, Kind.DATA, Kind.ANNOUNCE, 0, 99, Kind.REQUEST])
    version = rng.choice([PROTOCOL_VERSION, 0, 2, 255])
    flags = rng.choice([0, 1, 0x8000])
    meta_len = rng.choice([0, 3, 600, 70_000, 2**32 - 1])
    payload_len = rng.choice([0, 1, 64 * MiB + 1, 2**63])
    head = MAGIC + bytes([version, int(kind)]) + flags.to_bytes(2, "big")
    head += meta_len.to_bytes(4, "big") + payload_len.to_bytes(8, "big")
    return head + rng.randbytes(rng.randint(0, 64))


def _truncated(rng: random.Random) -> bytes:
    frame = encode(Kind.HELLO, {"v": 1, "node": 0, "inc": 1, "nonce": rng.randbytes(32)})
    return frame[: rng.randint(1, len(frame) - 1)]


def _bad_hello(rng: random.Random) -> bytes:
    meta = rng.choice(
        [
            {"v": 1, "node": 0, "inc": 1, "nonce": b"short", "channel": "control"},
            {"v": 1, "node": 7, "inc": 1, "nonce": rng.randbytes(32), "channel": "control"},
            {"v": 1, "node": "x", "inc": -1, "nonce": 5, "channel": 3},
            {"v": 2},
            {},
        ]
    )
    return encode(Kind.HELLO, meta) + encode(Kind.AUTH, {"mac": rng.randbytes(32)})


def _bad_auth_frames(rng: random.Random, link: SealedLink) -> bytes:
    """What an authenticated peer could send that breaks the rules: mostly sealed (so it gets
    past the integrity check to the parsers behind it), sometimes raw."""
    big = 64 * MiB
    sealed = [
        lambda: link.frame(Kind.HELLO, {"v": 1}),  # a handshake frame after the handshake
        lambda: link.frame(Kind.DATA, {"msg": 1, "off": 0}, b"x"),  # DATA on the control link
        lambda: link.frame(Kind.ANNOUNCE, {"job": 5, "rank": "r"}),
        lambda: link.frame(Kind.ANNOUNCE, {"job": "j", "rank": -1, "size": 0, "present": True}),
        lambda: link.frame(Kind.RTS, {"msg": -5, "job": "", "nbytes": "many"}),
        lambda: link.frame(Kind.CTS, {"msg": "x"}),
        lambda: link.frame(Kind.DONE, {}),
        lambda: link.frame(Kind.CANCEL, {"msg": 2**64 - 1}),
        lambda: link.frame(Kind.RTS, {"msg": 1}, b"p"),  # a payload on a control kind
        lambda: link.head(Kind.DATA, {"msg": 1, "off": 0}, big),  # 64 MiB declared
        lambda: link.frame(Kind.EAGER, {"msg": 1, "job": "j", "nbytes": -1}, b"e"),
        lambda: link.frame(Kind.EAGER, {**_EAGER, "nbytes": 2**63 - 1}, b"e"),  # not its size
        lambda: link.head(Kind.EAGER, _EAGER, big),  # 64 MiB declared for 8
        lambda: link.frame(Kind.RTR, {**_RTR, "rtr": 0}),
        lambda: link.frame(Kind.RTR, {"rtr": True, "job": b"j"}),
        lambda: link.frame(Kind.RTR, _RTR, b"p"),  # a payload on an RTR
        lambda: link.frame(Kind.DATA, {"msg": 1, "off": 0, "rtr": 99}, b"d"),  # control link
    ]
    raw = [
        lambda: encode(Kind.HEARTBEAT, {}),  # unsealed
        lambda: encode_head(Kind.ANNOUNCE, {}, 0)[:HEADER_SIZE] + b"\xc1",
        lambda: _bad_header(rng),
        lambda: _junk(rng),
        lambda: encode(Kind.REQUEST, {"id": 1, "op": "status"}),  # a client frame
    ]
    parts = []
    for _ in range(rng.randint(1, 3)):
        parts.append(rng.choice(sealed if rng.random() < 0.75 else raw)())
    return b"".join(parts)


#: what each session does, and how often (a truncated frame waits out handshake_timeout)
_KINDS = ["junk"] * 4 + ["header"] * 4 + ["hello"] * 4 + ["authenticated"] * 6 + ["truncated"]
_KINDS += ["stranger"]  # from a loopback address that is no node's: refused on arrival
WORKERS = 4  #: sessions at once: node 0's host has 1 + 2 spare slots on node 2, node 1's one


def _one_session(cluster: LocalCluster, secret: bytes, rng: random.Random) -> str:
    """One malformed session; returns its kind.  The daemon must close it."""
    address = cluster.nodes[TARGET].address
    kind = rng.choice(_KINDS)
    sock: socket
    if kind == "authenticated":
        try:
            link = authenticate(address, secret=secret, node=0, dialled=TARGET, fabric_size=3)
        except ConnectionError:  # a concurrent session's link, a newer incarnation, won
            return kind
        sock, payload = link.sock, _bad_auth_frames(rng, link)
    elif kind == "stranger":
        sock = connect(address, f"127.0.{rng.randint(1, 255)}.{rng.randint(2, 254)}")
        payload = _junk(rng)
    else:
        sock = connect(address)
        makers = {"junk": _junk, "header": _bad_header, "truncated": _truncated}
        payload = makers.get(kind, _bad_hello)(rng)
    with sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(payload)
        assert closed_by_peer(sock), f"a {kind} session was left open: {payload[:64]!r}"
    return kind


def _sessions(cluster: LocalCluster, secret: bytes, seed: int, count: int) -> dict[str, int]:
    rng = random.Random(seed)
    kinds: dict[str, int] = {}
    for _ in range(count):
        kind = _one_session(cluster, secret, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@pytest.mark.timeout(900)
def test_z5_malformed_sessions_against_a_live_daemon(make_cluster):
    cluster, secret, real = _pretend_node_zero(make_cluster, handshake_timeout=0.2)
    seed = int(os.environ.get("FABRICD_FUZZ_SEED", random.randrange(2**32)))
    pid = cluster.nodes[TARGET].pid
    share = SESSIONS // WORKERS
    warm = _sessions(cluster, secret, seed, share // 10)  # allocator pools warm up
    before = _rss(pid)
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = [
            pool.submit(_sessions, cluster, secret, seed + 1 + w, share) for w in range(WORKERS)
        ]
        kinds = [run.result() for run in runs]  # an assertion in a session fails the test here
    ran = sum(sum(k.values()) for k in [warm, *kinds])
    assert cluster.nodes[TARGET].process.poll() is None, f"seed {seed}: the daemon died"
    assert _rss(pid) - before < 32 * MiB, f"seed {seed}: memory grew with the sessions"
    status = _status(cluster, TARGET)
    assert status["counters"]["log_lines_left_out"] > 0  # the sessions' lines were summarised
    assert ran >= SESSIONS
    _real_peer_untouched(cluster, real)
