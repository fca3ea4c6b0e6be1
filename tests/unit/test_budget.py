"""The byte budget (issue 28, item 3): what the daemon holds for a tenant, charged before it is
made, refused past a cap naming the setting, and given back when freed.

The ledger is tested alone (every sequence of charges and releases keeps exact totals and never
passes a cap), then each charge against what its engine really holds: a collective's bound
against the arrays a :class:`Collective` makes, a parameter server's copies against the arrays
its engine keeps after rounds of pushes and pulls.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.daemon import config
from fabricd.daemon.config import Config, held_bytes_limits
from fabricd.daemon.services.ps import WORKER_COPIES, shard_copies
from fabricd.engines.budget import PER_JOB, PER_UID, ByteBudget, size_text
from fabricd.engines.collectives.persistent import Collective
from fabricd.engines.collectives.spec import Spec, held_bytes
from fabricd.engines.ps.consistency import Consistency
from fabricd.errors import ConfigError, ErrorCode, OperationFailed
from tests.unit.ps_fabric import KEY, Fabric

if TYPE_CHECKING:
    from pathlib import Path

MiB = 1 << 20


# -- the ledger ----------------------------------------------------------------------------------
def test_a_charge_past_the_jobs_cap_is_refused_naming_the_setting_and_holds_nothing() -> None:
    budget = ByteBudget(per_uid=100 * MiB, per_job=10 * MiB, node=3)
    first = budget.charge(1000, "train", 6 * MiB, "collective 'a' of job 'train'")
    with pytest.raises(OperationFailed) as refused:
        budget.charge(1000, "train", 5 * MiB, "collective 'b' of job 'train'")
    assert refused.value.code == ErrorCode.LIMIT
    message = str(refused.value)
    for part in ("max_held_bytes_per_job", "collective 'b'", "node 3", "5 MiB", "6 MiB"):
        assert part in message
    assert budget.held_by_job() == {"train": 6 * MiB}  # the refused charge left nothing
    assert budget.refused == {PER_UID: 0, PER_JOB: 1}
    first.release()
    assert (budget.held, budget.held_by_uid(), budget.held_by_job()) == (0, {}, {})


def test_a_uids_jobs_share_its_cap_and_other_uids_are_not_touched() -> None:
    budget = ByteBudget(per_uid=10 * MiB, per_job=8 * MiB)
    budget.charge(1000, "a", 8 * MiB, "x")
    with pytest.raises(OperationFailed, match="max_held_bytes_per_uid") as refused:
        budget.charge(1000, "b", 3 * MiB, "y")
    assert "uid 1000's jobs hold 8 MiB" in str(refused.value)
    other = budget.charge(2000, "c", 8 * MiB, "z")  # another tenant: its own budget
    assert budget.held_by_uid() == {1000: 8 * MiB, 2000: 8 * MiB}
    other.release()
    other.release()  # a holder freed on two paths gives its bytes back once
    assert budget.held_by_uid() == {1000: 8 * MiB}


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3), st.integers(0, 40)),
        max_size=60,
    )
)
def test_any_sequence_keeps_exact_totals_within_the_caps(
    steps: list[tuple[bool, int, int, int]],
) -> None:
    budget = ByteBudget(per_uid=100, per_job=60)
    live: list[Any] = []
    for release, uid, job, nbytes in steps:
        if release and live:
            live.pop(nbytes % len(live)).release()
            continue
        try:
            live.append(budget.charge(uid, f"job{job}", nbytes, "it"))
            refusal = None
        except OperationFailed as exc:
            refusal = exc.code
        assert refusal in (None, ErrorCode.LIMIT)
        by_uid: dict[int, int] = {}
        by_job: dict[str, int] = {}
        for charge in live:
            by_uid[charge.uid] = by_uid.get(charge.uid, 0) + charge.nbytes
            by_job[charge.job] = by_job.get(charge.job, 0) + charge.nbytes
        expected_uid = {uid: n for uid, n in by_uid.items() if n}
        expected_job = {job: n for job, n in by_job.items() if n}
        assert budget.held_by_uid() == expected_uid
        assert budget.held_by_job() == expected_job
        assert all(n <= 100 for n in expected_uid.values())
        assert all(n <= 60 for n in expected_job.values())
    for charge in live:
        charge.release()
    assert (budget.held_by_uid(), budget.held_by_job()) == ({}, {})


def test_sizes_read_for_a_person() -> None:
    assert [size_text(n) for n in (512, 3 * MiB, 1536 * MiB)] == ["512 B", "3 MiB", "1.5 GiB"]


# -- the settings --------------------------------------------------------------------------------
def test_the_default_budgets_are_a_quarter_of_the_memory_the_daemon_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(config, "_physical_memory", lambda: 64 << 30)
    monkeypatch.setattr(config, "_cgroup_memory_limit", lambda: 1 << 62)
    assert held_bytes_limits(Config()) == (16 << 30, 16 << 30)
    monkeypatch.setattr(config, "_cgroup_memory_limit", lambda: 8 << 30)  # a tighter cgroup
    assert held_bytes_limits(Config()) == (2 << 30, 2 << 30)
    set_here = Config(max_held_bytes_per_uid=5 * MiB, max_held_bytes_per_job=3 * MiB)
    assert held_bytes_limits(set_here) == (5 * MiB, 3 * MiB)


def test_the_cgroup_limit_is_read_from_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "sys/svc").mkdir(parents=True)
    (tmp_path / "sys/svc/memory.max").write_text("1073741824\n")
    (tmp_path / "v2").write_text("0::/svc\n")
    assert config._cgroup_memory_limit(str(tmp_path / "v2"), str(tmp_path / "sys")) == 1 << 30
    (tmp_path / "sys/svc/memory.max").write_text("max\n")  # no limit
    assert config._cgroup_memory_limit(str(tmp_path / "v2"), str(tmp_path / "sys")) == 1 << 62
    (tmp_path / "sys/memory/job").mkdir(parents=True)
    (tmp_path / "sys/memory/job/memory.limit_in_bytes").write_text("536870912\n")
    (tmp_path / "v1").write_text("5:cpu,cpuacct:/\n4:memory:/job\n")
    assert config._cgroup_memory_limit(str(tmp_path / "v1"), str(tmp_path / "sys")) == 1 << 29
    assert config._cgroup_memory_limit(str(tmp_path / "none"), str(tmp_path)) == 1 << 62


def test_a_negative_budget_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="max_held_bytes_per_job must be >= 0"):
        Config(max_held_bytes_per_job=-1).validate()


# -- the charges against what the engines hold ---------------------------------------------------
def _held_by(coll: Collective) -> int:
    """Bytes of the arrays a collective made (not a caller's array, in place)."""
    arrays = [*coll.given.arrays(), *coll.owed.arrays(), *coll.layout.arrays()]
    if not coll.inplace:
        arrays += [coll.data, coll.result]
    return sum(a.nbytes for a in arrays)


def _specs() -> list[tuple[Spec, int, int]]:
    cases = []
    for kind, mode, ring, direct, nodes, local, count, dtype in itertools.product(
        ("allreduce", "broadcast", "barrier"),
        ("sync", "solo", "majority"),
        (False, True),
        (False, True),
        (1, 2, 3, 4, 5, 8, 9),
        (1, 2),
        (1, 7, 1000, 4099),
        ("float32", "float64"),
    ):
        if (kind != "allreduce" and (mode != "sync" or ring)) or (direct and not ring):
            continue
        spec = Spec(kind=kind, count=count, dtype=dtype, mode=mode, ring=ring, direct=direct)
        cases.append((spec, nodes, local))
    return cases


def test_a_collectives_charge_bounds_what_it_holds_and_is_not_far_above_it() -> None:
    """Every kind, mode, algorithm, size and number of nodes and local ranks: the charge made
    before building (:func:`held_bytes`) is at least what the collective then holds, also after
    views with fewer nodes, and (with a peer to hear from) at most 5x it."""
    for spec, nodes, local in _specs():
        ranks = tuple(r // local for r in range(nodes * local))
        coll = Collective(
            spec, job="j", name="g", node=0, ranks=ranks, live=frozenset(range(len(ranks)))
        )
        bound = held_bytes(spec, nodes, inplace=coll.inplace)
        assert _held_by(coll) <= bound, (spec, nodes, local)
        if nodes > 1 and spec.count >= 1000 and spec.kind != "barrier":  # (else chunks of 0)
            assert bound <= 5 * _held_by(coll), (spec, nodes, local)
        for fewer in range(1, nodes):  # a view that lost nodes holds no more than the charge
            smaller = tuple(r // local for r in range(fewer * local))
            after = Collective(
                spec, job="j", name="g", node=0, ranks=smaller, live=frozenset(range(len(smaller)))
            )
            assert _held_by(after) <= bound, (spec, nodes, fewer)


def _arrays(obj: object, seen: set[int]) -> int:
    """Bytes of every numpy array and byte buffer reachable from ``obj`` (owned, not views)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.base is None else 0
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_arrays(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple | set | frozenset | deque):
        return sum(_arrays(v, seen) for v in obj)
    total = _arrays(getattr(obj, "__dict__", {}), seen)
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            total += _arrays(getattr(obj, slot, None), seen)
    return total


@pytest.mark.parametrize("consistency", list(Consistency))
@pytest.mark.parametrize("lossless", [False, True])
def test_a_parameter_servers_charges_bound_what_its_engine_keeps(
    consistency: Consistency, lossless: bool
) -> None:
    """Workers and primary and replica shards, after rounds of pushes and pulls and while
    BSP holds the pushes of workers ahead of a slow one, hold at most what the service charged
    for them (WORKER_COPIES, :func:`shard_copies`)."""
    size, workers = 4096, 4
    fabric = Fabric(
        workers=workers,
        shards=2,
        size=size,
        rounds=6,
        consistency=consistency,
        staleness=1 if consistency is Consistency.SSP else 0,
        replicas=True,
        lossless=lossless,
    )
    held_pushes = 0
    for _ in range(200):  # the last worker lags: the others run as far as they may
        for rank in range(workers - 1):
            fabric.step(rank)
        if not fabric.deliver(0):
            break
        _check_charges(fabric, size)
        held_pushes = max(held_pushes, _pending(fabric))
    if consistency is Consistency.BSP:
        assert held_pushes >= workers - 1  # the case the bound is for did happen
    fabric.drain()  # the laggard catches up; everything completes
    _check_charges(fabric, size)


def _pending(fabric: Fabric) -> int:
    """Pushes the servers hold until an iteration is complete (BSP)."""
    return max(
        sum(len(pushes) for pushes in server.coordinator._pending.values())
        for node in fabric.nodes.values()
        for server in node.models[KEY].servers.values()
    )


def _check_charges(fabric: Fabric, size: int) -> None:
    itemsize = 8  # the fabric's models are float64
    for node in fabric.nodes.values():
        model = node.models[KEY]
        for worker in model.local_workers.values():
            assert size * itemsize <= _arrays(worker, set()) <= WORKER_COPIES * size * itemsize
        for shard, server in model.servers.items():
            lo, hi = fabric.bounds[shard]
            held = _arrays(server, set())
            assert 2 * (hi - lo) * itemsize <= held
            assert held <= shard_copies(fabric.spec) * (hi - lo) * itemsize


# -- the services give back what they charged ------------------------------------------------
def test_a_parameter_servers_shards_and_workers_give_their_bytes_back_when_they_close() -> None:
    from tests.unit.test_ps_service_review import Fabric as Services

    services = Services()
    services.start()  # server and replica of one shard, two workers, on two nodes
    held = [host.budget.held_by_uid() for host in services.hosts]
    shard = 8 * 8  # SIZE float64, one shard
    workers = 2
    bsp = shard_copies({"n": 4, "servers": [0], "replicas": [1], "consistency": "bsp"}) * shard
    assert held == [{1000: bsp + WORKER_COPIES * shard}] * 2  # each node: a shard and a worker
    async_ = {"n": 4, "servers": [0], "replicas": [1], "consistency": "async"}
    assert shard_copies(async_) == 6 + workers  # a log entry per worker for the replica
    assert bsp == (6 + 2 * workers + workers) * shard
    for rank in (2, 3, 0, 1):
        services.leave(rank)
    assert [host.budget.held_by_uid() for host in services.hosts] == [{}, {}]


def test_a_shard_whose_open_fails_holds_nothing_and_may_open_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.unit.test_ps_service_review import Fabric as Services

    services = Services()
    services.join_all()
    service, host = services.services[0], services.hosts[0]
    real = service.engine.open_shard

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no room for the shard")

    monkeypatch.setattr(service.engine, "open_shard", failing)
    with pytest.raises(MemoryError):
        services.open(0, "server")
    assert host.budget.held_by_uid() == {}
    monkeypatch.setattr(service.engine, "open_shard", real)
    assert services.open(0, "server") is not None  # not "open here already"
    assert len(host.budget.held_by_uid()) == 1
