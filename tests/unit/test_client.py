"""The client library's own checks, which need no daemon (a fake one at most)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import pytest
from fakedaemon import FakeDaemon, answer_like_a_daemon

import fabricd
from fabricd import ipc
from fabricd.client import checks, connect
from fabricd.dtypes import ITEMSIZE
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, encode

if TYPE_CHECKING:
    from collections.abc import Callable


def test_no_daemon_says_which_socket_and_how_to_start_one(tmp_path):
    path = str(tmp_path / "absent.sock")
    with pytest.raises(fabricd.DaemonUnavailable) as missing:
        connect(socket_path=path)
    text = str(missing.value)
    assert path in text
    assert "fabricctl local-cluster" in text
    assert "FABRICD_SOCKET" in text


def test_a_process_out_of_fds_gets_a_daemon_unavailable_that_says_so(tmp_path, monkeypatch):
    def out_of_fds(*args: object) -> socket.socket:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(socket, "socket", out_of_fds)
    with pytest.raises(fabricd.DaemonUnavailable, match=r"absent\.sock \(Too many open files\)"):
        connect(socket_path=str(tmp_path / "absent.sock"))


def test_a_socket_path_may_be_a_path_object_and_nothing_else(tmp_path):
    with pytest.raises(fabricd.DaemonUnavailable, match=r"absent\.sock \(No such file"):
        connect(socket_path=tmp_path / "absent.sock")
    with pytest.raises(fabricd.UsageError, match="socket_path must be a str or a path, not int 5"):
        connect(socket_path=5)  # type: ignore[arg-type]


def test_rank_and_size_come_from_torchrun_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(fabricd.UsageError, match=r"\$RANK='five' is not an integer"):
        connect(job="j", socket_path=str(tmp_path / "s"))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fabricd.UsageError, match="rank 3 is outside a job of size 2"):
        connect(job="j", socket_path=str(tmp_path / "s"))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(fabricd.UsageError, match="needs rank and size"):
        connect(job="j", socket_path=str(tmp_path / "s"))


def test_every_error_is_a_fabric_error():
    for name in fabricd.__all__:
        value = getattr(fabricd, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, fabricd.FabricError), name
    assert issubclass(fabricd.Timeout, TimeoutError)
    assert issubclass(fabricd.ProtocolError, ValueError)
    failed = fabricd.PeerFailed("gone", rank=3, node=1)
    assert (failed.code, failed.rank, failed.node) == ("peer_failed", 3, 1)


def test_a_daemon_that_hangs_up_at_once_is_explained(tmp_path):
    import socket
    import threading

    path = str(tmp_path / "refusing.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse() -> None:  # what the daemon does with a uid it does not admit
        conn, _ = server.accept()
        conn.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    try:
        with pytest.raises(fabricd.DaemonUnavailable) as refused:
            connect(socket_path=path, timeout=5)
    finally:
        thread.join(5)
        server.close()
    assert "allowed_uids" in str(refused.value)
    assert "max_clients" in str(refused.value)  # the uid is one guess among the reasons
    assert path in str(refused.value)


def test_a_daemon_that_says_why_it_hangs_up_is_quoted_not_guessed_at(tmp_path):
    import socket
    import threading

    from fabricd.errors import ErrorCode
    from fabricd.ipc import closing_frame

    path = str(tmp_path / "refusing.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse() -> None:  # what the daemon does at accept with a uid it does not admit
        conn, _ = server.accept()
        conn.sendall(closing_frame(ErrorCode.REFUSED, "uid 4242 (gid 4242) may not use this"))
        conn.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    try:
        with pytest.raises(fabricd.DaemonUnavailable) as refused:
            connect(socket_path=path, timeout=5)
    finally:
        thread.join(5)
        server.close()
    assert "uid 4242 (gid 4242) may not use this" in str(refused.value)
    assert path in str(refused.value)
    assert "may have refused" not in str(refused.value)


# -- arguments are checked before anything is sent ----------------------------------------------


@pytest.fixture
def fake():
    """A fake daemon (stopped at teardown) and a client of job "j", rank 0 of 2, on it."""
    daemon = FakeDaemon()
    client = daemon.client(checks.membership("j", 0, 2))
    yield daemon, client
    client.close()
    daemon.stop()


def test_numpy_integers_are_taken_where_ints_are(fake):
    daemon, fab = fake
    array = fab.array("a", (np.int64(2), np.uint8(2)), "float32")
    done = fab.send(array, to=np.int64(1), tag=np.int32(7), timeout=5)
    assert done == fabricd.Completion(peer=1, tag=7, nbytes=16)
    sent = daemon.requests[-1]
    assert (sent["op"], sent["peer"], sent["tag"]) == ("send", 1, 7)
    assert type(sent["peer"]) is int
    assert fab.recv(array[0, :1], src=np.intp(1), timeout=5).nbytes == 4


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda fab, a: fab.send(a, to=1.0), "to must be an int rank in 0..1, not float 1.0"),
        (lambda fab, a: fab.send(a, to=True), "to must be an int rank in 0..1, not a bool"),
        (lambda fab, a: fab.send(a, to=np.bool_(True)), "to must be an int rank"),
        (lambda fab, a: fab.send(a, to="1"), "to must be an int rank in 0..1, not str '1'"),
        (lambda fab, a: fab.send(a, to=2), "rank 2 is outside job 'j' of size 2"),
        (lambda fab, a: fab.send(a, to=-1), "rank -1 is outside job 'j' of size 2"),
        (lambda fab, a: fab.recv(a, src=1, tag=-1), "tag -1 is outside 0..2147483647"),
        (lambda fab, a: fab.recv(a, src=np.float64(1)), "src must be an int rank"),
        (lambda fab, a: fab.send_async(a, 1, tag="x"), "tag must be an int in 0..2147483647"),
        (lambda fab, a: fab.recv_async(a, 1, tag=2**31), "tag 2147483648 is outside"),
        (lambda fab, a: fab.send(a, to=1, tag=1.5), "tag must be an int"),
        (lambda fab, a: fab.send(a.tolist(), to=1), "numpy arrays made by fab.array"),
        (lambda fab, a: fab.send(a.view(">f4"), to=1), "dtype >f4 is not supported"),
        (lambda fab, a: fab.recv(a.view(">f4"), src=1), "dtype >f4 is not supported"),
    ],
)
def test_wrong_send_and_recv_arguments_never_reach_the_daemon(fake, call, message):
    daemon, fab = fake
    array = fab.array("a", (4,), "float32")
    with pytest.raises(fabricd.UsageError, match=re.escape(message)):
        call(fab, array)
    assert not {"send", "recv"} & set(daemon.ops())


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((4,), "flaot32", "dtype str 'flaot32' is not supported; use one of bool, int8"),
        ((4,), None, "dtype NoneType None is not supported"),
        ((4,), "U8", "is not supported"),
        ((4,), ">f4", "is not supported"),  # not in this machine's byte order
        ((4,), "f4,(", "dtype str 'f4,(' is not supported"),  # numpy raises SyntaxError
        (np.array(4.0), "float32", "shape must be an int or a sequence of ints, not ndarray"),
        ((4.0,), "float32", "each dimension of shape must be an int, not float 4.0"),
        ((True, 2), "float32", "each dimension of shape must be an int, not a bool"),
        ("12", "float32", "shape must be an int or a sequence of ints, not str '12'"),
        (2.5, "float32", "shape must be an int or a sequence of ints, not float 2.5"),
        ((2, -1), "float32", "shape (2, -1) has a negative dimension"),
    ],
)
def test_wrong_array_arguments_never_reach_the_daemon(fake, shape, dtype, message):
    daemon, fab = fake
    with pytest.raises(fabricd.UsageError, match=re.escape(message)):
        fab.array("b", shape, dtype)
    assert "attach" not in daemon.ops()


def test_arrays_take_every_dtype_fabricd_moves_by_name_or_type(fake):
    _, fab = fake
    for dtype in ITEMSIZE:
        assert fab.array(dtype, (np.int16(3),), np.dtype(dtype)).dtype.name == dtype
    assert fab.array("by-type", 2, np.float16).dtype == np.float16
    assert fab.array("bf16", 2, ml_dtypes.bfloat16).dtype.name == "bfloat16"  # numpy's (JAX's)
    assert fab.array("0-d", np.array(3), "int8").shape == (3,)  # a numpy integer, 0-d
    with pytest.raises(fabricd.UsageError, match="an array's name must be a non-empty str"):
        fab.array("", 2)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((2**40, 2**40), "shape (1099511627776, 1099511627776) float32 is too large"),
        ((0, 2**62), "is too large"),  # numpy refuses it even with no element
        ((2**61 // 4,), "cannot make shared memory for array 'big' of 2305843009213693952 B: "),
    ],
)
def test_an_array_too_large_for_the_machine_is_a_usage_error(fake, shape, message):
    daemon, fab = fake
    with pytest.raises(fabricd.UsageError, match=re.escape(message)):
        fab.array("big", shape, "float32")
    assert "attach" not in daemon.ops()


def test_any_str_names_an_array(fake):
    daemon, fab = fake
    for name in ("a\0b", "\ud800", "é" * 300, "名" * 100):
        array = fab.array(name, 2, "int8")
        assert fab.array(name, 2, "int8") is array
        assert fab.send(array, to=1, timeout=5).nbytes == 2
    assert daemon.ops().count("attach") == 4


def test_threads_asking_for_one_name_at_once_share_one_array():
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "attach":  # slow to attach: the other thread asks meanwhile
            threading.Timer(0.3, daemon.reply, args=(request,)).start()
        else:
            answer_like_a_daemon(daemon, request)

    daemon = FakeDaemon(script)
    fab = daemon.client(checks.membership("j", 0, 2))
    got: list[Any] = []
    try:
        first = threading.Thread(target=lambda: got.append(fab.array("w", 4)))
        first.start()
        deadline = time.monotonic() + 10
        while "attach" not in daemon.ops() and time.monotonic() < deadline:
            time.sleep(0.005)
        got.append(fab.array("w", 4))  # while the first attach is still under way
        first.join(10)
        assert len(got) == 2
        assert got[0] is got[1]
        assert daemon.ops().count("attach") == 1
        fab.send(got[0], to=1, timeout=5)
    finally:
        fab.close()
        daemon.stop()


def test_a_send_looks_its_array_up_while_another_thread_makes_one(fake):
    _, fab = fake
    array = fab.array("a", 4)
    arrays = fab._arrays

    class Made:  # an entry looked at just when another thread's fab.array() lands
        root = np.zeros(0, np.uint8)

        @property
        def base(self) -> int:
            fab.array(f"other{len(arrays._entries)}", 2)
            return 0

    arrays._entries = {"made-meanwhile": Made(), **arrays._entries}  # type: ignore[dict-item]
    # a slice: a whole fab.array() is found by its identity, without the scan
    assert fab.send(array[1:], to=1, timeout=5).nbytes == 12
    assert fab.send(fab.array("other2", 2), to=1, timeout=5).nbytes == 8


@pytest.mark.parametrize(
    ("given", "taken"),
    [
        (None, None),
        (5, 5.0),
        (2.5, 2.5),
        (-1, -1.0),
        (0, 0.0),
        (float("inf"), None),
        (np.float64(2), 2.0),
        (np.int64(3), 3.0),
        (np.float32(float("inf")), None),
    ],
)
def test_a_timeout_is_a_float_of_seconds_or_none(given, taken):
    got = checks.timeout(given)
    assert got == taken
    assert got is None or type(got) is float


@pytest.mark.parametrize("given", [float("nan"), np.float64("nan"), True, np.bool_(False), "1"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(given):
    with pytest.raises(fabricd.UsageError, match="timeout must be None or a number of seconds"):
        checks.timeout(given)


@pytest.mark.parametrize("given", [0, 0.0, 0.01, np.float64(0.002), 5e-5])
def test_a_spin_is_a_float_of_seconds_up_to_max_spin(given):
    got = checks.spin(given)
    assert got == float(given)
    assert type(got) is float


@pytest.mark.parametrize("given", [-1e-6, 0.0100001, 1, float("nan"), True, "5", None])
def test_a_spin_outside_its_range_is_refused(given):
    with pytest.raises(fabricd.UsageError, match=r"spin must be a number of seconds in 0\.\.0\.01"):
        checks.spin(given)


def test_a_bad_spin_is_refused_before_any_socket_is_tried(tmp_path, monkeypatch):
    absent = str(tmp_path / "absent.sock")
    with pytest.raises(fabricd.UsageError, match="spin must be"):
        connect(socket_path=absent, spin=-1)
    monkeypatch.setenv("FABRICD_SPIN_US", "fast")
    with pytest.raises(fabricd.UsageError, match=r"\$FABRICD_SPIN_US='fast' is not a number"):
        connect(socket_path=absent)
    monkeypatch.setenv("FABRICD_SPIN_US", "20000")  # 20 ms: over MAX_SPIN, said in microseconds
    with pytest.raises(fabricd.UsageError, match=r"\$FABRICD_SPIN_US='20000' .* in 0\.\.10000"):
        connect(socket_path=absent)
    monkeypatch.setenv("FABRICD_SPIN_US", "50")  # fine: then no daemon answers
    with pytest.raises(fabricd.DaemonUnavailable):
        connect(socket_path=absent)


@pytest.mark.timeout(30)  # a spin that ignored a call's time limit would spin past it
@pytest.mark.parametrize("spin", [0.0, 0.002, checks.MAX_SPIN])
def test_a_spinning_client_gets_every_reply_and_keeps_its_time_limits(spin):
    answered = threading.Event()

    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "stalls":  # never answered: the call must time out
            return
        if request["op"] == "send" and answered.is_set():  # answered late, after the spin
            threading.Timer(0.05, answer_like_a_daemon, (daemon, request)).start()
            return
        answer_like_a_daemon(daemon, request)

    daemon = FakeDaemon(script)
    fab = daemon.client(checks.membership("j", 0, 2))
    try:
        fab._connection.spin = spin
        array = fab.array("a", (4,), "float32")
        for i in range(20):  # answered at once: within any spin
            assert fab.send(array, to=1, tag=i, timeout=5).tag == i
            assert fab.recv(array, src=1, tag=i).nbytes == 16
        answered.set()
        assert fab.send(array, to=1, tag=99).tag == 99  # slower than the spin: it sleeps
        assert fab.send(array, to=1, tag=98, timeout=5).tag == 98
        with pytest.raises(fabricd.Timeout):
            fab.stalls(timeout=0.001)  # a limit shorter than the spin ends the wait
        with pytest.raises(fabricd.Timeout):
            fab.stalls(timeout=0)
    finally:
        fab.close()
        daemon.stop()


def test_a_whole_array_is_placed_as_the_scan_would_place_it(fake):
    daemon, fab = fake
    arrays = fab._arrays
    for dtype in ITEMSIZE:
        array = fab.array(f"whole-{dtype}", (2, 3), dtype)
        # array[:] is another object, so the scan of the segments places it
        assert arrays.where(array) == arrays.where(array[:])
        assert arrays.locate(array) == arrays.locate(array[:])
        assert arrays.find(array) == (
            arrays.where(array)[0],
            arrays.where(array)[1],
            f"whole-{dtype}",
        )
    array = fab.array("changed", (2, 4), "int16")
    array.shape = (8,)  # numpy changes shape and dtype in place, never the address
    array.dtype = np.dtype("uint8")
    assert arrays.where(array) == arrays.where(array[:])
    assert fab.send(array, to=1, timeout=5).nbytes == 16
    assert daemon.requests[-1]["dtype"] == "uint8"
    array.dtype = np.dtype(">u2")
    with pytest.raises(fabricd.UsageError, match=re.escape("dtype >u2 is not supported")):
        fab.send(array, to=1)


@pytest.mark.parametrize(
    ("job", "rank", "size", "message"),
    [
        ("x" * 201, 0, 1, "job must be a str of 1..200 characters, not one of 201"),
        ("", 0, 1, "job must be a str of 1..200 characters, not one of 0"),
        (b"job", 0, 1, "job must be a str of 1..200 characters, not bytes b'job'"),
        ("j", 1.0, 2, "rank must be an int in 0..1, not float 1.0"),
        ("j", True, 2, "rank must be an int in 0..1, not a bool"),
        ("j", 0, "2", "size must be an int in 1..2147483648, not str '2'"),
        ("j", 0, 0, "size 0 is outside 1..2147483648"),
        ("j", 2, 2, "rank 2 is outside a job of size 2"),
    ],
)
def test_a_wrong_job_is_refused_before_any_socket_is_tried(tmp_path, job, rank, size, message):
    with pytest.raises(fabricd.UsageError, match=re.escape(message)):
        connect(job=job, rank=rank, size=size, socket_path=str(tmp_path / "absent.sock"))


def test_numpy_ranks_and_sizes_join(tmp_path):
    with pytest.raises(fabricd.DaemonUnavailable):  # past every check: on to the socket
        connect(job="j" * 200, rank=np.int64(1), size=np.int32(2), socket_path=str(tmp_path))


# -- where the socket is ------------------------------------------------------------------------


def test_a_named_socket_is_the_only_one_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setattr(ipc, "SYSTEM_SOCKET", str(tmp_path / "system.sock"))
    monkeypatch.setenv("FABRICD_SOCKET", str(tmp_path / "from-env.sock"))
    with pytest.raises(fabricd.DaemonUnavailable) as from_env:
        connect()
    with pytest.raises(fabricd.DaemonUnavailable) as given:
        connect(socket_path=str(tmp_path / "given.sock"))
    for raised, name in ((from_env, "from-env.sock"), (given, "given.sock")):
        tried = str(raised.value).split(". Start one")[0]
        assert (
            tried == f"no fabricd daemon answers on {tmp_path / name} (No such file or directory)"
        )


def _as_a_user(child: Callable[[], str]) -> str:
    """Run ``child`` in a forked process as a user that is not root (nobody, when run as root).

    Returns what it returned, or its exception as text.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            if os.geteuid() == 0:
                nobody = pwd.getpwnam("nobody")
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
            answer = child()
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        answer = report.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.fixture
def open_dir():
    """A directory every user can enter (pytest's tmp dirs are 0700), removed at teardown."""
    path = Path(tempfile.mkdtemp(prefix="fabricd-discovery-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_a_user_tries_their_runtime_dir_then_the_system_socket(open_dir, monkeypatch):
    monkeypatch.delenv("FABRICD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(open_dir / "runtime"))
    monkeypatch.setattr(ipc, "SYSTEM_SOCKET", str(open_dir / "system" / "fabricd.sock"))
    answer = _as_a_user(lambda: str(connect()))
    assert answer.startswith("DaemonUnavailable: no fabricd daemon answers on ")
    runtime = answer.index(str(open_dir / "runtime" / "fabricd" / "fabricd.sock"))
    assert runtime < answer.index(f"or {open_dir / 'system' / 'fabricd.sock'} (")
    assert "fabricctl local-cluster" in answer


def test_a_user_finds_a_daemon_at_the_system_socket(open_dir, monkeypatch):
    system = open_dir / "fabricd.sock"
    monkeypatch.delenv("FABRICD_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(open_dir / "runtime"))
    monkeypatch.setattr(ipc, "SYSTEM_SOCKET", str(system))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(system))
    system.chmod(0o666)
    server.listen(1)

    def child() -> str:
        with connect() as control:
            return f"{control.socket_path} node {control.node}"

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        server.close()
        os.close(read_end)
        os.write(write_end, _as_a_user(child).encode())
        os._exit(0)
    os.close(write_end)
    conn, _ = server.accept()  # the parent plays the daemon: one hello, answered
    server.close()
    conn.settimeout(10)
    decoder = Decoder(ipc.REQUEST_LIMITS)
    while not isinstance(hello := decoder.next_event(), Frame):
        if hello is NEED_DATA:
            decoder.feed(conn.recv(4096))
    conn.sendall(encode(Kind.REPLY, {"id": hello.meta["id"], "ok": True, "node": 3, "nodes": 4}))
    with os.fdopen(read_end, "rb") as report:
        answer = report.read().decode()
    os.waitpid(pid, 0)
    conn.close()
    assert hello.meta["op"] == "hello"
    assert answer == f"{system} node 3"


def test_late_is_checked_sent_for_partial_modes_only_and_results_read():
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "collective":
            daemon.reply(request, round=3, included=False, active=1, results=2)
        else:
            answer_like_a_daemon(daemon, request)

    daemon = FakeDaemon(script)
    fab = daemon.client(checks.membership("j", 0, 2))
    array = fab.array("late", (4,), "float32")
    with pytest.raises(fabricd.UsageError, match="late must be one of 'sum', 'latest', not 'all'"):
        fab.allreduce_async(array, "sum", "solo", late="all")  # type: ignore[arg-type]
    assert "collective" not in daemon.ops()
    result = fab.allreduce(array, "sum", "solo", late="sum", timeout=5)
    assert daemon.requests[-1]["late"] == "sum"
    assert result == fabricd.Result(round=3, included=False, active=1, results=2)
    fab.allreduce(array, "sum", "sync", timeout=5)
    assert "late" not in daemon.requests[-1]
    fab.close()
    daemon.stop()


def test_algorithm_is_checked_and_sent_only_when_asked_for():
    def script(daemon: FakeDaemon, request: dict[str, Any]) -> None:
        if request["op"] == "collective":
            daemon.reply(request, round=0, included=True, active=2)
        else:
            answer_like_a_daemon(daemon, request)

    daemon = FakeDaemon(script)
    fab = daemon.client(checks.membership("j", 0, 2))
    array = fab.array("algo", (4,), "float32")
    with pytest.raises(fabricd.UsageError, match=r"algorithm must be one of .*not 'gossip'"):
        fab.allreduce_async(array, algorithm="gossip")  # type: ignore[arg-type]
    with pytest.raises(fabricd.UsageError, match="sync allreduce"):
        fab.allreduce_async(array, "sum", "solo", algorithm="mlfabric")
    assert "collective" not in daemon.ops()
    fab.allreduce(array, "sum", "solo", algorithm="tree", timeout=5)
    assert daemon.requests[-1]["algorithm"] == "tree"
    assert daemon.requests[-1]["name"] == "allreduce:solo:sum:algo"  # the name does not say it
    fab.allreduce(array, timeout=5)
    assert "algorithm" not in daemon.requests[-1]  # "auto": the request of old
    fab.close()
    daemon.stop()
