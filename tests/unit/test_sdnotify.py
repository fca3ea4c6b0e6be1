"""sd_notify client: messages reach a real datagram socket standing in for systemd.

No mocks: each test binds an ``AF_UNIX``/``SOCK_DGRAM`` socket, points ``NOTIFY_SOCKET`` at it
(through the ``environ`` argument, never the process environment) and reads what arrived.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.sdnotify import Notifier

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def systemd_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket playing systemd's notify socket, and its address.

    A short private directory, not tmp_path: sun_path holds only 108 bytes and pytest's
    per-test paths can be longer than that.
    """
    with (
        tempfile.TemporaryDirectory(prefix="sdn") as tmp,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
    ):
        path = str(Path(tmp) / "notify")
        sock.bind(path)
        sock.settimeout(5.0)
        yield sock, path


@pytest.fixture
def notifier(systemd_socket: tuple[socket.socket, str]) -> Iterator[Notifier]:
    _, path = systemd_socket
    made = Notifier.from_environ({"NOTIFY_SOCKET": path})
    assert made is not None
    yield made
    made.close()


def test_ready_with_status_is_one_datagram(systemd_socket, notifier):
    sock, _ = systemd_socket
    notifier.ready("serving 4 peers")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 4 peers"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda n: n.ready(), b"READY=1"),
        (lambda n: n.stopping(), b"STOPPING=1"),
        (lambda n: n.watchdog(), b"WATCHDOG=1"),
        (lambda n: n.status("draining 3 ops"), b"STATUS=draining 3 ops"),
    ],
    ids=["ready", "stopping", "watchdog", "status"],
)
def test_each_message_arrives(systemd_socket, notifier, call, expected):
    sock, _ = systemd_socket
    call(notifier)
    assert sock.recv(4096) == expected


def test_each_send_is_its_own_datagram(systemd_socket, notifier):
    sock, _ = systemd_socket
    notifier.send("STATUS=a", "EXTEND_TIMEOUT_USEC=5000000")
    notifier.watchdog()
    assert sock.recv(4096) == b"STATUS=a\nEXTEND_TIMEOUT_USEC=5000000"
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_status_text_cannot_inject_assignments(systemd_socket, notifier):
    # Status text may quote a peer's error message; a newline in it must not become a second
    # assignment such as READY=1 or MAINPID=.
    sock, _ = systemd_socket
    notifier.status("peer said\nREADY=1\0x")
    assert sock.recv(4096) == b"STATUS=peer said READY=1 x"


def test_send_rejects_a_line_with_a_newline(notifier):
    with pytest.raises(ValueError, match="newline"):
        notifier.send("STATUS=a\nMAINPID=1")


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}], ids=["unset", "empty"])
def test_from_environ_without_notify_socket_is_none(environ):
    assert Notifier.from_environ(environ) is None


def test_from_environ_rejects_unsupported_address(caplog):
    caplog.set_level(logging.WARNING, logger="fabricd.daemon.sdnotify")
    assert Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}) is None
    assert "not a path or @abstract" in caplog.text


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "self"}, None),
        ({"WATCHDOG_USEC": "500000"}, 0.25),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "thirty"}, None),
        ({}, None),
    ],
    ids=[
        "usec-only",
        "pid-is-us",
        "pid-is-other",
        "pid-malformed",
        "sub-second",
        "zero",
        "negative",
        "malformed",
        "absent",
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(systemd_socket, extra, expected):
    _, path = systemd_socket
    n = Notifier.from_environ({"NOTIFY_SOCKET": path, **extra})
    assert n is not None
    try:
        assert n.watchdog_interval() == expected
    finally:
        n.close()


def test_abstract_address_works():
    name = f"fabricd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5.0)
        n = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        assert n is not None
        try:
            n.ready()
            assert sock.recv(4096) == b"READY=1"
        finally:
            n.close()


def test_vanished_socket_is_logged_not_raised(systemd_socket, notifier, caplog):
    sock, path = systemd_socket
    caplog.set_level(logging.DEBUG, logger="fabricd.daemon.sdnotify")
    sock.close()
    os.unlink(path)
    notifier.watchdog()
    notifier.ready("after systemd went away")
    failures = [r for r in caplog.records if "sd_notify to" in r.getMessage()]
    assert len(failures) == 2
    assert all(r.levelno == logging.DEBUG for r in failures)


def test_send_after_close_is_logged_not_raised(notifier, caplog):
    caplog.set_level(logging.DEBUG, logger="fabricd.daemon.sdnotify")
    notifier.close()
    notifier.close()  # idempotent
    notifier.stopping()
    assert "sd_notify to" in caplog.text


def test_socket_is_not_inherited(notifier, systemd_socket):
    # SOCK_CLOEXEC: a child process (a spawned helper) must not be able to speak for the daemon.
    sock, _ = systemd_socket
    notifier.watchdog()
    sock.recv(4096)
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    ours = [
        fd
        for fd in fds
        if _is_unbound_dgram_unix(fd)  # the notifier's socket, not the fake systemd's
    ]
    assert ours
    assert not any(os.get_inheritable(fd) for fd in ours)


def _is_unbound_dgram_unix(fd: int) -> bool:
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with probe:
        return (
            probe.family == socket.AF_UNIX
            and probe.type == socket.SOCK_DGRAM
            and probe.getsockname() in ("", b"")
        )
