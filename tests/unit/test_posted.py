"""Posted regions (transports/posted.py) and the decoder's abandon_payload, without sockets.

The conformance suite (tests/conformance/test_transports.py) runs WRITE frames over tcp and
inproc; here the checks the receive path makes are driven by hand: every (offset, length) a
hypothesis picks against every region is either placed exactly where it says or refused with
the region untouched, and a key retired while its write is half in lets no later byte land.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricd.errors import RemoteProtocolError
from fabricd.frames.p2p import Write
from fabricd.integrity import KEY_SIZE, IntegrityError, Opener, Sealer
from fabricd.transports.inproc import InprocLink, InprocTransport
from fabricd.transports.posted import (
    LOG_EVERY,
    LOG_FIRST,
    RETIRED_MEMORY,
    PostedRegions,
    PostKey,
    WriteLanded,
)
from fabricd.wire import (
    DEFAULT_LIMITS,
    DISCARD,
    NEED_DATA,
    Decoder,
    Frame,
    FrameHead,
    Kind,
    encode_head,
)

if TYPE_CHECKING:
    from fabricd.transports.base import Link

KEY = PostKey(epoch=3, slot=1)


class _Peer:
    peer_address = "peer:1"


def regions() -> PostedRegions:
    return PostedRegions(cast("Link", _Peer()))


def head(key: PostKey, off: int, nbytes: int, seq: int = 0) -> FrameHead:
    meta = Write(epoch=key.epoch, slot=key.slot, off=off, seq=seq).to_meta()
    return FrameHead(kind=Kind.WRITE, flags=0, meta=meta, payload_len=nbytes)


@given(
    size=st.integers(0, 64),
    itemsize_dtype=st.sampled_from([(1, "uint8"), (2, "float16"), (4, "int32"), (8, "float64")]),
    off=st.integers(0, 2**63 - 1) | st.integers(0, 80),
    nbytes=st.integers(0, 80),
)
def test_a_write_lands_exactly_in_bounds_or_not_at_all(
    size: int, itemsize_dtype: tuple[int, str], off: int, nbytes: int
) -> None:
    itemsize, dtype = itemsize_dtype
    region = bytearray(b"\xee" * size * itemsize)
    posted = regions()
    landed: list[WriteLanded] = []
    posted.post(KEY, memoryview(region), dtype=dtype, on_landed=landed.append)
    target = posted.begin(head(KEY, off, nbytes, seq=5))
    fits = off + nbytes <= len(region) and not off % itemsize and not nbytes % itemsize
    if not fits:
        assert target is DISCARD
        posted.end()
        assert region == b"\xee" * len(region)
        assert landed == []
        assert posted.statistics().writes_refused == 1
        return
    assert target is not DISCARD
    assert len(target) == nbytes
    target[:] = b"\x11" * nbytes  # what the decoder does with the payload
    posted.end()
    assert region == b"\xee" * off + b"\x11" * nbytes + b"\xee" * (len(region) - off - nbytes)
    assert landed == [WriteLanded(key=KEY, offset=off, nbytes=nbytes, seq=5)]


@given(st.dictionaries(st.sampled_from(["epoch", "slot", "off", "seq", "x"]), st.integers()))
def test_malformed_write_metadata_is_a_protocol_error(meta: dict[str, int]) -> None:
    posted = regions()
    posted.post(KEY, memoryview(bytearray(8)), on_landed=lambda _: pytest.fail("landed"))
    try:
        target = posted.begin(FrameHead(kind=Kind.WRITE, flags=0, meta=meta, payload_len=1))
    except RemoteProtocolError:
        return
    matches = meta.get("epoch") == KEY.epoch and meta.get("slot") == KEY.slot
    assert matches or target is DISCARD


def test_fence_retires_every_older_key_and_forbids_posting_below_it() -> None:
    posted = regions()
    for epoch, slot in [(1, 0), (1, 1), (2, 0), (3, 0)]:
        posted.post(PostKey(epoch=epoch, slot=slot), memoryview(bytearray(4)), on_landed=print)
    assert posted.fence(3) is False
    assert posted.statistics().posted == 1
    assert posted.begin(head(PostKey(epoch=2, slot=0), 0, 4)) is DISCARD
    with pytest.raises(ValueError, match="fenced below epoch 3"):
        posted.post(PostKey(epoch=2, slot=9), memoryview(bytearray(4)), on_landed=print)


def test_retired_keys_are_remembered_within_a_bound() -> None:
    posted = regions()
    for slot in range(RETIRED_MEMORY + 1):
        key = PostKey(epoch=0, slot=slot)
        posted.post(key, memoryview(bytearray(1)), on_landed=print)
        posted.retire(key)
    posted.post(PostKey(epoch=0, slot=0), memoryview(bytearray(1)), on_landed=print)  # forgotten
    with pytest.raises(ValueError, match="retired"):
        posted.post(PostKey(epoch=0, slot=1), memoryview(bytearray(1)), on_landed=print)


def test_post_keys_stay_on_the_wire() -> None:
    with pytest.raises(ValueError, match="post key"):
        PostKey(epoch=-1, slot=0)
    with pytest.raises(ValueError, match="post key"):
        PostKey(epoch=0, slot=2**32)


# -- a write cut off by retire: the decoder's two payload paths --------------------------------
def test_abandon_payload_on_the_in_place_path_places_no_later_byte() -> None:
    """As TCP reads: the kernel writes into payload_target(); retire lands between reads."""
    decoder = Decoder()
    region = bytearray(8)
    decoder.feed(encode_head(Kind.WRITE, {"x": 1}, 8))
    assert isinstance(decoder.next_event(), FrameHead)
    decoder.set_payload_buffer(memoryview(region))
    target = decoder.payload_target()
    assert target is not None
    target[:4] = b"AAAA"
    decoder.payload_written(4)
    decoder.abandon_payload()
    assert decoder.payload_target() is None  # the rest comes through feed, and is dropped
    decoder.feed(b"BBBB")
    frame = decoder.next_event()
    assert isinstance(frame, Frame)
    assert bytes(frame.payload) == b""
    assert region == b"AAAA" + bytes(4)
    decoder.abandon_payload()  # between frames: nothing to do
    assert decoder.next_event() is NEED_DATA


def sealed_pair() -> tuple[Sealer, Opener]:
    key = bytes(range(KEY_SIZE))
    return Sealer(key, cover_data=True), Opener(key, require_data=True)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_key_retired_mid_write_gets_no_more_bytes_and_no_completion(sealed: bool) -> None:
    """An inproc link fed a WRITE in two halves, the key retired in between (a tcp link sees
    the same when a large payload arrives over several reads)."""

    async def check() -> None:
        link = InprocLink("me", "peer", DEFAULT_LIMITS, InprocTransport())
        # no sink: the link's null sink refuses any frame, and WRITE never reaches a sink
        region = bytearray(8)
        landed: list[WriteLanded] = []
        link.post(KEY, memoryview(region), on_landed=landed.append)
        meta = Write(epoch=KEY.epoch, slot=KEY.slot, off=0, seq=1).to_meta()
        payload = b"AAAABBBB"
        frame = encode_head(Kind.WRITE, meta, 8)
        trailer = b""
        if sealed:
            sealer, opener = sealed_pair()
            flags = sealer.flags(Kind.WRITE)
            frame = encode_head(Kind.WRITE, meta, 8, flags=flags)
            trailer = sealer.seal(Kind.WRITE, frame, [payload])
            link._receiver.decoder.opener = opener
        link._receive(frame + payload[:4])
        assert region == b"AAAA" + bytes(4)
        link.retire(KEY)
        link._receive(payload[4:] + trailer)
        assert region == b"AAAA" + bytes(4)  # nothing after retire returned
        assert landed == []
        assert link.close_reason is None  # the MAC still checked out over the bytes sent
        stats = link.statistics()
        assert (stats.writes_landed, stats.writes_refused) == (0, 1)
        link.close("test over")

    asyncio.run(check())


def test_a_flood_of_refused_writes_is_counted_in_full_and_logged_sparingly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    posted = regions()
    with caplog.at_level(logging.WARNING, logger="fabricd.transport"):
        for seq in range(LOG_EVERY * 3):
            assert posted.begin(head(KEY, 0, 4, seq)) is DISCARD
    assert posted.statistics().writes_refused == LOG_EVERY * 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == LOG_FIRST + 3
    assert all("it is not posted" in line for line in lines)
    assert f"({LOG_EVERY * 3} refused on this link so far" in lines[-1]


def test_a_write_whose_mac_does_not_cover_its_payload_is_refused_where_required() -> None:
    """WRITE follows DATA's data_integrity rule: a receiver set to "mac" refuses it uncovered."""
    key = bytes(range(KEY_SIZE))
    sealer, opener = Sealer(key, cover_data=False), Opener(key, require_data=True)
    meta = Write(epoch=1, slot=0, off=0, seq=0).to_meta()
    frame = encode_head(Kind.WRITE, meta, 4, flags=sealer.flags(Kind.WRITE))
    decoder = Decoder()
    decoder.opener = opener
    decoder.feed(frame + b"abcd" + sealer.seal(Kind.WRITE, frame, [b"abcd"]))
    with pytest.raises(IntegrityError, match="WRITE frame whose MAC does not cover its payload"):
        decoder.next_event()
    lenient = Decoder()
    lenient.opener = Opener(key, require_data=False)
    lenient.feed(frame + b"abcd" + Sealer(key, cover_data=False).seal(Kind.WRITE, frame, [b"abcd"]))
    assert isinstance(lenient.next_event(), FrameHead)
    assert isinstance(lenient.next_event(), Frame)  # header and metadata still authenticated


# -- review of issue 8 item 1: the cut-off paths keep the MAC and let the region go ------------
def sealed_write(payload: bytes) -> tuple[bytes, bytes, Opener]:
    """A sealed WRITE to KEY at offset 0 (header and metadata, trailer) and the opener for it."""
    sealer, opener = sealed_pair()
    meta = Write(epoch=KEY.epoch, slot=KEY.slot, off=0, seq=1).to_meta()
    frame = encode_head(Kind.WRITE, meta, len(payload), flags=sealer.flags(Kind.WRITE))
    return frame, sealer.seal(Kind.WRITE, frame, [payload]), opener


def test_bytes_read_directly_after_an_abandon_are_still_hashed() -> None:
    """A covered payload read into the bounce buffer, abandoned before payload_written(): the
    bytes go nowhere but still pass through the MAC, or the trailer check fails and the peer
    is reset for a write the receiver itself withdrew."""
    frame, trailer, opener = sealed_write(b"AAAABBBB")
    decoder = Decoder()
    decoder.opener = opener
    region = bytearray(8)
    decoder.feed(frame)
    assert isinstance(decoder.next_event(), FrameHead)
    decoder.set_payload_buffer(memoryview(region))
    target = decoder.payload_target()
    assert target is not None
    target[:4] = b"AAAA"  # the kernel's read
    decoder.abandon_payload()  # retired before the read was reported
    decoder.payload_written(4)
    decoder.feed(b"BBBB" + trailer)
    frame_out = decoder.next_event()
    assert isinstance(frame_out, Frame)
    assert bytes(frame_out.payload) == b""
    assert region == bytes(8)  # the bounce was not copied in


def _resizable(region: bytearray) -> bool:
    """Whether nothing holds a view of ``region`` any more (a segment could be unmapped)."""
    try:
        region += b"x"
    except BufferError:
        return False
    del region[-1:]
    return True


@pytest.mark.parametrize("how", ["retire_before_trailer", "link_lost_mid_write"])
def test_a_cut_off_write_leaves_no_view_of_its_region(how: str) -> None:
    """After retire (or the link's loss) the poster may unmap the region's segment: nothing of
    the link may still hold a view of it, not even the decoder's payload buffer."""

    async def check() -> None:
        link = InprocLink("me", "peer", DEFAULT_LIMITS, InprocTransport())
        region = bytearray(8)
        view = memoryview(region)
        landed: list[WriteLanded] = []
        link.post(KEY, view, on_landed=landed.append)
        frame, trailer, opener = sealed_write(b"AAAABBBB")
        link._receiver.decoder.opener = opener
        if how == "retire_before_trailer":
            link._receive(frame + b"AAAABBBB")  # every byte in, the trailer not yet
            link.retire(KEY)
        else:
            link._receive(frame + b"AAAA")
            link.close("test: lost mid-write")
        view.release()
        assert _resizable(region)
        if how == "retire_before_trailer":
            link._receive(trailer)
            assert link.close_reason is None
            link.close("test over")
        assert landed == []

    asyncio.run(check())


def test_a_region_that_is_not_c_contiguous_is_refused_with_value_error() -> None:
    """post() names ValueError for a region it cannot take; a Fortran-order array (contiguous,
    but not in C order, so it cannot be cast to bytes) raised TypeError from memoryview.cast."""
    import numpy as np

    fortran = np.zeros((4, 4), dtype=np.float32, order="F")
    with pytest.raises(ValueError, match="C-contiguous"):
        regions().post(KEY, memoryview(fortran), dtype="float32", on_landed=print)
    with pytest.raises(ValueError, match="C-contiguous"):
        regions().post(KEY, memoryview(bytearray(8))[::2], on_landed=print)
