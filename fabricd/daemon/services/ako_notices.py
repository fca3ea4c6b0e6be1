"""Who may send an Ako death notice (docs/ako.md, "A death notice names the incarnation").

A closed exchange's daemon sends every peer a PART naming the closed incarnation dead.  Like
any PART it counts only from the node its rank lives on (issue 28, docs/architecture.md "Who
may send a job's frames": :func:`fabricd.daemon.services.senders.sender`), with one addition:
the notice travels on the data link and the rank's departure on the control link, so the
departure may come first, and the table then no longer has the rank.  So the node a rank
lived on when it left is remembered for ``route_timeout`` (the bound on a frame's wait
elsewhere), and a notice from that node counts too.  A node that never hosted the rank
cannot kill its live incarnation, nor push real dead nonces out of a survivor's bounded
list of them with forged ones.

Bounds: at most :data:`MAX_HOMES` departures are remembered (the oldest goes first), each
for ``route_timeout``; recording and asking cost O(1) (amortized).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from fabricd.daemon.services.senders import Sender, sender

if TYPE_CHECKING:
    from fabricd.daemon.service import Host
    from fabricd.daemon.services.senders import Gate, Ranks
    from fabricd.engines.membership import RankEntry

#: departed ranks whose last node is remembered, at most
MAX_HOMES: Final = 4096


class NoticeSenders:
    """Judges death notices by their sender (module docstring); ``gate``: the service's,
    which counts and logs what is refused."""

    def __init__(self, host: Host, ranks: Ranks, gate: Gate) -> None:
        self.host, self.ranks, self.gate = host, ranks, gate
        #: (job, rank) -> (the node it lived on when it left, until when that counts)
        self._homes: dict[tuple[str, int], tuple[int, float]] = {}

    def departed(self, entry: RankEntry, now: float) -> None:
        """``entry``'s rank left or is gone: its node may still send its notices."""
        key = (entry.job, entry.rank)
        self._homes.pop(key, None)  # (re-inserted last: the dict stays in expiry order)
        while self._homes and (
            len(self._homes) >= MAX_HOMES or next(iter(self._homes.values()))[1] < now
        ):
            del self._homes[next(iter(self._homes))]
        self._homes[key] = (entry.node, now + self.host.config.route_timeout)

    def judge(self, node: int, job: str, rank: int) -> Sender:
        """:func:`~fabricd.daemon.services.senders.sender`'s verdict on a notice from
        ``node`` as rank ``rank`` of ``job``, a :data:`Sender.MEMBER` also from the node the
        rank left within ``route_timeout``; a stranger's is counted and logged."""
        home = self._homes.get((job, rank))
        if home is not None and home[0] == node and self.host.now() <= home[1]:
            return Sender.MEMBER
        verdict = sender(self.ranks, node, job, rank)
        if verdict is Sender.STRANGER:
            self.gate.refused(node, rank, f"a death notice; job {job!r} has it elsewhere")
        return verdict
