"""``Daemon.reload_secrets`` (SIGHUP) on real in-process daemons: what a reload reads, and that
a source refused on reload leaves the secrets held, and every link, as they were."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .inproc import fabric

if TYPE_CHECKING:
    from pathlib import Path

    import pytest

OLD = "an inproc test secret of some length"  # what tests/integration/inproc.py writes
NEW = "the secret the fabric rotates to, long enough"


async def test_a_reload_reads_the_source_again_and_a_refused_one_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fabricd.daemon")
    async with fabric(tmp_path) as fab:
        daemon = fab.daemons[1]
        links = dict(daemon.links)
        secret = tmp_path / "secret"

        secret.write_text(f"{OLD}\n{NEW}\n")
        daemon.reload_secrets()
        assert daemon.peering.settings.secrets == (OLD.encode(), NEW.encode())
        assert "reload: 2 secret(s) from secret_file" in caplog.text

        secret.write_text("short\n")  # too short: refused
        daemon.reload_secrets()
        secret.write_text(f"{OLD}\n{NEW}\n")
        secret.chmod(0o644)  # open to others: refused
        daemon.reload_secrets()
        assert daemon.peering.settings.secrets == (OLD.encode(), NEW.encode())
        assert "reload refused, keeping the 2 secret(s) held: " in caplog.text
        assert "under 16 bytes" in caplog.text
        assert "mode 0644" in caplog.text
        assert NEW not in caplog.text  # the log names sources, never secrets
        assert OLD not in caplog.text
        assert daemon.links == links  # a reload touches no link
        assert fab.up()
