"""Spec agreement: every rank of a parameter-server model opens it alike, or the ranks' calls
fail naming both specs.

Issue 27, item 6: a worker that opened a model with another size or consistency than its
server opened fine, and the difference came back as ``PeerFailed`` at its first pull, while
the server's rank never heard of it.  Ranks of one daemon are compared by the service when
they open (against the model open there); this module compares the ranks of different
daemons.

Rules: :class:`Agreement` decides, for one daemon, whether a local rank's open is refused,
what the job's other daemons are told of the models opened here, and what a peer's OPENED
means.  It reads the rank table through :class:`~fabricd.engines.ps.routing.Ranks`, keeps a
bounded table of the specs peer ranks said they opened with, and returns actions for
:class:`~fabricd.engines.ps.node.PSNode` to hand back; it touches no socket and no clock.

Theory of operation.  The choice is *tell, don't wait*: when a model first opens on a daemon,
the daemon sends an OPENED (the spec, and a rank that opened it) to every other node known to
host a rank of the job, later to each node when it first hosts one (:meth:`rank_joined`), and
again to a node whose links are back (:meth:`peer_up`: a reset may have lost it).  An open
never waits for an answer, so with the specs alike it returns as soon as it did before (the
OPENED frames go out with its reply).  Waiting for the servers to confirm would make a
worker's open wait until every server of the model has opened, which it need not today.

* *Refused at open.*  A daemon keeps the first spec each model was said to be opened with by a
  peer rank (:data:`MAX_HEARD` models; a rank's leaving forgets what it said).  A local open
  whose spec differs from it is refused (``usage``, both specs and the fields that differ
  named), and every peer node of the job is told with an OPENED marked ``answer``: the ranks
  that opened first learn too, and their next calls fail naming both.
* *Found when the OPENED arrives.*  An open that raced a peer's OPENED (each daemon opened
  before it heard of the other), or whose peer's spec was not kept, is found when the OPENED
  arrives: the model is *disagreed* here (:func:`disagree`): every local worker's call in
  flight fails with ``usage`` naming both, and so does every later call and open; the
  processes of the local shards are told (:class:`Disagreed`, the ``ps_disagreed`` event,
  which ends their ``serve()``); and the sender is answered with this daemon's spec, so it
  learns too even if no OPENED of this daemon reached it.
* The model stays refused on this daemon until its ranks here close it.  A job whose ranks
  disagree on what they train is stopped, as a collective called two ways is, rather than
  left to hang (under BSP a server waits for every worker of the spec, one whose open was
  refused included) or to fail later for a reason that does not name the difference.

A worker's PUSH and PULL still carry the spec, and a server that finds it unlike its own
refuses the frame naming both (:func:`~fabricd.engines.ps.messages.unlike`): the backstop for
an OPENED lost with a link, and what a push meets that overtook its daemon's OPENED on the
data link.  Once the model is disagreed here such a frame is answered with an OPENED instead
(:meth:`Agreement.answer`): a refusal on the data link could overtake it, and the worker's
call would fail as ``peer_failed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.engines.actions import Failure, SendFrame
from fabricd.engines.ps.messages import describe
from fabricd.engines.ps.models import CallDone, Disagreed
from fabricd.errors import ErrorCode
from fabricd.frames.ps import PS_SPEC_FIELDS, Opened

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from fabricd.engines.ps.models import Action, Key, Model
    from fabricd.engines.ps.routing import Ranks
    from fabricd.wire import Meta

#: models whose peer's spec a daemon keeps, at most (past it a difference is found when an
#: OPENED arrives, not at open)
MAX_HEARD: Final = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Heard:
    """A peer's OPENED: rank ``rank`` of node ``node`` opened the model with ``spec``."""

    rank: int
    node: int
    spec: Meta


class Agreement:
    """Spec agreement for the models of the daemon of node ``node`` (module docstring).

    Args:
        node: this daemon's node id.
        ranks: the rank table and the links' state (read only).
        counters: the engine's counters (an OPENED naming a rank of another node counts as
            ``ps_frames_dropped``).
    """

    def __init__(self, node: int, ranks: Ranks, counters: dict[str, int]) -> None:
        self.node = node
        self.ranks = ranks
        self.counters = counters
        self._heard: dict[str, dict[str, Heard]] = {}  #: job -> model name -> first OPENED
        self._count = 0

    @property
    def heard(self) -> int:
        """Peers' specs kept."""
        return self._count

    # -- a local open ------------------------------------------------------------------------
    def refusal(
        self, key: Key, spec: Meta, rank: int, model: Model | None
    ) -> tuple[str | None, list[Action]]:
        """Why local ``rank``'s open of ``key`` with ``spec`` is refused (``None``: it is
        not), and the OPENED answers that tell the job's other daemons.  The caller compared
        ``spec`` with the model open here (``model``) first."""
        if model is not None and model.disagreed is not None:
            return model.disagreed, []
        heard = self._heard.get(key[0], {}).get(key[1])
        if heard is None or heard.spec == spec:
            return None, []
        why = difference(key, (heard.rank, heard.node, heard.spec), (rank, self.node, spec))
        frame = Opened(job=key[0], name=key[1], rank=rank, spec=spec, answer=True)
        nodes = self._nodes(key[0], spec["n"]) | {heard.node}
        return why, [SendFrame(node=n, frame=frame) for n in sorted(nodes)]

    def opened_here(self, key: Key, model: Model) -> list[Action]:
        """``model`` opened on this daemon (it was not open here): tell every other node
        known to host a rank of the job."""
        model.peers = self._nodes(key[0], model.spec["n"])
        return self._tell(key, model, model.peers)

    # -- peers -------------------------------------------------------------------------------
    def rank_joined(self, node: int, models: Iterable[tuple[Key, Model]]) -> list[Action]:
        """A rank of the job of ``models`` is known on ``node``: a node that hosts its first
        rank of the job is told of them."""
        out: list[Action] = []
        if node == self.node:
            return out
        for key, model in models:
            if node not in model.peers:
                model.peers.add(node)
                out += self._tell(key, model, {node})
        return out

    def peer_up(self, node: int, models: Iterable[tuple[Key, Model]]) -> list[Action]:
        """``node``'s links are back: it is told again of the models whose job it hosts a
        rank of (an OPENED may have been lost with the old links)."""
        out: list[Action] = []
        for key, model in models:
            if node in model.peers:
                out += self._tell(key, model, {node})
        return out

    def forget(self, job: str, rank: int) -> None:
        """Rank ``rank`` of ``job`` is gone: what it said it opened is forgotten."""
        names = self._heard.get(job)
        if names is None:
            return
        for name in [name for name, heard in names.items() if heard.rank == rank]:
            del names[name]
            self._count -= 1
        if not names:
            del self._heard[job]

    def on_opened(self, node: int, frame: Opened, models: Mapping[Key, Model]) -> list[Action]:
        """A peer's OPENED: kept (unless an answer) for the opens here to come, and compared
        with the model open here (of ``models``): a difference disagrees it, and the sender
        is answered (unless it answered)."""
        entry = self.ranks.lookup(frame.job, frame.rank)
        if entry is not None and entry.node != node:  # never taken as another node's rank
            self.counters["ps_frames_dropped"] += 1
            return []
        key = (frame.job, frame.name)
        model = models.get(key)
        if not frame.answer:  # an answer's rank may never have opened it (refused)
            self._remember(key, Heard(rank=frame.rank, node=node, spec=frame.spec))
        if model is None or model.spec == frame.spec:
            return []
        mine = (local_rank(model), self.node, model.spec)
        out = disagree(key, model, difference(key, (frame.rank, node, frame.spec), mine))
        if not frame.answer:
            out.append(self.answer(node, key, model))
        return out

    def answer(self, node: int, key: Key, model: Model) -> SendFrame:
        """An OPENED marked ``answer`` for ``node``: this daemon's spec of ``key``."""
        frame = Opened(
            job=key[0], name=key[1], rank=local_rank(model), spec=model.spec, answer=True
        )
        return SendFrame(node=node, frame=frame)

    # -- internals ---------------------------------------------------------------------------
    def _remember(self, key: Key, heard: Heard) -> None:
        names = self._heard.get(key[0])
        if (names is not None and key[1] in names) or self._count >= MAX_HEARD:
            return
        self._heard.setdefault(key[0], {})[key[1]] = heard
        self._count += 1

    def _nodes(self, job: str, n: int) -> set[int]:
        """The other nodes known to host a rank of ``job`` (of ``n`` ranks)."""
        entries = (self.ranks.lookup(job, rank) for rank in range(n))
        return {e.node for e in entries if e is not None and e.node != self.node}

    def _tell(self, key: Key, model: Model, nodes: Iterable[int]) -> list[Action]:
        """An OPENED of ``model`` for each of ``nodes`` whose links are up (one that is not
        is told by :meth:`peer_up`)."""
        frame = Opened(job=key[0], name=key[1], rank=local_rank(model), spec=model.spec)
        return [SendFrame(node=n, frame=frame) for n in sorted(nodes) if self.ranks.reachable(n)]


def local_rank(model: Model) -> int:
    """The rank that names this daemon's side of ``model``: its least local rank."""
    return min([*model.local_workers, *model.ranks.values()])


def disagree(key: Key, model: Model, why: str) -> list[Action]:
    """``model`` was opened two ways (``why``): refused here from now on; the local workers'
    calls in flight fail with ``usage``, and the local shards' processes are told.  Nothing
    more if it was refused already."""
    if model.disagreed is not None:
        return []
    model.disagreed = why
    failure = Failure(code=ErrorCode.USAGE, message=why)
    out: list[Action] = [Disagreed(key=key, message=why)]
    for rank, side in model.local_workers.items():
        side.out = None  # an answer still on its way must not land in the caller's array
        out.append(CallDone(key=key, rank=rank, failure=failure))
    return out


def difference(key: Key, one: tuple[int, int, Meta], other: tuple[int, int, Meta]) -> str:
    """The two ways ``key`` was opened, each (rank, node, spec), and the fields that differ:
    the lesser rank's first, so that both sides say the same."""
    (rank1, node1, spec1), (rank2, node2, spec2) = sorted((one, other), key=lambda w: w[0])
    fields = [f for f in PS_SPEC_FIELDS if spec1.get(f) != spec2.get(f)]
    return (
        f"parameter server {key[1]!r} of job {key[0]!r} is opened two ways: as "
        f"{describe(spec1)} by rank {rank1} (node {node1}), as {describe(spec2)} by rank "
        f"{rank2} (node {node2}); they differ in {', '.join(fields)}: every rank must open it "
        "alike"
    )
