"""A persistent collective's schedule over its member nodes, and where each of its buffers
lives: which recv takes a peer's message, the landing slots, and (in place) the allgather
messages that land straight in the caller's array.

Split from :mod:`~fabricd.engines.collectives.persistent`, which rebuilds a :class:`Layout`
at each view change.

Buffers: ``data`` (the round's working tensor, the result ends there; sync calls reduce into
it as they come), ``result`` (the last result, for late callers), ``accumulator`` and
``snapshot`` (partial modes: what ranks gave since the last round, and the round's
contribution, held if the round is abandoned), and two landing slots per required recv
with bytes (one per round parity: the engine's one-round overlap).  A send is complete once
handed to the service; the transport may keep a view of a queued payload until the kernel
took it, so a send hands over a view only where nothing writes those bytes before the peer
surely has them.  ``data`` and ``result`` swap at each round's end, so round ``r``'s tensor
is written again only in round ``r + 2``, once round ``r + 1`` ended; that needed every
member's round ``r + 1`` messages (ring allreduce, and the activation broadcast's allreduce,
need every member each round; the binary tree each node it sends to, its parent and children;
a broadcast's acknowledgements climb its whole tree), each
sent after its sender ended round ``r``, which needed this node's round ``r`` messages: on
a FIFO link, those were gone first.  Ring steps write a chunk only after the send that read
it was answered round the ring; broadcast slots are the same per round parity (and the binary
tree's: its ``allreduce_tree`` says why its sends may be views).  Recursive
doubling reduces into the very tensor it sent as soon as the partner's arrives, so its sends
are copies.  A view change allocates a fresh ``data`` and ``result``: frames of the abandoned
round, and round ``r - 1``'s to a node the new view lost (no round waits for it any more), may
still be queued reading the old ones.  In place (a node's only rank: its allreduce, its
allgather), ``data`` is the caller's array, written by the caller as soon as its call
completes: such rounds end with acknowledgements (docs/architecture.md, "In place for a
node's only rank").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.engines.collectives import algorithms as collectives
from fabricd.engines.collectives.algorithms import Region, chunk_bounds
from fabricd.engines.collectives.gather import allgather_ring, reduce_scatter_ring
from fabricd.engines.collectives.spec import in_place
from fabricd.engines.schedule import Kind, Schedule
from fabricd.errors import LocalProtocolError

if TYPE_CHECKING:
    from fabricd.engines.collectives.spec import Spec

#: pieces per chunk of the ring (its pipelining, ``allreduce_ring``): one, because on the
#: measured two-core machine every extra message costs more wake-ups than the overlap saves
#: (4 nodes, 64 MiB: 143-157 ms a round in one piece, 174-179 ms in 1 MiB pieces; 4 MiB in
#: 256 KiB pieces: 28-30 ms against 21 ms; docs/performance.md (i)).  Every node must agree.
RING_PIECES: Final = 1


def schedule_for(
    spec: Spec, ranks: tuple[int, ...], members: tuple[int, ...], node: int
) -> Schedule:
    """The schedule node ``node`` runs among ``members`` (sorted node ids) for ``spec``;
    ``ranks``: the node of every rank of the job."""
    me, n = members.index(node), len(members)
    #: a node runs it in the caller's array: the rounds end with acknowledgements, everywhere
    ack = any(in_place(spec, ranks, m) for m in members)
    match spec.kind:
        case "barrier":
            return collectives.barrier(me, n)
        case "broadcast":
            return collectives.broadcast(me, n, members.index(ranks[spec.root]))
        case "allgather":
            return allgather_ring(me, n, acknowledge=ack)
        case "reduce_scatter":
            return reduce_scatter_ring(me, n, spec.op)
    fn = "sum" if spec.partial else spec.op
    schedule: Schedule
    if spec.tree:
        schedule = collectives.allreduce_tree(me, n, fn)
    elif spec.ring:
        if spec.direct:
            schedule = collectives.allreduce_direct(me, n, fn, acknowledge=ack)
        else:
            schedule = collectives.allreduce_ring(me, n, fn, acknowledge=ack, pieces=RING_PIECES)
    else:
        schedule = collectives.allreduce_recursive_doubling(me, n, fn)
    if spec.partial:
        schedule = collectives.activation_broadcast(me, n, schedule)
    return schedule


class Layout:
    """Where ``schedule``'s buffers are, for a tensor of ``elements`` of ``dtype`` among
    ``members`` nodes (``inplace``: the sync ring of a node's only rank, in its array).
    ``bounds``: where each chunk of as many as the nodes begins (and the last ends), where
    they are not :func:`~fabricd.engines.collectives.algorithms.chunk_bounds`'s even split
    (an allgather's or reduce-scatter's chunks are their nodes' ranks' blocks)."""

    def __init__(
        self,
        schedule: Schedule,
        *,
        elements: int,
        dtype: np.dtype[Any],
        members: tuple[int, ...],
        inplace: bool,
        bounds: tuple[int, ...] | None = None,
        early: bool = False,
    ) -> None:
        self.schedule = schedule
        self.bounds = bounds
        #: in place, whether a message may come before its round runs here (an allgather's:
        #: it then lands in a slot)
        self.early = early
        self.elements, self.dtype, self.parts, self.inplace = (
            elements,
            dtype,
            len(members),
            inplace,
        )
        self.recv_of: dict[tuple[int, int], int] = {}  #: (peer, tag) -> recv op
        self.slots: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        #: in place: the allgather recvs that land straight in ``data`` (op -> chunk name)
        self.direct: dict[int, str] = {}
        for i, op in enumerate(schedule.ops):
            if op.kind is Kind.RECV:
                self.recv_of[op.peer, op.tag] = i
                self._place_recv(i)
        ops = schedule.ops
        #: in place: the allgather's copies a round runs
        self.copies = sum(op.kind is Kind.COMPUTE and op.fn == "copy" for op in ops)
        sends = [op for op in ops if op.kind is Kind.SEND and op.buffer != collectives.EMPTY]
        #: the nodes this node sends bytes to each round
        self.sent_to = tuple(sorted({members[op.peer] for op in sends}))

    def _place_recv(self, recv: int) -> None:
        """Where recv op ``recv``'s messages land.  A slot holds what the compute that reads
        it writes: a chunk or the whole tensor; none where the messages are empty by design.
        Two slots, one per round parity (the engine's one-round overlap), but in place, where
        every slot is a reduce-scatter's: its round ``r + 1`` message comes only once its
        sender ended round ``r``, which took a chunk this node completed after every one of its
        round ``r`` reductions (the ring's allgather, or the direct exchange's), so one slot
        serves both parities.  In place, an allgather's message lands straight in its chunk of
        ``data`` (the ``copy`` that would read its slot is then no copy): its round ``r``
        message comes only after this node's round ``r`` reduce-scatter send of that very
        chunk was received where the chunk is completed (round the ring, or at its owner), so
        nothing still reads it.
        """
        schedule = self.schedule
        name = schedule.ops[recv].buffer
        if collectives.parse(name).region is Region.EMPTY:
            return
        reader = next(
            (op for op in schedule.ops if op.kind is Kind.COMPUTE and name in op.inputs), None
        )
        if reader is None:
            raise LocalProtocolError(f"no compute reads {name!r}: its size is unknown")
        start, stop = self._span(collectives.parse(reader.buffer))
        elements = stop - start
        if self.inplace and reader.fn == "copy" and elements:
            self.direct[recv] = reader.buffer
            if not self.early:
                return
            self.slots[recv] = (np.zeros(elements, self.dtype), np.zeros(elements, self.dtype))
            return
        first = np.zeros(elements, self.dtype)
        self.slots[recv] = (first, first if self.inplace else np.zeros_like(first))

    def slotted(self, op: int, array: np.ndarray[Any, Any]) -> bool:
        """Whether ``array`` is one of recv ``op``'s slots (a direct recv's message that came
        early landed there)."""
        return any(array is slot for slot in self.slots.get(op, ()))

    def lands(self, op: int) -> bool:
        """Whether recv ``op``'s messages carry bytes that land somewhere."""
        return op in self.direct or (op in self.slots and bool(self.slots[op][0].nbytes))

    def buffer(
        self,
        name: str,
        round: int,
        data: np.ndarray[Any, Any],
        landed: dict[int, np.ndarray[Any, Any]],
    ) -> np.ndarray[Any, Any]:
        """The array buffer ``name`` of round ``round`` is, with ``data`` the round's tensor
        and ``landed`` where each direct recv's message of the round landed."""
        buffer = collectives.parse(name)
        match buffer.region:
            case Region.DATA:
                return data
            case Region.CHUNK:
                start, stop = self._span(buffer)
                return data[start:stop]
            case Region.SLOT:
                op = self.recv_of[buffer.peer, buffer.tag]
                if op in landed:  # in place, landed straight in its chunk
                    return landed[op]
                return self.slots[op][round % 2]
            case Region.EMPTY:
                return data[:0]

    def _span(self, buffer: collectives.Buffer) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the tensor that ``buffer`` is (none: a slot, empty)."""
        match buffer.region:
            case Region.DATA:
                return 0, self.elements
            case Region.CHUNK if self.bounds is not None and not buffer.parts:
                return self.bounds[buffer.index], self.bounds[buffer.index + 1]
            case Region.CHUNK:
                return chunk_bounds(self.elements, buffer.parts or self.parts, buffer.index)
        return 0, 0

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        """Every landing slot (once each: in place, both parities share one)."""
        return tuple({id(a): a for pair in self.slots.values() for a in pair}.values())
