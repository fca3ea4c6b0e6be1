"""The collective service's side of allgather and reduce-scatter on a fake host: a request
names two arrays (input, output), the daemon checks their sizes against the job's, and a call
that waits for its job's ranks views both again when it runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fabricd.daemon.service import Request
from fabricd.errors import UsageError
from tests.unit.test_collective_service_review import Segment, Table, client, join, service

NAME = "gathered"


def gather(svc: Any, session: Any, rid: int, kind: str, **fields: Any) -> None:
    """A ``kind`` request of ``session``: input segment 1, output segment 2 (float64)."""
    nbytes = session.segments[1].array.nbytes
    out = session.segments[2].array.nbytes
    meta = {"kind": kind, "name": NAME, "dtype": "float64", "seg": 1, "off": 0, "nbytes": nbytes}
    meta |= {"out_seg": 2, "out_off": 0, "out_nbytes": out} | fields
    svc.on_request(Request(session=session, id=rid, op="collective", meta=meta, fds=[]), 0.0)


def ranks(size: int, given: list[list[float]], out: int) -> list[Any]:
    sessions = [client(r, size, values) for r, values in enumerate(given)]
    for session in sessions:
        session.segments[2] = Segment([-1.0] * out)
    return sessions


def output(session: Any) -> list[float]:
    return list(session.segments[2].array)


def test_an_allgather_of_one_node_fills_every_ranks_output() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 2, (0, 0))
    a, b = ranks(2, [[1.0, 2.0], [3.0, 4.0]], 4)
    gather(svc, a, 1, "allgather")
    gather(svc, b, 2, "allgather")
    assert host.answered[1]["round"] == host.answered[2]["round"] == 0
    assert output(a) == output(b) == [1.0, 2.0, 3.0, 4.0]


def test_a_reduce_scatter_that_waited_for_its_ranks_views_both_arrays_again() -> None:
    table = Table()
    svc, host = service(table)
    a, b = ranks(2, [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]], 2)
    gather(svc, a, 1, "reduce_scatter", reduce="max")
    gather(svc, b, 2, "reduce_scatter", reduce="max")
    assert not host.answered  # the job's ranks are not known yet
    join(svc, table, 2, (0, 0))
    assert output(a) == [10.0, 20.0]
    assert output(b) == [30.0, 40.0]
    assert np.array_equal(a.segments[1].array, [1.0, 2.0, 3.0, 4.0])  # the input is unchanged


@pytest.mark.parametrize(
    ("kind", "given", "out", "match"),
    [
        ("allgather", [1.0, 2.0], 3, "fills 4"),
        ("reduce_scatter", [1.0, 2.0, 3.0], 2, "4, not 3"),
        ("barrier_or_so", [1.0], 2, "must be allreduce"),
    ],
)
def test_arrays_that_do_not_fit_the_job_are_refused(
    kind: str, given: list[float], out: int, match: str
) -> None:
    table = Table()
    svc, _ = service(table)
    (session,) = ranks(2, [given], out)
    with pytest.raises(UsageError, match=match):
        gather(svc, session, 1, kind, reduce="sum")


def test_a_reduce_scatter_takes_a_reduce_op() -> None:
    table = Table()
    svc, _ = service(table)
    (session,) = ranks(2, [[1.0] * 4], 2)
    with pytest.raises(UsageError, match="op must be"):
        gather(svc, session, 1, "reduce_scatter", reduce="prod")


class Bytes(Segment):
    """A segment of uint8."""

    def __init__(self, values: list[int]) -> None:
        self.array = np.array(values, dtype=np.uint8)


def test_an_allgather_also_gathers_bytes_and_only_it() -> None:
    table = Table()
    svc, host = service(table)
    join(svc, table, 2, (0, 0))
    sessions = ranks(2, [[0.0], [0.0]], 4)
    for rank, session in enumerate(sessions):
        session.segments[1] = Bytes([rank, 7])
        session.segments[2] = Bytes([0] * 4)
    for rid, session in enumerate(sessions, 1):
        gather(svc, session, rid, "allgather", dtype="uint8")
    assert [list(s.segments[2].array) for s in sessions] == [[0, 7, 1, 7]] * 2
    assert set(host.answered) == {1, 2}
    (session,) = ranks(2, [[0.0]], 2)
    session.segments[1], session.segments[2] = Bytes([1, 2, 3, 4]), Bytes([0, 0])
    with pytest.raises(UsageError, match="also gathers uint8"):
        gather(svc, session, 3, "reduce_scatter", dtype="uint8", reduce="sum", name="other")
