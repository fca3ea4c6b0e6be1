"""Review of membership's suspicion as the services see it: a restart seen by a new control
link, a finished job's suspicions, the cost of an ANNOUNCE, and the counting of resends.

Every test here shows a bug the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

from typing import Any

from fabricd.daemon.config import Config
from fabricd.daemon.services.membership import MembershipService
from fabricd.engines.link import peers
from fabricd.engines.link.handshake import Channel
from fabricd.engines.link.peers import PeerTable, Timeouts
from fabricd.engines.membership import (
    Membership,
    NodeBack,
    NodeGone,
    RankBack,
    RankGone,
    RankJoined,
    RankLeft,
    RankSuspected,
)
from fabricd.engines.ownership import User
from fabricd.frames.membership import Announce
from tests.unit.test_stochastic_service_review import call, client
from tests.unit.test_stochastic_service_review import service as stochastic_service

ALICE, BOB = User(uid=1000), User(uid=2000)

ANNOUNCE = Announce(job="j", rank=1, size=2, present=True, owner=1000)


class Host:
    """What the membership service needs of its node: the suspicion events it passes on."""

    def __init__(self) -> None:
        self.config = Config(node_id=0, nodes=("127.0.0.1:1", "127.0.0.1:2"))
        self.events: list[Any] = []
        self.incarnation = 1

    def send(self, node: int, frame: Any) -> None: ...

    def broadcast(self, frame: Any) -> None: ...

    def rank_event(self, event: Any) -> None: ...

    def suspicion(self, event: Any) -> None:
        self.events.append(event)


def table(nodes: int = 2) -> PeerTable:
    timeouts = Timeouts(heartbeat_interval=0.1, suspect_after=0.3, down_after=1.0)
    return PeerTable(node=0, nodes=nodes, now=0.0, timeouts=timeouts)


def perform(svc: MembershipService, actions: list[Any], now: float) -> None:
    """What the peering service and the node do with the peers engine's actions: a reset
    reaches every service's ``peer_down``, both links up their ``peer_up``."""
    for action in actions:
        if isinstance(action, peers.ResetPeer):
            svc.peer_down(action.node, action.reason, now)
        elif isinstance(action, peers.PeerUp):
            svc.peer_up(action.node, now)


# -- a restart seen by the new daemon's control link ------------------------------------------
def test_restart_detected_by_new_control_link_is_gone_not_back() -> None:
    """A node that restarts while its links still look up is gone, not back.

    The peers engine sees the restart when the new daemon's control link is admitted: it
    resets the old links (ResetPeer "restarted") but has taken the new incarnation by the time
    the service hears of the reset.  The service asked the engine, so membership recorded
    the new incarnation as the reset one and called the new daemon the same (NodeBack, and
    RankBack on its announcement: the reducers resent into a daemon that never had them)."""
    peer_table, host = table(), Host()
    svc = MembershipService(host, incarnation=peer_table.incarnation)  # type: ignore[arg-type]
    perform(svc, peer_table.on_link_authenticated(1, Channel.CONTROL, 7, 0.0), 0.0)
    perform(svc, peer_table.on_link_authenticated(1, Channel.DATA, 7, 0.0), 0.0)
    svc.on_frame(1, ANNOUNCE, 0.0)
    perform(svc, peer_table.on_link_authenticated(1, Channel.CONTROL, 8, 0.5), 0.5)
    perform(svc, peer_table.on_link_authenticated(1, Channel.DATA, 8, 0.5), 0.5)
    svc.on_frame(1, ANNOUNCE, 0.5)
    kinds = [type(e) for e in host.events]
    assert NodeBack not in kinds, host.events
    assert RankBack not in kinds, host.events
    assert NodeGone in kinds
    assert RankGone in kinds


def test_a_reconnect_of_the_same_daemon_is_still_back() -> None:
    """The other side of the fix above: links of the same daemon that reconnect (the control
    link SAME, ResetPeer "reconnected") leave the node and its rank back, not gone."""
    peer_table, host = table(), Host()
    svc = MembershipService(host, incarnation=peer_table.incarnation)  # type: ignore[arg-type]
    perform(svc, peer_table.on_link_authenticated(1, Channel.CONTROL, 7, 0.0), 0.0)
    perform(svc, peer_table.on_link_authenticated(1, Channel.DATA, 7, 0.0), 0.0)
    svc.on_frame(1, ANNOUNCE, 0.0)
    perform(svc, peer_table.on_link_authenticated(1, Channel.CONTROL, 7, 0.5), 0.5)
    perform(svc, peer_table.on_link_authenticated(1, Channel.DATA, 7, 0.5), 0.5)
    svc.on_frame(1, ANNOUNCE, 0.5)
    assert [type(e) for e in host.events] == [RankSuspected, NodeBack, RankBack]


# -- the cost of an ANNOUNCE ------------------------------------------------------------------
def test_the_peers_engine_tells_one_nodes_incarnation_alone() -> None:
    """An ANNOUNCE asked the peers engine for the announcer's incarnation by building every
    peer's status row (``peers(now)``: a PeerInfo and a frozenset each) and scanning them, so
    each cost O(nodes).  The engine answers for one node now, and the service asks it for the
    announcer only, once per announcement."""
    peer_table = table(nodes=64)
    assert peer_table.incarnation(5) is None  # no link yet
    peer_table.on_link_authenticated(5, Channel.CONTROL, 42, 0.0)
    assert (peer_table.incarnation(5), peer_table.incarnation(6)) == (42, None)
    asked: list[int] = []

    def incarnation(node: int) -> int | None:
        asked.append(node)
        return peer_table.incarnation(node)

    svc = MembershipService(Host(), incarnation=incarnation)  # type: ignore[arg-type]
    for rank in range(3):
        svc.on_frame(5, Announce(job="j", rank=rank, size=3, present=True, owner=1000), 0.0)
    assert asked == [5, 5, 5]


# -- a finished job's suspicions --------------------------------------------------------------
def rank_one_suspected() -> Membership:
    """Job 'j': rank 0 here, rank 1 on node 1, whose links were reset at 0 (rank 1 suspected
    until 10); then rank 0's trainer left at 1, so no rank of the job is known here."""
    m = Membership(node=0, down_after=10.0)
    m.attach("j", 0, 2, user=ALICE)
    m.on_announce(1, Announce(job="j", rank=1, size=2, present=True, owner=ALICE.uid), 7)
    m.peer_down(1, "unreachable (control link lost)", 0.0, 7)
    m.detach("j", 0, "rank 0 of job 'j' disconnected")
    assert m.job_size("j") is None
    return m


def test_a_later_job_of_the_name_never_loses_ranks_it_does_not_have() -> None:
    """A finished job's suspicion outlived it: a new job 'j' claimed before the old rank 1's
    deadline heard RankGone(j, 1) at 10 (the stochastic and PS services then failed or lost
    the new job's rank 1).  The claim that brings the name back ends the old suspicions
    first, so every service sees the old job end before the new one joins."""
    m = rank_one_suspected()
    actions = m.attach("j", 0, 2, user=BOB)  # t=2: a new job 'j' (another user's, even)
    events = [a for a in actions if isinstance(a, RankGone | RankJoined)]
    assert [type(e) for e in events] == [RankGone, RankJoined], actions
    assert (events[0].entry.rank, events[1].entry.rank) == (1, 0)
    assert not m.has_suspects("j")
    assert not [e for e in m.on_timer(10.0) if isinstance(e, RankGone | RankBack)]


def test_an_announcement_of_a_new_job_ends_the_old_ones_suspicions() -> None:
    """The same when the claim that brings the name back is a peer's ANNOUNCE (node 2's rank
    0 of the new job), not a local client's."""
    m = rank_one_suspected()
    ann = Announce(job="j", rank=0, size=2, present=True, owner=ALICE.uid)
    actions = m.on_announce(2, ann, 9)
    assert [type(a) for a in actions] == [RankGone, RankJoined], actions
    assert m.on_timer(10.0) == [NodeGone(node=1, reason="unreachable (control link lost)")]


def test_a_suspected_rank_back_is_no_new_job() -> None:
    """The rule's one exception: the claim is the suspected rank itself, back from the same
    node and daemon (a flap), so the job goes on: RankBack, not the end of the job."""
    m = rank_one_suspected()
    m.peer_up(1, 7)
    actions = m.on_announce(1, Announce(job="j", rank=1, size=2, present=True, owner=1000), 7)
    assert [type(a) for a in actions] == [RankBack, RankJoined], actions


def feed(svc: Any, actions: list[Any], now: float) -> None:
    """Membership's events to a service, as the membership service hands them on."""
    for a in actions:
        if isinstance(a, RankJoined | RankLeft):
            svc.on_rank_event(a, now)
        elif isinstance(a, RankSuspected | RankBack | RankGone | NodeBack | NodeGone):
            svc.on_suspicion(a, now)


def test_a_later_job_of_the_name_can_call_the_reduce() -> None:
    """The stochastic service kept a finished job's reducers while a rank of it was
    suspected: rank 0's closed reducer then failed the new job's call for good ("rank 0's
    trainer left during a call").  Its reducers are all local ranks', so they go once no rank
    of the job is known."""
    m = Membership(node=0, down_after=10.0)
    svc, host = stochastic_service(m)  # type: ignore[arg-type]
    ann = Announce(job="j", rank=1, size=2, present=True, owner=ALICE.uid)
    feed(svc, m.attach("j", 0, 2, user=ALICE), 0.0)
    feed(svc, m.on_announce(1, ann, 7), 0.0)
    old = client(0, 2)
    call(svc, old, 1)
    feed(svc, m.peer_down(1, "unreachable (control link lost)", 0.0, 7), 0.0)
    svc.client_gone(old, 1.0)
    feed(svc, m.detach("j", 0, "rank 0 of job 'j' disconnected"), 1.0)
    assert m.job_size("j") is None
    feed(svc, m.attach("j", 0, 2, user=ALICE), 2.0)
    feed(svc, m.peer_up(1, 7), 3.0)
    feed(svc, m.on_announce(1, ann, 7), 3.0)
    feed(svc, m.on_timer(20.0), 20.0)
    new = client(0, 2)
    call(svc, new, 2)
    assert host.answered.get(2) is None  # open: waits for rank 1's update, as it should
