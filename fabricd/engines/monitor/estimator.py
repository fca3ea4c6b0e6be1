"""How much one direction of this node's link can carry: a windowed maximum of delivery-rate
samples, less what the node moves now.

Rules: arithmetic on samples and a clock given as arguments; no sockets, no clock of its own.

Theory of operation (MLfabric §4 asks for "available network bandwidth", §7 reports it every
t_lag; the estimator is ours, since the paper does not say how its monitor measures):

* **capacity** is the largest delivery-rate sample of the last ``window`` seconds *of
  samples* -- BBR's bottleneck-bandwidth filter.  A delivery-rate sample (TCP_INFO's
  ``tcpi_delivery_rate``) is the rate at which one flight of data reached the peer: on a busy
  connection, what the path carries; on an idle one, less.  Taking the maximum keeps the
  underestimates of quiet moments from dragging the figure down, and the window lets a link
  whose capacity dropped (a tc rate changed, contending flows arrived) be believed lower once
  its older, higher samples have aged out.  The window is anchored at the *newest* sample, not
  at now: while nothing busy crosses the link there is no new evidence, and the last capacity
  seen is a better guess than none (an unknown link is reported at a large default, which
  would make a slow host look fast).
* only **busy** samples count: a sample that was not app-limited, or one taken while the link
  acknowledged at least :data:`BUSY_BYTES` since the previous reading.  Heartbeats alone would
  otherwise "measure" a 10 Gbit/s link at a few kB/s.
* **use** is what this node itself moved in that direction over the last interval (every
  link's byte counters), and **available** = capacity - use, but never below the share a new
  flow would get beside the busy ones (capacity / (busy flows + 1)): TCP shares a bottleneck
  about fairly, so a saturated link still gives a new transfer its share, and a figure of 0
  would tell a scheduler the transfer can never finish.
* the aggregate rate of the interval is a lower bound of capacity too (several flows may each
  get a part of the link, and each flow's samples then show only its part): capacity is never
  reported below it.
"""

from __future__ import annotations

from collections import deque
from typing import Final

#: bytes a link must have acknowledged since the previous reading for an app-limited sample
#: of it to count: a quarter MiB spans several congestion windows' worth on a LAN
BUSY_BYTES: Final = 256 * 1024
#: the most samples a window keeps (a monotonic queue holds only falling values, so it stays
#: far smaller unless samples keep falling; past this the oldest leaves early)
MAX_SAMPLES: Final = 1024


class WindowedMax:
    """The largest sample of the ``window`` seconds up to the newest sample.

    A monotonic queue: each sample evicts the smaller ones before it, so the front is the
    maximum and every operation is amortised O(1).
    """

    def __init__(self, window: float) -> None:
        if not window > 0:
            raise ValueError("window must be more than 0 seconds")
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()  #: (time, value), values falling
        self.newest: float | None = None  #: when the newest sample was taken

    def add(self, value: float, now: float) -> None:
        """Take a sample of ``value`` (>= 0) at ``now`` (never before an earlier sample's)."""
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((now, value))
        self.newest = now
        while samples[0][0] < now - self.window or len(samples) > MAX_SAMPLES:
            samples.popleft()

    @property
    def value(self) -> float | None:
        """The maximum of the window; ``None`` before the first sample."""
        return self._samples[0][1] if self._samples else None

    def __len__(self) -> int:
        return len(self._samples)


class Direction:
    """One direction (up or down) of this node's link: capacity, use, available."""

    def __init__(self, window: float) -> None:
        self.capacity_samples = WindowedMax(window)
        self.use = 0.0  #: bytes/s this node moved this way over the last interval
        self.flows = 0  #: peers this way that were busy over the last interval

    def sample(self, rate: float, now: float) -> None:
        """A busy delivery-rate sample of a path this way, bytes/s."""
        if rate > 0:
            self.capacity_samples.add(rate, now)

    def measured(self, use: float, flows: int) -> None:
        """What the node moved this way over the last interval, and over how many busy flows."""
        self.use, self.flows = max(0.0, use), max(0, flows)

    @property
    def capacity(self) -> float | None:
        """The capacity estimate; ``None``: no busy sample yet (unknown)."""
        best = self.capacity_samples.value
        return None if best is None else max(best, self.use)

    @property
    def available(self) -> float | None:
        """Capacity less use, at least a new flow's fair share; ``None``: unknown."""
        capacity = self.capacity
        if capacity is None:
            return None
        flows = max(self.flows, 1 if self.use > 0 else 0)  # any use is at least one flow
        return max(capacity - self.use, capacity / (flows + 1))
