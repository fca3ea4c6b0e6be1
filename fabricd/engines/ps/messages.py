"""The frames the parameter-server node engine sends, built from its engines' actions.

Rules: pure functions from what a :class:`~fabricd.engines.ps.worker.Worker` or a
:class:`~fabricd.engines.ps.server.ShardServer` decided to the PS frame that carries it
(:mod:`fabricd.frames.ps`), with the reasons in words a frame can carry; whom a frame goes to
and when is :mod:`fabricd.engines.ps.node`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.ps.scheduler import CopyGranted, Gather, Granted
from fabricd.engines.ps.shard_actions import (
    Acked,
    Answer,
    Forward,
    Logged,
    Need,
    Notice,
    Refuse,
    Snapshot,
)
from fabricd.engines.ps.worker import SendPush, SendReady
from fabricd.frames import ps as ps_frames
from fabricd.frames.ps import MAX_PS_REASON

if TYPE_CHECKING:
    from fabricd.engines.ps.gathering import Summed
    from fabricd.engines.ps.models import Key
    from fabricd.engines.ps.server import ShardServer
    from fabricd.engines.ps.worker import SendPull
    from fabricd.frames import registry
    from fabricd.wire import Meta


def to_server(
    key: Key,
    spec: Meta,
    worker: int,
    to: int,
    epoch: int,
    action: SendPush | SendPull | SendReady,
) -> tuple[registry.PeerFrame, bytes]:
    """A worker's push (PUSH, with its payload), pull (PULL) or ready update (READY) of one
    shard, for rank ``to``."""
    fields: Meta = {"job": key[0], "name": key[1], "shard": action.shard, "server": to}
    fields |= {"worker": worker, "epoch": epoch, "spec": spec}
    if isinstance(action, SendReady):
        ready = ps_frames.Ready(
            **fields,
            iteration=action.iteration,
            base=action.base,
            size=action.size,
            norm=action.norm,
            sizes=action.sizes,
            joint=action.joint,
        )
        return ready, b""
    if isinstance(action, SendPush):
        bounded = spec["replication"] == "bounded"  # (the only replication that rolls back)
        push = ps_frames.Push(
            **fields,
            iteration=action.iteration,
            base=action.base,
            group=action.group,
            base_epoch=action.base_epoch if bounded else None,
        )
        return push, bytes(action.payload)
    pull = ps_frames.Pull(**fields, clock=action.clock, since=action.since, direct=action.direct)
    return pull, b""


def to_worker(
    key: Key,
    shard: int,
    me: int,
    server: ShardServer,
    action: Acked | Answer | Notice | Refuse | Granted | CopyGranted,
) -> tuple[registry.PeerFrame, bytes]:
    """A shard's answer to a worker: PUSHED, PULLED (with the changed parameters, and the
    pulls a distributor forwards it to), a distribution tree's notice (PULLED with ``via``
    and ``expect_us``), a refused pull (PULLED with an error) or its scheduler's GRANT."""
    fields: Meta = {"job": key[0], "name": key[1], "shard": shard, "server": me}
    fields |= {"epoch": server.epoch, "worker": action.worker}
    if isinstance(action, Granted):
        grant = ps_frames.Grant(
            **fields,
            iteration=action.iteration,
            wait_us=_micros(action.wait),
            via=action.via,
            group=action.group,
            copy_us=None if action.copy_wait is None else _micros(action.copy_wait),
        )
        return grant, b""
    if isinstance(action, CopyGranted):
        copy = ps_frames.Grant(
            **fields, iteration=action.iteration, wait_us=_micros(action.wait), copy_only=True
        )
        return copy, b""
    if isinstance(action, Acked):
        dropped = text(action.dropped)
        pushed = ps_frames.Pushed(
            **fields, iteration=action.iteration, version=action.version, dropped=dropped
        )
        return pushed, b""
    if isinstance(action, Answer):
        answer = ps_frames.Pulled(
            **fields, clock=action.clock, version=action.version, forward=action.forward
        )
        return answer, bytes(action.data)
    if isinstance(action, Notice):
        notice = ps_frames.Pulled(
            **fields,
            clock=action.clock,
            version=action.version,
            via=action.via,
            expect_us=_micros(action.expect),
        )
        return notice, b""
    error = text(action.reason)
    return ps_frames.Pulled(**fields, clock=action.clock, version=server.version, error=error), b""


def refusal(
    key: Key,
    frame: ps_frames.Push | ps_frames.Pull | ps_frames.Ready,
    why: str,
    epoch: int | None,
) -> ps_frames.Pushed | ps_frames.Pulled:
    """``frame`` answered with ``why`` (a push as not applied, a pull as failed); ``epoch``:
    the shard's later epoch, which moves the worker's daemon to the rank serving it."""
    common: Meta = {"job": key[0], "name": key[1], "shard": frame.shard, "server": frame.server}
    common |= {"worker": frame.worker, "epoch": frame.epoch if epoch is None else epoch}
    if isinstance(frame, ps_frames.Push | ps_frames.Ready):
        return ps_frames.Pushed(**common, iteration=frame.iteration, version=0, dropped=text(why))
    return ps_frames.Pulled(**common, clock=frame.clock, version=0, error=text(why))


def to_partner(
    key: Key, spec: Meta, shard: int, me: int, other: int, action: Forward | Snapshot
) -> tuple[ps_frames.Replicate, bytes]:
    """A primary's entry or snapshot for its partner (REPLICATE, with its payload)."""
    if isinstance(action, Forward):
        entry = action.entry
        index, kind, payload = entry.index, entry.kind, entry.payload
        fields = (entry.worker, entry.iteration, entry.base, text(entry.reason))
    else:
        index, kind, payload = action.index, "snapshot", action.data
        fields = (0, 0, 0, None)
    frame = ps_frames.Replicate(
        job=key[0],
        name=key[1],
        shard=shard,
        server=me,
        replica=other,
        index=index,
        entry=kind,
        worker=fields[0],
        iteration=fields[1],
        base=fields[2],
        reason=fields[3],
        spec=spec,
        members=action.entry.members if isinstance(action, Forward) else None,
        copied=isinstance(action, Forward) and action.entry.copied,
        digest=(action.entry.digest or None) if isinstance(action, Forward) else None,
    )
    return frame, bytes(payload)


def confirmation(
    key: Key, shard: int, me: int, other: int, action: Logged | Need
) -> registry.PeerFrame:
    """A replica's REPLICATED: every entry up to the action's index is logged, or (``Need``)
    the entry of that index is asked for whole."""
    return ps_frames.Replicated(
        job=key[0],
        name=key[1],
        shard=shard,
        server=other,
        replica=me,
        index=action.index,
        need=isinstance(action, Need),
    )


def join(key: Key, spec: Meta, shard: int, me: int, other: int, epoch: int) -> registry.PeerFrame:
    """A JOIN asking the shard's partner for its state."""
    return ps_frames.Join(
        job=key[0], name=key[1], shard=shard, server=other, replica=me, epoch=epoch, spec=spec
    )


def unlike(worker: Meta, server: Meta) -> str:
    """Why a server refuses a worker's frame whose spec is unlike its own."""
    return f"the worker opened it as {describe(worker)}, the server as {describe(server)}"


def why_not_serving(server: ShardServer, epoch: int) -> str:
    """Why this rank refuses a worker's frame at ``epoch``."""
    if not server.has_state:
        return (
            "the shard's state is lost: this rank came back (or opened) after its partner "
            "served the shard, and the partner went before sending it the state"
        )
    if epoch > server.epoch:
        return (
            f"the shard's state is lost: its workers are at epoch {epoch}, but this rank "
            f"holds epoch {server.epoch} (it restarted after every copy of the shard went)"
        )
    role = "serves" if server.primary else "follows its partner"
    return (
        f"this rank {role} the shard at epoch {server.epoch}; the worker's daemon is at "
        f"epoch {epoch}"
    )


def text(why: str | None) -> str | None:
    """A reason as a frame carries it: 1 to ``MAX_PS_REASON`` characters (or none)."""
    if why is None:
        return None
    return (why or "no reason given")[:MAX_PS_REASON]


def describe(spec: Meta) -> str:
    """A model's spec in words."""
    return (
        f"{spec['size']} x {spec['dtype']} on servers {spec['servers']}"
        + (f" (replicas {spec['replicas']})" if spec["replicas"] else "")
        + f", {spec['consistency']}"
        + (f"({spec['staleness']})" if spec["consistency"] == "ssp" else "")
        + (f", tau_max {spec['delay_bound']}" if spec["delay_bound"] is not None else "")
        + (f", chunks of {spec['chunk']}" if spec["chunk"] != 1 else "")
    )


def _micros(seconds: float) -> int:
    """A wait in whole microseconds, as GRANT and GATHER carry it (at most their largest)."""
    if not seconds * 1e6 < ps_frames.MAX_GRANT_WAIT_US:  # (an infinite or NaN one too)
        return ps_frames.MAX_GRANT_WAIT_US
    return max(0, round(seconds * 1e6))


def gather(
    key: Key, spec: Meta, shard: int, me: int, epoch: int, action: Gather
) -> ps_frames.Gather:
    """A shard's scheduler's GATHER for the aggregator of one group (MLfabric §5.2)."""
    return ps_frames.Gather(
        job=key[0],
        name=key[1],
        shard=shard,
        server=me,
        epoch=epoch,
        group=action.group,
        members=action.members,
        wait_us=_micros(action.wait),
        spec=spec,
    )


def aggregate(key: Key, spec: Meta, sender: int, summed: Summed) -> tuple[ps_frames.Push, bytes]:
    """An aggregator's sum of a group's pushes for the group's server (PUSH with ``in``);
    ``sender`` is a worker rank of the aggregating node (its frames count from there)."""
    _, shard, server, epoch, group = summed.group
    push = ps_frames.Push(
        job=key[0],
        name=key[1],
        shard=shard,
        server=server,
        worker=sender,
        iteration=group,
        base=0,
        epoch=epoch,
        spec=spec,
        members=summed.members,
    )
    return push, bytes(summed.payload)
