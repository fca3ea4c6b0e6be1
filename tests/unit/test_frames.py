"""Typed views of peer and handshake frame metadata: what each kind carries, read at the edge."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd import frames
from fabricd.engines.handshake import HANDSHAKE_LIMITS
from fabricd.errors import RemoteProtocolError
from fabricd.wire import DEFAULT_LIMITS, PROTOCOL_VERSION, Decoder, Frame, Kind, Meta, encode

EXAMPLES: list[frames.PeerFrame] = [
    frames.Heartbeat(),
    frames.Bye(),
    frames.Announce(job="j", rank=3, size=4, present=True, owner=1000),
    frames.Announce(job="j", rank=3, size=4, present=False, owner=0),
    frames.Rts(msg=1, job="j", src=0, dst=3, tag=7, nbytes=64, dtype="float32"),
    frames.Cts(msg=1),
    frames.Data(msg=1, off=4096),
    frames.Done(msg=1),
    frames.Done(msg=1, code="mismatch", error="sizes differ"),
    frames.Cancel(msg=9),
]


NONCE = b"n" * frames.NONCE_SIZE
HANDSHAKE_EXAMPLES: list[frames.HandshakeFrame] = [
    frames.Hello(node=0, incarnation=7, nonce=NONCE, channel="control"),  # the initiator's
    frames.Hello(node=1, incarnation=9, nonce=NONCE, mac=b"m" * 32),  # the acceptor's
    frames.Auth(mac=b"m" * 32),
]
#: a well-formed HELLO's metadata, for the malformed ones below
HELLO_META: Meta = {"v": PROTOCOL_VERSION, "node": 0, "inc": 1, "nonce": NONCE}


def without(meta: Meta, key: str) -> Meta:
    return {k: v for k, v in meta.items() if k != key}


def over_the_wire(frame: frames.PeerFrame) -> frames.PeerFrame:
    decoder = Decoder(DEFAULT_LIMITS)
    decoder.feed(encode(frame.KIND, frame.to_meta()))
    decoder.next_event()
    decoded = decoder.next_event()
    assert isinstance(decoded, Frame)
    return frames.parse(decoded.kind, decoded.meta)


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_every_view_survives_the_wire(frame: frames.PeerFrame) -> None:
    assert over_the_wire(frame) == frame


def handshake_over_the_wire(frame: frames.HandshakeFrame) -> frames.HandshakeFrame:
    """Through the codec under the limits of a link not yet authenticated, then parsed."""
    decoder = Decoder(HANDSHAKE_LIMITS)
    decoder.feed(encode(frame.KIND, frame.to_meta()))
    decoder.next_event()
    decoded = decoder.next_event()
    assert isinstance(decoded, Frame)
    return frames.parse_handshake(decoded.kind, decoded.meta)


@pytest.mark.parametrize("frame", HANDSHAKE_EXAMPLES, ids=["hello-i", "hello-a", "auth"])
def test_every_handshake_view_survives_the_wire(frame: frames.HandshakeFrame) -> None:
    assert handshake_over_the_wire(frame) == frame


def test_every_peer_kind_but_the_handshake_has_a_view() -> None:
    peer_kinds = {k for k in Kind if k < Kind.REQUEST} - {Kind.HELLO, Kind.AUTH}
    assert peer_kinds == frames.PEER_KINDS


def test_handshake_kinds_are_read_apart_from_the_peer_kinds() -> None:
    assert {Kind.HELLO, Kind.AUTH} == frames.HANDSHAKE_KINDS
    assert not frames.HANDSHAKE_KINDS & frames.PEER_KINDS


@pytest.mark.parametrize("kind", sorted(frames.PEER_KINDS | {Kind.REQUEST, Kind.REPLY}))
def test_parse_handshake_refuses_every_other_kind(kind: Kind) -> None:
    with pytest.raises(RemoteProtocolError, match="not a handshake frame"):
        frames.parse_handshake(kind, {})


def test_a_hello_of_another_protocol_version_names_both() -> None:
    meta = frames.Hello(version=PROTOCOL_VERSION + 1, node=0, incarnation=1, nonce=NONCE).to_meta()
    with pytest.raises(RemoteProtocolError, match=f"protocol {PROTOCOL_VERSION + 1}, this daemon"):
        frames.parse_handshake(Kind.HELLO, meta)


@pytest.mark.parametrize(
    ("kind", "meta", "message"),
    [
        (Kind.HELLO, without(HELLO_META, "nonce"), "'nonce'"),
        (Kind.HELLO, {**HELLO_META, "nonce": b"short"}, "nonce has the wrong size"),
        (Kind.HELLO, {**HELLO_META, "node": -1}, "'node'"),
        (Kind.HELLO, without(HELLO_META, "inc"), "'inc'"),
        (Kind.HELLO, without(HELLO_META, "v"), "'v'"),
        (Kind.HELLO, {**HELLO_META, "channel": 1}, "'channel'"),
        (Kind.HELLO, {**HELLO_META, "mac": "m"}, "'mac'"),
        (Kind.AUTH, {}, "'mac'"),
        (Kind.AUTH, {"mac": "not bytes"}, "'mac'"),
    ],
)
def test_a_bad_handshake_field_is_a_remote_protocol_error_naming_it(
    kind: Kind, meta: Meta, message: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        frames.parse_handshake(kind, meta)


@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.AUTH, Kind.REQUEST, Kind.REPLY, Kind.EVENT])
def test_kinds_a_peer_may_not_send_are_refused(kind: Kind) -> None:
    with pytest.raises(RemoteProtocolError, match="not a frame a peer may send"):
        frames.parse(kind, {})


@pytest.mark.parametrize(
    ("kind", "meta", "field"),
    [
        (Kind.RTS, {"msg": 1, "job": "j", "src": 0, "dst": 1, "tag": 0, "nbytes": 4}, "dtype"),
        (Kind.RTS, {"msg": -1, "job": "j", "src": 0, "dst": 1, "tag": 0, "nbytes": 4}, "msg"),
        (Kind.ANNOUNCE, {"job": "j", "rank": 0, "size": 0, "present": True}, "size"),
        (Kind.ANNOUNCE, {"job": 5, "rank": 0, "size": 1}, "job"),
        (Kind.CTS, {"msg": "1"}, "msg"),
        (Kind.DATA, {"msg": 1}, "off"),
        (Kind.DONE, {"msg": 1, "code": "x"}, "error"),
        (Kind.CANCEL, {}, "msg"),
    ],
)
def test_a_bad_field_is_a_remote_protocol_error_naming_it(
    kind: Kind, meta: dict, field: str
) -> None:
    with pytest.raises(RemoteProtocolError, match=field):
        frames.parse(kind, meta)


def test_a_done_carries_code_and_error_together() -> None:
    with pytest.raises(ValueError, match="both"):
        frames.Done(msg=1, code="mismatch")


@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=8))
def test_parse_gives_a_view_of_its_kind_or_a_remote_protocol_error(meta: dict) -> None:
    for kind in frames.PEER_KINDS:
        try:
            view: frames.PeerFrame | None = frames.parse(kind, meta)
        except RemoteProtocolError:
            view = None
        assert view is None or view.KIND is kind
