"""(o) TDF's logistic regression through the parameter server: traffic cut by the filters.

The job of :mod:`fabricd.demo.logreg_fabric`: TDF's LR (§IV) on a seeded sparse data set
(200,000 binary features drawn from a Zipf law, 20-50 per row, 50,000 training rows split over
4 workers, 10,000 test rows; :mod:`fabricd.demo.logreg`), one server process and 4 worker
processes on 3 daemons (2 ranks each; the server shares its daemon with worker 1), each worker
500 iterations of pull, gradient of 256 rows, push, under the server's ``sgd`` rule (lr 16).
Workers 3 and 4 sleep 10 and 20 ms before each push (stragglers: under SSP the others run
ahead and the stragglers' pushes land late; under BSP every iteration waits for them).

For each consistency model (BSP, SSP(4), SSP(8)) one job without filters, the baseline, then
one per filter setting (:data:`FILTERS`): TDF's filters (G-SMP, G-LNP, P-SMP, P-LNP), the
same with G-RP, the lossless publish mode, and "sparse-only" (thresholds so small that only
exact zeros and unchanged parameters are dropped: what the data's sparsity alone gives).
Every byte count comes from the daemons' status rows (``ps_workers``: what the workers' pushes
sent and their pulls received, and the unfiltered equivalents; ``ps_servers``: the delay
histogram and the delay bound's drops), the accuracy and log loss from the final model pulled
after training, on the test set.

Baseline: the same consistency model's unfiltered job, in the same run.  The ratio is its push
and pull bytes over the row's (higher is better: how many times less traffic); the columns
give the push and pull cuts in %, the accuracy change in percentage points, and the training
time over the baseline's (wall time; the ranks share this machine's cores, so it is noisy).
TDF reports 79 % less push and 77 % less pull traffic at about 0.5 % accuracy cost (its Fig.
10-12); the target is that, for TDF's filters under every model.

Run alone: ``python -m bench.ps_logreg [--quick]``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Final

from bench.report import Column, Extra, Progress, Table, fmt_number, quiet, run_alone
from fabricd.engines.ps.filters import FilterSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.demo.logreg_fabric import Case, CaseResult, Settings

#: TDF's figures (§IV, Fig. 10-12): push and pull traffic cut (%), accuracy cost (pp)
TDF_PUSH, TDF_PULL, TDF_ACCURACY = 79.0, 77.0, 0.5
#: (consistency, staleness) of each model, in table order
MODELS: Final = (("bsp", 0), ("ssp", 4), ("ssp", 8))
#: the filter settings after each model's unfiltered baseline, by label
FILTERS: Final = {
    # TDF's filters: G-SMP drops gradients below 1e-3 of their parameter, pushes and pulls
    # in float16, P-SMP publishes only parameters that moved by 1 % or more
    "tdf": FilterSettings(gsmp_threshold=1e-3, glnp=True, psmp_threshold=1e-2, plnp=True),
    # and G-RP, which selects 97 % of the gradients for dropping (those G-SMP selects too go)
    "tdf+grp": FilterSettings(
        gsmp_threshold=1e-3, grp_drop=0.97, glnp=True, psmp_threshold=1e-2, plnp=True
    ),
    # the lossless publish mode: the server keeps exact values and publishes a parameter once
    # it moved by 5 % since it last did
    "lossless": FilterSettings(
        gsmp_threshold=1e-3,
        grp_drop=0.97,
        glnp=True,
        psmp_threshold=5e-2,
        plnp=True,
        lossless_publish=True,
    ),
    # drops only exact zeros (gradients of features not in the batch) and unchanged parameters
    "sparse-only": FilterSettings(gsmp_threshold=1e-30, psmp_threshold=1e-12),
}
#: a smoke run's models and filter settings (each job costs a few seconds of process starts)
QUICK_MODELS: Final = MODELS[:2]
QUICK_FILTERS: Final = ("tdf", "lossless", "sparse-only")
#: the filter setting the target is checked on
TARGETED: Final = "tdf"
#: worker 1..4's sleep before each push (ms)
DELAYS_MS: Final = (0.0, 0.0, 10.0, 20.0)


def settings(quick: bool) -> Settings:
    """The full run's settings, or a smoke run's: 20,000 features, 40 iterations of 64 rows,
    on 2 daemons."""
    from fabricd.demo.logreg_fabric import Settings

    full = Settings(delays_ms=DELAYS_MS)
    if not quick:
        return full
    return replace(
        full, nodes=2, ranks_per_node=3, features=20_000, samples=8_000, test=2_000,
        iterations=40, batch=64, delays_ms=(0.0, 0.0, 2.0, 4.0),
    )  # fmt: skip


def cases(quick: bool = False) -> list[Case]:
    """Per model of :data:`MODELS`, the unfiltered baseline and then each of :data:`FILTERS`;
    ``quick``: :data:`QUICK_MODELS` and :data:`QUICK_FILTERS` only."""
    from fabricd.demo.logreg_fabric import Case

    out = []
    for consistency, staleness in QUICK_MODELS if quick else MODELS:
        out.append(Case(consistency=consistency, staleness=staleness))
        out += [
            Case(consistency=consistency, staleness=staleness, filters=f, label=label)
            for label, f in FILTERS.items()
            if not quick or label in QUICK_FILTERS
        ]
    return out


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Every case of :func:`cases` on one fabric, tabulated against each model's baseline."""
    from fabricd.demo.logreg_fabric import run as run_jobs

    chosen = settings(quick)
    progress(
        f"{chosen.workers} workers and a server on {chosen.nodes} daemons, "
        f"{chosen.features} features, {chosen.iterations} iterations of {chosen.batch} rows"
    )
    baselines: dict[str, CaseResult] = {}

    def show(result: CaseResult) -> None:
        case = result.case
        baseline = baselines.setdefault(case.model, result)
        progress(
            f"{case.model}, {case.label}: push -{fmt_number(_cut(result, baseline, 'push'))}%, "
            f"pull -{fmt_number(_cut(result, baseline, 'pull'))}%, accuracy "
            f"{fmt_number(100 * result.accuracy)}%, {fmt_number(result.seconds)} s, ratio "
            f"{fmt_number(_ratio(baseline, result))}x"
        )

    return tabulate(chosen, run_jobs(chosen, cases(quick), show))


def _cut(result: CaseResult, baseline: CaseResult, direction: str) -> float:
    """How much less ``direction`` (push or pull) traffic ``result`` moved than ``baseline``, %."""
    ours = result.push_bytes if direction == "push" else result.pull_bytes
    theirs = baseline.push_bytes if direction == "push" else baseline.pull_bytes
    return 100 * (1 - ours / theirs) if theirs else math.nan


def _ratio(baseline: CaseResult, result: CaseResult) -> float:
    total = result.push_bytes + result.pull_bytes
    return (baseline.push_bytes + baseline.pull_bytes) / total if total else math.nan


def tabulate(settings: Settings, results: Sequence[CaseResult]) -> Table:
    """The table of ``results``: per model its unfiltered job (first), then the filtered ones."""
    table = Table(
        name="ps-logreg",
        title=(
            f"(o) TDF's LR through the parameter server: {settings.workers} workers and a "
            f"server on {settings.nodes} daemons, {settings.features} float32 parameters, "
            f"{settings.iterations} iterations of {settings.batch} rows per worker; traffic "
            "cut by the filters and accuracy change against the same model's unfiltered job"
        ),
        columns=[
            Column("push_cut", "push -%"),
            Column("pull_cut", "pull -%"),
            Column("push_mib", "push MiB"),
            Column("pull_mib", "pull MiB"),
            Column("accuracy", "accuracy %"),
            Column("accuracy_change", "change pp"),
            Column("log_loss", "log loss"),
            Column("mean_delay", "mean delay"),
            Column("max_delay", "max delay <=", 0),
            Column("dropped", "tau drops", 0),
            Column("seconds", "s"),
            Column("time_ratio", "time / unfiltered"),
        ],
        ratio="the same model's unfiltered push + pull bytes / this job's (higher is better)",
        target=(
            f"TDF's filters cut push traffic by >= {TDF_PUSH:g}% and pull traffic by >= "
            f"{TDF_PULL:g}% at <= {TDF_ACCURACY:g} pp accuracy loss, under every model "
            "(TDF §IV)"
        ),
        settings={
            "workers": settings.workers,
            "nodes": settings.nodes,
            "features": settings.features,
            "samples": settings.samples,
            "test": settings.test,
            "iterations": settings.iterations,
            "batch": settings.batch,
            "lr": settings.lr,
            "delays_ms": list(settings.delays_ms),
            "seed": settings.seed,
            "filters": {label: repr(f) for label, f in FILTERS.items()},
        },
    )
    mib = float(1 << 20)
    baselines: dict[str, CaseResult] = {}
    met: list[bool] = []
    for result in results:
        case = result.case
        baseline = baselines.setdefault(case.model, result)
        push_cut, pull_cut = _cut(result, baseline, "push"), _cut(result, baseline, "pull")
        change = 100 * (result.accuracy - baseline.accuracy)
        table.add(
            f"{case.model}, {case.label}",
            settings.features * 4,
            _ratio(baseline, result),
            push_cut=push_cut,
            pull_cut=pull_cut,
            push_mib=result.push_bytes / mib,
            pull_mib=result.pull_bytes / mib,
            accuracy=100 * result.accuracy,
            accuracy_change=change,
            log_loss=result.log_loss,
            mean_delay=result.mean_delay,
            max_delay=result.max_delay,
            dropped=result.dropped_worker + result.dropped_server,
            seconds=result.seconds,
            time_ratio=result.seconds / baseline.seconds,
            # not shown, in the JSON: the daemons' counts the columns come from
            push_bytes=result.push_bytes,
            pull_bytes=result.pull_bytes,
            push_dense_bytes=result.push_dense_bytes,
            pull_dense_bytes=result.pull_dense_bytes,
            pushes=result.pushes,
            pulls=result.pulls,
            applied=result.applied,
        )
        if case.label == TARGETED:
            met.append(push_cut >= TDF_PUSH and pull_cut >= TDF_PULL and change >= -TDF_ACCURACY)
    table.target_met = bool(met) and all(met)
    table.extras += [
        Extra(
            "TDF §IV, its LR against no filters: traffic cut",
            {"push": TDF_PUSH, "pull": TDF_PULL},
            "%",
        ),
        Extra("TDF §IV: accuracy cost", {"about": TDF_ACCURACY}, "pp"),
    ]
    by_label = {(r.case.model, r.case.label): r for r in results}
    shares = {}
    for model, baseline in baselines.items():
        tdf, sparse = by_label.get((model, TARGETED)), by_label.get((model, "sparse-only"))
        if tdf is not None and sparse is not None:
            for direction in ("push", "pull"):
                whole = _cut(tdf, baseline, direction)
                shares[f"{model} {direction}"] = 100 * _cut(sparse, baseline, direction) / whole
    if shares:
        table.extras.append(
            Extra(
                f"share of the {TARGETED!r} cut that 'sparse-only' (exact zeros and unchanged "
                "parameters dropped, nothing else) already gets",
                shares,
                "%",
            )
        )
    dense = next(iter(baselines.values()), None)
    if dense is not None:
        table.notes.append(
            f"unfiltered: every push dense ({fmt_number(dense.push_dense_bytes / mib)} MiB "
            f"dense-equivalent, {fmt_number(dense.push_bytes / mib)} MiB sent) and every pull "
            f"the whole model ({fmt_number(dense.pull_dense_bytes / mib)} MiB whole-model "
            f"equivalent, {fmt_number(dense.pull_bytes / mib)} MiB received), as the daemons "
            "count them"
        )
    table.notes += [
        f"most of the cut is the data's sparsity: a gradient of {settings.batch} rows touches a "
        "few percent of the parameters, and an iteration changes only those (the 'sparse-only' "
        "rows)",
        "accuracy: the final model pulled after training, on the test set; change: "
        "percentage points against the same model's unfiltered job",
        "mean delay: versions between the model a push was computed from and the one it was "
        "applied to (the server's histogram; 0 under BSP); max delay <=: the upper bound of the "
        "histogram's highest bucket with an update in it (bounds 0, 1, 2, 4, 8, 16, ...); "
        "tau drops: updates dropped by the delay bound (none is set under BSP and SSP)",
        f"s: the slowest worker's training time; workers sleep {list(settings.delays_ms)} ms "
        "before each push (stragglers); the ranks share this machine's cores",
    ]
    return table


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("ps_logreg", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
