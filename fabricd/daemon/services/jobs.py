"""What the services that run over a job's ranks (collectives, stochastic reduce) share: the
failure of a call that waited too long for the job's ranks to join, and which incarnation of a
peer the peers engine admitted (a node back after a reset is the same daemon only with the
same one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.actions import Failure
from fabricd.errors import ErrorCode

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from fabricd.engines.link.peers import PeerInfo
    from fabricd.engines.membership import Membership

#: missing ranks a failure names (the rest is "...")
_SHOWN: int = 10


def waited_too_long(
    what: str, job: str, size: int, membership: Membership, route_timeout: float
) -> Failure:
    """``no_such_rank`` for a call (``what``: "allreduce 'grad'") that waited
    ``route_timeout`` for the ranks of ``job`` not known yet, naming them."""
    missing = [r for r in range(size) if membership.lookup(job, r) is None]
    shown = ", ".join(map(str, missing[:_SHOWN])) + (" ..." if len(missing) > _SHOWN else "")
    return Failure(
        code=ErrorCode.NO_SUCH_RANK,
        message=(
            f"{what} of job {job!r} waited route_timeout ({route_timeout} s) for ranks {shown} "
            "to join; start them, or check their daemons are peers of this one"
        ),
    )


def admitted_incarnation(
    peers: Callable[[float], Iterable[PeerInfo]] | None, node: int, now: float
) -> int | None:
    """The incarnation the peers engine last admitted for ``node``, if it knows one."""
    if peers is None:
        return None
    return next((p.incarnation for p in peers(now) if p.node == node), None)
