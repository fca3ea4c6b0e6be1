"""Keyed FIFO queues with removal from anywhere, checked against a list per key."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines.queues import KeyedQueues, Slot


def test_each_key_is_first_in_first_out() -> None:
    queues: KeyedQueues[str, int] = KeyedQueues()
    for item in (1, 2, 3):
        queues.push("a", item)
    queues.push("b", 10)
    assert queues.first("a") == 1
    assert queues.first("a") == 1  # first() does not take the item
    assert queues.first("b") == 10
    assert queues.first("c") is None
    assert len(queues) == 4


def test_removal_from_the_middle_keeps_the_order_of_the_rest() -> None:
    queues: KeyedQueues[str, int] = KeyedQueues()
    slots = [queues.push("a", item) for item in range(5)]
    queues.remove(slots[0])
    queues.remove(slots[2])
    queues.remove(slots[2])  # twice is once
    assert len(queues) == 3
    assert queues.first("a") == 1
    queues.remove(slots[1])
    assert queues.first("a") == 3


def test_a_queue_whose_items_all_left_is_gone() -> None:
    queues: KeyedQueues[str, int] = KeyedQueues()
    slots = [queues.push("a", item) for item in range(3)]
    for slot in slots:
        queues.remove(slot)
    assert queues.first("a") is None
    assert len(queues) == 0
    assert queues._queues == {}  # no memory kept for an empty key


def test_removed_slots_do_not_pile_up_behind_a_long_lived_head() -> None:
    queues: KeyedQueues[str, int] = KeyedQueues()
    queues.push("a", -1)  # never leaves: the lazy head-drop alone would never free the rest
    for item in range(1000):
        queues.remove(queues.push("a", item))
    assert len(queues._queues["a"].slots) <= 2 * 1 + 8
    assert queues.first("a") == -1


ops = st.lists(
    st.tuples(st.sampled_from(["push", "remove", "first"]), st.integers(0, 2), st.integers(0, 50)),
    max_size=200,
)


@given(ops=ops)
def test_behaves_like_a_list_per_key(ops: list[tuple[str, int, int]]) -> None:
    queues: KeyedQueues[int, int] = KeyedQueues()
    model: dict[int, list[int]] = {}
    slots: list[Slot[int, int]] = []
    for n, (what, key, pick) in enumerate(ops):
        if what == "push":
            slots.append(queues.push(key, n))
            model.setdefault(key, []).append(n)
        elif what == "remove" and slots:
            slot = slots[pick % len(slots)]
            if slot.item is not None:
                model[slot.key].remove(slot.item)
            queues.remove(slot)
        expected = model.get(key) or [None]
        assert queues.first(key) == expected[0]
        assert len(queues) == sum(map(len, model.values()))
