"""The settings of membership from etcd (fabricd/daemon/config.py): what is required, what
must be left out, and the id space they give the fabric."""

from __future__ import annotations

import pytest

from fabricd.daemon.config import load
from fabricd.errors import ConfigError

ETCD = {"membership": "etcd", "listen": "127.0.0.1:7700", "secret_env": "S"}


def test_membership_from_etcd_gives_max_nodes_ids() -> None:
    config = load(environ={}, flags={**ETCD, "max_nodes": 16}).config
    assert config.fabric_size == 16
    assert load(environ={}, flags={"nodes": "a:1,b:2", "secret_env": "S"}).config.fabric_size == 2


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        ({"membership": "consul"}, "membership must be"),
        ({**ETCD, "listen": ""}, "listen: required"),
        ({**ETCD, "nodes": "a:1,b:2"}, "set by etcd"),
        ({**ETCD, "node_id": 1}, "set by etcd"),
        ({**ETCD, "secret_env": ""}, "one is required"),
        ({**ETCD, "max_nodes": 1}, "max_nodes"),
        ({**ETCD, "etcd_endpoints": "nohost"}, "etcd_endpoints"),
        ({**ETCD, "etcd_endpoints": ""}, "at least one"),
        ({**ETCD, "etcd_prefix": "/f"}, "etcd_prefix"),
        ({**ETCD, "etcd_lease_ttl": 1}, "etcd_lease_ttl"),
        ({**ETCD, "node_name": "a/b"}, "node_name"),
        ({**ETCD, "node_name": "é" * 128}, "at most 255 bytes"),  # (every HELLO carries it)
        ({**ETCD, "etcd_cert_file": "c.pem"}, "etcd_key_file"),
        ({**ETCD, "etcd_user": "u"}, "etcd_password_file"),
    ],
)
def test_settings_that_cannot_work_are_refused(flags: dict[str, object], complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        load(environ={}, flags=flags)
