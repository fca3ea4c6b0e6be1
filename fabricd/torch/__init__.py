"""PyTorch over fabricd (needs torch: the ``torch`` extra, ``pip install 'fabricd[torch]'``).

Two ways in (docs/torch.md):

* the ``torch.distributed`` backend ``"fabricd"`` (:mod:`fabricd.torch.backend`), registered
  by importing this package: ``dist.init_process_group("fabricd")``, and DDP, FSDP and every
  ``dist.*`` call run over the daemons unchanged (sync, as with gloo);
* the DDP communication hook (:mod:`fabricd.torch.hook`): gradient buckets averaged through
  fabricd in eager-SGD's partial modes (``solo``, ``majority``) as well as ``sync``.
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

__all__ = [
    "BACKEND",
    "FabricdProcessGroup",
    "HookState",
    "allreduce_hook",
    "broadcast_module",
    "init_local_process_group",
    "register",
]
