"""A stall report as the operator reads it: the row, its log line, and who may see it."""

from __future__ import annotations

from fabricd.daemon.access import redact
from fabricd.daemon.stalls import line, report
from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import PeerInfo, PeerState
from fabricd.engines.ownership import Ownership, User
from fabricd.engines.p2p.messages import Message
from fabricd.engines.stalls import Stalled, Waits

MSG = Message(job="train", src=1, dst=0, tag=7, nbytes=1024, dtype="float32")
PEERS = {
    1: PeerInfo(
        node=1,
        state=PeerState.SUSPECT,
        incarnation=1,
        silent_for=4.25,
        state_for=1.0,
        links=frozenset({Channel.CONTROL}),
    )
}


def stalled(**fields: object) -> Stalled:
    base: dict[str, object] = {
        "op": 3,
        "send": False,
        "msg": MSG,
        "node": 0,
        "pending_for": 31.0,
        "waits": Waits.RTS,
        "peer_node": 1,
        "peer_joined": True,
    }
    return Stalled(**(base | fields))  # type: ignore[arg-type]


def test_the_row_joins_what_the_operation_waits_for_with_the_peer_nodes_liveness() -> None:
    row = report(stalled(), PEERS, uid=1000, owner=1000)
    assert (row["rank"], row["peer"], row["waits"], row["peer_posted"]) == (0, 1, "rts", False)
    assert (row["peer_node_state"], row["peer_node_silent_for"]) == ("suspect", 4.25)
    assert line(row) == (
        "stalled: recv of rank 0 from rank 1, job 'train', tag 7, 1024 B float32, pending 31.0s; "
        "waits for rts: rank 1 on node 1 has sent nothing to rank 0 with tag 7 (no RTS has "
        "arrived); rank 1 has not posted a match, on node 1: suspect, last heard 4.2s ago"
    )


def test_a_peer_on_this_node_a_rank_not_joined_and_a_client_that_left_are_said() -> None:
    local = report(stalled(waits=Waits.MATCH, peer_node=0), PEERS, uid=1000, owner=1000)
    assert local["peer_node_state"] == "local"
    assert line(local).endswith("rank 1 has not posted a match, on this node")
    absent = report(
        stalled(waits=Waits.JOIN, peer_node=None, peer_joined=False), PEERS, uid=None, owner=1000
    )
    assert absent["client_left"]
    assert "(its client left)" in line(absent)
    assert line(absent).endswith("; rank 1 has not joined")


def test_only_users_who_may_see_the_job_see_its_stalls() -> None:
    rules = Ownership()
    answer = {
        "node": 0,
        "stall_after": 30.0,
        "stalls": [report(stalled(), PEERS, uid=1000, owner=1000)],
    }
    redact(answer, User(uid=1001), rules)
    assert (answer["stalls"], answer["hidden"]) == ([], {"stalls": 1})
    answer = {
        "node": 0,
        "stall_after": 30.0,
        "stalls": [report(stalled(), PEERS, uid=1000, owner=1000)],
    }
    redact(answer, User(uid=1000), rules)
    assert (len(answer["stalls"]), answer["hidden"]) == (1, {})
