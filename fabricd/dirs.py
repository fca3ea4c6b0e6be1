"""Directories fabricd creates, with the mode it means whatever the umask.

``os.makedirs(path, mode)`` applies the umask to the last directory and creates every missing
parent with ``0o777 & ~umask``: under ``umask 000`` those parents end up 0777, writable by
every user, around a socket whose safety rests on its directory.  :func:`make_dirs` creates
each missing directory itself with ``os.mkdir(path, mode)`` (never wider than ``mode``, since
the umask only takes bits away) and then ``os.chmod(path, mode)`` (so a stricter umask does not
leave it narrower than meant either), through an fd opened with ``O_NOFOLLOW``: in a parent
another user can write, the new directory could be renamed away and a symlink put in its place
between the two calls, and a chmod by path (as root) would change whatever it points to.
Directories that already exist are left as they are: they belong to whoever made them
(systemd's ``RuntimeDirectory=``, the operator); :func:`unsafe_directory` says whether one is
safe to keep a socket in.
"""

from __future__ import annotations

import os
import stat


def make_dirs(path: str | os.PathLike[str], mode: int) -> None:
    """Create ``path`` and its missing parents, each with exactly ``mode``.

    Raises:
        OSError: a directory cannot be created, or a component is not a directory.
    """
    path = os.path.abspath(os.fspath(path))
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # made by someone else meanwhile: theirs, left as it is
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def unsafe_directory(path: str) -> str | None:
    """Why another user could replace what this process puts in directory ``path``, if so.

    A directory is safe when it belongs to root or to this process's user and neither its group
    nor others may write it.  The sticky bit does not make it safe: in ``/tmp`` another user
    cannot remove a socket once it is bound, but may bind one under its name first.

    Raises:
        OSError: ``path`` cannot be examined.
    """
    info = os.stat(path)
    if info.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {info.st_uid}, who may replace what is in it"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write it (mode {stat.S_IMODE(info.st_mode):o})"
    return None
