"""An in-process parameter-server fabric for the ps engine tests: one
:class:`~fabricd.engines.ps.node.PSNode` engine per rank, each on its own simulated daemon,
wired by FIFO links that the test drives one frame at a time, without sockets.

Ranks: workers ``0..workers-1``, then one server per shard, then (``replicas``) one replica per
shard; rank ``r`` lives on node ``r``.  Between each pair of nodes there is a control and a data
link each way, as between daemons; each node's process has a link of its own for the update
callback's steps (``callback``: it adds the update to the model, the sum rule run outside the
engine, and answers :meth:`PSNode.stepped` in order).  Every decision -- where a frame goes,
what is sent again, who serves after a failover -- is the engine's; the fabric only moves
frames and says what the daemon would: a peer's links are back (:meth:`PSNode.peer_up`), a
rank joined or is gone (membership's news).

A test may deliver any link's next frame (once or twice), reset the links between a worker
and the rank serving a shard, or between a shard's two ranks (what is in flight is lost; each
side's rank is suspected by the other, then its links are up and it is announced again), make
a worker's daemon send again at any time, kill the rank serving a shard (its node and links
go; every other node hears the rank is gone, and the engines fail over), bring the killed rank
back empty (it opens the shard again and joins the rank serving it), make a late replica open
(``late_join``: the primary holds every entry until then), flush a shard (``lossless``: the
lossless publish mode, so a flush publishes what it held back), and lose a worker (its node
is cut off: the others hear it is gone).

Each simulated worker runs a training loop, one call at a time as the client does: pull, push
its update of that iteration, pull, ..., ending with a pull.  Updates are small integers, so
sums are exact and any update applied twice shows in the model.  The fabric records every
frame's effect and checks, as it goes, what must hold at every moment (versions never go back,
SSP's read rule, async's delay bound, acknowledgements of one push never disagree).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fabricd.engines.actions import SendFrame
from fabricd.engines.membership import RankEntry
from fabricd.engines.ps import worker as ps_worker
from fabricd.engines.ps.consistency import Consistency, Sum
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.models import CallDone, SendData, StepShard
from fabricd.engines.ps.node import PSNode
from fabricd.engines.ps.worker import Worker, shard_bounds
from fabricd.frames import ps as ps_frames

if TYPE_CHECKING:
    from fabricd.engines.ps.server import ShardServer

Array = np.ndarray[Any, Any]
JOB, NAME = "job", "m"
KEY = (JOB, NAME)
#: link kinds: (kind, from node, to node)
CONTROL, DATA, STEP = "control", "data", "step"


def gradient(worker: int, iteration: int, size: int) -> Array:
    """Worker ``worker``'s update of ``iteration``: distinct positive small integers."""
    return np.arange(1, size + 1, dtype=np.float64) + 100.0 * worker + 10.0 * iteration


class Table:
    """One daemon's rank table (every node reachable: the fabric drops what a reset loses)."""

    def __init__(
        self, ranks: dict[int, int], figures: dict[int, tuple[float, float]] | None = None
    ) -> None:
        self.nodes = dict(ranks)  #: rank -> node
        #: node -> its (up, down) bytes/s, as the network monitor would say (none: unknown)
        self.figures = figures if figures is not None else {}

    def lookup(self, job: str, rank: int, /) -> RankEntry | None:
        node = self.nodes.get(rank)
        if job != JOB or node is None:
            return None
        return RankEntry(job=job, rank=rank, size=0, node=node)

    def reachable(self, node: int, /) -> bool:
        return True

    def bandwidth(self, node: int, /) -> tuple[float, float] | None:
        return self.figures.get(node)


@dataclass
class SimWorker:
    """A worker's training loop and what it saw."""

    node: PSNode
    rank: int
    rounds: int
    cache: Array
    ops: deque[str] = field(default_factory=deque)  #: calls still to make
    call: str | None = None  #: the call in flight
    lost: bool = False
    pushes: list[ps_worker.PushDone] = field(default_factory=list)
    pulls: list[ps_worker.PullDone] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    fresh_next: bool = False  #: the next pull goes to a new array

    def __post_init__(self) -> None:
        for _ in range(self.rounds):
            self.ops += ["pull", "push"]
        self.ops.append("pull")

    @property
    def engine(self) -> Worker:
        return self.node.models[KEY].local_workers[self.rank].engine

    @property
    def done(self) -> bool:
        return self.lost or (not self.ops and self.call is None)


class Fabric:
    """One PS node engine per rank, wired by FIFO links (module docstring)."""

    def __init__(
        self,
        *,
        workers: int,
        shards: int,
        size: int,
        rounds: int,
        consistency: Consistency,
        staleness: int = 0,
        delay_bound: int | None = None,
        replicas: bool = False,
        chunk: int = 1,
        callback: bool = False,
        lossless: bool = False,
        late_join: bool = False,
        scheduled: bool = False,
        aggregation: bool = False,
        interval: float = 0.5,
        divergence_bound: list[Any] | None = None,
        tree: bool = False,
    ) -> None:
        self.consistency = consistency
        self.callback = callback
        self.flushes = 0  #: flushes asked for (BSP versions are iteration + 1 without any)
        self.lossless = lossless
        self.staleness = staleness
        self.delay_bound = delay_bound
        self.scheduled = scheduled
        self.interval = interval  #: the schedulers' batch interval (a frame takes 1 s here)
        #: node -> (up, down) bytes/s for the schedulers (``scheduled``); shared by every table
        self.figures: dict[int, tuple[float, float]] = {}
        self.size = size
        self.now = 0.0
        self.servers = [workers + s for s in range(shards)]
        self.replica_ranks = [workers + shards + s for s in range(shards)] if replicas else []
        self.spec: dict[str, Any] = {
            "n": workers + shards + len(self.replica_ranks),
            "size": size,
            "dtype": "float64",
            "servers": self.servers,
            "replicas": self.replica_ranks,
            "consistency": consistency.value,
            "staleness": staleness,
            "delay_bound": delay_bound if consistency is Consistency.ASYNC else None,
            "chunk": chunk,
            "scheduling": "mlfabric" if scheduled else "arrival",
            "aggregation": aggregation,
            "replication": "chain" if divergence_bound is None else "bounded",
            "divergence_bound": divergence_bound,
            "distribution": "tree" if tree else "direct",
        }
        #: bounded replication: a failover may roll a shard back (within the bound)
        self.bounded = divergence_bound is not None
        #: bounded: shard -> each (epoch killed, the version its replica had then)
        self.rollbacks: dict[int, list[tuple[int, int]]] = {}
        #: bounded: shard -> the killed primary's model and version
        self.killed_models: dict[int, tuple[Array, int]] = {}
        #: bounded: (worker, iteration, shard) -> epoch -> (version, dropped) of its acks
        self.acked_at: dict[tuple[int, int, int], dict[int, tuple[int, str | None]]] = {}
        self.bounds = shard_bounds(size, shards)
        # lossless publish with P-SMP: small changes are held back until a flush publishes them
        self.settings = (
            FilterSettings(psmp_threshold=0.3, lossless_publish=True) if lossless else None
        )
        #: replicas that have not opened yet (``late_join``)
        self.unjoined: set[int] = set(range(shards)) if replicas and late_join else set()
        late = {self.replica_ranks[s] for s in self.unjoined}
        self.known = {r: r for r in range(self.spec["n"]) if r not in late}  #: rank -> node
        self.nodes: dict[int, PSNode] = {}
        self.links: dict[tuple[str, int, int], deque[tuple[Any, bytes]]] = {}
        self.workers = [
            SimWorker(node=self._node(w), rank=w, rounds=rounds, cache=np.zeros(size))
            for w in range(workers)
        ]
        for sim in self.workers:
            settings = FilterSettings() if self.settings is None else self.settings
            sim.node.open_worker(
                KEY, self.spec, self.bounds, rank=sim.rank, settings=settings, seed=0, now=0.0
            )
        #: (worker, iteration, shard) -> (version, dropped) of its acknowledgement
        self.acked: dict[tuple[int, int, int], tuple[int, str | None]] = {}
        #: (worker, iteration, shard) -> the base it was pushed with
        self.bases: dict[tuple[int, int, int], int] = {}
        #: (worker, iteration, shard) -> how many updates the aggregate that held it summed
        self.summed: dict[tuple[int, int, int], int] = {}
        self.answers = 0  #: pull answers delivered
        #: (shard, iteration) -> the version BSP applied it as
        self.bsp_versions: dict[tuple[int, int], int] = {}
        #: id of a server -> (it, the version of the last Step it gave its process)
        self.stepped_to: dict[int, tuple[ShardServer, int]] = {}
        for s in range(shards):
            self._open(self.servers[s], s)
            if replicas and s not in self.unjoined:
                self._open(self.replica_ranks[s], s)

    # -- ranks and nodes --------------------------------------------------------------------
    def _node(self, rank: int) -> PSNode:
        node = PSNode(
            node=rank,
            ranks=Table(self.known, self.figures),
            max_payload=1 << 20,
            # a scheduled fabric runs the nodes' timers: early frames must not expire in it
            route_timeout=1e9 if self.scheduled or self.bounded else 1.0,
            schedule_interval=self.interval,
        )
        self.nodes[rank] = node
        return node

    def _open(self, rank: int, s: int) -> None:
        node = self.nodes.get(rank) or self._node(rank)
        lo, hi = self.bounds[s]
        actions = node.open_shard(
            KEY,
            self.spec,
            self.bounds,
            rank=rank,
            shard=s,
            initial=np.zeros(hi - lo),
            rule=None if self.callback else Sum(),
            settings=self.settings or FilterSettings(),
            now=self.now,
        )
        self._perform(rank, actions)

    def _tables(self) -> list[Table]:
        return [n.ranks for n in self.nodes.values()]  # type: ignore[misc]

    def _announce(self, rank: int) -> None:
        """Rank ``rank`` is known to every node now, and every other node hears it joined."""
        self.known[rank] = rank
        for table in self._tables():
            table.nodes[rank] = rank
        for r, node in list(self.nodes.items()):
            if r != rank:
                self._perform(r, node.rank_joined(JOB, rank, rank, self.now))

    def _gone(self, rank: int, reason: str) -> None:
        """Rank ``rank`` is gone: every other node forgets it and hears so."""
        self.known.pop(rank, None)
        for r, node in list(self.nodes.items()):
            if r != rank:
                node.ranks.nodes.pop(rank, None)  # type: ignore[attr-defined]
                self._perform(r, node.rank_gone(JOB, rank, reason, self.now))

    def _cut(self, a: int, b: int | None = None) -> None:
        """Drop what is in flight between nodes ``a`` and ``b`` (or to and from ``a`` at all)."""
        for key, frames in self.links.items():
            ends = {key[1], key[2]}
            if a in ends and (b is None or b in ends):
                frames.clear()

    def _pair(self, s: int) -> list[ShardServer]:
        """Shard ``s``'s live servers, the serving one first."""
        found = [
            n.models[KEY].servers.get(s)
            for r, n in self.nodes.items()
            if r in (self.servers[s], *self.replica_ranks[s : s + 1]) and KEY in n.models
        ]
        servers = [x for x in found if x is not None]
        return sorted(servers, key=lambda x: (not x.primary, -x.epoch))

    def serving(self, shard: int) -> ShardServer:
        return self._pair(shard)[0]

    def follower(self, shard: int) -> ShardServer | None:
        pair = self._pair(shard)
        return pair[1] if len(pair) > 1 else None

    @property
    def replicas(self) -> list[ShardServer | None]:
        """Each shard's rank that follows the serving one (its replica before any failover),
        or the one serving alone since its partner died (``None`` without replicas)."""
        if not self.replica_ranks:
            return [None] * len(self.bounds)
        return [self.follower(s) or self.serving(s) for s in range(len(self.bounds))]

    def _rank_of(self, server: ShardServer) -> int:
        for r, node in self.nodes.items():
            model = node.models.get(KEY)
            if model is not None and server in model.servers.values():
                return r
        raise AssertionError("a server on no node")

    # -- the test's moves -----------------------------------------------------------------
    def step(self, w: int) -> None:
        """Worker ``w`` makes its next call, if none is in flight."""
        sim = self.workers[w]
        if sim.lost or sim.call is not None or not sim.ops:
            return
        op = sim.ops.popleft()
        sim.call = op
        if op == "push":
            update = gradient(w, sim.engine.iteration, self.size)
            actions = sim.node.push(KEY, w, update, self.now)
        else:
            fresh = sim.fresh_next
            if fresh:
                sim.cache = np.zeros(self.size)
                sim.fresh_next = False
            actions = sim.node.pull(KEY, w, sim.cache, fresh=fresh, now=self.now)
        self._perform(w, actions)

    def deliver(self, pick: int, *, twice: bool = False) -> bool:
        """Deliver the next frame of the ``pick``-th (modulo) non-empty link, twice if asked
        (a duplicate).  False when every link is empty."""
        busy = [key for key, frames in self.links.items() if frames]
        if not busy:
            return False
        key = busy[pick % len(busy)]
        frame, payload = self.links[key].popleft()
        for _ in range(2 if twice and key[0] != STEP else 1):  # a process answers once
            self._arrive(key, frame, payload)
        return True

    def resend(self, w: int, s: int) -> None:
        """Worker ``w``'s daemon sends the rank serving shard ``s`` what is in flight again
        (as when that peer's links came back; nothing is lost)."""
        if not self.workers[w].lost:
            to = self._rank_of(self.serving(s))
            self._perform(w, self.nodes[w].peer_up(to, self.now))

    def reset(self, w: int, s: int) -> None:
        """The links between worker ``w`` and the rank serving ``s`` are reset."""
        if not self.workers[w].lost:
            self._reset(w, self._rank_of(self.serving(s)))

    def reset_replica(self, s: int) -> None:
        """The links between shard ``s``'s two ranks are reset."""
        follower = self.follower(s)
        if follower is not None:
            self._reset(self._rank_of(self.serving(s)), self._rank_of(follower))

    def _reset(self, a: int, b: int) -> None:
        """The links between nodes ``a`` and ``b`` are reset, as the daemons see it: what was
        in flight is lost, each forgets the other's rank (membership's news: suspected), the
        links come back (peer up) and the rank is announced again (it joined)."""
        self._cut(a, b)
        for here, there in ((a, b), (b, a)):
            del self.nodes[here].ranks.nodes[there]  # type: ignore[attr-defined]
            self.nodes[here].rank_suspected(JOB, there)
        for here, there in ((a, b), (b, a)):
            self._perform(here, self.nodes[here].peer_up(there, self.now))
        for here, there in ((a, b), (b, a)):
            self.nodes[here].ranks.nodes[there] = there  # type: ignore[attr-defined]
            self._perform(here, self.nodes[here].rank_joined(JOB, there, there, self.now))

    def join(self, s: int) -> None:
        """Shard ``s``'s late replica opens it (and joins its primary)."""
        if s not in self.unjoined:
            return
        self.unjoined.discard(s)
        rank = self.replica_ranks[s]
        self._node(rank)
        self._announce(rank)
        self._open(rank, s)

    def rejoin(self, s: int) -> None:
        """The rank of shard ``s`` killed last comes back empty: it opens the shard again and
        joins the rank serving it."""
        dead = [r for r in (self.servers[s], *self.replica_ranks[s : s + 1]) if r not in self.nodes]
        if not dead or s in self.unjoined:
            return
        rank = dead[0]
        self._node(rank)
        self._announce(rank)
        self._open(rank, s)

    def flush(self, s: int) -> None:
        """Shard ``s``'s serving process flushes (publishes what the lossless mode held)."""
        self.flushes += 1
        rank = self._rank_of(self.serving(s))
        _, actions = self.nodes[rank].flush(KEY, [s], self.flushes, self.now)
        self._perform(rank, actions)

    def kill(self, s: int) -> None:
        """The rank serving shard ``s`` dies: its node and links go, the others hear it is
        gone, and the engines fail the shard over to its partner."""
        replica = self.follower(s)
        if replica is None or replica.primary or not replica.has_state:
            return  # no partner that could take over (the engine fails the shard then)
        primary = self.serving(s)
        if self.bounded:  # the replica may be behind: what it has is what survives
            self.rollbacks.setdefault(s, []).append((primary.epoch, replica.version))
            self.killed_models[s] = (primary.store.model.copy(), primary.version)
        else:  # it logged (and applied, or its process steps it now) first
            decided = replica.coordinator.version
            assert decided >= primary.version
            seen = [d.versions[s] for sim in self.workers for d in sim.pushes]
            seen += [d.versions[s] for sim in self.workers for d in sim.pulls]
            assert decided >= max(seen, default=0)  # no version a worker saw is lost
        rank, epoch = self._rank_of(primary), replica.epoch
        self._cut(rank)
        del self.nodes[rank]
        self._gone(rank, "killed")
        assert (replica.primary, replica.epoch) == (True, epoch + 1)

    def lose(self, w: int) -> None:
        """Worker ``w``'s node is cut off for good: every other node hears it is gone.  They
        keep its rank table entry, so that what they still answer it is seen (and checked)
        before the cut link drops it."""
        self.workers[w].lost = True
        self._cut(w)
        for r, node in list(self.nodes.items()):
            if r != w:
                self._perform(r, node.rank_gone(JOB, w, "gone", self.now))

    def drain(self, limit: int = 20000) -> None:
        """Run every worker to the end of its loop, delivering in a fixed order (a late
        replica joins first: without it nothing is processed)."""
        for s in sorted(self.unjoined):
            self.join(s)
        for _ in range(limit):
            for w in range(len(self.workers)):
                self.step(w)
            if not self.deliver(0) and not ((self.scheduled or self.bounded) and self.tick()):
                if all(sim.done for sim in self.workers):
                    return
                stuck = [
                    (w, sim.call, sim.engine.in_flight)
                    for w, sim in enumerate(self.workers)
                    if not sim.done
                ]
                raise AssertionError(f"nothing in flight and workers wait: {stuck}")
        raise AssertionError("the fabric did not settle")

    def tick(self) -> bool:
        """Nothing in flight: the clock moves to the earliest deadline of any node (a
        scheduler's batch, a granted push's start, an early frame's expiry) and its timers
        run.  False when no node has one."""
        due = [d for n in self.nodes.values() if (d := n.next_deadline()) is not None]
        if not due:
            return False
        self.now = max(self.now, min(due))
        self._timers()
        return True

    def _timers(self) -> None:
        """Run the timers of every node whose deadline has come."""
        for rank, node in list(self.nodes.items()):
            due = node.next_deadline()
            if due is not None and due <= self.now:
                self._perform(rank, node.on_timer(self.now))

    # -- frames ---------------------------------------------------------------------------
    def _arrive(self, key: tuple[str, int, int], frame: Any, payload: bytes) -> None:
        kind, src, dst = key
        node = self.nodes[dst]
        self.now += 1.0
        if self.scheduled:  # (without a scheduler, early frames never expire here)
            self._timers()
        if kind == STEP:
            assert isinstance(frame, StepShard)
            model = frame.step.model + frame.step.update  # the process's callback: the sum rule
            actions = node.stepped(KEY, frame.shard, frame.step.version, model, self.now)
        else:
            if isinstance(frame, ps_frames.Pulled) and frame.error is None:
                self.answers += 1
            actions = node.on_frame(src, frame, payload, self.now)
        self._perform(dst, actions)

    def _perform(self, at: int, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendFrame | SendData):
                payload = action.payload if isinstance(action, SendData) else b""
                self._check_frame(at, action.frame)
                if action.node < len(self.workers) and self.workers[action.node].lost:
                    continue  # cut off
                kind = DATA if isinstance(action, SendData) else CONTROL
                self.links.setdefault((kind, at, action.node), deque()).append(
                    (action.frame, payload)
                )
            elif isinstance(action, StepShard):
                self._check_step(at, action)
                self.links.setdefault((STEP, at, at), deque()).append((action, b""))
            elif isinstance(action, CallDone):
                self._done(self.workers[action.rank], action)

    def _done(self, sim: SimWorker, done: CallDone) -> None:
        if done.failure is not None:
            assert sim.call == "pull", done
            assert sim.lost, done
            sim.failed.append(done.failure.message)
            sim.call = None
            sim.ops.clear()
            return
        assert done.result is not None
        versions = tuple(done.result["versions"])
        if sim.call == "push":
            result = ps_worker.PushDone(
                iteration=done.result["iteration"],
                versions=versions,
                dropped=tuple(done.result["dropped"]),
            )
            if sim.pushes and not self.bounded:  # (bounded: a failover may roll back)
                previous = sim.pushes[-1].versions
                assert all(a >= b for a, b in zip(versions, previous, strict=True)), done
            sim.pushes.append(result)
        else:
            assert sim.call == "pull", done
            assert versions == tuple(sim.engine.versions)
            if sim.pulls and not self.bounded:
                previous = sim.pulls[-1].versions
                assert all(a >= b for a, b in zip(versions, previous, strict=True)), done
            sim.pulls.append(ps_worker.PullDone(versions=versions))
        sim.call = None

    def _check_step(self, at: int, action: StepShard) -> None:
        """One step at a time, in version order, from the published model (a flush makes a
        version without one)."""
        assert self.callback, action
        server = self.nodes[at].models[KEY].servers[action.shard]
        last = self.stepped_to.get(id(server), (server, 0))[1]
        assert action.step.version > last, (last, action)
        assert action.step.version == server.store.version + 1, action
        self.stepped_to[id(server)] = (server, action.step.version)

    def _check_frame(self, at: int, frame: Any) -> None:
        """A worker's push remembers its base; a shard's acknowledgement and answer are
        checked (refusals, from a rank not serving at the frame's epoch, are not)."""
        if isinstance(frame, ps_frames.Push) and frame.members is not None:
            for w, it, base in frame.members:  # an aggregate: its members' bases, and its size
                self.bases[(w, it, frame.shard)] = base
                self.summed[(w, it, frame.shard)] = len(frame.members)
            return
        if isinstance(frame, ps_frames.Push):
            self.bases[(frame.worker, frame.iteration, frame.shard)] = frame.base
            return
        if not isinstance(frame, ps_frames.Pushed | ps_frames.Pulled):
            return
        server = self.nodes[at].models[KEY].servers.get(frame.shard)
        if server is None or not server.primary or frame.epoch != server.epoch:
            return
        if isinstance(frame, ps_frames.Pushed):
            self._record_ack(frame)
        elif frame.error is None and self.consistency is not Consistency.ASYNC:
            need = frame.clock - self.staleness  # SSP's read rule (BSP: s = 0)
            assert server.coordinator.complete >= need, (frame, need)

    def _record_ack(self, ack: ps_frames.Pushed) -> None:
        key = (ack.worker, ack.iteration, ack.shard)
        if self.bounded:  # one answer per epoch: a push a rollback lost is applied again
            at = self.acked_at.setdefault(key, {})
            seen = at.setdefault(ack.epoch, (ack.version, ack.dropped))
            assert seen == (ack.version, ack.dropped), f"{key} acknowledged as {seen} and {ack}"
            self.acked[key] = (ack.version, ack.dropped)
            return
        seen = self.acked.setdefault(key, (ack.version, ack.dropped))
        assert seen == (ack.version, ack.dropped), f"{key} acknowledged as {seen} and {ack}"
        if ack.dropped is None:
            if self.consistency is Consistency.BSP:
                # one version per iteration, every shard's pushes of it in one; a flush adds one
                same = self.bsp_versions.setdefault((ack.shard, ack.iteration), ack.version)
                assert same == ack.version, (same, ack)
                assert ack.version == ack.iteration + 1 or self.flushes, ack
                assert ack.version >= ack.iteration + 1, ack
            if self.consistency is Consistency.ASYNC and self.delay_bound is not None:
                # an aggregate of k advances the version by k: applied at version - k
                delay = ack.version - self.summed.get(key, 1) - self.bases[key]
                assert delay <= self.delay_bound, (ack, delay)

    # -- checks at the end ----------------------------------------------------------------
    def applied(self, s: int) -> list[tuple[int, int]]:
        """The (worker, iteration) pushes shard ``s`` acknowledged as applied, and a lost
        worker's last one the shard applied: its acknowledgement may never have been sent (the
        primary died before the replica confirmed it, and the worker never sent it again)."""
        applied = {
            (w, it) for (w, it, sh), (_, why) in self.acked.items() if sh == s and why is None
        }
        if self.bounded:
            applied = {(w, it) for (w, it, sh) in self.acked_at if sh == s and self._kept(w, it, s)}
        for w, (it, _, why) in self.serving(s).state()["last"].items():
            if self.workers[w].lost and why is None:
                applied.add((w, it))
        return sorted(applied)

    def _kept(self, w: int, it: int, s: int) -> bool:
        """Bounded: whether the serving rank holds ``w``'s push of ``it``: applied at some
        epoch, and within what the replica had at every kill since (versions are kept along
        the history each promotion carries on)."""
        kills = self.rollbacks.get(s, [])
        return any(
            why is None and all(version <= upto for killed, upto in kills if killed >= epoch)
            for epoch, (version, why) in self.acked_at[(w, it, s)].items()
        )

    def expected(self, s: int) -> Array:
        lo, hi = self.bounds[s]
        total = np.zeros(hi - lo)
        for w, it in self.applied(s):
            total += gradient(w, it, self.size)[lo:hi]
        return total

    def check_settled(self) -> None:
        """After :meth:`drain`: every push acknowledged by every shard, applied exactly once,
        the model the sum of what was applied, a replica equal to its primary, and a fresh
        pull of every worker equal to the model (after a flush of each shard in lossless
        mode: until then pulls serve the published values, not the exact ones)."""
        if self.lossless:
            for s in range(len(self.bounds)):
                self.flush(s)
            self.drain()
        for w, sim in enumerate(self.workers):
            for it in range(sim.engine.iteration if not sim.lost else 0):
                for s in range(len(self.bounds)):
                    gate_dropped = (w, it, s) not in self.bases
                    assert gate_dropped or (w, it, s) in self.acked, (w, it, s)
        for s in range(len(self.bounds)):
            self._check_shard(s)
        for sim in self.workers:
            if not sim.lost:
                sim.ops.append("pull")
                sim.fresh_next = True
        self.drain()
        for sim in self.workers:
            if sim.lost:
                continue
            assert sim.pulls[-1].versions == tuple(
                self.serving(s).version for s in range(len(self.bounds))
            )
            for s, (lo, hi) in enumerate(self.bounds):
                np.testing.assert_array_equal(sim.cache[lo:hi], self.serving(s).store.model)

    def _check_shard(self, s: int) -> None:
        server = self.serving(s)
        expected = self.expected(s)
        np.testing.assert_array_equal(server.filter.model, expected)
        np.testing.assert_array_equal(server.store.model, expected)
        applied = server.coordinator.statistics().applied
        assert applied == len(self.applied(s)), (applied, self.applied(s))
        replica = self.follower(s)
        if replica is not None and replica.has_state:
            assert not server.statistics().unreplicated
            assert replica.version == server.version
            np.testing.assert_array_equal(replica.store.model, server.store.model)
            np.testing.assert_array_equal(replica.store.versions, server.store.versions)
            np.testing.assert_array_equal(replica.filter.model, server.filter.model)
            np.testing.assert_array_equal(replica.filter.published, server.filter.published)
            assert replica.coordinator.complete == server.coordinator.complete
