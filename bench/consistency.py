"""(m) ASAP §6.2's consistency microbenchmark (Fig. 8): how many updates a stochastic reduce used.

8 ranks on 4 daemons (2 each, as the other multi-rank benchmarks place them on a two-core
machine), an all-to-all graph (in-degree 7), ``--rounds`` calls of
``fab.stochastic_reduce(model, "all-to-all", sync)`` per rank on a float32 model of ``--size``
bytes, once per sync mode (NOTIFY-ACK, barrier, async), each rank sleeping a seeded random
0..``--jitter-ms`` ms before every call (the compute between reduces; the same sequence of
sleeps in every mode).  A model of a MiB takes a while to land, so a read can meet an update
still landing (torn) or another round's (stale, mixed-version): what the daemon's consistency
check (a version in each update's header and footer, ASAP §6.2) counts and leaves out.

Each rank records every call's :class:`~fabricd.client.stochastic.ReduceResult` and its
timings; the parent adds them up per mode: the share of reduces that used all in-neighbours,
the share that used at least in-degree - 2 (5 of 7: the share ASAP quotes), the distribution
of inputs used (Fig. 8's bars), the torn and stale updates left out, the round time (a rank's
rounds, sleeps included, over their count, averaged over ranks) and the time in a call.  Every
rank also reports its daemon's status row for the reduce (``fab.status()``), whose ``used``
histogram must match the calls' own.

NOTIFY-ACK waits for every in-neighbour's whole update of the round, so it must use all 7 in
every reduce: the benchmark raises otherwise (a bug, with the daemons' rows in the message), and
checks that the model each rank ends with is the job's mean.  Baseline: NOTIFY-ACK, in the same
run; the ratio is a mode's full-input share over NOTIFY-ACK's (1 for NOTIFY-ACK; lower: more
reduces short of inputs).  ASAP Fig. 8 (8 machines, RCV1): NOTIFY-ACK 100 % with all 7; BSP
77 % and ASYNC 39 % with 5 or more.

Run alone: ``python -m bench.consistency [--quick] [--ranks 8] [--nodes 4] [--rounds 200]
[--jitter-ms 5] [--size 1MiB] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from bench.report import (
    Column,
    MiB,
    Progress,
    Table,
    fmt_number,
    parse_size,
    quiet,
    stderr_progress,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.queues import Queue

    from fabricd.client import Client
    from fabricd.client.stochastic import Sync

#: the sync modes, the baseline first (the order of fabricd.client.stochastic.SYNCS)
MODES: Final[tuple[Sync, ...]] = ("notify-ack", "barrier", "async")
GRAPH: Final = "all-to-all"
RANKS, QUICK_RANKS = 8, 4
NODES, QUICK_NODES = 4, 2  #: 2 ranks per daemon either way
ROUNDS, QUICK_ROUNDS = 200, 20
NBYTES, QUICK_NBYTES = 1 * MiB, MiB // 4
JITTER_MS = 5.0
SEED = 0
#: ASAP quotes the share of reduces with >= 5 of 7 inputs: in-degree minus this
SHORT_BY: Final = 2
#: a reduce or barrier call that takes longer than this is broken, not slow
WAIT: Final = 120.0


@dataclass(frozen=True, slots=True)
class Spec:
    """One run's settings, the same for every rank."""

    job: str
    ranks: int
    rounds: int
    nbytes: int
    jitter_ms: float
    seed: int


def reduce_name(mode: str) -> str:
    return f"consistency-{mode}"


def _rank_main(socket_path: str, rank: int, reports: Queue[Any], spec: Spec) -> None:
    """A rank's process (under :func:`fabricd.demo.training.run_ranks`): every mode in turn,
    between barriers so that modes never overlap; report ``{mode: figures}`` at the end."""
    from fabricd.client import connect

    figures: dict[str, dict[str, Any]] = {}
    with connect(job=spec.job, rank=rank, size=spec.ranks, socket_path=socket_path) as fab:
        model = fab.array("model", (spec.nbytes // 4,), "float32")
        for mode in MODES:
            model[:] = rank
            fab.barrier(name=f"start-{mode}", timeout=WAIT)
            figures[mode] = _rounds(fab, model, rank, spec, mode)
            if mode == "notify-ack":  # round 0 averaged every rank's whole model; later rounds
                # averaged that mean with itself
                figures[mode]["mean_ok"] = bool(np.all(model == (spec.ranks - 1) / 2))
            # nobody leaves a mode (or the job) while a neighbour may still wait for its update
            fab.barrier(name=f"end-{mode}", timeout=WAIT)
            figures[mode]["daemon"] = _daemon_row(fab, spec.job, mode, rank)
    reports.put(("report", (rank, figures)))


def _rounds(
    fab: Client, model: np.ndarray[Any, Any], rank: int, spec: Spec, mode: Sync
) -> dict[str, Any]:
    """One mode's calls: each rank's (round, inputs, in_degree, torn, stale) per call, the
    seconds in each call, and the seconds from the first sleep to the last return."""
    from fabricd.errors import FabricError

    jitter = random.Random(spec.seed * 1_000_003 + rank)  # the same sleeps in every mode
    results: list[tuple[int, int, int, int, int]] = []
    calls: list[float] = []
    start = time.perf_counter()
    for _ in range(spec.rounds):
        time.sleep(jitter.uniform(0, spec.jitter_ms) / 1000)
        called = time.perf_counter()
        try:
            r = fab.stochastic_reduce(model, GRAPH, mode, name=reduce_name(mode), timeout=WAIT)
        except FabricError as exc:  # one line, with what the daemon says of the reduce
            rows = fab.status()["stochastic_reduces"]
            raise RuntimeError(
                f"{mode}, call {len(results)}: {exc!r}; daemon rows: {json.dumps(rows)}"
            ) from exc
        calls.append(time.perf_counter() - called)
        results.append((r.round, r.inputs, r.in_degree, r.torn, r.stale))
    return {"results": results, "calls": calls, "elapsed": time.perf_counter() - start}


def _daemon_row(fab: Client, job: str, mode: str, rank: int) -> dict[str, Any]:
    """This rank's row of its daemon's stochastic-reduce status for ``mode``'s reduce."""
    [row] = [
        r
        for r in fab.status()["stochastic_reduces"]
        if (r["job"], r["name"], r["rank"]) == (job, reduce_name(mode), rank)
    ]
    return dict(row)


@dataclass(frozen=True, slots=True)
class Summary:
    """One mode's figures over every rank's reduces."""

    reduces: int
    in_degree: int
    histogram: tuple[int, ...]  #: reduces that used k inputs, k = 0..in_degree
    torn: int
    stale: int
    round_seconds: float  #: per rank: elapsed / rounds; averaged over ranks
    call_seconds: float  #: averaged over every call

    def share(self, at_least: int) -> float:
        """The share of reduces that used at least ``at_least`` inputs."""
        return sum(self.histogram[max(0, at_least) :]) / self.reduces


def summarise(ranks: Sequence[dict[str, Any]]) -> Summary:
    """Add up one mode's figures (as :func:`_rounds` makes them) over ranks.

    Raises:
        ValueError: no reduces, or ranks that disagree on the in-degree (the graph is regular).
    """
    results = [r for rank in ranks for r in rank["results"]]
    degrees = {r[2] for r in results}
    if len(degrees) != 1:
        raise ValueError(f"expected one in-degree over all reduces, got {sorted(degrees)}")
    [degree] = degrees
    histogram = [0] * (degree + 1)
    for _, inputs, _, _, _ in results:
        histogram[inputs] += 1
    return Summary(
        reduces=len(results),
        in_degree=degree,
        histogram=tuple(histogram),
        torn=sum(r[3] for r in results),
        stale=sum(r[4] for r in results),
        round_seconds=fmean(rank["elapsed"] / len(rank["results"]) for rank in ranks),
        call_seconds=fmean(c for rank in ranks for c in rank["calls"]),
    )


def measure(spec: Spec, nodes: int) -> dict[int, dict[str, dict[str, Any]]]:
    """Run the job on a fresh fabric of ``nodes`` daemons; ``{rank: {mode: figures}}``."""
    from fabricd.daemon.launcher import LocalCluster
    from fabricd.demo.training import run_ranks

    out: dict[int, dict[str, dict[str, Any]]] = {}

    def collect(message: tuple[int, dict[str, dict[str, Any]]]) -> None:
        out[message[0]] = message[1]

    with LocalCluster(nodes) as cluster:
        cluster.wait_connected()
        run_ranks(
            cluster,
            -(-spec.ranks // nodes),  # blocks of consecutive ranks per daemon
            spec.ranks,
            _rank_main,
            (spec,),
            # the ranks share this machine's cores: a round of MiB updates may take 100 ms
            seconds=WAIT + len(MODES) * spec.rounds * (spec.jitter_ms / 1000 + 0.5),
            what="consistency",
            collect=collect,
        )
    if sorted(out) != list(range(spec.ranks)):
        raise RuntimeError(f"{len(out)} of {spec.ranks} ranks reported")
    return out


def run(
    quick: bool = False,
    progress: Progress = quiet,
    *,
    ranks: int | None = None,
    nodes: int | None = None,
    rounds: int | None = None,
    jitter_ms: float = JITTER_MS,
    nbytes: int | None = None,
    seed: int = SEED,
) -> Table:
    """Every sync mode on one job of ``ranks`` ranks over an all-to-all graph.

    Raises:
        RuntimeError: NOTIFY-ACK used fewer than every in-neighbour in some reduce, or a rank's
            model is not the job's mean after it (bugs), or a rank failed.
    """
    size = ranks or (QUICK_RANKS if quick else RANKS)
    daemons = min(nodes or (QUICK_NODES if quick else NODES), size)
    nbytes = nbytes or (QUICK_NBYTES if quick else NBYTES)
    if nbytes < 4 or nbytes % 4:
        raise ValueError("the size must be a whole number of float32 elements (4 B)")
    spec = Spec(
        job=f"bench-consistency-{uuid.uuid4().hex[:8]}",
        ranks=size,
        rounds=rounds or (QUICK_ROUNDS if quick else ROUNDS),
        nbytes=nbytes,
        jitter_ms=jitter_ms,
        seed=seed,
    )
    progress(
        f"{size} ranks on {daemons} daemon(s), {spec.rounds} rounds of {', '.join(MODES)}, "
        f"{nbytes} B model, 0-{jitter_ms:g} ms jitter"
    )
    per_rank = measure(spec, daemons)
    summaries = {mode: summarise([per_rank[r][mode] for r in range(size)]) for mode in MODES}
    degree = summaries[MODES[0]].in_degree
    table = Table(
        name="consistency",
        title=(
            f"(m) consistency of stochastic reduce (ASAP 6.2, Fig. 8): {size} ranks on "
            f"{daemons} daemons, {GRAPH} (in-degree {degree}), {spec.rounds} rounds of a "
            f"{nbytes} B float32 model, 0-{jitter_ms:g} ms jitter; share of reduces by inputs used"
        ),
        columns=[
            Column("all", f"{degree} in %"),
            Column("most", f">={degree - SHORT_BY} in %"),
            *(Column(f"in{k}", f"{k}", 2) for k in range(degree + 1)),
            Column("torn", "torn", 0),
            Column("stale", "stale", 0),
            Column("round_ms", "ms/round"),
            Column("call_ms", "ms/call"),
        ],
        ratio="this mode's share of reduces with every input / NOTIFY-ACK's (same run)",
        target="NOTIFY-ACK reduces with every in-neighbour's update 100% of the time (ASAP Fig. 8)",
        settings={**asdict(spec), "nodes": daemons},
    )
    table.notes.append(
        f"columns 0..{degree}: % of reduces that used that many in-neighbours' updates; torn, "
        "stale: updates left out because they were still landing or another round's"
    )
    baseline = summaries[MODES[0]].share(degree)
    for mode, s in summaries.items():
        distribution = {f"in{k}": 100 * n / s.reduces for k, n in enumerate(s.histogram)}
        table.add(
            mode,
            nbytes,
            s.share(degree) / baseline if baseline else float("nan"),
            all=100 * s.share(degree),
            most=100 * s.share(degree - SHORT_BY),
            **distribution,
            torn=s.torn,
            stale=s.stale,
            round_ms=s.round_seconds * 1e3,
            call_ms=s.call_seconds * 1e3,
        )
        progress(
            f"{mode}: all {degree} inputs in {fmt_number(100 * s.share(degree))}% of "
            f"{s.reduces} reduces, inputs used {list(s.histogram)}, torn {s.torn}, stale "
            f"{s.stale}, {fmt_number(s.round_seconds * 1e3)} ms/round"
        )
        daemon = [per_rank[r][mode]["daemon"] for r in range(size)]
        counted = [
            int(sum(column)) for column in zip(*(row["used"] for row in daemon), strict=True)
        ]
        if counted != list(s.histogram):
            table.notes.append(
                f"{mode}: the daemons counted inputs used {counted}, the calls {list(s.histogram)}"
            )
    notify = summaries[MODES[0]]
    table.target_met = notify.share(degree) == 1.0
    if not table.target_met:
        rows = [per_rank[r][MODES[0]]["daemon"] for r in range(size)]
        raise RuntimeError(
            f"BUG: NOTIFY-ACK used all {degree} inputs in only {notify.histogram[degree]} of "
            f"{notify.reduces} reduces (inputs used {list(notify.histogram)}); daemon rows: "
            + json.dumps(rows)
        )
    wrong = [r for r in range(size) if not per_rank[r][MODES[0]]["mean_ok"]]
    if wrong:
        raise RuntimeError(f"BUG: after NOTIFY-ACK, rank(s) {wrong} do not hold the job's mean")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.consistency", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--ranks", type=int, default=0, help=f"ranks (default {RANKS})")
    parser.add_argument("--nodes", type=int, default=0, help=f"daemons (default {NODES})")
    parser.add_argument("--rounds", type=int, default=0, help=f"calls per mode ({ROUNDS})")
    parser.add_argument(
        "--jitter-ms", type=float, default=JITTER_MS, help="each rank sleeps 0..this before a call"
    )
    parser.add_argument("--size", default="", help=f"model bytes (default {NBYTES}; e.g. 4MiB)")
    parser.add_argument("--seed", type=int, default=SEED, help="the sleeps' seed")
    args = parser.parse_args(argv)
    table = run(
        args.quick,
        stderr_progress("consistency"),
        ranks=args.ranks or None,
        nodes=args.nodes or None,
        rounds=args.rounds or None,
        jitter_ms=args.jitter_ms,
        nbytes=parse_size(args.size) if args.size else None,
        seed=args.seed,
    )
    print(table.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
