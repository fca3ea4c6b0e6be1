"""A finding of F7 (tests/integration/test_notify_ack_faults.py), reduced to the engine and
fixed: the update :meth:`~fabricd.engines.stochastic.notify_ack.Reducer.resume` sends again was a
view of
the one outgoing buffer, which the next round stages into as soon as the ACK comes; the frame
then said round r, carried round r + 1 and failed its MAC.  It is a copy now."""

from __future__ import annotations

import numpy as np

from fabricd.engines.stochastic import graphs
from fabricd.engines.stochastic.notify_ack import (
    ACK,
    UPDATE,
    VERSION,
    Reducer,
    SendSignal,
    SendUpdate,
    Sync,
)


def reducer(rank: int) -> Reducer:
    return Reducer(
        rank=rank, graph=graphs.chain(2), sync=Sync.NOTIFY_ACK, dtype="float64", nbytes=8
    )


def test_a_resent_update_keeps_its_rounds_bytes_after_the_next_round_stages() -> None:
    sender, receiver = reducer(0), reducer(1)
    [update] = [a for a in sender.call(np.full(1, 2.0), 0.0) if isinstance(a, SendUpdate)]
    receiver.call(np.zeros(1), 0.0)
    view = receiver.landing(0, 0, len(update.payload))
    assert view is not None
    view[:] = update.payload
    receiver.landed(0, 0, 0.0)
    receiver.message(0, UPDATE, 0, 0.0)  # reduced; its ACK is lost with the links
    sender.interrupted(1)
    receiver.interrupted(0)
    # queued on the new data link, not written yet
    [resent] = [a for a in sender.resume(1) if isinstance(a, SendUpdate)]
    assert VERSION.unpack_from(resent.payload, 0)[0] == 1
    [ack] = [a for a in receiver.resume(0) if isinstance(a, SendSignal)]
    assert ack.tag == ACK
    sender.message(1, ACK, 0, 0.0)  # round 0 ends
    sender.call(np.full(1, 3.0), 0.0)  # round 1 stages into the same buffer
    assert VERSION.unpack_from(resent.payload, 0)[0] == 1  # still round 0's update
