"""The frame format and its decoder, example by example (docs/protocol.md).

Every malformed input must raise ``RemoteProtocolError`` (a ``ValueError``) and leave the decoder
dead; every length is checked against the limits *before* the bytes it announces arrive.  The
header is built here by hand from the documented layout, not with ``fabricd.wire``'s own struct,
so a change to the layout fails these tests.
"""

from __future__ import annotations

import array
import gc
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest

from fabricd.engines.collectives.spec import Spec
from fabricd.engines.link.handshake import HANDSHAKE_LIMITS
from fabricd.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from fabricd.frames.collectives import Coll
from fabricd.ipc import REPLY_LIMITS, REQUEST_LIMITS
from fabricd.wire import (
    DEFAULT_LIMITS,
    HEADER_SIZE,
    MAGIC,
    NEED_DATA,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    FrameHead,
    Kind,
    Limits,
    encode,
    encode_head,
    get_bytes,
    get_int,
    get_str,
)

#: a stochastic reduce's spec, as UPDATE and NOTIFY frames carry it
SPEC = {
    "graph": "expander",
    "n": 8,
    "degree": None,
    "seed": 0,
    "edges": None,
    "sync": "notify-ack",
    "dtype": "float32",
    "nbytes": 4096,
}

#: a parameter server's spec, as PUSH, PULL and REPLICATE frames carry it
PS_SPEC = {
    "n": 4,
    "size": 1_000_000,
    "dtype": "float32",
    "servers": [0, 1],
    "replicas": [1, 0],
    "consistency": "ssp",
    "staleness": 2,
    "delay_bound": None,
    "chunk": 1,
    "scheduling": "arrival",
    "aggregation": False,
    "replication": "chain",
    "divergence_bound": None,
    "distribution": "direct",
}

#: the documented header: magic, version u8, kind u8, flags u16, meta_len u32, payload_len u64
LAYOUT = struct.Struct(">4sBBHIQ")


def header(
    kind: int = Kind.HEARTBEAT,
    meta_len: int = 1,
    payload_len: int = 0,
    *,
    magic: bytes = b"FBRC",
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
) -> bytes:
    return LAYOUT.pack(magic, version, kind, flags, meta_len, payload_len)


def raw_frame(meta: bytes, kind: int = Kind.HEARTBEAT, payload: bytes = b"") -> bytes:
    """A frame whose metadata bytes are given as is (they need not be valid msgpack)."""
    return header(kind, len(meta), len(payload)) + meta + payload


def drain(decoder: Decoder) -> list[FrameHead | Frame]:
    events: list[FrameHead | Frame] = []
    while True:
        event = decoder.next_event()
        if event is NEED_DATA:
            return events
        assert isinstance(event, FrameHead | Frame), event
        events.append(event)


def decode_frames(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Frame]:
    """Decode a whole stream fed at once, checking that each Frame follows its FrameHead."""
    decoder = Decoder(limits)
    decoder.feed(data)
    events = drain(decoder)
    assert len(events) % 2 == 0, events
    frames = []
    for head, frame in zip(events[::2], events[1::2], strict=True):
        assert isinstance(head, FrameHead)
        assert isinstance(frame, Frame)
        assert (frame.kind, frame.flags, frame.meta) == (head.kind, head.flags, head.meta)
        assert len(frame.payload) == head.payload_len
        frames.append(frame)
    assert decoder.buffered == 0
    return frames


def assert_rejected(data: bytes, limits: Limits = DEFAULT_LIMITS, match: str | None = None) -> None:
    """``data`` makes the decoder raise RemoteProtocolError, after which it stays dead."""
    decoder = Decoder(limits)
    decoder.feed(data)
    with pytest.raises(RemoteProtocolError, match=match):
        drain(decoder)
    assert_dead(decoder)


def assert_dead(decoder: Decoder) -> None:
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.feed(encode(Kind.HEARTBEAT, {}))
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.next_event()


def meta_bytes(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# -- the format ----------------------------------------------------------------------------------

#: metadata in the shape each kind carries in fabricd (docs/protocol.md), plus odd corners
SAMPLE_META: dict[Kind, dict[str, object]] = {
    Kind.HELLO: {
        "v": 1,
        "node": 3,
        "inc": 1_700_000_000_123_456_789,
        "nonce": bytes(range(32)),
        "channel": "control",
    },
    Kind.AUTH: {"mac": b"\xff" * 32},
    Kind.HEARTBEAT: {},
    Kind.BYE: {},
    Kind.ANNOUNCE: {"job": "demo", "rank": 7, "size": 8, "present": True},
    Kind.RTS: {
        "msg": 12,
        "job": "jöb-ü€",
        "src": 0,
        "dst": 1,
        "tag": 2**31,
        "nbytes": 2**40,
        "dtype": "float32",
    },
    Kind.CTS: {"msg": 2**63 - 1},
    Kind.DATA: {"msg": 5, "off": 4 * 1024 * 1024},
    Kind.DONE: {"msg": 9, "code": "mismatch", "error": "x" * 4096},
    Kind.CANCEL: {"msg": 0},
    Kind.WRITE: {"epoch": 2**63 - 1, "slot": 2**32 - 1, "off": 4096, "seq": 7},
    Kind.EAGER: {
        "msg": 13,
        "job": "demo",
        "src": 1,
        "dst": 0,
        "tag": 4,
        "nbytes": 4096,
        "dtype": "uint8",
    },
    Kind.RTR: {
        "rtr": 3,
        "job": "demo",
        "src": 1,
        "dst": 0,
        "tag": 4,
        "nbytes": 2**30,
        "dtype": "float32",
    },
    Kind.COLL: {
        "job": "demo",
        "name": "allreduce:sync:grad",
        "r": 7,
        "t": 2,
        "off": 0,
        "lost": [3],
        "b": 5,
        "spec": {"kind": "allreduce", "count": 1024, "dtype": "float32", "op": "sum"},
    },
    Kind.UPDATE: {"job": "demo", "name": "svm", "src": 1, "dst": 2, "r": 3, "spec": SPEC},
    Kind.NOTIFY: {"job": "demo", "name": "svm", "src": 1, "dst": 2, "r": 3, "t": 0, "spec": SPEC},
    Kind.ACK: {"job": "demo", "name": "svm", "src": 2, "dst": 1, "r": 3},
    Kind.PUSH: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "it": 7,
        "b": 6,
        "ep": 0,
        "spec": PS_SPEC,
    },
    Kind.PULL: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "c": 8,
        "since": 6,
        "ep": 0,
        "spec": PS_SPEC,
    },
    Kind.PUSHED: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "it": 7,
        "ver": 9,
        "ep": 0,
        "drop": "delay",
    },
    Kind.PULLED: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "w": 3,
        "c": 8,
        "ver": 9,
        "ep": 0,
        "error": "not this epoch's server",
    },
    Kind.REPLICATE: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 1,
        "rep": 0,
        "ix": 12,
        "entry": "push",
        "w": 3,
        "it": 7,
        "b": 6,
        "spec": PS_SPEC,
    },
    Kind.REPLICATED: {"job": "demo", "name": "ps", "sh": 1, "srv": 1, "rep": 0, "ix": 12},
    Kind.JOIN: {"job": "demo", "name": "ps", "sh": 1, "srv": 1, "rep": 0, "ep": 2, "spec": PS_SPEC},
    Kind.OPENED: {"job": "demo", "name": "ps", "r": 3, "spec": PS_SPEC},
    Kind.MONITOR: {"up": 1.25e9, "down": 1.25e9, "rtt": 1e-4, "age": 0.0, "src": "measured"},
    Kind.READY: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 0,
        "w": 1,
        "it": 4,
        "b": 2,
        "ep": 0,
        "n": 4096,
        "norm": 1.5,
        "spec": PS_SPEC,
    },
    Kind.GATHER: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 0,
        "ep": 0,
        "grp": 3,
        "in": [[1, 4, 2], [2, 5, 2]],
        "wait": 0,
        "spec": PS_SPEC,
    },
    Kind.GRANT: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 0,
        "w": 1,
        "it": 4,
        "ep": 0,
        "wait": 1500,
    },
    Kind.PLAN: {
        "job": "demo",
        "name": "ps",
        "sh": 1,
        "srv": 3,
        "lead": 2,
        "in": [[1, 4, 1500, 800, None], [2, 5, 0, 0, "deadline passed"]],
    },
    Kind.PART: {
        "job": "demo",
        "name": "w",
        "src": 1,
        "dst": 2,
        "r": 4,
        "lo": 0,
        "c": 5,
        "e": 0,
        "n": 3,
        "spec": {"n": 3, "size": 8, "dtype": "float32", "lr": 0.5, "staleness": 1},
    },
    Kind.REQUEST: {
        "id": 1,
        "op": "send",
        "fds": 0,
        "seg": 1,
        "off": 0,
        "nbytes": 0,
        "dtype": "float64",
        "peer": 1,
        "tag": 0,
    },
    Kind.REPLY: {
        "id": 1,
        "ok": False,
        "code": "peer_failed",
        "error": "gone",
        "rank": None,
        "node": -1,
        "nested": {"a": [1, [2, [3, None]], b"", "", False]},
        "big": 2**64 - 1,
        "small": -(2**63),
    },
    Kind.EVENT: {"event": "closing", "code": "protocol", "error": "bad request"},
}

PAYLOADS = [b"", b"\x00", bytes(range(256)) * 3, b"\xab" * 70_000]


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: f"{len(p)}B")
@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_every_kind_round_trips(kind: Kind, payload: bytes) -> None:
    meta = SAMPLE_META[kind]
    data = encode(kind, meta, payload)
    assert data == encode_head(kind, meta, len(payload)) + payload

    [frame] = decode_frames(data)

    assert frame.kind is kind
    assert frame.flags == 0
    assert frame.meta == meta
    assert bytes(frame.payload) == payload
    assert encode(frame.kind, frame.meta, bytes(frame.payload)) == data  # same types, too


def test_header_layout_is_as_documented() -> None:
    data = encode(Kind.RTS, {"a": 1}, b"xyz")
    assert HEADER_SIZE == 20
    assert MAGIC == b"FBRC"
    assert PROTOCOL_VERSION == 16
    assert data[:20] == b"FBRC" + bytes([16, 6]) + b"\x00\x00" + (4).to_bytes(4, "big") + (
        3
    ).to_bytes(8, "big")
    assert data[20:24] == b"\x81\xa1a\x01"
    assert data[24:] == b"xyz"


def test_the_example_in_protocol_md() -> None:
    documented = "46 42 52 43 10 07 00 00 00 00 00 06 00 00 00 00 00 00 00 00 81 a3 6d 73 67 01"
    assert encode(Kind.CTS, {"msg": 1}) == bytes.fromhex(documented)


def test_kind_numbers_are_stable() -> None:
    assert {k.name: int(k) for k in Kind} == {
        "HELLO": 1,
        "AUTH": 2,
        "HEARTBEAT": 3,
        "BYE": 4,
        "ANNOUNCE": 5,
        "RTS": 6,
        "CTS": 7,
        "DATA": 8,
        "DONE": 9,
        "CANCEL": 10,
        "WRITE": 11,
        "EAGER": 12,
        "RTR": 13,
        "COLL": 14,
        "UPDATE": 15,
        "NOTIFY": 16,
        "ACK": 17,
        "PUSH": 18,
        "PULL": 19,
        "PUSHED": 20,
        "PULLED": 21,
        "REPLICATE": 22,
        "REPLICATED": 23,
        "JOIN": 24,
        "OPENED": 25,
        "MONITOR": 26,
        "READY": 27,
        "GRANT": 28,
        "GATHER": 29,
        "PLAN": 30,
        "PART": 31,
        "REQUEST": 32,
        "REPLY": 33,
        "EVENT": 34,
    }


def test_several_frames_in_one_feed_come_out_in_order() -> None:
    sent = [(k, SAMPLE_META[k], bytes([i]) * i) for i, k in enumerate(Kind)]
    frames = decode_frames(b"".join(encode(*f) for f in sent))
    assert [(f.kind, f.meta, bytes(f.payload)) for f in frames] == sent


def test_head_comes_before_the_payload_then_the_frame() -> None:
    payload = bytes(range(200))
    data = encode(Kind.DATA, {"msg": 1, "off": 0}, payload)
    decoder = Decoder()

    decoder.feed(data[:HEADER_SIZE])
    assert decoder.next_event() is NEED_DATA
    decoder.feed(data[HEADER_SIZE : len(data) - len(payload)])
    head = decoder.next_event()
    assert head == FrameHead(kind=Kind.DATA, flags=0, meta={"msg": 1, "off": 0}, payload_len=200)
    assert decoder.next_event() is NEED_DATA
    decoder.feed(data[-len(payload) : -1])
    assert decoder.next_event() is NEED_DATA
    decoder.feed(data[-1:])
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert bytes(frame.payload) == payload
    assert decoder.next_event() is NEED_DATA


def test_empty_payload() -> None:
    decoder = Decoder()
    decoder.feed(encode(Kind.CTS, {"msg": 4}))
    head, frame = drain(decoder)
    assert isinstance(head, FrameHead)
    assert head.payload_len == 0
    assert isinstance(frame, Frame)
    assert len(frame.payload) == 0
    assert frame.meta == {"msg": 4}
    assert decoder.buffered == 0


def test_short_input_returns_need_data_never_raises() -> None:
    data = encode(Kind.ANNOUNCE, SAMPLE_META[Kind.ANNOUNCE], b"abc")
    decoder = Decoder()
    assert decoder.next_event() is NEED_DATA
    seen: list[FrameHead | Frame] = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        seen += drain(decoder)
    assert [type(e) for e in seen] == [FrameHead, Frame]


# -- payloads landing in place --------------------------------------------------------------------


def test_set_payload_buffer_lands_the_payload_in_the_callers_buffer() -> None:
    payload = bytes(range(256)) * 40
    data = encode(Kind.DATA, {"msg": 1, "off": 0}, payload)
    segment = bytearray(b"\xee" * (len(payload) + 32))
    region = memoryview(segment)[16 : 16 + len(payload)]
    decoder = Decoder()

    decoder.feed(data[: len(data) - len(payload) + 100])  # some payload arrives with the head
    head = decoder.next_event()
    assert isinstance(head, FrameHead)
    decoder.set_payload_buffer(region)
    decoder.feed(data[len(data) - len(payload) + 100 :])
    frame = decoder.next_event()

    assert isinstance(frame, Frame)
    assert frame.payload is region
    assert bytes(region) == payload
    assert segment[:16] == b"\xee" * 16  # nothing written outside the region
    assert segment[-16:] == b"\xee" * 16


def test_set_payload_buffer_casts_typed_buffers_to_bytes() -> None:
    values = array.array("f", [1.5, -2.0, 3.25])
    data = encode(Kind.DATA, {"msg": 1, "off": 0}, values.tobytes())
    target = array.array("f", [0.0, 0.0, 0.0])
    decoder = Decoder()
    decoder.feed(data)
    assert isinstance(decoder.next_event(), FrameHead)
    decoder.set_payload_buffer(memoryview(target))
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert list(target) == [1.5, -2.0, 3.25]
    assert frame.payload.obj is target


@pytest.mark.parametrize(
    ("size", "readonly"), [(99, False), (101, False), (100, True)], ids=["short", "long", "ro"]
)
def test_set_payload_buffer_refuses_a_wrong_buffer(size: int, readonly: bool) -> None:
    decoder = Decoder()
    decoder.feed(encode(Kind.DATA, {"msg": 1, "off": 0}, bytes(100)))
    assert isinstance(decoder.next_event(), FrameHead)
    buffer = memoryview(bytes(size) if readonly else bytearray(size))
    with pytest.raises(LocalProtocolError, match="writable and 100 B"):
        decoder.set_payload_buffer(buffer)


def test_set_payload_buffer_only_right_after_a_head() -> None:
    decoder = Decoder()
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.set_payload_buffer(memoryview(bytearray(0)))
    decoder.feed(encode(Kind.DATA, {"msg": 1, "off": 0}, b"abcd"))
    assert isinstance(decoder.next_event(), FrameHead)
    decoder.set_payload_buffer(memoryview(bytearray(4)))
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.set_payload_buffer(memoryview(bytearray(4)))
    assert isinstance(decoder.next_event(), Frame)
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.set_payload_buffer(memoryview(bytearray(4)))


def read_like_tcp(
    decoder: Decoder, stream: bytes, read_size: int, *, supply: bool
) -> tuple[list[Frame], int]:
    """Play the TCP transport: the "kernel" writes into ``payload_target()`` when there is one.

    Returns the frames and how many bytes went straight into payload targets.
    """
    frames: list[Frame] = []
    supplied: memoryview | None = None
    pos = direct = 0
    while True:
        while (event := decoder.next_event()) is not NEED_DATA:
            if isinstance(event, Frame):
                assert supplied is None or event.payload is supplied
                frames.append(event)
                supplied = None
            elif supply and isinstance(event, FrameHead) and event.payload_len:
                supplied = memoryview(bytearray(event.payload_len))
                decoder.set_payload_buffer(supplied)
        if pos == len(stream):
            return frames, direct
        target = decoder.payload_target()
        if target is not None and len(target):
            n = min(len(target), read_size, len(stream) - pos)
            target[:n] = stream[pos : pos + n]  # recv_into(target)
            decoder.payload_written(n)
            direct += n
        else:
            n = min(read_size, len(stream) - pos)
            decoder.feed(stream[pos : pos + n])
        pos += n


@pytest.mark.parametrize("supply", [True, False], ids=["caller-buffer", "own-buffer"])
@pytest.mark.parametrize("read_size", [1, 7, 64, 4096, 1 << 20])
def test_payload_target_path(read_size: int, supply: bool) -> None:
    sent = [
        (Kind.DATA, {"msg": 1, "off": 0}, bytes(range(256)) * 64),
        (Kind.CTS, {"msg": 2}, b""),
        (Kind.DATA, {"msg": 1, "off": 16384}, b"\x01"),
        (Kind.DATA, {"msg": 3, "off": 0}, b"tail" * 1000),
    ]
    stream = b"".join(encode(*f) for f in sent)
    decoder = Decoder()

    frames, direct = read_like_tcp(decoder, stream, read_size, supply=supply)

    assert [(f.kind, f.meta, bytes(f.payload)) for f in frames] == sent
    if read_size < len(stream):
        assert direct > 0  # payload bytes went straight into the payload buffers
    else:
        assert direct == 0  # one read brought everything: nothing was left to read directly
    assert decoder.buffered == 0


def test_payload_target_is_the_rest_of_the_callers_buffer() -> None:
    payload = b"0123456789"
    data = encode(Kind.DATA, {"msg": 1, "off": 0}, payload)
    decoder = Decoder()
    assert decoder.payload_target() is None  # no payload under way
    decoder.feed(data[: -len(payload)])
    assert isinstance(decoder.next_event(), FrameHead)
    region = memoryview(bytearray(10))
    decoder.set_payload_buffer(region)

    target = decoder.payload_target()
    assert target is not None
    assert len(target) == 10
    target[:4] = payload[:4]
    decoder.payload_written(4)
    assert decoder.next_event() is NEED_DATA
    rest = decoder.payload_target()
    assert rest is not None
    assert len(rest) == 6
    rest[:] = payload[4:]
    decoder.payload_written(6)

    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert frame.payload is region
    assert bytes(region) == payload
    assert decoder.payload_target() is None


def test_payload_target_is_none_while_bytes_wait_in_the_buffer() -> None:
    data = encode(Kind.DATA, {"msg": 1, "off": 0}, b"abcdef")
    decoder = Decoder()
    decoder.feed(data[:-3])  # the head plus 3 payload bytes, in one read
    assert isinstance(decoder.next_event(), FrameHead)
    assert decoder.buffered == 3
    assert decoder.payload_target() is None  # those 3 bytes must land first
    assert decoder.next_event() is NEED_DATA  # ... which next_event() does
    assert decoder.buffered == 0
    target = decoder.payload_target()
    assert target is not None
    assert len(target) == 3
    target[:] = b"def"
    decoder.payload_written(3)
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert bytes(frame.payload) == b"abcdef"


def test_payload_written_refuses_more_than_the_target() -> None:
    decoder = Decoder()
    with pytest.raises(LocalProtocolError, match="payload_target"):
        decoder.payload_written(1)
    decoder.feed(encode(Kind.DATA, {"msg": 1, "off": 0}, b"abc")[:-3])
    assert isinstance(decoder.next_event(), FrameHead)
    target = decoder.payload_target()
    assert target is not None
    with pytest.raises(LocalProtocolError, match="payload_target"):
        decoder.payload_written(4)
    with pytest.raises(LocalProtocolError, match="payload_target"):
        decoder.payload_written(-1)


# -- limits checked at header time ---------------------------------------------------------------


@pytest.mark.parametrize(
    "payload_len", [DEFAULT_LIMITS.max_payload + 1, 4 << 30, 2**64 - 1], ids=str
)
def test_huge_payload_is_rejected_from_the_header_alone(payload_len: int) -> None:
    decoder = Decoder()
    decoder.feed(header(Kind.DATA, meta_len=10, payload_len=payload_len))
    with pytest.raises(RemoteProtocolError, match=f"payload of {payload_len} B exceeds"):
        decoder.next_event()
    assert_dead(decoder)


@pytest.mark.parametrize("meta_len", [DEFAULT_LIMITS.max_meta + 1, 2**32 - 1], ids=str)
def test_huge_metadata_is_rejected_from_the_header_alone(meta_len: int) -> None:
    decoder = Decoder()
    decoder.feed(header(Kind.HEARTBEAT, meta_len=meta_len))
    with pytest.raises(RemoteProtocolError, match=f"metadata of {meta_len} B exceeds"):
        decoder.next_event()
    assert_dead(decoder)


def test_lengths_exactly_at_the_limits_are_accepted() -> None:
    limits = DEFAULT_LIMITS
    meta = {"b": bytes(limits.max_meta - 6)}  # fixmap + fixstr "b" + bin16 header = 6 B
    head = encode_head(Kind.REPLY, meta)
    assert len(head) == HEADER_SIZE + limits.max_meta
    [frame] = decode_frames(head)
    assert frame.meta == meta

    decoder = Decoder(Limits(max_payload=5))
    decoder.feed(encode_head(Kind.DATA, {}, 5) + b"12345")
    assert [type(e) for e in drain(decoder)] == [FrameHead, Frame]


def test_handshake_limits() -> None:
    hello = {"v": 1, "node": 1, "inc": 2**62, "nonce": bytes(32), "channel": "control"}
    hello["name"] = "n" * 255  # the longest node name (MAX_NAME bytes)
    [frame] = decode_frames(encode(Kind.HELLO, hello), HANDSHAKE_LIMITS)
    assert frame.meta == hello
    assert HANDSHAKE_LIMITS.max_meta == 768
    assert_rejected(header(Kind.HELLO, meta_len=769), HANDSHAKE_LIMITS, "metadata of 769 B")
    assert_rejected(header(Kind.AUTH, meta_len=3, payload_len=1), HANDSHAKE_LIMITS, "payload")
    for kind in set(Kind) - {Kind.HELLO, Kind.AUTH}:
        assert_rejected(encode(kind, {}), HANDSHAKE_LIMITS, f"{kind.name} is not allowed")
    assert_rejected(encode(Kind.HELLO, {"s": "x" * 256}), HANDSHAKE_LIMITS, "malformed")
    assert_rejected(encode(Kind.HELLO, {"a": list(range(9))}), HANDSHAKE_LIMITS, "malformed")


def test_client_socket_limits() -> None:
    assert_rejected(encode(Kind.REPLY, {}), REQUEST_LIMITS, "REPLY is not allowed")
    assert_rejected(encode(Kind.HELLO, {}), REQUEST_LIMITS, "HELLO is not allowed")
    assert_rejected(header(Kind.REQUEST, 3, payload_len=1), REQUEST_LIMITS, "payload of 1 B")
    assert_rejected(header(Kind.REQUEST, 16 * 1024 + 1), REQUEST_LIMITS, "metadata of 16385 B")
    assert_rejected(encode(Kind.REQUEST, {}), REPLY_LIMITS, "REQUEST is not allowed")
    big_status = {"peers": [{"node": i, "state": "up"} for i in range(5000)]}
    [frame] = decode_frames(encode_head(Kind.REPLY, big_status, limits=REPLY_LIMITS), REPLY_LIMITS)
    assert frame.meta == big_status


# -- malformed headers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [0, 35, 255])
def test_unknown_kind(kind: int) -> None:
    assert_rejected(header(kind, 1) + b"\x80", match=f"unknown frame kind {kind}")


@pytest.mark.parametrize(
    "start", [b"X", b"F\x00", b"FBRX", b"fbrc", b"GET / HTTP/1.1\r\n", b"\x16\x03\x01\x02\x00"]
)
def test_bad_magic_is_detected_from_the_first_bytes(start: bytes) -> None:
    assert len(start) < HEADER_SIZE
    assert_rejected(start, match="bad magic")


def test_bad_magic_in_a_full_header() -> None:
    assert_rejected(header(magic=b"FBRD") + b"\x80", match="bad magic")


def test_a_prefix_of_the_magic_waits_for_more() -> None:
    for n in range(HEADER_SIZE):
        decoder = Decoder()
        decoder.feed(header(Kind.CTS)[:n])
        assert decoder.next_event() is NEED_DATA


@pytest.mark.parametrize("version", [0, 1, 2, 5, 15, 255])
def test_wrong_version(version: int) -> None:
    assert_rejected(header(version=version) + b"\x80", match=f"protocol version {version}")


@pytest.mark.parametrize("flags", [4, 0x8000, 0xFFFF])
def test_undefined_flag_bits(flags: int) -> None:
    assert_rejected(header(flags=flags) + b"\x80", match="undefined flag bits")


@pytest.mark.parametrize("flags", [1, 2, 3])
def test_a_sealed_frame_is_refused_where_no_keys_are(flags: int) -> None:
    # the client socket and a link in its handshake have no opener: integrity flags there
    # are a peer's mistake, refused before the metadata is read
    assert_rejected(header(flags=flags) + b"\x80", match="no session keys")


def test_kind_not_in_the_limits() -> None:
    limits = Limits(kinds=frozenset({Kind.RTS}))
    [frame] = decode_frames(encode(Kind.RTS, {}), limits)
    assert frame.kind is Kind.RTS
    assert_rejected(encode(Kind.CTS, {}), limits, "CTS is not allowed")


def test_frames_before_the_bad_one_are_delivered() -> None:
    decoder = Decoder()
    decoder.feed(encode(Kind.CTS, {"msg": 1}) + header(version=17) + b"\x80")
    assert isinstance(decoder.next_event(), FrameHead)
    assert isinstance(decoder.next_event(), Frame)
    with pytest.raises(RemoteProtocolError, match="version 17"):
        decoder.next_event()
    assert_dead(decoder)


# -- malformed metadata --------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"\x81\xa1a" + b"\x91" * depth + b"\xc0"  # {"a": [[[...[nil]...]]]}


BAD_META = {
    "not-a-map-list": meta_bytes([1, 2]),
    "not-a-map-int": meta_bytes(7),
    "not-a-map-nil": meta_bytes(None),
    "not-a-map-str": meta_bytes("k"),
    "int-key": meta_bytes({1: 2}),
    "bytes-key": meta_bytes({b"k": 2}),
    "nested-int-key": meta_bytes({"a": {1: 2}}),
    "fixext1": b"\x81\xa1a\xd4\x05\x00",
    "fixext16": b"\x81\xa1a\xd8\x01" + bytes(16),
    "ext8-empty": b"\x81\xa1a\xc7\x00\x05",
    "ext8-empty-in-list": b"\x81\xa1a\x91\xc7\x00\x7f",
    "ext16-empty": b"\x81\xa1a\xc8\x00\x00\x05",
    "ext32-empty": b"\x81\xa1a\xc9\x00\x00\x00\x00\x80",
    "ext8": b"\x81\xa1a\xc7\x03\x05abc",
    "ext32": b"\x81\xa1a\xc9\x00\x00\x00\x01\x05a",
    "timestamp32": b"\x81\xa1a\xd6\xff\x00\x00\x00\x01",
    "timestamp-empty": b"\x81\xa1a\xc7\x00\xff",
    "str-too-long": meta_bytes({"a": "x" * 4097}),
    "key-too-long": meta_bytes({"k" * 4097: 1}),
    "array-too-long": meta_bytes({"a": [0] * 1025}),
    "map-too-long": meta_bytes({str(i): i for i in range(257)}),
    "nested-map-too-long": meta_bytes({"a": {str(i): i for i in range(257)}}),
    "bin-longer-than-meta": b"\x81\xa1a\xc6\xff\xff\xff\xff",
    "str-header-only": b"\x81\xa1a\xdb\xff\xff\xff\xff",
    "array32-header-only": b"\x81\xa1a\xdd\xff\xff\xff\xff",
    "deep-nesting": nested(2000),
    "deep-nesting-maps": b"\x81\xa1a" * 2000 + b"\xc0",
    "empty": b"",
    "truncated": meta_bytes({"abc": 1})[:-1],
    "trailing-bytes": meta_bytes({"a": 1}) + b"\x00",
    "two-maps": meta_bytes({}) + meta_bytes({}),
    "reserved-byte": b"\x81\xa1a\xc1",
    "bad-utf8": b"\x81\xa1a\xa2\xff\xfe",
    "bad-utf8-key": b"\x81\xa2\xc3\x28\x01",
}


@pytest.mark.parametrize("meta", list(BAD_META.values()), ids=list(BAD_META))
def test_malformed_metadata(meta: bytes) -> None:
    assert_rejected(raw_frame(meta), match="malformed metadata|map with string keys")


def test_limits_on_strings_arrays_and_maps_are_configurable() -> None:
    limits = Limits(max_str=3, max_array=2, max_map=2)
    [frame] = decode_frames(encode(Kind.REPLY, {"abc": [1, 2], "d": "xyz"}), limits)
    assert frame.meta == {"abc": [1, 2], "d": "xyz"}
    assert_rejected(encode(Kind.REPLY, {"a": "wxyz"}), limits, "malformed")
    assert_rejected(encode(Kind.REPLY, {"abcd": 1}), limits, "malformed")
    assert_rejected(encode(Kind.REPLY, {"a": [1, 2, 3]}), limits, "malformed")
    assert_rejected(encode(Kind.REPLY, {"a": 1, "b": 2, "c": 3}), limits, "malformed")


def test_deep_nesting_is_reported_with_a_reason() -> None:
    decoder = Decoder()
    decoder.feed(raw_frame(nested(5000)))
    with pytest.raises(RemoteProtocolError, match=r"malformed metadata: \S"):
        decoder.next_event()


def test_moderate_nesting_is_accepted() -> None:
    [frame] = decode_frames(raw_frame(nested(100)))
    value = frame.meta["a"]
    for _ in range(100):
        assert isinstance(value, list)
        [value] = value
    assert value is None


def test_protocol_errors_are_value_errors() -> None:
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(ProtocolError, ValueError)
    decoder = Decoder()
    decoder.feed(b"junk")
    with pytest.raises(ValueError, match="bad magic"):
        decoder.next_event()


# -- encoding refuses what the decoder would refuse ----------------------------------------------


def test_encode_head_refuses_oversize_metadata() -> None:
    with pytest.raises(LocalProtocolError, match="metadata of"):
        encode_head(Kind.REPLY, {"b": bytes(DEFAULT_LIMITS.max_meta)})
    with pytest.raises(LocalProtocolError, match="metadata of"):
        encode_head(Kind.HELLO, {"b": bytes(800)}, limits=HANDSHAKE_LIMITS)


def test_encode_head_refuses_oversize_payload() -> None:
    encode_head(Kind.DATA, {}, DEFAULT_LIMITS.max_payload)
    with pytest.raises(LocalProtocolError, match="payload of"):
        encode_head(Kind.DATA, {}, DEFAULT_LIMITS.max_payload + 1)
    with pytest.raises(LocalProtocolError, match="payload of"):
        encode_head(Kind.DATA, {}, -1)
    with pytest.raises(LocalProtocolError, match="payload of 1 B exceeds 0 B"):
        encode_head(Kind.HELLO, {}, 1, limits=HANDSHAKE_LIMITS)


@pytest.mark.parametrize("flags", [4, 0x100, 0xFFFF])
def test_encode_head_refuses_undefined_flags(flags: int) -> None:
    with pytest.raises(LocalProtocolError, match="undefined flag bits"):
        encode_head(Kind.HEARTBEAT, {}, flags=flags)


def test_encode_head_packs_as_msgpack_does_and_survives_a_failed_pack() -> None:
    # encode_head keeps one msgpack Packer per thread: a pack that fails halfway must leave
    # nothing behind for the next frame
    metas: list[dict[str, object]] = [
        {"id": 1, "op": "send", "fds": 0, "seg": 1, "off": 64, "dtype": "float32", "tag": 0},
        {"id": 2, "op": "status", "fds": 0, "nested": {"a": [1, 2, b"x"]}},
        {},
    ]
    for meta in metas:
        assert encode_head(Kind.REQUEST, meta)[HEADER_SIZE:] == msgpack.packb(meta)
    with pytest.raises(TypeError):
        encode_head(Kind.REQUEST, {"x": [1, object()]})  # fails halfway through packing
    assert encode_head(Kind.REQUEST, metas[0])[HEADER_SIZE:] == msgpack.packb(metas[0])


def test_encode_head_keeps_no_large_buffer_after_large_or_refused_metadata() -> None:
    tracemalloc.start()
    try:
        encode_head(Kind.REPLY, {"x": 1})
        before = tracemalloc.get_traced_memory()[0]
        encode_head(Kind.REPLY, {"big": b"x" * (4 << 20)}, limits=Limits(max_meta=8 << 20))
        with pytest.raises(LocalProtocolError, match="metadata of"):
            encode_head(Kind.REPLY, {"big": b"x" * (16 << 20)})  # refused after packing
        with pytest.raises(TypeError):
            encode_head(Kind.REPLY, {"big": b"x" * (4 << 20), "then": object()})  # fails late
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, f"{held} B still held after packing large metadata"
    assert encode_head(Kind.REPLY, {"x": 1})[HEADER_SIZE:] == msgpack.packb({"x": 1})


def test_limits_must_be_sane() -> None:
    with pytest.raises(ValueError, match="positive"):
        Limits(max_meta=0)
    with pytest.raises(ValueError, match="positive"):
        Limits(max_map=0)
    with pytest.raises(ValueError, match="max_payload"):
        Limits(max_payload=-1)
    assert Limits(max_payload=0).max_payload == 0


def test_default_limits() -> None:
    documented = Limits(
        max_meta=65536, max_payload=64 << 20, max_str=4096, max_array=1024, max_map=256
    )
    assert documented == DEFAULT_LIMITS
    assert DEFAULT_LIMITS.kinds == frozenset(Kind)


# -- typed field access --------------------------------------------------------------------------


def test_get_int() -> None:
    meta = {"a": 5, "neg": -1, "big": 2**63, "t": True, "f": 1.0, "s": "5", "n": None}
    assert get_int(meta, "a") == 5
    assert get_int(meta, "a", lo=5, hi=5) == 5
    assert get_int(meta, "neg", lo=-1) == -1
    for key in ("neg", "big", "t", "f", "s", "n", "missing"):
        with pytest.raises(RemoteProtocolError, match=f"field '{key}' must be an integer"):
            get_int(meta, key)
    with pytest.raises(RemoteProtocolError, match=r"in \[0, 4\]"):
        get_int(meta, "a", hi=4)
    with pytest.raises(RemoteProtocolError, match=r"in \[6, "):
        get_int(meta, "a", lo=6)


def test_get_str() -> None:
    meta = {"s": "job", "e": "", "b": b"job", "i": 1}
    assert get_str(meta, "s") == "job"
    for key in ("e", "b", "i", "missing"):
        with pytest.raises(RemoteProtocolError, match=f"field '{key}' must be a non-empty string"):
            get_str(meta, key)


def test_get_bytes() -> None:
    meta = {"b": b"\x00\x01", "e": b"", "s": "ab", "ba": bytearray(b"ab"), "l": [1]}
    assert get_bytes(meta, "b") == b"\x00\x01"
    assert get_bytes(meta, "e") == b""
    for key in ("s", "ba", "l", "missing"):
        with pytest.raises(RemoteProtocolError, match=f"field '{key}' must be binary"):
            get_bytes(meta, key)


def test_field_access_on_decoded_metadata() -> None:
    [frame] = decode_frames(encode(Kind.RTS, SAMPLE_META[Kind.RTS]))
    assert get_int(frame.meta, "tag", hi=2**31) == 2**31
    assert get_str(frame.meta, "job") == "jöb-ü€"
    [frame] = decode_frames(encode(Kind.AUTH, {"mac": b"\x01" * 32, "ranks": [3, 1]}))
    assert get_bytes(frame.meta, "mac") == b"\x01" * 32


@pytest.mark.parametrize("read_size", [13, 4096, 1 << 20])
def test_a_discarded_payload_is_read_and_dropped_without_an_allocation(read_size: int) -> None:
    big = 2 << 20
    stream = encode(Kind.DATA, {"i": 0}, b"x" * big) + encode(Kind.DATA, {"i": 1}, b"after")
    decoder = Decoder()
    frames: list[Frame] = []
    tracemalloc.start()
    try:
        for start in range(0, len(stream), read_size):
            decoder.feed(memoryview(stream)[start : start + read_size])
            while (event := decoder.next_event()) is not NEED_DATA:
                if isinstance(event, FrameHead) and event.meta["i"] == 0:
                    decoder.discard_payload()
                    assert decoder.payload_target() is None  # read through the caller's buffer
                elif isinstance(event, Frame):
                    frames.append(event)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(f.meta["i"], bytes(f.payload)) for f in frames] == [(0, b""), (1, b"after")]
    assert peak < big // 4 + 2 * read_size  # nothing of the payload's size was allocated


def test_discard_payload_only_right_after_a_head() -> None:
    decoder = Decoder()
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.discard_payload()
    decoder.feed(encode_head(Kind.DATA, {"msg": 1, "off": 0}, 4))
    assert isinstance(decoder.next_event(), FrameHead)
    decoder.discard_payload()
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.discard_payload()
    with pytest.raises(LocalProtocolError, match="must follow a FrameHead"):
        decoder.set_payload_buffer(memoryview(bytearray(4)))


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "allgather", "count": 7, "dtype": "int64"},
        {"kind": "reduce_scatter", "count": 7, "dtype": "float16", "op": "avg"},
    ],
)
def test_a_coll_frame_carries_an_allgather_or_reduce_scatter_spec(spec: dict[str, Any]) -> None:
    """Issue 30: the two native collectives are new values of COLL's ``spec.kind`` (no new
    field, no new frame kind); a partial one is malformed (protocol.md §3.6)."""
    meta = {**SAMPLE_META[Kind.COLL], "spec": spec}
    (frame,) = decode_frames(encode(Kind.COLL, meta, b"\0" * 8))
    coll = Coll.from_meta(frame.meta)
    assert Spec.from_meta(coll.spec) == Spec(**spec)
    with pytest.raises(RemoteProtocolError, match="invalid"):
        Spec.from_meta({**spec, "mode": "solo"})
