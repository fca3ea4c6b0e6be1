"""The demo's validation loss against time, one line per mode, as a PNG.

matplotlib is the optional ``demo`` extra (``pip install 'fabricd[demo]'``; ``make demo``
installs it): the daemon and the client never need it, so it is imported only here, and only
when a plot is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

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
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window: the demo may run without a display
        from matplotlib import pyplot
    except ImportError as exc:
        raise UsageError(
            "the plot needs matplotlib: pip install 'fabricd[demo]' (make demo installs it)"
        ) from exc
    settings = result.settings
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
            f"{settings.nodes} daemons, one rank {settings.delay_ms:g} ms late per step",
            fontsize=10,
        )
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        pyplot.close(figure)
