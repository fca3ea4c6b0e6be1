"""A worker daemon's part in distribution trees (MLfabric §10.3): it forwards the server's
answer as a distributor, and waits, as a puller, for an answer a distributor forwards.

Rules (the shard's side is :mod:`fabricd.engines.ps.distributing`):

* a PULLED with ``forward`` comes from the server serving the shard (checked as any answer
  is): this daemon sends the same payload on, as a PULLED with ``via`` (its worker's rank), to
  each ``(rank, clock)`` listed, whether or not its own worker still waits for it (the
  distributor's client may have left; its pullers have not);
* a PULLED with ``via`` alone is taken only from the node worker rank ``via`` of the model
  lives on, and then as the server's answer: the puller's daemon checks its server and epoch,
  and its cache's version against the answer's (:meth:`~fabricd.engines.ps.worker.Worker.pulled`);
* a PULLED with ``via`` and ``expect_us`` (the server's notice) starts a wait: if the answer
  has not come when it ends, or ``via``'s daemon is gone or its links reset, the pull is sent
  again to the server, marked *direct*, and answered from there at once.  A forwarded answer
  that arrives after the direct one (or before its notice) finds no pull of its clock in
  flight, or one already at its version, and changes nothing: each pull is answered once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key
    from fabricd.engines.ps.node import PSNode
    from fabricd.frames import ps as ps_frames

#: a wait for a forwarded answer: (model, local worker rank, shard, the pull's clock)
Expected = tuple["Key", int, int, int]


class Relays:
    """The local workers' pulls told to expect their answer from another worker's daemon."""

    def __init__(self) -> None:
        self._due: Deadlines[Expected] = Deadlines()
        self._via: dict[Expected, tuple[int, int | None]] = {}  #: -> (via rank, its node)

    def expect(self, wait: Expected, via: int, node: int | None, at: float) -> None:
        self._due.set(wait, at)
        self._via[wait] = (via, node)

    def arrived(self, wait: Expected) -> None:
        self._due.cancel(wait)
        self._via.pop(wait, None)

    def next(self) -> float | None:
        return self._due.next()

    def due(self, now: float) -> list[Expected]:
        waits = self._due.pop_due(now)
        for wait in waits:
            self._via.pop(wait, None)
        return waits

    def through(
        self, *, job: str | None = None, rank: int | None = None, node: int | None = None
    ) -> list[Expected]:
        """The waits on rank ``rank`` of ``job``, or on any rank on ``node``; ended here."""
        waits = [
            w
            for w, (via, on) in self._via.items()
            if (job is not None and w[0][0] == job and via == rank)
            or (node is not None and on == node)
        ]
        for wait in waits:
            self.arrived(wait)
        return waits

    def __len__(self) -> int:
        return len(self._via)


def forward(node: PSNode, frame: ps_frames.Pulled, payload: bytes) -> None:
    """This daemon is a distributor: the server's answer ``frame`` goes on to each pull it
    lists, with the same payload."""
    for rank, clock in frame.forward:
        relayed = dataclasses.replace(frame, worker=rank, clock=clock, forward=(), via=frame.worker)
        node._send(frame.job, rank, relayed, payload)
    node.counters["ps_pulls_forwarded"] += len(frame.forward)


def at_forwarded(
    node: PSNode, sender: int, frame: ps_frames.Pulled, payload: bytes, now: float
) -> None:
    """A distributor's forwarded answer (module docstring)."""
    assert frame.via is not None
    key = (frame.job, frame.name)
    model = node.models.get(key)
    entry = node.ranks.lookup(frame.job, frame.via)
    if model is None or frame.via not in model.workers or entry is None or entry.node != sender:
        node.counters["ps_frames_dropped"] += 1
        message = f"node {sender} forwarded an answer as rank {frame.via}, not a worker on it"
        node._log(logging.WARNING, message, topic="stray")
        return
    node.relays.arrived((key, frame.worker, frame.shard, frame.clock))
    node._at_worker(frame, payload, now)


def expect(node: PSNode, frame: ps_frames.Pulled, now: float) -> None:
    """The server's notice: ``frame.worker``'s pull comes through rank ``frame.via``."""
    assert frame.via is not None
    assert frame.expect_us is not None
    key = (frame.job, frame.name)
    side = node.models[key].local_workers[frame.worker]
    if not side.engine.awaits_pull(frame.shard, frame.clock):
        return  # the forwarded answer overtook its notice
    entry = node.ranks.lookup(frame.job, frame.via)
    at = now + frame.expect_us / 1e6
    wait = (key, frame.worker, frame.shard, frame.clock)
    node.relays.expect(wait, frame.via, None if entry is None else entry.node, at)


def redirect(node: PSNode, waits: list[Expected]) -> None:
    """Send each of ``waits``' pulls again, straight to the server (module docstring)."""
    for key, rank, shard, clock in waits:
        model = node.models.get(key)
        side = None if model is None else model.local_workers.get(rank)
        if side is None:
            continue
        actions = side.engine.repull(shard, clock)
        node.counters["ps_pulls_redirected"] += len(actions)
        node._worker(key, side, actions)
