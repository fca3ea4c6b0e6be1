"""Directories fabricd creates, with the mode it means whatever the umask.

``os.makedirs(path, mode)`` applies the umask to the last directory and creates every missing
parent with ``0o777 & ~umask``: under ``umask 000`` those parents end up 0777, writable by
every user, around a socket whose safety rests on its directory.  :func:`make_dirs` creates
each missing directory itself with ``os.mkdir(path, mode)`` (never wider than ``mode``, since
the umask only takes bits away) and then ``os.chmod(path, mode)`` (so a stricter umask does not
leave it narrower than meant either).  Directories that already exist are left as they are:
they belong to whoever made them (systemd's ``RuntimeDirectory=``, the operator).
"""

from __future__ import annotations

import os


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
        os.chmod(directory, mode)
