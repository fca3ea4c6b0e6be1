"""A fabric for each Slurm job: the prolog starts a daemon on every node of the allocation,
the epilog stops it (``fabricctl slurm prolog`` / ``epilog``; docs/slurm.md).

What the prolog does on each node, as root (slurmd runs it before the job's first task there):

1. reads the job from Slurm's variables (:class:`fabricd.slurm.SlurmJob`): the allocation's
   hosts in hostlist order are the fabric's ``nodes``, this host's place in it its
   ``node_id``, and every daemon of the job listens on the port its job id gives;
2. makes the job's directory, ``/run/fabricd-slurm/<job id>``, root's and 0755, and writes in
   it the config (root's), the job's secret (below) and the log (the job user's, 0600); gives
   the user only its subdirectory ``run/``, where the daemon binds its socket.  The files root
   reads back (the pid record, the log's tail) are out of the user's reach to replace;
3. starts ``fabricd --no-dump`` *as the job's user* (uid, gid and groups; undumpable, so the
   user cannot ptrace it), in a session of its own so that slurmd, which kills what its prolog
   leaves in the prolog's process group, leaves it alone; records its pid, start time and uid
   (``fabricd.pid``); and waits for its ``READY=1`` (sd_notify on a socket of its own), so
   that the job's tasks find it listening.  A daemon that does not start in time fails the
   prolog, which Slurm answers by draining the node: the job could not communicate there.

The secret: every daemon of a job must hold the same one, and no other job's daemon may.  Each
prolog derives it from the site's key (``/etc/fabricd/slurm.key``: root's, mode 0600, the same
on every node, as munge's key is), the cluster's name, the job id and the job's uid, with
HMAC-SHA256 (the uid: job ids restart after a reset or wrap, and a reused id of another
user's must not give the same secret); so
nodes agree without talking, and a job's user, who can read their job's secret, learns nothing
of another job's.  A key file holding two keys (a rotation) gives two job secrets, and
the daemons accept either (docs/operations.md, "Rotating the secret").  A job on one node needs
no secret, and gets none when there is no key.

The epilog stops the job's daemon's whole session (SIGTERM, then SIGKILL after the drain), if
the recorded pid is still the process the prolog started, and removes the
directory, secret and all.  A job requeued under the same id finds the directory of its first
run: its prolog does what the epilog would first.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
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
#: prctl's option from <linux/prctl.h>
_PR_SET_DUMPABLE: Final = 4

_log = logging.getLogger("fabricd.daemon")


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


def job_secrets(keys: tuple[bytes, ...], cluster: str, job_id: int, uid: int) -> tuple[str, ...]:
    """The job's secrets, one per site key, in the keys' order (hex, 64 characters).

    Every node of the job derives the same from what each prolog is told alike (cluster, job
    id, the job's uid); a 22.05 prolog has no per-job start time to add, so an id reused by
    the same user after a reset repeats that user's own secret, never another user's.
    """
    message = f"fabricd slurm job {cluster} {job_id} uid {uid}".encode()
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
    os.mkdir(job.directory)
    os.chmod(job.directory, 0o755)  # root's for good: the user reaches run/ and reads the log
    try:
        cluster = environ.get("SLURM_CLUSTER_NAME", "")
        secret = _write_secret(job, owner, cluster, key_file)
        return _start(job, owner, job_settings(job, secret, listen_host), timeout)
    except BaseException:
        stop_job_daemon(job.job_id)  # nothing of a failed start stays, the secret above all
        raise


def _start(job: SlurmJob, owner: JobOwner, settings: dict[str, Any], timeout: float) -> int:
    """Write the job's config in its new directory, start the daemon, wait for it; its pid.

    The job's directory stays root's (0755): the user can neither replace nor add a file in it,
    so the pid record the epilog reads back is root's own.
    The user owns only ``run/`` in it, where the daemon binds its socket, and the files root
    gives them (secret, log), which they can write but not swap for a link or a FIFO.
    """
    directory = Path(job.directory)
    config = _create(directory / CONFIG_NAME, None, 0o644)
    with os.fdopen(config, "w") as fh:
        fh.write("".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items()))
    os.mkdir(job.run_directory, 0o700)
    os.chown(job.run_directory, owner.uid, owner.gid)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        notify.bind(str(directory / NOTIFY_NAME))
        os.chown(directory / NOTIFY_NAME, owner.uid, owner.gid)  # the daemon sends to it
        with os.fdopen(_create(directory / LOG_NAME, owner, 0o600), "ab") as log:
            process = _spawn(directory, Path(job.run_directory), owner, log)
        with os.fdopen(_create(directory / PID_NAME, None, 0o644), "w") as fh:
            fh.write(f"{process.pid} {_start_time(process.pid)} {owner.uid}\n")
        _wait_ready(process, notify, directory, owner, timeout)
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
        fh.write("\n".join(job_secrets(keys, cluster, job.job_id, owner.uid)) + "\n")
    return str(path)


def _spawn(directory: Path, run: Path, owner: JobOwner, log: BinaryIO) -> subprocess.Popen[bytes]:
    """Start the daemon as the job's user, detached from the prolog, logging to ``log``.

    ``--no-dump`` makes it undumpable (``PR_SET_DUMPABLE`` 0) as soon as it runs: after the
    switch to the user and ``execve`` the kernel makes it dumpable, and the user could then
    ptrace it or read its memory; the epilog stops its whole session.
    """
    # slurmd's own variables stay behind; FABRICD_<KEY> settings of its environment pass on,
    # but for those that make the job's fabric
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k not in _OURS}
    env["NOTIFY_SOCKET"] = str(directory / NOTIFY_NAME)
    switch: dict[str, Any] = {}
    if os.geteuid() != owner.uid:
        switch = {"user": owner.uid, "group": owner.gid, "extra_groups": list(owner.groups)}
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "fabricd.cli.daemon", "--no-dump"),
            *("--config", str(directory / CONFIG_NAME)),
        ],
        env=env,
        cwd=run,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # out of the prolog's process group, which slurmd kills
        **switch,
    )


def _wait_ready(
    process: subprocess.Popen[bytes],
    notify: socket.socket,
    directory: Path,
    owner: JobOwner,
    timeout: float,
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
                + _log_tail(directory, owner.uid)
            )
    process.kill()
    process.wait()
    raise JobDaemonError(
        f"the job's daemon was not ready after {timeout}s:\n{_log_tail(directory, owner.uid)}"
    )


def _log_tail(directory: Path, uid: int, lines: int = 20) -> str:
    """The last lines of the daemon's log (owned by ``uid``), for an error message."""
    raw = read_back(directory / LOG_NAME, uid, 1 << 16, tail=True)
    if raw is None:
        return "(no log)"
    return "\n".join(raw.decode(errors="replace").splitlines()[-lines:])


def read_back(path: Path, uid: int, limit: int, *, tail: bool = False) -> bytes | None:
    """At most ``limit`` bytes of ``path`` (its last ones with ``tail``), or None unless it is
    a regular file owned by ``uid``.

    Every file root reads back goes through here: never through a symlink (``O_NOFOLLOW``),
    never blocked by a FIFO or a device put in its place (``O_NONBLOCK``, then ``fstat``).
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return None
        if tail and info.st_size > limit:
            fh.seek(info.st_size - limit)
        return fh.read(limit)


def stop_job_daemon(job_id: int, timeout: float = 30.0) -> bool:
    """The epilog's work: stop job ``job_id``'s daemon on this node and remove its directory.

    The daemon leads a session of its own: SIGTERM goes to its whole process group, and lets
    it drain; a group whose leader still runs after ``timeout`` seconds is killed.  The pid is
    only signalled while it is the process the prolog started: same start time, same uid
    (after a crash, the pid may have gone to another process).

    Returns:
        whether a daemon was running.
    """
    directory = Path(job_directory(job_id))
    record = _record(directory)
    running = record is not None and _is_daemon(record)
    if record is not None and running:  # (record: for the type checker)
        pid = record[0]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _is_daemon(record) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _is_daemon(record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)
    return running


def stop_from_environ(environ: Mapping[str, str], timeout: float = 30.0) -> bool:
    """:func:`stop_job_daemon` for the job an epilog's environment names.

    Raises:
        JobDaemonError: ``SLURM_JOB_ID`` is unset.
    """
    job = job_id_of(environ)
    if job is None:
        raise JobDaemonError("SLURM_JOB_ID is not set: not a Slurm epilog")
    return stop_job_daemon(job, timeout)


def _record(directory: Path) -> tuple[int, int, int] | None:
    """The prolog's record of the daemon, ``(pid, start time, uid)``, if it is root's own."""
    raw = read_back(directory / PID_NAME, os.geteuid(), 100)
    fields = raw.decode(errors="replace").split() if raw is not None else []
    if len(fields) != 3 or not all(field.isdigit() for field in fields):
        return None
    return int(fields[0]), int(fields[1]), int(fields[2])


def _is_daemon(record: tuple[int, int, int] | None) -> bool:
    """Whether the recorded process still runs (not a zombie) with its start time and uid."""
    if record is None:
        return False
    pid, started, uid = record
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, IndexError):
        return False
    uids = [line.split()[1:2] for line in status.splitlines() if line.startswith("Uid:")]
    return fields[0] != "Z" and fields[19:20] == [str(started)] and uids == [[str(uid)]]


def _start_time(pid: int) -> int:
    """Process ``pid``'s start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22):
    with the pid, it names one process for good."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def forbid_dumps() -> None:
    """Make this process undumpable (``prctl(PR_SET_DUMPABLE, 0)``): no core file, and no
    ptrace or ``/proc/<pid>/mem`` for its uid; best effort, where Linux's prctl is there.

    The job's daemon (``fabricd --no-dump``) runs as the job's user, who could otherwise
    ptrace it: read its session keys, or make it do what the daemon's peers would not accept
    from a client; a failure is logged, not fatal.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        failed, reason = True, str(exc)
    if failed:
        _log.warning("could not make the daemon undumpable (prctl PR_SET_DUMPABLE): %s", reason)
