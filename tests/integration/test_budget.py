"""The byte budget on a real daemon (issue 28, item 3): a tenant whose collectives, reduces and
models would make the daemon hold more than ``max_held_bytes_per_job`` or
``max_held_bytes_per_uid`` is refused with ``limit`` naming the setting; the daemon's memory
stays within the budget plus a constant; another uid's job goes on working; what a finished job
held is given back.

The finding it answers: counting alone bounded how many collectives a job had, not how large,
so one tenant could make the daemon hold any amount and the kernel's OOM killer pick the daemon.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import pytest

import fabricd
from fabricd.engines.collectives.spec import Spec, held_bytes
from fabricd.errors import OperationFailed
from tests.integration.scrape import scrape
from tests.integration.test_client_socket import NOBODY, _as_a_user, _open_to_all

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.launcher import LocalCluster

MiB = 1 << 20
COUNT = MiB  #: float32 elements of each tenant array: 4 MiB
#: what a solo allreduce of COUNT float32 on a one-node job is charged (spec.held_bytes): data,
#: result, accumulator, snapshot, the held snapshots of abandoned rounds, the owed sum of its one
#: rank (late="sum"), and the bound's four slots, of 4 MiB + 4 B each
SOLO = held_bytes(
    Spec(kind="allreduce", count=COUNT, dtype="float32", mode="solo"), 1, inplace=False
)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _nothing_held(path: str) -> None:
    """Wait until the daemon holds nothing for anyone (the jobs that held it ended)."""
    with fabricd.connect(socket_path=path) as control:
        for _ in range(100):
            if not control.status()["held_bytes"]:
                break
            time.sleep(0.05)
        assert control.status()["held_bytes"] == []


def _names_until_refused(fab: fabricd.Fabric, prefix: str, limit: int) -> tuple[int, str]:
    """Solo allreduces under new names until one is refused; returns how many ran and why the
    last was refused."""
    array = fab.array(f"{prefix}-x", (COUNT,), "float32")
    array[:] = 1.0
    for n in range(limit):
        try:
            fab.allreduce(array, mode="solo", name=f"{prefix}{n}", timeout=30)
        except OperationFailed as exc:
            return n, f"{exc.code}: {exc}"
    return limit, ""


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to switch to")
def test_a_tenant_past_its_budget_is_refused_and_others_go_on(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(
        1,
        max_held_bytes_per_job=2 * SOLO + MiB,
        max_held_bytes_per_uid=3 * SOLO + MiB,
        allowed_uids=[NOBODY.pw_uid],
    )
    path = _open_to_all(cluster)
    daemon = cluster.nodes[0].process
    assert daemon is not None
    before = _rss(daemon.pid)
    with (
        fabricd.connect(job="greedy", rank=0, size=1, socket_path=path) as first,
        fabricd.connect(job="greedy2", rank=0, size=1, socket_path=path) as second,
    ):
        ran, why = _names_until_refused(first, "g", 10)
        assert ran == 2, why  # the third would take the job past its budget
        assert why.startswith("limit: "), why
        assert "max_held_bytes_per_job" in why, why
        ran, why = _names_until_refused(second, "h", 10)
        assert ran == 1, why  # the uid's budget: both jobs together
        assert "max_held_bytes_per_uid" in why, why
        grown = _rss(daemon.pid) - before
        # the rounds wrote their arrays (resident now): no more than the budget, plus the
        # interpreter's own growth (a few MiB)
        assert grown <= 3 * SOLO + 32 * MiB, grown / MiB

        def other_tenant() -> str:  # another uid, its own budget: it runs
            with fabricd.connect(job="theirs", rank=0, size=1, socket_path=path) as fab:
                array = fab.array("t", (COUNT,), "float32")
                array[:] = 2.0
                fab.allreduce(array, mode="solo", name="t", timeout=30)
                return "ok"

        assert _as_a_user(other_tenant) == "ok"
        with fabricd.connect(socket_path=path) as control:
            status = control.status()
        assert status["held_bytes"] == [{"uid": 0, "bytes": 3 * SOLO}]  # nobody's job ended
        assert status["max_held_bytes_per_job"] == 2 * SOLO + MiB
        assert status["counters"]["refused_max_held_bytes_per_job"] == 1
        assert status["counters"]["refused_max_held_bytes_per_uid"] == 1
        samples = scrape(status["metrics_url"])
        assert samples[("fabricd_held_bytes", frozenset({("uid", "0")}))] == 3 * SOLO
        limit = ("fabricd_held_bytes_limit", frozenset({("per", "uid")}))
        assert samples[limit] == 3 * SOLO + MiB
    # both jobs ended: what they held is given back, and a new job may hold it again
    _nothing_held(path)
    with fabricd.connect(job="greedy", rank=0, size=1, socket_path=path) as again:
        ran, why = _names_until_refused(again, "g", 2)
        assert ran == 2, why


def test_reduces_and_models_are_charged_too(make_cluster: Callable[..., LocalCluster]) -> None:
    """A stochastic reduce's slots and a parameter-server shard past the job's budget are
    refused at the call that would make them, naming the setting; smaller ones fit."""
    cluster = make_cluster(1, max_held_bytes_per_job=6 * MiB)
    path = cluster.nodes[0].socket_path
    with (
        fabricd.connect(job="big", rank=0, size=2, socket_path=path) as server,
        fabricd.connect(job="big", rank=1, size=2, socket_path=path),
    ):
        with pytest.raises(OperationFailed, match="max_held_bytes_per_job") as refused:
            server.parameter_server("m", COUNT, role="server", servers=(0,))  # 6 x 4 MiB
        assert refused.value.code == "limit"
        assert "shard 0 of parameter server 'm'" in str(refused.value)
        small = server.parameter_server("s", COUNT // 8, role="server", servers=(0,))
        assert small is not None  # 6 x 0.5 MiB fits
        array = server.array("r", (COUNT,), "float32")
        with pytest.raises(OperationFailed, match="max_held_bytes_per_job") as refused:
            server.stochastic_reduce(array, graph="ring", name="r", timeout=30)
        assert "stochastic reduce 'r'" in str(refused.value)
        with fabricd.connect(socket_path=path) as control:
            status = control.status()
        assert status["held_bytes"] == [{"uid": 0, "bytes": 6 * (COUNT // 8) * 4}]
        assert status["counters"]["refused_max_held_bytes_per_job"] == 2
    with (  # a reduce that fits is charged, and given back with its job
        fabricd.connect(job="fits", rank=0, size=2, socket_path=path) as a,
        fabricd.connect(job="fits", rank=1, size=2, socket_path=path) as b,
    ):
        arrays = [fab.array("r", (COUNT // 8,), "float32") for fab in (a, b)]
        calls = [
            fab.stochastic_reduce_async(array, graph="ring", name="r")
            for fab, array in zip((a, b), arrays, strict=True)
        ]
        for call in calls:
            call.wait(30)
        with fabricd.connect(socket_path=path) as control:
            held = control.status()["held_bytes"]
        assert held == [{"uid": 0, "bytes": 2 * 3 * ((COUNT // 8) * 4 + 16)}]  # 2 ranks x 3
    _nothing_held(path)
