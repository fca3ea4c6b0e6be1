"""The config a daemon runs with once registered in etcd (fabricd/daemon/services/roster.py,
``registered``): its id the slot, ``nodes`` the addresses read, as the roster engine takes
them, so the engine's first view changes nothing the peering service was built with."""

from __future__ import annotations

from fabricd.daemon.config import load
from fabricd.daemon.services.roster import Registration, registered
from fabricd.engines.roster import Member, Roster

FLAGS = {"membership": "etcd", "listen": "10.0.0.1:7700", "secret_env": "S", "max_nodes": 4}


def test_the_registered_config_has_the_slot_as_id_and_every_address_by_slot() -> None:
    loaded = load(environ={}, flags=FLAGS)
    members = [
        Member("b", "10.0.0.2:7700", 0),
        Member("c", "10.0.0.3:7700", 0),  # a second claim of slot 0: the first one holds it
        Member("d", "10.0.0.4:7700", 2),  # this daemon's own slot: ignored
        Member("e", "10.0.0.5:7700", 9),  # outside max_nodes: ignored
    ]
    registration = Registration(
        client=None, lease=1, slot=2, members=members, revision=5, endpoint=0
    )
    run = registered(loaded, registration)
    assert run.config.node_id == 2
    assert run.config.nodes == ("10.0.0.2:7700", "", "10.0.0.1:7700", "")
    assert (run.sources["node_id"], run.sources["nodes"]) == ("etcd", "etcd")
    engine = Roster(name="a", slot=2, max_nodes=4, now=0.0)
    changes = engine.load(members)
    assert {c.slot: c.address for c in changes} == {
        n: a for n, a in enumerate(run.config.nodes) if a and n != 2
    }
