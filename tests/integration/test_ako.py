"""Ako's partial gradient exchange between real daemons on loopback (issue 29): six ranks on
three daemons step with integer gradients and flush, and every replica is then exactly
``w0 - lr * (every rank's gradients)``, for p = 1, 2, 3 and "auto"; a daemon killed mid-run
leaves the survivors stepping, and after their flush their models are equal; a trainer that
leaves (its daemon sends every peer's daemon a death notice naming its incarnation) and opens
the exchange again is taken back at the survivors' next flush with rank 0's model, and the sum
is exact again from there.

Ranks are clients in this process, one connection each; every call is started with its
``_async`` form and then waited for, so one thread plays all ranks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from tests.integration.test_collectives import ranks
from tests.integration.test_collectives import wait_or_explain as collectives_wait

if TYPE_CHECKING:
    from fabricd.client import Client

pytestmark = pytest.mark.timeout(240)

#: rank -> node: six ranks on three nodes, two on each (local and remote peers)
PLACEMENT = (0, 1, 2, 0, 1, 2)
COUNT = 1000
LR = 0.5


def wait(handle: Any, fabs: list[Client]) -> Any:
    """``handle.wait``, or a report of every daemon's exchanges."""
    return collectives_wait(handle, fabs, rows="partial_exchanges")


def open_all(fabs: list[Client], partitions: int | str) -> tuple[list[Any], list[Any], Any]:
    models = [f.array("w", (COUNT,), "float64") for f in fabs]
    grads = [f.array("g", (COUNT,), "float64") for f in fabs]
    w0 = np.arange(COUNT, dtype=np.float64)
    for model in models:
        model[:] = w0
    exchanges = [
        f.partial_exchange("w", m, partitions=partitions, lr=LR, staleness=1)  # type: ignore[arg-type]
        for f, m in zip(fabs, models, strict=True)
    ]
    return exchanges, grads, w0


def step_all(
    fabs: list[Client], exchanges: list[Any], grads: list[Any], total: Any, rng: Any, who: list[int]
) -> None:
    handles = []
    for r in who:
        grads[r][:] = rng.integers(-8, 9, COUNT)
        total += grads[r]
        handles.append(exchanges[r].step_async(grads[r]))
    for handle in handles:
        wait(handle, fabs)


@pytest.mark.parametrize("partitions", [1, 2, 3, "auto"])
def test_after_a_flush_every_replica_is_the_exact_sum(
    make_cluster: Any, partitions: int | str
) -> None:
    cluster = make_cluster(3)
    with ranks(cluster, PLACEMENT, f"ako-{partitions}") as fabs:
        exchanges, grads, w0 = open_all(fabs, partitions)
        expected = len(PLACEMENT) - 1 if partitions == "auto" else partitions
        assert {ex.partitions for ex in exchanges} == {expected}
        rng = np.random.default_rng(29)
        total = np.zeros(COUNT)
        for _ in range(10):
            step_all(fabs, exchanges, grads, total, rng, list(range(len(PLACEMENT))))
        results = [wait(h, fabs) for h in [ex.flush_async() for ex in exchanges]]
        assert {r.flush for r in results} == {1}
        assert {r.synced_from for r in results} == {None}
        for ex in exchanges:
            np.testing.assert_array_equal(ex.model, w0 - LR * total)
        rows = [
            row
            for fab in fabs[:3]
            for row in fab.status()["partial_exchanges"]
            if row["job"] == f"ako-{partitions}"
        ]
        assert len(rows) == len(PLACEMENT)
        assert {row["clock"] for row in rows} == {10}
        assert all(row["bytes_sent"] > 0 and row["flushes"] == 1 for row in rows)


def test_survivors_of_a_killed_daemon_go_on_and_end_equal(make_cluster: Any) -> None:
    """Node 2 (ranks 2 and 5) is killed after four rounds: the others' steps are never held
    for them, and after the survivors' flush every survivor holds rank 0's model (which
    holds every survivor's gradients whole)."""
    cluster = make_cluster(3)
    with ranks(cluster, PLACEMENT, "ako-killed") as fabs:
        exchanges, grads, _ = open_all(fabs, 2)
        rng = np.random.default_rng(7)
        total = np.zeros(COUNT)
        everyone = list(range(len(PLACEMENT)))
        for _ in range(4):
            step_all(fabs, exchanges, grads, total, rng, everyone)
        cluster.kill(2)
        survivors = [r for r, n in enumerate(PLACEMENT) if n != 2]
        for _ in range(6):
            step_all(fabs, exchanges, grads, total, rng, survivors)
        handles = [exchanges[r].flush_async() for r in survivors]
        results = [wait(h, fabs) for h in handles]
        assert {r.synced_from for r in results} == {0}
        for r in survivors[1:]:
            np.testing.assert_array_equal(exchanges[r].model, exchanges[0].model)
        assert np.isfinite(exchanges[0].model).all()
        with pytest.raises(fabricd.UsageError, match="opened partial exchange 'w' already"):
            fabs[0].partial_exchange("w", exchanges[0].model, lr=LR)


def test_a_trainer_that_comes_back_is_taken_back_with_a_survivor_s_model(
    make_cluster: Any,
) -> None:
    """Rank 4's trainer leaves after three rounds; the others step on without it; a new
    trainer opens ``w`` again for rank 4 (its open blocks) and is taken back at the
    survivors' next flush, with rank 0's model; then six ranks step and flush, exactly."""
    cluster = make_cluster(3)
    job = "ako-back"
    with ranks(cluster, PLACEMENT, job) as fabs:
        exchanges, grads, _ = open_all(fabs, 2)
        rng = np.random.default_rng(4)
        everyone = list(range(len(PLACEMENT)))
        for _ in range(3):
            step_all(fabs, exchanges, grads, np.zeros(COUNT), rng, everyone)
        fabs[4].close()
        _death_noticed(fabs[:3], 5)  # (its daemon tells each peer's: the hang of two failures)
        survivors = [r for r in everyone if r != 4]
        for _ in range(3):
            step_all(fabs, exchanges, grads, np.zeros(COUNT), rng, survivors)
        socket = cluster.nodes[PLACEMENT[4]].socket_path
        fabs[4] = fabricd.connect(job=job, rank=4, size=len(PLACEMENT), socket_path=socket)
        model = fabs[4].array("w", (COUNT,), "float64")
        model[:] = -1.0  # (not the job's model: the survivors' comes)
        grads[4] = fabs[4].array("g", (COUNT,), "float64")
        with ThreadPoolExecutor(1) as pool:
            opening = pool.submit(
                fabs[4].partial_exchange, "w", model, partitions=2, lr=LR, staleness=1
            )
            for _ in range(3):  # its HELLO may come after a survivor's flush began: the next
                results = [wait(h, fabs) for h in [exchanges[r].flush_async() for r in survivors]]
                assert {r.synced_from for r in results} <= {0, None}
                rows = fabs[0].status()["partial_exchanges"]
                if all(4 not in row["gone"] for row in rows if row["rank"] == 0):
                    break  # (taken back: its open is answered once rank 0's model is there)
                step_all(fabs, exchanges, grads, np.zeros(COUNT), rng, survivors)
            exchanges[4] = opening.result(timeout=60)
        assert exchanges[4].joined_from == 0
        caught_up = exchanges[0].model.copy()
        for ex in exchanges:
            np.testing.assert_array_equal(ex.model, caught_up)
        total = np.zeros(COUNT)
        for _ in range(4):
            step_all(fabs, exchanges, grads, total, rng, everyone)
        results = [wait(h, fabs) for h in [ex.flush_async() for ex in exchanges]]
        assert len({r.flush for r in results}) == 1
        for ex in exchanges:
            np.testing.assert_array_equal(ex.model, caught_up - LR * total)
        rows = [row for f in fabs for row in f.status()["partial_exchanges"]]
        assert {row["phase"] for row in rows} == {"running"}
        taken_back = sum(f.status()["counters"]["ranks_taken_back"] for f in fabs[:3])
        assert taken_back == 1


def _death_noticed(daemons: list[Client], expected: int) -> None:
    """Poll until the daemons (a client of each) took ``expected`` death notices in all (a
    hang guard of 60 s)."""
    deadline = time.monotonic() + 60.0
    while sum(f.status()["counters"]["death_notices"] for f in daemons) < expected:
        assert time.monotonic() < deadline, "a closed exchange's death notices did not come"
        time.sleep(0.05)
    assert sum(f.status()["counters"]["death_notices"] for f in daemons) == expected


def test_bad_opens_are_refused_with_what_to_do(make_cluster: Any) -> None:
    cluster = make_cluster(1)
    with ranks(cluster, (0, 0), "ako-bad") as fabs:
        model = fabs[0].array("w", (8,), "float32")
        ints = fabs[0].array("i", (8,), "int32")
        with pytest.raises(fabricd.UsageError, match="lr"):
            fabs[0].partial_exchange("w", model, lr=0.0)
        with pytest.raises(fabricd.UsageError, match="partitions"):
            fabs[0].partial_exchange("w", model, lr=0.1, partitions=0)
        with pytest.raises(fabricd.UsageError, match="float"):
            fabs[0].partial_exchange("w", ints, lr=0.1)
        other = fabs[1].array("w", (8,), "float32")
        a = fabs[0].partial_exchange("w", model, lr=0.1, partitions=1)
        b = fabs[1].partial_exchange("w", other, lr=0.1, partitions=1)
        with pytest.raises(fabricd.UsageError, match="takes 8 elements"):
            a.step(fabs[0].array("g", (4,), "float32"))
        grad_a = fabs[0].array("ga", (8,), "float32")
        grad_b = fabs[1].array("gb", (8,), "float32")
        grad_a[:] = 1.0
        grad_b[:] = 2.0
        handles = [a.step_async(grad_a), b.step_async(grad_b)]
        for handle in handles:
            wait(handle, fabs)
        for handle in [a.flush_async(), b.flush_async()]:
            wait(handle, fabs)
        np.testing.assert_array_equal(model, other)
        np.testing.assert_allclose(model, -0.1 * 3.0, rtol=1e-6)
