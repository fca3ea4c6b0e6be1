"""Peer liveness driven by a hand-held clock: ``now`` only ever comes from the test.

The daemon arms one timer at :meth:`PeerTable.next_deadline` and calls :meth:`PeerTable.on_timer`
when it fires; :func:`drive` does the same without an event loop, so simulated seconds cost
nothing.  Test figures follow RELIABILITY.md: heartbeat every 100 ms, suspect after 3 misses,
failure-detection bound D = 1 s.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines.peers import (
    Action,
    Incarnation,
    PeerRestarted,
    PeerState,
    PeerTable,
    SendHeartbeat,
    StateChanged,
    Timeouts,
)

TIMEOUTS = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)
#: more timer firings than any test here needs; reaching it means the timer stopped advancing
MAX_FIRINGS = 100_000


def table(nodes: int = 2, *, now: float = 0.0, timeouts: Timeouts = TIMEOUTS) -> PeerTable:
    return PeerTable(node=0, nodes=nodes, timeouts=timeouts, now=now)


def drive(peers: PeerTable, until: float) -> list[tuple[float, Action]]:
    """Fire the timer at every deadline up to ``until``, as the daemon's event loop would.

    Every firing must push the deadline forward: a timer that stays due after it ran would spin
    the daemon's loop and hang a simulator.
    """
    fired: list[tuple[float, Action]] = []
    for _ in range(MAX_FIRINGS):
        deadline = peers.next_deadline()
        if deadline is None or deadline > until:
            return fired
        fired += [(deadline, action) for action in peers.on_timer(deadline)]
        after = peers.next_deadline()
        assert after is None or after > deadline, f"timer at {deadline!r} stays due"
    raise AssertionError("the timer never stopped firing")


def changes(fired: list[tuple[float, Action]]) -> list[tuple[float, StateChanged]]:
    return [(t, a) for t, a in fired if isinstance(a, StateChanged)]


def heartbeats(fired: list[tuple[float, Action]], node: int = 1) -> list[float]:
    return [t for t, a in fired if isinstance(a, SendHeartbeat) and a.node == node]


def up(peers: PeerTable, node: int = 1, incarnation: int = 1, now: float = 0.0) -> None:
    peers.on_established(node, incarnation, now)
    assert peers.state(node) is PeerState.UP


# -- the state machine ------------------------------------------------------------------------
def test_a_new_peer_is_connecting_until_established() -> None:
    peers = table(3)
    assert [peers.state(n) for n in (1, 2)] == [PeerState.CONNECTING] * 2
    assert peers.on_established(1, 5, now=2.0) == [
        StateChanged(node=1, old=PeerState.CONNECTING, new=PeerState.UP, reason="authenticated")
    ]
    assert peers.state(1) is PeerState.UP
    assert peers.state(2) is PeerState.CONNECTING


def test_the_table_excludes_this_node() -> None:
    peers = PeerTable(node=1, nodes=3, timeouts=TIMEOUTS, now=0.0)
    assert [info.node for info in peers.peers(0.0)] == [0, 2]
    with pytest.raises(KeyError):
        peers.state(1)


def test_heartbeats_are_sent_every_interval() -> None:
    peers = table()
    up(peers)
    fired: list[tuple[float, Action]] = []
    for tick in range(1, 41):  # the peer talks every 50 ms, so it stays up for 2 s
        now = tick * 0.05
        fired += drive(peers, now)
        peers.on_heard(1, now)
    sent = heartbeats(fired)
    assert len(sent) == 20  # at 0.0, 0.1, … 1.9
    assert sent[0] == 0.0  # the first one goes out as soon as the link is up
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert gaps == pytest.approx([TIMEOUTS.heartbeat_interval] * 19)
    assert changes(fired) == []


def test_heartbeats_go_to_every_live_peer_and_only_to_them() -> None:
    peers = table(4)
    up(peers, 1)
    up(peers, 2)
    fired = drive(peers, 0.25)
    assert {a.node for _, a in fired if isinstance(a, SendHeartbeat)} == {1, 2}
    assert len(heartbeats(fired, 1)) == len(heartbeats(fired, 2)) == 3


def test_a_silent_peer_becomes_suspect_then_down_with_reasons() -> None:
    peers = table()
    up(peers, now=10.0)
    seen = changes(drive(peers, 20.0))
    assert seen == [
        (10.3, StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT,
                            reason="silent for 0.30s")),
        (11.0, StateChanged(node=1, old=PeerState.SUSPECT, new=PeerState.DOWN,
                            reason="silent for 1.00s")),
    ]  # fmt: skip
    assert peers.state(1) is PeerState.DOWN
    assert peers.next_deadline() is None


def test_suspect_peers_still_get_heartbeats_and_down_peers_do_not() -> None:
    peers = table()
    up(peers)
    fired = drive(peers, 5.0)
    (down_at,) = [t for t, c in changes(fired) if c.new is PeerState.DOWN]
    sent = heartbeats(fired)
    assert any(TIMEOUTS.suspect_after < t for t in sent)  # suspect: maybe only its link is slow
    assert max(sent) < down_at


def test_heard_again_while_suspect_is_up() -> None:
    peers = table()
    up(peers)
    drive(peers, 0.5)
    assert peers.state(1) is PeerState.SUSPECT
    assert peers.on_heard(1, 0.5) == [
        StateChanged(node=1, old=PeerState.SUSPECT, new=PeerState.UP, reason="heard from it again")
    ]
    assert changes(drive(peers, 0.79)) == []  # the silence starts over from 0.5
    assert [c.new for _, c in changes(drive(peers, 1.6))] == [PeerState.SUSPECT, PeerState.DOWN]


def test_heard_while_up_changes_nothing_but_postpones_suspicion() -> None:
    peers = table()
    up(peers)
    assert peers.on_heard(1, 0.2) == []
    assert changes(drive(peers, 0.49)) == []
    assert [t for t, _ in changes(drive(peers, 0.5))] == [pytest.approx(0.5)]


def test_a_lost_link_makes_the_peer_suspect_at_once() -> None:
    peers = table()
    up(peers)
    assert peers.on_link_lost(1, 0.05) == [
        StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT, reason="control link lost")
    ]
    assert peers.on_link_lost(1, 0.06) == []  # already suspect
    (down,) = changes(drive(peers, 5.0))
    assert down == (1.0, StateChanged(node=1, old=PeerState.SUSPECT, new=PeerState.DOWN,
                                      reason="silent for 1.00s"))  # fmt: skip


def test_link_lost_before_any_link_changes_nothing() -> None:
    peers = table()
    assert peers.on_link_lost(1, 1.0) == []
    assert peers.state(1) is PeerState.CONNECTING


def test_a_down_peer_is_up_again_when_it_reconnects() -> None:
    peers = table()
    up(peers)
    drive(peers, 2.0)
    assert peers.state(1) is PeerState.DOWN
    assert peers.on_heard(1, 2.5) == []  # a stray frame does not revive it
    assert peers.state(1) is PeerState.DOWN
    assert peers.on_established(1, 1, 3.0) == [
        StateChanged(node=1, old=PeerState.DOWN, new=PeerState.UP, reason="authenticated")
    ]
    assert heartbeats(drive(peers, 3.0)) == [3.0]
    assert [t for t, _ in changes(drive(peers, 10.0))] == [pytest.approx(3.3), 4.0]


def test_heard_before_established_is_ignored() -> None:
    peers = table()
    assert peers.on_heard(1, 1.0) == []
    assert peers.state(1) is PeerState.CONNECTING
    assert peers.next_deadline() is None


# -- incarnations -----------------------------------------------------------------------------
def test_incarnations_compare_against_the_newest_seen() -> None:
    peers = table()
    assert peers.check_incarnation(1, 0) is Incarnation.NEWER  # never seen: anything is news
    up(peers, incarnation=5)
    assert peers.check_incarnation(1, 5) is Incarnation.SAME
    assert peers.check_incarnation(1, 6) is Incarnation.NEWER
    assert peers.check_incarnation(1, 4) is Incarnation.STALE


def test_a_restarted_peer_is_reported_before_it_is_up() -> None:
    peers = table()
    up(peers, incarnation=5)
    assert peers.on_established(1, 5, 1.0) == []  # the same daemon redialled
    assert peers.on_established(1, 8, 2.0) == [
        PeerRestarted(node=1, old_incarnation=5, new_incarnation=8)
    ]
    assert peers.check_incarnation(1, 5) is Incarnation.STALE


def test_a_restart_seen_after_down_says_restarted_then_up() -> None:
    peers = table()
    up(peers, incarnation=5)
    drive(peers, 2.0)
    assert peers.on_established(1, 6, 3.0) == [
        PeerRestarted(node=1, old_incarnation=5, new_incarnation=6),
        StateChanged(node=1, old=PeerState.DOWN, new=PeerState.UP, reason="authenticated"),
    ]


def test_once_down_an_older_incarnation_is_a_new_life() -> None:
    """A clock that stepped back across a restart must not lock the node out for good."""
    peers = table()
    up(peers, incarnation=5)
    assert peers.check_incarnation(1, 4) is Incarnation.STALE  # alive: a dead process's link
    drive(peers, 2.0)
    assert peers.state(1) is PeerState.DOWN
    assert peers.check_incarnation(1, 4) is Incarnation.NEWER
    assert peers.on_established(1, 4, 3.0)[0] == PeerRestarted(
        node=1, old_incarnation=5, new_incarnation=4
    )
    assert peers.check_incarnation(1, 4) is Incarnation.SAME


# -- timers and status ------------------------------------------------------------------------
def test_no_deadline_without_live_peers() -> None:
    peers = table(4)
    assert peers.next_deadline() is None
    assert peers.on_timer(100.0) == []
    up(peers, 2, now=1.0)
    assert peers.next_deadline() == 1.0  # the first heartbeat is due at once
    drive(peers, 10.0)
    assert peers.next_deadline() is None


def test_peers_reports_state_incarnation_and_silence() -> None:
    peers = table(3, now=1.0)
    up(peers, 1, incarnation=4, now=2.0)
    drive(peers, 2.5)
    info = {i.node: i for i in peers.peers(2.5)}
    assert info[1].state is PeerState.SUSPECT
    assert info[1].incarnation == 4
    assert info[1].silent_for == pytest.approx(0.5)
    assert info[1].state_for == pytest.approx(0.2)
    assert info[2].state is PeerState.CONNECTING
    assert info[2].incarnation is None
    assert info[2].silent_for is None
    assert info[2].state_for == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("interval", "suspect", "down"),
    [(0.0, 1.0, 2.0), (1.0, 1.0, 2.0), (0.1, 0.5, 0.4), (-1.0, 1.0, 2.0)],
)
def test_timeouts_must_be_ordered(interval: float, suspect: float, down: float) -> None:
    with pytest.raises(ValueError, match="heartbeat_interval < suspect_after"):
        Timeouts(heartbeat_interval=interval, suspect_after=suspect, down_after=down)


def test_suspect_after_may_equal_down_after() -> None:
    timeouts = Timeouts(heartbeat_interval=0.1, suspect_after=1.0, down_after=1.0)
    peers = table(timeouts=timeouts)
    up(peers)
    assert [(t, c.new) for t, c in changes(drive(peers, 5.0))] == [(1.0, PeerState.DOWN)]


# -- the failure-detection bound (RELIABILITY F2) ---------------------------------------------
@given(
    start=st.floats(min_value=0.0, max_value=1e6),
    talk=st.floats(min_value=0.0, max_value=5.0),
    interval=st.floats(min_value=0.01, max_value=1.0),
    misses=st.integers(min_value=2, max_value=5),
    extra=st.floats(min_value=0.0, max_value=3.0),
)
def test_a_silent_peer_is_down_exactly_once_within_the_bound(
    start: float, talk: float, interval: float, misses: int, extra: float
) -> None:
    """Heard last at ``t``: DOWN once, at or after ``t + down_after`` and no later than that
    plus one heartbeat interval, when the timer is driven by next_deadline."""
    timeouts = Timeouts(
        heartbeat_interval=interval,
        suspect_after=interval * misses,
        down_after=interval * misses + extra,
    )
    peers = table(timeouts=timeouts, now=start)
    up(peers, now=start)
    fired = drive(peers, start + talk)
    t = start + talk
    if peers.state(1) is not PeerState.DOWN:
        peers.on_heard(1, t)
    else:
        t = start
    fired += drive(peers, t + timeouts.down_after + 10 * interval)
    downs = [when for when, c in changes(fired) if c.new is PeerState.DOWN]
    assert len(downs) == 1
    assert t + timeouts.down_after <= downs[0] <= t + timeouts.down_after + interval
    assert peers.next_deadline() is None


# -- random histories -------------------------------------------------------------------------
NODES = 4
steps = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(min_value=0.0, max_value=0.7)),
        st.tuples(st.just("heard"), st.integers(1, NODES - 1)),
        st.tuples(st.just("link_lost"), st.integers(1, NODES - 1)),
        st.tuples(st.just("established"), st.integers(1, NODES - 1), st.integers(-1, 2)),
    ),
    max_size=60,
)


class Checker:
    """Replays what the table says against what the test did to it."""

    def __init__(self, peers: PeerTable, now: float) -> None:
        self.peers = peers
        self.now = now
        self.state = {n: PeerState.CONNECTING for n in range(1, NODES)}
        self.heard = {n: -math.inf for n in range(1, NODES)}  #: last contact while live
        self.incarnation: dict[int, int] = {}

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendHeartbeat):
                assert self.state[action.node] in (PeerState.UP, PeerState.SUSPECT)
            elif isinstance(action, StateChanged):
                assert action.old is self.state[action.node]
                assert action.new is not action.old
                assert action.reason
                if action.new is PeerState.DOWN:
                    assert self.now >= self.heard[action.node] + TIMEOUTS.down_after
                if action.new is PeerState.SUSPECT and action.reason != "control link lost":
                    assert self.now >= self.heard[action.node] + TIMEOUTS.suspect_after
                self.state[action.node] = action.new
            else:
                assert action.old_incarnation == self.incarnation[action.node]
        for node, state in self.state.items():
            assert self.peers.state(node) is state

    def timers(self, until: float) -> None:
        for _ in range(MAX_FIRINGS):
            deadline = self.peers.next_deadline()
            if deadline is None or deadline > until:
                return
            assert deadline >= self.now  # nothing was left overdue
            self.now = deadline
            self.apply(self.peers.on_timer(self.now))
            self.check_settled()
        raise AssertionError("the timer never stopped firing")

    def check_settled(self) -> None:
        """Right after the timer ran, nothing is overdue."""
        after = self.peers.next_deadline()
        assert after is None or after > self.now
        for node, state in self.state.items():
            if state in (PeerState.UP, PeerState.SUSPECT):
                assert self.now < self.heard[node] + TIMEOUTS.down_after
            if state is PeerState.UP:
                assert self.now < self.heard[node] + TIMEOUTS.suspect_after


@given(start=st.floats(min_value=0.0, max_value=1e7), history=steps)
def test_random_histories_keep_the_invariants(start: float, history: list[tuple]) -> None:
    peers = table(NODES, now=start)
    check = Checker(peers, start)
    for step in history:
        match step:
            case ("advance", dt):
                target = check.now + dt
                check.timers(target)
                check.now = target
            case ("heard", node):
                if check.state[node] in (PeerState.UP, PeerState.SUSPECT):
                    check.heard[node] = check.now
                check.apply(peers.on_heard(node, check.now))
            case ("link_lost", node):
                check.apply(peers.on_link_lost(node, check.now))
            case ("established", node, delta):
                incarnation = check.incarnation.get(node, 0) + delta
                if peers.check_incarnation(node, incarnation) is Incarnation.STALE:
                    continue  # the daemon refuses such a link
                check.heard[node] = check.now
                check.apply(peers.on_established(node, incarnation, check.now))
                check.incarnation[node] = incarnation
        assert peers.state(1) in PeerState
    check.timers(check.now + TIMEOUTS.down_after + TIMEOUTS.heartbeat_interval)
    assert all(s in (PeerState.CONNECTING, PeerState.DOWN) for s in check.state.values())
    assert peers.next_deadline() is None
