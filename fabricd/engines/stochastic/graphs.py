"""Communication graphs for stochastic reduce, and their spectral gap (ASAP §3.1, Appendix A).

Rules: a graph is directed, on nodes ``0..n-1``; an edge ``(src, dst)`` means "``src`` sends
its model to ``dst`` every round", so ``src`` is an in-neighbour of ``dst``.  Every node also
counts its own model as an input: that self-loop is implicit, never an edge of the list.  A
graph whose averaging never reaches agreement (spectral gap 0: disconnected) is refused with a
:class:`~fabricd.errors.UsageError` when it is built, so every :class:`Graph` has a positive
gap.  Sans-IO: numbers and lists only.

Theory of operation: ASAP averages each node's model with its in-neighbours' (eq. A.2), which
is one multiplication by the averaging matrix

    P = diag(d_in)^-1 (A + I),   (A + I)[dst, src] = 1 for each edge and for src == dst,

where ``d_in`` counts the node itself.  Its spectral gap, as ASAP computes it (Appendix A), is

    gap = 1 - sigma_2(P),

``sigma_2`` being the second largest *singular value* of ``P`` (not an eigenvalue modulus).
The paper also writes it ``sigma_1(P) - sigma_2(P)`` and assumes ``sigma_1(P) = 1``, which
holds when every node has the same in-degree (then ``P`` is doubly stochastic); for the star
and the chain ``sigma_1 > 1`` and we keep ``1 - sigma_2``, the formula the paper says it
calculates.  With one node there is no second singular value: the gap is 1 (``P = [1]`` is
already the average).  A gap of at most 0 is refused: with no node whose model reaches every
other node the gap is exactly 0; a graph that is connected but whose in-degrees are so unequal
that ``sigma_2 >= 1`` has a gap <= 0 that predicts nothing either.

The generators (names as ``fabricctl graph --kind`` spells them):

- ``all-to-all``: every node sends to every other; ``P = 11^T / n``, gap 1.
- ``star``: the parameter server, node 0 the centre: each worker sends to 0 and 0 to each
  worker.
- ``chain``: ``i -> i+1`` for ``i < n-1``, one way (ASAP Fig. 2(d): an update needs n-1 rounds
  to reach the last node).
- ``ring``: ``i -> i+1 mod n``; gap ``1 - cos(pi/n)`` for n >= 2 (``P = (I + S)/2`` is
  circulant, so its singular values are its eigenvalue moduli ``|cos(pi j/n)|``).
- ``expander``: ASAP's root expander: ``i -> i+1`` and ``i -> i+ceil(sqrt(n))``, mod n
  (coinciding or self-loop edges dropped, so n <= 3 gives fewer than two out-edges).
- ``regular``: a random k-regular digraph (in- and out-degree k, no self-loop, no parallel
  edge), deterministic for a seed: degree-preserving edge switches from a circulant, then
  components joined (see :func:`regular`).
- ``edges``: a user-supplied list.

Bytes sent per rank per round for a model of B bytes: out-degree x B.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

#: the generators' names, as ``fabricctl graph --kind`` and the client spell them
KINDS: Final = ("all-to-all", "star", "chain", "ring", "expander", "regular", "edges")

#: gaps at or below this are treated as 0 (floating-point noise of the singular values)
_GAP_EPSILON: Final = 1e-9

#: edge switches per edge of a random regular graph: enough to forget the circulant it began as
_SWITCHES_PER_EDGE: Final = 10

Edge = tuple[int, int]


@dataclass(frozen=True)
class Graph:
    """A directed communication graph on ``n`` nodes with a positive spectral gap.

    Build one with a generator (:func:`build` or the functions named like the kinds), never
    directly: they check it.
    """

    kind: str
    n: int
    #: ``(src, dst)`` pairs, sorted: ``src`` sends its model to ``dst`` each round
    edges: tuple[Edge, ...]
    #: ``out_neighbours[i]``: the nodes ``i`` sends to, ascending
    out_neighbours: tuple[tuple[int, ...], ...]
    #: ``in_neighbours[i]``: the nodes ``i`` receives from, ascending (not ``i`` itself)
    in_neighbours: tuple[tuple[int, ...], ...]
    #: ``1 - sigma_2(P)`` (module docstring), > 0
    spectral_gap: float

    @property
    def out_degrees(self) -> tuple[int, ...]:
        """Each node's out-degree (edges it sends on; the self-loop not counted)."""
        return tuple(len(targets) for targets in self.out_neighbours)

    @property
    def in_degrees(self) -> tuple[int, ...]:
        """Each node's in-degree (edges it receives on; the self-loop not counted)."""
        return tuple(len(sources) for sources in self.in_neighbours)

    def bytes_per_round(self, model_bytes: int) -> tuple[int, ...]:
        """Bytes each node sends per round for a model of ``model_bytes``: out-degree x B."""
        if model_bytes < 0:
            raise UsageError(f"a model has 0 bytes or more, not {model_bytes}")
        return tuple(degree * model_bytes for degree in self.out_degrees)

    def averaging_matrix(self) -> np.ndarray:
        """ASAP's ``P = diag(d_in)^-1 (A + I)``: row ``i`` averages node ``i``'s inputs."""
        return _averaging_matrix(self.n, self.edges)


def build(
    kind: str,
    n: int | None = None,
    *,
    degree: int | None = None,
    seed: int = 0,
    edges: Sequence[Edge] | None = None,
) -> Graph:
    """The graph of ``kind`` (one of :data:`KINDS`) on ``n`` nodes.

    ``degree`` is for ``regular`` only and required there; ``edges`` is for ``edges`` only and
    required there (``n`` then defaults to the largest node named + 1).

    Raises:
        UsageError: an unknown kind, an option the kind does not take or lacks, an impossible
            graph, or a disconnected one.
    """
    if kind not in KINDS:
        raise UsageError(f"unknown graph kind {kind!r}: one of {', '.join(KINDS)}")
    if degree is not None and kind != "regular":
        raise UsageError(f"a degree is for the regular kind only, not {kind}")
    if edges is not None and kind != "edges":
        raise UsageError(f"an edge list is for the edges kind only, not {kind}")
    if kind == "edges":
        if edges is None:
            raise UsageError("the edges kind needs an edge list")
        if n is None:
            n = 1 + max((max(edge) for edge in edges), default=0)
        return from_edges(n, edges)
    if n is None:
        raise UsageError(f"a {kind} graph needs a node count")
    if kind == "regular":
        if degree is None:
            raise UsageError("a regular graph needs a degree")
        return regular(n, degree, seed)
    generators = {
        "all-to-all": all_to_all,
        "star": star,
        "chain": chain,
        "ring": ring,
        "expander": expander,
    }
    return generators[kind](n)


def from_spec(spec: Mapping[str, Any]) -> Graph:
    """The graph a stochastic reduce's spec names (``graph``, ``n``, ``degree``, ``seed``,
    ``edges``: a call's or a peer's frame's), over the job's ``n`` ranks.

    Raises:
        UsageError: as :func:`build`, or edges that are not pairs of the job's ranks.
    """
    edges = spec["edges"]
    pairs = None
    if edges is not None:
        if not all(
            isinstance(e, list | tuple) and len(e) == 2 and all(type(x) is int for x in e)
            for e in edges
        ):
            raise UsageError("edges: a list of [src, dst] pairs of ranks")
        pairs = [(int(a), int(b)) for a, b in edges]
        if any(not 0 <= x < spec["n"] for pair in pairs for x in pair):
            raise UsageError(f"edges name ranks outside the job's 0..{spec['n'] - 1}")
    graph = build(spec["graph"], spec["n"], degree=spec["degree"], seed=spec["seed"], edges=pairs)
    if graph.n != spec["n"]:
        raise UsageError(f"a graph of {graph.n} ranks for a job of {spec['n']}")
    return graph


def all_to_all(n: int) -> Graph:
    """Every node sends to every other node (all-reduce): gap 1."""
    _check_count(n)
    return _graph("all-to-all", n, ((i, j) for i in range(n) for j in range(n) if i != j))


def star(n: int) -> Graph:
    """The parameter server: node 0 the centre, each worker sending to it and it to each."""
    _check_count(n)
    return _graph("star", n, [(0, i) for i in range(1, n)] + [(i, 0) for i in range(1, n)])


def chain(n: int) -> Graph:
    """``i -> i+1`` for each ``i < n-1``, one way."""
    _check_count(n)
    return _graph("chain", n, ((i, i + 1) for i in range(n - 1)))


def ring(n: int) -> Graph:
    """``i -> i+1 mod n``, one way: gap ``1 - cos(pi/n)`` for n >= 2."""
    _check_count(n)
    return _graph("ring", n, ((i, (i + 1) % n) for i in range(n)))


def expander(n: int) -> Graph:
    """ASAP's root expander: ``i -> i+1`` and ``i -> i+ceil(sqrt(n))``, both mod n."""
    _check_count(n)
    root = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) exactly, for n >= 1
    return _graph("expander", n, ((i, (i + step) % n) for i in range(n) for step in (1, root)))


def regular(n: int, k: int, seed: int = 0) -> Graph:
    """A random k-regular digraph: every node sends to k others and receives from k others.

    Deterministic for ``(n, k, seed)`` (numpy's PCG64).  It starts from the circulant
    ``i -> i+1..i+k``, makes ``10 x n x k`` random degree-preserving switches (edges ``a->b``
    and ``c->d`` become ``a->d`` and ``c->b`` when that makes no self-loop and no parallel
    edge), then joins its weakly connected components: in a digraph where each node's
    in-degree equals its out-degree each such component is closed and strongly connected, and
    a switch between an edge of one and an edge of another merges them.

    Raises:
        UsageError: k outside ``0..n-1`` (no such graph), or k = 0 with n > 1 (disconnected).
    """
    _check_count(n)
    if not 0 <= k <= n - 1:
        raise UsageError(
            f"no {k}-regular graph on {n} nodes: each node sends to k distinct other nodes, "
            f"so 0 <= k <= {n - 1}"
        )
    if k == 0 and n > 1:
        raise UsageError(f"a 0-regular graph on {n} nodes is disconnected: use k >= 1")
    rng = np.random.default_rng(seed)
    label = [int(node) for node in rng.permutation(n)]
    edges = [(label[i], label[(i + step) % n]) for i in range(n) for step in range(1, k + 1)]
    present = set(edges)
    draws = rng.integers(0, len(edges), size=(_SWITCHES_PER_EDGE * len(edges), 2)).tolist()
    for first, second in draws:
        _switch(edges, present, first, second)
    components = _weak_components(n, edges)
    while len(components) > 1:
        one, other = components[0], components[1]
        inside_one = [i for i, (src, _) in enumerate(edges) if src in one]
        inside_other = [i for i, (src, _) in enumerate(edges) if src in other]
        first = inside_one[int(rng.integers(0, len(inside_one)))]
        second = inside_other[int(rng.integers(0, len(inside_other)))]
        _switch(edges, present, first, second)  # no edge between components: always taken
        components = _weak_components(n, edges)
    return _graph("regular", n, edges)


def from_edges(n: int, edges: Iterable[Edge]) -> Graph:
    """A user-supplied graph: ``(src, dst)`` pairs on nodes ``0..n-1``.

    Raises:
        UsageError: a node outside ``0..n-1``, a self-loop (each node already counts its own
            model), an edge given twice, or a disconnected graph.
    """
    _check_count(n)
    listed: list[Edge] = []
    seen: set[Edge] = set()
    for src, dst in edges:
        if not (0 <= src < n and 0 <= dst < n):
            raise UsageError(f"edge {src}->{dst} names a node outside 0..{n - 1}")
        if src == dst:
            raise UsageError(
                f"edge {src}->{dst} is a self-loop: each node already counts its own model"
            )
        if (src, dst) in seen:
            raise UsageError(f"edge {src}->{dst} is given twice")
        seen.add((src, dst))
        listed.append((src, dst))
    return _graph("edges", n, listed)


def parse_edges(text: str) -> list[Edge]:
    """An edge list's text: one ``src dst`` (or ``src,dst``) per line; ``#`` starts a comment.

    Raises:
        UsageError: a line that is not two non-negative integers.
    """
    edges: list[Edge] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields:
            continue
        if len(fields) != 2 or not all(field.isdigit() for field in fields):
            raise UsageError(f"line {number}: {line.strip()!r} is not 'src dst' (two node numbers)")
        edges.append((int(fields[0]), int(fields[1])))
    return edges


def spectral_gap(n: int, edges: Iterable[Edge]) -> float:
    """ASAP's gap ``1 - sigma_2(P)`` of the graph (module docstring); 1.0 for one node.

    Not checked: it may be 0 (disconnected) or below (connected, in-degrees very unequal).
    """
    if n == 1:
        return 1.0
    singular = np.linalg.svd(_averaging_matrix(n, edges), compute_uv=False)
    return float(1.0 - singular[1])


def _check_count(n: int) -> None:
    if n < 1:
        raise UsageError(f"a graph has at least one node, not {n}")


def _averaging_matrix(n: int, edges: Iterable[Edge]) -> np.ndarray:
    inputs = np.eye(n)
    for src, dst in edges:
        inputs[dst, src] = 1.0
    result: np.ndarray = inputs / inputs.sum(axis=1, keepdims=True)
    return result


def _graph(kind: str, n: int, edges: Iterable[Edge]) -> Graph:
    """The checked graph of distinct, loop-free ``edges`` (generators' coinciding edges and
    self-loops are dropped here).

    Raises:
        UsageError: the gap is at most 0.
    """
    unique = sorted({(src, dst) for src, dst in edges if src != dst})
    gap = spectral_gap(n, unique)
    if gap <= _GAP_EPSILON:
        if not _rooted(n, unique):
            raise UsageError(
                f"the {kind} graph on {n} nodes is disconnected: no node's model reaches every "
                "other node, so averaging over it never agrees (spectral gap 0)"
            )
        raise UsageError(
            f"the {kind} graph on {n} nodes has spectral gap {gap:.3g} <= 0 (1 - sigma_2(P), "
            "ASAP Appendix A): its in-degrees are too unequal for the gap to bound convergence"
        )
    outs: list[list[int]] = [[] for _ in range(n)]
    ins: list[list[int]] = [[] for _ in range(n)]
    for src, dst in unique:
        outs[src].append(dst)
        ins[dst].append(src)
    return Graph(
        kind=kind,
        n=n,
        edges=tuple(unique),
        out_neighbours=tuple(tuple(targets) for targets in outs),
        in_neighbours=tuple(tuple(sorted(sources)) for sources in ins),
        spectral_gap=gap,
    )


def _rooted(n: int, edges: Sequence[Edge]) -> bool:
    """Whether some node's model reaches every node (a spanning out-tree exists)."""
    outs: list[list[int]] = [[] for _ in range(n)]
    for src, dst in edges:
        outs[src].append(dst)
    for root in range(n):
        reached = {root}
        frontier = deque([root])
        while frontier:
            for target in outs[frontier.popleft()]:
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
        if len(reached) == n:
            return True
    return False


def _switch(edges: list[Edge], present: set[Edge], first: int, second: int) -> None:
    """Edges ``a->b`` (at ``first``) and ``c->d`` (at ``second``) become ``a->d`` and
    ``c->b``, unless that makes a self-loop or a parallel edge: degrees are unchanged."""
    a, b = edges[first]
    c, d = edges[second]
    if a == d or c == b or (a, d) in present or (c, b) in present:
        return
    present.difference_update({(a, b), (c, d)})
    present.update({(a, d), (c, b)})
    edges[first] = (a, d)
    edges[second] = (c, b)


def _weak_components(n: int, edges: Sequence[Edge]) -> list[set[int]]:
    """The node sets of the weakly connected components, in order of their smallest node."""
    parent = list(range(n))

    def find(node: int) -> int:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for src, dst in edges:
        parent[find(src)] = find(dst)
    groups: dict[int, set[int]] = {}
    for node in range(n):
        groups.setdefault(find(node), set()).add(node)
    return sorted(groups.values(), key=min)
