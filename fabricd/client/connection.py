"""One connection to the daemon, shared by every thread of a training process.

The I/O around :class:`~fabricd.client.protocol.ClientProtocol`: the Unix socket, segment fds
passed with SCM_RIGHTS, and the hand-off between threads.  It has no thread of its own.

Threads and locks:

* one thread sends at a time (``_send_lock``), and sends never wait behind a read;
* one thread reads at a time (``_read_lock``): whichever thread is waiting (for a reply, or
  for an event in :meth:`Connection.poll`) and finds the lock free reads, and delivers
  everything it reads, replies to every waiting thread and events to the queue;
* the others wait on ``_state`` (a condition) until the reader has read, then look again.  A
  waiter counts itself in ``_waiting`` and then checks ``_read_lock``, both under ``_state``;
  the reader releases ``_read_lock`` and *then* looks at ``_waiting``, and notifies under
  ``_state`` if anyone counted itself.  So no waiter misses the last wake-up: either the reader
  sees it counted (and its notify, under ``_state``, comes once the waiter sleeps), or the
  waiter sees the read lock free (or taken by a later reader, who looks in turn) and goes back
  to read itself (two plain attribute accesses each, which the GIL runs in program order;
  an interpreter without a GIL gives no such order, so there the reader always notifies).
  A reader with nobody waiting (one thread, the common case) wakes nobody;
* ``_state`` also guards the protocol, the calls and the event queue; it is never held during
  I/O.  The hot paths take its lock (``_state_lock``) directly: ``Condition``'s own ``with``
  is Python code.

The socket stays blocking with no timeout (set so here, whatever ``socket.setdefaulttimeout``
says).  A read with a time limit waits in ``poll()`` (not ``select()``, which fails for fds
above 1024) and then takes what is there, so a read timeout never leaks into a send; a read
with none (a plain ``wait()``) goes straight into a blocking ``recv()``, which returns at the
same moment ``poll()`` would and saves its system call.  Either way only the thread holding
``_read_lock`` reads.  :meth:`close` shuts the socket down first, which wakes a reader in
``poll()`` or ``recv()`` and a sender stuck in ``sendall``, and releases the fd only while
holding both locks, so no thread ever polls, reads or writes an fd that was closed (and maybe
reused) under it.

Spinning (``spin``, off by default): a reader first asks the socket without blocking, over and
over, for up to ``spin`` seconds, and only then sleeps in ``poll()`` or ``recv()``.  A reply
that comes within the spin is taken without the sleep and the wake-up, which on a virtual
machine cost tens of microseconds each; the price is a core kept busy meanwhile, so it pays
only where the node has cores to spare (docs/performance.md, "The fast path").

A send that fails does not end the connection by itself: the daemon may have written why it
hung up (a closing event) before it did, so the socket is shut and the next read takes what is
left, the reason included, before the end.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.client import checks
from fabricd.client.protocol import ClientProtocol, Event, Reply, State
from fabricd.errors import DaemonUnavailable, Timeout
from fabricd.ipc import socket_candidates
from fabricd.slurm import job_directory, job_has_daemon, job_id_of

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_RECV_SIZE: Final = 256 * 1024
_MAX_POLL_MS: Final = 2**31 - 1  #: poll() takes a C int; longer waits just poll again
#: whether the interpreter has a GIL (the wake-up hand-off's ordering relies on it, see above)
_GIL: Final = bool(getattr(sys, "_is_gil_enabled", lambda: True)())
#: events kept for :meth:`Connection.poll`; past this the oldest are dropped (and counted)
MAX_QUEUED_EVENTS: Final = 10_000


@dataclass(slots=True, eq=False)
class Call:
    """One request in flight: its id, what it is (for messages), and its reply once in."""

    id: int
    what: str
    reply: Reply | None = None


class Connection:
    """A connected client socket and the protocol state on it.  Make one with :meth:`open`."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.path = path
        self.events_dropped = 0  #: events dropped because the queue was full
        #: seconds a reader asks the socket without blocking before it sleeps (0: never)
        self.spin = 0.0
        sock.settimeout(None)
        self._sock = sock
        self._protocol = ClientProtocol(peer=f"the daemon on {path}")
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._state_lock = threading.RLock()
        self._state = threading.Condition(self._state_lock)
        self._waiting = 0  #: threads asleep (or about to be) on _state
        self._calls: dict[int, Call] = {}
        self._events: collections.deque[Event] = collections.deque()
        self._broken: str | None = None  #: why sending failed, if it did
        self._closed_here = False
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    @classmethod
    def open(cls, paths: Sequence[str]) -> Connection:
        """Connect to the first of ``paths`` where a daemon listens.

        Raises:
            DaemonUnavailable: none answers; the message lists every path tried and why, and
                how to start a daemon.
        """
        tried = []
        for path in paths:
            sock = None
            try:  # socket() fails too, in a process out of fds
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                sock.connect(path)
            except OSError as exc:
                if sock is not None:
                    sock.close()
                tried.append(f"{path} ({exc.strerror or exc})")
                continue
            return cls(sock, path)
        if tuple(paths) == socket_candidates() and job_has_daemon(os.environ):
            raise DaemonUnavailable(
                f"this Slurm job's own daemon does not answer on {' or '.join(tried)}; the "
                f"prolog started it for this job ({job_directory(job_id_of(os.environ) or 0)} "
                "is there), so the node's other daemons, on another fabric, are not tried: "
                "see docs/slurm.md, section: The job's daemon"
            )
        raise DaemonUnavailable(
            f"no fabricd daemon answers on {' or '.join(tried)}. Start one with "
            f"`fabricd --config /etc/fabricd/fabricd.toml` (or `systemctl start fabricd`), or "
            f"for development `fabricctl local-cluster 1`; {_where_else(paths)}"
        )

    @property
    def closed(self) -> bool:
        """Whether the connection ended (closed here, or the daemon went)."""
        return self._protocol.state is State.CLOSED

    @property
    def closing(self) -> Event | None:
        """The closing event, if the daemon said why it closed (or is closing) the connection."""
        return self._protocol.closing

    # -- requests ---------------------------------------------------------------------------
    def submit(
        self,
        op: str,
        fields: Mapping[str, object],
        *,
        fds: Sequence[int] = (),
        what: str | None = None,
    ) -> Call:
        """Send a request (with ``fds`` passed along) and return its call; never waits for a read.

        Raises:
            FabricError: the connection has ended (``DaemonUnavailable``, or the daemon's
                reason); connect again.
        """
        with self._send_lock:
            with self._state_lock:
                rid, frame = self._protocol.request(op, fields, fds=len(fds))
                call = Call(rid, what or op)
                self._calls[rid] = call
            try:
                sent = socket.send_fds(self._sock, [frame], list(fds)) if fds else 0
                self._sock.sendall(frame[sent:])
            except OSError as exc:
                self._broke(f"sending to the daemon failed: {exc.strerror or exc}")
        return call

    def wait(self, call: Call, timeout: float | None) -> Reply:
        """Block until ``call`` has its reply (reading for every thread meanwhile).

        Raises:
            Timeout: ``timeout`` seconds passed; the request goes on, wait again later.
            UsageError: ``timeout`` is neither None nor a number (NaN is none).
        """
        timeout = checks.timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (reply := call.reply) is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise Timeout(
                    f"{call.what} did not finish within {timeout}s; it is still under way"
                )
            self._pump(remaining, call)
        return reply

    def ready(self, call: Call) -> bool:
        """Whether ``call`` has its reply, after reading what is already there (never blocks)."""
        if call.reply is None:
            self._pump(0.0, call)
        return call.reply is not None

    # -- events -----------------------------------------------------------------------------
    def poll(self, timeout: float | None = 0.0) -> list[Event]:
        """The events queued so far, waiting up to ``timeout`` seconds for one if none is.

        ``timeout=0`` reads what is already there and never blocks; ``None`` waits as long as
        it takes.  Returns ``[]`` when the time ran out.

        Raises:
            FabricError: the connection has ended and every event was taken
                (``DaemonUnavailable``, or the daemon's reason).
            UsageError: ``timeout`` is neither None nor a number (NaN is none).
        """
        timeout = checks.timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        taken = self._take_events()
        while not taken:
            remaining = None if deadline is None else deadline - time.monotonic()
            self._pump(None if remaining is None else max(remaining, 0.0), None)
            taken = self._take_events()
            if remaining is not None and remaining <= 0:
                break
        return taken

    def _take_events(self) -> list[Event]:
        with self._state:
            if not self._events and self._protocol.state is State.CLOSED:
                raise self._protocol.failure("poll")
            taken = list(self._events)
            self._events.clear()
        return taken

    # -- the end ----------------------------------------------------------------------------
    @property
    def closed_here(self) -> bool:
        """Whether :meth:`close` ended the connection (not the daemon)."""
        return self._closed_here

    def close(self) -> None:
        """End the connection: every pending call fails, then the fd is released."""
        self._closed_here = True
        self._end("the client was closed; connect again")
        with self._send_lock, self._read_lock:  # nobody writes or polls the fd now
            self._sock.close()

    def _end(self, why: str) -> None:
        """Fail every pending call (``why``, or the daemon's reason) and shut the socket."""
        with self._state:
            self._deliver(self._protocol.connection_lost(why))
            self._state.notify_all()
        self._shut()

    def _lost(self, why: str) -> None:
        """The socket failed or the daemon hung up (a failed send is the first cause)."""
        self._end(f"{self._broken or why} (socket {self.path}); is the daemon running?")

    def _broke(self, why: str) -> None:
        with self._state:
            self._broken = self._broken or why
        self._shut()  # the next read takes what the daemon left, then finds the end

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    # -- reading ----------------------------------------------------------------------------
    def _pump(self, timeout: float | None, until: Call | None) -> None:
        """Read once for everybody, or wait for the thread that reads, unless ``until`` has its
        reply (``None``: unless an event is queued)."""
        if self._read_lock.acquire(blocking=False):
            try:
                # no _state needed to look: whoever read before us delivered under the read
                # lock we now hold
                if not self._done(until):
                    self._read(timeout)
            finally:
                self._read_lock.release()
                if self._waiting or not _GIL:  # after the release: see the module's docstring
                    with self._state_lock:
                        self._state.notify_all()
            return
        with self._state_lock:  # another thread reads: it delivers for us too
            self._waiting += 1
            try:
                if not self._done(until) and self._read_lock.locked():
                    self._state.wait(timeout)
            finally:
                self._waiting -= 1

    def _done(self, until: Call | None) -> bool:
        return bool(self._events) if until is None else until.reply is not None

    def _read(self, timeout: float | None) -> None:
        if self._protocol.state is State.CLOSED:  # a close() racing this shuts the socket,
            return  # so the poll or recv below returns at once
        try:
            data, left = self._spin(timeout) if self.spin and timeout != 0 else (None, timeout)
            if data is None and left is None:
                data = self._sock.recv(_RECV_SIZE)
            elif data is None and left is not None:
                ms = min(math.ceil(left * 1000), _MAX_POLL_MS)
                data = self._sock.recv(_RECV_SIZE) if self._poller.poll(ms) else None
        except OSError as exc:
            self._lost(f"reading from the daemon failed: {exc.strerror or exc}")
            return
        if data is None:
            return
        if not data:
            self._lost("the daemon closed the connection")
            return
        with self._state_lock:
            self._deliver(self._protocol.receive_data(data))
        if self.closed:  # the daemon sent something unreadable
            self._shut()

    def _spin(self, timeout: float | None) -> tuple[bytes | None, float | None]:
        """Ask the socket without blocking until something comes or ``spin`` (at most
        ``timeout``) has passed; returns what came, if anything, and the time left to wait.

        Raises:
            OSError: the read failed.
        """
        start = time.monotonic()
        until = start + (self.spin if timeout is None else min(self.spin, timeout))
        while True:
            try:
                return self._sock.recv(_RECV_SIZE, socket.MSG_DONTWAIT), timeout
            except (BlockingIOError, InterruptedError):
                pass
            now = time.monotonic()
            if now >= until:
                return None, None if timeout is None else max(timeout - (now - start), 0.0)

    def _deliver(self, items: Sequence[Reply | Event]) -> None:
        """Hand replies to their calls and queue events (called under ``_state``)."""
        for item in items:
            if isinstance(item, Reply):
                self._calls.pop(item.id).reply = item
                continue
            if len(self._events) >= MAX_QUEUED_EVENTS:
                self._events.popleft()
                self.events_dropped += 1
            self._events.append(item)


def _where_else(paths: Sequence[str]) -> str:
    """How to point the client at another socket, told by where ``paths`` came from.

    Advice to set ``FABRICD_SOCKET`` is only right when nothing named a socket: when the
    variable named it, it is set already (and names a socket where nothing answers); when
    ``socket_path=`` (``--socket``) named it, the variable would not be read.
    """
    if tuple(paths) == socket_candidates():
        return "set FABRICD_SOCKET (or --socket) to use another socket"
    named = os.environ.get("FABRICD_SOCKET")
    if named and list(paths) == [named]:
        return (
            "FABRICD_SOCKET names this socket: point it at a running daemon's socket, or unset "
            f"it to try {' and '.join(socket_candidates())}"
        )
    return (
        "this socket was named explicitly (socket_path=, --socket), which FABRICD_SOCKET does "
        "not change: name a running daemon's socket"
    )
