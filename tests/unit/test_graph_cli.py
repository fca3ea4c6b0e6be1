"""What ``fabricctl graph`` prints: the table for people, the JSON contract for scripts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fabricd.cli.ctl import main as fabricctl
from fabricd.engines.stochastic import graphs


def invoke(*args: str):
    return CliRunner().invoke(fabricctl, ["graph", *args])


def test_json_has_the_contract_keys_and_agrees_with_the_engine():
    result = invoke("--kind", "expander", "-n", "25", "--model-bytes", "1000", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    expected = graphs.expander(25)
    assert document["spectral_gap"] == pytest.approx(expected.spectral_gap)
    assert [tuple(edge) for edge in document["edges"]] == list(expected.edges)
    assert document["kind"] == "expander"
    assert document["n"] == 25
    assert document["out_degree"] == [2] * 25
    assert document["in_degree"] == [2] * 25
    assert document["bytes_per_rank_per_round"] == [2000] * 25
    assert document["model_bytes"] == 1000


@pytest.mark.parametrize("kind", ["all-to-all", "star", "chain", "ring", "expander"])
def test_every_kind_is_named_as_documented(kind):
    result = invoke("--kind", kind, "-n", "6", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["spectral_gap"] > 0


def test_the_table_shows_edges_degrees_gap_and_bytes():
    result = invoke("--kind", "star", "-n", "4", "--model-bytes", "100")
    assert result.exit_code == 0, result.output
    assert "star graph, 4 nodes, 6 edges" in result.output
    assert "spectral gap 0.5" in result.output
    assert "1 2 3" in result.output  # the centre sends to every worker
    assert "bytes per rank per round: 100 to 300 (600 in all)" in result.output


def test_a_regular_graph_is_deterministic_for_its_seed():
    first = invoke("--kind", "regular", "-n", "12", "--degree", "3", "--seed", "7", "--json")
    again = invoke("--kind", "regular", "-n", "12", "--degree", "3", "--seed", "7", "--json")
    assert first.exit_code == 0, first.output
    assert first.output == again.output
    assert json.loads(first.output)["out_degree"] == [3] * 12


def test_an_edge_file(tmp_path):
    path = tmp_path / "edges.txt"
    path.write_text("# a directed triangle\n0 1\n1 2\n2 0\n")
    result = invoke("--kind", "edges", "--edges", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["edges"] == [[0, 1], [1, 2], [2, 0]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "regular", "-n", "5", "--degree", "7"], "no 7-regular graph on 5 nodes"),
        (["--kind", "regular", "-n", "5"], "needs a degree"),
        (["--kind", "ring", "-n", "5", "--degree", "2"], "regular kind only"),
        (["--kind", "ring"], "needs a node count"),
        (["--kind", "mesh", "-n", "5"], "'mesh' is not one of"),
    ],
)
def test_impossible_requests_are_usage_errors_with_the_reason(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_a_disconnected_edge_list_is_refused(tmp_path):
    path = tmp_path / "edges.txt"
    path.write_text("0 1\n2 3\n")
    result = invoke("--kind", "edges", "--edges", str(path))
    assert result.exit_code == 2
    assert "disconnected" in result.output
