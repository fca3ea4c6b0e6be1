"""A shard's model distribution trees (MLfabric §10.3): the pulls of one scheduling interval
answered together, at one version, some of them by pullers' daemons instead of the server.

Rules: under ``distribution="tree"`` (with ``scheduling="mlfabric"``) a pull the consistency
model lets the shard answer is not answered at once: it joins the shard's :class:`PullBatch`.
The batch opens with its first pull and is decided one scheduling interval later (§10.3:
"pull requests are batched per scheduling interval"), or at once when every live worker's
pull is in it (nothing more can come).  Deciding it plans
:func:`~fabricd.engines.scheduling.distribution.distribute` (Alg. 3's variant, ``k="auto"``,
per-branch deltas) over the monitor's figures and answers every pull at the shard's version
then:

* a pull the plan has the server send is answered as without a tree, with its own delta;
* a distributor's pull is answered with the delta from its *branch's* oldest cache (its own,
  its host's other workers', and those of the hosts it serves) and the list of pulls it
  forwards that same answer to (:class:`~fabricd.engines.ps.shard_actions.Answer`'s
  ``forward``); a delta from an older version applies at any cache at least that recent (the
  chunks it carries hold values, not increments: :func:`~fabricd.engines.ps.storage.
  apply_delta`);
* every pull a distributor answers is told so by a
  :class:`~fabricd.engines.ps.shard_actions.Notice` (a frame with no payload): which worker's
  daemon forwards it and within how long (the hop's planned end, plus
  ``max(RELAY_GRACE_MIN, 10 intervals)``).  The puller's daemon sends the pull again, marked
  *direct*, if the answer has not come by then or the distributor's daemon is gone; a direct
  pull is answered by the server at once.  So a distributor that dies, or a link that resets
  with the answer in flight, costs its pullers a delay, never an answer.

Choices where the paper is silent, and why:

* *Hosts, not workers, are the tree's pullers*: ``distribute`` plans one transfer per host (a
  distributor is a host that has the model).  Several workers on one host are one puller whose
  cache is their oldest: one answer crosses the link to the host, to its lowest worker rank,
  whose daemon hands it to the others (a local hand-over, no link).  Workers on the server's
  own host are answered straight (no link either).
* *The plan's network is the monitor's figures, nothing booked*: pulls flow out of the server
  and out of distributors, pushes into the server; the scheduler's booked pushes share no
  link direction with the server's answers, and a distributor's own push is one transfer.
* *One version per batch* is the shard's version when the batch is decided: a pull the
  consistency model released earlier gets a version at least as recent as it would have, which
  every consistency model allows (a pull's version is a lower bound).
* A pull the shard cannot place (its worker's host unknown) is answered straight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.ps.shard_actions import Answer, Notice
from fabricd.engines.scheduling.distribution import Puller, distribute
from fabricd.engines.scheduling.timelines import Network

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.engines.ps.consistency import Reply
    from fabricd.engines.ps.storage import TimedStore
    from fabricd.engines.scheduling.distribution import Hop

#: the least a puller waits past its hop's planned end before it asks the server straight
RELAY_GRACE_MIN: Final = 1.0
#: the most a puller waits for a distributor (a plan past it is a broken figure's)
MAX_EXPECT: Final = 600.0


@dataclass(frozen=True, slots=True)
class _Pull:
    worker: int
    clock: int
    since: int
    host: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeStatistics:
    """What a shard's trees did: batches decided, pulls answered through them, those another
    worker's daemon forwarded (a distributor's, or a host-mate's hand-over), and the bytes the
    server sent for them."""

    batches: int
    pulls: int
    forwarded: int
    server_bytes: int


class PullBatch:
    """One shard's batch of pulls and its trees (module docstring).

    Args:
        server: the node the shard's primary lives on.
        interval: seconds a batch gathers pulls (the scheduler's interval).
        unknown_bps: the bytes/s a host the monitor has no figures for is planned at.
    """

    def __init__(self, *, server: int, interval: float, unknown_bps: float) -> None:
        self.server = server
        self.interval = interval
        self.unknown_bps = unknown_bps
        self._batch: dict[int, _Pull] = {}  #: worker -> its pull in the batch
        self._hosts: dict[int, int] = {}  #: worker -> the node its last pull came from
        self._direct: set[int] = set()  #: workers whose pull now is to be answered straight
        self._straight: set[int] = set()  #: workers answered straight since the batch opened
        self._due: float | None = None
        self._batches = self._pulls = self._forwarded = self._server_bytes = 0

    def pulled(self, worker: int, host: int | None, *, direct: bool) -> None:
        """``worker``'s pull came from node ``host``; ``direct``: answer it straight."""
        if host is not None:
            self._hosts[worker] = host
        if direct:
            self._direct.add(worker)
            self._batch.pop(worker, None)

    def hold(self, reply: Reply, now: float, live: frozenset[int]) -> bool:
        """Whether the consistency model's ``reply`` to a pull joins the batch; ``False``:
        answer it now.  ``live``: the live workers (the batch is due at once when it holds a
        pull of each: no other can come)."""
        worker = reply.worker
        host = self._hosts.get(worker)
        if worker in self._direct or host is None or host == self.server:
            self._direct.discard(worker)
            self._straight.add(worker)
            self._due_if_all(live, now)
            return False
        self._batch[worker] = _Pull(worker, reply.clock, reply.since, host)
        if self._due is None:
            self._due = now + self.interval
        self._due_if_all(live, now)
        return True

    def _due_if_all(self, live: frozenset[int], now: float) -> None:
        """A batch is due at once when every live worker pulled (into it, or straight)."""
        if self._batch and live <= self._batch.keys() | self._straight:
            self._due = now

    def next_deadline(self) -> float | None:
        return self._due

    def clear(self) -> None:
        """Forget the batch (the shard's state was replaced: its workers pull again)."""
        self._batch.clear()
        self._direct.clear()
        self._straight.clear()
        self._due = None

    def decide(
        self,
        now: float,
        store: TimedStore,
        figures: Callable[[int], tuple[float, float] | None],
        live: frozenset[int],
    ) -> list[Answer | Notice]:
        """The batch's answers if its interval is over (module docstring); the pulls of
        workers no longer ``live`` are not answered (a lost worker is no distributor)."""
        if self._due is None or now < self._due:
            return []
        self._due = None
        self._straight.clear()
        pulls = [p for p in self._batch.values() if p.worker in live]
        self._batch = {}
        if not pulls:
            return []
        self._batches += 1
        version = store.version
        # a cache past the version (a restore rolled the shard back) gets the whole model
        pulls = [p if p.since <= version else _Pull(p.worker, p.clock, 0, p.host) for p in pulls]
        by_host: dict[int, list[_Pull]] = {}
        for pull in sorted(pulls, key=lambda p: p.worker):
            by_host.setdefault(pull.host, []).append(pull)
        pullers = [
            Puller(key=host, host=host, cached=min(p.since for p in group))
            for host, group in by_host.items()
        ]
        sizes: dict[int, float] = {}

        def delta(since: int) -> float:
            if since not in sizes:
                sizes[since] = float(min(store.sizes(since).values()))
            return sizes[since]

        plan = distribute(
            pullers,
            self._network(now, by_host, figures),
            server=self.server,
            version=version,
            whole=delta(0),
            delta=delta,
            k="auto",
            policy="delta",
        )
        return self._answers(now, plan.hops, by_host, store)

    def _answers(
        self, now: float, hops: list[Hop], by_host: dict[int, list[_Pull]], store: TimedStore
    ) -> list[Answer | Notice]:
        version = store.version
        sender = {hop.puller.host: hop.sender for hop in hops}
        ends = {hop.puller.host: hop.end for hop in hops}
        branches: dict[int, list[_Pull]] = {}  #: a distributor's host -> the pulls it serves
        for host, by in sender.items():
            if by != self.server:
                branches.setdefault(by, []).extend(by_host[host])
        grace = max(RELAY_GRACE_MIN, 10 * self.interval)
        out: list[Answer | Notice] = []
        for host, group in by_host.items():
            if sender[host] != self.server:
                continue  # answered through its distributor's branch
            lead, *served = group  # the host's other workers: a hand-over on their host
            served += branches.get(host, [])
            since = min(p.since for p in (lead, *served))
            forward = tuple((p.worker, p.clock) for p in served)
            self._forwarded += len(served)
            for pull in served:  # (the notices first: a host-mate's goes on the lead's link)
                expect = min(max(ends[pull.host] - now, 0.0), MAX_EXPECT) + grace
                out.append(
                    Notice(
                        worker=pull.worker,
                        clock=pull.clock,
                        version=version,
                        via=lead.worker,
                        expect=expect,
                    )
                )
            out.append(self._answer(lead, store.pull(since), version, forward))
        self._pulls += sum(len(g) for g in by_host.values())
        return out

    def _answer(
        self, pull: _Pull, data: bytearray, version: int, forward: tuple[tuple[int, int], ...] = ()
    ) -> Answer:
        self._server_bytes += len(data)
        return Answer(
            worker=pull.worker, clock=pull.clock, version=version, data=data, forward=forward
        )

    def _network(
        self,
        now: float,
        by_host: dict[int, list[_Pull]],
        figures: Callable[[int], tuple[float, float] | None],
    ) -> Network:
        up: dict[int, float] = {}
        down: dict[int, float] = {}
        for host in {self.server, *by_host}:
            known = figures(host)
            up[host], down[host] = known if known is not None else (self.unknown_bps,) * 2
        return Network(up, down, now=now)

    def statistics(self) -> TreeStatistics:
        return TreeStatistics(
            batches=self._batches,
            pulls=self._pulls,
            forwarded=self._forwarded,
            server_bytes=self._server_bytes,
        )
