"""The virtual network of the MLfabric experiment (bench/mlfabric.py): a star of hosts whose NIC
rates change over time (MLfabric §7, "network background traffic"), and a fluid model of the
transfers on it.

Rules: this module holds what the links can carry at each instant (:class:`Trace`) and moves
bytes over them (:class:`Fluid`): every active transfer crosses its source's uplink and its
destination's downlink (a congestion-free core, as MLfabric §4-§5 assumes) and the transfers
share the links max-min fairly, as long-lived TCP flows roughly do.  A transfer from a host to
itself crosses no link and ends the instant it starts.  There is no clock: the caller says
what time it is (:meth:`Fluid.advance`) and asks when the next thing happens
(:meth:`Fluid.next_time`).

Theory of operation.  §7: "for every T (= 5) seconds the NIC rate is changed to a value from
the set {1, 2.5, 3.3, 5, 10} Gbps with probability p"; "incoming and outgoing links are
treated independently".  A :class:`Trace` draws each host's up and down rate for each period
from a generator seeded by (seed, period), so a period's rates do not depend on which run
asked first: every strategy of a setting sees the same network.  Rates are scaled ÷100
(:data:`SCALE`): 10 Gbit/s becomes 100 Mbit/s, so a 1 MB model stands for ResNet-50's 100 MB
and every transfer takes the time it took in the paper.  Hosts listed as ``fixed`` keep one
rate (the server's dedicated machine, §7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

#: §7's NIC rates, Gbit/s
RATES_GBPS: Final = (1.0, 2.5, 3.3, 5.0, 10.0)
#: the paper's rates are divided by this (bench/mlfabric.py's module docstring)
SCALE: Final = 100
#: bytes/s of one Gbit/s after scaling
GBPS: Final = 1e9 / 8 / SCALE
#: §7's network settings: the probability of each of :data:`RATES_GBPS`
NETWORKS: Final = {
    "N1": (0.0, 0.0, 0.0, 0.1, 0.9),
    "N2": (0.0, 0.1, 0.1, 0.1, 0.7),
    "N3": (0.5, 0.0, 0.0, 0.0, 0.5),
}
#: §7: seconds between changes of the NIC rates
PERIOD: Final = 5.0


class Trace:
    """Each host's uplink and downlink rate (bytes/s) over time (module docstring)."""

    def __init__(
        self,
        hosts: Sequence[int],
        probabilities: Sequence[float],
        *,
        seed: int,
        fixed: Mapping[int, float | tuple[float, float]] | None = None,
        period: float = PERIOD,
    ) -> None:
        self.hosts = list(hosts)
        self.probabilities = np.asarray(probabilities, dtype=np.float64)
        self.seed = seed
        self.fixed = dict(fixed or {})
        self.period = period
        self._rates = np.asarray(RATES_GBPS) * GBPS
        self._column = {h: k for k, h in enumerate(self.hosts)}
        self._periods: dict[int, np.ndarray] = {}

    def _period(self, k: int) -> np.ndarray:
        """Period ``k``'s rates: row 0 up, row 1 down, a column per host."""
        drawn = self._periods.get(k)
        if drawn is None:
            rng = np.random.default_rng([self.seed, k])
            picks = rng.choice(len(self._rates), size=(2, len(self.hosts)), p=self.probabilities)
            drawn = self._rates[picks]
            self._periods[k] = drawn
        return drawn

    def rate(self, host: int, t: float, *, up: bool) -> float:
        """``host``'s uplink (``up``) or downlink rate at time ``t`` (``t < 0``: at 0)."""
        if host in self.fixed:
            fixed = self.fixed[host]
            if isinstance(fixed, tuple):
                return fixed[0] if up else fixed[1]
            return fixed
        k = max(0, math.floor(t / self.period))
        return float(self._period(k)[0 if up else 1, self._column[host]])

    def next_change(self, t: float) -> float:
        """The first instant after ``t`` at which a rate may change."""
        return (math.floor(t / self.period) + 1) * self.period

    def bottleneck(self, hosts: Sequence[int], t: float) -> float:
        """The slowest of ``hosts``' uplinks and downlinks at ``t``."""
        return min(min(self.rate(h, t, up=True), self.rate(h, t, up=False)) for h in hosts)

    def carry(self, hosts: Sequence[int], nbytes: float, start: float) -> float:
        """When ``nbytes`` sent from ``start`` at the bottleneck rate of ``hosts``' links (a
        ring's pace: each step waits for its slowest link) are all sent."""
        t, left = start, nbytes
        while True:
            rate, until = self.bottleneck(hosts, t), self.next_change(t)
            if left <= rate * (until - t):
                return t + left / rate
            left -= rate * (until - t)
            t = until


@dataclass(slots=True)
class _Flow:
    src: int
    dst: int
    left: float  #: bytes still to send
    size: float
    done: Callable[[float], None]
    rate: float = 0.0


#: a flow with this share of its bytes (or fewer than a millionth of a byte) left is done
_FINISHED: Final = 1e-9


class Fluid:
    """Transfers sharing a star network's links max-min fairly (module docstring)."""

    def __init__(self, trace: Trace, *, now: float = 0.0) -> None:
        self.trace = trace
        self.now = now
        self._flows: dict[int, _Flow] = {}
        self._next_id = 0
        self.received: dict[int, float] = {}  #: bytes delivered, by destination host

    def start(self, src: int, dst: int, size: float, done: Callable[[float], None]) -> None:
        """Send ``size`` bytes from ``src`` to ``dst`` from now on; ``done(t)`` runs when the
        last byte arrives (at once, from here, for a transfer that crosses no link)."""
        if src == dst or size <= 0:
            done(self.now)
            return
        self._flows[self._next_id] = _Flow(src, dst, size, size, done)
        self._next_id += 1
        self._share()

    def next_time(self) -> float:
        """When the next flow ends or the next rate change comes, whichever is first."""
        if not self._flows:
            return math.inf
        ends = min(self.now + f.left / f.rate for f in self._flows.values())
        return min(ends, self.trace.next_change(self.now))

    def advance(self, now: float) -> None:
        """Move every flow's bytes up to ``now``; flows that finish call their ``done``."""
        if now < self.now:
            raise ValueError(f"time runs forward: {now} < {self.now}")
        if not self._flows:
            self.now = now
            return
        changed = math.floor(now / self.trace.period) != math.floor(self.now / self.trace.period)
        elapsed = now - self.now
        self.now = now
        finished: list[_Flow] = []
        for key in list(self._flows):
            flow = self._flows[key]
            flow.left -= flow.rate * elapsed
            if flow.left <= max(_FINISHED * flow.size, 1e-6):
                finished.append(self._flows.pop(key))
                self.received[flow.dst] = self.received.get(flow.dst, 0.0) + flow.size
        if finished or changed:
            self._share()
        for flow in finished:  # after sharing: a done() may start the next flow
            flow.done(now)

    def _share(self) -> None:
        """Max-min fair rates (progressive filling) at the current link rates."""
        flows = list(self._flows.values())
        links: dict[tuple[bool, int], list[_Flow]] = {}
        for flow in flows:
            links.setdefault((True, flow.src), []).append(flow)
            links.setdefault((False, flow.dst), []).append(flow)
        left = {(up, host): self.trace.rate(host, self.now, up=up) for up, host in links}
        frozen: set[int] = set()
        while len(frozen) < len(flows):
            best_key, best_share = None, math.inf
            for key, members in links.items():
                open_ = [f for f in members if id(f) not in frozen]
                if open_ and left[key] / len(open_) < best_share:
                    best_key, best_share = key, left[key] / len(open_)
            assert best_key is not None
            for flow in links[best_key]:
                if id(flow) in frozen:
                    continue
                flow.rate = best_share
                frozen.add(id(flow))
                for key in ((True, flow.src), (False, flow.dst)):
                    left[key] -= best_share
