"""Configuration: precedence, provenance, validation and the secret file's mode."""

from __future__ import annotations

import pytest

from fabricd.daemon.config import Config, load
from fabricd.errors import ConfigError


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "fabricd.toml"
    path.write_text(
        'nodes = ["10.0.0.1:7700", "10.0.0.2:7700"]\nnode_id = 1\n'
        'secret_file = "/etc/fabricd/secret"\nheartbeat_interval = 0.5\n'
    )
    return path


def test_defaults_are_sane_and_come_from_default():
    loaded = load(None, environ={})
    assert loaded.config.nodes == ("127.0.0.1:7700",)
    assert loaded.config.listen_address == "127.0.0.1:7700"  # never all interfaces
    assert set(loaded.sources.values()) == {"default"}


def test_precedence_is_default_file_env_flag(config_file):
    loaded = load(
        str(config_file),
        environ={"FABRICD_HEARTBEAT_INTERVAL": "0.25", "FABRICD_DOWN_AFTER": "20"},
        flags={"down_after": 30.0},
    )
    cfg, sources = loaded.config, loaded.sources
    assert cfg.node_id == 1
    assert sources["node_id"] == str(config_file)
    assert cfg.heartbeat_interval == 0.25
    assert sources["heartbeat_interval"] == "env FABRICD_HEARTBEAT_INTERVAL"
    assert cfg.down_after == 30.0
    assert sources["down_after"] == "flag"
    assert cfg.suspect_after == 3.0
    assert sources["suspect_after"] == "default"
    assert cfg.listen_address == "10.0.0.2:7700"


def test_lists_from_the_environment_are_comma_separated():
    loaded = load(
        None,
        environ={
            "FABRICD_NODES": "a:1, b:2",
            "FABRICD_SECRET_FILE": "/s",
            "FABRICD_ALLOWED_UIDS": "1000,1001",
        },
    )
    assert loaded.config.nodes == ("a:1", "b:2")
    assert loaded.config.allowed_uids == (1000, 1001)


def test_describe_lists_every_key_with_value_and_source(config_file):
    described = load(str(config_file), environ={}).describe()
    assert list(described) == [f.name for f in Config.__dataclass_fields__.values()]
    assert described["nodes"] == {
        "value": ["10.0.0.1:7700", "10.0.0.2:7700"],
        "source": str(config_file),
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("node_id = 'x'\n", "node_id"),
        ("nodes = [\n", "config file"),
        ('log_format = "xml"\n', "log_format"),
        ('socket = "relative.sock"\n', "absolute path"),
        ("chunk_size = 100\n", "chunk_size"),
        ("node_id = true\n", "node_id"),
        ('log_level = "verbose"\n', "log_level"),
        ("reconnect_max_backoff = 0\n", "reconnect_max_backoff"),
        ("handshake_timeout = -1\n", "handshake_timeout"),
        ("drain_timeout = -1\n", "drain_timeout"),
        ("max_meta = 10\n", "max_meta"),
        ("max_clients = 0\n", "max_clients"),
        ("max_ops_per_client = 0\n", "max_ops_per_client must be at least 1"),
        ("max_ops_per_job = -1\n", "max_ops_per_job must be at least 1"),
        ("max_unmatched_rts_per_peer = 0\n", "max_unmatched_rts_per_peer must be at least 1"),
        ("max_segments = 0\n", "max_segments must be at least 1"),
        ("max_mapped_bytes_per_client = 0\n", "max_mapped_bytes_per_client must be at least 1"),
        ("max_mapped_bytes = 0\n", "max_mapped_bytes must be at least 1"),
        ("max_mapped_bytes = 70368744177665\n", "max_mapped_bytes must be at most"),
        ("client_hello_timeout = 0\n", "client_hello_timeout must be more than 0"),
        ("client_frame_timeout = nan\n", "client_frame_timeout must be more than 0"),
        ("client_hello_timeout = inf\n", "client_hello_timeout must be at most 86400"),
        ('data_integrity = "hmac"\n', "data_integrity must be 'mac' or 'none'"),
        # (names no resolver can look up: every dial would fail, retried for ever)
        ('nodes = ["h..:7700"]\n', "no resolver can look up 'h..'"),
        (f'nodes = ["{"a" * 64}.example:7700"]\n', "no resolver can look up"),
        ('nodes = ["h\\u0001x:7700"]\n', "no resolver can look up"),
    ],
)
def test_invalid_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(str(path), environ={})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load(str(tmp_path / "absent.toml"), environ={})


def test_job_groups_and_admin_gids_are_lists_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text('job_groups = ["train-*:2000", "ns:eval:2001"]\nadmin_gids = [4]\n')
    cfg = load(str(path), environ={}).config
    assert cfg.job_groups == ("train-*:2000", "ns:eval:2001")
    assert cfg.admin_gids == (4,)
    env = {"FABRICD_JOB_GROUPS": "train-*:2000, exp?:7", "FABRICD_ADMIN_GIDS": "4,5"}
    cfg = load(None, environ=env).config
    assert cfg.job_groups == ("train-*:2000", "exp?:7")
    assert cfg.admin_gids == (4, 5)
    assert load(None, environ={}).config.job_groups == ()  # default: only owners join


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FABRICD_JOB_GROUPS": "train-*"}, "job_groups: 'train-\\*' is not 'pattern:gid'"),
        ({"FABRICD_JOB_GROUPS": "train:staff"}, "job_groups: .* numeric gid"),
        ({"FABRICD_ADMIN_GIDS": "-1"}, "admin_gids"),
    ],
)
def test_a_bad_job_grant_or_admin_group_names_its_setting(env, message):
    with pytest.raises(ConfigError, match=message):
        load(None, environ=env)
