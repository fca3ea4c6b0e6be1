"""The deadline heap every engine keeps its timers in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines import deadlines as deadlines_module
from fabricd.engines.deadlines import Deadlines


def test_the_earliest_deadline_comes_first_and_pops_in_order() -> None:
    deadlines: Deadlines[str] = Deadlines()
    deadlines.set("b", 2.0)
    deadlines.set("a", 1.0)
    deadlines.set("c", 3.0)
    assert deadlines.next() == 1.0
    assert deadlines.pop_due(2.0) == ["a", "b"]
    assert deadlines.next() == 3.0
    assert "c" in deadlines
    assert "a" not in deadlines
    assert len(deadlines) == 1


def test_zero_is_a_deadline_like_any_other() -> None:
    deadlines: Deadlines[int] = Deadlines()
    deadlines.set(7, 0.0)  # a virtual clock starts at 0.0: it must not read as "no deadline"
    assert deadlines.next() == 0.0
    assert deadlines.pop_due(0.0) == [7]
    assert deadlines.next() is None


def test_moving_or_cancelling_a_deadline_forgets_the_old_one() -> None:
    deadlines: Deadlines[str] = Deadlines()
    deadlines.set("x", 1.0)
    deadlines.set("x", 5.0)
    assert deadlines.next() == 5.0
    assert deadlines.get("x") == 5.0
    deadlines.cancel("x")
    deadlines.cancel("never set")
    assert deadlines.next() is None
    assert deadlines.pop_due(10.0) == []


def test_stale_entries_do_not_pile_up() -> None:
    deadlines: Deadlines[int] = Deadlines()
    for i in range(10_000):
        deadlines.set(i % 10, float(i))  # ten keys, moved a thousand times each
    assert len(deadlines) == 10
    assert len(deadlines._heap) <= 2 * 10 + 64 + 1
    assert deadlines.next() == 9990.0


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "cancel", "pop"]),
            st.integers(0, 5),
            st.floats(0, 100, allow_nan=False),
        ),
        max_size=60,
    )
)
def test_behaves_like_a_dict_of_deadlines(steps: list[tuple[str, int, float]]) -> None:
    deadlines: Deadlines[int] = Deadlines()
    model: dict[int, float] = {}
    for what, key, at in steps:
        if what == "set":
            deadlines.set(key, at)
            model[key] = at
        elif what == "cancel":
            deadlines.cancel(key)
            model.pop(key, None)
        else:
            due = deadlines.pop_due(at)
            expected = sorted((t, k) for k, t in model.items() if t <= at)
            assert [model[k] for k in due] == [t for t, _ in expected]
            assert set(due) == {k for _, k in expected}
            for k in due:
                del model[k]
        assert deadlines.next() == min(model.values(), default=None)
        assert len(deadlines) == len(model)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "cancel", "pop"]),
            st.integers(0, 5),
            st.integers(0, 20).map(float),
        ),
        max_size=200,
    )
)
def test_compacting_after_every_removal_keeps_order_and_loses_nothing(
    steps: list[tuple[str, int, float]],
) -> None:
    # the model test above never passes the slack of 64, so it never compacts: with slack 0
    # the heap and table are rebuilt as soon as removals or stale entries outnumber twice the
    # live keys (hundreds of times per run), and equal times make stale entries look current
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadlines_module, "_SLACK", 0)
        deadlines: Deadlines[int] = Deadlines()
        model: dict[int, float] = {}
        for what, key, at in steps:
            if what == "set":
                deadlines.set(key, at)
                model[key] = at
            elif what == "cancel":
                deadlines.cancel(key)
                model.pop(key, None)
            else:
                due = deadlines.pop_due(at)
                expected = sorted((t, k) for k, t in model.items() if t <= at)
                assert [model[k] for k in due] == [t for t, _ in expected]
                assert sorted(due) == sorted(k for _, k in expected)
                for k in due:
                    del model[k]
            assert deadlines.next() == min(model.values(), default=None)
            assert len(deadlines) == len(model)
