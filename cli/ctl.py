"""``fabricctl``: control and watch fabricd.

This module is the command group and nothing else: each command lives in the module named
after it (``status`` and ``peers`` in :mod:`~fabricd.cli.status`, ``local-cluster`` in
:mod:`~fabricd.cli.local_cluster`, ...), and what they share (consoles, options, formats) in
:mod:`~fabricd.cli.common`.  Each command parses its arguments, calls one function of the
client library or the daemon package, and prints the result for humans (rich tables) or, with
``--json``, for scripts.
"""

from __future__ import annotations

import click

from fabricd.cli.bench import bench
from fabricd.cli.config import config
from fabricd.cli.daemon import main as daemon
from fabricd.cli.demo import demo
from fabricd.cli.graph import graph
from fabricd.cli.k8s import k8s
from fabricd.cli.local_cluster import local_cluster
from fabricd.cli.slurm import slurm
from fabricd.cli.stalls import stalls
from fabricd.cli.status import peers, status
from fabricd.cli.top import top


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fabricd")
def main() -> None:
    """Control and watch the fabricd daemon of this node."""


main.add_command(daemon, "daemon")
main.add_command(bench, "bench")
main.add_command(graph, "graph")
main.add_command(status)
main.add_command(peers)
main.add_command(stalls)
main.add_command(top)
main.add_command(config)
main.add_command(local_cluster)
main.add_command(demo)
main.add_command(k8s)
main.add_command(slurm)


if __name__ == "__main__":
    main()
