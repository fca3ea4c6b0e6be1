"""fabricd under a real Slurm: ``srun python train.py`` with no variable set by hand.

A single-host Slurm (Debian's slurmctld and slurmd, ``auth/none``: no munge needed) runs in
a private directory, with ``fabricctl slurm prolog`` and ``epilog`` as its Prolog and Epilog;
``srun -N1 -n2`` then starts two ranks that connect with nothing but ``job=`` and allreduce,
and then examples/slurm_train.py the same way.
Skips, with the reason, where Slurm is not installed and cannot be (tests/apt.py installs it as
root with apt), not run by root (slurmd starts jobs as their users), or cannot start here.

The launcher's handling of variables is tested without Slurm, by running it.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.slurm_job import stop_job_daemon
from fabricd.slurm import job_directory, job_socket
from tests import apt

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
#: the most jobs one test submits (their ids follow FirstJobId)
_MAX_JOBS = 8
#: the variables a rank could be told by hand: none of them reaches srun
_HAND_SET = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FABRICD_SOCKET")

_RANK_SCRIPT = """
import json, os, fabricd
from fabricd.ipc import socket_candidates
job_dir = os.path.dirname(os.path.dirname(socket_candidates()[0]))
pid = open(os.path.join(job_dir, "fabricd.pid")).read().split()[0]
with fabricd.connect(job="slurm-test") as fab:
    g = fab.array("g", (8,), "float32")
    g[:] = fab.rank + 1
    fab.allreduce(g)
    print(json.dumps({"rank": fab.rank, "size": fab.size, "sum": g.tolist(),
                      "socket": socket_candidates()[0],
                      "job_socket_exists": os.path.exists(socket_candidates()[0]),
                      "secret_mode": oct(os.stat(os.path.join(job_dir, "secret")).st_mode & 0o777),
                      "job_dir_mode": oct(os.stat(job_dir).st_mode & 0o777),
                      "record": open(os.path.join(job_dir, "fabricd.pid")).read().split(),
                      "no_dump": "--no-dump" in open(f"/proc/{pid}/cmdline").read().split(chr(0))}))
"""


def _free_port() -> int:
    """A port below the ephemeral range that nothing listens on now."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(12000, 20000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _write_conf(directory: Path, node: str, first_job: int) -> Path:
    """A one-node slurm.conf whose files all live in ``directory``."""
    for name in ("state", "spool"):
        (directory / name).mkdir()
    key = os.open(directory / "slurm.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(key, secrets.token_hex(32).encode())  # the site key: each job's secret is made of it
    os.close(key)
    for name, options in (("prolog", f"--key-file {directory}/slurm.key"), ("epilog", "")):
        script = directory / f"{name}.sh"
        script.write_text(
            "#!/bin/sh\n"  # slurmd gives a prolog no environment of ours: name the checkout
            f"PYTHONPATH={ROOT} exec {sys.executable} -m fabricd.cli.ctl slurm {name} "
            f"{options} >>{directory}/{name}.log 2>&1\n"
        )
        script.chmod(0o755)
    conf = directory / "slurm.conf"
    conf.write_text(
        f"""ClusterName=fabricdtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
FirstJobId={first_job}
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
Prolog={directory}/prolog.sh
Epilog={directory}/epilog.sh
NodeName={node} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=10 State=UP OverSubscribe=YES
"""
    )
    return conf


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        return "(no log)"


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running single-host Slurm; yields the environment srun needs (``SLURM_CONF``)."""
    for package, program in (
        ("slurmctld", "slurmctld"),
        ("slurmd", "slurmd"),
        ("slurm-client", "srun"),
    ):
        why = apt.ensure(package, program)  # (installed here where root with apt: CI)
        if why is not None:
            pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root (it starts each job as its user)")
    node = socket.gethostname().split(".")[0]
    first = random.randrange(1_000_000, 60_000_000)  # clear of other runs' job directories
    conf = _write_conf(tmp_path, node, first)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [_start(program, conf, env, tmp_path) for program in ("slurmctld", "slurmd")]
    try:
        _wait_idle(env, daemons, tmp_path)
        yield env
    finally:
        for job in range(first, first + _MAX_JOBS):  # the epilogs may still run: wait for them
            if not _gone(job_directory(job)):
                stop_job_daemon(job)  # never leave a daemon behind, whatever failed
        for daemon in daemons:
            daemon.send_signal(signal.SIGTERM)
        for daemon in daemons:
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _gone(path: str, timeout: float = 60.0) -> bool:
    """Wait until ``path`` is gone (an epilog removes its job's directory); whether it is."""
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def _start(program: str, conf: Path, env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    """Start a Slurm daemon in the foreground, its stderr in ``logs``."""
    with open(logs / f"{program}.out", "wb") as err:  # the child keeps its own copy
        return subprocess.Popen(
            [program, "-D", "-f", str(conf)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


def _wait_idle(env: dict[str, str], daemons: list[subprocess.Popen[bytes]], logs: Path) -> None:
    """Wait (30 s at most) until the node is idle; skip with the logs if Slurm cannot start."""
    deadline = time.monotonic() + 30
    state = ""
    while time.monotonic() < deadline:
        for daemon, name in zip(daemons, ("slurmctld", "slurmd"), strict=True):
            if daemon.poll() is not None:
                pytest.skip(
                    f"{name} cannot start here (exit status {daemon.returncode}):\n"
                    + _tail(logs / f"{name}.log")
                    + _tail(logs / f"{name}.out")
                )
        query = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
        )
        state = query.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.2)
    pytest.skip(
        f"the Slurm node is {state!r}, not idle, after 30 s:\n" + _tail(logs / "slurmd.log")
    )


@pytest.mark.timeout(240)
def test_srun_starts_ranks_that_allreduce_through_the_job_daemon(slurm, tmp_path):
    env = {k: v for k, v in slurm.items() if k not in _HAND_SET}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's fabricd, in the ranks too
    ran = subprocess.run(
        ["srun", "-N1", "-n2", "--overcommit", sys.executable, "-c", _RANK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, f"{ran.stderr}\nprolog: {_tail(tmp_path / 'prolog.log')}"
    ranks = sorted((json.loads(line) for line in ran.stdout.splitlines()), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(r["sum"] == [3.0] * 8 for r in ranks)  # 1 + 2
    assert all(r["job_socket_exists"] for r in ranks)
    assert all(r["secret_mode"] == "0o600" for r in ranks)  # the job's secret, its user's only
    job = int(Path(ranks[0]["socket"]).parent.parent.name)
    assert ranks[0]["socket"] == job_socket(job)  # the socket the client looks for
    assert all(r["job_dir_mode"] == "0o755" for r in ranks)  # root's: the user's is run/ only
    assert len(ranks[0]["record"]) == 3  # pid, start time, uid: one process for good
    assert ranks[0]["no_dump"]  # the daemon makes itself undumpable
    # the epilog runs after the job has ended: it stops the daemon and removes the directory
    assert _gone(job_directory(job)), _tail(tmp_path / "epilog.log")
    for _ in range(300):  # (the epilog removes the directory before it logs: 30 s guard)
        if "stopped" in (tmp_path / "epilog.log").read_text():
            break
        time.sleep(0.1)
    assert "stopped" in (tmp_path / "epilog.log").read_text()
    example = subprocess.run(
        ["srun", "-N1", "-n2", "--overcommit", sys.executable, "examples/slurm_train.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert example.returncode == 0, example.stderr
    drifts = sorted(line for line in example.stdout.splitlines() if "distance" in line)
    assert drifts == [f"rank {r} of 2: distance to rank 0's model 0.0" for r in (0, 1)]
    assert _gone(job_directory(job + 1)), _tail(tmp_path / "epilog.log")  # its epilog ran too


def _launch(environ: dict[str, str]) -> dict[str, str]:
    """The environment ``fabricctl slurm run`` gives its command, with ``environ``."""
    show = "import json, os; print(json.dumps(dict(os.environ)))"
    ran = subprocess.run(
        [sys.executable, "-m", "fabricd.cli.ctl", "slurm", "run", "--", sys.executable, "-c", show],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    return dict(json.loads(ran.stdout))


def test_the_launcher_sets_each_rank_from_slurm_and_keeps_torchrun_variables():
    task = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    seen = _launch(task)
    assert {k: seen[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }
    assert seen["MASTER_ADDR"] == "gpu07"
    assert "FABRICD_SOCKET" not in seen  # no daemon of job 77 here: the node's is found
    torchrun = {**task, "RANK": "13", "WORLD_SIZE": "16", "MASTER_ADDR": "head"}
    kept = _launch(torchrun)
    assert (kept["RANK"], kept["WORLD_SIZE"], kept["MASTER_ADDR"]) == ("13", "16", "head")


def test_the_launcher_outside_srun_says_what_is_missing():
    ran = subprocess.run(
        [sys.executable, "-m", "fabricd.cli.ctl", "slurm", "run", "--", "true"],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1
    assert "run this as a task of srun" in " ".join(ran.stderr.split())
