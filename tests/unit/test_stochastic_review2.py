"""Second review of stochastic reduce: how the suspicion of ranks whose node's links reset
meets the job's end.

The service runs on the first review's fake host (:mod:`tests.unit.test_stochastic_service_review`)
over a real membership engine, whose news it hears as the membership service delivers it.
Every test here shows a bug the review found, since fixed: they stay as regression tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabricd.engines.membership import Membership, RankJoined, RankLeft, Suspicion
from fabricd.engines.ownership import User
from fabricd.frames.membership import Announce
from tests.unit.test_stochastic_service_review import JOB, call, client, service

if TYPE_CHECKING:
    from fabricd.engines.membership import Action

OWNER = User(uid=1000)


class Fabric:
    """Node 0's stochastic service and membership engine."""

    def __init__(self) -> None:
        self.members = Membership(node=0)
        self.svc, self.host = service(self.members)  # type: ignore[arg-type]

    def start(self, nodes: tuple[int, ...], now: float) -> None:
        """A job of ``len(nodes)`` ranks, rank r on node ``nodes[r]``."""
        for rank, node in enumerate(nodes):
            if node == 0:
                self.hear(self.members.attach(JOB, rank, len(nodes), user=OWNER), now)
            else:
                frame = Announce(job=JOB, rank=rank, size=len(nodes), present=True, owner=1000)
                self.hear(self.members.on_announce(node, frame), now)

    def reset(self, node: int, now: float) -> None:
        self.hear(self.members.peer_down(node, "reset", now), now)

    def tick(self, now: float) -> None:
        self.hear(self.members.on_timer(now), now)
        self.svc.on_timer(now)

    def hear(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, RankJoined | RankLeft):
                self.svc.on_rank_event(action, now)
            elif isinstance(action, Suspicion):
                self.svc.on_suspicion(action, now)


def test_a_forgotten_jobs_other_suspects_do_not_fail_the_next_job_of_its_name() -> None:
    """Nodes 1 and 2 reset at different times (ranks 1 and 2 suspect), then rank 0, the job's
    last rank here, leaves.  When rank 1's suspicion runs out the job is forgotten; rank 2's,
    left behind, must go with it, or when it runs out it loses rank 2 to a later job of the
    same name, which has no rank 2: that job's barrier call fails as if a rank had died."""
    fab = Fabric()
    fab.start((0, 1, 2), 0.0)
    down_after = fab.members.down_after
    fab.reset(1, 0.0)
    fab.reset(2, 1.0)
    fab.hear(fab.members.detach(JOB, 0, "left"), 1.0)
    fab.tick(down_after)  # rank 1's suspicion ran out: the job is forgotten
    assert not fab.members.has_suspects(JOB)
    fab.start((0, 1), down_after)  # a new job of that name, 2 ranks
    call(fab.svc, client(0, 2), 7, sync="barrier")  # open: waits for rank 1's barrier step
    fab.tick(down_after + 1.0)
    assert 7 not in fab.host.answered, fab.host.answered.get(7)


def test_two_suspicions_of_a_job_running_out_together_forget_it_once() -> None:
    """The first suspicion to run out forgets the job, and its other suspicions with it: the
    timer must not then trip over them."""
    fab = Fabric()
    fab.start((0, 1, 1), 0.0)
    fab.reset(1, 0.0)
    fab.hear(fab.members.detach(JOB, 0, "left"), 0.0)
    fab.tick(fab.members.down_after)
    assert not fab.members.has_suspects(JOB)
    assert fab.members.next_deadline() is None
