"""fabricd.torch: DDP's gradient buckets averaged through real daemons (issue 10, item 5).

Each rank is a spawned process with its own DDP model over a process group of its own
(``init_local_process_group``), so fabricd is the only thing between the ranks: the initial
model comes from ``broadcast_module`` and every gradient from the hook.  The training tests run
on the CPU and, where torch sees a GPU, with the model on it (the hook's pinned-memory path).
"""

from __future__ import annotations

import inspect
import itertools
import multiprocessing
import queue
from typing import Any

import numpy as np
import pytest

# no importorskip: torch is in the test extra, so a missing torch is a broken test environment
# that must fail, not a reason to pass with the hook untested
import torch

import fabricd
import fabricd.torch as fabtorch

RANKS = 2
STEPS = 4
#: small enough that the model's parameters spread over several buckets
BUCKET_CAP_MB = 100 / 2**20
#: where the ranks' models live; a CUDA bucket goes through a pinned host copy in the hook
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="torch sees no CUDA device: the hook's CUDA path (pinned staging) needs a GPU",
        ),
    ),
]
#: DDP without its per-step buffer sync: torch 2.13 names the switch forward_sync_buffers and
#: warns on broadcast_buffers, the only name that older torch (as on a GPU machine) knows
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers"
    in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    )


def _batch(step: int, rank: int, device: str) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=generator).to(device)
    return x, x.sum(dim=1, keepdim=True)


def train_rank(
    socket_path: str,
    job: str,
    rank: int,
    mode: str,
    rendezvous: str | None,
    device: str,
    out: Any,
) -> None:
    """STEPS steps of DDP with the fabricd hook; report each step's gradients and results.

    DDP's process group is this process alone, or with ``rendezvous`` (a file) a gloo group of
    all ranks, which DDP then sets itself up through.  Alongside, a plain copy of the model
    computes every rank's gradient itself and averages them by hand: that is what DDP's
    gradients must be in mode sync.  Both models live on ``device``; the report says whether
    parameters and gradients were still there at the end, and whether every bucket went
    through pinned host memory (CUDA) or straight into the shared array (CPU).
    """
    torch.set_num_threads(1)
    with fabricd.connect(job=job, rank=rank, size=RANKS, socket_path=socket_path) as fab:
        if rendezvous is None:
            group = fabtorch.init_local_process_group()
        else:
            torch.distributed.init_process_group(
                "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=RANKS
            )
            group = torch.distributed.group.WORLD
        model = _model(seed=rank).to(device)  # different on every rank until the broadcast
        fabtorch.broadcast_module(fab, model, timeout=60)
        reference = _model(seed=0).to(device)  # rank 0's: what the broadcast must have given
        if any(
            not torch.equal(a, b)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        ):
            raise AssertionError("broadcast_module did not copy rank 0's parameters")
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB, **NO_BUFFER_SYNC
        )
        state = fabtorch.register(ddp, fab, mode, timeout=60)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = []
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = _batch(step, rank, device)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            expected = _manual_average(reference, step, device)
            error = max(
                (p.grad - e).abs().max().item()
                for p, e in zip(model.parameters(), expected, strict=True)
            )
            results = sorted((i, r.round, r.included, r.active) for i, r in state.results.items())
            steps.append((error, results))
            optimizer.step()
            with torch.no_grad():  # the next hand-made average starts where DDP's model is
                for p, q in zip(reference.parameters(), model.parameters(), strict=True):
                    p.copy_(q)
        placed = all(
            p.device.type == device and p.grad is not None and p.grad.device.type == device
            for p in model.parameters()
        )
        staged = [  # the hook's per-bucket copies: pinned for a CUDA bucket, none for a CPU one
            slot.staging is not None and slot.staging.is_pinned()
            for slot in state._buckets.values()
        ]
        # numpy, not tensors: torch would pass tensors by fd, from a process about to exit
        params = [p.detach().cpu().numpy().copy() for p in model.parameters()]
        out.put((rank, steps, params, placed, staged))


def _manual_average(model: Any, step: int, device: str) -> list[Any]:
    """The gradient of every rank's batch at ``step`` on ``model``, averaged by hand."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(RANKS):
        model.zero_grad()
        x, y = _batch(step, rank, device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for t, p in zip(total, model.parameters(), strict=True):
            t += p.grad
    model.zero_grad()
    return [t / RANKS for t in total]


class _TwoLayers(torch.nn.Module):
    """Two equal layers, applied in the order ``swapped`` says."""

    def __init__(self, swapped: bool) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.swapped = swapped

    def forward(self, x):
        if self.swapped:
            return self.first(self.second(x))
        return self.second(self.first(x))


def swapped_rank(socket_path: str, job: str, rank: int, out: Any) -> None:
    """The layers in another order on rank 1: the same bucket sizes, other contents."""
    torch.set_num_threads(1)
    with fabricd.connect(job=job, rank=rank, size=RANKS, socket_path=socket_path) as fab:
        group = fabtorch.init_local_process_group()
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            _TwoLayers(swapped=rank == 1),
            process_group=group,
            bucket_cap_mb=BUCKET_CAP_MB,
            **NO_BUFFER_SYNC,
        )
        fabtorch.register(ddp, fab, "sync", timeout=60)
        outcome = "no error"
        for _ in range(3):  # DDP lays the buckets out again, by gradient order, after step 0
            try:
                ddp(torch.randn(2, 4)).sum().backward()
            except Exception as exc:  # DDP may wrap what the hook raised
                outcome = str(exc)
                break
        out.put((rank, outcome))


def _run(make_cluster, spawn, target, *args) -> list[Any]:
    cluster = make_cluster(RANKS)
    out = multiprocessing.get_context("spawn").Queue()
    processes = [
        spawn(target, cluster.nodes[rank].socket_path, "torch", rank, *args, out)
        for rank in range(RANKS)
    ]
    reports = []
    for _ in processes:
        try:
            reports.append(out.get(timeout=120))
        except queue.Empty:
            pytest.fail(f"a rank reported nothing; exit codes {[p.exitcode for p in processes]}")
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    return sorted(reports, key=lambda report: report[0])


def _check_placement(device: str, placed: bool, staged: list[bool]) -> None:
    """The model and its gradients stayed on ``device``; the buckets took that device's path."""
    assert placed, f"a parameter or its gradient left {device}"
    assert staged  # the hook saw buckets
    assert all(staged) if device == "cuda" else not any(staged)


@pytest.mark.parametrize("device", DEVICES)
def test_sync_gradients_are_the_ranks_average(make_cluster, spawn, device):
    reports = _run(make_cluster, spawn, train_rank, "sync", None, device)
    for _rank, steps, _params, placed, staged in reports:
        _check_placement(device, placed, staged)
        for error, results in steps:
            assert error < 1e-6  # float32 sums in another order than the hand-made average
            assert all(included and active == RANKS for _, _, included, active in results)
        # DDP's first step has one bucket; from the second on, the layout it keeps: several
        # buckets, one collective each, one round per step
        assert len(steps[1][1]) > 1
        for (_, before), (_, after) in itertools.pairwise(steps[1:]):
            assert [(i, r + 1) for i, r, _, _ in before] == [(i, r) for i, r, _, _ in after]
    # the same gradients on both ranks, from the same start: the same model after every step
    for a, b in zip(reports[0][2], reports[1][2], strict=True):
        assert (a == b).all()


@pytest.mark.parametrize("device", DEVICES)
def test_with_a_gloo_group_of_all_ranks_gradients_still_come_from_fabricd(
    make_cluster, spawn, tmp_path, monkeypatch, device
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the spawned ranks inherit it: loopback only
    reports = _run(make_cluster, spawn, train_rank, "sync", str(tmp_path / "rendezvous"), device)
    for _rank, steps, _params, placed, staged in reports:
        _check_placement(device, placed, staged)
        for error, results in steps:
            assert error < 1e-6
            assert results  # the hook, not gloo, averaged them
            assert all(included and active == RANKS for _, _, included, active in results)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_partial_modes_train_and_report(make_cluster, spawn, mode, device):
    reports = _run(make_cluster, spawn, train_rank, mode, None, device)
    for _rank, steps, params, placed, staged in reports:
        _check_placement(device, placed, staged)
        # steps 0 and 1 are sync: DDP's first layout, then the one it keeps (the hook's rule)
        for error, results in steps[:2]:
            assert error < 1e-6
            assert all(included and active == RANKS for _, _, included, active in results)
        for _error, results in steps[2:]:
            for _index, round_, _included, active in results:
                assert round_ >= 0
                assert 1 <= active <= RANKS
        assert all(np.isfinite(p).all() for p in params)


def test_ranks_whose_buckets_differ_are_told(make_cluster, spawn):
    reports = _run(make_cluster, spawn, swapped_rank)
    for _rank, outcome in reports:
        assert "holds other parameters on other ranks" in outcome


def bfloat16_rank(socket_path: str, job: str, rank: int, out: Any) -> None:
    """A bfloat16 model: broadcast_module makes the ranks' models equal, and the hook's
    gradients, carried as bfloat16, are the ranks' average made in float32 and rounded once
    (two ranks: one addition in float32 rounded to bfloat16, then a halving, exact but in
    the subnormals, rounded the same way)."""
    torch.set_num_threads(1)
    with fabricd.connect(job=job, rank=rank, size=RANKS, socket_path=socket_path) as fab:
        group = fabtorch.init_local_process_group()
        model = _model(seed=rank).to(torch.bfloat16)
        fabtorch.broadcast_module(fab, model, timeout=60)
        reference = _model(seed=0).to(torch.bfloat16)
        equal = all(
            torch.equal(a, b)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB, **NO_BUFFER_SYNC
        )
        fabtorch.register(ddp, fab, "sync", timeout=60)
        grads = []
        for step in range(2):
            x, y = _batch(step, rank, "cpu")
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        expected = []
        for step in range(2):
            total = [torch.zeros(p.shape) for p in reference.parameters()]
            for r in range(RANKS):
                reference.zero_grad()
                x, y = _batch(step, r, "cpu")
                torch.nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()).backward()
                for t, p in zip(total, reference.parameters(), strict=True):
                    t += p.grad.float()
            expected.append([(t / RANKS).bfloat16() for t in total])
        same = all(
            torch.equal(g, e)
            for got, want in zip(grads, expected, strict=True)
            for g, e in zip(got, want, strict=True)
        )
        out.put((rank, equal, same))


def test_bfloat16_models_are_broadcast_and_averaged(make_cluster, spawn):
    for rank, equal, same in _run(make_cluster, spawn, bfloat16_rank):
        assert equal, f"rank {rank}: broadcast_module left another model"
        assert same, f"rank {rank}: bfloat16 gradients differ from the float32 average, rounded"
