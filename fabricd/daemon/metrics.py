"""The daemon's metrics: one registry per daemon, read when it is scraped.

Every number here already lives somewhere in the daemon (a transport's link counters, an
engine's ``statistics()``, the client socket's refusals); the registry does not keep a second
copy that the hot path would have to update.  A scrape (the HTTP endpoint,
:mod:`fabricd.daemon.metrics_http`) or ``status`` calls :meth:`MetricsRegistry.collect`, and
:class:`DaemonCollector` reads those counters at that moment and builds the Prometheus families.

Only what no counter holds yet is recorded as it happens, in plain Python objects the loop
updates for a few hundred nanoseconds: operations by kind and their latency
(:class:`OperationStats`, fed by the p2p service), peer frames by kind, client requests by op
and the loop's lag (:class:`NodeStats`, fed by the node), and the bytes of links that were
reset (:class:`LinkTotals`; a link's own counters die with it, and a Prometheus counter must
never go back).

Rules:

* one registry per daemon (never prometheus-client's global one: tests run several daemons in
  one process, and the exposition must say one daemon's numbers);
* everything is read and served on the daemon's event loop, so nothing here is shared with a
  thread and nothing needs a lock;
* engines never import this module or prometheus-client (``tests/unit/test_arrows.py``): a
  service reads its engine's counters and adds its own families through
  :meth:`~fabricd.daemon.service.Service.metrics`, built with :func:`counter`, :func:`gauge`
  and :class:`Histogram`;
* names follow Prometheus conventions: ``fabricd_`` prefix, base units (``_bytes``,
  ``_seconds``), ``_total`` on counters; label values come from small fixed sets (peer node
  numbers, channels, kinds, codes), never from job names or user input.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import TYPE_CHECKING, Final, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from fabricd.transports.base import LinkStatistics

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence

    from prometheus_client.metrics_core import Metric

    from fabricd.engines.link.handshake import Channel

#: upper bounds (seconds) of the operation latency buckets: a 4 KiB message on loopback takes
#: about 100 µs, a 256 MiB one about a second
LATENCY_BUCKETS: Final = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: upper bounds (seconds) of the loop-lag buckets: how late a timer fired
LAG_BUCKETS: Final = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
#: operation size classes: (largest size in bytes, label); the last class has no bound
SIZE_CLASSES: Final = (
    (4 << 10, "0-4KiB"),
    (64 << 10, "4-64KiB"),
    (1 << 20, "64KiB-1MiB"),
    (16 << 20, "1-16MiB"),
)
LARGEST_CLASS: Final = "16MiB+"
_SIZE_BOUNDS: Final = tuple(bound for bound, _ in SIZE_CLASSES)
_SIZE_NAMES: Final = (*(name for _, name in SIZE_CLASSES), LARGEST_CLASS)


def size_class(nbytes: int) -> str:
    """The size-class label of an operation of ``nbytes`` (``"0-4KiB"`` … ``"16MiB+"``)."""
    return _SIZE_NAMES[bisect.bisect_left(_SIZE_BOUNDS, nbytes)]


class Histogram:
    """Counts of observations per bucket and their sum: what Prometheus calls a histogram.

    Cheaper than prometheus-client's own (no lock, no per-bucket objects): an observation is a
    bisect and two additions on the loop.  ``bounds`` are the upper bounds, ascending; one more
    bucket, +Inf, takes the rest.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (a value equal to a bound is in that bound's bucket)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as the exposition format wants them, +Inf last."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


class OperationStats:
    """Operations of one service by kind (``send``, ``recv``, …): started, ended, latency.

    The service calls :meth:`started` when a client's request becomes an operation and
    :meth:`ended` when it is answered; an operation whose client left before it ended is
    :meth:`abandoned`.  So, per kind, started = completed + failed + abandoned + pending.
    """

    def __init__(self, service: str, kinds: Iterable[str] = ()) -> None:
        self.service = service
        # the kinds known from the start show 0 before their first operation, so a rate()
        # over the first one sees it
        self.started_by_kind: Counter[str] = Counter(dict.fromkeys(kinds, 0))
        self.completed_by_kind: Counter[str] = Counter(dict.fromkeys(kinds, 0))
        self.failed_by_kind: Counter[tuple[str, str]] = Counter()  #: by (kind, error code)
        self.abandoned_by_kind: Counter[str] = Counter(dict.fromkeys(kinds, 0))
        #: completed operations' latency (request to reply) by kind, then size class index
        self._latency: dict[str, list[Histogram | None]] = {}
        #: operations pending longer than ``stall_after`` now; set by whoever finds them
        self.stalled = 0

    def started(self, kind: str) -> None:
        self.started_by_kind[kind] += 1

    def ended(self, kind: str, nbytes: int, seconds: float, code: str | None) -> None:
        """An operation was answered: completed (``code`` None, its latency observed) or failed."""
        if code is not None:
            self.failed_by_kind[kind, code] += 1
            return
        # on every operation's reply: about 0.5 µs, so kept to lookups and additions
        self.completed_by_kind[kind] += 1
        row = self._latency.get(kind)
        if row is None:
            row = self._latency[kind] = [None] * len(_SIZE_NAMES)
        size = bisect.bisect_left(_SIZE_BOUNDS, nbytes)
        histogram = row[size]
        if histogram is None:
            histogram = row[size] = Histogram(LATENCY_BUCKETS)
        histogram.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        histogram.sum += seconds

    def latency(self) -> Iterator[tuple[str, str, Histogram]]:
        """(kind, size class, histogram) of every kind and size class observed."""
        for kind, row in sorted(self._latency.items()):
            for size, histogram in zip(_SIZE_NAMES, row, strict=True):
                if histogram is not None:
                    yield kind, size, histogram

    def abandoned(self, kind: str, count: int = 1) -> None:
        self.abandoned_by_kind[kind] += count

    def set_stalled(self, count: int) -> None:
        """How many operations are stalled now (``fabricd_stalled_operations``)."""
        self.stalled = count

    def families(self, pending: int) -> Iterator[Metric]:
        """The operation families, with ``pending`` operations open now."""
        labels = {"service": self.service}
        yield counter(
            "fabricd_operations_started",
            "Operations clients asked for, by kind.",
            ((labels | {"kind": k}, n) for k, n in self.started_by_kind.items()),
        )
        yield counter(
            "fabricd_operations_completed",
            "Operations that completed successfully, by kind.",
            ((labels | {"kind": k}, n) for k, n in self.completed_by_kind.items()),
        )
        yield counter(
            "fabricd_operations_failed",
            "Operations that failed, by kind and error code.",
            ((labels | {"kind": k, "code": c}, n) for (k, c), n in self.failed_by_kind.items()),
        )
        yield counter(
            "fabricd_operations_abandoned",
            "Operations whose client left before they ended, by kind.",
            ((labels | {"kind": k}, n) for k, n in self.abandoned_by_kind.items()),
        )
        yield gauge("fabricd_operations_pending", "Operations open now.", [(labels, pending)])
        yield gauge(
            "fabricd_stalled_operations",
            "Operations pending longer than stall_after now.",
            [(labels, self.stalled)],
        )
        yield histogram(
            "fabricd_operation_latency_seconds",
            "Time from a client's request to its successful reply, by kind and size class.",
            ((labels | {"kind": k, "size": s}, h) for k, s, h in self.latency()),
        )


class LinkTotals:
    """Each peer's bytes and frames per channel, over every link it ever had.

    A link's counters start at 0 and die with it; when the node drops a link it folds the
    link's last counters in here (:meth:`retire`), so the totals only grow.
    """

    def __init__(self) -> None:
        self._retired: dict[tuple[int, Channel], LinkStatistics] = {}

    def retire(self, node: int, channel: Channel, stats: LinkStatistics) -> None:
        old = self._retired.get((node, channel))
        self._retired[node, channel] = stats if old is None else _add(old, stats)

    def totals(
        self, current: Mapping[tuple[int, Channel], LinkStatistics]
    ) -> dict[tuple[int, Channel], LinkStatistics]:
        """Retired plus ``current`` (the live links' counters now), by (node, channel)."""
        out = dict(self._retired)
        for key, stats in current.items():
            old = out.get(key)
            out[key] = stats if old is None else _add(old, stats)
        return out


def _add(a: LinkStatistics, b: LinkStatistics) -> LinkStatistics:
    return LinkStatistics(
        frames_sent=a.frames_sent + b.frames_sent,
        frames_received=a.frames_received + b.frames_received,
        bytes_sent=a.bytes_sent + b.bytes_sent,
        bytes_received=a.bytes_received + b.bytes_received,
    )


class NodeStats:
    """What the node records as it happens: peer frames by kind, requests by op, loop lag."""

    def __init__(self) -> None:
        #: authenticated peer frames by kind (a list indexed by kind: an IntEnum hashes through
        #: Python code, which made a Counter cost 3x as much on every frame)
        self.frames_received = [0] * 256
        self.requests: Counter[str] = Counter()  #: client requests by op
        self.loop_lag = Histogram(LAG_BUCKETS)
        self.links = LinkTotals()


# -- building families --------------------------------------------------------------------
def counter(
    name: str, doc: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> CounterMetricFamily:
    """A counter family ``name`` (without ``_total``: the exposition adds it) from samples."""
    return _fill(CounterMetricFamily, name, doc, samples)


def gauge(
    name: str, doc: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> GaugeMetricFamily:
    """A gauge family ``name`` from (labels, value) samples."""
    return _fill(GaugeMetricFamily, name, doc, samples)


def histogram(
    name: str, doc: str, samples: Iterable[tuple[Mapping[str, str], Histogram]]
) -> HistogramMetricFamily:
    """A histogram family ``name`` from (labels, :class:`Histogram`) samples."""
    items = list(samples)
    family = HistogramMetricFamily(name, doc, labels=_label_names(items))
    for labels, h in items:
        family.add_metric(list(labels.values()), h.cumulative(), h.sum)
    return family


_F = TypeVar("_F", CounterMetricFamily, GaugeMetricFamily)


def _fill(
    kind: type[_F], name: str, doc: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> _F:
    items = list(samples)
    family = kind(name, doc, labels=_label_names(items))
    for labels, value in items:
        family.add_metric(list(labels.values()), value)
    return family


def _label_names(items: Sequence[tuple[Mapping[str, str], object]]) -> list[str]:
    return list(items[0][0]) if items else []


class MetricsRegistry:
    """One daemon's registry: its collectors, the exposition, and a JSON snapshot for status.

    Args:
        collectors: what to read at each scrape (the node's :class:`DaemonCollector`).
    """

    def __init__(self, collectors: Iterable[object] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in collectors:
            self.register(collector)

    def register(self, collector: object) -> None:
        """Read ``collector`` (anything with ``collect() -> Iterable[Metric]``) at each scrape."""
        self.registry.register(collector)  # type: ignore[arg-type]

    def exposition(self) -> bytes:
        """The Prometheus text exposition of everything, now."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        """Every sample now, JSON-ready: sample name -> [{"labels", "value"}].

        The same numbers the endpoint serves (``fabricctl status --json``, ``fabricctl top``).
        """
        out: dict[str, list[dict[str, object]]] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                value = int(sample.value) if float(sample.value).is_integer() else sample.value
                out.setdefault(sample.name, []).append({"labels": sample.labels, "value": value})
        return out
