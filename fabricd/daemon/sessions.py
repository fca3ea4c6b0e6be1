"""What the daemon holds for each connected client, and how it checks a client's requests.

A session owns the client's mapped segments and its place in a job; every service keeps what
the client has under way with it keyed by the session, so that when the client leaves —
cleanly or killed — everything it held is released and no other client notices.  Every field
of a request is checked here before anything acts on it: an unknown segment, an offset outside
it, a dtype fabricd does not move or a byte count that is not a whole number of elements is
refused with a message that says what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NoReturn

from fabricd.dtypes import ITEMSIZE
from fabricd.engines.p2p.messages import Message
from fabricd.errors import UsageError
from fabricd.ipc import MAX_JOB_NAME
from fabricd.wire import MAX_TAG, Meta, get_int, get_str

#: the largest integer a request's field may carry (as :func:`fabricd.wire.get_int` allows)
_MAX_INT: Final = 2**63 - 1

if TYPE_CHECKING:
    from fabricd.daemon.ipc_server import IpcConnection
    from fabricd.engines.p2p.messages import Messages
    from fabricd.shm import Segment


@dataclass(slots=True, eq=False)
class ClientSession:
    """One client connection's state in the daemon."""

    conn: IpcConnection
    job: str | None = None
    rank: int = -1
    size: int = 0
    segments: dict[int, Segment] = field(default_factory=dict)
    mapped: int = 0  #: bytes this client has mapped in the daemon (their sealed sizes)
    #: segments detached while a transfer still maps them (counted in ``mapped`` until unmapped)
    unmapping: int = 0

    def describe(self) -> dict[str, object]:
        creds = self.conn.credentials
        return {
            "id": self.conn.id,
            "pid": creds.pid,
            "uid": creds.uid,
            "job": self.job,
            "rank": self.rank if self.job else None,
            "segments": len(self.segments),
            "mapped_bytes": self.mapped,
        }

    def segment(self, seg: int) -> Segment:
        try:
            return self.segments[seg]
        except KeyError:
            raise UsageError(f"segment {seg} is not attached to this client") from None


def request_id(meta: Meta) -> int:
    return get_int(meta, "id")


def parse_transfer(
    session: ClientSession, meta: Meta, *, is_send: bool, messages: Messages | None = None
) -> tuple[Message, memoryview]:
    """Check a ``send``/``recv`` request against the session: its message (one of
    ``messages``, the engine's shared ones, if given) and its region.

    Every field is tested inline, and the reader that names the fault (``get_int``,
    ``get_str``, :func:`_refuse`) is called only when a test fails: on every request of the
    point-to-point path, the calls and the messages formatted ahead cost about 1 us.

    Raises:
        UsageError: the request names something wrong (message says what).
        ProtocolError: a field is missing or of the wrong type.
    """
    job = session.job
    if job is None:
        raise UsageError("connect with a job (fabricd.connect(job=...)) before sending")
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        dtype = get_str(meta, "dtype")
        raise UsageError(f"dtype {dtype!r} is not supported; use one of {', '.join(ITEMSIZE)}")
    nbytes, offset = meta.get("nbytes"), meta.get("off")
    if type(nbytes) is not int or not 0 <= nbytes <= _MAX_INT:
        nbytes = get_int(meta, "nbytes")
    if type(offset) is not int or not 0 <= offset <= _MAX_INT:
        offset = get_int(meta, "off")
    if nbytes % ITEMSIZE[dtype]:
        raise UsageError(f"{nbytes} B is not a whole number of {dtype} elements")
    peer, tag = meta.get("peer"), meta.get("tag")
    if type(peer) is not int or not 0 <= peer < session.size:
        _refuse(meta, "peer", f"outside job {job!r} of size {session.size}")
    if type(tag) is not int or not 0 <= tag <= MAX_TAG:
        _refuse(meta, "tag", f"outside 0..{MAX_TAG}")
    seg = meta.get("seg")
    if type(seg) is not int or not 0 <= seg <= _MAX_INT:
        seg = get_int(meta, "seg")
    region = session.segment(seg).view(offset, nbytes)
    src, dst = (session.rank, peer) if is_send else (peer, session.rank)
    if messages is None:
        message = Message(job=job, src=src, dst=dst, tag=tag, nbytes=nbytes, dtype=dtype)
        return message, region
    return messages.get(job, src, dst, tag, nbytes, dtype), region


def _refuse(meta: Meta, key: str, what: str) -> NoReturn:
    """An integer field is out of range (``what`` says of which), or no integer: the caller's
    mistake, not a protocol violation.

    Raises:
        UsageError: always, naming the field and its value.
    """
    value = meta.get(key)
    if type(value) is not int:
        raise UsageError(f"{key} must be an integer, not {type(value).__name__}")
    raise UsageError(f"{key} {value} is {what}")


def parse_hello(meta: Meta) -> tuple[str, int, int] | None:
    """The (job, rank, size) a ``hello`` claims, or ``None`` for a control client."""
    if meta.get("job") is None:
        return None
    job = meta.get("job")
    if not isinstance(job, str) or not 0 < len(job) <= MAX_JOB_NAME:
        raise UsageError(f"job must be a name of 1 to {MAX_JOB_NAME} characters")
    return job, get_int(meta, "rank", hi=2**31), get_int(meta, "size", lo=1, hi=2**31)
