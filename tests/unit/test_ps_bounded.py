"""Bounded-divergence replication of a parameter-server shard (MLfabric §3.3, §5.3;
fabricd/engines/ps/bounded.py): the primary leads its replica by at most the bound, recomputed
from the models themselves at every step; the replica applies every entry exactly once, in the
primary's order, whether the worker's copy or the order entry comes first or the copy is lost;
a failover loses at most what the bound allows and tells every worker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps.bounded import MAX_LEAD, NEED_AFTER, DivergenceBound, Lead
from fabricd.engines.ps.consistency import SGD, Consistency, Sum
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.shard_actions import Acked, Answer, Forward, Logged, Need, Snapshot, Step
from fabricd.engines.ps.worker import SendPull, Worker
from fabricd.engines.scheduling.replication import divergence
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.frames import ps as ps_frames
from tests.unit.ps_fabric import KEY, Fabric
from tests.unit.test_ps_server import moves, ones, payload, run

SIZE = 4


def bounded_pair(
    bound: DivergenceBound, *, rule: Any = None, workers: int = 3
) -> tuple[ShardServer, ShardServer]:
    """A primary and its replica under ``bound``, joined."""

    def make(**kw: Any) -> ShardServer:
        return ShardServer(
            initial=np.zeros(SIZE),
            workers=range(workers),
            consistency=Consistency.ASYNC,
            rule=Sum() if rule is None else rule(),
            bound=bound,
            **kw,
        )

    primary, replica = make(replicated=True), make(replica=True)
    [snapshot] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert replica.restore(snapshot.index, snapshot.data)
    return primary, replica


def forwards(actions: list[Any]) -> list[Forward]:
    return [a for a in actions if isinstance(a, Forward)]


def acks(actions: list[Any]) -> list[Acked]:
    return [a for a in actions if isinstance(a, Acked)]


# -- the bound --------------------------------------------------------------------------------
def test_a_bound_needs_a_norm_or_a_count_of_sane_values() -> None:
    for bad in ({}, {"norm": 0.0}, {"norm": float("inf")}, {"updates": 0}, {"norm": True}):
        with pytest.raises(UsageError):
            DivergenceBound(**bad)
    with pytest.raises(UsageError):
        DivergenceBound(updates=MAX_LEAD + 1)
    assert DivergenceBound.from_spec([2.0, None]) == DivergenceBound(norm=2.0)
    with pytest.raises(UsageError):
        DivergenceBound.from_spec([1.0])


def test_the_lead_allows_what_eq_10_bounds_under_momentum() -> None:
    lead = Lead(DivergenceBound(norm=3.0), momentum=0.5)
    lead.applied(1, 1, 1.0, 1.0)  # ||s_1|| = ||u_1|| = 1
    assert lead.divergence() == pytest.approx(divergence(0.0, [1.0], 0.5))
    # one more of norm 1: (1 + 0.5) * 1 + 1 = 2.5 <= 3; of norm 2: 3.5 > 3
    assert lead.allows(2, 1, 1.0)
    assert not lead.allows(2, 1, 2.0)
    lead.confirm(1)
    assert lead.lag == 0
    assert lead.divergence() == 0.0
    # the history carries on: the next step may be gamma ||h|| + ||u|| = 0.5 + 2.5 <= 3
    assert lead.allows(2, 1, 2.5)
    assert not lead.allows(2, 1, 2.6)
    assert lead.allows(1, 1, 99.0)  # an entry the replica applied already leads nothing


def test_a_norm_bound_with_an_update_callback_is_refused() -> None:
    with pytest.raises(UsageError, match="callback"):
        ShardServer(
            initial=np.zeros(SIZE),
            workers=range(2),
            consistency=Consistency.ASYNC,
            rule=None,
            bound=DivergenceBound(norm=1.0),
        )


# -- the primary ------------------------------------------------------------------------------
def test_the_primary_applies_within_the_bound_and_holds_beyond_it() -> None:
    primary, replica = bounded_pair(DivergenceBound(norm=5.0))  # ||ones|| = 2
    first = primary.push(0, 0, 0, ones(), 0.0)
    [order] = forwards(first)
    assert order.entry.copied
    assert not order.entry.payload
    assert acks(first)[0].version == 1  # applied at once: lead 2 <= 5
    assert acks(primary.push(1, 0, 0, ones(), 0.0))[0].version == 2  # lead 4
    held = primary.push(2, 0, 0, ones(), 0.0)  # lead 6 > 5: waits for the replica
    assert acks(held) == []
    assert primary.version == 2
    assert primary.statistics().lag == 2
    assert primary.statistics().divergence == pytest.approx(4.0)
    assert any("divergence bound" in w for w in primary.waiting_for())
    replica.copy(0, 0, 0, ones(), 0.0)
    [logged] = replica.log(order.entry, 0.0)
    assert logged == Logged(index=1)
    [ack] = acks(primary.replicated_upto(1, 0.0))
    assert (ack.worker, ack.version) == (2, 3)


def test_an_update_beyond_the_bound_alone_waits_for_the_replica_to_apply_it_first() -> None:
    primary, replica = bounded_pair(DivergenceBound(norm=1.0))
    out = primary.push(0, 0, 0, ones(), 0.0)
    assert acks(out) == []
    assert primary.version == 0
    replica.copy(0, 0, 0, ones(), 0.0)
    assert replica.log(forwards(out)[0].entry, 0.0) == [Logged(index=1)]
    assert replica.version == 1  # the replica first: the chain's order, for this entry
    assert acks(primary.replicated_upto(1, 0.0))[0].version == 1


def test_a_count_bound_caps_the_lead_in_updates() -> None:
    primary, _ = bounded_pair(DivergenceBound(updates=1))
    assert acks(primary.push(0, 0, 0, ones(), 0.0))
    assert acks(primary.push(1, 0, 0, ones(), 0.0)) == []
    assert primary.statistics().lag == 1


def test_the_replica_asks_for_an_entry_whose_copy_never_comes() -> None:
    primary, replica = bounded_pair(DivergenceBound(updates=4))
    [order] = forwards(primary.push(0, 0, 0, ones(), 0.0))
    assert replica.log(order.entry, 0.0) == []  # waits for the copy
    assert replica.next_deadline() == NEED_AFTER
    assert replica.on_timer(NEED_AFTER / 2, lambda _: None) == []
    assert replica.on_timer(NEED_AFTER, lambda _: None) == [Need(index=1)]
    assert replica.next_deadline() == 3 * NEED_AFTER  # asked again later, after twice as long
    [whole] = forwards(primary.needed(1))
    assert whole.entry.payload
    assert not whole.entry.copied
    assert replica.log(whole.entry, NEED_AFTER) == [Logged(index=1)]
    assert replica.copy(0, 0, 0, ones(), 2.0) == []  # the late copy: decided already
    np.testing.assert_array_equal(replica.store.model, primary.store.model)
    assert replica.next_deadline() is None


def test_a_copy_of_another_base_or_a_malformed_one_is_not_taken() -> None:
    primary, replica = bounded_pair(DivergenceBound(updates=4))
    with pytest.raises(RemoteProtocolError):
        replica.copy(0, 0, 0, payload(1.0), 0.0)  # the wrong size
    replica.copy(0, 0, 5, ones(), 0.0)  # not the push the primary takes (base 0)
    [order] = forwards(primary.push(0, 0, 0, ones(), 0.0))
    assert replica.log(order.entry, 0.0) == []
    assert replica.version == 0


def test_a_copied_entry_with_a_payload_is_refused() -> None:
    primary, replica = bounded_pair(DivergenceBound(updates=4))
    [order] = forwards(primary.push(0, 0, 0, ones(), 0.0))
    bad = type(order.entry)(
        index=1, kind="push", worker=0, iteration=0, payload=ones(), copied=True
    )
    with pytest.raises(RemoteProtocolError):
        replica.log(bad, 0.0)


# -- failover ---------------------------------------------------------------------------------
def test_a_promoted_replica_drops_pushes_from_versions_it_never_had_and_answers_whole() -> None:
    primary, replica = bounded_pair(DivergenceBound(updates=4))
    primary.push(0, 0, 0, ones(), 0.0)
    primary.push(1, 0, 0, ones(), 0.0)
    assert primary.version == 2
    assert replica.promote()  # nothing came: the replica is at version 0
    assert replica.rolled_back == 0
    [ack] = acks(replica.push(2, 0, 2, ones(), 1.0))  # computed from version 2: rolled back
    assert ack.dropped is not None
    assert "rolled" in ack.dropped
    assert ack.version == 0
    assert replica.push(2, 0, 2, ones(), 1.0) == [ack]  # sent again: the same answer
    [answer] = replica.pull(0, 1, 2, 1.0)  # a cache of version 2: answered whole
    assert isinstance(answer, Answer)
    assert answer.version == 0
    assert len(answer.data) > SIZE * 8  # every value
    assert acks(replica.push(2, 1, 0, ones(), 1.0))[0].version == 1  # the worker goes on


def test_a_worker_moved_under_bounded_replication_pulls_whole() -> None:
    worker = Worker(worker=0, size=SIZE, dtype="float64", shards=1)
    worker.versions[0] = 7
    worker.pull()
    [again] = worker.move(0, 1, forget=True)
    assert isinstance(again, SendPull)
    assert again.since == 0
    assert worker.versions == [7]  # what the cache holds (the next pushes' base) until answered


# -- properties, on the whole fabric ------------------------------------------------------------
BOUNDS = st.sampled_from([[60.0, None], [None, 1], [None, 3], [400.0, 2], [1e6, None]])


def bounded(bound: list[Any]) -> Fabric:
    return Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=3,
        consistency=Consistency.ASYNC,
        replicas=True,
        divergence_bound=bound,
    )


def check_lead(fabric: Fabric, bound: list[Any]) -> None:
    """Recompute, from the two models, how far each primary leads its replica."""
    norm, updates = bound
    for s in range(2):
        primary, replica = fabric.serving(s), fabric.follower(s)
        if (
            replica is None
            or replica.primary  # a rank back from the dead, tentative until it hears the epoch
            or not replica.has_state
            or replica.epoch != primary.epoch
            or not primary.replicated
        ):
            continue
        lag = primary.statistics().coordinator.applied - replica.statistics().coordinator.applied
        if lag <= 0:
            continue  # the replica is level or ahead (it applied first what the primary holds)
        if updates is not None:
            assert lag <= updates
        if norm is not None:
            assert np.linalg.norm(primary.filter.model - replica.filter.model) <= norm * (1 + 1e-12)


@settings(max_examples=80)
@given(BOUNDS, st.data())
def test_the_replica_never_lags_past_the_bound_and_applies_everything_once(
    bound: list[Any], data: st.DataObject
) -> None:
    fabric = bounded(bound)
    for move in data.draw(moves(3, 2, failover=False)):
        run(fabric, [move])
        check_lead(fabric, bound)
    fabric.drain()
    fabric.check_settled()  # every push once, the replica equal to its primary


@settings(max_examples=80)
@given(BOUNDS, st.data())
def test_a_failover_loses_at_most_the_bound_and_tells_every_worker(
    bound: list[Any], data: st.DataObject
) -> None:
    fabric = bounded(bound)
    run(fabric, data.draw(moves(3, 2, failover=False)))
    replica = fabric.follower(0)
    assert replica is not None
    while not replica.has_state:
        fabric.deliver(0)
    primary = fabric.serving(0)
    behind = primary.statistics().coordinator.applied - replica.statistics().coordinator.applied
    fabric.kill(0)
    model, _ = fabric.killed_models[0]
    if behind > 0:  # what the promoted replica lost is within the bound
        norm, updates = bound
        assert updates is None or behind <= updates
        assert norm is None or np.linalg.norm(model - replica.filter.model) <= norm * (1 + 1e-12)
    moved = [w.engine.epochs[0] for w in fabric.workers]
    assert moved == [1, 1, 1]  # every worker's daemon heard the epoch change
    run(fabric, data.draw(moves(3, 2, failover=False)))
    fabric.drain()
    fabric.check_settled()  # nothing applied twice; what survived is in the model


def test_sgd_with_momentum_keeps_the_bound_on_the_models() -> None:
    """Under momentum the history counts: the lead recomputed from the models stays within
    Div_max while pushes flow."""
    norm = 0.05
    primary, replica = bounded_pair(
        DivergenceBound(norm=norm), rule=lambda: SGD(lr=0.01, momentum=0.9)
    )
    orders = []
    for it in range(6):
        for w in range(3):
            out = primary.push(w, it, primary.version, ones(1.0 + w), float(it))
            orders += forwards(out)
            diff = np.linalg.norm(primary.filter.model - replica.filter.model)
            assert diff <= norm * (1 + 1e-12)
        # the replica catches up with this round's entries
        for order in orders:
            entry = order.entry
            replica.copy(entry.worker, entry.iteration, entry.base, ones(1.0 + entry.worker), it)
            for action in replica.log(order.entry, float(it)):
                if isinstance(action, Logged):
                    primary.replicated_upto(action.index, float(it))
        orders.clear()
    assert primary.version == replica.version == 18
    np.testing.assert_allclose(primary.filter.model, replica.filter.model)


@settings(max_examples=40)
@given(st.sampled_from([[None, 2], [1e6, None]]), st.data())
def test_bounded_replication_under_scheduling_and_aggregation(
    bound: list[Any], data: st.DataObject
) -> None:
    """MLfabric-A with aggregation and a bounded replica: an aggregate's entry travels whole
    (no copies are sent for pushes that go via an aggregator), a member sent straight after
    its wait is copied, and every update reaches the replica once."""
    fabric = Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=4,
        consistency=Consistency.ASYNC,
        replicas=True,
        scheduled=True,
        aggregation=True,
        interval=6.0,
        divergence_bound=bound,
    )
    for server in (3, 4, 5, 6):  # the servers' and replicas' downlinks slow: Alg. 3 groups
        fabric.figures[server] = (1e6, 30.0)
    for move in data.draw(moves(3, 2, failover=False)):
        run(fabric, [move])
        check_lead(fabric, bound)
    fabric.drain()
    fabric.check_settled()


def test_pushes_via_an_aggregator_send_the_replica_no_copy() -> None:
    fabric = Fabric(
        workers=3,
        shards=1,
        size=5,
        rounds=6,
        consistency=Consistency.ASYNC,
        replicas=True,
        scheduled=True,
        aggregation=True,
        interval=6.0,
        divergence_bound=[None, 4],
    )
    fabric.figures[3] = fabric.figures[4] = (1e6, 30.0)
    copies = via = 0
    original = fabric._check_frame

    def count(at: int, frame: Any) -> None:
        nonlocal copies, via
        if isinstance(frame, ps_frames.Push) and frame.copy:
            copies += 1
        elif isinstance(frame, ps_frames.Push) and frame.group is not None:
            via += 1
        original(at, frame)

    fabric._check_frame = count  # type: ignore[method-assign]
    for _ in range(60):
        for w in range(3):
            fabric.step(w)
        if not fabric.deliver(0):
            fabric.tick()
    fabric.drain()
    fabric.check_settled()
    assert via > 0  # groups formed
    assert copies > 0  # the straight pushes were copied
    assert copies <= 3 * 6 - via  # and none of those that went via an aggregator


def test_a_step_answer_for_a_state_a_snapshot_replaced_is_ignored() -> None:
    """Found by a random run with update callbacks: the replica's process runs the step of
    version 1 while the primary, ahead within the bound, sends a snapshot of version 2 (the
    replica asked to join again after a reset); the replica takes it, and the process's late
    answer for version 1 is dropped instead of refused (it would break the process's serve())
    or taken (it was computed from a replaced model)."""

    def make(**kw: Any) -> ShardServer:
        return ShardServer(
            initial=np.zeros(SIZE),
            workers=range(3),
            consistency=Consistency.ASYNC,
            rule=None,
            bound=DivergenceBound(updates=2),
            **kw,
        )

    primary, replica = make(replicated=True), make(replica=True)
    [snapshot] = primary.joined()
    assert replica.restore(snapshot.index, snapshot.data)  # type: ignore[union-attr]

    def step(server: ShardServer, actions: list[Any]) -> list[Any]:
        out = []
        for action in actions:
            if isinstance(action, Step):
                out += server.stepped(action.version, action.model + action.update, 0.0)
        return out

    first = primary.push(0, 0, 0, ones(), 0.0)
    step(primary, first)
    order = forwards(first)[0].entry
    replica.copy(0, 0, 0, ones(), 0.0)
    [pending] = [a for a in replica.log(order, 0.0) if isinstance(a, Step)]  # not answered yet
    step(primary, primary.push(1, 0, 1, ones(), 0.0))
    assert primary.version == 2  # two ahead of the replica: the bound allows it
    [again, *_] = primary.joined()  # the replica joins again (a reset): a snapshot at entry 2
    assert isinstance(again, Snapshot)
    assert again.index == 2
    assert replica.restore(again.index, again.data)
    assert replica.stepped(pending.version, pending.model + pending.update, 1.0) == []
    assert replica.version == 2
    np.testing.assert_array_equal(replica.store.model, primary.store.model)
    with pytest.raises(UsageError):  # a version never asked for is still refused
        replica.stepped(7, np.zeros(SIZE), 1.0)


@settings(max_examples=60)
@given(st.sampled_from([[None, 1], [None, 3]]), st.booleans(), st.booleans(), st.data())
def test_kills_joins_and_callbacks_at_any_point_lose_only_what_the_bound_allows(
    bound: list[Any], callback: bool, late: bool, data: st.DataObject
) -> None:
    """Primaries killed again and again, dead ranks back as replicas, late replicas, update
    callbacks in the servers' processes: the lead stays within the bound while a replica
    follows, and at the end every update survives once or was lost to a rollback."""
    fabric = Fabric(
        workers=3,
        shards=2,
        size=5,
        rounds=3,
        consistency=Consistency.ASYNC,
        replicas=True,
        callback=callback,
        late_join=late,
        divergence_bound=bound,
    )
    for move in data.draw(moves(3, 2, failover=True, joins=True)):
        run(fabric, [move])
        check_lead(fabric, bound)
    fabric.drain()
    fabric.check_settled()


# -- the review's findings --------------------------------------------------------------------
def test_a_shard_alone_leads_nobody_and_a_rejoined_replica_starts_level() -> None:
    """With its replica lost a primary keeps no lead (it grew by one per push, for ever, and
    held the first push after the replica came back); the snapshot a replica rejoins with
    makes it level."""
    primary, replica = bounded_pair(DivergenceBound(updates=2))
    primary.replica_lost(0.0)
    for it in range(50):
        assert acks(primary.push(0, it, primary.version, ones(), 0.0))
    stats = primary.statistics()
    assert (stats.lag, stats.divergence) == (0, 0.0)
    [snapshot, *_] = primary.joined()
    assert isinstance(snapshot, Snapshot)
    assert replica.restore(snapshot.index, snapshot.data)
    assert acks(primary.push(1, 0, primary.version, ones(), 1.0))  # applied at once
    assert primary.statistics().lag == 1


def test_only_the_shards_partner_confirms_or_replicates() -> None:
    """A worker's node forging a REPLICATED (which would clear the lead) or a REPLICATE as
    the primary is dropped and counted; the primary stays within the bound."""
    fabric = bounded([None, 1])
    node = fabric.nodes[fabric.servers[0]]
    primary = fabric.serving(0)
    for _ in range(200):
        for w in range(3):
            fabric.step(w)
        if primary.statistics().lag or not fabric.deliver(0):
            break
    version = primary.version
    dropped = node.counters["ps_frames_dropped"]
    forged = ps_frames.Replicated(
        job=KEY[0], name=KEY[1], shard=0, server=fabric.servers[0], replica=1, index=10**6
    )
    node.on_frame(1, forged, b"", fabric.now)
    assert node.counters["ps_frames_dropped"] == dropped + 1
    assert primary.version == version
    replica_node = fabric.nodes[fabric.replica_ranks[0]]
    dropped = replica_node.counters["ps_frames_dropped"]
    entry = ps_frames.Replicate(
        job=KEY[0],
        name=KEY[1],
        shard=0,
        server=2,  # a worker, not the primary
        replica=fabric.replica_ranks[0],
        index=1,
        entry="lose",
        worker=0,
        iteration=0,
        base=0,
        spec=fabric.spec,
        reason="forged",
    )
    replica_node.on_frame(2, entry, b"", fabric.now)
    assert replica_node.counters["ps_frames_dropped"] == dropped + 1


def test_a_bound_under_bsp_or_ssp_is_refused_by_the_engine_too() -> None:
    for consistency in (Consistency.BSP, Consistency.SSP):
        with pytest.raises(UsageError, match="async"):
            ShardServer(
                initial=np.zeros(SIZE),
                workers=range(2),
                consistency=consistency,
                rule=Sum(),
                bound=DivergenceBound(updates=1),
            )


def test_a_push_from_a_rolled_back_version_is_dropped_even_once_the_number_is_reused() -> None:
    """The primary applies two pushes (version 2) its replica never confirmed; the replica is
    promoted at version 0 and the two are sent again (version 2 once more).  A push computed
    from the old version 2, read at epoch 0, is dropped with the reason: its base names a model
    the failover lost, though the new lineage has a version 2 too.  Bases read at the new
    epoch, or 0, are taken."""
    primary, replica = bounded_pair(DivergenceBound(updates=4), workers=3)
    primary.push(0, 0, 0, ones(), 0.0)
    primary.push(1, 0, 0, ones(), 0.0)
    assert primary.version == 2
    assert replica.promote()
    assert replica.version == 0
    replica.push(0, 0, 0, ones(), 1.0, base_epoch=0)
    replica.push(1, 0, 0, ones(), 1.0, base_epoch=0)
    assert replica.version == 2
    [late] = acks(replica.push(2, 0, 2, ones(), 1.0, base_epoch=0))
    assert late.dropped is not None
    assert "rolled back" in late.dropped
    assert replica.version == 2
    [fresh] = acks(replica.push(2, 1, 2, ones(), 1.0, base_epoch=1))
    assert fresh.dropped is None  # the same number, read in the new lineage
    # the record travels with the state: a replica that joins the new primary knows it
    state = replica.state()
    assert state["lineage"] == {1: 0}


def test_a_worker_sends_the_epoch_its_base_was_read_at() -> None:
    worker = Worker(worker=0, size=SIZE, dtype="float64", shards=1)
    [pull] = worker.pull()
    assert isinstance(pull, SendPull)
    timed_reply = ShardServer(
        initial=np.zeros(SIZE), workers=range(1), consistency=Consistency.ASYNC, rule=Sum()
    ).store.pull(0)
    worker.pulled(0, pull.clock, timed_reply, np.zeros(SIZE))
    [push] = worker.push(np.ones(SIZE))
    assert push.base_epoch == 0
    [again] = worker.move(0, 1, forget=True)  # a rollback: the in-flight push keeps its epoch
    assert again.base_epoch == 0
    assert worker.read_epochs == [0]
    worker.pushed(0, 0, 1, None)
    [later] = worker.push(np.ones(SIZE))  # computed from the same cache: it says so
    assert (later.base, later.base_epoch) == (push.base, 0)
    [whole] = worker.pull()
    assert isinstance(whole, SendPull)
    assert whole.since == 0  # the next pull is whole


@pytest.mark.parametrize("copy_first", [True, False])
def test_a_copy_of_other_bytes_is_never_applied_the_entry_is_asked_for_whole(
    copy_first: bool,
) -> None:
    """A copy with the push's worker, iteration and base but other bytes (from another node,
    or encoded again) would make the replica diverge unbounded: the order entry's digest
    refuses it, before or after the entry came, and the entry is asked for whole."""
    primary, replica = bounded_pair(DivergenceBound(updates=4))
    [order] = forwards(primary.push(0, 0, 0, ones(), 0.0))
    assert len(order.entry.digest) == ps_frames.DIGEST_SIZE
    other = payload(np.full(SIZE, 7.0))
    if copy_first:
        replica.copy(0, 0, 0, other, 0.0)
        assert replica.log(order.entry, 0.0) == []
    else:
        assert replica.log(order.entry, 0.0) == []
        assert replica.copy(0, 0, 0, other, 0.0) == []
    assert replica.on_timer(NEED_AFTER, lambda _: None) == [Need(index=1)]
    [whole] = forwards(primary.needed(1))
    assert replica.log(whole.entry, NEED_AFTER) == [Logged(index=1)]
    np.testing.assert_array_equal(replica.store.model, primary.store.model)


def test_an_order_entrys_digest_travels_and_is_checked() -> None:
    common: dict[str, Any] = {"job": "j", "name": "m", "shard": 0, "server": 3, "replica": 4}
    fields: dict[str, Any] = {"index": 1, "entry": "push", "worker": 0, "iteration": 0, "base": 0}
    spec = Fabric(workers=1, shards=1, size=2, rounds=1, consistency=Consistency.ASYNC).spec
    frame = ps_frames.Replicate(**common, **fields, spec=spec, copied=True, digest=b"12345678")
    assert ps_frames.Replicate.from_meta(frame.to_meta()) == frame
    for bad in (b"1234", b"123456789"):
        with pytest.raises(RemoteProtocolError, match="digest"):
            ps_frames.Replicate.from_meta(frame.to_meta() | {"dg": bad})
