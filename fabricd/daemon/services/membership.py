"""The membership service: clients join jobs, and every daemon learns where each rank lives.

Drives :mod:`fabricd.engines.membership`.  A client's ``hello`` may claim a rank of a job; the
engine records it and ANNOUNCEs it to every peer, greets a peer that comes up with every local
rank, and forgets the ranks of a client that leaves or a node that goes down.  Each change is
passed on to every service as a :data:`~fabricd.engines.membership.RankEvent` (a send waiting
for its destination rank dispatches when the rank joins; operations with a rank that left fail).
The ranks of a node whose links were reset are suspected for ``down_after``; the engine's
verdicts on them and on their node (back from the same daemon, or gone) reach every service as
:data:`~fabricd.engines.membership.Suspicion` events: the service tells the engine which
incarnation the peers engine admitted for a node whenever the node's links or ranks change
(for a reset, the incarnation its links came up with: a restart is seen when the new daemon's
control link is admitted, before the old links are reset).

Jobs belong to the uid that opened them (:mod:`fabricd.engines.ownership`): a ``hello`` that
claims a rank of another user's job is refused with code ``permission`` unless a
``job_groups`` grant lets one of the client's groups in, and counted as ``refused_joins``.
The rows this service adds to ``status`` carry the job's ``owner``, so the node shows them only
to those who may see the job (:mod:`fabricd.daemon.access`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from fabricd.daemon import access
from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.jobs import refuse_while_draining
from fabricd.daemon.sessions import parse_hello
from fabricd.engines.actions import Broadcast, Notice, SendFrame
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
from fabricd.errors import PermissionDenied, UsageError
from fabricd.frames import membership as membership_frames
from fabricd.wire import PROTOCOL_VERSION, Kind, Meta

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.membership import Action
    from fabricd.frames import registry

log = logging.getLogger("fabricd.membership")
#: peers' announcements cause these lines: rate-limited
remote_log = RateLimitedLog(log)


class MembershipService(BaseService):
    """Who hosts which rank of which job, fabric-wide."""

    name = "membership"
    kinds = frozenset({Kind.ANNOUNCE})
    ops = frozenset({"hello"})

    def __init__(
        self, host: Host, *, incarnation: Callable[[int], int | None] | None = None
    ) -> None:
        """``incarnation``: the peers engine's newest admitted incarnation of a node
        (:meth:`~fabricd.engines.link.peers.PeerTable.incarnation`, O(1)), which tells a node
        back after a reset from a new daemon (without it, every node counts as the same
        daemon)."""
        self.host = host
        self._incarnation_of = incarnation
        #: the incarnation each node's links came up with (:meth:`peer_up`), until they are
        #: reset: the one a reset loses.  A restart is seen when the new daemon's control link
        #: is admitted, so by the time :meth:`peer_down` hears of the reset the peers engine
        #: already holds the new incarnation.
        self._up: dict[int, int | None] = {}
        self.engine = Membership(
            node=host.config.node_id,
            ownership=access.ownership(host.config),
            max_ranks_per_peer=host.config.max_ranks_per_peer,
            down_after=host.config.down_after,
        )

    def on_request(self, request: Request, now: float) -> Meta:
        session = request.session
        if session.job is not None:
            raise UsageError("this connection already joined a job")
        claim = parse_hello(request.meta)
        if claim is not None:
            refuse_while_draining(self.host)
            job, rank, size = claim
            creds = session.conn.credentials
            try:
                actions = self.engine.attach(job, rank, size, user=access.user_of(session))
            except PermissionDenied:  # counted; debug only, as a client may retry at will
                log.debug(
                    "client %d (pid %d, uid %d) refused job %r: it belongs to uid %s",
                    session.conn.id,
                    creds.pid,
                    creds.uid,
                    job,
                    self.engine.owner(job),
                )
                raise
            self._perform(actions)
            session.job, session.rank, session.size = job, rank, size
            log.info(
                "client %d (pid %d, uid %d) joined job %r as rank %d of %d",
                session.conn.id,
                creds.pid,
                creds.uid,
                job,
                rank,
                size,
            )
        cfg = self.host.config
        return {
            "node": cfg.node_id,
            "nodes": len(cfg.nodes),
            "incarnation": self.host.incarnation,
            "version": PROTOCOL_VERSION,
        }

    def on_frame(self, node: int, frame: registry.PeerFrame, now: float) -> None:
        assert isinstance(frame, membership_frames.Announce)
        # (a frame comes on a current link: the newest incarnation is the announcer's)
        self._perform(self.engine.on_announce(node, frame, self._incarnation(node)))

    def peer_up(self, node: int, now: float) -> None:
        # the peer forgot our ranks in its reset
        incarnation = self._up[node] = self._incarnation(node)
        self._perform(self.engine.peer_up(node, incarnation))

    def peer_down(self, node: int, reason: str, now: float) -> None:
        # the links' own incarnation, not the peers engine's: a restart resets them after
        # admitting the new daemon's control link (a node never up: the engine's, as nothing
        # of it can have been lost but what its links were admitted with)
        incarnation = self._up.pop(node) if node in self._up else self._incarnation(node)
        self._perform(self.engine.peer_down(node, reason, now, incarnation))

    def next_deadline(self) -> float | None:
        return self.engine.next_deadline()

    def on_timer(self, now: float) -> None:
        self._perform(self.engine.on_timer(now))

    def _incarnation(self, node: int) -> int | None:
        """The incarnation the peers engine last admitted for ``node``, if it knows one."""
        return None if self._incarnation_of is None else self._incarnation_of(node)

    def client_gone(self, session: ClientSession, now: float) -> None:
        if session.job is None:
            return
        reason = f"rank {session.rank} of job {session.job!r} disconnected"
        log.info(
            "rank %d of job %r left (client %d: %s)",
            session.rank,
            session.job,
            session.conn.id,
            session.conn.close_reason,
        )
        self._perform(self.engine.detach(session.job, session.rank, reason))

    def statistics(self) -> Meta:
        engine = self.engine
        ranks = [{**dataclasses.asdict(e), "owner": engine.owner(e.job)} for e in engine.entries()]
        stats = engine.statistics()
        counters = {
            "refused_joins": stats.refused_joins,
            "refused_announcements": stats.refused_announcements,
        }
        return {"ranks": ranks, "counters": counters}

    def client_statistics(self, session: ClientSession) -> Meta:
        if session.job is None:
            return {}
        return {"owner": self.engine.owner(session.job)}

    def _perform(self, actions: Iterable[Action]) -> None:
        for action in actions:
            match action:
                case SendFrame(node=node, frame=frame):
                    self.host.send(node, frame)
                case Broadcast(frame=frame):
                    self.host.broadcast(frame)
                case RankJoined() | RankLeft():
                    self.host.rank_event(action)
                case RankSuspected() | RankBack() | RankGone() | NodeBack() | NodeGone():
                    self.host.suspicion(action)
                case Notice(message=message):  # ignored announcements: a peer's doing
                    remote_log.warning("ignored announcement", "%s", message)
