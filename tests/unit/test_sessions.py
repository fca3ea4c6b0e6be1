"""A client sends and receives only as the rank it holds: the request cannot name another job
or another source, whatever fields it carries."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import pytest

from fabricd.daemon.sessions import ClientSession, parse_transfer
from fabricd.errors import UsageError
from fabricd.shm import Segment

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.daemon.ipc_server import IpcConnection
    from fabricd.wire import Meta


@pytest.fixture
def session() -> Iterator[ClientSession]:
    """Rank 1 of job "mine" (of 4), with one 4 KiB segment attached as segment 7."""
    segment = Segment.create("test", 4096)
    held = ClientSession(cast("IpcConnection", None), job="mine", rank=1, size=4)
    held.segments[7] = segment
    yield held
    segment.close()


def request(**extra: object) -> Meta:
    """A send or receive of 16 B at the start of the segment's data (offset 64)."""
    return {"seg": 7, "off": 64, "nbytes": 16, "dtype": "float32", "peer": 2, "tag": 3, **extra}


@pytest.mark.parametrize("is_send", [True, False])
def test_a_transfer_is_always_of_the_sessions_job_and_rank(
    session: ClientSession, is_send: bool
) -> None:
    # fields a hostile client adds to name another job or pose as another rank are not read
    meta = request(job="theirs", src=0, dst=0, rank=0, size=64)
    message, region = parse_transfer(session, meta, is_send=is_send)
    assert message.job == "mine"
    assert (message.src, message.dst) == ((1, 2) if is_send else (2, 1))
    assert len(region) == 16


def test_a_client_without_a_job_can_neither_send_nor_receive(session: ClientSession) -> None:
    session.job = None
    for is_send in (True, False):
        with pytest.raises(UsageError, match="connect with a job"):
            parse_transfer(session, request(job="theirs"), is_send=is_send)


def test_the_peer_must_be_a_rank_of_the_sessions_job(session: ClientSession) -> None:
    with pytest.raises(UsageError, match="outside job 'mine' of size 4"):
        parse_transfer(session, request(peer=4), is_send=True)
