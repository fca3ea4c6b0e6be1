"""Train a small model with PyTorch DDP, gradients through fabricd or, as a baseline, plain gloo.

Needs torch (``pip install 'fabricd[torch]'``).  It starts its own ranks, one process each, and
for ``--backend fabricd`` its own fabric of daemons on loopback (the ranks go round-robin over
the nodes)::

    python examples/ddp_train.py --mode majority --ranks 4 --nodes 2 --delay-ms 50
    python examples/ddp_train.py --backend gloo --ranks 4 --delay-ms 50    # the baseline

``--backend fabricd`` (the default) is DDP over a process group of each rank alone, every
gradient bucket averaged through fabricd by the communication hook (``fabricd.torch``), in mode
``--mode`` (sync, solo or majority).  ``--backend fabricd-pg`` is plain DDP, unchanged, over
the ``torch.distributed`` backend ``"fabricd"`` (``init_process_group("fabricd")``: every
collective through the daemons, sync).  ``--backend gloo`` is plain DDP over torch.distributed's
gloo group of all ranks (TCP on loopback, a file rendezvous), no daemons and no hook: what a
user would run without fabricd.  gloo has only the synchronous allreduce, so it takes no
``--mode`` but ``sync``.  Both start from the same model (rank 0's) and draw the same batches,
so with ``--mode sync`` the two train the same model up to the order of float additions.

The task: every rank fits a student network (16 inputs, two hidden layers of 64) to a fixed
random *teacher* network (16 inputs, 8 tanh units) on batches of its own.  The student can
represent the teacher exactly, so the loss keeps falling: on held-out data from 0.32 to 0.0016
in 200 steps of Adam in mode sync (30x lower after the first 60 steps).  Before each step one
rank, drawn from a seed every rank shares, sleeps ``--delay-ms`` (a slow machine, a long
input): with ``sync`` and gloo everyone waits for it every step; with ``solo`` and ``majority``
the others go on and it catches up (its gradients join the next round).

Rank 0 prints its batch loss as it goes.  At the end every rank prints its steps per second and
its model's loss on held-out data before and after training, and a last line sums the run up in
figures to set beside another run's (``summary: backend=... steps_per_s=... loss_final=...``):
the slowest rank's steps per second and the mean of the ranks' held-out losses.  With
``--device cuda`` every rank's model lives on the GPU (the hook moves its gradient buckets
through pinned host memory).  See docs/torch.md.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import multiprocessing
import os
import queue
import random
import tempfile
import time
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fabricd
import fabricd.torch
from fabricd.client.collectives import Mode
from fabricd.daemon.launcher import LocalCluster

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from fabricd.torch import HookState

INPUTS = 16
TEACHER_UNITS = 8
BATCH = 32
HELD_OUT = 1024
TEACHER_SEED = 1234
HELD_OUT_SEED = 10_000
PRINT_EVERY = 20
#: seconds a rank waits for the daemons or for gloo before it gives up
TIMEOUT = 60
#: DDP without its per-step buffer sync: torch 2.13 names the switch forward_sync_buffers and
#: warns on broadcast_buffers, the only name that older torch knows
NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class Report(NamedTuple):
    """What a rank tells the parent at the end (plain numbers: they cross a process boundary)."""

    rank: int
    steps_per_s: float
    loss_start: float
    loss_final: float
    #: ranks whose gradients were fresh in a bucket's round, on average; None for gloo
    active: float | None


def make_model(seed: int) -> torch.nn.Module:
    """The network every rank trains (each from its own seed: DDP or fabricd makes them equal)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )


def make_teacher(device: str) -> torch.nn.Module:
    """The function to learn: a fixed random one-layer tanh network, the same on every rank.

    Chosen over a closed-form function (the example's first version fitted a sine of a sum of
    inputs, which a small network barely learns in 200 steps) because the student can represent
    it exactly, so the loss keeps falling and a broken gradient path shows at once.  Weights of
    variance 1/fan-in keep its output near unit scale.
    """
    generator = torch.Generator().manual_seed(TEACHER_SEED)
    hidden = torch.nn.Linear(INPUTS, TEACHER_UNITS)
    out = torch.nn.Linear(TEACHER_UNITS, 1)
    with torch.no_grad():
        hidden.weight.copy_(torch.randn(TEACHER_UNITS, INPUTS, generator=generator) / INPUTS**0.5)
        out.weight.copy_(torch.randn(1, TEACHER_UNITS, generator=generator) / TEACHER_UNITS**0.5)
        hidden.bias.zero_()
        out.bias.zero_()
    return torch.nn.Sequential(hidden, torch.nn.Tanh(), out).requires_grad_(False).to(device)


def batch(
    generator: torch.Generator, teacher: torch.nn.Module, device: str, size: int = BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (standard normal) and the teacher's outputs for them."""
    x = torch.randn(size, INPUTS, generator=generator).to(device)
    return x, teacher(x)


def held_out_loss(model: torch.nn.Module, teacher: torch.nn.Module, device: str) -> float:
    """The model's loss on the same held-out inputs on every rank and in every run."""
    with torch.no_grad():
        x, y = batch(torch.Generator().manual_seed(HELD_OUT_SEED), teacher, device, HELD_OUT)
        return float(torch.nn.functional.mse_loss(model(x), y).item())


def fit(
    ddp: DistributedDataParallel,
    model: torch.nn.Module,
    rank: int,
    args: argparse.Namespace,
    state: HookState | None,
) -> Report:
    """The training loop, the same for both backends: ``args.steps`` steps of Adam.

    Adam rather than SGD: on this task, at their best learning rates, Adam's loss after 200 steps
    was about 3x lower than SGD with momentum's, and it needs no tuning per rank count.
    """
    teacher = make_teacher(args.device)
    start_loss = held_out_loss(model, teacher, args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(rank)
    slow = random.Random(args.seed)  # the same draws on every rank
    active: list[int] = []
    start = time.perf_counter()
    for step in range(args.steps):
        if slow.randrange(args.ranks) == rank:
            time.sleep(args.delay_ms / 1000)
        x, y = batch(data, teacher, args.device)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        torch.autograd.backward(loss)  # loss.backward() has no type hints
        optimizer.step()
        if state is not None:
            active.extend(result.active for result in state.results.values())
        if rank == 0 and step % PRINT_EVERY == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start
    return Report(
        rank,
        args.steps / seconds,
        start_loss,
        held_out_loss(model, teacher, args.device),
        sum(active) / len(active) if active else None,
    )


def train_fabricd(socket_path: str, rank: int, args: argparse.Namespace) -> Report:
    """One rank: DDP over a process group of its own, gradients through fabricd."""
    mode: Mode = args.mode
    with fabricd.connect(
        job="ddp_train", rank=rank, size=args.ranks, socket_path=socket_path
    ) as fab:
        group = fabricd.torch.init_local_process_group()
        model = make_model(seed=rank).to(args.device)
        fabricd.torch.broadcast_module(fab, model, timeout=TIMEOUT)
        ddp = DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=args.bucket_cap_mb, **NO_BUFFER_SYNC
        )
        state = fabricd.torch.register(ddp, fab, mode, timeout=TIMEOUT)
        return fit(ddp, model, rank, args, state)


def train_gloo(rendezvous: str, rank: int, args: argparse.Namespace) -> Report:
    """One rank of the baseline: plain DDP over a gloo group of all ranks, no fabricd at all
    (or, ``--backend fabricd-pg``, over the backend "fabricd": the same code, unchanged)."""
    dist.init_process_group(
        "fabricd" if args.backend == "fabricd-pg" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    try:
        model = make_model(seed=rank).to(args.device)
        # DDP's constructor broadcasts rank 0's parameters, as broadcast_module does for fabricd
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, **NO_BUFFER_SYNC)
        try:
            return fit(ddp, model, rank, args, None)
        finally:
            # (before the group goes: were DDP's Reducer the last to hold a gloo group, its
            # destructor would join gloo's threads holding the GIL one of them may be waiting
            # for, pytorch/pytorch#56297)
            del ddp
    finally:
        dist.destroy_process_group()


def run_rank(where: str, rank: int, args: argparse.Namespace, report: Queue[Report]) -> None:
    """A rank's process: ``where`` is its daemon's socket (fabricd) or the rendezvous file."""
    torch.set_num_threads(1)  # one core's worth per rank, whichever backend
    if args.backend == "fabricd-pg":  # (its daemon's socket; the rendezvous is the file's)
        os.environ["FABRICD_SOCKET"] = where
        where = args.rendezvous
    train = train_fabricd if args.backend == "fabricd" else train_gloo
    report.put(train(where, rank, args))


def run_ranks(places: list[str], args: argparse.Namespace) -> list[Report]:
    """Start one process per rank, rank ``r`` at ``places[r]``; their reports, by rank."""
    context = multiprocessing.get_context("spawn")
    report: Queue[Report] = context.Queue()
    ranks = [
        context.Process(target=run_rank, args=(place, rank, args, report))
        for rank, place in enumerate(places)
    ]
    for process in ranks:
        process.start()
    reports: list[Report] = []
    while len(reports) < len(ranks):
        try:
            reports.append(report.get(timeout=1))
        except queue.Empty:
            failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if failed:
                for process in ranks:
                    process.kill()
                raise SystemExit(f"a rank failed (exit codes {failed}); see above") from None
    for process in ranks:
        process.join()
    return sorted(reports)


def summary(reports: list[Report], args: argparse.Namespace) -> list[str]:
    """A line per rank, then the run's figures on one line of ``key=value`` pairs."""
    lines = []
    for r in reports:
        how = "gloo: every rank in every step"
        if r.active is not None:
            how = f"{r.active:.2f} of {args.ranks} ranks active on average"
        lines.append(
            f"rank {r.rank}: {r.steps_per_s:.1f} steps/s, held-out loss {r.loss_start:.4f} -> "
            f"{r.loss_final:.4f} ({r.loss_start / r.loss_final:.0f}x lower), {how}"
        )
    mode = "sync" if args.backend == "gloo" else args.mode
    figures = {
        "backend": args.backend,
        "mode": mode,
        "ranks": args.ranks,
        "steps": args.steps,
        "steps_per_s": f"{min(r.steps_per_s for r in reports):.2f}",
        "loss_start": f"{sum(r.loss_start for r in reports) / len(reports):.6f}",
        "loss_final": f"{sum(r.loss_final for r in reports) / len(reports):.6f}",
    }
    lines.append("summary: " + " ".join(f"{key}={value}" for key, value in figures.items()))
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=["fabricd", "fabricd-pg", "gloo"],
        default="fabricd",
        help="fabricd: DDP with fabricd's hook; fabricd-pg: plain DDP over the backend "
        '"fabricd"; gloo: plain DDP over gloo (the baseline)',
    )
    parser.add_argument(
        "--rendezvous",
        default="",
        help=argparse.SUPPRESS,  # (set by main for fabricd-pg)
    )
    parser.add_argument("--mode", choices=get_args(Mode), default="sync", help="fabricd only")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2, help="daemons (fabricd only)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=20, help="one slow rank per step")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.01, help="DDP's bucket size")
    parser.add_argument("--seed", type=int, default=0, help="which rank is slow at each step")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the models live"
    )
    args = parser.parse_args()
    if args.backend != "fabricd" and args.mode != "sync":
        parser.error(
            f"--mode {args.mode} needs --backend fabricd (the hook): a process group is sync"
        )
    if args.ranks < 1 or args.steps < 1 or args.nodes < 1:
        parser.error("--ranks, --steps and --nodes must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    what = f"fabricd, mode {args.mode}" if args.backend == "fabricd" else args.backend
    print(f"{what}: {args.ranks} ranks, {args.steps} steps, one {args.delay_ms:g} ms late each")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only; the ranks inherit it
    with tempfile.TemporaryDirectory() as directory:
        args.rendezvous = os.path.join(directory, "rendezvous")
        if args.backend == "gloo":
            reports = run_ranks([args.rendezvous] * args.ranks, args)
        else:
            with LocalCluster(args.nodes) as cluster:
                cluster.wait_connected()
                sockets = [node.socket_path for node in cluster.nodes]
                places = [sockets[rank % args.nodes] for rank in range(args.ranks)]
                reports = run_ranks(places, args)
    for line in summary(reports, args):
        print(line)


if __name__ == "__main__":
    main()
