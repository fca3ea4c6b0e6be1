"""The rank table: which node hosts which rank of which job, and the claims it refuses."""

from __future__ import annotations

import pytest

from fabricd.engines.routing import RankEntry, RankTable
from fabricd.errors import FabricError, UsageError

HERE = 0


@pytest.fixture
def routes() -> RankTable:
    return RankTable(node=HERE)


def test_claim_then_lookup(routes: RankTable) -> None:
    entry = routes.claim("demo", 1, 4, node=2)
    assert entry == RankEntry(job="demo", rank=1, size=4, node=2)
    assert routes.lookup("demo", 1) == entry
    assert routes.lookup("demo", 0) is None
    assert routes.lookup("other", 1) is None
    assert routes.job_size("demo") == 4
    assert routes.job_size("other") is None


def test_release_forgets_only_what_the_node_hosts(routes: RankTable) -> None:
    entry = routes.claim("demo", 1, 4, node=2)
    assert routes.release("demo", 1, node=3) is None  # not node 3's rank
    assert routes.lookup("demo", 1) == entry
    assert routes.release("demo", 1, node=2) == entry
    assert routes.lookup("demo", 1) is None
    assert routes.release("demo", 1, node=2) is None  # idempotent
    assert routes.job_size("demo") is None  # the last rank took the job's size with it


def test_a_released_rank_may_be_claimed_again_elsewhere(routes: RankTable) -> None:
    routes.claim("demo", 0, 2, node=1)
    routes.release("demo", 0, node=1)
    assert routes.claim("demo", 0, 2, node=3).node == 3


def test_a_new_size_is_accepted_once_the_job_is_empty(routes: RankTable) -> None:
    routes.claim("demo", 0, 2, node=1)
    routes.release("demo", 0, node=1)
    assert routes.claim("demo", 5, 8, node=1).size == 8


def test_drop_node_forgets_every_rank_it_hosted(routes: RankTable) -> None:
    a = routes.claim("demo", 0, 4, node=1)
    b = routes.claim("demo", 2, 4, node=1)
    c = routes.claim("other", 0, 1, node=1)
    kept = routes.claim("demo", 1, 4, node=2)
    assert sorted(routes.drop_node(1), key=lambda e: (e.job, e.rank)) == [a, b, c]
    assert routes.entries() == [kept]
    assert routes.drop_node(1) == []


def test_local_lists_the_ranks_of_this_node(routes: RankTable) -> None:
    mine = [routes.claim("demo", r, 4, node=HERE) for r in (0, 3)]
    routes.claim("demo", 1, 4, node=1)
    assert sorted(routes.local(), key=lambda e: e.rank) == mine


def test_entries_are_sorted_by_job_then_rank(routes: RankTable) -> None:
    routes.claim("zeta", 0, 1, node=1)
    routes.claim("alpha", 2, 3, node=1)
    routes.claim("alpha", 0, 3, node=2)
    assert [(e.job, e.rank) for e in routes.entries()] == [("alpha", 0), ("alpha", 2), ("zeta", 0)]


def test_a_peer_repeating_its_announcement_is_harmless(routes: RankTable) -> None:
    first = routes.claim("demo", 1, 4, node=2)
    assert routes.claim("demo", 1, 4, node=2) == first
    assert routes.entries() == [first]


# -- conflicts --------------------------------------------------------------------------------
def test_a_rank_hosted_elsewhere_cannot_be_claimed(routes: RankTable) -> None:
    routes.claim("demo", 1, 4, node=2)
    with pytest.raises(UsageError, match=r"rank 1 of job 'demo' is already running on node 2"):
        routes.claim("demo", 1, 4, node=HERE)
    with pytest.raises(UsageError, match="already running on node 2"):
        routes.claim("demo", 1, 4, node=3)
    assert routes.lookup("demo", 1) == RankEntry(job="demo", rank=1, size=4, node=2)


def test_a_rank_cannot_connect_twice_to_this_daemon(routes: RankTable) -> None:
    routes.claim("demo", 1, 4, node=HERE)
    with pytest.raises(UsageError, match="already connected to this daemon"):
        routes.claim("demo", 1, 4, node=HERE)


def test_a_remote_node_cannot_take_a_local_rank(routes: RankTable) -> None:
    routes.claim("demo", 1, 4, node=HERE)
    with pytest.raises(UsageError, match=f"already running on node {HERE}"):
        routes.claim("demo", 1, 4, node=5)


def test_every_rank_must_agree_on_the_job_size(routes: RankTable) -> None:
    routes.claim("demo", 0, 4, node=1)
    with pytest.raises(UsageError) as info:
        routes.claim("demo", 1, 8, node=2)
    message = str(info.value)
    assert "size 4" in message
    assert "not 8" in message
    assert "WORLD_SIZE" in message  # says how to fix it
    assert routes.lookup("demo", 1) is None
    assert routes.claim("other", 1, 8, node=2).size == 8  # other jobs are independent


@pytest.mark.parametrize(("rank", "size"), [(-1, 4), (4, 4), (9, 4), (0, 0)])
def test_a_rank_outside_the_job_is_refused(routes: RankTable, rank: int, size: int) -> None:
    with pytest.raises(UsageError, match=rf"rank {rank} is outside job 'demo' of size {size}"):
        routes.claim("demo", rank, size, node=1)
    assert routes.entries() == []


def test_usage_errors_are_fabric_errors(routes: RankTable) -> None:
    routes.claim("demo", 0, 1, node=1)
    with pytest.raises(FabricError):
        routes.claim("demo", 0, 1, node=2)
