"""Jobs belong to their users, on a real daemon: another uid cannot join a job or see it.

The other user is a forked child that drops to ``nobody`` (CI runs as root), admitted to the
socket through ``allowed_uids``, as in the adversarial review that found a user of uid 65534
joining root's job as rank 1 and receiving its tensor.  Without root no second uid exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

import fabricd
from fabricd.cli.ctl import main as fabricctl
from tests.integration.test_client_socket import NOBODY, _as_a_user, _open_to_all

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from fabricd.daemon.launcher import LocalCluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root to switch to")

JOB = "secret"


def _daemon(make_cluster: Callable[..., LocalCluster], **settings: object) -> str:
    """A one-node daemon that admits nobody to its socket; returns the socket's path."""
    return _open_to_all(make_cluster(1, allowed_uids=[NOBODY.pw_uid], **settings))


def test_another_uid_cannot_join_a_job_it_does_not_own(make_cluster):
    path = _daemon(make_cluster)
    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=path) as owner:
        tensor = owner.array("t", (4,), "float32")
        tensor[:] = [1, 2, 3, 4]
        sent = owner.send_async(tensor, to=1)

        def child() -> str:
            with fabricd.connect(job=JOB, rank=1, size=2, socket_path=path, timeout=10) as fab:
                got = fab.array("t", (4,), "float32")
                fab.recv(got, src=0, timeout=10)
                return f"joined and received {got.tolist()}"

        answer = _as_a_user(child)
        assert answer.startswith(f"PermissionDenied: hello: job '{JOB}' belongs to uid 0"), answer
        assert "job_groups" in answer  # the setting that grants access
        assert f"uid {NOBODY.pw_uid}" in answer
        assert not sent.done()  # nothing reached the intruder: the send still waits for rank 1
        assert owner.status()["counters"]["refused_joins"] == 1


def test_a_group_named_in_job_groups_may_join(make_cluster):
    path = _daemon(make_cluster, job_groups=[f"sec*:{NOBODY.pw_gid}"])
    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=path) as owner:
        tensor = owner.array("t", (4,), "float32")
        tensor[:] = [1, 2, 3, 4]
        sent = owner.send_async(tensor, to=1)

        def child() -> str:
            with fabricd.connect(job=JOB, rank=1, size=2, socket_path=path, timeout=10) as fab:
                got = fab.array("t", (4,), "float32")
                fab.recv(got, src=0, timeout=10)
                return f"received {got.tolist()}"

        assert _as_a_user(child) == "received [1.0, 2.0, 3.0, 4.0]"
        sent.wait(timeout=10)
        assert owner.status()["counters"]["refused_joins"] == 0


def _status_as_nobody(path: str) -> dict[str, object]:
    """The status a control client of nobody gets, while nobody also runs job "mine"."""

    def child() -> str:
        with (
            fabricd.connect(job="mine", rank=0, size=1, socket_path=path, timeout=10),
            fabricd.connect(socket_path=path, timeout=10) as control,
        ):
            return json.dumps(control.status())

    answer = _as_a_user(child)
    assert answer.startswith("{"), answer
    status: dict[str, object] = json.loads(answer)
    return status


def test_status_as_another_user_shows_only_its_own_jobs(make_cluster):
    path = _daemon(make_cluster)
    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=path):
        status = _status_as_nobody(path)
    assert JOB not in json.dumps(status)  # neither its rows nor the job's name
    clients = status["clients"]
    assert isinstance(clients, list)
    assert [(c["uid"], c["job"]) for c in clients] == [(NOBODY.pw_uid, "mine")]
    assert all(c["pid"] != os.getpid() for c in clients)  # root's pid is withheld too
    assert [r["job"] for r in status["ranks"]] == ["mine"]  # type: ignore[attr-defined]
    assert status["hidden"] == {"clients": 1, "ranks": 1}


def test_an_admin_group_sees_every_job(make_cluster):
    path = _daemon(make_cluster, admin_gids=[NOBODY.pw_gid])
    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=path):
        status = _status_as_nobody(path)
    assert sorted(r["job"] for r in status["ranks"]) == ["mine", JOB]  # type: ignore[attr-defined]
    assert status["hidden"] == {}


@contextlib.contextmanager
def _nobody_in_job(path: str, job: str) -> Iterator[None]:
    """A forked child, as nobody, holds rank 0 of ``job`` while the block runs."""
    joined_r, joined_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(joined_r)
            os.close(release_w)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            with fabricd.connect(job=job, rank=0, size=1, socket_path=path, timeout=10):
                os.write(joined_w, b"j")
                os.read(release_r, 1)  # until the parent closes its end
            code = 0
        finally:
            os._exit(code)
    os.close(joined_w)
    os.close(release_r)
    try:
        assert os.read(joined_r, 1) == b"j", "the child could not join"
        yield
    finally:
        os.close(release_w)
        os.close(joined_r)
        os.waitpid(pid, 0)


def test_root_sees_every_users_job(make_cluster):
    path = _daemon(make_cluster)
    with _nobody_in_job(path, "theirs"), fabricd.connect(socket_path=path) as control:
        status = control.status()
    assert [(c["uid"], c["job"]) for c in status["clients"]] == [(NOBODY.pw_uid, "theirs")]
    assert [(r["job"], r["owner"]) for r in status["ranks"]] == [("theirs", NOBODY.pw_uid)]
    assert status["hidden"] == {}


def test_a_job_is_free_for_another_user_once_its_last_rank_left(make_cluster):
    path = _daemon(make_cluster)
    with fabricd.connect(socket_path=path) as control:
        with fabricd.connect(job=JOB, rank=0, size=1, socket_path=path):
            assert [r["owner"] for r in control.status()["ranks"]] == [0]
        deadline = time.monotonic() + 10  # a hang guard: the daemon sees the close at once
        while control.status()["ranks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert control.status()["ranks"] == []

    def child() -> str:
        with fabricd.connect(job=JOB, rank=0, size=1, socket_path=path, timeout=10) as fab:
            return f"joined {fab.job}"

    assert _as_a_user(child) == f"joined {JOB}"


def test_nothing_a_request_says_lets_a_client_pose_as_another_rank(make_cluster):
    # A request names only its peer: the job and the client's own rank are the session's.  A
    # receive whose request also names root's job and rank 1 stays the impostor's own; the
    # message goes to the real rank 1 of the job.
    path = _daemon(make_cluster)
    with (
        fabricd.connect(job=JOB, rank=0, size=2, socket_path=path) as owner,
        fabricd.connect(job="other", rank=1, size=2, socket_path=path) as impostor,
    ):
        submit = impostor._connection.submit

        def forged(op: str, fields: dict[str, object], **kw: object) -> object:
            return submit(op, {**fields, "job": JOB, "src": 0, "dst": 1, "rank": 1}, **kw)

        impostor._connection.submit = forged  # type: ignore[method-assign,assignment]
        stolen = impostor.recv_async(impostor.array("g", (4,), "float32"), src=0)
        tensor = owner.array("t", (4,), "float32")
        tensor[:] = [1, 2, 3, 4]
        sent = owner.send_async(tensor, to=1)
        with fabricd.connect(job=JOB, rank=1, size=2, socket_path=path) as rank1:
            got = rank1.array("t", (4,), "float32")
            rank1.recv(got, src=0, timeout=10)
            assert got.tolist() == [1.0, 2.0, 3.0, 4.0]
        sent.wait(timeout=10)
        assert not stolen.done()  # still waiting for rank 0 of its own job


def test_fabricctl_status_as_another_user_says_rows_were_withheld(make_cluster):
    path = _daemon(make_cluster)

    def child() -> str:  # in the forked child: nobody may not run this checkout's interpreter
        shown = CliRunner().invoke(fabricctl, ["status", "--socket", path])
        return f"{shown.exit_code}\n{shown.output}"

    with fabricd.connect(job=JOB, rank=0, size=2, socket_path=path):
        answer = _as_a_user(child)
    code, _, output = answer.partition("\n")
    assert code == "0", output
    assert JOB not in output
    assert "clients (0, 1 hidden)" in output, output
    assert "ranks (0, 1 hidden)" in output, output
    assert "hidden: rows of other users' jobs" in output


def test_a_job_opened_on_one_node_is_refused_to_another_uid_on_another_node(make_cluster):
    cluster = make_cluster(2, allowed_uids=[NOBODY.pw_uid])
    _open_to_all(cluster)
    first, second = (node.socket_path for node in cluster.nodes)
    Path(second).chmod(0o666)
    with (
        fabricd.connect(job=JOB, rank=0, size=2, socket_path=first),
        fabricd.connect(socket_path=second) as control,
    ):
        deadline = time.monotonic() + 10  # a hang guard: the ANNOUNCE is on its way
        while not control.status()["ranks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(r["job"], r["node"], r["owner"]) for r in control.status()["ranks"]] == [
            (JOB, 0, 0)
        ]

        def child() -> str:
            with fabricd.connect(job=JOB, rank=1, size=2, socket_path=second, timeout=10):
                return "joined"

        answer = _as_a_user(child)
        assert answer.startswith(f"PermissionDenied: hello: job '{JOB}' belongs to uid 0"), answer
        assert control.status()["counters"]["refused_joins"] == 1
