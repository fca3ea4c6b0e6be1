"""The byte budget: what the daemon holds on a tenant's behalf, charged before it is held.

Rules: every buffer the daemon keeps because of a job -- a collective's arrays and landing
slots, a stochastic reduce's slots, a parameter-server shard and its copies -- is charged
here to the job and to its owner's uid *before* it is made, refused with ``limit`` naming the
setting when either would go over (``max_held_bytes_per_uid``, ``max_held_bytes_per_job``),
and released when freed.  Counting
alone (``max_collectives_per_job``) bounds how many things a tenant holds, not how large:
one 64 MiB solo allreduce name pinned 192 MiB, an all-to-all reduce name 512 MiB, and a
tenant whose arrays are sparse memfds paid nothing for what the daemon then held.

Theory of operation: a holder asks :meth:`ByteBudget.charge` for its bytes and keeps the
:class:`Charge` it gets; freeing the holder releases the charge (once; a second release is a
no-op, so a holder freed on two paths cannot release twice).  Totals are kept per uid and per
job, so a charge, a release and a refusal cost O(1) whatever else is held.  The job's owner is
who pays: the uid that opened the job on the fabric (:mod:`fabricd.engines.ownership`), also
for what a peer's frame builds before a local rank called -- that is the owner's job too.

Sans-IO: no clock and no I/O; the daemon derives the defaults from the node's memory
(:func:`fabricd.daemon.config.held_bytes_limits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from fabricd.engines.counts import count_down
from fabricd.errors import ErrorCode, OperationFailed

#: the settings a refusal names (docs/operations.md, "Limits")
PER_UID: Final = "max_held_bytes_per_uid"
PER_JOB: Final = "max_held_bytes_per_job"


@dataclass(slots=True, eq=False)
class Charge:
    """Bytes granted to one holder; :meth:`release` gives them back (once)."""

    budget: ByteBudget
    uid: int
    job: str
    nbytes: int
    what: str
    released: bool = field(default=False)

    def release(self) -> None:
        """Give the bytes back; later calls do nothing."""
        if not self.released:
            self.released = True
            self.budget._give_back(self)


class ByteBudget:
    """Totals held per uid and per job against two caps.

    Args:
        per_uid: the most one uid's jobs may make the daemon hold, in bytes.
        per_job: the most one job may make the daemon hold, in bytes.
        node: this node's id, for messages.
    """

    def __init__(self, *, per_uid: int, per_job: int, node: int = 0) -> None:
        if per_uid < 1 or per_job < 1:
            raise ValueError("byte budgets must be at least 1 byte")
        self.per_uid = per_uid
        self.per_job = per_job
        self._node = node
        self._by_uid: dict[int, int] = {}
        self._by_job: dict[str, int] = {}
        self.refused = {PER_UID: 0, PER_JOB: 0}  #: refusals by the setting that refused

    def charge(self, uid: int, job: str, nbytes: int, what: str) -> Charge:
        """Grant ``nbytes`` to ``what`` (a phrase: "collective 'g' of job 'j'") or refuse.

        Raises:
            OperationFailed: code ``limit``: the uid or the job would hold more than its cap;
                the message names the setting, what is held and what was asked (counted in
                :attr:`refused`).
        """
        if nbytes < 0:
            raise ValueError(f"cannot charge {nbytes} bytes")
        held_uid = self._by_uid.get(uid, 0)
        held_job = self._by_job.get(job, 0)
        if held_uid + nbytes > self.per_uid:
            self._refuse(PER_UID, f"uid {uid}'s jobs hold {size_text(held_uid)}", what, nbytes)
        if held_job + nbytes > self.per_job:
            self._refuse(PER_JOB, f"job {job!r} holds {size_text(held_job)}", what, nbytes)
        if nbytes:
            self._by_uid[uid] = held_uid + nbytes
            self._by_job[job] = held_job + nbytes
        return Charge(self, uid, job, nbytes, what)

    def held_by_uid(self) -> dict[int, int]:
        """Bytes held now per uid (uids holding nothing are left out)."""
        return dict(self._by_uid)

    def held_by_job(self) -> dict[str, int]:
        """Bytes held now per job (jobs holding nothing are left out)."""
        return dict(self._by_job)

    @property
    def held(self) -> int:
        """Bytes held now, every uid together."""
        return sum(self._by_uid.values())

    def _give_back(self, charge: Charge) -> None:
        if not charge.nbytes:
            return
        count_down(self._by_uid, charge.uid, charge.nbytes)
        count_down(self._by_job, charge.job, charge.nbytes)

    def _refuse(self, setting: str, held: str, what: str, nbytes: int) -> None:
        self.refused[setting] += 1
        cap = self.per_uid if setting == PER_UID else self.per_job
        raise OperationFailed(
            f"{what} needs {size_text(nbytes)} of daemon memory on node {self._node}, but {held} "
            f"of the {size_text(cap)} {setting} allows; free some (end unused collectives, "
            f"reduces or models) or ask the operator to raise {setting}",
            code=ErrorCode.LIMIT,
        )


def size_text(n: int) -> str:
    """``n`` bytes for a person: exact, in the largest binary unit that keeps it short."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.4g} {unit}" if value != int(value) else f"{int(value)} {unit}"
    return f"{n} B"
