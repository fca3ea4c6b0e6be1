"""Installing a Debian package a test needs, when it is missing: ``apt-get install`` as root.

CI runs ``make test`` as root on a fresh Debian-like machine, so a test that needs a system
program (etcd) installs it here rather than in a list kept elsewhere; on a machine where that
cannot be done (no root, no apt-get) the caller skips with the reason this returns.  Each
package is tried once per test session.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

#: how long one install may take (a hang guard: a fresh machine's index update included)
INSTALL_TIMEOUT = 600.0


def ensure(package: str, program: str) -> str | None:
    """Make ``program`` available, installing ``package`` if it is not on PATH.

    Returns:
        ``None`` when the program is there (now), else why not: the reason to skip with.
    """
    if shutil.which(program):
        return None
    return _install(package, program)


@functools.cache
def _install(package: str, program: str) -> str | None:
    if os.geteuid() != 0:
        return f"{program} is not installed and installing {package} needs root"
    if shutil.which("apt-get") is None:
        return f"{program} is not installed and there is no apt-get to install {package}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", package]
    done = _run(command, env)
    if done is None or done.returncode != 0:  # a fresh machine's index is empty or stale
        _run(["apt-get", "update"], env)
        done = _run(command, env)
    if done is None or done.returncode != 0:
        tail = "" if done is None else done.stdout[-500:]
        return f"apt-get install {package} failed: {tail}"
    return None if shutil.which(program) else f"{package} installed but {program} not on PATH"


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
