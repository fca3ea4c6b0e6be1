"""Properties of the frame decoder over generated input.

* Round trip and totality: ``decode(encode(m)) == m`` for every kind, and any truncation, bit
  flip or splice of a valid stream yields only valid frames, ``NEED_DATA`` or
  ``RemoteProtocolError``: any other exception (or an invalid frame) fails the test.
* Reassembly: a stream decodes to the same frames however it is cut into reads, through ``feed``
  and through the ``payload_target`` path the TCP transport uses.
* Allocation bounds: headers declaring huge lengths are refused before anything is allocated.

Hypothesis explores structured inputs and shrinks failures.  The figures the decoder is held to
(10^4 examples per frame type, 10^5 chunkings) would take Hypothesis minutes, so seeded loops
with ``random.Random`` reach them in a few seconds; every failure message names the seed and the
iteration.  Set ``FABRICD_FUZZ_SEED`` to run the loops from another seed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import struct
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabricd.engines.link.handshake import HANDSHAKE_LIMITS
from fabricd.errors import RemoteProtocolError
from fabricd.frames.p2p import Write
from fabricd.transports.inproc import InprocLink, InprocTransport
from fabricd.transports.posted import PostKey, WriteLanded
from fabricd.wire import (
    DEFAULT_LIMITS,
    DISCARD,
    HEADER_SIZE,
    NEED_DATA,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    FrameHead,
    Kind,
    Limits,
    encode,
)

SEED = int(os.environ.get("FABRICD_FUZZ_SEED", "20240611"))
LAYOUT = struct.Struct(">4sBBHIQ")  # the documented header (docs/protocol.md)
Sent = tuple[Kind, dict[str, Any], bytes]

#: Hypothesis budgets, kept small: the seeded loops below carry the 10^4/10^5 figures
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_KIND = settings(FAST, max_examples=40)

# -- strategies ----------------------------------------------------------------------------------

INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
SCALARS = st.none() | st.booleans() | INTS | st.text(max_size=20) | st.binary(max_size=40)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
METAS = st.dictionaries(st.text(max_size=10), VALUES, max_size=6)
PAYLOADS = st.binary(max_size=512)
FRAMES = st.tuples(st.sampled_from(list(Kind)), METAS, PAYLOADS)
STREAMS = st.lists(FRAMES, min_size=1, max_size=3)


def stream_of(frames: list[Sent]) -> bytes:
    return b"".join(encode(*f) for f in frames)


def as_sent(frames: list[Frame]) -> list[Sent]:
    return [(f.kind, f.meta, bytes(f.payload)) for f in frames]


# -- the checked decoder -------------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, str, bytes)


def check_value(value: object) -> None:
    """Only plain msgpack types come out of the decoder: no ext types, no tuples."""
    if isinstance(value, list):
        for item in value:
            check_value(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str | bytes), key
            check_value(item)
    else:
        assert type(value) in _PLAIN, type(value)


class Reader:
    """Runs a decoder over reads the way the transports do, checking every event it returns.

    ``direct``: payload bytes go into ``payload_target()`` when the decoder offers it (the TCP
    path).  ``supply``: a fresh caller buffer is given for every payload (``set_payload_buffer``).
    """

    def __init__(
        self, limits: Limits = DEFAULT_LIMITS, *, direct: bool = False, supply: bool = False
    ) -> None:
        self.decoder = Decoder(limits)
        self.limits = limits
        self.direct = direct
        self.supply = supply
        self.frames: list[Frame] = []
        self._head: FrameHead | None = None
        self._buffer: memoryview | None = None

    def read(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        self._events()
        while len(view):
            target = self.decoder.payload_target() if self.direct else None
            if target is not None and len(target):
                n = min(len(target), len(view))
                target[:n] = view[:n]
                self.decoder.payload_written(n)
                view = view[n:]
            else:
                self.decoder.feed(view)
                view = view[len(view) :]
            self._events()

    def _events(self) -> None:
        while (event := self.decoder.next_event()) is not NEED_DATA:
            if isinstance(event, FrameHead):
                assert self._head is None, "two heads without a frame"
                assert event.kind in self.limits.kinds
                assert event.flags == 0
                assert 0 <= event.payload_len <= self.limits.max_payload
                assert isinstance(event.meta, dict)
                assert all(isinstance(k, str) for k in event.meta)
                check_value(event.meta)
                self._head = event
                if self.supply and event.payload_len:
                    self._buffer = memoryview(bytearray(event.payload_len))
                    self.decoder.set_payload_buffer(self._buffer)
            else:
                assert isinstance(event, Frame), event
                head = self._head
                assert head is not None, "a frame without a head"
                assert (event.kind, event.flags, event.meta) == (head.kind, head.flags, head.meta)
                assert len(event.payload) == head.payload_len
                if self._buffer is not None:
                    assert event.payload is self._buffer
                self.frames.append(event)
                self._head, self._buffer = None, None

    def read_all(self, chunks: list[bytes]) -> RemoteProtocolError | None:
        """Read every chunk; return the protocol error that stopped it, if any.

        Any other exception propagates and fails the test.
        """
        try:
            for chunk in chunks:
                self.read(chunk)
        except RemoteProtocolError as exc:
            with pytest.raises(RemoteProtocolError):  # dead for good
                self.decoder.next_event()
            return exc
        return None


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def random_chunks(rng: random.Random, data: bytes) -> list[bytes]:
    """Cut ``data`` at 0 to 16 random places (every single-byte cut: see the small stream)."""
    cuts = [rng.randint(0, len(data)) for _ in range(rng.choice((0, 1, 2, 4, 8, 16)))]
    if cuts and rng.random() < 0.3:  # sometimes a run of 1-byte reads
        start = rng.randint(0, len(data))
        cuts += range(start, min(start + rng.randint(1, 24), len(data)))
    return chunked(data, cuts)


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@PER_KIND
@given(meta=METAS, payload=PAYLOADS)
def test_round_trip(kind: Kind, meta: dict[str, Any], payload: bytes) -> None:
    data = encode(kind, meta, payload)
    reader = Reader()
    assert reader.read_all([data]) is None
    [frame] = reader.frames
    assert (frame.kind, frame.meta, bytes(frame.payload)) == (kind, meta, payload)
    assert encode(frame.kind, frame.meta, bytes(frame.payload)) == data  # True is not 1, etc.


# -- totality ------------------------------------------------------------------------------------


@FAST
@given(frames=STREAMS, data=st.data())
def test_truncation_yields_a_prefix_of_the_frames(frames: list[Sent], data: st.DataObject) -> None:
    stream = stream_of(frames)
    cut = data.draw(st.integers(0, len(stream)), label="cut")
    reader = Reader()
    assert reader.read_all([stream[:cut]]) is None
    got = as_sent(reader.frames)
    assert got == frames[: len(got)]
    if cut < len(stream):
        assert len(got) < len(frames)


@FAST
@given(frames=STREAMS, data=st.data(), direct=st.booleans())
def test_bit_flips_yield_frames_or_protocol_errors(
    frames: list[Sent], data: st.DataObject, direct: bool
) -> None:
    mutated = bytearray(stream_of(frames))
    limit = data.draw(st.sampled_from([HEADER_SIZE, len(mutated)]), label="region")
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        position = data.draw(st.integers(0, min(limit, len(mutated)) - 1), label="byte")
        mutated[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    cuts = data.draw(st.lists(st.integers(0, len(mutated)), max_size=6), label="cuts")
    Reader(direct=direct).read_all(chunked(bytes(mutated), cuts))


@FAST
@given(a=STREAMS, b=STREAMS, data=st.data())
def test_splices_yield_frames_or_protocol_errors(
    a: list[Sent], b: list[Sent], data: st.DataObject
) -> None:
    first, second = stream_of(a), stream_of(b)
    i = data.draw(st.integers(0, len(first)), label="i")
    j = data.draw(st.integers(0, len(second)), label="j")
    how = data.draw(st.sampled_from(["join", "insert", "junk"]), label="how")
    if how == "join":
        spliced = first[:i] + second[j:]
    elif how == "insert":
        spliced = first[:i] + second[:j] + first[i:]
    else:
        spliced = first[:i] + data.draw(st.binary(min_size=1, max_size=64), label="junk")
    reader = Reader(direct=data.draw(st.booleans(), label="direct"))
    error = reader.read_all([spliced])
    if error is None and how == "join" and i == len(first) and j in (0, len(second)):
        assert as_sent(reader.frames) == (a + b if j == 0 else a)


@FAST
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_after_a_valid_header_prefix(data: bytes) -> None:
    Reader().read_all([b"FBRC\x01" + data])
    Reader().read_all([data])


# -- the same, 10^4 times per kind from a seeded RNG ----------------------------------------------

_CHARS = "abcxyz_-0189 \x00\n\x7féü€\u4e2d\U0001f600"


def random_str(rng: random.Random, longest: int) -> str:
    return "".join(rng.choices(_CHARS, k=rng.randint(0, longest)))


def random_value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth < 3 and r < 0.12:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and r < 0.18:
        return {random_str(rng, 6): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if r < 0.45:
        return rng.choice((rng.randint(-(2**63), 2**64 - 1), rng.randint(-40, 70_000)))
    if r < 0.65:
        return random_str(rng, rng.choice((4, 40, 200)))
    if r < 0.8:
        return rng.randbytes(rng.choice((0, 1, 32, rng.randint(0, 300))))
    return rng.choice((None, True, False))


def random_frame(rng: random.Random, kind: Kind) -> Sent:
    meta = {random_str(rng, 10): random_value(rng) for _ in range(rng.randint(0, 8))}
    payload = rng.randbytes(rng.choice((0, 0, 1, rng.randint(0, 64), rng.randint(0, 3000))))
    return kind, meta, payload


def mutate(rng: random.Random, stream: bytes, other: bytes) -> tuple[str, bytes]:
    how = rng.choice(("truncate", "flip", "flip-head", "splice", "insert", "field", "junk"))
    data = bytearray(stream)
    if how == "truncate":
        return how, stream[: rng.randrange(len(stream))]
    if how in ("flip", "flip-head"):
        reach = HEADER_SIZE + 16 if how == "flip-head" else len(data)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(min(reach, len(data)))] ^= 1 << rng.randrange(8)
        return how, bytes(data)
    if how == "splice":
        return how, stream[: rng.randint(0, len(stream))] + other[rng.randint(0, len(other)) :]
    if how == "insert":
        i = rng.randint(0, len(stream))
        return how, stream[:i] + other[: rng.randint(1, len(other))] + stream[i:]
    if how == "field":  # one header field of the first frame set to a random value
        start, size = rng.choice(((4, 1), (5, 1), (6, 2), (8, 4), (12, 8)))
        data[start : start + size] = rng.randbytes(size)
        return how, bytes(data)
    return how, stream[: rng.randint(0, len(stream))] + rng.randbytes(rng.randint(1, 64))


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_seeded_round_trip_and_mutations(kind: Kind) -> None:
    seed = SEED + int(kind)
    rng = random.Random(seed)
    other = encode(Kind.DATA, {"msg": 1, "off": 0}, b"payload")
    for i in range(10_000):
        sent = random_frame(rng, kind)
        data = encode(*sent)
        reader = Reader(direct=i % 2 == 1, supply=i % 4 == 1)
        error = reader.read_all(random_chunks(rng, data) if i % 3 else [data])
        assert error is None, f"seed {seed} iteration {i}: {error!r} for {sent!r}"
        assert as_sent(reader.frames) == [sent], f"seed {seed} iteration {i}: {sent!r}"

        how, mutated = mutate(rng, data + other if i % 5 == 0 else data, other)
        try:
            Reader(direct=i % 2 == 0).read_all(random_chunks(rng, mutated))
        except Exception as exc:
            pytest.fail(f"seed {seed} iteration {i} ({how}): {exc!r} on {mutated.hex()}")
        other = data  # the next splice partner: a frame of this kind


def random_token(rng: random.Random) -> bytes:
    """One msgpack scalar token, often malformed: ext of every form, bad UTF-8, short bodies."""
    token = rng.randrange(8)
    if token == 0:  # ext of every form, often of length 0 (ext 8) or with too few bytes
        head = rng.choice(
            (
                b"\xc7" + bytes([rng.choice((0, 0, 1, 4, 255))]),
                b"\xc8\x00\x00",
                b"\xc9\x00\x00\x00\x00",
                b"\xd4",
                b"\xd5",
                b"\xd6",
                b"\xd7",
                b"\xd8",
            )
        )
        sizes = {b"\xd4": 1, b"\xd5": 2, b"\xd6": 4, b"\xd7": 8, b"\xd8": 16}
        body = head[1] if head[0] == 0xC7 else sizes.get(head, 0)
        code = bytes([rng.choice((0, 5, 0x7F, 0x80, 0xFF))])
        return head + code + rng.randbytes(body if rng.random() < 0.8 else rng.randrange(4))
    if token == 1:  # fixstr, str 8, bin 8, or a str/bin header promising more than there is
        n = rng.randrange(8)
        head = rng.choice(
            (
                bytes([0xA0 | n]),
                b"\xd9" + bytes([n]),
                b"\xc4" + bytes([n]),
                b"\xda\xff\xff",
                b"\xdb\xff\xff\xff\xff",
                b"\xc6\x00\x01\x00\x00",
            )
        )
        return head + rng.choice((b"abcdefgh", b"\xff\xfe\xc3\x28\xe2\x82\x00\x01"))[:n]
    if token == 2:  # sized ints and floats
        code = rng.choice((0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xCA, 0xCB))
        size = {0xCC: 1, 0xD0: 1, 0xCD: 2, 0xD1: 2, 0xCE: 4, 0xD2: 4, 0xCA: 4}.get(code, 8)
        return bytes([code]) + rng.randbytes(size)
    if token == 3:  # a 16/32-bit array or map header with any count
        return bytes([rng.choice((0xDC, 0xDE, 0xDD, 0xDF))]) + rng.randbytes(rng.choice((2, 4)))
    if token == 4:  # the reserved byte, or any byte at all
        return rng.choice((b"\xc1", rng.randbytes(1)))
    return bytes([rng.choice((0x00, 0x7F, 0xE0, 0xFF, 0xC0, 0xC2, 0xC3))])


def random_msgpack(rng: random.Random, depth: int = 0) -> bytes:
    """A msgpack value: containers with the right counts around :func:`random_token` leaves."""
    r = rng.random()
    if depth < 4 and r < 0.2:
        n = rng.randrange(4)
        return bytes([0x90 | n]) + b"".join(random_msgpack(rng, depth + 1) for _ in range(n))
    if depth < 4 and r < 0.3:
        n = rng.randrange(3)
        items = (random_key(rng) + random_msgpack(rng, depth + 1) for _ in range(n))
        return bytes([0x80 | n]) + b"".join(items)
    return random_token(rng)


def random_key(rng: random.Random) -> bytes:
    return rng.choice((b"\xa1k", b"\xa3key", b"\xa0")) if rng.random() < 0.9 else random_token(rng)


def test_seeded_metadata_soup() -> None:
    """10^4 random msgpack token runs as metadata: plain values or RemoteProtocolError."""
    rng = random.Random(SEED)
    accepted = 0
    for i in range(10_000):
        n = rng.randint(1, 4)
        meta = bytes([0x80 | n]) + b"".join(random_key(rng) + random_msgpack(rng) for _ in range(n))
        if rng.random() < 0.1:
            meta = random_msgpack(rng)  # not a map, most of the time
        head = LAYOUT.pack(b"FBRC", PROTOCOL_VERSION, rng.choice(list(Kind)), 0, len(meta), 0)
        reader = Reader(HANDSHAKE_LIMITS if i % 4 == 0 else DEFAULT_LIMITS)
        try:
            error = reader.read_all(random_chunks(rng, head + meta))
        except Exception as exc:
            pytest.fail(f"seed {SEED} iteration {i}: {exc!r} on metadata {meta.hex()}")
        accepted += error is None and len(reader.frames) == 1
    assert accepted > 100  # the soup is not all garbage: valid maps get through and are checked


# -- stream reassembly ---------------------------------------------------------------------------

PATHS = {"feed": {}, "target": {"direct": True}, "target+buffer": {"direct": True, "supply": True}}


@pytest.mark.parametrize("path", list(PATHS))
@FAST
@given(frames=STREAMS, data=st.data())
def test_any_chunking_gives_the_same_frames(
    path: str, frames: list[Sent], data: st.DataObject
) -> None:
    stream = stream_of(frames)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20), label="cuts")
    reader = Reader(**PATHS[path])
    assert reader.read_all(chunked(stream, cuts)) is None
    assert as_sent(reader.frames) == frames


SMALL: list[Sent] = [
    (Kind.RTS, {"msg": 1, "job": "j", "nbytes": 3}, b""),
    (Kind.DATA, {"msg": 1, "off": 0}, b"abc"),
    (Kind.HEARTBEAT, {}, b""),
    (Kind.DONE, {"msg": 1}, b"z"),
]


@pytest.mark.parametrize("path", list(PATHS))
def test_every_split_of_a_small_stream(path: str) -> None:
    stream = stream_of(SMALL)
    chunkings = [[stream[i : i + 1] for i in range(len(stream))]]  # one byte at a time
    chunkings += [[stream[:i], stream[i:]] for i in range(len(stream) + 1)]
    chunkings += [
        [stream[:i], stream[i:j], stream[j:]]
        for i in range(len(stream) + 1)
        for j in range(i, len(stream) + 1, 3)
    ]
    for chunks in chunkings:
        reader = Reader(**PATHS[path])
        assert reader.read_all(chunks) is None
        assert as_sent(reader.frames) == SMALL, [len(c) for c in chunks]


def reassemble(chunks: list[bytes], *, direct: bool = False, supply: bool = False) -> list[Sent]:
    """:class:`Reader` without its per-event checks: the loop below runs 10^5 times."""
    decoder, frames = Decoder(), []
    for chunk in chunks:
        view = memoryview(chunk)
        while True:
            while (event := decoder.next_event()) is not NEED_DATA:
                if isinstance(event, Frame):
                    frames.append((event.kind, event.meta, bytes(event.payload)))
                elif supply and event.payload_len:
                    decoder.set_payload_buffer(memoryview(bytearray(event.payload_len)))
            if not view:
                break
            target = decoder.payload_target() if direct else None
            n = min(len(target), len(view)) if target else len(view)
            if target:
                target[:n] = view[:n]
                decoder.payload_written(n)
            else:
                decoder.feed(view)
            view = view[n:]
    return frames


@pytest.mark.parametrize("path", list(PATHS))
def test_seeded_chunkings(path: str) -> None:
    """10^5 random chunkings in all: a third on each read path."""
    seed = SEED + len(path)
    rng = random.Random(seed)
    sent = [random_frame(rng, kind) for kind in (Kind.RTS, Kind.DATA, Kind.CTS, Kind.DATA)]
    sent.append((Kind.HEARTBEAT, {}, b""))
    stream = stream_of(sent)
    for i in range(100_000 // len(PATHS) + 1):
        chunks = random_chunks(rng, stream)
        got = reassemble(chunks, **PATHS[path])
        assert got == sent, f"seed {seed} iteration {i}: cut into {[len(c) for c in chunks]}"


# -- allocation bounds ---------------------------------------------------------------------------


def test_huge_lengths_are_refused_before_allocation() -> None:
    """10^4 headers declaring up to 2^64-1 payload or 2^32-1 metadata bytes: peak < 1 MiB."""
    rng = random.Random(SEED)
    limits = DEFAULT_LIMITS
    kinds = list(Kind)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for i in range(10_000):
            meta_len = rng.randint(0, limits.max_meta)
            payload_len = rng.randint(0, limits.max_payload)
            which = i % 3
            if which in (0, 2):
                huge = rng.randint(limits.max_payload + 1, 2**64 - 1)
                payload_len = rng.choice((4 << 30, 2**64 - 1, huge))
            if which in (1, 2):
                meta_len = rng.choice((2**32 - 1, rng.randint(limits.max_meta + 1, 2**32 - 1)))
            head = LAYOUT.pack(
                b"FBRC", PROTOCOL_VERSION, rng.choice(kinds), 0, meta_len, payload_len
            )
            decoder = Decoder(limits)
            decoder.feed(head + rng.randbytes(i % 64))  # maybe a few body bytes behind it
            try:
                decoder.next_event()
            except RemoteProtocolError:
                pass
            else:
                pytest.fail(f"seed {SEED} iteration {i}: {head.hex()} was not refused")
            assert decoder.payload_target() is None
            assert decoder.buffered <= HEADER_SIZE + 64
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} B over 10^4 refused headers"


def test_a_refused_header_allocates_nothing_for_its_lengths() -> None:
    head = LAYOUT.pack(b"FBRC", PROTOCOL_VERSION, Kind.DATA, 0, 2**32 - 1, 2**64 - 1)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        decoder = Decoder()
        decoder.feed(head)
        with pytest.raises(RemoteProtocolError):
            decoder.next_event()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


# -- WRITE through the posted-region receive path (Z1, Z4 for the new kind) ---------------------


def write_frames(rng: random.Random, n: int) -> list[tuple[dict[str, Any], bytes]]:
    """WRITE metadata and payloads around one posted 256-byte uint32 region at (1, 0): some
    fit, some run past its end, some are misaligned, some name another key."""
    frames = []
    for _ in range(n):
        meta = {
            "epoch": rng.choice((1, 1, 1, 0, 2)),
            "slot": rng.choice((0, 0, 0, 1)),
            "off": rng.choice((rng.randrange(0, 300), rng.randrange(0, 2**63))),
            "seq": rng.randrange(2**63),
        }
        frames.append((meta, rng.randbytes(rng.randrange(0, 80))))
    return frames


def test_seeded_writes_land_in_bounds_or_nowhere() -> None:
    """10^4 WRITE frames, each intact or mutated, fed in random chunks to a link holding one
    posted region: every byte that changes lies in a write that passed the checks (and, on a
    link that stays open, was reported landed); an intact frame lands iff it fits; nothing
    but a protocol error (the link closing) ever comes out."""

    async def check() -> None:
        rng = random.Random(SEED + 11)
        other = encode(Kind.WRITE, Write(epoch=1, slot=0, off=0, seq=0).to_meta(), b"\x01" * 8)
        for i, (meta, payload) in enumerate(write_frames(rng, 10_000)):
            link = InprocLink("me", "peer", DEFAULT_LIMITS, InprocTransport())
            region = bytearray(256)
            landed: list[WriteLanded] = []
            link.post(PostKey(epoch=1, slot=0), memoryview(region), dtype="uint32",
                      on_landed=landed.append)  # fmt: skip
            accepted: list[tuple[int, int]] = []
            posted = link._receiver.posted
            begin = posted.begin

            def recording(head: FrameHead, begin: Any = begin, into: Any = accepted) -> Any:
                target = begin(head)
                if target is not DISCARD:
                    into.append((head.meta["off"], head.payload_len))
                return target

            posted.begin = recording  # type: ignore[method-assign]
            data = encode(Kind.WRITE, meta, payload)
            how, stream = ("intact", data) if i % 2 else mutate(rng, data, other)
            for chunk in random_chunks(rng, stream):
                link._receive(chunk)  # closes the link on a protocol error, raises nothing
                if link.closed:
                    assert (link.close_reason or "").startswith("protocol error"), how
                    break
            placed = bytearray(256)
            # a write cut off by the link closing, or still arriving (the stream ends
            # mid-frame), leaves its checked range undefined: bytes may change there, and
            # only there; otherwise only where a completion was reported
            cut = link.closed or link._receiver.decoder.mid_frame
            spans = [(w.offset, w.nbytes) for w in landed] + (accepted if cut else [])
            for off, n in spans:
                assert off + n <= 256
                assert off % 4 == 0
                assert n % 4 == 0
                placed[off : off + n] = region[off : off + n]
            assert region == placed, (
                f"seed {SEED + 11} iteration {i} ({how}): stray bytes {landed} {accepted} "
                f"{link.closed} {link.close_reason} {meta} {len(payload)}"
            )
            if how == "intact":
                fits = meta["epoch"] == 1 and meta["slot"] == 0 and meta["off"] % 4 == 0
                fits = fits and len(payload) % 4 == 0 and meta["off"] + len(payload) <= 256
                assert len(landed) == int(fits), f"iteration {i}: {meta}, {len(payload)} B"
                assert not landed or region[meta["off"] : meta["off"] + len(payload)] == payload
            link.close("next")

    asyncio.run(check())


def test_refused_writes_allocate_nothing_for_their_payload() -> None:
    """10^4 WRITE frames of 64 KiB to keys nobody posted: read and dropped through the
    decoder's buffer, peak allocation < 1 MiB (Z4)."""

    payload = bytes(64 * 1024)
    frame = encode(Kind.WRITE, Write(epoch=1, slot=7, off=0, seq=1).to_meta(), payload)
    logging.getLogger("fabricd.transport").disabled = True  # 10^4 refusal lines

    async def check() -> None:
        link = InprocLink("me", "peer", DEFAULT_LIMITS, InprocTransport())
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for _ in range(10_000):
                link._receive(frame[:4096])
                link._receive(frame[4096:])
            peak = tracemalloc.get_traced_memory()[1] - baseline
        finally:
            tracemalloc.stop()
        assert not link.closed
        assert link.statistics().writes_refused == 10_000
        assert peak < 1 << 20, f"peak {peak} B"
        link.close("done")

    try:
        asyncio.run(check())
    finally:
        logging.getLogger("fabricd.transport").disabled = False
