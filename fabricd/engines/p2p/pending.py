"""What pending point-to-point operations wait for: stall deadlines, and the reports of
``fabricctl stalls``.

Rules: this module decides when an operation counts as stalled and describes what it waits
for; it reads the engine's tables (:mod:`~fabricd.engines.p2p.tables`) and changes none but
the stall deadlines.  The words of a report are :mod:`fabricd.engines.stalls`'.

Theory of operation: with ``stall_after`` set, every operation gets a stall deadline when it is
posted (one heap push) that is cancelled when it ends (one dict removal; the heap entry is
dropped lazily).  An operation still pending then is returned once from
:meth:`~fabricd.engines.p2p.matching.Messaging.on_timer` as a
:class:`~fabricd.engines.stalls.Stalled` saying what it waits for; :meth:`Pending.stalls`
describes every such operation on demand.  The timer is told about stall deadlines lazily
(``_stall_check``): it only ever moves earlier when an operation is posted and is recomputed
when it fires, so an operation that ends never moves the daemon's timer, and a busy daemon
wakes for stall checks about once per ``stall_after``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Final

from fabricd.engines.p2p.operations import Recv, RecvState, Send, SendState
from fabricd.engines.p2p.tables import ANNOUNCED, Tables
from fabricd.engines.stalls import Stalled, Waits, other_tags

if TYPE_CHECKING:
    from collections.abc import Callable

#: what an operation waits for in each state (a receive still POSTED: see ``_stalled``)
_SEND_WAITS: Final = {
    SendState.ROUTE: Waits.JOIN,
    SendState.QUEUED: Waits.MATCH,
    SendState.RTS: Waits.CTS,
    SendState.EAGER: Waits.DONE,
    SendState.STREAM: Waits.DONE,
    SendState.COPY: Waits.COPY,
}
_RECV_WAITS: Final = {RecvState.LANDING: Waits.DATA, RecvState.COPY: Waits.COPY}
#: a stall report names the other tags among at most this many of the peer's oldest operations
#: from (or to) the rank: a scan of all of them made each report O(pending), and a job whose
#: tags all disagree, O(pending^2) in one timer callback
_TAGS_SCANNED: Final = 64


class Pending(Tables):
    """Stall deadlines and reports: which operations have been pending past ``stall_after``,
    and what each waits for."""

    def _watch(self, op: int, now: float) -> None:
        """Give a new operation its stall deadline: one heap push."""
        if self.stall_after is None:
            return
        at = now + self.stall_after
        self._stall_at.set(op, at)
        if self._stall_check is None or at < self._stall_check:
            self._stall_check = at

    def _report_stalls(self, now: float) -> list[Stalled]:
        """The operations whose stall deadline is due, each described once (the timer's part
        of :meth:`~fabricd.engines.p2p.matching.Messaging.on_timer`)."""
        if self._stall_check is None or self._stall_check > now:
            return []
        reports: list[Stalled] = []
        for op in self._stall_at.pop_due(now):
            operation = self._sends.get(op) or self._recvs.get(op)
            if operation is not None:
                reports.append(self._stalled(operation, now))
                self._stalls_reported += 1
        self._stall_check = self._stall_at.next()
        return reports

    def stalls(
        self,
        now: float,
        keep: Callable[[int, str], bool] | None = None,
        limit: int | None = None,
    ) -> list[Stalled]:
        """Every operation pending for ``stall_after`` or longer, longest first, with what it
        waits for.  O(pending operations): an operator's query, not a hot path.

        Args:
            keep: asked once for every such operation, oldest first, with its op and job:
                whether to describe it (the asker may see it).
            limit: describe at most this many (the oldest ``keep`` accepted); ``keep`` is
                still asked about the rest, so it can count them.  Describing one costs tens
                of microseconds, and a client may have tens of thousands pending.
        """
        if self.stall_after is None:
            return []
        since = now - self.stall_after
        found: list[Send | Recv] = [s for s in self._sends.values() if s.posted <= since]
        found += [r for r in self._recvs.values() if r.posted <= since]
        found.sort(key=lambda operation: (operation.posted, operation.op))
        out: list[Stalled] = []
        for operation in found:
            if keep is not None and not keep(operation.op, operation.msg.job):
                continue
            if limit is None or len(out) < limit:
                out.append(self._stalled(operation, now))
        return out

    def stalled(self, now: float) -> int:
        """How many operations are pending for ``stall_after`` or longer (a metrics gauge);
        O(pending operations), nothing described."""
        if self.stall_after is None:
            return 0
        since = now - self.stall_after
        sends = sum(1 for send in self._sends.values() if send.posted <= since)
        return sends + sum(1 for recv in self._recvs.values() if recv.posted <= since)

    def _stalled(self, operation: Send | Recv, now: float) -> Stalled:
        """What ``operation`` waits for, and where its peer rank is."""
        msg = operation.msg
        is_send = isinstance(operation, Send)
        me, peer = (msg.src, msg.dst) if is_send else (msg.dst, msg.src)
        entry = self.routes.lookup(msg.job, peer)
        node = None if entry is None else entry.node
        received: int | None = None
        tags: set[int] = set()
        if isinstance(operation, Send):
            waits = _SEND_WAITS.get(operation.state, Waits.COPY)
            if operation.state in ANNOUNCED:
                node = operation.node
            elif waits is Waits.MATCH:  # receives the peer posted from this rank, other tags
                posted = self._recvs_from.get((msg.job, me), ())
                near = itertools.islice(posted, _TAGS_SCANNED)
                tags = {recv.msg.tag for recv in near if recv.msg.dst == peer}
        elif operation.state is RecvState.POSTED:
            if node is None:
                waits = Waits.JOIN
            else:
                waits = Waits.MATCH if node == self.node else Waits.RTS
                offers = self._offers_to.get((msg.job, me), ())
                first = itertools.islice(offers, _TAGS_SCANNED)
                tags = {offer.msg.tag for offer in first if offer.msg.src == peer}
        else:
            waits = _RECV_WAITS.get(operation.state, Waits.COPY)
            if operation.state is RecvState.LANDING:
                node = operation.source[0]
                received = self._landing.received(*operation.source)
        return Stalled(
            op=operation.op,
            send=is_send,
            msg=msg,
            node=self.node,
            pending_for=now - operation.posted,
            waits=waits,
            peer_node=node,
            peer_joined=entry is not None,
            other_tags=other_tags(tags, msg.tag),
            received=received,
        )
