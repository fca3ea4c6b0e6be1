"""Peers' COLL frames held for collectives not built here yet (their job's ranks not all known).

Rules: bookkeeping only -- what is held, for which (job, name), until when; the collective
service decides what a frame means once its collective is built.

Theory of operation: frames are kept per (job, name) in arrival order, with counts of frames
and bytes kept as they change; a frame whose payload is still landing is found by its identity
(the node hands the service the same frame object for its buffer and its arrival), and each
(job, name)'s earliest deadline waits in a :class:`~fabricd.engines.deadlines.Deadlines` heap.
So holding a frame, landing one, and a timer tick cost O(log n) or less, and a job's news
touches only its own names -- the review found a sum over every held frame on every hold, a
list scan on every landing, and a ``min()`` over every held frame after every read batch.
Deadlines are the frames' arrival plus ``route_timeout``, so a name's frames expire in
arrival order; a frame whose payload is still landing when it expires stays until it is in
(its bytes are being written into it), then goes at the next tick.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from fabricd.frames import collectives as collectives_frames

Key = tuple[str, str]  #: (job, collective name)


@dataclass(slots=True, kw_only=True)
class Held:
    """A peer's frame for a collective not built here yet."""

    node: int
    frame: collectives_frames.Coll
    payload: bytearray
    complete: bool  #: its payload is all in (a frame still landing is not replayed yet)
    expires: float  #: dropped then if its collective still cannot be built (route_timeout)


class HeldFrames:
    """Held COLL frames by (job, name), oldest first, with their counts and deadlines."""

    def __init__(self) -> None:
        self._frames: dict[Key, deque[Held]] = {}
        self._names: dict[str, set[str]] = {}  #: names with frames held, per job
        self._landing: dict[int, tuple[Key, Held]] = {}  #: by id(frame): payload arriving
        self._due: Deadlines[Key] = Deadlines()  #: each name's oldest whole frame's expiry
        self.bytes = 0  #: payload bytes held
        self.count = 0  #: frames held

    def __contains__(self, key: object) -> bool:
        return key in self._frames

    def __bool__(self) -> bool:
        return bool(self._frames)

    def first(self, key: Key) -> Held | None:
        """``key``'s oldest frame, if any."""
        frames = self._frames.get(key)
        return frames[0] if frames else None

    def keys_of(self, job: str) -> list[Key]:
        return [(job, name) for name in self._names.get(job, ())]

    def hold(
        self, node: int, frame: collectives_frames.Coll, length: int, expires: float, *, whole: bool
    ) -> Held:
        """Keep ``frame`` from ``node``, with room for ``length`` payload bytes, ``whole`` or
        still landing (the caller checked the bounds: :attr:`count`, :attr:`bytes`)."""
        key = (frame.job, frame.name)
        held = Held(
            node=node, frame=frame, payload=bytearray(length), complete=whole, expires=expires
        )
        frames = self._frames.get(key)
        if frames is None:
            frames = self._frames[key] = deque()
            self._names.setdefault(frame.job, set()).add(frame.name)
        frames.append(held)
        if not whole:
            self._landing[id(frame)] = (key, held)
        self.bytes += length
        self.count += 1
        self._arm(key)
        return held

    def landed(self, frame: collectives_frames.Coll) -> Held | None:
        """``frame``'s payload is all in its hold: returns that frame, whole now (``None``:
        ``frame`` is not held)."""
        found = self._landing.pop(id(frame), None)
        if found is None or found[1].frame is not frame:
            return None
        key, held = found
        held.complete = True
        self._arm(key)
        return held

    def ready(self, key: Key) -> list[Held]:
        """Remove and return ``key``'s frames up to the first still landing, oldest first (a
        frame must be placed after those that came before it)."""
        frames = self._frames.get(key)
        taken: list[Held] = []
        while frames and frames[0].complete:
            held = frames.popleft()
            self.bytes -= len(held.payload)
            self.count -= 1
            taken.append(held)
        self._settle(key)
        return taken

    def drop(self, key: Key) -> int:
        """Forget ``key``'s frames; returns how many there were."""
        frames = self._frames.get(key, deque())
        count = len(frames)
        for held in frames:
            self._forget(held)
        frames.clear()
        self._settle(key)
        return count

    def drop_from(self, key: Key, node: int) -> int:
        """Forget ``key``'s frames from ``node`` (a node that hosts no rank of the job);
        returns how many there were."""
        frames = self._frames.get(key)
        if not frames:
            return 0
        kept = deque(h for h in frames if h.node != node)
        for held in frames:
            if held.node == node:
                self._forget(held)
        dropped = len(frames) - len(kept)
        self._frames[key] = kept
        self._settle(key)
        return dropped

    def drop_node(self, node: int) -> list[Key]:
        """Forget the frames ``node`` sent (its links were reset); returns the names that still
        hold frames of other nodes.  A rare event: it looks at every held frame (at most
        ``MAX_HELD_FRAMES``)."""
        left = []
        for key, frames in list(self._frames.items()):
            kept = deque(h for h in frames if h.node != node)
            for held in frames:
                if held.node == node:
                    self._forget(held)
            self._frames[key] = kept
            self._settle(key)
            if kept:
                left.append(key)
        return left

    def next_deadline(self) -> float | None:
        return self._due.next()

    def expire(self, now: float) -> list[tuple[Key, int]]:
        """Drop the whole frames held ``route_timeout`` (their job never completed here:
        nothing can use them); returns how many went, per name."""
        gone = []
        for key in self._due.pop_due(now):
            frames = self._frames.get(key)
            landing: list[Held] = []
            dropped = 0
            while frames and frames[0].expires <= now:
                held = frames.popleft()
                if held.complete:
                    self._forget(held)
                    dropped += 1
                else:  # its bytes are being written into it: it goes once they are in
                    landing.append(held)
            if frames is not None:
                frames.extendleft(reversed(landing))
            self._settle(key)
            if dropped:
                gone.append((key, dropped))
        return gone

    def _forget(self, held: Held) -> None:
        self.bytes -= len(held.payload)
        self.count -= 1
        if not held.complete:
            self._landing.pop(id(held.frame), None)

    def _settle(self, key: Key) -> None:
        """``key``'s frames changed: forget it if none is left, else arm its deadline."""
        frames = self._frames.get(key)
        if frames:
            self._arm(key)
            return
        self._frames.pop(key, None)
        self._due.cancel(key)
        job, name = key
        names = self._names.get(job)
        if names is not None:
            names.discard(name)
            if not names:
                del self._names[job]

    def _arm(self, key: Key) -> None:
        """``key``'s deadline: its oldest whole frame's (a frame still landing has none: its
        arrival arms it); only frames still landing may come before it, at most one per
        peer."""
        for held in self._frames[key]:
            if held.complete:
                if self._due.get(key) != held.expires:
                    self._due.set(key, held.expires)
                return
        self._due.cancel(key)
