"""``fabricctl k8s config``: the config of one node of a Kubernetes DaemonSet, with the node list
read from the DaemonSet's headless Service (:mod:`fabricd.deploy.kubernetes`,
docs/deployment.md).  The DaemonSet's init container runs it before the daemon starts.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click
from rich.markup import escape

from fabricd.cli.common import console, errors
from fabricd.deploy.kubernetes import (
    RETRY_INTERVAL,
    render_config,
    wait_for_members,
    write_config,
)
from fabricd.errors import ConfigError


@click.group()
def k8s() -> None:
    """Running fabricd as a Kubernetes DaemonSet (docs/deployment.md)."""


@k8s.command("config")
@click.option("--service", required=True, help="the headless Service's DNS name")
@click.option(
    "--expect",
    type=click.IntRange(min=1),
    required=True,
    help="how many nodes the DaemonSet runs on: the Service must list that many pods",
)
@click.option("--host-ip", required=True, help="this node's address (the pod's status.hostIP)")
@click.option("--node-name", default="", help="this node's name (spec.nodeName), for the record")
@click.option("--port", type=click.IntRange(1, 65535), default=7700, show_default=True)
@click.option(
    "--base",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="the config every node shares (a ConfigMap), without node_id and nodes",
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="where to write"
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="seconds to wait for the Service to list every pod",
)
def k8s_config(
    service: str,
    expect: int,
    host_ip: str,
    node_name: str,
    port: int,
    base: Path,
    out: Path,
    wait: float,
) -> None:
    """Write this node's config: the base, plus node_id and nodes from the Service's pods."""
    try:
        membership = wait_for_members(
            service,
            expect=expect,
            host_ip=host_ip,
            port=port,
            attempts=1 + math.ceil(wait / RETRY_INTERVAL),
        )
        text = render_config(base.read_text(), membership, node_name=node_name, service=service)
        write_config(text, out)
    except (ConfigError, OSError) as exc:
        errors.print(f"[red]fabricctl k8s config:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    console.print(
        f"node {escape(node_name or host_ip)} is node_id {membership.node_id} of "
        f"{len(membership.nodes)}: {escape(', '.join(membership.nodes))}; wrote {escape(str(out))}",
        soft_wrap=True,
    )
