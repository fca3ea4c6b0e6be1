"""Peer frames a collective service reads and drops without resetting the peer's links.

A peer's links carry every tenant's traffic between two nodes, so a frame that one tenant's
job cannot use here -- sent by a node that hosts no rank of the job, or for a collective a
limit keeps from being built -- is refused on its own: dropped, counted under the exception's
:attr:`Refused.counter`, and logged (issue 28).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabricd.frames import collectives as collectives_frames


class Refused(Exception):
    """A peer's frame this node reads and drops, counted under :attr:`counter`: never a
    reason to reset the peer's links, which every tenant's traffic shares."""

    counter = "frames_dropped"


class Stranger(Refused):
    """A peer's frame for a collective of a job that peer hosts no rank of."""

    counter = "frames_refused_not_member"

    def __init__(self, node: int, frame: collectives_frames.Coll) -> None:
        super().__init__(
            f"node {node} sent a frame of collective {frame.name!r} of job {frame.job!r}, "
            "whose ranks it hosts none of: refused"
        )


class OverLimit(Refused):
    """A peer's frame for a collective this node may not build (the job's or its owner's
    byte budget, or ``max_collectives_per_job``)."""

    counter = "frames_refused_limit"
