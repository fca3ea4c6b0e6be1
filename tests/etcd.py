"""A real etcd for the membership tests: Debian's ``etcd-server``, installed when missing
(:mod:`tests.apt`), on free loopback ports with its data in a temporary directory.

The tests stop it (a restart under a running fabric), and pause it with SIGSTOP (a partition:
its port still accepts, nothing answers, as behind a dropped route).  Timeouts here are hang
guards only.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.request
from typing import TYPE_CHECKING

from fabricd.daemon.launcher import _free_port, spawn_tied
from tests import apt

if TYPE_CHECKING:
    from pathlib import Path

#: how long etcd may take to answer after a start (a hang guard)
START_GUARD = 30.0


def skip_reason() -> str | None:
    """Why the etcd tests cannot run here (``None``: they can; etcd is installed now)."""
    return apt.ensure("etcd-server", "etcd")


class Etcd:
    """One etcd member: :meth:`start`, :meth:`stop`, :meth:`pause`, :meth:`resume`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start it (on the same ports and data as before, after a stop) and wait until it
        answers a health check."""
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        command = [
            "etcd",
            "--name=test",
            f"--data-dir={self.directory / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-outputs=stderr",
        ]
        with open(self.directory / "etcd.log", "ab") as log:
            self.process = spawn_tied(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_GUARD
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_tail()}")
            health = f"http://{self.endpoint}/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=1) as r:
                if b'"health":"true"' in r.read():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy after {START_GUARD}s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL past the guard); its data stays for the next start."""
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(START_GUARD)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """Stop it answering (SIGSTOP): connections hang, as in a partition."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.directory / "etcd.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return "(no log)"
