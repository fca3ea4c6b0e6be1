"""What the kernel knows about a TCP connection's path: Linux's ``TCP_INFO``, read and unpacked.

Rules: reading and unpacking only; what the figures mean for the fabric is the network
monitor's to decide (:mod:`fabricd.engines.monitor`).  Nothing here raises: a kernel, a
platform or a socket without ``TCP_INFO`` (or with an older, shorter ``struct tcp_info``)
gives ``None``, and the monitor falls back to what it knows otherwise.

Theory of operation: ``getsockopt(IPPROTO_TCP, TCP_INFO, n)`` copies at most ``n`` bytes of
the kernel's ``struct tcp_info`` (include/uapi/linux/tcp.h); the layout only ever grows at
its end, so the offsets below hold on every kernel that returns enough bytes for them.  The
fields read, and their offsets::

    byte 7, bit 0    tcpi_delivery_rate_app_limited   the last sample was limited by the sender
    68   u32         tcpi_rtt             smoothed round-trip time, microseconds
    120  u64         tcpi_bytes_acked     payload bytes the peer acknowledged (+1 for the SYN)
    128  u64         tcpi_bytes_received  payload bytes received
    160  u64         tcpi_delivery_rate   the kernel's last delivery-rate sample, bytes/s
                                          (Linux 4.9+; 168 bytes of struct in all)

``tcpi_delivery_rate`` is the rate at which data was acknowledged over the last flight
(the sample BBR's bandwidth filter takes): on a busy connection, what the path delivers to
the peer.  When the sender was *app-limited* it had nothing more to send, and the sample is
only a lower bound of what the path could carry.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Final, Protocol

#: bytes of ``struct tcp_info`` asked for (today's kernels fill about 280)
INFO_SIZE: Final = 512
#: bytes the fields read here need: up to the end of ``tcpi_delivery_rate``
NEEDED: Final = 168
_RTT: Final = struct.Struct("=I")
_U64: Final = struct.Struct("=Q")


@dataclass(frozen=True, slots=True, kw_only=True)
class PathInfo:
    """One reading of a connection's ``TCP_INFO``.

    Attributes:
        rtt: smoothed round-trip time, seconds.
        delivery_rate: the last delivery-rate sample, bytes per second (0: none yet).
        app_limited: the sender had nothing more to send while that sample was taken, so it
            is a lower bound of the path's rate.
        bytes_acked: payload bytes the peer acknowledged since the connection opened.
        bytes_received: payload bytes received since the connection opened.
    """

    rtt: float
    delivery_rate: float
    app_limited: bool
    bytes_acked: int
    bytes_received: int


class _Socket(Protocol):
    """What :func:`read` needs of a socket (asyncio's and uvloop's socket views have it)."""

    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def parse(raw: bytes) -> PathInfo | None:
    """Unpack a ``struct tcp_info``; ``None`` when it is too short to hold the fields read."""
    if len(raw) < NEEDED:
        return None
    return PathInfo(
        rtt=_RTT.unpack_from(raw, 68)[0] / 1e6,
        delivery_rate=float(_U64.unpack_from(raw, 160)[0]),
        app_limited=bool(raw[7] & 1),
        bytes_acked=_U64.unpack_from(raw, 120)[0],
        bytes_received=_U64.unpack_from(raw, 128)[0],
    )


def read(sock: _Socket | None) -> PathInfo | None:
    """``sock``'s ``TCP_INFO``, or ``None`` where there is none (no socket, not TCP, not
    Linux, an old kernel, a socket already closed)."""
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, INFO_SIZE)
    except (OSError, ValueError, TypeError):
        return None
    return parse(raw)
