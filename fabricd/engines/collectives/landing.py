"""Where one peer's message to a persistent collective lands, frame by frame.

Rules: this module keeps the bookkeeping of one message being received in pieces (the service
splits a message into frames of ``chunk_size``; :meth:`Collective.landing` hands out a view per
frame and :meth:`Collective.arrived` counts it in) and what happens to it when an in-place
round's array is taken from under it (:meth:`Landing.move`).  It decides nothing about the
schedule; :mod:`fabricd.engines.collectives.persistent` owns the landings and decides when
they move.

Theory of operation.  In place (docs/architecture.md, "In place for a node's only rank"), an
allgather message lands straight in its chunk of the caller's array.  When the caller's call
fails mid-round, the round goes on in a copy of the array (:func:`detach`): every
landing that points into the array is pointed at the same place in the copy (what landed so
far was copied with the array).  One frame may be in flight at that instant -- its view was
handed to the transport, which fills it over several reads -- and nothing can take that view
back: its bytes still go to the caller's array.  That frame is *torn*: when it arrives its
bytes are copied from the array into the copy (:meth:`Landing.mend`), and the collective holds
the failure until then, so no byte lands in the array after the caller hears of the failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Collection


def raw(array: np.ndarray[Any, Any]) -> memoryview:
    """A contiguous 1-d ``array``'s bytes, the same memory, as a flat memoryview: what a send
    hands the transport and a frame lands in.  Through a uint8 view, because numpy's buffer
    protocol refuses bfloat16 (``ml_dtypes``: "cannot include dtype 'E' in a buffer")."""
    return array.view(np.uint8).data


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether ``a`` and ``b`` are the very same elements (a copy between them is none)."""
    return a.shape == b.shape and (not a.size or a.ctypes.data == b.ctypes.data)


def moved(
    part: np.ndarray[Any, Any], old: np.ndarray[Any, Any], new: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any] | None:
    """``part`` of ``old`` as the same elements of ``new`` (a copy of ``old``); ``None``:
    ``part`` is not in ``old`` (a buffer of the daemon's own)."""
    if not part.size or not np.shares_memory(part, old):
        return None
    start = (part.ctypes.data - old.ctypes.data) // old.itemsize
    return new[start : start + len(part)]


@dataclass(slots=True, kw_only=True)
class Landing:
    """A message being received in frames: which recv, from which node, where, how much is in.

    Frames of one message come in order on one link, so at most one is in flight: the bytes
    ``[got, handed)`` of ``view``.
    """

    op: int
    node: int  #: the sender (a torn frame from it never arrives once its links are reset)
    view: memoryview
    array: np.ndarray[Any, Any]  #: the same bytes as ``view``, as the collective's dtype
    got: int = 0  #: bytes arrived
    handed: int = 0  #: where the bytes handed out for landing end
    #: the frame in flight when the landing moved (:meth:`move`): where it lands instead
    torn: memoryview | None = None

    def hand(self, offset: int, nbytes: int) -> memoryview:
        """The view ``nbytes`` at ``offset`` land in (checked against ``view`` by the caller)."""
        self.handed = max(self.handed, offset + nbytes)
        return self.view[offset : offset + nbytes]

    def move(self, old: np.ndarray[Any, Any], new: np.ndarray[Any, Any]) -> None:
        """Point this landing at the same place in ``new``, a copy of ``old`` just taken, if
        it lands in ``old``; a frame handed out and not yet arrived is torn (see the module
        docstring)."""
        array = moved(self.array, old, new)
        if array is None:
            return
        if self.handed > self.got:
            self.torn = self.view[self.got : self.handed]
        self.array, self.view = array, raw(array)

    def mend(self) -> None:
        """The torn frame arrived (in the old place): copy its bytes to where the landing is
        now."""
        if self.torn is not None:
            self.view[self.got : self.got + len(self.torn)] = self.torn
            self.torn = None


def detach(
    old: np.ndarray[Any, Any],
    new: np.ndarray[Any, Any],
    landings: Collection[Landing],
    landed: dict[int, np.ndarray[Any, Any]],
) -> bool:
    """An in-place round whose caller fails (a rank of the job left, a member node went down,
    its client stopped waiting) while the round runs goes on in ``new``, a copy of the caller's
    array ``old`` as it stands: its peers still need this node's messages, and they stay the
    same bytes, so nothing of the round touches the caller's array once the failure is
    delivered.  That array holds what the round had reduced into it so far -- undefined, as a
    failed sync round's result is (``PeerFailed``: resynchronise the model).  ``landings``
    into ``old`` land the rest in ``new``, and an allgather chunk landed whole in ``old``
    (``landed``: recv op -> chunk) is read from ``new``; a frame the transport is filling now
    is torn (the module docstring).  Returns whether one is."""
    for landing in landings:
        landing.move(old, new)
    for op, chunk in landed.items():
        if (there := moved(chunk, old, new)) is not None:
            landed[op] = there
    return any(landing.torn is not None for landing in landings)
