"""``fabricctl k8s config``: a DaemonSet node's config from its Service's DNS answers.

The decisions are pure functions (:mod:`fabricd.deploy.kubernetes`): answers in, config out, no
DNS.  The wait for every pod is driven with a fake lookup and a sleep that only records; the
command itself runs once against ``localhost`` (the hosts file, not DNS).
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
from click.testing import CliRunner

from fabricd.cli.ctl import main as fabricctl
from fabricd.daemon.config import load
from fabricd.deploy.kubernetes import (
    RETRY_INTERVAL,
    Membership,
    members,
    render_config,
    wait_for_members,
    write_config,
)
from fabricd.errors import ConfigError

BASE = 'socket = "/run/fabricd/fabricd.sock"\nsecret_file = "/etc/fabricd-secret/secret"\n'
PODS = ["10.0.0.9", "10.0.0.10", "10.0.1.2", "10.0.0.100"]


def test_every_node_derives_the_same_list_whatever_order_dns_answers_in():
    seen = set()
    for order in itertools.permutations(PODS):
        for host in PODS:
            membership = members(order, host, 7700)
            assert membership.nodes[membership.node_id] == f"{host}:7700"
            seen.add(membership.nodes)
    # numbers, not strings: 10.0.0.9 before 10.0.0.10 before 10.0.0.100
    assert seen == {("10.0.0.9:7700", "10.0.0.10:7700", "10.0.0.100:7700", "10.0.1.2:7700")}


def test_node_ids_number_the_nodes_once_each():
    ids = sorted(members(PODS, host, 7700).node_id for host in PODS)
    assert ids == list(range(len(PODS)))


def test_an_address_listed_twice_counts_once():
    membership = members(["10.0.0.2", "10.0.0.1", "10.0.0.2"], "10.0.0.2", 7700)
    assert membership == Membership(node_id=1, nodes=("10.0.0.1:7700", "10.0.0.2:7700"))


def test_a_dual_stack_answer_keeps_the_host_ips_family():
    answers = ["fd00::2", "10.0.0.1", "fd00::10", "10.0.0.2"]
    v6 = members(answers, "fd00::10", 7700)
    assert v6 == Membership(node_id=1, nodes=("[fd00::2]:7700", "[fd00::10]:7700"))
    assert members(answers, "10.0.0.1", 7701).nodes == ("10.0.0.1:7701", "10.0.0.2:7701")


def test_the_host_ip_in_another_spelling_is_still_found():
    assert members(["fd00::a", "fd00::b"], "fd00:0::B", 7700).node_id == 1


@pytest.mark.parametrize(
    ("answers", "host", "message"),
    [
        (["10.0.0.1", "10.0.0.2"], "10.0.0.3", "10.0.0.3 is not among the Service's 2"),
        ([], "10.0.0.3", "(none)"),
        (["10.0.0.1", "node-a"], "10.0.0.1", "a DNS answer 'node-a' is not an IP address"),
        (["10.0.0.1"], "node-a", "the host IP 'node-a' is not an IP address"),
    ],
)
def test_members_refuses_what_names_no_fabric(answers, host, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        members(answers, host, 7700)


def test_the_rendered_config_is_the_base_plus_membership(tmp_path):
    membership = members(PODS, "10.0.0.100", 7700)
    text = render_config(
        BASE + "drain_timeout = 5.0\n", membership, node_name="gpu-3", service="peers.fabricd"
    )
    assert "on node gpu-3" in text
    assert "Service peers.fabricd" in text
    path = tmp_path / "fabricd.toml"
    path.write_text(text)
    loaded = load(str(path), environ={})
    assert loaded.config.node_id == 2
    assert loaded.config.nodes == membership.nodes
    assert loaded.config.listen_address == "10.0.0.100:7700"
    assert loaded.config.drain_timeout == 5.0
    assert loaded.config.secret_file == "/etc/fabricd-secret/secret"


@pytest.mark.parametrize(
    ("base", "message"),
    [
        (BASE + "node_id = 0\n", "base config sets node_id"),
        (BASE + 'nodes = ["10.0.0.1:7700"]\n', "base config sets nodes"),
        ("socket = \n", "base config: "),
    ],
)
def test_a_base_that_decides_membership_itself_or_is_no_toml_is_refused(base, message):
    with pytest.raises(ConfigError, match=message):
        render_config(
            base, Membership(node_id=0, nodes=("10.0.0.1:7700",)), node_name="", service="s"
        )


class FakeDns:
    """Answers from a script, one list per query (the last repeats); records the sleeps."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.queries = []
        self.sleeps = []

    def lookup(self, name):
        self.queries.append(name)
        return self.answers[min(len(self.queries), len(self.answers)) - 1]

    def sleep(self, seconds):
        self.sleeps.append(seconds)

    def wait(self, *, expect, host="10.0.0.2", attempts=10):
        return wait_for_members(
            "peers.fabricd",
            expect=expect,
            host_ip=host,
            port=7700,
            attempts=attempts,
            lookup=self.lookup,
            sleep=self.sleep,
        )


def test_the_wait_lasts_until_every_pod_and_this_one_are_listed():
    dns = FakeDns([], ["10.0.0.1"], ["10.0.0.1", "10.0.0.3"], ["10.0.0.3", "10.0.0.2", "10.0.0.1"])
    membership = dns.wait(expect=3)
    assert membership.node_id == 1
    assert len(dns.queries) == 4
    assert dns.sleeps == [RETRY_INTERVAL] * 3
    assert dns.queries == ["peers.fabricd"] * 4


def test_the_wait_ignores_the_other_familys_answers():
    dns = FakeDns(["10.0.0.1", "fd00::1"], ["10.0.0.1", "fd00::1", "10.0.0.2"])
    assert dns.wait(expect=2).nodes == ("10.0.0.1:7700", "10.0.0.2:7700")
    assert len(dns.queries) == 2


def test_more_pods_than_expected_are_waited_out_as_a_rollout_terminates_them():
    """A Service publishing not-ready addresses lists a terminating pod for a while during a
    rollout: failing at once put every restarting pod in CrashLoopBackOff."""
    rolling = ["10.0.0.1", "10.0.0.2", "10.0.0.9"]
    dns = FakeDns(rolling, rolling, ["10.0.0.1", "10.0.0.2"])
    assert dns.wait(expect=2).nodes == ("10.0.0.1:7700", "10.0.0.2:7700")
    assert dns.sleeps == [RETRY_INTERVAL] * 2


def test_more_pods_than_expected_fail_only_after_the_attempts():
    dns = FakeDns(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    with pytest.raises(ConfigError, match="still lists 3 addresses, more than the 2 expected"):
        dns.wait(expect=2, attempts=4)
    assert len(dns.queries) == 4


def test_too_few_pods_fail_after_the_attempts_with_what_was_seen():
    dns = FakeDns(["10.0.0.1", "10.0.0.2"])
    with pytest.raises(ConfigError, match=r"lists 2 of the 3 addresses expected \(10.0.0.1, 10"):
        dns.wait(expect=3, attempts=5)
    assert len(dns.queries) == 5
    assert len(dns.sleeps) == 4


def test_a_full_list_without_this_node_is_waited_out_too():
    dns = FakeDns(["10.0.0.1", "10.0.0.3"])
    with pytest.raises(ConfigError, match=r"this node is 10\.0\.0\.2"):
        dns.wait(expect=2, attempts=3)


def test_the_wait_returns_the_same_list_to_every_node_on_shuffled_answers():
    rng = random.Random(26)
    lists = set()
    for host in PODS:
        shuffled = rng.sample(PODS, len(PODS))
        lists.add(FakeDns(shuffled).wait(expect=len(PODS), host=host).nodes)
    assert len(lists) == 1


def test_write_config_writes_only_what_the_daemon_accepts(tmp_path):
    path = tmp_path / "fabricd.toml"
    membership = Membership(node_id=0, nodes=("10.0.0.1:7700", "10.0.0.2:7700"))
    write_config(render_config(BASE, membership, node_name="a", service="s"), path)
    assert load(str(path), environ={}).config.nodes == membership.nodes
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    # two nodes and no secret source: the daemon would refuse it, so nothing is written over
    before = path.read_text()
    with pytest.raises(ConfigError, match="one is required"):
        write_config(render_config("", membership, node_name="a", service="s"), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fabricd.toml"]  # no temporary left


def test_the_command_writes_the_config_from_the_hosts_file(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(BASE)
    out = tmp_path / "fabricd.toml"
    args = ["k8s", "config", "--service=localhost", "--host-ip=127.0.0.1", "--node-name=n0"]
    args += [f"--base={base}", f"--out={out}"]
    result = CliRunner().invoke(fabricctl, [*args, "--expect=1"])
    assert result.exit_code == 0, result.output
    assert "node n0 is node_id 0 of 1: 127.0.0.1:7700" in result.output
    assert load(str(out), environ={}).config.nodes == ("127.0.0.1:7700",)
    out.unlink()
    result = CliRunner().invoke(fabricctl, [*args, "--expect=2", "--wait=0"])
    assert result.exit_code == 1
    assert "lists 1 of the 2 addresses expected" in result.output
    assert not out.exists()
