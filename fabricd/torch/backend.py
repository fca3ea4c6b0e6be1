"""The ``torch.distributed`` backend ``"fabricd"``: existing PyTorch code runs over the daemons.

``import fabricd.torch`` registers it; then::

    dist.init_process_group("fabricd")   # any rendezvous: env://, tcp://, a store
    dist.all_reduce(t); dist.all_gather_single(out, t); ...   # DDP, FSDP, ZeRO: unchanged

How it is built.  torch 2.13 accepts a process group written in Python: a subclass of
``torch.distributed.ProcessGroup`` whose methods (``allreduce``, ``all_gather_single``, ...)
torch's Python API and its C++ callers (DDP's reducer) reach through pybind, registered with
``Backend.register_backend(name, creator, devices=["cpu", "cuda"])`` (torch's own "threaded" test
backend is built this way; ``dist.BackendBase``, which newer documentation describes, is not
in 2.13).  Each process group is one fabricd client: a job of the group's ranks, named by
``$FABRICD_JOB`` for the default group (else drawn by rank 0 and shared through the
rendezvous store, so two runs on one fabric never collide; a subgroup's job is that name and
its own draw), its socket found as :func:`fabricd.connect` finds it.

A call copies its tensors into staging arrays (:mod:`fabricd.torch.staging`; a CUDA tensor
through page-locked ones, device to host and back, the same lines: :mod:`.devices`), starts the
daemon's operations at once, in the caller's thread, and returns a ``Work`` whose future one
thread per process group completes, as each call's operations end: it waits for the daemon,
copies the result out and sets the future (where DDP's ``then`` callbacks run, as on gloo's
threads).  Starting in the caller's thread keeps every rank's calls in the order torch made
them, and lets a later call (a receive) start while an earlier one (a send to a peer that has
not received yet) still waits.  Every call of one operation, dtype and span is one collective
on the daemons, of one name: a collective is built once and warm from its third round, where
a name per call (or per slot of a ring) would build one per name, with buffers the size of
the tensor.  The daemon takes one call of a collective per rank at a time, so a call whose
collective's previous call is still under way is deferred: the group's thread starts it when
that one's operations end (:mod:`fabricd.torch.completion`), in the same order on every
rank.  A call that fails (a rank left: ``PeerFailed``; ``timeout`` passed) fails its future,
so ``wait()`` raises, and never hangs.

What each operation is on the daemons: ``allreduce`` (sum, average, max, min),
``broadcast``, ``allgather`` and ``reduce_scatter`` (sum, average, max, min) are the daemons'
own collectives (the last two one phase of a ring each: no zero-padded allreduce), ``barrier``
theirs; ``allreduce`` with product or a bitwise op gathers every rank's tensor and reduces it
here, and ``reduce_scatter`` with one is an allreduce of which each rank keeps its part;
``reduce`` is an allreduce whose result only the root keeps; ``gather`` an allgather the root
keeps; ``scatter``, ``alltoall`` and ``send``/``recv`` the daemons' point-to-point messages
(tags from 2**30 are the backend's own).  The process group is sync: ``all_reduce`` means
what it means with gloo; eager-SGD's partial modes are in the DDP hook (:mod:`.hook`), where
a training loop chooses them knowingly.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist

import fabricd
from fabricd.errors import UsageError
from fabricd.torch import staging
from fabricd.torch.completion import Call, Completer, Work, all_of, settled
from fabricd.torch.devices import (
    CPU,
    CopyStreams,
    device_of,
    future_for,
    on_device,
    ready,
    settle,
)
from fabricd.torch.staging import (
    Slot,
    Staging,
    as_bytes,
    dense,
    flat_view,
    pack,
    reduce_dtype,
    unpack,
)

if TYPE_CHECKING:
    import datetime
    from collections.abc import Callable, Sequence

    from torch._C._distributed_c10d import Store

    from fabricd.client import Client
    from fabricd.client.collectives import Mode, Op
    from fabricd.client.handle import Handle

P = ParamSpec("P")
R = TypeVar("R")

BACKEND: Final = "fabricd"
#: what a collective that only moves bytes moves them as (the daemons' collectives take the
#: types they reduce): 8-byte words, the last one padded
WORDS: Final = "int64"
#: point-to-point tags from here on are the backend's own (scatter, all-to-all)
INTERNAL_TAGS: Final = 1 << 30
#: barrier names, used round robin: barriers in flight at once
BARRIERS: Final = 8
_R = dist.ReduceOp
#: the reductions the daemons make, by their names there
NATIVE_OPS: Final[dict[Any, Op]] = {_R.SUM: "sum", _R.AVG: "avg", _R.MAX: "max", _R.MIN: "min"}
#: the reductions made here, over every rank's tensor gathered
LOCAL_OPS: Final[dict[Any, Callable[[torch.Tensor], torch.Tensor]]] = {
    _R.PRODUCT: lambda stacked: stacked.prod(dim=0),
    _R.BAND: lambda stacked: _fold(stacked, torch.bitwise_and),
    _R.BOR: lambda stacked: _fold(stacked, torch.bitwise_or),
    _R.BXOR: lambda stacked: _fold(stacked, torch.bitwise_xor),
}


def _fold(
    stacked: torch.Tensor, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    result = stacked[0].clone()
    for row in stacked[1:]:
        result = op(result, row)
    return result


def _giving_back(method: Callable[P, R]) -> Callable[P, R]:
    """A call that fails before it is under way gives back the staging slots it took."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except BaseException:
            group = args[0]
            assert isinstance(group, FabricdProcessGroup)
            for slot in group._holding():
                group._staging.release(slot)
            group._holding().clear()
            raise

    return call


class FabricdProcessGroup(dist.ProcessGroup):
    """A process group of a fabricd job (module docstring)."""

    def __init__(self, fab: Client, rank: int, size: int, timeout: float, job: str) -> None:
        super().__init__(rank, size)
        self.fab = fab
        self.job = job
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._staging = Staging(fab, "torch")
        self._completer = Completer()
        self._copies = CopyStreams()  #: where the output copies of CUDA calls are made
        self._barriers: collections.deque[Handle[Any]] = collections.deque()
        self._barrier_count = 0
        self._taken = threading.local()  #: slots taken by the call being made (this thread)
        self._internal = 0  #: the backend's point-to-point calls so far (their tags)
        self._last: dict[str, Call] = {}  #: each collective's last call (the next waits for it)
        self._starting = threading.Lock()  #: a call's start and its place after the last
        self._group_name = ""
        self._mode: Mode = "sync"
        self._finalizer = weakref.finalize(self, _close, self._completer, self._staging, fab)

    # -- what torch asks of every process group ---------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._size

    @property
    def allreduce_mode(self) -> Mode:
        """How ``all_reduce`` with sum or average runs: ``"sync"`` (the default: what
        ``all_reduce`` means to every caller, gloo's and nccl's meaning), or eager-SGD's
        ``"solo"`` or ``"majority"``, set explicitly by a training loop that knows its
        ``all_reduce`` calls tolerate ranks that missed a round (they contribute zeros and get
        the result later).  Every rank must set the same, between calls.  Other calls (and
        other reductions) stay sync.  DDP itself is better served by the hook
        (:mod:`fabricd.torch.hook`), which averages over the ranks that took part."""
        return self._mode

    @allreduce_mode.setter
    def allreduce_mode(self, mode: Mode) -> None:
        if mode not in ("sync", "solo", "majority"):
            raise UsageError(f"allreduce_mode is 'sync', 'solo' or 'majority', not {mode!r}")
        self._mode = mode

    def _set_group_name(self, name: str) -> None:
        # (torch names every group it makes; a Python group's C++ side keeps no name it
        # can read back, so it is kept here)
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def __repr__(self) -> str:
        return f"FabricdProcessGroup(job={self.job!r}, rank={self._rank}, size={self._size})"

    def shutdown(self) -> None:
        """Finish nothing more; close the client (``destroy_process_group`` calls it)."""
        self._finalizer()

    abort = shutdown

    # -- reductions -------------------------------------------------------------------------
    @_giving_back
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._allreduce(tensors, _op(opts), "allreduce")

    @_giving_back
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._allreduce(tensors, _op(opts), "allreduce_coalesced")

    @_giving_back
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        return self._allreduce(tensors, _op(opts), "reduce", keep=self._rank == root)

    def _allreduce(self, tensors: list[torch.Tensor], op: Any, what: str, keep: bool = True) -> Any:
        device = device_of(tensors, what)
        copies, write_back = dense(tensors)
        flats = [flat_view(t, what) for t in copies]
        if len({f.dtype for f in flats}) > 1:
            raise UsageError(f"the fabricd backend's {what} takes tensors of one dtype")
        if op in LOCAL_OPS:
            return self._reduce_here(flats, op, what, keep, write_back)
        if op not in NATIVE_OPS:
            raise UsageError(f"the fabricd backend's {what} does not do {op}")
        dtype = flats[0].dtype
        name = reduce_dtype(dtype, what)
        parts = [torch.view_as_real(f).reshape(-1) if f.is_complex() else f for f in flats]
        if flats[0].is_complex() and op not in (_R.SUM, _R.AVG):
            raise UsageError(f"the fabricd backend's {what} of {dtype} sums or averages only")
        count = sum(p.numel() for p in parts)
        mode = self._mode if what == "allreduce" and op in (_R.SUM, _R.AVG) else "sync"
        slot = self._take(name, count, device)
        span = staging.span_for(count, slot.array.itemsize)
        stage = staging.tensor_of(slot.array)
        pack(parts, stage)
        collective = f"torch:ar:{NATIVE_OPS[op]}:{mode}:{name}:{span}"
        array = slot.array[:span]

        def start() -> list[Handle[Any]]:
            return [self.fab.allreduce_async(array, NATIVE_OPS[op], mode, name=collective)]

        def finish() -> list[torch.Tensor]:
            if keep:
                unpack(stage, parts)
                write_back()
            return tensors

        return self._call(what, start, finish, [slot], device, collective)

    def _reduce_here(
        self,
        flats: list[torch.Tensor],
        op: Any,
        what: str,
        keep: bool,
        write_back: Callable[[], None],
    ) -> Any:
        """Product and bitwise reductions: every rank's tensors gathered, reduced here."""
        if op != _R.PRODUCT and (flats[0].is_floating_point() or flats[0].is_complex()):
            raise UsageError(f"the fabricd backend's {what} with {op} takes integers or bool")
        joined = torch.cat(flats) if len(flats) > 1 else flats[0]
        gathered = torch.empty((self._size, joined.numel()), dtype=joined.dtype)
        gathering = self._gather_start(as_bytes(joined))

        def finish() -> list[torch.Tensor]:
            gathering.unstage(as_bytes(gathered).reshape(self._size, -1))
            if keep:
                unpack(LOCAL_OPS[op](gathered), flats)
                write_back()
            return flats

        return self._gathered(what, gathering, finish)

    # -- moving -----------------------------------------------------------------------------
    @_giving_back
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        device = device_of(tensors, "broadcast")
        copies, write_back = dense(tensors)
        parts = [as_bytes(flat_view(t, "broadcast")) for t in copies]
        count = _words(sum(p.numel() for p in parts))
        slot = self._take(WORDS, count, device)
        span = staging.span_for(count, slot.array.itemsize)
        stage = _bytes_of(slot)
        if self._rank == root:
            pack(parts, stage)
        collective = f"torch:bc:{root}:{span}"
        array = slot.array[:span]

        def start() -> list[Handle[Any]]:
            return [self.fab.broadcast_async(array, root, name=collective)]

        def finish() -> list[torch.Tensor]:
            if self._rank != root:
                unpack(stage, parts)
                write_back()
            return tensors

        return self._call("broadcast", start, finish, [slot], device, collective)

    @_giving_back
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        if len(inputs) != 1 or len(outputs) != 1 or len(outputs[0]) != self._size:
            raise UsageError(
                f"the fabricd backend's allgather takes one input and {self._size} outputs"
            )
        device_of([*inputs, *outputs[0]], "allgather")
        source = as_bytes(flat_view(inputs[0].contiguous(), "allgather"))
        for out in outputs[0]:
            if out.dtype != inputs[0].dtype or out.numel() != inputs[0].numel():
                raise UsageError("the fabricd backend's allgather takes equal tensors")
        gathering = self._gather_start(source)

        def finish() -> list[list[torch.Tensor]]:
            rows = [as_bytes(flat_view(out, "allgather")) for out in outputs[0]]
            gathering.unstage(rows)
            return outputs

        return self._gathered("allgather", gathering, finish)

    @_giving_back
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        device_of([input, output], "all_gather_single")
        source = as_bytes(flat_view(input.contiguous(), "all_gather_single"))
        target = as_bytes(flat_view(output, "all_gather_single"))
        if output.dtype != input.dtype or target.numel() != source.numel() * self._size:
            raise UsageError(
                f"the fabricd backend's all_gather_single needs an output of {self._size} "
                "times the input, of its dtype"
            )
        gathering = self._gather_start(source)

        def finish() -> list[torch.Tensor]:
            gathering.unstage(target.reshape(self._size, -1))
            return [output]

        return self._gathered("all_gather_single", gathering, finish)

    _allgather_base = all_gather_single

    @_giving_back
    def allgather_coalesced(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        """``outputs[r][i]`` becomes rank r's ``inputs[i]``: one allgather of them all."""
        what = "allgather_coalesced"
        device = device_of([*inputs, *(t for row in outputs for t in row)], what)
        sources = [as_bytes(flat_view(t, what)) for t in inputs]
        if len(outputs) != self._size or any(len(row) != len(inputs) for row in outputs):
            raise UsageError(f"the fabricd backend's {what} takes {self._size} output lists")
        joined = torch.cat(sources) if sources else torch.empty(0, dtype=torch.uint8, device=device)
        gathering = self._gather_start(joined)

        def finish() -> list[list[torch.Tensor]]:
            rows = torch.empty((self._size, joined.numel()), dtype=torch.uint8)
            gathering.unstage(rows)
            for r in range(self._size):
                unpack(rows[r], [as_bytes(flat_view(t, what)) for t in outputs[r]])
            return outputs

        return self._gathered(what, gathering, finish)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """Each pair as :meth:`all_gather_single`; one Work for them all."""
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_giving_back
    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        root = opts.rootRank if opts is not None else 0
        device_of([*inputs, *(t for row in outputs for t in row)], "gather")
        source = as_bytes(flat_view(inputs[0], "gather"))
        gathering = self._gather_start(source)

        def finish() -> list[list[torch.Tensor]]:
            if self._rank == root:
                gathering.unstage([as_bytes(flat_view(o, "gather")) for o in outputs[0]])
            return outputs

        return self._gathered("gather", gathering, finish)

    def _gather_start(self, source: torch.Tensor) -> _Gathering:
        """Stage gathering every rank's ``source`` bytes (the daemons' allgather)."""
        nbytes = source.numel()
        chunk = staging.span_for(nbytes, 1)
        every = self._take("uint8", chunk * self._size, source.device)
        rows = torch.from_numpy(every.array[: chunk * self._size]).reshape(self._size, chunk)
        rows[self._rank, :nbytes].copy_(source)  # given in its own block (MPI_IN_PLACE)
        name = f"torch:ag:{chunk}"
        output = every.array[: chunk * self._size]
        inputs = output[self._rank * chunk : (self._rank + 1) * chunk]

        def start() -> list[Handle[Any]]:
            return [self.fab.allgather_async(inputs, output, name=name)]

        def unstage(into: Any) -> None:
            for r in range(self._size):
                into[r].copy_(rows[r, :nbytes])

        return _Gathering(name, start, [every], unstage, source.device)

    def _gathered(self, what: str, gathering: _Gathering, finish: Callable[[], object]) -> Any:
        return self._call(
            what, gathering.start, finish, gathering.slots, gathering.device, gathering.name
        )

    @_giving_back
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        if len(outputs) != 1 or len(inputs) != 1 or len(inputs[0]) != self._size:
            raise UsageError(
                f"the fabricd backend's reduce_scatter takes {self._size} inputs and one output"
            )
        device_of([*outputs, *inputs[0]], "reduce_scatter")
        whole = torch.cat([flat_view(t, "reduce_scatter") for t in inputs[0]])
        return self._scatter_reduced(outputs[0], whole, _op(opts), "reduce_scatter")

    @_giving_back
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        device_of([input, output], "reduce_scatter_single")
        whole = flat_view(input, "reduce_scatter_single")
        return self._scatter_reduced(output, whole, _op(opts), "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """Each pair as :meth:`reduce_scatter_single`; one Work for them all."""
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return all_of(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _scatter_reduced(
        self, output: torch.Tensor, whole: torch.Tensor, op: Any, what: str
    ) -> Any:
        """Rank r's ``output`` becomes ``op`` over every rank's r-th part of ``whole``: the
        daemons' reduce-scatter (product, bitwise and complex: an allreduce, the part kept)."""
        target = flat_view(output, what)
        k = target.numel()
        if whole.numel() != k * self._size or whole.dtype != target.dtype:
            raise UsageError(
                f"the fabricd backend's {what} needs an input of {self._size} times the output"
            )
        if op not in NATIVE_OPS or whole.is_complex():
            return self._allreduced_part(target, whole.clone(), op, what, output)
        name = reduce_dtype(whole.dtype, what)
        itemsize = torch.empty(0, dtype=whole.dtype).element_size()
        chunk = staging.span_for(k, itemsize)
        every = self._take(name, chunk * self._size, whole.device)
        mine = self._take(name, chunk, whole.device)
        parts = staging.tensor_of(every.array[: chunk * self._size]).reshape(self._size, chunk)
        parts[:, :k].copy_(whole.reshape(self._size, k))
        collective = f"torch:rs:{NATIVE_OPS[op]}:{name}:{chunk}"
        inputs, result = every.array[: chunk * self._size], mine.array[:chunk]

        def start() -> list[Handle[Any]]:
            return [self.fab.reduce_scatter_async(inputs, result, NATIVE_OPS[op], name=collective)]

        def finish() -> list[torch.Tensor]:
            target.copy_(staging.tensor_of(mine.array[:k]))
            return [output]

        return self._call(what, start, finish, [every, mine], whole.device, collective)

    def _allreduced_part(
        self, target: torch.Tensor, whole: torch.Tensor, op: Any, what: str, output: torch.Tensor
    ) -> Any:
        """A reduce-scatter the daemons do not make: an allreduce of which this rank keeps
        its part."""
        reduced = self._allreduce([whole], op, what)
        k = target.numel()

        def take_part(future: torch.futures.Future[Any]) -> list[torch.Tensor]:
            future.value()
            target.copy_(whole[self._rank * k : (self._rank + 1) * k])
            settle(target.device)  # (a device-to-device copy: done before the future is)
            return [output]

        return Work(reduced.get_future().then(take_part))

    # -- point to point ---------------------------------------------------------------------
    @_giving_back
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._p2p("send", tensors, dst, _user_tag(tag))

    @_giving_back
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._p2p("recv", tensors, src, _user_tag(tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise UsageError("the fabricd backend receives from a named rank only (recv_anysource)")

    def _p2p(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        device = device_of(tensors, kind)
        copies, write_back = dense(tensors)
        parts = [as_bytes(flat_view(t, kind)) for t in copies]
        count = sum(p.numel() for p in parts)
        slot = self._take("uint8", count, device)
        stage = torch.from_numpy(slot.array)
        if kind == "send":
            pack(parts, stage)
        array = slot.array[:count]

        def start() -> list[Handle[Any]]:
            if kind == "send":
                return [self.fab.send_async(array, peer, tag)]
            return [self.fab.recv_async(array, peer, tag)]

        def finish() -> list[torch.Tensor]:
            if kind == "recv":
                unpack(stage, parts)
                write_back()
            return tensors

        return self._call(f"{kind} with rank {peer} (tag {tag})", start, finish, [slot], device)

    @_giving_back
    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        root = opts.rootRank if opts is not None else 0
        device_of([*outputs, *(t for row in inputs for t in row)], "scatter")
        target = as_bytes(flat_view(outputs[0], "scatter"))
        chunks = (
            [as_bytes(flat_view(t, "scatter")) for t in inputs[0]]
            if self._rank == root
            else [target] * self._size
        )
        return self._exchange("scatter", chunks, [target] * self._size, root=root)

    @_giving_back
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        device_of([*inputs, *outputs], "alltoall")
        sends = [as_bytes(flat_view(t, "alltoall")) for t in inputs]
        receives = [as_bytes(flat_view(t, "alltoall")) for t in outputs]
        return self._exchange("alltoall", sends, receives)

    @_giving_back
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        opts: Any = None,
    ) -> Any:
        device_of([input, output], "all_to_all_single")
        source, target = (
            flat_view(input, "all_to_all_single"),
            flat_view(output, "all_to_all_single"),
        )
        sends = _split(source, input_split_sizes, self._size, input.shape)
        receives = _split(target, output_split_sizes, self._size, output.shape)
        return self._exchange(
            "all_to_all_single", [as_bytes(t) for t in sends], [as_bytes(t) for t in receives]
        )

    alltoall_base = all_to_all_single

    def _exchange(
        self,
        what: str,
        sends: list[torch.Tensor],
        receives: list[torch.Tensor],
        root: int | None = None,
    ) -> Any:
        """Each rank sends ``sends[j]`` to rank ``j`` and receives ``receives[j]`` from it
        (``root``: only the root sends, to every other rank)."""
        if len(sends) != self._size or len(receives) != self._size:
            raise UsageError(f"the fabricd backend's {what} takes {self._size} tensors each way")
        tag = INTERNAL_TAGS + self._internal % INTERNAL_TAGS
        self._internal += 1
        out_bytes, in_bytes = sum(t.numel() for t in sends), sum(t.numel() for t in receives)
        device = receives[0].device
        out_slot = self._take("uint8", out_bytes, device)
        in_slot = self._take("uint8", in_bytes, device)
        handles: list[Handle[Any]] = []
        plans: list[tuple[torch.Tensor, torch.Tensor]] = []
        start_out = start_in = 0
        for peer in range(self._size):
            n_out, n_in = sends[peer].numel(), receives[peer].numel()
            view_out = out_slot.array[start_out : start_out + n_out]
            view_in = in_slot.array[start_in : start_in + n_in]
            start_out, start_in = start_out + n_out, start_in + n_in
            sending = root is None or self._rank == root
            receiving = root is None or peer == root
            if peer == self._rank:
                if root is None or self._rank == root:
                    # (through the host, as every other part: a copy the finishing thread
                    # makes from the device would race the caller's stream)
                    plans.append((receives[peer], sends[peer].to(CPU, copy=True)))
                continue
            if sending and n_out:
                torch.from_numpy(view_out).copy_(sends[peer])
                handles.append(self.fab.send_async(view_out, peer, tag))
            if receiving and (root is None or self._rank != root) and n_in:
                handles.append(self.fab.recv_async(view_in, peer, tag))
                plans.append((receives[peer], torch.from_numpy(view_in)))

        def finish() -> None:
            for into, came in plans:
                into.copy_(came)

        return self._call(what, lambda: handles, finish, [out_slot, in_slot], device)

    # -- the rest -----------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> Any:
        """The daemons' barrier; barriers in flight at once take :data:`BARRIERS` names round
        robin (a name's last barrier is waited for before it is used again: barriers carry no
        data, so a few names cost the daemons nothing)."""
        if len(self._barriers) == BARRIERS:
            self._barriers.popleft().wait(self._timeout)
        name = f"torch:barrier:{self._barrier_count % BARRIERS}"
        self._barrier_count += 1
        handle = self.fab.barrier_async(name=name)
        self._barriers.append(handle)
        return self._call("barrier", lambda: [handle], lambda: [], [], CPU)

    def _take(self, dtype: str, count: int, device: torch.device) -> Slot:
        """A staging array for a call on ``device`` (page-locked for CUDA)."""
        slot = self._staging.take(dtype, max(count, 1))
        self._holding().append(slot)
        return self._staging.for_device(slot, device)

    def _holding(self) -> list[Slot]:
        """The slots the call this thread is making took so far (given back if it fails
        before it is under way)."""
        if not hasattr(self._taken, "slots"):
            self._taken.slots = []
        slots: list[Slot] = self._taken.slots
        return slots

    def _call(
        self,
        what: str,
        start: Callable[[], list[Handle[Any]]],
        finish: Callable[[], object],
        slots: list[Slot],
        device: torch.device,
        collective: str | None = None,
    ) -> Any:
        """Start the call's operations (``start``) now, or, when ``collective``'s last call
        is still under way, once it is done (module docstring); hand it to the completer.
        A call on a CUDA ``device`` waits here for the caller's stream (its input copies and
        any device work the call added to it), makes its output copies on the group's copy
        stream, and has a CUDA-aware future, set once they are done
        (:mod:`fabricd.torch.devices`)."""
        ready(device)

        def finished() -> object:  # (on a thread of the group's, or a waiting caller's)
            with on_device(device), self._copies.on(device):
                value = finish()
                settle(device)
            return value

        call = Call(
            what=what,
            handles=[],
            finish=finish if device.type == "cpu" else finished,
            slots=slots,
            release=self._staging.release,
            deadline=time.monotonic() + self._timeout,
            future=future_for(device),
            device=device,
            start=start,
        )
        with self._starting:
            last = self._last.get(collective) if collective is not None else None
            if last is not None and not settled(last):
                call.after = last
            else:
                call.handles, call.start = start(), None  # (raises here: slots given back)
            self._holding().clear()
            if collective is not None:
                self._last[collective] = call
            self._completer.add(call)
        return Work(call.future, call, self._completer)


@dataclass(slots=True)
class _Gathering:
    """A gather staged: its collective's name, what starts it, its slots, and what copies the
    rows out once it is done."""

    name: str
    start: Callable[[], list[Handle[Any]]]
    slots: list[Slot]
    unstage: Callable[[Any], None]
    device: torch.device  #: where the gathered tensors are


def _words(nbytes: int) -> int:
    return -(-nbytes // 8)


def _bytes_of(slot: Slot) -> torch.Tensor:
    """A staging array of words, as its bytes."""
    return torch.from_numpy(slot.array.view(np.uint8))


def _op(opts: Any) -> Any:
    return opts.reduceOp.op if opts is not None else _R.SUM


def _user_tag(tag: int) -> int:
    if not 0 <= tag < INTERNAL_TAGS:
        raise UsageError(f"the fabricd backend's tags are 0 to 2**30 - 1, not {tag}")
    return tag


def _split(
    flat: torch.Tensor, sizes: Sequence[int] | None, parts: int, shape: torch.Size
) -> list[torch.Tensor]:
    """``flat`` cut along the first dimension of ``shape`` into ``sizes`` rows (even if none)."""
    rows = shape[0] if len(shape) else flat.numel()
    per_row = flat.numel() // max(rows, 1)
    sizes = list(sizes) if sizes else [rows // parts] * parts
    if sum(sizes) != rows or len(sizes) != parts:
        raise UsageError(f"split sizes {sizes} do not cut {rows} rows into {parts} parts")
    out, start = [], 0
    for size in sizes:
        out.append(flat[start * per_row : (start + size) * per_row])
        start += size
    return out


def _close(completer: Completer, staging: Staging, fab: Client) -> None:
    """The group's cleanup (shutdown, the garbage collector, or interpreter exit): each step
    runs even if one before it fails, the client's close last."""
    try:
        try:
            completer.close()
        finally:
            staging.close()
    finally:
        fab.close()


def _job(store: Store, rank: int, world: bool) -> str:
    """The fabricd job of a new group: ``$FABRICD_JOB`` for the default group, else a name
    rank 0 draws and shares through the group's store."""
    named = os.environ.get("FABRICD_JOB")
    if world and named:
        return named
    # (each rank counts its own inits on the store: its g-th init reads the g-th key, not the
    # last one's, whichever rank runs ahead)
    generation = store.add(f"fabricd/inits/{rank}", 1) - 1
    key = f"fabricd/job/{generation}"
    if rank == 0:
        store.set(key, f"{named or 'torch'}-{uuid.uuid4().hex[:16]}")
    return bytes(store.get(key)).decode()


def create(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> FabricdProcessGroup:
    """Make a process group: what ``init_process_group("fabricd")`` and ``new_group`` call."""
    job = _job(store, rank, world=not dist.is_initialized())
    fab = fabricd.connect(job=job, rank=rank, size=size)
    return FabricdProcessGroup(fab, rank, size, timeout.total_seconds(), job)


dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
