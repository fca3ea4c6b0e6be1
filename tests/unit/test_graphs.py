"""Communication graphs: generators for N = 1..64, ASAP's spectral gap against known values."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.stochastic import graphs
from fabricd.errors import UsageError

FIXED = ("all-to-all", "star", "chain", "ring", "expander")
COUNTS = range(1, 65)


def reaches_all(graph: graphs.Graph, root: int) -> bool:
    """Whether ``root``'s model reaches every node along the edges."""
    reached = {root}
    frontier = deque([root])
    while frontier:
        for target in graph.out_neighbours[frontier.popleft()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    return len(reached) == graph.n


def check_consistent(graph: graphs.Graph) -> None:
    """Edges, neighbour lists and degrees all say the same; no self-loop, no parallel edge."""
    assert len(set(graph.edges)) == len(graph.edges)
    assert all(src != dst for src, dst in graph.edges)
    assert all(0 <= node < graph.n for edge in graph.edges for node in edge)
    for node in range(graph.n):
        assert graph.out_neighbours[node] == tuple(d for s, d in graph.edges if s == node)
        assert graph.in_neighbours[node] == tuple(sorted(s for s, d in graph.edges if d == node))
    assert sum(graph.out_degrees) == sum(graph.in_degrees) == len(graph.edges)
    assert 0 < graph.spectral_gap <= 1 + 1e-12


@pytest.mark.parametrize("kind", FIXED)
@pytest.mark.parametrize("n", COUNTS)
def test_every_fixed_kind_is_consistent_and_connected_from_1_to_64_nodes(kind, n):
    graph = graphs.build(kind, n)
    check_consistent(graph)
    assert graph.kind == kind
    assert graph.n == n
    assert any(reaches_all(graph, root) for root in range(n))


@pytest.mark.parametrize("n", COUNTS)
def test_degrees_of_each_fixed_kind(n):
    assert graphs.all_to_all(n).out_degrees == (n - 1,) * n
    assert graphs.all_to_all(n).in_degrees == (n - 1,) * n
    star = graphs.star(n)
    assert star.out_degrees == star.in_degrees == (n - 1,) + (1,) * (n - 1)
    chain = graphs.chain(n)
    assert chain.out_degrees == (1,) * (n - 1) + (0,)
    assert chain.in_degrees == (0,) + (1,) * (n - 1)
    ring = graphs.ring(n)
    assert ring.out_degrees == ring.in_degrees == ((1,) * n if n > 1 else (0,))
    expander = graphs.expander(n)
    assert expander.out_degrees == expander.in_degrees
    assert set(expander.out_degrees) == {min(2, n - 1)}


@pytest.mark.parametrize("n", COUNTS)
def test_the_root_expander_sends_to_the_next_node_and_ceil_sqrt_n_ahead(n):
    step = math.ceil(math.sqrt(n))
    graph = graphs.expander(n)
    for node in range(n):
        wanted = {(node + 1) % n, (node + step) % n} - {node}
        assert set(graph.out_neighbours[node]) == wanted


@pytest.mark.parametrize("n", COUNTS)
def test_all_to_all_has_gap_one(n):
    assert graphs.all_to_all(n).spectral_gap == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", range(2, 65))
def test_a_rings_gap_is_one_minus_cos_pi_over_n(n):
    # P = (I + S)/2 with S the cyclic shift: circulant, hence normal, so its singular values
    # are its eigenvalue moduli |1 + w^j|/2 = |cos(pi j / n)|; the second largest is cos(pi/n)
    assert graphs.ring(n).spectral_gap == pytest.approx(1 - math.cos(math.pi / n), abs=1e-12)


def test_the_gap_is_one_minus_the_second_singular_value_of_the_averaging_matrix():
    graph = graphs.star(5)
    matrix = graph.averaging_matrix()
    assert matrix[0] == pytest.approx([0.2] * 5)  # the centre averages everyone
    assert matrix[3] == pytest.approx([0.5, 0, 0, 0.5, 0])  # a worker: itself and the centre
    singular = np.linalg.svd(matrix, compute_uv=False)
    assert graph.spectral_gap == pytest.approx(1 - singular[1])


@pytest.mark.parametrize("n", [6, 25])
def test_asaps_order_holds_at_the_sizes_of_its_figure_2(n):
    gap = {kind: graphs.build(kind, n).spectral_gap for kind in FIXED}
    assert gap["all-to-all"] == pytest.approx(1.0)
    assert gap["all-to-all"] > gap["star"] > gap["expander"] > gap["chain"]


@pytest.mark.parametrize(
    ("kind", "n", "gap"),
    [
        ("star", 6, 0.5),
        ("star", 25, 0.5),
        ("expander", 6, 0.4226),
        ("expander", 25, 0.1419),
        ("chain", 6, 0.0474),
        ("chain", 25, 0.0021),
        ("ring", 25, 0.0079),
    ],
)
def test_the_gaps_docs_graphs_md_lists(kind, n, gap):
    assert graphs.build(kind, n).spectral_gap == pytest.approx(gap, abs=5e-5)


def test_one_node_has_gap_one_and_sends_nothing():
    for kind in FIXED:
        graph = graphs.build(kind, 1)
        assert graph.edges == ()
        assert graph.spectral_gap == 1.0
        assert graph.bytes_per_round(1000) == (0,)


def test_bytes_per_round_are_out_degree_times_the_model():
    assert graphs.star(4).bytes_per_round(100) == (300, 100, 100, 100)
    assert graphs.expander(25).bytes_per_round(8) == (16,) * 25
    with pytest.raises(UsageError, match="0 bytes or more"):
        graphs.ring(3).bytes_per_round(-1)


@pytest.mark.parametrize("n", COUNTS)
def test_random_regular_graphs_for_a_few_degrees_from_1_to_64_nodes(n):
    for k in sorted({k for k in (1, 2, (n - 1) // 2, n - 1) if 1 <= k < n} or {0}):
        graph = graphs.regular(n, k, seed=n)
        check_consistent(graph)
        assert graph.out_degrees == graph.in_degrees == (k,) * n
        assert all(reaches_all(graph, root) for root in range(n))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_regular_graphs_are_regular_connected_and_deterministic(data):
    n = data.draw(st.integers(2, 40), label="n")
    k = data.draw(st.integers(1, n - 1), label="k")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    graph = graphs.regular(n, k, seed)
    check_consistent(graph)
    assert graph.out_degrees == graph.in_degrees == (k,) * n
    assert all(reaches_all(graph, root) for root in range(n))
    # P is doubly stochastic, so sigma_1 = 1 and the gap is at most 1
    assert np.linalg.svd(graph.averaging_matrix(), compute_uv=False)[0] == pytest.approx(1.0)
    assert graphs.regular(n, k, seed) == graph


def test_different_seeds_give_different_regular_graphs():
    assert len({graphs.regular(16, 3, seed).edges for seed in range(8)}) > 1


@pytest.mark.parametrize(
    ("n", "k", "message"),
    [
        (5, 5, "no 5-regular graph on 5 nodes"),
        (5, -1, "no -1-regular graph"),
        (1, 1, "no 1-regular graph on 1 nodes"),
        (4, 0, "disconnected"),
        (0, 0, "at least one node"),
    ],
)
def test_impossible_regular_graphs_are_refused(n, k, message):
    with pytest.raises(UsageError, match=message):
        graphs.regular(n, k)


def test_a_user_edge_list():
    graph = graphs.build("edges", edges=graphs.parse_edges("0 1\n1,2  # comment\n\n2 0\n"))
    assert graph.n == 3
    assert graph.edges == ((0, 1), (1, 2), (2, 0))
    assert graph.spectral_gap == pytest.approx(graphs.ring(3).spectral_gap)
    assert graphs.from_edges(5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)]).n == 5


@pytest.mark.parametrize(
    ("n", "edges", "message"),
    [
        (4, [(0, 1), (2, 3)], "disconnected"),
        (3, [(1, 0), (2, 0)], "disconnected"),  # workers to the server only: never back
        (3, [(0, 1), (1, 2), (2, 2)], "self-loop"),
        (3, [(0, 1), (0, 1), (1, 2)], "given twice"),
        (3, [(0, 3)], "outside 0..2"),
    ],
)
def test_bad_or_disconnected_edge_lists_are_refused(n, edges, message):
    with pytest.raises(UsageError, match=message):
        graphs.from_edges(n, edges)


def test_an_edge_file_that_is_not_pairs_of_numbers_is_refused():
    with pytest.raises(UsageError, match="line 2"):
        graphs.parse_edges("0 1\n1 2 3\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"kind": "mesh", "n": 4}, "unknown graph kind"),
        ({"kind": "ring", "n": 4, "degree": 2}, "regular kind only"),
        ({"kind": "ring", "n": 4, "edges": [(0, 1)]}, "edges kind only"),
        ({"kind": "regular", "n": 4}, "needs a degree"),
        ({"kind": "edges", "n": 4}, "needs an edge list"),
        ({"kind": "ring"}, "needs a node count"),
    ],
)
def test_build_refuses_options_a_kind_does_not_take_or_lacks(args, message):
    with pytest.raises(UsageError, match=message):
        graphs.build(**args)
