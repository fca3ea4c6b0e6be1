"""Model distribution trees (MLfabric §10.3): how one batch of pulls, answered at one version,
reaches its pullers through some of them instead of all through the server's one link.

Rules: this module decides, for a batch of pulls gathered in one scheduling interval, who
sends each puller the model (the server, or a puller that has it already: a *distributor*),
when, and how many bytes each hop carries (:func:`distribute`).  Pure computation on a
:class:`~fabricd.engines.scheduling.timelines.Network` copy; moving the bytes is the caller's.

Theory of operation (§10.3).  "If each request for the model is responded to individually
then the down-link at the server will become the bottleneck": the server's outbound link
carries one model per puller.  So the batch is answered at one version, ``k`` pullers are
earmarked as distributors, the server sends the model to the ``k``-th distributor first and
proceeds backwards to the first, then to the pullers it serves itself; each other puller is
mapped to the sender (the server or a distributor) whose transfer to it would end first once
that sender has the model, a variant of Alg. 3 with "the times taken to transfer the model
from server-to-distributor and distributor-to-worker" in place of its ``t_en``.  Every
transfer is booked on the network's residual timelines as it is decided.

Choices where the paper is silent, and why:

* *Which pullers distribute.*  The ``k`` with the fastest uplinks (ties: the earlier in the
  batch): a distributor's uplink carries the model to its whole group.  ``k="auto"`` tries
  every ``k`` from 0 to :data:`MAX_DISTRIBUTORS` and keeps the plan whose last puller has the
  model first (ties: fewer distributors).
* *Pullers are mapped shortest first*: in the order of their transfer time from the server
  alone, each to the sender that would finish it first, as Alg. 3 walks its list.
* *Deltas and trees* (the paper leaves them apart; TDF's pulls are deltas).  ``"whole"``:
  every hop carries the whole model.  ``"delta"``: what a hop carries must apply at every
  puller below it, so a distributor's *branch* (the distributor and the pullers it serves)
  carries one delta, from the branch's *oldest* cached version to the answered one; a
  puller the server serves itself gets its own delta, as it would without a tree; a puller
  with no cache (a fresh one, version 0) gets the whole model, from the server only, instead
  of making a branch carry it.  The mapping is planned with every branch carrying the
  batch's oldest delta (a branch's members are not known before), then booked again with
  each branch's own, which is never larger.  So the server never sends more than answering
  each pull itself (a branch's one delta is one of its members' own), and ``k = 0`` is
  exactly :func:`direct`: ``k="auto"``'s last puller is never served later than there.
  (One delta from the *batch's* oldest cache everywhere, the first reading of the issue,
  made one stale cache cost every puller: 4 pullers, caches 1 and 9 versions behind, sent
  2.25x the server's bytes of direct deltas, and finished 2.25x later.)  The caller gives
  the sizes (the timed store knows them); a delta is never larger than the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from fabricd.engines.scheduling.timelines import Network

#: the most distributors ``k="auto"`` tries
MAX_DISTRIBUTORS: Final = 16
Policy = Literal["whole", "delta"]


@dataclass(frozen=True, slots=True)
class Puller:
    """A pull of the batch: from ``host``, whose cache holds version ``cached`` (0: none).  One
    per host: a distributor is a host that has the model."""

    key: Hashable
    host: int
    cached: int


@dataclass(frozen=True, slots=True)
class Hop:
    """One transfer of the tree: ``size`` bytes from ``sender`` (the server's host, or a
    distributor's) to ``puller``, planned to run from ``start`` to ``end``."""

    puller: Puller
    sender: int
    size: float
    start: float
    end: float


@dataclass(frozen=True)
class Distribution:
    """:func:`distribute`'s answer: one hop per puller (in booking order), the version they all
    get, the distributors, and ``server_bytes``: the bytes the server sends, over its
    outbound link (the link §10.3 calls its "down-link", the direction the model flows)."""

    version: int
    hops: list[Hop]
    distributors: list[Puller]
    server_bytes: float

    @property
    def last(self) -> float:
        """When the last puller has the model."""
        return max((h.end for h in self.hops), default=0.0)


def distribute(
    pullers: Sequence[Puller],
    network: Network,
    *,
    server: int,
    version: int,
    whole: float,
    delta: Callable[[int], float] | None = None,
    k: int | Literal["auto"] = "auto",
    policy: Policy = "whole",
) -> Distribution:
    """The batch's tree (module docstring).  ``whole``: the model's bytes; ``delta(v)``: a
    delta's bytes from version ``v`` to ``version`` (``policy="delta"``); ``k``: distributors,
    or ``"auto"``.  ``network`` is not changed.

    Raises:
        KeyError: the server's or a puller's host is not one of ``network``'s.
        ValueError: a bad ``k``, ``policy`` or size, a puller twice, a cached version past
            ``version``, or ``policy="delta"`` without ``delta``.
    """
    _check(pullers, network, server, version, whole, delta, k, policy)
    if k == "auto":
        plans = [
            _plan(pullers, network, server, version, whole, delta, j, policy)
            for j in range(min(MAX_DISTRIBUTORS, max(len(pullers) - 1, 0)) + 1)
        ]
        return min(plans, key=lambda p: (p.last, len(p.distributors)))
    return _plan(pullers, network, server, version, whole, delta, k, policy)


def direct(
    pullers: Sequence[Puller],
    network: Network,
    *,
    server: int,
    version: int,
    whole: float,
    delta: Callable[[int], float] | None = None,
    policy: Policy = "whole",
) -> Distribution:
    """Every pull answered by the server alone, shortest first (§10.3's "each request
    responded to individually"): the baseline; each puller gets its own delta under
    ``"delta"``."""
    _check(pullers, network, server, version, whole, delta, 0, policy)
    running = network.copy()
    hops: list[Hop] = []
    sizes = {p.key: _own(p, whole, delta, policy) for p in pullers}
    for puller in sorted(pullers, key=lambda p: network.finish(server, p.host, sizes[p.key])):
        hops.append(_book(running, server, puller, sizes[puller.key], None))
    return Distribution(version, hops, [], sum(h.size for h in hops))


def _own(
    puller: Puller, whole: float, delta: Callable[[int], float] | None, policy: Policy
) -> float:
    if policy == "whole" or puller.cached == 0 or delta is None:
        return whole
    return min(whole, delta(puller.cached))


def _plan(
    pullers: Sequence[Puller],
    network: Network,
    server: int,
    version: int,
    whole: float,
    delta: Callable[[int], float] | None,
    k: int,
    policy: Policy,
) -> Distribution:
    fresh = [p for p in pullers if policy == "delta" and p.cached == 0]
    tree = [p for p in pullers if p not in fresh]
    own = {p.key: _own(p, whole, delta, policy) for p in pullers}
    shared = own[min(tree, key=lambda p: p.cached).key] if tree else whole  # oldest cache's
    k = min(k, max(len(tree) - 1, 0))
    ranked = sorted(
        range(len(tree)), key=lambda i: (-network.uplink(tree[i].host).at(network.now), i)
    )
    distributors = [tree[i] for i in sorted(ranked[:k])]
    rest = [p for p in pullers if p not in distributors]
    rest.sort(key=lambda p: network.finish(server, p.host, own[p.key]))
    senders = _map(network.copy(), server, distributors, rest, own, shared, fresh)
    oldest = {d.host: d for d in distributors}  # a branch's oldest cache: its delta travels
    for puller in rest:
        sender = senders[puller.key]
        if sender != server and puller.cached < oldest[sender].cached:
            oldest[sender] = puller
    branch = {host: own[p.key] for host, p in oldest.items()}
    running = network.copy()
    hops: list[Hop] = []
    ready: dict[int, float] = {}
    for distributor in reversed(distributors):
        hop = _book(running, server, distributor, branch[distributor.host], None)
        hops.append(hop)
        ready[distributor.host] = hop.end
    for puller in rest:
        sender = senders[puller.key]
        size = own[puller.key] if sender == server else branch[sender]
        hops.append(_book(running, sender, puller, size, ready.get(sender)))
    sent = sum(h.size for h in hops if h.sender == server)
    return Distribution(version, hops, distributors, sent)


def _map(
    running: Network,
    server: int,
    distributors: Sequence[Puller],
    rest: Sequence[Puller],
    own: dict[Hashable, float],
    shared: float,
    fresh: Sequence[Puller],
) -> dict[Hashable, int]:
    """Alg. 3's variant: each of ``rest``, in order, to the sender that would finish it first
    (distributors, served first, k-th first, carry ``shared``; the server sends a puller its
    own size, and is the only sender of a ``fresh`` one); every transfer is booked on
    ``running`` as it is decided."""
    ready: dict[int, float] = {}
    for distributor in reversed(distributors):  # the k-th first, then backwards
        ready[distributor.host] = _book(running, server, distributor, shared, None).end
    senders: dict[Hashable, int] = {}
    for puller in rest:
        options: list[tuple[int, float | None, float]] = [(server, None, own[puller.key])]
        if puller not in fresh:
            options += [(d.host, ready[d.host], shared) for d in distributors]
        best = min(
            options,
            key=lambda s: (running.finish(s[0], puller.host, s[2], start=s[1]), s[0] != server),
        )
        _book(running, best[0], puller, best[2], best[1])
        senders[puller.key] = best[0]
    return senders


def _book(network: Network, sender: int, puller: Puller, size: float, start: float | None) -> Hop:
    if network.finish(sender, puller.host, size, start=start) == math.inf:
        return Hop(puller, sender, size, network.now if start is None else start, math.inf)
    transfer = network.reserve(sender, puller.host, size, start=start)
    return Hop(puller, sender, size, transfer.start, transfer.end)


def _check(
    pullers: Sequence[Puller],
    network: Network,
    server: int,
    version: int,
    whole: float,
    delta: Callable[[int], float] | None,
    k: int | str,
    policy: str,
) -> None:
    network.uplink(server)
    if policy not in ("whole", "delta"):
        raise ValueError(f"policy is 'whole' or 'delta', not {policy!r}")
    if policy == "delta" and delta is None:
        raise ValueError("policy='delta' needs the delta sizes")
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k is an int >= 0 or 'auto', not {k!r}")
    if not (whole >= 0 and math.isfinite(whole)):
        raise ValueError(f"the model's size is a finite number >= 0, not {whole}")
    if len({p.key for p in pullers}) != len(pullers) or len({p.host for p in pullers}) != len(
        pullers
    ):
        raise ValueError("a puller (or a host) is in the batch twice")
    for puller in pullers:
        network.downlink(puller.host)
        if not 0 <= puller.cached <= version:
            raise ValueError(f"puller {puller.key!r} caches version {puller.cached} > {version}")
        if puller.host == server:
            raise ValueError(f"puller {puller.key!r} is on the server's host")
