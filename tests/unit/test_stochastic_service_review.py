"""Review of the stochastic service (stochastic reduce): peers' specs, bounds, a trainer that comes
back, and the shared data-link sender.

The service runs on the collective review's fake host (with control frames recorded too) and
fake rank table, so ranks join and leave as membership would say.  Every test here shows a bug
the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from fabricd.daemon.config import Config
from fabricd.daemon.service import Request
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.daemon.services.stochastic import StochasticService
from fabricd.daemon.sessions import ClientSession
from fabricd.engines.actions import Failure
from fabricd.engines.membership import RankJoined, RankLeft
from fabricd.engines.stochastic.notify_ack import OVERHEAD
from fabricd.errors import OperationFailed, RemoteProtocolError
from fabricd.frames import registry
from fabricd.frames import stochastic as stochastic_frames
from fabricd.wire import Kind
from tests.unit.test_collective_service_review import FakeHost, Link, Segment, Table

JOB, NAME = "j", "model"


@dataclass
class Host(FakeHost):
    """The fake host, with control frames recorded."""

    control: list[tuple[int, registry.PeerFrame]] = field(default_factory=list)
    incarnation: int = 1

    def send(self, node: int, frame: registry.PeerFrame, payload: Any = ()) -> None:
        self.control.append((node, frame))


def service(table: Table, node: int = 0, **settings: Any) -> tuple[StochasticService, Host]:
    config = Config(node_id=node, nodes=("127.0.0.1:1", "127.0.0.1:2"), **settings)
    host = Host(config)
    return StochasticService(host, membership=table), host  # type: ignore[arg-type]


def join(svc: StochasticService, table: Table, nodes: tuple[int, ...]) -> None:
    for entry in table.join(JOB, len(nodes), nodes, owner=1000):
        svc.on_rank_event(RankJoined(entry=entry), 0.0)


def client(rank: int, size: int, count: int = 4) -> ClientSession:
    session = ClientSession(conn=None, job=JOB, rank=rank, size=size)  # type: ignore[arg-type]
    session.segments[1] = Segment([float(rank)] * count)  # type: ignore[assignment]
    return session


def call(svc: StochasticService, session: ClientSession, rid: int, **fields: Any) -> None:
    nbytes = session.segments[1].array.nbytes  # type: ignore[attr-defined]
    meta = {"name": NAME, "seg": 1, "off": 0, "nbytes": nbytes, "dtype": "float64"}
    meta |= {"graph": "ring", "degree": None, "seed": 0, "edges": None, "sync": "notify-ack"}
    svc.on_request(
        Request(session=session, id=rid, op="stochastic_reduce", meta=meta | fields, fds=[]), 0.0
    )


def spec(**fields: Any) -> dict[str, Any]:
    good = {"graph": "ring", "n": 2, "degree": None, "seed": 0, "edges": None}
    return good | {"sync": "notify-ack", "dtype": "float64", "nbytes": 32} | fields


def notify(spec: dict[str, Any], name: str = NAME) -> stochastic_frames.Notify:
    return stochastic_frames.Notify(job=JOB, name=name, src=1, dst=0, round=0, tag=0, spec=spec)


# -- a peer's spec ----------------------------------------------------------------------------
HOSTILE = [
    {"sync": "bsp"},  # Sync("bsp"): ValueError
    {"sync": 5},
    {"n": "2"},  # "2" < 1: TypeError in the graph generators
    {"degree": "x", "graph": "regular"},
    {"seed": "x", "graph": "regular", "degree": 1},
    {"seed": -1, "graph": "regular", "degree": 1},  # numpy refuses a negative seed
    {"dtype": ["float64"]},
    {"dtype": "int8"},  # the graph is built and kept, then the reducer refuses it
    {"nbytes": "32"},
    {"nbytes": 2**62},  # a slot of 4 EiB
    {"n": 3000},  # a dense 3000 x 3000 SVD on the daemon's one thread, for a job of 2
    {"graph": "edges", "edges": [[1, 0], [0, "1"]]},
]


@pytest.mark.parametrize("fields", HOSTILE, ids=[str(f) for f in HOSTILE])
def test_a_hostile_spec_closes_only_the_peers_link_and_leaves_the_reduce_alone(
    fields: dict[str, Any],
) -> None:
    """A spec of wrong types or sizes is a protocol error (only that peer's link closes),
    never an exception the node logs as a bug, nor a giant allocation; and it leaves nothing
    behind, so this node's own ranks still call the reduce."""
    table = Table()
    svc, host = service(table)
    join(svc, table, (0, 1))
    meta = notify(spec(**fields)).to_meta()
    with pytest.raises(RemoteProtocolError):  # from the frame layer or the service
        svc.on_frame(1, registry.parse(Kind.NOTIFY, meta), 0.0)
    assert not svc.reducers
    call(svc, client(0, 2), 1)
    assert 1 not in host.answered  # open: waits for rank 1's NOTIFY, not refused as broken
    assert svc.reducers


def test_a_spec_with_other_keys_in_it_is_a_protocol_error() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, (0, 1))
    odd: dict[Any, Any] = {**spec(), b"graph": 1}
    with pytest.raises(RemoteProtocolError):
        svc.on_frame(1, registry.parse(Kind.NOTIFY, notify(odd).to_meta()), 0.0)


# -- bounds on a local client -----------------------------------------------------------------
def test_an_update_larger_than_a_frame_is_refused_not_dropped_on_the_wire() -> None:
    """An UPDATE is never chunked: one that cannot fit in a frame (max_payload) would be
    dropped by the link, and the receiver, holding its NOTIFY, would wait for it forever."""
    table = Table()
    svc, host = service(table, chunk_size=4096, max_payload=4096)
    host.links[1] = Link()
    host.links[1].writable = True
    join(svc, table, (0, 1))
    count = (4096 - OVERHEAD) // 8 + 1
    with pytest.raises(OperationFailed, match="max_payload"):
        call(svc, client(0, 2, count), 1)
    assert not svc.reducers


def test_the_names_of_a_job_are_bounded() -> None:
    table = Table()
    svc, _ = service(table, max_collectives_per_job=2)
    join(svc, table, (0, 1))
    session = client(0, 2)
    call(svc, session, 1, name="a", sync="async")
    call(svc, session, 2, name="b", sync="async")
    with pytest.raises(OperationFailed, match="max_collectives_per_job"):
        call(svc, session, 3, name="c", sync="async")
    # a peer's frame cannot build past the bound either: it is dropped and counted, and the
    # peer's links, which every tenant shares, are not reset for it (issue 28)
    dropped = svc._counters["graph_frames_dropped"]
    svc.on_frame(1, notify(spec(), name="d"), 0.0)
    assert svc._counters["graph_frames_dropped"] > dropped
    assert {k[1] for k in svc.reducers} == {"a", "b"}


# -- a trainer that comes back ----------------------------------------------------------------
def test_a_rank_whose_trainer_left_between_calls_fails_its_next_call_not_hangs() -> None:
    """Rank 1 leaves between two rounds of a notify-ack ring: rank 0 drops it for good.  A
    new trainer of rank 1 that calls the reduce again must be told, not wait for a NOTIFY
    nobody will send."""
    table = Table()
    svc, host = service(table)
    join(svc, table, (0, 0))
    first = [client(0, 2), client(1, 2)]
    call(svc, first[0], 1)
    call(svc, first[1], 2)
    assert host.answered[1]["round"] == 0
    assert host.answered[2]["round"] == 0
    svc.client_gone(first[1], 0.0)
    entry = table.entries.pop((JOB, 1))
    svc.on_rank_event(RankLeft(entry=entry, reason="rank 1 disconnected", lost=False), 0.0)
    table.entries[(JOB, 1)] = entry
    svc.on_rank_event(RankJoined(entry=entry), 0.0)
    call(svc, client(1, 2), 3)
    assert isinstance(host.answered.get(3), Failure), "the new trainer's call hangs"


# -- the shared sender ------------------------------------------------------------------------
def test_a_frame_sent_while_its_queue_is_dropped_is_told_once() -> None:
    """A link reset drops the queue (``left(False)`` for each frame) while the first frame's
    send is still being awaited; when that send then returns, the frame must not be told
    again (``left(True)``): the stochastic service counts its queued updates per edge with it."""

    async def scenario() -> list[bool]:
        host = Host(Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2")))
        host.links[1] = Link()
        told: list[bool] = []
        queues = DataQueues(host, Kind.UPDATE, sent=lambda n: None)  # type: ignore[arg-type]
        assert not queues.send(1, {"x": 1}, memoryview(b"ab"), told.append)
        for _ in range(10):
            await asyncio.sleep(0)
            if host.links[1].pending is not None:
                break
        queues.drop(1)  # the reset
        pending = host.links[1].pending
        assert pending is not None
        pending.set_result(None)  # the frame had made it into the old link's buffer
        await asyncio.gather(*host.tasks)
        return told

    assert asyncio.run(scenario()) == [False]


# -- who a frame says it is from --------------------------------------------------------------
def test_a_notify_with_the_acks_tag_is_a_protocol_error() -> None:
    table = Table()
    svc, _ = service(table)
    join(svc, table, (0, 1))
    frame = stochastic_frames.Notify(job=JOB, name=NAME, src=1, dst=0, round=0, tag=1, spec=spec())
    with pytest.raises(RemoteProtocolError, match="ACK's tag"):
        svc.on_frame(1, frame, 0.0)


def test_a_frame_as_a_rank_of_another_node_is_dropped() -> None:
    """Node 1 sends a NOTIFY and an ACK as rank 1, which lives on node 0: neither is taken
    as rank 1's (it could complete a round rank 1 never took part in)."""
    table = Table()
    svc, host = service(table)
    join(svc, table, (0, 0))
    call(svc, client(0, 2), 1)
    svc.on_frame(1, notify(spec()), 0.0)
    svc.on_frame(1, stochastic_frames.Ack(job=JOB, name=NAME, src=1, dst=0, round=0), 0.0)
    assert 1 not in host.answered  # still waits for the real rank 1
    assert svc.statistics()["counters"]["graph_frames_dropped"] == 2
