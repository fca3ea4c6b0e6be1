"""The parameter server between real daemons on loopback (issue 12): several workers and a
server under each consistency model, a model sharded over two servers, the sgd rule's
delay-adaptive step size (issue 24), malformed pushes refused while the server keeps serving,
and a server that dies replaced by its replica with no acknowledged update lost.

Ranks are clients in this process, one connection each; pushes and pulls are started with the
``_async`` forms and then waited for, so one thread plays all ranks.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import ranks
from tests.integration.test_collectives import wait_or_explain as collectives_wait

if TYPE_CHECKING:
    from fabricd.client import Client, ParameterServer

pytestmark = pytest.mark.timeout(240)

COUNT = 1000
#: seconds a call may take before the test is stuck (a hang guard)
WAIT = 60.0


def wait(handle: Any, fabs: list[Client]) -> Any:
    """``handle.wait``, or a report of every daemon's parameter-server rows and stalls."""
    return collectives_wait(handle, fabs, rows="ps_workers")


def open_all(
    fabs: list[Client], servers: list[int], replicas: tuple[int, ...] = (), **kw: Any
) -> dict[int, ParameterServer]:
    handles = {}
    for rank, fab in enumerate(fabs):
        role = "server" if rank in servers else "replica" if rank in replicas else "worker"
        handles[rank] = fab.parameter_server(
            "m", (COUNT,), "float64", role, servers=servers, replicas=list(replicas), **kw
        )
    return handles


def step(
    fabs: list[Client],
    pss: dict[int, ParameterServer],
    workers: list[int],
    updates: dict[int, np.ndarray[Any, Any]],
    models: dict[int, np.ndarray[Any, Any]],
) -> tuple[list[Any], list[int]]:
    """Every worker pushes its update, then pulls: the push results and the versions."""
    pushed = [pss[w].push_async(updates[w]) for w in workers]
    results = [wait(h, fabs) for h in pushed]
    pulled = [pss[w].pull_async(models[w]) for w in workers]
    return results, [wait(h, fabs) for h in pulled]


def test_bsp_applies_every_workers_push_once_per_iteration(make_cluster) -> None:
    cluster = make_cluster(2)
    placement = (0, 1, 0, 1)  # server rank 0; workers 1, 2 (local to the server), 3
    with ranks(cluster, placement, "ps-bsp") as fabs:
        pss = open_all(fabs, [0], consistency="bsp")
        workers = [1, 2, 3]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        rng = np.random.default_rng(3)
        expected = np.zeros(COUNT)
        for iteration in range(4):
            for w in workers:
                updates[w][:] = rng.standard_normal(COUNT)
                expected += updates[w]
            results, versions = step(fabs, pss, workers, updates, models)
            assert [r.iteration for r in results] == [iteration] * 3
            assert all(r.dropped == () for r in results)
            assert versions == [iteration + 1] * 3  # one version per iteration: BSP
            for w in workers:
                np.testing.assert_allclose(models[w], expected, rtol=1e-12, atol=1e-12)
        status = fabs[0].status()
        (row,) = [r for r in status["ps_servers"] if r["name"] == "m"]
        assert (row["version"], row["applied"], row["pushes"]) == (4, 12, 12)


@pytest.mark.parametrize("consistency", ["ssp", "async"])
def test_ssp_and_async_apply_every_push_on_arrival(make_cluster, consistency: str) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), f"ps-{consistency}") as fabs:
        kw: dict[str, Any] = {"staleness": 2} if consistency == "ssp" else {}
        pss = open_all(fabs, [0], consistency=consistency, **kw)
        workers = [1, 2]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        for w in workers:
            updates[w][:] = w
        for _ in range(3):
            step(fabs, pss, workers, updates, models)
        for w in workers:
            np.testing.assert_allclose(models[w], 3 * (1 + 2))
            assert wait(pss[w].pull_async(models[w]), fabs) == 6  # a version per push


def test_a_model_sharded_over_two_servers_with_sgd(make_cluster) -> None:
    cluster = make_cluster(3)
    placement = (0, 1, 2, 0, 1)  # servers 0 and 1, workers 2, 3, 4
    with ranks(cluster, placement, "ps-shards") as fabs:
        start = fabs[0].array("init", (COUNT,), "float64")
        start[:] = np.linspace(-1, 1, COUNT)
        start1 = fabs[1].array("init", (COUNT,), "float64")
        start1[:] = start
        pss = {}
        for rank, fab in enumerate(fabs):
            role = "server" if rank < 2 else "worker"
            initial = (start if rank == 0 else start1) if rank < 2 else None
            pss[rank] = fab.parameter_server(
                "m",
                (COUNT,),
                "float64",
                role,
                servers=[0, 1],
                consistency="bsp",
                update_rule="sgd",
                lr=0.1,
                momentum=0.5,
                initial=initial,
            )
        assert pss[2].bounds == [(0, 500), (500, 1000)]
        workers = [2, 3, 4]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        grads = {w: fabs[w].array("g", (COUNT,), "float64") for w in workers}
        model, velocity = start.copy(), np.zeros(COUNT)
        for w in workers:
            assert wait(pss[w].pull_async(models[w]), fabs) == 0
            np.testing.assert_array_equal(models[w], model)
        for _ in range(3):
            for w in workers:
                grads[w][:] = models[w] * w  # a gradient of the model each worker pulled
            total = sum(np.array(grads[w]) for w in workers)
            velocity = 0.5 * velocity - 0.1 * total  # MLfabric eq. 2, on the iteration's sum
            model = model + velocity
            results, _ = step(fabs, pss, workers, grads, models)
            assert all(len(r.versions) == 2 for r in results)
            for w in workers:
                np.testing.assert_allclose(models[w], model, rtol=1e-12, atol=1e-12)


def test_delay_adaptive_sgd_steps_a_stale_push_less_than_a_fresh_one(make_cluster) -> None:
    """``lr_delay="adaptive"`` (issue 24, item 5): the server sizes each push's step by the
    version it is applied to and its delay, ``lr sqrt(t0 / (t0 + t + tau))``."""
    cluster = make_cluster(2)
    lr, t0 = 0.5, 2.0
    with ranks(cluster, (0, 1, 1), "ps-adalr") as fabs:
        pss = open_all(
            fabs, [0], consistency="async", update_rule="sgd", lr=lr, lr_delay="adaptive", lr_t0=t0
        )
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in (1, 2)}
        grads = {w: fabs[w].array("g", (COUNT,), "float64") for w in (1, 2)}
        for w in (1, 2):
            grads[w][:] = 1.0
            assert wait(pss[w].pull_async(models[w]), fabs) == 0

        def alpha(t: int, tau: int) -> float:
            return lr * math.sqrt(t0 / (t0 + t + tau))

        # (worker, pulls first): worker 1 fresh each time, worker 2 never pulls again
        expected = 0.0
        for version, (w, fresh) in enumerate([(1, False), (2, False), (1, True), (2, False)]):
            if fresh:
                assert wait(pss[w].pull_async(models[w]), fabs) == version
            delay = 0 if fresh or version == 0 else version
            result = wait(pss[w].push_async(grads[w]), fabs)
            assert (result.versions, result.dropped) == ((version + 1,), ())
            expected -= alpha(version, delay)
        assert wait(pss[1].pull_async(models[1]), fabs) == 4
        np.testing.assert_allclose(models[1], expected, rtol=1e-12)
        as_if_fresh = -sum(alpha(t, 0) for t in range(4))  # worker 2's stale pushes moved less
        assert as_if_fresh < expected
        with pytest.raises(fabricd.UsageError, match="belong to update_rule='sgd'"):
            fabs[1].parameter_server("other", (COUNT,), "float64", lr_delay="adaptive")


def test_malformed_pushes_are_refused_and_the_server_keeps_serving(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), "ps-bad") as fabs:
        pss = open_all(fabs, [0], consistency="async")
        wrong_shape = fabs[1].array("short", (COUNT - 1,), "float64")
        wrong_dtype = fabs[1].array("f32", (COUNT,), "float32")
        bad = fabs[1].array("nan", (COUNT,), "float64")
        bad[3] = np.nan
        for update, what in ((wrong_shape, "999 of float64"), (wrong_dtype, "float32")):
            with pytest.raises(fabricd.UsageError, match=what):
                pss[1].push(update)
        with pytest.raises(fabricd.UsageError, match="NaN"):
            pss[1].push(bad)
        with pytest.raises(fabricd.UsageError, match="for workers"):
            pss[0].push(bad)
        with pytest.raises(fabricd.UsageError, match="opened here as"):
            fabs[2].parameter_server("m", (COUNT,), "float32", servers=[0])
        good = fabs[2].array("u", (COUNT,), "float64")
        good[:] = 1.0
        assert pss[2].push(good, norm=float(np.linalg.norm(good))).versions == (1,)
        model = fabs[2].array("w", (COUNT,), "float64")
        assert pss[2].pull(model) == 1
        np.testing.assert_array_equal(model, 1.0)


def test_a_dead_server_is_replaced_by_its_replica_and_nothing_acknowledged_is_lost(
    make_cluster,
) -> None:
    cluster = make_cluster(3)
    placement = (0, 1, 1, 2)  # server 0 alone on node 0; replica 1; workers 2 and 3
    with ranks(cluster, placement, "ps-failover") as fabs:
        pss = open_all(fabs, [0], [1], consistency="async")
        workers = [2, 3]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        acked = np.zeros(COUNT)
        for w in workers:
            updates[w][:] = w
        for _ in range(3):
            step(fabs, pss, workers, updates, models)
            acked += 2 + 3
        fabs[0].close()  # the server's process ends: its shard goes with it
        for _ in range(3):
            results, versions = step(fabs, pss, workers, updates, models)
            acked += 2 + 3
            assert all(r.epochs == (1,) for r in results)
        for w in workers:
            np.testing.assert_array_equal(models[w], acked)  # nothing acknowledged lost
            assert pss[w].epochs == (1,)
        assert versions[-1] == 12  # versions went on from where the server left them
        events = [e for e in fabs[2].poll(1.0) if e.name == "ps_epoch"]
        assert events
        assert (events[0].fields["epoch"], events[0].fields["server"]) == (1, 1)


def test_an_update_callback_runs_in_the_server_process(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), "ps-callback") as fabs:
        steps: list[int] = []

        def rule(model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
            steps.append(len(steps))
            model += 2.0 * update  # not a built-in rule: twice the update

        server = fabs[0].parameter_server(
            "m", (COUNT,), "float64", "server", servers=[0], consistency="bsp", update_rule=rule
        )
        thread = threading.Thread(target=server.serve, args=(30.0,), daemon=True)
        thread.start()
        pss = {
            r: fabs[r].parameter_server("m", (COUNT,), "float64", servers=[0], consistency="bsp")
            for r in (1, 2)
        }
        with pytest.raises(fabricd.UsageError, match="opened here as"):
            fabs[1].parameter_server("m", (COUNT,), "float64", servers=[0], consistency="ssp")
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in (1, 2)}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in (1, 2)}
        for w in (1, 2):
            updates[w][:] = w
        for _ in range(3):
            step(fabs, pss, [1, 2], updates, models)
        for w in (1, 2):
            np.testing.assert_array_equal(models[w], 3 * 2.0 * (1 + 2))
        assert steps == [0, 1, 2]  # once per BSP iteration, on the iteration's sum


def test_servers_killed_again_and_again_lose_nothing_and_never_go_back(make_cluster) -> None:
    """F6 with a replica: the rank serving the shard is killed five times; each time its
    partner takes over (one epoch later) and the killed rank comes back as the new replica,
    taking the shard's state from its partner.  Nothing acknowledged is lost, no version goes
    back, and every change of epoch is told."""
    cluster = make_cluster(3)
    placement = (0, 1, 2, 2)  # server 0, replica 1, workers 2 and 3
    job = "ps-f6"
    with ranks(cluster, placement, job) as fabs:
        pss = open_all(fabs, [0], [1], consistency="bsp")
        workers = [2, 3]
        models = {w: fabs[w].array("w", (COUNT,), "float64") for w in workers}
        updates = {w: fabs[w].array("u", (COUNT,), "float64") for w in workers}
        for w in workers:
            updates[w][:] = w
        acked = np.zeros(COUNT)
        seen = {w: 0 for w in workers}
        extra: list[Client] = []
        try:
            for kill in range(5):
                for _ in range(2):
                    results, versions = step(fabs, pss, workers, updates, models)
                    acked += 2 + 3
                    for w, version in zip(workers, versions, strict=True):
                        assert version > seen[w]  # never back
                        seen[w] = version
                for w in workers:
                    np.testing.assert_array_equal(models[w], acked)
                    assert pss[w].epochs == (kill,)
                serving = (0, 1)[kill % 2]
                victim = next(f for f in [*fabs, *extra] if not f.closed and f.rank == serving)
                victim.close()  # the rank serving the shard dies
                back = fabricd.connect(
                    job=job, rank=serving, size=4, socket_path=cluster.nodes[serving].socket_path
                )
                extra.append(back)
                back.parameter_server(
                    "m",
                    (COUNT,),
                    "float64",
                    ("server", "replica")[serving],
                    servers=[0],
                    replicas=[1],
                    consistency="bsp",
                )  # comes back: it follows its partner now
            results, versions = step(fabs, pss, workers, updates, models)
            acked += 2 + 3
            for w in workers:
                np.testing.assert_array_equal(models[w], acked)
                assert pss[w].epochs == (5,)
            assert all(r.epochs == (5,) for r in results)
            epochs = [e.fields["epoch"] for e in fabs[2].poll(1.0) if e.name == "ps_epoch"]
            assert epochs == [1, 2, 3, 4, 5]
        finally:
            for client in extra:
                client.close()


def test_a_replica_may_open_after_its_server_started_serving(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1, 1), "ps-late") as fabs:
        server = fabs[0].parameter_server(
            "m", (COUNT,), "float64", "server", servers=[0], replicas=[1], consistency="async"
        )
        worker = fabs[2].parameter_server(
            "m", (COUNT,), "float64", servers=[0], replicas=[1], consistency="async"
        )
        update = fabs[2].array("u", (COUNT,), "float64")
        model = fabs[2].array("w", (COUNT,), "float64")
        update[:] = 1.0
        pushed = worker.push_async(update)  # held: nothing is acknowledged on one copy
        with pytest.raises(fabricd.Timeout):
            pushed.wait(timeout=0.5)
        status = fabs[0].status()  # held until the replica answered the server's JOIN
        assert [(r["role"], r["version"]) for r in status["ps_servers"]] == [("primary", 0)]
        assert status["counters"]["ps_early_frames"] == 1
        fabs[1].parameter_server(
            "m", (COUNT,), "float64", "replica", servers=[0], replicas=[1], consistency="async"
        )  # joins: takes the state, then the held push
        assert wait(pushed, fabs).versions == (1,)
        fabs[0].close()  # the replica has everything acknowledged
        assert worker.pull(model) == 1
        np.testing.assert_array_equal(model, 1.0)
        assert worker.epochs == (1,)
        del server


def test_a_server_back_after_every_copy_went_says_the_state_is_lost(make_cluster) -> None:
    cluster = make_cluster(3)
    job = "ps-lost"
    with ranks(cluster, (0, 1, 2), job) as fabs:
        pss = open_all(fabs, [0], [1], consistency="async")
        update = fabs[2].array("u", (COUNT,), "float64")
        model = fabs[2].array("w", (COUNT,), "float64")
        update[:] = 1.0
        pss[2].push(update)
        fabs[0].close()
        assert pss[2].pull(model) == 1  # served by the replica, epoch 1
        fabs[1].close()  # and now the replica: no copy of the shard is left
        with pytest.raises(fabricd.PeerFailed, match="no server"):
            pss[2].pull(model)
        with fabricd.connect(
            job=job, rank=0, size=3, socket_path=cluster.nodes[0].socket_path
        ) as back:  # the server comes back empty: it must not serve version 0 as the model
            back.parameter_server("m", (COUNT,), "float64", "server", servers=[0], replicas=[1])
            with pytest.raises(fabricd.PeerFailed, match="no server"):
                pss[2].pull(model)
        np.testing.assert_array_equal(model, 1.0)


def test_flush_publishes_what_the_lossless_mode_held_back_on_both_copies(make_cluster) -> None:
    cluster = make_cluster(3)
    filters = fabricd.FilterSettings(psmp_threshold=0.5, lossless_publish=True)
    with ranks(cluster, (0, 1, 2), "ps-flush") as fabs:
        start = [fabs[r].array("init", (COUNT,), "float64") for r in (0, 1)]
        for a in start:
            a[:] = 1.0
        layout: dict[str, Any] = {"servers": [0], "replicas": [1], "consistency": "async"}
        servers = [
            fabs[r].parameter_server(
                "m", (COUNT,), "float64", role, filters=filters, initial=start[r], **layout
            )
            for r, role in ((0, "server"), (1, "replica"))
        ]
        worker = fabs[2].parameter_server("m", (COUNT,), "float64", filters=filters, **layout)
        update = fabs[2].array("u", (COUNT,), "float64")
        model = fabs[2].array("w", (COUNT,), "float64")
        update[:] = 0.1  # a 10% change: under the 50% threshold, held back
        for _ in range(3):
            worker.push(update)
        assert worker.pull(model) == 3
        np.testing.assert_array_equal(model, 1.0)  # nothing published yet
        assert servers[1].flush() is False  # the replica follows: flush where it is served
        assert servers[0].flush_async().wait(timeout=WAIT) is True
        assert worker.pull(model) == 4  # the flush is a version of its own
        np.testing.assert_allclose(model, 1.3, rtol=1e-12)
        fabs[0].close()  # the replica flushed the same: it serves the exact model
        other = fabs[2].array("w2", (COUNT,), "float64")  # another array: pulled whole
        assert worker.pull(other) == 4
        np.testing.assert_allclose(other, 1.3, rtol=1e-12)
        with pytest.raises(fabricd.UsageError, match="for a server or replica"):
            worker.flush()
        with pytest.raises(fabricd.UsageError, match="for a server or replica"):
            worker.flush_async()


def test_a_worker_that_opens_after_a_failover_finds_the_rank_serving(make_cluster) -> None:
    """Workers whose daemon held no copy of the model when its server died start at epoch 0:
    one whose server rank is gone asks the partner, one whose server rank came back (as the
    replica now, first without the state) is told the epoch; both move to the rank serving
    the shard and hear ps_epoch."""
    cluster = make_cluster(4)
    job = "ps-late-worker"
    layout: dict[str, Any] = {"servers": [0], "replicas": [1], "consistency": "async"}

    def client(rank: int, node: int) -> Client:
        return fabricd.connect(
            job=job, rank=rank, size=5, socket_path=cluster.nodes[node].socket_path
        )

    first = [client(0, 0), client(1, 1), client(2, 1)]
    late: list[Client] = []
    try:
        first[0].parameter_server("m", (COUNT,), "float64", "server", **layout)
        first[1].parameter_server("m", (COUNT,), "float64", "replica", **layout)
        worker = first[2].parameter_server("m", (COUNT,), "float64", **layout)
        update = first[2].array("u", (COUNT,), "float64")
        update[:] = 1.0
        assert worker.push(update).versions == (1,)
        first[0].close()  # the server dies: rank 1 serves at epoch 1
        assert worker.push(update).epochs == (1,)
        for rank in (3, 4):  # on nodes 2 and 3, which never held the model
            if rank == 4:  # rank 0 comes back on node 0, as the replica now
                back = client(0, 0)
                late.append(back)
                back.parameter_server("m", (COUNT,), "float64", "server", **layout)
            fab = client(rank, rank - 1)
            late.append(fab)
            ps = fab.parameter_server("m", (COUNT,), "float64", **layout)
            mine = fab.array("u", (COUNT,), "float64")
            mine[:] = 1.0
            result = ps.push(mine, timeout=WAIT)
            assert result.epochs == (1,)
            assert result.dropped == ()
            model = fab.array("w", (COUNT,), "float64")
            assert ps.pull(model, timeout=WAIT) == result.versions[0]
            epochs = [e.fields for e in fab.poll(1.0) if e.name == "ps_epoch"]
            assert [(e["epoch"], e["server"]) for e in epochs] == [(1, 1)]
        np.testing.assert_array_equal(model, 4.0)  # 2 pushes of rank 2, one of 3, one of 4
    finally:
        for fab in first + late:
            fab.close()


@pytest.mark.parametrize(
    ("differ", "worker_spec"),
    [("size", {"shape": (2 * COUNT,)}), ("consistency", {"consistency": "async"})],
)
def test_a_worker_that_opens_the_model_another_way_fails_and_so_does_its_server(
    make_cluster, differ: str, worker_spec: dict[str, Any]
) -> None:
    """Issue 27, item 6: a worker on node 1 opening with another size (or consistency) than
    the server on node 0 opened fine, and its first pull failed as ``PeerFailed``; the
    server never heard of it.  Now the worker's open fails, or (when the two daemons had not
    heard of each other's open yet) its first call, and so does the server's ``serve()``,
    each with ``usage`` naming both specs and what differs."""
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1), f"ps-unlike-{differ}") as fabs:
        server = fabs[0].parameter_server(
            "m", (COUNT,), "float64", "server", servers=[0], consistency="bsp"
        )
        spec: dict[str, Any] = {"shape": (COUNT,), "consistency": "bsp", **worker_spec}

        def open_and_pull() -> None:
            ps = fabs[1].parameter_server(
                "m", spec["shape"], "float64", servers=[0], consistency=spec["consistency"]
            )
            ps.pull(fabs[1].array("w", spec["shape"], "float64"), timeout=WAIT)

        with pytest.raises(fabricd.UsageError) as worker_failed:
            open_and_pull()
        with pytest.raises(fabricd.UsageError) as server_failed:
            server.serve(duration=WAIT)  # the daemon's ps_disagreed ends it
        worker_says = f"as {spec['shape'][0]} x float64 on servers [0], {spec['consistency']}"
        for failed in (worker_failed, server_failed):
            message = str(failed.value)
            assert "as 1000 x float64 on servers [0], bsp by rank 0 (node 0)" in message
            assert f"{worker_says} by rank 1 (node 1)" in message
            assert f"they differ in {differ}: every rank must open it alike" in message
