"""Parameter-server consistency: when a server applies workers' updates, when a worker's pull
may be answered, which updates are too stale to apply, and how an update changes the model
(MLfabric §2, §3.1, §4 and Table 1, eq. 2; SSP as MLfabric §6 and its [23] define it).

Rules: this module decides, for one model (or one shard of one) on its server, which pushed
updates to apply, in which order and grouped how (:class:`Apply`), when to answer each pull
(:class:`Reply`), which updates to drop as too delayed (:class:`Drop`), and which pulls it will
never answer (:class:`Refused`); and it holds the update rules (:class:`Sum`, :class:`SGD`, a
user's :class:`UpdateCallback`) that turn one :class:`Apply` into a model step.  It never
touches a socket, a segment or a clock (``now`` only stamps held pulls for stall reports) and
holds no model: the parameter-server service keeps the model, performs the actions *in the
order given* (a :class:`Reply` follows the :class:`Apply` actions it must see), moves the
bytes, and says when a worker is lost.  On a worker's node,
:class:`~fabricd.engines.ps.delay_gate.DelayGate` is MLfabric's worker-side drop.  Every
malformed push or pull raises :class:`RemoteProtocolError` (the worker's daemon broke the
protocol; nothing in the coordinator changed); a wrong setting raises :class:`UsageError`.

Theory of operation.  The model has a *version*: the number of :class:`Apply` actions so far,
each one step of the update rule.  A worker at *clock* ``c`` computes its update of iteration
``c`` from the model it pulled last (its *base* version), pushes it, and pulls for clock
``c + 1``.  An update's *delay* is the version of the model it is applied to minus its base
(MLfabric §2: "the difference between the version of the model being updated and the one used
to compute the update").  Every worker's pushes are numbered 0, 1, 2, ...; a push repeating or
going back on a worker's iteration is a protocol error under every consistency model.  Pulls
travel on the control channel and pushes on the data channel, so a pull may overtake its
worker's pushes: under BSP and SSP its clock may run up to ``s + 1`` past the pushes that
arrived (as many as an honest worker can have in flight), no further.

* ``bsp`` (synchronous SGD, MLfabric §6).  Iteration ``t`` is applied exactly once, as one
  :class:`Apply` holding every worker's push of ``t`` (the rule steps once with their sum:
  version ``t + 1`` is the model after iteration ``t``), when the last of them arrived.  A pull
  at clock ``c`` is answered once iterations ``0 .. c - 1`` are applied (version >= ``c``),
  else held until then.  A worker pushes its iterations in order and at most one iteration
  ahead of the one being collected: pushing ``t + 1`` before ``t`` is applied is allowed (a
  worker that pushes, then pulls without waiting, pipelines by one), ``t + 2`` is an error,
  so at most two iterations' pushes are ever held.
* ``ssp`` with staleness ``s`` (stale synchronous parallel: slow workers lag fast ones by at
  most ``s`` iterations).  Every push is applied on arrival (one :class:`Apply` each).  The
  server tracks each worker's clock (iterations pushed) and the *complete* count: the least
  clock over live workers, i.e. every live worker's updates of iterations ``< complete`` are
  applied.  The classic SSP read rule: a worker at clock ``c`` may read once every worker's
  updates of iterations up to ``c - s - 1`` are applied, ``complete >= c - s``; a pull that
  would break it is held and answered as soon as a push (or a loss) lifts ``complete``.  So the
  model a reader at clock ``c`` gets lacks at most the updates of iterations ``c - s .. c - 1``:
  it is at most ``s`` iterations behind the reader (``s = 0`` reads like BSP, but applies on
  arrival).  Pushes go in order, at most ``s + 1`` iterations past ``complete`` (a worker
  whose pull at clock ``c`` was answered may push ``c``, and one more without waiting, as
  under BSP, which is ``s = 0`` here).
* ``async`` (asynchronous SGD, MLfabric §2, §3.1).  Every push is applied on arrival; a push
  whose delay would exceed the bound ``tau_max`` is dropped instead (:class:`Drop`, reason
  :attr:`DropReason.DELAY`, counted), as §3.1 allows ("no update with delay > τmax should be
  applied").  Pulls are answered at once.  Iterations may skip numbers (a worker that dropped
  an update at home sends none for it).  MLfabric drops such updates at the worker, before
  they cost the network anything (§5.1.3, §7.1):
  :class:`~fabricd.engines.ps.delay_gate.DelayGate` does that where the worker can know — the
  server's version only grows, so an update whose base is more than ``tau_max`` behind the
  newest version the worker has heard of would be dropped on arrival — and the server drops
  what the worker could not know about.

Lost workers (:meth:`Coordinator.lose`): nothing waits for a lost worker again.  Under BSP an
iteration is applied once every *live* worker's push of it arrived (the one being collected
included, so the survivors go on at once); under SSP ``complete`` is the least clock over live
workers.  Held pulls are re-examined and answered where now allowed; the lost worker's own held
pull is :class:`Refused`.  What a lost worker pushed before it was lost is kept and applied
(under BSP with its iteration's other pushes): an update that arrived is never discarded
silently.  What it pushes afterwards (a frame still in flight) is dropped (:class:`Drop`,
:attr:`DropReason.LOST`, counted) and its pulls are refused.  A lost worker does not come back
to the same coordinator: a job whose membership grows starts a new one.

Aggregates (MLfabric §5.2, :meth:`Coordinator.push_aggregate`): one sum of several workers'
updates.  Under async it is applied at once as one step that advances the version by the
number of members, or dropped whole (a member's worker lost, or a member over the bound): a
sum cannot be taken apart.  Under BSP (MLfabric-S, §6) it holds one iteration's updates and
waits, like a push, for that iteration's others; the iteration's step adds each aggregate's sum
once (:attr:`Apply.parts`).  A member whose worker was lost since is applied with its fellows
there (the server refuses such an aggregate before it reaches here: this covers a loss taken
between the two): dropping the aggregate would drop live workers' updates their iteration
waits for.

Duplicates: a push of an iteration the worker pushed already is an error, not a duplicate to
absorb.  A service that sends pushes again after a link reset must recognise its own resends
(by frame sequence) before they reach the coordinator.

Cost: a push or a pull is O(1) plus, when ``complete`` moves, O(held pulls) to release them;
BSP holds at most two iterations' pushes; one held pull per worker.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np

from fabricd.engines.ps import snapshot as snap
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.wire import get_int

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping


class Consistency(enum.Enum):
    """When updates are applied and pulls answered (module docstring)."""

    BSP = "bsp"
    SSP = "ssp"
    ASYNC = "async"


CONSISTENCIES: Final = tuple(c.value for c in Consistency)
#: the built-in update rules' names (:func:`update_rule`)
RULES: Final = ("sum", "sgd")
#: the sgd rule's step-size schedules besides a constant ``lr`` (:class:`SGD`'s ``lr_delay``)
LR_DELAYS: Final = ("adaptive",)
#: upper bounds of the delay histogram's buckets (:attr:`CoordinatorStatistics.delays`): bucket
#: ``i`` counts applied updates with ``DELAY_BUCKETS[i - 1] < delay <= DELAY_BUCKETS[i]``, and
#: one more bucket those above the last bound
DELAY_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


# -- update rules -------------------------------------------------------------------------
class UpdateRule(Protocol):
    """How one :class:`Apply` changes the model: ``apply`` steps ``model`` in place by
    ``update`` (an :class:`Apply`'s :meth:`Apply.combined`), once per version."""

    def apply(self, model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None: ...


class UpdateCallback(Protocol):
    """A user's update rule (MLfabric Table 1, ``registerUpdateCallback``): called in the
    server's own process with the model and the update, it changes the model in place.  Under
    BSP it gets the sum of an iteration's updates; state it needs (a learning-rate schedule,
    the version) it keeps itself."""

    def __call__(self, model: np.ndarray[Any, Any], update: np.ndarray[Any, Any], /) -> None: ...


def _check_shapes(model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
    if update.shape != model.shape:
        raise UsageError(f"an update of shape {update.shape} for a model of shape {model.shape}")


class Sum:
    """``w += u``: the update is the step (the worker scaled it)."""

    def apply(self, model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
        _check_shapes(model, update)
        model += update


class SGD:
    """SGD with momentum, MLfabric eq. 2 with eq. 1's step taken on the server::

        w_{t+1} = w_t + u_t + gamma (w_t - w_{t-1}),    u_t = -alpha g_t

    where ``g_t`` is the pushed update (a gradient: the worker folds any regularisation term of
    eq. 1 into it), ``alpha`` is eq. 1's learning rate (eta) and ``gamma`` is ``momentum``.  The
    rule keeps the last step ``w_t - w_{t-1}`` (zero before the first: ``w_{-1} = w_0``), the
    server state MLfabric's footnote 2 names "history of updates ... used for momentum based
    model updates"; each call computes ``step = -alpha g + gamma step`` and ``w += step``, which
    is eq. 2 exactly.

    The step size ``alpha`` is ``lr``, or with ``lr_delay="adaptive"`` AdaDelay's
    delay-adaptive one (Sra et al., MLfabric's [31], §3.1 eq. 3-4; §10.4 eq. 21:
    ``1/alpha(t, tau) = c sqrt(t + tau)``), for an update applied to the model's version ``t``
    with delay ``tau`` (:meth:`rate`)::

        alpha(t, tau) = lr * sqrt(t0 / (t0 + t + tau))

    which is eq. 21's form with ``c = 1 / (lr sqrt(t0))`` and the time counted from ``t0``.
    **The choice**: [31] and §10.4 count iterations from 1 and leave ``c`` free; counting from
    ``t0`` (``lr_t0``, 1 by default: the papers' own count) makes ``alpha(0, 0) = lr``, so
    ``lr`` stays the initial step size, and ``lr_t0`` says how long it stays near it (the step
    of a fresh update halves after ``3 t0`` versions).  An update ``tau`` versions stale steps as
    a fresh one ``tau`` versions later would: less.  Each update of an :class:`Apply` gets its
    own ``alpha`` (:meth:`apply_updates`); under BSP an iteration's pushes all have delay 0, so
    the iteration's sum steps with ``alpha(t, 0)``.  ``alpha`` depends only on the version and
    the delays the coordinator gives the :class:`Apply`, so a replica that processes the same
    log computes the same steps, and the rule keeps no state for it (:func:`rule_state`).
    """

    def __init__(
        self,
        *,
        lr: float,
        momentum: float = 0.0,
        lr_delay: str | None = None,
        lr_t0: float | None = None,
    ) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise UsageError(f"the sgd rule needs a finite lr > 0, not {lr}")
        if not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise UsageError(f"the sgd rule needs 0 <= momentum < 1, not {momentum}")
        if lr_delay is not None and lr_delay not in LR_DELAYS:
            raise UsageError(f"lr_delay is one of {', '.join(LR_DELAYS)} or None, not {lr_delay!r}")
        if lr_t0 is not None and lr_delay is None:
            raise UsageError('lr_t0= belongs to lr_delay="adaptive"')
        if lr_t0 is not None and not (math.isfinite(lr_t0) and lr_t0 > 0):
            raise UsageError(f"lr_t0 is a finite number > 0, not {lr_t0}")
        self.lr = lr
        self.momentum = momentum
        self.lr_delay = lr_delay
        self.lr_t0 = 1.0 if lr_t0 is None else lr_t0
        self.step: np.ndarray[Any, Any] | None = None  #: w_t - w_{t-1}, None before the first

    def rate(self, version: int, delay: int) -> float:
        """``alpha(t, tau)`` for an update of delay ``delay`` applied to version ``version``:
        ``lr``, or (``lr_delay="adaptive"``) ``lr * sqrt(t0 / (t0 + t + tau))``."""
        if self.lr_delay is None:
            return self.lr
        return self.lr * math.sqrt(self.lr_t0 / (self.lr_t0 + version + delay))

    def apply(self, model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
        """One step with ``alpha = lr`` (``alpha(0, 0)``: no version or delay known)."""
        _check_shapes(model, update)
        self._descend(model, self.lr * update)

    def apply_updates(self, model: np.ndarray[Any, Any], action: Apply) -> None:
        """One step for ``action``, each update with its own :meth:`rate` (the version the
        model is at before the step, the update's delay); one rate for all steps with their
        sum, as :meth:`apply` does.  An aggregate (MLfabric §5.2) is one sum that cannot be
        taken apart: it steps at its stalest member's rate, the smallest."""
        if action.summed:
            before = action.version - len(action.updates)
            rate = min(self.rate(before, u.delay) for u in action.updates)
            self._descend(model, rate * action.combined())
            return
        version = action.version - 1
        rates = [self.rate(version, u.delay) for u in action.updates]
        for u in action.updates:
            _check_shapes(model, u.values)
        if len(set(rates)) == 1:
            self._descend(model, rates[0] * action.combined())
            return
        descent = np.zeros_like(model)
        if action.parts:  # BSP aggregates: each sum once, at its stalest member's rate
            rate_of = {u.worker: r for u, r in zip(action.updates, rates, strict=True)}
            for workers, values in action.parts:
                descent += min(rate_of[w] for w in workers) * values
        else:
            for rate, u in zip(rates, action.updates, strict=True):
                descent += rate * u.values
        self._descend(model, descent)

    def _descend(self, model: np.ndarray[Any, Any], descent: np.ndarray[Any, Any]) -> None:
        """``step = gamma step - descent; w += step`` (``descent``: ``alpha g``, summed)."""
        if self.step is None:
            self.step = np.zeros_like(model)
        elif self.step.shape != model.shape:
            raise UsageError(f"this rule steps a model of shape {self.step.shape}")
        step = self.step
        step *= self.momentum
        step -= descent
        model += step


def step_model(rule: UpdateRule, model: np.ndarray[Any, Any], action: Apply) -> None:
    """Step ``model`` once by ``rule`` for ``action``: the sgd rule sizes each update's step
    by its version and delay (:meth:`SGD.apply_updates`); the others take the combined update."""
    if isinstance(rule, SGD):
        rule.apply_updates(model, action)
    else:
        rule.apply(model, action.combined())


def rule_state(rule: UpdateRule | None) -> dict[str, Any]:
    """What a replica needs of ``rule`` (SGD's last step; its delay-adaptive step sizes come
    from each :class:`Apply`'s version and delays, which the coordinator's state and the log
    give the replica; the other rules keep nothing here: a callback's own state lives in its
    process)."""
    if isinstance(rule, SGD):
        return {"step": rule.step}
    return {}


def restore_rule(
    rule: UpdateRule | None, state: dict[str, Any], like: np.ndarray[Any, Any]
) -> None:
    """Take :func:`rule_state`'s ``state`` into ``rule`` (a model shaped ``like``).

    Raises:
        RemoteProtocolError: a step of another shape or dtype.
    """
    if not isinstance(rule, SGD):
        return
    step = state.get("step")
    if step is not None and (
        not isinstance(step, np.ndarray) or step.shape != like.shape or step.dtype != like.dtype
    ):
        raise RemoteProtocolError("a snapshot's sgd step of another shape or dtype")
    rule.step = step


class Callback:
    """A user's :class:`UpdateCallback` as an :class:`UpdateRule`."""

    def __init__(self, callback: UpdateCallback) -> None:
        self.callback = callback

    def apply(self, model: np.ndarray[Any, Any], update: np.ndarray[Any, Any]) -> None:
        self.callback(model, update)


def update_rule(
    rule: str | UpdateCallback,
    *,
    lr: float | None = None,
    momentum: float | None = None,
    lr_delay: str | None = None,
    lr_t0: float | None = None,
) -> UpdateRule:
    """The rule ``update_rule=`` names: ``"sum"``, ``"sgd"`` (``lr`` required, ``momentum``
    0 unless given, ``lr_delay``/``lr_t0`` as :class:`SGD` takes them), or a callable
    (:class:`UpdateCallback`).

    Raises:
        UsageError: an unknown name, a bad setting, or ``lr``/``momentum``/``lr_delay``/
            ``lr_t0`` given to a rule that takes none.
    """
    if rule == "sgd":
        if lr is None:
            raise UsageError('update_rule="sgd" needs lr=')
        momentum = 0.0 if momentum is None else momentum
        return SGD(lr=lr, momentum=momentum, lr_delay=lr_delay, lr_t0=lr_t0)
    if rule != "sum" and (isinstance(rule, str) or not callable(rule)):
        raise UsageError(f"update_rule is one of {', '.join(RULES)} or a callable, not {rule!r}")
    if any(x is not None for x in (lr, momentum, lr_delay, lr_t0)):
        raise UsageError('lr=, momentum=, lr_delay= and lr_t0= belong to update_rule="sgd"')
    return Sum() if isinstance(rule, str) else Callback(rule)


# -- actions ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    """Worker ``worker``'s push of iteration ``iteration``, computed from model version
    ``base``; ``delay`` is the version it was applied to (or dropped at) minus ``base``."""

    worker: int
    iteration: int
    base: int
    delay: int
    values: np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Apply:
    """Step the model once with the update rule and :meth:`combined`: the model becomes
    version ``version``.  ``updates`` is one push (SSP, async) or every push of iteration
    ``iteration`` (BSP), in worker order."""

    version: int
    iteration: int
    updates: tuple[Update, ...]
    #: an aggregate's (MLfabric §5.2): every update carries the members' sum, once
    summed: bool = False
    #: BSP with aggregates in the iteration: what to add, as (the workers inside, their sum):
    #: each aggregate once (its updates share its sum), each lone push alone; else empty
    parts: tuple[tuple[tuple[int, ...], np.ndarray[Any, Any]], ...] = ()

    def combined(self) -> np.ndarray[Any, Any]:
        """The update to step with: the one push's values (or an aggregate's sum), or a new
        array with their sum."""
        if len(self.updates) == 1 or self.summed:
            return self.updates[0].values
        arrays = tuple(v for _, v in self.parts) or tuple(u.values for u in self.updates)
        if len(arrays) == 1:
            return arrays[0]
        total = np.array(arrays[0], copy=True)
        for values in arrays[1:]:
            total += values
        return total


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """Answer worker ``worker``'s pull at clock ``clock`` with the model at ``version`` (what
    changed since its cached ``since``).  Every live worker's updates of iterations below
    ``complete`` are in it; ``held`` says the pull waited."""

    worker: int
    clock: int
    version: int
    since: int
    complete: int
    held: bool


class DropReason(enum.Enum):
    """Why an update was not applied."""

    DELAY = "delay"  #: its delay would exceed the bound (async)
    LOST = "lost"  #: its worker was lost before it arrived
    SCHEDULED = "scheduled"  #: MLfabric's scheduler dropped it before it was sent (§5.1.3)


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop:
    """Worker ``worker``'s update of ``iteration`` (base version ``base``, ``delay`` versions
    behind) is not applied, for ``reason`` (counted; :attr:`message` says it for a log)."""

    worker: int
    iteration: int
    base: int
    delay: int
    reason: DropReason
    bound: int | None = None  #: the delay bound, for :attr:`DropReason.DELAY`
    why: str | None = None  #: the scheduler's words, for :attr:`DropReason.SCHEDULED`

    @property
    def message(self) -> str:
        if self.reason is DropReason.SCHEDULED:
            return f"worker {self.worker}'s update of iteration {self.iteration} was {self.why}"
        if self.reason is DropReason.DELAY:
            return (
                f"worker {self.worker}'s update of iteration {self.iteration} was dropped: "
                f"delay {self.delay} > bound {self.bound}"
            )
        return f"worker {self.worker}'s update of iteration {self.iteration} came after it was lost"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """Worker ``worker``'s pull at clock ``clock`` will never be answered (``reason``)."""

    worker: int
    clock: int
    reason: str


Action = Apply | Reply | Drop | Refused


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorStatistics:
    """What ``fabricctl status`` and the metrics show of one model's consistency."""

    version: int
    complete: int
    applied: int  #: updates applied (under BSP several per version)
    dropped: Mapping[str, int]  #: updates dropped, by :class:`DropReason` value
    delays: tuple[int, ...]  #: applied updates by delay (:data:`DELAY_BUCKETS`)
    delay_sum: int  #: the applied updates' delays added up (a histogram's sum: the mean delay)
    held: int  #: pulls held now
    held_total: int  #: pulls that had to wait, ever
    refused: int  #: pulls refused (lost workers)
    live: int  #: workers not lost
    waiting: tuple[str, ...]


@dataclass(slots=True)
class _Held:
    clock: int
    since: int
    at: float  #: when it was held (``now``)


class Coordinator:
    """The consistency of one model (or shard) on its server (module docstring).

    ``workers`` are the worker ids; ``staleness`` is SSP's ``s``; ``delay_bound`` is async's
    ``tau_max`` (``None``: no bound).
    """

    def __init__(
        self,
        *,
        workers: Iterable[int],
        consistency: Consistency,
        staleness: int = 0,
        delay_bound: int | None = None,
    ) -> None:
        ids = sorted(set(workers))
        if not ids or ids[0] < 0:
            raise UsageError("a parameter server needs one or more workers, ids >= 0")
        if staleness < 0 or (staleness and consistency is not Consistency.SSP):
            raise UsageError(f"staleness >= 0 belongs to ssp, not {consistency.value}")
        if delay_bound is not None and (delay_bound < 0 or consistency is not Consistency.ASYNC):
            raise UsageError(f"a delay bound >= 0 belongs to async, not {consistency.value}")
        self.consistency = consistency
        self.staleness = staleness
        self.delay_bound = delay_bound
        self.workers: tuple[int, ...] = tuple(ids)
        self._live = set(ids)
        self._next = dict.fromkeys(ids, 0)  #: each worker's clock: its next iteration
        self._version = 0
        self._complete = 0
        #: BSP: iteration -> worker -> its push (base version, values)
        self._pending: dict[int, dict[int, tuple[int, np.ndarray[Any, Any]]]] = {}
        #: BSP: iteration -> the member workers of each aggregate held (their values: its sum)
        self._grouped: dict[int, list[tuple[int, ...]]] = {}
        self._held: dict[int, _Held] = {}  #: worker -> its held pull, in arrival order
        self._applied = 0
        self._dropped = {r.value: 0 for r in DropReason}
        self._delays = [0] * (len(DELAY_BUCKETS) + 1)
        self._delay_sum = 0
        self._held_total = 0
        self._refused = 0

    # -- inputs ---------------------------------------------------------------------------
    def push(
        self, worker: int, iteration: int, base: int, values: np.ndarray[Any, Any], now: float
    ) -> list[Action]:
        """Worker ``worker`` pushed its update of ``iteration``, computed from version ``base``.

        Raises:
            RemoteProtocolError: an unknown worker, a base version the model never had, an
                iteration pushed before (or older than one pushed), or (BSP, SSP) one that
                skips an iteration or runs too far ahead (module docstring).
        """
        self.check_push(worker, iteration, base)
        self._next[worker] = iteration + 1
        delay = self._version - base
        if worker not in self._live:
            return [self._drop(worker, iteration, base, delay, DropReason.LOST)]
        bound = self.delay_bound
        if self.consistency is Consistency.ASYNC and bound is not None and delay > bound:
            return [self._drop(worker, iteration, base, delay, DropReason.DELAY)]
        if self.consistency is Consistency.BSP:
            self._pending.setdefault(iteration, {})[worker] = (base, values)
            out: list[Action] = self._apply_iterations()
        else:
            out = [self._apply(iteration, {worker: (base, values)})]
            self._advance()
        return out + self._release()

    def push_aggregate(
        self, members: tuple[tuple[int, int, int], ...], values: np.ndarray[Any, Any], now: float
    ) -> list[Action]:
        """An aggregate of ``members`` (worker, iteration, base each; MLfabric §5.2) whose
        updates sum to ``values`` (async, BSP: the consistencies MLfabric schedules).  Async:
        applied as one step that advances the version by the number of members, or, if any
        member's worker was lost or any member's delay is over the bound, dropped whole (each
        member's drop counted and said): a sum cannot be taken apart.  BSP: held with its
        iteration's other pushes (module docstring).

        Raises:
            RemoteProtocolError: as :meth:`push`, for any member; no members; (BSP) members
                of more than one iteration, or a worker twice; SSP.
        """
        if not members or self.consistency is Consistency.SSP:
            raise RemoteProtocolError("an aggregate holds members, of an async or bsp model")
        for worker, iteration, base in members:
            self.check_push(worker, iteration, base)
        if self.consistency is Consistency.BSP:
            return self._hold_aggregate(members, values)
        for worker, iteration, _ in members:
            self._next[worker] = iteration + 1
        lost = any(w not in self._live for w, _, _ in members)
        bound = self.delay_bound
        late = bound is not None and any(self._version - b > bound for _, _, b in members)
        if lost or late:
            reason = DropReason.LOST if lost else DropReason.DELAY
            out: list[Action] = [
                self._drop(w, it, b, self._version - b, reason) for w, it, b in members
            ]
            self._advance()
            return out + self._release()
        updates = tuple(
            Update(worker=w, iteration=it, base=b, delay=self._version - b, values=values)
            for w, it, b in members
        )
        for u in updates:
            self._delays[_bucket(u.delay)] += 1
            self._delay_sum += u.delay
        self._applied += len(updates)
        self._version += len(updates)
        self._advance()
        apply = Apply(version=self._version, iteration=members[0][1], updates=updates, summed=True)
        return [apply, *self._release()]

    def _hold_aggregate(
        self, members: tuple[tuple[int, int, int], ...], values: np.ndarray[Any, Any]
    ) -> list[Action]:
        """BSP: ``members`` (checked) wait with their iteration's pushes, sharing ``values``."""
        iterations = {it for _, it, _ in members}
        workers = [w for w, _, _ in members]
        if len(iterations) != 1 or len(set(workers)) != len(workers):
            raise RemoteProtocolError("a bsp aggregate holds one iteration, each worker once")
        iteration = iterations.pop()
        for worker in workers:
            self._next[worker] = iteration + 1
        if not any(w in self._live for w in workers):
            # lost meanwhile, every one (the server checked them live when it took it): held,
            # it would wait below ``complete`` for ever, as no live worker's iteration needs it
            out: list[Action] = []
            for worker, _, base in members:
                delay = self._version - base
                out.append(self._drop(worker, iteration, base, delay, DropReason.LOST))
            return out + self._release()
        pushes = self._pending.setdefault(iteration, {})
        for worker, _, base in members:
            pushes[worker] = (base, values)
        self._grouped.setdefault(iteration, []).append(tuple(workers))
        return self._apply_iterations() + self._release()

    def skip(self, worker: int, iteration: int, base: int, why: str) -> list[Action]:
        """Worker ``worker``'s update of ``iteration`` was dropped by MLfabric's scheduler
        before it was sent (``why``): the iteration is done, nothing is applied, the drop is
        counted (async only: the scheduler runs for it).

        Raises:
            RemoteProtocolError: as :meth:`push`.
        """
        self.check_push(worker, iteration, base)
        self._next[worker] = iteration + 1
        self._dropped[DropReason.SCHEDULED.value] += 1
        drop = Drop(
            worker=worker,
            iteration=iteration,
            base=base,
            delay=self._version - base,
            reason=DropReason.SCHEDULED,
            why=why,
        )
        self._advance()
        return [drop, *self._release()]

    def check_push(self, worker: int, iteration: int, base: int) -> None:
        """Raise as :meth:`push` would for this push, changing nothing: a server that logs a
        push (to replicate it) before it applies it refuses a malformed one first.

        Raises:
            RemoteProtocolError: as :meth:`push`.
        """
        self._known(worker)
        if not 0 <= base <= self._version:
            raise RemoteProtocolError(
                f"worker {worker} pushed an update computed from version {base}; "
                f"the model is at version {self._version}"
            )
        self._check_iteration(worker, iteration)

    def pull(self, worker: int, clock: int, since: int, now: float) -> list[Action]:
        """Worker ``worker``, at clock ``clock``, asks for the model; it holds version
        ``since``.  Answered now, held (answered by a later input) or refused (a lost worker).

        Raises:
            RemoteProtocolError: an unknown worker, a cached version the model never had, a
                second pull while one is held, or (BSP, SSP) a clock more than ``s + 1`` past
                the iterations the worker pushed (an honest worker has at most ``s + 1``
                pushes in flight, and its pull may overtake them).
        """
        self._known(worker)
        if not 0 <= since <= self._version:
            raise RemoteProtocolError(
                f"worker {worker} holds version {since}; the model is at version {self._version}"
            )
        if worker in self._held:
            raise RemoteProtocolError(f"worker {worker} pulled again while its pull is held")
        if clock < 0 or (
            self.consistency is not Consistency.ASYNC
            and clock > self._next[worker] + self.staleness + 1
        ):
            raise RemoteProtocolError(
                f"worker {worker} pulled at clock {clock} having pushed "
                f"{self._next[worker]} iterations"
            )
        if worker not in self._live:
            self._refused += 1
            return [Refused(worker=worker, clock=clock, reason=f"worker {worker} was lost")]
        if self._readable(clock):
            return [self._reply(worker, clock, since, held=False)]
        self._held[worker] = _Held(clock=clock, since=since, at=now)
        self._held_total += 1
        return []

    def lose(self, worker: int, reason: str, now: float) -> list[Action]:
        """Worker ``worker`` left or its node went down (module docstring, Lost workers)."""
        self._known(worker)
        if worker not in self._live:
            return []
        self._live.discard(worker)
        out: list[Action] = []
        held = self._held.pop(worker, None)
        if held is not None:
            self._refused += 1
            out.append(Refused(worker=worker, clock=held.clock, reason=f"lost: {reason}"))
        if self.consistency is Consistency.BSP:
            out += self._apply_iterations()
        else:
            self._advance()
        return out + self._release()

    # -- reading --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The model's version: :class:`Apply` actions so far."""
        return self._version

    @property
    def complete(self) -> int:
        """Every live worker's updates of iterations below this are applied."""
        return self._complete

    def held(self, worker: int) -> int | None:
        """The clock of ``worker``'s held pull, if one is held."""
        held = self._held.get(worker)
        return None if held is None else held.clock

    def bump(self) -> int:
        """A new version that applies no update (the server published what its lossless
        filter held back); returns it."""
        self._version += 1
        return self._version

    def clock(self, worker: int) -> int:
        """``worker``'s clock: the iteration it pushes next (0 before its first push)."""
        self._known(worker)
        return self._next[worker]

    @property
    def live(self) -> frozenset[int]:
        """The workers not lost."""
        return frozenset(self._live)

    def waiting_for(self) -> list[str]:
        """What held pulls and (BSP) the iteration being collected wait for (stall reports)."""
        out: list[str] = []
        if self.consistency is Consistency.BSP and self._pending.get(self._complete):
            missing = sorted(self._live - self._pending[self._complete].keys())
            out.append(f"iteration {self._complete} waits for the pushes of workers {missing}")
        for worker, held in self._held.items():
            need = held.clock - self.staleness
            slow = sorted(w for w in self._live if self._next[w] < need)
            out.append(
                f"worker {worker}'s pull at clock {held.clock} (held since {held.at:.3f}) waits "
                f"for iteration {need - 1} from workers {slow}"
            )
        return out

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(
            version=self._version,
            complete=self._complete,
            applied=self._applied,
            dropped=dict(self._dropped),
            delays=tuple(self._delays),
            delay_sum=self._delay_sum,
            held=len(self._held),
            held_total=self._held_total,
            refused=self._refused,
            live=len(self._live),
            waiting=tuple(self.waiting_for()),
        )

    # -- snapshots ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a replica needs to go on from here (held pulls excepted: their workers send
        them again to whoever serves next); see :mod:`fabricd.engines.ps.snapshot`."""
        return {
            "live": sorted(self._live),
            "next": dict(self._next),
            "version": self._version,
            "complete": self._complete,
            "pending": {
                it: {w: [base, values] for w, (base, values) in pushes.items()}
                for it, pushes in self._pending.items()
            },
            "grouped": {it: [list(m) for m in groups] for it, groups in self._grouped.items()},
            "applied": self._applied,
            "dropped": dict(self._dropped),
            "delays": list(self._delays),
            "delay_sum": self._delay_sum,
            "held_total": self._held_total,
            "refused": self._refused,
        }

    def restore(self, state: dict[str, Any], *, size: int, dtype: np.dtype[Any]) -> None:
        """Take ``state`` (:meth:`state` of a coordinator of the same workers and settings,
        holding pushes of ``size`` elements of ``dtype``); held pulls are dropped.

        Raises:
            RemoteProtocolError: ``state`` is not such a state; nothing changed.
        """
        live = snap.field(state, "live", list)
        nexts = snap.field(state, "next", dict)
        workers = set(self.workers)
        if not all(type(w) is int for w in live):
            raise RemoteProtocolError("snapshot workers must be ints")
        if set(nexts) != workers or not set(live) <= workers:
            raise RemoteProtocolError("a snapshot of another set of workers")
        if not all(type(v) is int and v >= 0 for v in nexts.values()):
            raise RemoteProtocolError("snapshot clocks must be ints >= 0")
        pending: dict[int, dict[int, tuple[int, np.ndarray[Any, Any]]]] = {}
        for it, pushes in snap.field(state, "pending", dict).items():
            if type(it) is not int or not isinstance(pushes, dict) or not set(pushes) <= workers:
                raise RemoteProtocolError("snapshot pushes of unknown iterations or workers")
            pending[it] = {}
            for w, entry in pushes.items():
                if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int:
                    raise RemoteProtocolError("a snapshot push is [base, values]")
                values = entry[1]
                if (
                    not isinstance(values, np.ndarray)
                    or values.shape != (size,)
                    or values.dtype != dtype
                ):
                    raise RemoteProtocolError("a snapshot push of another shape or dtype")
                pending[it][w] = (entry[0], values)
        grouped = _grouped(snap.field(state, "grouped", dict), pending)
        dropped = snap.field(state, "dropped", dict)
        delays = snap.field(state, "delays", list)
        if set(dropped) != set(self._dropped) or len(delays) != len(self._delays):
            raise RemoteProtocolError("snapshot counters of another shape")
        if not all(type(v) is int and v >= 0 for v in [*dropped.values(), *delays]):
            raise RemoteProtocolError("snapshot counters must be ints >= 0")
        counts = {
            name: get_int(state, name)
            for name in ("version", "complete", "applied", "delay_sum", "held_total", "refused")
        }
        complete = counts["complete"]
        if self.consistency is Consistency.BSP and complete > counts["version"]:
            raise RemoteProtocolError("a snapshot with more iterations complete than versions")
        if any(nexts[w] < complete for w in live):
            raise RemoteProtocolError("a snapshot with a live worker's clock below complete")
        if pending and self.consistency is not Consistency.BSP:
            raise RemoteProtocolError(f"a snapshot with pushes held under {self.consistency.value}")
        for it, pushes in pending.items():
            if it < complete or any(it >= nexts[w] for w in pushes):
                raise RemoteProtocolError(f"a snapshot holding pushes of iteration {it}")
        self._live = set(live)
        self._next = dict(nexts)
        self._pending = pending
        self._grouped = grouped
        self._held = {}
        self._version, self._complete = counts["version"], counts["complete"]
        self._applied, self._delay_sum = counts["applied"], counts["delay_sum"]
        self._held_total, self._refused = counts["held_total"], counts["refused"]
        self._dropped = {k: int(v) for k, v in dropped.items()}
        self._delays = [int(v) for v in delays]

    # -- internals ------------------------------------------------------------------------
    def _known(self, worker: int) -> None:
        if worker not in self._next:
            raise RemoteProtocolError(f"worker {worker} is not a worker of this model")

    def _check_iteration(self, worker: int, iteration: int) -> None:
        """Raise unless ``iteration`` may be ``worker``'s next push (module docstring)."""
        expected = self._next[worker]
        if iteration < expected:
            raise RemoteProtocolError(
                f"worker {worker} pushed iteration {iteration} after pushing {expected - 1}"
            )
        if self.consistency is Consistency.ASYNC:
            return
        if iteration > expected:
            raise RemoteProtocolError(
                f"worker {worker} pushed iteration {iteration}, skipping {expected}"
            )
        ahead = self._complete + self.staleness + 1
        if iteration > ahead:
            raise RemoteProtocolError(
                f"worker {worker} pushed iteration {iteration} before its pull at clock "
                f"{iteration} could be answered (at most {ahead} while {self._complete} "
                f"iterations are complete)"
            )

    def _drop(self, worker: int, iteration: int, base: int, delay: int, reason: DropReason) -> Drop:
        self._dropped[reason.value] += 1
        bound = self.delay_bound if reason is DropReason.DELAY else None
        return Drop(
            worker=worker, iteration=iteration, base=base, delay=delay, reason=reason, bound=bound
        )

    def _apply(
        self, iteration: int, pushes: Mapping[int, tuple[int, np.ndarray[Any, Any]]]
    ) -> Apply:
        """One version: ``pushes`` (worker -> base, values) of ``iteration``, in worker
        order, with their delays, counted (BSP: with the iteration's aggregates' parts)."""
        groups = self._grouped.pop(iteration, [])
        grouped = {w for members in groups for w in members}
        parts: list[tuple[tuple[int, ...], np.ndarray[Any, Any]]]
        parts = [((w,), pushes[w][1]) for w in sorted(pushes) if w not in grouped]
        parts += [(members, pushes[members[0]][1]) for members in groups]
        updates = tuple(
            Update(
                worker=w,
                iteration=iteration,
                base=pushes[w][0],
                delay=self._version - pushes[w][0],
                values=pushes[w][1],
            )
            for w in sorted(pushes)
        )
        for u in updates:
            self._delays[_bucket(u.delay)] += 1
            self._delay_sum += u.delay
        self._applied += len(updates)
        self._version += 1
        return Apply(
            version=self._version,
            iteration=iteration,
            updates=updates,
            parts=tuple(parts) if groups else (),
        )

    def _apply_iterations(self) -> list[Action]:
        """BSP: apply every iteration, in order, whose live workers' pushes are all in."""
        out: list[Action] = []
        while (pushes := self._pending.get(self._complete)) and self._live <= pushes.keys():
            del self._pending[self._complete]
            out.append(self._apply(self._complete, pushes))
            self._complete += 1
        return out

    def _advance(self) -> None:
        """SSP, async: ``complete`` is the least clock over live workers (never lower)."""
        if self._live:
            self._complete = max(self._complete, min(self._next[w] for w in self._live))

    def _readable(self, clock: int) -> bool:
        return self.consistency is Consistency.ASYNC or self._complete >= clock - self.staleness

    def _reply(self, worker: int, clock: int, since: int, *, held: bool) -> Reply:
        return Reply(
            worker=worker,
            clock=clock,
            version=self._version,
            since=since,
            complete=self._complete,
            held=held,
        )

    def _release(self) -> list[Action]:
        """Answer the held pulls now allowed, in the order they came."""
        ready = [w for w, h in self._held.items() if self._readable(h.clock)]
        out: list[Action] = []
        for worker in ready:
            held = self._held.pop(worker)
            out.append(self._reply(worker, held.clock, held.since, held=True))
        return out


def _grouped(
    state: dict[Any, Any], pending: dict[int, dict[int, tuple[int, np.ndarray[Any, Any]]]]
) -> dict[int, list[tuple[int, ...]]]:
    """A snapshot's BSP aggregates, checked against its held pushes: each names held pushes
    of its iteration, and no push is in two (one sum each).

    Raises:
        RemoteProtocolError: anything else.
    """
    grouped: dict[int, list[tuple[int, ...]]] = {}
    for it, groups in state.items():
        if type(it) is not int or it not in pending or not isinstance(groups, list):
            raise RemoteProtocolError("snapshot aggregates are lists of a held iteration's")
        if not all(isinstance(g, list) and g and all(type(w) is int for w in g) for g in groups):
            raise RemoteProtocolError("snapshot aggregates are lists of member workers")
        held = pending[it]
        members = [w for g in groups for w in g]
        if len(set(members)) != len(members) or not set(members) <= held.keys():
            raise RemoteProtocolError(f"snapshot aggregates of iteration {it} it does not hold")
        if any(not np.array_equal(held[w][1], held[g[0]][1]) for g in groups for w in g):
            raise RemoteProtocolError(f"a snapshot aggregate of iteration {it} of unlike sums")
        grouped[it] = [tuple(g) for g in groups]
    return grouped


def _bucket(delay: int) -> int:
    for i, bound in enumerate(DELAY_BUCKETS):
        if delay <= bound:
            return i
    return len(DELAY_BUCKETS)
