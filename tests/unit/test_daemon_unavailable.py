"""What DaemonUnavailable advises, by where the socket tried came from (issue 27, item 2): it
said "set FABRICD_SOCKET" even to a user whose FABRICD_SOCKET named the socket tried."""

from __future__ import annotations

import pytest

import fabricd
from fabricd import ipc
from fabricd.client import connect


def _refusal(**kw: str) -> str:
    with pytest.raises(fabricd.DaemonUnavailable) as missing:
        connect(**kw)
    return str(missing.value)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No daemon at the default sockets (both in ``tmp_path``)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setattr(ipc, "SYSTEM_SOCKET", str(tmp_path / "system.sock"))
    monkeypatch.delenv("FABRICD_SOCKET", raising=False)
    return tmp_path


def test_with_fabricd_socket_set_it_says_the_variable_names_the_socket(nowhere, monkeypatch):
    named = str(nowhere / "from-env.sock")
    monkeypatch.setenv("FABRICD_SOCKET", named)
    text = _refusal()
    assert named in text
    assert "set FABRICD_SOCKET" not in text
    assert "FABRICD_SOCKET names this socket" in text
    assert "unset it to try" in text


def test_with_nothing_named_it_advises_setting_fabricd_socket(nowhere):
    text = _refusal()
    assert "set FABRICD_SOCKET (or --socket) to use another socket" in text
    assert str(nowhere / "system.sock") in text


def test_a_socket_named_explicitly_is_not_changed_by_the_variable(nowhere, monkeypatch):
    monkeypatch.setenv("FABRICD_SOCKET", str(nowhere / "from-env.sock"))
    given = str(nowhere / "given.sock")
    text = _refusal(socket_path=given)
    assert given in text
    assert "from-env.sock" not in text
    assert "set FABRICD_SOCKET" not in text
    assert "named explicitly" in text
