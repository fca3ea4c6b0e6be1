"""The arrays a client made with ``fab.array()``: shared-memory segments the daemon maps too.

Each array lives in its own sealed memfd (:mod:`fabricd.shm`), attached to the daemon once
with SCM_RIGHTS under a segment id this client picks.  Every facet that moves arrays
(point-to-point today) turns an array, or a contiguous slice of one, into
(segment id, offset) with :meth:`SharedArrays.locate`, so only that travels over the socket.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.client import checks
from fabricd.dtypes import ITEMSIZE
from fabricd.errors import UsageError
from fabricd.shm import Segment

if TYPE_CHECKING:
    from fabricd.client.connection import Connection


@dataclass(slots=True)
class _Entry:
    seg: int
    segment: Segment
    root: np.ndarray[Any, Any]  #: the whole segment as bytes
    array: np.ndarray[Any, Any]  #: what fab.array() returned
    base: int  #: address of the mapping in this process
    start: int  #: address of ``array``'s first byte (it never moves)


class SharedArrays:
    """This client's named arrays and the segments under them; any thread may use them.

    One thread creates at a time (``_creating``), so a name asked for by two threads at once
    is made once.  ``_entries`` and ``_made`` are replaced, never changed, so a thread looking an
    array up reads whole tables while another thread adds to them (an array not in ``_made``
    yet is found by the scan of ``_entries``, like any slice).
    """

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._ids = itertools.count(1)
        self._creating = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        #: each fab.array() by its id(): an entry holds its array, so no other object has the id
        self._made: dict[int, _Entry] = {}

    def create(self, name: object, shape: object, dtype: object) -> np.ndarray[Any, Any]:
        """The array called ``name``: made (zero-filled) and attached the first time.

        Raises:
            UsageError: a bad name, shape or dtype, a name reused with another layout, or an
                array this machine cannot hold (memory, fds).
            OperationFailed: the daemon refused to attach it: code ``limit`` (a cap on segments
                or mapped bytes, named with its setting) or ``resources`` (it could not map it).
        """
        name = checks.array_name(name)
        dims, dt = checks.shape(shape), checks.dtype(dtype)
        with self._creating:
            return self._create(name, dims, dt)

    def _create(self, name: str, dims: tuple[int, ...], dt: np.dtype[Any]) -> np.ndarray[Any, Any]:
        existing = self._entries.get(name)
        if existing is not None:
            if existing.array.shape != dims or existing.array.dtype != dt:
                raise UsageError(
                    f"array {name!r} already exists as {existing.array.shape} "
                    f"{existing.array.dtype}; use another name for {dims} {dt}"
                )
            return existing.array
        nbytes = math.prod(dims) * dt.itemsize
        if math.prod(d for d in dims if d) * dt.itemsize > sys.maxsize:  # numpy's own bound
            raise UsageError(
                f"array {name!r} of shape {dims} {dt} is too large for this machine's memory"
            )
        try:
            segment = Segment.create(_label(name), nbytes)
        except (OSError, OverflowError) as exc:  # ENOMEM, EMFILE, a size off_t cannot hold
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(
                f"cannot make shared memory for array {name!r} of {nbytes} B: {reason}; make it "
                "smaller, or free memory or file descriptors"
            ) from None
        seg = next(self._ids)
        try:
            call = self._connection.submit(
                "attach", {"seg": seg, "size": segment.size}, fds=[segment.fd]
            )
            self._connection.wait(call, 10.0).result(f"attach array {name!r}")
        except BaseException:
            segment.close()
            raise
        segment.release_fd()
        # offsets the daemon is given count from the start of the mapping (shm.py's layout):
        # root is the whole mapping, the array its data part
        root = np.frombuffer(segment.buffer, dtype=np.uint8)
        start = segment.layout.data_offset
        array: np.ndarray[Any, Any] = root[start : start + nbytes].view(dt).reshape(dims)
        entry = _Entry(seg, segment, root, array, _address(root), _address(array))
        self._entries = {**self._entries, name: entry}
        self._made = {**self._made, id(array): entry}
        return array

    def locate(self, array: object) -> tuple[int, int]:
        """The (segment id, byte offset) of ``array``, a fab.array() or a contiguous slice of one.

        Raises:
            UsageError: not a numpy array, an unsupported dtype, not contiguous, or not in
                fabricd shared memory.
        """
        entry, start, _ = self._place(array)
        return entry.seg, start - entry.base

    def where(self, array: object) -> tuple[int, int, str]:
        """:meth:`locate`, and the name of ``array``'s dtype (what a request carries).

        Raises:
            UsageError: as for :meth:`locate`.
        """
        entry, start, dtype = self._place(array)
        return entry.seg, start - entry.base, dtype

    def find(self, array: object) -> tuple[int, int, str]:
        """:meth:`locate`, and the name of the array: its ``fab.array()`` name, with
        ``@OFFSET`` (bytes into the array) for a slice that does not start at its beginning.

        Raises:
            UsageError: as for :meth:`locate`.
        """
        entry, start, _ = self._place(array)
        into = start - entry.start
        label = next(n for n, e in self._entries.items() if e is entry)
        return entry.seg, start - entry.base, f"{label}@{into}" if into else label

    def _place(self, array: object) -> tuple[_Entry, int, str]:
        """The entry whose segment holds ``array``, the array's address, and its dtype's name.

        Raises:
            UsageError: as for :meth:`locate`.
        """
        if not isinstance(array, np.ndarray):
            raise UsageError("send and recv take numpy arrays made by fab.array()")
        dtype = _NATIVE_NAMES.get(array.dtype)
        if dtype is None:
            raise UsageError(f"dtype {array.dtype} is not supported")
        if not array.flags.c_contiguous:
            raise UsageError("array must be C-contiguous (use a contiguous slice of a fab.array())")
        made = self._made.get(id(array))
        if made is not None and made.array is array:
            # a whole fab.array(): its address and byte size never change (numpy moves or
            # resizes no array that does not own its memory), and asking numpy for an address
            # builds __array_interface__'s dict (1.1 us of a 17 us send)
            return made, made.start, dtype
        start = _address(array)
        for entry in self._entries.values():
            if entry.base <= start and start + array.nbytes <= entry.base + entry.root.nbytes:
                return entry, start, dtype
        raise UsageError(
            "array is not in fabricd shared memory; create it with fab.array(name, shape, dtype)"
        )


#: the name of each supported dtype in this machine's byte order (numpy's ``dtype.name`` is a
#: property computed on every read; a non-native dtype equals none of these, so it is refused)
_NATIVE_NAMES: Final[dict[np.dtype[Any], str]] = {np.dtype(name): name for name in ITEMSIZE}


def _label(name: str) -> str:
    """``name`` as the memfd's label, which only tools see (``/proc/PID/fd``).

    The kernel takes a NUL-free name of at most 249 bytes; an array's name is any str.
    """
    raw = name.replace("\0", "?").encode("utf-8", "replace")[:200]
    return raw.decode("utf-8", "ignore")


def _address(array: np.ndarray[Any, Any]) -> int:
    pointer: int = array.__array_interface__["data"][0]
    return pointer
