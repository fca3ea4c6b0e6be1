"""Synchronous collectives and the activation broadcast, built as one rank's schedule DAG.

Rules: this module only *builds* :class:`~fabricd.engines.schedule.Schedule` objects for rank
``rank`` of ``size`` (any ``size >= 1``, not only powers of two); the schedule engine runs them,
the daemon's schedule service performs their actions.  It knows no dtype and no length: a
schedule works for any tensor, whose bytes the service splits by :func:`chunk_bounds`.  The
choice of algorithm by message size is :func:`choose_allreduce`, with the switch point a
parameter: the daemon's ``ring_from_bytes``, measured (docs/performance.md: the two are level
at 2 MiB), not guessed here.

Buffers: the convention the service must implement.  An :class:`Op`'s ``buffer`` and
``inputs`` are one of (:func:`parse` reads them back as a :class:`Buffer`):

* ``"data"`` (:data:`DATA`): the rank's tensor for the round, given by its call; the result
  ends there, in place.
* ``"data:I"`` (:func:`chunk`): chunk ``I`` of ``"data"``, elements
  ``chunk_bounds(count, size, I)``.  Chunks may be empty (fewer elements than ranks): their
  messages then carry zero bytes.
* ``"slot:P:T"`` (:func:`slot`): where the recv of message tag ``T`` from rank ``P`` lands,
  one per recv.  A slot, never ``"data"``, because a message of round ``r + 1`` may land while
  round ``r`` still uses ``"data"`` (see the engine's "Rounds and the overlap allowed": one
  slot per round parity for a required recv).  A send may read a slot (a broadcast forwards
  from it); the slot of round ``r`` is free again once round ``r`` ended.
* ``"empty"`` (:data:`EMPTY`): no bytes: barrier and activation messages, which only say "I
  got here" (optional recvs of the activation need no landing slot at all).

Compute functions (``Op.fn``), elementwise, in the tensor's dtype (integers wrap):
``"sum"``, ``"max"``, ``"min"``: ``buffer = fn(inputs[0], inputs[1])``; ``"copy"``:
``buffer = inputs[0]``; ``"div"``: ``buffer = inputs[0] / size`` with ``size`` the number of
ranks of the collective (floor division for integer dtypes).  A reduction ``"avg"`` is built
as ``"sum"`` then one ``"div"``, applied where it costs least and leaves every rank the same
bits: on the rank's own chunk before the ring's allgather, after the last exchange of
recursive doubling.  The reductions are commutative, so the two ranks of an exchange compute
``a + b`` and ``b + a``, equal in IEEE arithmetic: every rank ends with the same bits.

Theory of operation, with the cost of a message of ``m`` bytes as ``alpha + m * beta``:

* **Ring allreduce** (:func:`allreduce_ring`; Patarasuk and Yuan, "Bandwidth optimal all-reduce
  algorithms for clusters of workstations", JPDC 2009; Thakur, Rabenseifner and Gropp,
  "Optimization of collective communication operations in MPICH", IJHPCA 2005): the tensor in
  ``size`` chunks; a reduce-scatter of ``size - 1`` steps (step ``s``: send chunk
  ``rank - s`` to the right, reduce chunk ``rank - s - 1`` from the left) leaves chunk
  ``rank + 1`` complete here, and an allgather of ``size - 1`` steps passes the complete chunks
  round.  ``2 (size - 1)`` messages per rank, ``2 (size - 1) / size * m`` bytes: bandwidth
  optimal, for large messages.
* **Recursive doubling** (:func:`allreduce_recursive_doubling`; Thakur, Rabenseifner and Gropp
  2005, the allreduce for short messages, with its handling of a ``size`` that is not a power
  of two): with ``p`` the largest power of two ``<= size`` and ``rem = size - p``, the first
  ``2 rem`` ranks pair up, each even one sends its tensor to the odd one above it and sits the
  doubling out; the ``p`` ranks left exchange whole tensors with the partner ``new ^ 2**k`` at
  step ``k`` (``new``: the rank among them) and reduce; the odd ranks send the result back.
  ``log2 p`` messages per rank (one more for the odd folding ranks, one in all for the even
  ones), each of ``m`` bytes: fewest steps, for small messages.
* **Binary tree** (:func:`allreduce_tree`; MLfabric §7.2's *Tr-Sync*, "MPI AllReduce that
  aggregates and distributes updates along a binary tree", NCCL's tree and MPICH's
  reduce-then-broadcast in one schedule): rank ``i``'s children are ``2i + 1`` and ``2i + 2``.
  Each rank reduces its children's tensors into its own and sends the sum to its parent; rank
  0, the root, ends with the whole sum and sends it back down the same tree, each rank
  forwarding it to its children straight from its landing slot.  ``2 (size - 1)`` messages in
  all, each of ``m`` bytes, ``2 floor(log2 size)`` steps: neither bandwidth nor latency
  optimal, a baseline (MLfabric's) that :func:`choose_allreduce` never picks; a caller asks for
  it.  Every rank gets the root's bits.
* **Broadcast** (:func:`broadcast`; the binomial tree of MPICH, Thakur et al. 2005): relative
  rank ``v = rank - root``; ``v`` takes the tensor from ``v`` without its lowest set bit and
  forwards it, straight from its slot, to ``v + 2**j`` for each ``2**j`` below that bit, the
  largest subtree first.  ``ceil(log2 size)`` steps; a rank's call only gates the copy into
  its own ``"data"``, never its subtree.
* **Barrier** (:func:`barrier`; the dissemination barrier of Hensgen, Finkel and Manber,
  "Two algorithms for barrier synchronization", IJPP 1988): ``ceil(log2 size)`` steps, step
  ``k`` sends an empty message to ``rank + 2**k`` and takes one from ``rank - 2**k``; step
  ``k + 1`` waits for step ``k``'s message.  Works for any size.
* **Activation broadcast** (:func:`activation_broadcast`; eager-SGD §4.1.1, Fig. 6): the
  union of the binomial trees rooted at every rank, so any rank may initiate.  On channel
  ``k`` a rank sends an empty message to ``rank + 2**k`` and takes one from ``rank - 2**k``
  (mod ``size``); the rank's call sends on every channel, a message on channel ``j`` forwards
  on the channels above ``j``.  From initiator ``i`` this reaches ``i + m`` for every
  ``m < 2**ceil(log2 size)``: every rank exactly once for a power of two (as Fig. 6's XOR
  scheme does; addition mod ``size`` also serves the other sizes), and some twice otherwise --
  the second message is a consumed or skipped optional recv, absorbed by the engine like a
  second initiator's.  The call, the recvs and the sends are optional; a required nop (the
  paper's N1) waits for any of them and starts the collective, so simultaneous initiators run
  the collective exactly once (operations are consumable).  Such a redundant message may
  come rounds late, held back on a slow link while the data flows on other paths; the engine
  absorbs it (its "Rounds and the overlap allowed").

Persistence, rounds, and when a message may come are the engine's (its docstring); a broadcast
root hears nobody, so the data plane's credit must keep it from running two rounds ahead.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import Final

from fabricd.engines.schedule import Join, Kind, Op, Schedule
from fabricd.errors import UsageError

#: the reductions an allreduce takes
REDUCTIONS: Final = ("sum", "avg", "max", "min")

#: the rank's tensor for the round (the result lands in it)
DATA: Final = "data"
#: a message of no bytes (barrier, activation)
EMPTY: Final = "empty"


def chunk(index: int, parts: int = 0) -> str:
    """The name of chunk ``index`` of :data:`DATA` cut in ``parts`` (0: as many as ranks)."""
    return f"{DATA}:{index}/{parts}" if parts else f"{DATA}:{index}"


def slot(peer: int, tag: int) -> str:
    """The name of the landing slot of message ``tag`` from ``peer``."""
    return f"slot:{peer}:{tag}"


def chunk_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of chunk ``index`` of ``count`` split in ``parts``: sizes
    differ by at most one, and every rank computes the same split."""
    return index * count // parts, (index + 1) * count // parts


class Region(enum.Enum):
    DATA = "data"  #: the whole tensor
    CHUNK = "chunk"  #: one chunk of it (``index``)
    SLOT = "slot"  #: a recv's landing slot (``peer``, ``tag``)
    EMPTY = "empty"  #: no bytes


@dataclass(frozen=True, slots=True)
class Buffer:
    """A buffer name, read back: what the service maps it to."""

    region: Region
    index: int = -1
    peer: int = -1
    tag: int = -1
    parts: int = 0  #: a chunk: how many the tensor is cut in (0: as many as ranks)


_CHUNK = re.compile(r"data:(\d+)(?:/(\d+))?")
_SLOT = re.compile(r"slot:(\d+):(\d+)")


def parse(name: str) -> Buffer:
    """Read a buffer name this module wrote.

    Raises:
        UsageError: not a name of the convention.
    """
    if name == DATA:
        return Buffer(Region.DATA)
    if name == EMPTY:
        return Buffer(Region.EMPTY)
    if m := _CHUNK.fullmatch(name):
        return Buffer(Region.CHUNK, index=int(m[1]), parts=int(m[2] or 0))
    if m := _SLOT.fullmatch(name):
        return Buffer(Region.SLOT, peer=int(m[1]), tag=int(m[2]))
    raise UsageError(f"{name!r} is not a collective buffer (data, data:I[/N], slot:P:T, empty)")


class Algorithm(enum.Enum):
    RING = "ring"
    DIRECT = "direct exchange"
    RECURSIVE_DOUBLING = "recursive doubling"
    TREE = "binary tree"  #: only when asked for (:func:`allreduce_tree`)
    #: only when asked for; no schedule here (a dynamic one: engines/collectives/mlfabric.py)
    MLFABRIC = "mlfabric"


#: the most nodes the direct exchange is chosen for (measured to 8: docs/performance.md (i));
#: beyond, the ring, whose messages per step do not grow with the nodes
DIRECT_MAX_NODES: Final = 8


def choose_allreduce(size: int, nbytes: int, *, ring_from_bytes: int) -> Algorithm:
    """Ring for tensors of ``ring_from_bytes`` or more, recursive doubling below; from 3 to
    :data:`DIRECT_MAX_NODES` ranks the ring's direct-exchange form
    (:func:`allreduce_direct`), the same bytes in two steps instead of ``2 (size - 1)``: on
    the measured machine 8-30% faster at 4 and 8 nodes, 4 and 64 MiB.

    The switch point is the caller's: it depends on the fabric's alpha and beta and is to be
    measured (``bench/``), never guessed here.  With two ranks both move the same bytes,
    recursive doubling in one step, the ring in two of half the size: the ring still wins on
    large tensors, as one half is reduced while the other travels and it sends straight from
    the tensor (see fabricd/engines/collectives/persistent.py: recursive doubling's sends are
    copies).
    """
    if ring_from_bytes < 0 or nbytes < 0:
        raise UsageError("sizes in bytes must be >= 0")
    if 3 <= size <= DIRECT_MAX_NODES and nbytes >= ring_from_bytes:
        return Algorithm.DIRECT
    if size > 1 and nbytes >= ring_from_bytes:
        return Algorithm.RING
    return Algorithm.RECURSIVE_DOUBLING


def allreduce(rank: int, size: int, op: str, nbytes: int, *, ring_from_bytes: int) -> Schedule:
    """The allreduce :func:`choose_allreduce` picks for ``nbytes``."""
    match choose_allreduce(size, nbytes, ring_from_bytes=ring_from_bytes):
        case Algorithm.RING:
            return allreduce_ring(rank, size, op)
        case Algorithm.DIRECT:
            return allreduce_direct(rank, size, op)
        case Algorithm.RECURSIVE_DOUBLING:
            return allreduce_recursive_doubling(rank, size, op)
        case Algorithm.TREE:
            return allreduce_tree(rank, size, op)
        case Algorithm.MLFABRIC:  # (never chosen by size)
            raise ValueError("MLfabric-S has no static schedule")


class _Builder:
    """Appends operations; op 0 is the activation (the rank's call)."""

    def __init__(self) -> None:
        self.ops: list[Op] = [Op.nop()]

    def add(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def build(self) -> Schedule:
        return Schedule(ops=tuple(self.ops), activation=0)


_CALL: Final = 0


def _check(rank: int, size: int, op: str | None = None) -> None:
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} of {size}: need size >= 1 and 0 <= rank < size")
    if op is not None and op not in REDUCTIONS:
        raise UsageError(f"op {op!r}: must be one of {', '.join(REDUCTIONS)}")


def _reduce_fn(op: str) -> str:
    return "sum" if op == "avg" else op


def allreduce_ring(
    rank: int, size: int, op: str, *, acknowledge: bool = False, pieces: int = 1
) -> Schedule:
    """Ring allreduce (reduce-scatter, then allgather) of ``"data"`` in ``size`` chunks.

    Tags: reduce-scatter step ``s`` is tag ``s``, allgather step ``s`` tag ``size - 1 + s``.
    Besides the data flow, allgather step ``s``'s copy into chunk ``rank - s`` waits for the
    reduce-scatter send that read that chunk (a write after a read in flight).

    ``pieces`` (pipelining, as in the segmented ring of Patarasuk and Yuan 2009 §4 and of
    NCCL): each chunk is cut in ``pieces`` and every piece runs its own chain of steps, so a
    piece is reduced and sent on while the next piece of the same step is still arriving:
    the steps overlap instead of each waiting for a whole chunk.  The chunks are the same
    elements as without pieces (piece ``k`` of chunk ``c`` is part ``c * pieces + k`` of
    ``size * pieces``, see :func:`chunk_bounds`), reduced in the same order: the result has
    the same bits.  With pieces, step ``s``'s message of piece ``k`` has tag
    ``s * pieces + k`` (allgather steps following the reduce-scatter's).

    ``acknowledge``: the round also ends with an empty message to the left once every
    message from it is in, and the round here ends only with the right
    neighbour's.  Every message a rank sends in a ring goes to its right neighbour, so that
    acknowledgement says, over a FIFO link, that the right one *received* all of them:
    nothing of the round is still queued in this node's transport reading ``"data"``.  The
    in-place allreduce needs it (its ``"data"`` is the caller's array, written by the caller
    as soon as the round's result is delivered; gloo's allreduce, likewise, returns only once
    its sends completed).  Every rank of a ring must agree on both options.
    """
    _check(rank, size, op)
    if pieces < 1:
        raise UsageError(f"pieces {pieces}: must be >= 1")
    b = _Builder()
    right, left = (rank + 1) % size, (rank - 1) % size
    fn = _reduce_fn(op)
    parts = size * pieces if pieces > 1 else 0

    def part(index: int, piece: int) -> str:
        return chunk(index * pieces + piece, parts) if parts else chunk(index)

    recvs: list[int] = []
    for piece in range(pieces):
        last = _CALL  #: the op after which this piece's next send is ready
        scattered: list[int] = []  #: the reduce-scatter sends, by step
        for step in range(size - 1):
            mine, theirs = part((rank - step) % size, piece), part((rank - step - 1) % size, piece)
            tag = step * pieces + piece
            scattered.append(b.add(Op.send(right, mine, tag=tag, after=(last,))))
            got = b.add(Op.recv(left, slot(left, tag), tag=tag))
            recvs.append(got)
            last = b.add(Op.compute(fn, theirs, (theirs, slot(left, tag)), after=(_CALL, got)))
        owned = part((rank + 1) % size, piece)  # complete here after the reduce-scatter
        if op == "avg" and size > 1:
            last = b.add(Op.compute("div", owned, (owned,), after=(last,)))
        for step in range(size - 1):
            tag = (size - 1 + step) * pieces + piece
            mine, theirs = part((rank + 1 - step) % size, piece), part((rank - step) % size, piece)
            b.add(Op.send(right, mine, tag=tag, after=(last,)))
            got = b.add(Op.recv(left, slot(left, tag), tag=tag))
            recvs.append(got)
            last = b.add(
                Op.compute("copy", theirs, (slot(left, tag),), after=(got, scattered[step]))
            )
    if acknowledge and size > 1:
        tag = 2 * (size - 1) * pieces
        b.add(Op.send(left, EMPTY, tag=tag, after=tuple(recvs)))
        b.add(Op.recv(right, EMPTY, tag=tag))
    return b.build()


def allreduce_direct(rank: int, size: int, op: str, *, acknowledge: bool = False) -> Schedule:
    """Reduce-scatter then allgather of ``"data"`` in ``size`` chunks, each by pairwise
    exchange with every other rank at once (Thakur, Rabenseifner and Gropp 2005: the
    pairwise-exchange reduce-scatter of long messages, its steps here not one after another
    but all posted together, and the allgather likewise).  Rank ``i`` owns chunk ``i``: it
    gets every other rank's chunk ``i`` (tag 0), reduces them into its own in rank order
    from its left (``rank - 1``, ``rank - 2``, ...: a fixed order whatever the arrivals, so
    every run gives the same bits), then sends the result to every other rank (tag 1), which
    lands it in its chunk ``i``.  The same bytes as the ring, ``2 (size - 1) / size * m``
    per rank, in two steps of latency instead of ``2 (size - 1)``: what counts where a
    message's wake-ups cost more than its bytes (docs/performance.md (i)).  It asks of the
    network every pair at once, which a switch gives and a ring of links would not.

    Each allgather copy into chunk ``j`` waits for the reduce-scatter send that read it.
    ``acknowledge``: as the ring's, but to and from every other rank (tag 2), each sent once
    every message from that rank is in: a rank's messages to a peer all travel on their one
    FIFO link.
    """
    _check(rank, size, op)
    b = _Builder()
    fn = _reduce_fn(op)
    others = [(rank - k) % size for k in range(1, size)]  #: the reduction's fixed order
    sent = {peer: b.add(Op.send(peer, chunk(peer), tag=0, after=(_CALL,))) for peer in others}
    last = _CALL
    got: dict[int, list[int]] = {peer: [] for peer in others}
    mine = chunk(rank)
    for peer in others:
        got[peer].append(b.add(Op.recv(peer, slot(peer, 0), tag=0)))
        last = b.add(
            Op.compute(
                fn, mine, (mine, slot(peer, 0)), after=tuple(sorted({_CALL, last, got[peer][0]}))
            )
        )
    if op == "avg" and size > 1:
        last = b.add(Op.compute("div", mine, (mine,), after=(last,)))
    for peer in others:
        b.add(Op.send(peer, mine, tag=1, after=(last,)))
        got[peer].append(b.add(Op.recv(peer, slot(peer, 1), tag=1)))
        b.add(Op.compute("copy", chunk(peer), (slot(peer, 1),), after=(got[peer][1], sent[peer])))
    if acknowledge:
        for peer in others:
            b.add(Op.send(peer, EMPTY, tag=2, after=tuple(got[peer])))
            b.add(Op.recv(peer, EMPTY, tag=2))
    return b.build()


def allreduce_recursive_doubling(rank: int, size: int, op: str) -> Schedule:
    """Recursive-doubling allreduce of the whole ``"data"``, any ``size`` (see the module).

    Tags: the fold-in message is tag 0, doubling step ``k`` is tag ``1 + k``, the result sent
    back to a folded rank is tag ``1 + log2 p``.  Each step's reduction waits for the step's
    send to complete, since it overwrites what the send reads.
    """
    _check(rank, size, op)
    b = _Builder()
    fn = _reduce_fn(op)
    steps = size.bit_length() - 1
    rem = size - (1 << steps)
    back = 1 + steps  #: the tag of the result sent back to a folded rank
    last = _CALL  #: the op after which "data" holds this rank's partial result
    if rank < 2 * rem and rank % 2 == 0:  # folded: hands its tensor over, gets the result
        sent = b.add(Op.send(rank + 1, DATA, tag=0, after=(_CALL,)))
        got = b.add(Op.recv(rank + 1, slot(rank + 1, back), tag=back))
        b.add(Op.compute("copy", DATA, (slot(rank + 1, back),), after=(got, sent)))
        return b.build()
    if rank < 2 * rem:  # takes its even neighbour's tensor in
        got = b.add(Op.recv(rank - 1, slot(rank - 1, 0), tag=0))
        last = b.add(Op.compute(fn, DATA, (DATA, slot(rank - 1, 0)), after=(_CALL, got)))
        new = rank // 2
    else:
        new = rank - rem
    for k in range(steps):
        partner = new ^ (1 << k)
        peer = 2 * partner + 1 if partner < rem else partner + rem
        tag = 1 + k
        sent = b.add(Op.send(peer, DATA, tag=tag, after=(last,)))
        got = b.add(Op.recv(peer, slot(peer, tag), tag=tag))
        last = b.add(Op.compute(fn, DATA, (DATA, slot(peer, tag)), after=(sent, got)))
    if op == "avg" and size > 1:
        last = b.add(Op.compute("div", DATA, (DATA,), after=(last,)))
    if rank < 2 * rem:
        b.add(Op.send(rank - 1, DATA, tag=back, after=(last,)))
    return b.build()


def allreduce_tree(rank: int, size: int, op: str) -> Schedule:
    """Binary-tree allreduce of the whole ``"data"`` (Tr-Sync; see the module): a reduce up the
    tree rooted at rank 0 (tag 0), then the root's result down it (tag 1).

    A rank reduces its children's tensors into ``"data"`` in a fixed order (``2i + 1``, then
    ``2i + 2``), whatever the arrivals; the root divides once for ``"avg"``; every other rank
    copies the root's result into ``"data"`` once its own send up (which read ``"data"``) is
    done, and forwards the result to its children from the slot it landed in.  Nothing is
    written while a send that read it may still be queued: ``"data"`` only after the parent's
    answer, which the parent sent after it received what ``"data"`` sent; a slot only two rounds
    later, after this rank heard its children's messages of the next round, which they sent
    only after receiving this round's.  Messages: one up and one down per rank but the root.
    """
    _check(rank, size, op)
    b = _Builder()
    fn = _reduce_fn(op)
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < size]
    last = _CALL  #: the op after which "data" holds this rank's subtree's sum
    for child in children:
        got = b.add(Op.recv(child, slot(child, 0), tag=0))
        inputs = (DATA, slot(child, 0))
        last = b.add(Op.compute(fn, DATA, inputs, after=tuple(sorted({_CALL, last, got}))))
    if rank == 0:
        if op == "avg" and size > 1:
            last = b.add(Op.compute("div", DATA, (DATA,), after=(last,)))
        source, ready = DATA, last
    else:
        parent = (rank - 1) // 2
        sent = b.add(Op.send(parent, DATA, tag=0, after=(last,)))
        source = slot(parent, 1)
        ready = b.add(Op.recv(parent, source, tag=1))
        b.add(Op.compute("copy", DATA, (source,), after=(ready, sent)))
    for child in children:
        b.add(Op.send(child, source, tag=1, after=(ready,)))
    return b.build()


def broadcast(rank: int, size: int, root: int) -> Schedule:
    """Binomial-tree broadcast of ``root``'s ``"data"`` into every rank's ``"data"``.

    Tag 0 carries the data down the tree; tag 1 is an empty acknowledgement up it, sent once
    the rank copied the data (after its own call) and heard from its whole subtree.  A rank's
    round ends only with its children's acknowledgements, so the root, which hears nobody
    else, cannot run more than one round ahead of the slowest rank (the engine's rule).
    """
    _check(rank, size)
    if not 0 <= root < size:
        raise UsageError(f"root {root}: must be a rank of 0..{size - 1}")
    b = _Builder()
    v = (rank - root) % size
    parent = -1
    if v == 0:
        source, ready, below, copied = DATA, _CALL, 1 << (size - 1).bit_length(), _CALL
    else:
        below = v & -v  # the lowest set bit: the parent is v without it
        parent = (v - below + root) % size
        source = slot(parent, 0)
        ready = b.add(Op.recv(parent, source, tag=0))
        copied = b.add(Op.compute("copy", DATA, (source,), after=(_CALL, ready)))
    acks: list[int] = []
    step = below >> 1
    while step:
        if v + step < size:
            child = (v + step + root) % size
            b.add(Op.send(child, source, tag=0, after=(ready,)))
            acks.append(b.add(Op.recv(child, EMPTY, tag=1)))
        step >>= 1
    if parent >= 0:
        b.add(Op.send(parent, EMPTY, tag=1, after=(copied, *acks)))
    return b.build()


def barrier(rank: int, size: int) -> Schedule:
    """Dissemination barrier: empty messages, tag ``k`` at step ``k``."""
    _check(rank, size)
    b = _Builder()
    last: tuple[int, ...] = (_CALL,)
    for k in range((size - 1).bit_length()):
        sent = b.add(Op.send((rank + (1 << k)) % size, EMPTY, tag=k, after=last))
        got = b.add(Op.recv((rank - (1 << k)) % size, EMPTY, tag=k))
        last = (sent, got)
    return b.build()


def activation_broadcast(rank: int, size: int, collective: Schedule) -> Schedule:
    """``collective`` started by the first of the rank's call or any rank's activation message.

    Ops ``0 .. 2K + 1`` (``K = ceil(log2 size)`` channels) are the activation: 0 the call
    (optional), ``1 .. K`` the recvs of channels ``0 .. K - 1``, ``K + 1 .. 2K`` the sends, and
    ``2K + 1`` the required nop N1; tags ``0 .. K - 1``.  The collective follows, its
    activation now a nop after N1, its tags (and slot names) shifted up by ``K``.

    Raises:
        UsageError: ``collective`` has no activation to hang behind N1.
    """
    _check(rank, size)
    if collective.activation is None:
        raise UsageError("the collective has no activation nop to start after the broadcast")
    channels = (size - 1).bit_length()
    ops = [Op.nop(optional=True)]
    recvs = [1 + k for k in range(channels)]
    ops += [Op.recv((rank - (1 << k)) % size, EMPTY, tag=k, optional=True) for k in range(channels)]
    ops += [
        Op.send(
            (rank + (1 << k)) % size,
            EMPTY,
            tag=k,
            after=(0, *recvs[:k]),
            join=Join.ANY,
            optional=True,
        )
        for k in range(channels)
    ]
    n1 = len(ops)
    ops.append(Op.nop(after=(0, *recvs), join=Join.ANY))
    offset = len(ops)
    for index, op in enumerate(collective.ops):
        if index == collective.activation:
            ops.append(Op.nop(after=(n1,)))
            continue
        tag = op.tag + channels if op.kind in (Kind.SEND, Kind.RECV) else op.tag
        ops.append(
            replace(
                op,
                after=tuple(d + offset for d in op.after),
                tag=tag,
                buffer=_shift(op.buffer, channels),
                inputs=tuple(_shift(name, channels) for name in op.inputs),
            )
        )
    return Schedule(ops=tuple(ops), activation=0)


def _shift(name: str, channels: int) -> str:
    """A slot's name follows its recv's tag when the tags move up by ``channels``."""
    if not name:
        return name
    buffer = parse(name)
    return slot(buffer.peer, buffer.tag + channels) if buffer.region is Region.SLOT else name
