"""TDF's gradient and parameter filters (fabricd/engines/ps/filters.py) against direct numpy
computations of eq. 1-3: G-SMP, G-RP (dropped only when both select), G-LNP, eq. 2's
accumulation with nothing lost, P-SMP, P-LNP, and the lossless publish mode."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import filters as pf
from fabricd.errors import UsageError

FLOATS = ("float16", "float32", "float64")


def gradient(rng: np.random.Generator, n: int, dtype: str, scale: float) -> np.ndarray:
    """Random gradient values with the cases that matter mixed in: zeros, values right at
    ``scale`` (a threshold), and values past float16's range."""
    values = rng.normal(0, scale, n)
    special = rng.integers(0, 8, n)
    values[special == 0] = 0
    values[special == 1] = scale * rng.choice([-1, 1], int(np.count_nonzero(special == 1)))
    if dtype != "float16":
        values[special == 2] = rng.choice([-1, 1], int(np.count_nonzero(special == 2))) * 7e4
    return values.astype(dtype)


def reference_push(
    total: np.ndarray, s: pf.FilterSettings, t: int, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 1, G-RP, the both-select rule, exact zeros left out, and G-LNP written out:
    (dropped mask, what is pushed as a dense array, what stays held)."""
    n = total.size
    selections = []
    if s.gsmp_threshold:
        threshold = s.gsmp_threshold / (1 + s.gsmp_decay * math.log(t))
        selections.append(np.abs(total).astype(np.float64) < threshold)
    if s.grp_drop:
        assert rng is not None
        chosen = np.zeros(n, bool)
        chosen[rng.choice(n, size=round(s.grp_drop * n), replace=False)] = True
        selections.append(chosen)
    dropped = np.logical_and.reduce(selections) if selections else np.zeros(n, bool)
    if s.gradient_filters:
        dropped |= total == 0  # an exact zero carries nothing: never pushed once a filter is on
    pushed = np.where(dropped, np.zeros_like(total), total)
    if s.glnp and total.dtype != np.float16:
        pushed = np.clip(pushed, -65504, 65504).astype(np.float16)
    return dropped, pushed, total - pushed.astype(total.dtype)


gradient_settings = st.builds(
    pf.FilterSettings,
    gsmp_threshold=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    gsmp_decay=st.sampled_from([0.0, 0.5, 3.0]),
    grp_drop=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    glnp=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(
    s=gradient_settings,
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(1, 12),
)
def test_gradient_filter_follows_eq_1_and_2_grp_and_glnp_push_by_push(s, dtype, n, seed, rounds):
    data = np.random.default_rng(seed)
    draws, mirror = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    f = pf.GradientFilter(s, size=n, dtype=dtype, rng=draws)
    held = np.zeros(n, dtype)
    smp = rp = 0
    for t in range(1, rounds + 1):
        new = gradient(data, n, dtype, 1.0)
        total = new + held  # eq. 2
        dropped, pushed, held = reference_push(total, s, t, mirror)
        push = f.push(new, t)
        assert push.size == n
        assert push.pushed == n - np.count_nonzero(dropped)
        assert push.values.dtype == pushed.dtype
        assert np.array_equal(push.dense(), pushed)
        assert np.array_equal(f.residual, held)
        if s.gsmp_threshold:
            threshold = s.gsmp_threshold / (1 + s.gsmp_decay * math.log(t))
            smp += int(np.count_nonzero(np.abs(total).astype(np.float64) < threshold))
        if s.grp_drop:
            rp += round(s.grp_drop * n)
        # the smaller encoding, ties dense
        per_value = push.values.dtype.itemsize
        assert (push.indices is not None) == (push.pushed * (4 + per_value) < n * per_value)
        if push.indices is not None:
            assert push.indices.dtype == np.uint32
            assert np.array_equal(push.indices, np.flatnonzero(~dropped))
    stats = f.statistics()
    assert stats.pushes == rounds
    assert stats.considered == rounds * n
    assert stats.considered_bytes == rounds * n * np.dtype(dtype).itemsize
    assert stats.pushed + stats.dropped == stats.considered
    assert (stats.smp_selected, stats.rp_selected) == (smp, rp)


def test_exact_zeros_are_never_pushed_whatever_grp_selects() -> None:
    """G-RP alone leaves 1 - p of the elements unselected; the zeros among them carry
    nothing, so they are not sent (sparse), and nothing is held for them."""
    rng = np.random.default_rng(5)
    f = pf.GradientFilter(pf.FilterSettings(grp_drop=0.5), size=1000, dtype="float32", rng=rng)
    gradient = np.zeros(1000, np.float32)
    gradient[:10] = 1.0
    push = f.push(gradient, 1)
    assert push.indices is not None  # sparse: at most the 10 nonzero elements go
    assert push.pushed <= 10
    assert np.all(push.values != 0)
    np.testing.assert_array_equal(push.dense() + f.residual, gradient)


def test_a_gradient_is_dropped_only_when_both_gsmp_and_grp_select_it():
    n = 64
    values = np.where(np.arange(n) % 2 == 0, 0.01, 5.0).astype(np.float32)  # even: small
    s = pf.FilterSettings(gsmp_threshold=1.0, grp_drop=0.5)
    f = pf.GradientFilter(s, size=n, dtype="float32", rng=np.random.default_rng(7))
    chosen = np.zeros(n, bool)
    chosen[np.random.default_rng(7).choice(n, size=32, replace=False)] = True
    small = np.arange(n) % 2 == 0
    push = f.push(values, 1)
    held = f.residual != 0
    assert np.array_equal(held, small & chosen)
    # each policy alone selected elements that were pushed all the same
    assert np.any(small & ~chosen)
    assert np.all(push.dense()[small & ~chosen] == values[small & ~chosen])
    assert np.any(~small & chosen)
    assert np.all(push.dense()[~small & chosen] == 5.0)


def test_one_selection_policy_alone_decides():
    values = np.array([0.1, -0.1, 2.0, -3.0, 0.0], np.float32)
    alone = pf.GradientFilter(pf.FilterSettings(gsmp_threshold=1.0), size=5, dtype="float32")
    assert np.array_equal(alone.push(values, 1).dense(), [0, 0, 2.0, -3.0, 0])
    rng = np.random.default_rng(3)
    chosen = np.random.default_rng(3).choice(5, size=round(0.6 * 5), replace=False)
    random_only = pf.GradientFilter(
        pf.FilterSettings(grp_drop=0.6), size=5, dtype="float32", rng=rng
    )
    random_only.push(values, 1)
    assert np.array_equal(
        np.flatnonzero(random_only.residual != 0), np.sort(chosen[values[chosen] != 0])
    )


def test_gsmp_threshold_decays_with_the_iteration_as_eq_1_says():
    assert pf.smp_threshold(0.5, 2.0, 1) == 0.5
    for t in (2, 10, 1000):
        assert pf.smp_threshold(0.5, 2.0, t) == 0.5 / (1 + 2.0 * math.log(t))
    # a value between threshold(2) and threshold(1) is dropped at t=1 and pushed at t=2
    s = pf.FilterSettings(gsmp_threshold=0.5, gsmp_decay=2.0)
    value = np.array([0.4], np.float32)
    assert pf.GradientFilter(s, size=1, dtype="float32").push(value, 1).pushed == 0
    assert pf.GradientFilter(s, size=1, dtype="float32").push(value, 2).pushed == 1


def test_smp_compares_exactly_with_the_float64_threshold():
    # 0.7 is no float32: float32(0.7) is just below it (dropped), the next one above (kept);
    # comparing with float32(0.7), as numpy does with a Python float, would keep both
    at = np.float32(0.7)
    above = np.nextafter(at, np.float32(1))
    assert float(at) < 0.7 < float(above)
    f = pf.GradientFilter(pf.FilterSettings(gsmp_threshold=0.7), size=2, dtype="float32")
    assert np.array_equal(f.push(np.array([at, above]), 1).dense(), [0, above])
    # eq. 3 alike: relative changes of exactly float32(0.7) and the next float32 (1 - r is
    # exact by Sterbenz's lemma, so is (new - 1) / 1)
    p = pf.ParameterFilter(pf.FilterSettings(psmp_threshold=0.7), np.ones(2, np.float32))
    assert np.array_equal(p.update(1 - np.array([at, above]), 1).mask, [False, True])


def test_held_gradient_is_added_to_the_next_push_eq_2():
    f = pf.GradientFilter(pf.FilterSettings(gsmp_threshold=1.0), size=3, dtype="float64")
    assert f.push(np.array([0.6, 0.2, 3.0]), 1).pushed == 1
    assert np.array_equal(f.residual, [0.6, 0.2, 0])
    push = f.push(np.array([0.6, 0.2, 0.0]), 2)  # 1.2 crosses the threshold, 0.4 does not
    assert np.array_equal(push.dense(), [1.2, 0, 0])
    assert np.array_equal(f.residual, [0, 0.4, 0])


def test_glnp_pushes_float16_and_holds_what_it_rounded_or_clipped():
    values = np.array([1 / 3, 1e5, -7e4, 1e-9, 2.0], np.float32)
    f = pf.GradientFilter(pf.FilterSettings(glnp=True), size=5, dtype="float32")
    push = f.push(values, 1)
    assert push.values.dtype == np.float16
    assert push.indices is None
    assert np.array_equal(push.values, np.clip(values, -65504, 65504).astype(np.float16))
    assert np.array_equal(f.residual, values - push.values.astype(np.float32))
    assert f.residual[1] == np.float32(1e5) - 65504
    assert f.residual[3] == np.float32(1e-9)
    assert f.residual[4] == 0
    assert f.statistics().glnp_clipped == 2
    assert f.statistics().pushed_bytes == 10


@settings(max_examples=60, deadline=None)
@given(
    s=gradient_settings,
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 100),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-3, 1.0, 3e4]),
)
def test_no_gradient_is_lost_over_many_pushes(s, dtype, n, seed, scale):
    scale = min(scale, 1.0) if dtype == "float16" else scale  # no overflow of eq. 2's sum
    data = np.random.default_rng(seed)
    f = pf.GradientFilter(s, size=n, dtype=dtype, rng=np.random.default_rng(seed))
    rounds = []
    for t in range(1, 51):
        new = gradient(data, n, dtype, scale)
        rounds.append((new, f.push(new, t), f.residual.copy()))
    b = pf.balance(rounds)
    assert b.holds, np.max(np.abs(b.gap) - b.bound)
    # and the bound is rounding, not slack: with G the sum of |given|, held <= G and pushed
    # <= G + held per push, so it is at most (51 + 150) u G plus the check's own 101 float64
    # additions of terms up to 52 G in all
    given_total = sum(np.abs(g.astype(np.float64)) for g, _, _ in rounds)
    u, u64 = np.finfo(dtype).eps / 2, np.finfo(np.float64).eps / 2
    assert np.all(b.bound <= (210 * u + 6000 * u64) * given_total)


def test_conservation_is_exact_when_no_arithmetic_rounds():
    # multiples of 2**-10 below 2**12: every float32 sum is exact, and so (Sterbenz) is every
    # float16 remainder, so pushed + held == given to the last bit
    data = np.random.default_rng(5)
    s = pf.FilterSettings(gsmp_threshold=0.5, gsmp_decay=1.0, grp_drop=0.5, glnp=True)
    f = pf.GradientFilter(s, size=300, dtype="float32", rng=np.random.default_rng(6))
    given_sum = np.zeros(300)
    pushed_sum = np.zeros(300)
    for t in range(1, 101):
        new = (data.integers(-2048, 2049, 300) / 1024).astype(np.float32)
        given_sum += new
        pushed_sum += f.push(new, t).dense()
    assert np.array_equal(pushed_sum + f.residual, given_sum)
    assert np.any(f.residual != 0)


def test_off_by_default_filters_are_the_identity():
    s = pf.FilterSettings()
    assert not s.gradient_filters
    data = np.random.default_rng(0)
    for dtype in FLOATS:
        f = pf.GradientFilter(s, size=50, dtype=dtype)
        for t in range(1, 4):
            new = gradient(data, 50, dtype, 1.0)
            push = f.push(new, t)
            assert push.indices is None
            assert push.values.dtype == new.dtype
            assert push.values.tobytes() == new.tobytes()
            assert push.values is not new  # the caller may reuse its array
            assert not f.residual.any()
        initial = gradient(data, 50, dtype, 1.0)
        p = pf.ParameterFilter(s, initial)
        new = gradient(data, 50, dtype, 1.0)
        publish = p.update(new, 1)
        assert publish.mask.all()
        assert publish.values.tobytes() == new.tobytes()
        assert p.model.tobytes() == p.published.tobytes() == new.tobytes()


def test_views_are_read_only():
    f = pf.GradientFilter(pf.FilterSettings(gsmp_threshold=1.0), size=3, dtype="float32")
    p = pf.ParameterFilter(pf.FilterSettings(), np.zeros(3, np.float32))
    for view in (f.residual, p.model, p.published):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1


# -- server -------------------------------------------------------------------------------
def reference_eq3(old: np.ndarray, new: np.ndarray, threshold: float) -> np.ndarray:
    """Which parameters eq. 3 does not drop (unchanged ones have nothing to publish)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.abs((new - old) / old)
    return np.asarray(~(relative.astype(np.float64) < threshold) & (new != old))


def parameters(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Random parameters, a sixth of them 0 (eq. 3 divides by them)."""
    values = rng.normal(0, 1, n)
    values[rng.integers(0, 6, n) == 0] = 0
    return values.astype(dtype)


def step(rng: np.random.Generator, model: np.ndarray, scale: float) -> np.ndarray:
    """An update rule's new values: small relative changes, some none, some from zero."""
    change = rng.normal(0, scale, model.size) * np.abs(model)
    change[rng.integers(0, 5, model.size) == 0] = 0
    change[(model == 0) & (rng.integers(0, 2, model.size) == 0)] = 1e-3
    return np.asarray(model + change.astype(model.dtype), model.dtype)


parameter_settings = st.builds(
    pf.FilterSettings,
    psmp_threshold=st.sampled_from([0.0, 1e-3, 1e-2, 0.1]),
    psmp_decay=st.sampled_from([0.0, 0.5, 3.0]),
    plnp=st.booleans(),
    lossless_publish=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(
    s=parameter_settings,
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 120),
    chunk=st.sampled_from([1, 1, 3, 8]),
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(1, 15),
)
def test_parameter_filter_follows_eq_3_in_both_modes(s, dtype, n, chunk, seed, rounds):
    data = np.random.default_rng(seed)
    initial = parameters(data, n, dtype)
    p = pf.ParameterFilter(s, initial, chunk=chunk)
    model, published = initial.copy(), initial.copy()
    chunks = -(-n // chunk)
    total_published = 0
    for t in range(1, rounds + 1):
        new = step(data, model, 0.02)
        threshold = s.psmp_threshold / (1 + s.psmp_decay * math.log(t))
        elements = (
            reference_eq3(published, new, threshold) if s.psmp_threshold else np.ones(n, bool)
        )
        mask = np.array([elements[c * chunk : (c + 1) * chunk].any() for c in range(chunks)])
        elements = np.repeat(mask, chunk)[:n]
        publish = p.update(new, t)
        assert np.array_equal(publish.mask, mask)
        if s.lossless_publish:  # every change kept; published only when significant
            model = new
            published = np.where(elements, new, published)
        else:  # TDF: a dropped change is gone, the model is what is published
            model = published = np.where(elements, new, published)
        expected = published[elements]
        if s.plnp:
            expected = np.clip(expected, -65504, 65504).astype(np.float16)
        assert publish.values.dtype == expected.dtype
        assert np.array_equal(publish.values, expected)
        assert np.array_equal(p.model, model)
        assert np.array_equal(p.published, published)
        total_published += expected.size
    stats = p.statistics()
    assert stats.updates == rounds
    assert stats.considered == rounds * n
    assert stats.published == total_published
    assert stats.dropped == rounds * n - total_published


@settings(max_examples=80, deadline=None)
@given(
    threshold=st.sampled_from([1e-3, 1e-2, 0.1]),
    decay=st.sampled_from([0.0, 1.0]),
    dtype=st.sampled_from(("float32", "float64")),
    chunk=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_lossless_publish_stays_within_the_threshold_and_a_flush_makes_it_exact(
    threshold, decay, dtype, chunk, seed
):
    data = np.random.default_rng(seed)
    s = pf.FilterSettings(psmp_threshold=threshold, psmp_decay=decay, lossless_publish=True)
    exact = parameters(data, 64, dtype)
    p = pf.ParameterFilter(s, exact, chunk=chunk)
    lr = np.asarray(1e-3, dtype)
    u = np.finfo(dtype).eps / 2
    for t in range(1, 201):
        exact = exact - lr * data.normal(0, 1, 64).astype(dtype)  # plain SGD, nothing dropped
        p.update(exact, t)
        assert np.array_equal(p.model, exact)
        published = p.published.astype(np.float64)
        # eq. 3's bound, the relative change computed with at most two roundings
        limit = pf.smp_threshold(threshold, decay, t) * np.abs(published) * (1 + u) ** 2
        assert np.all(np.abs(exact.astype(np.float64) - published) <= limit)
    before = p.published.copy()
    publish = p.flush()
    assert np.array_equal(p.published, exact)
    changed = before != exact
    assert np.array_equal(np.repeat(publish.mask, chunk)[:64] & changed, changed)
    assert publish.values.size == np.count_nonzero(np.repeat(publish.mask, chunk)[:64])
    assert not p.flush().mask.any()


def test_tdf_mode_discards_small_changes_for_good_and_lossless_does_not():
    nudge = np.array([0.006, 0], np.float32)  # 0.6% a step, under P-SMP's 1%
    tdf = pf.ParameterFilter(pf.FilterSettings(psmp_threshold=0.01), np.ones(2, np.float32))
    lossless = pf.ParameterFilter(
        pf.FilterSettings(psmp_threshold=0.01, lossless_publish=True), np.ones(2, np.float32)
    )
    published = []
    for t in range(1, 11):
        assert not tdf.update(tdf.model + nudge, t).mask.any()
        published.append(bool(lossless.update(lossless.model + nudge, t).mask[0]))
    assert np.array_equal(tdf.model, [1, 1])
    assert tdf.statistics().dropped == 20
    assert lossless.model[0] == pytest.approx(1.06, rel=1e-6)
    assert published == [False, True] * 5  # every second step crosses 1% since the last
    assert lossless.published[0] == lossless.model[0]


def test_psmp_relative_change_from_zero_is_published_and_no_change_is_not():
    s = pf.FilterSettings(psmp_threshold=0.5)
    p = pf.ParameterFilter(s, np.array([0.0, 0.0, 2.0, 2.0], np.float32))
    publish = p.update(np.array([1e-30, 0.0, 2.0, 2.9], np.float32), 1)
    assert np.array_equal(publish.mask, [True, False, False, False])
    publish = p.update(np.array([1e-30, 0.0, 2.0, 3.1], np.float32), 2)
    assert np.array_equal(publish.mask, [False, False, False, True])


def test_plnp_publishes_float16_clipped_and_counts_the_clipped():
    s = pf.FilterSettings(plnp=True)
    p = pf.ParameterFilter(s, np.zeros(3, np.float64))
    publish = p.update(np.array([1 / 3, 1e6, -1e6]), 1)
    assert publish.values.dtype == np.float16
    assert np.array_equal(publish.values, np.array([1 / 3, 65504, -65504], np.float16))
    assert p.published[1] == 1e6  # the server keeps its precision
    assert p.statistics().plnp_clipped == 2
    assert p.statistics().published_bytes == 6


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gsmp_threshold", -1.0),
        ("gsmp_threshold", math.nan),
        ("gsmp_decay", math.inf),
        ("psmp_threshold", -1e-9),
        ("psmp_decay", -0.5),
        ("psmp_threshold", "0.1"),
        ("gsmp_threshold", True),
        ("grp_drop", 1.0),
        ("grp_drop", -0.1),
        ("grp_drop", math.nan),
        ("glnp", 1),
        ("plnp", "yes"),
        ("lossless_publish", None),
    ],
)
def test_bad_settings_are_refused(field, value):
    with pytest.raises(UsageError, match=field):
        pf.FilterSettings(**{field: value})


def test_bad_calls_are_refused():
    on = pf.FilterSettings(gsmp_threshold=1.0)
    with pytest.raises(UsageError, match="Generator"):
        pf.GradientFilter(pf.FilterSettings(grp_drop=0.5), size=3, dtype="float32")
    with pytest.raises(UsageError, match="int32"):
        pf.GradientFilter(on, size=3, dtype="int32")
    with pytest.raises(UsageError, match="1 element"):
        pf.GradientFilter(on, size=0, dtype="float32")
    f = pf.GradientFilter(on, size=3, dtype="float32")
    with pytest.raises(UsageError, match="3 elements of float32"):
        f.push(np.zeros(3, np.float64), 1)
    with pytest.raises(UsageError, match="3 elements of float32"):
        f.push(np.zeros(4, np.float32), 1)
    bad: tuple[Any, ...] = (0, -1, 1.0, True)
    for t in bad:
        with pytest.raises(UsageError, match="iteration"):
            f.push(np.zeros(3, np.float32), t)
    f.push(np.array([0.5, 0, 0], np.float32), 1)
    with pytest.raises(UsageError, match="NaN or an infinity"):
        f.push(np.array([0, np.nan, 0], np.float32), 2)
    with pytest.raises(UsageError, match="NaN or an infinity"):
        f.push(np.array([np.inf, 0, 0], np.float32), 2)
    assert np.array_equal(f.residual, [0.5, 0, 0])  # a refused push changes nothing
    with pytest.raises(UsageError, match="one push"):
        pf.balance([])
    with pytest.raises(UsageError, match="model is"):
        pf.ParameterFilter(on, np.zeros(3, np.int64))
    with pytest.raises(UsageError, match="flat"):
        pf.ParameterFilter(on, np.zeros((2, 2), np.float32))
    with pytest.raises(UsageError, match="chunk"):
        pf.ParameterFilter(on, np.zeros(3, np.float32), chunk=0)
    p = pf.ParameterFilter(on, np.zeros(3, np.float32))
    with pytest.raises(UsageError, match="3 parameters of float32"):
        p.update(np.zeros(3, np.float64), 1)
    with pytest.raises(UsageError, match="iteration"):
        p.update(np.zeros(3, np.float32), 0)
