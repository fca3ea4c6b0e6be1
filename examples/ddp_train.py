"""Train a small model with PyTorch DDP whose gradients go through fabricd (sync, solo, majority).

Needs torch (``pip install 'fabricd[torch]'``).  It starts its own fabric of daemons on
loopback and one process per rank, spread over the nodes::

    python examples/ddp_train.py --mode majority --ranks 4 --nodes 2 --delay-ms 50

With ``--device cuda`` every rank's model lives on the GPU and the hook moves its gradient
buckets through pinned host memory.

Every rank fits the same small network to a fixed random function on batches of its own; before
each step one rank, drawn from a seed every rank shares, sleeps ``--delay-ms`` (a slow machine,
a long input).  With ``--mode sync`` everyone waits for it every step; with ``solo`` and
``majority`` the others go on and it catches up (its gradients join the next round).  Rank 0
prints the loss as it goes, then steps per second, the final loss on held-out data, and how many
ranks were active per bucket on average.  See docs/torch.md.
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import queue
import random
import time
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch.nn.parallel import DistributedDataParallel

import fabricd
import fabricd.torch
from fabricd.client.collectives import Mode
from fabricd.daemon.launcher import LocalCluster

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

INPUTS = 16
BATCH = 32
#: DDP without its per-step buffer sync: torch 2.13 names the switch forward_sync_buffers and
#: warns on broadcast_buffers, the only name that older torch knows
NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def make_model(seed: int) -> torch.nn.Module:
    """The network every rank trains (each from its own seed: the broadcast makes them equal)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )


def batch(generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the function to learn: a fixed smooth function of the inputs."""
    x = torch.randn(BATCH, INPUTS, generator=generator).to(device)
    return x, torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:8].sum(
        dim=1, keepdim=True
    )


def train(
    socket_path: str, rank: int, args: argparse.Namespace, report: Queue[tuple[int, str]]
) -> None:
    """One rank: DDP over a process group of its own, gradients through fabricd."""
    torch.set_num_threads(1)
    mode: Mode = args.mode
    with fabricd.connect(
        job="ddp_train", rank=rank, size=args.ranks, socket_path=socket_path
    ) as fab:
        group = fabricd.torch.init_local_process_group()
        model = make_model(seed=rank).to(args.device)
        fabricd.torch.broadcast_module(fab, model, timeout=60)
        ddp = DistributedDataParallel(
            model,
            process_group=group,
            bucket_cap_mb=args.bucket_cap_mb,
            **NO_BUFFER_SYNC,
        )
        state = fabricd.torch.register(ddp, fab, mode, timeout=60)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        data = torch.Generator().manual_seed(rank)
        slow = random.Random(args.seed)  # the same draws on every rank
        active: list[int] = []
        start = time.perf_counter()
        for step in range(args.steps):
            if slow.randrange(args.ranks) == rank:
                time.sleep(args.delay_ms / 1000)
            x, y = batch(data, args.device)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            torch.autograd.backward(loss)  # loss.backward() has no type hints
            optimizer.step()
            active.extend(result.active for result in state.results.values())
            if rank == 0 and step % 20 == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}")
        seconds = time.perf_counter() - start
        held_out = torch.Generator().manual_seed(10_000)
        with torch.no_grad():
            x, y = batch(held_out, args.device)
            final = torch.nn.functional.mse_loss(model(x), y).item()
        report.put(
            (
                rank,
                f"rank {rank}: {args.steps / seconds:.1f} steps/s, held-out loss {final:.4f}, "
                f"{sum(active) / len(active):.2f} of {args.ranks} ranks active on average",
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=get_args(Mode), default="sync")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2, help="daemons; ranks go round-robin")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=20, help="one slow rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.01, help="DDP's bucket size")
    parser.add_argument("--seed", type=int, default=0, help="which rank is slow at each step")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the models live"
    )
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    report: Queue[tuple[int, str]] = context.Queue()
    with LocalCluster(args.nodes) as cluster:
        cluster.wait_connected()
        ranks = [
            context.Process(
                target=train,
                args=(cluster.nodes[rank % args.nodes].socket_path, rank, args, report),
            )
            for rank in range(args.ranks)
        ]
        for process in ranks:
            process.start()
        lines: list[tuple[int, str]] = []
        while len(lines) < len(ranks):
            try:
                lines.append(report.get(timeout=1))
            except queue.Empty:
                failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
                if failed:
                    raise SystemExit(f"a rank failed (exit codes {failed}); see above") from None
        for process in ranks:
            process.join()
    for _, line in sorted(lines):
        print(line)


if __name__ == "__main__":
    main()
