"""What every call and every node of one persistent collective agree on, and what the
collective engine (:mod:`fabricd.engines.collectives.persistent`) tells its service to do.

Rules: the collective's :class:`Spec` (checked here, carried in every COLL frame), the
initiator draw of majority mode (eager-SGD §4.2), and the engine's actions
(:class:`Transmit`, :class:`Deliver`, :class:`Fail`).  Kept apart from the engine so that the
service and the tests name them without the engine's internals, and so the engine module stays
within its size budget.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from fabricd.dtypes import REDUCE_DTYPES
from fabricd.engines.collectives import algorithms as collectives
from fabricd.engines.collectives.ledger import MAX_HELD
from fabricd.engines.collectives.partial import LATE
from fabricd.errors import RemoteProtocolError, UsageError

#: the native allgather and reduce-scatter (:mod:`~fabricd.engines.collectives.gather`)
GATHERS: Final = ("allgather", "reduce_scatter")
KINDS: Final = ("allreduce", "broadcast", "barrier", *GATHERS)
MODES: Final = ("sync", "solo", "majority")
#: what an allreduce's caller may ask for: ``"auto"``, the size rule
#: (:func:`~fabricd.engines.collectives.algorithms.choose_allreduce`), or one algorithm
ALGORITHMS: Final = ("auto", "ring", "doubling", "tree", "mlfabric")
#: the tag of a frame that carries only its sender's view (no schedule uses it)
NOTICE: Final = 2**31 - 1
#: how a sync allreduce folds the local ranks' arrays into the node's contribution
REDUCE: Final = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec:
    """What every call of one collective must agree on (its first call fixes it)."""

    kind: str  #: allreduce, broadcast, barrier, allgather, reduce_scatter
    #: elements of each rank's array (allgather, reduce_scatter: of each rank's block, its
    #: input and its output respectively)
    count: int = 0
    dtype: str = "uint8"
    op: str = "sum"  #: allreduce, reduce_scatter
    mode: str = "sync"  #: allreduce: sync, solo, majority
    root: int = 0  #: broadcast: the rank whose array everyone gets
    ring: bool = False  #: allreduce: ring (else recursive doubling), chosen by the first call
    #: allreduce, with ``ring``: its reduce-scatter and allgather by direct exchange with every
    #: node instead of round the ring (the same bytes in fewer steps), chosen likewise
    direct: bool = False
    #: partial modes: what a rank that missed rounds gets: ``"sum"``, the sum of the results
    #: it missed, or ``"latest"``, the latest one (eager-SGD §4.2's receive buffer)
    late: str = "sum"
    #: allreduce: the algorithm its callers asked for (:data:`ALGORITHMS`): ``"auto"`` leaves
    #: ``ring`` and ``direct`` to the first call's size rule; ``"ring"`` is the ring proper
    #: (not its direct-exchange form), ``"doubling"`` recursive doubling, ``"tree"`` the
    #: binary tree (Tr-Sync), ``"mlfabric"`` MLfabric-S (a root per round, Alg. 3's groups;
    #: :mod:`~fabricd.engines.collectives.mlfabric`), which neither flag marks
    algorithm: str = "auto"

    @property
    def partial(self) -> bool:
        return self.mode != "sync"

    @property
    def tree(self) -> bool:
        """Whether it runs the binary-tree allreduce."""
        return self.kind == "allreduce" and self.algorithm == "tree"

    @property
    def mlfabric(self) -> bool:
        """Whether it runs MLfabric-S (:mod:`~fabricd.engines.collectives.mlfabric`)."""
        return self.kind == "allreduce" and self.algorithm == "mlfabric"

    @property
    def doubling(self) -> bool:
        """Whether it runs recursive doubling (whose sends must be copies: the layout's
        module docstring, "Buffers")."""
        return self.kind == "allreduce" and not self.ring and not self.tree and not self.mlfabric

    def describe(self, against: Spec | None = None) -> str:
        """In words; an allreduce's algorithm is named when asked for, or when ``against``
        (the spec it is told apart from) asked for another."""
        named = self.algorithm != "auto" or (against is not None and against.algorithm != "auto")
        by = f", algorithm {self.algorithm}" if named else ""
        match self.kind:
            case "allreduce" if self.partial:
                return (
                    f"{self.mode} allreduce {self.op} of {self.count} {self.dtype} "
                    f"(late {self.late}){by}"
                )
            case "allreduce":
                return f"{self.mode} allreduce {self.op} of {self.count} {self.dtype}{by}"
            case "broadcast":
                return f"broadcast of {self.count} {self.dtype} from rank {self.root}"
            case "allgather":
                return f"allgather of {self.count} {self.dtype} a rank"
            case "reduce_scatter":
                return f"reduce_scatter {self.op} of {self.count} {self.dtype} a rank"
            case _:
                return "barrier"

    def same_call(self, other: Spec) -> bool:
        """Whether ``other`` (a call's spec) agrees with this one: ``algorithm``, what the caller
        asked for, must be the same; ``ring`` and ``direct`` are not compared (under
        ``"auto"`` the first call chose them once, for everyone)."""
        return self == Spec(**{**_fields(other), "ring": self.ring, "direct": self.direct})

    def to_meta(self) -> dict[str, Any]:
        return _fields(self)

    @classmethod
    def from_meta(cls, meta: object) -> Spec:
        """Raises RemoteProtocolError: not a spec a daemon of this release sends."""
        if not isinstance(meta, dict):
            raise RemoteProtocolError("a collective frame's spec must be a map")
        try:
            spec = cls(**meta)
        except TypeError as exc:
            raise RemoteProtocolError(f"a collective frame's spec is malformed: {exc}") from None
        try:
            spec.check()
        except UsageError as exc:
            raise RemoteProtocolError(f"a collective frame's spec is invalid: {exc}") from None
        return spec

    def check(self) -> None:
        """Raises UsageError: a field out of its range."""
        if self.kind not in KINDS or self.mode not in MODES:
            raise UsageError(f"kind must be one of {KINDS} and mode one of {MODES}")
        if type(self.count) is not int or self.count < 0 or type(self.root) is not int:
            raise UsageError("count and root must be ints, count >= 0")
        if (
            self.dtype not in _DTYPES
            or type(self.ring) is not bool
            or type(self.direct) is not bool
        ):
            raise UsageError(f"dtype must be one of {', '.join(_DTYPES)}")
        if self.direct and not self.ring:  # (direct exchange replaces the ring: no ring, no it)
            raise UsageError("direct exchange is a form of the ring allreduce: direct needs ring")
        self._check_algorithm()
        if self.op not in collectives.REDUCTIONS:
            raise UsageError(f"op must be one of {', '.join(collectives.REDUCTIONS)}")
        if self.kind in GATHERS and self.ring:
            raise UsageError(f"a {self.kind} runs its own ring: ring is for an allreduce")
        if self.kind == "allgather" and self.op != "sum":
            raise UsageError("an allgather reduces nothing: op is for an allreduce")
        if self.partial and (self.kind != "allreduce" or self.op not in ("sum", "avg")):
            raise UsageError("solo and majority are allreduce modes, with op sum or avg")
        if self.late not in LATE:
            raise UsageError(f"late must be one of {', '.join(map(repr, LATE))}")

    def _check_algorithm(self) -> None:
        """Raises UsageError: an algorithm that is not one, or that ``ring`` and ``direct``
        contradict (:func:`asked` sets them)."""
        if not isinstance(self.algorithm, str) or self.algorithm not in ALGORITHMS:
            raise UsageError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}")
        if self.kind != "allreduce" and self.algorithm != "auto":
            raise UsageError(f"a {self.kind} has one algorithm: algorithm is for an allreduce")
        if self.algorithm != "auto" and (self.ring != (self.algorithm == "ring") or self.direct):
            raise UsageError(f"algorithm {self.algorithm!r} contradicts ring and direct")
        if self.algorithm == "mlfabric" and self.partial:
            raise UsageError("algorithm 'mlfabric' (MLfabric-S) is a sync allreduce")


_DTYPES: Final = (*REDUCE_DTYPES, "uint8")


def asked(spec: Spec) -> Spec:
    """``spec`` with ``ring`` and ``direct`` set as its caller's algorithm says, if it named
    one (``"auto"``: left to :func:`chosen`, once every rank's node is known)."""
    if spec.kind != "allreduce" or spec.algorithm == "auto":
        return spec
    return replace(spec, ring=spec.algorithm == "ring", direct=False)


def chosen(spec: Spec, nodes: int, *, ring_from_bytes: int) -> Spec:
    """``spec`` with its algorithm fixed for ``nodes`` member nodes: the one its caller named,
    or under ``"auto"`` what :func:`~fabricd.engines.collectives.algorithms.choose_allreduce`
    picks for its size (the first call's: ``ring_from_bytes`` is its daemon's setting)."""
    if spec.kind != "allreduce" or spec.algorithm != "auto":
        return asked(spec)
    nbytes = spec.count * np.dtype(spec.dtype).itemsize
    picked = collectives.choose_allreduce(nodes, nbytes, ring_from_bytes=ring_from_bytes)
    direct = picked is collectives.Algorithm.DIRECT
    return replace(spec, ring=direct or picked is collectives.Algorithm.RING, direct=direct)


def algorithm(spec: Spec) -> collectives.Algorithm:
    """The allreduce algorithm ``spec`` runs (once :func:`chosen`)."""
    if spec.kind in GATHERS:  # (each is one phase of the ring allreduce)
        return collectives.Algorithm.RING
    if spec.tree:
        return collectives.Algorithm.TREE
    if spec.mlfabric:
        return collectives.Algorithm.MLFABRIC
    if spec.direct:
        return collectives.Algorithm.DIRECT
    return collectives.Algorithm.RING if spec.ring else collectives.Algorithm.RECURSIVE_DOUBLING


def in_place(spec: Spec, ranks: tuple[int, ...], node: int) -> bool:
    """Whether node ``node`` (``ranks``: the node of every rank) runs ``spec`` in its only
    rank's array (the engine's "In place"): a sync ring allreduce, or an allgather into the
    rank's output where every node's ranks are consecutive (the node's tensor is then the
    output, block for block: :class:`~fabricd.engines.collectives.gather.Blocks`).  A
    reduce-scatter never does: it would reduce into the caller's input."""
    if spec.partial or ranks.count(node) != 1:
        return False
    if spec.kind == "allgather":
        return list(ranks) == sorted(ranks)
    return spec.kind == "allreduce" and spec.ring


def held_bytes(spec: Spec, nodes: int, *, inplace: bool, local: int = 1, size: int = 1) -> int:
    """The most bytes a node's collective of ``spec`` among ``nodes`` member nodes, ``local``
    of the job's ranks on it, ever holds:
    what the daemon's byte budget charges before building it (:mod:`fabricd.engines.budget`).

    A bound, not the exact figure, so that it holds for every later view too (a node lost
    makes the ring's chunks larger, never the sum of its slots).  With ``T`` the tensor's bytes
    (partial modes carry one more element, the active count): ``data`` and ``result`` (in
    place they are the callers' arrays, but a call that fails or leaves mid-round leaves the
    round a copy of its array: one ``T``), partial modes' accumulator and snapshot and the
    snapshots of abandoned rounds held (:data:`~fabricd.engines.collectives.ledger.MAX_HELD`),
    and under
    ``late="sum"`` what each local rank missed (one ``T`` a rank, while it is behind), and the
    landing slots, one per receive and per round parity: the ring's and the direct
    exchange's receives of one round add up to under ``2T`` (in place only the
    reduce-scatter's, under ``T``, one slot for both parities), recursive doubling's to at
    most ``T`` per step (``ceil(log2 nodes)`` steps and two more for a size that is no power
    of two), the binary tree's to ``3T`` (two children's and the parent's), a broadcast's
    one message of ``T``; a barrier's messages are empty.  MLfabric-S
    (:mod:`~fabricd.engines.collectives.mlfabric`) holds, for each of the two rounds it may
    hold at once, the root's total and, per other member node, up to two messages landing (a
    part and a group's sum), a part held for its GATHER and a group summed here: ``8`` a node.
    An allgather's or reduce-scatter's tensor is every one of the job's ``size`` ranks'
    blocks; its ring's receives of one round add up to under ``T``.
    """
    blocks = size if spec.kind in GATHERS else 1
    tensor = (spec.count * blocks + (1 if spec.partial else 0)) * np.dtype(spec.dtype).itemsize
    own = (1 if inplace else 2) + (2 + MAX_HELD if spec.partial else 0)
    if spec.partial and spec.late == "sum":
        own += local
    if spec.mlfabric:
        return tensor * (2 + 2 * (1 + 4 * max(nodes - 1, 0)))
    match spec.kind:
        case "barrier":
            slots = 0
        case "broadcast" | "allgather" | "reduce_scatter":
            slots = 2
        case _ if inplace:
            slots = 1
        case _ if spec.tree:  # two children's messages and the parent's
            slots = 6
        case _ if spec.ring:
            slots = 4
        case _:
            slots = 2 * ((nodes - 1).bit_length() + 2)
    return tensor * (own + slots)


def _fields(spec: Spec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "count": spec.count,
        "dtype": spec.dtype,
        "op": spec.op,
        "mode": spec.mode,
        "root": spec.root,
        "ring": spec.ring,
        "direct": spec.direct,
        "late": spec.late,
        "algorithm": spec.algorithm,
    }


def initiator(job: str, name: str, round: int, size: int, live: frozenset[int]) -> int:
    """The rank that starts round ``round`` of a majority allreduce (eager-SGD §4.2).

    Drawn uniformly from ``0 .. size - 1`` by a hash of (job, name, round): every node computes
    the same rank with no message, and over many rounds each rank initiates equally often.  A
    drawn rank that is not ``live`` (its trainer left or its node went down) passes the turn to
    the next live rank above it (cyclically), so a round always has an initiator while any rank
    lives; nodes that briefly disagree on who lives may start a round twice (absorbed, like any
    simultaneous initiators) but never leave it without one once they agree.
    """
    digest = hashlib.blake2b(f"{job}\0{name}\0{round}".encode(), digest_size=8).digest()
    drawn = int.from_bytes(digest, "little") % size
    for step in range(size):
        rank = (drawn + step) % size
        if rank in live:
            return rank
    return drawn


# -- actions --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Transmit:
    """Send message ``tag`` of round ``round`` (``payload``: may be empty) to ``node``, saying
    the sender's view (``lost``, ``base``).  ``payload`` is a view of the collective's buffers
    that stays unchanged until the frame has surely left (the module docstring says why), or
    a copy where the schedule overwrites it sooner."""

    node: int
    round: int
    tag: int
    payload: memoryview
    lost: tuple[int, ...]
    base: int
    #: a NOTICE's word on the views its sender left: (lost, base, last round ended there)
    notes: tuple[tuple[tuple[int, ...], int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Deliver:
    """Call ``token`` is complete: its array holds round ``round``'s result, or (``results``
    > 1, ``late="sum"``) the sum of the ``results`` results its rank missed, up to round
    ``round``'s.  ``kept``: the round of its rank's previous call, if that call's client
    stopped waiting for it and the round kept its data
    (:meth:`~fabricd.engines.collectives.persistent.Collective.abandon`)."""

    token: int
    round: int
    included: bool
    active: int
    kept: int | None = None
    results: int = 1

    def reply(self) -> dict[str, int | bool]:
        """The client's answer: ``round``, ``included``, ``active``, ``kept`` if set, and
        ``results`` if not 1."""
        reply: dict[str, int | bool] = {
            "round": self.round,
            "included": self.included,
            "active": self.active,
        }
        if self.kept is not None:
            reply["kept"] = self.kept
        if self.results != 1:
            reply["results"] = self.results
        return reply


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """Call ``token`` failed (``code``, ``message``); its array is undefined."""

    token: int
    code: str
    message: str
    node: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Settle:
    """In place: round ``round``'s result is whole in its caller's array.  If nothing this node
    sent to ``nodes`` is still held in this process (the transport's queue included), say so
    with :meth:`~fabricd.engines.collectives.persistent.Collective.sent` and the call completes
    now; else it completes with the round's acknowledgements, which prove the same."""

    round: int
    nodes: tuple[int, ...]


Action = Transmit | Deliver | Fail | Settle
