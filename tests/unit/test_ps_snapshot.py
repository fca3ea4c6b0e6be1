"""A shard's snapshot (fabricd/engines/ps/snapshot.py) and the restores that read one: hostile
bytes are refused with RemoteProtocolError and nothing else, and a state that could not have
come from a shard (versions that disagree, clocks below what is complete, pushes held where
none can be) is refused before anything is taken."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import push as ps_push
from fabricd.engines.ps import snapshot as ps_snapshot
from fabricd.engines.ps.consistency import Consistency, Coordinator, Sum
from fabricd.engines.ps.filters import Push
from fabricd.engines.ps.server import ShardServer
from fabricd.engines.ps.storage import TimedStore
from fabricd.errors import RemoteProtocolError

SIZE = 8


def shard(consistency: Consistency = Consistency.BSP, *, replica: bool = False) -> ShardServer:
    return ShardServer(
        initial=np.zeros(SIZE),
        workers=(1, 2),
        consistency=consistency,
        rule=Sum(),
        replica=replica,
    )


def served(consistency: Consistency = Consistency.BSP) -> ShardServer:
    """A primary that applied one BSP iteration and holds worker 1's push of the next."""
    server = shard(consistency)
    push = ps_push.encode(Push(size=SIZE, pushed=SIZE, indices=None, values=np.ones(SIZE)))
    for worker in (1, 2):
        server.push(worker, 0, 0, push, 0.0)
    server.push(1, 1, 1, push, 0.0)
    return server


def array_ext(dtype: object, shape: object, body: bytes) -> msgpack.ExtType:
    head = msgpack.packb([dtype, shape])
    return msgpack.ExtType(1, bytes([len(head)]) + head + body)


@pytest.mark.parametrize(
    ("what", "value"),
    [
        ("a dimension that is not an int", array_ext("float64", [float("inf")], b"")),
        ("a size that overflows", array_ext("uint64", [2**32, 2**32], b"")),
        ("too many dimensions", array_ext("bool", [1] * 5, b"\x00")),
        ("a negative dimension", array_ext("bool", [-1], b"")),
        ("a dtype it never holds", array_ext("object", [1], b"\x00" * 8)),
        ("another extension", msgpack.ExtType(7, b"\x00")),
        ("msgpack's timestamp", msgpack.Timestamp(0, 0)),
    ],
)
def test_a_hostile_array_or_value_is_refused(what: str, value: object) -> None:
    data = msgpack.packb({"x": [value]}, datetime=False)
    with pytest.raises(RemoteProtocolError):
        ps_snapshot.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_are_refused_never_another_error(data: bytes) -> None:
    try:
        state = ps_snapshot.decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(state, dict)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_spoiled_snapshot_is_refused_or_taken_whole_never_half(data: st.DataObject) -> None:
    good = bytearray(ps_snapshot.encode(served().state()))
    for _ in range(data.draw(st.integers(1, 4))):
        good[data.draw(st.integers(0, len(good) - 1))] = data.draw(st.integers(0, 255))
    replica = shard(replica=True)
    before = ps_snapshot.encode(replica.state())
    try:
        replica.restore(1, bytes(good))
    except RemoteProtocolError:
        assert ps_snapshot.encode(replica.state()) == before  # nothing taken
        assert not replica.has_state


def test_a_good_snapshot_round_trips() -> None:
    primary = served()
    replica = shard(replica=True)
    assert replica.restore(3, ps_snapshot.encode(primary.state()))
    assert replica.has_state
    assert replica.version == primary.version == 1
    np.testing.assert_array_equal(replica.store.model, primary.store.model)


def _coordinator_state(change: dict[str, Any]) -> dict[str, Any]:
    state = copy.deepcopy(served().coordinator.state())
    state.update(change)
    return state


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("more iterations complete than versions", {"complete": 5}),
        ("a live worker's clock below complete", {"next": {1: 2, 2: 0}}),
        ("pushes of an iteration already complete", {"pending": {0: {1: [0, np.ones(SIZE)]}}}),
        (
            "a push of an iteration its worker never reached",
            {"pending": {3: {2: [1, np.ones(SIZE)]}}},
        ),
    ],
)
def test_a_coordinator_state_no_coordinator_could_reach_is_refused(
    what: str, change: dict[str, Any]
) -> None:
    coordinator = Coordinator(workers=(1, 2), consistency=Consistency.BSP)
    before = coordinator.state()
    with pytest.raises(RemoteProtocolError):
        coordinator.restore(_coordinator_state(change), size=SIZE, dtype=np.dtype("float64"))
    assert coordinator.state()["version"] == before["version"] == 0


def test_pushes_held_outside_bsp_are_refused() -> None:
    coordinator = Coordinator(workers=(1, 2), consistency=Consistency.SSP, staleness=1)
    state = served().coordinator.state()  # BSP's: worker 1's push of iteration 1 held
    with pytest.raises(RemoteProtocolError, match="held under ssp"):
        coordinator.restore(state, size=SIZE, dtype=np.dtype("float64"))


def test_a_snapshot_whose_model_and_consistency_versions_differ_is_refused() -> None:
    state = served().state()
    state["store"]["version"] = 7
    state["store"]["versions"] = np.zeros_like(state["store"]["versions"])
    replica = shard(replica=True)
    with pytest.raises(RemoteProtocolError, match="at version 7 and its consistency at 1"):
        replica.restore(1, ps_snapshot.encode(state))
    assert not replica.has_state


def test_acknowledgement_records_of_unknown_workers_are_refused() -> None:
    state = served().state()
    state["last"][9] = [0, 1, None]
    replica = shard(replica=True)
    with pytest.raises(RemoteProtocolError, match="acknowledgement records"):
        replica.restore(1, ps_snapshot.encode(state))


def test_a_store_restore_that_fails_late_changes_nothing() -> None:
    store = TimedStore(np.zeros(SIZE))
    state = TimedStore(np.ones(SIZE)).state()
    state["pulled_bytes"] = -1  # checked after chunks_published
    with pytest.raises(RemoteProtocolError):
        store.restore(state)
    assert store.statistics().chunks_published == 0
    np.testing.assert_array_equal(store.model, 0.0)


def test_a_primary_that_becomes_a_replica_forgets_a_pending_join() -> None:
    primary = shard()
    primary.replicated = True
    primary._join_pending = True  # a replica asked while a step was out
    later = served().state()
    later["epoch"] = 1
    assert primary.restore(2, ps_snapshot.encode(later))
    assert not primary.primary
    assert primary.joined() == []  # a replica sends nobody snapshots
    assert not primary.synced
