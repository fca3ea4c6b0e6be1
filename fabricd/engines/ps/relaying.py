"""A worker daemon's part in distribution trees (MLfabric §10.3): it forwards the server's
answer as a distributor, and waits, as a puller, for an answer a distributor forwards.

Rules (the shard's side is :mod:`fabricd.engines.ps.distributing`):

* a PULLED with ``forward`` comes from the server serving the shard and passes every check an
  answer does (its server, epoch and local worker; a tree model); its list must name distinct
  workers of the model other than the answer's own, no more than the model has.  This daemon
  then sends the same payload on, as a PULLED with ``via`` (its worker's rank), to each
  ``(rank, clock)`` listed.  A list that breaks the rules is not forwarded at all (a server is
  not the only rank a node may claim to be: an unchecked list would be an amplifier);
* a PULLED with ``via`` and ``expect_us`` (the server's notice) starts a wait for the answer
  of that pull, at that version, through rank ``via``;
* a PULLED with ``via`` alone (forwarded) is taken only against such a wait: the same worker,
  shard, clock, ``via`` and version, from the node ``via`` lives on.  One that comes before its
  notice (its notice went another way) is held, at most :data:`EARLY_HOLD` seconds and
  :data:`MAX_EARLY` of them, and taken when the notice comes; any other is dropped and counted.
  So only the rank the server named can answer a pull for it;
* a wait whose answer has not come when it ends, or whose ``via`` is gone (or unknown when its
  notice comes) or whose node's links come back (what was in flight is lost), sends the pull
  again to the server, marked *direct*, and it is answered from there at once.  A forwarded
  answer after that finds no wait and is dropped: each pull is answered once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.deadlines import Deadlines

if TYPE_CHECKING:
    from fabricd.engines.ps.models import Key
    from fabricd.engines.ps.node import PSNode
    from fabricd.frames import ps as ps_frames

#: a wait for a forwarded answer: (model, local worker rank, shard, the pull's clock)
Expected = tuple["Key", int, int, int]
#: seconds a forwarded answer that came before its notice is held
EARLY_HOLD: Final = 5.0
#: the most such answers held at once (older ones are dropped: their pulls are asked again)
MAX_EARLY: Final = 256


@dataclass(frozen=True, slots=True)
class _Wait:
    via: int
    node: int | None  #: the node ``via`` lived on when the notice came
    version: int


@dataclass(frozen=True, slots=True)
class _Early:
    sender: int
    frame: ps_frames.Pulled
    payload: bytes


class Relays:
    """The local workers' pulls told to expect their answer from another worker's daemon,
    and forwarded answers that came before their notices."""

    def __init__(self) -> None:
        self._due: Deadlines[Expected] = Deadlines()
        self._waits: dict[Expected, _Wait] = {}
        self._early_due: Deadlines[Expected] = Deadlines()
        self._early: dict[Expected, _Early] = {}

    def expect(self, wait: Expected, via: _Wait, at: float) -> _Early | None:
        """Wait for ``wait``'s answer through ``via`` until ``at``; a forwarded answer held
        for it comes back (and no wait is kept)."""
        early = self._early.pop(wait, None)
        self._early_due.cancel(wait)
        if early is not None:
            return early
        self._due.set(wait, at)
        self._waits[wait] = via
        return None

    def take(self, wait: Expected, frame: ps_frames.Pulled) -> bool | None:
        """Whether forwarded ``frame`` answers ``wait`` (its wait ends); ``None``: no wait
        (hold it, or drop it)."""
        known = self._waits.get(wait)
        if known is None:
            return None
        if (known.via, known.version) != (frame.via, frame.version):
            return False
        self.arrived(wait)
        return True

    def hold(self, wait: Expected, early: _Early, now: float) -> bool:
        """Hold a forwarded answer that came before its notice; ``False``: no room."""
        if wait not in self._early and len(self._early) >= MAX_EARLY:
            return False
        self._early[wait] = early
        self._early_due.set(wait, now + EARLY_HOLD)
        return True

    def arrived(self, wait: Expected) -> None:
        self._due.cancel(wait)
        self._waits.pop(wait, None)

    def next(self) -> float | None:
        due = [d for d in (self._due.next(), self._early_due.next()) if d is not None]
        return min(due, default=None)

    def due(self, now: float) -> tuple[list[Expected], int]:
        """The waits that ended unanswered, and how many held answers expired."""
        waits = self._due.pop_due(now)
        for wait in waits:
            self._waits.pop(wait, None)
        expired = self._early_due.pop_due(now)
        for wait in expired:
            self._early.pop(wait, None)
        return waits, len(expired)

    def through(
        self, *, job: str | None = None, rank: int | None = None, node: int | None = None
    ) -> list[Expected]:
        """The waits on rank ``rank`` of ``job``, or on any rank on ``node``; ended here."""
        waits = [
            w
            for w, known in self._waits.items()
            if (job is not None and w[0][0] == job and known.via == rank)
            or (node is not None and known.node == node)
        ]
        for wait in waits:
            self.arrived(wait)
        return waits

    def __len__(self) -> int:
        return len(self._waits)


def forward(node: PSNode, frame: ps_frames.Pulled, payload: bytes) -> None:
    """This daemon is a distributor: the server's answer ``frame`` (checked as an answer)
    goes on to each pull it lists, with the same payload, if the list keeps the rules."""
    model = node.models[(frame.job, frame.name)]
    ranks = [rank for rank, _ in frame.forward]
    if (
        model.spec["distribution"] != "tree"
        or len(set(ranks)) != len(ranks)
        or len(ranks) > len(model.workers)
        or frame.worker in ranks
        or not set(ranks) <= set(model.workers)
    ):
        node.counters["ps_frames_dropped"] += 1
        node._log(logging.WARNING, "a forward list against the rules was not forwarded")
        return
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
    wait = (key, frame.worker, frame.shard, frame.clock)
    if (
        model is None
        or model.spec["distribution"] != "tree"
        or frame.via == frame.worker
        or frame.via not in model.workers
        or entry is None
        or entry.node != sender
    ):
        _stray(node, sender, frame)
        return
    taken = node.relays.take(wait, frame)
    if taken is None and node.relays.hold(wait, _Early(sender, frame, payload), now):
        return  # before its notice: taken when the notice comes
    if not taken:
        _stray(node, sender, frame)
        return
    node._at_worker(frame, payload, now)


def _stray(node: PSNode, sender: int, frame: ps_frames.Pulled) -> None:
    node.counters["ps_frames_dropped"] += 1
    message = f"node {sender} forwarded an answer as rank {frame.via} that no notice named"
    node._log(logging.WARNING, message, topic="stray")


def expect(node: PSNode, frame: ps_frames.Pulled, now: float) -> None:
    """The server's notice: ``frame.worker``'s pull comes through rank ``frame.via``."""
    assert frame.via is not None
    assert frame.expect_us is not None
    key = (frame.job, frame.name)
    side = node.models[key].local_workers[frame.worker]
    if not side.engine.awaits_pull(frame.shard, frame.clock):
        return  # answered meanwhile (straight, after a reset)
    wait = (key, frame.worker, frame.shard, frame.clock)
    entry = node.ranks.lookup(frame.job, frame.via)
    if entry is None:  # gone already (or never heard of): no answer will come through it
        redirect(node, [wait])
        return
    known = _Wait(frame.via, entry.node, frame.version)
    early = node.relays.expect(wait, known, now + frame.expect_us / 1e6)
    if early is None:
        return
    if (early.frame.via, early.frame.version, early.sender) == (
        frame.via,
        frame.version,
        entry.node,
    ):
        node.relays.arrived(wait)
        node._at_worker(early.frame, early.payload, now)
    else:
        _stray(node, early.sender, early.frame)
        node.relays.expect(wait, known, now + frame.expect_us / 1e6)


def on_timer(node: PSNode, now: float) -> None:
    """Waits that ended unanswered ask the server straight; held answers that never met
    their notices are dropped."""
    waits, expired = node.relays.due(now)
    node.counters["ps_frames_dropped"] += expired
    redirect(node, waits)


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
