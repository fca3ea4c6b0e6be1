"""What a killed local cluster leaves behind, and which of it the next launcher may remove.

A cluster's directory is named after the process that made it (pid and start time); only a
directory whose maker has exited is removed, and nothing that merely looks like one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from fabricd.cli.ctl import main as fabricctl
from fabricd.daemon import launcher
from fabricd.daemon.launcher import (
    DIRECTORY_PREFIX,
    _directory_prefix,
    _pid_namespace,
    cluster_name,
    remove_leftovers,
    running_clusters,
)


def _never_a_pid() -> int:
    """A pid no process can have: the kernel hands out pids below ``pid_max`` only."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def _leftover(root: Path, pid: int, started: int, namespace: int | None = None) -> Path:
    namespace = _pid_namespace() if namespace is None else namespace
    directory = root / f"{DIRECTORY_PREFIX}{pid}-{started}-{namespace}-k1ll3d"
    directory.mkdir()
    (directory / "secret").write_text("s")
    (directory / "node0.log").write_text("log")
    return directory


def test_the_directory_of_an_exited_launcher_is_removed_with_its_files(tmp_path):
    directory = _leftover(tmp_path, _never_a_pid(), 12345)
    assert remove_leftovers(tmp_path) == [directory]
    assert not directory.exists()


def test_a_running_launchers_directory_is_kept(tmp_path):
    mine = tmp_path / (_directory_prefix() + "running")
    mine.mkdir()
    assert remove_leftovers(tmp_path) == []
    assert mine.is_dir()


def test_a_pid_given_to_a_new_process_does_not_keep_a_dead_launchers_directory(tmp_path):
    started = int(_directory_prefix().removeprefix(DIRECTORY_PREFIX).split("-")[1])
    directory = _leftover(tmp_path, os.getpid(), started + 1)
    assert remove_leftovers(tmp_path) == [directory]


def test_a_directory_from_another_pid_namespace_is_left_alone(tmp_path):
    """Its pid names a process there, not here: only a clean-up there can judge it."""
    directory = _leftover(tmp_path, _never_a_pid(), 1, namespace=_pid_namespace() + 1)
    assert remove_leftovers(tmp_path) == []
    assert directory.is_dir()


def test_what_only_looks_like_a_leftover_is_never_touched(tmp_path):
    dead = _never_a_pid()
    untouched = [
        tmp_path / f"{DIRECTORY_PREFIX}abcd1234",  # made before names carried the launcher
        tmp_path / f"{DIRECTORY_PREFIX}{dead}-1-k1ll3d",  # no pid namespace in its name
        tmp_path / "fabricd-other-1-2-x",
        tmp_path / f"{DIRECTORY_PREFIX}{dead}-x-y",
    ]
    for path in untouched:
        path.mkdir()
    namespace = _pid_namespace()
    plain_file = tmp_path / f"{DIRECTORY_PREFIX}{dead}-1-{namespace}-file"
    plain_file.write_text("not a directory")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("k")
    link = tmp_path / f"{DIRECTORY_PREFIX}{dead}-1-{namespace}-link"
    link.symlink_to(target)
    assert remove_leftovers(tmp_path) == []
    assert all(path.is_dir() for path in untouched)
    assert plain_file.is_file()
    assert link.is_symlink()
    assert (target / "keep").is_file()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_another_users_directory_is_never_removed(tmp_path):
    directory = _leftover(tmp_path, _never_a_pid(), 1)
    os.chown(directory, 65534, 65534)
    assert remove_leftovers(tmp_path) == []
    assert directory.is_dir()


def test_local_cluster_clean_removes_leftovers_and_says_which(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = _leftover(tmp_path, _never_a_pid(), 1)
    human = CliRunner().invoke(fabricctl, ["local-cluster", "--clean"])
    assert human.exit_code == 0, human.output
    assert "removed 1 directory left by killed local clusters" in human.output
    assert str(first) in human.output
    assert not first.exists()
    second = _leftover(tmp_path, _never_a_pid(), 2)
    scripted = CliRunner().invoke(fabricctl, ["local-cluster", "--clean", "--json"])
    assert scripted.exit_code == 0, scripted.output
    assert json.loads(scripted.output) == {"removed": [str(second)]}


def test_local_cluster_wants_either_nodes_or_clean():
    both = CliRunner().invoke(fabricctl, ["local-cluster", "--clean", "2"])
    assert both.exit_code == 2
    assert "--clean starts no cluster" in both.output
    neither = CliRunner().invoke(fabricctl, ["local-cluster"])
    assert neither.exit_code == 2
    assert "missing NODES" in neither.output


def test_a_leftover_that_another_cleaner_removes_first_is_passed_over(tmp_path, monkeypatch):
    """Two local clusters that start at once both clean up: neither may fail for it."""
    gone = _leftover(tmp_path, _never_a_pid(), 1)
    kept = _leftover(tmp_path, _never_a_pid(), 2)
    listing = os.scandir

    @contextlib.contextmanager
    def racing_listing(path):
        with listing(path) as entries:
            listed = sorted(entries, key=lambda entry: entry.name)
        shutil.rmtree(gone)  # the other launcher's clean-up got there first
        yield iter(listed)

    def scandir(path):  # os.scandir for the whole process: shutil.rmtree uses it too
        return racing_listing(path) if path == tmp_path else listing(path)

    monkeypatch.setattr(launcher.os, "scandir", scandir)
    assert remove_leftovers(tmp_path) == [kept]
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_that_cannot_start_its_daemons_leaves_no_socket_open(monkeypatch):
    def refuse(command, **popen):
        raise OSError(11, "fork refused")

    monkeypatch.setattr(launcher, "spawn_tied", refuse)
    cluster = launcher.LocalCluster(3)
    with pytest.raises(OSError, match="fork refused"):
        cluster.start()
    assert [node.notify.fileno() for node in cluster.nodes] == [-1, -1, -1]
    assert cluster.directory is None


def test_top_all_finds_the_sockets_of_running_clusters_only(tmp_path):
    mine = tmp_path / (_directory_prefix() + "running")
    mine.mkdir()
    for name in ("node10.sock", "node2.sock", "node0.sock", "nodeX.sock", "secret"):
        (mine / name).write_text("")
    dead = _leftover(tmp_path, _never_a_pid(), 12345)
    (dead / "node0.sock").write_text("")
    elsewhere = _leftover(tmp_path, os.getpid(), 1, namespace=_pid_namespace() + 1)
    (elsewhere / "node0.sock").write_text("")
    assert running_clusters(tmp_path) == [[str(mine / f"node{i}.sock") for i in (0, 2, 10)]]


def test_a_cluster_is_named_by_its_launcher_and_its_directory(tmp_path):
    directory = tmp_path / (_directory_prefix() + "abc_12")
    name = f"{os.getpid()}-abc_12"
    assert cluster_name(directory) == name
    assert cluster_name(str(directory / "node3.sock")) == name  # a socket of it
    assert cluster_name(tmp_path / "node0.sock") is None  # a socket of no local cluster
    assert cluster_name("/run/fabricd/fabricd.sock") is None
