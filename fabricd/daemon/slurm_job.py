"""A fabric for each Slurm job: the prolog starts a daemon on every node of the allocation,
the epilog stops it (``fabricctl slurm prolog`` / ``epilog``; docs/slurm.md).

What the prolog does on each node, as root (slurmd runs it before the job's first task there):

1. reads the job from Slurm's variables (:class:`fabricd.slurm.SlurmJob`): the allocation's
   hosts in hostlist order are the fabric's ``nodes``, this host's place in it its
   ``node_id``, and every daemon of the job listens on the port its job id gives;
2. makes the job's directory, ``/run/fabricd-slurm/<job id>``, mode 0700 and owned by the job's
   user, and writes in it the job's secret (below) and config;
3. starts ``fabricd`` there *as the job's user* (uid, gid and groups), in a session of its
   own so that slurmd, which kills what its prolog leaves in the prolog's process group, leaves
   it alone; and waits for its ``READY=1`` (sd_notify on a socket of its own), so that the job's
   tasks find it listening.  A daemon that does not start in time fails the prolog, which
   Slurm answers by draining the node: the job could not communicate there.

The secret: every daemon of a job must hold the same one, and no other job's daemon may.  Each
prolog derives it from the site's key (``/etc/fabricd/slurm.key``: root's, mode 0600, the same
on every node, as munge's key is), the cluster's name and the job id, with HMAC-SHA256; so
nodes agree without talking, and a job's user, who can read their job's secret, learns nothing
of another job's.  A key file holding two keys (a rotation) gives two job secrets, and
the daemons accept either (docs/operations.md, "Rotating the secret").  A job on one node needs
no secret, and gets none when there is no key.

The epilog stops the job's daemon (SIGTERM, then SIGKILL after the drain) and removes the
directory, secret and all.  A job requeued under the same id finds the directory of its first
run: its prolog does what the epilog would first.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from fabricd.daemon.keyring import SOURCE_KEYS, read_secret_file
from fabricd.daemon.launcher import toml_value
from fabricd.dirs import make_dirs
from fabricd.errors import FabricError
from fabricd.slurm import DEFAULT_KEY_FILE, JOB_ROOT, SlurmJob, job_directory, job_id_of
from fabricd.transports.base import join_address

if TYPE_CHECKING:
    from collections.abc import Mapping

#: the files of a job's directory
CONFIG_NAME: Final = "fabricd.toml"
SECRET_NAME: Final = "secret"
PID_NAME: Final = "fabricd.pid"
LOG_NAME: Final = "fabricd.log"
NOTIFY_NAME: Final = "notify"


#: the variables that would override the job's own config: never passed to its daemon
_OURS: Final = frozenset(
    f"FABRICD_{key.upper()}"
    for key in ("config", "nodes", "node_id", "listen", "socket", "metrics_address", *SOURCE_KEYS)
)


class JobDaemonError(FabricError):
    """The job's daemon could not be started or stopped (the message says why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOwner:
    """Whom the job's daemon runs as: the job's user, with their groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobOwner:
        """``SLURM_JOB_UID`` and ``SLURM_JOB_GID`` (the user's primary group when unset),
        and the groups the user database gives that user.

        Raises:
            JobDaemonError: no job uid.
        """
        raw = environ.get("SLURM_JOB_UID", "")
        if not raw.isdigit():
            raise JobDaemonError("SLURM_JOB_UID is not set: not a Slurm prolog")
        uid = int(raw)
        try:
            user: pwd.struct_passwd | None = pwd.getpwuid(uid)
        except KeyError:
            user = None  # a uid the database does not know: no supplementary groups
        gid_text = environ.get("SLURM_JOB_GID", "")
        gid = int(gid_text) if gid_text.isdigit() else (user.pw_gid if user else uid)
        groups = tuple(os.getgrouplist(user.pw_name, gid)) if user else (gid,)
        return cls(uid=uid, gid=gid, groups=groups)


def job_secrets(keys: tuple[bytes, ...], cluster: str, job_id: int) -> tuple[str, ...]:
    """The job's secrets, one per site key, in the keys' order (hex, 64 characters)."""
    message = f"fabricd slurm job {cluster} {job_id}".encode()
    return tuple(hmac.new(key, message, hashlib.sha256).hexdigest() for key in keys)


def job_settings(job: SlurmJob, secret_file: str, listen_host: str = "") -> dict[str, Any]:
    """The config of the job's daemon on this node ("" for ``secret_file``: none).

    The daemon listens where its node's name resolves, unless ``listen_host`` names an address
    (``0.0.0.0``: every interface, for a node whose own name resolves to a loopback address,
    as Debian's ``127.0.1.1`` line in /etc/hosts makes it).  The metrics endpoint is off: its
    fixed default port belongs to the node's own daemon, and several jobs may share a node.
    """
    settings: dict[str, Any] = {
        "nodes": [join_address(host, job.port) for host in job.nodes],
        "node_id": job.node_id,
        "socket": job.socket_path,
        "metrics_address": "",
    }
    if listen_host:
        settings["listen"] = join_address(listen_host, job.port)
    if secret_file:
        settings["secret_file"] = secret_file
    return settings


def start_job_daemon(
    environ: Mapping[str, str],
    *,
    key_file: str = DEFAULT_KEY_FILE,
    listen_host: str = "",
    timeout: float = 30.0,
) -> int:
    """The prolog's work (this module's docstring): start the job's daemon on this node.

    Returns:
        the daemon's pid.

    Raises:
        JobDaemonError: not a prolog's environment, the job needs a secret and there is no
            key, or the daemon did not say READY=1 within ``timeout`` seconds (its log tail
            is in the message).
        ConfigError: the job's variables or the key file are wrong.
    """
    job = SlurmJob.from_environ(environ, socket.gethostname())
    owner = JobOwner.from_environ(environ)
    stop_job_daemon(job.job_id)  # a requeued job's first run may have left its directory
    make_dirs(JOB_ROOT, 0o755)
    os.mkdir(job.directory, 0o700)  # root's until every file in it is written (_start)
    try:
        secret = _write_secret(job, owner, environ.get("SLURM_CLUSTER_NAME", ""), key_file)
        return _start(job, owner, job_settings(job, secret, listen_host), timeout)
    except BaseException:
        stop_job_daemon(job.job_id)  # nothing of a failed start stays, the secret above all
        raise


def _start(job: SlurmJob, owner: JobOwner, settings: dict[str, Any], timeout: float) -> int:
    """Write the job's config in its new directory, start the daemon, wait for it; its pid.

    Every file is written while the directory is still root's, and only then is the directory
    given to the job's user (whose daemon binds its socket there): a user who owns it could
    put a symlink where root is about to write.  The one file written later, the pid file, is
    created with ``O_EXCL | O_NOFOLLOW``.
    """
    directory = Path(job.directory)
    config = _create(directory / CONFIG_NAME, owner, 0o600)
    with os.fdopen(config, "w") as fh:
        fh.write("".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items()))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        notify.bind(str(directory / NOTIFY_NAME))
        os.chown(directory / NOTIFY_NAME, owner.uid, owner.gid)  # the daemon sends to it
        with os.fdopen(_create(directory / LOG_NAME, owner, 0o600), "ab") as log:
            os.chown(directory, owner.uid, owner.gid)
            process = _spawn(directory, owner, log)
        with os.fdopen(_create(directory / PID_NAME, None, 0o644), "w") as fh:
            fh.write(f"{process.pid}\n")
        _wait_ready(process, notify, directory, timeout)
    finally:
        notify.close()
        with contextlib.suppress(FileNotFoundError):
            (directory / NOTIFY_NAME).unlink()
    return process.pid


def _create(path: Path, owner: JobOwner | None, mode: int) -> int:
    """A new file at ``path`` (never through a symlink, never an existing one), given to
    ``owner`` (None: stays root's); its fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    if owner is not None:
        os.fchown(fd, owner.uid, owner.gid)
    return fd


def _write_secret(job: SlurmJob, owner: JobOwner, cluster: str, key_file: str) -> str:
    """Write the job's secret into its directory, 0600 and the job user's; its path, or ""
    for a one-node job without a site key.

    Raises:
        JobDaemonError: the job spans several nodes and there is no key file.
    """
    if not os.path.exists(key_file):
        if len(job.nodes) == 1:
            return ""
        raise JobDaemonError(
            f"job {job.job_id} spans {len(job.nodes)} nodes, whose daemons need a shared "
            f"secret, and there is no site key {key_file}: write one, the same on every node, "
            "readable by root only (umask 077; head -c 32 /dev/urandom | base64 > "
            f"{key_file}), or pass --key-file"
        )
    keys = read_secret_file(Path(key_file), f"site key {key_file}")
    path = Path(job.directory) / SECRET_NAME
    with os.fdopen(_create(path, owner, 0o600), "w") as fh:
        fh.write("\n".join(job_secrets(keys, cluster, job.job_id)) + "\n")
    return str(path)


def _spawn(directory: Path, owner: JobOwner, log: BinaryIO) -> subprocess.Popen[bytes]:
    """Start the daemon as the job's user, detached from the prolog, logging to ``log``."""
    # slurmd's own variables stay behind; FABRICD_<KEY> settings of its environment pass on,
    # but for those that make the job's fabric
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k not in _OURS}
    env["NOTIFY_SOCKET"] = str(directory / NOTIFY_NAME)
    switch: dict[str, Any] = {}
    if os.geteuid() != owner.uid:
        switch = {"user": owner.uid, "group": owner.gid, "extra_groups": list(owner.groups)}
    return subprocess.Popen(
        [sys.executable, "-m", "fabricd.cli.daemon", "--config", str(directory / CONFIG_NAME)],
        env=env,
        cwd=directory,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # out of the prolog's process group, which slurmd kills
        **switch,
    )


def _wait_ready(
    process: subprocess.Popen[bytes], notify: socket.socket, directory: Path, timeout: float
) -> None:
    """Wait for the daemon's READY=1; kill it and raise if it exits or stays silent."""
    notify.settimeout(0.1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            if "READY=1" in notify.recv(4096).decode(errors="replace").splitlines():
                return
        if process.poll() is not None:
            raise JobDaemonError(
                f"the job's daemon exited with status {process.returncode}:\n"
                + _log_tail(directory)
            )
    process.kill()
    process.wait()
    raise JobDaemonError(
        f"the job's daemon was not ready after {timeout}s:\n{_log_tail(directory)}"
    )


def _log_tail(directory: Path, lines: int = 20) -> str:
    """The last lines of the daemon's log, for an error message."""
    try:  # the job's user owns the directory: never through a symlink put there
        fd = os.open(directory / LOG_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read(1 << 20).decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def stop_job_daemon(job_id: int, timeout: float = 30.0) -> bool:
    """The epilog's work: stop job ``job_id``'s daemon on this node and remove its directory.

    SIGTERM lets the daemon drain; one still running after ``timeout`` seconds is killed.  A
    pid is only signalled while it runs the job's own config (``/proc/<pid>/cmdline``): after a
    crash, the pid may have gone to another process.

    Returns:
        whether a daemon was running.
    """
    directory = Path(job_directory(job_id))
    pid = _daemon_pid(directory)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _runs_config(pid, directory) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _runs_config(pid, directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)
    return pid is not None


def stop_from_environ(environ: Mapping[str, str], timeout: float = 30.0) -> bool:
    """:func:`stop_job_daemon` for the job an epilog's environment names.

    Raises:
        JobDaemonError: ``SLURM_JOB_ID`` is unset.
    """
    job = job_id_of(environ)
    if job is None:
        raise JobDaemonError("SLURM_JOB_ID is not set: not a Slurm epilog")
    return stop_job_daemon(job, timeout)


def _daemon_pid(directory: Path) -> int | None:
    """The pid the prolog recorded, if that process still runs the job's daemon."""
    try:  # (the job's user may have replaced the file: it only names a pid to check)
        fd = os.open(directory / PID_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read(32).decode(errors="replace").strip()
    except OSError:
        return None
    pid = int(text) if text.isdigit() else None
    return pid if pid is not None and _runs_config(pid, directory) else None


def _runs_config(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` is alive (not a zombie) and runs the config in ``directory``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and str(directory / CONFIG_NAME).encode() in cmdline
