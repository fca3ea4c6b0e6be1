"""tests/apt.py, the helper that installs a Debian package a test needs: it installs only
what is missing, only as root with apt-get, updates a stale index once, and otherwise says
why not (the reason the caller skips with)."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

import pytest

from tests import apt

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(autouse=True)
def _forget_installs() -> Iterator[None]:
    """The helper tries each package once per session: a fake machine's answer must not be
    what a real test asks after these (the etcd tests, on a machine without etcd)."""
    apt._install.cache_clear()
    yield
    apt._install.cache_clear()


def _machine(monkeypatch: pytest.MonkeyPatch, *, root: bool, installed: set[str]) -> list[str]:
    """A machine where ``installed`` programs are on PATH; returns the commands it ran."""
    ran: list[str] = []
    monkeypatch.setattr(apt.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setattr(apt.shutil, "which", lambda p: f"/usr/bin/{p}" if p in installed else None)

    def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        ran.append(" ".join(command[:2]))
        if command[1] == "update":
            installed.add("updated")
            return subprocess.CompletedProcess(command, 0, "")
        if "updated" not in installed:  # a fresh machine's empty index
            return subprocess.CompletedProcess(command, 100, "E: Unable to locate package")
        installed.add("etcd")
        return subprocess.CompletedProcess(command, 0, "")

    monkeypatch.setattr(apt, "_run", run)
    return ran


def test_a_program_on_path_needs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _machine(monkeypatch, root=False, installed={"etcd"})
    assert apt.ensure("etcd-server", "etcd") is None
    assert ran == []


def test_without_root_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _machine(monkeypatch, root=False, installed={"apt-get"})
    assert "needs root" in (apt.ensure("etcd-server", "etcd") or "")
    assert ran == []


def test_root_installs_after_updating_a_stale_index(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _machine(monkeypatch, root=True, installed={"apt-get"})
    assert apt.ensure("etcd-server", "etcd") is None
    assert ran == ["apt-get install", "apt-get update", "apt-get install"]


def test_without_apt_get_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _machine(monkeypatch, root=True, installed=set())
    assert "no apt-get" in (apt.ensure("etcd-server", "etcd") or "")
    assert ran == []
