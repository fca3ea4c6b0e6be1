"""Shared-memory segments: sealed memfds passed over the client socket.

A client creates each segment with ``memfd_create``, sizes it, writes its header and seals its
size (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) *before* handing the fd to the daemon with
SCM_RIGHTS.  Seals belong to the inode and can never be removed, so a client cannot truncate a
segment under the daemon (which would make the daemon's next access die of SIGBUS); the daemon
refuses any fd that is not a memfd sealed that way.  A memfd has no name in ``/dev/shm``: it
vanishes when the last fd and mapping are gone, even if every process was killed with SIGKILL.

Layout (version 1) of a segment holding one array of ``nbytes`` bytes::

    0          64 = data_offset        data_offset + nbytes   footer_offset        size
    +----------+------------------------------+----------------+---------------------+
    | header   | array data, C order, nbytes  | zero padding   | footer              |
    | 64 B     | (what fab.array() views)     | to a multiple  | 64 B                |
    |          |                              | of 64 (< 64 B) |                     |
    +----------+------------------------------+----------------+---------------------+

    header                                   footer
    off  type  field                         off  type  field
     0   8s    magic  b"FABRICD\\0"           0   u64   footer version slot
     8   u32   layout version (1)             8   --    reserved, zero
    12   u32   flags (none defined: 0)
    16   u64   data offset
    24   u64   data length (nbytes)
    32   u64   footer offset
    40   u64   size of the whole segment
    48   u64   header version slot
    56   --    reserved, zero

Every field is little-endian.  fabricd runs only on Linux x86-64 and AArch64, where
little-endian *is* the native order, so the version slots can be read and written with one
native 8-byte load or store each (see "Memory ordering") while the bytes still mean the same
thing to a tool that dumps a segment without knowing which host wrote it; importing this
module on a big-endian host fails rather than mislabelling the slots.

Invariants:

1. The fd is a memfd sealed against shrinking and growing (and against new seals) before any
   other process sees it, and its size is ``layout.size``; the daemon insists on the first two.
2. The layout is a pure function of (layout version, nbytes) -- :meth:`Layout.for_array` --
   so the daemon can recompute every offset from the data length alone and refuse a header
   that disagrees.  ``size`` is a multiple of 64 and at least 128, so a zero-byte array still
   has a valid mapping.
3. ``data_offset`` is a multiple of 64 and every mapping starts on a page, so the array's first
   byte is 64-byte aligned (a cache line, the widest SIMD load) in every process.
4. The creator writes the header's fixed fields once, before sending the fd.  The daemon reads
   them once, at :meth:`Segment.adopt`, into a private copy (``pread``), checks them, and from
   then on uses only the :class:`Layout` it derived: a client that scribbles on its header
   later cannot move the daemon's view of the data.
5. The daemon touches only ``[data_offset, data_offset + nbytes)`` (:meth:`Segment.view`
   refuses anything else), so no transfer overwrites a header or a footer.
6. The version slots start at 0.  An update is bracketed by its writer: header slot bumped
   first (:meth:`Segment.begin_update`), data written, footer slot set to the same value last
   (:meth:`Segment.end_update`).  Header != footer means an update is in flight, or its writer
   died mid-way; either way the data is not one whole update.

Memory ordering.  Python has no fences, so here is what holds between processes:

* Each version slot is an aligned 8-byte word accessed through ``memoryview.cast("Q")``, which
  copies it with a fixed-size 8-byte ``memcpy`` that compilers emit as one load or store; such
  accesses are single-copy atomic on x86-64 and AArch64, so a slot is never seen half-written.
  (``struct`` with an explicit byte order promises no such thing -- CPython packs those byte by
  byte -- so it writes only the fixed fields, once, before the fd is shared.)
* A reader must read the versions in the opposite order to the writer: footer before its copy
  (:meth:`Segment.read_begin`), header after it (:meth:`Segment.read_end`).  If both equal
  ``v``, update ``v`` had finished before the copy began and ``v + 1`` had not begun when it
  ended (reading header first would miss a writer that finished during the copy).
* On x86-64 (TSO) stores become visible in program order and loads are not reordered with each
  other, so that argument holds as written and ``read_end() is True`` proves a whole update.
* On AArch64 (weakly ordered) nothing stops the data stores becoming visible after the footer
  store, or the reader's loads completing out of order.  A mismatch still means "discard the
  copy"; a match is only evidence.  There the guarantee is the NOTIFY-ACK message itself: the
  socket send and receive are system calls, and the kernel's locking orders everything the
  sender stored before sending before everything the receiver loads after receiving.  The
  version check detects readers that did not wait for that message (ASAP §6.2), it does not
  replace it.
* One writer per update: whoever writes the array brackets the write, and only that one.  Two
  concurrent writers make the versions meaningless.  In this release only a client may write
  them (around its own writes, before a send): the daemon never reads or writes the slots, so
  bytes it delivers into a receive leave them as they were, and a client learns that a receive
  is whole from ``recv`` returning (the daemon's completion message), never from
  :meth:`Segment.read_end`.

File descriptors.  On the daemon's side a segment holds exactly one fd for as long as it is
mapped, and that fd is not ours to close.  :meth:`Segment.adopt` closes the fd the client passed
as soon as the mapping exists, but CPython's ``mmap.mmap`` keeps a ``dup`` of it for its own
``size()``/``resize()`` and closes that dup in ``mmap.close()``.  Closing the dup behind mmap's
back (``os.close`` on a number read out of it, or mapping through ctypes) is not safe: mmap would
later close whatever file reused that number, and a ctypes mapping cannot tell when the last
view into it (a DATA frame still in a socket buffer) is gone.  Python 3.13's ``trackfd=False``
drops the dup cleanly; fabricd runs on 3.11, so it keeps it and bounds it instead: the daemon
caps its segments (``max_segments``, and no more than its fd limit leaves once every client and
peer link has its fd — :mod:`fabricd.daemon.segments`), so segments can never take the fds that
accepting clients and peers needs.  Each mapping is also one entry of ``vm.max_map_count``, which
the same cap bounds.  docs/operations.md ("Limits") has the numbers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Final

from fabricd.errors import UsageError

if sys.byteorder != "little":
    raise ImportError("fabricd shared memory is little-endian; this host is big-endian")

SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: seals the daemon insists on before it maps a client's segment
REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

MAGIC: Final = b"FABRICD\0"
LAYOUT_VERSION: Final = 1
#: the header's fixed fields: magic, layout version, flags, data offset, data length,
#: footer offset, size (the module docstring has the table)
HEADER: Final = struct.Struct("<8sIIQQQQ")
HEADER_SIZE: Final = 64
FOOTER_SIZE: Final = 64
#: alignment of the data and of the footer: a cache line, and the widest SIMD load
ALIGN: Final = 64
#: where the header version slot lives, right after the fixed fields
HEADER_VERSION_OFFSET: Final = HEADER.size
_VERSION_MOD: Final = 1 << 64
#: errnos with which mmap says the process has no room (memory, address space, maps, fds)
_NO_ROOM: Final = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN})


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where things are in a segment (byte offsets from the start of the mapping).

    Build one with :meth:`for_array`; the layout is a function of ``nbytes`` alone.
    """

    header_size: int
    data_offset: int
    nbytes: int  #: length of the array data
    footer_offset: int  #: the footer version slot is its first 8 bytes
    size: int  #: of the whole mapping

    @classmethod
    def for_array(cls, nbytes: int) -> Layout:
        """The layout of a segment holding an array of ``nbytes`` bytes.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"an array cannot be {nbytes} B")
        data_offset = _align(HEADER_SIZE)
        footer_offset = _align(data_offset + nbytes)
        return cls(
            header_size=HEADER_SIZE,
            data_offset=data_offset,
            nbytes=nbytes,
            footer_offset=footer_offset,
            size=footer_offset + FOOTER_SIZE,
        )

    def header(self) -> bytes:
        """The header's fixed fields, packed (the version slot and reserved bytes excluded)."""
        return HEADER.pack(
            MAGIC, LAYOUT_VERSION, 0, self.data_offset, self.nbytes, self.footer_offset, self.size
        )


def _checked_layout(header: bytes, size: int) -> Layout:
    """The layout a daemon may trust, from a private copy of a segment's header.

    Raises:
        UsageError: what is wrong with the header.
    """
    if len(header) < HEADER_SIZE:
        raise UsageError(f"segment is {size} B, too small for its {HEADER_SIZE} B header")
    magic, version, flags, data_offset, nbytes, footer_offset, total = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise UsageError(
            f"segment header starts with {magic!r}, not {MAGIC!r}: not made by fab.array(), "
            "or its header was overwritten"
        )
    if version != LAYOUT_VERSION:
        raise UsageError(
            f"segment layout version {version} is not {LAYOUT_VERSION}: the client and the "
            "daemon run different fabricd versions"
        )
    if flags:
        raise UsageError(
            f"segment header flags {flags:#x} are unknown to layout version {LAYOUT_VERSION}"
        )
    layout = Layout.for_array(nbytes)
    found = (data_offset, footer_offset, total, size)
    if found != (layout.data_offset, layout.footer_offset, layout.size, layout.size):
        raise UsageError(
            f"segment header puts {nbytes} B of data at {data_offset}, the footer at "
            f"{footer_offset} and the end at {total} in a {size} B segment; a {nbytes} B array "
            f"has them at {layout.data_offset}, {layout.footer_offset} and {layout.size}"
        )
    return layout


class Segment:
    """A mapped memfd with a header, one array and a footer.

    Both the client (creator) and the daemon (mapper) hold one.

    Attributes:
        layout: where the data and the version slots are; on the daemon's side the copy it
            checked at adopt time, never re-read from the live header.
        buffer: the whole writable mapping, header and footer included.
    """

    def __init__(self, fd: int, layout: Layout) -> None:
        self.layout = layout
        self.buffer = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd: int | None = fd

    @classmethod
    def create(cls, name: str, nbytes: int) -> Segment:
        """Create, size, label and seal a new memfd for an array of ``nbytes`` bytes (client).

        The data starts zero-filled and both version slots at 0.
        """
        layout = Layout.for_array(nbytes)
        fd = os.memfd_create(f"fabricd:{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, layout.size)
            os.pwrite(fd, layout.header(), 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, layout)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, declared_size: int) -> Segment:
        """Map a client's fd after checking its seals, size and header (daemon side).

        Takes ownership of ``fd`` (closed on failure and after mapping).  The header is read
        once, into a private copy, before mapping; :attr:`layout` comes from that copy.

        Raises:
            UsageError: not a sealed memfd, its size is not ``declared_size``, its header is not
                a valid fabricd header for that size (the message says which field is wrong),
                or it cannot be mapped for writing.  Refuse the attach; the client's segment
                is unusable and it should make another with ``fab.array()``.
            OSError: errno ENOMEM, EMFILE, ENFILE or EAGAIN: this process has no room for the
                mapping or for the fd it keeps (see "File descriptors").  The segment is fine.
            MemoryError: no memory for the mapping object.
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
            if actual != declared_size:
                raise UsageError(f"segment is {actual} B but was declared as {declared_size} B")
            try:
                header = os.pread(fd, HEADER_SIZE, 0)
            except OSError as exc:  # opened write-only (a reopened /proc/self/fd/N, say)
                raise UsageError(
                    f"segment fd cannot be read ({exc.strerror}); pass the memfd fab.array() made"
                ) from None
            layout = _checked_layout(header, actual)
            try:
                segment = cls(fd, layout)
            except OSError as exc:
                if exc.errno in _NO_ROOM:  # the daemon's trouble, not the client's mistake
                    raise
                # e.g. also sealed against writes (EPERM): we could not fill it
                raise UsageError(f"segment cannot be mapped for writing: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        segment.release_fd()
        return segment

    @property
    def size(self) -> int:
        """The sealed size in bytes (what the client declares when it attaches)."""
        return self.layout.size

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

    def data(self) -> memoryview:
        """A writable view of exactly the array's ``nbytes``, starting 64-byte aligned."""
        start = self.layout.data_offset
        return memoryview(self.buffer)[start : start + self.layout.nbytes]

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``[offset, offset + nbytes)`` inside the array data.

        Offsets count from the start of the mapping, not of the data, as the client's
        addresses do (``array address - mapping address``).  An empty range may sit anywhere
        in ``[0, size]``: it touches nothing, and numpy leaves an empty slice's address at
        the start of what was sliced, so ``root[64:64]`` reports offset 0.

        Raises:
            UsageError: the range is not inside the data (it would touch the header, the
                footer or nothing at all).  The request naming it is wrong; refuse it.
        """
        lo, n = self.layout.data_offset, self.layout.nbytes
        inside = lo <= offset and offset + nbytes <= lo + n
        empty = nbytes == 0 and 0 <= offset <= self.size
        if nbytes < 0 or not (inside or empty):
            raise UsageError(
                f"range [{offset}, {offset + nbytes}) is outside the {n} B segment's data "
                f"at [{lo}, {lo + n})"
            )
        return memoryview(self.buffer)[offset : offset + nbytes]

    # -- version slots (module docstring: invariant 6 and "Memory ordering") ----------------
    def begin_update(self) -> int:
        """Writer: bump the header version before writing the data; returns the new version."""
        version = (self._load(HEADER_VERSION_OFFSET) + 1) % _VERSION_MOD
        self._store(HEADER_VERSION_OFFSET, version)
        return version

    def end_update(self, version: int) -> None:
        """Writer: after the data, set the footer to ``version`` (from :meth:`begin_update`)."""
        self._store(self.layout.footer_offset, version)

    def read_begin(self) -> int:
        """Reader: before copying, the footer version (the last update that finished)."""
        return self._load(self.layout.footer_offset)

    def read_end(self, begun: int) -> bool:
        """Reader: after copying, whether the copy was one whole update.

        Args:
            begun: what :meth:`read_begin` returned before the copy.

        Returns:
            ``True`` if no update began since ``begun`` finished.  ``False``: the copy may mix
            two updates; discard it, and copy again or wait for the writer's notification.
        """
        return self._load(HEADER_VERSION_OFFSET) == begun

    def read_versions(self) -> tuple[int, int]:
        """The (header, footer) versions now; they differ while an update is in flight."""
        return self._load(HEADER_VERSION_OFFSET), self._load(self.layout.footer_offset)

    def _load(self, offset: int) -> int:
        with memoryview(self.buffer)[offset : offset + 8].cast("Q") as slot:
            return slot[0]

    def _store(self, offset: int, value: int) -> None:
        with memoryview(self.buffer)[offset : offset + 8].cast("Q") as slot:
            slot[0] = value

    def close(self) -> None:
        """Unmap and close.  If views are still exported the mapping lives until they go."""
        self.release_fd()
        # a view may still be in use (queued in a socket buffer, say): then GC unmaps later
        with contextlib.suppress(BufferError):
            self.buffer.close()
