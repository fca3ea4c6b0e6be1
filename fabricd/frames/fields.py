"""What several capabilities' frames share: the limits on ranks, uids and names, and the
field readers beyond :mod:`fabricd.wire`'s."""

from __future__ import annotations

from typing import Final

from fabricd.errors import RemoteProtocolError
from fabricd.wire import Meta, get_int

#: the largest rank or job size a frame carries
MAX_RANK: Final = 2**31
#: the largest uid a frame carries (uid_t is 32 bits; 2**32 - 1 is the kernel's "no uid")
MAX_UID: Final = 2**32 - 2
#: the size of a handshake nonce: fresh random bytes, one from each side
#: the longest name of a collective, stochastic reduce or model a frame carries
MAX_NAME: Final = 200


def optional_int(meta: Meta, key: str) -> int:
    """``meta[key]`` as :func:`get_int` reads it, or 0 when the field is absent."""
    return get_int(meta, key) if key in meta else 0


def get_bool(meta: Meta, key: str) -> bool:
    """Return ``meta[key]`` as a bool, or raise RemoteProtocolError."""
    value = meta.get(key)
    if type(value) is not bool:
        raise RemoteProtocolError(f"field {key!r} must be true or false")
    return value
