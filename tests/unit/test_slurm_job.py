"""The prolog's and epilog's dealings with what the job's user can touch
(fabricd/daemon/slurm_job.py): the files root reads back, the pid record, the daemon's whole
session, its dumpability; and a job's client that never falls back to another daemon."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fabricd import slurm
from fabricd.client.connection import Connection
from fabricd.daemon import slurm_job
from fabricd.daemon.slurm_job import PID_NAME, read_back, stop_job_daemon
from fabricd.errors import DaemonUnavailable
from fabricd.ipc import socket_candidates

_ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving files away needs root")
#: a stranger's uid, the job's user in these tests
_USER = 65534

#: a daemon stand-in: a session leader with a child of its own, which prints the child's pid
_SESSION = (
    "import os, sys, time\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    time.sleep(120); os._exit(0)\n"
    "print(child, flush=True); time.sleep(120)\n"
)


@pytest.fixture
def job_root(tmp_path, monkeypatch):
    """Job directories under ``tmp_path`` instead of /run/fabricd-slurm."""
    monkeypatch.setattr(slurm, "JOB_ROOT", str(tmp_path))
    return tmp_path


def _alive(pid):
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(pid):
    """Wait (up to 20 s) for ``pid`` to end; whether it did."""
    for _ in range(400):
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _end(leader):
    """Kill the stand-in's session (what the test left of it) and reap its leader."""
    if leader.poll() is None:  # (once reaped, its pid is no longer its group's for sure)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    leader.stdout.close()


def _session(directory, record=None):
    """Start the stand-in in a session of its own; write the prolog's record of it (or
    ``record``); the leader's Popen and its child's pid."""
    leader = subprocess.Popen(
        [sys.executable, "-c", _SESSION], stdout=subprocess.PIPE, start_new_session=True
    )
    child = int(leader.stdout.readline())
    text = record or f"{leader.pid} {slurm_job._start_time(leader.pid)} {os.getuid()}\n"
    (directory / PID_NAME).write_text(text.format(pid=leader.pid))
    return leader, child


def test_the_epilog_stops_the_daemons_whole_session(job_root):
    directory = job_root / "41"
    directory.mkdir()
    leader, child = _session(directory)
    try:
        assert stop_job_daemon(41, timeout=10)
        assert leader.wait(timeout=30) == -signal.SIGTERM
        assert _gone(child)  # a process the daemon started goes with it
        assert not directory.exists()
    finally:
        _end(leader)


@_ROOT_ONLY
@pytest.mark.parametrize(
    "forged",
    [
        "{pid} 1 0\n",  # another process's start time: the pid was reused
        "{pid}\n",  # the record of old, without start time and uid
    ],
)
def test_a_pid_record_that_does_not_name_the_daemon_is_not_signalled(job_root, forged):
    directory = job_root / "42"
    directory.mkdir()
    leader, _ = _session(directory, forged)
    try:
        assert not stop_job_daemon(42, timeout=1)
        assert _alive(leader.pid)
        assert not directory.exists()
    finally:
        _end(leader)


@_ROOT_ONLY
def test_a_pid_record_the_user_owns_is_not_read(tmp_path):
    """The user once owned the job's directory, and could rewrite or delete the pid file."""
    record = tmp_path / PID_NAME
    record.write_text("1 2 3\n")
    os.chown(record, _USER, _USER)
    assert read_back(record, 0, 100) is None
    assert read_back(record, _USER, 100) == b"1 2 3\n"


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path):
    """Root's reading of a FIFO put where the pid record or the log was blocked the epilog
    forever; a thread reads it, so that a regression fails instead of hanging."""
    fifo = tmp_path / PID_NAME
    os.mkfifo(fifo)
    results = []
    reader = threading.Thread(target=lambda: results.append(read_back(fifo, os.getuid(), 9)))
    reader.daemon = True
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # let the stuck open return, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("read_back blocked on a FIFO")
    assert results == [None]


def test_read_back_refuses_links_and_reads_a_logs_tail(tmp_path):
    log = tmp_path / "fabricd.log"
    log.write_bytes(b"a" * 100 + b"last line\n")
    (tmp_path / "link").symlink_to(log)
    assert read_back(tmp_path / "link", os.getuid(), 100) is None
    assert read_back(log, os.getuid(), 10, tail=True) == b"last line\n"
    assert read_back(tmp_path / "missing", os.getuid(), 10) is None


def test_the_job_daemon_is_undumpable():
    """The daemon runs as the job's user, who could otherwise ptrace it or read its memory."""
    script = (
        "import ctypes\n"
        "from fabricd.daemon.slurm_job import forbid_dumps\n"
        "libc = ctypes.CDLL(None)\n"
        "before = libc.prctl(3, 0, 0, 0, 0)\n"  # PR_GET_DUMPABLE
        "forbid_dumps()\n"
        "print(before, libc.prctl(3, 0, 0, 0, 0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["1", "0"]


def test_a_job_with_its_own_daemon_never_falls_back_to_the_nodes(job_root, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    assert len(socket_candidates()) > 1  # no job directory: no job daemon, the node's serve
    (job_root / "43" / "run").mkdir(parents=True)
    job_socket = f"{job_root}/43/run/fabricd.sock"
    assert socket_candidates() == (job_socket,)
    with pytest.raises(DaemonUnavailable, match="job's own daemon does not answer") as caught:
        Connection.open(socket_candidates())
    assert job_socket in str(caught.value)
