"""PyTorch DistributedDataParallel over fabricd: gradient buckets allreduced by the daemons.

Needs torch (the ``torch`` extra: ``pip install 'fabricd[torch]'``); the rest of fabricd does
not.  DDP hands its gradients, flattened into buckets, to a *communication hook*
(``ddp.register_comm_hook(state, hook)``); :func:`allreduce_hook` allreduces each bucket with
op ``avg`` through fabricd, in mode ``sync``, ``solo`` or ``majority`` -- the partial modes of
eager-SGD that torch.distributed itself does not offer (pytorch issue 71330)::

    import fabricd, fabricd.torch
    from torch.nn.parallel import DistributedDataParallel

    fab = fabricd.connect(job="train")                  # rank and size from RANK/WORLD_SIZE
    group = fabricd.torch.init_local_process_group()    # DDP's own group: this process only
    fabricd.torch.broadcast_module(fab, model)          # every rank starts from rank 0's model
    ddp = DistributedDataParallel(model, process_group=group, forward_sync_buffers=False)
    state = fabricd.torch.register(ddp, fab, mode="majority")
    ...  # train as usual: loss.backward() averages the gradients over fabricd's ranks

The process group.  DDP refuses to run without one; it uses it to check that every rank has the
same parameters, to broadcast rank 0's parameters at construction, to agree on a bucket layout,
and (``forward_sync_buffers``, ``find_unused_parameters``) for work in every step.  Two ways:

* :func:`init_local_process_group`: a gloo group of this process alone, with an in-memory store.
  DDP's own collectives then cost nothing and never wait for another rank, which is what the
  partial modes need; fabricd does what they did: :func:`broadcast_module` makes the ranks'
  models equal, and the hook checks that every rank's buckets hold the same parameters.
* a real group of all ranks (``torch.distributed.init_process_group("gloo", ...)`` with its own
  rendezvous): DDP sets itself up through it and the hook still moves every gradient through
  fabricd.  With a partial mode keep ``forward_sync_buffers=False`` and
  ``find_unused_parameters=False``: either makes DDP run a synchronous collective on that group
  in every step, which would make every rank wait for the slowest again.

Buckets.  Each bucket index gets a fabricd array (``{prefix}:bucket{i}:{numel}:{dtype}``),
made the first time a bucket of that index is larger than what it has; the bucket is copied in,
allreduced, and copied back, and the hook returns a completed future.  DDP lays its buckets out
again after the first step (in the order the gradients became ready), so a training run makes
two arrays per index at most.  The first round of every layout runs in mode ``sync`` whatever the
mode, after a small sync collective that checks every rank has that layout: a partial round
leaves the data of ranks that were not there in the daemons for that collective's next round,
and the layout that DDP drops after the first step has no next round.

CUDA: fabricd's arrays are host memory, so a CUDA bucket goes through a pinned host copy (one
per bucket index): device to pinned memory, pinned memory to the array, and back the same way.
The tests run it where torch sees a GPU (CI has none; docs/torch.md says where it passed).

Zero copy without DDP: ``torch.from_numpy`` shares memory with the numpy array it is given, so a
tensor made from ``fab.array()`` lives in fabricd's shared memory and the daemon reduces it in
place, with no copy on either side::

    grad = torch.from_numpy(fab.array("grad", (n,), "float32"))
    grad.copy_(compute_gradient())        # or let torch write into it (out=grad)
    fab.allreduce(grad.numpy(), op="avg", mode="solo")   # .numpy() is the same memory again

(For bfloat16, which torch's ``from_numpy`` and ``numpy()`` do not take, :func:`tensor_of` and
:func:`array_of` of :mod:`fabricd.torch.staging` do the same.)  bfloat16 buckets are carried as
bfloat16 (docs/torch.md, "bfloat16").
"""

from __future__ import annotations

import hashlib
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

# torch.distributed re-exports HashStore and GradBucket from here, without telling type checkers
from torch._C._distributed_c10d import GradBucket, HashStore

from fabricd.errors import UsageError
from fabricd.torch.staging import array_of, pack, tensor_of, unpack

if TYPE_CHECKING:
    from fabricd.client import Client
    from fabricd.client.collectives import Mode, Result

__all__ = [
    "HookState",
    "allreduce_hook",
    "broadcast_module",
    "init_local_process_group",
    "register",
]


def init_local_process_group() -> dist.ProcessGroup:
    """Make this process's default group a gloo group of this process alone, and return it.

    For DDP's own set-up only (see the module docstring): no rendezvous, no traffic, no waiting
    for another rank.  Call it once per process, before making the DDP model.
    """
    if dist.is_initialized():
        raise UsageError(
            "torch.distributed already has a default process group; pass that group to "
            "DistributedDataParallel instead (DDP sets itself up through it, the hook still "
            "moves the gradients through fabricd)"
        )
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    assert group is not None  # init_process_group just set it
    return group


def broadcast_module(
    fab: Client,
    module: torch.nn.Module,
    root: int = 0,
    *,
    prefix: str = "ddp",
    timeout: float | None = None,
) -> None:
    """Copy rank ``root``'s parameters and buffers into every rank's ``module``, via fabricd.

    What DDP's constructor does through its process group, for a group of one process
    (:func:`init_local_process_group`); also how a restarted trainer fetches the current model.
    One broadcast per element type, through an array ``{prefix}:init:{dtype}``.  Every rank of
    the job must call it.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, tensors in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        name = _carried(dtype)
        array = fab.array(f"{prefix}:init:{name}", (sum(t.numel() for t in tensors),), name)
        flat = tensor_of(array)
        with torch.no_grad():
            if fab.rank == root:
                pack(tensors, flat)
            fab.broadcast(array, root, timeout=timeout)
            if fab.rank != root:
                unpack(flat, tensors)


@dataclass(slots=True, eq=False)
class HookState:
    """What :func:`allreduce_hook` needs between calls: the ``state`` of ``register_comm_hook``.

    Args:
        fab: a client that joined the training job.
        mode: ``"sync"``, ``"solo"`` or ``"majority"``; every rank must use the same.
        parameters: the model's parameters in a fixed order (``list(module.parameters())``);
            a bucket's layout is checked against the other ranks' by these indices.
        prefix: the start of every array and collective name; one per DDP model in a job.
        timeout: seconds one bucket's allreduce may take before :class:`fabricd.Timeout`;
            ``None`` waits as long as the daemons do (a dead node fails a sync round with
            :class:`fabricd.PeerFailed` within the peer timeout).

    Attributes:
        results: the latest :class:`fabricd.Result` of every bucket index, written by the hook:
            ``round``, whether this rank's gradients were ``included``, how many ranks were
            ``active``.
    """

    fab: Client
    mode: Mode
    parameters: list[torch.Tensor]
    prefix: str = "ddp"
    timeout: float | None = None
    results: dict[int, Result] = field(init=False, default_factory=dict)
    #: a parameter's index in ``parameters``, by the parameter's id
    _index: dict[int, int] = field(init=False, default_factory=dict, repr=False)
    _buckets: dict[int, _Bucket] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "solo", "majority"):
            raise UsageError(f"mode must be 'sync', 'solo' or 'majority', not {self.mode!r}")
        self._index = {id(p): i for i, p in enumerate(self.parameters)}

    def allreduce(self, bucket: GradBucket) -> torch.Tensor:
        """Average ``bucket``'s gradients over the job's ranks, in place; returns its buffer."""
        index, buffer = bucket.index(), bucket.buffer()
        layout = (buffer.numel(), buffer.dtype, [self._index[id(p)] for p in bucket.parameters()])
        slot = self._buckets.get(index)
        mode = self.mode
        if slot is None or slot.layout != layout:
            slot = self._buckets[index] = self._layout(index, buffer, layout)
            mode = "sync"
        numel = buffer.numel()
        shared = slot.shared[:numel]
        staging = slot.staging[:numel] if slot.staging is not None else None
        if staging is None:
            shared.copy_(buffer)
        else:  # CUDA: device -> pinned host memory -> the segment, and back after
            staging.copy_(buffer)
            shared.copy_(staging)
        name = f"{self.prefix}:bucket{index}:{numel}:{mode}"
        self.results[index] = self.fab.allreduce(
            array_of(shared), "avg", mode, name=name, timeout=self.timeout
        )
        if staging is None:
            buffer.copy_(shared)
        else:
            staging.copy_(shared)
            buffer.copy_(staging)
        return buffer

    def _layout(self, index: int, buffer: torch.Tensor, layout: _Layout) -> _Bucket:
        """Check that every rank has this layout for bucket ``index``; the arrays for it."""
        self._check_layout(index, layout)
        old = self._buckets.get(index)
        numel, dtype = buffer.numel(), _carried(buffer.dtype)
        if old is not None and old.shared.numel() >= numel and old.layout[1] == buffer.dtype:
            return _Bucket(layout, old.shared, old.staging)
        name = f"{self.prefix}:bucket{index}:{numel}:{dtype}"
        shared = tensor_of(self.fab.array(name, (numel,), dtype))
        staging = None
        if buffer.is_cuda:
            staging = torch.empty(numel, dtype=buffer.dtype, pin_memory=True)
        return _Bucket(layout, shared, staging)

    def _check_layout(self, index: int, layout: _Layout) -> None:
        """Raise unless every rank's bucket ``index`` holds the same parameters.

        DDP makes its ranks agree on a layout through its process group; with a group of one
        process (:func:`init_local_process_group`) each rank chooses alone.  A rank whose
        bucket held other parameters of the same total size would silently average unrelated
        gradients; a max-allreduce of ``(h, -h)``, ``h`` a hash of the layout, catches that.
        """
        digest = hashlib.blake2b(repr((index, *layout)).encode(), digest_size=8).digest()
        mine = int.from_bytes(digest) >> 2  # 62 bits: -h fits in an int64
        check = self.fab.array(f"{self.prefix}:layout", (2,), "int64")
        check[:] = (mine, -mine)
        self.fab.allreduce(check, "max", "sync", timeout=self.timeout)
        if check[0] != mine or -check[1] != mine:
            raise UsageError(
                f"DDP's bucket {index} holds other parameters on other ranks (parameters "
                f"{layout[2]} here): every rank must build the same model, with the same "
                "bucket_cap_mb, and run the same backward graph"
            )


def allreduce_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``bucket`` averaged over fabricd's ranks, as a completed future.

    Register it with ``ddp.register_comm_hook(state, allreduce_hook)`` (or :func:`register`).
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(state.allreduce(bucket))
    return future


# DDP refuses a hook whose annotations are not GradBucket and Future[Tensor] themselves, and this
# module's annotations are strings (PEP 563): give it the objects they name.
allreduce_hook.__annotations__ = typing.get_type_hints(allreduce_hook)


def register(
    ddp: torch.nn.parallel.DistributedDataParallel,
    fab: Client,
    mode: Mode = "sync",
    *,
    prefix: str = "ddp",
    timeout: float | None = None,
) -> HookState:
    """Register :func:`allreduce_hook` on ``ddp``; returns its state (``state.results``)."""
    state = HookState(fab, mode, list(ddp.module.parameters()), prefix=prefix, timeout=timeout)
    ddp.register_comm_hook(state, allreduce_hook)
    return state


#: what the hook compares across ranks: element count, type, parameter indices in order
_Layout = tuple[int, torch.dtype, list[int]]


@dataclass(slots=True, frozen=True)
class _Bucket:
    """One bucket index's current layout, its fabricd array, and its pinned copy (CUDA)."""

    layout: _Layout
    shared: torch.Tensor
    staging: torch.Tensor | None


def _carried(dtype: torch.dtype) -> str:
    """The fabricd dtype a tensor of ``dtype`` is carried in: its numpy name, bfloat16's
    included (``ml_dtypes.bfloat16``, which torch's ``numpy()`` does not know)."""
    return "bfloat16" if dtype == torch.bfloat16 else _numpy_dtype(dtype)


def _numpy_dtype(dtype: torch.dtype) -> str:
    """The numpy (and fabricd) name of a torch element type."""
    try:
        return str(torch.empty((), dtype=dtype).numpy().dtype.name)
    except TypeError:
        raise UsageError(f"fabricd cannot move {dtype} tensors (no numpy equivalent)") from None
