"""Model distribution trees on the parameter server (MLfabric §10.3;
fabricd/engines/ps/distributing.py, relaying.py): a batch's pulls are answered at one version,
each exactly once, through distributors that forward the server's answer; a distributor that
never forwards, is cut off or whose links reset costs its pullers a direct pull, never an
answer; the server's link sends fewer bytes than answering every pull itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.daemon.services.ps_requests import check_spec
from fabricd.engines.ps import relaying
from fabricd.engines.ps.consistency import Consistency, Reply
from fabricd.engines.ps.distributing import PullBatch
from fabricd.engines.ps.shard_actions import Answer, Notice
from fabricd.engines.ps.storage import HEADER, TimedStore
from fabricd.engines.ps.worker import SendPull, Worker
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.frames import ps as ps_frames
from fabricd.wire import Kind
from tests.unit.ps_fabric import KEY, Fabric
from tests.unit.test_frames import PS_SPEC, SHARD
from tests.unit.test_ps_server import moves, run
from tests.unit.test_ps_sync_scheduling import spec

SERVER = 99
SLOW = (300.0, 1e9)  #: the server's host: a slow uplink (the direction a pull's answer takes)


def store(size: int = 64, versions: int = 3) -> TimedStore:
    """A store at ``versions``, each version changing a different part of the model."""
    timed = TimedStore(np.zeros(size), chunk=1)
    for v in range(versions):
        chunks = np.arange(v * 4, v * 4 + 4)
        timed.publish(chunks, np.full(4, float(v + 1)))
    return timed


def make_worker(rank: int) -> Worker:
    return Worker(worker=rank, size=64, dtype="float64", shards=1)


def reply(worker: int, clock: int = 1, since: int = 0, version: int = 3) -> Reply:
    return Reply(worker=worker, clock=clock, version=version, since=since, complete=0, held=False)


def batch_of(pulls: dict[int, tuple[int, int]], timed: TimedStore) -> list[Answer | Notice]:
    """A decided batch of ``pulls`` (worker -> (host, since)), the server's uplink slow."""
    trees = PullBatch(server=SERVER, interval=1.0, unknown_bps=1e9)
    live = frozenset(pulls)
    for worker, (host, since) in pulls.items():
        trees.pulled(worker, host, direct=False)
        assert trees.hold(reply(worker, since=since), 0.0, live)
    assert trees.next_deadline() == 0.0  # every live worker pulled: due at once

    def figures(host: int) -> tuple[float, float] | None:
        return SLOW if host == SERVER else None

    return trees.decide(0.0, timed, figures, live)


def deliveries(out: list[Answer | Notice]) -> dict[int, int]:
    """worker -> how many answers reach it (its own, or forwarded to it)."""
    got: dict[int, int] = {}
    for action in out:
        if isinstance(action, Answer):
            for worker in (action.worker, *(w for w, _ in action.forward)):
                got[worker] = got.get(worker, 0) + 1
    return got


# -- the shard's batch ------------------------------------------------------------------------
def test_a_batch_reaches_every_puller_once_at_one_version_through_distributors() -> None:
    timed = store()
    out = batch_of({w: (w, 0 if w == 0 else 2) for w in range(8)}, timed)
    assert deliveries(out) == dict.fromkeys(range(8), 1)
    assert {a.version for a in out} == {timed.version}
    forwarded = {w for a in out if isinstance(a, Answer) for w, _ in a.forward}
    noticed = {n.worker for n in out if isinstance(n, Notice)}
    assert forwarded == noticed
    assert forwarded
    sent = sum(len(a.data) for a in out if isinstance(a, Answer))
    direct = len(timed.pull(0)) + 7 * len(timed.pull(2))
    assert sent < direct  # the server's link sends less than answering each itself
    for answer in (a for a in out if isinstance(a, Answer) and a.forward):
        assert HEADER.unpack_from(answer.data)[5] == 2  # the branch's oldest cache
        for worker, _ in answer.forward:  # it applies at every cache it reaches
            cache = timed.model.copy()
            cache[8:12] = 0.0  # what a cache at version 2 holds
            engine = make_worker(worker)
            engine.versions = [2]
            engine.pull()
            engine.pulled(0, 0, answer.data, cache, older=True)
            np.testing.assert_array_equal(cache, timed.model)


def test_workers_on_one_host_get_one_answer_handed_over_there() -> None:
    timed = store()
    out = batch_of({0: (1, 3), 1: (1, 2), 2: (2, 3)}, timed)
    assert deliveries(out) == {0: 1, 1: 1, 2: 1}
    [to_host_1] = [a for a in out if isinstance(a, Answer) and a.worker in (0, 1)]
    assert to_host_1.worker == 0
    assert (1, 1) in to_host_1.forward
    assert [n.via for n in out if isinstance(n, Notice) and n.worker == 1] == [0]


def test_a_direct_pull_or_one_from_an_unknown_or_the_servers_host_is_answered_at_once() -> None:
    trees = PullBatch(server=SERVER, interval=1.0, unknown_bps=1e9)
    live = frozenset({0, 1, 2, 3})
    trees.pulled(0, 5, direct=True)
    assert not trees.hold(reply(0), 0.0, live)
    assert not trees.hold(reply(1), 0.0, live)  # its host never said
    trees.pulled(2, SERVER, direct=False)
    assert not trees.hold(reply(2), 0.0, live)
    trees.pulled(3, 6, direct=False)
    assert trees.hold(reply(3), 0.0, live | {4})
    assert trees.next_deadline() == 1.0  # one interval: worker 4 may come
    assert trees.hold(reply(3), 0.5, live)  # sent again: every live worker pulled (three
    assert trees.next_deadline() == 0.5  # of them straight): no other can come, due now
    trees.pulled(3, 6, direct=True)  # its distributor did not deliver: out of the batch
    assert trees.decide(1.0, store(), lambda host: None, live) == []


def test_a_cache_past_a_restored_version_is_answered_whole() -> None:
    timed = store()
    out = batch_of({0: (1, 7), 1: (2, 7)}, timed)  # (the shard was rolled back to 3)
    assert deliveries(out) == {0: 1, 1: 1}
    for answer in (a for a in out if isinstance(a, Answer)):
        assert len(answer.data) == len(timed.pull(0))


# -- the worker's side ------------------------------------------------------------------------
def test_a_delta_from_an_older_version_applies_and_a_newer_cache_refuses_an_older_answer() -> None:
    timed = store()
    worker = make_worker(0)
    cache = np.zeros(64)
    old = timed.pull(1)  # from 1 up to 3
    timed.publish(np.arange(20, 24), np.full(4, 9.0))
    worker.pull()
    worker.pulled(0, 0, timed.pull(0), cache)  # the cache at 4
    worker.pull()
    assert worker.pulled(0, 0, old, cache, older=True) == []  # up to 3: no fit for a cache at 4
    assert worker.awaits_pull(0, 0)
    assert worker.repull(0, 0) == [SendPull(shard=0, clock=0, since=4, direct=True)]
    timed.publish(np.arange(30, 34), np.full(4, 7.0))
    newer = timed.pull(2)  # from 2 to 5: fits a cache at 4 as a tree's answer, and only so
    assert worker.pulled(0, 0, newer, cache) == []  # (straight: an earlier pull's, sent again)
    worker.pulled(0, 0, newer, cache, older=True)
    np.testing.assert_array_equal(cache, timed.model)
    assert worker.repull(0, 0) == []  # answered: nothing to send again


# -- frames and specs -------------------------------------------------------------------------
def pulled(**fields: Any) -> ps_frames.Pulled:
    common = {"job": "j", "name": "m", "shard": 0, "server": 9, "worker": 1, "epoch": 0}
    return ps_frames.Pulled(**common, clock=2, version=5, **fields)


@pytest.mark.parametrize(
    "frame",
    [
        pulled(forward=((2, 3), (4, 5))),
        pulled(via=7, expect_us=1500),
        pulled(via=7),
    ],
)
def test_the_tree_forms_of_pulled_travel_whole(frame: ps_frames.Pulled) -> None:
    assert frame.KIND is Kind.PULLED
    assert ps_frames.Pulled.from_meta(frame.to_meta()) == frame
    assert frame.forwarded == (frame.via is not None and frame.expect_us is None)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"fw": [[2, 3]], "via": 7}, "the server's answer itself"),
        ({"exp": 5}, "names its via"),
        ({"fw": [[2]]}, "rank, clock"),
        ({"fw": []}, "rank, clock"),
        ({"fw": [[2, -1]]}, "rank, clock"),
    ],
)
def test_malformed_tree_forms_of_pulled_are_refused(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        ps_frames.Pulled.from_meta(pulled().to_meta() | extra)


def test_a_direct_pull_travels_whole() -> None:
    frame = ps_frames.Pull(**SHARD, worker=2, clock=3, since=1, epoch=0, spec=PS_SPEC, direct=True)
    assert ps_frames.Pull.from_meta(frame.to_meta()) == frame
    assert "d" not in dataclasses.replace(frame, direct=False).to_meta()


def test_trees_need_mlfabric_scheduling() -> None:
    check_spec(spec("async") | {"distribution": "tree"})
    with pytest.raises(UsageError, match="needs scheduling='mlfabric'"):
        check_spec(spec("async") | {"distribution": "tree", "scheduling": "arrival"})
    with pytest.raises(UsageError, match="distribution 'forest'"):
        check_spec(spec("async") | {"distribution": "forest"})


# -- the whole path ---------------------------------------------------------------------------
def tree_fabric(consistency: Consistency = Consistency.ASYNC, *, tree: bool = True) -> Fabric:
    """Six workers, two shards, pulls batched over 20 s (a frame takes 1 s here); the servers'
    uplinks slow, so trees pay."""
    fabric = Fabric(
        workers=6,
        shards=2,
        size=5,
        rounds=3,
        consistency=consistency,
        scheduled=True,
        tree=tree,
        interval=20.0,
    )
    for server in (6, 7):
        fabric.figures[server] = (30.0, 1e6)
    return fabric


def counted(fabric: Fabric, name: str) -> int:
    return sum(node.counters[name] for node in fabric.nodes.values())


def pull_bytes(fabric: Fabric) -> int:
    return sum(fabric.serving(s).statistics().pull_bytes for s in range(2))


@pytest.mark.parametrize("consistency", [Consistency.ASYNC, Consistency.BSP])
def test_trees_forward_answers_and_the_server_sends_fewer_bytes(consistency: Consistency) -> None:
    fabric, plain = tree_fabric(consistency), tree_fabric(consistency, tree=False)
    for each in (fabric, plain):
        each.drain()
        each.check_settled()  # every push once, every pull at the model
    assert counted(fabric, "ps_pulls_forwarded") > 0
    assert counted(fabric, "ps_pulls_redirected") == 0
    trees = [fabric.serving(s).statistics().trees for s in range(2)]
    assert all(t is not None and t.forwarded > 0 for t in trees)
    assert pull_bytes(fabric) < pull_bytes(plain)


def test_a_distributor_that_never_forwards_costs_its_pullers_a_direct_pull(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relaying, "forward", lambda node, frame, payload: None)
    fabric = tree_fabric()
    fabric.drain()
    fabric.check_settled()
    assert counted(fabric, "ps_pulls_redirected") > 0


def test_pullers_of_a_lost_distributor_pull_straight_at_once() -> None:
    fabric = tree_fabric()
    for _ in range(400):  # until some answer is on its way through a distributor
        waits = [w for n in fabric.nodes.values() for w in n.relays._waits.values()]
        if waits:
            break
        for w in range(6):
            fabric.step(w)
        assert fabric.deliver(0) or fabric.tick()
    via = waits[0].via
    redirected = counted(fabric, "ps_pulls_redirected")
    fabric.lose(via)
    assert counted(fabric, "ps_pulls_redirected") > redirected  # told it is gone: at once
    fabric.drain()
    fabric.check_settled()


def test_a_forwarded_answer_from_a_node_its_via_is_not_on_is_dropped() -> None:
    fabric = tree_fabric()
    node = fabric.nodes[0]
    fabric.step(0)
    forged = pulled(via=3)
    forged = dataclasses.replace(forged, job=KEY[0], name=KEY[1], worker=0, server=6)
    assert not node.may_send(2, forged)
    dropped = node.counters["ps_frames_dropped"]
    node.on_frame(2, forged, b"", fabric.now)
    assert node.counters["ps_frames_dropped"] == dropped + 1


def one_version_per_batch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Check every decided batch: one version, each worker reached once; returns sizes."""
    sizes: list[int] = []
    decide = PullBatch.decide

    def checked(
        self: PullBatch, now: float, timed: TimedStore, figures: Any, live: frozenset[int]
    ) -> Any:
        out = decide(self, now, timed, figures, live)
        assert {a.version for a in out} <= {timed.version}
        got = deliveries(out)
        assert set(got.values()) <= {1}, got
        sizes.append(len(got))
        return out

    monkeypatch.setattr(PullBatch, "decide", checked)
    return sizes


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([Consistency.ASYNC, Consistency.BSP]), st.data())
def test_trees_under_resets_duplicates_and_lost_workers_answer_every_pull_once(
    consistency: Consistency, data: st.DataObject
) -> None:
    """Resends, duplicates, resets between any two ranks (a distributor and its puller too)
    and (async) a worker lost: every pull answered once (the fabric fails a second answer),
    every push applied once, every batch at one version."""
    with pytest.MonkeyPatch.context() as patch:
        sizes = one_version_per_batch(patch)
        fabric = tree_fabric(consistency)
        script = data.draw(moves(6, 2, failover=False))
        pairs = st.tuples(st.just("between"), st.integers(0, 5), st.integers(0, 5))
        script += data.draw(st.lists(pairs, max_size=4))
        lost = data.draw(st.sampled_from([None, 5])) if consistency is Consistency.ASYNC else None
        for move in script:
            if move[0] == "between":
                if move[1] != move[2]:
                    fabric._reset(move[1], move[2])
            else:
                run(fabric, [move])
            if lost is not None and data.draw(st.integers(0, 20)) == 0:
                fabric.lose(lost)
                lost = None
        fabric.drain()
        fabric.check_settled()
        assert sizes


# -- the review's findings --------------------------------------------------------------------
def evil_answer(fabric: Fabric) -> bytes:
    """A delta that sets every parameter of shard 0 to 666, from version 0 to 1."""
    lo, hi = fabric.bounds[0]
    evil = TimedStore(np.zeros(hi - lo), chunk=1)
    evil.publish(np.arange(hi - lo), np.full(hi - lo, 666.0))
    return bytes(evil.pull(0))


@pytest.mark.parametrize("tree", [True, False])
def test_an_answer_forwarded_as_a_rank_no_notice_named_is_never_applied(tree: bool) -> None:
    """A node hosting a worker of the model forwards an answer nobody asked it for: held for a
    notice that never comes, then dropped (a direct model's at once); the pull is untouched."""
    fabric = tree_fabric(tree=tree)
    fabric.step(1)  # worker 1 pulls
    node = fabric.nodes[1]
    forged = dataclasses.replace(
        pulled(via=3), job=KEY[0], name=KEY[1], worker=1, server=6, clock=0, version=1
    )
    dropped = node.counters["ps_frames_dropped"]
    node.on_frame(3, forged, evil_answer(fabric), fabric.now)
    node.on_timer(fabric.now + relaying.EARLY_HOLD + 1)
    assert node.counters["ps_frames_dropped"] == dropped + 1
    assert fabric.workers[1].engine.awaits_pull(0, 0)
    assert not np.any(fabric.workers[1].cache == 666.0)


def test_a_forward_list_is_honoured_only_from_the_server_and_within_the_rules() -> None:
    fabric = tree_fabric()
    node = fabric.nodes[0]
    fabric.step(0)
    payload = evil_answer(fabric)  # (well-formed: the server's own answer is taken)
    # from worker 3's node, as "server" 3: dropped before anything is forwarded
    amplifier = ps_frames.Pulled(
        job=KEY[0],
        name=KEY[1],
        shard=0,
        server=3,
        worker=0,
        epoch=0,
        clock=0,
        version=0,
        forward=((1, 0),) * ps_frames.MAX_MEMBERS,
    )
    out = node.on_frame(3, amplifier, payload, fabric.now)
    assert not [a for a in out if hasattr(a, "payload")]
    # from the real server, a list naming a worker twice: answered, not forwarded
    twice = dataclasses.replace(amplifier, server=6, forward=((1, 0), (1, 0)))
    out = node.on_frame(6, twice, payload, fabric.now)
    assert not [a for a in out if getattr(a, "node", None) == 1]
    assert node.counters["ps_pulls_forwarded"] == 0


def test_a_lost_workers_pull_is_not_answered_nor_made_a_distributor() -> None:
    timed = store()
    trees = PullBatch(server=SERVER, interval=1.0, unknown_bps=1e9)
    everyone = frozenset(range(6))
    for worker in range(6):
        trees.pulled(worker, worker, direct=False)
        trees.hold(reply(worker, since=2), 0.0, everyone)
    out = trees.decide(1.0, timed, lambda h: SLOW if h == SERVER else None, everyone - {0})
    assert 0 not in deliveries(out)
    assert all(n.via != 0 for n in out if isinstance(n, Notice))
    assert deliveries(out) == dict.fromkeys(range(1, 6), 1)
    stats = trees.statistics()
    assert stats.pulls == 5


def test_a_notice_naming_a_rank_gone_sends_the_pull_straight_at_once() -> None:
    fabric = tree_fabric()
    fabric.step(1)
    node = fabric.nodes[1]
    del node.ranks.nodes[3]  # type: ignore[attr-defined]  # rank 3 is gone here
    notice = dataclasses.replace(
        pulled(via=3, expect_us=10_000_000), job=KEY[0], name=KEY[1], worker=1, server=6, clock=0
    )
    out = node.on_frame(6, notice, b"", fabric.now)
    assert node.counters["ps_pulls_redirected"] == 1
    sent = [a.frame for a in out if isinstance(getattr(a, "frame", None), ps_frames.Pull)]
    assert [p.direct for p in sent] == [True]


def test_a_tree_counts_every_pull_it_answers() -> None:
    fabric, plain = tree_fabric(), tree_fabric(tree=False)
    for each in (fabric, plain):
        each.drain()
    pulls = [sum(f.serving(s).statistics().pulls for s in range(2)) for f in (fabric, plain)]
    assert pulls[0] == pulls[1]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([Consistency.ASYNC, Consistency.BSP]),
    st.booleans(),
    st.booleans(),
    st.data(),
)
def test_trees_with_replicas_kills_joins_and_callbacks_answer_every_pull_once(
    consistency: Consistency, callback: bool, bounded: bool, data: st.DataObject
) -> None:
    """Trees on replicated shards (chain, or bounded under async) with primaries killed and
    brought back, late replicas joining, update callbacks, and resets between any two nodes:
    every pull answered once, every push applied once (the review's fuzz, kept)."""
    fabric = Fabric(
        workers=5,
        shards=2,
        size=5,
        rounds=3,
        consistency=consistency,
        delay_bound=3 if consistency is Consistency.ASYNC else None,
        replicas=True,
        scheduled=True,
        tree=True,
        interval=20.0,
        callback=callback,
        divergence_bound=[None, 2] if bounded and consistency is Consistency.ASYNC else None,
    )
    for server in (5, 6, 7, 8):
        fabric.figures[server] = (30.0, 1e6)
    script = data.draw(moves(5, 2, failover=True, joins=True))
    pairs = st.tuples(st.just("between"), st.integers(0, 8), st.integers(0, 8))
    for move in script + data.draw(st.lists(pairs, max_size=4)):
        if move[0] != "between":
            run(fabric, [move])
        elif move[1] != move[2] and move[1] in fabric.nodes and move[2] in fabric.nodes:
            fabric._reset(move[1], move[2])
    fabric.drain()
    fabric.check_settled()
