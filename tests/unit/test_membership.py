"""Membership: the rank table, the claims it refuses, and the news it gives of every change."""

from __future__ import annotations

import pytest

from fabricd.engines.actions import Broadcast, Notice, SendFrame
from fabricd.engines.membership import (
    Membership,
    MembershipStatistics,
    RankEntry,
    RankJoined,
    RankLeft,
)
from fabricd.errors import FabricError, UsageError
from fabricd.frames import Announce

HERE = 0


@pytest.fixture
def members() -> Membership:
    return Membership(node=HERE)


def announce(
    members: Membership, node: int, rank: int, size: int = 4, *, job: str = "demo", present=True
) -> list:
    frame = Announce(job=job, rank=rank, size=size, present=present)
    return members.on_announce(node, frame)


def entry(rank: int, node: int, size: int = 4, job: str = "demo") -> RankEntry:
    return RankEntry(job=job, rank=rank, size=size, node=node)


# -- local clients ----------------------------------------------------------------------------
def test_attach_announces_the_rank_and_reports_it_joined(members: Membership) -> None:
    actions = members.attach("demo", 1, 4)
    mine = entry(1, HERE)
    assert actions == [
        Broadcast(frame=Announce(job="demo", rank=1, size=4, present=True)),
        RankJoined(entry=mine),
    ]
    assert members.lookup("demo", 1) == mine
    assert members.local() == [mine]


def test_detach_announces_the_departure_and_reports_a_clean_leave(members: Membership) -> None:
    members.attach("demo", 1, 4)
    actions = members.detach("demo", 1, "rank 1 of job 'demo' disconnected")
    assert actions == [
        Broadcast(frame=Announce(job="demo", rank=1, size=4, present=False)),
        RankLeft(entry=entry(1, HERE), reason="rank 1 of job 'demo' disconnected", lost=False),
    ]
    assert members.lookup("demo", 1) is None
    assert members.detach("demo", 1, "again") == []  # idempotent


def test_detach_of_a_rank_hosted_elsewhere_does_nothing(members: Membership) -> None:
    announce(members, 2, 1)
    assert members.detach("demo", 1, "no such client") == []
    assert members.lookup("demo", 1) == entry(1, 2)


# -- peers ------------------------------------------------------------------------------------
def test_an_announcement_adds_a_rank_once(members: Membership) -> None:
    assert announce(members, 2, 1) == [RankJoined(entry=entry(1, 2))]
    assert members.lookup("demo", 1) == entry(1, 2)
    assert members.lookup("demo", 0) is None
    assert members.lookup("other", 1) is None
    assert members.job_size("demo") == 4
    assert members.job_size("other") is None
    assert announce(members, 2, 1) == []  # a peer repeating itself changes nothing
    assert members.entries() == [entry(1, 2)]


def test_an_absent_announcement_removes_only_what_that_node_hosts(members: Membership) -> None:
    announce(members, 2, 1)
    assert announce(members, 3, 1, present=False) == []  # not node 3's rank
    assert members.lookup("demo", 1) == entry(1, 2)
    [left] = announce(members, 2, 1, present=False)
    assert left == RankLeft(
        entry=entry(1, 2), reason="rank 1 of job 'demo' on node 2 disconnected", lost=False
    )
    assert members.lookup("demo", 1) is None
    assert announce(members, 2, 1, present=False) == []  # idempotent
    assert members.job_size("demo") is None  # the last rank took the job's size with it


def test_a_released_rank_may_be_claimed_again_elsewhere(members: Membership) -> None:
    announce(members, 1, 0, 2)
    announce(members, 1, 0, 2, present=False)
    assert announce(members, 3, 0, 2) == [RankJoined(entry=entry(0, 3, 2))]


def test_a_new_size_is_accepted_once_the_job_is_empty(members: Membership) -> None:
    announce(members, 1, 0, 2)
    announce(members, 1, 0, 2, present=False)
    assert announce(members, 1, 5, 8) == [RankJoined(entry=entry(5, 1, 8))]


def test_peer_up_tells_the_peer_every_local_rank(members: Membership) -> None:
    members.attach("demo", 3, 4)
    members.attach("demo", 0, 4)
    announce(members, 1, 1)
    assert members.peer_up(5) == [
        SendFrame(node=5, frame=Announce(job="demo", rank=r, size=4, present=True)) for r in (0, 3)
    ]
    assert Membership(node=7).peer_up(5) == []


def test_peer_down_loses_every_rank_the_node_hosted(members: Membership) -> None:
    gone = [entry(0, 1), entry(2, 1), entry(0, 1, 1, job="other")]
    for e in gone:
        announce(members, 1, e.rank, e.size, job=e.job)
    announce(members, 2, 1)
    actions = members.peer_down(1, "restarted")
    assert actions == [
        RankLeft(entry=e, reason="node 1 is restarted", lost=True)
        for e in sorted(gone, key=lambda e: (e.job, e.rank))
    ]
    assert members.entries() == [entry(1, 2)]
    assert members.job_size("other") is None
    assert members.peer_down(1, "down") == []


def test_local_and_entries_are_sorted_by_job_then_rank(members: Membership) -> None:
    members.attach("demo", 3, 4)
    members.attach("demo", 0, 4)
    announce(members, 1, 1)
    announce(members, 1, 0, 1, job="zeta")
    announce(members, 2, 2, 3, job="alpha")
    assert members.local() == [entry(0, HERE), entry(3, HERE)]
    assert [(e.job, e.rank) for e in members.entries()] == [
        ("alpha", 2),
        ("demo", 0),
        ("demo", 1),
        ("demo", 3),
        ("zeta", 0),
    ]


def test_statistics_count_ranks_local_ranks_and_jobs(members: Membership) -> None:
    assert members.statistics() == MembershipStatistics(ranks=0, local_ranks=0, jobs=0)
    members.attach("demo", 0, 4)
    announce(members, 1, 1)
    announce(members, 1, 0, 1, job="other")
    assert members.statistics() == MembershipStatistics(ranks=3, local_ranks=1, jobs=2)
    members.peer_down(1, "down")
    assert members.statistics() == MembershipStatistics(ranks=1, local_ranks=1, jobs=1)


# -- conflicts --------------------------------------------------------------------------------
def test_a_rank_hosted_elsewhere_cannot_be_attached(members: Membership) -> None:
    announce(members, 2, 1)
    with pytest.raises(UsageError, match=r"rank 1 of job 'demo' is already running on node 2"):
        members.attach("demo", 1, 4)
    assert members.lookup("demo", 1) == entry(1, 2)


def test_a_conflicting_announcement_is_ignored_with_a_notice(members: Membership) -> None:
    announce(members, 2, 1)
    [notice] = announce(members, 3, 1)
    assert isinstance(notice, Notice)
    assert "ignored announcement from node 3" in notice.message
    assert "already running on node 2" in notice.message
    assert members.lookup("demo", 1) == entry(1, 2)


def test_a_rank_cannot_connect_twice_to_this_daemon(members: Membership) -> None:
    members.attach("demo", 1, 4)
    with pytest.raises(UsageError, match="already connected to this daemon"):
        members.attach("demo", 1, 4)


def test_a_remote_node_cannot_take_a_local_rank(members: Membership) -> None:
    members.attach("demo", 1, 4)
    [notice] = announce(members, 5, 1)
    assert isinstance(notice, Notice)
    assert f"already running on node {HERE}" in notice.message
    assert members.local() == [entry(1, HERE)]


def test_every_rank_must_agree_on_the_job_size(members: Membership) -> None:
    announce(members, 1, 0)
    with pytest.raises(UsageError) as info:
        members.attach("demo", 1, 8)
    message = str(info.value)
    assert "size 4" in message
    assert "not 8" in message
    assert "WORLD_SIZE" in message  # says how to fix it
    [notice] = announce(members, 2, 1, 8)
    assert isinstance(notice, Notice)
    assert "not 8" in notice.message
    assert members.lookup("demo", 1) is None
    assert announce(members, 2, 1, 8, job="other") == [RankJoined(entry=entry(1, 2, 8, "other"))]


@pytest.mark.parametrize(("rank", "size"), [(-1, 4), (4, 4), (9, 4), (0, 0)])
def test_a_rank_outside_the_job_is_refused(members: Membership, rank: int, size: int) -> None:
    with pytest.raises(UsageError, match=rf"rank {rank} is outside job 'demo' of size {size}"):
        members.attach("demo", rank, size)
    assert members.entries() == []


def test_usage_errors_are_fabric_errors(members: Membership) -> None:
    announce(members, 1, 0, 1)
    with pytest.raises(FabricError):
        members.attach("demo", 0, 1)


# -- claims that lose a race ------------------------------------------------------------------
# A rank that restarts on another node (or a job restarted with another placement or size)
# sends its departure and its arrival on two different links, so a third daemon can hear the
# arrival first.  Ignoring it for good would leave that daemon blind to the rank: its sends fail
# with no_such_rank and the rank's receives from it wait forever.
def test_an_ignored_claim_takes_effect_once_the_rank_it_lost_to_leaves(
    members: Membership,
) -> None:
    announce(members, 1, 2)
    [notice] = announce(members, 2, 2)  # rank 2 restarted on node 2; node 1's news is late
    assert isinstance(notice, Notice)
    assert announce(members, 1, 2, present=False) == [
        RankLeft(
            entry=entry(2, 1), reason="rank 2 of job 'demo' on node 1 disconnected", lost=False
        ),
        RankJoined(entry=entry(2, 2)),
    ]
    assert members.lookup("demo", 2) == entry(2, 2)


def test_an_ignored_claim_takes_effect_when_the_winners_node_goes_down(
    members: Membership,
) -> None:
    announce(members, 1, 2)
    announce(members, 2, 2)
    assert members.peer_down(1, "down") == [
        RankLeft(entry=entry(2, 1), reason="node 1 is down", lost=True),
        RankJoined(entry=entry(2, 2)),
    ]


def test_a_local_rank_that_leaves_hands_its_rank_to_the_ignored_claim(
    members: Membership,
) -> None:
    members.attach("demo", 2, 4)
    announce(members, 5, 2)
    actions = members.detach("demo", 2, "rank 2 of job 'demo' disconnected")
    assert actions[-1] == RankJoined(entry=entry(2, 5))
    assert members.local() == []


def test_a_new_size_ignored_while_the_old_job_ran_takes_effect_once_it_is_gone(
    members: Membership,
) -> None:
    announce(members, 1, 0, 2)
    announce(members, 1, 1, 2)
    announce(members, 2, 3, 8)  # the job restarted with 8 ranks; node 1's news is late
    assert announce(members, 1, 0, 2, present=False)[1:] == []  # size 2 still stands
    assert announce(members, 1, 1, 2, present=False)[1:] == [RankJoined(entry=entry(3, 2, 8))]
    assert members.job_size("demo") == 8


def test_an_ignored_claim_is_dropped_when_its_node_retracts_it_or_goes_down(
    members: Membership,
) -> None:
    announce(members, 1, 2)
    announce(members, 2, 2)
    announce(members, 3, 2)
    assert announce(members, 2, 2, present=False) == []  # node 2's client left meanwhile
    assert members.peer_down(3, "down") == []  # and node 3 went down
    [left] = announce(members, 1, 2, present=False)
    assert isinstance(left, RankLeft)
    assert members.entries() == []
    assert members._ignored == {}


def test_claims_that_can_never_hold_are_not_kept(members: Membership) -> None:
    announce(members, 1, 7, 4)  # outside the job
    assert members._ignored == {}
