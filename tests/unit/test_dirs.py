"""Directories fabricd creates have the mode it asks for, whatever the umask."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import TYPE_CHECKING

import pytest

from fabricd.dirs import make_dirs, unsafe_directory

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077], ids=["umask000", "umask022", "umask077"])
def test_every_directory_made_has_exactly_the_mode(tmp_path, mask):
    target = tmp_path / "a" / "b" / "c"
    with _umask(mask):
        make_dirs(target, 0o750)
    for directory in (target, target.parent, target.parent.parent):
        assert _mode(directory) == 0o750, directory


def test_directories_that_exist_are_left_as_they_are(tmp_path):
    existing = tmp_path / "mine"
    existing.mkdir()
    existing.chmod(0o755)
    with _umask(0):
        make_dirs(existing / "new", 0o700)
        make_dirs(existing, 0o700)
    assert _mode(existing) == 0o755
    assert _mode(existing / "new") == 0o700


def test_a_file_in_the_way_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        make_dirs(tmp_path / "file" / "below", 0o700)


def test_a_symlink_swapped_in_after_mkdir_is_not_chmodded_through(tmp_path, monkeypatch):
    # in a directory another user can write, the new directory can be renamed away and a
    # symlink put in its place between mkdir and chmod: chmod followed it (as root: any file)
    victim = tmp_path / "victim"
    victim.write_text("")
    victim.chmod(0o600)
    made = tmp_path / "shared" / "fabricd"
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: str, mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        if path == str(made):
            os.rename(path, str(tmp_path / "moved"))
            os.symlink(victim, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(OSError, match=r"Not a directory|Too many levels"):  # the symlink, refused
        make_dirs(made, 0o750)
    assert _mode(victim) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o757])
def test_a_directory_others_may_write_is_named(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    reason = unsafe_directory(str(shared))
    assert reason is not None
    assert f"other users may write it (mode {mode:o})" == reason


def test_a_private_directory_is_fine(tmp_path):
    for mode in (0o700, 0o750, 0o755):
        tmp_path.chmod(mode)
        assert unsafe_directory(str(tmp_path)) is None


def test_a_directory_of_another_user_is_named(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o755)
    if os.geteuid() == 0:
        owner = 65534  # nobody
        os.chown(theirs, owner, -1)
    else:  # the directory is ours: pretend to be someone else
        owner = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    assert (
        unsafe_directory(str(theirs)) == f"it belongs to uid {owner}, who may replace what is in it"
    )
