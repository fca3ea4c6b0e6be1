"""Peer links when something goes wrong inside the daemon: the pair must still come back.

Two in-process daemons (:mod:`tests.integration.inproc`); each test breaks one step of
admitting, resetting or closing links, and checks that no dial is left waiting forever, no
service is left untold and nothing is started after the daemon stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .inproc import Fabric

if TYPE_CHECKING:
    from pathlib import Path


async def test_a_failure_while_admitting_a_dialled_link_fails_the_dial_and_it_is_retried(
    tmp_path: Path,
) -> None:
    fab = Fabric(tmp_path)
    d0 = await fab.start(0)  # node 0 dials node 1
    greet = d0.peer_up
    broke: list[int] = []

    def peer_up_breaks_once(node: int) -> None:
        if not broke:
            broke.append(node)
            raise RuntimeError("a bug while greeting the peer")
        greet(node)

    d0.peer_up = peer_up_breaks_once  # type: ignore[method-assign]
    await fab.start(1)
    try:
        await fab.until(lambda: bool(broke))
        await fab.until(fab.up, 5)  # the dial that broke must not wait forever
    finally:
        for node in list(fab.tasks):
            await fab.stop(node)
