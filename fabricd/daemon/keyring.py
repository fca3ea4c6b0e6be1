"""The shared secrets this daemon holds: where they come from, and why a source is refused.

Rules: this module reads the one configured secret source and returns its secrets; it never
logs or prints a secret (messages name the source, the mode, the owner and the group only).
The daemon reads it at start and again on SIGHUP
(:meth:`fabricd.daemon.node.Daemon.reload_secrets`), and hands what it finds to the peering
service for the next handshakes.

Three sources, exactly one configured (:meth:`fabricd.daemon.config.Config.validate`):

* ``secret_file``: a file.  It must be a regular file (a symlink to one is followed: a
  Kubernetes Secret volume is a tree of symlinks), owned by the daemon's user or by root,
  never readable, writable or executable by others, and never writable by its group.  Its
  group may read it (mode 0640/0440) only if that group is the daemon's effective gid and the
  group database lists no member but the daemon's own user: that is the file a Kubernetes
  ``fsGroup`` mount (with ``runAsGroup`` set to the same gid) or ``chgrp fabricd`` gives, and
  the group then holds no one the daemon cannot vouch for.  Any other group could hold users
  who are not the daemon, and each of them could then act as a node of the fabric.
* ``secret_credential``: a systemd credential (``LoadCredential=<name>:<path>``), read from
  ``$CREDENTIALS_DIRECTORY/<name>``.  Its mode is not checked: systemd copies it into a
  directory that only the service can read, with mode 0400, at every start of the unit.
* ``secret_env``: an environment variable, for containers whose orchestrator hands secrets
  out that way.  The environment of a process can be read by its own uid and by root
  (``/proc/<pid>/environ``) for as long as it runs, and is inherited by child processes; a
  file or a credential is safer where there is a choice (docs/operations.md).

Each source holds one secret, or two during a rotation: one per line, the older first, blank
lines and surrounding whitespace ignored.  Every secret must be at least
:data:`MIN_SECRET_BYTES` long.  The handshake accepts a peer that proves either secret and
uses the newer one whenever the peer holds it too (:mod:`fabricd.engines.link.handshake`).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Final

from fabricd.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from fabricd.daemon.config import Config

#: the shortest secret accepted: 128 bits, if random
MIN_SECRET_BYTES: Final = 16
#: the most secrets one source may hold: the current one and, during a rotation, the next
MAX_SECRETS: Final = 2
#: the most bytes a source may hold: two long secrets fit many times over; more is no secret
#: (a wrong path, say) and is not read into memory
MAX_SOURCE_BYTES: Final = 4096
#: the settings that name a secret source; exactly one is set on a node of several
SOURCE_KEYS: Final = ("secret_file", "secret_credential", "secret_env")


def source_name(cfg: Config) -> str:
    """The configured source as its setting and value say it (never its contents)."""
    for key in SOURCE_KEYS:
        if value := getattr(cfg, key):
            return f"{key} {value}"
    return "no secret source"


def read_secrets(cfg: Config, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    """The secrets of the configured source, the older first; ``()`` when none is configured.

    Args:
        cfg: the effective configuration (validated: at most one source is set).
        environ: where ``secret_env`` and ``$CREDENTIALS_DIRECTORY`` are looked up
            (``os.environ`` if omitted).

    Raises:
        ConfigError: the source is missing, unreadable, refused (the message names the mode,
            owner and group that made it so), empty, too short, or holds too many secrets.
            At start the daemon exits with it; on reload it keeps the secrets it had.
    """
    environ = os.environ if environ is None else environ
    where = source_name(cfg)
    if cfg.secret_file:
        text = _read_private_file(Path(cfg.secret_file), where)
    elif cfg.secret_credential:
        text = _read_credential(cfg.secret_credential, environ, where)
    elif cfg.secret_env:
        value = environ.get(cfg.secret_env, "")
        if not value:
            raise ConfigError(f"{where}: the variable is not set or empty in the environment")
        text = value.encode()
    else:
        return ()
    return parse_secrets(text, where)


def read_secret_file(path: Path, where: str) -> tuple[bytes, ...]:
    """The secrets of the file ``path``, checked as ``secret_file`` is (the older first).

    The Slurm prolog reads the site's key with it (:mod:`fabricd.daemon.slurm_job`).

    Raises:
        ConfigError: as :func:`read_secrets` does for ``secret_file``; ``where`` names it.
    """
    return parse_secrets(_read_private_file(path, where), where)


def parse_secrets(text: bytes, where: str) -> tuple[bytes, ...]:
    """One secret per non-blank line, stripped; one or :data:`MAX_SECRETS`, each long enough.

    Raises:
        ConfigError: no secret, too many, one shorter than :data:`MIN_SECRET_BYTES`, or a
            source larger than :data:`MAX_SOURCE_BYTES`.
    """
    if len(text) > MAX_SOURCE_BYTES:
        raise ConfigError(f"{where} holds more than {MAX_SOURCE_BYTES} bytes: not a secret")
    found = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not found:
        raise ConfigError(f"{where} holds no secret")
    if len(found) > MAX_SECRETS:
        raise ConfigError(
            f"{where} holds {len(found)} secrets (one per line); at most {MAX_SECRETS}: "
            "the current one and, during a rotation, the next"
        )
    for number, secret in enumerate(found, 1):
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"{where}: secret {number} holds under {MIN_SECRET_BYTES} bytes; "
                "generate a longer one (head -c 32 /dev/urandom | base64)"
            )
    return found


def _read_credential(name: str, environ: Mapping[str, str], where: str) -> bytes:
    """``$CREDENTIALS_DIRECTORY/<name>``, which systemd fills from ``LoadCredential=``."""
    directory = environ.get("CREDENTIALS_DIRECTORY", "")
    if not directory:
        raise ConfigError(
            f"{where}: $CREDENTIALS_DIRECTORY is not set; start the daemon from a systemd unit "
            f"with LoadCredential={name}:/etc/fabricd/secret (systemd/fabricd.service)"
        )
    path = Path(directory) / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read {path}: {exc.strerror}; does the unit's LoadCredential= "
            f"name it {name!r}?"
        ) from None


def _read_private_file(path: Path, where: str) -> bytes:
    """The bytes of ``path``, once :func:`check_file_access` accepts who may read it.

    The checks are made on the file that was opened (``fstat``), not on the name, so a file
    renamed over it in between (as a rotation does) is never read unchecked.
    """
    try:  # (O_NONBLOCK: a FIFO put there must not hang the open; fstat then refuses it)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    try:
        check_file_access(os.fstat(fd), where)
        chunks, size = [], 0
        while size <= MAX_SOURCE_BYTES and (chunk := os.read(fd, MAX_SOURCE_BYTES + 1)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    finally:
        os.close(fd)


def check_file_access(
    status: os.stat_result,
    where: str,
    *,
    members: Callable[[int], list[str]] | None = None,
) -> None:
    """Refuse a secret file that anyone but the daemon (and root) could read or replace.

    The rule and its reasons are in this module's docstring.  ``members`` lists the
    users a group holds besides the daemon's own (:func:`other_members`, the group database,
    if omitted; tests name a group's members without editing /etc/group).

    Raises:
        ConfigError: naming the mode, owner and group found, and the command that fixes it.
    """
    mode = stat.S_IMODE(status.st_mode)
    uid, gid = os.geteuid(), os.getegid()
    found = f"mode {mode:04o}, owner uid {status.st_uid}, group gid {status.st_gid}"
    fix = f"chmod 600 and chown to uid {uid}, or chmod 640 with group gid {gid}"
    if not stat.S_ISREG(status.st_mode):
        raise ConfigError(f"{where} is not a regular file")
    if status.st_uid not in (uid, 0):
        raise ConfigError(
            f"{where} ({found}) is owned by another user, who could read or replace it; "
            f"the owner must be this daemon's uid {uid} or root ({fix})"
        )
    if mode & stat.S_IRWXO:
        raise ConfigError(f"{where} ({found}) is open to others; {fix}")
    if mode & (stat.S_IWGRP | stat.S_IXGRP):
        raise ConfigError(f"{where} ({found}) is writable by its group; {fix}")
    if mode & stat.S_IRGRP:
        if status.st_gid != gid:
            raise ConfigError(
                f"{where} ({found}) is readable by a group that is not this daemon's "
                f"(gid {gid}); {fix}"
            )
        if others := (members or other_members)(gid):
            raise ConfigError(
                f"{where} ({found}) is readable by group gid {gid}, which also lists "
                f"{', '.join(others)}; {fix}, or take them out of the group"
            )


def other_members(gid: int) -> list[str]:
    """The users the group database lists in ``gid`` other than the daemon's own user.

    A gid that no database names (usual in containers: the orchestrator picked it) lists
    nobody.
    """
    try:
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        return []
    try:
        me = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        me = ""
    return sorted(m for m in members if m != me)
