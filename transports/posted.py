"""Posted regions: where one-hop WRITE frames land, and the checks they pass first.

A receiving side posts a destination in advance: a writable, contiguous region (a view of a
client's segment or a daemon-owned buffer) under a :class:`PostKey`, with a dtype and a
completion callback.  A peer then writes into it with single WRITE frames carrying
(key, offset, sequence) in their metadata and the byte count in their header: no RTS, no CTS.
This is the TCP shape of an RDMA WRITE with immediate into a registered memory region
(docs/architecture.md, "How a verbs transport fits without changing the contract").

Rules, the same on every transport (each link keeps one :class:`PostedRegions`, fed by the
shared receive path in transports/framing.py):

* **Checked before any byte is placed.**  A WRITE's key, offset and length are all in its header
  and metadata, which arrive before its payload; the write is accepted only if the key is posted,
  ``0 <= off`` and ``off + nbytes <= len(region)``, and both are whole elements of the dtype.
  Otherwise it is *refused*: logged with its reason (the first :data:`LOG_FIRST` per link, then
  one in :data:`LOG_EVERY`), counted, and its payload read and dropped
  (allocating nothing), so it never lands anywhere.  A refusal does not close the link: a write
  racing a retirement is normal.  A WRITE whose metadata is malformed is a protocol error and
  closes the link, like any malformed frame.
* **Told when in place.**  The region's ``on_landed`` callback gets a :class:`WriteLanded` once
  every byte of the write is in the region and, on a sealed link, its frame's MAC checked out.
  Nothing else says bytes are in place: a link lost mid-write leaves the range undefined and
  reports nothing.
* **Retirement is final.**  After :meth:`PostedRegions.retire` returns, no byte of any write lands
  in that region, not even the rest of a write whose payload is arriving right then (what came
  before stays; its completion is never reported).  Posting a retired key again is refused
  while it is among the last :data:`RETIRED_MEMORY` retired; a poster that recycles slots
  raises its epoch instead (next rule), which no stale write can match.
* **Fenced by incarnation.**  A key is ``(epoch, slot)``: the epoch is the posting side's
  incarnation, or any number it raises when what it posted stops being valid (a restart, a
  re-registration).  A writer names the epoch it was told; a write for any other epoch matches
  no key.  :meth:`PostedRegions.fence` retires every key below an epoch at once and refuses to
  post below it again, so nothing a writer cached from an old incarnation can ever land.
* **Concurrent writers** need no coordination here: frames on one link are delivered one at a
  time, whole, so writes to disjoint ranges (of one region, from several tasks or several
  links) land independently; overlapping writes land in frame order per link and in no defined
  order across links.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.dtypes import ITEMSIZE
from fabricd.frames.p2p import MAX_SLOT, Write
from fabricd.wire import DISCARD, Discard

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.transports.base import Link
    from fabricd.wire import FrameHead

log = logging.getLogger("fabricd.transport")

#: retired keys remembered, so that a refusal can say "retired" rather than "unknown"
RETIRED_MEMORY: Final = 1024
#: refusals logged one by one per link; after that one line in every LOG_EVERY (a peer that
#: floods refused writes cannot flood the log; the counter still counts every one)
LOG_FIRST: Final = 16
LOG_EVERY: Final = 1000


@dataclass(frozen=True, slots=True, order=True)
class PostKey:
    """The name a region is posted under: the poster's ``epoch`` (its incarnation) and a small
    ``slot`` number it chose (the verbs analogue: an rkey, which also changes on re-registration).
    """

    epoch: int
    slot: int

    def __post_init__(self) -> None:
        if not 0 <= self.epoch < 2**63 or not 0 <= self.slot <= MAX_SLOT:
            raise ValueError(f"a post key is (epoch < 2**63, slot <= {MAX_SLOT}), not {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteLanded:
    """A write is in place: ``nbytes`` bytes at byte ``offset`` of the region posted as ``key``;
    ``seq`` is the number the writer gave it."""

    key: PostKey
    offset: int
    nbytes: int
    seq: int


@dataclass(slots=True)
class _Region:
    view: memoryview  #: the region as bytes
    itemsize: int
    on_landed: Callable[[WriteLanded], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class PostedStatistics:
    """Counters of one link's posted regions."""

    posted: int  #: regions posted now
    writes_landed: int
    bytes_landed: int
    writes_refused: int


class PostedRegions:
    """One link's posted regions and the write being placed, if any (see the module docstring).

    Args:
        link: the link the writes arrive on (its peer address goes into log lines).
    """

    def __init__(self, link: Link) -> None:
        self._link = link
        self._regions: dict[PostKey, _Region] = {}
        self._retired: collections.OrderedDict[PostKey, None] = collections.OrderedDict()
        self._floor = 0  #: the lowest epoch that may still be posted (fence)
        self._pending: tuple[_Region, WriteLanded] | None = None
        self._landed = 0
        self._bytes_landed = 0
        self._refused = 0

    def post(
        self,
        key: PostKey,
        region: memoryview,
        *,
        dtype: str = "uint8",
        on_landed: Callable[[WriteLanded], None],
    ) -> None:
        """Accept writes into ``region`` under ``key`` from now on.

        The caller keeps ``region`` valid and unchanged in size until it retires the key (or the
        link is lost, which drops every post).

        Raises:
            ValueError: ``key`` is posted already, was retired, or is below the fence; ``dtype``
                is unknown; ``region`` is read-only, not C-contiguous, or not whole elements.
        """
        if key in self._regions:
            raise ValueError(f"post key {key} is posted already")
        if key in self._retired or key.epoch < self._floor:
            raise ValueError(f"post key {key} was retired (or fenced below epoch {self._floor})")
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is None:
            raise ValueError(f"unknown dtype {dtype!r}")
        if region.readonly or not region.c_contiguous:  # cast("B") needs C order
            raise ValueError("a posted region must be writable and C-contiguous")
        view = region.cast("B") if region.format != "B" or region.ndim != 1 else region
        if len(view) % itemsize:
            raise ValueError(f"a region of {len(view)} B is not whole {dtype} elements")
        self._regions[key] = _Region(view=view, itemsize=itemsize, on_landed=on_landed)

    def retire(self, key: PostKey) -> bool:
        """Stop accepting writes under ``key``; return whether a write to it was being placed
        right now (the caller must then make the rest of its payload go nowhere).

        Retiring a key that is not posted is a no-op (it may have been fenced).
        """
        region = self._regions.pop(key, None)
        if region is None:
            return False
        self._remember_retired(key)
        pending = self._pending
        if pending is not None and pending[1].key == key:
            self._pending = None
            self._refuse(pending[1].key, "it was retired while the write was arriving")
            return True
        return False

    def fence(self, epoch: int) -> bool:
        """Retire every key below ``epoch`` and refuse to post below it from now on; return
        whether a write being placed right now was cut off (as :meth:`retire`)."""
        self._floor = max(self._floor, epoch)
        cut = False
        for key in [k for k in self._regions if k.epoch < epoch]:
            cut = self.retire(key) or cut
        return cut

    def clear(self) -> bool:
        """Drop every post (the link is gone): no callback runs.  Return whether a write was
        being placed (the caller must then drop the decoder's view of its region, as after
        :meth:`retire`)."""
        self._regions.clear()
        cut, self._pending = self._pending is not None, None
        return cut

    def begin(self, head: FrameHead) -> memoryview | Discard:
        """Check the WRITE whose head arrived; return where its payload lands, or ``DISCARD``
        (refused: logged and counted).

        Raises:
            RemoteProtocolError: the metadata is malformed (close the link).
        """
        write = Write.from_meta(head.meta)
        key = PostKey(epoch=write.epoch, slot=write.slot)
        nbytes = head.payload_len
        region = self._regions.get(key)
        if region is None:
            self._refuse(key, self._why_unknown(key))
            return DISCARD
        end = write.off + nbytes
        if end > len(region.view):
            self._refuse(
                key, f"{nbytes} B at offset {write.off} run past the region's {len(region.view)} B"
            )
            return DISCARD
        if write.off % region.itemsize or nbytes % region.itemsize:
            self._refuse(
                key,
                f"{nbytes} B at offset {write.off} are not whole elements of {region.itemsize} B",
            )
            return DISCARD
        landed = WriteLanded(key=key, offset=write.off, nbytes=nbytes, seq=write.seq)
        self._pending = (region, landed)
        return region.view[write.off : end]

    def end(self) -> None:
        """The WRITE whose head :meth:`begin` accepted is whole (and its MAC checked): tell
        the poster.  Nothing happens for a refused or cut-off write."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        region, landed = pending
        self._landed += 1
        self._bytes_landed += landed.nbytes
        region.on_landed(landed)

    def statistics(self) -> PostedStatistics:
        return PostedStatistics(
            posted=len(self._regions),
            writes_landed=self._landed,
            bytes_landed=self._bytes_landed,
            writes_refused=self._refused,
        )

    def _why_unknown(self, key: PostKey) -> str:
        if key in self._retired:
            return "it was retired"
        if key.epoch < self._floor:
            return f"its epoch is fenced (below {self._floor}: an old incarnation)"
        return "it is not posted"

    def _remember_retired(self, key: PostKey) -> None:
        self._retired[key] = None
        if len(self._retired) > RETIRED_MEMORY:
            self._retired.popitem(last=False)

    def _refuse(self, key: PostKey, reason: str) -> None:
        self._refused += 1
        n = self._refused
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            log.warning(
                "WRITE from %s to key %s refused: %s%s",
                self._link.peer_address,
                key,
                reason,
                ""
                if n < LOG_FIRST
                else f" ({n} refused on this link so far; logging 1 in {LOG_EVERY} from now on)",
            )
