"""The daemon's side of job ownership: who a client is, and what of ``status`` it may see.

The rules themselves are sans-IO, in :mod:`fabricd.engines.ownership`; this module builds them
from the configuration (``job_groups``, ``admin_gids``, and the daemon's own uid), turns a
client's kernel credentials into a :class:`~fabricd.engines.ownership.User`, and withholds the
rows of other users' jobs from the status a client asked for.

Which rows are private is a convention every service follows, so the node needs to know no
service's fields: a row (a dict in a top-level list of the status) that carries ``uid`` is a
client's, one that carries ``owner`` (and ``job``) is a job's.  A client's row is shown to its
own uid and to whoever may see its job; a job's row to whoever may see the job
(:meth:`~fabricd.engines.ownership.Ownership.may_see`).  Rows with neither (peers) are the
node's and shown to all.  How many rows were withheld is reported under ``hidden``, so
``fabricctl status`` can say that the list is not the whole daemon's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fabricd.engines.ownership import JobGrant, Ownership, User

if TYPE_CHECKING:
    from fabricd.daemon.config import Config
    from fabricd.daemon.sessions import ClientSession
    from fabricd.wire import Meta


def ownership(config: Config) -> Ownership:
    """The access rules ``config`` sets (it was validated, so every grant parses)."""
    return Ownership(
        grants=tuple(JobGrant.parse(text) for text in config.job_groups),
        admin_gids=frozenset(config.admin_gids),
        superusers=frozenset({0, os.geteuid()}),
    )


def user_of(session: ClientSession) -> User:
    """The user behind ``session``, from what the kernel said at its connect."""
    creds = session.conn.credentials
    return User(uid=creds.uid, gids=frozenset({creds.gid}) | creds.groups)


def redact(status: Meta, user: User, rules: Ownership) -> None:
    """Remove from ``status`` (in place) the rows ``user`` may not see; count them in
    ``status["hidden"]`` (list name -> rows withheld, empty when nothing was)."""
    hidden: dict[str, int] = {}
    if not rules.sees_everything(user):
        for key, rows in status.items():
            if not isinstance(rows, list):
                continue
            shown = [row for row in rows if _visible(row, user, rules)]
            if len(shown) != len(rows):
                status[key], hidden[key] = shown, len(rows) - len(shown)
    status["hidden"] = hidden


def visible(row: Meta, user: User, rules: Ownership) -> bool:
    """Whether ``user`` may see ``row`` (what :func:`redact` keeps)."""
    return rules.sees_everything(user) or _visible(row, user, rules)


def _visible(row: object, user: User, rules: Ownership) -> bool:
    if not isinstance(row, dict):
        return True
    if "uid" in row and row["uid"] == user.uid:
        return True
    if "owner" in row:
        job, owner = row.get("job"), row["owner"]
        if isinstance(job, str) and isinstance(owner, int):
            return rules.may_see(user, job, owner)
        return False
    return "uid" not in row
