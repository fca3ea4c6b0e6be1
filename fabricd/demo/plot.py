"""The demos' PNGs: the eager-SGD demo's validation loss against time, one line per mode; the
SVM job's test accuracy against bytes sent per rank, one line per graph.

matplotlib is the optional ``demo`` extra (``pip install 'fabricd[demo]'``; ``make demo``
installs it): the daemon and the client never need it, so it is imported only here, and only
when a plot is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabricd.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from matplotlib.figure import Figure

    from fabricd.demo.svm import History, Settings
    from fabricd.demo.training import DemoResult


def available() -> bool:
    """Whether matplotlib can be imported (the ``demo`` extra is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(result: DemoResult, path: Path) -> None:
    """Draw every mode's validation loss against seconds of training into ``path``.

    Raises:
        UsageError: matplotlib is not installed.
    """
    settings = result.settings
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=120)
    try:
        for mode in result.modes:
            seconds, losses = zip(*mode.history, strict=True)
            axes.plot(seconds, losses, marker=".", markersize=3, label=mode.mode)
        axes.axhline(result.target_loss, color="grey", linestyle="--", label="target")
        axes.set_yscale("log")
        axes.set_xlabel("seconds of training")
        axes.set_ylabel("validation loss (mean squared error)")
        axes.set_title(
            f"hyperplane regression, {settings.dim} dimensions: {settings.ranks} ranks on "
            f"{settings.nodes} daemons,\n{settings.compute_ms:g} ms steps, {settings.lateness}",
            fontsize=10,
        )
        _finish(figure, path)
    finally:
        pyplot.close(figure)


def write_svm_png(histories: Sequence[History], settings: Settings, path: Path) -> None:
    """Draw each run's worst-rank test accuracy against bytes sent per rank into ``path``
    (ASAP Fig. 6/7: what a graph pays in traffic for its accuracy).

    Raises:
        UsageError: matplotlib is not installed.
    """
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=120)
    try:
        for history in histories:
            series = history.series()[1:]  # the zero model sent nothing: no place on a log axis
            axes.plot(
                [p.bytes_sent / 2**20 for p in series],
                [p.accuracy for p in series],
                marker=".",
                markersize=3,
                label=f"{history.graph} ({history.sync}, gap {history.spectral_gap:.2f})",
            )
        axes.axhline(settings.target, color="grey", linestyle="--", label="target")
        axes.set_xscale("log")
        axes.set_xlabel("MiB sent per rank (mean over the ranks)")
        axes.set_ylabel("test accuracy (the worst rank's model)")
        axes.set_title(
            f"linear SVM (SVM-SGD), {settings.dim} dimensions, {settings.examples} examples: "
            f"{settings.ranks} ranks, a reduce every {settings.local_steps} step(s)",
            fontsize=10,
        )
        _finish(figure, path)
    finally:
        pyplot.close(figure)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing into files only.

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window: the demo may run without a display
        from matplotlib import pyplot
    except ImportError as exc:
        raise UsageError(
            "the plot needs matplotlib: pip install 'fabricd[demo]' (make demo installs it)"
        ) from exc
    return pyplot


def _finish(figure: Figure, path: Path) -> None:
    """Grid, legend, layout, and the PNG written to ``path``."""
    axes = figure.axes[0]
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
