"""Membership: the rank table, the claims it refuses, and the news it gives of every change."""

from __future__ import annotations

import pytest

from fabricd.engines.actions import Broadcast, Notice, SendFrame
from fabricd.engines.membership import (
    MAX_RANKS_PER_PEER,
    Membership,
    MembershipStatistics,
    RankEntry,
    RankGone,
    RankJoined,
    RankLeft,
    RankSuspected,
)
from fabricd.engines.ownership import JobGrant, Ownership, User
from fabricd.errors import FabricError, PermissionDenied, RemoteProtocolError, UsageError
from fabricd.frames.membership import Announce

HERE = 0
ALICE = User(uid=1000, gids=frozenset({1000}))  #: owns "demo" in most tests


@pytest.fixture
def members() -> Membership:
    return Membership(node=HERE)


def announce(
    members: Membership,
    node: int,
    rank: int,
    size: int = 4,
    *,
    job: str = "demo",
    present: bool = True,
    owner: int = ALICE.uid,
) -> list:
    frame = Announce(job=job, rank=rank, size=size, present=present, owner=owner)
    return members.on_announce(node, frame)


def entry(rank: int, node: int, size: int = 4, job: str = "demo") -> RankEntry:
    return RankEntry(job=job, rank=rank, size=size, node=node)


# -- local clients ----------------------------------------------------------------------------
def test_attach_announces_the_rank_and_reports_it_joined(members: Membership) -> None:
    actions = members.attach("demo", 1, 4, user=ALICE)
    mine = entry(1, HERE)
    assert actions == [
        Broadcast(frame=Announce(job="demo", rank=1, size=4, present=True, owner=ALICE.uid)),
        RankJoined(entry=mine),
    ]
    assert members.lookup("demo", 1) == mine
    assert members.local() == [mine]


def test_detach_announces_the_departure_and_reports_a_clean_leave(members: Membership) -> None:
    members.attach("demo", 1, 4, user=ALICE)
    actions = members.detach("demo", 1, "rank 1 of job 'demo' disconnected")
    assert actions == [
        Broadcast(frame=Announce(job="demo", rank=1, size=4, present=False, owner=ALICE.uid)),
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
    members.attach("demo", 3, 4, user=ALICE)
    members.attach("demo", 0, 4, user=ALICE)
    announce(members, 1, 1)
    assert members.peer_up(5) == [
        SendFrame(node=5, frame=Announce(job="demo", rank=r, size=4, present=True, owner=ALICE.uid))
        for r in (0, 3)
    ]
    assert Membership(node=7).peer_up(5) == []


def test_peer_down_loses_every_rank_the_node_hosted(members: Membership) -> None:
    gone = [entry(0, 1), entry(2, 1), entry(0, 1, 1, job="other")]
    for e in gone:
        announce(members, 1, e.rank, e.size, job=e.job)
    announce(members, 2, 1)
    actions = members.peer_down(1, "restarted", 0.0)
    assert actions == [
        event
        for e in sorted(gone, key=lambda e: (e.job, e.rank))
        for event in (
            RankLeft(entry=e, reason="node 1 is restarted", lost=True),
            RankSuspected(entry=e, reason="node 1 is restarted"),
        )
    ]
    assert members.entries() == [entry(1, 2)]
    assert members.job_size("other") is None
    assert members.peer_down(1, "down", 0.0) == []


def test_local_and_entries_are_sorted_by_job_then_rank(members: Membership) -> None:
    members.attach("demo", 3, 4, user=ALICE)
    members.attach("demo", 0, 4, user=ALICE)
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
    assert members.statistics() == MembershipStatistics(
        ranks=0, local_ranks=0, jobs=0, refused_joins=0, refused_announcements=0
    )
    members.attach("demo", 0, 4, user=ALICE)
    announce(members, 1, 1)
    announce(members, 1, 0, 1, job="other")
    assert members.statistics() == MembershipStatistics(
        ranks=3, local_ranks=1, jobs=2, refused_joins=0, refused_announcements=0
    )
    members.peer_down(1, "down", 0.0)
    assert members.statistics() == MembershipStatistics(
        ranks=1, local_ranks=1, jobs=1, refused_joins=0, refused_announcements=0
    )


# -- conflicts --------------------------------------------------------------------------------
def test_a_rank_hosted_elsewhere_cannot_be_attached(members: Membership) -> None:
    announce(members, 2, 1)
    with pytest.raises(UsageError, match=r"rank 1 of job 'demo' is already running on node 2"):
        members.attach("demo", 1, 4, user=ALICE)
    assert members.lookup("demo", 1) == entry(1, 2)


def test_a_conflicting_announcement_is_ignored_with_a_notice(members: Membership) -> None:
    announce(members, 2, 1)
    [notice] = announce(members, 3, 1)
    assert isinstance(notice, Notice)
    assert "ignored announcement from node 3" in notice.message
    assert "already running on node 2" in notice.message
    assert members.lookup("demo", 1) == entry(1, 2)


def test_a_rank_cannot_connect_twice_to_this_daemon(members: Membership) -> None:
    members.attach("demo", 1, 4, user=ALICE)
    with pytest.raises(UsageError, match="already connected to this daemon"):
        members.attach("demo", 1, 4, user=ALICE)


def test_a_remote_node_cannot_take_a_local_rank(members: Membership) -> None:
    members.attach("demo", 1, 4, user=ALICE)
    [notice] = announce(members, 5, 1)
    assert isinstance(notice, Notice)
    assert f"already running on node {HERE}" in notice.message
    assert members.local() == [entry(1, HERE)]


def test_every_rank_must_agree_on_the_job_size(members: Membership) -> None:
    announce(members, 1, 0)
    with pytest.raises(UsageError) as info:
        members.attach("demo", 1, 8, user=ALICE)
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
        members.attach("demo", rank, size, user=ALICE)
    assert members.entries() == []


def test_usage_errors_are_fabric_errors(members: Membership) -> None:
    announce(members, 1, 0, 1)
    with pytest.raises(FabricError):
        members.attach("demo", 0, 1, user=ALICE)


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
    assert members.peer_down(1, "down", 0.0) == [
        RankLeft(entry=entry(2, 1), reason="node 1 is down", lost=True),
        RankSuspected(entry=entry(2, 1), reason="node 1 is down"),
        # the rank is taken elsewhere: the one node 1 had is gone
        RankGone(entry=entry(2, 1), reason="node 1 is down; it came back restarted"),
        RankJoined(entry=entry(2, 2)),
    ]


def test_a_local_rank_that_leaves_hands_its_rank_to_the_ignored_claim(
    members: Membership,
) -> None:
    members.attach("demo", 2, 4, user=ALICE)
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
    assert members.peer_down(3, "down", 0.0) == []  # and node 3 went down
    [left] = announce(members, 1, 2, present=False)
    assert isinstance(left, RankLeft)
    assert members.entries() == []
    assert members._ignored == {}


def test_claims_that_can_never_hold_are_not_kept(members: Membership) -> None:
    announce(members, 1, 7, 4)  # outside the job
    assert members._ignored == {}


# -- owners -----------------------------------------------------------------------------------
# The first client to open a job makes its uid the job's owner; another uid joins only through a
# job_groups grant.  Every ANNOUNCE carries the owner, so a peer learns it with the ranks.
BOB = User(uid=1001, gids=frozenset({1001, 2000}))  #: in group 2000
ROOT = User(uid=0, gids=frozenset({0}))


def owned(grants: str = "") -> Membership:
    """A membership engine whose daemon grants ``grants`` (``"pattern:gid,..."``)."""
    rules = Ownership(grants=tuple(JobGrant.parse(g) for g in grants.split(",") if g))
    return Membership(node=HERE, ownership=rules)


def test_the_first_client_to_open_a_job_owns_it(members: Membership) -> None:
    assert members.owner("demo") is None
    [broadcast, _] = members.attach("demo", 0, 4, user=ALICE)
    assert members.owner("demo") == ALICE.uid
    assert isinstance(broadcast, Broadcast)
    assert broadcast.frame == Announce(job="demo", rank=0, size=4, present=True, owner=ALICE.uid)


def test_another_uid_cannot_join_the_job(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    with pytest.raises(PermissionDenied) as info:
        members.attach("demo", 1, 4, user=BOB)
    message = str(info.value)
    assert f"belongs to uid {ALICE.uid}" in message
    assert "job_groups" in message  # the setting that would let BOB in
    assert info.value.code == "permission"
    assert members.lookup("demo", 1) is None
    assert members.statistics().refused_joins == 1


def test_a_refused_user_learns_nothing_of_the_jobs_ranks_or_size(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    for rank, size in [(0, 4), (1, 8), (9, 4)]:  # taken, wrong size, outside: all the same
        with pytest.raises(PermissionDenied):
            members.attach("demo", rank, size, user=BOB)
    assert members.statistics().refused_joins == 3


def test_root_gets_no_exemption_from_joining(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    with pytest.raises(PermissionDenied):
        members.attach("demo", 1, 4, user=ROOT)


def test_a_job_known_from_a_peer_is_owned_here_too(members: Membership) -> None:
    announce(members, 2, 0, owner=ALICE.uid)
    assert members.owner("demo") == ALICE.uid
    with pytest.raises(PermissionDenied):
        members.attach("demo", 1, 4, user=BOB)
    members.attach("demo", 1, 4, user=ALICE)


def test_a_group_grant_lets_another_uid_join_and_the_owner_stays() -> None:
    members = owned("dem*:2000")
    members.attach("demo", 0, 4, user=ALICE)
    [broadcast, joined] = members.attach("demo", 1, 4, user=BOB)
    assert joined == RankJoined(entry=entry(1, HERE))
    assert isinstance(broadcast, Broadcast)
    assert broadcast.frame == Announce(job="demo", rank=1, size=4, present=True, owner=ALICE.uid)
    assert members.owner("demo") == ALICE.uid
    members.detach("demo", 0, "rank 0 left")
    assert members.owner("demo") == ALICE.uid  # BOB's rank keeps ALICE's job alive


@pytest.mark.parametrize("grants", ["other:2000", "demo:3000", "d:2000", "demo2*:2000"])
def test_a_grant_for_another_job_or_group_does_not_let_bob_in(grants: str) -> None:
    members = owned(grants)
    members.attach("demo", 0, 4, user=ALICE)
    with pytest.raises(PermissionDenied):
        members.attach("demo", 1, 4, user=BOB)


def test_the_job_is_released_when_its_last_rank_leaves(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    members.attach("demo", 1, 4, user=ALICE)
    members.detach("demo", 0, "left")
    members.detach("demo", 1, "left")
    assert members.owner("demo") is None
    members.attach("demo", 0, 2, user=BOB)  # the name is free: any user, any size
    assert members.owner("demo") == BOB.uid


def test_a_job_with_ranks_left_on_another_node_is_not_released(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    announce(members, 2, 1, owner=ALICE.uid)
    members.detach("demo", 0, "left")  # the last local rank
    with pytest.raises(PermissionDenied):
        members.attach("demo", 0, 4, user=BOB)
    members.peer_down(2, "down", 0.0)  # its node's ranks are lost: the job is gone
    members.attach("demo", 0, 4, user=BOB)


def test_a_peer_that_names_another_owner_is_ignored_with_a_notice(members: Membership) -> None:
    members.attach("demo", 0, 4, user=ALICE)
    [notice] = announce(members, 2, 1, owner=BOB.uid)  # BOB opened "demo" there at once
    assert isinstance(notice, Notice)
    assert f"belongs to uid {ALICE.uid} on this fabric, not uid {BOB.uid}" in notice.message
    assert members.lookup("demo", 1) is None
    # the job here is gone: BOB's claim, kept while node 2 stands by it, takes effect
    actions = members.detach("demo", 0, "rank 0 left")
    assert actions[-1] == RankJoined(entry=entry(1, 2))
    assert members.owner("demo") == BOB.uid


def test_peer_up_announces_each_rank_with_its_jobs_owner() -> None:
    members = owned("*:2000")
    members.attach("demo", 0, 4, user=ALICE)
    members.attach("demo", 1, 4, user=BOB)
    members.attach("solo", 0, 1, user=BOB)
    frames = [a.frame for a in members.peer_up(5) if isinstance(a, SendFrame)]
    assert [(f.job, f.rank, f.owner) for f in frames if isinstance(f, Announce)] == [
        ("demo", 0, ALICE.uid),
        ("demo", 1, ALICE.uid),
        ("solo", 0, BOB.uid),
    ]


# -- what a peer may make this daemon hold ----------------------------------------------------
def test_a_peer_announcing_past_max_ranks_per_peer_is_refused_and_counted() -> None:
    members = Membership(node=HERE, max_ranks_per_peer=3)
    for rank in range(3):
        assert announce(members, 1, rank, size=10_000, job="flood")
    assert announce(members, 1, 0, size=10_000, job="flood") == []  # held already: no news
    with pytest.raises(RemoteProtocolError, match=r"max_ranks_per_peer \(3\)"):
        announce(members, 1, 3, size=10_000, job="flood")
    with pytest.raises(RemoteProtocolError):  # a new job is a new rank too
        announce(members, 1, 0, job="another")
    assert members.statistics().refused_announcements == 2
    assert members.statistics().ranks == 3  # nothing past the bound was kept
    assert announce(members, 2, 0, job="other")  # another peer has its own room
    announce(members, 1, 2, size=10_000, job="flood", present=False)
    assert announce(members, 1, 3, size=10_000, job="flood")  # room again once one left


def test_ignored_claims_count_towards_a_peers_bound() -> None:
    members = Membership(node=HERE, max_ranks_per_peer=2)
    announce(members, 1, 0, size=4)  # node 1's rank 0 of demo (size 4)
    assert of_kind(Notice, announce(members, 2, 0, size=8))  # ignored, but held
    assert of_kind(Notice, announce(members, 2, 1, size=8))
    with pytest.raises(RemoteProtocolError):
        announce(members, 2, 2, size=8)
    assert of_kind(Notice, announce(members, 2, 1, size=8))  # a claim it holds: not new


def test_a_reset_peer_gets_its_room_back() -> None:
    members = Membership(node=HERE, max_ranks_per_peer=2)
    announce(members, 1, 0)
    announce(members, 1, 1)
    members.peer_down(1, "reset", 0.0)
    assert announce(members, 1, 2)
    assert announce(members, 1, 3)


def test_twenty_thousand_announcements_hold_at_most_the_bound() -> None:
    members = Membership(node=HERE)  # the default bound
    refused = 0
    for rank in range(20_000):
        try:
            announce(members, 1, rank, size=2**31 - 1, job="flood")
        except RemoteProtocolError:
            refused += 1
    assert members.statistics().ranks == MAX_RANKS_PER_PEER
    assert refused == 20_000 - MAX_RANKS_PER_PEER


def of_kind(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]
