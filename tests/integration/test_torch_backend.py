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

import multiprocessing
import os
import queue
import tempfile
import traceback
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
    checks: list[tuple[str, bool, str]] = []
    try:
        import fabricd.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        gloo = dist.new_group(backend="gloo")
        assert dist.get_backend() == "fabricd"
        for part in (_reductions, _movements, _scatters, _the_rest):
            part(rank, n, gloo, checks)
        dist.destroy_process_group()
        out.put((rank, checks, None))
    except BaseException:
        out.put((rank, checks, traceback.format_exc()))


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
                reports.append(results.get(timeout=240))
            except queue.Empty:
                pytest.fail(
                    f"a rank reported nothing; exit codes {[p.exitcode for p in processes]}"
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
