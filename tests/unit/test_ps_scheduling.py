"""MLfabric scheduling of a parameter server's pushes (fabricd/engines/ps/scheduler.py, and
the READY/GRANT path through the worker, shard and node engines) without sockets: the
in-process fabric of ``ps_fabric`` with ``scheduling="mlfabric"``, under arbitrary
interleavings, resends, duplicates, resets and failovers, and the scheduler alone under a fake
clock.

What must hold (issue 24): an update is applied exactly once or reported dropped to its
worker, never both, never neither; nothing applied breaks the delay bound; the pushes a batch
grants go out at their planned starts (time-shared), and what cannot make its deadline is
dropped before it is sent.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps.consistency import Consistency
from fabricd.engines.ps.scheduler import Denied, Granted, ShardScheduler
from fabricd.errors import RemoteProtocolError
from fabricd.frames import ps as ps_frames
from tests.unit.ps_fabric import Fabric
from tests.unit.test_ps_server import moves, run

#: bytes/s of the links in the fabric tests: a push of a few parameters takes a fraction of the
#: fabric's one second per delivered frame, so plans overlap deliveries
FIGURES = st.sampled_from([None, 50.0, 200.0, 1e6])


def scheduled(
    *,
    bound: int | None,
    replicas: bool,
    figures: dict[int, tuple[float, float]],
    aggregation: bool = False,
    interval: float = 0.5,
    consistency: Consistency = Consistency.ASYNC,
) -> Fabric:
    fabric = Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=4,
        consistency=consistency,
        delay_bound=bound,
        replicas=replicas,
        scheduled=True,
        aggregation=aggregation,
        interval=interval,
    )
    fabric.figures.update(figures)
    return fabric


def settle(fabric: Fabric) -> None:
    fabric.drain()
    fabric.check_settled()


def outcomes(fabric: Fabric) -> tuple[int, int, int]:
    """(pushes made, shard pushes applied, shard pushes dropped) over every worker's results."""
    shards = len(fabric.bounds)
    made = applied = dropped = 0
    for sim in fabric.workers:
        for done in sim.pushes:
            made += 1
            dropped += len(done.dropped)
            applied += shards - len(done.dropped)
    return made, applied, dropped


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(st.none(), st.integers(0, 3)),
    st.booleans(),
    st.lists(st.tuples(FIGURES, FIGURES), min_size=7, max_size=7),
    st.data(),
)
def test_each_update_applied_once_or_dropped_under_any_interleaving(
    bound: int | None,
    replicas: bool,
    links: list[tuple[float | None, float | None]],
    data: st.DataObject,
) -> None:
    """Resends, duplicates, resets and (with replicas) a dying primary at any point, over
    links of any speed: every push of every worker is acknowledged by every shard, applied
    exactly once or dropped (the fabric checks acknowledgements never disagree and no applied
    update breaks the bound), and the model is the sum of what was applied."""
    figures = {n: (up or 1e6, down or 1e6) for n, (up, down) in enumerate(links)}
    fabric = scheduled(bound=bound, replicas=replicas, figures=figures)
    run(fabric, data.draw(moves(3, 2, failover=replicas)))
    settle(fabric)
    made, applied, dropped = outcomes(fabric)
    assert made == sum(sim.rounds for sim in fabric.workers)
    assert applied + dropped == made * len(fabric.bounds)
    for s in range(len(fabric.bounds)):
        assert fabric.serving(s).coordinator.statistics().applied == len(fabric.applied(s))
    for sim in fabric.workers:
        for done in sim.pushes:
            assert all("dropped by the scheduler" in w or "delay" in w for w in done.dropped)


def test_a_push_waits_for_its_grant_and_goes_once_granted() -> None:
    """Under scheduling the worker sends a READY, not the push; the push goes only after the
    shard's batch was decided (its interval), and is then applied."""
    fabric = scheduled(bound=None, replicas=False, figures={})
    fabric.step(0)  # pull
    while fabric.deliver(0):
        pass
    fabric.step(0)  # push
    sent = [f for (kind, src, _), q in fabric.links.items() if src == 0 for f, _ in q]
    assert sent
    assert all(isinstance(f, ps_frames.Ready) for f in sent)
    assert not any(isinstance(f, ps_frames.Push) for f in sent)
    assert fabric.deliver(0)  # one READY reaches its shard: it waits for the interval
    waiting = [fabric.serving(s).scheduler.statistics().waiting for s in range(2)]  # type: ignore[union-attr]
    assert sorted(waiting) == [0, 1]
    assert not any(isinstance(f, ps_frames.Push) for q in fabric.links.values() for f, _ in q)
    for _ in range(100):
        if fabric.workers[0].call is None or not (fabric.deliver(0) or fabric.tick()):
            break
    assert fabric.workers[0].call is None
    assert fabric.workers[0].pushes
    assert not fabric.workers[0].pushes[0].dropped
    for s in range(2):
        assert fabric.serving(s).coordinator.statistics().applied == 1
        assert fabric.serving(s).scheduler.statistics().granted == 1  # type: ignore[union-attr]


# -- the scheduler alone ----------------------------------------------------------------------
def test_scheduler_batches_an_interval_and_paces_what_shares_the_server_link() -> None:
    """Two updates ready in one interval: both granted when it ends; the server's downlink
    carries one after the other, so one of them waits for the other's transfer."""
    scheduler = ShardScheduler(server=9, delay_bound=None, interval=0.1)
    assert scheduler.ready(0, 0, 0, 1000, 1.0, host=1, now=0.0) == []
    assert scheduler.ready(1, 0, 0, 1000, 1.0, host=2, now=0.05) == []
    assert scheduler.next_deadline() == pytest.approx(0.1)
    assert scheduler.on_timer(0.09, 0, lambda host: (1e6, 1e6)) == []
    decided = scheduler.on_timer(0.1, 0, lambda host: (1e6, 1e4))  # the server's down: 10 kB/s
    grants = sorted((d for d in decided if isinstance(d, Granted)), key=lambda g: g.wait)
    assert [g.worker for g in grants] in ([0, 1], [1, 0])
    assert grants[0].wait == pytest.approx(0.0)
    assert grants[1].wait == pytest.approx(0.1, rel=0.05)  # 1000 B at 10 kB/s
    stats = scheduler.statistics()
    assert (stats.ready, stats.granted, stats.batches, stats.outstanding) == (2, 2, 1, 2)
    assert stats.latency_max == pytest.approx(0.1)
    scheduler.settled(0, 0)
    assert scheduler.statistics().outstanding == 1


def test_scheduler_drops_what_cannot_make_its_deadline() -> None:
    """MLfabric §5.1.3's Fig. 5: an update behind a slow link (10 Mbit/s) that must be applied
    first, and a fresher one behind a fast one (90 Mbit/s) that would finish before it: the
    slow one is dropped at its worker (a Denied, with the reason), the fast one granted."""
    scheduler = ShardScheduler(server=9, delay_bound=2, interval=0.1)
    mbit = 1e6 / 8
    figures = {1: (10 * mbit, 100 * mbit), 2: (90 * mbit, 100 * mbit), 9: (100 * mbit, 100 * mbit)}
    # the model is at version 4: worker 0's update (from 2) must be applied first (dl = 1)
    scheduler.ready(0, 0, 2, 12_500_000, 1.0, host=1, now=0.0)
    scheduler.ready(1, 0, 4, 12_500_000, 1.0, host=2, now=0.0)
    decided = scheduler.on_timer(0.1, 4, figures.get)
    denied = [d for d in decided if isinstance(d, Denied)]
    granted = [d for d in decided if isinstance(d, Granted)]
    assert [(d.worker, d.iteration, d.base) for d in denied] == [(0, 0, 2)]
    assert "dropped by the scheduler" in denied[0].reason
    assert [g.worker for g in granted] == [1]
    assert scheduler.statistics().denied


def test_a_ready_sent_again_for_a_granted_update_is_granted_at_once() -> None:
    scheduler = ShardScheduler(server=9, delay_bound=None, interval=0.1)
    scheduler.ready(0, 3, 0, 100, 1.0, host=1, now=0.0)
    [granted] = scheduler.on_timer(0.1, 0, lambda host: None)
    assert isinstance(granted, Granted)
    again = scheduler.ready(0, 3, 0, 100, 1.0, host=1, now=0.5)
    assert again == [Granted(worker=0, iteration=3, wait=0.0)]
    assert scheduler.statistics().ready == 1  # not counted twice


def test_a_grant_whose_push_never_comes_stops_counting() -> None:
    """A granted push that never arrives (its worker died) counts towards v_init only until
    its planned end plus the grace: later deadlines are not tightened for ever."""
    scheduler = ShardScheduler(server=9, delay_bound=0, interval=0.1)
    scheduler.ready(0, 0, 0, 100, 1.0, host=1, now=0.0)
    scheduler.on_timer(0.1, 0, lambda host: None)
    assert scheduler.statistics().outstanding == 1
    # while it counts, an update from version 0 under tau_max 0 cannot be applied: dl = -0
    scheduler.ready(1, 0, 0, 100, 1.0, host=2, now=0.2)
    [denied] = scheduler.on_timer(0.35, 0, lambda host: None)
    assert isinstance(denied, Denied)
    scheduler.ready(1, 1, 0, 100, 1.0, host=2, now=5.0)
    [granted] = scheduler.on_timer(5.1, 0, lambda host: None)  # the grant expired meanwhile
    assert isinstance(granted, Granted)
    assert scheduler.statistics().outstanding == 1


def test_a_lost_worker_is_forgotten() -> None:
    scheduler = ShardScheduler(server=9, delay_bound=None, interval=0.1)
    scheduler.ready(0, 0, 0, 100, 1.0, host=1, now=0.0)
    scheduler.ready(1, 0, 0, 100, 1.0, host=2, now=0.0)
    scheduler.lose(0)
    decided = scheduler.on_timer(0.1, 0, lambda host: None)
    assert [d.worker for d in decided] == [1]


# -- found in review ---------------------------------------------------------------------------
def test_a_float16_push_is_ready_with_a_finite_norm() -> None:
    """A float16 shard's sum of squares overflows float16 at 65504: the norm is taken in
    float64, or the READY is refused as malformed and sent again for ever."""
    from fabricd.engines.ps.worker import SendReady, Worker

    worker = Worker(worker=0, size=1000, dtype="float16", shards=1, scheduled=True)
    [ready] = worker.push(np.full(1000, 10.0, np.float16))
    assert isinstance(ready, SendReady)
    assert ready.norm == pytest.approx(316.2, rel=1e-3)


def test_a_later_ready_replaces_an_earlier_one_the_scheduler_still_holds() -> None:
    """A worker has one push at a time: its next iteration says the last was decided (the
    scheduler may still hold its grant); an earlier one after a later is a protocol error."""
    scheduler = ShardScheduler(server=9, delay_bound=None, interval=0.1)
    scheduler.ready(0, 3, 0, 100, 1.0, host=1, now=0.0)
    scheduler.on_timer(0.1, 0, lambda host: None)
    scheduler.ready(0, 4, 0, 100, 1.0, host=1, now=0.2)
    assert scheduler.statistics().outstanding == 0
    with pytest.raises(RemoteProtocolError):
        scheduler.ready(0, 2, 0, 100, 1.0, host=1, now=0.3)


def test_a_ready_larger_than_a_frame_is_refused() -> None:
    fabric = scheduled(bound=None, replicas=False, figures={})
    server = fabric.nodes[fabric.servers[0]]
    ready = ps_frames.Ready(
        job="job",
        name="m",
        shard=0,
        server=fabric.servers[0],
        worker=0,
        iteration=0,
        base=0,
        epoch=0,
        size=(1 << 20) + 1,
        norm=1.0,
        spec=fabric.spec,
    )
    with pytest.raises(RemoteProtocolError, match="READY"):
        server.on_frame(0, ready, b"", 0.0)


def test_a_promoted_replica_plans_afresh() -> None:
    """What a shard's scheduler planned while it last served is void once another rank
    served it: a rank promoted again starts with nothing planned (else an honest worker's
    next READY would meet its stale grant)."""
    from fabricd.engines.ps.consistency import Sum
    from fabricd.engines.ps.server import ShardServer

    replica = ShardServer(
        initial=np.zeros(2),
        workers=range(2),
        consistency=Consistency.ASYNC,
        rule=Sum(),
        replica=True,
        scheduler=ShardScheduler(server=9, delay_bound=None, interval=0.1),
    )
    assert replica.scheduler is not None
    replica.scheduler.ready(0, 0, 0, 10, 1.0, host=1, now=0.0)
    old = replica.scheduler
    replica.has_state = True
    assert replica.promote()
    assert replica.scheduler is not old
    assert replica.scheduler.statistics().waiting == 0
