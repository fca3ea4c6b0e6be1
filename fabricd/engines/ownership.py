"""Who owns a job, and who else may join it or see it.

Rules: this module holds the access rules for jobs and nothing else.  It decides from a user's
uid and groups, a job's name and its owner; the rank table that remembers owners is
:mod:`fabricd.engines.membership`, and the daemon reads a client's uid and groups from the
kernel (SO_PEERCRED, SO_PEERGROUPS), never from what the client says.

Theory of operation: the first client to open a job on the fabric makes its uid the job's
*owner* (the membership engine records it and sends it with every ANNOUNCE, so every daemon
knows it).  Joining a job means claiming one of its ranks, and only a rank of the job can send
to or receive from its ranks, so the one check at join time keeps a job's traffic to the users
it is meant for.  Another uid may join only if one of its groups (primary or supplementary) is
granted the job by a ``job_groups`` entry ``"pattern:gid"``, where ``pattern`` is a shell-style
glob matched against the whole job name (``train-*``, ``exp?``, or an exact name).  Root gets no
exemption here: a job name is a meeting point, and root's script that picks a user's job name
by accident must not mix into that job.

Seeing is wider than joining: whoever may join a job may see its ranks and clients in
``status``; root, the daemon's own uid and members of ``admin_gids`` see everything (they can
read the daemon's memory or its log anyway).  Every decision is O(grants).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase


@dataclass(frozen=True, slots=True, kw_only=True)
class User:
    """Who a client is, as the kernel told the daemon."""

    uid: int
    gids: frozenset[int] = frozenset()  #: the primary group and every supplementary one


@dataclass(frozen=True, slots=True, kw_only=True)
class JobGrant:
    """Members of group ``gid`` may join (and see) every job whose name matches ``pattern``."""

    pattern: str
    gid: int

    @classmethod
    def parse(cls, text: str) -> JobGrant:
        """Read ``"pattern:gid"`` (split at the last colon, so a pattern may hold colons).

        Raises:
            ValueError: no colon, an empty pattern, or a gid that is not a number >= 0.
        """
        pattern, colon, gid = text.rpartition(":")
        if not colon or not pattern:
            raise ValueError(f"{text!r} is not 'pattern:gid' (e.g. 'train-*:2000')")
        if not gid.isdigit():
            raise ValueError(f"{text!r}: the group must be a numeric gid, not {gid!r}")
        return cls(pattern=pattern, gid=int(gid))

    def covers(self, job: str) -> bool:
        """Whether ``job`` is one of the jobs this grant names."""
        return fnmatchcase(job, self.pattern)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ownership:
    """The access rules of one daemon (from ``job_groups`` and ``admin_gids``)."""

    grants: tuple[JobGrant, ...] = ()
    admin_gids: frozenset[int] = frozenset()
    #: uids that see every job in ``status`` (root and the daemon's own uid)
    superusers: frozenset[int] = field(default_factory=lambda: frozenset({0}))

    def may_join(self, user: User, job: str, owner: int) -> bool:
        """Whether ``user`` may claim a rank of ``job``, which ``owner`` opened."""
        if user.uid == owner:
            return True
        return any(g.gid in user.gids and g.covers(job) for g in self.grants)

    def may_see(self, user: User, job: str, owner: int) -> bool:
        """Whether ``user`` may see ``job``'s ranks and clients in ``status``."""
        return self.sees_everything(user) or self.may_join(user, job, owner)

    def sees_everything(self, user: User) -> bool:
        """Root, the daemon's own uid and ``admin_gids`` members see every job."""
        return user.uid in self.superusers or not self.admin_gids.isdisjoint(user.gids)

    def refusal(self, user: User, job: str, owner: int) -> str:
        """Why ``user`` may not join ``job``, and which setting would let it."""
        return (
            f"job {job!r} belongs to uid {owner}, and no job_groups entry of this daemon grants "
            f"it to a group of uid {user.uid}; use another job name, or have the operator add "
            f"'{job}:<gid>' to job_groups for a group you are in"
        )
