"""What the services that run calls over a job's ranks (collectives, stochastic reduce) share.

* :func:`refuse_while_draining`: every service that starts work refuses it alike once the daemon
  is stopping;
* :class:`WaitingForRanks`: calls that wait for every rank of their job to be known (their
  frames cannot be routed before), up to ``route_timeout`` each, then fail with
  ``no_such_rank`` naming the missing ranks (:func:`_waited_too_long`); a client holds at most
  ``max_ops_per_client`` of them;
* :class:`OpenCalls`: the calls an engine holds, by the service's key, and whom to answer: each
  answered once, its latency and outcome counted in the service's
  :class:`~fabricd.daemon.metrics.OperationStats`.

Which ranks are suspected, back or gone after a reset of their node's links is membership's
(:mod:`fabricd.engines.membership`), not this kit's.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from fabricd.engines.actions import Failure
from fabricd.errors import ErrorCode, FabricError, OperationFailed, code_of

if TYPE_CHECKING:
    from collections.abc import Callable, ItemsView, Iterator

    from fabricd.daemon.metrics import OperationStats
    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.membership import Membership
    from fabricd.wire import Meta

#: missing ranks a failure names (the rest is "...")
_SHOWN: int = 10


def refuse_while_draining(host: Host) -> None:
    """Raises OperationFailed (``daemon_stopping``): the daemon is stopping, so no new work
    starts; the client should retry against a daemon that serves."""
    if host.draining:
        raise OperationFailed("the daemon is stopping; retry later", code=ErrorCode.DAEMON_STOPPING)


def _waited_too_long(
    what: str, job: str, size: int, membership: Membership, route_timeout: float
) -> Failure:
    """``no_such_rank`` for a call (``what``: "allreduce 'grad'") that waited
    ``route_timeout`` for the ranks of ``job`` not known yet, naming them."""
    missing = [r for r in range(size) if membership.lookup(job, r) is None]
    shown = ", ".join(map(str, missing[:_SHOWN])) + (" ..." if len(missing) > _SHOWN else "")
    return Failure(
        code=ErrorCode.NO_SUCH_RANK,
        message=(
            f"{what} of job {job!r} waited route_timeout ({route_timeout} s) for ranks {shown} "
            "to join; start them, or check their daemons are peers of this one"
        ),
    )


class Waits(Protocol):
    """A call that waits for its job's ranks: its request, and when it stops waiting."""

    @property
    def request(self) -> Request: ...

    @property
    def deadline(self) -> float: ...


W = TypeVar("W", bound=Waits)
K = TypeVar("K", bound=Hashable)


class WaitingForRanks(Generic[W]):
    """Calls that wait for every rank of their job to be known, oldest first.

    Args:
        host: the node (its config's ``max_ops_per_client`` and ``route_timeout``; whom to
            fail).
        membership: the rank table a late call's failure names the missing ranks from.
        calls: what the calls are, in words, for the refusal past ``max_ops_per_client``
            ("collective calls").
        describe: a call in words, for its failure ("allreduce 'grad'").
    """

    def __init__(
        self, host: Host, membership: Membership, calls: str, describe: Callable[[W], str]
    ) -> None:
        self.host = host
        self.membership = membership
        self.calls = calls
        self.describe = describe
        self._items: list[W] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[W]:
        return iter(self._items)

    def add(self, item: W) -> None:
        """Let ``item`` wait.

        Raises:
            OperationFailed: its client already has ``max_ops_per_client`` calls waiting
                (``limit``).
        """
        session = item.request.session
        held = sum(1 for w in self._items if w.request.session is session)
        if held >= self.host.config.max_ops_per_client:
            raise OperationFailed(
                f"this client has {held} {self.calls} waiting for their job's ranks, the most "
                "max_ops_per_client allows; start the missing ranks first",
                code=ErrorCode.LIMIT,
            )
        self._items.append(item)

    def retry(self, job: str, attempt: Callable[[W], bool]) -> None:
        """A rank of ``job`` joined: ``attempt`` each of its calls again, in order; one it
        answers ``False`` waits on, one it raises for fails with the error's code."""
        mine = [w for w in self._items if w.request.session.job == job]
        if not mine:  # only this job's calls can have become ready
            return
        self._items = [w for w in self._items if w.request.session.job != job]
        for item in mine:
            try:
                if not attempt(item):
                    self._items.append(item)
            except FabricError as exc:
                self._fail(item, Failure(code=code_of(exc), message=str(exc)))

    def client_gone(self, session: ClientSession) -> None:
        self._items = [w for w in self._items if w.request.session is not session]

    def next_deadline(self) -> float | None:
        if not self._items:  # the usual case, asked after every frame and request
            return None
        return min(w.deadline for w in self._items)

    def expire(self, now: float) -> None:
        """Fail the calls that waited ``route_timeout`` (``no_such_rank``, naming the ranks
        still missing)."""
        late = [w for w in self._items if w.deadline <= now]
        if not late:
            return
        self._items = [w for w in self._items if w.deadline > now]
        for item in late:
            session = item.request.session
            failure = _waited_too_long(
                self.describe(item),
                str(session.job),
                session.size,
                self.membership,
                self.host.config.route_timeout,
            )
            self._fail(item, failure)

    def shutdown(self, failure: Failure) -> None:
        """The drain is over: every call still waiting fails with ``failure``."""
        items, self._items = self._items, []
        for item in items:
            self._fail(item, failure)

    def _fail(self, item: W, failure: Failure) -> None:
        self.host.fail(item.request.session, item.request.id, failure)


@dataclass(slots=True, kw_only=True)
class OpenCall:
    """A call an engine holds: whom to answer, and what its statistics count."""

    session: ClientSession
    request: int  #: the request's id
    kind: str  #: the operation kind it is counted under
    name: str  #: the collective's or reduce's name
    started: float
    nbytes: int  #: counted when it succeeds


class OpenCalls(Generic[K]):
    """The calls a service's engine holds, by the service's key; each answered once."""

    def __init__(self, host: Host, operations: OperationStats) -> None:
        self.host = host
        self.operations = operations
        self._calls: dict[K, OpenCall] = {}
        self._by_session: dict[ClientSession, set[K]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, key: object) -> bool:
        return key in self._calls

    def get(self, key: K) -> OpenCall | None:
        return self._calls.get(key)

    def items(self) -> ItemsView[K, OpenCall]:
        return self._calls.items()

    def count(self, session: ClientSession) -> int:
        """Calls ``session`` has open."""
        return len(self._by_session.get(session, ()))

    def open(self, key: K, call: OpenCall) -> None:
        """``call`` is open under ``key`` (counted as started)."""
        self._calls[key] = call
        self._by_session.setdefault(call.session, set()).add(key)
        self.operations.started(call.kind)

    def reply(self, key: K, result: Meta) -> None:
        """Answer ``key``'s call with ``result``, if it is still open."""
        call = self._pop(key)
        if call is not None:
            seconds = self.host.now() - call.started
            self.operations.ended(call.kind, call.nbytes, seconds, None)
            self.host.reply(call.session, call.request, result)

    def fail(self, key: K, failure: Failure) -> None:
        """Fail ``key``'s call with ``failure``, if it is still open."""
        call = self._pop(key)
        if call is not None:
            seconds = self.host.now() - call.started
            self.operations.ended(call.kind, 0, seconds, str(failure.code))
            self.host.fail(call.session, call.request, failure)

    def abandon(self, session: ClientSession) -> list[tuple[K, OpenCall]]:
        """``session``'s client left: its calls are forgotten unanswered (counted as
        abandoned); returns them, for the engine to forget too."""
        keys = self._by_session.pop(session, set())
        gone = [(key, self._calls.pop(key)) for key in keys]
        for _, call in gone:
            self.operations.abandoned(call.kind)
        return gone

    def _pop(self, key: K) -> OpenCall | None:
        call = self._calls.pop(key, None)
        if call is not None:
            keys = self._by_session[call.session]
            keys.discard(key)
            if not keys:
                del self._by_session[call.session]
        return call
