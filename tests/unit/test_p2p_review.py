"""Review of issue 8's engine (eager, credit, pool, RTR): interleavings that once reset a
healthy peer or broke the engine's own rules, over two independent channels (fakenet.py,
``data_channel``).  Layout as in test_p2p_eager.py: ranks 0 and 1 on node 0, 2 and 3 on node 1.
"""

from __future__ import annotations

import pytest
from test_p2p_eager import BIG, check_idle, code, deliver_all, layout, payload

from fabricd.engines.landing import CANCELLED_KEPT
from fabricd.frames.p2p import Rtr


def test_data_of_an_answered_rtr_is_dropped_after_many_receives_are_abandoned() -> None:
    """A client that leaves with more receives than the landing table remembers cancels of
    (each with an RTR out) must not push out the mark of the one whose RTR the sender already
    answered: its DATA, on the data link, then reset a healthy peer as unasked-for DATA."""
    net = layout()
    many = CANCELLED_KEPT + 8
    recvs = [net.recv(1, src=0, dst=2, nbytes=BIG) for _ in range(many)]
    deliver_all(net, 1, 0)  # every RTR reaches the sender, which keeps them
    assert sum(isinstance(f, Rtr) for _, _, f in net.frames) == many
    send = net.send(0, src=0, dst=2, data=payload(1, BIG))  # answers the first RTR at once
    assert net.data_links[0, 1], "the send streams without a CTS"
    net.detach(1, 2, recvs)  # the receiving client leaves, oldest receive first
    net.run()  # the DATA of the answered RTR arrives after its receive was abandoned
    assert code(net, 0, send) == "receiver_left"
    check_idle(net)


@pytest.mark.xfail(
    strict=True,
    reason="an RTR sent before its source rank left is answered by the rank's next client "
    "(not fixed: the sender cannot tell such an RTR from a new one without a protocol change)",
)
def test_an_rtr_from_before_its_source_rank_left_is_not_answered_after_it_rejoins() -> None:
    """The receiver voids RTR 1 (a plain RTS takes its receive) while RTR 1 is on its way; the
    sending client leaves and its rank rejoins before RTR 1 arrives, so the sender keeps it and
    the new client's first send answers it.  Its DATA must not reset the peer (it no longer
    does), and that send should meet the receive posted for it, not fail ``receiver_left``."""
    net = layout()
    net.hold(1, 0)
    first = net.recv(1, src=0, dst=2, nbytes=BIG)  # RTR 1 waits on the held link
    old = net.send(0, src=0, dst=2, data=payload(1, BIG))  # plain: no RTR kept yet
    deliver_all(net, 0, 1)  # the RTS takes the receive and voids RTR 1; CTS held behind it
    net.detach(0, 0, [old])  # the sending client leaves (CANCEL), and its rank ...
    net.attach(0, 0)  # ... rejoins at once
    net.release(1, 0)
    net.run()  # RTR 1 is kept: the rank is here again and nothing of the key is unanswered
    assert code(net, 1, first) == "peer_failed"
    second = net.recv(1, src=0, dst=2, nbytes=BIG)
    new = net.send(0, src=0, dst=2, data=payload(2, BIG))
    net.run()  # no RemoteProtocolError: the DATA naming voided RTR 1 is dropped
    assert net.ok(0, new), code(net, 0, new)
    assert net.region(1, second) == payload(2, BIG)
    check_idle(net)
