"""Posted regions between daemons: how a later engine's service sends a round's messages as one
WRITE frame each (issue 8 item 1, and its "done when").

A service posts a region on a peer's data link when the peer comes up, under a key whose
epoch is its daemon's incarnation; the peer's service writes into it with one frame and no
rendezvous.  A reset drops every post (a new link has none), so a write meant for an old
incarnation is refused and counted, never placed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.node import default_services
from fabricd.daemon.service import BaseService
from fabricd.transports.posted import PostKey, WriteLanded
from tests.integration.inproc import fabric

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from fabricd.daemon.node import Daemon
    from fabricd.daemon.service import Service

pytestmark = pytest.mark.timeout(60)

SLOT = 7
SIZE = 64


class Inbox(BaseService):
    """Posts one region for each peer that comes up; records every write that lands."""

    name = "inbox"

    def __init__(self, host: Daemon) -> None:
        self.host = host
        self.region = bytearray(SIZE)
        self.landed: list[WriteLanded] = []
        self.keys: dict[int, PostKey] = {}

    def peer_up(self, node: int, now: float) -> None:
        link = self.host.data_link(node)
        assert link is not None
        key = PostKey(epoch=self.host.incarnation, slot=SLOT)
        link.post(key, memoryview(self.region), on_landed=self.landed.append)
        self.keys[node] = key


def with_inbox(daemon: Daemon) -> Sequence[Service]:
    return [*default_services(daemon), Inbox(daemon)]


async def test_a_service_writes_into_a_region_its_peer_posted_in_one_frame(
    tmp_path: Path,
) -> None:
    async with fabric(tmp_path, {1: with_inbox}) as fab:
        inbox = fab.daemons[1].service("inbox")
        assert isinstance(inbox, Inbox)
        await fab.until(lambda: 0 in inbox.keys)
        key = inbox.keys[0]
        writer = fab.daemons[0].data_link(1)
        assert writer is not None
        frames_before = writer.statistics().frames_sent
        await writer.write(key, 8, [b"x" * 16], seq=1)
        await fab.until(lambda: len(inbox.landed) == 1)
        assert inbox.landed == [WriteLanded(key=key, offset=8, nbytes=16, seq=1)]
        assert bytes(inbox.region[8:24]) == b"x" * 16
        assert writer.statistics().frames_sent == frames_before + 1  # one frame, one hop

        # out of bounds: refused and counted, nothing placed, the link stays up
        reader = fab.daemons[1].data_link(0)
        assert reader is not None
        await writer.write(key, SIZE - 8, [b"y" * 16], seq=2)
        await fab.until(lambda: reader.statistics().writes_refused == 1)
        assert b"y" not in inbox.region
        assert fab.daemons[1].data_link(0) is reader


async def test_a_write_for_an_old_incarnation_never_lands(tmp_path: Path) -> None:
    async with fabric(tmp_path, {1: with_inbox}) as fab:
        inbox = fab.daemons[1].service("inbox")
        assert isinstance(inbox, Inbox)
        await fab.until(lambda: 0 in inbox.keys)
        old = inbox.keys.pop(0)
        await fab.stop(1)  # node 1 restarts: a new incarnation, new links, nothing posted yet
        await fab.start(1)
        await fab.until(fab.up)
        fresh = fab.daemons[1].service("inbox")
        assert isinstance(fresh, Inbox)
        await fab.until(lambda: 0 in fresh.keys)
        assert fresh.keys[0].epoch != old.epoch
        writer, reader = fab.daemons[0].data_link(1), fab.daemons[1].data_link(0)
        assert writer is not None
        assert reader is not None
        await writer.write(old, 0, [b"z" * 8], seq=3)  # what node 0 cached before the restart
        await fab.until(lambda: reader.statistics().writes_refused == 1)
        await asyncio.sleep(0.05)
        assert fresh.landed == []
        assert b"z" not in fresh.region
