"""PyTorch over fabricd (needs torch: the ``torch`` extra, ``pip install 'fabricd[torch]'``).

Two ways in (docs/torch.md):

* the ``torch.distributed`` backend ``"fabricd"`` (:mod:`fabricd.torch.backend`), registered
  by importing this package: ``dist.init_process_group("fabricd")``, and DDP, FSDP and every
  ``dist.*`` call run over the daemons unchanged (sync, as with gloo), on CPU tensors and on
  CUDA tensors through page-locked host memory (:mod:`fabricd.torch.devices`);
* the DDP communication hook (:mod:`fabricd.torch.hook`): gradient buckets averaged through
  fabricd in eager-SGD's partial modes (``solo``, ``majority``) as well as ``sync``.

:func:`tensor_of` and :func:`array_of` are ``torch.from_numpy`` and ``Tensor.numpy`` for
bfloat16 too (a ``fab.array(..., "bfloat16")`` is an ``ml_dtypes.bfloat16`` array, which torch
does not know), sharing the memory.
"""

from __future__ import annotations

from fabricd.torch.backend import BACKEND, FabricdProcessGroup
from fabricd.torch.hook import (
    HookState,
    allreduce_hook,
    broadcast_module,
    init_local_process_group,
    register,
)
from fabricd.torch.staging import array_of, tensor_of

__all__ = [
    "BACKEND",
    "FabricdProcessGroup",
    "HookState",
    "allreduce_hook",
    "array_of",
    "broadcast_module",
    "init_local_process_group",
    "register",
    "tensor_of",
]
