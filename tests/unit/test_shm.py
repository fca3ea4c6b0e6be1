"""Shared-memory segments: sealed memfds the daemon can trust (RELIABILITY S6)."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from fabricd.errors import UsageError
from fabricd.shm import REQUIRED_SEALS, Segment, mapping_size


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
    client = Segment.create("x", 64)
    daemon = Segment.adopt(os.dup(client.fd), 64)
    client.view(0, 64)[:] = bytes(range(64))
    assert bytes(daemon.view(0, 64)) == bytes(range(64))
    daemon.view(10, 1)[0] = 255
    assert client.buffer[10] == 255
    client.close()
    daemon.close()


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


def test_views_are_bounds_checked():
    segment = Segment.create("b", 100)
    assert len(segment.view(90, 10)) == 10
    for offset, nbytes in ((95, 10), (-1, 1), (0, 101), (0, -1)):
        with pytest.raises(UsageError, match="outside the 100 B segment"):
            segment.view(offset, nbytes)
    segment.close()


def test_zero_byte_arrays_get_a_one_byte_mapping_and_close_is_safe_with_views():
    assert mapping_size(0) == 1
    segment = Segment.create("z", 0)
    view = segment.view(0, 0)
    segment.close()  # a live view defers the unmap instead of failing
    assert len(view) == 0


def test_a_segment_sealed_against_writes_is_refused_not_crashed_on():
    fd = os.memfd_create("ro", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_WRITE)
    with pytest.raises(UsageError, match="cannot be mapped for writing"):
        Segment.adopt(fd, 4096)
