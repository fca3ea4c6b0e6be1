"""The node's status counters: a name several parts count is their sum (issue 27, item 1)."""

from __future__ import annotations

from fabricd.daemon import status_counters
from fabricd.daemon.metrics import OperationStats
from fabricd.daemon.service import BaseService


class _Counting(BaseService):
    """A service with operations, counting them itself or not."""

    def __init__(self, own: dict[str, int]) -> None:
        self.operations = OperationStats("x", kinds=["a"])
        self.own = own

    def statistics(self) -> dict[str, object]:
        return {"counters": dict(self.own)}


def test_a_name_several_parts_count_is_their_sum_not_the_last() -> None:
    merged = status_counters.merge(
        [{"bytes_sent": 40 << 20, "bytes_received": 3}, {"bytes_sent": 0, "rounds": 2}, {}]
    )
    assert merged == {"bytes_sent": 40 << 20, "bytes_received": 3, "rounds": 2}


def test_a_service_that_does_not_count_its_operations_gets_them_from_its_stats() -> None:
    quiet = _Counting({"rounds": 1})
    quiet.operations.ended("a", 0, 0.1, None)
    for _ in range(3):
        quiet.operations.ended("a", 0, 0.1, "usage")
    counters = status_counters.service_counters(quiet, quiet.statistics())
    assert counters == {"rounds": 1, "ops_completed": 1, "ops_failed": 3}
    # one that counts them itself (p2p) keeps its own figures: they are not counted twice
    own = _Counting({"ops_completed": 5, "ops_failed": 2})
    own.operations.ended("a", 0, 0.1, "usage")
    assert status_counters.service_counters(own, own.statistics()) == own.own
    merged = status_counters.merge(
        status_counters.service_counters(s, s.statistics()) for s in (quiet, own)
    )
    assert (merged["ops_completed"], merged["ops_failed"]) == (6, 5)


def test_a_service_without_operations_adds_none() -> None:
    plain = BaseService()
    assert status_counters.service_counters(plain, {"counters": {"peer_resets": 1}}) == {
        "peer_resets": 1
    }
    assert status_counters.service_counters(plain, {}) == {}
