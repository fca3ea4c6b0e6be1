"""Membership's suspicion of a reset node and its ranks, on a hand-driven clock: suspected,
then back (the same daemon) or gone (``down_after`` passed, or a new daemon came back)."""

from __future__ import annotations

import pytest

from fabricd.engines.actions import SendFrame
from fabricd.engines.membership import (
    Membership,
    NodeBack,
    NodeGone,
    RankBack,
    RankEntry,
    RankGone,
    RankJoined,
    RankLeft,
    RankSuspected,
)
from fabricd.engines.ownership import User
from fabricd.frames.membership import Announce

HERE, PEER = 0, 1
DOWN_AFTER = 10.0
ALICE = User(uid=1000)
REASON = f"node {PEER} is control link lost"


def announce(members: Membership, rank: int, incarnation: int, node: int = PEER) -> list[object]:
    frame = Announce(job="j", rank=rank, size=3, present=True, owner=ALICE.uid)
    return list(members.on_announce(node, frame, incarnation))


def entry(rank: int, node: int = PEER) -> RankEntry:
    return RankEntry(job="j", rank=rank, size=3, node=node)


@pytest.fixture
def members() -> Membership:
    """Rank 0 here, ranks 1 and 2 on the peer (incarnation 7), whose links were reset at 0."""
    members = Membership(node=HERE, down_after=DOWN_AFTER)
    members.attach("j", 0, 3, user=ALICE)
    announce(members, 1, 7)
    announce(members, 2, 7)
    assert members.peer_down(PEER, "control link lost", 0.0, 7) == [
        RankLeft(entry=entry(1), reason=REASON, lost=True),
        RankSuspected(entry=entry(1), reason=REASON),
        RankLeft(entry=entry(2), reason=REASON, lost=True),
        RankSuspected(entry=entry(2), reason=REASON),
    ]
    return members


def test_a_reset_nodes_ranks_leave_the_table_and_are_suspected_for_down_after(
    members: Membership,
) -> None:
    assert members.lookup("j", 1) is None
    assert members.suspected("j", 1)
    assert members.has_suspects("j")
    assert members.next_deadline() == DOWN_AFTER
    assert members.on_timer(DOWN_AFTER - 0.5) == []


def test_the_same_daemon_back_brings_its_ranks_back(members: Membership) -> None:
    actions = members.peer_up(PEER, 7)
    assert [a for a in actions if not isinstance(a, SendFrame)] == [NodeBack(node=PEER)]
    assert announce(members, 1, 7) == [RankBack(entry=entry(1)), RankJoined(entry=entry(1))]
    assert not members.suspected("j", 1)
    assert members.suspected("j", 2)  # not announced again (yet)
    assert members.next_deadline() == DOWN_AFTER


def test_a_rank_not_announced_again_is_gone_at_its_deadline_though_its_node_came_back(
    members: Membership,
) -> None:
    members.peer_up(PEER, 7)
    announce(members, 1, 7)
    assert members.on_timer(DOWN_AFTER) == [RankGone(entry=entry(2), reason=REASON)]
    assert not members.has_suspects("j")
    assert members.next_deadline() is None


def test_a_node_not_back_within_down_after_is_gone_with_its_ranks(members: Membership) -> None:
    assert members.on_timer(DOWN_AFTER) == [
        NodeGone(node=PEER, reason="control link lost"),
        RankGone(entry=entry(1), reason=REASON),
        RankGone(entry=entry(2), reason=REASON),
    ]
    assert members.next_deadline() is None
    assert [a for a in members.peer_up(PEER, 7) if not isinstance(a, SendFrame)] == []
    assert announce(members, 1, 7) == [RankJoined(entry=entry(1))]  # a new rank now


def test_a_new_incarnation_is_gone_at_once_with_its_ranks(members: Membership) -> None:
    actions = members.peer_up(PEER, 8)
    assert [a for a in actions if not isinstance(a, SendFrame)] == [
        NodeGone(node=PEER, reason="control link lost; it restarted"),
        RankGone(entry=entry(1), reason=f"{REASON}; it restarted"),
        RankGone(entry=entry(2), reason=f"{REASON}; it restarted"),
    ]
    assert members.next_deadline() is None
    assert announce(members, 1, 8) == [RankJoined(entry=entry(1))]


def test_a_new_incarnations_announcement_before_its_links_are_up_is_a_new_rank(
    members: Membership,
) -> None:
    """The peer's ANNOUNCE may overtake this node's admission of its data link."""
    assert announce(members, 1, 8) == [
        RankGone(entry=entry(1), reason=f"{REASON}; it came back restarted"),
        RankJoined(entry=entry(1)),
    ]


def test_a_suspected_rank_claimed_elsewhere_is_gone(members: Membership) -> None:
    assert announce(members, 1, 5, node=2) == [
        RankGone(entry=entry(1), reason=f"{REASON}; it came back restarted"),
        RankJoined(entry=entry(1, node=2)),
    ]
    members.detach("j", 0, "left")
    members.attach("j", 2, 3, user=ALICE)  # rank 2's trainer restarted here
    assert not members.has_suspects("j")


def test_a_node_back_and_reset_again_is_suspected_anew_but_its_missing_ranks_are_not(
    members: Membership,
) -> None:
    members.peer_up(PEER, 7)
    members.peer_down(PEER, "data link lost", 3.0, 7)  # back, reset again
    assert members.on_timer(DOWN_AFTER) == [
        RankGone(entry=entry(1), reason=REASON),
        RankGone(entry=entry(2), reason=REASON),
    ]
    assert members.on_timer(3.0 + DOWN_AFTER) == [NodeGone(node=PEER, reason="data link lost")]


def test_when_a_suspicion_runs_out_with_no_rank_of_its_job_known_the_job_is_over() -> None:
    """Its other suspicions end with it: a later job of that name must not lose ranks to them."""
    members = Membership(node=HERE, down_after=DOWN_AFTER)
    announce(members, 1, 7)
    announce(members, 2, 7, node=2)
    members.peer_down(PEER, "reset", 0.0, 7)
    members.peer_down(2, "reset", 1.0, 7)
    assert members.on_timer(DOWN_AFTER) == [
        NodeGone(node=PEER, reason="reset"),
        RankGone(entry=entry(1), reason="node 1 is reset"),
        RankGone(entry=entry(2, node=2), reason="node 2 is reset"),
    ]
    assert members.on_timer(1.0 + DOWN_AFTER) == [NodeGone(node=2, reason="reset")]


def test_down_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="down_after"):
        Membership(node=HERE, down_after=0.0)
