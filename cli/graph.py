"""``fabricctl graph``: a communication graph's edges, degrees, spectral gap and traffic.

For choosing a graph for stochastic reduce (ASAP §3, docs/graphs.md): the spectral gap predicts
how fast averaging over the graph converges, out-degree x model bytes what it costs each rank
per round.  With ``--json`` it prints one object whose ``spectral_gap`` and ``edges`` keys are a
contract (scripts and benchmarks read them) and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from fabricd.engines.stochastic import graphs
from fabricd.errors import UsageError

console = Console(emoji=False)


@click.command()
@click.option("--kind", type=click.Choice(graphs.KINDS), required=True, help="the graph")
@click.option("-n", "--nodes", type=click.IntRange(1), default=None, help="node count")
@click.option(
    "--model-bytes",
    type=click.IntRange(0),
    default=1 << 20,
    show_default=True,
    help="bytes of the model each rank sends on each out-edge per round",
)
@click.option("--degree", type=click.IntRange(0), default=None, help="k, for --kind regular")
@click.option("--seed", type=int, default=0, show_default=True, help="for --kind regular")
@click.option(
    "--edges",
    "edges_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="for --kind edges: one 'src dst' per line (src sends to dst), # comments",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
def graph(
    kind: str,
    nodes: int | None,
    model_bytes: int,
    degree: int | None,
    seed: int,
    edges_file: Path | None,
    as_json: bool,
) -> None:
    """Show a communication graph: edges, degrees, spectral gap, bytes per rank per round."""
    try:
        edges = graphs.parse_edges(edges_file.read_text()) if edges_file is not None else None
        built = graphs.build(kind, nodes, degree=degree, seed=seed, edges=edges)
    except UsageError as exc:
        raise click.UsageError(str(exc)) from None
    sent = built.bytes_per_round(model_bytes)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "kind": built.kind,
                    "n": built.n,
                    "edges": [list(edge) for edge in built.edges],
                    "spectral_gap": built.spectral_gap,
                    "out_neighbours": [list(targets) for targets in built.out_neighbours],
                    "in_neighbours": [list(sources) for sources in built.in_neighbours],
                    "out_degree": list(built.out_degrees),
                    "in_degree": list(built.in_degrees),
                    "model_bytes": model_bytes,
                    "bytes_per_rank_per_round": list(sent),
                }
            )
        )
        return
    table = Table(title=f"{built.kind} graph, {built.n} nodes, {len(built.edges)} edges")
    for column in ("rank", "sends to", "receives from", "out", "in", "bytes/round"):
        table.add_column(column, justify="left" if "to" in column or "from" in column else "right")
    for rank in range(built.n):
        table.add_row(
            str(rank),
            " ".join(map(str, built.out_neighbours[rank])) or "-",
            " ".join(map(str, built.in_neighbours[rank])) or "-",
            str(built.out_degrees[rank]),
            str(built.in_degrees[rank]),
            f"{sent[rank]:,}",
        )
    console.print(table)
    console.print(
        f"spectral gap {built.spectral_gap:.4g}  (ASAP: 1 - sigma_2(P), P = diag(d_in)^-1 (A + I))"
    )
    console.print(
        f"bytes per rank per round: {min(sent):,} to {max(sent):,} "
        f"({sum(sent):,} in all) for a {model_bytes:,}-byte model"
    )
