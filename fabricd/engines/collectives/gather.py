"""Native allgather and reduce-scatter over a job's nodes: their ring schedules, and where each
rank's block lives in a node's buffer.

Rules: this module builds the two collectives' schedules (for
:func:`~fabricd.engines.collectives.layout.schedule_for`) and places a job's ranks' blocks in
the tensor one node runs them on (:class:`Blocks`, which the persistent engine,
:mod:`~fabricd.engines.collectives.persistent`, asks to fold a local call in and to hand a
call its result).  Sans-IO: numpy only.

Theory of operation.  A ring allreduce is a reduce-scatter followed by an allgather
(Patarasuk and Yuan 2009; Thakur, Rabenseifner and Gropp 2005); each phase alone is the native
collective, and moving only its phase is what makes it cheaper than an allreduce of a padded
tensor: a node sends ``(nodes - 1) / nodes`` of the tensor once, not twice.

* **The node's tensor.**  Each rank's block has ``k`` elements (the spec's ``count``); a node
  holds ``size * k``, the blocks ordered by node (the sorted member nodes), then by rank
  within a node: node ``i``'s blocks are one contiguous *chunk* ``i``, so a chunk is what its
  node's ranks give (allgather) or get (reduce-scatter), and chunks differ in size when nodes
  host different numbers of ranks (:attr:`Blocks.bounds`; the ring's chunks are not the
  even split of :func:`~fabricd.engines.collectives.algorithms.chunk_bounds`).  Where every
  node's ranks are consecutive (the usual placement) that order is the ranks' own, and no
  block moves on the way in or out.
* **Hierarchical**, as the allreduce: a node's ranks fold into its tensor through shared
  memory first (an allgather's call copies its block into place; a reduce-scatter's reduces
  its whole input in), and the ring runs once per node, not per rank.
* **Allgather** (:func:`allgather_ring`): at step ``s`` node ``i`` sends chunk ``i - s`` to
  the right and copies the chunk ``i - s - 1`` it got from the left into place; after
  ``nodes - 1`` steps every node has every chunk.
* **Reduce-scatter** (:func:`reduce_scatter_ring`): the ring allreduce's first phase, shifted
  by one so that node ``i`` ends owning chunk ``i`` (its own ranks' blocks): at step ``s`` it
  sends chunk ``i - s - 1`` and reduces chunk ``i - s - 2`` with what came from the left.
  ``avg`` divides the owned chunk by the job's size once, there (a single node divides the
  sum at the round's end, as the allreduce does).
* **Buffers.**  The schedules follow the allreduce ring's naming (``data:I``, ``slot:P:T``),
  and the engine's buffer rules hold as for it: a chunk is written (copied into, or reduced
  into) before this round's one send of it, never after, and ``data`` and ``result`` swap
  each round, so sends may hand the transport views.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from fabricd.engines.collectives.algorithms import EMPTY, REDUCTIONS, chunk, slot
from fabricd.engines.collectives.landing import same
from fabricd.engines.collectives.spec import GATHERS, REDUCE, Spec
from fabricd.engines.schedule import Op, Schedule
from fabricd.errors import UsageError

_CALL: Final = 0  #: op 0 of a schedule: the round's activation (every local rank gave)


def _check(rank: int, size: int, op: str = "sum") -> None:
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} of {size}: need size >= 1 and 0 <= rank < size")
    if op not in REDUCTIONS:
        raise UsageError(f"op {op!r}: must be one of {', '.join(REDUCTIONS)}")


def allgather_ring(rank: int, size: int, *, acknowledge: bool = False) -> Schedule:
    """Ring allgather of ``"data"`` in ``size`` chunks, chunk ``rank`` given here.  Tag ``s``
    is step ``s``; a chunk is sent on only once it was copied into place.  ``acknowledge``:
    as the ring allreduce's (:func:`~fabricd.engines.collectives.algorithms.allreduce_ring`),
    an empty message to the left once every message from it is in (tag ``size - 1``), and
    the round here ends only with the right neighbour's: nothing of the round still reads
    ``"data"``, which in place is the caller's output.  Every rank must agree on it."""
    _check(rank, size)
    ops = [Op.nop()]
    right, left = (rank + 1) % size, (rank - 1) % size
    last = _CALL
    recvs = []
    for step in range(size - 1):
        mine, theirs = chunk((rank - step) % size), chunk((rank - step - 1) % size)
        ops.append(Op.send(right, mine, tag=step, after=(last,)))
        ops.append(Op.recv(left, slot(left, step), tag=step))
        recvs.append(len(ops) - 1)
        ops.append(Op.compute("copy", theirs, (slot(left, step),), after=(_CALL, len(ops) - 1)))
        last = len(ops) - 1
    if acknowledge and size > 1:
        ops.append(Op.send(left, EMPTY, tag=size - 1, after=tuple(recvs)))
        ops.append(Op.recv(right, EMPTY, tag=size - 1))
    return Schedule(ops=tuple(ops), activation=_CALL)


def reduce_scatter_ring(rank: int, size: int, op: str) -> Schedule:
    """Ring reduce-scatter of ``"data"`` in ``size`` chunks: chunk ``rank`` ends complete here
    (divided by the job's size for ``"avg"``, where ``size > 1``).  Tag ``s`` is step ``s``."""
    _check(rank, size, op)
    ops = [Op.nop()]
    right, left = (rank + 1) % size, (rank - 1) % size
    fn = "sum" if op == "avg" else op
    last = _CALL
    for step in range(size - 1):
        mine, theirs = chunk((rank - step - 1) % size), chunk((rank - step - 2) % size)
        ops.append(Op.send(right, mine, tag=step, after=(last,)))
        ops.append(Op.recv(left, slot(left, step), tag=step))
        got = len(ops) - 1
        ops.append(Op.compute(fn, theirs, (theirs, slot(left, step)), after=(_CALL, got)))
        last = len(ops) - 1
    if op == "avg" and size > 1:
        ops.append(Op.compute("div", chunk(rank), (chunk(rank),), after=(last,)))
    return Schedule(ops=tuple(ops), activation=_CALL)


class Blocks:
    """Where each rank's block of ``count`` elements lives in a node's tensor, for a job whose
    rank ``r`` is on node ``ranks[r]``, among ``members`` (sorted node ids): the module's
    "The node's tensor"."""

    def __init__(
        self, kind: str, ranks: tuple[int, ...], members: tuple[int, ...], count: int
    ) -> None:
        if kind not in GATHERS:
            raise UsageError(f"kind {kind!r}: blocks are for {' and '.join(GATHERS)}")
        self.kind, self.count, self.size = kind, count, len(ranks)
        index = {node: i for i, node in enumerate(members)}
        #: the ranks in the tensor's order: by node, then by rank
        self.order = sorted(range(self.size), key=lambda r: (index[ranks[r]], r))
        self.position = {rank: i for i, rank in enumerate(self.order)}
        self.moves = self.order != list(range(self.size))  #: whether blocks are reordered
        edges = [0]
        for node in members:
            edges.append(edges[-1] + ranks.count(node) * count)
        #: element offsets: chunk ``i`` (node ``members[i]``'s blocks) is ``[b[i], b[i + 1])``
        self.bounds = tuple(edges)

    @classmethod
    def of(cls, spec: Spec, ranks: tuple[int, ...], members: tuple[int, ...]) -> Blocks | None:
        """The blocks of ``spec``'s collective, ``None`` unless it is one of :data:`GATHERS`."""
        if spec.kind not in GATHERS:
            return None
        return cls(spec.kind, ranks, members, spec.count)

    @property
    def elements(self) -> int:
        """The node's tensor: every rank's block."""
        return self.size * self.count

    def _block(self, tensor: np.ndarray[Any, Any], rank: int) -> np.ndarray[Any, Any]:
        start = self.position[rank] * self.count
        return tensor[start : start + self.count]

    def give(
        self,
        data: np.ndarray[Any, Any],
        rank: int,
        array: np.ndarray[Any, Any],
        *,
        op: str,
        first: bool,
    ) -> None:
        """Fold local ``rank``'s call (its input ``array``) into the round's ``data``: an
        allgather's block is copied into place; a reduce-scatter's whole input is copied
        (``first``: the node's first call of the round) or reduced in with ``op``."""
        if self.kind == "allgather":
            block = self._block(data, rank)
            if not same(block, array):  # an input that is its block of the output is there
                np.copyto(block, array)
            return
        if self.moves:  # into the tensor's order (a copy: numpy's gather of rows)
            array = array.reshape(self.size, self.count)[self.order].reshape(-1)
        if first:
            np.copyto(data, array)
        else:
            REDUCE[op](data, array, out=data)

    def take(self, result: np.ndarray[Any, Any], rank: int, output: np.ndarray[Any, Any]) -> None:
        """Hand local ``rank``'s call its part of the round's ``result``: every block, in rank
        order (allgather), or its own block, reduced (reduce-scatter)."""
        if self.kind == "reduce_scatter":
            np.copyto(output, self._block(result, rank))
        elif self.moves:
            output.reshape(self.size, self.count)[self.order] = result.reshape(
                self.size, self.count
            )
        elif not same(output, result):  # in place, the result is the output
            np.copyto(output, result)
