"""The secret sources (file, systemd credential, environment) and every refusal of one."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

import pytest

from fabricd.daemon.config import Config, load
from fabricd.daemon.keyring import check_file_access, parse_secrets, read_secrets
from fabricd.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

S1 = "s1-" + "a" * 40
S2 = "s2-" + "b" * 40
PEERS = ("a:1", "b:2")


def status(mode: int, *, uid: int | None = None, gid: int | None = None) -> os.stat_result:
    """What stat() says of a regular file with this mode, owner and group."""
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    return os.stat_result((stat.S_IFREG | mode, 1, 1, 1, uid, gid, 44, 0, 0, 0))


def nobody_else(gid: int) -> list[str]:
    return []


def private_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return path


# -- the file ---------------------------------------------------------------------------------
def test_a_private_file_gives_its_secret(tmp_path: Path) -> None:
    path = private_file(tmp_path, S1 + "\n")
    assert read_secrets(Config(nodes=PEERS, secret_file=str(path))) == (S1.encode(),)


def test_a_file_of_two_lines_gives_both_the_older_first(tmp_path: Path) -> None:
    path = private_file(tmp_path, f"  {S1}  \n\n{S2}\n")
    assert read_secrets(Config(nodes=PEERS, secret_file=str(path))) == (
        S1.encode(),
        S2.encode(),
    )


def test_a_group_readable_file_of_the_daemons_own_group_is_accepted(tmp_path: Path) -> None:
    path = private_file(tmp_path, S1, mode=0o640)  # created with this process's egid
    check_file_access(path.stat(), "secret_file", members=nobody_else)
    check_file_access(status(0o440, uid=0), "secret_file", members=nobody_else)  # fsGroup mount


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0o604, r"mode 0604.*open to others"),
        (0o644, r"mode 0644.*open to others"),
        (0o601, r"mode 0601.*open to others"),
        (0o660, r"mode 0660.*writable by its group"),
        (0o650, r"mode 0650.*writable by its group"),
    ],
)
def test_modes_that_open_the_file_to_others_are_refused(mode: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_file_access(status(mode), "secret_file /s", members=nobody_else)


def test_a_file_of_another_owner_is_refused_naming_owner_and_group() -> None:
    other = os.geteuid() + 1000
    with pytest.raises(ConfigError, match=rf"owner uid {other}, group gid .*another user"):
        check_file_access(status(0o600, uid=other), "secret_file /s", members=nobody_else)


def test_group_read_by_a_group_not_the_daemons_is_refused() -> None:
    other = os.getegid() + 1000
    with pytest.raises(ConfigError, match=rf"mode 0640.*group gid {other}.*not this daemon's"):
        check_file_access(status(0o640, gid=other), "secret_file /s", members=nobody_else)


def test_group_read_by_the_daemons_group_with_other_members_is_refused() -> None:
    def crowded(gid: int) -> list[str]:
        return ["alice", "bob"]

    with pytest.raises(ConfigError, match=r"mode 0640.*also lists alice, bob"):
        check_file_access(status(0o640), "secret_file /s", members=crowded)


def test_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secrets(Config(nodes=PEERS, secret_file=str(tmp_path)))


def test_a_refused_file_on_disk_names_the_fix(tmp_path: Path) -> None:
    path = private_file(tmp_path, S1, mode=0o604)
    with pytest.raises(ConfigError, match=rf"secret_file {path} \(mode 0604.*chmod 600"):
        read_secrets(Config(nodes=PEERS, secret_file=str(path)))


def test_a_huge_file_is_refused_unread(tmp_path: Path) -> None:
    path = private_file(tmp_path, "x" * (1 << 20))
    with pytest.raises(ConfigError, match="more than 4096 bytes"):
        read_secrets(Config(nodes=PEERS, secret_file=str(path)))


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        read_secrets(Config(nodes=PEERS, secret_file=str(tmp_path / "nope")))


# -- the contents -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"", "holds no secret"),
        (b" \n\n  \n", "holds no secret"),
        (b"short", "secret 1 holds under 16 bytes"),
        (S1.encode() + b"\nshort\n", "secret 2 holds under 16 bytes"),
        (f"{S1}\n{S2}\n{S1}x".encode(), "holds 3 secrets"),
        (b"x" * 5000, "more than 4096 bytes"),
    ],
)
def test_empty_short_or_too_many_secrets_are_refused(text: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_secrets(text, "src")


def test_a_refusal_never_shows_the_secret(tmp_path: Path) -> None:
    path = private_file(tmp_path, f"{S1}\n{S2}\ntoo-many-" + "c" * 30, mode=0o600)
    with pytest.raises(ConfigError) as caught:
        read_secrets(Config(nodes=PEERS, secret_file=str(path)))
    assert S1 not in str(caught.value)
    assert S2 not in str(caught.value)


# -- systemd credentials ----------------------------------------------------------------------
def test_a_credential_is_read_from_the_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "fabricd-secret").write_text(S1 + "\n" + S2)
    cfg = Config(nodes=PEERS, secret_credential="fabricd-secret")
    environ = {"CREDENTIALS_DIRECTORY": str(tmp_path)}
    assert read_secrets(cfg, environ) == (S1.encode(), S2.encode())


def test_a_credential_outside_systemd_is_refused_naming_load_credential() -> None:
    cfg = Config(nodes=PEERS, secret_credential="fabricd-secret")
    with pytest.raises(ConfigError, match=r"CREDENTIALS_DIRECTORY is not set.*LoadCredential="):
        read_secrets(cfg, {})


def test_a_missing_credential_is_refused(tmp_path: Path) -> None:
    cfg = Config(nodes=PEERS, secret_credential="fabricd-secret")
    with pytest.raises(ConfigError, match=r"cannot read .*fabricd-secret.*LoadCredential"):
        read_secrets(cfg, {"CREDENTIALS_DIRECTORY": str(tmp_path)})


@pytest.mark.parametrize("name", ["../secret", "a/b", "..", "."])
def test_a_credential_name_is_not_a_path(name: str) -> None:
    with pytest.raises(ConfigError, match="a credential name, not a path"):
        Config(nodes=PEERS, secret_credential=name).validate()


# -- the environment --------------------------------------------------------------------------
def test_a_secret_from_the_environment(tmp_path: Path) -> None:
    cfg = Config(nodes=PEERS, secret_env="FABRICD_SECRET")
    assert read_secrets(cfg, {"FABRICD_SECRET": S1}) == (S1.encode(),)
    assert read_secrets(cfg, {"FABRICD_SECRET": f"{S1}\n{S2}"}) == (S1.encode(), S2.encode())


@pytest.mark.parametrize("environ", [{}, {"FABRICD_SECRET": ""}])
def test_an_unset_or_empty_variable_is_refused(environ: dict[str, str]) -> None:
    cfg = Config(nodes=PEERS, secret_env="FABRICD_SECRET")
    with pytest.raises(ConfigError, match=r"secret_env FABRICD_SECRET: .*not set or empty"):
        read_secrets(cfg, environ)


def test_the_variable_named_by_secret_env_is_not_a_setting(tmp_path: Path) -> None:
    """FABRICD_SECRET is no config key: the effective config (config show) never holds it."""
    loaded = load(None, environ={"FABRICD_SECRET_ENV": "FABRICD_SECRET", "FABRICD_SECRET": S1})
    assert S1 not in str(loaded.describe())


# -- exactly one source -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"secret_file": "/s", "secret_env": "V"}, "secret_file, secret_env: 2"),
        ({"secret_file": "/s", "secret_credential": "c"}, "secret_file, secret_credential: 2"),
        (
            {"secret_file": "/s", "secret_credential": "c", "secret_env": "V"},
            "secret_file, secret_credential, secret_env: 3",
        ),
    ],
)
def test_two_sources_conflict_and_are_named(settings: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"{named} secret sources are set, they conflict"):
        Config(nodes=PEERS, **settings).validate()


def test_a_conflict_from_file_and_environment_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "fabricd.toml"
    path.write_text('nodes = ["a:1", "b:2"]\nsecret_credential = "fabricd-secret"\n')
    with pytest.raises(ConfigError, match="secret_file, secret_credential: 2"):
        load(str(path), environ={"FABRICD_SECRET_FILE": "/etc/fabricd/secret"})


def test_peers_need_a_source_and_one_node_needs_none() -> None:
    with pytest.raises(ConfigError, match="secret_file, secret_credential or secret_env"):
        Config(nodes=PEERS).validate()
    Config().validate()
    assert read_secrets(Config()) == ()
