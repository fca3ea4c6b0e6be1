"""systemd/: the unit is hardened and valid, the drop-in stays narrow, the samples are true.

``systemd-analyze security --offline=true --threshold=25`` passes for the TCP
unit (displayed exposure <= 2.5) and the InfiniBand variant passes at 45. The systemd-analyze
tests need no running systemd, only the binary; they skip with a reason where it is missing or
too old. The remaining tests read the files themselves and run everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fabricd.daemon.config import Config

SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD_DIR / "fabricd.service"
RDMA_DROPIN = SYSTEMD_DIR / "fabricd-rdma.conf"
SAMPLE_CONFIG = SYSTEMD_DIR / "fabricd.toml"
SYSUSERS = SYSTEMD_DIR / "fabricd.sysusers"
TMPFILES = SYSTEMD_DIR / "fabricd.tmpfiles"

#: Every configuration key the daemon reads: the sample must document each one, and no other
CONFIG_KEYS = frozenset(field.name for field in dataclasses.fields(Config))

#: The defaults the sample must document. node_id, nodes and secret_file have none (the sample
#: shows an example); listen is unset by default (the sample shows it commented out). When the
#: daemon's config module lands, compare against its defaults instead of repeating them here.
DOCUMENTED_DEFAULTS: dict[str, object] = {
    "socket": "/run/fabricd/fabricd.sock",
    "allowed_uids": [],
    "allowed_gids": [],
    "job_groups": [],
    "admin_gids": [],
    "heartbeat_interval": 1.0,
    "suspect_after": 3.0,
    "down_after": 10.0,
    "handshake_timeout": 2.0,
    "reconnect_max_backoff": 2.0,
    "route_timeout": 30.0,
    "chunk_size": 4194304,
    "max_payload": 67108864,
    "max_meta": 65536,
    "max_clients": 256,
    "client_hello_timeout": 10.0,
    "client_frame_timeout": 10.0,
    "max_segments_per_client": 1024,
    "max_segments": 32768,
    "max_mapped_bytes_per_client": 256 << 30,
    "max_mapped_bytes": 64 << 40,
    "drain_timeout": 10.0,
    "log_level": "info",
    "log_format": "text",
    "event_loop": "uvloop",
}

# ---------------------------------------------------------------------------------------------
# helpers


def unit_settings(path: Path) -> dict[tuple[str, str], list[str]]:
    """Parse a unit file into {(section, key): [values in order]}.

    A small line parser rather than configparser: unit files repeat keys (SystemCallFilter=,
    DeviceAllow=), which configparser either rejects or silently collapses.
    """
    settings: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        assert not line.endswith("\\"), f"{path.name}: continuation lines are not used: {raw!r}"
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a setting: {raw!r}"
        settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


#: Consecutive settings that share the comment above the first (one reason covers both).
SHARED_REASON = frozenset(
    {("Wants", "After"), ("User", "Group"), ("CapabilityBoundingSet", "AmbientCapabilities")}
)


def uncommented_lines_without_reason(path: Path) -> list[str]:
    """Settings not explained by a `#` comment right above them: every unit line says why.

    Only the pairs in SHARED_REASON may share one comment.
    """
    lines = [raw.strip() for raw in path.read_text().splitlines()]
    unexplained = []
    for i, line in enumerate(lines):
        if not line or line.startswith(("#", "[", "Description=")):
            continue
        above = lines[i - 1] if i else ""
        if above.startswith("#"):
            continue
        pair = (above.partition("=")[0], line.partition("=")[0])
        if pair in SHARED_REASON and i >= 2 and lines[i - 2].startswith("#"):
            continue
        unexplained.append(line)
    return unexplained


def systemd_analyze() -> str:
    """Path of systemd-analyze, or skip the calling test with the reason."""
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: package systemd)")
    return exe


def require_analyze_options(exe: str, *options: str) -> None:
    """Skip unless this systemd-analyze knows every option (offline security needs >= 250)."""
    help_text = subprocess.run(
        [exe, "--help"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    version = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout.split("\n", 1)[0]
    missing = [opt for opt in options if opt not in help_text]
    if missing:
        pytest.skip(f"{version.strip() or 'systemd-analyze'} lacks {', '.join(missing)}")


def run_analyze(exe: str, unit_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run systemd-analyze with the scratch unit directory first in the unit search path.

    The trailing ':' in SYSTEMD_UNIT_PATH keeps the system's own directories after ours, so
    network-online.target and friends resolve; our fabricd.service.d/ drop-ins are found too.
    """
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_COLORS": "0"}
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, env=env, check=False, timeout=120
    )


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """A scratch unit directory holding fabricd.service with a runnable ExecStart.

    `systemd-analyze verify` reports "Command /usr/bin/fabricd is not executable" wherever
    fabricd is not installed there (CI, a virtualenv, /usr/local/bin). That is about this
    machine, not the unit, so the copy points ExecStart at the running interpreter, which
    certainly exists, and keeps the arguments. Everything else is byte for byte the same.
    """
    text, count = re.subn(
        r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(), flags=re.MULTILINE
    )
    assert count == 1
    directory = tmp_path / "units"
    directory.mkdir()
    (directory / "fabricd.service").write_text(text)
    return directory


@pytest.fixture
def rdma_unit_dir(unit_dir: Path) -> Path:
    """unit_dir plus the InfiniBand drop-in, where an administrator would put it."""
    dropins = unit_dir / "fabricd.service.d"
    dropins.mkdir()
    shutil.copy(RDMA_DROPIN, dropins / "rdma.conf")
    return unit_dir


def findings_about_fabricd(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Lines of `systemd-analyze verify` output that concern our unit or drop-in.

    verify also loads the dependencies (network-online.target, multi-user.target, ...) and may
    warn about the host's own units; those lines are not about fabricd and are left out.
    """
    output = result.stdout + result.stderr
    return [line for line in output.splitlines() if "fabricd" in line]


def exposure(output: str) -> float:
    """The displayed overall exposure (0.0-10.0) from `systemd-analyze security` output."""
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", output)
    assert match, output
    return float(match.group(1))


# ---------------------------------------------------------------------------------------------
# the unit's content


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("WatchdogSec", "30"),
        ("Restart", "on-failure"),
        ("KillSignal", "SIGTERM"),
        ("User", "fabricd"),
        ("Group", "fabricd"),
        ("RuntimeDirectory", "fabricd"),
        ("RuntimeDirectoryMode", "0750"),
        ("UMask", "0077"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("RestrictNamespaces", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("LockPersonality", "yes"),
        ("SystemCallArchitectures", "native"),
        ("MemoryDenyWriteExecute", "yes"),
        ("OOMScoreAdjust", "-500"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("ProtectControlGroups", "yes"),
        ("ProtectClock", "yes"),
        ("ProtectHostname", "yes"),
        ("LimitMEMLOCK", "infinity"),
    ],
)
def test_unit_sets(key, value):
    assert unit_settings(UNIT).get(("Service", key)) == [value]


def test_unit_filters_syscalls_to_the_system_service_set():
    filters = unit_settings(UNIT)[("Service", "SystemCallFilter")]
    assert filters[0] == "@system-service"
    assert all(f.startswith("~") for f in filters[1:])


def test_unit_runs_the_daemon_with_the_config_file():
    (exec_start,) = unit_settings(UNIT)[("Service", "ExecStart")]
    assert exec_start == "/usr/bin/fabricd --config /etc/fabricd/fabricd.toml"


def test_unit_waits_for_the_network():
    settings = unit_settings(UNIT)
    assert settings[("Unit", "After")] == ["network-online.target"]
    assert settings[("Unit", "Wants")] == ["network-online.target"]


def test_stop_timeout_leaves_room_for_the_drain():
    # SIGKILL after TimeoutStopSec= must not cut the drain short (drain_timeout in the sample).
    (stop,) = unit_settings(UNIT)[("Service", "TimeoutStopSec")]
    drain = tomllib.loads(SAMPLE_CONFIG.read_text())["drain_timeout"]
    assert float(stop) >= drain + 10


@pytest.mark.parametrize("path", [UNIT, RDMA_DROPIN], ids=lambda p: p.name)
def test_every_setting_says_why(path):
    assert uncommented_lines_without_reason(path) == []


def test_rdma_dropin_relaxes_only_device_access():
    settings = unit_settings(RDMA_DROPIN)
    assert set(settings) == {
        ("Unit", "After"),
        ("Service", "PrivateDevices"),
        ("Service", "DevicePolicy"),
        ("Service", "DeviceAllow"),
        ("Service", "RestrictAddressFamilies"),
    }
    assert settings[("Service", "PrivateDevices")] == ["no"]
    assert settings[("Service", "DevicePolicy")] == ["closed"]
    assert settings[("Service", "DeviceAllow")] == [
        "char-infiniband_verbs rw",
        "/dev/infiniband/rdma_cm rw",
    ]
    assert settings[("Service", "RestrictAddressFamilies")] == ["AF_NETLINK"]


# ---------------------------------------------------------------------------------------------
# systemd-analyze


def test_verify_is_clean(unit_dir):
    exe = systemd_analyze()
    require_analyze_options(exe, "--man")
    # --man=no: verify would otherwise run man(1) on Documentation= entries, which fails on
    # machines without man pages. Any other output (unknown key, bad value) is a real finding:
    # systemd only warns and ignores such lines, so the exit status alone would not catch them.
    result = run_analyze(exe, unit_dir, "verify", "--man=no", str(unit_dir / "fabricd.service"))
    assert findings_about_fabricd(result) == []
    assert result.returncode == 0, result.stdout + result.stderr


def test_verify_with_rdma_dropin_is_clean(rdma_unit_dir):
    exe = systemd_analyze()
    require_analyze_options(exe, "--man")
    unit = rdma_unit_dir / "fabricd.service"
    result = run_analyze(exe, rdma_unit_dir, "verify", "--man=no", str(unit))
    assert findings_about_fabricd(result) == []
    assert result.returncode == 0, result.stdout + result.stderr


def test_security_exposure_of_tcp_unit(unit_dir):
    exe = systemd_analyze()
    require_analyze_options(exe, "--offline", "--threshold")
    unit = unit_dir / "fabricd.service"
    result = run_analyze(exe, unit_dir, "security", "--offline=true", "--threshold=25", str(unit))
    assert result.returncode == 0, result.stdout + result.stderr
    assert exposure(result.stdout) <= 2.5


def test_security_exposure_of_rdma_unit(rdma_unit_dir):
    exe = systemd_analyze()
    require_analyze_options(exe, "--offline", "--threshold")
    unit = rdma_unit_dir / "fabricd.service"
    result = run_analyze(
        exe, rdma_unit_dir, "security", "--offline=true", "--threshold=45", str(unit)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The drop-in is really applied: its device ACL shows up in the analysis.
    assert "char-infiniband_verbs" in result.stdout
    assert exposure(result.stdout) <= 4.5


def test_security_threshold_really_gates(unit_dir):
    # Guard against a systemd-analyze that ignores --threshold: 0 must fail for any real unit.
    exe = systemd_analyze()
    require_analyze_options(exe, "--offline", "--threshold")
    unit = unit_dir / "fabricd.service"
    result = run_analyze(exe, unit_dir, "security", "--offline=true", "--threshold=0", str(unit))
    assert result.returncode != 0


# ---------------------------------------------------------------------------------------------
# sample config, sysusers, tmpfiles


def test_sample_config_has_exactly_the_documented_keys():
    text = SAMPLE_CONFIG.read_text()
    assert set(tomllib.loads(text)) == CONFIG_KEYS - {"listen"}
    # listen is optional (default: nodes[node_id]); the sample documents it commented out.
    enabled, count = re.subn(r"^# (listen = )", r"\1", text, flags=re.MULTILINE)
    assert count == 1
    assert set(tomllib.loads(enabled)) == CONFIG_KEYS


def test_sample_config_documents_the_defaults():
    config = tomllib.loads(SAMPLE_CONFIG.read_text())
    assert {key: config[key] for key in DOCUMENTED_DEFAULTS} == DOCUMENTED_DEFAULTS
    # Types matter as much as values: 1 and 1.0 parse differently in TOML.
    for key, value in DOCUMENTED_DEFAULTS.items():
        assert type(config[key]) is type(value), key


def test_sample_config_membership_is_well_formed():
    config = tomllib.loads(SAMPLE_CONFIG.read_text())
    nodes = config["nodes"]
    assert isinstance(config["node_id"], int)
    assert 0 <= config["node_id"] < len(nodes)
    for node in nodes:
        host, _, port = node.rpartition(":")
        assert host not in ("", "0.0.0.0", "[::]", "::"), node  # never all interfaces
        assert 0 < int(port) < 65536, node
    # More than one node means peers authenticate: the secret file is then required.
    assert len(nodes) > 1
    assert config["secret_file"].startswith("/etc/fabricd/")
    assert config["log_format"] in ("text", "json")
    assert config["event_loop"] in ("uvloop", "asyncio")


def test_sample_socket_is_in_the_units_runtime_directory():
    config = tomllib.loads(SAMPLE_CONFIG.read_text())
    (runtime_dir,) = unit_settings(UNIT)[("Service", "RuntimeDirectory")]
    assert Path(config["socket"]).parent == Path("/run") / runtime_dir


def test_sysusers_creates_the_fabricd_user_and_group(tmp_path):
    exe = shutil.which("systemd-sysusers")
    if exe is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    subprocess.run(
        [exe, f"--root={tmp_path}", str(SYSUSERS)], capture_output=True, check=True, timeout=60
    )
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    user = passwd["fabricd"]
    assert user[3] == groups["fabricd"][2]  # primary group is group fabricd
    assert user[6].endswith("nologin")
    assert int(user[2]) < 1000  # a system uid


def test_tmpfiles_creates_the_runtime_dir_like_the_unit(tmp_path):
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    if sysusers is None or tmpfiles is None:
        pytest.skip("systemd-sysusers or systemd-tmpfiles is not installed")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles must chown to fabricd inside the scratch root: needs root")
    (tmp_path / "etc").mkdir()
    subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)], check=True, timeout=60)
    subprocess.run(
        [tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES)], check=True, timeout=60
    )
    uid = next(
        int(line.split(":")[2])
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
        if line.startswith("fabricd:")
    )
    made = (tmp_path / "run/fabricd").stat()
    (unit_mode,) = unit_settings(UNIT)[("Service", "RuntimeDirectoryMode")]
    assert oct(made.st_mode & 0o7777) == oct(int(unit_mode, 8))
    assert (made.st_uid, made.st_gid) == (uid, uid)
