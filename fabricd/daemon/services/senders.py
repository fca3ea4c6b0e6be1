"""Who may send a job's frames: a peer's stochastic-reduce or parameter-server frame counts
only from the node its sender rank lives on, and one whose rank is not known here yet waits
for that rank's announcement (issue 28, item 2).

Rules: :func:`sender` judges one frame from what membership knows (changing nothing);
:class:`Unannounced` keeps the frames that must wait, bounded, until their rank is known or
``route_timeout`` passes; :class:`Gate` does both for a service, counts and logs what it
refuses, and hands a frame that waited back to the service (``replay``) once its rank is
announced.  The services decide what a frame means once it is a member's.

Theory of operation.  Every such frame names the rank it is from (a reduce's ``src``, a
worker, server or replica), and membership knows where every rank of a job lives once it is
announced.  So:

* the rank is known: the frame counts only from its node (:data:`Sender.MEMBER`); from any
  other it is refused (:data:`Sender.STRANGER`) -- also a rank past the job's size;
* the rank was lost with its node's links (suspected): from that node it counts (after a
  reset a frame sent again on the data link may overtake the rank's announcement on the
  control link);
* the rank is not known, but the job is (another of its ranks is): the announcement may be
  on its way (:data:`Sender.NOT_YET`).  Announcements travel on the control link and updates
  and pushes on the data link, two streams, so a real member's first frame can come first.
  Refusing it would lose an update its NOTIFY then waits for; taking it would let any node
  build or break a job's reduce, or forge a worker's push, while a rank is missing.  It waits
  instead, in :class:`Unannounced`, and is judged again when its rank is announced;
* no rank of the job is known here (:data:`Sender.NO_JOB`): nothing here is for the frame
  (a job that ended here, or none): the service drops it as it drops any frame for a rank
  not here.

Bounds: :class:`Unannounced` holds at most :data:`MAX_FRAMES` frames and two
``max_payload`` of payload, and a single node at most half of either, so a node that sends
frames of a job it has no rank in cannot crowd out a member's; past that the sender's link
is closed (``RemoteProtocolError``): it sends again after the reset, as it does what any
reset may have lost.  A frame waits ``route_timeout`` at most, and frames from a node whose
links were reset go with them (what its engine sends again replaces them).  Holding,
landing, releasing a rank's frames and a timer tick cost O(log n) or O(frames released); a
peer's reset, rare, looks at every frame held (at most :data:`MAX_FRAMES`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from fabricd.engines.deadlines import Deadlines
from fabricd.errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.logs import RateLimitedLog
    from fabricd.daemon.service import Host
    from fabricd.engines.membership import RankEntry
    from fabricd.frames import registry

#: frames held for ranks not announced yet, at most (the whole node)
MAX_FRAMES: Final = 1024
#: ... holding at most this many max_payloads of payload bytes in all
MAX_PAYLOADS: Final = 2

RankKey = tuple[str, int]  #: (job, the rank a frame is from)


class Sender(enum.Enum):
    """What membership says of a frame's sender (:func:`sender`)."""

    MEMBER = "member"  #: its rank lives on the node that sent it
    STRANGER = "stranger"  #: its rank lives on another node, or the job has no such rank
    NOT_YET = "not yet"  #: its rank is not known here yet, its job is: wait for it
    NO_JOB = "no job"  #: no rank of its job is known here


class Ranks(Protocol):
    """What :func:`sender` reads of membership."""

    def lookup(self, job: str, rank: int, /) -> RankEntry | None: ...

    def job_size(self, job: str, /) -> int | None: ...

    def suspected_on(self, job: str, rank: int, /) -> int | None: ...


def sender(ranks: Ranks, node: int, job: str, rank: int) -> Sender:
    """Whether ``node`` may send frames as rank ``rank`` of ``job`` (module docstring)."""
    entry = ranks.lookup(job, rank)
    if entry is not None:
        return Sender.MEMBER if entry.node == node else Sender.STRANGER
    size = ranks.job_size(job)
    if size is None:
        return Sender.NO_JOB
    if rank >= size:
        return Sender.STRANGER
    if ranks.suspected_on(job, rank) == node:
        return Sender.MEMBER
    return Sender.NOT_YET  # (suspected on another node: it may have moved, and say so yet)


@dataclass(slots=True, kw_only=True)
class Waiting:
    """A peer's frame whose sender rank is not known here yet."""

    node: int
    rank: RankKey
    frame: registry.PeerFrame
    payload: bytearray | None  #: ``None``: a frame without one
    complete: bool  #: its payload is all in
    expires: float  #: dropped then if its rank is still not known (route_timeout)


class Unannounced:
    """Frames waiting for their sender rank's announcement, by rank, oldest first."""

    def __init__(self, max_payload: int, max_frames: int = MAX_FRAMES) -> None:
        self.max_bytes = MAX_PAYLOADS * max_payload
        self.max_frames = max_frames
        self._frames: dict[RankKey, deque[Waiting]] = {}
        self._landing: dict[int, Waiting] = {}  #: by id(frame): its payload is arriving
        self._due: Deadlines[RankKey] = Deadlines()  #: each rank's oldest frame's expiry
        self._of_node: dict[int, tuple[int, int]] = {}  #: node -> (frames, bytes) it holds
        self.count = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.count

    def hold(
        self, node: int, rank: RankKey, frame: registry.PeerFrame, length: int, expires: float
    ) -> memoryview | None:
        """Keep ``frame`` from ``node`` until ``rank`` is known; returns the buffer its
        payload of ``length`` bytes lands in (``None``: it has none).

        Raises:
            RemoteProtocolError: the hold, or ``node``'s half of it, is full.
        """
        frames, nbytes = self._of_node.get(node, (0, 0))
        if (
            self.count >= self.max_frames
            or self.bytes + length > self.max_bytes
            or 2 * (frames + 1) > self.max_frames
            or 2 * (nbytes + length) > self.max_bytes
        ):
            raise RemoteProtocolError(
                f"node {node} sent more frames of ranks not announced yet ({frames} held, "
                f"{nbytes} B) than this node holds for it"
            )
        payload = bytearray(length) if length else None
        waiting = Waiting(
            node=node,
            rank=rank,
            frame=frame,
            payload=payload,
            complete=payload is None,
            expires=expires,
        )
        self._frames.setdefault(rank, deque()).append(waiting)
        if payload is not None:
            self._landing[id(frame)] = waiting
        self._arm(rank)
        self._of_node[node] = (frames + 1, nbytes + length)
        self.count += 1
        self.bytes += length
        return None if payload is None else memoryview(payload)

    def landed(self, frame: registry.PeerFrame) -> Waiting | None:
        """``frame``'s payload is in; the frame if it is held here (it stays held: the caller
        takes its rank's frames if that rank is known now)."""
        waiting = self._landing.pop(id(frame), None)
        if waiting is not None:
            waiting.complete = True
            self._arm(waiting.rank)
        return waiting

    def take(self, rank: RankKey) -> list[Waiting]:
        """Remove and return ``rank``'s frames oldest first, up to the first whose payload is
        still landing (it and those after it are taken once it is in: frames are handed over
        in the order they came)."""
        ready: list[Waiting] = []
        queue = self._frames.get(rank)
        while queue and queue[0].complete:
            ready.append(queue[0])
            self.remove(queue[0])
        return ready

    def remove(self, waiting: Waiting) -> None:
        """Forget ``waiting`` (held here)."""
        queue = self._frames[waiting.rank]
        queue.remove(waiting)
        self._landing.pop(id(waiting.frame), None)
        if queue:
            self._arm(waiting.rank)
        else:
            del self._frames[waiting.rank]
            self._due.cancel(waiting.rank)
        frames, nbytes = self._of_node[waiting.node]
        length = 0 if waiting.payload is None else len(waiting.payload)
        if frames > 1:
            self._of_node[waiting.node] = (frames - 1, nbytes - length)
        else:
            del self._of_node[waiting.node]
        self.count -= 1
        self.bytes -= length

    def drop_node(self, node: int) -> int:
        """``node``'s links were reset: its frames go (it sends again what the reset may have
        lost); returns how many went."""
        if node not in self._of_node:
            return 0
        gone = [w for queue in self._frames.values() for w in queue if w.node == node]
        for waiting in gone:
            self.remove(waiting)
        return len(gone)

    def next_deadline(self) -> float | None:
        return self._due.next()

    def expire(self, now: float) -> list[Waiting]:
        """Remove and return the frames held past their deadline, oldest first (one still
        landing stays until it is in: its arrival arms its deadline again)."""
        expired: list[Waiting] = []
        for rank in self._due.pop_due(now):
            due = [w for w in self._frames[rank] if w.complete and w.expires <= now]
            for waiting in due:
                self.remove(waiting)
            if rank in self._frames:
                self._arm(rank)
            expired += due
        return expired

    def _arm(self, rank: RankKey) -> None:
        """``rank``'s deadline: its oldest whole frame's (one still landing has none yet)."""
        for waiting in self._frames[rank]:
            if waiting.complete:
                if self._due.get(rank) != waiting.expires:
                    self._due.set(rank, waiting.expires)
                return
        self._due.cancel(rank)


class Gate:
    """One service's judge of its peers' frames by their sender rank (module docstring).

    ``counters``: the service's; a refused frame counts in ``frames_refused_not_member``
    and in ``dropped`` (the service's count of every frame it drops).  ``replay``: hands a
    frame that waited back to the service, judged again, as if it came now (with its
    payload, if it has one); a :class:`RemoteProtocolError` from it is counted and logged
    (the link that brought the frame may be gone by then).
    """

    def __init__(
        self,
        host: Host,
        ranks: Ranks,
        log: RateLimitedLog,
        counters: dict[str, int],
        dropped: str,
        replay: Callable[[Waiting, float], None],
    ) -> None:
        self.host, self.ranks, self.log = host, ranks, log
        self.counters, self.dropped, self.replay = counters, dropped, replay
        counters["frames_refused_not_member"] = 0
        self.held = Unannounced(host.config.max_payload)

    def judge(self, node: int, job: str, rank: int) -> Sender:
        """Membership's verdict on a frame from ``node`` as rank ``rank`` of ``job``; a
        stranger's is counted and logged (the service drops it)."""
        verdict = sender(self.ranks, node, job, rank)
        if verdict is Sender.STRANGER:
            self.refused(node, rank, f"job {job!r} has it elsewhere or not at all")
        return verdict

    def refused(self, node: int, rank: int, why: str) -> None:
        """Count and log a frame refused for its sender."""
        self.counters[self.dropped] += 1
        self.counters["frames_refused_not_member"] += 1
        self.log.warning("stray", "node %d sent a frame as rank %d, not on it: %s", node, rank, why)

    def hold(
        self, node: int, job: str, rank: int, frame: registry.PeerFrame, length: int
    ) -> memoryview | None:
        """Keep a frame judged :data:`Sender.NOT_YET` (see :meth:`Unannounced.hold`)."""
        expires = self.host.now() + self.host.config.route_timeout
        return self.held.hold(node, (job, rank), frame, length, expires)

    def landed(self, node: int, frame: registry.PeerFrame, now: float) -> bool:
        """``frame``'s payload is in: whether it is one held here (then, if its rank was
        announced while it landed, it and the frames after it are handed over)."""
        held = self.held.landed(frame)
        if held is None:
            return False
        if sender(self.ranks, node, *held.rank) is not Sender.NOT_YET:
            self.release(*held.rank, now)
        return True

    def release(self, job: str, rank: int, now: float) -> None:
        """Rank ``rank`` of ``job`` was announced: the frames that waited for it are handed
        back in the order they came, and judged again."""
        for held in self.held.take((job, rank)):
            try:
                self.replay(held, now)
            except RemoteProtocolError as exc:
                self.counters[self.dropped] += 1
                self.log.warning("held", "a frame held from node %d: %s", held.node, exc)

    def drop_node(self, node: int) -> None:
        """``node``'s links were reset: what it sends again replaces its frames held here."""
        self.held.drop_node(node)

    def next_deadline(self) -> float | None:
        return self.held.next_deadline()

    def expire(self, now: float) -> None:
        """Frames whose rank was not announced within ``route_timeout``: refused."""
        for held in self.held.expire(now):
            job, rank = held.rank
            self.refused(held.node, rank, f"job {job!r} never announced it here")


def earliest(*deadlines: float | None) -> float | None:
    """The earliest of ``deadlines`` that is not ``None``."""
    due = [d for d in deadlines if d is not None]
    return min(due) if due else None
