"""The collectives facet: allreduce (sync, solo, majority), broadcast, barrier, sync_model.

``fab.allreduce`` and the others come here; the daemon's collective service
(:mod:`fabricd.daemon.services.collectives`) runs each as a *persistent schedule* per
(job, collective name): the first call builds it on every node, later calls reuse it round
after round (eager-SGD §4.1, §4.3).  Only (segment, offset, length, dtype) travels over the
socket; the daemon reads the contribution from the array's shared memory and writes the result
back into it, in place.

Names: a collective is named after its kind (with an allreduce's mode and op) and its array
(``fab.array``'s name, ``@OFFSET`` for a slice that does not start at the array's beginning),
e.g. ``allreduce:solo:avg:grad`` or ``broadcast:0:model`` (a broadcast's root), unless
``name=`` says otherwise.
Every rank must call a collective of one name with the same shape, dtype, op, mode and
algorithm; the daemon refuses a call that disagrees with what the job's first call said.  The
default name does not say the algorithm: two algorithms on one array need two names.

Partial modes (eager-SGD §4.1, §4.2): with ``mode="solo"`` the first rank to call starts the
round and every other rank takes part passively, its daemon contributing what the rank gave
since its last contribution (zeros, or gradients a round missed); with ``mode="majority"`` the
round's initiator, drawn from a seed all ranks share, starts it.  Nothing a rank gives is lost:
a call that comes after its round started gets that round's result (``included`` false) and
its data is added to its next contribution.  A rank more than one round behind gets the latest
result only.

A call that stops being waited for -- Ctrl-C (``KeyboardInterrupt``) or a timeout in
``allreduce()``, or its client closed or its process gone -- is not withdrawn once its data may
have left its node: a sync round's contribution leaves when every rank of the node gave, and
peers reduce it into theirs as it lands, where nothing can take it back out.  So the daemon
keeps it: its round counts this rank's data at every rank, and the rank's next call of that
collective says so in :attr:`Result.kept` -- a restarted trainer's first call is then for the
next round (a failure's message says why).  A sync call whose node had not started the round
(another rank of the node had not called) is withdrawn when its client goes: nothing of it
left the node; the rank's next call gives to that round again, and ``kept`` is ``None``.  In a
process that goes on after the interrupt, the call is still under way (nothing is withdrawn
while the client is open) and its array is still the call's:
:meth:`Collectives.interrupted_collectives` has its handle; the exception's note says so.
docs/architecture.md, "Collectives", has the reasons.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from fabricd.client.handle import Handle
from fabricd.errors import FabricError, Timeout, UsageError
from fabricd.frames.fields import MAX_NAME

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.client import checks
    from fabricd.client.arrays import SharedArrays
    from fabricd.client.connection import Call, Connection
    from fabricd.wire import Meta

Mode = Literal["sync", "solo", "majority"]
Op = Literal["sum", "avg", "max", "min"]
#: what a rank of a partial allreduce gets when it missed rounds (the :class:`Result`'s
#: ``results``): the sum of every result it missed, or only the latest (eager-SGD §4.2)
Late = Literal["sum", "latest"]
LATES: Final = ("sum", "latest")
#: how an allreduce runs between nodes: ``"auto"`` picks by size (recursive doubling for small
#: arrays, the ring or its direct-exchange form for large: the daemon's ``ring_from_bytes``),
#: or the ring, recursive doubling, or the binary tree (MLfabric's Tr-Sync, a baseline)
AllreduceAlgorithm = Literal["auto", "ring", "doubling", "tree", "mlfabric"]
ALGORITHMS: Final = ("auto", "ring", "doubling", "tree", "mlfabric")
MODES: Final = ("sync", "solo", "majority")
OPS: Final = ("sum", "avg", "max", "min")
#: the ops a partial (solo, majority) allreduce takes: a passive rank's zeros must not change
#: the result, which rules out max and min
PARTIAL_OPS: Final = ("sum", "avg")


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What a collective call returns (DESIGN §8).

    ``round``: the round whose result is now in the array (0, 1, ...; per collective name).
    ``included``: whether this call's data is in that result; false when the round had started
    without it (solo, majority), in which case its data goes into the rank's next contribution.
    ``active``: how many ranks contributed data they gave since their last contribution (for
    sync: every rank).
    ``kept``: the round of this rank's previous call of this collective if that call stopped
    being waited for (Ctrl-C, a timeout, its client closed or its process gone) and was kept:
    that round counted its data (solo and majority: that round, or if it had started without
    the data, a later one, as for ``included`` false), so this call is for a later round.
    ``None``: no such call, or it was withdrawn (module docstring).
    ``results``: how many rounds' results the array holds: more than 1 when a solo or
    majority rank had missed rounds and ``late="sum"`` handed it the sum of all it missed
    (``round`` is then the last of them).
    """

    round: int
    included: bool
    active: int
    kept: int | None = None
    results: int = 1


class Collectives:
    """Collective calls over the ranks of a job, on arrays made by ``fab.array()``.

    Between a call and its completion the array must not be touched: the daemon reads the
    contribution from it and writes the result into it.
    """

    def __init__(
        self, connection: Connection, arrays: SharedArrays, job: checks.Membership | None
    ) -> None:
        self._connection = connection
        self._arrays = arrays
        self._job = job
        self._syncs: dict[str, int] = {}  #: sync_model calls per collective name
        #: calls of the blocking methods that stopped waiting and went on (by collective name)
        self._interrupted: dict[str, Handle[Result]] = {}

    def allreduce(
        self,
        array: np.ndarray[Any, Any],
        op: Op = "sum",
        mode: Mode = "sync",
        *,
        name: str | None = None,
        timeout: float | None = None,
        late: Late = "sum",
        algorithm: AllreduceAlgorithm = "auto",
    ) -> Result:
        """Reduce ``array`` over every rank of the job, in place; see :class:`Result`.

        ``op``: ``"sum"``, ``"avg"`` (the sum divided by the job's size; integers floor),
        ``"max"``, ``"min"``; partial modes take ``"sum"`` and ``"avg"`` only.  The array is
        float16/32/64, bfloat16 (``fab.array(name, shape, "bfloat16")``) or int32/64.
        bfloat16 travels as bfloat16 (half float32's bytes) and every step of the reduction
        adds two arrays in float32 and rounds the sum to bfloat16, to nearest, ties to even,
        as torch and gloo do; so a sum of two ranks' arrays is exactly torch's, and of more
        ranks it may differ from a float32 sum rounded once by a few units in the last place
        (docs/torch.md, "bfloat16").  ``late``
        (solo and majority): what a call gets when its rank missed rounds (it was behind, or
        started late): ``"sum"``, the sum of every result it missed, so that each replica
        applies every round's result once and the replicas stay alike; ``"latest"``, only
        the latest result, as eager-SGD's receive buffer (the replicas drift until
        :meth:`sync_model`).  Every rank must pass the same.

        ``algorithm``: how the nodes' contributions meet (the ranks of one node always reduce
        through shared memory first): ``"auto"``, by size (recursive doubling below the
        daemon's ``ring_from_bytes``, 2 MiB by default; from there the ring, in its
        direct-exchange form from 3 to 8 nodes); ``"ring"``; ``"doubling"`` (recursive
        doubling); ``"tree"``, a reduce up a binary tree of the nodes to the first and the
        result back down it (MLfabric's Tr-Sync: 2 (nodes - 1) messages of the whole array, a
        baseline); ``"mlfabric"``, MLfabric-S (sync only): each round a root drawn anew, to
        which the nodes say they are ready; it groups their contributions, in the order they
        became ready, to be summed at other nodes' daemons on links the network monitor sees
        idle (Alg. 3), and sends every node the result (docs/mlfabric.md).  Any mode takes
        the others.  Every rank must pass the same.

        Raises:
            UsageError: a bad argument, or a call that disagrees with the collective's first
                (shape, dtype, op, mode, late, algorithm).
            PeerFailed: sync only: a node of the job went down or a rank left during the round;
                the round's result is undefined (resynchronise the model before going on).
            Timeout: ``timeout`` passed; the call goes on (:meth:`interrupted_collectives`
                has its handle), as after Ctrl-C (the module docstring).
        """
        handle = self.allreduce_async(array, op, mode, name=name, late=late, algorithm=algorithm)
        return self._wait(handle, timeout)

    def allreduce_async(
        self,
        array: np.ndarray[Any, Any],
        op: Op = "sum",
        mode: Mode = "sync",
        *,
        name: str | None = None,
        late: Late = "sum",
        algorithm: AllreduceAlgorithm = "auto",
    ) -> Handle[Result]:
        """Start an allreduce; leave ``array`` alone until ``handle.wait()`` returns."""
        if algorithm not in ALGORITHMS:
            raise UsageError(
                f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, not {algorithm!r}"
            )
        if late not in LATES:
            raise UsageError(f"late must be one of {', '.join(map(repr, LATES))}, not {late!r}")
        if mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
        if op not in OPS:
            raise UsageError(f"op must be one of {', '.join(map(repr, OPS))}, not {op!r}")
        if mode != "sync" and algorithm == "mlfabric":
            raise UsageError("algorithm='mlfabric' (MLfabric-S) is a sync allreduce")
        if mode != "sync" and op not in PARTIAL_OPS:
            raise UsageError(
                f"a {mode} allreduce takes op 'sum' or 'avg': ranks that take part passively "
                f"contribute zeros, which {op!r} would count"
            )
        extra: dict[str, str] = {} if mode == "sync" else {"late": late}
        if algorithm != "auto":
            extra["algorithm"] = algorithm
        return self._start(f"allreduce:{mode}:{op}", array, name, reduce=op, mode=mode, **extra)

    def broadcast(
        self,
        array: np.ndarray[Any, Any],
        root: int = 0,
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Copy rank ``root``'s ``array`` into every rank's, in place (a sync collective)."""
        return self._wait(self.broadcast_async(array, root, name=name), timeout)

    def broadcast_async(
        self, array: np.ndarray[Any, Any], root: int = 0, *, name: str | None = None
    ) -> Handle[Result]:
        """Start a broadcast; leave ``array`` alone until ``handle.wait()`` returns."""
        job = self._joined()
        if type(root) is not int or not 0 <= root < job.size:
            raise UsageError(f"root must be a rank of 0..{job.size - 1}, not {root!r}")
        return self._start(f"broadcast:{root}", array, name, root=root)

    def allgather(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Gather every rank's ``input`` into every rank's ``output``: afterwards
        ``output[r * k:(r + 1) * k]`` holds rank ``r``'s input, on every rank (a sync
        collective; the daemons move each node's blocks once round a ring, never an allreduce
        of a padded array).

        ``input``: a 1-d array of ``k`` elements made by ``fab.array()``; ``output``: one of
        ``size * k`` elements of the same dtype (it may hold ``input``: its own block).  The
        dtypes are an allreduce's, and ``uint8`` (bytes, e.g. pickled objects).  The
        daemon reads ``input`` once the node's round starts and writes ``output`` when the
        call completes: leave both alone until then.  The default name is
        ``allgather:INPUT``, with ``INPUT`` the input's array name.

        Raises:
            UsageError: a bad argument, or a call that disagrees with the collective's first
                (``k``, dtype).
            PeerFailed: a node of the job went down or a rank left during the round; the
                round's result is undefined.
            Timeout: ``timeout`` passed; the call goes on, as :meth:`allreduce`'s does.
        """
        return self._wait(self.allgather_async(input, output, name=name), timeout)

    def allgather_async(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        *,
        name: str | None = None,
    ) -> Handle[Result]:
        """Start an allgather (:meth:`allgather`); leave both arrays alone until
        ``handle.wait()`` returns."""
        self._blocks("allgather", input, output)
        return self._start("allgather", input, name, **self._output(output))

    def reduce_scatter(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        op: Op = "sum",
        *,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        """Reduce ``input`` over every rank and scatter the blocks: afterwards rank ``r``'s
        ``output`` holds ``op`` over every rank's ``input[r * k:(r + 1) * k]`` (a sync
        collective; each node's daemon sends ``(nodes - 1) / nodes`` of the array once, round
        a ring: half an allreduce's bytes).

        ``input``: a 1-d array of ``size * k`` elements made by ``fab.array()``; ``output``:
        one of ``k`` elements of the same dtype.  ``op``: as :meth:`allreduce`'s (``"avg"``
        divides by the job's size; integers floor).  The default name is
        ``reduce_scatter:OP:INPUT``.  Raises as :meth:`allgather`, and a call that disagrees
        on ``op``.
        """
        return self._wait(self.reduce_scatter_async(input, output, op, name=name), timeout)

    def reduce_scatter_async(
        self,
        input: np.ndarray[Any, Any],
        output: np.ndarray[Any, Any],
        op: Op = "sum",
        *,
        name: str | None = None,
    ) -> Handle[Result]:
        """Start a reduce-scatter (:meth:`reduce_scatter`); leave both arrays alone until
        ``handle.wait()`` returns."""
        if op not in OPS:
            raise UsageError(f"op must be one of {', '.join(map(repr, OPS))}, not {op!r}")
        self._blocks("reduce_scatter", input, output)
        fields = self._output(output)
        return self._start(f"reduce_scatter:{op}", input, name, reduce=op, **fields)

    def barrier(self, *, name: str = "barrier", timeout: float | None = None) -> Result:
        """Return once every rank of the job called ``barrier`` of this name."""
        return self._wait(self.barrier_async(name=name), timeout)

    def barrier_async(self, *, name: str = "barrier") -> Handle[Result]:
        """Enter the barrier; ``handle.wait()`` returns once every rank entered it."""
        self._joined()
        return self._submit({"kind": "barrier", "name": _name(name)})

    def sync_model(
        self,
        array: np.ndarray[Any, Any],
        *,
        every: int = 1,
        root: int | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> Result | None:
        """Synchronise the model ``array`` across ranks every ``every``-th call (eager-SGD §5).

        Partial allreduce lets replicas drift (a rank more than one round behind sees only the
        latest result); the paper resynchronises the models every few epochs.  With ``root``
        ``None`` the replicas are averaged (a sync allreduce ``avg``); with a rank, that rank's
        model replaces every other (a broadcast), which is also how a restarted trainer fetches
        the current model before it contributes again.  Every rank must make the same sequence
        of calls; returns ``None`` on the calls that do not synchronise.
        """
        handle = self.sync_model_async(array, every=every, root=root, name=name)
        return None if handle is None else self._wait(handle, timeout)

    def sync_model_async(
        self,
        array: np.ndarray[Any, Any],
        *,
        every: int = 1,
        root: int | None = None,
        name: str | None = None,
    ) -> Handle[Result] | None:
        """Count a :meth:`sync_model` call and, on every ``every``-th, start the
        synchronisation: ``None`` on the calls that do not synchronise, else a handle whose
        ``wait()`` returns its :class:`Result`; leave ``array`` alone until then."""
        if type(every) is not int or every < 1:
            raise UsageError(f"every must be an int >= 1, not {every!r}")
        key = name or self._arrays.find(array)[2]
        calls = self._syncs.get(key, 0) + 1
        self._syncs[key] = calls
        if calls % every:
            return None
        label = f"sync_model:{key}"
        if root is None:
            return self.allreduce_async(array, "avg", "sync", name=label)
        return self.broadcast_async(array, root, name=label)

    def interrupted_collectives(self) -> dict[str, Handle[Result]]:
        """The calls of the blocking methods (``allreduce()``, ``broadcast()``, ``barrier()``,
        ``sync_model()``) that stopped waiting -- Ctrl-C, a timeout -- and are still under way,
        by collective name.  Each is kept by the daemon: its round counts this rank's data and
        writes its result into its array, which stays the call's until then.  ``wait()`` on
        one takes its result; the next call of that name refuses to start while one is under
        way (the rank would have two calls open), and once it has ended says its round in
        :attr:`Result.kept`."""
        return {n: h for n, h in self._interrupted.items() if not h.done()}

    # -- helpers ----------------------------------------------------------------------------
    def _wait(self, handle: Handle[Result], timeout: float | None) -> Result:
        """Wait for a blocking method's call.  One that stops waiting while the call goes on
        (Ctrl-C, a timeout) keeps its handle, and the exception says what became of the
        call: it is not withdrawn (the module docstring)."""
        try:
            return handle.wait(timeout)
        except BaseException as exc:
            if isinstance(exc, FabricError) and not isinstance(exc, Timeout):
                raise  # the call ended (it failed): nothing goes on
            assert isinstance(handle, _Named)  # (every facet's call makes one)
            self._interrupted[handle.collective] = handle
            exc.add_note(
                f"fabricd: {handle.what} goes on: it was not withdrawn, so its round counts "
                "this rank's data and its result will be written into its array (leave the "
                "array alone until then); fab.interrupted_collectives() has its handle, and "
                "the next call of this collective says the round in Result.kept"
            )
            raise

    def _submit(self, request: dict[str, Any]) -> _Named:
        """Send a collective request, once no call of its collective that a blocking method
        stopped waiting for is under way.

        Raises:
            UsageError: one is (the rank would have two calls of the collective open).
        """
        collective = request["name"]
        kept = None
        earlier = self._interrupted.get(collective)
        if earlier is not None:
            if not earlier.done():
                raise UsageError(
                    f"{earlier.what} stopped waiting and is still under way (kept: its round "
                    "counts this rank's data and writes its result into its array): wait for "
                    f"it, fab.interrupted_collectives()[{collective!r}].wait(), before calling "
                    "it again"
                )
            del self._interrupted[collective]
            with contextlib.suppress(FabricError):  # failed: nothing of it was kept
                kept = earlier.wait(0).round
        what = f"{request['kind']} {collective!r}"
        call = self._connection.submit("collective", request, what=what)
        return _Named(self._connection, call, partial(_result, kept=kept), collective)

    def _blocks(self, kind: str, input: object, output: object) -> None:
        """Check an allgather's or reduce-scatter's arrays: 1-d numpy arrays of one dtype, of
        ``k`` and ``size * k`` elements (allgather), or ``size * k`` and ``k``.

        Raises:
            UsageError: they are not.
        """
        size = self._joined().size
        if not isinstance(input, np.ndarray) or not isinstance(output, np.ndarray):
            raise UsageError(f"a {kind} takes numpy arrays made by fab.array(), input and output")
        if input.ndim != 1 or output.ndim != 1:
            raise UsageError(f"a {kind} takes 1-d arrays, not {input.shape} and {output.shape}")
        if input.dtype != output.dtype:
            raise UsageError(
                f"a {kind}'s input ({input.dtype}) and output ({output.dtype}) must have one dtype"
            )
        k = input.size if kind == "allgather" else output.size
        given, wanted = (k, size * k) if kind == "allgather" else (size * k, k)
        if (input.size, output.size) != (given, wanted):
            shape = "k and size * k" if kind == "allgather" else "size * k and k"
            raise UsageError(
                f"a {kind} in a job of {size} ranks takes an input and an output of {shape} "
                f"elements: {given} and {wanted} here, not {input.size} and {output.size}"
            )

    def _output(self, output: np.ndarray[Any, Any]) -> dict[str, Any]:
        """An allgather's or reduce-scatter's output, as its request says it."""
        seg, offset, _ = self._arrays.find(output)
        if not output.flags.writeable:
            raise UsageError("a collective writes its result into output: it cannot be read-only")
        return {"out_seg": seg, "out_off": offset, "out_nbytes": output.nbytes}

    def _joined(self) -> checks.Membership:
        if self._job is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        return self._job

    def _start(
        self, what: str, array: np.ndarray[Any, Any], name: str | None, **fields: Any
    ) -> Handle[Result]:
        """``what``: the kind, with an allreduce's mode and op (``allreduce:solo:sum``) or a
        broadcast's root, which the default name starts with: one array may serve several
        modes, ops and roots, each its own persistent schedule."""
        self._joined()
        seg, offset, label = self._arrays.find(array)
        if not array.flags.writeable and "out_seg" not in fields:  # (else it is only read)
            raise UsageError(f"a {what} writes its result into the array: it cannot be read-only")
        request = {
            "kind": what.partition(":")[0],
            "name": _name(name if name is not None else f"{what}:{label}"),
            "seg": seg,
            "off": offset,
            "nbytes": array.nbytes,
            "dtype": array.dtype.name,
            **fields,
        }
        return self._submit(request)


class _Named(Handle[Result]):
    """A collective call's handle, which knows its collective's name."""

    def __init__(
        self,
        connection: Connection,
        call: Call,
        result: Callable[[Meta], Result],
        collective: str,
    ) -> None:
        super().__init__(connection, call, result)
        self.collective = collective


def _name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise UsageError(f"a collective name is a str of 1 to {MAX_NAME} characters, not {name!r}")
    return name


def _result(reply: Meta, kept: int | None = None) -> Result:
    """``kept``: the round of an earlier call of this client that a blocking method stopped
    waiting for (the daemon says it of a call abandoned by an earlier client of the rank)."""
    said = reply.get("kept")
    return Result(
        round=int(reply["round"]),
        included=bool(reply["included"]),
        active=int(reply["active"]),
        kept=kept if said is None else int(said),
        results=int(reply.get("results", 1)),
    )
