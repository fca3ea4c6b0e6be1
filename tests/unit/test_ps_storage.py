"""Timed parameter storage (fabricd/engines/ps/storage.py): a worker that applies the reply to
a pull from any version it may hold ends bitwise equal to the server's published model; every
encoding round-trips; the reply is the smallest encoding; malformed replies are refused with
RemoteProtocolError and leave the cache untouched."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.engines.ps import storage as ps
from fabricd.errors import RemoteProtocolError, UsageError

FLOATS = ("float16", "float32", "float64")


def values(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Random values with the bit patterns a copy could lose mixed in: NaN, -0.0, infinities."""
    out = rng.normal(0, 10, n).astype(dtype)
    special = rng.integers(0, 10, n)
    out[special == 0] = np.nan
    out[special == 1] = -0.0
    out[special == 2] = np.inf
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN equals NaN, -0.0 differs from 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def history(
    seed: int, dtype: str, count: int, chunk: int, rounds: list[float]
) -> tuple[ps.TimedStore, list[np.ndarray]]:
    """A store after one publish per entry of ``rounds`` (the share of chunks published), and
    the model at every version."""
    rng = np.random.default_rng(seed)
    store = ps.TimedStore(values(rng, count, dtype), chunk=chunk)
    models = [store.model.copy()]
    for share in rounds:
        mask = rng.random(store.chunks) < share
        indices = np.flatnonzero(mask)
        store.publish(mask, values(rng, ps._elements(indices, count, store.chunk), dtype))
        models.append(store.model.copy())
    return store, models


stores = st.builds(
    history,
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(FLOATS),
    count=st.integers(1, 120),
    chunk=st.integers(1, 130),
    rounds=st.lists(st.sampled_from([0.0, 0.02, 0.1, 0.5, 1.0]), max_size=6),
)


@settings(max_examples=150)
@given(stores, st.data())
def test_a_worker_pulling_from_any_version_ends_with_the_published_model(built, data):
    store, models = built
    for since in range(store.version + 1):
        # the reply may be applied to a cache at any version from ``since`` on
        held = data.draw(st.integers(since, store.version))
        # a fresh worker's cache holds anything
        cache = models[held].copy() if held else np.full(store.count, 7, store.dtype)
        reply = store.pull(since, data.draw(st.sampled_from([None, *ps.Encoding])))
        assert ps.apply_delta(reply, cache, held) == store.version
        assert same(cache, store.model)


@settings(max_examples=100)
@given(stores)
def test_every_encoding_round_trips(built):
    store, _ = built
    for since in range(store.version + 1):
        delta = store.delta(since)
        for encoding in ps.Encoding:
            got_encoding, got = ps.decode(store.pull(since, encoding), store.count)
            assert got_encoding is encoding
            assert (got.since, got.version, got.chunk, got.count) == (
                since,
                store.version,
                store.chunk,
                store.count,
            )
            if encoding is ps.Encoding.DENSE:  # every chunk, changed or not
                assert np.array_equal(got.indices, np.arange(store.chunks))
                assert same(got.values, store.model)
            else:
                assert np.array_equal(got.indices, delta.indices)
                assert same(got.values, delta.values)


@settings(max_examples=100)
@given(stores)
def test_the_reply_is_the_smallest_encoding_ties_dense_then_index(built):
    store, _ = built
    for since in range(store.version + 1):
        sizes = store.sizes(since)
        assert sizes == {e: len(store.pull(since, e)) for e in ps.Encoding}
        encoding, _ = ps.decode(store.pull(since), store.count)
        smallest = min(sizes.values())
        assert sizes[encoding] == smallest
        preferred = [ps.Encoding.DENSE, ps.Encoding.INDEX, ps.Encoding.BITMAP]
        assert encoding is next(e for e in preferred if sizes[e] == smallest)


def test_the_delta_holds_the_chunks_published_after_the_version():
    store = ps.TimedStore(np.zeros(10, np.float32), chunk=3)  # chunks 0..3, the last of 1
    store.publish(np.array([1, 3]), np.array([1, 1, 1, 2], np.float32))
    store.publish(np.array([False, True, False, False]), np.array([3, 3, 3], np.float32))
    store.publish(np.array([0]), np.array([4, 4, 4], np.float32))
    assert store.version == 3
    assert store.versions.tolist() == [3, 2, 0, 1]
    assert store.delta(1).indices.tolist() == [0, 1]
    assert store.delta(1).values.tolist() == [4, 4, 4, 3, 3, 3]
    assert store.delta(3).indices.size == 0
    assert store.delta(0).indices.tolist() == [0, 1, 2, 3]  # a fresh worker: everything
    assert store.model.tolist() == [4, 4, 4, 3, 3, 3, 0, 0, 0, 2]


def test_an_empty_publish_makes_a_version_and_an_up_to_date_pull_is_a_header():
    store = ps.TimedStore(np.ones(1000, np.float32))
    assert store.publish(np.zeros(1000, bool), np.empty(0, np.float32)) == 1
    reply = store.pull(1)
    assert len(reply) == ps.HEADER.size
    cache = np.ones(1000, np.float32)
    assert ps.apply_delta(reply, cache, 1) == 1


def test_statistics_count_publishes_and_pulls():
    store = ps.TimedStore(np.zeros(64, np.float32), chunk=4)
    store.publish(np.array([2]), np.ones(4, np.float32))
    sizes = [len(store.pull(0)), len(store.pull(1)), len(store.pull(1, ps.Encoding.BITMAP))]
    stats = store.statistics()
    assert (stats.version, stats.chunks_published, stats.pulls) == (1, 1, 3)
    assert (stats.dense_pulls, stats.index_pulls, stats.bitmap_pulls) == (1, 1, 1)
    assert stats.pulled_bytes == sum(sizes)


# -- the worker's cache ---------------------------------------------------------------------
def test_a_float16_reply_fills_a_wider_cache_exactly():
    # P-LNP: the server keeps a float16 store; the worker's model is float32 or float64
    store, _ = history(3, "float16", 50, 4, [0.3, 0.3])
    for dtype in ("float32", "float64"):
        cache = np.zeros(50, dtype)
        assert ps.apply_delta(store.pull(0), cache, 0) == 2
        assert same(cache, store.model.astype(dtype))


def test_the_cache_is_written_in_place_through_a_shared_buffer_of_any_shape():
    store, _ = history(4, "float32", 24, 5, [0.5, 0.5])
    segment = bytearray(24 * 4)  # stands in for the worker's shared-memory segment
    cache = np.frombuffer(segment, np.float32).reshape(4, 6)
    assert ps.apply_delta(store.pull(0), cache, 0) == 2
    assert same(np.frombuffer(segment, np.float32), store.model)


@pytest.mark.parametrize(
    ("cache", "version"),
    [
        (np.zeros(8, np.float32)[::2], 0),  # not contiguous: a copy would be written
        (np.zeros(4, np.int32), 0),
        (np.zeros(0, np.float32), 0),
        (np.zeros(4, np.float32), -1),
        (np.zeros(4, np.float32), True),
    ],
)
def test_a_wrong_cache_or_version_is_a_usage_error(cache, version):
    store = ps.TimedStore(np.zeros(4, np.float32))
    with pytest.raises(UsageError):
        ps.apply_delta(store.pull(0), cache, version)


def test_a_read_only_cache_is_a_usage_error():
    store = ps.TimedStore(np.zeros(4, np.float32))
    with pytest.raises(UsageError):
        ps.apply_delta(store.pull(0), store.model, 0)


# -- malformed replies ----------------------------------------------------------------------
def reply_fields(reply: bytes | bytearray) -> list[int]:
    return list(ps.HEADER.unpack_from(reply))


def with_fields(reply: bytes | bytearray, **changes: int) -> bytes:
    names = ("kind", "item", "reserved", "chunk", "count", "since", "version", "carried")
    fields = dict(zip(names, reply_fields(reply), strict=True)) | changes
    return ps.HEADER.pack(*fields.values()) + bytes(reply[ps.HEADER.size :])


def refused(reply: bytes | bytearray, cache: np.ndarray, version: int) -> None:
    before = cache.copy()
    with pytest.raises(RemoteProtocolError):
        ps.apply_delta(reply, cache, version)
    assert same(cache, before)


@pytest.fixture
def sample() -> tuple[ps.TimedStore, list[np.ndarray]]:
    """20 float32 parameters in chunks of 3 (the last of 2), three publishes."""
    return history(5, "float32", 20, 3, [0.3, 0.3, 0.3])


def test_header_fields_that_make_no_sense_are_refused(sample):
    store, models = sample
    reply = store.pull(1, ps.Encoding.INDEX)
    cache = models[1].copy()
    for change in (
        {"kind": 3},
        {"item": 3},
        {"item": 16},
        {"reserved": 1},
        {"chunk": 0},
        {"chunk": 21},  # larger than the model
        {"count": 21},  # another model
        {"since": 2, "version": 1},
        {"carried": 8},  # more chunks than the model has
        {"carried": 2**63},
    ):
        refused(with_fields(reply, **change), cache, 1)


def test_replies_that_do_not_fit_the_cache_version_are_refused(sample):
    store, models = sample
    refused(store.pull(2), models[1].copy(), 1)  # built since a later version: misses chunks
    old = store.pull(1)
    store.publish(np.ones(store.chunks, bool), np.zeros(20, np.float32))
    refused(old, store.model.copy(), 4)  # older than the cache: would take chunks back


def test_values_the_cache_would_round_are_refused():
    store, _ = history(6, "float64", 10, 1, [0.5])
    refused(store.pull(0), np.zeros(10, np.float32), 0)


def test_every_truncation_and_an_extra_byte_are_refused(sample):
    store, models = sample
    for encoding in ps.Encoding:
        reply = bytes(store.pull(1, encoding))
        for end in range(len(reply)):
            refused(reply[:end], models[1].copy(), 1)
        refused(reply + b"\0", models[1].copy(), 1)


def test_index_lists_out_of_range_or_not_ascending_are_refused(sample):
    _, models = sample
    head = ps.HEADER.pack(ps.Encoding.INDEX, 4, 0, 3, 20, 1, 3, 2)
    three = np.zeros(3, "<f4").tobytes()
    for indices in ([1, 7], [2, 1], [1, 1]):
        body = np.array(indices, "<u4").tobytes() + three + three
        refused(head + body, models[1].copy(), 1)
    # chunk 6 is the short last one (2 values): 5 values, not 6
    good = head + np.array([1, 6], "<u4").tobytes() + np.zeros(5, "<f4").tobytes()
    assert ps.apply_delta(good, models[1].copy(), 1) == 3
    refused(good + np.zeros(1, "<f4").tobytes(), models[1].copy(), 1)


def test_bitmaps_with_unused_bits_or_a_wrong_count_are_refused(sample):
    _, models = sample
    head = ps.HEADER.pack(ps.Encoding.BITMAP, 4, 0, 3, 20, 1, 3, 1)
    three = np.zeros(3, "<f4").tobytes()
    assert ps.apply_delta(head + bytes([0b10]) + three, models[1].copy(), 1) == 3
    refused(head + bytes([0b10000010]) + three, models[1].copy(), 1)  # bit 7: no chunk 7
    refused(head + bytes([0b110]) + three + three, models[1].copy(), 1)  # 2 set, says 1


def test_a_dense_reply_must_carry_every_chunk(sample):
    store, models = sample
    reply = store.pull(0, ps.Encoding.DENSE)
    refused(with_fields(reply, carried=store.chunks - 1), models[1].copy(), 1)


@settings(max_examples=300)
@given(stores, st.data())
def test_corrupted_replies_raise_only_remote_protocol_errors(built, data):
    store, models = built
    since = data.draw(st.integers(0, store.version))
    reply = bytearray(store.pull(since, data.draw(st.sampled_from(list(ps.Encoding)))))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(reply) - 1))
        reply[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(reply)))
    cache = models[since].copy()
    with contextlib.suppress(RemoteProtocolError):  # anything else fails the test
        ps.apply_delta(bytes(reply[:cut]), cache, since)


# -- the store's arguments ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("initial", "chunk"),
    [
        (np.zeros(4, np.int64), 1),
        (np.zeros((2, 2), np.float32), 1),
        (np.zeros(0, np.float32), 1),
        (np.zeros(4, np.float32), 0),
        (np.zeros(4, np.float32), True),
        (np.zeros(4, np.float32), 2.0),
    ],
)
def test_a_wrong_model_or_chunk_is_a_usage_error(initial, chunk):
    with pytest.raises(UsageError):
        ps.TimedStore(initial, chunk=chunk)


def test_a_chunk_larger_than_the_model_is_the_whole_model():
    store = ps.TimedStore(np.zeros(5, np.float32), chunk=1000)
    assert (store.chunk, store.chunks) == (5, 1)


@pytest.mark.parametrize(
    ("chunks", "published"),
    [
        (np.ones(3, bool), np.zeros(10, np.float32)),  # a mask over 3 of 4 chunks
        (np.array([2, 1]), np.zeros(6, np.float32)),
        (np.array([1, 1]), np.zeros(6, np.float32)),
        (np.array([4]), np.zeros(3, np.float32)),
        (np.array([-1]), np.zeros(3, np.float32)),
        (np.array([0.5]), np.zeros(3, np.float32)),
        (np.array([3]), np.zeros(3, np.float32)),  # the last chunk holds 1
        (np.array([0]), np.zeros(3, np.float64)),  # would be rounded
        (np.array([0]), np.zeros(3, np.int32)),
    ],
)
def test_a_wrong_publish_is_a_usage_error_and_changes_nothing(chunks, published):
    store = ps.TimedStore(np.zeros(10, np.float32), chunk=3)
    with pytest.raises(UsageError):
        store.publish(chunks, published)
    assert store.version == 0
    assert not store.versions.any()


def test_float16_values_publish_into_a_float32_model():
    store = ps.TimedStore(np.zeros(4, np.float32))
    store.publish(np.array([1, 2]), np.array([0.5, 65504], np.float16))
    assert store.model.tolist() == [0, 0.5, 65504, 0]


@pytest.mark.parametrize("since", [-1, 2])
def test_a_version_the_model_never_had_is_a_remote_protocol_error(since):
    store = ps.TimedStore(np.zeros(4, np.float32))
    store.publish(np.array([0]), np.zeros(1, np.float32))
    for build in (store.delta, store.pull, store.sizes):
        with pytest.raises(RemoteProtocolError):
            build(since)
