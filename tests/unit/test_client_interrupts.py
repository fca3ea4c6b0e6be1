"""The client's side of a collective call that stops being waited for (issue 27, item 5), on
a fake daemon.

A blocking ``allreduce()``/``barrier()`` whose wait ends by Ctrl-C or a timeout leaves its call
under way: the daemon keeps it (nothing is withdrawn while the client is open).  The exception
says so in a note, ``interrupted_collectives()`` has the handle, the next call of that
collective refuses to start while it is under way (before: the daemon's bare "already has a
call open"), and once it has ended says its round in ``Result.kept``.  The daemon's own
``kept`` (a call abandoned by an earlier client of the rank) comes through too.  The same path
with a real Ctrl-C is in tests/integration/test_collective_interrupts.py.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest
from fakedaemon import FakeDaemon, answer_like_a_daemon

import fabricd
from fabricd.client import checks
from fabricd.wire import Kind, encode

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fabricd.client import Client
    from fabricd.wire import Meta


class Held:
    """A daemon that holds collective requests until the test answers them."""

    def __init__(self) -> None:
        self.calls: list[Meta] = []
        self.arrived = threading.Semaphore(0)

    def script(self, daemon: FakeDaemon, request: Meta) -> None:
        if request["op"] == "collective":
            self.calls.append(request)
            self.arrived.release()
        else:
            answer_like_a_daemon(daemon, request)


@pytest.fixture
def held() -> Iterator[tuple[FakeDaemon, Held, Client]]:
    hold = Held()
    daemon = FakeDaemon(hold.script)
    fab = daemon.client(checks.membership("j", 1, 2))
    yield daemon, hold, fab
    fab.close()
    daemon.stop()


def test_a_timed_out_blocking_call_is_kept_said_and_reported_by_the_next(
    held: tuple[FakeDaemon, Held, Any],
) -> None:
    daemon, hold, fab = held
    with pytest.raises(fabricd.Timeout) as stopped:
        fab.barrier(timeout=0)
    assert any("was not withdrawn" in note for note in stopped.value.__notes__)
    assert list(fab.interrupted_collectives()) == ["barrier"]
    with pytest.raises(fabricd.UsageError, match="still under way"):
        fab.barrier(timeout=5)
    assert hold.arrived.acquire(timeout=5)
    assert len(hold.calls) == 1  # the refused call never reached the daemon
    handle = fab.interrupted_collectives()["barrier"]
    daemon.reply(hold.calls[0], round=0, included=True, active=2)
    assert handle.wait(5).round == 0  # the kept call's own result, for who wants it
    assert fab.interrupted_collectives() == {}
    answered = threading.Thread(target=lambda: _answer(daemon, hold, round=1))
    answered.start()
    result = fab.barrier(timeout=5)
    answered.join(5)
    assert (result.round, result.kept) == (1, 0)  # the next call says the kept one's round
    answered = threading.Thread(target=lambda: _answer(daemon, hold, round=2))
    answered.start()
    assert fab.barrier(timeout=5).kept is None  # said once
    answered.join(5)


def test_the_daemons_kept_reaches_the_result(held: tuple[FakeDaemon, Held, Any]) -> None:
    daemon, hold, fab = held
    answered = threading.Thread(target=lambda: _answer(daemon, hold, round=4, kept=3))
    answered.start()
    result = fab.barrier(timeout=5)
    answered.join(5)
    assert (result.round, result.kept) == (4, 3)


def test_a_failed_call_is_not_kept(held: tuple[FakeDaemon, Held, Any]) -> None:
    """A blocking call that failed (the daemon said why) ended: nothing of it goes on."""
    daemon, hold, fab = held

    def fail() -> None:
        assert hold.arrived.acquire(timeout=5)
        request = hold.calls[-1]
        error = {"code": "peer_failed", "error": "rank 0 left"}
        daemon.send(encode(Kind.REPLY, {"id": request["id"], "ok": False, **error}))

    failing = threading.Thread(target=fail)
    failing.start()
    with pytest.raises(fabricd.PeerFailed) as failed:
        fab.barrier(timeout=5)
    failing.join(5)
    assert not getattr(failed.value, "__notes__", [])
    assert fab.interrupted_collectives() == {}


def _answer(daemon: FakeDaemon, hold: Held, *, round: int, **fields: Any) -> None:
    assert hold.arrived.acquire(timeout=5)
    daemon.reply(hold.calls[-1], round=round, included=True, active=2, **fields)
