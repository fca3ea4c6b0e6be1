"""ANNOUNCE: which ranks of which jobs a node hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fabricd.frames.fields import MAX_RANK, MAX_UID
from fabricd.wire import Kind, Meta, get_int, get_str


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """``rank`` of ``job`` (of ``size`` ranks) now lives (``present``) or no longer lives there.

    ``owner`` is the uid of the job's owner as the sender knows it (the uid of the client that
    opened the job, not necessarily of the rank's own client, which a ``job_groups`` grant may
    have let in): every daemon enforces one owner per job (docs/architecture.md, "Jobs and
    their owners").
    """

    KIND: ClassVar[Kind] = Kind.ANNOUNCE
    job: str
    rank: int
    size: int
    present: bool
    owner: int

    def to_meta(self) -> Meta:
        return {
            "job": self.job,
            "rank": self.rank,
            "size": self.size,
            "present": self.present,
            "owner": self.owner,
        }

    @classmethod
    def from_meta(cls, meta: Meta) -> Announce:
        return cls(
            job=get_str(meta, "job"),
            rank=get_int(meta, "rank", hi=MAX_RANK),
            size=get_int(meta, "size", lo=1, hi=MAX_RANK),
            present=meta.get("present") is True,
            owner=get_int(meta, "owner", hi=MAX_UID),
        )
