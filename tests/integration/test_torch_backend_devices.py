"""The backend "fabricd" on each device it takes (fabricd/torch/devices.py, issue 30, item 1).

Every operation of the process group runs on tensors of the device under test (the CPU, and a
CUDA device where torch sees one: both ranks share ``cuda:0``), and the same operation runs on
a gloo group of the same ranks over CPU tensors of the same values: the results must be equal,
and stay on the device.  Each case also makes an input on a side stream and calls with that
stream current (on CUDA the call must see the producer's work, and the stream the result after
``wait()``; on the CPU the stream is nothing), and trains DDP on the device to the parameters
DDP over gloo reaches on the CPU; on CUDA a call whose tensors are on two devices is refused.

The CPU case runs everywhere (it exercises the same lines as the CUDA case: copies with
``copy_`` between the tensors and the staging arrays).  The CUDA case skips without a GPU
("no CUDA device"); on a GPU machine run it as is::

    pytest -q -p no:randomly tests/integration/test_torch_backend_devices.py
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.integration.test_torch_backend import STACKS_AFTER, _compare, _run, _values

pytestmark = pytest.mark.timeout(300)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="no CUDA device: the process group's CUDA path (page-locked staging) "
            "needs a GPU that 2 processes can share",
        ),
    ),
]
Checks = list[tuple[str, bool, str]]


def _on(device: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device)


def _reductions(rank: int, n: int) -> dict[str, Any]:
    """name -> what runs it on ``group`` with tensors on ``dev``, returning the result."""

    def reduce(dtype: torch.dtype, op: Any, length: int = 7) -> Any:
        def run(group: Any, dev: str) -> torch.Tensor:
            t = _on(dev, _values(rank, n, dtype, length))
            dist.all_reduce(t, op=op, group=group)
            return t

        return run

    def strided(group: Any, dev: str) -> torch.Tensor:
        t = _on(dev, torch.arange(6.0).reshape(2, 3) + rank).t()
        dist.all_reduce(t, group=group)
        return t

    def coalesced(group: Any, dev: str) -> torch.Tensor:
        ts = [_on(dev, _values(rank, n, torch.float32, k)) for k in (4, 9)]
        dist.all_reduce_coalesced(ts, group=group)
        return torch.cat(ts)

    def reduce_to(group: Any, dev: str) -> torch.Tensor:
        t = _on(dev, _values(rank, n, torch.float32))
        dist.reduce(t, dst=n - 1, group=group)
        return t if rank == n - 1 else t[:0]

    return {
        "all_reduce sum float32": reduce(torch.float32, dist.ReduceOp.SUM),
        "all_reduce sum bfloat16": reduce(torch.bfloat16, dist.ReduceOp.SUM),
        "all_reduce max int64": reduce(torch.int64, dist.ReduceOp.MAX),
        "all_reduce sum int8": reduce(torch.int8, dist.ReduceOp.SUM),
        "all_reduce product float32": reduce(torch.float32, dist.ReduceOp.PRODUCT),
        "all_reduce bxor int32": reduce(torch.int32, dist.ReduceOp.BXOR),
        "all_reduce sum float32 large": reduce(torch.float32, dist.ReduceOp.SUM, 70_000),
        "all_reduce strided": strided,
        "all_reduce_coalesced": coalesced,
        "reduce": reduce_to,
    }


def _moves(rank: int, n: int) -> dict[str, Any]:
    def bcast(group: Any, dev: str) -> torch.Tensor:
        t = _on(dev, _values(rank, n, torch.float32, 5) if rank == 1 else torch.zeros(5))
        dist.broadcast(t, src=1, group=group)
        return t

    def gather_list(group: Any, dev: str) -> torch.Tensor:
        out = [_on(dev, torch.zeros(5, dtype=torch.int64)) for _ in range(n)]
        dist.all_gather(out, _on(dev, _values(rank, n, torch.int64, 5)), group=group)
        return torch.stack(out)

    def gather_flat(group: Any, dev: str) -> torch.Tensor:
        out = _on(dev, torch.zeros(5 * n, dtype=torch.bfloat16))
        dist.all_gather_into_tensor(out, _on(dev, _values(rank, n, torch.bfloat16, 5)), group=group)
        return out

    def gather_many(group: Any, dev: str) -> torch.Tensor:
        ins = [_on(dev, _values(rank + k, n, torch.float32, 3 + k)) for k in range(2)]
        outs = [[torch.zeros_like(t) for t in ins] for _ in range(n)]
        dist.all_gather_coalesced(outs, ins, group=group)
        return torch.cat([t for row in outs for t in row])

    def gather_to(group: Any, dev: str) -> torch.Tensor:
        out = [_on(dev, torch.zeros(4)) for _ in range(n)] if rank == 0 else None
        dist.gather(_on(dev, _values(rank, n, torch.float32, 4)), out, dst=0, group=group)
        return torch.stack(out) if out is not None else torch.zeros(0, device=dev)

    return {
        "broadcast": bcast,
        "all_gather": gather_list,
        "all_gather_into_tensor": gather_flat,
        "all_gather_coalesced": gather_many,
        "gather": gather_to,
    }


def _scatters(rank: int, n: int) -> dict[str, Any]:
    def rs_list(group: Any, dev: str) -> torch.Tensor:
        out = _on(dev, torch.zeros(3))
        ins = [_on(dev, _values(rank + j, n, torch.float32, 3)) for j in range(n)]
        dist.reduce_scatter(out, ins, group=group)
        return out

    def rs_flat(op: Any) -> Any:
        def run(group: Any, dev: str) -> torch.Tensor:
            out = _on(dev, torch.zeros(3, dtype=torch.int64))
            whole = _on(dev, _values(rank, n, torch.int64, 3 * n))
            dist.reduce_scatter_tensor(out, whole, op=op, group=group)
            return out

        return run

    def scatter_from(group: Any, dev: str) -> torch.Tensor:
        out = _on(dev, torch.zeros(4))
        ins = [_on(dev, _values(j, n, torch.float32, 4)) for j in range(n)] if rank == 0 else None
        dist.scatter(out, ins, src=0, group=group)
        return out

    def a2a(group: Any, dev: str) -> torch.Tensor:
        outs = [_on(dev, torch.zeros(2)) for _ in range(n)]
        ins = [_on(dev, _values(rank * n + j, n, torch.float32, 2)) for j in range(n)]
        dist.all_to_all(outs, ins, group=group)
        return torch.stack(outs)

    def a2a_uneven(group: Any, dev: str) -> torch.Tensor:
        splits_in = [(rank + j) % 2 + 1 for j in range(n)]
        splits_out = [(j + rank) % 2 + 1 for j in range(n)]
        source = _on(dev, torch.arange(sum(splits_in)).float() + 100 * rank)
        out = _on(dev, torch.zeros(sum(splits_out)))
        dist.all_to_all_single(out, source, splits_out, splits_in, group=group)
        return out

    return {
        "reduce_scatter": rs_list,
        "reduce_scatter_tensor sum": rs_flat(dist.ReduceOp.SUM),
        "reduce_scatter_tensor product": rs_flat(dist.ReduceOp.PRODUCT),
        "scatter": scatter_from,
        "all_to_all": a2a,
        "all_to_all_single uneven": a2a_uneven,
    }


def _point_to_point(rank: int, n: int) -> dict[str, Any]:
    def ring(group: Any, dev: str) -> torch.Tensor:
        mine, got = _on(dev, torch.full((6,), float(rank))), _on(dev, torch.zeros(6))
        right, left = (rank + 1) % n, (rank - 1) % n  # (gloo's group: every rank, in order)
        works = [dist.irecv(got, left, group=group), dist.isend(mine, right, group=group)]
        for work in works:
            work.wait()
        return got

    def future(group: Any, dev: str) -> torch.Tensor:
        t = _on(dev, torch.ones(1000))
        value = dist.all_reduce(t, async_op=True, group=group).get_future().wait()
        return value[0] if isinstance(value, list) else t

    return {"isend/irecv ring": ring, "async all_reduce's future": future}


def _side_stream(device: str) -> Any:
    """A stream other than the current one (CUDA), or nothing (CPU)."""
    if device == "cuda":
        return torch.cuda.stream(torch.cuda.Stream())
    return contextlib.nullcontext()


def _streams(rank: int, n: int, device: str, checks: Checks) -> None:
    """The input made on a side stream (a long kernel chain) and the call made with that
    stream current: the call must see the whole chain, and the stream the result."""
    with _side_stream(device):
        t = torch.zeros(1 << 20, device=device)
        for _ in range(50):
            t += 1
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        total = float(t.sum())  # (summed and read on the side stream, after wait())
    _compare(checks, f"{device}: side stream", total, float(50 * n * (1 << 20)))


def _ddp(rank: int, device: str, gloo: Any, checks: Checks) -> None:
    """DDP trains a model on ``device`` over the fabricd group to the parameters DDP over gloo
    reaches on the CPU (to float rounding: a GPU's matmuls round otherwise)."""
    params = []
    for group, dev in ((None, device), (gloo, "cpu")):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model = torch.nn.parallel.DistributedDataParallel(
            net.to(dev), process_group=group, bucket_cap_mb=0.0001
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = (model(x.to(dev)) - x.sum(dim=1, keepdim=True).to(dev)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        params.append(torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()]))
        del model
    close = torch.allclose(params[0], params[1], rtol=1e-4, atol=1e-5)
    checks.append((f"{device}: DDP as over gloo", close, f"{params[0]} {params[1]}"))


def _refusals(device: str, checks: Checks) -> None:
    if device != "cuda":
        return
    try:
        dist.all_gather_into_tensor(torch.zeros(4), torch.zeros(2, device="cuda"))
        checks.append(("cuda: mixed devices refused", False, "accepted"))
    except Exception as exc:
        said = str(exc)
        ok = "all_gather_single takes tensors on one device" in said
        checks.append(("cuda: mixed devices refused", ok, said))


def devices_rank(socket_path: str, init: str, rank: int, n: int, device: str, out: Any) -> None:
    """Every operation on ``device`` over the fabricd default group, against gloo on the CPU."""
    os.environ["FABRICD_SOCKET"] = socket_path
    faulthandler.dump_traceback_later(STACKS_AFTER)
    checks: Checks = []
    try:
        import fabricd.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("fabricd", init_method=init, rank=rank, world_size=n)
        gloo = dist.new_group(backend="gloo")
        cases: dict[str, Any] = {}
        for part in (_reductions, _moves, _scatters, _point_to_point):
            cases |= part(rank, n)
        for name, run in cases.items():
            got, ref = run(None, device), run(gloo, "cpu")
            on = got.device.type == device
            checks.append((f"{device}: {name} stays on {device}", on, str(got.device)))
            _compare(checks, f"{device}: {name}", got.cpu(), ref)
        dist.barrier()
        _streams(rank, n, device, checks)
        _ddp(rank, device, gloo, checks)
        _refusals(device, checks)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, checks, None))
    except BaseException:
        out.put((rank, checks, traceback.format_exc()))


@pytest.mark.parametrize("device", DEVICES)
def test_every_operation_on_the_device_matches_gloo(
    make_cluster: Any, spawn: Any, device: str
) -> None:
    for rank, checks, error in _run(make_cluster, spawn, devices_rank, 2, device):
        assert error is None, f"rank {rank}: {error}"
        wrong = [(what, detail) for what, ok, detail in checks if not ok]
        assert not wrong, f"rank {rank}: {wrong}"
        assert len(checks) == 2 * 23 + 2 + (device == "cuda")
