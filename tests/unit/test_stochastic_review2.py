"""Second review of stochastic reduce: how the stochastic service's suspicion of ranks whose node's
links reset meets the job's end.

The service runs on the first review's fake host and rank table
(:mod:`tests.unit.test_stochastic_service_review`).  Every test here shows a bug the review found,
since fixed: they stay as regression tests.
"""

from __future__ import annotations

from fabricd.engines.membership import RankJoined, RankLeft
from tests.unit.test_collective_service_review import Table
from tests.unit.test_stochastic_service_review import JOB, call, client, service


def test_a_forgotten_jobs_other_suspects_do_not_fail_the_next_job_of_its_name() -> None:
    """Nodes 1 and 2 reset at different times (ranks 1 and 2 suspect), then rank 0, the job's
    last rank here, leaves.  When rank 1's suspicion runs out the job is forgotten; rank 2's,
    left behind, must go with it, or when it runs out it loses rank 2 to a later job of the
    same name, which has no rank 2: that job's barrier call fails as if a rank had died."""
    table = Table()
    svc, host = service(table)
    entries = table.join(JOB, 3, (0, 1, 2), owner=1000)
    for entry in entries:
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    down_after = host.config.down_after
    svc.on_rank_event(RankLeft(entry=table.entries.pop((JOB, 1)), reason="reset", lost=True), 0.0)
    svc.on_rank_event(RankLeft(entry=table.entries.pop((JOB, 2)), reason="reset", lost=True), 1.0)
    svc.on_rank_event(RankLeft(entry=table.entries.pop((JOB, 0)), reason="left", lost=False), 1.0)
    svc.on_timer(down_after)  # rank 1's suspicion ran out: the job is forgotten
    assert not svc._suspects
    for entry in table.join(JOB, 2, (0, 1), owner=1000):  # a new job of that name, 2 ranks
        svc.on_rank_event(RankJoined(entry=entry), down_after)
    call(svc, client(0, 2), 7, sync="barrier")  # open: waits for rank 1's barrier step
    svc.on_timer(down_after + 1.0)
    assert 7 not in host.answered, host.answered.get(7)


def test_two_suspicions_of_a_job_running_out_together_forget_it_once() -> None:
    """The first suspicion to run out forgets the job, and its other suspicions with it: the
    timer must not then trip over them."""
    table = Table()
    svc, host = service(table)
    for entry in table.join(JOB, 3, (0, 1, 1), owner=1000):
        svc.on_rank_event(RankJoined(entry=entry), 0.0)
    for rank in (1, 2):
        entry = table.entries.pop((JOB, rank))
        svc.on_rank_event(RankLeft(entry=entry, reason="reset", lost=True), 0.0)
    svc.on_rank_event(RankLeft(entry=table.entries.pop((JOB, 0)), reason="left", lost=False), 0.0)
    svc.on_timer(host.config.down_after)
    assert not svc._suspects
