"""Directories fabricd creates have the mode it asks for, whatever the umask."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import TYPE_CHECKING

import pytest

from fabricd.dirs import make_dirs

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
