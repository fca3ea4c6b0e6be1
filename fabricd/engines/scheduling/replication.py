"""Bounded-divergence replication (MLfabric §3.3, §5.3): how far a replica may lag its server,
and which update copies a batch sends the replica now (Alg. 4 of the paper's §5.3, in words).

Rules: this module decides, for one batch the server's schedule was planned for, which
workers' copies of updates go to the replica now, through which aggregators (Alg. 3 over the
residual network the server's transfers left), which wait for a later batch ("punted"), and
whether the server's last transfer must wait for the replica; and it bounds the divergence
``||w_s - w_r||`` of a server that leads its replica by some updates (eq. 10-11).  Pure
computation on a :class:`~fabricd.engines.scheduling.timelines.Network` copy; who sends and
when is the caller's business.

**The bound** (:func:`divergence`).  The update rule (eq. 2, the ``sgd`` rule with momentum
``gamma``): a step is ``s_t = gamma s_{t-1} + u_t`` (``u_t``: the update scaled by its
learning rate) and ``w_t = w_{t-1} + s_t``.  Let the server and the replica share ``w_m`` and
the step that led there, ``h = s_m`` (the replica's *history*), and the server apply
``u_{m+1} .. u_k`` beyond it, in the replica's own order.  Unrolling,

    s_t = gamma^(t-m) h + Σ_{j=m+1..t} gamma^(t-j) u_j,
    w_k - w_m = Σ_{t=m+1..k} s_t = c_0 h + Σ_{j=m+1..k} c_j u_j,
    c_j = 1 + gamma + ... + gamma^(k-j),   c_0 = gamma c_{m+1},

and by the triangle inequality ``||w_k - w_m|| <= c_0 ||h|| + Σ c_j ||u_j||``.  With
``k = m + 2`` this is eq. 7's ``(gamma + gamma^2) h + (1 + gamma) u_1 + u_2`` bounded term by
term; eq. 11 bounds the square of the same sum through Cauchy-Schwarz, which with its cross
terms' constants ``2 c_i c_j`` is this bound squared: the same figure, from the norms alone
(the scheduler has no update's values, only its norm, §4).  ``gamma = 0`` (the ``sum`` rule,
or ``sgd`` without momentum) leaves ``Σ ||u_j||``.  The replica's history is bounded the same
way as it applies updates: ``||s_{m+1}|| <= gamma ||s_m|| + ||u_{m+1}||`` (:func:`stepped`).
The bound is tight when every update and the history point the same way.

**A batch** (:func:`replicate`).  The batch's updates, in the server's apply order, follow
the updates the server applied earlier whose copies were punted (the *lagging* ones): the
replica applies them all in that one order (§3.3: replicas that apply updates in another order
diverge without bound, eq. 6).  Their copies are planned as a list (footnote 4: "replicated
transfers use already-computed server transfer ordering") with Alg. 3 toward the replica and
its earmarked aggregators, on the network the server's transfers left, so the server's go
first.  With ``T_last`` the batch's last commit at the server, the replica will have applied
the prefix whose copies all arrived by then.  If the bound (a norm, ``Div_max``, and/or a
count of updates the replica may lag) holds with the server at the batch's end and the
replica at that prefix, the prefix's copies are sent and the rest punted; else the server's
last transfer is delayed to start after the earliest prefix that satisfies it commits at the
replica (``a_e``), that prefix is sent, and the rest punted (§5.3).

Choices where the paper is silent, and why:

* *Groups are not cut.*  An aggregate cannot be taken apart, so a prefix that would end
  inside a replica group is extended to the group's end: a longer prefix only lowers the lead.
* *An empty batch* (only lagging copies) sends every copy that will arrive and delays
  nothing: nothing of the server's is planned, and an idle server must not leave its replica
  behind for ever.
* *A replica no link reaches* is never waited for: a copy that would never arrive is not
  sent, no delay is planned, and the plan says ``unreachable`` (a dead replica must not stall
  its server; the caller gives it up).
* *Momentum forbids summed copies* (:func:`replicate`): the bound holds only if the replica
  applies exactly the server's steps.
* *The check is at* ``T_last`` *only*, as the paper's: within a batch the lead may be larger
  for a moment.  The schedule is a plan; the server enforces the bound on what it applies
  (the caller's business), so a plan that the network does not keep cannot break it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabricd.engines.scheduling.aggregation import Group, aggregate
from fabricd.engines.scheduling.ordering import Planned, Update, in_list_order

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from fabricd.engines.scheduling.timelines import Network


def divergence(history: float, steps: Sequence[float], momentum: float) -> float:
    """The bound on ``||w_s - w_r||`` of a server that applied updates of norms ``steps``
    (in order, already scaled by their learning rates) beyond a replica whose last step's norm
    is at most ``history`` (module docstring: ``c_0 ||h|| + Σ c_j ||u_j||``).

    Raises:
        ValueError: a momentum outside ``[0, 1)``, or a norm negative or not finite.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum is in [0, 1), not {momentum}")
    if not all(0.0 <= n < math.inf for n in (history, *steps)):
        raise ValueError("norms are finite and >= 0")
    if not steps:
        return 0.0
    total = 0.0
    c = 0.0  # c_j, from the last update back: c_k = 1, c_j = 1 + gamma c_{j+1}
    for norm in reversed(steps):
        c = 1.0 + momentum * c
        total += c * norm
    return total + momentum * c * history


def stepped(history: float, step: float, momentum: float) -> float:
    """The bound on the norm of the replica's step once it applied an update of norm
    ``step``, its last step's being at most ``history``: ``gamma ||s|| + ||u||``."""
    return momentum * history + step


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """How far the replica may lag: ``norm`` (``Div_max``) and/or ``updates`` (a count, as
    §7.3 measures it); ``None``: no such limit."""

    norm: float | None = None
    updates: int | None = None

    def __post_init__(self) -> None:
        if self.norm is not None and not self.norm >= 0.0:  # (NaN fails too)
            raise ValueError(f"a divergence bound is >= 0, not {self.norm}")
        if self.updates is not None and self.updates < 0:
            raise ValueError(f"a lead in updates is >= 0, not {self.updates}")

    def holds(self, history: float, steps: Sequence[float], momentum: float) -> bool:
        if self.updates is not None and len(steps) > self.updates:
            return False
        return self.norm is None or divergence(history, steps, momentum) <= self.norm


@dataclass(frozen=True)
class Replication:
    """:func:`replicate`'s answer.

    ``sent``: the copies sent to the replica now, in order (each with its transfer, to the
    replica or to its group's aggregator); ``groups``: the replica groups among them;
    ``punted``: the copies that wait for a later batch, in order; ``delay``: the server's last
    transfer (its update's key) and the earliest it may start, or ``None``; ``lead``: the
    bound at ``T_last`` under the plan; ``history``: the bound on the replica's last step
    once it applied ``sent``; ``unreachable``: the replica could not have the prefix the bound
    needs, ever (a link with no capacity): no delay is planned (a dead replica must not stall
    its server), and the caller gives the replica up as it gives up a lost one."""

    sent: list[Planned]
    groups: list[Group]
    punted: list[Update]
    delay: tuple[Hashable, float] | None
    lead: float
    history: float
    unreachable: bool = False


def replicate(
    batch: Sequence[tuple[Update, float]],
    lagging: Sequence[Update],
    network: Network,
    *,
    replica: int,
    aggregators: Sequence[int],
    history: float,
    momentum: float,
    bound: Bound,
) -> Replication:
    """Plan the replica's copies of ``lagging`` then ``batch`` (module docstring, "A batch").

    ``batch``: the batch's updates in the server's apply order, each with its tentative commit
    time at the server; ``lagging``: updates the server applied (or will, before the batch)
    whose copies were punted, in order; ``network``: the state with the server's transfers
    booked (not changed); ``aggregators``: the hosts earmarked for the replica (k');
    ``history``: the bound on the replica's last step; every update's ``norm`` is its step's
    (scaled by its learning rate).

    With momentum (``momentum > 0``) ``aggregators`` must be empty: a sum applied as one step
    is not its members applied one by one (eq. 2: the second member's step carries the first's
    momentum), so a replica that summed copies would drift from its server by more than the
    bound says.  (The same holds for a learning rate that changes with the step, AdaDelay's:
    the caller passes no aggregators then either.)  The replica must apply exactly the
    server's steps, in the server's order, for the bound to hold.

    Raises:
        ValueError: the replica is one of the aggregators, aggregators with momentum, or a bad
            momentum or norm.
        KeyError: an unknown host.
    """
    if momentum > 0 and aggregators:
        raise ValueError("with momentum the replica's copies cannot be summed: no aggregators")
    order = [*lagging, *(u for u, _ in batch)]
    norms = [u.norm for u in order]
    listed = in_list_order(order, network, server=replica)
    plan = aggregate(listed.planned, network, server=replica, aggregators=aggregators)
    arrival: dict[int, float] = {}  # position in order -> when its copy reaches the replica
    member_of: dict[int, int] = {}  # position -> its group's index
    for p in plan.direct:
        arrival[p.position - 1] = p.transfer.end
    for g, group in enumerate(plan.groups):
        for member in group.members:
            arrival[member.position - 1] = group.forward.end
            member_of[member.position - 1] = g
    committed: list[float] = []  # committed[i]: when the replica has applied order[: i + 1]
    for i in range(len(order)):
        committed.append(max(arrival[i], committed[-1] if committed else -math.inf))
    # with no batch nothing of the server's is planned: every copy punted so far goes (else
    # an idle server would leave its replica behind for ever)
    t_last = max((t for _, t in batch), default=math.inf)
    m = sum(1 for t in committed if t <= t_last and t < math.inf)
    m = _whole(m, member_of, plan.groups)
    unreachable = False

    histories = [history]  # histories[k]: the replica's history once it applied order[:k]
    for norm in norms:
        histories.append(stepped(histories[-1], norm, momentum))

    delay: tuple[Hashable, float] | None = None
    if batch and not bound.holds(histories[m], norms[m:], momentum):
        e = next(
            k for k in range(m, len(order) + 1) if bound.holds(histories[k], norms[k:], momentum)
        )
        e = _whole(e, member_of, plan.groups)
        start = committed[e - 1] if e else network.now
        if math.isfinite(start):
            m, delay = e, (batch[-1][0].key, start)
        else:
            unreachable = True  # the prefix never arrives: send what will, delay nothing
    elif not batch and m < len(order):
        unreachable = True  # an idle server's copies that will never arrive
    transfers = {p.position: p for p in plan.direct}
    for group in plan.groups:
        for member in group.members:
            transfers[member.position] = member
    sent = [transfers[i] for i in range(1, m + 1)]
    groups = [g for g in plan.groups if all(x.position <= m for x in g.members)]
    lead = divergence(histories[m], norms[m:], momentum)
    return Replication(
        sent=sent,
        groups=groups,
        punted=order[m:],
        delay=delay,
        lead=lead,
        history=histories[m],
        unreachable=unreachable,
    )


def _whole(prefix: int, member_of: dict[int, int], groups: Sequence[Group]) -> int:
    """``prefix`` extended to the end of the replica group it ends inside, if any."""
    if prefix == 0 or (prefix - 1) not in member_of:
        return prefix
    group = groups[member_of[prefix - 1]]
    return max(prefix, max(member.position for member in group.members))
