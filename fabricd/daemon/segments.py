"""What clients map into the daemon: every attached segment, counted and capped.

A segment costs the daemon three things whatever its pages hold:

* **address space**: its whole sealed size is mapped at attach.  A sparse memfd of 2^46 bytes
  costs no RAM, yet it takes 64 TiB of the 128 TiB a process can address on x86-64; a few of
  them and the daemon can map nothing more, nor start a thread (a thread's stack is a mapping);
* **a file descriptor**: Python's mmap keeps a duplicate of the fd for as long as the mapping
  lives (:mod:`fabricd.shm`, "File descriptors"), and a daemon at its fd limit cannot accept a
  client;
* **a memory map**: one of ``vm.max_map_count`` (65530 by default), which the daemon's threads,
  libraries and heap share.

So the daemon counts the *declared* size of each segment before it maps it, and refuses an
attach that would take a client past ``max_segments_per_client`` or
``max_mapped_bytes_per_client``, or the daemon past ``max_segments`` or ``max_mapped_bytes``,
however sparse the segment is.  A refusal fails that attach with code ``limit`` naming the limit
and its setting, and is counted; nothing was mapped, and the client may detach arrays it no
longer needs and try again.

The daemon-wide caps in force may be lower than the settings: at start the daemon measures
what the process may really hold (:func:`segment_budget`) — file descriptors left under
``RLIMIT_NOFILE`` (``LimitNOFILE=`` in the unit) once every client and peer link has one, maps
left under ``vm.max_map_count``, half of the address space — and logs a warning naming the
setting when that is less than configured.  So a segment can never take the fd a client
connection needs, whatever the operator set.

A segment counts for as long as it is really mapped.  ``detach`` (or the client leaving) while
a transfer still holds a view of it cannot unmap it (``mmap`` refuses to close under a view,
and keeps its fd): it stays counted, for its client too, until the last view goes and CPython
unmaps it.  Otherwise a client could attach, post a receive that never matches, detach and
repeat, past every cap.

An attach that the kernel refuses for want of a resource (``mmap`` out of memory or address
space, no fd left for the duplicate, a ``MemoryError``) fails that attach with code
``resources``, and is counted; the daemon goes on.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import resource
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.daemon.logs import RateLimitedLog
from fabricd.engines.budget import size_text as _size
from fabricd.errors import ErrorCode, OperationFailed, UsageError
from fabricd.shm import Segment

if TYPE_CHECKING:
    import mmap

    from fabricd.daemon.config import Config
    from fabricd.daemon.sessions import ClientSession

log = logging.getLogger("fabricd.daemon")
#: attaches the kernel had no room for: a client that keeps trying must not flood the journal
short_log = RateLimitedLog(log)

#: fds kept for what is not a segment or a client: the loop, logs, sd_notify, the listeners,
#: libraries (an idle daemon holds 17; tests/integration/test_local_limits.py checks < this)
FD_RESERVE: Final = 128
#: maps kept for threads (a stack and its guard each), malloc arenas and late-loaded libraries
MAP_RESERVE: Final = 4096
#: the errnos with which the kernel says it has no room for a mapping or its fd
_NO_ROOM: Final = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN})


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentLimits:
    """The caps in force, and why each daemon-wide one is what it is.

    Attributes:
        per_client: most segments one client holds (``max_segments_per_client``).
        bytes_per_client: most bytes one client maps (``max_mapped_bytes_per_client``).
        total: most segments the daemon holds: ``max_segments`` or the process's budget.
        total_bytes: most bytes the daemon maps: ``max_mapped_bytes`` or half its address space.
        total_why: what bounds ``total``, for refusals and the start-up warning.
        total_bytes_why: what bounds ``total_bytes``.
    """

    per_client: int
    bytes_per_client: int
    total: int
    total_bytes: int
    total_why: str = "max_segments"
    total_bytes_why: str = "max_mapped_bytes"

    @classmethod
    def from_config(cls, cfg: Config) -> SegmentLimits:
        """The configured caps, lowered to what this process can hold (raising its soft fd
        limit toward the hard one first, where the sandbox allows)."""
        wanted = cfg.max_segments + _fds_besides_segments(cfg)
        _raise_fd_limit(wanted)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        fds = soft - _fds_besides_segments(cfg) if soft != resource.RLIM_INFINITY else wanted
        total, total_why = segment_budget(
            cfg.max_segments, fds=fds, maps=_maps_left(), fd_limit=soft
        )
        total_bytes, bytes_why = cfg.max_mapped_bytes, "max_mapped_bytes"
        half = _address_space() // 2
        if half < total_bytes:
            total_bytes = half
            bytes_why = (
                f"max_mapped_bytes, lowered to {_size(half)}: half of this host's "
                f"{_size(2 * half)} address space"
            )
        for why in (total_why, bytes_why):
            if why not in ("max_segments", "max_mapped_bytes"):
                log.warning("%s", why)
        return cls(
            per_client=cfg.max_segments_per_client,
            bytes_per_client=cfg.max_mapped_bytes_per_client,
            total=total,
            total_bytes=total_bytes,
            total_why=total_why,
            total_bytes_why=bytes_why,
        )


def segment_budget(configured: int, *, fds: int, maps: int, fd_limit: int) -> tuple[int, str]:
    """How many segments the daemon may hold, and what bounds it.

    Args:
        configured: ``max_segments``.
        fds: file descriptors left for segments once clients, peers and the rest have theirs.
        maps: entries of ``vm.max_map_count`` left for segments.
        fd_limit: the soft ``RLIMIT_NOFILE`` (for the message).

    Returns:
        ``(cap, why)``: ``why`` is ``"max_segments"`` when the setting is what binds, else a
        sentence naming the setting, the system limit and how to raise it.
    """
    cap = max(1, min(configured, fds, maps))
    if cap == configured:
        return cap, "max_segments"
    if fds <= maps:
        why = (
            f"max_segments, lowered to {cap}: the fd limit is {fd_limit} (LimitNOFILE= in "
            "fabricd.service, or ulimit -n) and every client, peer link and segment takes one; "
            "raise LimitNOFILE or lower max_clients"
        )
    else:
        why = (
            f"max_segments, lowered to {cap}: only {maps} memory maps are left under "
            "vm.max_map_count; raise vm.max_map_count (sysctl)"
        )
    return cap, why


class SegmentTable:
    """Every segment the daemon maps for its clients, with the caps (module docstring).

    Each session keeps its own segments (``session.segments``, ``session.mapped``); the table
    keeps the daemon's totals and the counters.
    """

    def __init__(self, limits: SegmentLimits) -> None:
        self.limits = limits
        self.segments = 0  #: held by every client together
        self.mapped = 0  #: bytes mapped for every client together
        #: detached segments a transfer still maps, by a weak reference to their mapping
        self._unmapping: dict[weakref.ref[mmap.mmap], tuple[ClientSession, int]] = {}
        #: of those, the ones CPython has unmapped since: the weakref callback may run in a
        #: copy's worker thread, so it only appends here, and the loop settles them
        self._unmapped: collections.deque[weakref.ref[mmap.mmap]] = collections.deque()
        self._counters = {
            "attach_refused_client_segments": 0,
            "attach_refused_client_bytes": 0,
            "attach_refused_segments": 0,
            "attach_refused_bytes": 0,
            "attach_failed_resources": 0,
        }

    def attach(self, session: ClientSession, seg: int, size: int, fd: int) -> None:
        """Map the client's segment ``seg`` of ``size`` declared bytes from ``fd``.

        Takes ownership of ``fd`` (closed in every case).

        Raises:
            UsageError: ``seg`` is already attached, or the fd is no valid segment.
            OperationFailed: code ``limit`` (a cap, named with its setting) or ``resources``
                (the kernel had no room); nothing was mapped.
        """
        try:
            if seg in session.segments:
                raise UsageError(f"segment {seg} is already attached")
            self._reap()
            self._admit(session, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        try:
            segment = Segment.adopt(fd, size)  # owns fd from here, closes it in every case
        except MemoryError:
            raise self._no_room("out of memory") from None
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            raise self._no_room(os.strerror(exc.errno or 0)) from None
        session.segments[seg] = segment
        session.mapped += segment.size
        self.segments += 1
        self.mapped += segment.size

    def detach(self, session: ClientSession, seg: int) -> None:
        """Unmap segment ``seg`` of ``session``, if attached."""
        segment = session.segments.pop(seg, None)
        if segment is not None:
            self._unmap(session, segment)

    def release(self, session: ClientSession) -> None:
        """Unmap every segment of a client that left."""
        for segment in session.segments.values():
            self._unmap(session, segment)
        session.segments.clear()

    def gauges(self) -> dict[str, int]:
        """What the daemon maps now, for status: ``segments`` and ``mapped_bytes``."""
        self._reap()
        return {"segments": self.segments, "mapped_bytes": self.mapped}

    def counters(self) -> dict[str, int]:
        """Attaches refused at each cap, and failed for want of a resource, since start."""
        return dict(self._counters)

    def _unmap(self, session: ClientSession, segment: Segment) -> None:
        segment.close()
        if segment.buffer.closed:
            self._uncount(session, segment.size)
            return
        # a transfer holds a view: the mapping and its fd live until the view goes
        ref = weakref.ref(segment.buffer, self._unmapped.append)
        self._unmapping[ref] = (session, segment.size)
        session.unmapping += 1

    def _reap(self) -> None:
        """Stop counting the detached segments that CPython has unmapped since."""
        while self._unmapped:
            session, size = self._unmapping.pop(self._unmapped.popleft())
            session.unmapping -= 1
            self._uncount(session, size)

    def _uncount(self, session: ClientSession, size: int) -> None:
        session.mapped -= size
        self.segments -= 1
        self.mapped -= size

    def _admit(self, session: ClientSession, size: int) -> None:
        limits = self.limits
        held = len(session.segments) + session.unmapping
        if held >= limits.per_client:
            self._refuse(
                "attach_refused_client_segments",
                f"this client holds {held} segments, the most "
                "max_segments_per_client allows; free arrays it no longer needs (or raise "
                "max_segments_per_client in the daemon's config)",
            )
        if session.mapped + size > limits.bytes_per_client:
            self._refuse(
                "attach_refused_client_bytes",
                f"a {_size(size)} segment would take this client's mapped bytes to "
                f"{_size(session.mapped + size)}, over the {_size(limits.bytes_per_client)} "
                "max_mapped_bytes_per_client allows; free arrays it no longer needs (or raise "
                "max_mapped_bytes_per_client in the daemon's config)",
            )
        if self.segments >= limits.total:
            self._refuse(
                "attach_refused_segments",
                f"the daemon holds {self.segments} segments for its clients, the most it may "
                f"({limits.total_why}); retry once other clients freed arrays",
            )
        if self.mapped + size > limits.total_bytes:
            self._refuse(
                "attach_refused_bytes",
                f"a {_size(size)} segment would take the daemon's mapped bytes to "
                f"{_size(self.mapped + size)}, over the {_size(limits.total_bytes)} it may map "
                f"({limits.total_bytes_why}); retry once other clients freed arrays",
            )

    def _refuse(self, counter: str, message: str) -> None:
        self._counters[counter] += 1
        raise OperationFailed(message, code=ErrorCode.LIMIT)

    def _no_room(self, reason: str) -> OperationFailed:
        self._counters["attach_failed_resources"] += 1
        short_log.log(logging.WARNING, "no_room", "attach: could not map a segment: %s", reason)
        return OperationFailed(
            f"the daemon could not map the segment: {reason}; retry later, with fewer or "
            "smaller arrays (the daemon's log and status counters say more)",
            code=ErrorCode.RESOURCES,
        )


def _fds_besides_segments(cfg: Config) -> int:
    """fds the daemon must keep for what is not a segment: every client, per node two links
    and two dials plus its host's handshake slots (:mod:`fabricd.engines.link.gate`), the rest."""
    per_node = 4 + 1 + cfg.handshake_spare_slots
    return cfg.max_clients + per_node * len(cfg.nodes) + FD_RESERVE


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft fd limit toward ``wanted`` (never past the hard one); quietly not where
    the sandbox forbids it (systemd's unit sets the limit itself, LimitNOFILE=)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.info("RLIMIT_NOFILE stays %d: raising it to %d failed (%s)", soft, target, exc)
        else:
            log.info("raised RLIMIT_NOFILE from %d to %d", soft, target)


def _maps_left() -> int:
    """Entries of ``vm.max_map_count`` not yet used by this process, less a reserve."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as fh:
            limit = int(fh.read())
        with open("/proc/self/maps", "rb") as fh:
            used = sum(1 for _ in fh)
    except (OSError, ValueError):
        return 1 << 31  # not Linux's /proc: nothing to measure, the setting decides
    return limit - used - MAP_RESERVE


def _address_space() -> int:
    """The size of this process's address space: the power of two above its stack.

    The stack sits at the top of it: 128 TiB on x86-64 (47 bits), 256 TiB on most AArch64
    kernels, 512 GiB on those built with 39-bit addresses.
    """
    top = 0
    with contextlib.suppress(OSError, ValueError), open("/proc/self/maps", "rb") as fh:
        for line in fh:
            if line.rstrip().endswith(b"[stack]"):
                top = int(line.split(b"-", 1)[1].split(b" ", 1)[0], 16)
    return 1 << top.bit_length() if top else 1 << 47
