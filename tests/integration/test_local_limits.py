"""What a local client can make the daemon hold, and what fails when the system runs short.

Each test stages one finding of issue 7 against a daemon and checks that only the request
that caused it fails, with a code and a message naming the limit and its setting, and that the
daemon goes on serving everyone else:

* sparse sealed memfds of 2^46 bytes and down, which cost no RAM but fill the address space;
* many small segments, each of which holds an fd in the daemon (Python's mmap keeps a dup);
* a local copy whose worker thread cannot start (``RuntimeError: can't start new thread``);
* ``mmap`` failing with MemoryError or OSError while a segment is attached.

Attacks use raw ``attach`` requests with memfds this process makes and never maps, so the
attacker's own address space is not what runs out.  Daemons as subprocesses where the daemon's
address space or fd table is the point; in-process daemons (``inproc.py``) where a fault is
injected with monkeypatch.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import fabricd
from fabricd import shm
from fabricd.daemon import datapath
from fabricd.daemon.segments import FD_RESERVE
from fabricd.daemon.services import p2p as p2p_service
from fabricd.shm import SEALS, Layout

from .inproc import fabric

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from fabricd.client import Fabric as Client

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def sealed_memfd(size: int) -> int:
    """A valid, sealed, *unmapped* segment fd of ``size`` bytes (sparse: it costs no RAM)."""
    layout = Layout.for_array(size - 128)
    assert layout.size == size, "sizes here are multiples of 64, at least 128"
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, layout.header(), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def raw_attach(client: Client, seg: int, size: int) -> str:
    """Attach a sparse memfd of ``size`` bytes as segment ``seg``: "ok" or "code: message"."""
    fd = sealed_memfd(size)
    try:
        call = client._connection.submit("attach", {"seg": seg, "size": size}, fds=[fd])
    finally:
        os.close(fd)
    try:
        client._connection.wait(call, 10.0).result("attach")
    except fabricd.OperationFailed as exc:
        return f"{exc.code}: {exc}"
    except fabricd.UsageError as exc:
        return f"usage: {exc}"
    return "ok"


def halving(start: int = 1 << 46, smallest: int = 128) -> list[int]:
    """2^46, 2^45, ... down to ``smallest`` bytes: the address-space attack of issue 7."""
    sizes = []
    while start >= smallest:
        sizes.append(start)
        start //= 2
    return sizes


def local_copy_works(socket_path: str, job: str, nbytes: int = 4 * MiB) -> bool:
    """Two ranks of one job on this daemon: a copy of ``nbytes`` (>= 1 MiB: a worker thread)."""
    with (
        fabricd.connect(job=job, rank=0, size=2, socket_path=socket_path) as a,
        fabricd.connect(job=job, rank=1, size=2, socket_path=socket_path) as b,
    ):
        x, y = a.array("x", (nbytes // 4,), "float32"), b.array("y", (nbytes // 4,), "float32")
        x[:] = np.arange(x.size, dtype=np.float32)
        sent, got = a.send_async(x, to=1), b.recv_async(y, src=0)
        sent.wait(timeout=30)
        got.wait(timeout=30)
        return bool(np.array_equal(x, y))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def segments_freed(socket_path: str) -> None:
    """Wait (a hang guard, not a threshold) until the daemon has released every segment: a
    client that closed its connection is forgotten when the daemon reads the end of it."""
    deadline = time.monotonic() + 30
    with fabricd.connect(socket_path=socket_path, timeout=10) as control:
        while control.status()["segments"]:
            assert time.monotonic() < deadline, "the daemon kept segments of clients that left"
            time.sleep(0.01)


# -- address space ----------------------------------------------------------------------------
def test_sparse_memfds_cannot_fill_the_daemons_address_space(make_cluster):
    cluster = make_cluster(1)
    path = cluster.nodes[0].socket_path
    sizes = halving()  # 2^46 .. 2^7: 40 segments, 128 TiB in all if they were mapped
    with ExitStack() as stack:
        attackers = [
            stack.enter_context(fabricd.connect(socket_path=path, timeout=10)) for _ in range(4)
        ]
        for attacker in attackers:
            outcomes = [raw_attach(attacker, seg, size) for seg, size in enumerate(sizes)]
            taken = [size for size, out in zip(sizes, outcomes, strict=True) if out == "ok"]
            assert taken == [256 * GiB], outcomes  # exactly up to its own cap, however sparse
            refused = [out for out in outcomes if out != "ok"]
            assert all(out.startswith("limit: ") for out in refused), refused
            assert all("max_mapped_bytes_per_client" in out for out in refused)
        # the attackers still connected: everyone else attaches and copies (a worker thread)
        assert local_copy_works(path, "victims")
        with fabricd.connect(socket_path=path) as control:
            status = control.status()
    assert status["state"] == "serving"
    assert status["mapped_bytes"] == 4 * 256 * GiB  # the victims' arrays are gone again
    assert status["counters"]["attach_refused_client_bytes"] == 4 * (len(sizes) - 1)
    assert cluster.nodes[0].process is not None
    assert cluster.nodes[0].process.poll() is None


def test_the_daemon_wide_byte_cap_refuses_and_frees(make_cluster):
    cluster = make_cluster(1, max_mapped_bytes=TiB)
    path = cluster.nodes[0].socket_path
    with ExitStack() as stack:
        attackers = [
            stack.enter_context(fabricd.connect(socket_path=path, timeout=10)) for _ in range(5)
        ]
        outcomes = [raw_attach(attacker, 0, 256 * GiB) for attacker in attackers]
        assert outcomes[:4] == ["ok"] * 4
        assert outcomes[4].startswith("limit: "), outcomes[4]
        assert "max_mapped_bytes" in outcomes[4]
        assert "per_client" not in outcomes[4]
        with fabricd.connect(socket_path=path) as control:
            assert control.status()["mapped_bytes"] == TiB
            assert control.status()["counters"]["attach_refused_bytes"] == 1
    # the attackers left: their address space is the daemon's again
    segments_freed(path)
    assert local_copy_works(path, "after")
    with fabricd.connect(socket_path=path) as control:
        assert control.status()["mapped_bytes"] == 0


# -- file descriptors -------------------------------------------------------------------------
@pytest.fixture
def own_daemon(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start a daemon process with an fd limit of our choosing; stopped (and its log checked
    for tracebacks) at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, nofile: int | None = None) -> subprocess.Popen[bytes]:
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / "notify"))
        notify.settimeout(30)

        def limit() -> None:  # pragma: no cover - runs in the child
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        command = [sys.executable, "-m", "fabricd.cli.daemon", "--socket", str(tmp_path / "d.sock")]
        command += ["--nodes", "127.0.0.1:0", *args]
        with open(tmp_path / "daemon.log", "ab") as log:
            daemon = subprocess.Popen(
                command,
                env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=limit,  # only setrlimit, before exec
            )
        started.append(daemon)
        with notify:
            while "READY=1" not in notify.recv(4096).decode().splitlines():
                pass
        return daemon

    yield start
    for daemon in started:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
    log = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "Traceback" not in log, log


def test_many_small_segments_stay_within_the_fd_limit(own_daemon, tmp_path):
    daemon = own_daemon("--max-clients", "64", nofile=1024)
    path = str(tmp_path / "d.sock")
    before = fd_count(daemon.pid)
    assert before < FD_RESERVE  # what the daemon keeps for itself covers an idle daemon
    with ExitStack() as stack:
        attackers = [
            stack.enter_context(fabricd.connect(socket_path=path, timeout=10)) for _ in range(4)
        ]
        outcomes = [raw_attach(a, seg, 4096) for a in attackers for seg in range(256)]
        taken = outcomes.count("ok")
        refused = [out for out in outcomes if out != "ok"]
        assert 0 < taken < 1024 - 64  # what the fd limit leaves once clients have theirs
        assert refused
        assert all(out.startswith("limit: ") for out in refused), refused[:3]
        assert "max_segments, lowered to" in refused[0]
        assert "LimitNOFILE" in refused[0]
        held = fd_count(daemon.pid)
        assert held <= before + taken + len(attackers)  # one fd per segment, none more
        assert held + 64 + 7 <= 1024  # room for every client, and for each node's links
        # the daemon is full, yet a new client connects and is told why it cannot attach
        with fabricd.connect(job="v", rank=0, size=1, socket_path=path, timeout=10) as victim:
            with pytest.raises(fabricd.OperationFailed, match="max_segments") as refusal:
                victim.array("x", (16,), "float32")
            assert refusal.value.code == "limit"
            status = victim.status()
        assert status["segments"] == taken
        assert status["counters"]["attach_refused_segments"] == len(refused) + 1
    # the attackers left: their fds went with them, and everyone else attaches and copies
    segments_freed(path)
    assert fd_count(daemon.pid) <= before + 1  # the connection that asked may linger
    assert local_copy_works(path, "victims", nbytes=2 * MiB)
    assert daemon.poll() is None


def test_max_segments_bounds_the_daemons_fds(own_daemon, tmp_path):
    daemon = own_daemon("--max-segments", "100", "--max-segments-per-client", "64")
    path = str(tmp_path / "d.sock")
    before = fd_count(daemon.pid)
    with ExitStack() as stack:
        attackers = [
            stack.enter_context(fabricd.connect(socket_path=path, timeout=10)) for _ in range(3)
        ]
        outcomes = {
            i: [raw_attach(a, seg, 4096) for seg in range(70)] for i, a in enumerate(attackers)
        }
        everything = [out for outs in outcomes.values() for out in outs]
        assert everything.count("ok") == 100
        assert outcomes[0].count("ok") == 64  # its own cap first
        assert all("max_segments_per_client" in out for out in outcomes[0][64:])
        assert all("the daemon holds 100 segments" in out for out in outcomes[2] if out != "ok")
        assert fd_count(daemon.pid) <= before + 100 + len(attackers)
        with fabricd.connect(socket_path=path) as control:
            counters = control.status()["counters"]
        assert counters["attach_refused_client_segments"] == 6
        assert counters["attach_refused_segments"] == 3 * 70 - 100 - 6
    segments_freed(path)
    # every segment's fd went with its client (the connection that asked may linger)
    assert fd_count(daemon.pid) <= before + 1
    assert daemon.poll() is None


# -- faults injected in an in-process daemon --------------------------------------------------
def _in_a_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run blocking client code in a plain thread (not the loop's executor, which the daemon's
    copies use): its result, or its exception, lands in the returned list."""
    result: list[Any] = []

    def body() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, result


async def test_a_copy_whose_thread_cannot_start_fails_and_the_daemon_serves_on(
    tmp_path, monkeypatch
):
    async with fabric(tmp_path) as fab:
        p2p = fab.daemons[0].service("p2p")
        ready, go, failed, again = (threading.Event() for _ in range(4))

        def pair() -> list[str]:
            outcomes = []
            with (
                fabricd.connect(job="c", rank=0, size=2, socket_path=fab.socket(0)) as a,
                fabricd.connect(job="c", rank=1, size=2, socket_path=fab.socket(0)) as b,
            ):
                x, y = a.array("x", (MiB,), "float32"), b.array("y", (MiB,), "float32")
                x[:] = 7.0
                ready.set()
                go.wait(30)
                for handle in (a.send_async(x, to=1), b.recv_async(y, src=0)):
                    try:
                        handle.wait(timeout=30)
                        outcomes.append("ok")
                    except fabricd.OperationFailed as exc:
                        outcomes.append(f"{exc.code}: {exc}")
                outcomes.append("untouched" if not y.any() else "written")
                failed.set()
                again.wait(30)
                sent = a.send_async(x, to=1)
                b.recv(y, src=0, timeout=30)
                sent.wait(timeout=30)
                outcomes.append("copied" if (y == 7.0).all() else "wrong bytes")
            return outcomes

        thread, result = _in_a_thread(pair)
        await fab.until(ready.is_set)

        real_start = threading.Thread.start

        def no_thread(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        copiers = ThreadPoolExecutor()  # no idle worker: the next copy must start a thread
        monkeypatch.setattr(datapath, "_copiers", copiers)
        monkeypatch.setattr(threading.Thread, "start", no_thread)
        go.set()
        await fab.until(lambda: failed.is_set() or not thread.is_alive(), timeout=60)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert p2p.statistics()["counters"]["copies_failed"] == 1
        again.set()
        await fab.until(lambda: not thread.is_alive(), timeout=30)
        outcomes = result[0]
        assert not isinstance(outcomes, BaseException), outcomes
        sent, got, untouched, copied = outcomes
        for outcome in (sent, got):
            assert outcome.startswith("resources: "), outcome
            assert "the daemon could not start a thread for a 4194304 B copy" in outcome
        assert untouched == "untouched"  # nothing was copied into the failed receive
        assert copied == "copied"  # the next copy, with threads again, works
        assert not fab.tasks[0].done()
        copiers.shutdown()


@pytest.mark.parametrize(
    "fault",
    [MemoryError(), OSError(errno.ENOMEM, "Cannot allocate memory"), OSError(errno.EMFILE, "")],
    ids=["MemoryError", "ENOMEM", "EMFILE"],
)
async def test_mmap_running_short_on_attach_fails_that_request_only(tmp_path, monkeypatch, fault):
    async with fabric(tmp_path) as fab:
        ready, go = threading.Event(), threading.Event()

        def client() -> tuple[str, str]:
            with fabricd.connect(job="m", rank=0, size=1, socket_path=fab.socket(0)) as c:
                c.array("before", (16,), "float32")
                ready.set()
                go.wait(30)
                short = raw_attach(c, 99, 4096)  # the daemon's mmap fails: only this request
                go.clear()
                ready.set()
                go.wait(30)
                c.array("after", (16,), "float32")  # the same connection goes on
                return short, raw_attach(c, 99, 4096)

        thread, result = _in_a_thread(client)
        await fab.until(ready.is_set)
        ready.clear()

        def short(*args: object, **kwargs: object) -> None:
            raise fault

        monkeypatch.setattr(shm.mmap, "mmap", short)
        go.set()
        await fab.until(ready.is_set)
        monkeypatch.undo()
        go.set()
        await fab.until(lambda: not thread.is_alive(), timeout=30)
        outcome = result[0]
        assert not isinstance(outcome, BaseException), outcome
        failed, retried = outcome
        assert failed.startswith("resources: attach: the daemon could not map the segment"), failed
        assert retried == "ok"  # the same segment id was never taken
        daemon = fab.daemons[0]
        assert daemon.segments.counters()["attach_failed_resources"] == 1
        assert daemon.segments.gauges() == {"segments": 0, "mapped_bytes": 0}  # client left
        assert not fab.tasks[0].done()


async def test_a_client_over_its_caps_is_told_the_limit_and_the_setting(tmp_path):
    async with fabric(tmp_path, max_mapped_bytes_per_client=MiB, max_segments_per_client=2) as fab:

        def client() -> list[str]:
            told = []
            with fabricd.connect(job="k", rank=0, size=1, socket_path=fab.socket(0)) as c:
                for name, elements in (("big", MiB), ("a", 16), ("b", 16), ("c", 16)):
                    try:
                        c.array(name, (elements,), "uint8")
                        told.append("ok")
                    except fabricd.OperationFailed as exc:
                        told.append(f"{exc.code}: {exc}")
            return told

        big, a, b, c = await asyncio.to_thread(client)
        assert big.startswith("limit: "), big
        assert "max_mapped_bytes_per_client" in big
        assert "1 MiB" in big  # the cap, in units a person reads
        assert (a, b) == ("ok", "ok")
        assert c.startswith("limit: "), c
        assert "max_segments_per_client" in c
        counters = fab.daemons[0].segments.counters()
        assert counters["attach_refused_client_bytes"] == 1
        assert counters["attach_refused_client_segments"] == 1
        assert fab.daemons[0].segments.gauges() == {"segments": 0, "mapped_bytes": 0}


@pytest.mark.parametrize("fault", [MemoryError(), OSError(errno.ENOBUFS, "No buffer space")])
async def test_a_stream_that_raises_fails_that_message_only(tmp_path, monkeypatch, fault):
    async with fabric(tmp_path) as fab:
        sender = fab.daemons[0].service("p2p")
        real_stream = p2p_service.stream
        broken = [True]

        async def stream(*args: Any) -> None:
            if broken[0]:
                broken[0] = False
                raise fault
            await real_stream(*args)

        monkeypatch.setattr(p2p_service, "stream", stream)

        def receiver() -> list[str]:
            outcomes = []
            with fabricd.connect(job="s", rank=1, size=2, socket_path=fab.socket(1)) as b:
                y = b.array("y", (MiB,), "float32")  # 4 MiB: several chunks, a stream task
                for _ in range(2):
                    try:
                        b.recv(y, src=0, timeout=30)
                        outcomes.append("ok" if (y == 3.0).all() else "wrong bytes")
                    except fabricd.FabricError as exc:
                        outcomes.append(type(exc).__name__)
            return outcomes

        def sender_client() -> list[str]:
            outcomes = []
            with fabricd.connect(job="s", rank=0, size=2, socket_path=fab.socket(0)) as a:
                x = a.array("x", (MiB,), "float32")
                x[:] = 3.0
                for _ in range(2):
                    try:
                        a.send(x, to=1, timeout=30)
                        outcomes.append("ok")
                    except fabricd.OperationFailed as exc:
                        outcomes.append(f"{exc.code}: {exc}")
            return outcomes

        got = asyncio.create_task(asyncio.to_thread(receiver))
        sent = await asyncio.to_thread(sender_client)
        received = await got
        assert sent[0].startswith("resources: "), sent
        assert type(fault).__name__ in sent[0]
        assert received[0] == "PeerFailed"  # told by the sender's CANCEL, not left waiting
        assert (sent[1], received[1]) == ("ok", "ok")  # the next message streams whole
        assert sender.statistics()["counters"]["ops_failed"] == 1
        assert not fab.tasks[0].done()


async def test_a_detached_segment_a_receive_still_holds_counts_until_unmapped(tmp_path):
    # A pending receive keeps a view of its segment, so ``detach`` cannot unmap it (mmap
    # refuses to close under a view; the daemon's copy of the fd stays open too).  The caps
    # went back all the same, so a client could attach, post a receive that never matches,
    # detach, and repeat: past max_mapped_bytes_per_client and every other cap, with fds.
    async with fabric(tmp_path, max_mapped_bytes_per_client=2 * MiB) as fab:
        daemon = fab.daemons[0]

        def client() -> tuple[str, dict[str, int]]:
            path = fab.socket(0)
            with (
                fabricd.connect(job="d", rank=0, size=2, socket_path=path) as a,
                fabricd.connect(job="d", rank=1, size=2, socket_path=path),
            ):
                x = a.array("x", (MiB,), "uint8")
                pending = a.recv_async(x, src=1)  # rank 1 never sends
                call = a._connection.submit("detach", {"seg": 1})
                a._connection.wait(call, 10.0).result("detach")
                with_view = daemon.segments.gauges()
                try:
                    a.array("y", (MiB,), "uint8")
                    second = "ok"
                except fabricd.OperationFailed as exc:
                    second = f"{exc.code}: {exc}"
                del pending
            return second, with_view

        second, with_view = await asyncio.to_thread(client)
        assert with_view == {"segments": 1, "mapped_bytes": MiB + 128}  # still mapped
        assert second.startswith("limit: "), second
        assert "max_mapped_bytes_per_client" in second
        await fab.until(lambda: daemon.segments.gauges() == {"segments": 0, "mapped_bytes": 0})


async def test_segments_detached_and_clients_gone_during_a_copy_stay_mapped_until_it_ends(
    tmp_path, monkeypatch
):
    # The copy's worker thread writes through numpy views of both segments: the receiver
    # detaching its segment and both clients leaving mid-copy must neither unmap them under the
    # thread (a segfault of the daemon) nor give the caps back before the copy let go of them.
    async with fabric(tmp_path) as fab:
        daemon = fab.daemons[0]
        copying, finish = threading.Event(), threading.Event()
        real_run = datapath._Copy.run

        def slow_run(self: datapath._Copy) -> None:
            copying.set()
            finish.wait(30)
            real_run(self)

        monkeypatch.setattr(datapath._Copy, "run", slow_run)

        def pair() -> None:
            path = fab.socket(0)
            with (
                fabricd.connect(job="u", rank=0, size=2, socket_path=path) as a,
                fabricd.connect(job="u", rank=1, size=2, socket_path=path) as b,
            ):
                x, y = a.array("x", (MiB,), "float32"), b.array("y", (MiB,), "float32")
                x[:] = 3.0
                a.send_async(x, to=1)
                b.recv_async(y, src=0)
                assert copying.wait(30)
                call = b._connection.submit("detach", {"seg": 1})
                b._connection.wait(call, 10.0).result("detach")

        await asyncio.to_thread(pair)  # both clients left while the copy waits to run
        await fab.until(lambda: not daemon.sessions)
        assert daemon.segments.gauges() == {"segments": 2, "mapped_bytes": 2 * (4 * MiB + 128)}
        finish.set()
        await fab.until(lambda: daemon.segments.gauges() == {"segments": 0, "mapped_bytes": 0})
        assert daemon.service("p2p").statistics()["counters"]["bytes_copied"] == 4 * MiB
        assert await asyncio.to_thread(local_copy_works, fab.socket(0), "after") is True
        assert not fab.tasks[0].done()
