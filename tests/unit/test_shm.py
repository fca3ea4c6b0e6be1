"""Shared-memory segments: sealed memfds the daemon can trust (never resized under it), and their
layout: a checked header, 64-byte aligned data, and version slots for torn-read checks."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricd.errors import UsageError
from fabricd.shm import (
    ALIGN,
    FOOTER_SIZE,
    HEADER,
    HEADER_SIZE,
    HEADER_VERSION_OFFSET,
    LAYOUT_VERSION,
    MAGIC,
    REQUIRED_SEALS,
    Layout,
    Segment,
)


def _pair(nbytes: int) -> tuple[Segment, Segment]:
    """A client's segment and the daemon's adoption of it."""
    client = Segment.create("pair", nbytes)
    return client, Segment.adopt(os.dup(client.fd), client.size)


def _forge(segment: Segment, **fields: object) -> None:
    """Overwrite some of ``segment``'s header fields, as a buggy or hostile client might."""
    names = ("magic", "version", "flags", "data_offset", "nbytes", "footer_offset", "size")
    values = dict(zip(names, HEADER.unpack_from(segment.buffer), strict=True))
    HEADER.pack_into(segment.buffer, 0, *{**values, **fields}.values())


# -- layout arithmetic ------------------------------------------------------------------------
@given(st.integers(0, 1 << 48))
def test_layout_puts_aligned_data_between_header_and_footer(nbytes):
    layout = Layout.for_array(nbytes)
    assert layout.nbytes == nbytes
    assert layout.header_size == HEADER_SIZE <= layout.data_offset
    assert layout.data_offset % ALIGN == 0
    assert layout.data_offset + nbytes <= layout.footer_offset < layout.data_offset + nbytes + ALIGN
    assert layout.footer_offset % ALIGN == 0
    assert layout.size == layout.footer_offset + FOOTER_SIZE
    assert layout.size % ALIGN == 0
    assert layout.size >= HEADER_SIZE + FOOTER_SIZE  # a zero-byte array still maps


def test_layout_refuses_a_negative_length():
    with pytest.raises(ValueError, match="cannot be -1 B"):
        Layout.for_array(-1)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 20_000))
def test_header_round_trips_and_the_daemon_derives_the_same_layout(nbytes):
    client, daemon = _pair(nbytes)
    layout = client.layout
    assert layout == Layout.for_array(nbytes) == daemon.layout
    assert len(client.buffer) == os.fstat(client.fd).st_size == layout.size == client.size
    assert HEADER.unpack_from(client.buffer) == (
        MAGIC,
        LAYOUT_VERSION,
        0,
        layout.data_offset,
        nbytes,
        layout.footer_offset,
        layout.size,
    )
    assert client.read_versions() == daemon.read_versions() == (0, 0)
    assert len(client.data()) == len(daemon.data()) == nbytes
    client.close()
    daemon.close()


# -- the memfd itself -------------------------------------------------------------------------
def test_segments_are_sealed_memfds_that_cannot_change_size():
    segment = Segment.create("grad", 10_000)
    try:
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & REQUIRED_SEALS == REQUIRED_SEALS
        for size in (0, 5_000, 20_000):
            with pytest.raises(PermissionError) as refused:
                os.ftruncate(segment.fd, size)
            assert refused.value.errno == errno.EPERM
        assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:fabricd:grad")
    finally:
        segment.close()


def test_the_daemon_side_sees_the_clients_bytes():
    client, daemon = _pair(64)
    client.data()[:] = bytes(range(64))
    assert bytes(daemon.data()) == bytes(range(64))
    lo = daemon.layout.data_offset
    daemon.view(lo + 10, 1)[0] = 255
    assert client.data()[10] == 255
    client.close()
    daemon.close()


def test_the_clients_array_is_an_aligned_c_view_of_exactly_the_data():
    """The integration recipe for ``fab.array``: the whole mapping as bytes, sliced."""
    client, daemon = _pair(6 * 4)
    layout = client.layout
    root = np.frombuffer(client.buffer, dtype=np.uint8)
    array = (
        root[layout.data_offset : layout.data_offset + layout.nbytes].view("float32").reshape(2, 3)
    )
    assert array.flags.c_contiguous
    assert array.nbytes == layout.nbytes
    assert array.ctypes.data % ALIGN == 0
    array[:] = np.arange(6).reshape(2, 3)
    offset = array[1].ctypes.data - root.ctypes.data  # what the client sends on the wire
    assert np.frombuffer(daemon.view(offset, 12), dtype="float32").tolist() == [3.0, 4.0, 5.0]
    assert client.read_versions() == (0, 0)  # the array never reaches the version slots
    del root, array
    client.close()
    daemon.close()


def test_views_stay_inside_the_data():
    segment = Segment.create("b", 100)
    lo = segment.layout.data_offset
    assert len(segment.view(lo + 90, 10)) == 10
    assert len(segment.view(lo + 100, 0)) == 0
    assert len(segment.view(0, 0)) == len(segment.view(segment.size, 0)) == 0  # touch nothing
    header, footer = (0, 8), (segment.layout.footer_offset, 8)
    cases = ((lo + 95, 10), (lo - 1, 1), (lo, 101), (lo, -1), header, footer, (-1, 0))
    for offset, nbytes in (*cases, (segment.size + 1, 0)):
        with pytest.raises(UsageError, match=r"outside the 100 B segment's data at \[64, 164\)"):
            segment.view(offset, nbytes)
    segment.close()


def test_zero_byte_arrays_get_a_valid_mapping_and_close_is_safe_with_views():
    segment = Segment.create("z", 0)
    assert segment.size == HEADER_SIZE + FOOTER_SIZE
    root = np.frombuffer(segment.buffer, dtype=np.uint8)
    lo = segment.layout.data_offset
    array = root[lo:lo].view("float64").reshape(0, 3)
    offset = array.ctypes.data - root.ctypes.data  # numpy may report 0 for an empty slice
    assert len(segment.view(offset, 0)) == 0
    del root, array
    view = segment.data()
    assert len(view) == len(segment.view(lo, 0)) == 0
    segment.close()  # a live view defers the unmap instead of failing
    assert len(view) == 0


# -- what adopt refuses -----------------------------------------------------------------------
def test_adopt_refuses_what_it_cannot_trust():
    read_end, write_end = os.pipe()
    with pytest.raises(UsageError, match="not a memfd"):
        Segment.adopt(read_end, 1)
    os.close(write_end)
    unsealed = os.memfd_create("u", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    with pytest.raises(UsageError, match="not sealed"):
        Segment.adopt(unsealed, 4096)
    good = Segment.create("g", 4096)
    with pytest.raises(UsageError, match="declared as 8192"):
        Segment.adopt(os.dup(good.fd), 8192)
    good.close()
    for fd in (read_end, unsealed):  # adopt took ownership and closed them
        with pytest.raises(OSError, match="Bad file descriptor") as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF


def test_adopt_refuses_a_segment_too_small_for_a_header():
    fd = os.memfd_create("tiny", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 16)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    with pytest.raises(UsageError, match="16 B, too small for its 64 B header"):
        Segment.adopt(fd, 16)


def test_adopt_refuses_a_segment_bigger_than_its_header_says():
    layout = Layout.for_array(100)
    fd = os.memfd_create("big", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, layout.header(), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    with pytest.raises(UsageError, match="the end at 256 in a 4096 B segment"):
        Segment.adopt(fd, 4096)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"magic": b"NOTFABRI"}, r"starts with b'NOTFABRI', not b'FABRICD\\x00'"),
        ({"version": 2}, "layout version 2 is not 1"),
        ({"flags": 4}, "flags 0x4 are unknown"),
        ({"data_offset": 0}, "100 B of data at 0, .* a 100 B array has them at 64"),
        ({"data_offset": 128}, "data at 128"),
        ({"footer_offset": 128}, "the footer at 128"),
        ({"nbytes": 10_000}, "10000 B of data .* in a 256 B segment"),
        ({"nbytes": 1}, "1 B of data .* and 192"),  # fits, but not this segment's layout
        ({"size": 4096}, "the end at 4096 in a 256 B segment"),
    ],
)
def test_adopt_refuses_a_bad_header_and_says_what_is_wrong(fields, message):
    client = Segment.create("forged", 100)
    _forge(client, **fields)
    fd = os.dup(client.fd)
    with pytest.raises(UsageError, match=message):
        Segment.adopt(fd, client.size)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    client.close()


def test_the_daemon_keeps_the_layout_it_checked_when_the_header_changes_later():
    client, daemon = _pair(100)
    _forge(client, data_offset=0, nbytes=client.size)  # would expose the header and footer
    assert daemon.layout == Layout.for_array(100)
    assert len(daemon.data()) == 100
    with pytest.raises(UsageError, match="outside"):
        daemon.view(0, 8)
    client.close()
    daemon.close()


def test_a_segment_sealed_against_writes_is_refused_not_crashed_on():
    layout = Layout.for_array(100)
    fd = os.memfd_create("ro", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, layout.size)
    os.pwrite(fd, layout.header(), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_WRITE)
    with pytest.raises(UsageError, match="cannot be mapped for writing"):
        Segment.adopt(fd, layout.size)


# -- version slots ----------------------------------------------------------------------------
def test_version_slots_detect_a_torn_read():
    """A copy is whole iff the versions around it agree.

    The torn-read check of *ASAP: Asynchronous Approximate Data-Parallel Computation* (Kadav and
    Kruus), §6.2: a version before and after each update.
    """
    writer, reader = _pair(64)
    old, new = b"\x01" * 64, b"\x02" * 64
    writer.data()[:] = old  # before any update: versions (0, 0), a copy is whole
    begun = reader.read_begin()
    assert bytes(reader.data()) == old
    assert reader.read_end(begun)

    begun = reader.read_begin()
    version = writer.begin_update()
    assert version == 1
    assert reader.read_versions() == (1, 0)  # mid-update: header != footer
    writer.data()[:32] = new[:32]
    torn = bytes(reader.data())
    writer.data()[32:] = new[32:]
    writer.end_update(version)
    assert torn == new[:32] + old[32:]
    assert not reader.read_end(begun)  # so the reader knows to discard it

    assert reader.read_versions() == (1, 1)
    begun = reader.read_begin()
    assert bytes(reader.data()) == new
    assert reader.read_end(begun)  # the retry is whole


def test_a_copy_begun_mid_update_is_torn_even_after_the_update_ends():
    writer, reader = _pair(8)
    version = writer.begin_update()
    begun = reader.read_begin()  # the footer still names the previous update
    writer.end_update(version)
    assert not reader.read_end(begun)
    assert reader.read_end(reader.read_begin())


def test_version_slots_are_little_endian_words_that_wrap_and_leave_the_rest_alone():
    writer, reader = _pair(16)
    writer.data()[:] = b"\xff" * 16
    for _ in range(3):
        writer.end_update(writer.begin_update())
    assert reader.read_versions() == (3, 3)
    header_slot = slice(HEADER_VERSION_OFFSET, HEADER_VERSION_OFFSET + 8)
    footer = reader.layout.footer_offset
    assert reader.buffer[header_slot] == reader.buffer[footer : footer + 8] == b"\x03" + bytes(7)
    writer.buffer[header_slot] = b"\xff" * 8
    assert writer.begin_update() == 0
    writer.end_update(0)
    assert reader.read_versions() == (0, 0)
    assert bytes(reader.data()) == b"\xff" * 16
    assert HEADER.unpack_from(reader.buffer) == HEADER.unpack(reader.layout.header())
