"""Collectives between real daemons on loopback (issue 10): every mode and op against numpy, 1
to 8 ranks with several per node, broadcast and barrier, and failures (F1, F2, F4, a small F8).

Ranks are clients in this process, one connection each; every call is started with the
``_async`` form and then waited for, so one thread plays all ranks.
"""

from __future__ import annotations

import contextlib
import time
from random import Random
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from fabricd.client import Client
    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.timeout(240)

#: rank -> node: 1, 2, 3, 5 and 8 ranks, several ranks per node where there are more ranks
PLACEMENTS = {
    1: (0,),
    2: (0, 1),
    3: (0, 1, 0),
    5: (0, 1, 2, 0, 1),
    8: (0, 1, 2, 3, 0, 1, 2, 3),
}
WAIT = 60.0


@contextlib.contextmanager
def ranks(cluster: LocalCluster, placement: tuple[int, ...], job: str) -> Iterator[list[Client]]:
    clients = [
        fabricd.connect(
            job=job, rank=r, size=len(placement), socket_path=cluster.nodes[n].socket_path
        )
        for r, n in enumerate(placement)
    ]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def wait_or_explain(handle: Any, fabs: list[Client], rows: str = "collectives") -> Any:
    """``handle.wait``, or on a timeout an AssertionError carrying what every daemon says of
    its ``rows`` (status rows: its collectives, or ``stochastic_reduces``) and stalled calls:
    a hang must be readable from the report alone."""
    try:
        return handle.wait(timeout=WAIT)
    except fabricd.Timeout:
        seen = {}
        for fab in fabs:
            with contextlib.suppress(fabricd.FabricError):
                status = fab.status()
                seen[status["node"]] = {
                    rows: status[rows],
                    "stalls": fab.stalls()["stalls"],
                }
        raise AssertionError(f"{handle.what} hung; the daemons say: {seen}") from None


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Start every rank's call, then wait for all of them."""
    handles = [call() for call in calls]
    return [h.wait(timeout=WAIT) for h in handles]


def reference(inputs: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    stacked = np.stack(inputs)
    dtype = stacked.dtype
    match op:
        case "sum":
            return stacked.sum(axis=0, dtype=dtype)
        case "avg":
            total = stacked.sum(axis=0, dtype=dtype)
            return total / len(inputs) if dtype.kind == "f" else total // len(inputs)
        case "max":
            return stacked.max(axis=0)
        case _:
            return stacked.min(axis=0)


@pytest.mark.parametrize("size", sorted(PLACEMENTS))
def test_sync_allreduce_every_op_and_dtype_equals_numpy(make_cluster, size: int) -> None:
    placement = PLACEMENTS[size]
    cluster = make_cluster(max(placement) + 1)
    rng = np.random.default_rng(size)
    with ranks(cluster, placement, f"sync{size}") as fabs:
        for dtype in ("float16", "float32", "float64", "int32", "int64"):
            # 1031 elements: chunks of unequal sizes; 300_000 float32 (1.2 MB): the ring
            count = 300_000 if dtype == "float32" else 1031
            arrays = [f.array(f"x-{dtype}", (count,), dtype) for f in fabs]
            for op in ("sum", "avg", "max", "min"):
                for _ in range(2):  # a second round reuses the persistent schedule
                    inputs = [rng.integers(-50, 50, count).astype(dtype) for _ in fabs]
                    for a, x in zip(arrays, inputs, strict=True):
                        a[:] = x
                    results = together(
                        [
                            lambda f=f, a=a, op=op: f.allreduce_async(a, op, "sync")
                            for f, a in zip(fabs, arrays, strict=True)
                        ]
                    )
                    want = reference(inputs, op)
                    for a, res in zip(arrays, results, strict=True):
                        assert res.included
                        assert res.active == size
                        np.testing.assert_allclose(
                            a.astype("float64"), want.astype("float64"), rtol=3e-3, atol=1e-3
                        )
                    assert all(np.array_equal(arrays[0], a) for a in arrays)  # the same bits


@pytest.mark.parametrize(
    ("mode", "op", "late", "dtype"),
    [
        ("solo", "sum", "sum", "float64"),
        ("majority", "sum", "sum", "float64"),
        ("solo", "avg", "sum", "float64"),
        ("majority", "sum", "latest", "float64"),
        ("solo", "sum", "latest", "float64"),
        ("solo", "sum", "sum", "bfloat16"),  # (the active count is a bfloat16 too)
        ("majority", "avg", "sum", "bfloat16"),
    ],
)
@pytest.mark.parametrize("size", [2, 5, 8])
def test_partial_allreduce_loses_no_contribution(
    make_cluster, mode: str, op: str, late: str, dtype: str, size: int
) -> None:
    """Ranks call in a random order with random skew, then rounds of zeros drain what waited.
    Each call gives one gift, a one-hot element of its own, so a result says which gifts it
    counted: an ``included`` call's gift is in the round it got, and no gift is counted
    twice.  ``late="latest"``: every rank sees a round alike, and every gift is in a round
    seen (a round every rank was too late for is seen by nobody: eager-SGD's receive buffer).
    ``late="sum"``: what each rank applied holds every gift of the rounds it got at most
    once, and the rank that got the last round applied every gift exactly once."""
    placement = PLACEMENTS[size]
    cluster = make_cluster(max(placement) + 1)
    rng = Random(size)
    steps, drain = 6, 6
    given = np.zeros(size * steps, "int64")
    seen: dict[int, np.ndarray[Any, Any]] = {}
    applied = [np.zeros_like(given) for _ in range(size)]
    last = [-1] * size  #: the last round each rank got
    scale = size if op == "avg" else 1  # avg: the sum over the job's size, as eager-SGD does
    with ranks(cluster, placement, f"{mode}{op}{late}{dtype}{size}") as fabs:
        arrays = [f.array("g", (size * steps,), dtype) for f in fabs]
        for step in range(steps + drain):
            order = list(range(size))
            rng.shuffle(order)
            handles = []
            for r in order:
                arrays[r][:] = 0
                if step < steps:
                    arrays[r][r * steps + step] = 1
                    given += arrays[r].astype("int64")
                handle = fabs[r].allreduce_async(arrays[r], op, mode, late=late)
                handles.append((r, step, handle))
                time.sleep(rng.random() * 0.003)
            for r, step_, handle in handles:
                res = wait_or_explain(handle, fabs)
                assert 0 <= res.active <= size
                got = np.rint(arrays[r] * scale).astype("int64")
                applied[r] += got
                last[r] = res.round
                if res.included and step_ < steps:
                    assert got[r * steps + step_] == 1, "an included gift is missing"
                if res.results > 1:
                    assert late == "sum"
                elif res.round in seen:
                    np.testing.assert_array_equal(seen[res.round], got)
                else:
                    seen[res.round] = got
        status = fabs[0].status()
    rows = [row for row in status["collectives"] if row["name"] == f"allreduce:{mode}:{op}:g"]
    assert rows
    if late == "sum":
        assert max(a.max() for a in applied) <= 1, "a rank applied a gift twice"
        ahead = [r for r in range(size) if last[r] == max(last)]
        if rows[0]["rounds"] == max(last) + 1:  # (else a round ended after every last call)
            for r in ahead:
                np.testing.assert_array_equal(applied[r], given)
        return
    counted = sum(seen.values(), np.zeros_like(given))
    assert counted.max() <= 1, "a gift counted twice"
    unseen = rows[0]["rounds"] - len(seen)
    assert unseen >= 0
    if unseen == 0:
        np.testing.assert_array_equal(counted, given)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_broadcast_from_every_root_and_barrier(make_cluster, size: int) -> None:
    placement = PLACEMENTS[size]
    cluster = make_cluster(max(placement) + 1)
    with ranks(cluster, placement, f"bcast{size}") as fabs:
        arrays = [f.array("w", (1000,), "float64") for f in fabs]
        for root in range(size):
            for r, a in enumerate(arrays):
                a[:] = r * 10 + root
            together(
                [
                    lambda f=f, a=a, root=root: f.broadcast_async(a, root)
                    for f, a in zip(fabs, arrays, strict=True)
                ]
            )
            assert all((a == root * 10 + root).all() for a in arrays)
        together([lambda f=f: f.barrier_async() for f in fabs])


def test_sync_model_averages_or_copies_the_root_every_every_th_call(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, PLACEMENTS[3], "sync-model") as fabs:
        models = [f.array("model", (1000,), "float64") for f in fabs]
        for r, model in enumerate(models):
            model[:] = r
        skipped = [f.sync_model_async(m, every=2) for f, m in zip(fabs, models, strict=True)]
        assert skipped == [None, None, None]  # every=2: the first call synchronises nothing
        assert all((m == r).all() for r, m in enumerate(models))
        handles = [f.sync_model_async(m, every=2) for f, m in zip(fabs, models, strict=True)]
        results = [wait_or_explain(h, fabs) for h in handles]
        assert {(r.round, r.included, r.active) for r in results} == {(0, True, 3)}
        assert all((m == 1.0).all() for m in models)  # the mean of 0, 1 and 2
        models[2][:] = 7.0
        together(
            [
                lambda f=f, m=m: f.sync_model_async(m, root=2, name="restart")
                for f, m in zip(fabs, models, strict=True)
            ]
        )
        assert all((m == 7.0).all() for m in models)  # rank 2's model replaced the others
    with ranks(cluster, PLACEMENTS[1], "sync-model-alone") as (alone,):
        model = alone.array("model", (10,), "float32")
        assert alone.sync_model(model, every=2, timeout=WAIT) is None
        assert alone.sync_model(model, every=2, timeout=WAIT) == fabricd.Result(
            round=0, included=True, active=1
        )


def test_a_call_that_disagrees_is_refused_with_both_shapes(make_cluster) -> None:
    cluster = make_cluster(2)
    with ranks(cluster, (0, 1), "mismatch") as (a, b):
        x, y = a.array("g", (10,), "float32"), b.array("g", (20,), "float32")
        # both nodes build "grad" from their own call, or one from the other's frame: either
        # way both calls fail, and the message shows both shapes
        handles = [a.allreduce_async(x, name="grad"), b.allreduce_async(y, name="grad")]
        for handle in handles:
            with pytest.raises(fabricd.UsageError) as failed:
                handle.wait(timeout=WAIT)
            assert "10 float32" in str(failed.value)
            assert "20 float32" in str(failed.value)
        with pytest.raises(fabricd.UsageError, match=r"solo allreduce takes op 'sum' or 'avg'"):
            a.allreduce(x, "max", "solo")


# -- failures ----------------------------------------------------------------------------------
def test_a_dead_node_fails_sync_within_the_peer_timeout(make_cluster) -> None:
    """F1 for sync: rank 2's node dies while ranks 0 and 1 wait in a round: both raise
    PeerFailed (never hang), and later calls say the collective cannot go on."""
    cluster = make_cluster(3)
    with ranks(cluster, (0, 1, 2), "dead-sync") as fabs:
        arrays = [f.array("g", (100,), "float32") for f in fabs]
        together([lambda f=f, a=a: f.allreduce_async(a) for f, a in zip(fabs, arrays, strict=True)])
        waiting = [fabs[r].allreduce_async(arrays[r]) for r in (0, 1)]
        cluster.kill(2)
        started = time.monotonic()
        for handle in waiting:
            with pytest.raises(fabricd.PeerFailed, match=r"rank 2|node 2"):
                handle.wait(timeout=WAIT)
        assert time.monotonic() - started < WAIT
        with pytest.raises(fabricd.UsageError, match="cannot go on"):
            fabs[0].allreduce(arrays[0], timeout=WAIT)


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_partial_modes_go_on_among_the_survivors(make_cluster, mode: str) -> None:
    """F1/F2 for solo and majority: a node dies mid-loop; the survivors' calls keep completing,
    with active counting only survivors, and what the survivors gave is never lost."""
    placement = (0, 1, 2, 0, 1, 2)
    cluster = make_cluster(3)
    with ranks(cluster, placement, f"dead-{mode}") as fabs:
        arrays = [f.array("g", (16,), "int64") for f in fabs]
        survivors = [r for r, n in enumerate(placement) if n != 2]
        for step in range(8):
            if step == 3:
                cluster.kill(2)
            alive = range(len(fabs)) if step < 3 else survivors
            for r in alive:
                arrays[r][:] = 1
            handles = [(r, fabs[r].allreduce_async(arrays[r], "sum", mode)) for r in alive]
            for r, handle in handles:
                if step == 3 and r not in survivors:
                    continue
                try:
                    res = handle.wait(timeout=WAIT)
                except fabricd.DaemonUnavailable:
                    assert r not in survivors
                    continue
                if step >= 5:
                    assert res.active <= len(survivors)
        for r in survivors:
            assert fabs[r].status()["collectives"][0]["lost"] == [2]


def test_a_trainer_that_restarts_rejoins_at_the_current_round(make_cluster) -> None:
    """F4: rank 1's process dies (its client goes) between rounds of a solo allreduce; the
    others go on without it and hear rank_left; a new client for rank 1 joins the same job, its
    first call is matched to the job's current round, and a broadcast hands it the model."""
    cluster = make_cluster(2)
    sock = [n.socket_path for n in cluster.nodes]
    with ranks(cluster, (0, 1, 1), "rejoin") as fabs:
        arrays = [f.array("g", (8,), "float32") for f in fabs]
        for _ in range(2):
            together(
                [
                    lambda f=f, a=a: f.allreduce_async(a, "sum", "solo")
                    for f, a in zip(fabs, arrays, strict=True)
                ]
            )
        fabs[1].close()
        for _ in range(3):
            together(
                [lambda r=r: fabs[r].allreduce_async(arrays[r], "sum", "solo") for r in (0, 2)]
            )
        events = [e for e in fabs[2].poll(timeout=5.0) if e.name == "rank_left"]
        assert events
        assert events[0].fields["rank"] == 1
        with fabricd.connect(job="rejoin", rank=1, size=3, socket_path=sock[1]) as back:
            mine = back.array("g", (8,), "float32")
            res = together(
                [lambda: back.allreduce_async(mine, "sum", "solo")]
                + [lambda r=r: fabs[r].allreduce_async(arrays[r], "sum", "solo") for r in (0, 2)]
            )
            assert res[0].round == res[1].round  # matched to the job's current round
            model = back.array("model", (4,), "float64")
            models = [
                fabs[0].array("model", (4,), "float64"),
                fabs[2].array("model", (4,), "float64"),
            ]
            models[0][:] = 7.0
            together(
                [lambda: back.collectives.broadcast_async(model, 0)]
                + [
                    lambda m=m, f=f: f.collectives.broadcast_async(m, 0)
                    for m, f in zip(models, (fabs[0], fabs[2]), strict=True)
                ]
            )
            assert (model == 7.0).all()


def test_random_kills_during_a_solo_loop_never_hang(make_cluster) -> None:
    """A smaller F8: nodes die at random steps of a solo loop; every call of a survivor
    completes or fails, within the wait, every time."""
    placement = (0, 1, 2, 3)
    cluster = make_cluster(4)
    rng = Random(8)
    victims = rng.sample([1, 2, 3], 2)
    kill_at = sorted(rng.sample(range(2, 10), 2))
    with ranks(cluster, placement, "f8") as fabs:
        arrays = [f.array("g", (256,), "float32") for f in fabs]
        dead: set[int] = set()
        for step in range(12):
            if kill_at and step == kill_at[0]:
                kill_at.pop(0)
                victim = victims.pop()
                cluster.kill(victim)
                dead.add(victim)
            alive = [r for r in range(4) if placement[r] not in dead]
            handles = [fabs[r].allreduce_async(arrays[r], "avg", "solo") for r in alive]
            for handle in handles:
                with contextlib.suppress(fabricd.DaemonUnavailable):
                    handle.wait(timeout=WAIT)  # a Timeout here is the hang this test forbids
        assert fabs[0].status()["collectives"][0]["lost"] == sorted(dead)


def test_a_collective_call_that_waits_shows_in_stalls(make_cluster) -> None:
    """fabricctl stalls names a collective call pending past stall_after, and what its round
    waits for: here rank 1, which never calls."""
    cluster = make_cluster(2, stall_after=0.2)
    with ranks(cluster, (0, 1), "stalled") as fabs:
        x = fabs[0].array("g", (16,), "float32")
        handle = fabs[0].allreduce_async(x)
        deadline = time.monotonic() + WAIT
        rows: list[dict[str, Any]] = []
        while not rows and time.monotonic() < deadline:
            time.sleep(0.1)
            rows = fabs[0].stalls()["stalls"]
        assert rows, "no stall row within the wait"
        row = rows[0]
        assert (row["job"], row["rank"], row["kind"], row["tag"]) == (
            "stalled",
            0,
            "allreduce",
            "allreduce:sync:sum:g",
        )
        assert row["waits"] == "messages"
        assert "messages from nodes [1]" in row["detail"]
        assert not handle.done()
