"""The stochastic-reduce facet: model averaging over a communication graph (ASAP §3-§4).

``fab.stochastic_reduce(w, graph="expander", sync="notify-ack")`` averages the model ``w`` (an
array made by ``fab.array()``, float16/32/64) in place with the models its in-neighbours in
``graph`` handed the same round (ASAP eq. A.2), and returns the round and how many of their
updates it used.  The graph is over the job's ranks: a kind of ``fabricctl graph``
(``all-to-all``, ``star``, ``chain``, ``ring``, ``expander``, ``regular`` with ``degree=`` and
``seed=``, or ``edges=[(src, dst), ...]``).  The daemon's graph service
(:mod:`fabricd.daemon.services.stochastic`) runs it as a persistent schedule per (job, name): every
rank must call a reduce of one name with the same graph, sync, dtype and size, one call at a
time, and its ``k``-th call is round ``k``.

``sync``:

* ``"notify-ack"`` (default): a rank averages once every in-neighbour's update of the round
  is in, whole, and sends its next update only after its out-neighbours acknowledged the last:
  every reduce uses all in-neighbours (``inputs == in_degree``), and a slow rank holds back
  only its neighbours, not the whole job;
* ``"barrier"`` (BSP): updates, then a barrier over all ranks, then the average of whatever
  arrived whole for the round (``inputs`` may be fewer: ASAP Fig. 8);
* ``"async"``: no waiting; the average takes each in-neighbour's newest whole update not used
  yet.

A lost rank fails the calls that need it (``PeerFailed``: under notify-ack its neighbours',
under barrier everybody's); async goes on without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from fabricd.client.handle import Handle
from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.errors import UsageError
from fabricd.frames.fields import MAX_NAME
from fabricd.frames.stochastic import MAX_SPEC_EDGES

if TYPE_CHECKING:
    from collections.abc import Iterable

    from fabricd.client import checks
    from fabricd.client.arrays import SharedArrays
    from fabricd.client.connection import Connection
    from fabricd.wire import Meta

Sync = Literal["notify-ack", "barrier", "async"]
SYNCS: Final = ("notify-ack", "barrier", "async")
#: the graph kinds (as ``fabricctl graph --kind`` names them)
GRAPHS: Final = ("all-to-all", "star", "chain", "ring", "expander", "regular", "edges")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceResult:
    """What a stochastic reduce call returns.

    ``round``: the round whose average is now in the array (0, 1, ...; per reduce name).
    ``inputs``: how many in-neighbours' updates the average used (the model itself besides).
    ``in_degree``: how many in-neighbours the rank has (``inputs`` under notify-ack).
    ``torn``, ``stale``: updates not used because they were still landing, or were another
    round's (barrier, async).
    """

    round: int
    inputs: int
    in_degree: int
    torn: int
    stale: int


class StochasticReduce:
    """Stochastic reduce calls over the ranks of a job, on arrays made by ``fab.array()``.

    Between a call and its completion the array must not be touched: the daemon reads the
    model from it and writes the average into it.
    """

    def __init__(
        self, connection: Connection, arrays: SharedArrays, job: checks.Membership | None
    ) -> None:
        self._connection = connection
        self._arrays = arrays
        self._job = job

    def stochastic_reduce(
        self,
        array: np.ndarray[Any, Any],
        graph: str = "expander",
        sync: Sync = "notify-ack",
        *,
        degree: int | None = None,
        seed: int = 0,
        edges: Iterable[tuple[int, int]] | None = None,
        name: str | None = None,
        timeout: float | None = None,
    ) -> ReduceResult:
        """Average ``array`` in place with its in-neighbours' models of this round.

        Raises:
            UsageError: a bad argument, a graph that cannot be built (disconnected, a degree
                the kind does not take), or a call unlike the reduce's first (graph, sync,
                dtype, size).
            PeerFailed: a rank the round needs was lost (notify-ack: a neighbour; barrier:
                any rank).
            Timeout: ``timeout`` passed.  The call is still open in the daemon, and this
                rank's next call of the name is refused until it ends: with a timeout, use
                :meth:`stochastic_reduce_async` and wait on its handle again.
        """
        return self.stochastic_reduce_async(
            array, graph, sync, degree=degree, seed=seed, edges=edges, name=name
        ).wait(timeout)

    def stochastic_reduce_async(
        self,
        array: np.ndarray[Any, Any],
        graph: str = "expander",
        sync: Sync = "notify-ack",
        *,
        degree: int | None = None,
        seed: int = 0,
        edges: Iterable[tuple[int, int]] | None = None,
        name: str | None = None,
    ) -> Handle[ReduceResult]:
        """Start a stochastic reduce; leave ``array`` alone until ``handle.wait()`` returns."""
        if self._job is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        if sync not in SYNCS:
            raise UsageError(f"sync must be one of {', '.join(map(repr, SYNCS))}, not {sync!r}")
        if graph not in GRAPHS:
            raise UsageError(f"graph must be one of {', '.join(map(repr, GRAPHS))}, not {graph!r}")
        if degree is not None and (type(degree) is not int or degree < 1):
            raise UsageError(f"degree must be an int >= 1, not {degree!r}")
        if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
            raise UsageError(f"seed must be an int >= 0, not {seed!r}")
        pairs = None if edges is None else _edges(edges)
        seg, offset, label = self._arrays.find(array)
        if array.dtype.name not in DTYPES:
            raise UsageError(f"a stochastic reduce averages {', '.join(DTYPES)}, not {array.dtype}")
        if not array.flags.writeable:
            raise UsageError("a stochastic reduce writes the average into the array: not read-only")
        reduce = name if name is not None else f"reduce:{graph}:{sync}:{label}"
        if not isinstance(reduce, str) or not 0 < len(reduce) <= MAX_NAME:
            raise UsageError(f"a reduce name is a str of 1 to {MAX_NAME} characters, not {name!r}")
        request = {
            "name": reduce,
            "seg": seg,
            "off": offset,
            "nbytes": array.nbytes,
            "dtype": array.dtype.name,
            "graph": graph,
            "degree": degree,
            "seed": int(seed),
            "edges": pairs,
            "sync": sync,
        }
        call = self._connection.submit(
            "stochastic_reduce", request, what=f"stochastic reduce {reduce!r}"
        )
        return Handle(self._connection, call, _result)


def _edges(edges: Iterable[tuple[int, int]]) -> list[list[int]]:
    """``edges`` as the request carries them, or a UsageError naming the first bad one."""
    pairs: list[list[int]] = []
    for edge in edges:
        if (
            not isinstance(edge, tuple | list)
            or len(edge) != 2
            or not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in edge)
        ):
            raise UsageError(f"edges are (src, dst) pairs of ranks (ints), not {edge!r}")
        pairs.append([int(edge[0]), int(edge[1])])
        if len(pairs) > MAX_SPEC_EDGES:
            raise UsageError(f"at most {MAX_SPEC_EDGES} edges (a spec travels in every frame)")
    return pairs


def _result(reply: Meta) -> ReduceResult:
    return ReduceResult(
        round=int(reply["round"]),
        inputs=int(reply["inputs"]),
        in_degree=int(reply["in_degree"]),
        torn=int(reply["torn"]),
        stale=int(reply["stale"]),
    )
