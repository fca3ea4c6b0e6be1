"""Rejoin cases found in the fourth review of Ako's rejoin (fabricd/engines/ako/rejoin.py): a
departure no survivor can attribute, a newcomer that had a rank gone from its join SYNC, a rank
that dies while two come back, and a flush marker sent again after a reset, without sockets.

What must hold: every flush completes at every survivor (no survivor waits for a rank the others
have gone, or for a SYNC none sends), a live newcomer is taken back, and afterwards every
replica is equal (for ``p > 1`` too: a marker sent again carries what the first carried).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ako.exchange import Exchange
from fabricd.engines.ako.rejoin import MAX_DEAD
from fabricd.errors import RemoteProtocolError
from fabricd.frames.ako import Part
from tests.unit.test_ako_rejoin import (
    LR,
    SIZE,
    Fabric,
    Opened,
    _deliver_pair,
    _equal_after_a_round,
    _gone_and_settled,
)


def _next_flushes_complete(fab: Fabric, ranks: list[int]) -> None:
    """Two rounds of a step each and a flush: none hangs, every replica ends equal."""
    for _ in range(2):
        _equal_after_a_round(fab, ranks)


@pytest.mark.parametrize("variant", ["never opened", "hello lost"])
def test_a_departure_no_survivor_can_attribute_kills_no_later_incarnation(variant: str) -> None:
    """F1: an incarnation of rank 2 left unheard at rank 1 (it never opened, or its HELLO to 1
    was lost); the next one, 77, is heard first through rank 0's marker at rank 1.  Rank 1
    must take 77 back as rank 0 does (it once killed it: both survivors then hung)."""
    fab = _gone_and_settled(3, 2)
    if variant == "never opened":  # (a restart that attached and died before its open)
        for r in (0, 1):
            fab.act(r, fab.ex[r].left(2))
    else:  # (66's HELLO reaches rank 0 only; it dies before any flush)
        fab.revive(2, nonce=66)
        fab.queues.pop((2, 1))
        _deliver_pair(fab, 2, 0)
        fab.kill(2)
        for r in (0, 1):
            fab.act(r, fab.ex[r].lose(2))
            fab.act(r, fab.ex[r].left(2))
    fab.revive(2, nonce=77)
    _deliver_pair(fab, 2, 0)
    fab.flush([0, 1])
    _deliver_pair(fab, 0, 1)  # (0's marker listing 77 reaches 1 before 77's HELLO)
    fab.drain()
    assert fab.opened[2] == Opened(joined_from=0)
    assert not any(fab.busy)
    assert fab.ex[0].gone_peers == fab.ex[1].gone_peers == frozenset()
    _next_flushes_complete(fab, [0, 1, 2])


def test_a_death_a_survivor_heard_first_reaches_it_in_the_next_markers() -> None:
    """F2: newcomer 2 has rank 3 gone from its join SYNC; 3's next incarnation, 88, says HELLO
    to 0 and 1 only and dies while their markers listing it are on their way to 2.  Rank 2
    cannot tell whose departure it heard (it ignores it), takes 88 back, and learns from the
    next markers (their dead incarnations) that 88 died, as 0 and 1 know."""
    fab = Fabric(4, 1, 0)
    fab.drain()
    for dead in (2, 3):
        fab.kill(dead)
        for r in (0, 1):
            fab.act(r, fab.ex[r].left(dead))
    fab.flush([0, 1])
    fab.drain()
    fab.revive(2, nonce=77)
    fab.drain()
    fab.flush([0, 1])
    fab.drain()
    assert fab.opened[2] is not None
    assert fab.ex[2].gone_peers == {3}
    fab.revive(3, nonce=88)
    fab.queues.pop((3, 2))
    for src in (0, 1):
        _deliver_pair(fab, 3, src)
    for r in (0, 1, 2):
        assert fab.step(r, np.ones(SIZE))
    fab.drain()
    fab.flush([0, 1, 2])
    fab.kill(3)
    for r in (0, 1, 2):
        fab.act(r, fab.ex[r].lose(3))
        fab.act(r, fab.ex[r].left(3))
    fab.drain()
    assert not any(fab.busy)
    _next_flushes_complete(fab, [0, 1, 2])
    assert all(fab.ex[r].gone_peers == {3} for r in (0, 1, 2))


def test_a_rank_dying_while_two_come_back_is_unsettled_at_the_newcomer_too() -> None:
    """F3: ranks 0 and 3 come back at one flush; 3 dies during it.  The survivors unsettle 3;
    newcomer 0 (the lowest rank) must too, so that it sends the SYNC that settles 3 (it once
    counted 3 settled, and the survivors waited for that SYNC for ever)."""
    fab = Fabric(4, 1, 0)
    fab.drain()
    for dead in (0, 3):
        fab.kill(dead)
        for r in (1, 2):
            fab.act(r, fab.ex[r].left(dead))
    fab.flush([1, 2])
    fab.drain()
    fab.revive(0, nonce=77)
    fab.revive(3, nonce=88)
    fab.drain()
    fab.flush([1, 2])
    fab.kill(3)
    for r in (1, 2):
        fab.act(r, fab.ex[r].left(3))
    fab.drain()
    assert fab.opened[0] is not None
    assert not any(fab.busy)
    assert fab.ex[0].gone_peers == {3}
    assert 3 not in fab.ex[0]._settled
    _next_flushes_complete(fab, [0, 1, 2])


def test_a_marker_sent_again_after_a_reset_carries_what_the_first_carried() -> None:
    """F4: with ``p = 2`` a flush marker carries the window's unsent parts; one lost in a reset
    and sent again on back carries them again (it carried one zero: the replicas ended unequal,
    and no later flush evened them out)."""
    fab = Fabric(3, 2, 2)
    fab.drain()
    total = np.zeros(SIZE)
    for r in range(3):
        gradient = np.full(SIZE, r + 1.0)
        assert fab.step(r, gradient)
        total += gradient
    fab.drain()
    fab.flush([0, 1, 2])
    lost = fab.queues.pop((0, 1))
    assert any(frame.payload.any() for frame in lost)
    for a, b in ((0, 1), (1, 0)):
        fab.act(a, fab.ex[a].lose(b))
    fab.drain()
    for a, b in ((0, 1), (1, 0)):
        fab.act(a, fab.ex[a].back(b))
    fab.drain()
    assert not any(fab.busy)
    expected = fab.w0 - LR * total
    for r in range(3):
        np.testing.assert_array_equal(fab.ex[r].model, expected)


def test_a_marker_sent_again_is_applied_once_where_the_first_came() -> None:
    """F4's other side: the first marker came, the link reset, the marker goes again: its
    payload is not applied twice."""
    fab = Fabric(3, 2, 2)
    fab.drain()
    total = np.zeros(SIZE)
    for r in range(3):
        assert fab.step(r, np.full(SIZE, r + 1.0))
        total += r + 1.0
    fab.drain()
    fab.flush([0, 1, 2])
    fab.drain()
    for a, b in ((0, 1), (1, 0)):
        fab.act(a, fab.ex[a].lose(b))
    for a, b in ((0, 1), (1, 0)):
        fab.act(a, fab.ex[a].back(b))
    fab.drain()
    assert not any(fab.busy)
    for r in range(3):
        np.testing.assert_array_equal(fab.ex[r].model, fab.w0 - LR * total)


def test_the_dead_and_unsettled_fields_round_trip_and_are_checked() -> None:
    spec = {"n": 4, "size": 10, "dtype": "float32", "lr": 0.5, "staleness": 2}
    marker = Part(
        job="j", name="w", src=1, dst=2, round=None, lo=0, clock=8, spec=spec, flush=2,
        dead=((3, 66), (0, 5)),
    )  # fmt: skip
    assert Part.from_meta(marker.to_meta()) == marker
    join = Part(
        job="j", name="w", src=1, dst=2, round=None, lo=0, clock=8, spec=spec, flush=2,
        sync=True, join=True, gone=(0,), unsettled=(3,),
    )  # fmt: skip
    assert Part.from_meta(join.to_meta()) == join
    for bad in ({"us": [3]}, {"dd": [[3]]}, {"dd": [[3, 0]]}, {"dd": [[3, 1]] * 257}):
        with pytest.raises(RemoteProtocolError):
            Part.from_meta(marker.to_meta() | bad)


def _deliver_some(fab: Fabric, picks: list[int]) -> None:
    for pick in picks:
        if not fab.deliver(pick):
            return


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 5), st.data())
def test_one_of_two_ranks_coming_back_dying_at_any_point_hangs_no_flush(
    n: int, data: st.DataObject
) -> None:
    """F3 at any point: two ranks come back at one flush, one dies during it (each survivor
    told at any point); every flush after completes and the replicas end equal."""
    fab = Fabric(n, 1, 0)
    fab.drain()
    a, b = data.draw(st.permutations(range(n)))[:2]
    survivors = [r for r in range(n) if r not in (a, b)]
    for dead in (a, b):
        fab.kill(dead)
        for r in survivors:
            fab.act(r, fab.ex[r].left(dead))
    fab.flush(survivors)
    fab.drain()
    fab.revive(a, 77)
    fab.revive(b, 88)
    fab.drain(data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=8)))
    fab.flush(survivors)
    picks = st.lists(st.integers(0, 60), max_size=6 * n)
    _deliver_some(fab, data.draw(picks))
    fab.kill(b)
    for r in data.draw(st.permutations(survivors)):
        fab.act(r, fab.ex[r].left(b))
        _deliver_some(fab, data.draw(picks))
    fab.drain(data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=8)))
    assert fab.opened[a] is not None
    assert not any(fab.busy)
    fab.act(a, fab.ex[a].left(b))  # (its daemon heard it too: a no-op if gone there)
    _next_flushes_complete(fab, sorted([*survivors, a]))


def test_a_death_that_completes_the_knower_s_flush_is_still_announced() -> None:
    """Rank 2's new incarnation is heard by rank 0 alone and dies after both took it back
    (rank 1 through 0's marker, ignoring the departure it could not attribute).  When rank 0
    learns of the death during the next flush, the death completes that flush at once: its
    marker listing the death must still go to rank 1, or rank 1 waits for rank 2 for ever."""
    fab = Fabric(3, 1, 2)
    fab.drain()
    fab.kill(2)
    for r in (0, 1):
        fab.act(r, fab.ex[r].left(2))
    fab.flush([0, 1])
    fab.drain()
    fab.revive(2, 101)
    fab.queues.pop((2, 1))  # (its HELLO to rank 1 is lost)
    _deliver_pair(fab, 2, 0)
    _deliver_pair(fab, 0, 2)
    fab.flush([0, 1])  # this flush's markers list (2, 101)
    fab.kill(2)
    fab.act(1, fab.ex[1].left(2))  # not attributable at rank 1: ignored
    fab.drain()  # both take 101 back
    for r in (0, 1):
        fab.step(r, np.ones(SIZE))
        fab.drain()
    fab.flush([0, 1])
    _deliver_pair(fab, 1, 0)
    _deliver_pair(fab, 0, 1)  # the next flush's markers, neither listing the death
    fab.act(0, fab.ex[0].left(2))  # rank 0 learns of it: its flush completes at once
    fab.drain()
    assert fab.busy == [False, False, False]  # no flush waits
    assert all(2 in fab.ex[r]._gone for r in (0, 1))


def test_an_incarnation_killed_again_is_listed_once() -> None:
    """A marker listing more dead nonces of one rank than a rank remembers (MAX_DEAD) makes
    it kill the evicted ones again at every marker: each is listed dead once, and another
    rank's obituary is kept."""
    ex = Exchange(rank=0, ranks=4, model=np.zeros(4), partitions=1, lr=0.5, staleness=1, nonce=7)
    ex._kill(2, 999)
    dead = tuple((3, 1000 + i) for i in range(MAX_DEAD + 4))
    for _ in range(14):
        ex._obituaries(dead)
    listed = list(ex._obits)
    assert len(listed) == len(set(listed))  # no duplicates
    assert (2, 999) in listed
