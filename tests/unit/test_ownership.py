"""Job ownership rules: who may join a job, who may see it, and how a grant is written."""

from __future__ import annotations

import pytest

from fabricd.engines.ownership import JobGrant, Ownership, User

ALICE = User(uid=1000, gids=frozenset({1000}))
BOB = User(uid=1001, gids=frozenset({1001, 2000, 3000}))
ROOT = User(uid=0, gids=frozenset({0}))


@pytest.mark.parametrize(
    ("text", "pattern", "gid"),
    [
        ("train-*:2000", "train-*", 2000),
        ("exact:0", "exact", 0),
        ("ns:job:7", "ns:job", 7),  # split at the last colon: patterns may hold colons
    ],
)
def test_a_grant_reads_pattern_colon_gid(text: str, pattern: str, gid: int) -> None:
    assert JobGrant.parse(text) == JobGrant(pattern=pattern, gid=gid)


@pytest.mark.parametrize("text", ["train", ":2000", "train:", "train:staff", "train:-1", "x: 1"])
def test_a_malformed_grant_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        JobGrant.parse(text)


def test_a_grant_covers_the_whole_name_by_glob() -> None:
    grant = JobGrant(pattern="train-*", gid=1)
    assert grant.covers("train-a")
    assert grant.covers("train-")
    assert not grant.covers("xtrain-a")  # the whole name, not a part of it
    assert not grant.covers("Train-a")  # case matters, as in job names
    assert JobGrant(pattern="exp?", gid=1).covers("exp1")
    assert not JobGrant(pattern="exp", gid=1).covers("exp1")


def test_only_the_owner_joins_without_a_grant() -> None:
    rules = Ownership()
    assert rules.may_join(ALICE, "demo", owner=ALICE.uid)
    assert not rules.may_join(BOB, "demo", owner=ALICE.uid)
    assert not rules.may_join(ROOT, "demo", owner=ALICE.uid)  # no exemption for root


def test_a_grant_lets_members_of_its_group_join_matching_jobs() -> None:
    rules = Ownership(grants=(JobGrant(pattern="team-*", gid=2000),))
    assert rules.may_join(BOB, "team-x", owner=ALICE.uid)
    assert not rules.may_join(BOB, "demo", owner=ALICE.uid)  # not a job the grant names
    assert not rules.may_join(ALICE, "team-x", owner=BOB.uid)  # ALICE is not in 2000


def test_root_the_daemons_uid_and_admin_groups_see_everything() -> None:
    rules = Ownership(admin_gids=frozenset({3000}), superusers=frozenset({0, 999}))
    assert rules.sees_everything(ROOT)
    assert rules.sees_everything(User(uid=999))
    assert rules.sees_everything(BOB)  # through admin group 3000
    assert not rules.sees_everything(ALICE)
    assert rules.may_see(BOB, "demo", owner=ALICE.uid)
    assert not rules.may_join(BOB, "demo", owner=ALICE.uid)  # seeing is not joining


def test_whoever_may_join_a_job_may_see_it() -> None:
    rules = Ownership(grants=(JobGrant(pattern="*", gid=2000),))
    assert rules.may_see(ALICE, "demo", owner=ALICE.uid)
    assert rules.may_see(BOB, "demo", owner=ALICE.uid)
    assert not rules.may_see(ALICE, "demo", owner=BOB.uid)


def test_the_refusal_names_the_owner_and_the_setting() -> None:
    message = Ownership().refusal(BOB, "demo", ALICE.uid)
    assert "job 'demo' belongs to uid 1000" in message
    assert "uid 1001" in message
    assert "'demo:<gid>' to job_groups" in message
