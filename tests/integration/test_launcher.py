"""Processes started by :func:`spawn_tied` die with the process that started them, and only then.

The children here are small Python processes, not daemons: what is tested is the tie.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from fabricd.daemon.launcher import spawn_tied
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
