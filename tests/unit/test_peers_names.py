"""Names in the peers engine (membership from etcd): a link is admitted as a node id only from
the name, and the registered incarnation, this node's view of etcd has in that slot
(fabricd/engines/link/peers.py, "Names").  A view that lags refuses the new holder for now,
never fences it; incarnations are compared with the registered one, never ordered by clock."""

from __future__ import annotations

from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import (
    AdmitLink,
    Dial,
    PeerRestarted,
    PeerState,
    PeerTable,
    PeerUp,
    RefuseLink,
    ResetPeer,
    Timeouts,
)

TIMEOUTS = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)


def table(*, named: bool = True) -> PeerTable:
    """Node 0 of 4 slots: it dials 1, 2 and 3."""
    return PeerTable(node=0, nodes=4, timeouts=TIMEOUTS, now=0.0, named=named)


def link(peers: PeerTable, node: int, name: str, inc: int, now: float) -> list[object]:
    """``name``'s control then data link, as ``node``, of incarnation ``inc``."""
    actions: list[object] = []
    for channel in (Channel.CONTROL, Channel.DATA):
        actions += peers.on_link_authenticated(node, channel, inc, now, name)
    return actions


def admitted(actions: list[object]) -> list[Channel]:
    return [a.channel for a in actions if isinstance(a, AdmitLink)]


def refused(actions: list[object]) -> list[str]:
    return [a.reason for a in actions if isinstance(a, RefuseLink)]


def resets(actions: list[object]) -> list[int]:
    return [a.node for a in actions if isinstance(a, ResetPeer)]


def test_a_stale_view_refuses_the_new_holder_until_it_names_it_then_admits_it() -> None:
    """Slot 2 went from a to d; this node's view still says a (cut off from etcd, a watch
    behind).  d's links are refused, and nothing is fenced: once the view names d, the same
    incarnation is admitted (before the fix, d was admitted as a and later refused for good)."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "a", 500, 0.0)
    refusals = link(peers, 2, "d", 100, 1.0)
    assert admitted(refusals) == []
    assert len(refused(refusals)) == 2  # control and data
    assert "'d' does not hold node id 2" in refused(refusals)[0]
    assert "held by 'a'" in refused(refusals)[0]
    assert "until the view has it" in refused(refusals)[0]
    assert resets(refusals) == []
    assert peers.state(2) is PeerState.CONNECTING
    assert peers.incarnation(2) is None

    assert peers.set_holder(2, "", None, 2.0) == []  # a's registration went: still not d's
    assert refused(link(peers, 2, "d", 100, 2.1))
    assert "(free)" in refused(link(peers, 2, "", 100, 2.2))[0]  # no name holds a free slot
    assert peers.set_holder(2, "d", 100, 3.0) == []  # the view caught up
    actions = link(peers, 2, "d", 100, 3.1)
    assert admitted(actions) == [Channel.CONTROL, Channel.DATA]
    assert any(isinstance(a, PeerUp) for a in actions)
    assert peers.state(2) is PeerState.UP
    assert peers.incarnation(2) == 100


def test_a_new_holder_with_a_lower_incarnation_is_admitted_when_its_registration_names_it() -> None:
    """d's clock is behind a's: its incarnation (start time) is lower than the one a's links
    were admitted with.  Ordered by time it was refused as a dead a; named by its registration,
    it is admitted, and a's links are closed when the view gives the slot to d."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "a", 500, 0.0)
    assert admitted(link(peers, 2, "a", 500, 0.1)) == [Channel.CONTROL, Channel.DATA]

    handover = peers.set_holder(2, "d", 100, 1.0)
    assert resets(handover) == [2]
    assert "its id went to 'd'" in next(a.reason for a in handover if isinstance(a, ResetPeer))
    assert peers.state(2) is PeerState.DOWN

    actions = link(peers, 2, "d", 100, 1.1)
    assert admitted(actions) == [Channel.CONTROL, Channel.DATA]
    assert [
        (a.old_incarnation, a.new_incarnation) for a in actions if isinstance(a, PeerRestarted)
    ] == [(500, 100)]
    assert peers.state(2) is PeerState.UP
    assert peers.incarnation(2) == 100


def test_the_old_holders_late_links_are_refused_and_leave_the_new_holder_alone() -> None:
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "d", 100, 0.0)
    link(peers, 2, "d", 100, 0.1)
    late = link(peers, 2, "a", 500, 0.2)  # a, away from etcd, still dials as id 2
    assert admitted(late) == []
    assert "'a' does not hold node id 2" in refused(late)[0]
    assert resets(late) == []
    assert peers.state(2) is PeerState.UP
    assert peers.incarnation(2) == 100
    again = peers.on_link_authenticated(2, Channel.CONTROL, 100, 0.3, "d")  # d reconnects
    assert admitted(again) == [Channel.CONTROL]


def test_links_of_the_new_holder_while_the_old_ones_are_up_wait_for_the_view() -> None:
    """The view lags: a's links are up, d's are refused and a's stay; when the view gives
    the slot to d, a's links go and d's are admitted."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "a", 500, 0.0)
    link(peers, 2, "a", 500, 0.1)
    assert refused(link(peers, 2, "d", 100, 0.2))
    assert peers.state(2) is PeerState.UP
    assert peers.incarnation(2) == 500
    assert resets(peers.set_holder(2, "d", 100, 0.5)) == [2]
    assert admitted(link(peers, 2, "d", 100, 0.6)) == [Channel.CONTROL, Channel.DATA]


def test_an_incarnation_other_than_the_registered_one_is_refused_until_registered() -> None:
    """x restarted with its clock stepped back: its new incarnation is lower.  The old one's
    links are refused once the new one is registered; the new one until then."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(3, "x", 200, 0.0)
    link(peers, 3, "x", 200, 0.1)
    early = peers.on_link_authenticated(3, Channel.CONTROL, 150, 0.2, "x")
    assert "incarnation 150 of 'x' is not the one registered in etcd (200)" in refused(early)[0]
    assert peers.incarnation(3) == 200

    restart = peers.set_holder(3, "x", 150, 1.0)
    assert resets(restart) == [3]
    reasons = [a.reason for a in restart if isinstance(a, ResetPeer)]
    assert "'x' registered again as incarnation 150" in reasons[0]
    assert admitted(link(peers, 3, "x", 150, 1.1)) == [Channel.CONTROL, Channel.DATA]
    assert refused([*peers.on_link_authenticated(3, Channel.CONTROL, 200, 1.2, "x")])
    assert peers.incarnation(3) == 150


def test_the_same_registration_read_again_changes_nothing() -> None:
    """A full read repeats every registration (after a reconnection, every 60 s): the links of
    the holder it names stay; so do they when its slot goes free (liveness decides them)."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(1, "b", 7, 0.0)
    link(peers, 1, "b", 7, 0.1)
    assert peers.set_holder(1, "b", 7, 0.2) == []
    assert peers.set_holder(1, "", None, 0.3) == []
    assert peers.state(1) is PeerState.UP
    assert refused([*peers.on_link_authenticated(1, Channel.CONTROL, 7, 0.4, "b")])  # free now


def test_a_registration_without_an_incarnation_checks_the_name_and_orders_one_names() -> None:
    """A registration that carries no incarnation: the name decides; a link of another name
    than the last admitted is that node's first (never ordered by clock against another
    node's), and among one name's links an older one is a dead process's, as before."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "a", None, 0.0)
    link(peers, 2, "a", 500, 0.1)
    assert "incarnation 400 is dead" in refused(link(peers, 2, "a", 400, 0.2))[0]
    assert resets(peers.set_holder(2, "d", None, 1.0)) == [2]
    assert admitted(link(peers, 2, "d", 100, 1.1)) == [Channel.CONTROL, Channel.DATA]
    assert peers.incarnation(2) == 100


def test_the_view_naming_a_holder_brings_a_waiting_dial_forward() -> None:
    """The dial of d was refused while the view lagged and waits its backoff: the view
    naming d dials it at once, so the fabric heals when etcd's news arrives."""
    peers = table()
    peers.start(0.0)
    peers.set_holder(2, "a", 500, 0.0)
    assert refused(peers.on_link_authenticated(2, Channel.CONTROL, 100, 0.1, "d"))
    now = 0.1
    for _ in range(6):  # the backoff grows past a second
        peers.on_dial_failed(2, "link refused", now)
        now = peers.next_deadline() or now
        assert [a.node for a in peers.on_timer(now) if isinstance(a, Dial)] == [2]
    peers.on_dial_failed(2, "link refused", now)
    assert (peers.next_deadline() or 0.0) > now + 1.0
    peers.set_holder(2, "d", 100, now + 0.01)
    assert peers.next_deadline() == now + 0.01
    assert [a.node for a in peers.on_timer(now + 0.01) if isinstance(a, Dial)] == [2]


def test_a_static_list_looks_at_no_name() -> None:
    """Without membership from etcd the name a HELLO carries (any, or none) changes nothing:
    incarnations are ordered by start time as they always were."""
    peers = table(named=False)
    peers.start(0.0)
    assert admitted(link(peers, 1, "", 500, 0.1)) == [Channel.CONTROL, Channel.DATA]
    assert "incarnation 400 is dead" in refused(link(peers, 1, "other", 400, 0.2))[0]
    assert peers.on_link_authenticated(1, Channel.CONTROL, 500, 0.3, "renamed")[0] == ResetPeer(
        node=1, reason="reconnected"
    )


def test_the_view_check_is_asked_of_a_hello_before_it_is_answered() -> None:
    """The peering service asks it (on_hello) of every HELLO before answering it, so a refused
    dialler sees a failed dial (and backs off) and a refused acceptor an unfinished handshake,
    rather than a link that comes up and is closed at once (that the service asks it first:
    test_peering_view_check.py).  A refusal there counts as a refused link."""
    peers = table()
    peers.set_holder(2, "a", 500, 0.0)
    assert peers.not_in_view(2, "a", 500) == ""
    assert "held by 'a'" in peers.not_in_view(2, "d", 100)
    assert "not the one registered" in peers.not_in_view(2, "a", 400)
    assert "(free)" in peers.not_in_view(1, "b", 1)
    assert table(named=False).not_in_view(2, "anyone", 1) == ""
    assert peers.statistics().links_refused == 0  # not_in_view only asks
    assert peers.on_hello(2, "a", 500) == ""
    assert peers.on_hello(2, "a", 400) == peers.not_in_view(2, "a", 400)
    assert peers.statistics().links_refused == 1
    assert peers.statistics().handshakes_refused == 0
