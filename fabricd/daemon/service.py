"""The service contract: how one engine plugs into the daemon.

Each engine is driven by one *service*.  The service owns its engine, names the peer frame
kinds and client request ops it handles, performs the engine's actions through the
:class:`Host` (the node), and reports its next deadline.  The node routes every frame, request
and timer tick to the one service that claimed it and owns only links, sessions and the one
timer; it refuses to start when two services claim the same kind or op.

Adding an engine is one engine file (``engines/x.py``, sans-IO), one service file
(``daemon/x_service.py``, implementing :class:`Service`) and one client facet.

Rules for a service:

* every call from the node is synchronous and quick; work that waits (streaming bytes, a large
  copy) runs in a task from :meth:`Host.spawn` and calls back into the service, which then calls
  :meth:`Host.rearm` if its deadlines may have moved;
* a malformed frame raises :class:`~fabricd.errors.RemoteProtocolError` (the node closes that
  peer's links); a bad request raises a :class:`~fabricd.errors.FabricError` (the node replies
  with its code); anything else is a bug in the service: the node logs it and fails the request
  with ``internal`` but keeps serving.  A bug raised from a timer tick, a peer's or a rank's
  news, a client's departure or the drain is logged too, and the other services still get it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Coroutine, Iterable, Sequence

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.config import Config
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.actions import Failure
    from fabricd.engines.budget import ByteBudget
    from fabricd.engines.membership import RankEvent, Suspicion
    from fabricd.engines.monitor.table import LinkFigures
    from fabricd.frames.registry import PayloadFrame, PeerFrame
    from fabricd.transports.base import Buffer, Link
    from fabricd.wire import Kind, Meta


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One client request as a service sees it: who asked, which op, its fields and fds.

    ``fds`` belong to the service once it is called (the node closes whatever is left in the
    list afterwards, so a service takes an fd by popping it).
    """

    session: ClientSession
    id: int
    op: str
    meta: Meta
    fds: list[int]


class Host(Protocol):
    """What the node offers its services.

    No way to reset a peer: that is the peers engine's decision alone (one it did not make
    would leave it believing the links are up).  A service that must drop a peer raises
    :class:`~fabricd.errors.RemoteProtocolError` from :meth:`Service.on_frame`.
    """

    @property
    def config(self) -> Config:
        """The daemon's effective configuration."""

    @property
    def budget(self) -> ByteBudget:
        """The byte budgets: charge what is held on a job's behalf before making it."""

    @property
    def draining(self) -> bool:
        """Whether the daemon is stopping (new work is refused with ``daemon_stopping``)."""

    def now(self) -> float:
        """The loop's monotonic clock, the ``now`` engines are given."""

    def send(self, node: int, frame: PeerFrame, payload: Sequence[Buffer] = ()) -> None:
        """Queue ``frame`` (with ``payload``: an EAGER's) on ``node``'s control link; dropped
        (debug log) if it has none."""

    def broadcast(self, frame: PeerFrame) -> None:
        """Queue ``frame`` to every peer that is up (both links; see :meth:`Service.peer_up`)."""

    def data_link(self, node: int) -> Link | None:
        """``node``'s data link, if it is up."""

    @property
    def incarnation(self) -> int:
        """This daemon's incarnation (its start time in ns; grows across restarts)."""

    def reply(self, session: ClientSession, request_id: int, result: Meta) -> None:
        """Answer a request with success (dropped if the client has left)."""

    def fail(self, session: ClientSession, request_id: int, failure: Failure) -> None:
        """Answer a request with a failure (dropped if the client has left)."""

    def push(self, session: ClientSession, event: str, fields: Meta) -> None:
        """Push an EVENT frame to a client that did not ask for it just now."""

    def rank_event(self, event: RankEvent) -> None:
        """Tell every service that a rank joined or left (membership's news)."""

    def suspicion(self, event: Suspicion) -> None:
        """Tell every service membership's verdict on a node whose links were reset, or on
        one of its ranks (suspected, back, gone)."""

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` in the daemon's task group; the drain cancels what is left of it."""

    def rearm(self) -> None:
        """Re-read every service's next deadline (call after work a task finished)."""

    def network(self, now: float) -> dict[int, LinkFigures]:
        """Every node's available up/down bandwidth (bytes/s), RTT, their age and source, as
        the network monitor knows them now (:mod:`fabricd.engines.monitor.table`; MLfabric
        §4: what a scheduler plans transfers with).  Node id -> figures, this node included."""


class Service(Protocol):
    """One engine's driver.  See the module docstring for the rules."""

    #: a short name for logs and status
    name: str
    #: the peer frame kinds this service handles
    kinds: frozenset[Kind]
    #: the client request ops this service handles
    ops: frozenset[str]

    def on_frame(self, node: int, frame: PeerFrame, now: float) -> None:
        """A frame of one of :attr:`kinds` from authenticated peer ``node``."""

    def payload_buffer(self, node: int, frame: PayloadFrame, length: int) -> memoryview | None:
        """Where the ``length`` payload bytes of a DATA (or EAGER) frame from ``node`` must
        land; ``None``: read them and drop them (nothing is allocated for them).

        Only called on the service that claims the frame's kind, before the first payload
        byte is read, so the bytes land in place.  Raise ``RemoteProtocolError`` for a chunk
        nobody asked for: its link is closed.
        """

    def on_data(self, node: int, frame: PayloadFrame, length: int, now: float) -> None:
        """A whole DATA (or EAGER) frame of ``length`` payload bytes from ``node`` has landed
        (an EAGER of no bytes comes here without :meth:`payload_buffer`)."""

    def on_request(self, request: Request, now: float) -> Meta | None:
        """A client request of one of :attr:`ops`; return the reply, or ``None`` to answer
        later through :meth:`Host.reply`/:meth:`Host.fail`."""

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` must next run (``None``: never)."""

    def on_timer(self, now: float) -> None:
        """The clock reached :meth:`next_deadline`."""

    def peer_up(self, node: int, now: float) -> None:
        """Both of ``node``'s links are up (after any reset of older ones)."""

    def peer_down(self, node: int, reason: str, now: float) -> None:
        """Everything exchanged with ``node`` is lost (its links were reset)."""

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        """A rank joined or left the fabric."""

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        """A rank lost with its node's links is suspected, back or gone; or such a node is back
        or gone (:mod:`fabricd.engines.membership`, "Suspicion")."""

    def client_gone(self, session: ClientSession, now: float) -> None:
        """A client disconnected; release what it held in this service."""

    def in_flight(self) -> int:
        """Work a drain waits for (bytes moving now)."""

    async def settle(self) -> None:
        """Wait for work that cannot be cancelled (a copy in a thread) to end."""

    def shutdown(self, failure: Failure) -> None:
        """The drain is over: fail every request still open with ``failure``."""

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Operations pending longer than ``stall_after``, oldest first, one JSON-ready row
        each saying what it waits for (``fabricctl stalls``); rows carry ``job``, ``owner``
        and ``uid`` like status rows, so the node withholds them from clients that may not see
        the job.

        ``keep`` is asked about every such operation with ``{"job", "owner", "uid"}`` before
        its row is built; only those it accepts are described, and at most ``limit`` of them
        (a reply has a size bound, and a client may have tens of thousands pending).
        """

    def statistics(self) -> Meta:
        """What ``fabricctl status`` shows of this service: top-level status fields.

        JSON-ready.  A ``"counters"`` entry is merged with the other services' counters.  A
        row (a dict in a top-level list) about a job carries ``job`` and ``owner``, one about a
        client ``uid``: the node withholds such rows from clients that may not see them
        (:mod:`fabricd.daemon.access`).
        """

    def client_statistics(self, session: ClientSession) -> Meta:
        """Fields of ``session``'s row in ``fabricctl status`` (e.g. operations it has open)."""

    def metrics(self) -> Iterable[Metric]:
        """This service's own Prometheus families, built when the daemon is scraped.

        Read the engine's counters here (engines never import prometheus-client); build the
        families with :mod:`fabricd.daemon.metrics` (``counter``, ``gauge``, ``histogram``,
        :class:`~fabricd.daemon.metrics.OperationStats`).  Families of one name from two
        services are merged, so give their samples a ``service`` label.
        """


class BaseService:
    """No-op defaults for the hooks a service does not need; subclass and override."""

    name = "base"
    kinds: frozenset[Kind] = frozenset()
    ops: frozenset[str] = frozenset()

    def on_frame(self, node: int, frame: PeerFrame, now: float) -> None:
        raise NotImplementedError(f"{self.name} claims no frame kinds")

    def payload_buffer(self, node: int, frame: PayloadFrame, length: int) -> memoryview | None:
        raise NotImplementedError(f"{self.name} takes no payloads")

    def on_data(self, node: int, frame: PayloadFrame, length: int, now: float) -> None:
        raise NotImplementedError(f"{self.name} takes no payloads")

    def on_request(self, request: Request, now: float) -> Meta | None:
        raise NotImplementedError(f"{self.name} claims no request ops")

    def next_deadline(self) -> float | None:
        return None

    def on_timer(self, now: float) -> None:
        return None

    def peer_up(self, node: int, now: float) -> None:
        return None

    def peer_down(self, node: int, reason: str, now: float) -> None:
        return None

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        return None

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        return None

    def client_gone(self, session: ClientSession, now: float) -> None:
        return None

    def in_flight(self) -> int:
        return 0

    async def settle(self) -> None:
        return None

    def shutdown(self, failure: Failure) -> None:
        return None

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        return []

    def statistics(self) -> Meta:
        return {}

    def client_statistics(self, session: ClientSession) -> Meta:
        return {}

    def metrics(self) -> Iterable[Metric]:
        return ()


def check_claims(services: Sequence[Service]) -> None:
    """Refuse a set of services in which two claim one frame kind or one request op.

    Raises:
        ValueError: names both services and what they both claim.
    """
    kinds: dict[Kind, str] = {}
    ops: dict[str, str] = {}
    for service in services:
        for kind in service.kinds:
            if kind in kinds:
                raise ValueError(
                    f"services {kinds[kind]!r} and {service.name!r} both claim {kind.name} frames"
                )
            kinds[kind] = service.name
        for op in service.ops:
            if op in ops:
                raise ValueError(f"services {ops[op]!r} and {service.name!r} both claim op {op!r}")
            ops[op] = service.name
