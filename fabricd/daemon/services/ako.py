"""The Ako service: ``ako_open``, ``ako_step`` and ``ako_flush`` requests and PART frames.

Drives :mod:`fabricd.engines.ako.exchange`: one :class:`~fabricd.engines.ako.exchange.Exchange`
per (job, name, local rank), made by the rank's ``ako_open`` on its model array (a view of its
segment: received parts are written into it as they come, Ako §4.2 (5)).  A step hands the
engine the rank's gradient (read at once: the array may be reused once the call returns) and
is answered when the staleness gate lets the trainer compute the next one; a flush is answered
once every part sent before it by every reachable rank is applied here.

The data plane: a part travels to its peer as one PART frame on the data link (in order per
peer, :class:`~fabricd.daemon.services.data_queues.DataQueues`); between two ranks of one node
the service hands it over itself.  A PART for a rank that has not opened the exchange yet is
held for it (:mod:`fabricd.daemon.services.ako_early`): a trainer may step before a slower
one opened.

An open is answered when the engine's handshake is done (:meth:`Exchange.start`): every peer
answered its HELLO FRESH (a peer's daemon answers for a rank that has not opened yet), or the
rank had left and the survivors took it back at their next flush, with a model (its open
waits until then).  A HELLO not answered within ``route_timeout`` fails the open (a rank not
started, or its node unreachable); one to a rank not known yet is said again when it is, and
every ``route_timeout`` / 4 to the peers that did not answer (one may have been refused).

Partition counts (Ako §3.2): ``partitions=N``, or ``"auto"``: the rank steps with ``n - 1``
partitions (the least bandwidth) while it measures its gradient rate over its first
:data:`PROFILE_STEPS` steps, then cuts into eq. 3's ``p``, with ``B`` the network monitor's
figure for this node's uplink (:func:`fabricd.engines.ako.cost.partitions_for`).

Membership (Ako §4.3): a rank whose node's links were reset is suspected: its peers stop
sending it and keep what they owe it (:meth:`Exchange.lose`); back, it is sent its debt
(:meth:`Exchange.back`); gone, or left, it is forgotten (:meth:`Exchange.gone`), and the
survivors never wait for it.  A rank that opens the exchange again after it left is taken back
(Ako §4.3; the engine's module docstring says how).

Bounds: a model travels whole in one frame at most (a flush, a debt): its bytes are at most
``max_payload``; a job has at most ``max_collectives_per_job`` exchanges on a node; what an
exchange holds (its window, its sum, each debt) is charged to the job's byte budget first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.daemon.logs import RateLimitedLog
from fabricd.daemon.metrics import OperationStats, counter, gauge
from fabricd.daemon.service import BaseService
from fabricd.daemon.services.ako_early import EarlyParts
from fabricd.daemon.services.ako_frames import part_frame, received, unfit
from fabricd.daemon.services.ako_notices import NoticeSenders
from fabricd.daemon.services.data_queues import DataQueues
from fabricd.daemon.services.jobs import Groups, OpenCall, OpenCalls, refuse_while_draining
from fabricd.daemon.services.senders import Gate, Sender, earliest
from fabricd.daemon.stalls import call_line
from fabricd.dtypes import FLOAT_DTYPES
from fabricd.engines.actions import Failure
from fabricd.engines.ako.cost import partitions_for
from fabricd.engines.ako.exchange import (
    MAX_PARTITIONS,
    Exchange,
    Flushed,
    Opened,
    SendPart,
    SendSignal,
    Stepped,
)
from fabricd.engines.deadlines import Deadlines
from fabricd.engines.membership import RankBack as RankBackEvent
from fabricd.engines.membership import RankGone, RankJoined, RankLeft, RankSuspected
from fabricd.errors import ErrorCode, OperationFailed, RemoteProtocolError, UsageError
from fabricd.frames.ako import Part, Signal, describe
from fabricd.frames.fields import MAX_NAME
from fabricd.wire import Kind, Meta, get_int, get_str

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from prometheus_client.metrics_core import Metric

    from fabricd.daemon.service import Host, Request
    from fabricd.daemon.services.senders import Waiting
    from fabricd.daemon.sessions import ClientSession
    from fabricd.engines.ako.exchange import Action
    from fabricd.engines.budget import Charge
    from fabricd.engines.membership import Membership, RankEvent, Suspicion
    from fabricd.frames import registry

log = logging.getLogger("fabricd.ako")
remote_log = RateLimitedLog(log)

Key = tuple[str, str]  #: (job, exchange name)
RankKey = tuple[str, str, int]  #: (job, exchange name, rank)

#: steps a rank with ``partitions="auto"`` measures its gradient rate over
PROFILE_STEPS: Final = 5
#: seconds a stopping daemon waits for its queued PART frames (its last death notices) to go
STOP_GRACE: Final = 2.0


class AkoService(BaseService):
    """Ako's partial gradient exchange between the ranks of a job."""

    name = "ako"
    kinds = frozenset({Kind.PART})
    ops = frozenset({"ako_open", "ako_step", "ako_flush"})

    def __init__(self, host: Host, *, membership: Membership) -> None:
        self.host = host
        self.membership = membership
        self.exchanges: dict[RankKey, Exchange] = {}
        self._of_job: Groups[str, RankKey] = Groups()
        self._specs: dict[RankKey, Meta] = {}
        self._charges: dict[RankKey, list[Charge]] = {}
        #: "auto" ranks still measuring: the times of their steps so far
        self._profiles: dict[RankKey, list[float]] = {}
        self.operations = OperationStats(self.name, kinds=["step", "flush"])
        self._open: OpenCalls[RankKey] = OpenCalls(host, self.operations)
        #: exchanges whose HELLOs wait for answers: when their opens fail
        self._hellos: Deadlines[RankKey] = Deadlines()
        #: when exchanges still waiting for answers say HELLO again to the peers that did not
        #: answer (the first may have been refused: its rank moved, and the peer's table
        #: still had it on its old node)
        self._rehellos: Deadlines[RankKey] = Deadlines()
        #: exchanges opened in two ways: every call fails, saying so
        self._broken: dict[RankKey, str] = {}
        #: the debts each exchange keeps for unreachable peers, charged to the budget
        self._debts: dict[RankKey, dict[int, Charge]] = {}
        self._landing: dict[tuple[int, str, str, int, int], bytearray] = {}
        self._frames = DataQueues(host, Kind.PART, sent=self._count_sent)
        self._counters = {
            "part_bytes_sent": 0,
            #: for a rank not here, an exchange opened otherwise, held too long or past the
            #: bounds, or from a node its sender is not on (frames_refused_not_member too)
            "part_frames_dropped": 0,
            "repartitions": 0,
            "ranks_taken_back": 0,  #: opens answered with a survivor's model
            "death_notices": 0,  #: peers' death notices that killed an incarnation here
        }
        self._early = EarlyParts(host, self._counters)
        self._gate = Gate(
            host, membership, remote_log, self._counters, "part_frames_dropped", self._replay
        )
        self._notices = NoticeSenders(host, membership, self._gate)

    def _count_sent(self, nbytes: int) -> None:
        self._counters["part_bytes_sent"] += nbytes

    # -- requests ---------------------------------------------------------------------------
    def on_request(self, request: Request, now: float) -> Meta | None:
        refuse_while_draining(self.host)
        session = request.session
        if session.job is None:
            raise UsageError("connect with a job (fabricd.connect(job=...)) before exchanging")
        name = get_str(request.meta, "name")
        if not 0 < len(name) <= MAX_NAME:
            raise UsageError(f"a partial exchange name has 1 to {MAX_NAME} characters")
        rank_key = (session.job, name, session.rank)
        if request.op == "ako_open":
            return self._open_exchange(request, rank_key, now)
        if rank_key in self._broken:
            raise UsageError(self._broken[rank_key])
        exchange = self.exchanges.get(rank_key)
        if exchange is None:
            raise UsageError(f"rank {session.rank} has not opened partial exchange {name!r}")
        if rank_key in self._open:
            raise UsageError(f"rank {session.rank}'s last step or flush of {name!r} is open")
        if request.op == "ako_flush":
            self._start(request, rank_key, "flush", 0, now)
            self._perform(rank_key, exchange.flush(now))
            return None
        gradient = self._array(session, request.meta, exchange.model.dtype.name)
        if gradient.size != exchange.model.size:
            raise UsageError(
                f"partial exchange {name!r} takes gradients of {exchange.model.size} elements, "
                f"not {gradient.size}"
            )
        actions = self._profile(rank_key, exchange, now)
        try:
            stepped = exchange.step(gradient, now)  # (UsageError: the step changed nothing)
        except UsageError:
            self._perform(rank_key, actions)  # (a repartition's frames are counted: they go)
            raise
        self._start(request, rank_key, "step", gradient.nbytes, now)
        self._perform(rank_key, actions + stepped)
        return None

    def _start(
        self, request: Request, rank_key: RankKey, kind: str, nbytes: int, now: float
    ) -> None:
        call = OpenCall(
            session=request.session,
            request=request.id,
            kind=kind,
            name=rank_key[1],
            started=now,
            nbytes=nbytes,
        )
        self._open.open(rank_key, call)

    @staticmethod
    def _array(session: ClientSession, meta: Meta, dtype: str) -> np.ndarray[Any, Any]:
        if get_str(meta, "dtype") != dtype:
            raise UsageError(f"this exchange's arrays are {dtype}, not {get_str(meta, 'dtype')}")
        nbytes = get_int(meta, "nbytes")
        region = session.segment(get_int(meta, "seg")).view(get_int(meta, "off"), nbytes)
        return np.frombuffer(region, dtype=dtype)

    def _open_exchange(self, request: Request, rank_key: RankKey, now: float) -> Meta | None:
        meta, session = request.meta, request.session
        job, name, rank = rank_key
        if rank_key in self.exchanges:
            raise UsageError(f"rank {rank} opened partial exchange {name!r} already")
        spec, partitions = self._spec(meta, session)
        model = self._array(session, meta, spec["dtype"])
        missed = self._early.missed(rank_key)
        if missed is not None:
            raise OperationFailed(
                f"rank {rank}'s peers sent it parts of partial exchange {name!r} before it "
                f"opened, and {missed}: its model would miss them; open it sooner (every rank "
                "opens before its first step), or under another name",
                code=ErrorCode.LIMIT,
            )
        names = len({k[1] for k in self._of_job.of(job)})
        if names >= self.host.config.max_collectives_per_job:
            raise OperationFailed(
                f"job {job!r} has {names} partial exchanges on node {self.host.config.node_id}, "
                "the most max_collectives_per_job allows",
                code=ErrorCode.LIMIT,
            )
        count = min(partitions or max(1, spec["n"] - 1), spec["size"])
        # the window (p gradients), the model at the last flush, g* in float64, and one debt
        # (more are charged when made)
        charge = self._charge(job, ((count + 1) * model.itemsize + 16) * model.size, name)
        try:
            exchange = Exchange(
                rank=rank,
                ranks=spec["n"],
                model=model,
                partitions=count,
                lr=spec["lr"],
                staleness=spec["staleness"],
                nonce=secrets.randbits(63) or 1,
            )
        except BaseException:
            charge.release()
            raise
        self.exchanges[rank_key] = exchange
        self._specs[rank_key] = spec
        self._charges[rank_key] = [charge]
        self._of_job.add(job, rank_key)
        if partitions is None and spec["n"] > 1:
            self._profiles[rank_key] = []
        self._start(request, rank_key, "open", 0, now)
        self._hellos.set(rank_key, now + self.host.config.route_timeout)
        self._rehellos.set(rank_key, now + self.host.config.route_timeout / 4)
        for frame, payload in self._early.take(rank_key):
            self._apply(frame, payload)
        self._perform(rank_key, exchange.start())
        return None

    def _spec(self, meta: Meta, session: ClientSession) -> tuple[Meta, int | None]:
        """An open's spec (what every rank must agree on) and partition count (``None``:
        "auto"), checked."""
        dtype = get_str(meta, "dtype")
        if dtype not in FLOAT_DTYPES:
            raise UsageError(
                f"a partial exchange's model is {', '.join(FLOAT_DTYPES)}, not {dtype}"
            )
        nbytes = get_int(meta, "nbytes")
        itemsize = np.dtype(dtype).itemsize
        if nbytes == 0 or nbytes % itemsize:
            raise UsageError(f"{nbytes} B is not a whole number (> 0) of {dtype} elements")
        if nbytes > self.host.config.max_payload:
            raise OperationFailed(
                f"a partial exchange sends its model's size in one frame when it flushes: "
                f"{nbytes} B is more than max_payload ({self.host.config.max_payload} B) allows; "
                "exchange a smaller array, or several under names of their own",
                code=ErrorCode.LIMIT,
            )
        lr = meta.get("lr")
        if type(lr) is not float or not np.isfinite(lr) or lr <= 0:
            raise UsageError(f"lr must be a finite float > 0, not {lr!r}")
        partitions = meta.get("partitions")
        if partitions != "auto" and (type(partitions) is not int or partitions < 1):
            raise UsageError(f'partitions must be "auto" or an int >= 1, not {partitions!r}')
        spec = {
            "n": session.size,
            "size": nbytes // itemsize,
            "dtype": dtype,
            "lr": lr,
            "staleness": get_int(meta, "staleness", hi=2**31 - 1),
        }
        return spec, None if partitions == "auto" else int(partitions)

    def _charge(self, job: str, nbytes: int, name: str) -> Charge:
        owner = self.membership.owner(job)
        what = f"partial exchange {name!r} of job {job!r}"
        return self.host.budget.charge(-1 if owner is None else owner, job, nbytes, what)

    def _profile(self, rank_key: RankKey, exchange: Exchange, now: float) -> list[Action]:
        """``partitions="auto"``: after :data:`PROFILE_STEPS` steps, cut into eq. 3's count."""
        times = self._profiles.get(rank_key)
        if times is None:
            return []
        times.append(now)
        if len(times) <= PROFILE_STEPS:
            return []
        del self._profiles[rank_key]
        gamma = (len(times) - 1) / max(times[-1] - times[0], 1e-9)
        figures = self.host.network(now).get(self.host.config.node_id)
        bandwidth = figures.up if figures is not None and figures.up > 0 else 1.25e9
        spec = self._specs[rank_key]
        p = partitions_for(
            gamma=gamma,
            model_bytes=exchange.model.nbytes,
            ranks=spec["n"],
            bandwidth=bandwidth,
            elements=exchange.model.size,
        )
        p = min(p, MAX_PARTITIONS)
        if p == exchange.partitions:
            return []
        if p > exchange.partitions:  # (the window grows: its bytes are charged first)
            more = (p - exchange.partitions) * exchange.model.nbytes
            try:
                self._charges[rank_key].append(self._charge(rank_key[0], more, rank_key[1]))
            except OperationFailed as exc:
                log.warning("partial exchange %r keeps %d partitions: %s", rank_key[1], p, exc)
                return []
        self._counters["repartitions"] += 1
        log.info(
            "partial exchange %r of rank %d: %.1f gradients/s, %.3g B/s up: %d partitions",
            rank_key[1],
            rank_key[2],
            gamma,
            bandwidth,
            p,
        )
        return exchange.repartition(p)

    # -- peers ------------------------------------------------------------------------------
    def payload_buffer(
        self, node: int, frame: registry.PayloadFrame, length: int
    ) -> memoryview | None:
        assert isinstance(frame, Part)
        verdict = self._gate.judge(node, frame.job, frame.src)
        if verdict is Sender.NOT_YET:
            return self._gate.hold(node, frame.job, frame.src, frame, length)
        if verdict is Sender.STRANGER:
            return None
        entry = self.membership.lookup(frame.job, frame.dst)
        why = unfit(frame, length)
        if entry is None or entry.node != self.host.config.node_id or why is not None:
            self._dropped("a part for rank %d: %s", frame.dst, why or "not here")
            return None  # (its bytes are read and dropped)
        buffer = bytearray(length)
        self._landing[(node, frame.job, frame.name, frame.src, frame.dst)] = buffer
        return memoryview(buffer)

    def on_data(self, node: int, frame: registry.PayloadFrame, length: int, now: float) -> None:
        assert isinstance(frame, Part)
        if not length:  # (a handshake signal or a death notice: no buffer was asked for)
            verdict = self._judge(node, frame)
            if verdict is Sender.NOT_YET:
                self._gate.hold(node, frame.job, frame.src, frame, 0)
                self._gate.landed(node, frame, now)
            elif verdict is not Sender.STRANGER:
                self._take(node, frame, b"", now)
            return
        buffer = self._landing.pop((node, frame.job, frame.name, frame.src, frame.dst), None)
        if buffer is None:  # held for its sender's announcement, or a stranger's
            self._gate.landed(node, frame, now)
            return
        self._take(node, frame, buffer, now)

    def _replay(self, held: Waiting, now: float) -> None:
        """A frame that waited for its sender's rank to be known: judged again (a node that
        does not host that rank may not speak for it)."""
        frame = held.frame
        assert isinstance(frame, Part)
        if self._judge(held.node, frame) is not Sender.MEMBER:
            self._counters["part_frames_dropped"] += 1
            return
        self._take(held.node, frame, bytes(held.payload or b""), now)

    def _judge(self, node: int, frame: Part) -> Sender:
        """Whether ``node`` may send ``frame`` as its rank (a death notice also from the
        node that rank left: :mod:`~fabricd.daemon.services.ako_notices`)."""
        judge = self._notices.judge if frame.notice else self._gate.judge
        return judge(node, frame.job, frame.src)

    def _take(self, node: int, frame: Part, payload: bytes | bytearray, now: float) -> None:
        """A PART (with its bytes) from ``node``: applied, or held for its rank's open."""
        entry = self.membership.lookup(frame.job, frame.dst)
        if entry is None or entry.node != self.host.config.node_id:
            self._dropped("node %d sent a part for rank %d, not here", node, frame.dst)
            return
        why = unfit(frame, len(payload))
        if why is not None:
            self._dropped("a part for rank %d's %r: %s", frame.dst, frame.name, why)
            return
        rank_key = (frame.job, frame.name, frame.dst)
        if rank_key in self.exchanges:
            self._apply(frame, payload)
        elif frame.notice:
            return  # (of a peer's incarnation: a rank not open here has nothing of it)
        elif frame.signal is Signal.HELLO:  # (answered for a rank not open yet: a member)
            fresh = SendSignal(dst=frame.src, signal=Signal.FRESH, nonce=0, to=frame.nonce)
            self._send(rank_key, fresh, frame.spec)
        elif frame.signal is None and frame.to:  # (for an earlier incarnation: none opened)
            self._dropped(
                "a part for rank %d's %r, an incarnation that left", rank_key[2], rank_key[1]
            )
        elif frame.signal is None and not self._early.hold(rank_key, frame, payload, now):
            remote_log.warning(
                "dropped", "a part for rank %d's %r, not open yet: too many held", *rank_key[1:]
            )

    def _apply(self, frame: Part, payload: bytes | bytearray) -> None:
        """A part :meth:`_take` found fit (now, or when it held it) for an open exchange."""
        rank_key = (frame.job, frame.name, frame.dst)
        exchange = self.exchanges[rank_key]
        spec = self._specs[rank_key]
        if frame.spec != spec and frame.notice:  # (its sender's word alone: nothing broken)
            self._dropped("a death notice of rank %d's %r opened otherwise", frame.src, frame.name)
            return
        if frame.spec != spec:
            self._counters["part_frames_dropped"] += 1
            self._break(
                rank_key,
                f"partial exchange {frame.name!r} was opened in two ways: rank {frame.src} as "
                f"{describe(frame.spec)}, rank {frame.dst} as {describe(spec)}; every rank must "
                "open it with the same lr, staleness, dtype and size (or use another name)",
            )
            if frame.signal is Signal.HELLO:  # (answered with this spec: its open fails too)
                self._send(rank_key, SendSignal(dst=frame.src, signal=Signal.FRESH, nonce=0, to=0))
            return
        values = np.frombuffer(payload, dtype=exchange.model.dtype)
        news = frame.notice and not exchange.is_dead(frame.src, frame.nonce)
        try:
            if frame.signal is not None:
                actions = exchange.signal(frame.src, frame.signal, nonce=frame.nonce, to=frame.to)
            else:
                actions = received(exchange, frame, values)
        except RemoteProtocolError as exc:  # (a member's: its link, every job's, stays up)
            self._dropped("a part from rank %d refused: %s", frame.src, exc)
            return
        self._counters["death_notices"] += news
        self._perform(rank_key, actions)

    def _dropped(self, message: str, *args: object) -> None:
        self._counters["part_frames_dropped"] += 1
        remote_log.warning("dropped", message, *args)

    def peer_down(self, node: int, reason: str, now: float) -> None:
        """Frames queued for ``node`` go with its links (§4.3: in-flight parts are lost with a
        failure); its ranks' fate is membership's news."""
        self._frames.drop(node)
        self._landing = {k: b for k, b in self._landing.items() if k[0] != node}
        self._gate.drop_node(node)

    def on_rank_event(self, event: RankEvent, now: float) -> None:
        job, rank = event.entry.job, event.entry.rank
        if isinstance(event, RankLeft):
            self._notices.departed(event.entry, now)
            if not event.lost:  # (one lost with its node's links: on_suspicion decides)
                self._forget(job, rank, event.reason)
            return
        self._gate.release(job, rank, now)
        if isinstance(event, RankJoined):  # (a HELLO to it may have found no route)
            for rank_key in self._of_job.of(job):
                if rank in self.exchanges[rank_key].peers:
                    self._perform(rank_key, self.exchanges[rank_key].hello_again(rank))

    def on_suspicion(self, event: Suspicion, now: float) -> None:
        match event:
            case RankSuspected(entry=entry):
                for rank_key in self._of_job.of(entry.job):
                    exchange = self.exchanges[rank_key]
                    if entry.rank in exchange.peers:
                        self._owe(rank_key, exchange, entry.rank)
            case RankBackEvent(entry=entry):
                for rank_key in self._of_job.of(entry.job):
                    exchange = self.exchanges[rank_key]
                    if entry.rank in exchange.peers:
                        self._settle(rank_key, entry.rank)
                        self._perform(rank_key, exchange.back(entry.rank))
            case RankGone(entry=entry, reason=reason):
                self._notices.departed(entry, now)
                self._forget(entry.job, entry.rank, reason)

    def _owe(self, rank_key: RankKey, exchange: Exchange, peer: int) -> None:
        """``peer`` is unreachable: its debt is charged first; a debt the budget refuses is
        not kept (the peer is forgotten for good: the replicas may then differ)."""
        debts = self._debts.setdefault(rank_key, {})
        if peer in exchange.gone_peers:  # (if taken back meanwhile, it is owed: no debt yet)
            self._perform(rank_key, exchange.lose(peer))
            return
        if peer in debts:
            return
        try:
            debts[peer] = self._charge(rank_key[0], 8 * exchange.model.size, rank_key[1])
        except OperationFailed as exc:
            remote_log.warning("debt", "%s: rank %d is forgotten, its debt not kept", exc, peer)
            self._perform(rank_key, exchange.gone(peer))
            return
        self._perform(rank_key, exchange.lose(peer))

    def _settle(self, rank_key: RankKey, peer: int) -> None:
        """``peer``'s debt is paid (it is back) or dropped (gone): its charge goes."""
        charge = self._debts.get(rank_key, {}).pop(peer, None)
        if charge is not None:
            charge.release()

    def _break(self, rank_key: RankKey, message: str) -> None:
        """The exchange was opened in two ways: its open call and every later one fail."""
        if rank_key in self._broken:
            return
        log.warning("%s", message)
        self._broken[rank_key] = message
        self._open.fail(rank_key, Failure(code=ErrorCode.USAGE, message=message))

    def _forget(self, job: str, rank: int, reason: str) -> None:
        """Rank ``rank`` left or is gone: its peers here forget it; its own exchanges go."""
        for rank_key in list(self._of_job.of(job)):
            exchange = self.exchanges[rank_key]
            if rank_key[2] == rank:
                self._drop(rank_key, f"rank {rank} left job {job!r} ({reason})")
            elif rank in exchange.peers:
                self._settle(rank_key, rank)
                self._perform(rank_key, exchange.left(rank))
        self._early.drop_rank(job, rank)

    def _drop(self, rank_key: RankKey, why: str, code: ErrorCode = ErrorCode.PEER_FAILED) -> None:
        """``rank_key``'s exchange is closed: its peers are sent its death notices (a peer
        that took it back through another's marker may have no other way to learn it died)
        and what it holds goes."""
        exchange = self.exchanges.pop(rank_key)
        self._hellos.cancel(rank_key)
        self._rehellos.cancel(rank_key)
        spec = self._specs.pop(rank_key)
        for notice in exchange.death_notices():
            self._send(rank_key, notice, spec)
        self._profiles.pop(rank_key, None)
        self._of_job.discard(rank_key[0], rank_key)
        for charge in self._charges.pop(rank_key):
            charge.release()
        for peer in list(self._debts.get(rank_key, {})):
            self._settle(rank_key, peer)
        self._debts.pop(rank_key, None)
        self._broken.pop(rank_key, None)
        self._open.fail(rank_key, Failure(code=code, message=why))

    # -- sending ----------------------------------------------------------------------------
    def _perform(self, rank_key: RankKey, actions: list[Action]) -> None:
        """Carry out ``rank_key``'s actions (a local peer's frame is taken at once)."""
        for action in actions:
            if isinstance(action, Stepped):
                self._reply(rank_key, {"round": action.round})
            elif isinstance(action, Flushed):
                self._reply(rank_key, {"flush": action.flush, "synced_from": action.synced_from})
            elif isinstance(action, Opened):
                self._opened(rank_key, action)
            else:
                self._send(rank_key, action)
        debts = self._debts.get(rank_key)
        if debts and rank_key in self.exchanges:  # (a peer back in a new incarnation: no debt)
            lost = self.exchanges[rank_key].lost
            for peer in [peer for peer in debts if peer not in lost]:
                self._settle(rank_key, peer)

    def _opened(self, rank_key: RankKey, action: Opened) -> None:
        self._hellos.cancel(rank_key)
        self._rehellos.cancel(rank_key)
        spec = self._specs[rank_key]
        if action.joined_from is not None:
            self._counters["ranks_taken_back"] += 1
            log.info(
                "rank %d of job %r is taken back into partial exchange %r, with rank %d's model",
                rank_key[2],
                rank_key[0],
                rank_key[1],
                action.joined_from,
            )
        self._reply(
            rank_key,
            {
                "ranks": spec["n"],
                "auto": rank_key in self._profiles,
                "joined_from": action.joined_from,
                "flush": self.exchanges[rank_key].statistics().flushes,
            },
        )

    def _reply(self, rank_key: RankKey, result: Meta) -> None:
        exchange = self.exchanges.get(rank_key)
        if exchange is None:  # (dropped while a local peer's frame was taken)
            return
        result |= {
            "clock": exchange.clock,
            "partitions": exchange.partitions,
            "slowest": exchange.slowest,
        }
        self._open.reply(rank_key, result)

    def _send(
        self, rank_key: RankKey, action: SendPart | SendSignal, spec: Meta | None = None
    ) -> None:
        job, name, src = rank_key
        entry = self.membership.lookup(job, action.dst)
        if entry is None:
            return  # gone (membership's news forgets it), or not known yet (a HELLO: said again)
        spec = self._specs[rank_key] if spec is None else spec
        frame, payload = part_frame(job, name, src, action, spec)
        if entry.node == self.host.config.node_id:
            self._take(entry.node, frame, payload, self.host.now())
        else:
            self._frames.send(entry.node, frame.to_meta(), memoryview(payload))

    # -- clients, time, the drain -----------------------------------------------------------
    def client_gone(self, session: ClientSession, now: float) -> None:
        """A trainer that left takes its exchanges with it (its model was its array); its
        peers forget it when membership says its rank left."""
        self._open.abandon(session)
        for rank_key in [k for k in self._of_job.of(str(session.job)) if k[2] == session.rank]:
            self._drop(rank_key, "its trainer left")

    def next_deadline(self) -> float | None:
        return earliest(
            self._hellos.next(),
            self._rehellos.next(),
            self._gate.next_deadline(),
            self._early.next_deadline(),
            self._open.next_stall(),
        )

    def on_timer(self, now: float) -> None:
        self._gate.expire(now)
        for rank_key in self._early.expire(now):
            remote_log.warning(
                "early", "parts for rank %d's %r: it did not open in time", rank_key[2], rank_key[1]
            )
        for rank_key in self._rehellos.pop_due(now):
            self._hello_again(rank_key, now)
        for rank_key in self._hellos.pop_due(now):
            exchange = self.exchanges.get(rank_key)
            if exchange is None or exchange.phase != "hello":
                continue  # (taken back later: it waits for the survivors' flush)
            unanswered = sorted(exchange.unanswered)
            self._drop(
                rank_key,
                f"ranks {unanswered} did not answer the open of partial exchange "
                f"{rank_key[1]!r} within route_timeout ({self.host.config.route_timeout} s): "
                "start every rank of the job, and check their nodes are reachable",
                code=ErrorCode.NO_SUCH_RANK,
            )
        for rank_key, _ in self._open.stalled(now):
            row = self._stall_row(rank_key, now)
            if row is not None:
                log.warning("%s", call_line(row))

    def _hello_again(self, rank_key: RankKey, now: float) -> None:
        exchange = self.exchanges.get(rank_key)
        if exchange is None or exchange.phase == "running" or not exchange.unanswered:
            return
        for peer in sorted(exchange.unanswered):
            self._perform(rank_key, exchange.hello_again(peer))
        self._rehellos.set(rank_key, now + self.host.config.route_timeout / 4)

    def stalls(
        self, now: float, keep: Callable[[Meta], bool] | None = None, limit: int | None = None
    ) -> list[Meta]:
        """Steps and flushes open longer than ``stall_after``, oldest first, saying what they
        wait for (the staleness gate's slowest peer, or the peers a flush waits for)."""
        return self._open.stall_rows(now, lambda k: self._stall_row(k, now), keep, limit)

    def _stall_row(self, rank_key: RankKey, now: float) -> Meta | None:
        exchange, call = self.exchanges.get(rank_key), self._open.get(rank_key)
        if exchange is None or call is None:
            return None
        job, name, rank = rank_key
        stats = exchange.statistics()
        if call.kind == "open" and exchange.phase == "hello":
            detail = f"answers to its HELLO from ranks {sorted(exchange.unanswered)}"
        elif call.kind == "open":
            detail = "to be taken back: the survivors' next flush (it left, and came back)"
        elif call.kind == "step":
            detail = (
                f"the staleness gate: clock {stats.clock}, the slowest reachable peer heard at "
                f"{stats.slowest}, bound {exchange.bound}"
            )
        else:
            detail = f"flush {stats.flushes}: every reachable peer's flush" + (
                f", and peers {list(stats.lost)} back or gone" if stats.lost else ""
            )
        return {
            "job": job,
            "owner": self.membership.owner(job),
            "uid": call.session.conn.credentials.uid if call.session.conn is not None else None,
            "node": self.host.config.node_id,
            "op": f"{name}@{rank}",
            "kind": f"partial exchange {call.kind}",
            "rank": rank,
            "peer": "-",
            "tag": name,
            "nbytes": call.nbytes,
            "dtype": str(exchange.model.dtype),
            "pending_for": now - call.started,
            "waits": "peer",
            "detail": detail,
            "peer_joined": True,
            "peer_node": None,
            "peer_node_state": None,
            "client_left": False,
        }

    async def settle(self) -> None:
        """The daemon stops: every exchange here closes now, while the links are up, so its
        peers get its death notices (after this the node cancels its tasks, says BYE and
        closes the links); the frames queued go first, within :data:`STOP_GRACE`."""
        why = "the daemon is stopping; retry later"
        self.shutdown(Failure(code=ErrorCode.DAEMON_STOPPING, message=why))  # (first: a local
        for rank_key in list(self.exchanges):  # peer's notice must answer no open call)
            if rank_key in self.exchanges:
                self._drop(rank_key, why, code=ErrorCode.DAEMON_STOPPING)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_GRACE):
                await self._frames.sent_all()

    def shutdown(self, failure: Failure) -> None:
        for rank_key in [rank_key for rank_key, _ in self._open.items()]:
            self._open.fail(rank_key, failure)

    # -- status and metrics -----------------------------------------------------------------
    def statistics(self) -> Meta:
        rows = []
        for (job, name, rank), exchange in sorted(self.exchanges.items()):
            stats = exchange.statistics()
            rows.append(
                {
                    "job": job,
                    "owner": self.membership.owner(job),
                    "name": name,
                    "rank": rank,
                    "clock": stats.clock,
                    "partitions": stats.partitions,
                    "auto": (job, name, rank) in self._profiles,
                    "slowest": stats.slowest,
                    "held": stats.held,
                    "bytes_sent": stats.bytes_sent,
                    "bytes_received": stats.bytes_received,
                    "bytes_per_round": stats.bytes_sent / stats.clock if stats.clock else 0.0,
                    "parts_sent": stats.parts_sent,
                    "parts_received": stats.parts_received,
                    "flushes": stats.flushes,
                    "lost": list(stats.lost),
                    "gone": list(stats.gone),
                    "phase": stats.phase,
                }
            )
        return {
            "partial_exchanges": rows,
            "counters": {
                **self._counters,
                "parts_held_early": self._early.count,
                "exchange_opens_waiting": sum(
                    e.phase != "running" for e in self.exchanges.values()
                ),
            },
        }

    def client_statistics(self, session: ClientSession) -> Meta:
        return {"exchange_calls": self._open.count(session)}

    def metrics(self) -> Iterable[Metric]:
        """Totals over this node's exchanges (no job or name labels: their number has no
        bound); per-exchange figures are in the status rows."""
        yield from self.operations.families(pending=len(self._open))
        labels = {"service": self.name}
        stats = [e.statistics() for e in self.exchanges.values()]
        yield counter(
            "fabricd_ako_part_bytes_sent",
            "Bytes of PART frames sent to peers (Ako's partial gradient exchange)",
            [(labels, self._counters["part_bytes_sent"])],
        )
        yield counter(
            "fabricd_ako_rounds",
            "Rounds (steps) of the partial exchanges on this node",
            [(labels, sum(s.clock for s in stats))],
        )
        yield gauge(
            "fabricd_ako_exchanges",
            "Partial exchanges (rank, name) on this node",
            [(labels, len(stats))],
        )
