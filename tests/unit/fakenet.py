"""A fake network of point-to-point engines, one pair per node, that plays every daemon's part.

:class:`FakeNet` holds N real :class:`~fabricd.engines.p2p.matching.Messaging` engines, each
reading its
own :class:`~fabricd.engines.membership.Membership`, and performs their actions the way the
daemon does, minus the I/O:

* ``SendFrame``/``Broadcast`` become control frames, encoded and decoded with the real wire codec
  and parsed with :func:`fabricd.frames.registry.parse`, queued per (sender, receiver) pair.
  Each pair is
  FIFO, like the control link it stands for; :meth:`deliver_one` picks which pair goes next, so
  frames between *different* pairs can be reordered (``rng``), held back (:meth:`hold`) or
  dropped (``drop``).  ANNOUNCE goes to membership, the rest to messaging.
* ``RankJoined``/``RankLeft`` from membership go to the node's messaging engine, as the service
  host's ``rank_event`` does.
* ``SendEager`` becomes an EAGER frame on the control pair, its payload a copy of the send's
  bytes; its receiver lands it through ``payload_buffer`` and ``data_arrived`` when it is
  delivered (a zero-byte one through ``data_arrived`` alone, as the daemon does).  ``Place``
  copies a pooled payload into its receive.
* ``StreamData`` cuts the send's bytes into DATA chunks of ``chunk_size`` and lands them through
  the receiver's engine (``payload_buffer``, then ``data_arrived``), the way the data channel
  does, at once -- unless ``auto_stream`` is off, in which case it waits for
  :meth:`finish_stream`/:meth:`fail_stream`.  Where bytes land is the engine's landing table;
  the fake keeps no table of its own.
* ``data_channel`` on: ``StreamData`` instead puts every DATA chunk of the stream (the daemon
  writes them all at once) on a FIFO per (sender, receiver) of its own, the data link, which
  :meth:`deliver_one` serves independently of the control pair: with ``rng`` a DATA that answers
  an RTR may land before or after its RTS, and a CANCEL may overtake DATA sent before it.
  :meth:`cut_stream` fails a stream whose chunks are still on the data link.
* ``CopyLocal`` copies segment to segment and reports ``copied`` (or waits, with ``auto_copy``
  off, for :meth:`finish_copy`).
* ``Complete`` is recorded per (node, op); a second completion of one op is kept too, so tests
  can assert "exactly once".

Crashes: :meth:`crash` stops a node; frames to it vanish, frames it already sent stay in flight
until a survivor notices (:meth:`detect`), which fences the dead node's frames and calls
``peer_down`` on both engines, as the daemon's link reset does.

Time is ``now``, moved only by :meth:`advance` and :meth:`run_timers`.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.actions import Broadcast, Complete, Failure, Notice, SendFrame
from fabricd.engines.membership import Membership, RankJoined, RankLeft
from fabricd.engines.ownership import User
from fabricd.engines.p2p.matching import Messaging
from fabricd.engines.p2p.messages import (
    FRAME_KINDS,
    CopyLocal,
    Message,
    Place,
    SendEager,
    StreamData,
)
from fabricd.errors import ErrorCode, RemoteProtocolError
from fabricd.frames.membership import Announce
from fabricd.frames.p2p import Cancel, Cts, Data, Done, Eager, Rtr, Rts
from fabricd.frames.registry import PeerFrame, parse
from fabricd.wire import DEFAULT_LIMITS, Decoder, Frame, Kind, Meta, encode

if TYPE_CHECKING:
    import random
    from collections.abc import Callable, Iterable

    from fabricd.engines import membership
    from fabricd.engines.p2p import messages as p2p

    Action = p2p.Action | membership.Action

JOB = "job"
#: the user every rank of the fake network runs as (ownership has its own tests)
USER: Final = User(uid=1000)


def transmit(kind: Kind, meta: Meta) -> Meta:
    """Metadata as the peer decodes it (msgpack turns tuples into lists, and so on)."""
    decoder = Decoder(DEFAULT_LIMITS)
    decoder.feed(encode(kind, meta))
    decoder.next_event()
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    return frame.meta


@dataclass(slots=True)
class Posted:
    """One operation a test posted, with what it needs for checking."""

    node: int
    op: int
    send: bool
    msg: Message
    region: np.ndarray[Any, np.dtype[np.uint8]]


@dataclass
class FakeNet:
    nodes: int
    route_timeout: float = 5.0
    stall_after: float | None = None  #: report operations pending this long (None: never)
    #: the engines' max_unmatched_rts_per_peer (None: no bound)
    max_unmatched_rts_per_peer: int | None = None
    rng: random.Random | None = None  #: pick the next pair at random (reorders across pairs)
    auto_stream: bool = True
    auto_copy: bool = True
    chunk_size: int = 8  #: DATA chunk size: most test messages take several chunks
    eager_limit: int = 0  #: the engines' eager_limit (0: every message has a rendezvous)
    eager_credit: int = 0  #: the engines' eager_credit (credit and pool per peer, bytes)
    receiver_initiated: bool = True  #: the engines send RTRs for receives posted first
    #: DATA travels data links of its own (see the module docstring) instead of landing at once
    data_channel: bool = False
    #: return True to lose a frame (sender, receiver, frame): for deliberate fault tests
    drop: Callable[[int, int, PeerFrame], bool] | None = None
    now: float = 0.0

    members: list[Membership] = field(init=False)
    engines: list[Messaging] = field(init=False)
    #: control frames in flight per (sender, receiver): kind, metadata, payload (EAGER's)
    links: dict[tuple[int, int], collections.deque[tuple[Kind, Meta, bytes]]] = field(init=False)
    #: with ``data_channel``: DATA chunks in flight per (sender, receiver): msg, off, bytes, rtr
    data_links: dict[tuple[int, int], collections.deque[tuple[int, int, bytes, int]]] = field(
        init=False
    )
    held: set[tuple[int, int]] = field(default_factory=set)
    crashed: set[int] = field(default_factory=set)
    fenced: set[tuple[int, int]] = field(default_factory=set)  #: (survivor, dead node)
    ops: dict[tuple[int, int], Posted] = field(default_factory=dict)
    streams: list[tuple[int, StreamData]] = field(default_factory=list)
    #: bytes of each stream (sender, msg) already landed, for streams delivered a chunk at a time
    streamed: dict[tuple[int, int], int] = field(default_factory=dict)
    #: DATA chunks a failed stream had already put on its data link (sender, receiver, msg,
    #: off, bytes, rtr): they still arrive, possibly after the CANCEL on the control link
    late: list[tuple[int, int, int, int, bytes, int]] = field(default_factory=list)
    #: per (sender, receiver), the DATA chunk being read into its buffer right now: its frame,
    #: bytes, buffer, and the receive it fills; see :meth:`begin_chunk`
    filling: dict[tuple[int, int], tuple[Data, bytes, memoryview | None, int | None]] = field(
        default_factory=dict
    )
    copies: list[tuple[int, CopyLocal]] = field(default_factory=list)
    completed: dict[tuple[int, int], list[Failure | None]] = field(default_factory=dict)
    actions: list[tuple[int, Action]] = field(default_factory=list)
    frames: list[tuple[int, int, PeerFrame]] = field(default_factory=list)  #: delivered
    notices: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = [Membership(n) for n in range(self.nodes)]
        self.engines = [
            Messaging(
                node=n,
                routes=self.members[n],
                route_timeout=self.route_timeout,
                stall_after=self.stall_after,
                max_unmatched_rts_per_peer=self.max_unmatched_rts_per_peer,
                eager_limit=self.eager_limit,
                eager_credit=self.eager_credit,
                receiver_initiated=self.receiver_initiated,
            )
            for n in range(self.nodes)
        ]
        pairs = [(a, b) for a, b in itertools.product(range(self.nodes), repeat=2) if a != b]
        self.links = {pair: collections.deque() for pair in pairs}
        self.data_links = {pair: collections.deque() for pair in pairs}
        self._ids = itertools.count(1)

    # -- what clients do ----------------------------------------------------------------------
    def attach(self, node: int, rank: int, size: int = 4, job: str = JOB) -> None:
        self.perform(node, self.members[node].attach(job, rank, size, user=USER))

    def detach(self, node: int, rank: int, ops: Iterable[int] = (), job: str = JOB) -> None:
        """The client of ``rank`` left: its operations are abandoned, then its rank goes."""
        self.abandon(node, ops)
        reason = f"rank {rank} of job {job!r} disconnected"
        self.perform(node, self.members[node].detach(job, rank, reason))

    def abandon(self, node: int, ops: Iterable[int]) -> None:
        self.perform(node, self.engines[node].abandon(list(ops)))

    def send(
        self,
        node: int,
        src: int,
        dst: int,
        data: bytes,
        *,
        tag: int = 0,
        dtype: str = "uint8",
        job: str = JOB,
    ) -> int:
        """Post a send of ``data``; return its op id."""
        msg = Message(job=job, src=src, dst=dst, tag=tag, nbytes=len(data), dtype=dtype)
        region = np.frombuffer(bytearray(data), dtype=np.uint8)
        op = self._post(node, True, msg, region)
        self.perform(node, self.engines[node].post_send(op, msg, self.now))
        return op

    def recv(
        self,
        node: int,
        src: int,
        dst: int,
        nbytes: int,
        *,
        tag: int = 0,
        dtype: str = "uint8",
        job: str = JOB,
    ) -> int:
        """Post a receive into a fresh region (filled with 0xEE, so unwritten bytes show)."""
        msg = Message(job=job, src=src, dst=dst, tag=tag, nbytes=nbytes, dtype=dtype)
        region = np.full(nbytes, 0xEE, dtype=np.uint8)
        op = self._post(node, False, msg, region)
        self.perform(node, self.engines[node].post_recv(op, msg, region.data, self.now))
        return op

    def _post(
        self, node: int, send: bool, msg: Message, region: np.ndarray[Any, np.dtype[np.uint8]]
    ) -> int:
        op = next(self._ids)
        self.ops[node, op] = Posted(node=node, op=op, send=send, msg=msg, region=region)
        return op

    # -- what the daemon does -----------------------------------------------------------------
    def perform(self, node: int, actions: Iterable[Action]) -> None:
        for action in actions:
            self.actions.append((node, action))
            match action:
                case SendFrame(node=peer, frame=frame):
                    self._queue(node, peer, frame)
                case Broadcast(frame=frame):
                    for peer in range(self.nodes):
                        if peer != node and (node, peer) not in self.fenced:
                            self._queue(node, peer, frame)
                case RankJoined() | RankLeft():
                    self.perform(node, self.engines[node].on_rank_event(action, self.now))
                case SendEager(node=peer, op=op, frame=frame):
                    payload = self.ops[node, op].region.tobytes()
                    self._queue(node, peer, frame, payload)
                case Place(op=op, payload=payload):
                    self.ops[node, op].region[:] = np.frombuffer(payload, dtype=np.uint8)
                case StreamData() if self.data_channel:
                    self._write_data(node, action)
                case StreamData():
                    self.streams.append((node, action))
                    if self.auto_stream:
                        self.finish_stream(len(self.streams) - 1)
                case CopyLocal():
                    self.copies.append((node, action))
                    if self.auto_copy:
                        self.finish_copy(len(self.copies) - 1)
                case Complete(op=op, failure=failure):
                    landing = [f[3] for (_, dst), f in self.filling.items() if dst == node]
                    assert op not in landing, f"op {op} answered while a chunk lands in it"
                    self.completed.setdefault((node, op), []).append(failure)
                case Notice(message=message):
                    self.notices.append((node, message))

    def _queue(self, src: int, dst: int, frame: PeerFrame, payload: bytes = b"") -> None:
        assert src not in self.crashed, "a crashed node acted"
        if dst not in self.crashed:
            meta = transmit(frame.KIND, frame.to_meta())
            self.links[src, dst].append((frame.KIND, meta, payload))

    def _write_data(self, sender: int, stream: StreamData) -> None:
        """The daemon writes every DATA chunk of ``stream`` on its data link (``data_channel``)."""
        if stream.node in self.crashed:
            return
        source = self.ops[sender, stream.op].region.tobytes()
        link = self.data_links[sender, stream.node]
        for off in range(0, len(source), self.chunk_size):
            link.append((stream.msg, off, source[off : off + self.chunk_size], stream.rtr))

    def cut_stream(self, sender: int, receiver: int, index: int) -> bool:
        """The stream of the chunk at ``index`` on the data link from ``sender`` to
        ``receiver`` fails there (``data_channel``): its chunks from ``index`` on never leave,
        those before it are still on their way, and the sender's engine hears
        ``stream_failed`` (so its CANCEL may overtake them).  Return False if there is no such
        chunk."""
        link = self.data_links[sender, receiver]
        if index >= len(link):
            return False
        msg = link[index][0]
        kept = [chunk for i, chunk in enumerate(link) if i < index or chunk[0] != msg]
        link.clear()
        link.extend(kept)
        self.perform(sender, self.engines[sender].stream_failed(msg, "data link failed"))
        return True

    def receive(self, src: int, dst: int, kind: Kind, meta: Meta, payload: bytes = b"") -> None:
        """``dst``'s daemon parses a control frame from ``src`` and hands it to its engine
        (an EAGER's ``payload`` lands where the engine says, as the daemon's would).

        Raises:
            RemoteProtocolError: malformed, or a kind neither engine takes.
        """
        frame = parse(kind, meta)
        if self.drop is not None and self.drop(src, dst, frame):
            return
        self.frames.append((src, dst, frame))
        match frame:
            case Announce():
                self.perform(dst, self.members[dst].on_announce(src, frame))
            case Rts() | Cts() | Done() | Cancel() | Rtr():
                assert frame.KIND in FRAME_KINDS
                self.perform(dst, self.engines[dst].on_frame(src, frame, self.now))
            case Eager():
                engine = self.engines[dst]
                if payload:
                    buffer = engine.payload_buffer(src, frame, len(payload))
                    if buffer is not None:
                        buffer[:] = payload
                arrived = engine.data_arrived(src, frame, len(payload), self.now)
                self.perform(dst, arrived)
            case _:
                raise RemoteProtocolError(f"no engine takes {kind.name} frames")

    def finish_stream(self, index: int = 0) -> None:
        """The daemon streamed every DATA chunk of ``streams[index]``: they land at once."""
        self.stream_chunks(index, -1)

    def stream_chunks(self, index: int, count: int) -> None:
        """The next ``count`` DATA chunks of ``streams[index]`` land (``-1``: all that are left;
        then the stream is done and leaves ``streams``)."""
        sender, stream = self.streams[index]
        receiver = stream.node
        source = self.ops[sender, stream.op].region.tobytes()
        start = self.streamed.pop((sender, stream.msg), 0)
        end = len(source) if count < 0 else min(len(source), start + count * self.chunk_size)
        if end >= len(source):
            self.streams.pop(index)
        else:
            self.streamed[sender, stream.msg] = end
        for off in range(start, end, self.chunk_size):
            chunk = source[off : min(end, off + self.chunk_size)]
            self.land(sender, receiver, stream.msg, off, chunk, stream.rtr)

    def begin_chunk(self, index: int) -> None:
        """The next DATA chunk of ``streams[index]`` starts landing: its buffer is taken and
        half of it written, as a transport reads a large chunk over several reads, while other
        frames (a CANCEL on the control link) go on arriving.  :meth:`finish_chunk` ends it."""
        sender, stream = self.streams[index]
        receiver = stream.node
        self.finish_chunk(sender, receiver)  # a link carries one frame at a time
        source = self.ops[sender, stream.op].region.tobytes()
        start = self.streamed.pop((sender, stream.msg), 0)
        end = min(len(source), start + self.chunk_size)
        if end >= len(source):
            self.streams.pop(index)
        else:
            self.streamed[sender, stream.msg] = end
        if receiver in self.crashed or (receiver, sender) in self.fenced:
            return
        engine, chunk = self.engines[receiver], source[start:end]
        frame = Data(msg=stream.msg, off=start, rtr=stream.rtr)
        buffer = engine.payload_buffer(sender, frame, len(chunk))
        entry = engine._landing._entry(sender, -stream.rtr if stream.rtr else stream.msg)
        if buffer is not None:
            buffer[: len(chunk) // 2] = chunk[: len(chunk) // 2]
        op = None if buffer is None or entry is None else entry.op
        self.filling[sender, receiver] = (frame, chunk, buffer, op)

    def finish_chunk(self, sender: int, receiver: int) -> None:
        """The chunk :meth:`begin_chunk` started between the pair is in (if there is one)."""
        started = self.filling.pop((sender, receiver), None)
        if started is None or receiver in self.crashed or (receiver, sender) in self.fenced:
            return
        frame, chunk, buffer, _ = started
        if buffer is not None:
            buffer[:] = chunk
        engine = self.engines[receiver]
        self.perform(receiver, engine.data_arrived(sender, frame, len(chunk), self.now))

    def land(
        self, sender: int, receiver: int, msg: int, off: int, chunk: bytes, rtr: int = 0
    ) -> None:
        """One DATA chunk from ``sender`` reaches ``receiver`` (unless the link is gone)."""
        self.finish_chunk(sender, receiver)  # the frame before it on the link comes first
        if receiver in self.crashed or (receiver, sender) in self.fenced:
            return  # the bytes went into a dead or reset link
        engine = self.engines[receiver]
        frame = Data(msg=msg, off=off, rtr=rtr)
        buffer = engine.payload_buffer(sender, frame, len(chunk))
        if buffer is not None:  # None: dropped (a discarded or cancelled message)
            buffer[:] = chunk
        self.perform(receiver, engine.data_arrived(sender, frame, len(chunk), self.now))

    def fail_stream(
        self,
        index: int = 0,
        reason: str = "data link closed",
        code: ErrorCode = ErrorCode.TRANSPORT,
        late: int = 0,
    ) -> None:
        """``streams[index]`` failed with ``code``; the first ``late`` of its chunks not landed
        yet were already on the data link (they join :attr:`late`), the rest never leave."""
        sender, stream = self.streams.pop(index)
        source = self.ops[sender, stream.op].region.tobytes()
        start = self.streamed.pop((sender, stream.msg), 0)
        for off in range(start, len(source), self.chunk_size)[:late]:
            chunk = source[off : off + self.chunk_size]
            self.late.append((sender, stream.node, stream.msg, off, chunk, stream.rtr))
        self.perform(sender, self.engines[sender].stream_failed(stream.msg, reason, code))

    def land_late(self, index: int = 0) -> None:
        """The oldest late chunk between the pair of ``late[index]`` lands (a link is FIFO)."""
        pair = self.late[index][:2]
        first = next(i for i, item in enumerate(self.late) if item[:2] == pair)
        self.land(*self.late.pop(first))

    def finish_copy(self, index: int = 0) -> None:
        node, copy = self.copies.pop(index)
        self.ops[node, copy.dst_op].region[:] = self.ops[node, copy.src_op].region
        self.perform(node, self.engines[node].copied(copy.src_op, copy.dst_op))

    def fail_copy(
        self, index: int = 0, code: ErrorCode = ErrorCode.RESOURCES, reason: str = "no thread"
    ) -> None:
        """The daemon could not run ``copies[index]`` (no worker thread): nothing is copied."""
        node, copy = self.copies.pop(index)
        engine = self.engines[node]
        self.perform(node, engine.copy_failed(copy.src_op, copy.dst_op, code, reason))

    # -- the network --------------------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(len(q) for q in self.links.values()) + sum(
            len(q) for q in self.data_links.values()
        )

    def hold(self, src: int, dst: int) -> None:
        """Delay every frame from ``src`` to ``dst`` until :meth:`release`."""
        self.held.add((src, dst))

    def release(self, src: int, dst: int) -> None:
        self.held.discard((src, dst))

    def deliver_one(self) -> bool:
        """Deliver the oldest frame of one link (a control pair, or a data link); return False
        when nothing can move."""
        ready = [
            (data, pair)
            for data, links in ((False, self.links), (True, self.data_links))
            for pair, q in links.items()
            if q and pair not in self.held
        ]
        if not ready:
            return False
        data, (src, dst) = self.rng.choice(ready) if self.rng is not None else ready[0]
        self.deliver(src, dst, data=data)
        return True

    def deliver(self, src: int, dst: int, *, data: bool = False) -> None:
        """Deliver the oldest frame from ``src`` to ``dst``: of the control pair, or (``data``)
        of the data link."""
        if data:
            self.land(src, dst, *self.data_links[src, dst].popleft())
            return
        kind, meta, payload = self.links[src, dst].popleft()
        if (dst, src) not in self.fenced:
            self.receive(src, dst, kind, meta, payload)

    def run(self, limit: int = 100_000) -> None:
        """Deliver until every pair that is not held is empty."""
        for _ in range(limit):
            if not self.deliver_one():
                return
        raise AssertionError("frames kept flowing")

    def crash(self, node: int) -> None:
        """``node`` stops dead: frames to it vanish; what it sent is still in flight."""
        self.crashed.add(node)
        for links in (self.links, self.data_links):
            for (_, dst), queue in links.items():
                if dst == node:
                    queue.clear()

    def detect(self, survivor: int, node: int, reason: str = "down") -> None:
        """``survivor``'s daemon resets its links to ``node`` and fails what involved it."""
        self.fenced.add((survivor, node))
        self.links[node, survivor].clear()
        self.data_links[node, survivor].clear()
        self.perform(survivor, self.members[survivor].peer_down(node, reason, self.now))
        self.perform(survivor, self.engines[survivor].peer_down(node, reason))

    # -- time ---------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [n for n in range(self.nodes) if n not in self.crashed]

    def advance(self, now: float) -> None:
        self.now = now
        for node in self.live():
            self.perform(node, self.engines[node].on_timer(now))

    def next_deadline(self) -> float | None:
        deadlines = [self.engines[n].next_deadline() for n in self.live()]
        return min((d for d in deadlines if d is not None), default=None)

    def run_timers(self, limit: int = 10_000) -> None:
        """Deliver frames and fire timers until nothing is left to happen."""
        for _ in range(limit):
            self.run()
            deadline = self.next_deadline()
            if deadline is None:
                return
            assert deadline >= self.now
            self.advance(deadline)
        raise AssertionError("timers kept firing")

    # -- results ------------------------------------------------------------------------------
    def outcome(self, node: int, op: int) -> Failure | None:
        """The one completion of ``op`` (fails the test if there were none or several)."""
        done = self.completed.get((node, op), [])
        assert len(done) == 1, f"op {op} on node {node} completed {len(done)} times: {done}"
        return done[0]

    def ok(self, node: int, op: int) -> bool:
        return (node, op) in self.completed and self.outcome(node, op) is None

    def region(self, node: int, op: int) -> bytes:
        return self.ops[node, op].region.tobytes()

    def pending(self) -> list[int]:
        return [self.engines[n].pending() for n in range(self.nodes)]

    def kinds(self) -> list[Kind]:
        """The kinds of the frames delivered so far, in order."""
        return [frame.KIND for _, _, frame in self.frames]

    def of(self, node: int, kind: type) -> list[Any]:
        """Actions of one type that ``node``'s engines returned, in order."""
        return [a for n, a in self.actions if n == node and isinstance(a, kind)]
