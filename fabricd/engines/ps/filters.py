"""Gradient and parameter filters of the parameter server (TDF §III.C-D, eq. 1-3), and a
lossless publish mode beyond TDF.

Rules: this module decides, for one worker's pushes of one model (or shard), which gradient
elements go out now and which wait, and, for one server's model (or shard), which parameters a
model update publishes.  It keeps the state that takes: the worker's held gradients (eq. 2's
residual) and the server's model (its exact and its published values).  numpy arithmetic only:
no socket, no clock, and no randomness but the numpy ``Generator`` the caller passes (G-RP
draws from it, nothing else does), so a seeded caller gets the same pushes every run.  The
``ps`` service sends what a :class:`Push` holds and bumps the versions of the chunks a
:class:`Publish` names.  :class:`FilterSettings` turns each filter on; every one is off by
default, and then both filters are the identity.

Theory of operation.  TDF's thresholds shrink as training goes on (the "regulariser" of eq. 1
and 3): at iteration ``t`` (1, 2, ...; :func:`smp_threshold`)

    threshold(t) = phi / (1 + d * log t),

``phi`` the initial threshold, ``d >= 0`` the decay, ``log`` natural (another base only
rescales ``d``), so ``threshold(1) = phi`` and it falls from there.

The worker (:class:`GradientFilter`, TDF §III.C and Fig. 4), at each push of iteration ``t``:

1. adds what it held back to the new gradient, elementwise (eq. 2):
   ``grad_j = grad_j^New + grad_j^Dropped``;
2. G-SMP (eq. 1) selects ``grad_j`` when ``|grad_j| < threshold(t)`` (``gsmp_threshold``,
   ``gsmp_decay``); G-RP selects ``round(p_grp * n)`` (Python's round, half to even) of the
   ``n`` elements, uniformly without
   replacement: TDF's ``p_grp`` is "the percentage of gradients to be dropped" ("drop 90% of
   gradients, if p_grp = 0.9"), a share, not a per-element coin.  An element is dropped when
   every policy that is on selects it: "part of the gradients [is dropped] if they are selected
   by both G-SMP and G-RP".  With one policy off, the other alone decides (an off policy
   selecting nothing would turn the other off too); with both off nothing is dropped.  An
   exact zero (the new gradient plus what was held) is never pushed, whatever the policies
   selected, once any filter is on: it carries nothing, and sparse data has many (G-RP would
   otherwise send the zeros it left unselected);
3. G-LNP casts what is pushed to float16 (TDF Table I), clipping to +-65504 (float16's range);
4. keeps what it did not push, ``grad_j - pushed_j``: the dropped elements whole, and the part
   of a pushed element G-LNP rounded off or clipped.  TDF keeps dropped gradients because "all
   gradients work together to make parameters converge" (§III.C); the same holds for what
   G-LNP rounds away, which TDF loses.  Kept, it is pushed later like a dropped gradient, and
   the filter conserves gradient: over any run of pushes, what was pushed plus what is held
   equals what was given (:func:`balance`, up to the rounding bounded there).

A push is dense (every element, 0 where dropped) or sparse (ascending indices, uint32 below
2**32 elements, and their values), whichever is fewer bytes, ties dense: dense costs ``n``
values, sparse ``k`` indices and ``k`` values, so with float16 values sparse wins when fewer
than a third of the elements go, with float32 fewer than half.  The server adds either into
its gradient sum, a dropped element adding 0.

The server (:class:`ParameterFilter`, TDF §III.D and Fig. 5) filters each model update, the
new values its update rule computed from :attr:`ParameterFilter.model`:

* P-SMP (eq. 3) drops ``theta'_j`` when ``|(theta'_j - theta_j) / theta_j| < threshold(t)``
  (``psmp_threshold``, ``psmp_decay``), evaluated as written in the parameters' dtype.  With
  ``theta_j = 0`` any change is infinitely large and published; an unchanged parameter
  (``theta'_j = theta_j``, where eq. 3 reads 0/0 for ``theta_j = 0``) is never published:
  nothing changed.  With P-SMP off every parameter is published.
* With versions per chunk (``chunk > 1``), a chunk is published, all its values, when any of
  its parameters is: per-chunk P-SMP never holds back a change per-parameter P-SMP publishes.
* TDF mode (``lossless_publish`` off): a dropped change is gone: "the server nodes would not
  update parameters that are dropped ... Unchanged parameters ... keep their original values
  and version numbers", and the next update starts from the kept value.  One array is both
  the model and what pulls serve.
* Lossless mode (beyond TDF): the server keeps the exact values, every update applied, and
  eq. 3's ``theta_j`` is the parameter's last *published* value: a parameter is published (the
  caller bumps its version) once its accumulated change since its last publish is
  significant.  After an update of iteration ``t`` every parameter's published value is within
  ``threshold(t)`` of relative change of its exact one, ``|exact - published| <= threshold(t) *
  |published|`` (as eq. 3 computes it, in the parameters' dtype); :meth:`ParameterFilter.flush`
  publishes every remaining difference (end of training, a checkpoint).  Memory: a second copy
  of the model.
* P-LNP: the published values go out as float16, clipped to +-65504 (counted: unlike G-LNP's,
  no residual keeps the clipped part).  TDF "use[s] Float16 to store parameters"; the server
  here keeps its own dtype and only the values for pulls are float16, since a float16 store
  would round away, for good, every update below half a float16 ulp of its parameter.

Comparisons with a threshold are exact: ``|x| < threshold`` for ``x`` of the data's dtype is
evaluated against the smallest value of that dtype not below the (float64) threshold, which
gives the same answer as comparing real numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.ps import snapshot as snap
from fabricd.errors import RemoteProtocolError, UsageError

if TYPE_CHECKING:
    from collections.abc import Iterable

Array = np.ndarray[Any, Any]

#: G-LNP's and P-LNP's format (TDF Table I, half precision)
LOW: Final = np.dtype(np.float16)
#: float16's largest value: G-LNP and P-LNP clip to +- this
LOW_MAX: Final = float(np.finfo(np.float16).max)

_THRESHOLDS: Final = ("gsmp_threshold", "gsmp_decay", "psmp_threshold", "psmp_decay")
_SWITCHES: Final = ("glnp", "plnp", "lossless_publish")


@dataclass(frozen=True, slots=True, kw_only=True)
class FilterSettings:
    """Which of TDF's filters are on, and their constants (TDF's names in brackets).

    Every filter is off by default: thresholds 0 drop nothing, ``grp_drop`` 0 selects nothing,
    the switches are false.  A decay without its threshold is harmless (the threshold stays 0),
    so is ``lossless_publish`` without P-SMP (everything is published either way).

    Raises:
        UsageError: a threshold or decay that is not a finite number >= 0, a ``grp_drop``
            outside [0, 1), or a switch that is not a bool.
    """

    #: G-SMP's initial threshold (phi_gsmp, eq. 1); 0: off
    gsmp_threshold: float = 0.0
    #: G-SMP's decay (d_gsmp, eq. 1)
    gsmp_decay: float = 0.0
    #: G-RP: the share of the gradient elements it selects for dropping (p_grp); 0: off
    grp_drop: float = 0.0
    #: G-LNP: push float16
    glnp: bool = False
    #: P-SMP's initial threshold (phi_psmp, eq. 3); 0: off
    psmp_threshold: float = 0.0
    #: P-SMP's decay (d_psmp, eq. 3)
    psmp_decay: float = 0.0
    #: P-LNP: publish float16
    plnp: bool = False
    #: keep exact values and publish accumulated changes (module docstring); off: TDF's P-SMP
    lossless_publish: bool = False

    def __post_init__(self) -> None:
        for name in (*_THRESHOLDS, "grp_drop"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise UsageError(f"{name} is a finite number >= 0 (0: off), not {value!r}")
        if self.grp_drop >= 1:
            raise UsageError(
                f"grp_drop is the share of gradient elements G-RP selects, in [0, 1), not "
                f"{self.grp_drop!r} (1 would hold back, G-SMP off, every gradient for ever)"
            )
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} is true or false, not {getattr(self, name)!r}")

    @property
    def gradient_filters(self) -> bool:
        """Whether any worker-side filter (G-SMP, G-RP, G-LNP) is on."""
        return bool(self.gsmp_threshold or self.grp_drop or self.glnp)


def smp_threshold(initial: float, decay: float, iteration: int) -> float:
    """The G-SMP (eq. 1) or P-SMP (eq. 3) threshold of ``iteration``:
    ``initial / (1 + decay * log iteration)``, natural log.

    Raises:
        UsageError: ``iteration`` is not an int >= 1 (TDF's ``t`` counts iterations from 1).
    """
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 1:
        raise UsageError(f"an iteration number is an int >= 1, not {iteration!r}")
    return initial / (1.0 + decay * math.log(iteration))


def _not_below(dtype: np.dtype[Any], bound: float) -> np.floating[Any]:
    """The smallest value of ``dtype`` that is >= ``bound``: for any ``x`` of ``dtype``,
    ``x < result`` exactly when ``x < bound`` as real numbers (infinity past the dtype's
    range)."""
    if bound > float(np.finfo(dtype).max):
        return dtype.type(np.inf)  # type: ignore[no-any-return]
    value = dtype.type(bound)
    if float(value) < bound:
        value = np.nextafter(value, dtype.type(np.inf))
    return value  # type: ignore[no-any-return]


def _float_dtype(dtype: np.dtype[Any] | str, what: str) -> np.dtype[Any]:
    """``dtype`` if it is one of :data:`DTYPES` (``what`` names the array in the refusal)."""
    if np.dtype(dtype).name not in DTYPES:
        raise UsageError(f"{what} is {', '.join(DTYPES)}, not {np.dtype(dtype).name}")
    return np.dtype(dtype)


def _readonly(array: Array) -> Array:
    """A read-only view of ``array``: callers see the filter's state without changing it."""
    view = array.view()
    view.flags.writeable = False
    return view


def _low(values: Array) -> tuple[Array, int]:
    """``values`` as float16, clipped to its range, and how many were clipped."""
    if values.dtype == LOW:
        return values, 0
    clipped = int(np.count_nonzero(np.abs(values) > LOW_MAX))
    return np.clip(values, -LOW_MAX, LOW_MAX).astype(LOW), clipped


# -- worker: gradient filter ----------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Push:
    """What one push sends: ``values`` at ``indices`` (sparse), or, ``indices`` None, every
    element (dense, 0 where dropped).  ``values`` are float16 under G-LNP, else the gradient's
    dtype; ``indices`` ascend."""

    size: int  #: elements of the whole gradient
    pushed: int  #: elements the filters let through (values of a dense push count them all)
    indices: Array | None
    values: Array

    @property
    def nbytes(self) -> int:
        """Bytes of the push: its values and, sparse, its indices."""
        return self.values.nbytes + (0 if self.indices is None else self.indices.nbytes)

    def dense(self) -> Array:
        """The push as a whole gradient (0 where dropped), in the values' dtype (the values
        themselves when the push is dense)."""
        if self.indices is None:
            return self.values
        out = np.zeros(self.size, self.values.dtype)
        out[self.indices] = self.values
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientStatistics:
    """A :class:`GradientFilter`'s counters since it was made (elements and bytes)."""

    pushes: int
    considered: int  #: gradient elements given to the filter (after eq. 2: one per element)
    considered_bytes: int  #: bytes of those in the gradient's dtype (an unfiltered push)
    pushed: int
    pushed_bytes: int  #: bytes the pushes carried (values and indices)
    dropped: int  #: elements held back (selected by every selection policy that is on)
    smp_selected: int  #: elements G-SMP selected
    rp_selected: int  #: elements G-RP selected
    glnp_clipped: int  #: pushed elements G-LNP clipped to float16's range (rest held)
    sparse: int  #: pushes sent sparse


class GradientFilter:
    """One worker's hybrid gradient filter for one gradient of ``size`` elements of ``dtype``
    (module docstring).  ``rng`` is G-RP's only source of randomness, needed when it is on.

    Raises:
        UsageError: a dtype other than float16/32/64, ``size`` < 1, or G-RP on and no ``rng``.
    """

    def __init__(
        self,
        settings: FilterSettings,
        *,
        size: int,
        dtype: str,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.dtype = _float_dtype(dtype, "a gradient")
        if size < 1:
            raise UsageError(f"a gradient has 1 element or more, not {size}")
        if settings.grp_drop and rng is None:
            raise UsageError(
                "G-RP draws its drops from a numpy Generator: pass rng=np.random.default_rng(seed)"
            )
        self.settings = settings
        self.size = size
        self._rng = rng
        self._index = np.dtype(np.uint32 if size <= 2**32 else np.uint64)
        self._residual = np.zeros(size, self.dtype)
        self._pushes = self._pushed = self._pushed_bytes = self._sparse = 0
        self._smp = self._rp = self._clipped = 0

    @property
    def residual(self) -> Array:
        """What the filter holds for the next push (eq. 2's dropped gradient), read-only."""
        return _readonly(self._residual)

    def push(self, gradient: Array, iteration: int) -> Push:
        """Filter iteration ``iteration``'s new gradient, with what was held added (eq. 2),
        and hold what is not pushed.

        Raises:
            UsageError: ``gradient`` is not ``size`` elements of ``dtype``; ``iteration`` < 1;
                a filter is on and the gradient plus what is held is not finite (the residual
                would hold a NaN or an infinity for ever).  The filter is unchanged then.
        """
        if gradient.dtype != self.dtype or gradient.shape != (self.size,):
            raise UsageError(
                f"this filter takes {self.size} elements of {self.dtype}, not an array of "
                f"shape {gradient.shape} of {gradient.dtype}"
            )
        s = self.settings
        threshold = smp_threshold(s.gsmp_threshold, s.gsmp_decay, iteration)
        if not s.gradient_filters:
            return self._count(
                Push(size=self.size, pushed=self.size, indices=None, values=gradient.copy())
            )
        total = gradient + self._residual  # eq. 2
        if not np.isfinite(total).all():
            raise UsageError(
                "the gradient plus what the filter holds has a NaN or an infinity: the filter "
                "would hold it for every later push"
            )
        drop: Array | None = None
        if s.gsmp_threshold:
            drop = np.abs(total) < _not_below(self.dtype, threshold)  # eq. 1
            self._smp += int(np.count_nonzero(drop))
        if s.grp_drop:
            assert self._rng is not None  # checked when made
            chosen = np.zeros(self.size, bool)
            chosen[
                self._rng.choice(self.size, size=round(s.grp_drop * self.size), replace=False)
            ] = True
            self._rp += int(np.count_nonzero(chosen))
            drop = chosen if drop is None else drop & chosen
        # an exact zero (new gradient and what was held) carries nothing: never sent, whatever
        # the policies selected, and nothing is held for it
        zero = total == 0
        drop = zero if drop is None else drop | zero
        dense = np.where(drop, 0, total)
        if s.glnp:
            dense, clipped = _low(dense)
            self._clipped += clipped
        # exact but where eq. 2 rounds or a clipped value's remainder does (balance())
        np.subtract(total, dense, out=self._residual)
        pushed = self.size - int(np.count_nonzero(drop))
        value = dense.dtype.itemsize
        if pushed * (self._index.itemsize + value) < self.size * value:
            indices = np.flatnonzero(~drop).astype(self._index)
            self._sparse += 1
            return self._count(
                Push(size=self.size, pushed=pushed, indices=indices, values=dense[indices])
            )
        return self._count(Push(size=self.size, pushed=pushed, indices=None, values=dense))

    def _count(self, push: Push) -> Push:
        self._pushes += 1
        self._pushed += push.pushed
        self._pushed_bytes += push.nbytes
        return push

    def statistics(self) -> GradientStatistics:
        return GradientStatistics(
            pushes=self._pushes,
            considered=self._pushes * self.size,
            considered_bytes=self._pushes * self.size * self.dtype.itemsize,
            pushed=self._pushed,
            pushed_bytes=self._pushed_bytes,
            dropped=self._pushes * self.size - self._pushed,
            smp_selected=self._smp,
            rp_selected=self._rp,
            glnp_clipped=self._clipped,
            sparse=self._sparse,
        )


@dataclass(frozen=True, slots=True)
class Balance:
    """How far a gradient filter's pushes are from conserving gradient, elementwise (float64):
    ``gap = sum given - sum pushed - held``, and the ``bound`` float rounding explains."""

    gap: Array
    bound: Array

    @property
    def holds(self) -> bool:
        """Whether every element's gap is within its rounding bound."""
        return bool(np.all(np.abs(self.gap) <= self.bound))


def balance(rounds: Iterable[tuple[Array, Push, Array]]) -> Balance:
    """Check conservation over a filter's pushes: ``rounds`` holds, for each push since the
    filter was made and in order, the gradient given, the :class:`Push`, and a copy of
    :attr:`GradientFilter.residual` after it.

    The bound: per push, ``pushed + held`` equals eq. 2's sum exactly (a dropped element is
    held as it is, a pushed one holds 0, and the remainder of a value G-LNP rounds within
    float16's range is exact by Sterbenz's lemma: value and rounding are within a factor 2 of
    each other, or the rounding is 0), except that eq. 2's addition rounds, by at most ``u *
    |sum|``, and so may the remainder of a clipped value, by at most ``u * |held|``, ``u`` the
    unit roundoff of the gradient's dtype (2**-24 for float32).  Those telescope over the pushes
    into ``u * (|pushed| + 3 |held|)`` summed over the pushes (the 3 covers ``|sum| <= |pushed|
    + |held| + u |held|`` with room to spare).  The check's own float64 sum of ``m = 2 pushes +
    1`` terms adds ``gamma_m * sum of their magnitudes``, ``gamma_m = m u64 / (1 - m u64)``.
    """
    gap: Array | None = None
    rounding: Array | None = None
    magnitude: Array | None = None
    held: Array | None = None
    terms = 1
    for given, push, after in rounds:
        g = given.astype(np.float64)
        p = push.dense().astype(np.float64)
        held = after.astype(np.float64)
        u = float(np.finfo(after.dtype).eps) / 2
        step = g - p
        err = u * (np.abs(p) + 3 * np.abs(held))
        mag = np.abs(g) + np.abs(p)
        gap = step if gap is None else gap + step
        rounding = err if rounding is None else rounding + err
        magnitude = mag if magnitude is None else magnitude + mag
        terms += 2
    if gap is None or rounding is None or magnitude is None or held is None:
        raise UsageError("balance() needs one push or more")
    u64 = float(np.finfo(np.float64).eps) / 2
    gamma = terms * u64 / (1 - terms * u64)
    return Balance(gap=gap - held, bound=rounding + gamma * (magnitude + np.abs(held)))


# -- server: parameter filter ---------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Publish:
    """What a model update publishes: ``mask[c]``, chunk ``c`` is published (its version is
    bumped), and ``values``, the published chunks' values in ascending order (float16 under
    P-LNP, else the model's dtype), for the pulls."""

    mask: Array
    values: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterStatistics:
    """A :class:`ParameterFilter`'s counters since it was made (parameters and bytes)."""

    updates: int
    flushes: int
    considered: int  #: parameters of the updates (not of the flushes)
    published: int  #: parameters published, by updates and flushes
    dropped: int  #: parameters of updates not published (TDF: discarded; lossless: deferred)
    chunks_published: int
    published_bytes: int  #: bytes of the published values
    plnp_clipped: int  #: published values P-LNP clipped to float16's range


class ParameterFilter:
    """One server's hybrid parameter filter over one model (or shard), starting from
    ``initial`` (copied), with one version per ``chunk`` parameters (module docstring).

    Raises:
        UsageError: ``initial`` is not a non-empty 1-d float16/32/64 array, or ``chunk`` < 1.
    """

    def __init__(self, settings: FilterSettings, initial: Array, *, chunk: int = 1) -> None:
        _float_dtype(initial.dtype, "a model")
        if initial.ndim != 1 or initial.size == 0:
            raise UsageError(f"a model is a non-empty flat array, not of shape {initial.shape}")
        if chunk < 1:
            raise UsageError(f"a chunk has 1 parameter or more, not {chunk}")
        self.settings = settings
        self.chunk = chunk
        self._model = initial.copy()
        self._published = self._model.copy() if settings.lossless_publish else self._model
        self._starts = np.arange(0, initial.size, chunk)
        self._updates = self._flushes = self._considered = self._published_count = 0
        self._dropped = self._chunks = self._bytes = self._clipped = 0

    @property
    def model(self) -> Array:
        """The values the next update starts from (read-only): the exact ones in lossless
        mode, else the stored (published) ones, dropped changes gone."""
        return _readonly(self._model)

    @property
    def published(self) -> Array:
        """The published values, full precision (read-only): what pulls serve."""
        return _readonly(self._published)

    def update(self, new: Array, iteration: int) -> Publish:
        """Filter the update rule's ``new`` values of iteration ``iteration`` (eq. 3), take
        them into the model, and say what to publish.

        Raises:
            UsageError: ``new`` is not the model's shape and dtype, or ``iteration`` < 1.
        """
        if new.dtype != self._model.dtype or new.shape != self._model.shape:
            raise UsageError(
                f"this model is {self._model.size} parameters of {self._model.dtype}, not an "
                f"array of shape {new.shape} of {new.dtype}"
            )
        s = self.settings
        threshold = smp_threshold(s.psmp_threshold, s.psmp_decay, iteration)
        self._updates += 1
        self._considered += new.size
        if not s.psmp_threshold:
            publish = np.ones(new.size, bool)
        else:
            old = self._published
            with np.errstate(divide="ignore", invalid="ignore"):
                relative = np.abs((new - old) / old)
            # eq. 3: dropped below the threshold; an unchanged parameter has nothing to publish
            publish = ~(relative < _not_below(new.dtype, threshold)) & (new != old)
        mask, elements = self._chunked(publish)
        if s.lossless_publish:
            np.copyto(self._model, new)
            np.copyto(self._published, new, where=elements)
        else:
            np.copyto(self._model, new, where=elements)
        result = self._publish(mask, elements)
        self._dropped += new.size - result.values.size
        return result

    def flush(self) -> Publish:
        """Publish every chunk whose published values differ from the exact ones (lossless
        mode; in TDF mode they never differ and nothing is published)."""
        self._flushes += 1
        mask, elements = self._chunked(self._published != self._model)
        np.copyto(self._published, self._model, where=elements)
        return self._publish(mask, elements)

    def _chunked(self, publish: Array) -> tuple[Array, Array]:
        """The chunk mask of per-parameter ``publish`` (a chunk goes when any of its
        parameters does) and its per-parameter expansion."""
        if self.chunk == 1:
            return publish, publish
        mask = np.logical_or.reduceat(publish, self._starts)
        return mask, np.repeat(mask, self.chunk)[: publish.size]

    def _publish(self, mask: Array, elements: Array) -> Publish:
        values = self._published[elements]
        if self.settings.plnp:
            values, clipped = _low(values)
            self._clipped += clipped
        self._published_count += values.size
        self._chunks += int(np.count_nonzero(mask))
        self._bytes += values.nbytes
        return Publish(mask=mask, values=values)

    def state(self) -> dict[str, Any]:
        """What a replica needs to go on from here (:mod:`fabricd.engines.ps.snapshot`)."""
        return {
            "model": self._model,
            "published": self._published if self.settings.lossless_publish else None,
            "counts": [
                self._updates,
                self._flushes,
                self._considered,
                self._published_count,
                self._dropped,
                self._chunks,
                self._bytes,
                self._clipped,
            ],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take :meth:`state` of a filter of the same model and settings.

        Raises:
            RemoteProtocolError: ``state`` is not such a state; nothing changed.
        """
        model = snap.array(state, "model", self._model)
        published = (
            snap.array(state, "published", self._model) if self.settings.lossless_publish else model
        )
        counts = snap.field(state, "counts", list)
        if len(counts) != 8 or not all(type(c) is int and c >= 0 for c in counts):
            raise RemoteProtocolError("snapshot filter counters of another shape")
        self._model = model
        self._published = published.copy() if published is not model else model
        (
            self._updates,
            self._flushes,
            self._considered,
            self._published_count,
            self._dropped,
            self._chunks,
            self._bytes,
            self._clipped,
        ) = counts

    def statistics(self) -> ParameterStatistics:
        return ParameterStatistics(
            updates=self._updates,
            flushes=self._flushes,
            considered=self._considered,
            published=self._published_count,
            dropped=self._dropped,
            chunks_published=self._chunks,
            published_bytes=self._bytes,
            plnp_clipped=self._clipped,
        )
