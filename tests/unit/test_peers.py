"""The peers engine driven by a hand-held clock: ``now`` only ever comes from the test.

The daemon arms one timer at :meth:`PeerTable.next_deadline` and calls :meth:`PeerTable.on_timer`
when it fires; :func:`drive` does the same without an event loop, so simulated seconds cost
nothing.  Test figures are the launcher's fast liveness settings: heartbeat every 100 ms,
suspect after 3 misses, failure-detection bound D = 1 s.  :class:`Shell` plays the daemon for
random histories: it performs every action on a model of the links, dials and handshakes, and
checks each one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.actions import Notice, SendFrame
from fabricd.engines.link.gate import CloseHandshake, RefuseHandshake
from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import (
    FIRST_BACKOFF,
    Action,
    AdmitLink,
    Dial,
    DialRetry,
    PeerRestarted,
    PeerState,
    PeerTable,
    PeerUp,
    RefuseLink,
    ResetPeer,
    StateChanged,
    Timeouts,
)
from fabricd.frames.link import Heartbeat

CONTROL, DATA = Channel.CONTROL, Channel.DATA
TIMEOUTS = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)
#: more timer firings than any test here needs; reaching it means the timer stopped advancing
MAX_FIRINGS = 100_000


def table(
    nodes: int = 2,
    *,
    now: float = 0.0,
    node: int = 0,
    timeouts: Timeouts = TIMEOUTS,
    **limits: Any,
) -> PeerTable:
    return PeerTable(node=node, nodes=nodes, timeouts=timeouts, now=now, **limits)


def due(peers: PeerTable) -> float:
    deadline = peers.next_deadline()
    assert deadline is not None
    return deadline


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
    return [
        t
        for t, a in fired
        if isinstance(a, SendFrame) and a.node == node and isinstance(a.frame, Heartbeat)
    ]


def of(kind: type, actions: list[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, kind)]


def links(peers: PeerTable, node: int = 1) -> set[Channel]:
    return set(next(i for i in peers.peers(0.0) if i.node == node).links)


def up(peers: PeerTable, node: int = 1, incarnation: int = 1, now: float = 0.0) -> list[Action]:
    actions = peers.on_link_authenticated(node, CONTROL, incarnation, now)
    assert AdmitLink(node=node, channel=CONTROL) in actions
    assert peers.state(node) is PeerState.UP
    return actions


def connected(peers: PeerTable, node: int = 1, incarnation: int = 1, now: float = 0.0) -> None:
    up(peers, node, incarnation, now)
    assert AdmitLink(node=node, channel=DATA) in peers.on_link_authenticated(
        node, DATA, incarnation, now
    )


# -- the state machine ------------------------------------------------------------------------
def test_a_new_peer_is_connecting_until_its_control_link_is_admitted() -> None:
    peers = table(3)
    assert [peers.state(n) for n in (1, 2)] == [PeerState.CONNECTING] * 2
    assert peers.on_link_authenticated(1, CONTROL, 5, now=2.0) == [
        AdmitLink(node=1, channel=CONTROL),
        StateChanged(node=1, old=PeerState.CONNECTING, new=PeerState.UP, reason="authenticated"),
    ]
    assert peers.state(1) is PeerState.UP
    assert peers.state(2) is PeerState.CONNECTING


def test_a_peer_is_greeted_once_both_of_its_links_are_admitted() -> None:
    """Services greet a peer on PeerUp (membership ANNOUNCEs its ranks), and a rendezvous that
    follows moves its bytes on the data link: greeted any earlier, a send matched at once would
    find no data link to stream on."""
    peers = table()
    assert of(PeerUp, peers.on_link_authenticated(1, CONTROL, 5, 0.0)) == []
    assert peers.on_link_authenticated(1, DATA, 5, 0.1) == [
        AdmitLink(node=1, channel=DATA),
        PeerUp(node=1),
    ]
    assert of(PeerUp, peers.on_link_authenticated(1, CONTROL, 5, 0.2)) == []  # reconnected


def test_the_table_excludes_this_node() -> None:
    peers = table(3, node=1)
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
    assert {a.node for _, a in fired if isinstance(a, SendFrame)} == {1, 2}
    assert len(heartbeats(fired, 1)) == len(heartbeats(fired, 2)) == 3


def test_a_silent_peer_becomes_suspect_then_down_with_reasons() -> None:
    peers = table()
    up(peers, now=10.0)
    fired = drive(peers, 20.0)
    assert changes(fired) == [
        (10.3, StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT,
                            reason="silent for 0.30s")),
        (11.0, StateChanged(node=1, old=PeerState.SUSPECT, new=PeerState.DOWN,
                            reason="silent for 1.00s")),
    ]  # fmt: skip
    assert of(ResetPeer, [a for _, a in fired]) == [ResetPeer(node=1, reason="down")]
    assert peers.state(1) is PeerState.DOWN
    assert links(peers) == set()
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


def test_a_lost_link_resets_the_peer_and_makes_it_suspect_at_once() -> None:
    peers = table()
    connected(peers)
    reason = "unreachable (control link lost)"
    assert peers.on_link_closed(1, CONTROL, 0.05) == [
        ResetPeer(node=1, reason=reason),
        StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT, reason=reason),
    ]
    assert links(peers) == set()  # the data link went with it
    assert peers.on_link_closed(1, DATA, 0.06) == []  # closed by the reset: no news
    assert peers.on_link_closed(1, CONTROL, 0.06) == []
    (down,) = changes(drive(peers, 5.0))
    assert down == (1.0, StateChanged(node=1, old=PeerState.SUSPECT, new=PeerState.DOWN,
                                      reason="silent for 1.00s"))  # fmt: skip


def test_losing_the_data_link_resets_the_peer_too() -> None:
    peers = table()
    connected(peers)
    reason = "unreachable (data link lost)"
    assert peers.on_link_closed(1, DATA, 0.5) == [
        ResetPeer(node=1, reason=reason),
        StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT, reason=reason),
    ]
    assert links(peers) == set()
    assert heartbeats(drive(peers, 0.9)) == []  # no control link to send them on


def test_link_lost_before_any_link_changes_nothing() -> None:
    peers = table()
    assert peers.on_link_closed(1, CONTROL, 1.0) == []
    assert peers.state(1) is PeerState.CONNECTING


def test_a_peer_that_said_bye_is_reset_as_expected_until_it_is_back() -> None:
    peers = table()
    up(peers)
    peers.on_bye(1)
    (reset,) = of(ResetPeer, peers.on_link_closed(1, CONTROL, 0.1))
    assert reset.expected
    up(peers, now=0.2)
    (reset,) = of(ResetPeer, peers.on_link_closed(1, CONTROL, 0.3))
    assert not reset.expected


def test_a_down_peer_is_up_again_when_it_reconnects() -> None:
    peers = table()
    up(peers)
    drive(peers, 2.0)
    assert peers.state(1) is PeerState.DOWN
    assert peers.on_heard(1, 2.5) == []  # a stray frame does not revive it
    assert peers.state(1) is PeerState.DOWN
    assert peers.on_link_authenticated(1, CONTROL, 1, 3.0) == [
        AdmitLink(node=1, channel=CONTROL),
        StateChanged(node=1, old=PeerState.DOWN, new=PeerState.UP, reason="authenticated"),
    ]
    assert heartbeats(drive(peers, 3.0)) == [3.0]
    assert [t for t, _ in changes(drive(peers, 10.0))] == [pytest.approx(3.3), 4.0]


def test_heard_before_any_link_is_ignored() -> None:
    peers = table()
    assert peers.on_heard(1, 1.0) == []
    assert peers.state(1) is PeerState.CONNECTING
    assert peers.next_deadline() is None


# -- link admission ---------------------------------------------------------------------------
def test_a_stale_incarnation_is_refused_while_the_peer_lives() -> None:
    peers = table()
    connected(peers, incarnation=5)
    for channel in (CONTROL, DATA):
        assert peers.on_link_authenticated(1, channel, 4, 1.0) == [
            RefuseLink(node=1, channel=channel, reason="incarnation 4 is dead")
        ]
    assert links(peers) == {CONTROL, DATA}  # the live links are untouched
    drive(peers, 0.5)
    assert peers.state(1) is PeerState.SUSPECT  # suspect is still alive
    assert of(RefuseLink, peers.on_link_authenticated(1, CONTROL, 4, 0.5))


def test_a_newer_incarnation_resets_the_peer_before_it_is_admitted() -> None:
    peers = table()
    connected(peers, incarnation=5)
    assert peers.on_link_authenticated(1, CONTROL, 8, 1.0) == [
        ResetPeer(node=1, reason="restarted"),
        AdmitLink(node=1, channel=CONTROL),
        PeerRestarted(node=1, old_incarnation=5, new_incarnation=8),
    ]
    assert links(peers) == {CONTROL}
    assert of(RefuseLink, peers.on_link_authenticated(1, DATA, 5, 1.0))  # now stale
    assert of(AdmitLink, peers.on_link_authenticated(1, DATA, 8, 1.0))


def test_a_replaced_control_link_resets_the_peer() -> None:
    peers = table()
    connected(peers, incarnation=5)
    assert peers.on_link_authenticated(1, CONTROL, 5, 1.0) == [
        ResetPeer(node=1, reason="reconnected"),
        AdmitLink(node=1, channel=CONTROL),
    ]
    assert links(peers) == {CONTROL}


def test_a_data_link_needs_a_control_link_first() -> None:
    peers = table()
    refused = [
        RefuseLink(node=1, channel=DATA, reason="data channel opened before the control channel")
    ]
    assert peers.on_link_authenticated(1, DATA, 5, 0.0) == refused
    up(peers, incarnation=5)
    peers.on_link_closed(1, CONTROL, 0.1)
    assert peers.on_link_authenticated(1, DATA, 5, 0.2) == refused
    assert peers.state(1) is PeerState.SUSPECT


def test_a_data_link_of_another_incarnation_than_the_control_link_is_refused() -> None:
    peers = table()
    up(peers, incarnation=5)
    assert peers.on_link_authenticated(1, DATA, 6, 0.0) == [
        RefuseLink(node=1, channel=DATA, reason="data link of incarnation 6, control of 5")
    ]
    assert links(peers) == {CONTROL}


def test_a_second_data_link_is_refused_and_resets_the_peer() -> None:
    peers = table()
    connected(peers, incarnation=5)
    reason = "reconnected (second data link)"
    assert peers.on_link_authenticated(1, DATA, 5, 0.1) == [
        RefuseLink(node=1, channel=DATA, reason="a data link to this node was already up"),
        ResetPeer(node=1, reason=reason),
        StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT, reason=reason),
    ]
    assert links(peers) == set()


def test_a_restart_seen_after_down_says_restarted_then_up() -> None:
    peers = table()
    up(peers, incarnation=5)
    drive(peers, 2.0)
    assert peers.on_link_authenticated(1, CONTROL, 6, 3.0) == [
        ResetPeer(node=1, reason="restarted"),
        AdmitLink(node=1, channel=CONTROL),
        PeerRestarted(node=1, old_incarnation=5, new_incarnation=6),
        StateChanged(node=1, old=PeerState.DOWN, new=PeerState.UP, reason="authenticated"),
    ]


def test_once_down_an_older_incarnation_is_a_new_life() -> None:
    """A clock that stepped back across a restart must not lock the node out for good."""
    peers = table()
    up(peers, incarnation=5)
    drive(peers, 2.0)
    assert peers.state(1) is PeerState.DOWN
    actions = peers.on_link_authenticated(1, CONTROL, 4, 3.0)
    assert PeerRestarted(node=1, old_incarnation=5, new_incarnation=4) in actions
    assert of(AdmitLink, peers.on_link_authenticated(1, DATA, 4, 3.0))  # 4 is the one now
    assert of(RefuseLink, peers.on_link_authenticated(1, CONTROL, 5, 3.0)) == []  # 5 is newer


def test_statistics_count_links_refusals_and_resets() -> None:
    peers = table(3)
    connected(peers, 1)
    up(peers, 2)
    peers.on_link_authenticated(2, DATA, 7, 0.0)  # another incarnation: refused
    peers.on_link_closed(1, DATA, 0.1)
    stats = peers.statistics()
    assert (stats.links_up, stats.links_refused, stats.resets) == (1, 1, 1)
    assert stats.dial_attempts == {1: 0, 2: 0}


# -- dialling ---------------------------------------------------------------------------------
def failing(peers: PeerTable, node: int, now: float, times: int) -> tuple[float, list[float]]:
    """Fail ``times`` dials of ``node`` in a row; return the time and the waits between them."""
    waits = []
    for _ in range(times):
        peers.on_dial_failed(node, "connection refused", now)
        waits.append(due(peers) - now)
        now = due(peers)
        assert peers.on_timer(now) == [Dial(node=node)]
    return now, waits


def test_a_node_dials_every_node_with_a_higher_id() -> None:
    assert table(4, node=1).dial_targets() == [2, 3]
    assert table(4, node=3).dial_targets() == []
    peers = table(4, node=1)
    assert peers.start(0.0) == [Dial(node=2), Dial(node=3)]
    assert peers.start(0.0) == []  # dials under way are not repeated


def test_failed_dials_back_off_doubling_up_to_the_cap() -> None:
    peers = table(max_backoff=1.0)
    peers.start(0.0)
    _, waits = failing(peers, 1, 0.0, 8)
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert peers.statistics().dial_attempts == {1: 8}


def test_a_failed_dial_is_told_at_the_first_tenth_and_every_hundredth_failure() -> None:
    peers = table(max_backoff=1.0)
    peers.start(0.0)
    now, told = 0.0, []
    for _ in range(300):
        told += peers.on_dial_failed(1, "refused", now)
        now = due(peers)
        peers.on_timer(now)
    assert [a.attempts for a in told if isinstance(a, DialRetry)] == [1, 10, 100, 200, 300]
    assert told[0] == DialRetry(node=1, attempts=1, error="refused", retry_in=FIRST_BACKOFF)
    assert told[-1] == DialRetry(node=1, attempts=300, error="refused", retry_in=1.0)


def test_no_second_dial_while_one_is_under_way() -> None:
    peers = table()
    assert peers.start(0.0) == [Dial(node=1)]
    assert peers.next_deadline() is None  # nothing until the dial says how it went
    up(peers, now=0.1)  # its control link
    peers.on_link_closed(1, CONTROL, 0.2)  # lost before the data link: the dial goes on
    assert of(Dial, [a for _, a in drive(peers, 0.5)]) == []
    (refused,) = peers.on_link_authenticated(1, DATA, 1, 0.5)  # its data link comes too late
    assert isinstance(refused, RefuseLink)
    assert of(Dial, peers.on_dial_failed(1, "data link refused", 0.5)) == []
    assert peers.next_deadline() == pytest.approx(0.55)


def test_a_successful_dial_resets_the_backoff_and_a_loss_redials_soon() -> None:
    peers = table(max_backoff=1.0)
    peers.start(0.0)
    now, _ = failing(peers, 1, 0.0, 5)
    connected(peers, now=now)  # the dial succeeded
    assert peers.statistics().dial_attempts == {1: 0}
    assert peers.next_deadline() == now  # only the first heartbeat
    drive(peers, now)
    peers.on_link_closed(1, DATA, now + 0.01)
    fired = drive(peers, now + 0.2)
    (dialled,) = [t for t, a in fired if isinstance(a, Dial)]
    assert dialled == pytest.approx(now + 0.01 + FIRST_BACKOFF)
    _, waits = failing(peers, 1, dialled, 2)
    assert waits == pytest.approx([0.05, 0.1])  # the backoff starts over


def test_a_peer_that_goes_down_is_redialled() -> None:
    peers = table()
    peers.start(0.0)
    connected(peers)
    fired = drive(peers, 1.2)
    down_at = next(t for t, a in fired if isinstance(a, ResetPeer))
    assert [t for t, a in fired if isinstance(a, Dial)] == [pytest.approx(down_at + 0.05)]


def test_a_dial_that_fails_after_its_control_link_resets_the_peer() -> None:
    peers = table()
    peers.start(0.0)
    up(peers, now=0.1)
    reason = "dial failed: connection refused"
    assert peers.on_dial_failed(1, "connection refused", 0.2) == [
        ResetPeer(node=1, reason=reason),
        StateChanged(node=1, old=PeerState.UP, new=PeerState.SUSPECT, reason=reason),
        DialRetry(node=1, attempts=1, error="connection refused", retry_in=FIRST_BACKOFF),
    ]
    assert links(peers) == set()
    assert peers.on_dial_failed(1, "again", 0.2) == []  # no dial is under way


def test_a_node_that_is_dialled_never_dials_back() -> None:
    peers = table(node=1)
    assert peers.start(0.0) == []
    connected(peers, node=0)
    peers.on_link_closed(0, CONTROL, 0.1)
    assert of(Dial, [a for _, a in drive(peers, 5.0)]) == []


# -- handshakes -------------------------------------------------------------------------------
#: node 0 dials node 1 (it has the lower id); nodes 1 and 2 share a host
THREE = {0: frozenset({"10.0.0.9"}), 1: frozenset({"10.0.0.5"}), 2: frozenset({"10.0.0.5"})}


def test_a_handshake_that_takes_too_long_is_closed() -> None:
    peers = table(handshake_timeout=2.0, node=1, hosts=THREE)
    assert peers.on_handshake_started(7, "10.0.0.9", 1.0) == []
    assert peers.next_deadline() == 3.0
    assert peers.on_timer(2.9) == []
    assert peers.on_timer(3.0) == [CloseHandshake(link_id=7, reason="no handshake within 2.0s")]
    assert peers.next_deadline() is None
    peers.on_handshake_over(7, failed=True)  # the close reported back: already counted
    assert peers.statistics().handshakes_refused == 1
    assert peers.statistics().handshakes_pending == 0


def test_a_handshake_over_in_time_has_no_deadline() -> None:
    peers = table(node=1, hosts=THREE)
    peers.on_handshake_started(7, "10.0.0.9", 0.0, accepted=False)
    peers.on_handshake_started(8, "10.0.0.9", 0.0)
    peers.on_handshake_over(7)
    peers.on_handshake_over(8, failed=True)
    assert peers.next_deadline() is None
    assert peers.statistics().handshakes_refused == 1


def test_links_from_a_host_no_node_dials_from_are_refused_on_arrival() -> None:
    peers = table(3, node=1, hosts=THREE)
    for link_id, host in enumerate(["10.0.0.7", "127.0.0.1", "10.0.0.5", "h"]):
        assert peers.on_handshake_started(link_id, host, 0.0) == [
            RefuseHandshake(
                link_id=link_id,
                reason=f"{host} is not the address of a node in this fabric's nodes list",
            )
        ]  # 10.0.0.5 is node 2's host, but node 2 never dials node 1: node 1 dials it
    stats = peers.statistics()
    assert (stats.handshakes_pending, stats.handshakes_refused, stats.gate.unknown_host) == (
        0,
        4,
        4,
    )
    assert peers.next_deadline() is None  # a refused link holds no deadline either


def test_a_node_whose_name_resolved_late_gets_its_slots_and_pending_links_keep_theirs() -> None:
    peers = table(3, node=2, hosts={0: frozenset(), 1: frozenset({"10.0.0.5"})})
    assert of(RefuseHandshake, peers.on_handshake_started(1, "10.0.0.9", 0.0))  # no host yet
    assert peers.on_handshake_started(2, "10.0.0.5", 0.0) == []
    peers.set_hosts({0: frozenset({"10.0.0.9"}), 1: frozenset({"10.0.0.5"})})
    assert peers.on_handshake_started(3, "10.0.0.9", 0.0) == []  # node 0's links are admitted
    peers.on_handshake_over(2)  # a link pending across the change ends as usual
    peers.on_handshake_over(3)
    assert peers.statistics().handshakes_pending == 0


def test_node_zero_accepts_nobody() -> None:
    peers = table(3, node=0, hosts=THREE)
    assert of(RefuseHandshake, peers.on_handshake_started(1, "10.0.0.5", 0.0))


def test_each_dialling_node_has_its_slots_and_a_full_host_replaces_its_oldest() -> None:
    hosts = {n: frozenset({"10.0.0.1"}) for n in range(3)} | {3: frozenset({"10.0.0.2"})}
    peers = table(5, node=4, hosts=hosts, spare_slots=1)  # 10.0.0.1: 3 + 1, 10.0.0.2: 1 + 1
    assert [peers.on_handshake_started(i, "10.0.0.1", 0.0) for i in range(4)] == [[]] * 4
    assert peers.on_handshake_started(4, "10.0.0.1", 0.5) == [
        CloseHandshake(
            link_id=0,
            reason="replaced by a newer link from 10.0.0.1: 4 handshakes may be pending from "
            "it (one per node there that dials this one, plus spare)",
        )
    ]
    assert of(CloseHandshake, peers.on_handshake_started(5, "10.0.0.1", 0.5))[0].link_id == 1
    # the other host's slots are its own: the flood from 10.0.0.1 takes none of them
    assert peers.on_handshake_started(6, "10.0.0.2", 0.5) == []
    assert peers.on_handshake_started(7, "10.0.0.2", 0.5) == []
    peers.on_handshake_over(6)  # authenticated: its slot is free
    assert peers.on_handshake_started(8, "10.0.0.2", 0.5) == []
    stats = peers.statistics()
    assert (stats.handshakes_pending, stats.gate.evicted, stats.handshakes_refused) == (6, 2, 2)
    # the evicted links hold no deadline: the rest close at theirs
    closed = of(CloseHandshake, peers.on_timer(2.5))
    assert sorted(c.link_id for c in closed) == [2, 3, 4, 5, 7, 8]


def test_a_flood_cannot_keep_a_dialling_node_out() -> None:
    """However many links a host opens, the newest one gets a slot and may authenticate."""
    peers = table(3, node=2, hosts={0: frozenset({"a"}), 1: frozenset({"b"})}, spare_slots=0)
    for i in range(10_000):
        peers.on_handshake_started(i, "b", 0.0)  # node 1's host floods
        assert peers.on_handshake_started(100_000 + i, "x", 0.0)  # others are refused
    assert peers.on_handshake_started(-1, "a", 0.0) == []  # node 0's own slot is free
    assert peers.on_handshake_started(-2, "b", 0.0)  # the newest from b always gets in
    peers.on_handshake_over(-2)  # ... and may authenticate
    assert peers.statistics().handshakes_pending == 1


def test_dialled_handshakes_count_towards_no_slot() -> None:
    peers = table(node=1, hosts={0: frozenset({"a"})}, spare_slots=0)
    for i in range(10):
        assert peers.on_handshake_started(i, "a", 0.0, accepted=False) == []
    assert peers.on_handshake_started(10, "a", 0.0) == []
    assert of(CloseHandshake, peers.on_timer(2.0)) == [
        CloseHandshake(link_id=i, reason="no handshake within 2.0s") for i in range(11)
    ]


def test_a_link_id_is_in_one_handshake_at_a_time() -> None:
    peers = table(node=1, hosts={0: frozenset({"a"})})
    peers.on_handshake_started(1, "a", 0.0)
    with pytest.raises(ValueError, match="already in its handshake"):
        peers.on_handshake_started(1, "a", 0.0, accepted=False)


# -- timers and status ------------------------------------------------------------------------
def test_no_deadline_without_live_peers() -> None:
    peers = table(4)
    assert peers.next_deadline() is None
    assert peers.on_timer(100.0) == []
    up(peers, 2, now=1.0)
    assert peers.next_deadline() == 1.0  # the first heartbeat is due at once
    drive(peers, 10.0)
    assert peers.next_deadline() is None


def test_a_deadline_at_zero_is_a_deadline() -> None:
    peers = table(now=0.0)
    up(peers, now=0.0)
    assert peers.next_deadline() == 0.0
    assert peers.on_timer(0.0) == [SendFrame(node=1, frame=Heartbeat())]


def test_peers_reports_state_incarnation_links_and_silence() -> None:
    peers = table(3, now=1.0)
    up(peers, 1, incarnation=4, now=2.0)
    drive(peers, 2.5)
    info = {i.node: i for i in peers.peers(2.5)}
    assert info[1].state is PeerState.SUSPECT
    assert info[1].incarnation == 4
    assert info[1].silent_for == pytest.approx(0.5)
    assert info[1].state_for == pytest.approx(0.2)
    assert info[1].links == {CONTROL}
    assert info[2].state is PeerState.CONNECTING
    assert info[2].incarnation is None
    assert info[2].silent_for is None
    assert info[2].state_for == pytest.approx(1.5)
    assert info[2].links == frozenset()


@pytest.mark.parametrize(
    ("interval", "suspect", "down"),
    [(0.0, 1.0, 2.0), (1.0, 1.0, 2.0), (0.1, 0.5, 0.4), (-1.0, 1.0, 2.0)],
)
def test_timeouts_must_be_ordered(interval: float, suspect: float, down: float) -> None:
    with pytest.raises(ValueError, match="heartbeat_interval < suspect_after"):
        Timeouts(heartbeat_interval=interval, suspect_after=suspect, down_after=down)


@pytest.mark.parametrize(
    "settings",
    [
        {"handshake_timeout": 0.0},
        {"max_backoff": -1.0},
        {"spare_slots": -1},
    ],
)
def test_limits_must_be_positive(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        table(**settings)


def test_suspect_after_may_equal_down_after() -> None:
    timeouts = Timeouts(heartbeat_interval=0.1, suspect_after=1.0, down_after=1.0)
    peers = table(timeouts=timeouts)
    up(peers)
    assert [(t, c.new) for t, c in changes(drive(peers, 5.0))] == [(1.0, PeerState.DOWN)]


# -- the failure-detection bound --------------------------------------------------------------
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
ME = 1  #: dialled by node 0, dials nodes 2 and 3
OTHERS = [n for n in range(NODES) if n != ME]
HOSTS = ("a", "b", "c")
HANDSHAKE_TIMEOUT = 0.5
MAX_BACKOFF = 0.4
SPARE = 1
#: node 0 (the one that dials ME) is on host a; b is node 2's, c nobody's
NODE_HOSTS = {0: frozenset({"a"}), 1: frozenset({"a"}), 2: frozenset({"b"}), 3: frozenset({"b"})}

nodes = st.sampled_from(OTHERS)
channels = st.sampled_from([CONTROL, DATA])
#: the incarnation of a new link, relative to the newest admitted: mostly the same daemon
deltas = st.sampled_from([0, 0, 0, 1, 2, -1])
steps = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(min_value=0.0, max_value=0.7)),
        st.tuples(st.just("start")),
        st.tuples(st.just("authenticated"), nodes, channels, deltas),
        st.tuples(st.just("connected"), nodes, deltas),
        st.tuples(st.just("closed"), nodes, channels),
        st.tuples(st.just("heard"), nodes),
        st.tuples(st.just("bye"), nodes),
        st.tuples(st.just("dial_failed"), nodes),
        st.tuples(st.just("handshakes"), st.sampled_from(HOSTS), st.booleans(), st.integers(1, 4)),
        st.tuples(st.just("handshake_over"), st.integers(0, 8), st.booleans()),
    ),
    max_size=80,
)


@dataclass(frozen=True)
class Authenticated:
    """The link the call under check is about."""

    node: int
    channel: Channel
    incarnation: int
    state: PeerState  #: the peer's state before the call
    known: int | None  #: the newest incarnation admitted before the call


@dataclass
class Shell:
    """Plays the daemon: performs the actions on a model and checks every one of them."""

    peers: PeerTable
    now: float
    state: dict[int, PeerState] = field(default_factory=dict)
    heard: dict[int, float] = field(default_factory=dict)  #: last contact while live
    links: dict[tuple[int, Channel], int] = field(default_factory=dict)  #: -> incarnation
    newest: dict[int, int] = field(default_factory=dict)  #: of the last admitted control link
    dialling: set[int] = field(default_factory=set)
    handshakes: dict[int, tuple[str, bool, float]] = field(default_factory=dict)
    next_link: int = 0

    def __post_init__(self) -> None:
        self.state = {n: PeerState.CONNECTING for n in OTHERS}
        self.heard = {n: -math.inf for n in OTHERS}

    def perform(self, actions: list[Action], link: Authenticated | None = None) -> None:
        for action in actions:
            self.check(action, link)
        for node in OTHERS:
            mine = {ch for (n, ch) in self.links if n == node}
            info = next(i for i in self.peers.peers(self.now) if i.node == node)
            assert info.links == mine
            assert DATA not in mine or CONTROL in mine
            assert info.state is self.state[node]
        after = self.peers.next_deadline()
        assert after is None or after >= self.now  # nothing is overdue after an input

    def check(self, action: Action, link: Authenticated | None) -> None:
        match action:
            case SendFrame(node=node, frame=frame):
                assert isinstance(frame, Heartbeat)
                assert (node, CONTROL) in self.links
            case StateChanged(node=node, old=old, new=new, reason=reason):
                assert old is self.state[node]
                assert new is not old
                assert reason
                if new is PeerState.DOWN:
                    assert self.now >= self.heard[node] + TIMEOUTS.down_after
                if new is PeerState.SUSPECT and reason.startswith("silent"):
                    assert self.now >= self.heard[node] + TIMEOUTS.suspect_after
                self.state[node] = new
            case PeerRestarted(node=node, old_incarnation=old, new_incarnation=new):
                assert link is not None
                assert (node, old, new) == (link.node, link.known, link.incarnation)
            case PeerUp(node=node):
                assert (node, DATA) in self.links  # both links are up
            case AdmitLink(node=node, channel=channel):
                self.admit(node, channel, link)
            case RefuseLink(node=node, channel=channel):
                assert link is not None
                assert (link.node, link.channel) == (node, channel)
            case ResetPeer(node=node):
                for channel in (CONTROL, DATA):
                    self.links.pop((node, channel), None)
            case Dial(node=node):
                assert node in self.peers.dial_targets()
                assert node not in self.dialling
                self.dialling.add(node)
            case DialRetry(node=node):
                assert node not in self.dialling
            case RefuseHandshake(link_id=link_id):
                host, accepted, _ = self.handshakes.pop(link_id)
                assert accepted
                assert host != "a"  # only node 0 dials ME
            case CloseHandshake(link_id=link_id):
                host, accepted, started = self.handshakes.pop(link_id)
                mine = [h for h, a, _ in self.handshakes.values() if a]
                evicted = accepted and mine.count(host) >= 1 + SPARE
                assert evicted or self.now >= started + HANDSHAKE_TIMEOUT
            case Notice():
                pass

    def admit(self, node: int, channel: Channel, link: Authenticated | None) -> None:
        assert link is not None
        assert (link.node, link.channel) == (node, channel)
        assert (node, channel) not in self.links  # never two admitted links of one channel
        if link.known is not None and link.incarnation < link.known:  # stale: only after DOWN
            assert link.state is PeerState.DOWN
        if channel is DATA:  # only beside a control link of the same incarnation
            assert self.links.get((node, CONTROL)) == link.incarnation
            self.dialling.discard(node)
        else:
            self.newest[node] = link.incarnation
            self.heard[node] = self.now
        self.links[node, channel] = link.incarnation

    def authenticated(self, node: int, channel: Channel, incarnation: int) -> None:
        link = Authenticated(node, channel, incarnation, self.state[node], self.newest.get(node))
        self.perform(self.peers.on_link_authenticated(node, channel, incarnation, self.now), link)

    def timers(self, until: float) -> None:
        for _ in range(MAX_FIRINGS):
            deadline = self.peers.next_deadline()
            if deadline is None or deadline > until:
                return
            assert deadline >= self.now  # nothing was left overdue
            self.now = deadline
            self.perform(self.peers.on_timer(self.now))
            self.check_settled()
        raise AssertionError("the timer never stopped firing")

    def check_settled(self) -> None:
        """Right after the timer ran, nothing is due and no peer is past a bound."""
        after = self.peers.next_deadline()
        assert after is None or after > self.now
        for node, state in self.state.items():
            if state in (PeerState.UP, PeerState.SUSPECT):
                assert self.now < self.heard[node] + TIMEOUTS.down_after
            if state is PeerState.UP:
                assert self.now < self.heard[node] + TIMEOUTS.suspect_after

    def step(self, step: tuple) -> None:
        peers, now = self.peers, self.now
        match step:
            case ("advance", dt):
                self.timers(now + dt)
                self.now = now + dt
            case ("start",):
                self.perform(peers.start(now))
            case ("authenticated", node, channel, delta):
                self.authenticated(node, channel, (self.newest.get(node) or 0) + delta)
            case ("connected", node, delta):  # what a dial does when all goes well
                incarnation = (self.newest.get(node) or 0) + delta
                self.authenticated(node, CONTROL, incarnation)
                self.authenticated(node, DATA, incarnation)
            case ("closed", node, channel) if (node, channel) in self.links:
                self.perform(peers.on_link_closed(node, channel, now))
            case ("heard", node):
                if self.state[node] in (PeerState.UP, PeerState.SUSPECT):
                    self.heard[node] = now
                self.perform(peers.on_heard(node, now))
            case ("bye", node):
                peers.on_bye(node)
            case ("dial_failed", node) if node in self.dialling:
                self.dialling.discard(node)
                self.perform(peers.on_dial_failed(node, "connection refused", now))
            case ("handshakes", host, accepted, count):
                for link_id in range(self.next_link, self.next_link + count):
                    self.handshakes[link_id] = (host, accepted, now)
                    self.perform(peers.on_handshake_started(link_id, host, now, accepted=accepted))
                self.next_link += count
            case ("handshake_over", pick, failed) if self.handshakes:
                link_id = sorted(self.handshakes)[pick % len(self.handshakes)]
                del self.handshakes[link_id]
                peers.on_handshake_over(link_id, failed=failed)
                self.perform([])


@settings(max_examples=300, deadline=None)
@given(start=st.floats(min_value=0.0, max_value=1e7), history=steps)
def test_random_histories_keep_the_invariants(start: float, history: list[tuple]) -> None:
    peers = PeerTable(
        node=ME,
        nodes=NODES,
        timeouts=TIMEOUTS,
        now=start,
        handshake_timeout=HANDSHAKE_TIMEOUT,
        max_backoff=MAX_BACKOFF,
        hosts=NODE_HOSTS,
        spare_slots=SPARE,
    )
    shell = Shell(peers, start)
    for step in history:
        shell.step(step)
    quiet = max(TIMEOUTS.down_after, HANDSHAKE_TIMEOUT, MAX_BACKOFF) + TIMEOUTS.heartbeat_interval
    shell.timers(shell.now + quiet)
    assert all(s in (PeerState.CONNECTING, PeerState.DOWN) for s in shell.state.values())
    assert not shell.links
    assert not shell.handshakes
    assert peers.next_deadline() is None
    assert peers.statistics().handshakes_pending == 0
