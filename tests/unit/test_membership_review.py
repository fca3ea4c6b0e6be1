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
from fabricd.engines.membership import NodeBack, NodeGone, RankBack, RankGone, RankSuspected
from fabricd.frames.membership import Announce

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
