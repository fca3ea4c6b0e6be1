"""What a ``collective`` request asks for: the collective's spec, its name, and the caller's
arrays (views of its segments), checked before anything is built.

Split from :mod:`fabricd.daemon.services.collectives` (its service, which keeps within its
size budget): an allreduce or a broadcast names one array, in place; an allgather or a
reduce-scatter two, its input and its output (``out_seg``, ``out_off``, ``out_nbytes``), of
one dtype: ``k`` elements in and ``size * k`` out, or the other way round.  An allgather
reduces nothing, so it also takes ``uint8`` (bytes: a torch backend's
``all_gather_object``).  The input is read when the node's round takes it and the output
written when the call completes, so the two may overlap (an allgather whose input is its own
block of the output, as ``MPI_IN_PLACE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.daemon.services.jobs import region
from fabricd.dtypes import ITEMSIZE, REDUCE_DTYPES, exact_count
from fabricd.engines.collectives.spec import GATHERS, Spec, asked
from fabricd.errors import UsageError
from fabricd.frames.fields import MAX_NAME
from fabricd.wire import get_int, get_str

if TYPE_CHECKING:
    from fabricd.daemon.sessions import ClientSession
    from fabricd.wire import Meta

Region = tuple[int, int, int]  #: an array's (segment, offset, bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parsed:
    """A checked request: its spec and name, its arrays, and where they are (for a call that
    waits, which views them again when it runs)."""

    spec: Spec
    name: str
    array: np.ndarray[Any, Any] | None  #: ``None``: a barrier
    output: np.ndarray[Any, Any] | None = None  #: an allgather's or reduce-scatter's
    regions: tuple[Region, ...] = ()  #: the array's, then the output's


def view(session: ClientSession, where: Region, dtype: str) -> np.ndarray[Any, Any]:
    """The array at ``where`` in ``session``'s segments.

    Raises:
        UsageError: the segment is not (or no longer) attached, or the bytes are outside it.
    """
    seg, off, nbytes = where
    return np.frombuffer(session.segment(seg).view(off, nbytes), dtype=dtype)


def parse(meta: Meta, session: ClientSession) -> Parsed:
    """Read and check a ``collective`` request of ``session``.

    Raises:
        UsageError: a field missing or out of range, the arrays' sizes unlike the kind needs.
    """
    kind, name = get_str(meta, "kind"), get_str(meta, "name")
    if not 0 < len(name) <= MAX_NAME:
        raise UsageError(f"a collective name has 1 to {MAX_NAME} characters")
    if kind == "barrier":
        return Parsed(spec=Spec(kind="barrier"), name=name, array=None)
    dtype = get_str(meta, "dtype")
    if dtype not in ITEMSIZE or (dtype == "uint8" and kind != "allgather"):
        raise UsageError(
            f"dtype {dtype!r}: collectives reduce {', '.join(REDUCE_DTYPES)} (an allgather "
            "also gathers uint8: bytes)"
        )
    nbytes = get_int(meta, "nbytes")
    if nbytes % ITEMSIZE[dtype]:
        raise UsageError(f"{nbytes} B is not a whole number of {dtype} elements")
    regions: tuple[Region, ...] = (region(meta),)
    array = view(session, regions[0], dtype)
    fields: dict[str, Any] = {"kind": kind, "count": len(array), "dtype": dtype}
    output = None
    if kind == "allreduce":
        late = meta.get("late", "sum")  # (partial modes; Spec.check checks it, and this)
        algorithm = meta.get("algorithm", "auto")
        fields.update(op=get_str(meta, "reduce"), mode=get_str(meta, "mode"), late=late)
        fields.update(algorithm=algorithm)
    elif kind == "broadcast":
        root = get_int(meta, "root")
        if root >= session.size:
            raise UsageError(f"root {root} is outside job {session.job!r} of {session.size}")
        fields.update(root=root)
    elif kind in GATHERS:
        regions += (_output(meta),)
        output = view(session, regions[1], dtype)
        fields.update(count=_block(kind, len(array), len(output), session.size, dtype))
        if kind == "reduce_scatter":
            fields.update(op=get_str(meta, "reduce"))
    else:
        raise UsageError(f"kind {kind!r}: must be allreduce, broadcast, barrier, or a gather")
    spec = asked(Spec(**fields))
    spec.check()
    if spec.partial and session.size > exact_count(dtype):
        raise UsageError(
            f"a {spec.mode} allreduce of {dtype} counts its active ranks in {dtype}, exactly "
            f"up to {exact_count(dtype)} ranks, not {session.size}: use float32"
        )
    return Parsed(spec=spec, name=name, array=array, output=output, regions=regions)


def _output(meta: Meta) -> Region:
    return get_int(meta, "out_seg"), get_int(meta, "out_off"), get_int(meta, "out_nbytes")


def _block(kind: str, given: int, wanted: int, size: int, dtype: str) -> int:
    """The elements of one rank's block, from the input's (``given``) and the output's
    (``wanted``) elements in a job of ``size`` ranks.

    Raises:
        UsageError: the sizes are not ``k`` and ``size * k`` as the kind needs.
    """
    if kind == "allgather" and wanted != size * given:
        raise UsageError(
            f"an allgather of {given} {dtype} a rank fills {size * given} (the job's {size} "
            f"ranks' blocks), not an output of {wanted}"
        )
    if kind == "reduce_scatter" and (given != size * wanted):
        raise UsageError(
            f"a reduce_scatter's input has the job's {size} ranks' blocks of its output's "
            f"{wanted} {dtype}: {size * wanted}, not {given}"
        )
    return given if kind == "allgather" else wanted
