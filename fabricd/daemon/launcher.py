"""A fabric of daemons on loopback, for development, tests, the demo and benchmarks.

:class:`LocalCluster` writes a config and a 0600 secret into a private temporary directory,
starts one ``fabricd`` process per node with its own ``NOTIFY_SOCKET`` (so it knows each one is
listening exactly when systemd would), removes the secret once every daemon has read it, and on
:meth:`LocalCluster.stop` sends SIGTERM, waits for the drain, and removes the directory:
nothing is left behind.

A launcher that is killed before it can stop its cluster (SIGKILL, a crash) takes its daemons
along: the kernel kills each of them when the launcher dies (:func:`spawn_tied`).  Only its
directory stays, without the secret; the directory's name records which process made it, and
:func:`remove_leftovers` removes the directories whose process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import random
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabricd.dirs import make_dirs
from fabricd.errors import FabricError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import TracebackType

#: liveness settings for development and the failure tests: a silent peer is suspect after
#: 0.3 s and down after 1 s, so a failure shows within a second
FAST_LIVENESS: dict[str, Any] = {
    "heartbeat_interval": 0.1,
    "suspect_after": 0.3,
    "down_after": 1.0,
}


class ClusterError(FabricError):
    """A local cluster could not start (the message carries the failing node's log)."""


@dataclass(slots=True)
class NodeProcess:
    """One daemon of a local cluster."""

    node: int
    address: str
    socket_path: str
    log_path: Path
    notify: socket.socket
    #: the metrics endpoint's ``host:port`` the launcher chose ("" when the settings choose)
    metrics_address: str = ""
    process: subprocess.Popen[bytes] | None = None
    ready: bool = False

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        """Its metrics endpoint (``status`` says the same under ``metrics_url``)."""
        return f"http://{self.metrics_address}/metrics" if self.metrics_address else ""

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass(slots=True)
class LocalCluster:
    """N daemons on 127.0.0.1; a context manager that starts and stops them.

    Args:
        size: number of nodes.
        settings: extra config keys for every node (e.g. liveness timeouts).
        log_dir: where daemon logs go; default: inside the temporary directory (removed).
        node_env: extra environment variables for single nodes (``FABRICD_<KEY>`` overrides).
        hosts: the address each node listens on, by node; default: 127.0.0.1 for every node.
        wrappers: a command prefix for single nodes' daemons, e.g. ``ip netns exec <ns>`` to run
            one in its own network namespace (the network tests); it must exec the daemon, so
            that the process started is the daemon itself.

    With ``membership = "etcd"`` in ``settings`` (and ``etcd_endpoints``), the config lists no
    nodes: each daemon is told its ``listen`` address and its name (``node<i>``) and registers
    in etcd, which gives it its node id; :meth:`add_node` starts one more into the running
    fabric.  ``NodeProcess.node`` is then the launcher's index, not the node id.
    """

    size: int
    settings: dict[str, Any] = field(default_factory=dict)
    log_dir: Path | None = None
    node_env: dict[int, dict[str, str]] = field(default_factory=dict)
    hosts: list[str] | None = None
    wrappers: dict[int, list[str]] = field(default_factory=dict)
    nodes: list[NodeProcess] = field(default_factory=list)
    directory: Path | None = None
    config_path: Path | None = None
    _secret: str = field(default="", repr=False)

    def start(self, timeout: float = 30.0) -> None:
        """Start every daemon and wait until each has said READY=1.

        Raises:
            ClusterError: a daemon exited or stayed silent; its log tail is in the message.
        """
        if self.size < 1:
            raise ClusterError("a cluster needs at least one node")
        if self.hosts is not None and len(self.hosts) != self.size:
            raise ClusterError(f"{len(self.hosts)} hosts given for {self.size} nodes")
        self.directory = Path(tempfile.mkdtemp(prefix=_directory_prefix()))
        try:
            self._write_files()
            for node in self.nodes:
                self._spawn(node)
            self._wait_ready(timeout)
            self._forget_secret()
        except BaseException:
            self.stop()
            raise

    def _write_files(self) -> None:
        assert self.directory is not None
        secret = self._write_secret()
        # each daemon's peer port and, unless the settings say otherwise, its own metrics port
        metrics = "metrics_address" not in self.settings
        ports: list[int] = []
        while len(ports) < self.size * (2 if metrics else 1):
            port = _free_port()
            if port not in ports:
                ports.append(port)
        hosts = self.hosts or ["127.0.0.1"] * self.size
        addresses = [f"{host}:{port}" for host, port in zip(hosts, ports[: self.size], strict=True)]
        lines = [f"secret_file = {toml_value(str(secret))}"]
        if not self.etcd:
            lines.append(f"nodes = {toml_value(addresses)}")
        for key, value in self.settings.items():
            lines.append(f"{key} = {toml_value(value)}")
        self.config_path = self.directory / "fabricd.toml"
        self.config_path.write_text("\n".join(lines) + "\n")
        log_dir = self.log_dir or self.directory
        make_dirs(log_dir, 0o700)  # logs name jobs and pids: the user's own, whatever the umask
        for i, address in enumerate(addresses):
            # on loopback, also inside a network namespace of its own
            self._add_process(address, f"127.0.0.1:{ports[self.size + i]}" if metrics else "")

    @property
    def etcd(self) -> bool:
        """Whether the daemons take their membership from etcd."""
        return self.settings.get("membership") == "etcd"

    def _add_process(self, address: str, metrics_address: str) -> NodeProcess:
        assert self.directory is not None
        i = len(self.nodes)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(str(self.directory / f"notify{i}"))
        notify.setblocking(False)
        node = NodeProcess(
            node=i,
            address=address,
            socket_path=str(self.directory / f"node{i}.sock"),
            log_path=(self.log_dir or self.directory) / f"node{i}.log",
            notify=notify,
            metrics_address=metrics_address,
        )
        self.nodes.append(node)
        return node

    def add_node(self, timeout: float = 30.0) -> NodeProcess:
        """Start one more daemon into the running fabric (membership from etcd only: a
        static node list cannot grow) and wait until it is ready."""
        if not self.etcd or self.directory is None:
            raise ClusterError("only a started cluster with membership = 'etcd' grows")
        metrics = "metrics_address" not in self.settings
        node = self._add_process(
            f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}" if metrics else ""
        )
        self._write_secret()
        try:
            self._spawn(node)
            self._wait_ready(timeout)
        finally:
            self._forget_secret()
        return node

    def _spawn(self, node: NodeProcess) -> None:
        assert self.directory is not None
        assert self.config_path is not None
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(self.directory / f"notify{node.node}"),
            **(
                {"FABRICD_LISTEN": node.address, "FABRICD_NODE_NAME": f"node{node.node}"}
                if self.etcd
                else {"FABRICD_NODE_ID": str(node.node)}
            ),
            "FABRICD_SOCKET": node.socket_path,
            **({"FABRICD_METRICS_ADDRESS": node.metrics_address} if node.metrics_address else {}),
            **self.node_env.get(node.node, {}),
        }
        command = [
            *self.wrappers.get(node.node, []),
            *(sys.executable, "-m", "fabricd.cli.daemon", "--config", str(self.config_path)),
        ]
        with open(node.log_path, "ab") as log:
            node.process = spawn_tied(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
            )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(node.ready for node in self.nodes):
            for node in self.nodes:
                self._read_notify(node)
                assert node.process is not None
                if not node.ready and node.process.poll() is not None:
                    raise ClusterError(
                        f"node {node.node} exited with status {node.process.returncode}:\n"
                        + node.log_tail()
                    )
            if time.monotonic() > deadline:
                late = [n for n in self.nodes if not n.ready]
                raise ClusterError(
                    f"node {late[0].node} not ready after {timeout}s:\n" + late[0].log_tail()
                )
            time.sleep(0.01)

    def _read_notify(self, node: NodeProcess) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                message = node.notify.recv(4096).decode(errors="replace")
                if "READY=1" in message.splitlines():
                    node.ready = True

    def wait_connected(self, timeout: float = 30.0) -> None:
        """Wait until every daemon sees every other one up.

        Raises:
            ClusterError: the mesh did not form in time.
        """
        from fabricd.client import connect
        from fabricd.errors import DaemonUnavailable, Timeout

        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                # (a loaded machine may take longer than a call's default: the wait's deadline
                # bounds every call, and a daemon too busy to answer is asked again)
                left = max(1.0, deadline - time.monotonic())
                try:
                    with connect(socket_path=node.socket_path, timeout=left) as client:
                        states = [p["state"] for p in client.status(timeout=left)["peers"]]
                except (DaemonUnavailable, Timeout) as exc:
                    states = [f"unknown ({exc})"]
                if len(states) >= len(self.nodes) - 1 and all(s == "up" for s in states):
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"node {node.node} sees peers {states} after {timeout}s")
                time.sleep(0.05)

    def restart(self, node: int, timeout: float = 30.0) -> None:
        """Start a node again after it exited or was killed (a new incarnation)."""
        process = self.nodes[node].process
        if process is not None and process.poll() is None:
            raise ClusterError(f"node {node} is still running")
        self.nodes[node].ready = False
        self._write_secret()
        try:
            self._spawn(self.nodes[node])
            self._wait_ready(timeout)
        finally:
            self._forget_secret()

    @property
    def secret(self) -> bytes:
        """The cluster's shared secret (for tests that play a peer)."""
        return self._secret.encode()

    def _write_secret(self) -> Path:
        """Write the secret where the config says, 0600 from its first byte."""
        assert self.directory is not None
        if not self._secret:
            self._secret = secrets.token_hex(32)
        path = self.directory / "secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self._secret)
        return path

    def _forget_secret(self) -> None:
        """Remove the secret file once every daemon has read it (each reads it at start; a
        SIGHUP later finds it gone and keeps the secret it read): a launcher killed with
        SIGKILL then leaves no secret behind, only its daemons' sockets and logs, which the
        next launcher removes."""
        assert self.directory is not None
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "secret").unlink()

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one daemon (for failure tests)."""
        process = self.nodes[node].process
        if process is not None and process.poll() is None:
            process.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> dict[int, int]:
        """SIGTERM every daemon, wait for them, remove the directory.

        A daemon still running after ``timeout`` seconds is killed with SIGKILL.

        Returns:
            each started node's exit status, as :attr:`subprocess.Popen.returncode` has it:
            negative for the number of the signal that ended it.
        """
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        statuses: dict[int, int] = {}
        for node in self.nodes:
            if node.process is not None:
                try:
                    statuses[node.node] = node.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    statuses[node.node] = node.process.wait()
            node.notify.close()  # a node never started has one too
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        return statuses

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


#: what the name of every cluster's directory starts with, followed by
#: ``<pid>-<start>-<pid namespace>-``
DIRECTORY_PREFIX = "fabricd-cluster-"
_DIRECTORY_NAME = re.compile(re.escape(DIRECTORY_PREFIX) + r"(\d+)-(\d+)-(\d+)-([^/]+)")


def _directory_prefix() -> str:
    """The prefix of this process's cluster directories: its pid, when it started, and where.

    The name itself says who made the directory, so there is no moment at which a directory
    exists without saying so (as there would be between creating it and writing a marker file
    into it), and the start time tells this process apart from a later one given the same pid.
    The pid namespace says which processes the pid is one of: a container may share ``/tmp``
    with its host, and there the same pid names two different processes.
    """
    pid = os.getpid()
    return f"{DIRECTORY_PREFIX}{pid}-{_started(pid)}-{_pid_namespace()}-"


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), or 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if it has exited.

    A zombie counts as exited: it has died, and only waits for its parent to collect its status.
    """
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or parentheses
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def remove_leftovers(root: Path | None = None) -> list[Path]:
    """Remove the cluster directories under ``root`` that a killed launcher left behind.

    Only a directory owned by this user, named by :func:`_directory_prefix`, whose launcher
    process has exited is removed; its daemons died with that launcher (:func:`spawn_tied`).
    Anything else, a running launcher's directory above all, is left alone.  Launchers are
    told apart by pid and start time, which only means something in the pid namespace that
    made the directory: one made in another (a container sharing ``/tmp``, or its host) is
    left for a clean-up there.

    Args:
        root: where to look; default: the temporary directory (``$TMPDIR``, else ``/tmp``).

    Returns:
        the directories removed.
    """
    removed: list[Path] = []
    for entry, running in _cluster_directories(root):
        if running:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def _cluster_directories(root: Path | None) -> Iterator[tuple[os.DirEntry[str], bool]]:
    """This user's cluster directories under ``root`` made in this pid namespace (never through
    a symlink), by name, each with whether its launcher is still running."""
    namespace = _pid_namespace()
    with os.scandir(root or tempfile.gettempdir()) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        match = _DIRECTORY_NAME.fullmatch(entry.name)
        if match is None or int(match[3]) != namespace:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # another launcher's clean-up removed it first
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        yield entry, _started(int(match[1])) == int(match[2])


def running_clusters(root: Path | None = None) -> list[list[str]]:
    """The client sockets of this user's local clusters whose launcher is running.

    What ``fabricctl top --all`` watches.  Only directories named by :func:`_directory_prefix`
    in this pid namespace, owned by this user, whose launcher is alive count.

    Args:
        root: where to look; default: the temporary directory.

    Returns:
        per cluster (by directory name), its daemons' socket paths in node order.
    """
    found: list[list[str]] = []
    for entry, running in _cluster_directories(root):
        if not running:
            continue  # its launcher is gone: nothing serves there
        numbered = [
            (int(m[1]), path)
            for path in Path(entry.path).glob("node*.sock")
            if (m := re.fullmatch(r"node(\d+)\.sock", path.name))
        ]
        if numbered:
            found.append([str(path) for _, path in sorted(numbered)])
    return found


def cluster_name(path: str | os.PathLike[str]) -> str | None:
    """The short name of the local cluster whose directory is ``path`` or holds it (a socket),
    or None for a path of no local cluster.

    The name is ``<launcher pid>-<suffix>``: the pid of the process that started the cluster
    (``fabricctl local-cluster``: what stops it) and the directory's random suffix, which tells
    apart clusters one process started.  ``fabricctl top --all`` shows it in its ``cluster``
    column, and ``local-cluster`` says it when it starts.
    """
    for part in (Path(path), *Path(path).parents):
        match = _DIRECTORY_NAME.fullmatch(part.name)
        if match is not None:
            return f"{match[1]}-{match[4]}"
    return None


def spawn_tied(command: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``command`` as a process that the kernel kills (SIGKILL) when this process dies.

    Every daemon of a local cluster is started this way, so a launcher that cannot stop its
    cluster (killed with SIGKILL, crashed) leaves no daemon running.  Of the two ways to tie a
    child's life to its parent's, this is the one that needs nothing from the child:

    - ``prctl(PR_SET_PDEATHSIG)``, used here, is done by the kernel.  It kills a daemon that is
      still importing, whose event loop is stuck, or that is stopped by SIGSTOP.
    - A pipe whose write end only the launcher holds would tell a daemon of the launcher's death
      by an end of file, but only a daemon whose event loop runs and watches the pipe.

    The parent-death signal has two traps, both closed here.  It fires when the *thread* that
    forked the child exits, not the process: a cluster started from a short-lived thread would
    lose its daemons with that thread, so every child is forked by one thread that lives as long
    as the process (:class:`_ForkThread`).  And a launcher could die between the fork and the
    ``prctl``: the child then checks that its parent is still the launcher, and exits if not.

    Args:
        command: the program and its arguments.
        popen: keyword arguments for :class:`subprocess.Popen` (not ``preexec_fn``).
    """
    hook = _die_with(os.getpid())
    return _FORK_THREAD.run(lambda: subprocess.Popen(command, preexec_fn=hook, **popen))


@functools.cache
def _prctl() -> Callable[..., int]:
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


#: prctl(2) option: the signal a process gets when its parent (thread) dies
_PR_SET_PDEATHSIG = 1


def _die_with(launcher: int) -> Callable[[], None]:
    """The hook a child runs between fork and exec: die when process ``launcher`` does.

    prctl is looked up now, in the parent, so that the child only calls it: between a fork and
    an exec a child should do as little as it can.
    """
    prctl = _prctl()

    def hook() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


class _ForkThread:
    """One daemon thread, started on first use, that runs every fork of :func:`spawn_tied`.

    A daemon thread lives until the process exits, so the parent-death signal of the children
    it forks fires exactly when the launcher process dies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, job: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """Run ``job`` on the fork thread and return its result (or raise its exception)."""
        with self._lock:
            # after os.fork() a child process has no fork thread, only the parent's object
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="fabricd-fork", daemon=True
                )
                self._thread.start()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((job, future))
        try:
            return future.result()
        except BaseException:
            # the caller gives up (a signal handler raised while it waited, say): a job that
            # has not begun never runs, and a child it starts anyway is killed, since nobody
            # would ever stop it
            if not future.cancel():
                future.add_done_callback(_kill_unwanted)
            raise

    def _serve(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it began
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)


def _kill_unwanted(future: Future[subprocess.Popen[bytes]]) -> None:
    """Kill and reap the child a fork job started for a caller that stopped waiting for it."""
    if future.cancelled() or future.exception() is not None:
        return
    process = future.result()
    process.kill()
    process.wait()


_FORK_THREAD = _ForkThread()


def _free_port() -> int:
    """A port that is free now and below the kernel's ephemeral range.

    A port the kernel handed out for ``bind(0)`` comes from the ephemeral range, which every
    outgoing connection on the machine (the daemons' own dials included) also draws from, so
    it could be taken before the daemon binds it; ports below the range are never handed out.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ClusterError("found no free port on 127.0.0.1 below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def toml_value(value: Any) -> str:
    """``value`` (a bool, str, number or list of them) as a TOML value, for a written config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)
