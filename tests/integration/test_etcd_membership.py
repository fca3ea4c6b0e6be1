"""Membership from etcd (docs/operations.md, "Membership from etcd"), with real daemons on
loopback and a real etcd (tests/etcd.py; Debian's etcd-server, installed when missing):

* a fourth daemon joins a running three-node fabric, nobody restarts, and a job spans all four;
* a daemon killed: its peers see it down (liveness), its lease expires and its registration
  goes; started again it takes its old id back;
* etcd restarted under a running fabric: links and jobs keep working, every daemon says etcd
  was unreachable and then connected again, and registrations are all there;
* etcd partitioned (SIGSTOP: connections hang): the fabric keeps its last view and says so in
  ``status``; once etcd is back, registration comes back;
* one daemon cut off from etcd while a slot changes hands: its stale view refuses the new
  holder (by name) instead of admitting it under the old holder's name, and admits it once
  the view has it;
* one daemon cut off from etcd while the peer it dials restarts: it refuses the new
  incarnation before sending AUTH, so that peer never admits and resets its links;
* etcd over TLS with client certificates and a password: daemons register and join the same.

Leases last 2 s here; a silent peer is down after 4 s, not FAST_LIVENESS's 1 s: these tests
are about etcd, and assert that links stay up, which a loaded machine's pauses of a second
must not fail.  Timeouts are hang guards only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd.daemon.config import load
from fabricd.daemon.launcher import LocalCluster
from fabricd.daemon.services import roster
from fabricd.daemon.services.roster import EtcdSettings
from tests.etcd import Etcd, Line, make_tls, skip_reason

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from fabricd.client import Client

#: a hang guard for anything the fabric or etcd must get to
GUARD = 60.0
TTL = 2


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    server = Etcd(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fabric(etcd: Etcd, make_cluster: Any) -> Callable[..., LocalCluster]:
    """Start a cluster of daemons that register in ``etcd`` (``make_cluster``'s: stopped, and
    their logs checked for tracebacks, at teardown)."""

    def make(size: int, **settings: Any) -> LocalCluster:
        cluster: LocalCluster = make_cluster(
            size, **{**ETCD_SETTINGS, "etcd_endpoints": [etcd.endpoint], **settings}
        )
        return cluster

    return make


ETCD_SETTINGS: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "suspect_after": 2.0,
    "down_after": 4.0,
    "membership": "etcd",
    "etcd_lease_ttl": TTL,
    "max_nodes": 8,
    "metrics_address": "",
}


def status(cluster: LocalCluster, i: int) -> dict[str, Any]:
    with fabricd.connect(socket_path=cluster.nodes[i].socket_path) as client:
        return client.status()


def wait_until(what: str, check: Callable[[], bool]) -> None:
    """Poll ``check`` until it holds (a hang guard of GUARD seconds)."""
    deadline = time.monotonic() + GUARD
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {GUARD}s: {what}")
        time.sleep(0.05)


def registered(cluster: LocalCluster, i: int) -> set[str]:
    """The names node ``i`` sees registered, itself included."""
    membership = status(cluster, i)["membership"]
    return {membership["name"], *membership["registered"]}


@contextlib.contextmanager
def ranks(cluster: LocalCluster, nodes: list[int], job: str) -> Iterator[list[Client]]:
    clients = [
        fabricd.connect(job=job, rank=r, size=len(nodes), socket_path=cluster.nodes[n].socket_path)
        for r, n in enumerate(nodes)
    ]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def allreduce_works(cluster: LocalCluster, nodes: list[int], job: str) -> None:
    """One sum allreduce with a rank on each of ``nodes``: every rank gets the right sum."""
    with ranks(cluster, nodes, job) as fabs:
        arrays = [f.array("g", (1000,), "float32") for f in fabs]
        for r, array in enumerate(arrays):
            array[:] = r + 1
        handles = [f.allreduce_async(a, "sum") for f, a in zip(fabs, arrays, strict=True)]
        for handle in handles:
            handle.wait(timeout=GUARD)
        expected = sum(range(1, len(nodes) + 1))
        for array in arrays:
            assert np.all(array == expected)


def connected_again(cluster: LocalCluster, names: set[str]) -> None:
    """Wait until every node is connected to etcd and sees every one of ``names``."""
    for i in range(len(cluster.nodes)):
        wait_until(
            f"node{i} is connected to etcd again with every registration",
            lambda i=i: (
                status(cluster, i)["membership"]["state"] == "connected"
                and registered(cluster, i) == names
            ),
        )


def test_a_fourth_daemon_joins_a_running_fabric_without_restarts(fabric) -> None:
    cluster = fabric(3)
    before = {i: status(cluster, i) for i in range(3)}
    ids = {before[i]["node"] for i in range(3)}
    assert len(ids) == 3  # each took its own slot
    assert all(s["membership"]["source"] == "etcd" for s in before.values())
    allreduce_works(cluster, [0, 1, 2], "three")

    cluster.add_node()
    cluster.wait_connected()
    names = {f"node{i}" for i in range(4)}
    for i in range(4):
        wait_until(f"node{i} sees all four registered", lambda i=i: registered(cluster, i) == names)
    after = {i: status(cluster, i) for i in range(4)}
    for i in range(3):  # nobody restarted, and the fourth has its own id
        assert after[i]["incarnation"] == before[i]["incarnation"]
        assert after[i]["node"] == before[i]["node"]
    assert after[3]["node"] not in ids
    peer_names = {p["name"] for p in after[0]["peers"]}
    assert peer_names == {"node1", "node2", "node3"}
    allreduce_works(cluster, [0, 1, 2, 3], "four")


def test_a_killed_daemon_is_down_its_lease_expires_and_it_comes_back(fabric) -> None:
    cluster = fabric(3)
    killed = status(cluster, 2)["node"]
    cluster.kill(2)

    def down_and_gone(i: int) -> bool:
        seen = status(cluster, i)
        peer = next(p for p in seen["peers"] if p["node"] == killed)
        return peer["state"] == "down" and "node2" not in seen["membership"]["registered"]

    for i in (0, 1):
        wait_until(f"node{i} sees node2 down and unregistered", lambda i=i: down_and_gone(i))
    allreduce_works(cluster, [0, 1], "survivors")

    cluster.restart(2)
    cluster.wait_connected()
    assert status(cluster, 2)["node"] == killed  # its remembered slot
    allreduce_works(cluster, [0, 1, 2], "back")


def peer_row(cluster: LocalCluster, i: int, node: int) -> dict[str, Any]:
    """Node ``i``'s ``status`` row of peer ``node`` ({} when it has none)."""
    return next((p for p in status(cluster, i)["peers"] if p["node"] == node), {})


def test_a_stale_view_refuses_a_slots_new_holder_until_it_catches_up(fabric, etcd) -> None:
    """node2 is cut off from etcd (its own line to it; a long lease keeps it registered) while
    the holder of slot 0 dies and node3 takes the slot.  node2's view still names the dead
    holder: node3's links are refused, by name, not admitted as the old holder.  Once node2
    reaches etcd again its view names node3, which it then admits; before names were in the
    handshake it admitted node3 under the old name and, catching up, refused it for good."""
    cluster = fabric(2, max_nodes=3)
    line = Line(etcd.endpoint)
    line.start()
    try:
        cluster.node_env[2] = {
            "FABRICD_ETCD_ENDPOINTS": line.endpoint,
            "FABRICD_ETCD_LEASE_TTL": "60",
        }
        cluster.add_node()
        cluster.wait_connected()
        slots = {i: status(cluster, i)["node"] for i in range(3)}
        assert slots[2] == 2  # the two first took 0 and 1
        victim = next(i for i in (0, 1) if slots[i] == 0)
        survivor = 1 - victim

        line.cut()
        wait_until(
            "node2 says etcd is unreachable",
            lambda: status(cluster, 2)["membership"]["state"] == "unreachable",
        )
        cluster.kill(victim)
        wait_until(
            f"node{survivor} sees node{victim}'s registration go",
            lambda: f"node{victim}" not in registered(cluster, survivor),
        )
        cluster.add_node()  # node3: slot 0, the only one free; it dials node2 (slot 2)
        assert status(cluster, 3)["node"] == 0
        wait_until(
            "node2 refuses node3 as node 0",
            lambda: "'node3' does not hold node id 0" in cluster.nodes[2].log_path.read_text(),
        )
        wait_until(  # refused before its HELLO is answered: node3 sees failed dials, backs off
            "node3's dials of node2 fail",
            lambda: status(cluster, 3)["dial_failures"].get("2", 0) >= 2,
        )
        stale = status(cluster, 2)
        assert stale["membership"]["registered"][f"node{victim}"] == 0  # the view is stale
        assert not any(peer_row(cluster, 2, 0)["links"].values())  # node3 is not admitted

        line.mend()
        wait_until(
            "node2's view has node3 in slot 0, and its links are up",
            lambda: (
                status(cluster, 2)["membership"]["registered"].get("node3") == 0
                and peer_row(cluster, 2, 0).get("state") == "up"
                and all(peer_row(cluster, 2, 0)["links"].values())
            ),
        )
        assert peer_row(cluster, 2, 0)["name"] == "node3"
        allreduce_works(cluster, [survivor, 2, 3], "after-the-handover")
    finally:
        line.close()


def test_a_lagging_dialler_refuses_a_restarted_peer_before_its_auth(fabric, etcd) -> None:
    """node2 (slot 2) is cut off from etcd while node3 (slot 3, which node2 dials) restarts
    under its name, slot and address with a new incarnation.  node2's view still has the old
    one, and refuses node3's proven HELLO before it sends AUTH: node3 sees unfinished
    handshakes, never admits a link that is then closed, and so never resets node2 (before,
    it did every backoff for as long as node2's view lagged).  Once node2's view catches up
    the two connect."""
    cluster = fabric(2, max_nodes=4)
    line = Line(etcd.endpoint)
    line.start()
    try:
        cluster.node_env[2] = {
            "FABRICD_ETCD_ENDPOINTS": line.endpoint,
            "FABRICD_ETCD_LEASE_TTL": "60",
        }
        cluster.add_node()  # node2: slot 2
        cluster.add_node()  # node3: slot 3
        cluster.wait_connected()
        assert [status(cluster, i)["node"] for i in (2, 3)] == [2, 3]
        line.cut()
        wait_until(
            "node2 says etcd is unreachable",
            lambda: status(cluster, 2)["membership"]["state"] == "unreachable",
        )
        cluster.kill(3)
        killed = cluster.nodes[3].process
        assert killed is not None
        killed.wait(GUARD)
        cluster.restart(3)  # a new incarnation registered; node2's view keeps the old one
        wait_until(
            "node2 refuses node3's new incarnation three times",
            lambda: cluster.nodes[2].log_path.read_text().count("not the one registered") >= 3,
        )
        stale, fresh = status(cluster, 2), status(cluster, 3)
        assert stale["dial_failures"].get("3", 0) >= 2  # failed dials: node2 backs off
        assert stale["counters"]["refused_links"] >= 3
        assert fresh["counters"]["peer_resets"] == 0  # never admitted, so never reset
        assert not any(peer_row(cluster, 3, 2)["links"].values())

        line.mend()
        wait_until(
            "node2's view has node3's new incarnation, and their links are up",
            lambda: (
                peer_row(cluster, 2, 3).get("state") == "up"
                and all(peer_row(cluster, 2, 3)["links"].values())
            ),
        )
        assert peer_row(cluster, 2, 3)["incarnation"] == status(cluster, 3)["incarnation"]
        allreduce_works(cluster, [2, 3], "after-the-restart")
    finally:
        line.close()


def test_etcd_restarted_under_a_running_fabric(fabric, etcd: Etcd) -> None:
    cluster = fabric(3)
    resets = [status(cluster, i)["counters"]["peer_resets"] for i in range(3)]
    etcd.stop()
    for i in range(3):
        wait_until(
            f"node{i} says etcd is unreachable",
            lambda i=i: status(cluster, i)["membership"]["state"] == "unreachable",
        )
    allreduce_works(cluster, [0, 1, 2], "without-etcd")
    etcd.start()
    connected_again(cluster, {"node0", "node1", "node2"})
    allreduce_works(cluster, [0, 1, 2], "after-etcd")
    for i in range(3):  # links were never touched
        seen = status(cluster, i)
        assert seen["counters"]["peer_resets"] == resets[i]
        assert all(p["state"] == "up" for p in seen["peers"])


def test_a_partitioned_etcd_leaves_the_last_view_and_says_so(fabric, etcd: Etcd) -> None:
    cluster = fabric(3)
    names = {"node0", "node1", "node2"}
    etcd.pause()
    try:
        for i in range(3):
            wait_until(
                f"node{i} says etcd is unreachable",
                lambda i=i: status(cluster, i)["membership"]["state"] == "unreachable",
            )
        for i in range(3):
            seen = status(cluster, i)
            assert registered(cluster, i) == names  # the last view, kept
            assert seen["membership"]["error"]
            assert all(p["state"] == "up" for p in seen["peers"])
        allreduce_works(cluster, [0, 1, 2], "partitioned")
        time.sleep(TTL + 1)  # long enough for every lease to run out meanwhile
    finally:
        etcd.resume()
    connected_again(cluster, names)
    allreduce_works(cluster, [0, 1, 2], "healed")


def test_a_malformed_registration_is_ignored_not_fatal(etcd: Etcd, fabric) -> None:
    """A value nobody can dial, written to etcd before and while the fabric runs: every
    daemon starts, keeps running, and counts it ignored."""
    garbage = b'{"address": "garbage", "slot": 3}'
    etcd.put(b"/fabricd/nodes/bad0", garbage)
    cluster = fabric(2)
    etcd.put(b"/fabricd/nodes/bad1", b'{"address": "0.0.0.0:7", "slot": 4}')
    for i in range(2):
        wait_until(
            f"node{i} counts both ignored",
            lambda i=i: status(cluster, i)["counters"]["etcd_ignored_registrations"] >= 2,
        )
        assert registered(cluster, i) == {"node0", "node1"}
    cluster.add_node()
    cluster.wait_connected()
    allreduce_works(cluster, [0, 1, 2], "after garbage")


def test_one_name_cannot_take_two_slots(etcd: Etcd) -> None:
    """Two daemons given one name, racing for two free slots: the transaction lets one win."""
    config = load(
        environ={}, flags={**ETCD_SETTINGS, "listen": "127.0.0.1:7700", "secret_env": "S"}
    )
    settings = dataclasses.replace(
        EtcdSettings.from_config(config.config), endpoints=(etcd.endpoint,), name="twin"
    )

    async def race() -> list[bool]:
        client = await roster._connect(settings, 0)
        try:
            lease = await client.lease(TTL)
            return [await roster._take(client, settings, lease.id, slot, 5) for slot in (1, 2)]
        finally:
            await client.close()

    assert asyncio.run(race()) == [True, False]


def test_daemons_register_over_tls_with_a_password(tmp_path: Path) -> None:
    reason = skip_reason()
    tls = make_tls(tmp_path)
    if reason is not None or isinstance(tls, str):
        pytest.skip(reason or str(tls))
    server = Etcd(tmp_path, tls)
    server.start()
    (tmp_path / "password").write_text("s3cret\n")
    server.enable_auth("s3cret")
    settings = {
        **ETCD_SETTINGS,
        "etcd_endpoints": [server.endpoint],
        "etcd_ca_file": str(tls.ca),
        "etcd_cert_file": str(tls.client_cert),
        "etcd_key_file": str(tls.client_key),
        "etcd_user": "root",
        "etcd_password_file": str(tmp_path / "password"),
    }
    cluster = LocalCluster(2, settings=settings, log_dir=tmp_path / "logs")
    try:
        cluster.start()
        cluster.wait_connected()
        cluster.add_node()
        cluster.wait_connected()
        names = {"node0", "node1", "node2"}
        for i in range(3):
            wait_until(f"node{i} sees all three", lambda i=i: registered(cluster, i) == names)
    finally:
        cluster.stop()
        server.stop()
