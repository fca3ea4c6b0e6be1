"""deploy/kubernetes and deploy/Dockerfile: valid Kubernetes objects, and the invariants that
make the daemon start and the training pods reach it.

Every manifest is validated against the Kubernetes API's OpenAPI schemas as
``kubernetes-validate`` ships them (offline; strict: an unknown field is an error), for the
oldest and the newest release it bundles.  The invariants are checked with the daemon's own
rules where there is one (the secret file's: :func:`fabricd.daemon.keyring.check_file_access`;
the socket's admission: :meth:`fabricd.daemon.ipc_server.Credentials.allowed`), fed what the
kubelet makes of the manifests.  No image is built here (no container engine in the tests):
the Dockerfile is read as text.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fabricd.daemon import keyring
from fabricd.daemon.config import load
from fabricd.daemon.ipc_server import Credentials, IpcServer
from fabricd.deploy.kubernetes import Membership, render_config
from fabricd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SOCKET_DIR = "/run/fabricd"
#: the mode bits the kubelet adds to a read-only volume's files (secret, configMap) when the pod
#: has an fsGroup: group read (pkg/volume/volume_linux.go, roMask), with the group set to fsGroup
KUBELET_FSGROUP_READ = 0o440


def documents():
    """(file name, object) for every document of every manifest and of the Secret template."""
    files = [*sorted(MANIFESTS.glob("*.yaml")), MANIFESTS / "secret.yaml.template"]
    return [(f.name, doc) for f in files for doc in yaml.safe_load_all(f.read_text()) if doc]


def one(kind, name=None):
    found = [
        d for _, d in documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def daemon_pod():
    return one("DaemonSet")["spec"]["template"]["spec"]


def job_pod():
    return one("Job")["spec"]["template"]["spec"]


def container(pod, name):
    return next(
        c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == name
    )


def volume_for(pod, container_spec, mount_path):
    """The pod's volume mounted at ``mount_path`` in the container, and the mount."""
    mount = next(m for m in container_spec["volumeMounts"] if m["mountPath"] == mount_path)
    return next(v for v in pod["volumes"] if v["name"] == mount["name"]), mount


def base_config():
    return one("ConfigMap", "fabricd-config")["data"]["fabricd.toml"]


def rendered_config(tmp_path):
    """The config the membership init container would write for node 0 of two."""
    path = tmp_path / "fabricd.toml"
    membership = Membership(node_id=0, nodes=("10.0.0.1:7700", "10.0.0.2:7700"))
    path.write_text(render_config(base_config(), membership, node_name="n", service="s"))
    return load(str(path), environ={}).config


def flag(command, name):
    """The value of ``--name=value`` in a container's command."""
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"--{name}="))


VERSIONS = [kubernetes_validate.utils.all_versions()[0], kubernetes_validate.utils.latest_version()]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_a_valid_kubernetes_object(version):
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Service",
        "DaemonSet",
        "Job",
    }
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_the_validator_refuses_an_unknown_field_and_a_wrong_type():
    daemonset = one("DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrk"):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)
    daemonset = one("DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError, match="'yes' is not of type"):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_the_daemons_run_on_the_host_network_and_resolve_the_cluster():
    pod = daemon_pod()
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    port = int(flag(container(pod, "membership")["command"], "port"))
    (fabric,) = container(pod, "fabricd")["ports"]
    assert fabric["containerPort"] == fabric["hostPort"] == port
    assert one("Service")["spec"]["ports"][0]["port"] == port


def test_the_service_lists_every_daemon_pod_ready_or_not():
    service = one("Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per pod
    assert service["spec"]["publishNotReadyAddresses"] is True  # no daemon is ready before
    labels = one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    meta = service["metadata"]
    dns = flag(container(daemon_pod(), "membership")["command"], "service")
    assert dns == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"


def test_identity_comes_from_the_downward_api_and_the_count_from_the_config_map():
    membership = container(daemon_pod(), "membership")
    env = {e["name"]: e["valueFrom"] for e in membership["env"]}
    assert env["HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert flag(membership["command"], "host-ip") == "$(HOST_IP)"
    assert flag(membership["command"], "expect") == "$(EXPECTED_NODES)"
    key = env["EXPECTED_NODES"]["configMapKeyRef"]
    assert int(one("ConfigMap", key["name"])["data"][key["key"]]) >= 1


def test_the_membership_container_writes_where_the_daemon_reads(tmp_path):
    pod = daemon_pod()
    out = flag(container(pod, "membership")["command"], "out")
    daemon = container(pod, "fabricd")
    assert daemon["command"] == ["fabricd", "--config", out]
    written, _ = volume_for(pod, container(pod, "membership"), os.path.dirname(out))
    read, mount = volume_for(pod, daemon, os.path.dirname(out))
    assert written == read == {"name": read["name"], "emptyDir": {}}
    assert mount["readOnly"] is True
    base = flag(container(pod, "membership")["command"], "base")
    config_map, _ = volume_for(pod, container(pod, "membership"), os.path.dirname(base))
    assert config_map["configMap"]["name"] == "fabricd-config"
    assert rendered_config(tmp_path).node_id == 0  # the base renders into a config the daemon takes


def test_the_socket_directory_is_the_hostpath_both_pods_mount(tmp_path):
    config = rendered_config(tmp_path)
    assert os.path.dirname(config.socket) == SOCKET_DIR
    daemon, _ = volume_for(daemon_pod(), container(daemon_pod(), "fabricd"), SOCKET_DIR)
    assert daemon["hostPath"] == {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}
    rank = job_pod()["containers"][0]
    job, mount = volume_for(job_pod(), rank, SOCKET_DIR)
    assert job["hostPath"] == {"path": SOCKET_DIR, "type": "Directory"}  # the daemon made it
    assert mount["readOnly"] is True
    assert {"name": "FABRICD_SOCKET", "value": config.socket} in rank["env"]


def test_the_socket_directory_is_handed_to_the_daemons_user_and_nothing_more():
    pod = daemon_pod()
    init = container(pod, "socket-dir")
    script = shlex.split(init["command"][-1])
    owner = f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert script == ["chown", owner, SOCKET_DIR, "&&", "chmod", "0750", SOCKET_DIR]
    context = init["securityContext"]
    assert context["runAsUser"] == 0
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert context["allowPrivilegeEscalation"] is False
    assert pod["initContainers"][0] is init  # before anything that needs the directory


class NoRequests:
    """A request handler for a server that is only started and stopped."""

    def client_request(self, conn, meta, fds):
        raise AssertionError("no client connects here")

    def client_gone(self, conn):
        raise AssertionError("no client connects here")


async def test_the_daemon_serves_from_the_directory_socket_dir_leaves(tmp_path):
    """The directory as the init container leaves it (the daemon's own, the manifest's mode):
    the daemon accepts it, and its socket is 0660 in the daemon's group, the group that the
    training pods hold and that the daemon admits."""
    mode = shlex.split(container(daemon_pod(), "socket-dir")["command"][-1])[5]
    directory = tmp_path / "run-fabricd"
    directory.mkdir()
    os.chmod(directory, int(mode, 8))
    server = IpcServer(str(directory / "fabricd.sock"), NoRequests())
    server.start()
    try:
        socket_stat = (directory / "fabricd.sock").stat()
        assert stat.S_IMODE(socket_stat.st_mode) == 0o660
        assert socket_stat.st_gid == os.getegid()  # runAsGroup, in the pod
        rank = Credentials(pid=0, uid=65530, gid=65530, groups=frozenset({os.getegid()}))
        assert rank.allowed(server.allowed_uids, server.allowed_gids)
    finally:
        server.close()


def test_every_other_container_runs_non_root_without_capabilities():
    for pod in (daemon_pod(), job_pod()):
        assert pod["securityContext"]["runAsUser"] != 0
        for spec in [*pod.get("initContainers", []), *pod["containers"]]:
            context = spec["securityContext"]
            assert "privileged" not in context
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            if spec["name"] != "socket-dir":
                assert context["capabilities"] == {"drop": ["ALL"]}
                assert True in (
                    context.get("runAsNonRoot"),
                    pod["securityContext"].get("runAsNonRoot"),
                )
                assert "runAsUser" not in context


def mounted_secret(pod, path):
    """The stat of the secret file at ``path`` as the kubelet mounts it for ``pod``: owned by
    root, group fsGroup, the volume's mode plus group read (a Secret volume is read-only)."""
    daemon = container(pod, "fabricd")
    volume, mount = volume_for(pod, daemon, os.path.dirname(path))
    assert mount["readOnly"] is True
    source = volume["secret"]
    assert source["secretName"] == "fabricd-secret"
    assert source["items"] == [{"key": "secret", "path": os.path.basename(path)}]
    mode = source["defaultMode"] | KUBELET_FSGROUP_READ
    fields = [stat.S_IFREG | mode, 0, 0, 1, 0, pod["securityContext"]["fsGroup"], 44, 0, 0, 0]
    return os.stat_result(fields)


@pytest.mark.parametrize("fs_group", [None, 2000])
def test_the_daemon_accepts_the_mounted_secret_and_only_with_its_own_group(
    monkeypatch, tmp_path, fs_group
):
    pod = daemon_pod()
    context = pod["securityContext"]
    if fs_group is not None:
        context["fsGroup"] = fs_group
    monkeypatch.setattr(keyring.os, "geteuid", lambda: context["runAsUser"])
    monkeypatch.setattr(keyring.os, "getegid", lambda: context["runAsGroup"])
    status = mounted_secret(pod, rendered_config(tmp_path).secret_file)
    assert stat.S_IMODE(status.st_mode) == 0o440
    if fs_group is None:  # the image's /etc/group lists nobody in the group: test_dockerfile_*
        keyring.check_file_access(status, "secret_file", members=lambda gid: [])
    else:
        with pytest.raises(ConfigError, match="not this daemon's"):
            keyring.check_file_access(status, "secret_file", members=lambda gid: [])


def test_training_pods_hold_the_daemons_group_and_are_admitted():
    daemon = daemon_pod()["securityContext"]
    job = job_pod()["securityContext"]
    assert daemon["runAsGroup"] in job["supplementalGroups"]
    assert job["runAsUser"] != daemon["runAsUser"]
    rank = Credentials(
        pid=0,
        uid=job["runAsUser"],
        gid=job["runAsGroup"],
        groups=frozenset(job["supplementalGroups"]),
    )
    assert rank.allowed({0, daemon["runAsUser"]}, {daemon["runAsGroup"]})
    stranger = Credentials(pid=0, uid=job["runAsUser"], gid=job["runAsGroup"])
    assert not stranger.allowed({0, daemon["runAsUser"]}, {daemon["runAsGroup"]})


def test_the_example_job_runs_one_rank_per_completion_index_on_daemon_nodes():
    job = one("Job")
    assert job["metadata"]["namespace"] != one("DaemonSet")["metadata"]["namespace"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    rank = job_pod()["containers"][0]
    env = {e["name"]: e for e in rank["env"]}
    assert int(env["WORLD_SIZE"]["value"]) == spec["completions"] == spec["parallelism"]
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["RANK"]["valueFrom"] == {"fieldRef": {"fieldPath": index}}
    assert job_pod()["nodeSelector"] == daemon_pod()["nodeSelector"]
    script = rank["command"][1]
    assert f"COPY examples/{Path(script).name} {script}" in DOCKERFILE.read_text()


def test_the_secret_template_holds_no_secret_and_is_never_applied_with_the_folder():
    secret = one("Secret")
    (value,) = secret["stringData"].values()
    with pytest.raises(ConfigError, match="holds no secret"):
        keyring.parse_secrets(value.encode(), "the template")
    # kubectl apply -f <folder> reads only .yaml, .yml and .json files
    assert [p.name for p in MANIFESTS.glob("*secret*")] == ["secret.yaml.template"]


def test_the_drain_fits_in_the_grace_period(tmp_path):
    grace = daemon_pod()["terminationGracePeriodSeconds"]
    assert rendered_config(tmp_path).drain_timeout < grace


def test_every_pod_runs_the_same_image():
    images = {
        c["image"]
        for pod in (daemon_pod(), job_pod())
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }
    assert len(images) == 1


def dockerfile_stages():
    """The Dockerfile's instructions (continuations joined), split by stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    stages, current = [], []
    for line in lines:
        if line.upper().startswith("FROM ") and current:
            stages.append(current)
            current = []
        current.append(line)
    return [*stages, current]


def test_dockerfile_builds_in_one_stage_and_runs_from_another():
    build, runtime = dockerfile_stages()
    assert re.fullmatch(r"FROM python:3\.11\S* AS build", build[0])
    assert re.fullmatch(r"FROM python:3\.11-slim\S* AS runtime", runtime[0])
    assert any("pip wheel" in line for line in build)
    installs = [line for line in runtime if "pip install" in line]
    assert installs == [next(line for line in runtime if "from=build" in line)]
    assert "--no-index" in installs[0]  # only the first stage's wheels
    copies = [line for line in runtime if line.startswith(("COPY", "ADD"))]
    assert copies == ["COPY examples/pingpong.py /opt/fabricd/examples/pingpong.py"]


def test_dockerfile_runs_as_the_manifests_non_root_user():
    _, runtime = dockerfile_stages()
    args = dict(re.findall(r"^ARG (\w+)=(\d+)$", "\n".join(runtime), re.MULTILINE))
    user = next(line for line in runtime if line.startswith("USER "))
    uid, gid = (args[name.strip("${}")] for name in user.split()[1].split(":"))
    context = daemon_pod()["securityContext"]
    assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"]) != (0, 0)
    assert context["fsGroup"] == int(gid)
    assert runtime[-2] == user  # nothing after it runs as root; then only CMD


def test_dockerfile_gives_the_daemons_group_no_members_and_copies_no_secret():
    text = " ".join(" ".join(stage) for stage in dockerfile_stages())
    # a member of the daemon's group could read the group-readable secret (keyring.py)
    assert not re.search(r"usermod|gpasswd|adduser \S+ \S+|useradd[^&]* (-G|--groups)", text)
    copied = re.findall(r"(?:COPY|ADD)\s+(?:--\S+\s+)?(\S+)", text)
    assert copied
    assert not [c for c in copied if "secret" in c.lower()]
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[line.startswith("#") for line in ignore].index(False)] == "*"  # deny first
