"""The landing table: where DATA chunks land, the in-order rule, and the bytes it drops."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.engines.landing import CANCELLED_KEPT, Landing
from fabricd.errors import LocalProtocolError, RemoteProtocolError

NODE, MSG, OP = 3, 7, 42


def land(landing: Landing, node: int, msg: int, off: int, chunk: bytes) -> bool:
    """Do what the daemon does with one DATA chunk; return whether the message is complete."""
    buffer = landing.payload_buffer(node, msg, off, len(chunk))
    if buffer is not None:  # None: read and dropped
        buffer[:] = chunk
    return landing.arrived(node, msg, len(chunk))


def test_chunks_land_in_the_region_until_the_message_is_complete() -> None:
    landing = Landing()
    region = bytearray(10)
    landing.expect(NODE, MSG, OP, memoryview(region))
    assert landing.expects(NODE, MSG)
    assert len(landing) == 1
    assert not land(landing, NODE, MSG, 0, b"0123")
    assert not land(landing, NODE, MSG, 4, b"")  # an empty chunk moves nothing
    assert land(landing, NODE, MSG, 4, b"456789")
    assert region == b"0123456789"
    assert landing.bytes == 10
    assert landing.forget(NODE, MSG) == OP
    assert not landing.expects(NODE, MSG)
    assert len(landing) == 0


def test_the_view_is_the_region_itself_so_the_kernel_writes_there() -> None:
    landing = Landing()
    region = bytearray(8)
    landing.expect(NODE, MSG, OP, memoryview(region))
    view = landing.payload_buffer(NODE, MSG, 0, 8)
    assert view.obj is region  # no copy in user space


@pytest.mark.parametrize(
    ("off", "length", "why"),
    [
        (4, 2, "skips ahead"),
        (0, 2, "repeats the first chunk"),
        (1, 2, "overlaps the first chunk"),
        (2, 9, "runs past the end"),
    ],
)
def test_a_chunk_out_of_place_is_a_remote_protocol_error(off: int, length: int, why: str) -> None:
    landing = Landing()
    region = bytearray(10)
    landing.expect(NODE, MSG, OP, memoryview(region))
    land(landing, NODE, MSG, 0, b"ab")
    with pytest.raises(RemoteProtocolError, match=r"does not continue at 2 of 10 B"):
        landing.payload_buffer(NODE, MSG, off, length)
    assert landing.payload_buffer(NODE, MSG, 2, 8).nbytes == 8  # the table is unchanged


def test_a_chunk_past_the_end_of_an_untouched_message_is_refused() -> None:
    landing = Landing()
    landing.expect(NODE, MSG, OP, memoryview(bytearray(4)))
    with pytest.raises(RemoteProtocolError, match=r"\[0, 5\) of message 7"):
        landing.payload_buffer(NODE, MSG, 0, 5)


def test_data_nobody_asked_for_is_a_protocol_error_and_allocates_nothing() -> None:
    landing = Landing()
    tracemalloc.start()
    try:
        for node in range(100):
            with pytest.raises(RemoteProtocolError, match="never asked node"):
                landing.payload_buffer(node, MSG, 0, 64 << 20)  # a 64 MiB chunk, unasked
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing of the declared size was allocated
    assert not landing.arrived(NODE, MSG, 16)
    assert landing.bytes == 0  # nobody waits for them: not counted


def test_a_complete_message_takes_no_more_data() -> None:
    landing = Landing()
    landing.expect(NODE, MSG, OP, memoryview(bytearray(4)))
    assert land(landing, NODE, MSG, 0, b"abcd")
    assert landing.forget(NODE, MSG) == OP
    with pytest.raises(RemoteProtocolError, match="or which is complete"):
        landing.payload_buffer(NODE, MSG, 4, 1)


def test_a_discarded_message_is_counted_but_written_nowhere() -> None:
    landing = Landing()
    region = bytearray(b"\xee" * 6)
    landing.expect(NODE, MSG, OP, memoryview(region))
    assert not land(landing, NODE, MSG, 0, b"abc")
    landing.discard(NODE, MSG)
    assert landing.expects(NODE, MSG)
    with pytest.raises(RemoteProtocolError):  # still in order
        landing.payload_buffer(NODE, MSG, 0, 3)
    assert land(landing, NODE, MSG, 3, b"def")
    assert region == b"abc\xee\xee\xee"
    assert landing.bytes == 6
    assert landing.forget(NODE, MSG) is None  # nobody to give the message to


def test_cancel_ends_a_message_and_its_late_chunks_are_dropped_unallocated() -> None:
    landing = Landing()
    landing.expect(NODE, MSG, OP, memoryview(bytearray(4)))
    assert landing.cancel(NODE, MSG) == OP
    assert landing.forget(NODE, MSG) is None
    assert landing.payload_buffer(NODE, MSG, 2, 2) is None  # late chunks: read and dropped
    assert not landing.arrived(NODE, MSG, 2)
    assert len(landing) == 0  # nothing waits for them: a drain does not


def test_only_the_last_cancelled_messages_of_a_node_are_remembered() -> None:
    landing = Landing()
    for msg in range(CANCELLED_KEPT + 10):
        landing.expect(NODE, msg, msg, memoryview(bytearray(8)))
        assert landing.cancel(NODE, msg) == msg
    assert landing.payload_buffer(NODE, CANCELLED_KEPT + 9, 0, 8) is None
    assert landing.payload_buffer(NODE, 10, 0, 8) is None
    with pytest.raises(RemoteProtocolError):
        landing.payload_buffer(NODE, 9, 0, 8)  # forgotten: the table stays bounded
    landing.forget_node(NODE)  # a reset forgets them all
    with pytest.raises(RemoteProtocolError):
        landing.payload_buffer(NODE, 10, 0, 8)


def test_cancels_of_messages_never_expected_do_not_push_out_one_whose_data_still_comes() -> None:
    # a message whose stream failed mid-way (its CANCEL overtook its DATA on the other link),
    # then a client leaving with thousands of sends the receiver had refused or never matched:
    # their CANCELs have no DATA under way, and pushing the first one out made its late DATA
    # "never asked for", which reset a healthy peer
    landing = Landing()
    landing.expect(NODE, MSG, OP, memoryview(bytearray(8)))
    assert land(landing, NODE, MSG, 0, b"abcd") is False
    assert landing.cancel(NODE, MSG) == OP
    for msg in range(MSG + 1, MSG + 1 + 10 * CANCELLED_KEPT):
        assert landing.cancel(NODE, msg) is None
    assert landing.payload_buffer(NODE, MSG, 4, 4) is None  # still read and dropped
    with pytest.raises(RemoteProtocolError):  # no CTS, so no DATA: still refused
        landing.payload_buffer(NODE, MSG + 1, 0, 4)


def test_forget_node_returns_the_receives_that_still_wanted_its_messages() -> None:
    landing = Landing()
    for msg, op in ((1, 10), (2, 20), (3, 30)):
        landing.expect(NODE, msg, op, memoryview(bytearray(4)))
    landing.expect(NODE + 1, 1, 40, memoryview(bytearray(4)))
    landing.discard(NODE, 2)
    assert landing.forget_node(NODE) == [10, 30]
    assert len(landing) == 1
    assert landing.expects(NODE + 1, 1)
    assert landing.forget_node(NODE) == []


def test_a_typed_region_is_filled_byte_by_byte() -> None:
    landing = Landing()
    values = np.zeros(3, dtype=np.float32)
    landing.expect(NODE, MSG, OP, memoryview(values))
    source = np.array([1.5, -2.0, 3.25], dtype=np.float32).tobytes()
    assert not land(landing, NODE, MSG, 0, source[:5])
    assert land(landing, NODE, MSG, 5, source[5:])
    assert values.tolist() == [1.5, -2.0, 3.25]


@pytest.mark.parametrize(
    ("region", "match"),
    [(memoryview(b"read-only"), "writable"), (memoryview(bytearray()), "writable")],
)
def test_a_region_that_cannot_take_bytes_is_refused(region: memoryview, match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        Landing().expect(NODE, MSG, OP, region)


def test_a_message_is_expected_once() -> None:
    landing = Landing()
    landing.expect(NODE, MSG, OP, memoryview(bytearray(4)))
    with pytest.raises(LocalProtocolError, match="already expected"):
        landing.expect(NODE, MSG, OP + 1, memoryview(bytearray(4)))


@given(
    payload=st.binary(min_size=1, max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=12),
    discard_at=st.none() | st.integers(0, 12),
)
def test_any_chunking_lands_every_byte_exactly_once(
    payload: bytes, cuts: list[int], discard_at: int | None
) -> None:
    bounds = sorted({0, len(payload), *(c % len(payload) for c in cuts)})
    chunks = [(a, payload[a:b]) for a, b in itertools.pairwise(bounds)]
    landing = Landing()
    region = bytearray(len(payload))
    landing.expect(NODE, MSG, OP, memoryview(region))
    done = []
    for i, (off, chunk) in enumerate(chunks):
        if i == discard_at:
            landing.discard(NODE, MSG)
        done.append(land(landing, NODE, MSG, off, chunk))
    assert done == [False] * (len(chunks) - 1) + [True]  # complete at the last chunk only
    assert landing.bytes == len(payload)
    discarded = discard_at is not None and discard_at < len(chunks)
    kept = chunks[discard_at][0] if discarded else len(payload)  # type: ignore[index]
    assert region[:kept] == payload[:kept]
    assert region[kept:] == bytes(len(payload) - kept)
    assert landing.forget(NODE, MSG) == (None if discarded else OP)
