"""Review of issue 8's engine (eager, credit, pool, RTR): interleavings that once reset a
healthy peer or broke the engine's own rules, over two independent channels (fakenet.py,
``data_channel``).  Layout as in test_p2p_eager.py: ranks 0 and 1 on node 0, 2 and 3 on node 1.
"""

from __future__ import annotations

from test_p2p_eager import BIG, check_idle, code, deliver_all, layout, payload

from fabricd.engines.landing import CANCELLED_KEPT
from fabricd.frames import Rtr


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
