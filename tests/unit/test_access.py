"""What of ``status`` a client sees: its own clients, the jobs it may see, and every peer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.daemon.access import redact
from fabricd.engines.ownership import JobGrant, Ownership, User

if TYPE_CHECKING:
    from fabricd.wire import Meta

ALICE = User(uid=1000, gids=frozenset({1000}))
BOB = User(uid=1001, gids=frozenset({1001}))
RULES = Ownership(grants=(JobGrant(pattern="shared", gid=1001),), admin_gids=frozenset({4}))


def status() -> Meta:
    """A daemon's status with rows of root's, ALICE's and BOB's jobs and control clients."""
    return {
        "node": 0,
        "peers": [{"node": 1, "state": "up"}],
        "clients": [
            {"id": 1, "uid": 0, "pid": 10, "job": "root-job", "rank": 0, "owner": 0},
            {"id": 2, "uid": 1000, "pid": 11, "job": "alice-job", "rank": 0, "owner": 1000},
            {"id": 3, "uid": 1000, "pid": 12, "job": None, "rank": None},
            {"id": 4, "uid": 0, "pid": 13, "job": None, "rank": None},
            {"id": 5, "uid": 0, "pid": 14, "job": "shared", "rank": 1, "owner": 0},
        ],
        "ranks": [
            {"job": "alice-job", "rank": 0, "size": 2, "node": 0, "owner": 1000},
            {"job": "alice-job", "rank": 1, "size": 2, "node": 1, "owner": 1000},
            {"job": "root-job", "rank": 0, "size": 1, "node": 0, "owner": 0},
            {"job": "shared", "rank": 1, "size": 2, "node": 0, "owner": 0},
        ],
        "counters": {"refused_joins": 0},
    }


def test_a_user_sees_its_own_clients_and_jobs_and_every_peer() -> None:
    seen = status()
    redact(seen, ALICE, RULES)
    assert [row["id"] for row in seen["clients"]] == [2, 3]
    assert [(row["job"], row["rank"]) for row in seen["ranks"]] == [
        ("alice-job", 0),
        ("alice-job", 1),  # on another node: still ALICE's job
    ]
    assert seen["peers"] == status()["peers"]
    assert seen["counters"] == status()["counters"]
    assert seen["hidden"] == {"clients": 3, "ranks": 2}


def test_a_granted_group_sees_the_job_it_may_join() -> None:
    seen = status()
    redact(seen, BOB, RULES)
    assert [row["id"] for row in seen["clients"]] == [5]  # root's rank of "shared"
    assert [row["job"] for row in seen["ranks"]] == ["shared"]
    assert seen["hidden"] == {"clients": 4, "ranks": 3}


def test_root_and_admin_groups_see_everything() -> None:
    for user in (User(uid=0), User(uid=1002, gids=frozenset({4}))):
        seen = status()
        redact(seen, user, RULES)
        assert seen == {**status(), "hidden": {}}
