"""The test nets themselves: isolated from the machine, torn down fully, leftovers removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.network.netns import PREFIX, NetError, TestNet, _base36, remove_leftovers, run

pytestmark = pytest.mark.network


def _namespaces() -> set[str]:
    return {line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.split()}


def test_a_net_adds_nothing_to_the_machines_namespace_and_leaves_nothing_behind() -> None:
    links_before = run("ip", "-o", "link", "show")
    with TestNet(2) as net:
        made = {net.switch, net.namespace(0), net.namespace(1)}
        assert made <= _namespaces()
        assert run("ip", "-o", "link", "show") == links_before
        probe = "import socket; socket.create_connection(('%s', 9), timeout=5)"
        reached = subprocess.run(
            [*net.wrapper(0), sys.executable, "-c", probe % net.address(1)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert "ConnectionRefusedError" in reached.stderr  # node 1 answered: the link works
    assert not made & _namespaces()


def test_leftovers_of_a_dead_run_are_removed_and_a_live_runs_are_kept() -> None:
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # no process has this pid
    leftover = f"{PREFIX}-{_base36(dead)}-0h0"
    run("ip", "netns", "add", leftover)
    try:
        with TestNet(1) as mine:
            assert leftover in remove_leftovers()
            assert leftover not in _namespaces()
            assert mine.namespace(0) in _namespaces()  # this process is alive
            assert mine.name.startswith(f"{PREFIX}-{_base36(os.getpid())}-")
    finally:
        if leftover in _namespaces():
            run("ip", "netns", "delete", leftover)


def test_a_shaped_links_rate_changes_in_place_both_ways() -> None:
    with TestNet(1) as net:
        net.shape(0, 100)
        net.set_rate(0, 10)
        ends = ((net.switch, "v0"), (net.namespace(0), "eth0"))
        for ns, dev in ends:
            shown = run("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev)
            assert "tbf" in shown, shown
            assert "rate 10Mbit" in shown, shown
        net.unshape(0)
        with pytest.raises(NetError):  # nothing to change on a link not shaped
            net.set_rate(0, 10)
