"""Joint reservation of a sharded model's updates: every part of an update planned at once, by
one scheduler, so that each update is sent to every shard or dropped from every shard
(MLfabric §10.2, eq. 18).

Rules: under ``scheduling="mlfabric"`` (async, without aggregation, chain replication) a model
of more than one shard is planned jointly (:func:`joint_for`).  Shard 0's primary is the
*lead*: a worker's daemon tells it the size of every part of an update that waits for a grant
(READY ``sz``), and tells the other shards' primaries, the *followers*, that the lead plans
their part (READY ``j``).  The lead's scheduler orders its batch with
:func:`~fabricd.engines.scheduling.joint.order_joint` (``t_en(g) = max_j t_en(g^j)``, the
deadline rule of eq. 9 and the drops of §5.1.3 over whole updates), grants its own part, and
sends each follower a PLAN: the wait and planned duration of each of its parts it granted, or
the reason it dropped the update.  A follower holds a jointly planned READY until the PLAN
for it comes (:class:`JointParts`), and grants or drops the part as the PLAN says, as its
own decision (a drop is logged and acknowledged like any; a grant counts on its timelines).

Theory of operation.  Planning the parts independently, each shard's scheduler its own, lets
one shard drop what another applies: 18 % of the updates of 8 workers on 4 servers end
partial in the virtual-time bench (``python -m bench --only scheduling-joint``, issue 25 s3),
and a shard of small parts is served first.  One lead plans the way ``order_joint`` does, so
the decisions agree by construction; the followers only carry them out.

Choices where the paper is silent, and why:

* *The lead is shard 0's primary.*  Every worker's daemon knows it without a vote, and a
  failover moves it with the shard (a promoted lead plans afresh, as any promoted scheduler).
* *A follower waits, then plans alone.*  A PLAN lost with a reset, or a lead that died with
  its batch, would leave a part waiting for ever: a follower plans a held part itself once it
  waited :func:`fallback_after` (``max(1 s, 10 intervals)``, the grants' own grace), and
  counts it (status ``scheduler.joint.fell_back``): that update may end partial, as without
  joint reservation.  A PLAN for a part the follower already decided (it fell back, or the
  part was granted before and asked again) is ignored.
* *A PLAN may overtake its READY.*  The worker's READYs to the lead and a follower race over
  different links: a follower keeps a PLAN's entry for a part it has not heard of for
  the same grace, at most :data:`MAX_EARLY` of them, and decides the READY at once when it
  comes.
* *An update's deadline is its stalest part's.*  A worker's shards answer its pull at
  different moments, so its parts may have been read at different versions (READY ``sz``
  carries each part's base), and each shard's server checks its own part's delay on arrival:
  the lead plans with the smallest base, against its own version.
* *Parts on one node share its downlink.*  Two shards served on one node get one booking of
  their summed size (booking them one after the other ends the last no earlier); both are
  told that transfer's times.
* *The lead's timelines.*  Its own part counts until its push is processed, as any grant;
  the other parts count until their planned end (the lead hears nothing of their arrival).
* *What stays per shard.*  BSP drops nothing (MLfabric-S plans lists, no update ends
  partial); aggregation's groups and bounded replication's copies are planned against one
  shard's order: those keep one scheduler per shard (docs/mlfabric.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fabricd.wire import Meta

#: the least a follower holds a jointly planned part before it plans it alone
FALLBACK_MIN = 1.0
#: the most PLAN entries a follower keeps for parts whose READY has not come (per shard)
MAX_EARLY = 4096


def joint_for(spec: Meta) -> bool:
    """Whether a model's updates are planned jointly over its shards (module docstring)."""
    return (
        spec["scheduling"] == "mlfabric"
        and spec["consistency"] == "async"
        and not spec["aggregation"]
        and spec["replication"] == "chain"
        and len(spec["servers"]) > 1
    )


def fallback_after(interval: float) -> float:
    """Seconds a follower holds a part for its PLAN before it plans it alone."""
    return max(FALLBACK_MIN, 10 * interval)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartPlanned:
    """The lead's decision for shard ``shard``'s part of ``worker``'s update of ``iteration``
    (a worker's iterations name its updates: its parts' bases are each shard's version):
    granted, to start ``wait`` seconds from now and take ``duration``; or dropped for
    ``reason``."""

    shard: int
    worker: int
    iteration: int
    wait: float = 0.0
    duration: float = 0.0
    reason: str | None = None


def by_node(sizes: Mapping[int, int], servers: Mapping[int, int]) -> dict[int, float]:
    """An update's parts (shard -> bytes) as the bytes each server node receives (parts of
    shards served on one node summed); ``KeyError`` for a shard with no known node."""
    nodes: dict[int, float] = {}
    for shard, size in sizes.items():
        node = servers[shard]
        nodes[node] = nodes.get(node, 0.0) + size
    return nodes


@dataclass(slots=True, kw_only=True)
class Decision:
    """A PLAN's entry for one part, kept since ``at``: granted (``wait`` seconds after ``at``,
    taking ``duration``) or dropped (``reason``)."""

    at: float
    wait: float = 0.0
    duration: float = 0.0
    reason: str | None = None


class JointParts:
    """A follower's jointly planned parts: the READYs that wait for their PLAN, and the PLAN
    entries that came before their READY (module docstring), each kept ``grace`` seconds."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._held: dict[tuple[int, int], float] = {}  #: (worker, iteration) -> since
        self._early: dict[tuple[int, int], Decision] = {}
        self.fell_back = 0  #: parts planned alone: their PLAN did not come in time

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: tuple[int, int], now: float) -> Decision | None:
        """A jointly planned READY came: its PLAN's decision if that came first (its wait
        counted from now), else ``None`` and the part waits."""
        early = self._early.pop(key, None)
        if early is not None:
            self._held.pop(key, None)
            early.wait = max(0.0, early.wait - (now - early.at))
            return early
        self._held.setdefault(key, now)
        return None

    def holds(self, key: tuple[int, int]) -> bool:
        return key in self._held

    def planned(self, part: PartPlanned, now: float, *, known: bool) -> bool:
        """The PLAN's entry for ``part``: ``True`` when its READY is held (it is decided now,
        and no longer held); else kept for its READY, unless ``known`` (the part was decided
        already: this entry is ignored) or :data:`MAX_EARLY` are kept."""
        key = (part.worker, part.iteration)
        if self._held.pop(key, None) is not None:
            return True
        if not known and len(self._early) < MAX_EARLY:
            self._early[key] = Decision(
                at=now,
                wait=part.wait,
                duration=part.duration,
                reason=part.reason,
            )
        return False

    def forget(self, key: tuple[int, int]) -> None:
        """The part was decided another way, or its worker moved on: forget it."""
        self._held.pop(key, None)
        self._early.pop(key, None)

    def forget_worker(self, worker: int) -> None:
        for table in (self._held, self._early):
            for key in [k for k in table if k[0] == worker]:
                del table[key]

    def due(self, now: float) -> list[tuple[int, int]]:
        """The held parts whose PLAN did not come within the grace (no longer held: they are
        planned alone), and the early entries past it forgotten."""
        late = [key for key, since in self._held.items() if since + self.grace <= now]
        for key in late:
            del self._held[key]
        self.fell_back += len(late)
        for key in [k for k, e in self._early.items() if e.at + self.grace <= now]:
            del self._early[key]
        return late

    def next_deadline(self) -> float | None:
        times = [*self._held.values(), *(e.at for e in self._early.values())]
        return min(times) + self.grace if times else None
