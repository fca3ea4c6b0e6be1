"""Eager messages and receiver-initiated rendezvous between real daemons (issue 8, items 2-3).

MPI's non-overtaking rule must hold for every mix of the three ways a message travels: whole in
one EAGER frame (into its posted receive, or into the receiver's pool until it is posted), with
an RTS when the sender is out of credit or the message is large, and streamed at once when the
receive was posted first and sent an RTR.  Four ranks on two daemons send each other 10^4
numbered messages and check that each (source, tag) stream arrives whole, once and in order.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Final

import numpy as np

import fabricd

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.process import BaseProcess

    from fabricd.client.handle import Handle
    from fabricd.daemon.launcher import LocalCluster

NODES: Final = 2
SIZE: Final = 4  #: rank r lives on node r % 2: two ranks per daemon
TAGS: Final = 4
#: messages per (source, destination, tag) stream: 12 ordered pairs x 4 tags x 209 >= 10^4
PER_STREAM: Final = 209
EAGER_LIMIT: Final = 64 * 1024  #: the default, set here so the sizes below straddle it
#: small: RTS fallback once the unmatched messages use it up (its pool, on the other side)
EAGER_CREDIT: Final = 256 * 1024
BARRIER_TAG: Final = TAGS  #: a tag no stream uses
WAIT: Final = 60.0  #: hang guard for any one operation
HEADER: Final = 16  #: bytes that carry (sequence, stream) in every message


def size_of(src: int, dst: int, tag: int, seq: int) -> int:
    """The byte size of message ``seq`` of a stream: mostly below the eager limit, each 50th
    above it (the first too, so a receive posted first sends an RTR for it)."""
    if seq % 50 == 0:
        return EAGER_LIMIT + 1 + 997 * (src + dst + tag)
    return HEADER + random.Random(hash((src, dst, tag, seq))).randrange(0, 4096)


def fill(view: np.ndarray[Any, Any], src: int, dst: int, tag: int, seq: int) -> None:
    """Write message ``seq`` of stream (src, dst, tag) into ``view`` (uint8)."""
    view[:8] = np.frombuffer(seq.to_bytes(8, "little"), np.uint8)
    view[8:HEADER] = np.frombuffer(
        ((src * SIZE + dst) * TAGS + tag).to_bytes(8, "little"), np.uint8
    )
    view[HEADER:] = (np.arange(HEADER, len(view)) + seq * 7 + src) % 251


def check(view: np.ndarray[Any, Any], src: int, dst: int, tag: int, seq: int) -> None:
    """Raise unless ``view`` holds message ``seq`` of the stream (src, dst, tag)."""
    got = int.from_bytes(view[:8].tobytes(), "little")
    stream = int.from_bytes(view[8:HEADER].tobytes(), "little")
    if (got, stream) != (seq, (src * SIZE + dst) * TAGS + tag):
        raise AssertionError(f"rank {dst} tag {tag}: from {src} wanted #{seq}, got #{got}")
    expected = (np.arange(HEADER, len(view)) + seq * 7 + src) % 251
    if not np.array_equal(view[HEADER:], expected.astype(np.uint8)):
        raise AssertionError(f"rank {dst} tag {tag}: message #{seq} from {src} is corrupt")


def _streams(rank: int) -> list[tuple[int, int]]:
    """(peer, tag) of every stream into or out of ``rank``."""
    return [(peer, tag) for peer in range(SIZE) if peer != rank for tag in range(TAGS)]


def _wait_all(handles: list[Handle[Any]]) -> None:
    for handle in handles:
        handle.wait(timeout=WAIT)


def numbered_rank(socket_path: str, job: str, rank: int) -> None:
    """One rank: post the first half of every incoming stream's receives, meet every rank at a
    barrier (so those receives are posted everywhere before anything is sent), send every
    outgoing stream in an interleaving of its own, post the second half of the receives, then
    check each receive holds the next message of its stream.  Raises on any wrong message."""
    streams = _streams(rank)
    sizes_in = {(p, t): [size_of(p, rank, t, s) for s in range(PER_STREAM)] for p, t in streams}
    sizes_out = {(p, t): [size_of(rank, p, t, s) for s in range(PER_STREAM)] for p, t in streams}
    with fabricd.connect(job=job, rank=rank, size=SIZE, socket_path=socket_path) as fab:
        inbox = fab.array("in", (sum(map(sum, sizes_in.values())),), "uint8")
        outbox = fab.array("out", (sum(map(sum, sizes_out.values())),), "uint8")
        token = fab.array("token", (1,), "uint8")
        views_in, views_out = _carve(inbox, sizes_in), _carve(outbox, sizes_out)
        early = [
            (key, seq, fab.recv_async(views_in[key][seq], src=key[0], tag=key[1]))
            for key in streams
            for seq in range(PER_STREAM // 2)
        ]
        barrier = [fab.send_async(token, to=p, tag=BARRIER_TAG) for p in range(SIZE) if p != rank]
        barrier += [fab.recv_async(token, src=p, tag=BARRIER_TAG) for p in range(SIZE) if p != rank]
        _wait_all(barrier)
        order = [key for key in streams for _ in range(PER_STREAM)]
        random.Random(rank).shuffle(order)  # any interleaving of streams, each in its order
        sent: list[Handle[Any]] = []
        next_seq = dict.fromkeys(streams, 0)
        for key in order:
            seq = next_seq[key]
            next_seq[key] += 1
            view = views_out[key][seq]
            fill(view, rank, key[0], key[1], seq)
            sent.append(fab.send_async(view, to=key[0], tag=key[1]))
        late = [
            (key, seq, fab.recv_async(views_in[key][seq], src=key[0], tag=key[1]))
            for key in streams
            for seq in range(PER_STREAM // 2, PER_STREAM)
        ]
        for (peer, tag), seq, handle in early + late:
            done = handle.wait(timeout=WAIT)
            if (done.peer, done.tag, done.nbytes) != (peer, tag, sizes_in[peer, tag][seq]):
                raise AssertionError(f"rank {rank}: completion {done} for #{seq} is wrong")
            check(views_in[peer, tag][seq], peer, rank, tag, seq)
        _wait_all(sent)


def _carve(
    buffer: np.ndarray[Any, Any], sizes: dict[tuple[int, int], list[int]]
) -> dict[tuple[int, int], list[np.ndarray[Any, Any]]]:
    """One contiguous slice of ``buffer`` per message, in stream order."""
    views: dict[tuple[int, int], list[np.ndarray[Any, Any]]] = {}
    at = 0
    for key, lengths in sizes.items():
        views[key] = []
        for length in lengths:
            views[key].append(buffer[at : at + length])
            at += length
    return views


def test_ten_thousand_numbered_messages_arrive_once_and_in_order_per_source_and_tag(
    make_cluster: Callable[..., LocalCluster], spawn: Callable[..., BaseProcess]
) -> None:
    assert SIZE * (SIZE - 1) * TAGS * PER_STREAM >= 10_000
    cluster = make_cluster(NODES, eager_limit=EAGER_LIMIT, eager_credit=EAGER_CREDIT)
    ranks = [
        spawn(numbered_rank, cluster.nodes[r % NODES].socket_path, "numbered", r)
        for r in range(SIZE)
    ]
    for r, process in enumerate(ranks):
        process.join(WAIT * 2)
        assert process.exitcode == 0, f"rank {r} failed:\n" + cluster.nodes[r % NODES].log_tail()
    counters: dict[str, int] = {}
    for node in cluster.nodes:
        with fabricd.connect(socket_path=node.socket_path) as control:
            status = control.status()
        # nothing left over: a duplicate would wait here as an unexpected message
        assert status["pending_ops"] == 0
        assert status["unexpected_messages"] == 0
        assert status["eager_pool_bytes"] == 0
        for name, value in status["counters"].items():
            counters[name] = counters.get(name, 0) + value
    # every way a message travels was taken: eager, RTS for want of credit, answered RTRs
    assert counters["eager_sent"] > 0
    assert counters["eager_no_credit"] > 0
    assert counters["rtr_sent"] > 0
    assert counters["rtr_answered"] > 0
    assert counters["ops_failed"] == 0
