"""A tiny sd_notify(3) client: tell systemd that fabricd is ready, alive, or stopping.

The protocol
------------
A service started with ``Type=notify`` finds the address of systemd's notification socket in
``$NOTIFY_SOCKET``: a filesystem path (``/run/systemd/notify``) or, when it starts with ``@``, a
Linux abstract-namespace name (the ``@`` stands for a leading NUL byte). The service sends one
``AF_UNIX``/``SOCK_DGRAM`` datagram per message, made of newline-separated ``VARIABLE=value``
assignments:

- ``READY=1``: startup is finished. fabricd sends it only after every listener is bound and the
  client socket has its permissions, so that ``systemctl start`` returning means "usable".
- ``STOPPING=1``: shutdown (the SIGTERM drain) has begun.
- ``WATCHDOG=1``: "still alive". With ``WatchdogSec=`` set, systemd exports ``$WATCHDOG_USEC``
  (and ``$WATCHDOG_PID``) and kills and restarts the service if no ping arrives in time.
- ``STATUS=...``: one line of free text shown by ``systemctl status``.

systemd identifies the sender by the pid in the datagram's kernel-attached credentials, which is
why the unit says ``NotifyAccess=main``: only the daemon's own process may speak for it.

Why the watchdog is pinged from the event loop
----------------------------------------------
The watchdog exists to catch a daemon that is still running but no longer doing its job. For
fabricd that means a stalled event loop (a blocking call, a runaway callback): every peer
heartbeat, client request and drain runs on it. A ping from a helper thread would carry on while
the loop is stuck and hide exactly that failure, so the daemon schedules ``watchdog()`` on the
loop itself, every ``watchdog_interval()`` seconds (half of ``WATCHDOG_USEC``, as
sd_watchdog_enabled(3) recommends, so one late or lost ping never trips it)::

    async def ping_watchdog(notifier: Notifier, interval: float) -> None:
        while True:
            notifier.watchdog()
            await asyncio.sleep(interval)

The methods are synchronous on purpose: the socket is non-blocking and a datagram send either
goes into the receive queue at once or fails at once, so there is nothing to await. Failures
(systemd restarted, the socket vanished, a full queue) are logged at debug level and swallowed:
losing systemd must never take the training traffic down with it.

No dependency beyond the standard library is used; the whole protocol is one ``sendto``.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Notifier"]

_log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify(3) messages to the socket systemd named in ``$NOTIFY_SOCKET``.

    Create it with :meth:`from_environ`, which returns ``None`` when the daemon is not run by
    systemd (so callers write ``if notifier: notifier.ready()``), and :meth:`close` it at exit.
    One instance per process; it is not meant to be shared across ``fork()`` (the watchdog
    check below deliberately turns itself off in a child).
    """

    __slots__ = ("_address", "_sock", "_watchdog_pid", "_watchdog_usec")

    def __init__(
        self,
        address: str,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        """Open a datagram socket aimed at ``address``.

        Args:
            address: an absolute socket path, or ``@name`` for an abstract-namespace socket.
            watchdog_usec: the watchdog timeout in microseconds (``$WATCHDOG_USEC``), if any.
            watchdog_pid: the pid the watchdog is meant for (``$WATCHDOG_PID``), if given.

        Raises:
            ValueError: ``address`` is neither absolute nor abstract. :meth:`from_environ`
                catches this and returns ``None``; direct callers should fix the address.
            OSError: the process cannot create a socket (out of descriptors).
        """
        if address.startswith("@"):
            self._address = b"\0" + os.fsencode(address[1:])
        elif address.startswith("/"):
            self._address = os.fsencode(address)
        else:
            raise ValueError(f"unsupported NOTIFY_SOCKET address {address!r}")
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        # Non-blocking: a send from the event loop must never wait on systemd's queue.
        self._sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier | None:
        """Build a notifier from ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.

        Args:
            environ: the environment to read; ``os.environ`` when omitted.

        Returns:
            A notifier, or ``None`` when ``NOTIFY_SOCKET`` is unset or empty (not started by
            systemd, or by a unit that is not ``Type=notify``), or names an address family
            this client does not speak (logged as a warning). Callers then skip notification.
        """
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if not address:
            return None
        watchdog_usec = _parse_positive_int(env.get("WATCHDOG_USEC"))
        pid_text = env.get("WATCHDOG_PID")
        watchdog_pid = _parse_positive_int(pid_text)
        if pid_text is not None and watchdog_pid is None:
            # sd_watchdog_enabled(3) treats an unparsable WATCHDOG_PID as "not for us".
            watchdog_usec = None
        try:
            return cls(address, watchdog_usec=watchdog_usec, watchdog_pid=watchdog_pid)
        except ValueError:
            _log.warning("NOTIFY_SOCKET=%r is not a path or @abstract name; not notifying", address)
            return None

    def send(self, *lines: str) -> None:
        """Send ``lines`` (``VARIABLE=value`` assignments) to systemd as one datagram.

        Errors from the socket are logged at debug level and swallowed: a missing or restarted
        systemd must not crash the daemon, and the next ping or status update simply tries
        again. Nothing is sent when no lines are given.

        Raises:
            ValueError: a line contains a newline or NUL byte. That would smuggle in another
                assignment (``MAINPID=``, ``READY=1``) or make systemd drop the datagram; it is
                a bug in the caller. Use :meth:`status` for free text, which cleans it.
        """
        if not lines:
            return
        for line in lines:
            if "\n" in line or "\0" in line:
                raise ValueError(f"sd_notify line contains a newline or NUL: {line!r}")
        payload = "\n".join(lines).encode("utf-8", errors="replace")
        try:
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            _log.debug("sd_notify to %r failed: %s", self._address, exc)

    def ready(self, status: str = "") -> None:
        """Report that startup is complete (``READY=1``), with an optional status line."""
        if status:
            self.send("READY=1", "STATUS=" + _one_line(status))
        else:
            self.send("READY=1")

    def stopping(self) -> None:
        """Report that shutdown has begun (``STOPPING=1``), so systemd shows "deactivating"."""
        self.send("STOPPING=1")

    def watchdog(self) -> None:
        """Ping the watchdog (``WATCHDOG=1``); call it from the event loop, see the module doc."""
        self.send("WATCHDOG=1")

    def status(self, text: str) -> None:
        """Set the one-line status ``systemctl status`` shows; newlines become spaces."""
        self.send("STATUS=" + _one_line(text))

    def watchdog_interval(self) -> float | None:
        """Return the seconds between watchdog pings, or ``None`` when there is no watchdog.

        The interval is half of ``WATCHDOG_USEC``. As in sd_watchdog_enabled(3), a
        ``WATCHDOG_PID`` that is set but is not this process (say, a child that inherited the
        environment) means the watchdog belongs to someone else, so ``None``.
        """
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        """Close the socket. Idempotent; later sends fail quietly (logged at debug)."""
        self._sock.close()


def _parse_positive_int(text: str | None) -> int | None:
    """Parse a systemd-exported unsigned integer; ``None`` if absent, malformed, or zero."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()):
        _log.warning("ignoring malformed systemd watchdog variable %r", text)
        return None
    value = int(text)
    return value if value > 0 else None


def _one_line(text: str) -> str:
    """Make free text safe as a single sd_notify value (no newline, no NUL)."""
    return text.replace("\r", " ").replace("\n", " ").replace("\0", " ")
