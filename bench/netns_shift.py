"""A time-varying network condition on a test net: the slow link moves from host to host.

MLfabric §7.1's conditions N2/N3 change the bandwidth of some hosts' links over time.  A
:class:`Shift` stands for that on a :class:`tests.network.netns.TestNet` whose links are
``tbf``-shaped: one host of ``hosts`` is slowed to ``slow`` Mbit/s, the others run at ``fast``,
and every ``period`` seconds the slowdown moves to the next host of ``hosts`` (in order,
cyclically; :meth:`TestNet.set_rate`, ``tc qdisc change``).  Meanwhile, once every
``every`` seconds (``period`` should be a multiple of it: the slowdown moves at the first
tick at or past each period's end), it reads what a daemon's network monitor believes
(``observe``: the ``network`` table of its status) and keeps it beside the true rates of that
instant (:class:`Sample`): the daemons run with no configured rates in this condition, so those
measured figures are what MLfabric's scheduler plans with (docs/mlfabric.md, "The network
monitor").

Used as a context manager around one mode's training: entering puts the slowdown on the
first host and starts the clock; leaving stops the thread (bounded join) and keeps the
samples in :attr:`Shift.samples`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class Rated(Protocol):
    """What a :class:`Shift` needs of a net: a way to set a shaped link's rate."""

    def set_rate(self, node: int, mbit: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading: when (s since the shift began), the true rates (Mbit/s, each way, by
    node: the shifted hosts only) and the monitor's table (its status rows)."""

    at: float
    true: dict[int, float]
    rows: list[dict[str, Any]]

    def measured(self, node: int) -> tuple[float, float, str]:
        """Node ``node``'s available uplink and downlink as the monitor reported them
        (Mbit/s) and where they came from (``measured``, ``default``...)."""
        row = next(r for r in self.rows if r["node"] == node)
        return row["up"] * 8 / 1e6, row["down"] * 8 / 1e6, str(row["source"])


@dataclass
class Shift:
    """Move a ``slow`` Mbit/s link around ``hosts`` every ``period`` s; sample ``observe``."""

    net: Rated
    hosts: Sequence[int]
    fast: float
    slow: float
    period: float
    observe: Callable[[], list[dict[str, Any]]]
    every: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def slow_host(self, at: float) -> int:
        """The host slowed ``at`` seconds after the shift began."""
        periods = math.floor(at / self.period + 1e-9)  # 3 x 0.1 s is 0.3 s, not 0.2999...
        return self.hosts[periods % len(self.hosts)]

    def rates(self, at: float) -> dict[int, float]:
        """Every shifted host's true rate ``at`` seconds after the shift began."""
        slow = self.slow_host(at)
        return {host: self.slow if host == slow else self.fast for host in self.hosts}

    def _apply(self, rates: dict[int, float]) -> None:
        for host, mbit in rates.items():
            self.net.set_rate(host, mbit)

    def __enter__(self) -> Shift:
        self._apply(self.rates(0.0))
        self._thread = threading.Thread(target=self._run, args=(time.monotonic(),), daemon=True)
        self._thread.start()
        return self

    def _run(self, began: float) -> None:
        """Until stopped: at each multiple of ``every`` take a sample, at each multiple of
        ``period`` move the slowdown (the sample first: it shows the figures just before)."""
        ticks, current = 1, self.rates(0.0)
        try:
            while not self._stop.wait(max(0.0, began + ticks * self.every - time.monotonic())):
                at = time.monotonic() - began
                self.samples.append(Sample(at, current, self.observe()))
                wanted = self.rates(ticks * self.every)
                if wanted != current:
                    self._apply(wanted)
                    current = wanted
                ticks += 1
        except BaseException as exc:  # kept for the caller: a failed shift spoils the run
            self.errors.append(exc)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
