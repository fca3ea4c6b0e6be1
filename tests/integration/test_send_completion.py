"""When a send returns: on delivery (the default), or once its bytes are copied (``wait="sent"``).

Two in-process daemons; rank 0 on node 0 sends to rank 1 on node 1, which posts its receive only
after the send returned, so a send that waited for delivery would time out instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

import fabricd
from tests.integration.inproc import fabric

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.timeout(60)


def _early_send_then_late_receive(
    socket0: str, socket1: str, nbytes: int, arrived: Callable[[], bool] = lambda: True
) -> dict[str, object]:
    """Rank 0 sends ``nbytes`` with ``wait="sent"`` and overwrites its array once the send
    returned; only then, and once ``arrived()`` says so, does rank 1 post its receive.  What
    each side saw."""
    joined, sent = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    count = nbytes // 4

    def receiver() -> None:
        with fabricd.connect(job="j", rank=1, size=2, socket_path=socket1) as fab:
            array = fab.array("in", (count,), "int32")
            joined.set()
            assert sent.wait(20)
            deadline = time.monotonic() + 20
            while not arrived():  # the message is at node 1 before its receive is posted
                assert time.monotonic() < deadline, "the message never reached node 1"
                time.sleep(0.005)
            try:
                fab.recv(array, src=0, timeout=20)
            except fabricd.FabricError as exc:
                seen["received"] = type(exc).__name__
            else:
                seen["received"] = array.tolist() == list(range(count))

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        with fabricd.connect(job="j", rank=0, size=2, socket_path=socket0) as fab:
            array = fab.array("out", (count,), "int32")
            array[:] = np.arange(count)
            assert joined.wait(20)
            try:
                fab.send(array, to=1, timeout=5, wait="sent")
            except fabricd.FabricError as exc:
                seen["sent"] = type(exc).__name__
            else:
                seen["sent"] = "ok"
            array[:] = -1  # the daemon holds its own copy: this must not reach rank 1
            sent.set()
            thread.join(30)
    finally:
        sent.set()
        thread.join(30)
    return seen


async def test_a_sent_send_returns_before_its_receive_is_posted(tmp_path: Path) -> None:
    async with fabric(tmp_path) as fab:
        seen = await asyncio.to_thread(
            _early_send_then_late_receive, fab.socket(0), fab.socket(1), 4096
        )
        assert seen == {"sent": "ok", "received": True}
        counters = fab.daemons[0].service("p2p").statistics()["counters"]
        assert counters["eager_sent"] == 1
        await fab.until(lambda: fab.daemons[0].service("p2p").engine.pending() == 0)


async def test_a_sent_send_whose_payload_the_receiver_dropped_streams_the_copy(
    tmp_path: Path,
) -> None:
    # node 1's pool holds nothing: the EAGER's payload is dropped and taken as an RTS; the CTS
    # that follows the late receive makes node 0 stream -- from its copy, not the array that
    # rank 0 overwrote after its send returned
    async with fabric(tmp_path) as fab:
        engine = fab.daemons[1].service("p2p").engine
        engine.eager_credit = 0

        def arrived() -> bool:  # read from the receiver's thread: one int
            return bool(engine.statistics().unexpected == 1)

        seen = await asyncio.to_thread(
            _early_send_then_late_receive, fab.socket(0), fab.socket(1), 4096, arrived
        )
        assert seen == {"sent": "ok", "received": True}
        assert fab.daemons[1].service("p2p").statistics()["counters"]["eager_pool_full"] == 1


async def test_a_large_sent_send_still_waits_for_delivery(tmp_path: Path) -> None:
    # above eager_limit nothing is copied, so wait="sent" cannot return before the receive:
    # with the receive posted only after the send returns, the send times out
    async with fabric(tmp_path, eager_limit=1024) as fab:
        seen = await asyncio.to_thread(
            _early_send_then_late_receive, fab.socket(0), fab.socket(1), 4096
        )
        assert seen["sent"] == "Timeout"


async def test_a_sent_send_refused_later_is_reported_to_the_receiver_only(
    tmp_path: Path,
) -> None:
    async with fabric(tmp_path) as fab:

        def run() -> tuple[str, str]:
            joined, sent = threading.Event(), threading.Event()
            outcome: list[str] = []

            def receiver() -> None:
                with fabricd.connect(job="j", rank=1, size=2, socket_path=fab.socket(1)) as peer:
                    small = peer.array("in", (2,), "int32")  # rank 0 sends 8
                    joined.set()
                    assert sent.wait(20)
                    try:
                        peer.recv(small, src=0, timeout=20)
                        outcome.append("ok")
                    except fabricd.UsageError as exc:  # what a mismatch raises
                        outcome.append(str(exc))

            thread = threading.Thread(target=receiver)
            thread.start()
            with fabricd.connect(job="j", rank=0, size=2, socket_path=fab.socket(0)) as me:
                array = me.array("out", (8,), "int32")
                assert joined.wait(20)
                me.send(array, to=1, timeout=5, wait="sent")
                sent.set()
                thread.join(30)
            return "ok", outcome[0]

        sent, received = await asyncio.to_thread(run)
        assert sent == "ok"
        assert "does not fit its receive" in received
        p2p = fab.daemons[0].service("p2p")
        await fab.until(lambda: p2p.statistics()["counters"]["sent_then_failed"] == 1)
        assert p2p.engine.pending() == 0


async def test_wait_must_be_a_known_word_and_only_for_sends(tmp_path: Path) -> None:
    async with fabric(tmp_path) as fab:

        def run() -> list[str]:
            errors: list[str] = []
            with fabricd.connect(job="j", rank=0, size=2, socket_path=fab.socket(0)) as me:
                array = me.array("out", (2,), "int32")
                with pytest.raises(fabricd.UsageError, match="wait must be one of"):
                    me.send_async(array, to=1, wait="later")  # type: ignore[arg-type]
                # the daemon checks too, for clients that are not this library
                for fields in ({"wait": "later"}, {"wait": "sent", "op": "recv"}):
                    op = str(fields.pop("op", "send"))
                    seg, off = me._arrays.locate(array)
                    meta = {"seg": seg, "off": off, "nbytes": 8, "dtype": "int32", "peer": 1}
                    connection = me._connection
                    call = connection.submit(op, {**meta, "tag": 0, **fields}, what=op)
                    try:
                        connection.wait(call, 10).result(op)
                    except fabricd.UsageError as exc:
                        errors.append(str(exc))
            return errors

        errors = await asyncio.to_thread(run)
        assert len(errors) == 2
        assert "wait must be 'delivered' or 'sent'" in errors[0]
        assert "wait applies to sends only" in errors[1]
