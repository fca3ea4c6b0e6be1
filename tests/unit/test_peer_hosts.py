"""Which host an accepted peer link comes from, and which hosts the configured nodes are."""

from __future__ import annotations

import pytest

from fabricd.daemon.services.peering import node_hosts, peer_host
from fabricd.engines.link.gate import host_slots


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("127.0.0.1:5555", "127.0.0.1"),
        ("[::1]:5555", "::1"),
        ("[::ffff:127.0.0.2]:5555", "127.0.0.2"),  # IPv4 through an IPv6 listener is itself
        ("[0:0:0:0:0:0:0:1]:80", "::1"),  # one spelling per address
        ("inproc-client-3", "inproc-client-3"),  # not host:port: the name itself
    ],
)
def test_peer_host_is_the_address_as_the_configuration_resolves_it(address: str, host: str) -> None:
    assert peer_host(address) == host


def test_node_hosts_resolve_every_configured_node() -> None:
    hosts = node_hosts(["127.0.0.1:7000", "[::1]:7001", "localhost:7002"])
    assert hosts[0] == {"127.0.0.1"}
    assert hosts[1] == {"::1"}
    assert "127.0.0.1" in hosts[2]  # a name: every address it resolves to


def test_a_name_that_does_not_resolve_gives_its_node_no_host(caplog) -> None:
    assert node_hosts(["127.0.0.1:1", "no-such-host.invalid:2"])[1] == frozenset()
    assert "host no-such-host.invalid does not resolve" in caplog.text  # the host, no port


def test_an_address_that_does_not_split_gives_its_node_no_host(caplog) -> None:
    """Treated as a name that does not resolve, never raised: one from etcd would otherwise
    end the daemon."""
    assert node_hosts(["127.0.0.1:1", "garbage"]) == {0: {"127.0.0.1"}, 1: frozenset()}
    assert "host garbage does not resolve" in caplog.text


def test_slots_go_to_the_hosts_of_the_nodes_that_dial_this_one() -> None:
    hosts = {
        0: frozenset({"a"}),
        1: frozenset({"a"}),
        2: frozenset({"b", "c"}),
        3: frozenset({"a"}),
    }
    assert host_slots(3, hosts, spare=2) == {"a": 4, "b": 3, "c": 3}  # nodes 0, 1 and 2 dial 3
    assert host_slots(0, hosts, spare=2) == {}  # node 0 dials everyone
    with pytest.raises(ValueError, match="handshake_spare_slots"):
        host_slots(3, hosts, spare=-1)
