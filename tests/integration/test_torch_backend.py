"""The torch.distributed backend "fabricd" (fabricd/torch/backend.py, issue 30) on real daemons.

Each rank is a spawned process with its own daemon (one rank per node): it opens the default
group with ``init_process_group("fabricd")`` and, beside it, a gloo group of the same ranks, and
runs every operation on both with the same tensors: the results must be equal, for every dtype
and reduction (and a reduction must be what every rank's inputs make it, exactly: they are
small integers).  On 2, 3 and 4 ranks.  Also: DDP trains to the same parameters as on
gloo; a rank killed in the middle of an allreduce fails the others' ``wait()``; two jobs at once
under different names.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import queue
import re
import tempfile
import traceback
from functools import partial
from typing import Any

import pytest

# no importorskip: torch is in the test extra, so a missing torch must fail, not skip
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(300)

REDUCE_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
BITWISE = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _values(rank: int, n: int, dtype: torch.dtype, length: int = 7) -> torch.Tensor:
    """Small integers (exact in every dtype, products included) that differ per rank."""
    base = torch.arange(length) % 3 + 1 + (torch.arange(length) + rank) % 2
    return base.to(dtype)


def _compare(checks: list[tuple[str, bool, str]], what: str, got: Any, ref: Any) -> None:
    same = torch.equal(got, ref) if isinstance(got, torch.Tensor) else got == ref
    checks.append((what, bool(same), "" if same else f"fabricd {got} gloo {ref}"))


def _both(run: Any, gloo: Any) -> tuple[Any, Any]:
    """``run(group)`` on the fabricd group (the default) and on gloo."""
    return run(None), run(gloo)


def _reductions(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    for dtype in REDUCE_DTYPES:
        ops = dict(OPS)
        if not dtype.is_floating_point:
            ops |= BITWISE
        for name, op in ops.items():

            def run(group: Any, op: Any = op, dtype: torch.dtype = dtype) -> torch.Tensor:
                t = _values(rank, n, dtype)
                dist.all_reduce(t, op=op, group=group)
                return t

            got, ref = _both(run, gloo)
            _compare(checks, f"all_reduce {name} {dtype}", got, ref)
            exact = _expected(name, n).to(dtype)  # (and exact: small integers in every dtype)
            _compare(checks, f"all_reduce {name} {dtype} exact", got, exact)
        if dtype.is_floating_point:
            t = _values(rank, n, dtype)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            summed = torch.stack([_values(r, n, torch.float64) for r in range(n)]).sum(0)
            _compare(checks, f"all_reduce avg {dtype}", t, (summed / n).to(dtype))


def _expected(name: str, n: int) -> torch.Tensor:
    """A reduction of every rank's ``_values``, made here (in int64: exact)."""
    rows = [_values(r, n, torch.int64) for r in range(n)]
    folds: dict[str, Any] = {
        "sum": torch.add,
        "max": torch.maximum,
        "min": torch.minimum,
        "product": torch.mul,
        "band": torch.bitwise_and,
        "bor": torch.bitwise_or,
        "bxor": torch.bitwise_xor,
    }
    result = rows[0]
    for row in rows[1:]:
        result = folds[name](result, row)
    return result


def _movements(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        for root in range(n):

            def bcast(group: Any, root: int = root, dtype: torch.dtype = dtype) -> torch.Tensor:
                t = _values(rank, n, dtype, 5) if rank == root else torch.zeros(5, dtype=dtype)
                dist.broadcast(t, src=root, group=group)
                return t

            got, ref = _both(bcast, gloo)
            _compare(checks, f"broadcast from {root} {dtype}", got, ref)

        def gather_list(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = [torch.zeros(5, dtype=dtype) for _ in range(n)]
            dist.all_gather(out, _values(rank, n, dtype, 5), group=group)
            return torch.stack(out)

        got, ref = _both(gather_list, gloo)
        _compare(checks, f"all_gather {dtype}", got, ref)

        def gather_flat(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = torch.zeros(5 * n, dtype=dtype)
            dist.all_gather_into_tensor(out, _values(rank, n, dtype, 5), group=group)
            return out

        got, ref = _both(gather_flat, gloo)
        _compare(checks, f"all_gather_into_tensor {dtype}", got, ref)


def _scatters(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    for dtype in (torch.float32, torch.int64):

        def rs_list(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = torch.zeros(3, dtype=dtype)
            ins = [_values(rank + j, n, dtype, 3) for j in range(n)]
            dist.reduce_scatter(out, ins, group=group)
            return out

        got, ref = _both(rs_list, gloo)
        _compare(checks, f"reduce_scatter {dtype}", got, ref)

        def rs_flat(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter_tensor(out, _values(rank, n, dtype, 3 * n), group=group)
            return out

        got, ref = _both(rs_flat, gloo)
        _compare(checks, f"reduce_scatter_tensor {dtype}", got, ref)

        def reduce_to(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            t = _values(rank, n, dtype)
            dist.reduce(t, dst=n - 1, group=group)
            return t if rank == n - 1 else torch.zeros(0)

        got, ref = _both(reduce_to, gloo)
        _compare(checks, f"reduce {dtype}", got, ref)

        def gather_to(group: Any, dtype: torch.dtype = dtype) -> Any:
            out = [torch.zeros(4, dtype=dtype) for _ in range(n)] if rank == 0 else None
            dist.gather(_values(rank, n, dtype, 4), out, dst=0, group=group)
            return torch.stack(out) if out is not None else torch.zeros(0)

        got, ref = _both(gather_to, gloo)
        _compare(checks, f"gather {dtype}", got, ref)

        def scatter_from(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            out = torch.zeros(4, dtype=dtype)
            ins = [_values(j, n, dtype, 4) for j in range(n)] if rank == 0 else None
            dist.scatter(out, ins, src=0, group=group)
            return out

        got, ref = _both(scatter_from, gloo)
        _compare(checks, f"scatter {dtype}", got, ref)

        def a2a(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            outs = [torch.zeros(2, dtype=dtype) for _ in range(n)]
            ins = [_values(rank * n + j, n, dtype, 2) for j in range(n)]
            dist.all_to_all(outs, ins, group=group)
            return torch.stack(outs)

        got, ref = _both(a2a, gloo)
        _compare(checks, f"all_to_all {dtype}", got, ref)

        def a2a_uneven(group: Any, dtype: torch.dtype = dtype) -> torch.Tensor:
            splits_in = [(rank + j) % 2 + 1 for j in range(n)]
            splits_out = [(j + rank) % 2 + 1 for j in range(n)]
            source = torch.arange(sum(splits_in)).to(dtype) + 100 * rank
            out = torch.zeros(sum(splits_out), dtype=dtype)
            dist.all_to_all_single(out, source, splits_out, splits_in, group=group)
            return out

        got, ref = _both(a2a_uneven, gloo)
        _compare(checks, f"all_to_all_single uneven {dtype}", got, ref)


def _coalesced(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    def gather_many(group: Any) -> torch.Tensor:
        ins = [_values(rank, n, torch.float32, 3), _values(rank + 1, n, torch.float32, 5)]
        outs = [[torch.zeros_like(t) for t in ins] for _ in range(n)]
        dist.all_gather_coalesced(outs, ins, group=group)
        return torch.cat([t.double() for row in outs for t in row])

    got, ref = _both(gather_many, gloo)
    _compare(checks, "all_gather_coalesced", got, ref)

    def reduce_many(group: Any) -> torch.Tensor:
        ts = [_values(rank, n, torch.float32, 4), _values(rank, n, torch.float32, 9)]
        dist.all_reduce_coalesced(ts, group=group)
        return torch.cat(ts)

    got, ref = _both(reduce_many, gloo)
    _compare(checks, "all_reduce_coalesced", got, ref)


def _random_bf16(rank: int, length: int) -> torch.Tensor:
    """bfloat16 values over many exponents, rank's own: their sums round."""
    generator = torch.Generator().manual_seed(77 + rank)
    scale = 2.0 ** torch.randint(-20, 20, (length,), generator=generator)
    return (torch.randn(length, generator=generator) * scale).bfloat16()


def _bf16_rounding(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    """bfloat16 sums that round (not small integers): each reduction step adds in float32 and
    rounds to nearest even, on fabricd as on gloo.  Two ranks make one addition, so the two
    groups agree bit for bit; more ranks round every partial sum in an order each algorithm
    picks (gloo's ring, the daemons' doubling or ring), so both must be within (n - 1) half
    ulps of the partial sums of the exact sum, (n - 1) 2**-8 of the sum of magnitudes, and
    need not agree bit for bit."""
    for length in (1000, 70_000):  # a whole staging class, and a span of granules
        k = length // n
        rows = [_random_bf16(r, k * n) for r in range(n)]
        exact = torch.stack([row.double() for row in rows]).sum(0)
        bound = (n - 1) * 2.0**-8 * torch.stack([row.double().abs() for row in rows]).sum(0)
        mine = slice(rank * k, (rank + 1) * k)
        for what, run, part in (
            ("all_reduce", partial(_ar_bf16, rows[rank]), slice(None)),
            ("reduce_scatter_tensor", partial(_rs_bf16, rows[rank], n), mine),
        ):
            got, ref = _both(run, gloo)
            for name, result in (("fabricd", got), ("gloo", ref)):
                within = bool(((result.double() - exact[part]).abs() <= bound[part]).all())
                checks.append((f"bf16 {what} {length} {name} within the bound", within, ""))
            if n == 2:
                same = torch.equal(got.view(torch.int16), ref.view(torch.int16))
                checks.append((f"bf16 {what} {length} bit for bit", same, f"{got} {ref}"))
        t = rows[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if n == 2:  # torch's own: the rounded sum, then the rounded half
            _compare(checks, f"bf16 all_reduce avg {length}", t, (rows[0] + rows[1]) / 2)
        else:  # the sum's bound, divided, and the division's own rounding
            off = (t.double() - exact / n).abs() - bound / n - 2.0**-8 * (exact / n).abs()
            checks.append(
                (f"bf16 all_reduce avg {length} within the bound", bool((off <= 0).all()), "")
            )


def _ar_bf16(row: torch.Tensor, group: Any) -> torch.Tensor:
    t = row.clone()
    dist.all_reduce(t, group=group)
    return t


def _rs_bf16(whole: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    out = torch.zeros(whole.numel() // n, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, whole, group=group)
    return out


def _the_rest(rank: int, n: int, gloo: Any, checks: list[tuple[str, bool, str]]) -> None:
    ring = torch.full((6,), float(rank))
    got = torch.zeros(6)
    if rank % 2 == 0:
        dist.send(ring, (rank + 1) % n, tag=7)
        dist.recv(got, (rank - 1) % n, tag=7)
    else:
        dist.recv(got, (rank - 1) % n, tag=7)
        dist.send(ring, (rank + 1) % n, tag=7)
    _compare(checks, "send/recv ring", got, torch.full((6,), float((rank - 1) % n)))
    dist.barrier()
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "pad": "x" * (rank * 1000)})
    _compare(checks, "all_gather_object", [o["rank"] for o in objects], list(range(n)))
    listed: list[Any] = [{"from": rank}] if rank == 1 else [None]
    dist.broadcast_object_list(listed, src=1)
    _compare(checks, "broadcast_object_list", listed[0], {"from": 1})
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    work.wait()
    _compare(checks, "async all_reduce's future", value[0], torch.full((1000,), float(n)))


def ops_rank(socket_path: str, init: str, rank: int, n: int, out: Any) -> None:
    """Every operation on the fabricd default group and a gloo group of the same ranks."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    checks: list[tuple[str, bool, str]] = []
    try:
        import fabricd.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        gloo = dist.new_group(backend="gloo")
        assert dist.get_backend() == "fabricd"
        for part in (_reductions, _bf16_rounding, _movements, _scatters, _coalesced, _the_rest):
            part(rank, n, gloo, checks)
        dist.destroy_process_group()
        out.put((rank, checks, None))
    except BaseException:
        out.put((rank, checks, traceback.format_exc()))


#: seconds each rank has to report; a rank still running at STACKS_AFTER prints its stacks
REPORT_WITHIN = 240
STACKS_AFTER = REPORT_WITHIN - 20


def _run(make_cluster: Any, spawn: Any, target: Any, n: int, *args: Any) -> list[Any]:
    cluster = make_cluster(n)
    results = multiprocessing.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as scratch:
        init = f"file://{scratch}/rendezvous"
        processes = [
            spawn(target, cluster.nodes[r].socket_path, init, r, n, *args, results)
            for r in range(n)
        ]
        reports = []
        for _ in processes:
            try:
                reports.append(results.get(timeout=REPORT_WITHIN))
            except queue.Empty:
                pytest.fail(
                    f"a rank reported nothing; exit codes {[p.exitcode for p in processes]}; "
                    f"reports {[(r[0], r[2]) for r in reports]} (a hung rank's stacks are in "
                    "the captured stderr)"
                )
        for process in processes:
            process.join(30)
    return sorted(reports, key=lambda report: report[0])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_operation_matches_gloo(make_cluster: Any, spawn: Any, n: int) -> None:
    for rank, checks, error in _run(make_cluster, spawn, ops_rank, n):
        assert error is None, f"rank {rank}: {error}"
        wrong = [(what, detail) for what, ok, detail in checks if not ok]
        assert not wrong, f"rank {rank}: {wrong}"
        assert len(checks) > 80  # (every case ran: the count grows with n)


def _train(model: Any, rank: int, steps: int) -> None:
    """``steps`` of SGD on this rank's batches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 6, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )


def parity_rank(socket_path: str, init: str, rank: int, n: int, kind: str, out: Any) -> None:
    """20 steps of DDP (or FSDP) over the fabricd default group, and the same over gloo."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    try:
        import fabricd.torch  # noqa: F401

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        gloo = dist.new_group(backend="gloo")
        results = []
        for group in (None, gloo):
            if kind == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(
                    _net(), process_group=group, bucket_cap_mb=0.001
                )
                _train(model, rank, 20)
                results.append([p.detach().clone().reshape(-1) for p in model.parameters()])
            else:  # FSDP2 (FSDP1 wants an accelerator): a CPU mesh over the group
                from torch.distributed.device_mesh import DeviceMesh
                from torch.distributed.fsdp import fully_shard

                mesh = DeviceMesh.from_group(
                    group or dist.distributed_c10d._get_default_group(), "cpu"
                )
                model = _net()
                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                _train(model, rank, 20)
                # (each rank's shards: DTensor's full_tensor() goes through torch's C++
                # functional collectives, which a Python process group cannot serve)
                results.append([p.to_local().detach().reshape(-1) for p in model.parameters()])
        # (the gloo group must not die with DDP's Reducer: the Reducer's destructor holds the
        # GIL, and gloo's joins its worker threads, one of which may be freeing a tensor and
        # waiting for the GIL -- a deadlock, pytorch/pytorch#56297.  Dropped from Python last,
        # the group is destroyed with the GIL released)
        del model
        dist.destroy_process_group()
        del gloo
        out.put((rank, [torch.cat(r).numpy() for r in results], None))
    except BaseException:
        out.put((rank, [], traceback.format_exc()))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("n", [2, 4])
def test_training_matches_gloo(make_cluster: Any, spawn: Any, kind: str, n: int) -> None:
    import numpy as np

    reports = _run(make_cluster, spawn, parity_rank, n, kind)
    for rank, (fabricd_params, gloo_params), error in [
        (r[0], r[1] or [None, None], r[2]) for r in reports
    ]:
        assert error is None, f"rank {rank}: {error}"
        if n == 2:  # (two addends: the same sum in any order, bit for bit)
            np.testing.assert_array_equal(fabricd_params, gloo_params)
        else:
            np.testing.assert_allclose(fabricd_params, gloo_params, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(fabricd_params, reports[0][1][0] * 0)  # (it trained)


def dying_rank(socket_path: str, init: str, rank: int, n: int, out: Any) -> None:
    """The last rank dies once the group is up; the others' allreduce must fail, not hang."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    try:
        import fabricd.torch  # noqa: F401

        dist.init_process_group(
            "fabricd",
            init_method=init,
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=60),
        )
        dist.barrier()
        if rank == n - 1:
            out.put((rank, "died", None))
            out.close()
            out.join_thread()  # (the report is out before the process goes)
            os._exit(1)  # (no goodbye: the process is gone)
        t = torch.ones(100_000)
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait()
        except RuntimeError as exc:
            out.put((rank, str(exc), None))
            return
        out.put((rank, "no error", None))
    except BaseException:
        out.put((rank, "", traceback.format_exc()))


def test_a_rank_killed_mid_operation_fails_the_others_wait(make_cluster: Any, spawn: Any) -> None:
    reports = _run(make_cluster, spawn, dying_rank, 3)
    assert reports[2][1] == "died"
    for rank, said, error in reports[:2]:
        assert error is None, f"rank {rank}: {error}"
        assert "allreduce failed" in said, said
        # (rank 2 gone while the allreduce waits: "rank 2 left"; gone before it began: the
        # allreduce waits route_timeout "for ranks 2 to join", as for a rank never started;
        # under load rank 0 may not have joined yet either: "for ranks 0, 2 to join")
        assert re.search(r"\branks? (\d+, )*2\b", said), said


def job_rank(socket_path: str, init: str, rank: int, n: int, value: float, out: Any) -> None:
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    try:
        import fabricd.torch  # noqa: F401

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        t = torch.full((1000,), value + rank)
        for _ in range(20):
            dist.all_reduce(t)
            t /= n
        job = dist.group.WORLD.job  # type: ignore[union-attr]
        dist.destroy_process_group()
        out.put((rank, (float(t[0]), job), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def test_two_jobs_at_once_keep_apart(make_cluster: Any, spawn: Any) -> None:
    """Two runs of two ranks on the same two daemons, each with its own rendezvous: each
    job's name is drawn apart, and each averages only its own ranks' tensors."""
    cluster = make_cluster(2)
    results = multiprocessing.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as scratch:
        processes = [
            spawn(
                job_rank,
                cluster.nodes[r].socket_path,
                f"file://{scratch}/{job}",
                r,
                2,
                100.0 * job,
                results,
            )
            for job in (1, 2)
            for r in range(2)
        ]
        reports = [results.get(timeout=120) for _ in processes]
    assert all(error is None for _, _, error in reports), reports
    averages = sorted(value for _, (value, _), _ in reports)
    assert averages == [100.5, 100.5, 200.5, 200.5]
    assert len({job for _, (_, job), _ in reports}) == 2


def solo_rank(socket_path: str, init: str, rank: int, n: int, early: Any, out: Any) -> None:
    """allreduce_mode "solo": ranks 0 and 1 make five all_reduces while rank 2 has not begun
    (it waits until they are done): a sync all_reduce would hold them for it for ever."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    try:
        import fabricd.torch  # noqa: F401

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        group = dist.group.WORLD
        with pytest.raises(Exception, match="allreduce_mode is"):
            group.allreduce_mode = "sometimes"  # type: ignore[union-attr]
        group.allreduce_mode = "solo"  # type: ignore[union-attr]
        t = torch.ones(10)
        dist.all_reduce(t)  # (every rank's first call sets the collective up)
        if rank == 2 and not early.wait(60):
            out.put((rank, "ranks 0 and 1 were held", None))
            return
        for _ in range(5):
            dist.all_reduce(t)
        if rank == 1:
            early.set()
        group.allreduce_mode = "sync"  # type: ignore[union-attr]
        dist.barrier()
        out.put((rank, "done", None))
    except BaseException:
        out.put((rank, "", traceback.format_exc()))


def test_solo_allreduce_does_not_wait_for_a_late_rank(make_cluster: Any, spawn: Any) -> None:
    early = multiprocessing.get_context("spawn").Event()
    for rank, said, error in _run(make_cluster, spawn, solo_rank, 3, early):
        assert error is None, f"rank {rank}: {error}"
        assert said == "done", f"rank {rank}: {said}"


def review_rank(socket_path: str, init: str, rank: int, n: int, out: Any) -> None:
    """The review's findings, each as torch users write it (two ranks)."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    checks: list[tuple[str, bool, str]] = []
    try:
        import fabricd.torch  # noqa: F401

        store = dist.FileStore(init.removeprefix("file://") + ".store", n)
        for generation in range(2):  # (an init made again on the same store: a new job)
            dist.init_process_group(
                "fabricd",
                store=store,
                rank=rank,
                world_size=n,
                timeout=datetime.timedelta(seconds=60),
            )
            job = dist.group.WORLD.job  # type: ignore[union-attr]
            if generation:
                dist.destroy_process_group()
                break
            first_job = job
            dist.destroy_process_group()
        _compare(checks, "init again on one store: another job", job != first_job, True)
        dist.init_process_group("fabricd", store=store, rank=rank, world_size=n)
        peer = 1 - rank
        # an early irecv must not hold later collectives back
        got = torch.zeros(4)
        if rank == 0:
            early = dist.irecv(got, src=1)
            dist.barrier()
            dist.barrier()
            early.wait()
        else:
            dist.barrier()
            dist.barrier()
            dist.send(torch.ones(4), dst=0)
        _compare(checks, "irecv before two barriers", float(got.sum()) if rank == 0 else 4.0, 4.0)
        # more receives posted than a ring has slots, then the sends
        outs = [torch.zeros(4) for _ in range(12)]
        works = [dist.irecv(outs[i], src=peer, tag=i) for i in range(12)]
        works += [dist.isend(torch.full((4,), float(i)), dst=peer, tag=i) for i in range(12)]
        for work in works:
            work.wait()
        _compare(
            checks,
            "12 irecvs then 12 isends",
            [float(o[0]) for o in outs],
            [float(i) for i in range(12)],
        )
        # a future's callback that waits for another collective of the group (PowerSGD does)
        t, u = torch.ones(3), torch.ones(3)
        dist.all_reduce(t, async_op=True).get_future().then(
            lambda _: dist.all_reduce(u, async_op=True).get_future().wait()
        ).wait()
        _compare(checks, "a callback waits for a collective", float(u[0]), float(n))
        w1, w2 = dist.barrier(async_op=True), dist.barrier(async_op=True)
        w1.wait()
        w2.wait()
        checks.append(("two async barriers", True, ""))
        # uneven point-to-point traffic, then a gather: every rank names it alike
        if rank == 0:
            for _ in range(3):
                dist.send(torch.ones(256), dst=1)
        else:
            for _ in range(3):
                dist.recv(torch.zeros(256), src=0)
        gathered = [torch.zeros(4) for _ in range(n)]
        dist.all_gather(gathered, torch.full((4,), float(rank)))
        _compare(checks, "gather after uneven p2p", [float(g[0]) for g in gathered], [0.0, 1.0])
        # a Work's wait(timeout) honours it
        slow = dist.irecv(torch.zeros(2), src=peer, tag=99)
        try:
            slow.wait(datetime.timedelta(seconds=0.5))
            checks.append(("wait(timeout)", False, "returned"))
        except RuntimeError as exc:
            checks.append(("wait(timeout)", "did not finish within" in str(exc), str(exc)))
        dist.barrier()  # (no send before both timed waits are over, however late one rank is)
        dist.send(torch.zeros(2), dst=peer, tag=99)
        slow.wait()
        # a parameter (requires grad) and a strided tensor, reduced in place
        parameter = torch.nn.Parameter(torch.ones(3))
        with torch.no_grad():
            dist.all_reduce(parameter)
        _compare(
            checks, "all_reduce of a Parameter", parameter.detach(), torch.full((3,), float(n))
        )
        strided = torch.arange(6.0).reshape(2, 3).t()
        dist.all_reduce(strided)
        _compare(
            checks,
            "all_reduce of a strided tensor",
            strided,
            torch.arange(6.0).reshape(2, 3).t() * n,
        )
        dist.destroy_process_group()
        out.put((rank, checks, None))
    except BaseException:
        out.put((rank, checks, traceback.format_exc()))


def test_the_review_s_findings_stay_fixed(make_cluster: Any, spawn: Any) -> None:
    for rank, checks, error in _run(make_cluster, spawn, review_rank, 2):
        assert error is None, f"rank {rank}: {error}"
        wrong = [(what, detail) for what, ok, detail in checks if not ok]
        assert not wrong, f"rank {rank}: {wrong}"
        assert len(checks) == 9


def in_flight_rank(socket_path: str, init: str, rank: int, n: int, out: Any) -> None:
    """Many calls of one collective in flight at once (the later ones deferred until the one
    before ends), then how many collectives the daemon built for them."""
    os.environ["FABRICD_SOCKET"] = socket_path
    checks: list[tuple[str, bool, str]] = []
    try:
        import fabricd.torch  # noqa: F401
        from fabricd.client.top import total

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        rounds, k = 12, 4096
        gathered = [torch.zeros(k * n) for _ in range(rounds)]
        parts = [torch.zeros(k) for _ in range(rounds)]
        works = []
        for i in range(rounds):  # (no wait in between: all in flight together)
            works.append(
                dist.all_gather_into_tensor(
                    gathered[i], torch.full((k,), 1.0 * i + rank), async_op=True
                )
            )
            whole = torch.arange(k * n, dtype=torch.float32) + i
            works.append(dist.reduce_scatter_tensor(parts[i], whole, async_op=True))
            works.append(dist.all_reduce(torch.ones(k), async_op=True))
        for work in works:
            work.wait()
        for i in range(rounds):
            want = torch.cat([torch.full((k,), 1.0 * i + r) for r in range(n)])
            _compare(checks, f"all_gather {i}", gathered[i], want)
            mine = (torch.arange(k * n, dtype=torch.float32) + i)[rank * k : (rank + 1) * k] * n
            _compare(checks, f"reduce_scatter {i}", parts[i], mine)
        # one collective per operation, dtype and size on the daemon, whatever the calls in
        # flight: the allgather, the reduce-scatter, the allreduce (and a name per barrier
        # the init made)
        status = dist.group.WORLD.fab.status()  # type: ignore[union-attr]
        built = total(status, "fabricd_collectives")
        checks.append(("one collective each", 3 <= built <= 3 + 8, f"{built} collectives"))
        dist.destroy_process_group()
        out.put((rank, checks, None))
    except BaseException:
        out.put((rank, checks, traceback.format_exc()))


@pytest.mark.parametrize("n", [2, 3])
def test_calls_of_one_collective_in_flight_at_once(make_cluster: Any, spawn: Any, n: int) -> None:
    for rank, checks, error in _run(make_cluster, spawn, in_flight_rank, n):
        assert error is None, f"rank {rank}: {error}"
        wrong = [(what, detail) for what, ok, detail in checks if not ok]
        assert not wrong, f"rank {rank}: {wrong}"
        assert len(checks) == 12 * 2 + 1
