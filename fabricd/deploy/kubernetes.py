"""A Kubernetes DaemonSet's membership: the static node list, computed from DNS at each start.

The daemon knows its peers only from ``nodes``, a list every node must hold in the same order,
and its own index in it, ``node_id`` (:mod:`fabricd.daemon.config`).  In Kubernetes no operator
writes that list by hand: an init container of the DaemonSet runs ``fabricctl k8s config``
(:mod:`fabricd.cli.k8s`), which

1. resolves the DaemonSet's headless Service, whose DNS name lists the address of every pod it
   selects, ready or not (``publishNotReadyAddresses``: no daemon is ready before it has its
   config), until it lists exactly ``--expect`` addresses, this node's among them;
2. sorts them as numbers (so every node derives the same list from the same answers, whatever
   order DNS gave them in) and finds this node's by ``status.hostIP`` from the downward API
   (with ``hostNetwork`` a pod's address is its node's);
3. writes the base config (a ConfigMap) with ``node_id`` and ``nodes`` added, after checking
   that the daemon would accept it.

Rules: :func:`members` and :func:`render_config` are pure (DNS answers in, config text out) and
carry every decision; :func:`wait_for_members` and :func:`write_config` are the I/O around them,
with the resolver and the sleep passed in so that tests need no DNS and no clock.

What this does not do: the list is fixed when the pod starts.  A node added to or removed from
the DaemonSet is seen only after every daemon pod restarts with a new ``--expect``
(docs/deployment.md, "Limits"); etcd membership (issue 26, item 1) is what will lift that.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from fabricd.daemon.config import load
from fabricd.errors import ConfigError
from fabricd.transports.base import join_address

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

#: the settings this module writes; a base config that sets one of them is refused
MANAGED_KEYS: Final = ("node_id", "nodes")
#: seconds between two DNS queries while the Service lists too few pods
RETRY_INTERVAL: Final = 2.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True, kw_only=True)
class Membership:
    """This node's place in the fabric: ``nodes`` as every node lists it, and its index."""

    node_id: int
    nodes: tuple[str, ...]


def members(answers: Iterable[str], host_ip: str, port: int) -> Membership:
    """The fabric the answers describe: each address once, sorted, with ``port``.

    Only addresses of ``host_ip``'s family are kept (a dual-stack Service answers with both,
    and a node binds one).  Sorting by value is what makes the list the same on every node.

    Raises:
        ConfigError: ``host_ip`` or an answer is not an IP address, or ``host_ip`` is not among
            the answers (DNS does not list this pod yet, or the pod is not on the host network).
    """
    me = _address(host_ip, "the host IP")
    found = {_address(a, "a DNS answer") for a in answers}
    ordered = sorted((a for a in found if a.version == me.version), key=int)
    if me not in ordered:
        raise ConfigError(
            f"this node's address {me} is not among the Service's {len(ordered)} "
            f"addresses ({', '.join(map(str, ordered)) or 'none'})"
        )
    nodes = tuple(join_address(str(a), port) for a in ordered)
    return Membership(node_id=ordered.index(me), nodes=nodes)


def render_config(base: str, membership: Membership, *, node_name: str, service: str) -> str:
    """``base`` (TOML) with this node's ``node_id`` and ``nodes`` added, and a comment saying
    where they came from.

    Raises:
        ConfigError: ``base`` is not TOML, or it sets ``node_id`` or ``nodes`` itself (one
            place decides membership, or nodes could disagree about it).
    """
    try:
        settings = tomllib.loads(base)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"base config: {exc}") from None
    if taken := [key for key in MANAGED_KEYS if key in settings]:
        raise ConfigError(
            f"base config sets {', '.join(taken)}; leave membership to fabricctl k8s config, "
            "which computes it from the Service"
        )
    listed = ", ".join(f'"{node}"' for node in membership.nodes)
    return (
        f"{base.rstrip()}\n\n"
        f"# --- membership: written by `fabricctl k8s config` on node {node_name or '?'}\n"
        f"# from the addresses of Service {service} at the pod's start\n"
        f"node_id = {membership.node_id}\n"
        f"nodes = [{listed}]\n"
    )


def resolve(name: str) -> list[str]:
    """Every address DNS gives for ``name`` (one per pod of a headless Service); none when the
    name does not resolve (yet)."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in found})


def wait_for_members(
    service: str,
    *,
    expect: int,
    host_ip: str,
    port: int,
    attempts: int,
    lookup: Callable[[str], list[str]] = resolve,
    sleep: Callable[[float], None] = time.sleep,
) -> Membership:
    """Ask DNS for ``service`` until it lists ``expect`` addresses of this node's family, this
    node's among them, at most ``attempts`` times, :data:`RETRY_INTERVAL` apart.

    More addresses than ``expect`` is waited out too, not an error at once: during a rollout a
    Service that publishes not-ready addresses still lists the terminating pods for a while,
    and failing then would put every restarting pod in CrashLoopBackOff.

    Raises:
        ConfigError: the Service still lists other than ``expect`` addresses, or not this
            node's, after ``attempts`` queries (``--expect`` is wrong, the DaemonSet runs where
            it should not, or pods are missing).
    """
    me = _address(host_ip, "the host IP")
    found: set[Address] = set()
    for attempt in range(attempts):
        if attempt:
            sleep(RETRY_INTERVAL)
        answers = {_address(a, "a DNS answer") for a in lookup(service)}
        found = {a for a in answers if a.version == me.version}
        if len(found) == expect and me in found:
            return members(map(str, found), host_ip, port)
    if len(found) > expect:
        raise ConfigError(
            f"Service {service} still lists {len(found)} addresses, more than the {expect} "
            f"expected, after {attempts} queries; set --expect to the number of nodes the "
            "DaemonSet runs on"
        )
    raise ConfigError(
        f"Service {service} lists {len(found)} of the {expect} addresses expected "
        f"({', '.join(sorted(map(str, found))) or 'none'}; this node is {me}) after "
        f"{attempts} queries; "
        "are all the DaemonSet's pods scheduled, and does the Service publish not-ready ones?"
    )


def write_config(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` once the daemon's own loader accepts it (defaults and this
    file only: the daemon container's environment is not this one's).

    The file is written beside ``path`` and renamed over it, so a daemon never reads half of it.

    Raises:
        ConfigError: the daemon would refuse this config (the message names the key).
    """
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        load(temporary, environ={})
        os.chmod(temporary, 0o640)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _address(text: str, what: str) -> Address:
    """``text`` as an IP address, or a ConfigError naming ``what`` it was."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not an IP address") from None
