"""(f) What sealed frames cost: DATA throughput with ``data_integrity`` on and off, and the
cost per control frame.

``integrity``: two ``LocalCluster(2)`` pairs on loopback at once, one with
``data_integrity = "none"`` (the baseline: control frames and DATA headers sealed, DATA payloads
not) and one with ``"mac"`` (DATA payloads covered too: HMAC-SHA256 over every chunk on both
ends).  Rank 0 (this process) sends each message to rank 1 (another process) with ``fab.send``,
one message in flight, as (b) throughput does; samples alternate between the pairs, so both see
the same background load.  Each row gives the median GB/s of each pair, the spread of its
samples ((max - min) / median), and the ratio mac / none.

``integrity-frame``: the codec's share of one frame, in this process, without sockets: encode
the header, decode it (and, sealed, compute and check the MAC) for a HEARTBEAT, an RTS and a
DATA header (without its payload), against the same frames unsealed (what every frame cost
before protocol 2); batches alternate.  Extra figures: BLAKE2b and HMAC-SHA256 over 4 MiB in
GB/s, the two MACs a sealed DATA payload could use.

Run alone: ``python -m bench.integrity [--quick]`` (both tables).
"""

from __future__ import annotations

import hashlib
import hmac
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from bench import ranks
from bench.report import (
    Column,
    Extra,
    KiB,
    MiB,
    Progress,
    Table,
    fmt_number,
    fmt_size,
    median,
    messages_per_sample,
    per_call,
    quiet,
    reap,
    spawn,
    stderr_progress,
)
from fabricd.frames.link import Heartbeat
from fabricd.frames.p2p import Data, Rts
from fabricd.integrity import KEY_SIZE, Opener, Sealer
from fabricd.wire import NEED_DATA, Decoder, Frame, encode_head

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fabricd.wire import Kind

SIZES: Final = [64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES: Final = [64 * KiB, 4 * MiB]
MODES: Final = ("none", "mac")


def _spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / median(values)


def run(quick: bool = False, progress: Progress = quiet) -> Table:
    """DATA throughput with data_integrity mac against none (two pairs, samples alternating)."""
    from fabricd.client import connect
    from fabricd.daemon.launcher import LocalCluster

    sizes = QUICK_SIZES if quick else SIZES
    samples = 3 if quick else 9
    budget, cap = (16 * MiB, 20) if quick else (256 * MiB, 200)
    cases = [(n, messages_per_sample(n, budget, cap)) for n in sizes]
    per_side = [(n, 1 + samples * k) for n, k in cases]
    table = Table(
        name="integrity",
        title="(f) DATA throughput with data_integrity = mac against none, GB/s (1e9 B/s), "
        "1 message in flight",
        columns=[
            Column("none", "none GB/s"),
            Column("none_spread", "none spread"),
            Column("mac", "mac GB/s"),
            Column("mac_spread", "mac spread"),
        ],
        ratio="mac / none (1x: authenticating DATA costs nothing)",
        settings={"samples": samples, "window": 1},
    )
    job = f"bench-{uuid.uuid4().hex[:8]}"
    progress("starting 2 pairs of daemons (data_integrity none and mac)")
    clusters = [LocalCluster(2, settings={"data_integrity": m}) for m in MODES]
    peers, clients = [], []
    try:
        for cluster in clusters:
            cluster.start()
        for cluster in clusters:
            cluster.wait_connected()
            socket_path = cluster.nodes[1].socket_path
            peers.append(spawn(ranks.fabric_receiver, socket_path, job, per_side, 1))
            fab = connect(job=job, rank=0, size=2, socket_path=cluster.nodes[0].socket_path)
            clients.append(fab)
        sources = [fab.array("bench-send", (max(sizes),), "uint8") for fab in clients]
        for source in sources:
            source[:] = np.arange(max(sizes), dtype=np.uint64).astype(np.uint8)
        for nbytes, messages in cases:
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for fab, source in zip(clients, sources, strict=True):  # a warm-up message each
                fab.send(source[:nbytes], to=1, timeout=ranks.CALL_TIMEOUT)
            for _ in range(samples):
                for mode, fab, source in zip(MODES, clients, sources, strict=True):
                    start = time.perf_counter()
                    for _ in range(messages):
                        fab.send(source[:nbytes], to=1, timeout=ranks.CALL_TIMEOUT)
                    times[mode].append(time.perf_counter() - start)
            rates = {m: [nbytes * messages / t / 1e9 for t in times[m]] for m in MODES}
            figures = {m: median(rates[m]) for m in MODES}
            table.add(
                fmt_size(nbytes),
                nbytes,
                figures["mac"] / figures["none"],
                none=figures["none"],
                none_spread=_spread(rates["none"]),
                mac=figures["mac"],
                mac_spread=_spread(rates["mac"]),
            )
            progress(
                f"{fmt_size(nbytes)}: none {fmt_number(figures['none'])} GB/s, "
                f"mac {fmt_number(figures['mac'])} GB/s"
            )
    finally:
        for fab in clients:
            fab.close()
        for peer in peers:
            reap(peer)
        for cluster in clusters:
            cluster.stop()
    table.notes.append(
        "both pairs seal control frames and DATA headers; 'mac' also covers each DATA "
        "payload with HMAC-SHA256 on each daemon's event loop, over a private copy of the "
        "chunk on both ends (no client can change what is hashed): the sender hashes it once "
        "it handed it to the kernel, the receiver as each read lands in its own buffer"
    )
    table.notes.append("spread = (max - min) / median of the samples; the machine is shared")
    return table


# -- the cost per frame -----------------------------------------------------------------------
_KEY: Final = bytes(range(KEY_SIZE))


def _frame_samples() -> list[tuple[str, Kind, dict[str, object]]]:
    rts = Rts(msg=12345, job="job-0", src=0, dst=1, tag=7, nbytes=4096, dtype="float32")
    return [
        ("HEARTBEAT", Heartbeat.KIND, Heartbeat().to_meta()),
        ("RTS", Rts.KIND, rts.to_meta()),
        ("DATA head", Data.KIND, Data(msg=12345, off=0).to_meta()),
    ]


def _round_trip(kind: Kind, meta: dict[str, object], sealed: bool) -> Any:
    """One frame encoded and decoded, sealed or not, on a long-lived sealer/decoder pair."""
    decoder = Decoder()
    sealer = None
    if sealed:
        sealer = Sealer(_KEY, cover_data=True)
        decoder.opener = Opener(_KEY, require_data=True)

    def once() -> None:
        if sealer is None:
            decoder.feed(encode_head(kind, meta))
        else:
            head = encode_head(kind, meta, flags=sealer.flags(kind))
            decoder.feed(head + sealer.seal(kind, head, ()))
        while not isinstance(decoder.next_event(), Frame):
            pass
        assert decoder.next_event() is NEED_DATA

    return once


def _hash_rate(fn: Any, data: memoryview, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - start)
    return len(data) / median(times) / 1e9


def run_frame(quick: bool = False, progress: Progress = quiet) -> Table:
    """The codec's cost of one frame, sealed against unsealed."""
    calls, samples = (2000, 5) if quick else (20000, 15)
    table = Table(
        name="integrity-frame",
        title="(f) encode + decode of one frame, sealed against unsealed, us per frame",
        columns=[Column("plain", "unsealed us"), Column("sealed", "sealed us")],
        ratio="sealed / unsealed",
        settings={"calls": calls, "samples": samples},
    )
    for label, kind, meta in _frame_samples():
        plain, sealed = _round_trip(kind, meta, False), _round_trip(kind, meta, True)
        times: dict[str, list[float]] = {"plain": [], "sealed": []}
        for _ in range(samples):  # batches alternate
            times["plain"] += per_call(plain, calls, 1)
            times["sealed"] += per_call(sealed, calls, 1)
        us = {k: median(v) * 1e6 for k, v in times.items()}
        table.add(label, 0, us["sealed"] / us["plain"], **us)
        progress(f"{label}: {fmt_number(us['plain'])} us unsealed, {fmt_number(us['sealed'])} us")
    data = memoryview(bytearray(4 * MiB))
    rounds = 5 if quick else 20
    rates = {
        "BLAKE2b-128 keyed": _hash_rate(
            lambda d: hashlib.blake2b(d, key=_KEY, digest_size=16).digest(), data, rounds
        ),
        "HMAC-SHA256": _hash_rate(lambda d: hmac.digest(_KEY, d, "sha256"), data, rounds),
    }
    table.extras.append(
        Extra(label="MAC over a 4 MiB payload, one core", figures=rates, unit="GB/s")
    )
    table.notes.append(
        "a frame's sealed cost: the trailer's MAC computed by the sender and again by the "
        "receiver, plus 24 B more to move; 'DATA head' is a DATA frame without its payload"
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    for fn, name in ((run_frame, "integrity-frame"), (run, "integrity")):
        print(fn(quick, stderr_progress(name)).render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
