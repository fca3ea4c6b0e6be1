"""(n) Timed parameter storage (TDF §III.B): a version per parameter against one per chunk.

One :class:`~fabricd.engines.ps.storage.TimedStore` of 10^6 float32 parameters per chunk size
(1, 16, 256, 4096), all in this process: no daemon, no socket.  Each store takes the same five
publishes, each changing 1% or 10% of the parameters, scattered at random or in runs of 256
consecutive ones (a chunk is published whole when any of its parameters changed, as the ``ps``
service publishes what :mod:`~fabricd.engines.ps.filters` kept).  Then, for a worker one round
behind and one four rounds behind: the bytes of the reply (:meth:`TimedStore.pull`, the
smallest encoding), its encoding, and the median time to build it; the median time to apply
the one-round reply to a worker's cache (:func:`~fabricd.engines.ps.storage.apply_delta`); and
the versions' memory.  Both replies are checked: applied to the model as it was one and four
rounds before, they must give the published model bitwise (the benchmark raises otherwise).

Baseline: one version per parameter (chunk 1), with the same changes, in the same run.  The
ratio is its reply's bytes over this chunk size's, one round behind (above 1: chunks make the
reply smaller; below 1: they send unchanged neighbours along).  The bytes are exact for
:data:`SEED` (one generator drawn in a fixed order: each case's masks, then each store's initial
and published values, so docs/performance.md's byte counts come back exactly); the times are
one process's on a shared machine and only compare within a run.  The apply time is
:func:`~fabricd.engines.ps.storage.apply_delta` alone, into the same cache each time (it writes
the same values again), not a copy of the cache.

Run alone: ``python -m bench.ps_storage [--quick]``.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Final

import numpy as np

from bench.report import Column, Progress, Table, fmt_number, median, per_call, quiet, run_alone
from fabricd.engines.ps import storage as ps_storage

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.engines.ps.storage import Array

#: parameters per version: the baseline first
CHUNKS: Final = (1, 16, 256, 4096)
#: the share of the parameters each publish changes
FRACTIONS: Final = (0.01, 0.10)
#: how the changed parameters lie: scattered at random, or in runs of ``RUN`` consecutive ones
PATTERNS: Final = ("random", "in runs")
RUN: Final = 256
PARAMETERS, QUICK_PARAMETERS = 10**6, 10**5
REPEATS, QUICK_REPEATS = 7, 3
#: publishes before the pulls: a worker four rounds behind needs at least four
PUBLISHES: Final = 5
#: the rounds behind of the two pulls measured
BEHIND: Final = (1, 4)
SEED: Final = 1


def changed(rng: np.random.Generator, count: int, fraction: float, pattern: str) -> Array:
    """A mask of about ``fraction * count`` changed parameters: scattered (``"random"``), or in
    runs of :data:`RUN` from random starts (``"in runs"``; runs may overlap, so somewhat fewer)."""
    mask = np.zeros(count, bool)
    wanted = int(fraction * count)
    if pattern == "random":
        mask[rng.choice(count, wanted, replace=False)] = True
        return mask
    runs = wanted // RUN
    starts = rng.choice(count // RUN, runs, replace=False) * RUN + rng.integers(0, RUN, runs)
    mask[np.minimum(starts[:, None] + np.arange(RUN), count - 1)] = True
    return mask


def _by_chunk(mask: Array, chunk: int) -> Array:
    """Which chunks of ``chunk`` parameters hold a changed parameter of ``mask``."""
    if chunk == 1:
        return mask
    return np.logical_or.reduceat(mask, np.arange(0, mask.size, chunk))


def measure(
    masks: Sequence[Array], chunk: int, repeats: int, rng: np.random.Generator
) -> dict[str, float]:
    """One store of ``chunk`` parameters per version, from random values through ``masks``'
    publishes: each pull's bytes, encoding and build time, the apply time, the versions' bytes.

    Raises:
        RuntimeError: a reply applied to the model as it was does not give the published model.
    """
    count = masks[0].size
    store = ps_storage.TimedStore(rng.normal(size=count).astype(np.float32), chunk=chunk)
    kept = {len(masks) - behind for behind in BEHIND}
    before: dict[int, Array] = {}
    for mask in masks:
        if store.version in kept:
            before[store.version] = store.model.copy()
        published = _by_chunk(mask, store.chunk)
        values = rng.normal(size=np.count_nonzero(np.repeat(published, store.chunk)[:count]))
        store.publish(published, values.astype(np.float32))
    figures: dict[str, float] = {"versions_kb": store.versions.nbytes / 1e3}
    for behind in BEHIND:
        since = store.version - behind
        reply = store.pull(since)  # also the warm-up
        cache = before.pop(since)
        ps_storage.apply_delta(reply, cache, since)
        if not np.array_equal(cache.view(np.uint8), store.model.view(np.uint8)):
            raise RuntimeError(f"BUG: chunk {chunk}: a reply since {since} did not give the model")
        figures[f"kb{behind}"] = len(reply) / 1e3
        figures[f"enc{behind}"] = reply[0]
        figures[f"build{behind}_ms"] = 1e3 * median(
            per_call(functools.partial(store.pull, since), 1, repeats)
        )
        if behind == BEHIND[0]:  # the same values again: applying is idempotent
            figures["apply_ms"] = 1e3 * median(
                per_call(functools.partial(ps_storage.apply_delta, reply, cache, since), 1, repeats)
            )
    return figures


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """Every chunk size in :data:`CHUNKS` under every share and pattern of changes."""
    count = QUICK_PARAMETERS if quick else PARAMETERS
    repeats = QUICK_REPEATS if quick else REPEATS
    rng = np.random.default_rng(SEED)
    one, four = BEHIND
    table = Table(
        name="ps-storage",
        title=(
            f"(n) timed parameter storage: reply to a pull {one} and {four} rounds behind, "
            f"{count} float32 parameters, a version per chunk of N"
        ),
        columns=[
            Column(f"kb{one}", f"kB {one} behind"),
            Column(f"enc{one}", "enc", 0),
            Column(f"build{one}_ms", "build ms"),
            Column(f"kb{four}", f"kB {four} behind"),
            Column(f"enc{four}", "enc", 0),
            Column(f"build{four}_ms", "build ms"),
            Column(f"ratio{four}", f"ratio {four} behind"),
            Column("apply_ms", f"apply {one} ms"),
            Column("versions_kb", "versions kB"),
        ],
        ratio=(
            f"reply bytes {one} round behind with a version per parameter / with a version per "
            f"chunk of N, same changes, same run (higher: chunks send less)"
        ),
        settings={
            "parameters": count,
            "dtype": "float32",
            "publishes": PUBLISHES,
            "run": RUN,
            "repeats": repeats,
            "seed": SEED,
        },
    )
    progress(f"{count} parameters, {PUBLISHES} publishes, median of {repeats} builds and applies")
    for fraction in FRACTIONS:
        for pattern in PATTERNS:
            masks = [changed(rng, count, fraction, pattern) for _ in range(PUBLISHES)]
            baseline: dict[str, float] = {}
            for chunk in CHUNKS:
                figures = measure(masks, chunk, repeats, rng)
                baseline = baseline or figures
                figures[f"ratio{four}"] = baseline[f"kb{four}"] / figures[f"kb{four}"]
                ratio = baseline[f"kb{one}"] / figures[f"kb{one}"]
                label = f"{fraction:.0%} {pattern}, chunk {chunk}"
                table.add(label, count * 4, ratio, chunk=chunk, **figures)
                progress(
                    f"{label}: {one} behind {fmt_number(figures[f'kb{one}'])} kB "
                    f"{_encoding(figures[f'enc{one}'])} in {fmt_number(figures[f'build{one}_ms'])}"
                    f" ms, {four} behind {fmt_number(figures[f'kb{four}'])} kB "
                    f"{_encoding(figures[f'enc{four}'])} in "
                    f"{fmt_number(figures[f'build{four}_ms'])} ms, apply "
                    f"{fmt_number(figures['apply_ms'])} ms, ratio {ratio:.2f}x"
                )
    table.notes.append(
        "enc: the reply's encoding, "
        + ", ".join(f"{int(e)} {_encoding(e)}" for e in ps_storage.Encoding)
        + f"; apply: the {one}-round reply into a worker's cache; versions: 8 B per chunk"
    )
    table.notes.append(
        f"each publish changes the share of parameters in the label, scattered at random or in "
        f"runs of {RUN}; a chunk holding a changed parameter is published whole"
    )
    return table


def _encoding(kind: float) -> str:
    return ps_storage.Encoding(int(kind)).name.lower()


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("ps_storage", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
