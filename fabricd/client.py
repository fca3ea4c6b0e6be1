"""The client library: what a training process imports to talk to its node's daemon.

>>> import fabricd
>>> with fabricd.connect(job="demo") as fab:           # rank/size also from RANK/WORLD_SIZE
...     g = fab.array("grad", (1024,), "float32")      # numpy view of a shared-memory segment
...     fab.send(g, to=1)                              # or fab.recv(g, src=1)

Arrays live in sealed memfd segments (:mod:`fabricd.shm`) that the daemon maps too, so a send
or receive passes only (segment, offset, length, dtype) over the socket; the daemon reads and
writes the array's memory directly.  Between a send and its completion the array must not be
changed; between a receive and its completion it must not be read.

The client is synchronous and thread-safe, with no thread of its own: one waiting thread at a
time reads replies from the socket and completes whichever handles they belong to, while the
others wait to be told; sends never wait behind a read.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from fabricd.dtypes import ITEMSIZE
from fabricd.errors import (
    DaemonUnavailable,
    OperationFailed,
    PeerFailed,
    ProtocolError,
    Timeout,
    UsageError,
)
from fabricd.ipc import REPLY_LIMITS, default_socket_path
from fabricd.shm import Segment
from fabricd.wire import MAX_TAG, NEED_DATA, Decoder, Frame, Kind, Meta, encode

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

_RECV_SIZE = 256 * 1024
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A finished send or receive: the other rank, the tag, and the bytes moved."""

    peer: int
    tag: int
    nbytes: int


class Handle(Generic[T]):
    """An operation in progress.  :meth:`wait` until it is done; waiting again is allowed."""

    def __init__(self, client: Client, what: str, result: Callable[[Meta], T]) -> None:
        self._client = client
        self.request = 0
        self.what = what
        self._result = result
        self._reply: Meta | None = None

    def done(self) -> bool:
        """Whether the operation has finished (reads any replies already waiting)."""
        if self._reply is None:
            self._client._pump_nowait()
        return self._reply is not None

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finishes and return its result.

        Raises:
            Timeout: ``timeout`` seconds passed; the operation goes on, wait again later.
            PeerFailed: the other rank's node went down or the rank left.
            UsageError: the request was wrong (the message says what).
            OperationFailed: the daemon could not do it (``code`` says why).
            DaemonUnavailable: the daemon went away.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._reply is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise Timeout(
                    f"{self.what} did not finish within {timeout}s; it is still under way"
                )
            self._client._pump(remaining, until=self)
        return self._result(_raise_for(self._reply, self.what))

    def _resolve(self, reply: Meta) -> None:
        self._reply = reply


def _reply_fields(reply: Meta) -> Meta:
    return reply


def _raise_for(reply: Meta, what: str) -> Meta:
    if reply.get("ok") is True:
        return reply
    code, text = str(reply.get("code", "failed")), f"{what}: {reply.get('error', 'failed')}"
    if code in ("peer_failed", "receiver_left"):
        rank, node = reply.get("rank"), reply.get("node")
        raise PeerFailed(
            text,
            rank=rank if isinstance(rank, int) else None,
            node=node if isinstance(node, int) else None,
            code=code,
        )
    if code in ("usage", "mismatch"):
        raise UsageError(text)
    if code == "daemon_gone":
        raise DaemonUnavailable(text)
    raise OperationFailed(text, code=code)


@dataclass(slots=True)
class _Segment:
    seg: int
    segment: Segment
    root: np.ndarray[Any, Any]  #: the whole segment as bytes
    array: np.ndarray[Any, Any]  #: what fab.array() returned
    base: int  #: address of the mapping in this process


class Client:
    """A connection to the local daemon.  Make one with :func:`connect`."""

    def __init__(
        self, path: str, job: str | None, rank: int | None, size: int | None, timeout: float
    ) -> None:
        self.socket_path = path
        self.job = job
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._delivered = threading.Condition()
        self._ids = itertools.count(1)
        self._seg_ids = itertools.count(1)
        self._pending: dict[int, Handle[Any]] = {}
        self._segments: dict[str, _Segment] = {}
        self._decoder = Decoder(REPLY_LIMITS)
        self._closed = False
        self._sock = _open(path)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        fields: dict[str, Any] = {"pid": os.getpid()}
        if job is not None:
            fields.update(job=job, rank=rank, size=size)
        try:
            hello = self._call("hello", timeout=timeout, **fields)
        except DaemonUnavailable as exc:
            self._sock.close()
            raise DaemonUnavailable(
                f"{exc}. A daemon that hangs up at once has refused this process: its uid "
                f"{os.getuid()} and groups must be in the daemon's allowed_uids/allowed_gids "
                "(or in group fabricd); the daemon's log names the refused pid"
            ) from None
        except BaseException:
            self._sock.close()
            raise
        self._rank, self._size = rank, size
        self.node: int = hello["node"]
        self.nodes: int = hello["nodes"]

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        if self._rank is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks in the job."""
        if self._size is None:
            raise UsageError("this client joined no job; pass job= to fabricd.connect()")
        return self._size

    # -- arrays -----------------------------------------------------------------------------
    def array(
        self, name: str, shape: int | Sequence[int], dtype: Any = "float32"
    ) -> np.ndarray[Any, Any]:
        """A zero-filled numpy array in shared memory that the daemon can move directly.

        Asking again for the same name returns the same array (shape and dtype must agree).

        Raises:
            UsageError: unsupported dtype, bad shape, or a name reused with another layout.
        """
        dt = np.dtype(dtype)
        if dt.name not in ITEMSIZE or not dt.isnative:
            raise UsageError(f"dtype {dt} is not supported; use one of {', '.join(ITEMSIZE)}")
        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise UsageError(f"shape {dims} has a negative dimension")
        existing = self._segments.get(name)
        if existing is not None:
            if existing.array.shape != dims or existing.array.dtype != dt:
                raise UsageError(
                    f"array {name!r} already exists as {existing.array.shape} "
                    f"{existing.array.dtype}; use another name for {dims} {dt}"
                )
            return existing.array
        nbytes = math.prod(dims) * dt.itemsize
        segment = Segment.create(name, nbytes)
        seg = next(self._seg_ids)
        try:
            self._call("attach", fds=[segment.fd], seg=seg, size=segment.size)
        except BaseException:
            segment.close()
            raise
        segment.release_fd()
        root = np.frombuffer(segment.buffer, dtype=np.uint8, count=nbytes)
        array: np.ndarray[Any, Any] = root.view(dt).reshape(dims)
        self._segments[name] = _Segment(seg, segment, root, array, _address(root))
        return array

    # -- point to point ---------------------------------------------------------------------
    def send(
        self, array: np.ndarray[Any, Any], to: int, tag: int = 0, *, timeout: float | None = None
    ) -> Completion:
        """Send ``array`` to rank ``to``; returns once the receiver has all of it."""
        return self.send_async(array, to, tag).wait(timeout)

    def recv(
        self, array: np.ndarray[Any, Any], src: int, tag: int = 0, *, timeout: float | None = None
    ) -> Completion:
        """Receive from rank ``src`` into ``array`` (same byte size and dtype as sent)."""
        return self.recv_async(array, src, tag).wait(timeout)

    def send_async(self, array: np.ndarray[Any, Any], to: int, tag: int = 0) -> Handle[Completion]:
        """Start a send; leave ``array`` unchanged until the handle is done."""
        return self._transfer("send", array, to, tag)

    def recv_async(self, array: np.ndarray[Any, Any], src: int, tag: int = 0) -> Handle[Completion]:
        """Start a receive; don't read ``array`` until the handle is done."""
        return self._transfer("recv", array, src, tag)

    def _transfer(
        self, op: str, array: np.ndarray[Any, Any], peer: int, tag: int
    ) -> Handle[Completion]:
        if not 0 <= peer < self.size:
            raise UsageError(f"rank {peer} is outside job {self.job!r} of size {self.size}")
        if not 0 <= tag <= MAX_TAG:
            raise UsageError(f"tag {tag} is outside 0..{MAX_TAG}")
        if op == "recv" and not array.flags.writeable:
            raise UsageError("cannot receive into a read-only array")
        seg, offset = self._locate(array)
        fields = {
            "seg": seg,
            "off": offset,
            "nbytes": array.nbytes,
            "dtype": array.dtype.name,
            "peer": peer,
            "tag": tag,
        }
        what = f"{op} {'to' if op == 'send' else 'from'} rank {peer} (tag {tag})"

        def completion(reply: Meta) -> Completion:
            return Completion(peer=peer, tag=int(reply["tag"]), nbytes=int(reply["nbytes"]))

        handle = Handle(self, what, completion)
        self._submit(op, handle, **fields)
        return handle

    def _locate(self, array: np.ndarray[Any, Any]) -> tuple[int, int]:
        if not isinstance(array, np.ndarray):
            raise UsageError("send and recv take numpy arrays made by fab.array()")
        if array.dtype.name not in ITEMSIZE:
            raise UsageError(f"dtype {array.dtype} is not supported")
        if not array.flags.c_contiguous:
            raise UsageError("array must be C-contiguous (use a contiguous slice of a fab.array())")
        start = _address(array)
        for entry in self._segments.values():
            if entry.base <= start and start + array.nbytes <= entry.base + entry.root.nbytes:
                return entry.seg, start - entry.base
            if array.nbytes == 0 and entry.base <= start <= entry.base + entry.root.nbytes:
                return entry.seg, start - entry.base
        raise UsageError(
            "array is not in fabricd shared memory; create it with fab.array(name, shape, dtype)"
        )

    # -- control ----------------------------------------------------------------------------
    def status(self, timeout: float = 10.0) -> Meta:
        """The daemon's status (what ``fabricctl status`` prints)."""
        return self._call("status", timeout=timeout)

    def config(self, timeout: float = 10.0) -> Meta:
        """The daemon's effective configuration with each value's source."""
        result: Meta = self._call("config", timeout=timeout)["config"]
        return result

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by :meth:`close`, or because the daemon went)."""
        return self._closed

    def close(self) -> None:
        """Disconnect; the daemon releases this client's segments and operations."""
        self._shut("the client was closed")  # wakes a reader and a stuck sender alike
        with self._read_lock:  # no reader is polling the fd now: it may be released
            self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the socket -------------------------------------------------------------------------
    # Threads: one sends at a time (_send_lock); one reads at a time (_read_lock) and delivers
    # every reply it reads, to whichever thread's handle it belongs; the others wait on
    # _delivered.  The socket stays blocking with no timeout: reads wait in select(), so a
    # read timeout never leaks into a send.
    def _call(
        self, op: str, *, timeout: float | None = 10.0, fds: Sequence[int] = (), **fields: Any
    ) -> Meta:
        handle = Handle(self, op, _reply_fields)
        self._submit(op, handle, fds=fds, **fields)
        return handle.wait(timeout)

    def _submit(
        self, op: str, handle: Handle[Any], *, fds: Sequence[int] = (), **fields: Any
    ) -> None:
        with self._send_lock:
            if self._closed:
                raise DaemonUnavailable("the client is closed; connect again")
            handle.request = next(self._ids)
            frame = encode(
                Kind.REQUEST, {"id": handle.request, "op": op, "fds": len(fds), **fields}
            )
            self._pending[handle.request] = handle
            try:
                sent = socket.send_fds(self._sock, [frame], list(fds)) if fds else 0
                self._sock.sendall(frame[sent:])
            except OSError as exc:
                self._lost(f"sending to the daemon failed: {exc}")
            if self.closed and handle._reply is None:  # shut by another thread meanwhile
                self._pending.pop(handle.request, None)
                handle._resolve(_gone("the connection to the daemon closed"))

    def _pump_nowait(self) -> None:
        if self._read_lock.acquire(blocking=False):
            try:
                self._read(0.0)
            finally:
                self._read_lock.release()
                self._wake()

    def _pump(self, timeout: float | None, until: Handle[Any]) -> None:
        if self._closed and until._reply is None:  # nothing will ever answer it now
            until._resolve(_gone("the connection to the daemon closed"))
            return
        if self._read_lock.acquire(blocking=False):
            try:
                if until._reply is None:
                    self._read(timeout)
            finally:
                self._read_lock.release()
                self._wake()
            return
        with self._delivered:  # another thread reads: it delivers our reply too
            # the reader notifies under this lock after releasing _read_lock, so checking both
            # here cannot miss its wake-up; if it already left, go back and read ourselves
            if until._reply is None and self._read_lock.locked():
                self._delivered.wait(timeout)

    def _wake(self) -> None:
        with self._delivered:
            self._delivered.notify_all()

    def _read(self, timeout: float | None) -> None:
        if self._closed:
            return
        try:  # poll, not select: a process with over 1024 open files is no exception here
            ready = self._poller.poll(None if timeout is None else math.ceil(timeout * 1000))
            data = self._sock.recv(_RECV_SIZE) if ready else None
        except (OSError, ValueError) as exc:  # ValueError: the fd was closed under us
            self._lost(f"reading from the daemon failed: {exc}")
            return
        if data is None:
            return
        if not data:
            self._lost("the daemon closed the connection")
            return
        try:
            self._decoder.feed(data)
            while (event := self._decoder.next_event()) is not NEED_DATA:
                if isinstance(event, Frame):
                    self._deliver(event.meta)
        except ProtocolError as exc:
            self._lost(f"the daemon sent something unreadable: {exc}")

    def _deliver(self, meta: Meta) -> None:
        request = meta.get("id")
        handle = self._pending.pop(request, None) if isinstance(request, int) else None
        if handle is not None:
            handle._resolve(meta)

    def _lost(self, why: str) -> None:
        if not self._closed:
            self._shut(f"{why} (socket {self.socket_path}); is the daemon running?")

    def _shut(self, why: str) -> None:
        """Shut the connection (waking a reader in poll) and fail every pending handle.

        The fd itself is released by :meth:`close` under the read lock, so a reader never
        polls an fd that was closed, or reused, under it.
        """
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        for handle in list(self._pending.values()):
            handle._resolve(_gone(why))
        self._pending.clear()
        self._wake()


def _gone(why: str) -> Meta:
    return {"ok": False, "code": "daemon_gone", "error": why}


def _address(array: np.ndarray[Any, Any]) -> int:
    pointer: int = array.__array_interface__["data"][0]
    return pointer


def _open(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(
            f"no fabricd daemon answers on {path} ({exc.strerror or exc}). Start one with "
            f"`fabricd --config /etc/fabricd/fabricd.toml` (or `systemctl start fabricd`), or "
            f"for development `fabricctl local-cluster 1`; set FABRICD_SOCKET to use another socket"
        ) from None
    return sock


def _env_int(value: int | None, name: str, what: str) -> int | None:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"${name}={raw!r} is not an integer {what}") from None


def connect(
    job: str | None = None,
    rank: int | None = None,
    size: int | None = None,
    *,
    socket_path: str | None = None,
    timeout: float = 10.0,
) -> Client:
    """Connect to the local daemon and, with ``job``, join it as ``rank`` of ``size``.

    ``rank`` and ``size`` default to ``$RANK`` and ``$WORLD_SIZE`` (as torchrun sets them), the
    socket to ``$FABRICD_SOCKET`` or the system default.  Without a job (and no ``$FABRICD_JOB``)
    the client can only query the daemon (status, config).

    Raises:
        DaemonUnavailable: no daemon at the socket (the message says how to start one).
        UsageError: rank or size missing or out of range, or the rank is taken.
    """
    job = job if job is not None else os.environ.get("FABRICD_JOB")
    path = socket_path or os.environ.get("FABRICD_SOCKET") or default_socket_path()
    rank = _env_int(rank, "RANK", "rank")
    size = _env_int(size, "WORLD_SIZE", "job size")
    if job is not None:
        if rank is None or size is None:
            raise UsageError(f"joining job {job!r} needs rank and size (or $RANK and $WORLD_SIZE)")
        if not 0 <= rank < size:
            raise UsageError(f"rank {rank} is outside a job of size {size}")
    try:
        return Client(path, job, rank, size, timeout)
    except Timeout:
        raise DaemonUnavailable(f"the daemon on {path} did not answer within {timeout}s") from None
