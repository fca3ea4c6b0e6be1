"""Shared-memory segments: sealed memfds passed over the client socket.

A client creates each segment with ``memfd_create``, sizes it, and seals its size
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) *before* handing the fd to the daemon with
SCM_RIGHTS.  Seals belong to the inode and can never be removed, so a client cannot truncate a
segment under the daemon (which would make the daemon's next access die of SIGBUS); the daemon
refuses any fd that is not a memfd sealed that way.  A memfd has no name in ``/dev/shm``: it
vanishes when the last fd and mapping are gone, even if every process was killed with SIGKILL.

Layout: one segment holds one array, at offset 0, ``size`` bytes, C order.  Segments of
zero-byte arrays are one byte long, because an empty mapping cannot exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import Final

from fabricd.errors import UsageError

SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: seals the daemon insists on before it maps a client's segment
REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def mapping_size(nbytes: int) -> int:
    """Bytes of the memfd that holds an array of ``nbytes`` (a mapping can't be empty)."""
    return max(nbytes, 1)


class Segment:
    """A mapped memfd.  Both the client (creator) and the daemon (mapper) hold one.

    Attributes:
        size: the sealed size in bytes.
        buffer: the writable mapping.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.buffer = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd: int | None = fd

    @classmethod
    def create(cls, name: str, nbytes: int) -> Segment:
        """Create, size and seal a new memfd for an array of ``nbytes`` bytes (client side)."""
        size = mapping_size(nbytes)
        fd = os.memfd_create(f"fabricd:{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, declared_size: int) -> Segment:
        """Map a client's fd after checking it is a memfd sealed at ``declared_size`` (daemon).

        Takes ownership of ``fd`` (closed on failure and after mapping).

        Raises:
            UsageError: not a sealed memfd, or its size is not ``declared_size``.
        """
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise UsageError(
                    "segment fd is not a memfd; create segments with fab.array()"
                ) from None
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise UsageError("segment memfd is not sealed against shrinking and growing")
            actual = os.fstat(fd).st_size
            if actual != declared_size or actual < 1:
                raise UsageError(f"segment is {actual} B but was declared as {declared_size} B")
            try:
                segment = cls(fd, actual)
            except OSError as exc:  # e.g. also sealed against writes: we could not fill it
                raise UsageError(f"segment cannot be mapped for writing: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        segment.release_fd()
        return segment

    @property
    def fd(self) -> int:
        """The memfd (only the creator keeps it, to pass it on)."""
        if self._fd is None:
            raise ValueError("segment fd already released")
        return self._fd

    def release_fd(self) -> None:
        """Close the fd; the mapping stays valid."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``[offset, offset + nbytes)``.

        Raises:
            UsageError: the range is outside the segment.
        """
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise UsageError(
                f"range [{offset}, {offset + nbytes}) is outside the {self.size} B segment"
            )
        return memoryview(self.buffer)[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap and close.  If views are still exported the mapping lives until they go."""
        self.release_fd()
        # a view may still be in use (queued in a socket buffer, say): then GC unmaps later
        with contextlib.suppress(BufferError):
            self.buffer.close()
