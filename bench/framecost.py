"""(d) The engines' cost of one rendezvous, with few and with many operations pending.

Two daemons' engines in this process, wired by hand: node 0 hosts rank 0, node 1 hosts rank 1,
and each has its :class:`~fabricd.engines.membership.Membership` and
:class:`~fabricd.engines.p2p.matching.Messaging` engine, as the daemon does.  One rendezvous is
what the
daemons' engines do for one 64-byte message from rank 0 to rank 1: node 1 posts the receive,
node 0 posts the send (RTS), node 1 takes the RTS (CTS), node 0 takes the CTS (stream), node 1
lands the one DATA chunk (DONE), node 0 takes the DONE -- and after every input the daemon's
question of when to wake next (``next_deadline``).  No sockets, no codec: this is the engines'
share of each frame, the part that could grow with the number of operations a daemon holds.

Each engine also holds N unrelated operations that wait, as a busy daemon's would: sends to
ranks that have not joined (each with a route deadline), receives on other tags from the peer
rank, receives from ranks that have not joined (with deadlines), and sends to the peer rank on
tags nobody receives -- announced, so the sender keeps them by message id and node, and the peer
keeps their RTS as messages waiting for a receive (the other engine's N includes those).  Every
index a frame could scan holds thousands of entries, then.  The figure is the time
per rendezvous with N = 10,000; the baseline is the same with N = 10, measured in the same run,
batches alternating.  The ratio is 1x when the cost of a frame does not depend on what waits:
matching by key, indexes by rank and node, and a deadline heap make every input O(1) amortised.

Run alone: ``python -m bench.framecost [--quick]``.
"""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Final, TypeVar

from bench.report import Column, Progress, Table, fmt_number, median, per_call, quiet, run_alone
from fabricd.engines.actions import Broadcast, Complete, SendFrame
from fabricd.engines.membership import Membership, RankJoined
from fabricd.engines.ownership import User
from fabricd.engines.p2p.matching import Messaging
from fabricd.engines.p2p.messages import Message, StreamData
from fabricd.frames.membership import Announce
from fabricd.frames.p2p import Cts, Data, Done, Rts

if TYPE_CHECKING:
    from collections.abc import Sequence

F = TypeVar("F", Rts, Cts, Done)

#: operations waiting on each engine: the baseline first
PENDING: Final = (10, 10_000)
PAYLOAD: Final = 64
TARGET_RATIO: Final = 2.0
JOB: Final = "bench"
#: far beyond any run: the waiting operations must wait, not time out
ROUTE_TIMEOUT: Final = 1e9


class Pair:
    """Two nodes' engines, ranks 0 and 1 joined on both, ``pending`` waiting operations on each."""

    def __init__(self, pending: int) -> None:
        self.members = [Membership(node) for node in (0, 1)]
        self.engines = [
            Messaging(node=node, routes=self.members[node], route_timeout=ROUTE_TIMEOUT)
            for node in (0, 1)
        ]
        self._ops = itertools.count(1)
        for node in (0, 1):
            self._join(node)
        for node, engine in enumerate(self.engines):
            for rts in self._wait(engine, rank=node, peer=1 - node, count=pending):
                if self.engines[1 - node].on_frame(node, rts, 0.0):
                    raise RuntimeError(f"an announced send did not wait for its receive: {rts}")
        self.payload = bytes(range(PAYLOAD))
        self.region = bytearray(PAYLOAD)
        self.send = Message(job=JOB, src=0, dst=1, tag=0, nbytes=PAYLOAD, dtype="uint8")

    def _join(self, node: int) -> None:
        """Rank ``node`` attaches to its daemon; the other daemon hears the ANNOUNCE."""
        for action in self.members[node].attach(JOB, node, 2, user=User(uid=0)):
            if isinstance(action, RankJoined):
                self.engines[node].on_rank_event(action, 0.0)
            elif isinstance(action, Broadcast) and isinstance(action.frame, Announce):
                for event in self.members[1 - node].on_announce(node, action.frame):
                    if isinstance(event, RankJoined):
                        self.engines[1 - node].on_rank_event(event, 0.0)

    def _wait(self, engine: Messaging, *, rank: int, peer: int, count: int) -> list[Rts]:
        """Post ``count`` operations that nothing will ever complete; return the RTS frames of
        those announced to the peer, for the peer's engine to hold."""
        region = memoryview(bytearray(1))
        announced: list[Rts] = []
        for i in range(count):
            op = next(self._ops)
            match i % 4:
                case 0:  # a send to a rank that has not joined: a route deadline
                    ghost = Message(job="ghost", src=rank, dst=i, tag=0, nbytes=1, dtype="uint8")
                    engine.post_send(op, ghost, 0.0)
                case 1:  # a receive from the peer rank on a tag nobody sends
                    other = Message(job=JOB, src=peer, dst=rank, tag=1 + i, nbytes=1, dtype="uint8")
                    engine.post_recv(op, other, region, 0.0)
                case 2:  # a receive from a rank that has not joined: a route deadline
                    ghost = Message(job="ghost", src=i, dst=rank, tag=0, nbytes=1, dtype="uint8")
                    engine.post_recv(op, ghost, region, 0.0)
                case _:  # a send to the peer rank on a tag nobody receives: announced
                    other = Message(job=JOB, src=rank, dst=peer, tag=1 + i, nbytes=1, dtype="uint8")
                    announced.append(_answer(engine.post_send(op, other, 0.0), Rts))
        if engine.pending() != count:
            raise RuntimeError(f"{engine.pending()} operations wait, not {count}")
        return announced

    def rendezvous(self) -> None:
        """One message from rank 0 to rank 1, every frame through both engines."""
        sender, receiver = self.engines
        recv_op, send_op = next(self._ops), next(self._ops)
        receiver.post_recv(recv_op, self.send, memoryview(self.region), 0.0)
        receiver.next_deadline()
        rts = _answer(sender.post_send(send_op, self.send, 0.0), Rts)
        sender.next_deadline()
        cts = _answer(receiver.on_frame(0, rts, 0.0), Cts)
        receiver.next_deadline()
        [stream] = sender.on_frame(1, cts, 0.0)
        sender.next_deadline()
        if not isinstance(stream, StreamData):
            raise RuntimeError(f"a CTS did not start the stream: {stream}")
        chunk = Data(msg=stream.msg, off=0)
        landing = receiver.payload_buffer(0, chunk, PAYLOAD)
        assert landing is not None, "an expected chunk always has a place to land"
        landing[:] = self.payload
        *landed, received = receiver.data_arrived(0, chunk, PAYLOAD, 0.0)
        receiver.next_deadline()
        done = _answer(landed, Done)
        [sent] = sender.on_frame(1, done, 0.0)
        sender.next_deadline()
        if received != Complete(op=recv_op) or sent != Complete(op=send_op):
            raise RuntimeError(f"the rendezvous failed: {received}, {sent}")

    def check(self) -> None:
        """One rendezvous delivers the payload and leaves the waiting operations as they were."""
        before = [engine.pending() for engine in self.engines]
        self.region[:] = bytes(PAYLOAD)
        self.rendezvous()
        if self.region != self.payload:
            raise RuntimeError("the payload did not land")
        if [engine.pending() for engine in self.engines] != before:
            raise RuntimeError("a rendezvous disturbed the waiting operations")


def _answer(actions: Sequence[object], kind: type[F]) -> F:
    """The one frame of type ``kind`` that an input must be answered with."""
    [action] = actions
    if not isinstance(action, SendFrame) or not isinstance(action.frame, kind):
        raise RuntimeError(f"expected one {kind.__name__} frame, got {actions}")
    return action.frame


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Time a rendezvous with each number of waiting operations in ``PENDING``."""
    samples, calls = (5, 300) if quick else (15, 3000)
    table = Table(
        name="framecost",
        title="(d) engines' cost of one rendezvous (RTS, CTS, DATA, DONE), microseconds",
        columns=[Column("pending", "pending ops", 0), Column("us", "us/rendezvous")],
        ratio=f"time with N pending / time with {PENDING[0]} pending (lower is better; 1x = flat)",
        target=f"ratio <= {TARGET_RATIO:g}x at {PENDING[-1]} pending",
        settings={"samples": samples, "calls": calls, "payload": PAYLOAD},
    )
    progress(f"posting {' and '.join(map(str, PENDING))} waiting operations per engine")
    pairs = [Pair(n) for n in PENDING]
    for pair in pairs:
        pair.check()
        per_call(pair.rendezvous, calls, 1)  # warm-up
    times: list[list[float]] = [[] for _ in pairs]
    for _ in range(samples):  # alternate, so every case sees the same background load
        for pair, taken in zip(pairs, times, strict=True):
            taken += per_call(pair.rendezvous, calls, 1)
    base = median(times[0])
    for n, taken in zip(PENDING, times, strict=True):
        took = median(taken)
        label = f"{n} pending"
        table.add(label, PAYLOAD, took / base, pending=n, us=took * 1e6)
        progress(f"{label}: {fmt_number(took * 1e6)} us per rendezvous, ratio {took / base:.2f}x")
    table.target_met = table.rows[-1].ratio <= TARGET_RATIO
    table.notes.append(
        f"waiting operations per engine: sends and receives for ranks that never join (with "
        f"route deadlines), receives on other tags, and sends announced on other tags (the peer "
        f"holds their RTS unmatched); {PAYLOAD} B payload in one DATA chunk"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("framecost", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
