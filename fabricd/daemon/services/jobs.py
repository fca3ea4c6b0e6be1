"""What the services that run calls over a job's ranks (collectives, stochastic reduce) share.

* :func:`refuse_while_draining`: every service that starts work refuses it alike once the daemon
  is stopping;
* :class:`WaitingForRanks`: calls that wait for every rank of their job to be known (their
  frames cannot be routed before), up to ``route_timeout`` each, then fail with
  ``no_such_rank`` naming the missing ranks (:func:`_waited_too_long`); a client holds at most
  ``max_ops_per_client`` of them, the jobs of one uid ``max_waiting_calls_per_uid``;
* :class:`OpenCalls`: the calls an engine holds, by the service's key, and whom to answer: each
  answered once, its latency and outcome counted in the service's
  :class:`~fabricd.daemon.metrics.OperationStats`; each found stalled once, ``stall_after``
  after it opened, for the service to log (:class:`StallWatch`, which the parameter server's
  calls use too).

Both keep counts and indexes, never scans: the cost of a request, a frame or a timer tick
does not grow with the number of calls that wait or are open (issue 28, item 1).

Which ranks are suspected, back or gone after a reset of their node's links is membership's
(:mod:`fabricd.engines.membership`), not this kit's.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, Protocol, TypeVar

from fabricd.engines.actions import Failure
from fabricd.engines.counts import count_down
from fabricd.engines.deadlines import Deadlines
from fabricd.errors import ErrorCode, FabricError, OperationFailed, code_of
from fabricd.wire import get_int

if TYPE_CHECKING:
    from collections.abc import Callable, ItemsView, Iterator

    from fabricd.daemon.metrics import OperationStats
    from fabricd.daemon.service import Host
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
    # the first few missing ranks only: a job's size is the client's to say (up to 2**31), and
    # a list of every missing rank cost the loop seconds, or its memory, per expired call
    missing = list(
        itertools.islice((r for r in range(size) if membership.lookup(job, r) is None), _SHOWN + 1)
    )
    shown = ", ".join(map(str, missing[:_SHOWN])) + (" ..." if len(missing) > _SHOWN else "")
    return Failure(
        code=ErrorCode.NO_SUCH_RANK,
        message=(
            f"{what} of job {job!r} waited route_timeout ({route_timeout} s) for ranks {shown} "
            "to join; start them, or check their daemons are peers of this one"
        ),
    )


class Waits(Protocol):
    """A call that waits for its job's ranks: whose, which request, its name, and when it stops
    waiting.  Services keep it in a few plain fields (no request object, no view of a segment:
    its array is viewed again when the call runs), so that 10^5 of them add few objects for the
    garbage collector to walk: each full collection walks every one, and the review measured
    pauses of 70 ms with six objects per waiting call."""

    @property
    def session(self) -> ClientSession: ...

    @property
    def request_id(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def deadline(self) -> float: ...


W = TypeVar("W", bound=Waits)
K = TypeVar("K", bound=Hashable)

#: waiting calls failed in one timer tick at most: 10^5 calls whose ``route_timeout`` ends at
#: once are answered over several ticks, so other clients' requests and frames are read between
#: them (each tick costs about 1 ms, not seconds)
EXPIRE_PER_TICK: Final = 256
#: removals tolerated beyond twice the calls left before the tables are rebuilt (a dict never
#: gives back the memory of its deleted entries)
_SLACK: Final = 64
#: distinct values a :class:`Shared` pool keeps
_SHARED: Final = 1024
#: stalled calls a service is told of (and describes, and logs) in one timer tick at most: a
#: whole job's calls stall together, and each description costs tens of microseconds; the
#: rest stay due, so the node's timer runs again at once, after reading what came meanwhile
STALLS_PER_TICK: Final = 64


class WaitingForRanks(Generic[W]):
    """Calls that wait for every rank of their job to be known, oldest first.

    Theory of operation: every call gets a number; the calls are kept by number (so oldest
    first), indexed by job, by client session and by (session, name), with their deadlines in
    a :class:`~fabricd.engines.deadlines.Deadlines` heap and a count per uid.  So adding a call,
    asking for the next deadline and expiring a call cost O(log n) or less, however many calls
    wait (the review found a list scanned on every request, and a ``min()`` over it after every
    read batch: 30,000 waiting calls of one tenant stalled every other tenant for seconds);
    a rank's arrival touches only its job's calls, and only once every rank of the job is
    known (before, none of them can be ready); a client that leaves costs O(its calls).

    Args:
        host: the node (its config's ``max_ops_per_client``, ``max_waiting_calls_per_uid`` and
            ``route_timeout``; whom to fail).
        membership: the rank table: which ranks of a job are known, whose job it is (the uid
            the per-uid bound counts, as the byte budget does), and the missing ranks a late
            call's failure names.
        calls: what the calls are, in words, for the refusals past the bounds
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
        self._items: dict[int, W] = {}  #: by number, oldest first
        self._numbers = itertools.count()
        self._deadlines: Deadlines[int] = Deadlines()
        self._by_job: dict[str, dict[int, None]] = {}  #: numbers, oldest first
        self._by_session: dict[ClientSession, set[int]] = {}
        self._named: dict[tuple[ClientSession, str], int] = {}  #: calls per (session, name)
        self._per_uid: dict[int, int] = {}  #: calls per uid of the jobs' owners
        self._uids: dict[int, int] = {}  #: the uid each call is counted under, by number
        self._removed = 0  #: calls that left since the tables were last rebuilt

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[W]:
        return iter(list(self._items.values()))

    def count(self, session: ClientSession) -> int:
        """Calls ``session`` has waiting."""
        return len(self._by_session.get(session, ()))

    def count_uid(self, uid: int) -> int:
        """Calls waiting of the jobs ``uid`` owns."""
        return self._per_uid.get(uid, 0)

    def has(self, session: ClientSession, name: str) -> bool:
        """Whether ``session`` has a call of ``name`` waiting."""
        return (session, name) in self._named

    def add(self, item: W) -> None:
        """Let ``item`` wait.

        Raises:
            OperationFailed: its client already has ``max_ops_per_client`` calls waiting, or
                the uid that owns its job ``max_waiting_calls_per_uid`` (``limit``).
        """
        session = item.session
        config = self.host.config
        held = self.count(session)
        if held >= config.max_ops_per_client:
            raise OperationFailed(
                f"this client has {held} {self.calls} waiting for their job's ranks, the most "
                "max_ops_per_client allows; start the missing ranks first",
                code=ErrorCode.LIMIT,
            )
        uid = self._uid(session)
        held = self._per_uid.get(uid, 0)
        if held >= config.max_waiting_calls_per_uid:
            raise OperationFailed(
                f"the jobs of uid {uid} have {held} {self.calls} waiting for their ranks on "
                f"node {config.node_id}, the most max_waiting_calls_per_uid allows; start the "
                "missing ranks first",
                code=ErrorCode.LIMIT,
            )
        self._put(item, uid)

    def _uid(self, session: ClientSession) -> int:
        owner = self.membership.owner(str(session.job))
        return -1 if owner is None else owner

    def _put(self, item: W, uid: int) -> None:
        number = next(self._numbers)
        session = item.session
        self._items[number] = item
        self._deadlines.set(number, item.deadline)
        self._by_job.setdefault(str(session.job), {})[number] = None
        self._by_session.setdefault(session, set()).add(number)
        named = (session, item.name)
        self._named[named] = self._named.get(named, 0) + 1
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._uids[number] = uid

    def _take(self, number: int) -> W:
        """Remove call ``number`` from every table."""
        item = self._items.pop(number)
        self._deadlines.cancel(number)
        session = item.session
        job = str(session.job)
        numbers = self._by_job[job]
        del numbers[number]
        if not numbers:
            del self._by_job[job]
        mine = self._by_session[session]
        mine.discard(number)
        if not mine:
            del self._by_session[session]
        named = (session, item.name)
        count_down(self._named, named)
        count_down(self._per_uid, self._uids.pop(number))
        self._removed += 1
        if self._removed > 2 * len(self._items) + _SLACK:
            self._rebuild()
        return item

    def _rebuild(self) -> None:
        """Give back the memory of the calls that left: O(calls waiting), after at least as
        many removals."""
        self._items = dict(self._items)
        self._uids = dict(self._uids)
        self._by_job = {job: dict(numbers) for job, numbers in self._by_job.items()}
        self._by_session = {session: set(mine) for session, mine in self._by_session.items()}
        self._named = dict(self._named)
        self._removed = 0

    def retry(self, job: str, attempt: Callable[[W], bool]) -> None:
        """A rank of ``job`` joined: ``attempt`` each of its calls again, in order, once every
        rank of the job is known (a call waits for no less); one it answers ``False`` waits on
        (with its deadline), one it raises for fails with the error's code."""
        numbers = self._by_job.get(job)
        if not numbers or not self._complete(job):
            return
        for number in list(numbers):
            uid = self._uids[number]
            item = self._take(number)
            try:
                if not attempt(item):
                    self._put(item, uid)
            except FabricError as exc:
                self._fail(item, Failure(code=code_of(exc), message=str(exc)))

    def _complete(self, job: str) -> bool:
        size = self.membership.job_size(job)
        return size is not None and self.membership.known(job) >= size

    def client_gone(self, session: ClientSession) -> None:
        """``session``'s client left: its calls go, unanswered."""
        for number in list(self._by_session.get(session, ())):
            self._take(number)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def expire(self, now: float) -> None:
        """Fail the calls that waited ``route_timeout`` (``no_such_rank``, naming the ranks
        still missing), the oldest :data:`EXPIRE_PER_TICK` (the rest stay due: the node's
        timer runs again at once, after reading what came meanwhile)."""
        for number in self._deadlines.pop_due(now, EXPIRE_PER_TICK):
            item = self._take(number)
            session = item.session
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
        for number in list(self._items):
            self._fail(self._take(number), failure)

    def _fail(self, item: W, failure: Failure) -> None:
        self.host.fail(item.session, item.request_id, failure)


class StallWatch(Generic[K]):
    """When each open call of a service counts as stalled: ``stall_after`` seconds after it
    opened.  Each call is found stalled once (the service logs it then), if it is still open.

    Theory of operation: as the point-to-point engine's (``engines/p2p/pending.py``), one
    deadline per call in a :class:`~fabricd.engines.deadlines.Deadlines` heap: one push when it
    opens (its deadlines only grow, so the push sifts up one level), an O(1) cancel when it
    ends, stale entries dropped lazily.  The timer is told lazily too (``_check``): the check
    only moves earlier when a call opens and is recomputed when it fires, so calls that end
    never move the daemon's timer, and a busy service wakes for stall checks about once per
    ``stall_after``.  With no call watched it asks for no timer at all.
    """

    def __init__(self, after: float) -> None:
        self.after = after
        self._at: Deadlines[K] = Deadlines()
        self._check: float | None = None  #: at or before the earliest live deadline

    def watch(self, key: K, started: float) -> None:
        """The call under ``key`` opened at ``started`` (replacing any earlier one of it)."""
        at = started + self.after
        self._at.set(key, at)
        if self._check is None or at < self._check:
            self._check = at

    def forget(self, key: K) -> None:
        """The call under ``key`` ended (or its client left)."""
        self._at.cancel(key)

    def next_deadline(self) -> float | None:
        """When :meth:`due` may next find a call: ``None`` once no call is watched (so a
        service whose calls all ended asks for no timer)."""
        return self._check if len(self._at) else None

    def due(self, now: float) -> list[K]:
        """The calls stalled by ``now`` not found before, oldest first: at most
        :data:`STALLS_PER_TICK` (the rest stay due, and :meth:`next_deadline` says so)."""
        if self._check is None or self._check > now:
            return []
        keys = self._at.pop_due(now, STALLS_PER_TICK)
        self._check = self._at.next()
        return keys


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
    """The calls a service's engine holds, by the service's key; each answered once, and each
    one still open ``stall_after`` after it opened found stalled once (:meth:`stalled`)."""

    def __init__(self, host: Host, operations: OperationStats) -> None:
        self.host = host
        self.operations = operations
        self._calls: dict[K, OpenCall] = {}
        self._stalls: StallWatch[K] = StallWatch(host.config.stall_after)
        self._by_session: dict[ClientSession, set[K]] = {}
        self._by_job: dict[str, set[K]] = {}  #: so that a job's end touches only its calls

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

    def of_job(self, job: str) -> list[K]:
        """The keys of the calls of ``job``'s clients."""
        return list(self._by_job.get(job, ()))

    def some_of_job(self, job: str, limit: int) -> list[OpenCall]:
        """At most ``limit`` of the calls of ``job``'s clients, in no particular order (a stall
        row's look at what else a job's ranks wait in: bounded, however many are open)."""
        return [self._calls[key] for key in itertools.islice(self._by_job.get(job, ()), limit)]

    def open(self, key: K, call: OpenCall) -> None:
        """``call`` is open under ``key`` (counted as started)."""
        self._calls[key] = call
        self._by_session.setdefault(call.session, set()).add(key)
        self._by_job.setdefault(str(call.session.job), set()).add(key)
        self._stalls.watch(key, call.started)
        self.operations.started(call.kind)

    def next_stall(self) -> float | None:
        """When :meth:`stalled` may next find a call (the service's timer asks)."""
        return self._stalls.next_deadline()

    def stall_rows(
        self,
        now: float,
        row: Callable[[K], Meta | None],
        keep: Callable[[Meta], bool] | None = None,
        limit: int | None = None,
    ) -> list[Meta]:
        """The stall rows (``row`` of each key; ``None``: none) of the calls open
        ``stall_after`` or longer, oldest first, those ``keep`` takes, at most ``limit``."""
        after = self.host.config.stall_after
        late = sorted((c.started, k) for k, c in self._calls.items() if now - c.started >= after)
        rows: list[Meta] = []
        for _, key in late:
            if limit is not None and len(rows) >= limit:
                break
            found = row(key)
            if found is not None and (keep is None or keep(found)):
                rows.append(found)
        return rows

    def stalled(self, now: float) -> list[tuple[K, OpenCall]]:
        """The calls open ``stall_after`` or longer by ``now`` that were not found before,
        oldest first, at most :data:`STALLS_PER_TICK`: each call is found once."""
        return [(key, self._calls[key]) for key in self._stalls.due(now)]

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
        for key, call in gone:
            self._unjob(key, call)
            self._stalls.forget(key)
            self.operations.abandoned(call.kind)
        return gone

    def _pop(self, key: K) -> OpenCall | None:
        call = self._calls.pop(key, None)
        if call is not None:
            keys = self._by_session[call.session]
            keys.discard(key)
            if not keys:
                del self._by_session[call.session]
            self._unjob(key, call)
            self._stalls.forget(key)
        return call

    def _unjob(self, key: K, call: OpenCall) -> None:
        job = str(call.session.job)
        keys = self._by_job[job]
        keys.discard(key)
        if not keys:
            del self._by_job[job]


def region(meta: Meta) -> tuple[int, int, int]:
    """A request's array as (segment, offset, bytes), for a call that waits (checked by its
    parse already; see :class:`Waits`)."""
    return get_int(meta, "seg"), get_int(meta, "off"), get_int(meta, "nbytes")


class Shared(Generic[K]):
    """One object for equal values (a collective's spec): 30,000 waiting calls of 1,000 names
    hold 1,000 specs, not 30,000 (see :class:`Waits`).  At most :data:`_SHARED` values; past
    it the pool starts afresh (a value is only shared, never lost)."""

    def __init__(self) -> None:
        self._values: dict[K, K] = {}

    def one(self, value: K) -> K:
        if len(self._values) >= _SHARED and value not in self._values:
            self._values.clear()
        return self._values.setdefault(value, value)


G = TypeVar("G", bound=Hashable)


class Groups(Generic[G, K]):
    """A service's keys by group -- by job (collectives, reducers), or by client session (a
    parameter server's places) -- so that a rank's news, a job's end, a client's request or its
    departure touches only its own keys: the review found rank events that walked every
    collective of every job, and requests that walked every shard of every process."""

    def __init__(self) -> None:
        self._keys: dict[G, dict[K, None]] = {}  #: oldest first

    def add(self, group: G, key: K) -> None:
        self._keys.setdefault(group, {})[key] = None

    def discard(self, group: G, key: K) -> None:
        keys = self._keys.get(group)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._keys[group]

    def of(self, group: G) -> list[K]:
        """``group``'s keys, oldest first (a copy: the caller may remove them meanwhile)."""
        return list(self._keys.get(group, ()))

    def newest(self, group: G, limit: int) -> list[K]:
        """``group``'s ``limit`` newest keys, newest first."""
        return list(itertools.islice(reversed(self._keys.get(group, {})), limit))

    def count(self, group: G) -> int:
        return len(self._keys.get(group, ()))

    def pop(self, group: G) -> list[K]:
        """Remove and return ``group``'s keys."""
        return list(self._keys.pop(group, ()))

    def __bool__(self) -> bool:
        return bool(self._keys)
