"""Processes started by :func:`spawn_tied` die with the process that started them, and only then.

The children here are small Python processes, not daemons: what is tested is the tie.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import fabricd
from fabricd.daemon.launcher import (
    _FORK_THREAD,
    FAST_LIVENESS,
    LocalCluster,
    remove_leftovers,
    spawn_tied,
)
from tests.integration.processes import exited, wait_exited

#: a child that echoes its input, line by line, until end of file
ECHO = [sys.executable, "-c", "import sys\nfor line in sys.stdin: print(line, end='', flush=True)"]


def test_a_child_outlives_the_thread_that_asked_for_it():
    started: list[subprocess.Popen[str]] = []
    thread_ids: list[int] = []

    def ask() -> None:
        thread_ids.append(threading.get_native_id())
        started.append(spawn_tied(ECHO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(30)
    child = started[0]
    try:
        # the thread has left the kernel's task list: a parent-death signal tied to it has fired
        task = Path(f"/proc/self/task/{thread_ids[0]}")
        deadline = time.monotonic() + 30
        while task.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not task.exists()
        # a child killed then could never answer
        output, _ = child.communicate("still here\n", timeout=30)
        assert output == "still here\n"
        assert child.returncode == 0
    finally:
        child.kill()
        child.wait(30)


def test_a_child_dies_with_the_process_that_started_it_even_by_sigkill():
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import subprocess, sys, time
                from fabricd.daemon.launcher import spawn_tied
                child = spawn_tied(
                    [sys.executable, "-c", "import time; time.sleep(300)"],
                    stdout=subprocess.DEVNULL,
                )
                print(child.pid, flush=True)
                time.sleep(300)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        assert not exited(child)
        launcher.kill()
        launcher.wait(30)
        assert wait_exited([child]) == []
    finally:
        launcher.kill()
        launcher.communicate(timeout=30)


class _Interrupted(Exception):
    """What a signal handler raised in a caller waiting for its child."""


def _children_running(marker: str) -> list[int]:
    """This process's children whose command line holds ``marker`` and that are not zombies."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and marker.encode() in command:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("when", ["queued", "forking"])
def test_a_caller_interrupted_while_its_child_starts_leaves_no_child(when):
    """A signal handler that raises in the waiting caller (Ctrl-C, SIGHUP in fabricctl) must
    not leave a child running that nobody knows of: its launcher would never stop it."""
    marker = f"tied-child-{when}-{os.getpid()}"
    command = [sys.executable, "-c", "import sys, time; time.sleep(60)", marker]
    gate = threading.Event()
    forking = threading.Event()
    if when == "queued":  # the fork thread is busy with someone else's job
        busy = threading.Thread(target=_FORK_THREAD.run, args=(lambda: gate.wait(30),))
        busy.start()
        job = lambda: spawn_tied(command)  # noqa: E731
    else:  # the fork thread is already starting this caller's child

        def slow_spawn() -> subprocess.Popen[bytes]:
            forking.set()
            gate.wait(30)
            return subprocess.Popen(command)

        job = lambda: _FORK_THREAD.run(slow_spawn)  # noqa: E731

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupted):
            job()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if when == "forking":
        assert forking.is_set()
    gate.set()
    _FORK_THREAD.run(lambda: None)  # runs after every job queued before it
    try:
        assert _children_running(marker) == []
    finally:
        for pid in _children_running(marker):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


#: a launcher's first step, in a process of its own: make its directory, say where, wait
_MAKES_ITS_DIRECTORY = """
import sys, tempfile, time
from fabricd.daemon.launcher import _directory_prefix
print(tempfile.mkdtemp(prefix=_directory_prefix()), flush=True)
sys.stdin.read()
"""


def _in_new_pid_namespace(command: list[str]) -> list[str] | None:
    """``command`` in a new pid namespace (with its own /proc, as in a container), if allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    wrap = [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*wrap, "true"], capture_output=True, timeout=30, check=False)
    return [*wrap, *command] if probe.returncode == 0 else None


def test_a_running_launcher_in_another_pid_namespace_keeps_its_directory(tmp_path):
    """Containers may share /tmp with the host: there a pid names another process."""
    command = _in_new_pid_namespace([sys.executable, "-c", _MAKES_ITS_DIRECTORY])
    if command is None:
        pytest.skip("unshare cannot make a pid namespace here")
    launcher = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        assert launcher.stdout is not None
        directory = Path(launcher.stdout.readline().strip())
        assert directory.parent == tmp_path
        assert remove_leftovers(tmp_path) == []
        assert directory.is_dir()
    finally:
        launcher.communicate("", timeout=30)


def test_the_secret_is_on_disk_only_while_daemons_start(tmp_path):
    # a launcher killed with SIGKILL leaves its directory to the next one; without this the
    # fabric's secret stayed in it until then
    with LocalCluster(2, settings=FAST_LIVENESS, log_dir=tmp_path) as cluster:
        assert cluster.directory is not None
        assert not (cluster.directory / "secret").exists()
        cluster.wait_connected()
        cluster.kill(1)
        process = cluster.nodes[1].process
        assert process is not None
        process.wait(30)
        cluster.restart(1)  # a new incarnation reads the secret again, then it is gone again
        assert not (cluster.directory / "secret").exists()
        cluster.wait_connected()
        with fabricd.connect(socket_path=cluster.nodes[0].socket_path) as control:
            (row,) = control.status()["peers"]
        assert row["state"] == "up"
        assert len(cluster.secret) == 64
