"""What fabricctl prints for people: figures, exit statuses, the demo's table."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fabricd import demo
from fabricd.cli.ctl import _exit_description, _figure
from fabricd.cli.ctl import main as fabricctl


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.012345, "0.0123"),
        (0.000456, "0.000456"),
        (0.5, "0.500"),
        (2.345, "2.35"),
        (12.34, "12.3"),
        (123.4, "123"),
        (98765.4, "98765"),
        (0.0, "0"),
    ],
)
def test_figures_keep_three_significant_digits_without_an_exponent(value, shown):
    assert _figure(value) == shown


@pytest.mark.parametrize(
    ("status", "shown"),
    [(0, "exit 0"), (3, "exit 3"), (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM")],
)
def test_exit_statuses_say_how_a_process_ended(status, shown):
    assert _exit_description(status) == shown


def test_the_demo_prints_small_rates_and_ratios_with_their_digits(monkeypatch):
    def slow_ring(nodes, nbytes, laps, progress=None, settings=None):
        if progress is not None:
            progress(1, 2.0)
        return demo.DemoResult(
            nodes=nodes,
            nbytes=nbytes,
            laps=laps,
            hops=nodes * laps,
            seconds=8.0,
            ring_gbps=0.0419,
            memcpy_gbps=3.41,
            ratio=0.0123,
            verified=True,
            checksum="0123456789abcdef",
        )

    monkeypatch.setattr(demo, "run", slow_ring)
    result = CliRunner().invoke(
        fabricctl, ["demo", "--nodes", "2", "--size-mib", "1", "--laps", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "0.0123x memcpy" in result.output
    assert "0.0419 GB/s" in result.output
    assert "3.41 GB/s (same run)" in result.output
    assert "8.00 s moving data, from when every rank was ready" in result.output
    assert "0.00x" not in result.output
