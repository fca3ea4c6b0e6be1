"""MLfabric's Table 2 in virtual time: MLfabric-A against RR-Sync, Tr-Sync and Async under
compute stragglers C1-C3 and network conditions N1-N3 (MLfabric §7, §7.1), and MLfabric-S
against RR-Sync and Tr-Sync in the same settings (§7.2).

A discrete-event simulation (:mod:`bench.mlfabric_sim`; no sleeping, no sockets, seeded,
bounded) of data-parallel training of L2-regularised logistic regression
(:mod:`bench.mlfabric_model`) by ``n`` workers (8, and 16 in the full run) and one server on a
star network whose hosts' NIC rates change every 5 s (:mod:`bench.mlfabric_net`).  MLfabric-A's
decisions are fabricd's engines': the shard scheduler (Alg. 2, and Alg. 3's groups with
``aggregation=True``: its ``Granted.via`` and ``Gather`` decisions), the aggregator daemon's
``Gathering``, and the parameter server's consistency engine with its delay bound
(``push_aggregate`` for aggregates).

The mapping to the paper (§7): rates are the paper's ÷100 (10 Gbit/s becomes 100 Mbit/s) and
the model is 1 MB on the wire, so each transfer takes the time ResNet-50's 100 MB took at the
paper's rates; compute times are not scaled.  Parameters and why:

* compute: 1.0 s per mini-batch (:data:`BASE_COMPUTE`), because the paper's iterations took
  about 1.3 s (§7.1: "100 ms - 7.6 % of overall 1300 ms"; LDA's RR-Sync 182 s / 145
  iterations) of which a push and a pull at full rate are 0.16 s.  The speedup depends on it:
  the extra row at 0.25 s shows the other side (there the server's uplink, which carries
  every pull, is the bottleneck: see docs/mlfabric.md);
* the server's NIC is 10 Gbit/s (scaled) both ways and not varied: §7 hosts it on a
  dedicated machine; every worker's up and down rates vary independently (N1-N3);
* ``tau_max = n`` (the paper's 30 for 30 workers, scaled with ``n``); the extra row gives
  the paper's 30 at 8 workers;
* one learning rate for every strategy, per gradient (a synchronous step is ``lr`` times the
  sum of the ``n`` gradients, an asynchronous one ``lr`` times one): 0.2, the best of the
  doubling grid 0.1, 0.2, 0.4 for RR-Sync, the baseline (0.4 does not reach the target);
* the target: the loss gap to the optimum down to 2 % of the initial gap (5 % in quick
  mode), the median over 5 seeds.  At 1 % the target sits in SGD's noise floor (RR-Sync
  needed 84 to 248 iterations to it over five seeds of C1-N1; 61 to 91 at 2 %), and the time
  to it measured the noise more than the strategy; time per iteration is virtual seconds per
  ``n`` gradients applied;
* the scheduler batches every 100 ms and the monitor lags 0.2 s (§7).

Aggregation rows (issue 24 item 7's ">= 2x fewer server bytes"): in the main sweep a 100 ms
batch holds less than one update at 8 workers (each ready once per 1.4-2.6 s), so Alg. 3 has
little to group.  Aggregation matters (§3.2) where updates are ready faster than the server's
downlink takes them, so batches hold several: the rows run C1-N1 with 0.1 s computations
(communication-bound: a push and a pull at full rate take 0.16 s), MLfabric-A with and
without aggregation, 5 seeds, in exact mode (updates on a 2^-30 grid under the ``sum`` rule,
so the equality of the model with aggregation and its updates applied one by one is checked
bit for bit).  With the server's NIC at 10 Gbit/s both ways the server's *uplink*, which every
pull crosses, limits how fast workers come back (the paper spreads pulls over a distribution
tree, §10.3, not simulated); the rows with an 80 Gbit/s server uplink stand for that tree, so
that the server's downlink, aggregation's target, is the bottleneck.  Reported: server bytes
per update that reached it without / with aggregation, the share of updates inside
aggregates, seconds per iteration and to the target, server MB in all, and the largest replay
difference.  Kept apart from the Table 2 sweep, whose parameters stay the paper's.

Baseline: RR-Sync in the same setting, same seeds.  The ratio is RR-Sync's time to the target
over the row's (higher is better; the median over the seeds).  Targets (issue 24, item 7):
MLfabric-A (with aggregation, as the paper runs it) >= 1.2x in at least 6 of the 9 settings
(Table 2: 1.23-2.96x), and aggregation cutting the server's inbound bytes >= 2x at 8 workers.

MLfabric-S (§7.2 has no table, only ranges): its rows beside RR-Sync's and Tr-Sync's, with
each synchronous strategy's communication per iteration (past the slowest computation) and its
reduce part, and extras setting by setting: RR-Sync's time to the target over MLfabric-S's
(the paper: 1.2-2x, except C2-N1 where MLfabric-S wins by 16 %), Tr-Sync's communication per
iteration over MLfabric-S's (the paper: MLfabric-S 18-22 % less under C2-N2), and the largest
difference between MLfabric-S's model and RR-Sync's.

Run alone: ``python -m bench.mlfabric [--quick]``.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.mlfabric_model import COMPUTES, Problem, problem
from bench.mlfabric_net import NETWORKS
from bench.mlfabric_sim import STRATEGIES, Outcome, Setting, simulate
from bench.report import Column, Extra, Progress, Table, fmt_number, quiet, run_alone
from fabricd.engines.ps.consistency import SGD, Sum, UpdateRule

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Table 2 (§7.1): MLfabric-A's speedup over RR-Sync, by compute and network setting
PAPER: Final = {
    ("C1", "N1"): 1.74, ("C1", "N2"): 1.23, ("C1", "N3"): 1.42,
    ("C2", "N1"): 2.96, ("C2", "N2"): 2.0, ("C2", "N3"): 2.32,
    ("C3", "N1"): 1.90, ("C3", "N2"): 1.33, ("C3", "N3"): 1.42,
}  # fmt: skip
BASE_COMPUTE: Final = 1.0
LR: Final = 0.2
#: the target's share of the initial loss gap
GAP: Final = 0.02
QUICK_GAP: Final = 0.05
WORKERS: Final = (8, 16)
QUICK_WORKERS: Final = (8,)
SEEDS: Final = (1, 2, 3, 4, 5)
QUICK_SEEDS: Final = (1,)
#: the strategy the targets are checked on
TARGETED: Final = "MLfabric-A+agg"
SPEEDUP: Final = 1.2
SETTINGS_NEEDED: Final = 6
BYTES_CUT: Final = 2.0


@dataclass(frozen=True)
class Case:
    """One row: a strategy at ``workers`` in a compute and network setting, over seeds."""

    workers: int
    compute: str
    network: str
    strategy: str
    outcomes: tuple[Outcome, ...]

    @property
    def label(self) -> str:
        return f"{self.workers}w {self.compute}-{self.network} {self.strategy}"

    @property
    def reached(self) -> float:
        return statistics.median(o.reached for o in self.outcomes)

    @property
    def per_iteration(self) -> float:
        return statistics.median(o.per_iteration for o in self.outcomes)

    @property
    def communication(self) -> float:
        """Synchronous strategies: seconds per iteration past its slowest computation."""
        return statistics.median(o.communication_per_iteration for o in self.outcomes)

    @property
    def reduced(self) -> float:
        """Tr-Sync and MLfabric-S: the same up to the reduce's end."""
        return statistics.median(
            o.reduced / o.iterations if o.iterations else math.nan for o in self.outcomes
        )


def settings(workers: int, compute: str, network: str, seed: int, target: float) -> Setting:
    """The parameters of one run (module docstring)."""
    return Setting(
        compute=compute, network=network, workers=workers, seed=seed, target=target, lr=LR,
        tau_max=workers, base_compute=BASE_COMPUTE,
    )  # fmt: skip


def target_of(data: Problem, gap: float) -> float:
    return data.optimum + gap * (data.loss(data.start) - data.optimum)


def sweep(quick: bool, progress: Progress = quiet) -> list[Case]:
    """Every strategy in every setting at every worker count, over the seeds."""
    seeds = QUICK_SEEDS if quick else SEEDS
    data = {seed: problem(seed) for seed in seeds}
    targets = {seed: target_of(d, QUICK_GAP if quick else GAP) for seed, d in data.items()}
    cases: list[Case] = []
    for workers in QUICK_WORKERS if quick else WORKERS:
        for compute in COMPUTES:
            for network in NETWORKS:
                rr: Case | None = None
                for strategy in STRATEGIES:
                    outcomes = tuple(
                        simulate(
                            settings(workers, compute, network, seed, targets[seed]),
                            data[seed],
                            strategy,
                        )
                        for seed in seeds
                    )
                    case = Case(workers, compute, network, strategy, outcomes)
                    rr = rr or case
                    progress(
                        f"{case.label}: {fmt_number(case.reached)} s to the target, "
                        f"{fmt_number(case.per_iteration)} s/iteration, ratio "
                        f"{fmt_number(rr.reached / case.reached)}x"
                    )
                    cases.append(case)
    return cases


def sensitivity(progress: Progress = quiet) -> dict[str, float]:
    """C1-N1 at 8 workers with one parameter changed: MLfabric-A+agg's speedup over RR-Sync
    (medians over the seeds) with 0.25 s computations, and with the paper's ``tau_max = 30``."""
    data = {seed: problem(seed) for seed in SEEDS}
    out = {}
    for label, change in (
        ("compute 0.25 s", {"base_compute": 0.25}),
        ("tau_max 30", {"tau_max": 30}),
    ):
        times: dict[str, list[float]] = {"RR-Sync": [], TARGETED: []}
        for seed, d in data.items():
            setting = replace(settings(8, "C1", "N1", seed, target_of(d, GAP)), **change)
            for strategy, found in times.items():
                found.append(simulate(setting, d, strategy).reached)
        out[label] = statistics.median(times["RR-Sync"]) / statistics.median(times[TARGETED])
        progress(f"C1-N1, 8 workers, {label}: {TARGETED} {fmt_number(out[label])}x RR-Sync")
    return out


def replay_difference(outcome: Outcome, start: np.ndarray, rule: UpdateRule) -> float:
    """The largest difference between ``outcome``'s final model and the same applied updates
    (each as its worker pushed it) applied one by one by ``rule`` (a fresh one, the run's
    kind), in the order applied, without aggregation."""
    model = start.copy()
    for _, _, values in outcome.log:
        rule.apply(model, values)
    assert outcome.final is not None
    return float(np.max(np.abs(model - outcome.final)))


#: the aggregation rows: (label, workers, server uplink in Gbit/s); module docstring
AGGREGATION_ROWS: Final = (
    ("8w, server 10 Gbit/s both ways", 8, 10.0),
    ("8w, server uplink 80 Gbit/s", 8, 80.0),
    ("16w, server uplink 80 Gbit/s", 16, 80.0),
)
#: the aggregation rows' computation time (seconds): communication-bound
AGGREGATION_COMPUTE: Final = 0.1


def aggregation_rows(
    seeds: Sequence[int] = SEEDS, progress: Progress = quiet
) -> list[tuple[str, dict[str, float]]]:
    """MLfabric-A with and without aggregation where batches hold several updates (module
    docstring): C1-N1, 0.1 s computations, exact mode; medians over ``seeds``, except the
    largest replay difference (over every run with aggregation) and the bytes (summed)."""
    data = {seed: problem(seed) for seed in seeds}
    out = []
    for label, workers, up in AGGREGATION_ROWS:
        runs: dict[str, list[Outcome]] = {"MLfabric-A": [], TARGETED: []}
        for seed, d in data.items():
            setting = replace(
                settings(workers, "C1", "N1", seed, target_of(d, GAP)),
                base_compute=AGGREGATION_COMPUTE, server_up_gbps=up, exact=True,
            )  # fmt: skip
            for strategy, found in runs.items():
                found.append(simulate(setting, d, strategy))
        plain, agg = runs["MLfabric-A"], runs[TARGETED]
        figures = {
            "bytes_cut": _per_update(plain) / _per_update(agg),
            "grouped_pct": 100 * sum(o.grouped for o in agg) / sum(o.delivered for o in agg),
            "s_per_it": statistics.median(o.per_iteration for o in plain),
            "s_per_it_agg": statistics.median(o.per_iteration for o in agg),
            "to_target": statistics.median(o.reached for o in plain),
            "to_target_agg": statistics.median(o.reached for o in agg),
            "server_mb": sum(o.server_bytes for o in plain) / 1e6,
            "server_mb_agg": sum(o.server_bytes for o in agg) / 1e6,
            "max_replay_diff": max(
                replay_difference(o, data[seed].start, Sum())
                for seed, o in zip(data, agg, strict=True)
            ),
        }
        progress(
            f"aggregation, {label}: server bytes per update / {fmt_number(figures['bytes_cut'])}"
            f", {fmt_number(figures['s_per_it'])} -> {fmt_number(figures['s_per_it_agg'])} s/it"
            f"eration, replay difference {figures['max_replay_diff']}"
        )
        out.append((label, figures))
    return out


def _per_update(outcomes: Sequence[Outcome]) -> float:
    delivered = sum(o.delivered for o in outcomes)
    return sum(o.server_bytes for o in outcomes) / delivered if delivered else math.nan


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    progress(
        "virtual time: strategies x C1-C3 x N1-N3, seeds "
        + str(list(SEEDS[:1] if quick else SEEDS))
    )
    cases = sweep(quick, progress)
    extra = {} if quick else sensitivity(progress)
    rows = aggregation_rows(QUICK_SEEDS if quick else SEEDS, progress)
    return tabulate(cases, quick=quick, sensitivity=extra, aggregation=rows)


def _bytes_per_update(cases: Sequence[Case], strategy: str, workers: int) -> float:
    chosen = [
        o for c in cases if (c.strategy, c.workers) == (strategy, workers) for o in c.outcomes
    ]
    delivered = sum(o.delivered for o in chosen)
    return sum(o.server_bytes for o in chosen) / delivered if delivered else math.nan


def tabulate(
    cases: Sequence[Case],
    *,
    quick: bool,
    sensitivity: dict[str, float] | None = None,
    aggregation: Sequence[tuple[str, dict[str, float]]] = (),
) -> Table:
    """The table of ``cases`` (rows in sweep order, RR-Sync first in each setting)."""
    table = Table(
        name="mlfabric",
        title=(
            "MLfabric Table 2 in virtual time: time to a target loss and per iteration, "
            "against RR-Sync in the same setting (1 MB model, rates / 100, 1.0 s computations)"
        ),
        columns=[
            Column("to_target", "s to target"),
            Column("per_iteration", "s/iteration"),
            Column("paper", "Table 2"),
            Column("dropped", "dropped %"),
            Column("mean_delay", "mean delay"),
            Column("max_delay", "max delay", 0),
            Column("server_mb", "server MB/update"),
            Column("communication", "comm s/it"),
            Column("reduced", "reduce s/it"),
            Column("grouped", "via aggregators %"),
        ],
        ratio="RR-Sync's time to the target / this row's (median over seeds; higher is better)",
        target=(
            f"{TARGETED} >= {SPEEDUP}x RR-Sync in >= {SETTINGS_NEEDED} of the 9 settings at 8 "
            f"workers (Table 2: 1.23-2.96x), and aggregation cutting the server's inbound bytes "
            f">= {BYTES_CUT}x at 8 workers"
        ),
        settings={
            "base_compute_s": BASE_COMPUTE,
            "lr": LR,
            "gap": QUICK_GAP if quick else GAP,
            "seeds": list(QUICK_SEEDS if quick else SEEDS),
            "tau_max": "workers",
            "interval_s": 0.1,
            "lag_s": 0.2,
            "model_bytes": 1e6,
            "rate_scale": 100,
        },
    )
    baseline: dict[tuple[int, str, str], float] = {}
    wins: dict[tuple[int, str], int] = {}
    for case in cases:
        rr = baseline.setdefault((case.workers, case.compute, case.network), case.reached)
        ratio = rr / case.reached if case.reached > 0 else math.nan
        outcomes = case.outcomes
        computed = sum(o.computed for o in outcomes)
        dropped = sum(o.dropped_scheduler + o.dropped_server for o in outcomes)
        delays = [d for o in outcomes for d in o.delays]
        delivered = sum(o.delivered for o in outcomes)
        table.add(
            case.label,
            int(1e6),
            ratio,
            to_target=case.reached,
            per_iteration=case.per_iteration,
            paper=PAPER[(case.compute, case.network)] if case.strategy == TARGETED else math.nan,
            dropped=100 * dropped / computed if computed else math.nan,
            mean_delay=float(np.mean(delays)) if delays else math.nan,
            max_delay=max(delays) if delays else math.nan,
            server_mb=sum(o.server_bytes for o in outcomes) / delivered / 1e6
            if delivered
            else math.nan,
            communication=case.communication,
            reduced=case.reduced,
            grouped=100 * sum(o.grouped for o in outcomes) / delivered if delivered else math.nan,
        )
        if case.strategy in ("MLfabric-A", TARGETED) and ratio >= SPEEDUP:
            wins[(case.workers, case.strategy)] = wins.get((case.workers, case.strategy), 0) + 1
    workers = sorted({c.workers for c in cases})
    table.extras.append(
        Extra(
            f"settings (of 9) where MLfabric-A is >= {SPEEDUP}x RR-Sync",
            {f"{n}w {s}": wins.get((n, s), 0) for n in workers for s in ("MLfabric-A", TARGETED)},
            "",
        )
    )
    cut = _bytes_per_update(cases, "MLfabric-A", 8) / _bytes_per_update(cases, TARGETED, 8)
    table.extras.append(
        Extra(
            "server inbound bytes per update that reached it, without aggregation / with it, "
            "MLfabric-A, all settings",
            {
                f"{n}w": _bytes_per_update(cases, "MLfabric-A", n)
                / _bytes_per_update(cases, TARGETED, n)
                for n in workers
            },
            "x",
        )
    )
    diffs = [
        replay_difference(o, np.zeros_like(o.final), SGD(lr=LR))
        for c in cases
        if c.strategy == TARGETED
        for o in c.outcomes
        if o.final is not None
    ]
    table.extras.append(
        Extra(
            "largest |model with aggregation - the same applied updates applied one by one|",
            {"max": max(diffs, default=math.nan)},
            "",
        )
    )
    table.extras += sync_extras(cases)
    if sensitivity:
        table.extras.append(
            Extra(
                f"C1-N1, 8 workers, {TARGETED}'s speedup with one parameter changed",
                sensitivity,
                "x",
            )
        )
    for label, figures in aggregation:
        table.extras.append(
            Extra(
                f"aggregation where batches hold several updates (C1-N1, "
                f"{AGGREGATION_COMPUTE} s computations, exact sum rule), {label}: MLfabric-A "
                f"without / with aggregation",
                figures,
                "",
            )
        )
    table.target_met = wins.get((8, TARGETED), 0) >= SETTINGS_NEEDED and cut >= BYTES_CUT
    table.notes += [
        "virtual time: a seeded discrete-event simulation; MLfabric-A's grants, denials, "
        "aggregation and applies are fabricd's engines' (docs/mlfabric.md, 'The experiment')",
        "s/iteration: virtual seconds per n gradients applied; dropped %: gradients computed "
        "and not applied (denied by the scheduler or dropped by the server)",
        "Table 2: the paper's speedup for the row's setting (30 workers, ResNet-50, to 74 % "
        "accuracy), beside ours",
        "comm s/it: synchronous strategies' seconds per iteration past its slowest computation "
        "(reduce s/it: up to the root holding the sum); via aggregators %: MLfabric-S's "
        "contributions that reached the root inside a group's sum",
        "MLfabric-S (§7.2, no Table 2 figure): RR-Sync 1.2-2x faster except C2-N1, where "
        "MLfabric-S wins by 16 %; 18-22 % less communication per iteration than Tr-Sync "
        "under C2-N2",
    ]
    return table


def sync_extras(cases: Sequence[Case]) -> list[Extra]:
    """MLfabric-S beside RR-Sync and Tr-Sync, setting by setting (§7.2's comparisons), and
    the largest difference between its model and RR-Sync's where both ran as many iterations
    (the same sums, summed along other paths)."""
    by = {(c.workers, c.compute, c.network, c.strategy): c for c in cases}
    speedup: dict[str, float] = {}
    per_iteration: dict[str, float] = {}
    communication: dict[str, float] = {}
    diffs: list[float] = []
    for (n, compute, network, strategy), mls in by.items():
        rr, tr = by.get((n, compute, network, "RR-Sync")), by.get((n, compute, network, "Tr-Sync"))
        if strategy != "MLfabric-S" or rr is None or tr is None:
            continue
        key = f"{n}w {compute}-{network}"
        speedup[key] = rr.reached / mls.reached
        per_iteration[key] = rr.per_iteration / mls.per_iteration
        communication[key] = tr.communication / mls.communication
        diffs += [
            float(np.max(np.abs(a.final - b.final)))
            for a, b in zip(mls.outcomes, rr.outcomes, strict=True)
            if a.final is not None and b.final is not None and a.iterations == b.iterations
        ]
    if not speedup:
        return []
    return [
        Extra("MLfabric-S: RR-Sync's time to the target / MLfabric-S's", speedup, "x"),
        Extra("MLfabric-S: RR-Sync's seconds per iteration / MLfabric-S's", per_iteration, "x"),
        Extra(
            "MLfabric-S: Tr-Sync's communication seconds per iteration (past the slowest "
            "computation) / MLfabric-S's",
            communication,
            "x",
        ),
        Extra(
            "largest |MLfabric-S's model - RR-Sync's| after as many iterations",
            {"max": max(diffs, default=math.nan)},
            "",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("mlfabric", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
