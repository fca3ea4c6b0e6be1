"""fabricd: a per-node daemon that owns the network traffic of distributed ML training.

Training scripts use the client library::

    import fabricd
    fab = fabricd.connect(job="demo")  # rank/size from RANK/WORLD_SIZE (else srun's) if not given
    g = fab.array("grad", (1024,), "float32")
    fab.send(g, to=1); fab.recv(g, src=1)
    fab.close()

Every error fabricd raises on purpose is a :class:`FabricError`.
"""

from __future__ import annotations

from fabricd.client import (
    Client,
    Completion,
    DivergenceBound,
    Event,
    FilterSettings,
    FlushResult,
    Handle,
    ParameterServer,
    PartialExchange,
    PushResult,
    Result,
    StepResult,
    connect,
)
from fabricd.errors import (
    ConfigError,
    DaemonUnavailable,
    FabricError,
    OperationFailed,
    PeerFailed,
    PermissionDenied,
    ProtocolError,
    RemoteProtocolError,
    Timeout,
    TransportError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Completion",
    "ConfigError",
    "DaemonUnavailable",
    "DivergenceBound",
    "Event",
    "FabricError",
    "FilterSettings",
    "FlushResult",
    "Handle",
    "OperationFailed",
    "ParameterServer",
    "PartialExchange",
    "PeerFailed",
    "PermissionDenied",
    "ProtocolError",
    "PushResult",
    "RemoteProtocolError",
    "Result",
    "StepResult",
    "Timeout",
    "TransportError",
    "UsageError",
    "__version__",
    "connect",
]
