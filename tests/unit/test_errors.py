"""Error codes: one StrEnum, one map from code to exception for daemon and client alike."""

from __future__ import annotations

import pytest

from fabricd.errors import (
    DaemonUnavailable,
    ErrorCode,
    OperationFailed,
    PeerFailed,
    PermissionDenied,
    ProtocolError,
    UsageError,
    code_of,
    error_for,
)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (ErrorCode.USAGE, UsageError),
        (ErrorCode.MISMATCH, UsageError),
        (ErrorCode.PEER_FAILED, PeerFailed),
        (ErrorCode.RECEIVER_LEFT, PeerFailed),
        (ErrorCode.NO_SUCH_RANK, OperationFailed),
        (ErrorCode.TRANSPORT, OperationFailed),
        (ErrorCode.DAEMON_STOPPING, OperationFailed),
        (ErrorCode.LIMIT, OperationFailed),
        (ErrorCode.RESOURCES, OperationFailed),
        (ErrorCode.PERMISSION, PermissionDenied),
        (ErrorCode.INTERNAL, OperationFailed),
        (ErrorCode.DAEMON_GONE, DaemonUnavailable),
        (ErrorCode.PROTOCOL, DaemonUnavailable),
        ("some_future_code", OperationFailed),
    ],
)
def test_each_code_raises_what_protocol_md_says(code: str, kind: type) -> None:
    exc = error_for(code, "what happened", rank=2, node=1)
    assert type(exc) is kind
    assert str(exc) == "what happened"
    if isinstance(exc, OperationFailed):
        assert exc.code == code


def test_peer_failed_keeps_rank_and_node() -> None:
    exc = error_for("peer_failed", "gone", rank=3, node=2)
    assert isinstance(exc, PeerFailed)
    assert (exc.rank, exc.node, exc.code) == (3, 2, "peer_failed")


def test_codes_are_plain_strings_on_the_wire() -> None:
    assert ErrorCode.NO_SUCH_RANK == "no_such_rank"
    assert f"{ErrorCode.MISMATCH}" == "mismatch"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UsageError("bad"), "usage"),
        (OperationFailed("stopping", code=ErrorCode.DAEMON_STOPPING), "daemon_stopping"),
        (ProtocolError("junk"), "protocol"),
    ],
)
def test_the_daemon_reports_the_code_of_what_it_raised(exc: Exception, code: str) -> None:
    assert code_of(exc) == code  # type: ignore[arg-type]
