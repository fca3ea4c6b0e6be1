"""An in-process parameter-server fabric for the ps engine tests: :class:`Worker` engines and
:class:`ShardServer` engines (a primary per shard, and a replica if asked) wired together by
FIFO links that the test drives one frame at a time, without sockets.

The links are the ``ps`` service's: per worker and shard, pushes on a data link and pulls on a
control link to the server, acknowledgements on a control link and pull answers (and refusals)
on a data link back; per shard, the replica's snapshot (it joins at the start) and entries
on a data link to the replica and confirmations on a
control link back.  A test may deliver any link's next frame (once or twice), reset the links
between a worker and a shard (what is in flight is lost, and :meth:`Worker.resend` sends what
it must again, as the service does on ``peer_up``), reset the links to a replica (the primary
sends :meth:`ShardServer.unconfirmed` again), make a worker resend at any time, kill a
primary (its links and unconfirmed entries are lost, the replica is promoted, every worker
fails over; workers lost before are lost to the promoted replica too, as the service does),
and lose a worker.

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

from fabricd.engines import ps_server, ps_worker
from fabricd.engines.ps_consistency import Consistency, Sum
from fabricd.engines.ps_server import ShardServer
from fabricd.engines.ps_worker import Worker

Array = np.ndarray[Any, Any]
Frame = Any

#: link names; a link is (name, worker, shard) or, for replication, (name, -1, shard)
PUSH, PULL, ACK, ANSWER, FORWARD, LOGGED = "push", "pull", "ack", "answer", "forward", "logged"
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
    ) -> None:
        self.consistency = consistency
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

        def server(
            lo: int, hi: int, *, replica: bool = False, replicated: bool = False
        ) -> ShardServer:
            return ShardServer(
                initial=np.zeros(hi - lo),
                workers=range(workers),
                consistency=consistency,
                staleness=staleness,
                delay_bound=delay_bound if consistency is Consistency.ASYNC else None,
                rule=Sum(),
                chunk=chunk,
                replica=replica,
                replicated=replicated,
            )

        self.primaries: list[ShardServer | None] = [
            server(lo, hi, replicated=replicas) for lo, hi in self.bounds
        ]
        self.replicas: list[ShardServer | None] = [
            server(lo, hi, replica=True) if replicas else None for lo, hi in self.bounds
        ]
        self.links: dict[tuple[str, int, int], deque[Frame]] = {}
        for s in range(shards):
            for w in range(workers):
                for name in WORKER_LINKS:
                    self.links[(name, w, s)] = deque()
            if replicas:
                self.links[(FORWARD, -1, s)] = deque()
                self.links[(LOGGED, -1, s)] = deque()
        #: (worker, iteration, shard) -> (version, dropped) of its acknowledgement
        self.acked: dict[tuple[int, int, int], tuple[int, str | None]] = {}
        #: (worker, iteration, shard) -> the base it was pushed with
        self.bases: dict[tuple[int, int, int], int] = {}
        self.answers = 0  #: pull answers delivered
        if replicas:  # each replica joins: its primary sends it a snapshot, then entries
            for s, primary in enumerate(self.primaries):
                assert primary is not None
                self._server(s, primary.joined())

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
        for _ in range(2 if twice else 1):
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

    def kill(self, s: int) -> None:
        """Shard ``s``'s primary dies: its links go, its replica serves, workers fail over."""
        replica = self.replicas[s]
        if self.primaries[s] is None or replica is None or not replica.has_state:
            return  # no replica that could take over (the service fails the shard then)
        primary = self.primaries[s]
        assert primary is not None
        assert replica.version >= primary.version  # it logged (and applied) first
        seen = [d.versions[s] for sim in self.workers for d in sim.pushes]
        seen += [d.versions[s] for sim in self.workers for d in sim.pulls]
        assert replica.version >= max(seen, default=0)  # no version a worker saw is lost
        self.primaries[s] = None
        for key in self.links:
            if key[2] == s:
                self.links[key].clear()
        assert replica.promote()
        assert replica.primary
        assert replica.epoch == 1
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
        """Run every worker to the end of its loop, delivering in a fixed order."""
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
                assert replica.restore(frame.index, frame.data)
            else:
                self._server(s, replica.log(frame.entry, self.now), replica=True)
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
            if isinstance(action, ps_server.Forward | ps_server.Snapshot):
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
                assert ack.version == ack.iteration + 1, ack
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
        pull of every worker equal to the model."""
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
