"""Private test networks: a bridge and N network namespaces joined to it by veth pairs.

A :class:`TestNet` is one switch namespace holding a bridge, and one namespace per node whose
``eth0`` is a veth into that bridge, with an address in :data:`SUBNET`.  The bridge and the
switch-side ends live in a namespace of their own, so nothing is added to the machine's own
network namespace: no route, no address, no interface; the test subnet can only reach the
namespaces of the same net, and deleting the namespaces removes every interface with them.

Names are ``fdt-<pid in base 36>-<net>``-based, unique per test process and per net, so parallel
runs never collide; :func:`remove_leftovers` deletes the namespaces of test processes that died
without tearing down (a run killed by SIGKILL or pytest-timeout's signal).

Faults, done from the switch side: :meth:`TestNet.link_down` / :meth:`TestNet.link_up` (a
partition: the bridge port loses carrier, frames are dropped, TCP sees silence, not a reset),
and :meth:`TestNet.shape` (``tbf`` on both ends of a node's link; this kernel has no netem), whose
rate :meth:`TestNet.set_rate` changes in place (a time-varying network).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

#: what every namespace name of these tests starts with
PREFIX = "fdt"
#: the private test subnet: node i is ``10.231.77.(i + 1)``; it exists only inside the
#: namespaces of one net, so two nets (or the machine) using it never meet
SUBNET = "10.231.77"
_NAME = re.compile(re.escape(PREFIX) + r"-([0-9a-z]+)-\d+(?:s|h\d+)")
_nets = itertools.count()


class NetError(RuntimeError):
    """An ``ip``/``tc`` command failed (the message carries its stderr)."""


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = digits[digit] + text
        if number == 0:
            return text


def run(*command: str) -> str:
    """Run one command, return its stdout.

    Raises:
        NetError: it exited non-zero.
    """
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NetError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why these tests cannot run here (one line), or None if they can.

    They need root, ``ip`` and ``tc``, and a kernel that lets this process create a network
    namespace, a bridge, a veth pair and a ``tbf`` qdisc, and run a program in the namespace
    (``ip netns exec`` also needs a mount namespace): the check tries each once.
    """
    if os.geteuid() != 0:
        return "network namespace tests need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespace tests need `{tool}` (iproute2)"
    try:
        with TestNet(1) as net:
            net.shape(0, 100)
            run(*net.wrapper(0), sys.executable, "-c", "pass")
    except (NetError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces unavailable: {str(exc).splitlines()[0]}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces of test processes that have exited; return their names.

    A namespace whose process still runs (another test run, in parallel) is left alone.
    """
    removed = []
    listing = run("ip", "netns", "list")
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match[1], 36)):
            continue
        with contextlib.suppress(NetError):
            run("ip", "netns", "delete", name)
            removed.append(name)
    return removed


@dataclass
class TestNet:
    """A switch namespace with a bridge and ``size`` node namespaces; a context manager.

    Node ``i`` lives in namespace :meth:`namespace` ``(i)`` with address :meth:`address` ``(i)``
    on its ``eth0``; the bridge port facing it is ``v<i>`` in the switch namespace.
    """

    __test__ = False  # a fixture, not a test class

    size: int
    name: str = field(default="")
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"{PREFIX}-{_base36(os.getpid())}-{next(_nets)}"

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.name}s"

    def namespace(self, node: int) -> str:
        return f"{self.name}h{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def wrapper(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def start(self) -> None:
        """Create the namespaces, the bridge and the links; on failure undo what was made."""
        try:
            self._add(self.switch)
            run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for node in range(self.size):
                ns = self.namespace(node)
                self._add(ns)
                port = f"v{node}"
                run(
                    *("ip", "-n", self.switch, "link", "add", port, "type", "veth"),
                    *("peer", "name", "eth0", "netns", ns),
                )
                run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
                run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                run("ip", "-n", ns, "link", "set", "eth0", "up")
                run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.stop()
            raise

    def _add(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.created.append(ns)

    def stop(self) -> None:
        """Delete every namespace this net made (their interfaces go with them)."""
        while self.created:
            ns = self.created.pop()
            with contextlib.suppress(NetError, subprocess.TimeoutExpired):
                run("ip", "netns", "delete", ns)

    def __enter__(self) -> TestNet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults -----------------------------------------------------------------------------
    def link_down(self, node: int) -> None:
        """Cut node ``node`` off: its bridge port goes down, every frame to or from it is lost."""
        run("ip", "-n", self.switch, "link", "set", f"v{node}", "down")

    def link_up(self, node: int) -> None:
        """Heal the cut of :meth:`link_down`."""
        run("ip", "-n", self.switch, "link", "set", f"v{node}", "up")

    def shape(self, node: int, mbit: float) -> None:
        """Limit node ``node``'s link to ``mbit`` Mbit/s each way (``tbf`` on both veth ends).

        The bucket holds 128 KiB (a few GSO segments; tbf splits larger ones) and at most
        20 ms of queue, so a control frame never waits long behind bulk data.
        """
        tbf = ("root", "tbf", "rate", f"{mbit}mbit", "burst", "128kb", "latency", "20ms")
        run("ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"v{node}", *tbf)
        run(
            "ip",
            "netns",
            "exec",
            self.namespace(node),
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            *tbf,
        )

    def set_rate(self, node: int, mbit: float) -> None:
        """Change the rate of a link :meth:`shape` shaped to ``mbit`` Mbit/s, each way, in place
        (``tc qdisc change``: the qdisc and its queue stay; only the rate moves), so a running
        experiment can vary a host's bandwidth over time.

        Raises:
            NetError: the link is not shaped (``tc`` has no ``tbf`` to change).
        """
        tbf = ("root", "tbf", "rate", f"{mbit}mbit", "burst", "128kb", "latency", "20ms")
        for ns, dev in ((self.switch, f"v{node}"), (self.namespace(node), "eth0")):
            run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, *tbf)

    def unshape(self, node: int) -> None:
        """Remove the shaping of :meth:`shape`."""
        for ns, dev in ((self.switch, f"v{node}"), (self.namespace(node), "eth0")):
            with contextlib.suppress(NetError):
                run("ip", "netns", "exec", ns, "tc", "qdisc", "delete", "dev", dev, "root")

    def qdisc_stats(self, node: int) -> str:
        """``tc -s qdisc`` of node ``node``'s own end (for messages)."""
        return run(
            "ip", "netns", "exec", self.namespace(node), "tc", "-s", "qdisc", "show", "dev", "eth0"
        )
