"""What a Slurm job says about its fabric and its ranks, read from Slurm's variables.

Slurm describes a job in its environment: the hosts of the allocation as a compressed hostlist
(``SLURM_JOB_NODELIST=node[01-03,07],gpu-a[1-2]``), this node's name (``SLURMD_NODENAME``),
and, in each task that ``srun`` starts, the task's rank among the step's tasks
(``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS``) and on its node (``SLURM_LOCALID``).  This
module turns that into what fabricd needs (docs/slurm.md):

* the job's fabric (:class:`SlurmJob`): the node list every daemon of the job agrees on (the
  hostlist, expanded in its own order), this node's index in it, the peer port, and where the
  job's daemon keeps its socket on each node;
* a task's identity (:func:`task_identity`): rank, world size, local rank and local world size,
  and torch's ``env://`` rendezvous (``MASTER_ADDR``, ``MASTER_PORT``), which
  ``fabricctl slurm run`` exports and :func:`fabricd.connect` reads directly.

``RANK`` and ``WORLD_SIZE`` already set win over Slurm's: torchrun sets them for the processes
it starts (``srun torchrun ...`` runs one torchrun per node, each with a ``SLURM_PROCID`` that
is not a trainer's rank), and a user who sets them by hand means them.

Only a task of a job *step* has a rank: ``srun`` sets ``SLURM_STEP_NUM_TASKS``, while a batch
script's own process also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS``, and taking those for a
rank would make the batch script a rank 0 that never meets the others.

Rules: pure functions of a mapping of variables, no I/O but :func:`job_has_daemon`'s look
at the job's directory; the client imports this module
(tests/unit/test_arrows.py), so it loads nothing of the daemon.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fabricd.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

#: the site's key from which the prolog derives each job's secret (the same on every node)
DEFAULT_KEY_FILE: Final = "/etc/fabricd/slurm.key"
#: where the per-job daemons of the prolog keep their directories, one per job id, on each node
JOB_ROOT: Final = "/run/fabricd-slurm"
#: the job's daemons listen on ``PORT_BASE + 2 * (job id % PORT_SLOTS)``; torch's rendezvous
#: (``MASTER_PORT``) takes the port above.  Below Linux's ephemeral range (32768-60999), so an
#: outgoing connection never holds it, and above Slurm's own 6817/6818.
PORT_BASE: Final = 21000
#: how many jobs on one node can hold distinct ports: job ids this many apart share theirs
PORT_SLOTS: Final = 4000
#: the most hosts one hostlist may expand to (Slurm's largest clusters are far below)
MAX_HOSTS: Final = 1 << 16

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_NAME = re.compile(r"[^\[\],\s]+")
_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmError(ConfigError):
    """A Slurm variable that is missing or malformed (a hostlist that is not Slurm's syntax,
    or expands to more than :data:`MAX_HOSTS`, a rank that is not a number, ...)."""


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm hostlist, in its order (as ``scontrol show hostnames``).

    ``node[01-03,07],gpu-a[1-2]`` is node01, node02, node03, node07, gpu-a1, gpu-a2.  A range
    keeps the width of its lower bound (``[08-10]`` is 08, 09, 10; ``[8-10]`` is 8, 9, 10);
    several brackets in one name multiply out, the rightmost fastest (``r[1-2]n[1-2]`` is
    r1n1, r1n2, r2n1, r2n2).

    Raises:
        SlurmError: unbalanced brackets, an empty name, a bad range, or too many hosts.
    """
    hosts: list[str] = []
    for entry in _split_top_level(text):
        hosts.extend(_expand_entry(entry))
        if len(hosts) > MAX_HOSTS:
            raise SlurmError(f"hostlist {text[:80]!r} names more than {MAX_HOSTS} hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets; an empty entry is an error."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"hostlist {text[:80]!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"hostlist {text[:80]!r}: ']' without '['")
        elif char == "," and depth == 0:
            entries.append(text[start:index].strip())
            start = index + 1
    if depth:
        raise SlurmError(f"hostlist {text[:80]!r}: '[' without ']'")
    entries.append(text[start:].strip())
    if any(not entry for entry in entries):
        raise SlurmError(f"hostlist {text[:80]!r}: an empty host name")
    return entries


def _expand_entry(entry: str) -> list[str]:
    """One name with zero or more bracketed range lists, multiplied out."""
    match = _BRACKET.search(entry)
    if match is None:
        if not _NAME.fullmatch(entry):
            raise SlurmError(f"host name {entry!r} holds a space, bracket or comma")
        return [entry]
    head, rest = entry[: match.start()], entry[match.end() :]
    if head and not _NAME.fullmatch(head):
        raise SlurmError(f"host name {entry!r} holds a space")
    tails = _expand_entry(rest) if rest else [""]
    if len(tails) > MAX_HOSTS:
        raise SlurmError(f"host name {entry[:80]!r} names more than {MAX_HOSTS} hosts")
    names: list[str] = []
    for number in _expand_ranges(match[1], entry):
        names.extend(head + number + tail for tail in tails)
        if len(names) > MAX_HOSTS:
            raise SlurmError(f"host name {entry[:80]!r} names more than {MAX_HOSTS} hosts")
    return names


def _expand_ranges(ranges: str, entry: str) -> list[str]:
    """``01-03,07`` as ``["01", "02", "03", "07"]``: each range at its lower bound's width."""
    numbers: list[str] = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise SlurmError(f"host name {entry!r}: {part!r} is not a number or a range")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise SlurmError(f"host name {entry!r}: range {part!r} runs backwards")
        if last - first + len(numbers) >= MAX_HOSTS:
            raise SlurmError(f"host name {entry!r} names more than {MAX_HOSTS} hosts")
        numbers.extend(str(n).zfill(len(low)) for n in range(first, last + 1))
    return numbers


def collapse_hostlist(hosts: list[str]) -> str:
    """A hostlist that :func:`expand_hostlist` turns back into exactly ``hosts``, in order.

    Consecutive names that differ only in a trailing number counting up by one share a range
    (node01, node02, node03 is ``node[01-03]``); nothing is reordered, so the node order, which
    is every daemon's node id, survives the round trip.

    Raises:
        SlurmError: a name holds a bracket, comma or space, or is empty.
    """
    runs: list[tuple[str, int, int, int]] = []  # (prefix, width, first, last); width 0: no number
    for host in hosts:
        if not _NAME.fullmatch(host):
            raise SlurmError(f"host name {host!r} is empty or holds a bracket, comma or space")
        match = _TRAILING_DIGITS.match(host)
        if match is None:
            runs.append((host, 0, 0, 0))
            continue
        prefix, digits = match[1], match[2]
        number = int(digits)
        if runs:
            last_prefix, width, first, last = runs[-1]
            if (
                width
                and last_prefix == prefix
                and number == last + 1
                and str(number).zfill(width) == digits
            ):
                runs[-1] = (prefix, width, first, number)
                continue
        runs.append((prefix, len(digits), number, number))
    return ",".join(_format_run(*run) for run in runs)


def _format_run(prefix: str, width: int, first: int, last: int) -> str:
    """One entry of :func:`collapse_hostlist`."""
    if not width:
        return prefix
    if first == last:
        return f"{prefix}{str(first).zfill(width)}"
    return f"{prefix}[{str(first).zfill(width)}-{str(last).zfill(width)}]"


def expand_task_counts(text: str) -> list[int]:
    """Slurm's tasks per node (``SLURM_STEP_TASKS_PER_NODE=2(x3),1``) as ``[2, 2, 2, 1]``.

    Raises:
        SlurmError: not of that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.fullmatch(part.strip())
        if match is None:
            raise SlurmError(f"tasks per node {text[:80]!r}: {part!r} is not N or N(xM)")
        repeat = int(match[2] or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise SlurmError(f"tasks per node {text[:80]!r} covers more than {MAX_HOSTS} nodes")
        counts.extend([int(match[1])] * repeat)
    return counts


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmJob:
    """A job's fabric: one daemon on each node of its allocation."""

    #: ``SLURM_JOB_ID``
    job_id: int
    #: the allocation's hosts, in the hostlist's order: node ``i`` of the fabric is ``nodes[i]``
    nodes: tuple[str, ...]
    #: this node's name, one of :attr:`nodes`
    node_name: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], hostname: str) -> SlurmJob:
        """The job that ``environ`` (a prolog's, or a task's) describes, on host ``hostname``.

        The node list is ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST`` (what a 22.05 prolog
        gets); this node is ``SLURMD_NODENAME``, else ``hostname`` (its short name too).

        Raises:
            SlurmError: no job id or node list, or this node is not in the list.
        """
        job = job_id_of(environ)
        if job is None:
            raise SlurmError("SLURM_JOB_ID is not set to a job id: not inside a Slurm job")
        listed = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not listed:
            raise SlurmError("neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set")
        nodes = tuple(expand_hostlist(listed))
        name = environ.get("SLURMD_NODENAME") or _own_name(hostname, nodes)
        if name not in nodes:
            raise SlurmError(f"this node, {name!r}, is not in the job's nodes {listed!r}")
        return cls(job_id=job, nodes=nodes, node_name=name)

    @property
    def node_id(self) -> int:
        """This node's index in :attr:`nodes`: its ``node_id`` in the fabric."""
        return self.nodes.index(self.node_name)

    @property
    def port(self) -> int:
        """The port every daemon of the job listens on (:data:`PORT_BASE`)."""
        return job_port(self.job_id)

    @property
    def directory(self) -> str:
        """The job's directory on each node: its daemon's config, secret, socket and log."""
        return job_directory(self.job_id)

    @property
    def run_directory(self) -> str:
        """The job user's part of :attr:`directory`: where the daemon binds its socket."""
        return job_run_directory(self.job_id)

    @property
    def socket_path(self) -> str:
        """Where the job's daemon listens for the job's ranks on this node."""
        return job_socket(self.job_id)


def job_port(job_id: int) -> int:
    """The peer port of job ``job_id``'s daemons; ``MASTER_PORT`` is the one above."""
    return PORT_BASE + 2 * (job_id % PORT_SLOTS)


def job_directory(job_id: int) -> str:
    """Job ``job_id``'s directory on each of its nodes (:attr:`SlurmJob.directory`)."""
    return f"{JOB_ROOT}/{job_id}"


def job_run_directory(job_id: int) -> str:
    """The subdirectory of :func:`job_directory` that the job's user owns (its socket's).

    The job directory itself stays root's: the files root reads back in the epilog (the
    daemon's pid) must be out of the user's reach (docs/slurm.md, "Security").
    """
    return f"{job_directory(job_id)}/run"


def job_socket(job_id: int) -> str:
    """The client socket of job ``job_id``'s daemon on each of its nodes."""
    return f"{job_run_directory(job_id)}/fabricd.sock"


def job_socket_candidates(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Where a client inside a Slurm job looks first: its job's socket; ``()`` outside one."""
    job = job_id_of(environ)
    return () if job is None else (job_socket(job),)


def job_has_daemon(environ: Mapping[str, str]) -> bool:
    """Whether the prolog made this job a daemon of its own on this node (its directory is
    there): then a client must use that daemon's socket and no other."""
    job = job_id_of(environ)
    return job is not None and os.path.isdir(job_directory(job))


def job_id_of(environ: Mapping[str, str]) -> int | None:
    """``SLURM_JOB_ID`` as a number, or None when unset or not one."""
    raw = environ.get("SLURM_JOB_ID", "")
    return int(raw) if raw.isdigit() else None


def _own_name(hostname: str, nodes: tuple[str, ...]) -> str:
    """``hostname``, or its first label when only that is in ``nodes`` (Slurm names nodes by
    short name, while a host may call itself by its full one)."""
    return hostname if hostname in nodes else hostname.split(".", 1)[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskIdentity:
    """A training process's place in its job, as torch's ``env://`` and fabricd read it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: where rank 0 runs: the step's first host ("" when unknown)
    master_addr: str
    #: torch's rendezvous port (0 when unknown)
    master_port: int
    #: "environment" (``RANK`` and ``WORLD_SIZE`` were set: torchrun, or by hand) or "slurm"
    source: str

    def variables(self) -> dict[str, str]:
        """The variables torch and fabricd read, as strings (the unknown ones left out)."""
        found = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        if self.master_addr:
            found["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            found["MASTER_PORT"] = str(self.master_port)
        return found


def task_identity(environ: Mapping[str, str]) -> TaskIdentity | None:
    """This process's rank and world size: torchrun's (or hand-set) variables, else the Slurm
    step's; None when neither says (a batch script's own process, or no launcher at all).

    Raises:
        SlurmError: a variable that Slurm or torchrun sets is malformed.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        return TaskIdentity(
            rank=rank,
            world_size=size,
            # set by hand without LOCAL_RANK: Slurm's, if a task of srun, else one node's
            local_rank=_int(environ, "LOCAL_RANK", _int(environ, "SLURM_LOCALID", rank)),
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", size),
            master_addr=environ.get("MASTER_ADDR", ""),
            master_port=_int(environ, "MASTER_PORT", 0),
            source="environment",
        )
    if "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    return _slurm_identity(environ)


def _slurm_identity(environ: Mapping[str, str]) -> TaskIdentity:
    """The identity of a task that ``srun`` started."""
    node = _int(environ, "SLURM_NODEID", 0)
    per_node = expand_task_counts(environ.get("SLURM_STEP_TASKS_PER_NODE", "1"))
    if not 0 <= node < len(per_node):
        raise SlurmError(
            f"SLURM_NODEID={node} is not a node of SLURM_STEP_TASKS_PER_NODE="
            f"{environ.get('SLURM_STEP_TASKS_PER_NODE')!r}"
        )
    listed = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    job = job_id_of(environ)
    # a block or cyclic distribution puts task 0 on the step's first node
    return TaskIdentity(
        rank=_int(environ, "SLURM_PROCID"),
        world_size=_int(environ, "SLURM_STEP_NUM_TASKS"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=per_node[node],
        master_addr=expand_hostlist(listed)[0] if listed else "",
        master_port=job_port(job) + 1 if job is not None else 0,
        source="slurm",
    )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """``$name`` as an int; ``default`` when unset (an error if there is none)."""
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise SlurmError(f"${name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmError(f"${name}={raw!r} is not an integer") from None


def stale_rank_warning(environ: Mapping[str, str]) -> str:
    """Why ``WORLD_SIZE`` looks stale in a task of ``srun``, or "" when it does not.

    ``RANK`` and ``WORLD_SIZE`` win over Slurm's (:func:`task_identity`), and ``srun`` passes
    the submitting shell's on: ones exported there by hand, for another run, would silently
    make a wrong world.  Outside torchrun (no ``TORCHELASTIC_*`` variable), a ``WORLD_SIZE``
    other than the step's task count is most likely that.
    """
    size, tasks = environ.get("WORLD_SIZE"), environ.get("SLURM_STEP_NUM_TASKS")
    if size is None or tasks is None or size == tasks:
        return ""
    if any(name.startswith("TORCHELASTIC_") for name in environ):
        return ""
    return (
        f"WORLD_SIZE={size} is set, but this srun step has {tasks} tasks: the set RANK and "
        "WORLD_SIZE win; unset them if the submitting shell exported them for another run"
    )


def launch_environment(
    environ: Mapping[str, str], job_socket_exists: bool = False
) -> dict[str, str]:
    """The variables ``fabricctl slurm run`` adds to ``environ`` before it runs the trainer.

    Rank, world size and local rank and size come from :func:`task_identity`, so torchrun's
    stay as torchrun set them; ``MASTER_ADDR``, ``MASTER_PORT`` and ``FABRICD_SOCKET`` are only
    added when not set, and ``FABRICD_SOCKET`` only when the job's daemon is there
    (``job_socket_exists``), so that without one the client still finds the node's daemon.

    Raises:
        SlurmError: no task identity (not a task of ``srun``), or a malformed variable.
    """
    identity = task_identity(environ)
    if identity is None:
        raise SlurmError(
            "no rank here: run this as a task of srun (SLURM_STEP_NUM_TASKS is unset), or set "
            "RANK and WORLD_SIZE"
        )
    chosen = identity.variables()
    # srun passes the submitting shell's variables on: a stale LOCAL_RANK there is not this task's
    fixed = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    replace = fixed if identity.source == "slurm" else ()
    added = {k: v for k, v in chosen.items() if k in replace or k not in environ}
    sockets = job_socket_candidates(environ)
    if job_socket_exists and sockets and "FABRICD_SOCKET" not in environ:
        added["FABRICD_SOCKET"] = sockets[0]
    return added
