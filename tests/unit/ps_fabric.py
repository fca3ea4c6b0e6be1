"""An in-process parameter-server fabric for the ps engine tests: :class:`Worker` engines and
:class:`ShardServer` engines (a primary per shard, and a replica if asked) wired together by
FIFO links that the test drives one frame at a time, without sockets.

The links are the ``ps`` service's: per worker and shard, pushes on a data link and pulls on a
control link to the server, acknowledgements on a control link and pull answers (and refusals)
on a data link back; per shard, the replica's snapshot (it joins at the start) and entries on a
data link to the replica and confirmations on a control link back; and, with ``callback``, each
server's :class:`~ps_server.Step` events to its own process, which adds the update to the model
(the sum rule, run outside the engine) and answers :meth:`ShardServer.stepped` in order. A test
may deliver any link's next frame (once or twice), reset the links between a worker and a shard
(what is in flight is lost, and :meth:`Worker.resend` sends what it must again, as the service
does on ``peer_up``), reset the links to a replica (the primary sends
:meth:`ShardServer.unconfirmed` again), make a worker resend at any time, kill a primary (its
links and unconfirmed entries are lost, the replica is promoted, every worker fails over;
workers lost before are lost to the promoted replica too, as the service does), bring a fresh
replica to the promoted one (it joins: a snapshot of whatever is processed then), make a late
replica join (``late_join``: the primary holds every entry until then), flush a shard
(``lossless``: the lossless publish mode, so a flush publishes what it held back), and lose a
worker.

Each simulated worker runs a training loop, one call at a time as the client does: pull, push
its update of that iteration, pull, ..., ending with a pull.  Updates are small integers, so
sums are exact and any update applied twice shows in the model.  The fabric records every
frame's effect and checks, as it goes, what must hold at every moment (versions never go back,
SSP's read rule, async's delay bound, acknowledgements of one push never disagree).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabricd.engines.ps import server as ps_server
from fabricd.engines.ps import worker as ps_worker
from fabricd.engines.ps.consistency import Consistency, Sum
from fabricd.engines.ps.filters import FilterSettings
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.worker import Worker

Array = np.ndarray[Any, Any]
Frame = Any

#: link names; a link is (name, worker, shard) or, for replication, (name, -1, shard)
PUSH, PULL, ACK, ANSWER, FORWARD, LOGGED = "push", "pull", "ack", "answer", "forward", "logged"
#: a server's Step events to its process: (STEP, 0, shard) the primary's, (STEP, 1, shard) the
#: replica's
STEP = "step"
WORKER_LINKS = (PUSH, PULL, ACK, ANSWER)


def gradient(worker: int, iteration: int, size: int) -> Array:
    """Worker ``worker``'s update of ``iteration``: distinct positive small integers."""
    return np.arange(1, size + 1, dtype=np.float64) + 100.0 * worker + 10.0 * iteration


@dataclass
class SimWorker:
    """A worker's training loop and what it saw."""

    engine: Worker
    rounds: int
    cache: Array
    ops: deque[str] = field(default_factory=deque)  #: calls still to make
    call: str | None = None  #: the call in flight
    lost: bool = False
    pushes: list[ps_worker.PushDone] = field(default_factory=list)
    pulls: list[ps_worker.PullDone] = field(default_factory=list)
    failed: list[ps_worker.PullFailed] = field(default_factory=list)
    fresh_next: bool = False  #: the next pull goes to a new array

    def __post_init__(self) -> None:
        for _ in range(self.rounds):
            self.ops += ["pull", "push"]
        self.ops.append("pull")

    @property
    def done(self) -> bool:
        return not self.ops and self.call is None


class Fabric:
    """Workers and shards wired by FIFO links (module docstring)."""

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
    ) -> None:
        self.consistency = consistency
        self.callback = callback
        self.lossless = lossless
        self.flushes = 0  #: flushes asked for (BSP versions are iteration + 1 without any)
        self.staleness = staleness
        self.delay_bound = delay_bound
        self.size = size
        self.now = 0.0
        self.workers = [
            SimWorker(
                engine=Worker(
                    worker=w, size=size, dtype="float64", shards=shards, delay_bound=delay_bound
                ),
                rounds=rounds,
                cache=np.zeros(size),
            )
            for w in range(workers)
        ]
        self.bounds = self.workers[0].engine.bounds

        # lossless publish with P-SMP: small changes are held back until a flush publishes them
        settings = FilterSettings(psmp_threshold=0.3, lossless_publish=True) if lossless else None

        def server(
            lo: int, hi: int, *, replica: bool = False, replicated: bool = False
        ) -> ShardServer:
            return ShardServer(
                initial=np.zeros(hi - lo),
                workers=range(workers),
                consistency=consistency,
                staleness=staleness,
                delay_bound=delay_bound if consistency is Consistency.ASYNC else None,
                rule=None if callback else Sum(),
                settings=settings,
                chunk=chunk,
                replica=replica,
                replicated=replicated,
            )

        self._server_of = server
        self.primaries: list[ShardServer | None] = [
            server(lo, hi, replicated=replicas) for lo, hi in self.bounds
        ]
        self.replicas: list[ShardServer | None] = [
            server(lo, hi, replica=True) if replicas else None for lo, hi in self.bounds
        ]
        #: shards whose replica has not asked to join yet (``late_join``)
        self.unjoined: set[int] = set(range(shards)) if replicas and late_join else set()
        #: id of a server -> (it, the version of the last Step it gave its process since it
        #: last took a snapshot)
        self.stepped_to: dict[int, tuple[ShardServer, int]] = {}
        self.links: dict[tuple[str, int, int], deque[Frame]] = {}
        for s in range(shards):
            for w in range(workers):
                for name in WORKER_LINKS:
                    self.links[(name, w, s)] = deque()
            if replicas:
                self.links[(FORWARD, -1, s)] = deque()
                self.links[(LOGGED, -1, s)] = deque()
            self.links[(STEP, 0, s)] = deque()
            self.links[(STEP, 1, s)] = deque()
        #: (worker, iteration, shard) -> (version, dropped) of its acknowledgement
        self.acked: dict[tuple[int, int, int], tuple[int, str | None]] = {}
        #: (worker, iteration, shard) -> the base it was pushed with
        self.bases: dict[tuple[int, int, int], int] = {}
        self.answers = 0  #: pull answers delivered
        #: (shard, iteration) -> the version BSP applied it as
        self.bsp_versions: dict[tuple[int, int], int] = {}
        for s in range(shards):  # each replica joins: a snapshot, then entries
            if replicas and s not in self.unjoined:
                self.join(s)

    # -- who serves ------------------------------------------------------------------------
    def serving(self, shard: int) -> ShardServer:
        server = self.primaries[shard] or self.replicas[shard]
        assert server is not None
        return server

    # -- the test's moves -----------------------------------------------------------------
    def step(self, w: int) -> None:
        """Worker ``w`` makes its next call, if none is in flight."""
        sim = self.workers[w]
        if sim.call is not None or not sim.ops:
            return
        op = sim.ops.popleft()
        sim.call = op
        if op == "push":
            iteration = sim.engine.iteration
            actions = sim.engine.push(gradient(w, iteration, self.size))
        else:
            fresh = sim.fresh_next
            if fresh:
                sim.cache = np.zeros(self.size)
                sim.fresh_next = False
            actions = sim.engine.pull(fresh=fresh)
        self._worker(w, actions)

    def deliver(self, pick: int, *, twice: bool = False) -> bool:
        """Deliver the next frame of the ``pick``-th (modulo) non-empty link, twice if asked
        (a duplicate).  False when every link is empty."""
        busy = [key for key, frames in self.links.items() if frames]
        if not busy:
            return False
        key = busy[pick % len(busy)]
        frame = self.links[key].popleft()
        for _ in range(2 if twice and key[0] != STEP else 1):  # a process answers once
            self._arrive(key, frame)
        return True

    def resend(self, w: int, s: int) -> None:
        """Worker ``w`` sends shard ``s`` what is in flight again (nothing is lost)."""
        self._worker(w, self.workers[w].engine.resend(s))

    def reset(self, w: int, s: int) -> None:
        """The links between worker ``w`` and shard ``s`` are reset: frames lost, resent."""
        for name in WORKER_LINKS:
            self.links[(name, w, s)].clear()
        self.resend(w, s)

    def reset_replica(self, s: int) -> None:
        """The links between shard ``s``'s primary and replica are reset."""
        primary, replica = self.primaries[s], self.replicas[s]
        if primary is None or replica is None:
            return
        self.links[(FORWARD, -1, s)].clear()
        self.links[(LOGGED, -1, s)].clear()
        if replica.has_state:
            self._server(s, list(primary.unconfirmed()))
        else:  # its snapshot was lost: it asks to join again
            self._server(s, primary.joined())

    def join(self, s: int) -> None:
        """Shard ``s``'s replica (late, or fresh after a failover) asks to join."""
        self.unjoined.discard(s)
        primary = self.primaries[s]
        if primary is not None and self.replicas[s] is not None:
            self._server(s, primary.joined())

    def rejoin(self, s: int) -> None:
        """A fresh replica comes to shard ``s``'s promoted replica (the dead primary's rank
        back, empty) and joins it: the two swap roles."""
        if self.primaries[s] is not None:
            return
        promoted = self.replicas[s]
        assert promoted is not None
        assert promoted.primary
        lo, hi = self.bounds[s]
        self.primaries[s], self.replicas[s] = promoted, self._server_of(lo, hi, replica=True)
        for key in ((FORWARD, -1, s), (LOGGED, -1, s), (STEP, 1, s)):
            self.links[key].clear()
        self.links[(STEP, 0, s)].extend(self.links[(STEP, 1, s)])  # the promoted's process
        self.join(s)

    def flush(self, s: int) -> None:
        """Shard ``s``'s serving process flushes (publishes what the lossless mode held)."""
        self.flushes += 1
        self._server(s, self.serving(s).flush(self.now))

    def kill(self, s: int) -> None:
        """Shard ``s``'s primary dies: its links go, its replica serves, workers fail over."""
        replica = self.replicas[s]
        if self.primaries[s] is None or replica is None or not replica.has_state:
            return  # no replica that could take over (the service fails the shard then)
        primary = self.primaries[s]
        assert primary is not None
        # it logged (and applied, or its process steps it now) first
        decided = replica.coordinator.version
        assert decided >= primary.version
        seen = [d.versions[s] for sim in self.workers for d in sim.pushes]
        seen += [d.versions[s] for sim in self.workers for d in sim.pulls]
        assert decided >= max(seen, default=0)  # no version a worker saw is lost
        self.primaries[s] = None
        for key in self.links:
            if key[2] == s and key != (STEP, 1, s):  # the replica's process goes on
                self.links[key].clear()
        epoch = replica.epoch
        assert replica.promote()
        assert replica.primary
        assert replica.epoch == epoch + 1
        self.links[(STEP, 0, s)] = self.links[(STEP, 1, s)]  # its process serves on
        self.links[(STEP, 1, s)] = deque()
        for w, sim in enumerate(self.workers):  # the service loses the ranks gone (_promote)
            if sim.lost:
                self._server(s, replica.lose(w, "gone at the failover", self.now))
        for w, sim in enumerate(self.workers):
            self._worker(w, sim.engine.failover(s))

    def lose(self, w: int) -> None:
        """Worker ``w`` is lost to every serving shard.  Its daemon does not know (a node cut
        off longer than ``down_after``): it goes on resending, pushes once more at most and
        stops when its next pull is refused, as its client would."""
        self.workers[w].lost = True
        for s in range(len(self.bounds)):
            self._server(s, self.serving(s).lose(w, "gone", self.now))

    def drain(self, limit: int = 20000) -> None:
        """Run every worker to the end of its loop, delivering in a fixed order (a late
        replica joins first: without it nothing is processed)."""
        for s in sorted(self.unjoined):
            self.join(s)
        for _ in range(limit):
            for w in range(len(self.workers)):
                self.step(w)
            if not self.deliver(0):
                if all(sim.done for sim in self.workers):
                    return
                stuck = [
                    (w, sim.call, sim.engine.in_flight)
                    for w, sim in enumerate(self.workers)
                    if not sim.done
                ]
                raise AssertionError(f"nothing in flight and workers wait: {stuck}")
        raise AssertionError("the fabric did not settle")

    # -- frames ---------------------------------------------------------------------------
    def _arrive(self, key: tuple[str, int, int], frame: Frame) -> None:
        name, w, s = key
        self.now += 1.0
        if name == PUSH:
            self._server(
                s, self.serving(s).push(w, frame.iteration, frame.base, frame.payload, self.now)
            )
        elif name == PULL:
            self._server(s, self.serving(s).pull(w, frame.clock, frame.since, self.now))
        elif name == FORWARD:
            replica = self.replicas[s]
            assert replica is not None
            if isinstance(frame, ps_server.Snapshot):
                # a second snapshot (its JOIN came twice) is ignored by a replica that has
                # the state up to it already
                if replica.restore(frame.index, frame.data):
                    self.stepped_to.pop(id(replica), None)
                else:
                    assert replica.has_state
                    assert replica.statistics().logged >= frame.index
            else:
                self._server(s, replica.log(frame.entry, self.now), replica=True)
        elif name == STEP:
            server = self.serving(s) if w == 0 else self.replicas[s]
            assert server is not None
            model = frame.model + frame.update  # the process's callback: the sum rule
            self._server(s, server.stepped(frame.version, model, self.now), replica=w == 1)
        elif name == LOGGED:
            primary = self.primaries[s]
            assert primary is not None
            self._server(s, primary.replicated_upto(frame.index, self.now))
        else:
            sim = self.workers[w]
            if isinstance(frame, ps_server.Acked):
                actions = sim.engine.pushed(s, frame.iteration, frame.version, frame.dropped)
            elif isinstance(frame, ps_server.Refuse):
                actions = sim.engine.refused(s, frame.clock, frame.reason)
            else:
                assert isinstance(frame, ps_server.Answer)
                if sim.call != "pull":
                    return  # nobody waits for it: the service drops it too
                self.answers += 1
                actions = sim.engine.pulled(s, frame.clock, frame.data, sim.cache)
            self._worker(w, actions)

    def _worker(self, w: int, actions: list[ps_worker.Action]) -> None:
        sim = self.workers[w]
        for action in actions:
            if isinstance(action, ps_worker.SendPush):
                self.bases[(w, action.iteration, action.shard)] = action.base
                self.links[(PUSH, w, action.shard)].append(action)
            elif isinstance(action, ps_worker.SendPull):
                self.links[(PULL, w, action.shard)].append(action)
            elif isinstance(action, ps_worker.PushDone):
                assert sim.call == "push", action
                if sim.pushes:
                    assert all(
                        a >= b
                        for a, b in zip(action.versions, sim.pushes[-1].versions, strict=True)
                    ), (sim.pushes[-1], action)
                sim.pushes.append(action)
                sim.call = None
            elif isinstance(action, ps_worker.PullDone):
                assert sim.call == "pull", action
                assert action.versions == tuple(sim.engine.versions)
                if sim.pulls:
                    assert all(
                        a >= b for a, b in zip(action.versions, sim.pulls[-1].versions, strict=True)
                    ), (sim.pulls[-1], action)
                sim.pulls.append(action)
                sim.call = None
            else:
                assert isinstance(action, ps_worker.PullFailed)
                assert sim.call == "pull", action
                assert sim.lost, action
                assert "lost" in action.reason, action
                sim.failed.append(action)
                sim.call = None
                sim.ops.clear()

    def _server(self, s: int, actions: list[ps_server.Action], *, replica: bool = False) -> None:
        server = self.replicas[s] if replica else self.serving(s)
        assert server is not None
        for action in actions:
            if isinstance(action, ps_server.Step):
                assert self.callback, action
                # one step at a time, in version order, from the published model (a flush
                # makes a version without one)
                last = self.stepped_to.get(id(server), (server, 0))[1]
                assert action.version > last, (last, action)
                assert action.version == server.store.version + 1, action
                self.stepped_to[id(server)] = (server, action.version)
                self.links[(STEP, 0 if server.primary else 1, s)].append(action)
            elif isinstance(action, ps_server.Forward | ps_server.Snapshot):
                self.links[(FORWARD, -1, s)].append(action)
            elif isinstance(action, ps_server.Logged):
                self.links[(LOGGED, -1, s)].append(action)
            elif isinstance(action, ps_server.Acked):
                self._record_ack(s, action)
                self.links[(ACK, action.worker, s)].append(action)
            elif isinstance(action, ps_server.Answer):
                if self.consistency is not Consistency.ASYNC:  # SSP's read rule (BSP: s = 0)
                    need = action.clock - self.staleness
                    assert server.coordinator.complete >= need, (action, need)
                self.links[(ANSWER, action.worker, s)].append(action)
            else:
                assert isinstance(action, ps_server.Refuse)
                self.links[(ANSWER, action.worker, s)].append(action)

    def _record_ack(self, s: int, ack: ps_server.Acked) -> None:
        key = (ack.worker, ack.iteration, s)
        seen = self.acked.setdefault(key, (ack.version, ack.dropped))
        assert seen == (ack.version, ack.dropped), f"{key} acknowledged as {seen} and {ack}"
        if ack.dropped is None:
            if self.consistency is Consistency.BSP:
                # one version per iteration, every shard's pushes of it in one; a flush adds one
                same = self.bsp_versions.setdefault((s, ack.iteration), ack.version)
                assert same == ack.version, (same, ack)
                assert ack.version == ack.iteration + 1 or self.flushes, ack
                assert ack.version >= ack.iteration + 1, ack
            if self.consistency is Consistency.ASYNC and self.delay_bound is not None:
                delay = ack.version - 1 - self.bases[key]
                assert delay <= self.delay_bound, (ack, delay)

    # -- checks at the end ----------------------------------------------------------------
    def applied(self, s: int) -> list[tuple[int, int]]:
        """The (worker, iteration) pushes shard ``s`` acknowledged as applied."""
        return sorted(
            (w, it) for (w, it, sh), (_, why) in self.acked.items() if sh == s and why is None
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
            for it in range(sim.engine.iteration):
                for s in range(len(self.bounds)):
                    gate_dropped = (w, it, s) not in self.bases
                    assert gate_dropped or (w, it, s) in self.acked, (w, it, s)
        for s in range(len(self.bounds)):
            server = self.serving(s)
            expected = self.expected(s)
            np.testing.assert_array_equal(server.filter.model, expected)
            np.testing.assert_array_equal(server.store.model, expected)
            applied = server.coordinator.statistics().applied
            assert applied == len(self.applied(s)), (applied, self.applied(s))
            replica = self.replicas[s]
            if self.primaries[s] is not None and replica is not None:
                primary = self.primaries[s]
                assert primary is not None
                assert not primary.statistics().unreplicated
                assert replica.version == primary.version
                np.testing.assert_array_equal(replica.store.model, primary.store.model)
                np.testing.assert_array_equal(replica.store.versions, primary.store.versions)
                np.testing.assert_array_equal(replica.filter.model, primary.filter.model)
                np.testing.assert_array_equal(replica.filter.published, primary.filter.published)
                assert replica.coordinator.complete == primary.coordinator.complete
        for sim in self.workers:
            if sim.lost:
                continue
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
