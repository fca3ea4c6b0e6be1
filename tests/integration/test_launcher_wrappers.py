"""LocalCluster's ``hosts`` and ``wrappers``: each daemon on its own address, under a command
that execs it (the network tests use ``ip netns exec``; here ``env``, on loopback, so it runs
anywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fabricd
from fabricd.daemon.launcher import FAST_LIVENESS, ClusterError, LocalCluster


def test_each_node_listens_on_its_host_and_runs_under_its_wrapper(tmp_path: Path) -> None:
    # node 0 dials node 1 from its own configured address, the only host node 1 admits
    hosts = ["127.0.0.2", "127.0.0.3"]
    wrapped = ["env", "FABRICD_TEST_WRAPPED=yes"]
    with LocalCluster(
        2, settings=FAST_LIVENESS, log_dir=tmp_path, hosts=hosts, wrappers={1: wrapped}
    ) as cluster:
        cluster.wait_connected()
        with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as control:
            (row,) = control.status()["peers"]
        assert row["address"].startswith("127.0.0.3:")
        assert row["state"] == "up"
        # the wrapper execs the daemon: the pid started is the daemon's, with its environment
        environ = [Path(f"/proc/{node.pid}/environ").read_bytes() for node in cluster.nodes]
        assert b"FABRICD_TEST_WRAPPED=yes" in environ[1]
        assert b"FABRICD_TEST_WRAPPED" not in environ[0]
        assert b"fabricd.cli.daemon" in Path(f"/proc/{cluster.nodes[1].pid}/cmdline").read_bytes()


def test_hosts_must_name_every_node() -> None:
    with pytest.raises(ClusterError, match="1 hosts given for 2 nodes"):
        LocalCluster(2, hosts=["127.0.0.2"]).start()
