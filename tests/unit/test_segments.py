"""The daemon's segment table: caps on count and mapped bytes per client and per daemon.

Real sealed memfds, never written (sparse), mapped by the table as the daemon maps them; the
budget arithmetic is checked with the numbers a host would give it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest

from fabricd.daemon import segments
from fabricd.daemon.config import Config
from fabricd.daemon.segments import SegmentLimits, SegmentTable, _size, segment_budget
from fabricd.daemon.sessions import ClientSession
from fabricd.errors import OperationFailed, UsageError
from fabricd.shm import SEALS, Layout

MiB = 1 << 20


def memfd(size: int) -> int:
    """A sealed, unmapped segment fd of ``size`` bytes (a multiple of 64, at least 128)."""
    layout = Layout.for_array(size - 128)
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, layout.size)
    os.pwrite(fd, layout.header(), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def session() -> ClientSession:
    return ClientSession(conn=SimpleNamespace())  # type: ignore[arg-type]


def open_fds() -> int:
    gc.collect()  # garbage other tests left must not close its fds in the middle of a count
    return len(os.listdir("/proc/self/fd"))


def limits(**caps: Any) -> SegmentLimits:
    values = {"per_client": 4, "bytes_per_client": 4 * MiB, "total": 6, "total_bytes": 6 * MiB}
    return SegmentLimits(**{**values, **caps})


def refusal(table: SegmentTable, client: ClientSession, seg: int, size: int) -> str:
    with pytest.raises(OperationFailed) as failed:
        table.attach(client, seg, size, memfd(size))
    assert failed.value.code == "limit"
    return str(failed.value)


def test_each_cap_refuses_names_its_setting_and_counts() -> None:
    table = SegmentTable(limits())
    a, b = session(), session()
    fds = open_fds()
    table.attach(a, 0, 4 * MiB, memfd(4 * MiB))  # exactly its byte cap
    assert "max_mapped_bytes_per_client" in refusal(table, a, 1, 128)
    table.attach(b, 0, 128, memfd(128))
    table.attach(b, 1, 128, memfd(128))
    table.attach(b, 2, 128, memfd(128))
    table.attach(b, 3, 128, memfd(128))
    assert "max_segments_per_client" in refusal(table, b, 4, 128)
    c = session()
    assert "(max_mapped_bytes)" in refusal(table, c, 0, 2 * MiB)  # 6 MiB for the daemon
    table.attach(c, 0, 128, memfd(128))  # the sixth segment fits
    assert "(max_segments)" in refusal(table, c, 1, 128)
    assert table.counters() == {
        "attach_refused_client_segments": 1,
        "attach_refused_client_bytes": 1,
        "attach_refused_segments": 1,
        "attach_refused_bytes": 1,
        "attach_failed_resources": 0,
    }
    assert table.gauges() == {"segments": 6, "mapped_bytes": 4 * MiB + 5 * 128}
    assert (a.mapped, b.mapped, c.mapped) == (4 * MiB, 4 * 128, 128)
    assert open_fds() == fds + 6  # one per mapping (mmap's own), none for a refusal
    table.detach(a, 0)
    table.detach(a, 0)  # unknown now: nothing happens
    for client in (b, c):
        table.release(client)
    assert table.gauges() == {"segments": 0, "mapped_bytes": 0}
    assert open_fds() == fds
    table.attach(a, 0, 4 * MiB, memfd(4 * MiB))  # what was given back can be taken again


def test_the_declared_size_counts_before_anything_is_mapped() -> None:
    table = SegmentTable(limits(bytes_per_client=1 << 46))
    client = session()
    fds = open_fds()
    big = 1 << 45  # sparse: costs no RAM, but 32 TiB of address space
    with pytest.raises(OperationFailed, match=r"\(max_mapped_bytes\)"):
        table.attach(client, 0, big, memfd(big))
    assert open_fds() == fds  # the fd was closed, nothing was mapped
    assert table.gauges() == {"segments": 0, "mapped_bytes": 0}


def test_a_bad_segment_or_a_reused_id_is_a_usage_error_and_costs_nothing() -> None:
    table = SegmentTable(limits())
    client = session()
    fds = open_fds()
    with pytest.raises(UsageError, match="declared as"):
        table.attach(client, 0, 256, memfd(128))
    table.attach(client, 0, 128, memfd(128))
    with pytest.raises(UsageError, match="already attached"):
        table.attach(client, 0, 128, memfd(128))
    assert table.gauges() == {"segments": 1, "mapped_bytes": 128}
    assert open_fds() == fds + 1
    table.release(client)


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_PATH], ids=["write-only", "O_PATH"])
def test_a_memfd_reopened_so_it_cannot_be_read_is_a_usage_error(flags: int) -> None:
    # the same sealed memfd through /proc/self/fd: pread failed with EBADF, which reached the
    # daemon as an internal error with a traceback in the log, once per request
    table = SegmentTable(limits())
    fds = open_fds()
    sealed = memfd(128)
    reopened = os.open(f"/proc/self/fd/{sealed}", flags)
    os.close(sealed)
    with pytest.raises(UsageError, match="segment fd"):
        table.attach(session(), 0, 128, reopened)
    assert open_fds() == fds
    assert table.gauges() == {"segments": 0, "mapped_bytes": 0}


def test_the_budget_is_the_setting_unless_the_host_leaves_less() -> None:
    assert segment_budget(32768, fds=64000, maps=60000, fd_limit=65536) == (32768, "max_segments")
    cap, why = segment_budget(32768, fds=500, maps=60000, fd_limit=1024)
    assert cap == 500
    assert "max_segments, lowered to 500" in why
    assert "LimitNOFILE" in why
    cap, why = segment_budget(32768, fds=64000, maps=20000, fd_limit=65536)
    assert cap == 20000
    assert "vm.max_map_count" in why
    assert segment_budget(32768, fds=-10, maps=60000, fd_limit=256)[0] == 1


def test_limits_from_the_config_never_exceed_the_settings_or_the_host() -> None:
    cfg = Config()
    caps = SegmentLimits.from_config(cfg)
    assert caps.per_client == cfg.max_segments_per_client
    assert caps.bytes_per_client == cfg.max_mapped_bytes_per_client
    assert 1 <= caps.total <= cfg.max_segments
    assert caps.total_bytes <= cfg.max_mapped_bytes
    huge = SegmentLimits.from_config(dataclasses.replace(cfg, max_segments=1 << 40))
    assert huge.total < 1 << 40  # no host has that many fds and maps to spare
    assert "lowered to" in huge.total_why


@pytest.mark.parametrize(
    ("n", "text"),
    [(100, "100 B"), (1 << 46, "64 TiB"), (3 << 29, "1.5 GiB"), (256 << 30, "256 GiB")],
)
def test_sizes_read_as_a_person_writes_them(n: int, text: str) -> None:
    assert _size(n) == text


def test_a_detached_segment_counts_until_the_last_view_of_it_goes() -> None:
    # a pending transfer holds a view: the mapping (and mmap's fd) outlive detach and client
    # exit, and so must the count, or the caps could be passed by detaching in-use segments
    table = SegmentTable(limits(per_client=2))
    a = session()
    fds = open_fds()
    table.attach(a, 0, 4 * MiB, memfd(4 * MiB))
    held = a.segments[0].view(64, 64)  # what a receive keeps
    table.detach(a, 0)
    assert table.gauges() == {"segments": 1, "mapped_bytes": 4 * MiB}
    assert "max_mapped_bytes_per_client" in refusal(table, a, 1, 128)
    assert open_fds() == fds + 1
    held.release()
    assert open_fds() == fds
    assert table.gauges() == {"segments": 0, "mapped_bytes": 0}
    assert a.mapped == 0
    table.attach(a, 1, 128, memfd(128))
    held = a.segments[1].view(64, 0)
    table.detach(a, 1)
    table.attach(a, 2, 128, memfd(128))
    assert "max_segments_per_client" in refusal(table, a, 3, 128)  # one mapped, one unmapping
    b = session()
    table.attach(b, 0, 128, memfd(128))
    view = b.segments[0].view(64, 0)
    table.release(b)  # the client left while a transfer holds its segment
    assert table.gauges() == {"segments": 3, "mapped_bytes": 3 * 128}
    del held, view
    assert table.gauges() == {"segments": 1, "mapped_bytes": 128}


def test_raising_the_fd_limit_at_start_is_logged(monkeypatch, caplog):
    limits_now = {"soft": 1024, "hard": 4096}

    def getrlimit(_: int) -> tuple[int, int]:
        return limits_now["soft"], limits_now["hard"]

    def setrlimit(_: int, new: tuple[int, int]) -> None:
        if new[0] > limits_now["hard"]:
            raise ValueError("not allowed to raise maximum limit")
        limits_now["soft"] = new[0]

    monkeypatch.setattr(segments.resource, "getrlimit", getrlimit)
    monkeypatch.setattr(segments.resource, "setrlimit", setrlimit)
    with caplog.at_level(logging.INFO, logger="fabricd.daemon"):
        segments._raise_fd_limit(40000)
    assert limits_now["soft"] == 4096  # as far as the hard limit allows
    assert "raised RLIMIT_NOFILE from 1024 to 4096" in caplog.text
