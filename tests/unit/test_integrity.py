"""Sealed frames (RELIABILITY S4): a :class:`Sealer` and an :class:`Opener` through the decoder.

Frames are sealed as a link seals them (``flags`` into the header, the trailer after the
payload) and decoded by a real :class:`~fabricd.wire.Decoder` holding the opener, fed in
whatever chunks hypothesis picks, so the trailer, the counters and the payload MAC are checked
on every path the decoder has: buffered, in place, and dropped unread.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.errors import RemoteProtocolError
from fabricd.integrity import (
    FLAG_PAYLOAD_MAC,
    FLAG_SEALED,
    KEY_SIZE,
    TRAILER_SIZE,
    IntegrityError,
    Opener,
    Sealer,
)
from fabricd.wire import HEADER_SIZE, NEED_DATA, Decoder, Frame, FrameHead, Kind, encode_head

KEY = bytes(range(KEY_SIZE))
OTHER = bytes(KEY_SIZE)


def sealed(sealer: Sealer, kind: Kind, meta: dict[str, object], payload: bytes = b"") -> bytes:
    """One frame as a secured link sends it."""
    head = encode_head(kind, meta, len(payload), flags=sealer.flags(kind))
    return head + payload + sealer.seal(kind, head, [payload])


def decoder(*, key: bytes = KEY, require_data: bool = False) -> Decoder:
    dec = Decoder()
    dec.opener = Opener(key, require_data=require_data)
    return dec


def drain(dec: Decoder, *, discard: bool = False) -> list[Frame]:
    """Every whole frame the decoder has; payloads dropped unread if ``discard``."""
    out: list[Frame] = []
    while (event := dec.next_event()) is not NEED_DATA:
        if isinstance(event, Frame):
            out.append(event)
        elif isinstance(event, FrameHead) and event.payload_len and discard:
            dec.discard_payload()
    return out


def feed_all(
    dec: Decoder, chunks: list[bytes], *, discard: bool = False
) -> tuple[list[Frame], RemoteProtocolError | None]:
    """Feed ``chunks`` one by one; the frames delivered, and the error that ended it if any."""
    out: list[Frame] = []
    try:
        for chunk in chunks:
            dec.feed(chunk)
            out += drain(dec, discard=discard)
    except RemoteProtocolError as exc:
        return out, exc
    return out, None


def stream(*frames: tuple[Kind, dict[str, object], bytes], cover_data: bool = True) -> list[bytes]:
    sealer = Sealer(KEY, cover_data=cover_data)
    return [sealed(sealer, kind, meta, payload) for kind, meta, payload in frames]


CTS = (Kind.CTS, {"msg": 1}, b"")
ANNOUNCE = (Kind.ANNOUNCE, {"job": "j", "rank": 3, "size": 4, "present": True, "owner": 0}, b"")
DATA = (Kind.DATA, {"msg": 1, "off": 0}, bytes(range(200)))


# -- what passes ----------------------------------------------------------------------------
@given(cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=12), discard=st.booleans())
def test_sealed_frames_pass_in_any_chunks(cuts: list[int], discard: bool) -> None:
    data = b"".join(stream(CTS, DATA, ANNOUNCE, DATA))
    dec = decoder(require_data=True)
    frames: list[Frame] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        dec.feed(data[start : max(start, cut)])
        start = max(start, cut)
        frames += drain(dec, discard=discard)
    assert [f.kind for f in frames] == [Kind.CTS, Kind.DATA, Kind.ANNOUNCE, Kind.DATA]
    assert all(f.flags == FLAG_SEALED | FLAG_PAYLOAD_MAC for f in frames)
    if not discard:
        assert bytes(frames[1].payload) == DATA[2]
    assert dec.opener is not None
    assert dec.opener.seq == 4


def test_a_payload_written_in_place_is_checked_after_it_landed() -> None:
    (frame,) = stream(DATA)
    dec = decoder(require_data=True)
    head_len = len(frame) - len(DATA[2]) - TRAILER_SIZE
    dec.feed(frame[:head_len])
    assert isinstance(dec.next_event(), FrameHead)
    landing = bytearray(len(DATA[2]))
    dec.set_payload_buffer(memoryview(landing))
    target = dec.payload_target()
    assert target is not None
    target[:] = frame[head_len : head_len + len(landing)]  # as the kernel writes it
    dec.payload_written(len(landing))
    assert dec.next_event() is NEED_DATA  # no frame before its trailer
    dec.feed(frame[-TRAILER_SIZE:])
    event = dec.next_event()
    assert isinstance(event, Frame)
    assert bytes(landing) == DATA[2]


def test_data_without_payload_mac_passes_a_receiver_that_does_not_ask_for_it() -> None:
    dec = decoder(require_data=False)
    for frame in stream(DATA, CTS, cover_data=False):
        dec.feed(frame)
    frames = drain(dec)
    assert frames[0].flags == FLAG_SEALED  # the DATA frame's payload is not covered
    assert frames[1].flags == FLAG_SEALED | FLAG_PAYLOAD_MAC  # a control frame always is


# -- what is rejected -----------------------------------------------------------------------
def rejected(data: bytes, match: str, **opener: bool) -> None:
    dec = decoder(**opener)
    _, error = feed_all(dec, [data])
    assert isinstance(error, IntegrityError)
    assert re.search(match, str(error)), error
    with pytest.raises(RemoteProtocolError, match="already failed"):
        dec.next_event()  # dead: the link must be closed


def test_a_replayed_frame_is_rejected() -> None:
    first, second = stream(CTS, ANNOUNCE)
    rejected(first + second + second, "frame number 1 where 2 was due")
    rejected(first + first, "frame number 0 where 1 was due")


def test_reordered_frames_are_rejected() -> None:
    first, second = stream(CTS, ANNOUNCE)
    rejected(second + first, "frame number 1 where 0 was due")


def test_an_injected_unsealed_frame_is_rejected() -> None:
    (first,) = stream(CTS)
    forged = encode_head(*ANNOUNCE[:2])
    rejected(first + forged, "unsealed ANNOUNCE")


def test_a_frame_sealed_under_another_key_is_rejected() -> None:
    """An attacker who sealed with a key of their own (or of another link) gets nowhere."""
    forged = sealed(Sealer(OTHER, cover_data=True), *ANNOUNCE)
    rejected(forged, "frame 0 was altered")


def test_a_frame_of_the_other_direction_is_rejected() -> None:
    """What a node sent, reflected back to it, does not open under its receive key."""
    reflected = sealed(Sealer(KEY, cover_data=True), *CTS)
    _, error = feed_all(decoder(key=OTHER), [reflected])
    assert isinstance(error, IntegrityError)
    assert "altered" in str(error)


def test_a_receiver_that_asks_for_data_integrity_refuses_uncovered_data() -> None:
    (frame,) = stream(DATA, cover_data=False)
    rejected(frame, "does not cover its payload.*data_integrity", require_data=True)


def test_a_control_frame_must_cover_its_payload() -> None:
    sealer = Sealer(KEY, cover_data=False)
    head = encode_head(Kind.CTS, {"msg": 1}, 0, flags=FLAG_SEALED)  # PAYLOAD_MAC cleared
    rejected(head + sealer.seal(Kind.CTS, head, []), "CTS frame whose MAC does not cover")


@given(st.data())
def test_one_flipped_bit_anywhere_is_never_accepted(data: st.DataObject) -> None:
    """Header, metadata, payload or trailer: the frame is refused (whatever the first check
    that notices), never handed on with other bytes than were sealed."""
    frames = stream(CTS, DATA, ANNOUNCE)
    which = data.draw(st.integers(0, len(frames) - 1))
    bit = data.draw(st.integers(0, len(frames[which]) * 8 - 1))
    discard = data.draw(st.booleans())
    tampered = bytearray(frames[which])
    tampered[bit // 8] ^= 1 << (bit % 8)
    frames[which] = bytes(tampered)
    dec = decoder(require_data=True)
    delivered, error = feed_all(dec, frames, discard=discard)
    assert len(delivered) == which  # every frame before the altered one, none from it on
    # refused, or (a length made larger) still waiting for bytes that will never make it whole
    assert error is not None or dec.mid_frame


def test_a_flipped_mac_bit_is_rejected() -> None:
    (frame,) = stream(ANNOUNCE)
    tampered = bytearray(frame)
    tampered[-1] ^= 0x01
    rejected(bytes(tampered), "frame 0 was altered")


def test_a_flipped_bit_in_a_dropped_payload_is_still_caught() -> None:
    (frame,) = stream(DATA)
    tampered = bytearray(frame)
    tampered[-TRAILER_SIZE - 1] ^= 0x80  # the payload's last byte, read and dropped
    delivered, error = feed_all(decoder(require_data=True), [bytes(tampered)], discard=True)
    assert not delivered
    assert isinstance(error, IntegrityError)
    assert "altered" in str(error)


def test_without_data_integrity_a_flipped_data_byte_goes_through() -> None:
    """What the setting buys: with data_integrity = none, the DATA payload is not covered
    (its header and metadata are)."""
    (frame,) = stream(DATA, cover_data=False)
    tampered = bytearray(frame)
    tampered[-TRAILER_SIZE - 1] ^= 0x80
    dec = decoder(require_data=False)
    dec.feed(bytes(tampered))
    (got,) = drain(dec)
    assert bytes(got.payload) != DATA[2]
    tampered[HEADER_SIZE + 2] ^= 0x01  # but the metadata (msg, off) is covered
    _, error = feed_all(decoder(require_data=False), [bytes(tampered)])
    assert isinstance(error, IntegrityError)


def test_keys_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"short", cover_data=True)


def test_the_sealer_counts_from_zero_and_the_trailer_carries_the_number() -> None:
    sealer = Sealer(KEY, cover_data=True)
    frames = [sealed(sealer, *CTS) for _ in range(3)]
    assert [int.from_bytes(f[-TRAILER_SIZE:-16], "big") for f in frames] == [0, 1, 2]
    assert len({f[-16:] for f in frames}) == 3  # the same frame never gets the same MAC


# -- a client's memory changing under a covered payload ---------------------------------------
@pytest.mark.parametrize("step", [1000, 4096, 70_000])
def test_a_receiver_scribbling_on_its_region_while_data_lands_cannot_fail_the_check(
    step: int,
) -> None:
    # The region is a client's shared memory: its process may write there at any moment,
    # also between the kernel's write and the daemon's next look.  The MAC must cover the bytes
    # that came off the link, not what the region holds afterwards: a check that fails here
    # resets the peer, and any user of the node could then fail every job with that node.
    payload = bytes(range(256)) * 1000
    (frame,) = stream((Kind.DATA, {"msg": 1, "off": 0}, payload))
    head_len = len(frame) - len(payload) - TRAILER_SIZE
    dec = decoder(require_data=True)
    dec.feed(frame[:head_len])
    assert isinstance(dec.next_event(), FrameHead)
    region = bytearray(len(payload))
    dec.set_payload_buffer(memoryview(region))
    body = frame[head_len:]
    frames: list[Frame] = []
    for at in range(0, len(body), step):
        piece = body[at : at + step]
        target = dec.payload_target()
        if target is not None and len(target) >= len(piece):  # a read straight into the region
            target[: len(piece)] = piece
            region[:] = bytes(len(region))  # the client writes before the daemon looks
            dec.payload_written(len(piece))
        else:  # a read through the link's own buffer (TcpLink.buffer_updated)
            dec.feed(piece)
            region[:] = bytes(len(region))
        frames += drain(dec)
    assert len(frames) == 1  # delivered: the check saw the bytes the peer sent
    assert dec.opener is not None
    assert dec.opener.seq == 1


def test_the_bulk_kinds_agree_with_the_wire() -> None:
    """integrity.py names the bulk kinds by number (wire imports it): they must stay the same,
    or a COLL payload would be hashed (or not) against the setting."""
    from fabricd import integrity
    from fabricd.wire import BULK_KINDS

    assert {int(kind) for kind in BULK_KINDS} == integrity._BULK_KINDS
