"""The node's status counters: every part's counters merged into one table, by name.

``fabricctl status`` shows one ``counters`` table and the metrics endpoint exports the same
table as ``fabricd_status_counters_total{counter=NAME}``; both are built here, so they cannot
disagree.  The parts are the client socket's counters, the segment table's, and each service's
``statistics()["counters"]``.

The choice: a name two parts both count is **summed**, never overwritten.  ``bytes_sent`` is
counted by the p2p service (message payloads) and by the collectives service (its data frames);
merging them with ``dict.update`` let the later one replace the earlier, and after a 40 MiB
transfer ``status`` said ``bytes_sent 0``.  Naming the counters per service instead would have
renamed numbers users read and alert on; summing keeps every name and makes each one mean "on
this node, in all": ``bytes_sent`` is every message and collective payload byte this node sent
to peers (the per-service figures stay in the services' own series, and ``update_bytes_sent``
and ``ps_bytes_sent`` keep their names).

``ops_completed`` and ``ops_failed`` are the node's operations of every service, as the
``fabricd_operations_completed_total`` and ``fabricd_operations_failed_total`` series count them
(an operation is a request a service took on; one refused outright is not one).  Only the p2p
service counts them among its own counters; for a service that does not, they are taken from
its :class:`~fabricd.daemon.metrics.OperationStats`, so a failed collective counts too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from fabricd.daemon.metrics import OperationStats

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from fabricd.daemon.service import Service
    from fabricd.wire import Meta

#: the counters every service's operations add to, taken from its OperationStats unless the
#: service counts them itself
OPERATION_COUNTERS: Final = ("ops_completed", "ops_failed")


def service_counters(service: Service, stats: Meta) -> dict[str, int]:
    """``service``'s counters from its ``statistics()`` (``stats``), with its operations'
    :data:`OPERATION_COUNTERS` added where it does not count them itself."""
    counters: dict[str, int] = dict(stats.get("counters", {}))
    operations = getattr(service, "operations", None)
    if isinstance(operations, OperationStats):
        if "ops_completed" not in counters:
            counters["ops_completed"] = sum(operations.completed_by_kind.values())
        if "ops_failed" not in counters:
            counters["ops_failed"] = sum(operations.failed_by_kind.values())
    return counters


def merge(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """One table of ``parts``' counters: a name in several parts gets the sum of their values."""
    total: dict[str, int] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total.get(name, 0) + value
    return total
