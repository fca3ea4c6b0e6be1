"""Finding an RDMA device: does pyverbs import, and does it list any device?

The probe never raises: a missing pyverbs (the ``rdma`` extra), a missing rdma-core, or a host
without an HCA all mean "no verbs here", with a reason the daemon logs in one line.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """What the host offers for verbs."""

    devices: tuple[str, ...]
    reason: str  #: why there is no usable device, or which one was found


def probe() -> Probe:
    """Look for RDMA devices through pyverbs."""
    try:
        device = importlib.import_module("pyverbs.device")
    except ImportError as exc:
        return Probe(devices=(), reason=f"pyverbs is not installed ({exc.name or exc})")
    try:
        found = device.get_device_list()
    except Exception as exc:  # pyverbs raises its own PyverbsRDMAError without rdma-core
        return Probe(devices=(), reason=f"pyverbs could not list devices: {exc}")
    names = tuple(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in found)
    if not names:
        return Probe(devices=(), reason="pyverbs found no RDMA device")
    return Probe(devices=names, reason=f"RDMA devices {', '.join(names)}")
