"""The client library's own checks, which need no daemon."""

from __future__ import annotations

import pytest

import fabricd
from fabricd.client import connect


def test_no_daemon_says_which_socket_and_how_to_start_one(tmp_path):
    path = str(tmp_path / "absent.sock")
    with pytest.raises(fabricd.DaemonUnavailable) as missing:
        connect(socket_path=path)
    text = str(missing.value)
    assert path in text
    assert "fabricctl local-cluster" in text
    assert "FABRICD_SOCKET" in text


def test_rank_and_size_come_from_torchrun_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(fabricd.UsageError, match=r"\$RANK='five' is not an integer"):
        connect(job="j", socket_path=str(tmp_path / "s"))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fabricd.UsageError, match="rank 3 is outside a job of size 2"):
        connect(job="j", socket_path=str(tmp_path / "s"))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(fabricd.UsageError, match="needs rank and size"):
        connect(job="j", socket_path=str(tmp_path / "s"))


def test_every_error_is_a_fabric_error():
    for name in fabricd.__all__:
        value = getattr(fabricd, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, fabricd.FabricError), name
    assert issubclass(fabricd.Timeout, TimeoutError)
    assert issubclass(fabricd.ProtocolError, ValueError)
    failed = fabricd.PeerFailed("gone", rank=3, node=1)
    assert (failed.code, failed.rank, failed.node) == ("peer_failed", 3, 1)


def test_a_daemon_that_hangs_up_at_once_is_explained(tmp_path):
    import socket
    import threading

    path = str(tmp_path / "refusing.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse() -> None:  # what the daemon does with a uid it does not admit
        conn, _ = server.accept()
        conn.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    try:
        with pytest.raises(fabricd.DaemonUnavailable) as refused:
            connect(socket_path=path, timeout=5)
    finally:
        thread.join(5)
        server.close()
    assert "allowed_uids" in str(refused.value)
    assert path in str(refused.value)
