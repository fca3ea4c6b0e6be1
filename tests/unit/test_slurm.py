"""Slurm's variables as fabricd reads them (fabricd/slurm.py): hostlists, the job's fabric,
each rank's identity and what the launcher exports; and the prolog's secret and config."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from fabricd.cli.ctl import main as fabricctl
from fabricd.daemon.slurm_job import JobDaemonError, JobOwner, job_secrets, job_settings
from fabricd.ipc import default_socket_path, socket_candidates
from fabricd.slurm import (
    PORT_BASE,
    PORT_SLOTS,
    SlurmError,
    SlurmJob,
    collapse_hostlist,
    expand_hostlist,
    expand_task_counts,
    job_port,
    launch_environment,
    stale_rank_warning,
    task_identity,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1]-ib", ["a1-ib"]),
        ("b,a", ["b", "a"]),  # the list's order is the node ids' order: never sorted
        (
            "h1.example.org,h[2-3].example.org",
            ["h1.example.org", "h2.example.org", "h3.example.org"],
        ),
    ],
)
def test_hostlists_expand_as_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty host name"),
        ("a,,b", "empty host name"),
        ("n[1-2", "'\\[' without '\\]'"),
        ("n1-2]", "'\\]' without '\\['"),
        ("n[[1]]", "nested"),
        ("n[3-1]", "backwards"),
        ("n[a-b]", "not a number"),
        ("n[]", "not a number"),
        ("two words", "space"),
        ("n[0-99999999]", "more than 65536"),
        ("a[0-999]b[0-999]", "more than 65536"),
    ],
)
def test_malformed_hostlists_are_refused_with_the_reason(text, why):
    with pytest.raises(SlurmError, match=why):
        expand_hostlist(text)


_names = st.from_regex(r"[a-z][a-z0-9.-]{0,6}[0-9]{0,3}", fullmatch=True)


@given(st.lists(_names, min_size=1, max_size=30))
def test_collapsing_then_expanding_gives_the_same_hosts_in_the_same_order(hosts):
    assert expand_hostlist(collapse_hostlist(hosts)) == hosts


def test_collapse_shares_ranges_only_between_neighbours():
    assert collapse_hostlist(["node01", "node02", "node03", "gpu7"]) == "node[01-03],gpu7"
    assert collapse_hostlist(["n2", "n1"]) == "n2,n1"  # no reordering
    assert collapse_hostlist(["n9", "n10"]) == "n[9-10]"
    assert collapse_hostlist(["n09", "n10", "n100"]) == "n[09-10],n100"
    with pytest.raises(SlurmError, match="bracket"):
        collapse_hostlist(["n[1]"])


def test_task_counts_expand():
    assert expand_task_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_task_counts("4") == [4]
    with pytest.raises(SlurmError, match="not N or N"):
        expand_task_counts("2x3")


_PROLOG = {  # what a 22.05 prolog gets (SLURM_NODELIST, not SLURM_JOB_NODELIST)
    "SLURM_JOB_ID": "4007",
    "SLURM_NODELIST": "gpu[01-02],cpu1",
    "SLURMD_NODENAME": "gpu02",
    "SLURM_JOB_UID": "1000",
    "SLURM_JOB_GID": "1000",
}


def test_the_job_fabric_is_the_allocation_in_hostlist_order():
    job = SlurmJob.from_environ(_PROLOG, "ignored")
    assert job.nodes == ("gpu01", "gpu02", "cpu1")
    assert (job.node_name, job.node_id) == ("gpu02", 1)
    assert job.port == PORT_BASE + 2 * 7 == job_port(4007 + PORT_SLOTS)
    assert job.socket_path == "/run/fabricd-slurm/4007/run/fabricd.sock"
    settings = job_settings(job, "/run/fabricd-slurm/4007/secret")
    assert settings["nodes"] == [f"{h}:{job.port}" for h in job.nodes]
    assert settings["node_id"] == 1
    assert settings["metrics_address"] == ""  # the node's own daemon has the default port
    assert "listen" not in settings  # where the node's name resolves
    assert job_settings(job, "", "0.0.0.0")["listen"] == f"0.0.0.0:{job.port}"
    assert "secret_file" not in job_settings(job, "")


def test_the_node_name_falls_back_to_the_host_name():
    environ = {k: v for k, v in _PROLOG.items() if k != "SLURMD_NODENAME"}
    assert SlurmJob.from_environ(environ, "cpu1.cluster.example").node_id == 2
    with pytest.raises(SlurmError, match="'other', is not in the job's nodes"):
        SlurmJob.from_environ(environ, "other")
    with pytest.raises(SlurmError, match="not inside a Slurm job"):
        SlurmJob.from_environ({}, "cpu1")


def test_job_secrets_agree_across_nodes_and_differ_between_jobs():
    keys = (b"k" * 32, b"n" * 32)
    first = job_secrets(keys, "cluster", 7, 1000)
    assert first == job_secrets(keys, "cluster", 7, 1000)  # every node derives the same
    assert len(first) == 2
    assert all(len(s) == 64 for s in first)
    assert set(first).isdisjoint(job_secrets(keys, "cluster", 8, 1000))
    assert set(first).isdisjoint(job_secrets(keys, "other", 7, 1000))
    # job ids restart after a reset or wrap: another user's job under a reused id
    assert set(first).isdisjoint(job_secrets(keys, "cluster", 7, 1001))


def test_the_job_owner_comes_from_the_prolog_variables():
    owner = JobOwner.from_environ({"SLURM_JOB_UID": "4242424", "SLURM_JOB_GID": "77"})
    assert (owner.uid, owner.gid, owner.groups) == (4242424, 77, (77,))
    with pytest.raises(JobDaemonError, match="not a Slurm prolog"):
        JobOwner.from_environ({})


#: what srun gave task 3 of `srun -N2 -n5` (3 tasks on the first node, 2 on the second)
_TASK = {
    "SLURM_JOB_ID": "12",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_NTASKS": "5",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "3,2",
    "SLURMD_NODENAME": "n2",
}


def test_a_task_of_srun_takes_its_rank_from_slurm():
    identity = task_identity(_TASK)
    assert identity is not None
    assert identity.variables() == {
        "RANK": "3",
        "WORLD_SIZE": "5",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": str(job_port(12) + 1),
    }
    assert identity.source == "slurm"


def test_a_batch_script_is_no_rank():
    batch = {"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SLURM_NTASKS": "5"}  # no step
    assert task_identity(batch) is None
    with pytest.raises(SlurmError, match="run this as a task of srun"):
        launch_environment(batch)


def test_torchrun_variables_win_over_slurm():
    torchrun = {
        **_TASK,
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    identity = task_identity(torchrun)
    assert identity is not None
    assert (identity.rank, identity.world_size, identity.local_rank) == (9, 16, 1)
    assert identity.source == "environment"
    assert launch_environment(torchrun) == {}  # nothing torchrun set is replaced
    by_hand = task_identity({**_TASK, "RANK": "3", "WORLD_SIZE": "5"})  # no LOCAL_RANK
    assert by_hand is not None
    assert (by_hand.local_rank, by_hand.source) == (0, "environment")  # SLURM_LOCALID's
    assert task_identity({"RANK": "2", "WORLD_SIZE": "4"}).local_rank == 2  # one node


def test_the_launcher_adds_what_is_missing_and_replaces_stale_local_ranks():
    stale = {**_TASK, "LOCAL_RANK": "7", "MASTER_PORT": "1234"}  # from the submitting shell
    added = launch_environment(stale, job_socket_exists=True)
    assert added["RANK"] == "3"
    assert added["LOCAL_RANK"] == "0"
    assert "MASTER_PORT" not in added  # set by the user: theirs
    assert added["FABRICD_SOCKET"] == "/run/fabricd-slurm/12/run/fabricd.sock"
    assert "FABRICD_SOCKET" not in launch_environment(_TASK, job_socket_exists=False)
    named = {**_TASK, "FABRICD_SOCKET": "/elsewhere.sock"}
    assert "FABRICD_SOCKET" not in launch_environment(named, job_socket_exists=True)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"SLURM_PROCID": "x"}, r"\$SLURM_PROCID='x' is not an integer"),
        ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5 is not a node"),
        ({"RANK": "1"}, r"\$WORLD_SIZE is not set"),
    ],
)
def test_malformed_task_variables_are_refused(change, why):
    with pytest.raises(SlurmError, match=why):
        task_identity({**_TASK, **change})


def test_a_client_in_a_job_looks_for_the_job_daemon_first(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    assert socket_candidates()[0] == "/run/fabricd-slurm/31/run/fabricd.sock"
    assert default_socket_path() != socket_candidates()[0]  # a daemon never takes it unasked
    monkeypatch.delenv("SLURM_JOB_ID")
    assert all("slurm" not in path for path in socket_candidates())


def test_fabricctl_slurm_env_prints_export_lines_for_a_task_prolog(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for name, value in _TASK.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(fabricctl, ["slurm", "env"])
    assert result.exit_code == 0, result.output
    assert "export RANK=3\n" in result.output
    assert "export LOCAL_WORLD_SIZE=2\n" in result.output
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    refused = CliRunner().invoke(fabricctl, ["slurm", "env"])
    assert refused.exit_code == 1
    assert "run this as a task of srun" in " ".join(refused.output.split())


def test_a_stale_world_size_outside_torchrun_is_warned_about():
    """srun passes on the submitting shell's WORLD_SIZE, which wins over Slurm's."""
    assert stale_rank_warning(_TASK) == ""  # Slurm's own: nothing to say
    stale = {**_TASK, "RANK": "0", "WORLD_SIZE": "16"}
    assert "WORLD_SIZE=16 is set, but this srun step has 5 tasks" in stale_rank_warning(stale)
    assert stale_rank_warning({**stale, "TORCHELASTIC_RUN_ID": "x"}) == ""  # torchrun's own
    assert stale_rank_warning({**stale, "WORLD_SIZE": "5"}) == ""
