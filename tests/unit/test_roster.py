"""The roster engine (fabricd/engines/roster.py): slot choice, the view from etcd's
registrations and watch events, and what a partition changes, on a fake clock."""

from __future__ import annotations

import json

import pytest

from fabricd.engines.roster import (
    FIRST_RETRY,
    MAX_IGNORED_REMEMBERED,
    AddressChanged,
    Claim,
    Member,
    Roster,
    State,
    choose_slot,
    dialable,
)


def test_a_new_name_takes_the_lowest_free_slot() -> None:
    assert choose_slot({}, "a", None, 4) == 0
    assert choose_slot({0: "x", 2: "y"}, "a", None, 4) == 1


def test_a_restarted_node_gets_its_remembered_slot_back_when_free() -> None:
    assert choose_slot({0: "x"}, "a", 3, 4) == 3


def test_a_name_still_holding_its_slot_waits_for_its_old_lease() -> None:
    assert choose_slot({3: "a"}, "a", 3, 4) is Claim.WAIT
    assert choose_slot({1: "a"}, "a", None, 4) is Claim.WAIT  # never a second id per name
    assert choose_slot({3: "x"}, "x", 1, 4) is Claim.WAIT  # even if the remembered one is free


def test_a_remembered_slot_someone_else_took_falls_back_to_the_lowest_free() -> None:
    assert choose_slot({3: "b"}, "a", 3, 4) == 0
    assert choose_slot({0: "x", 1: "y"}, "a", 7, 2) is Claim.FULL


def test_member_values_round_trip_and_foreign_values_are_refused() -> None:
    member = Member("n1", "10.0.0.1:7700", 2)
    assert Member.decode("n1", member.encode()) == member
    for junk in (b"", b"[]", b'{"address": 5, "slot": 1}', b'{"address": "a:1", "slot": true}'):
        assert Member.decode("n1", junk) is None


def test_a_registration_carries_the_incarnation_of_the_daemon_that_made_it() -> None:
    """The peers admit that incarnation of the name by equality (no clock ordering); a
    registration without one (another release's) is still one, and an ``inc`` that is not
    an integer makes it none."""
    member = Member("n1", "10.0.0.1:7700", 2, incarnation=1_700_000_000_123_456_789)
    assert json.loads(member.encode())["inc"] == 1_700_000_000_123_456_789
    assert Member.decode("n1", member.encode()) == member
    assert Member.decode("n1", b'{"address": "a:1", "slot": 1}') == Member("n1", "a:1", 1)
    for inc in (b'"5"', b"true", b"1.5"):
        assert Member.decode("n1", b'{"address": "a:1", "slot": 1, "inc": ' + inc + b"}") is None


def test_every_change_names_the_holder_and_its_registered_incarnation() -> None:
    """What the peers engine admits as the slot's holder (peers.py, "Names"): a load, a put,
    and the same name registered again by a new daemon (a new incarnation) all say it."""
    r = roster()
    assert r.load([Member("a", "h:1", 2, 500)]) == [AddressChanged(2, "a", "h:1", incarnation=500)]
    assert r.on_put(Member("a", "h:1", 2, 150)) == [AddressChanged(2, "a", "h:1", incarnation=150)]
    assert r.load([Member("a", "h:1", 2, 150)]) == []
    assert r.load([Member("a", "h:1", 2, 90)]) == [AddressChanged(2, "a", "h:1", incarnation=90)]
    assert r.on_delete("a") == [AddressChanged(2, "a", "")]


def test_an_address_that_cannot_be_dialled_is_not_a_registration() -> None:
    """A value written by mistake (or by whoever can write the prefix) must never reach the
    peering service, where an address that does not split would end the daemon."""
    for address in ("garbage", "0.0.0.0:7700", "[::]:7700", ":7700", "h:0", "h:x", "h:99999"):
        value = json.dumps({"address": address, "slot": 3}).encode()
        assert Member.decode("n1", value) is None, address
    for address in ("h..:7450", f"{'a' * 64}:7450", ".:1", "h\x00:7450", "h\x7f:1", "[h..]:1"):
        assert not dialable(address), address  # the resolver could not encode the name
    for address in ("gpu-11:7700", "10.0.0.1:7700", "[::1]:7700", f"{'a' * 63}.b:1", "é:1"):
        value = json.dumps({"address": address, "slot": 3}).encode()
        assert Member.decode("n1", value) == Member("n1", address, 3)


def test_refused_registrations_are_counted() -> None:
    r = roster()
    r.invalid([("b", b"x"), ("c", b"y")])
    r.invalid([("b", b"x")])  # the same, read again (every full read): counted once
    assert r.ignored == 2
    r.invalid([("b", b"z")])  # written again, as wrong
    assert r.ignored == 3


def roster(now: float = 0.0) -> Roster:
    return Roster(name="me", slot=0, max_nodes=4, now=now, max_retry=1.0)


def test_watch_events_move_the_address_table() -> None:
    r = roster()
    assert r.on_put(Member("b", "h:2", 2)) == [AddressChanged(2, "b", "h:2")]
    assert r.on_put(Member("b", "h:2", 2)) == []  # the same registration again: no news
    assert r.address(2) == "h:2"
    assert r.name_of(2) == "b"
    assert r.name_of(0) == "me"
    assert r.on_put(Member("b", "h:3", 2)) == [AddressChanged(2, "b", "h:3")]  # new address
    assert r.on_delete("b") == [AddressChanged(2, "b", "")]
    assert r.address(2) == ""
    assert r.on_delete("b") == []


def test_a_registration_that_moves_slot_frees_the_old_one() -> None:
    r = roster()
    r.on_put(Member("b", "h:2", 2))
    assert r.on_put(Member("b", "h:2", 3)) == [
        AddressChanged(2, "b", ""),
        AddressChanged(3, "b", "h:2"),
    ]


def test_registrations_for_own_taken_or_foreign_slots_are_ignored_and_counted() -> None:
    r = roster()
    r.on_put(Member("b", "h:2", 2))
    assert r.on_put(Member("c", "h:9", 2)) == []  # b holds it
    assert r.on_put(Member("d", "h:9", 0)) == []  # this daemon's own
    assert r.on_put(Member("e", "h:9", 4)) == []  # outside max_nodes
    assert r.ignored == 3
    r.load([Member("b", "h:2", 2), Member("c", "h:9", 2), Member("e", "h:9", 4)])  # read again
    assert r.ignored == 3
    assert r.address(2) == "h:2"


def test_a_slot_that_another_name_registers_in_comes_out_replaced() -> None:
    """The old holder may still be up and linked as that id (it lost etcd, not the fabric):
    the peering service must drop it.  The same name back in its slot is no replacement."""
    r = roster()
    r.load([Member("a", "h:1", 2)])
    assert r.on_delete("a") == [AddressChanged(2, "a", "")]
    assert r.on_put(Member("a", "h:1", 2)) == [AddressChanged(2, "a", "h:1")]
    r.on_delete("a")
    assert r.on_put(Member("d", "h:4", 2)) == [AddressChanged(2, "d", "h:4", replaced=True)]
    assert r.load([Member("e", "h:5", 2)]) == [AddressChanged(2, "e", "h:5", replaced=True)]
    assert r.load([Member("e", "h:5", 2)]) == []


def test_a_new_name_prefers_a_slot_no_other_name_remembers() -> None:
    """A slot another name had may belong to a node away only from etcd: it is taken last."""
    assert choose_slot({0: "x"}, "n", None, 4, others_remember=[1, 2]) == 3
    assert choose_slot({0: "x"}, "n", None, 4, others_remember=[1, 2, 3]) == 1
    assert choose_slot({0: "x"}, "n", 2, 4, others_remember=[2]) == 2  # its own, remembered


def test_a_full_read_replaces_the_view_and_reports_only_differences() -> None:
    r = roster()
    r.load([Member("b", "h:1", 1), Member("c", "h:2", 2)])
    changes = r.load([Member("b", "h:1", 1), Member("d", "h:3", 3)])
    assert changes == [AddressChanged(2, "c", ""), AddressChanged(3, "d", "h:3")]
    assert [m.name for m in r.members()] == ["b", "d"]


def test_a_partition_keeps_the_view_and_says_since_when() -> None:
    r = roster(now=10.0)
    r.load([Member("b", "h:1", 1)])
    r.on_unreachable(12.0, "deadline exceeded")
    r.on_unreachable(13.0, "connection refused")  # still since the first failure
    described = r.describe(15.0)
    assert described["state"] == "unreachable"
    assert described["since"] == 3.0
    assert described["error"] == "connection refused"
    assert r.address(1) == "h:1"  # the last view is kept
    r.on_connected(20.0)
    assert r.state is State.CONNECTED
    assert r.describe(21.0)["since"] == 1.0
    assert "error" not in r.describe(21.0)


def test_retries_back_off_to_the_cap_and_start_over_once_connected() -> None:
    r = roster()
    waits = [r.retry_in() for _ in range(6)]
    assert waits == [FIRST_RETRY, 0.2, 0.4, 0.8, 1.0, 1.0]
    r.on_connected(1.0)
    assert r.retry_in() == FIRST_RETRY


def test_the_own_slot_must_be_in_the_id_space() -> None:
    with pytest.raises(ValueError, match="slot 4"):
        Roster(name="me", slot=4, max_nodes=4, now=0.0)


def test_ignored_registrations_are_remembered_within_a_bound() -> None:
    """A tool writing ever-changing bad values under the prefix: each is counted, and what is
    remembered (so that one read again is not counted again) stays bounded."""
    r = Roster(name="me", slot=0, max_nodes=4, now=0.0, max_retry=1.0)
    for i in range(MAX_IGNORED_REMEMBERED + 50):
        r.invalid([("junk", str(i).encode())])
    r.invalid([("junk", b"0")])  # (remembered: not counted again)
    assert r.ignored == MAX_IGNORED_REMEMBERED + 50
    assert len(r._ignored) == MAX_IGNORED_REMEMBERED
