"""The daemon's configuration: defaults < TOML file < environment < flags, with provenance.

Every key is a top-level TOML key, an environment variable ``FABRICD_<KEY>`` (lists are
comma-separated) and a flag ``--<key-with-dashes>``.  :func:`load` records where each effective
value came from, which ``fabricctl config show`` prints.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from fabricd.daemon.keyring import SOURCE_KEYS
from fabricd.engines.link.handshake import MAX_NAME
from fabricd.engines.ownership import JobGrant
from fabricd.engines.roster import resolvable
from fabricd.errors import ConfigError
from fabricd.ipc import default_socket_path
from fabricd.transports.base import split_address

#: the most ``max_mapped_bytes`` may be: half of x86-64's 128 TiB user address space
MAX_MAPPED_BYTES: Final = 1 << 46
#: the most eager_credit: eager messages ride the control link, which a peer may leave at most
#: MAX_UNREAD (64 MiB) unread before it is dropped; a quarter keeps control frames well clear
MAX_EAGER_CREDIT: Final = 16 << 20

if TYPE_CHECKING:
    from collections.abc import Mapping


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Effective settings of one daemon (systemd/fabricd.toml documents each key)."""

    node_id: int = 0
    nodes: tuple[str, ...] = ("127.0.0.1:7700",)
    listen: str = ""
    socket: str = field(default_factory=default_socket_path)
    secret_file: str = ""
    secret_credential: str = ""
    secret_env: str = ""
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    job_groups: tuple[str, ...] = ()
    admin_gids: tuple[int, ...] = ()
    heartbeat_interval: float = 1.0
    suspect_after: float = 3.0
    down_after: float = 10.0
    handshake_timeout: float = 2.0
    handshake_spare_slots: int = 2
    reconnect_max_backoff: float = 2.0
    route_timeout: float = 30.0
    stall_after: float = 30.0
    majority_wait: float = 2.0
    schedule_interval: float = 0.1
    chunk_size: int = 4 * 1024 * 1024
    max_payload: int = 64 * 1024 * 1024
    max_meta: int = 64 * 1024
    data_integrity: str = "none"
    max_clients: int = 256
    max_clients_per_uid: int = 192
    max_ranks_per_peer: int = 4096
    client_hello_timeout: float = 10.0
    client_frame_timeout: float = 10.0
    max_segments_per_client: int = 1024
    max_segments: int = 32768
    max_mapped_bytes_per_client: int = 256 << 30
    max_mapped_bytes: int = 64 << 40
    max_ops_per_client: int = 65536
    max_ops_per_job: int = 262144
    max_waiting_calls_per_uid: int = 65536
    max_unmatched_rts_per_peer: int = 65536
    eager_limit: int = 64 * 1024
    eager_credit: int = 4 * 1024 * 1024
    receiver_initiated: bool = True
    ring_from_bytes: int = 2 * 1024 * 1024
    max_collectives_per_job: int = 1024
    max_held_bytes_per_uid: int = 0
    max_held_bytes_per_job: int = 0
    drain_timeout: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    event_loop: str = "uvloop"
    metrics_address: str = "127.0.0.1:9720"
    monitor_interval: float = 0.2
    link_up_bps: float = 0.0
    link_down_bps: float = 0.0
    membership: str = "static"
    node_name: str = ""
    max_nodes: int = 64
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    etcd_prefix: str = "/fabricd/"
    etcd_lease_ttl: int = 10
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""

    @property
    def listen_address(self) -> str:
        """Where to bind: ``listen`` if set, else this node's entry of ``nodes``."""
        return self.listen or self.nodes[self.node_id]

    def validate(self) -> None:
        """Raise ConfigError naming the key when a value cannot work."""
        if self.membership == "etcd":
            self._validate_etcd()
        elif self.membership != "static":
            raise ConfigError("membership must be 'static' or 'etcd'")
        if len(self.node_name.encode()) > MAX_NAME:  # (every HELLO carries it)
            raise ConfigError(f"node_name: at most {MAX_NAME} bytes (UTF-8)")
        self._validate_fabric()
        self._validate_timers()
        self._validate_limits()
        self._validate_service()

    def _validate_fabric(self) -> None:
        """The node list, the addresses, the secret, liveness and framing."""
        if not self.nodes:
            raise ConfigError("nodes: list at least this node's host:port")
        if not 0 <= self.node_id < len(self.nodes):
            raise ConfigError(
                f"node_id {self.node_id} is not an index of nodes (0..{len(self.nodes) - 1})"
            )
        for key, address in [("nodes", a) for a in self.nodes] + [("listen", self.listen_address)]:
            try:
                host, _ = split_address(address)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            if not resolvable(host):  # (else every dial would fail, retried for ever)
                raise ConfigError(f"{key}: {address!r}: no resolver can look up {host!r}")
        self._validate_secret_source()
        if not 0 < self.heartbeat_interval < self.suspect_after <= self.down_after:
            raise ConfigError("need 0 < heartbeat_interval < suspect_after <= down_after")
        if not 4096 <= self.chunk_size <= self.max_payload:
            raise ConfigError("chunk_size must be between 4096 and max_payload")

    def _validate_etcd(self) -> None:
        """Membership from etcd: the node ids and addresses come from there
        (:mod:`fabricd.engines.roster`), so ``nodes`` and ``node_id`` must be left out."""
        if self.nodes != _DEFAULT_NODES or self.node_id != 0:
            raise ConfigError(
                "nodes, node_id: set by etcd when membership = 'etcd'; leave them out"
            )
        if not self.listen:
            raise ConfigError(
                "listen: required when membership = 'etcd' (the host:port peers dial, "
                "registered in etcd)"
            )
        if not 2 <= self.max_nodes <= 4096:
            raise ConfigError("max_nodes must be between 2 and 4096")
        if not self.etcd_endpoints:
            raise ConfigError("etcd_endpoints: list at least one host:port")
        for endpoint in self.etcd_endpoints:
            try:
                split_address(endpoint)
            except ValueError as exc:
                raise ConfigError(f"etcd_endpoints: {exc}") from None
        if not self.etcd_prefix.endswith("/"):
            raise ConfigError("etcd_prefix must end with '/'")
        if not 2 <= self.etcd_lease_ttl <= 3600:
            raise ConfigError("etcd_lease_ttl must be between 2 and 3600 seconds")
        if "/" in self.node_name:
            raise ConfigError(f"node_name {self.node_name!r}: a name, without '/'")
        if bool(self.etcd_cert_file) != bool(self.etcd_key_file):
            raise ConfigError("etcd_cert_file and etcd_key_file: set both or neither")
        if bool(self.etcd_user) != bool(self.etcd_password_file):
            raise ConfigError("etcd_user and etcd_password_file: set both or neither")

    @property
    def fabric_size(self) -> int:
        """How many node ids there are: ``nodes`` listed, or ``max_nodes`` slots in etcd."""
        return self.max_nodes if self.membership == "etcd" else len(self.nodes)

    def _validate_secret_source(self) -> None:
        """At most one secret source (:mod:`fabricd.daemon.keyring`), and one when there
        are peers to authenticate: two could disagree, and which one wins would be a guess."""
        chosen = [key for key in SOURCE_KEYS if getattr(self, key)]
        if len(chosen) > 1:
            raise ConfigError(
                f"{', '.join(chosen)}: {len(chosen)} secret sources are set, they conflict; "
                "configure exactly one"
            )
        if self.fabric_size > 1 and not chosen:
            raise ConfigError(
                "secret_file, secret_credential or secret_env: one is required when nodes "
                "lists more than one node, or membership = 'etcd'"
            )
        if "/" in self.secret_credential or self.secret_credential in (".", ".."):
            raise ConfigError(
                f"secret_credential {self.secret_credential!r}: a credential name, not a path "
                "(the name given to LoadCredential=)"
            )

    def _validate_timers(self) -> None:
        """Every timeout is positive, and those the loop arms are at most a day."""
        for key in (
            "handshake_timeout",
            "reconnect_max_backoff",
            "route_timeout",
            "stall_after",
            "majority_wait",
            "schedule_interval",
            "client_hello_timeout",
            "client_frame_timeout",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be more than 0 seconds")
        loop_timers = ("client_hello_timeout", "client_frame_timeout", "stall_after")
        for key in (*loop_timers, "majority_wait", "schedule_interval"):
            if not getattr(self, key) <= 86400:
                raise ConfigError(f"{key} must be at most 86400 seconds (a day)")
        if self.drain_timeout < 0:
            raise ConfigError("drain_timeout must be 0 seconds or more")
        if not 0 <= self.monitor_interval <= 60:
            raise ConfigError("monitor_interval must be between 0 (off) and 60 seconds")
        for key in ("link_up_bps", "link_down_bps"):
            if not 0 <= getattr(self, key) <= 1e13:
                raise ConfigError(f"{key} must be between 0 (measure) and 1e13 bytes/s")

    def _validate_limits(self) -> None:
        """The caps on clients, segments, operations, eager messages and peers."""
        if min(self.max_clients, self.max_segments_per_client, self.max_clients_per_uid) < 1:
            raise ConfigError(
                "max_clients, max_clients_per_uid and max_segments_per_client must be at least 1"
            )
        for key in ("max_segments", "max_mapped_bytes_per_client", "max_mapped_bytes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1")
        if self.max_mapped_bytes > MAX_MAPPED_BYTES:
            raise ConfigError(
                f"max_mapped_bytes must be at most {MAX_MAPPED_BYTES} (64 TiB): half of the "
                "128 TiB a process can address, so the daemon's own memory always fits"
            )
        for key in (
            "max_ops_per_client",
            "max_ops_per_job",
            "max_waiting_calls_per_uid",
            "max_unmatched_rts_per_peer",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1")
        if not 0 <= self.eager_limit <= min(self.eager_credit, self.max_payload):
            raise ConfigError(
                "eager_limit must be between 0 and both eager_credit and max_payload (a message "
                "sent eager must fit the peer's pool and one frame)"
            )
        if self.ring_from_bytes < 0:
            raise ConfigError("ring_from_bytes must be >= 0 (0: ring allreduce at every size)")
        if self.max_collectives_per_job < 1:
            raise ConfigError("max_collectives_per_job must be at least 1")
        for key in ("max_held_bytes_per_uid", "max_held_bytes_per_job"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0 bytes (0: a quarter of this node's memory)")
        if self.eager_credit > MAX_EAGER_CREDIT:
            raise ConfigError(
                f"eager_credit must be at most {MAX_EAGER_CREDIT} bytes: eager messages travel "
                "on the control channel, whose unread bytes are bounded"
            )
        if not 0 <= self.handshake_spare_slots <= 1024:
            raise ConfigError("handshake_spare_slots must be between 0 and 1024")
        if self.max_ranks_per_peer < self.max_clients:
            raise ConfigError(
                "max_ranks_per_peer must be at least max_clients: a peer hosts a rank per client, "
                "and one past the bound is reset"
            )

    def _validate_service(self) -> None:
        """Metadata, integrity, access rules, logs, the loop, metrics and the socket."""
        if self.max_meta < 1024:
            raise ConfigError("max_meta must be at least 1024 bytes")
        if self.data_integrity not in ("mac", "none"):
            raise ConfigError("data_integrity must be 'mac' or 'none'")
        for text in self.job_groups:
            try:
                JobGrant.parse(text)
            except ValueError as exc:
                raise ConfigError(f"job_groups: {exc}") from None
        if any(gid < 0 for gid in self.admin_gids):
            raise ConfigError("admin_gids must list group ids >= 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level must be one of debug, info, warning, error")
        if self.log_format not in ("text", "json"):
            raise ConfigError("log_format must be 'text' or 'json'")
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ConfigError("event_loop must be 'uvloop' or 'asyncio'")
        if self.metrics_address:
            _check_metrics_address(self.metrics_address)
        if not self.socket.startswith("/"):
            raise ConfigError(
                "socket must be an absolute path (abstract sockets have no permissions)"
            )


def _check_metrics_address(address: str) -> None:
    """``metrics_address`` must be ``ip:port``: an address, so what is bound is exactly it.

    A host name could resolve to more than one address, or to another one tomorrow; the
    endpoint is bound to one interface the operator named (RELIABILITY S3).  ``0.0.0.0`` or
    ``::`` (every interface) is taken only when written here.
    """
    try:
        host, _ = split_address(address)
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"metrics_address: {address!r} is not ip:port (e.g. 127.0.0.1:9720 or [::1]:9720; "
            "empty turns the endpoint off)"
        ) from None


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_DEFAULT_NODES: Final = _FIELDS["nodes"].default


def _coerce(key: str, value: Any, origin: str) -> Any:
    kind = str(_FIELDS[key].type)
    try:
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            items = [i.strip() if isinstance(i, str) else i for i in items if i != ""]
            return tuple(int(i) for i in items) if "int" in kind else tuple(str(i) for i in items)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            return words[str(value).strip().lower()]
        if kind == "float":
            return float(value)
        if not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError, KeyError):
        raise ConfigError(f"{key} ({origin}): {value!r} is not a valid {kind}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    """A config plus where each value came from ("default", a file path, "env ...", "flag")."""

    config: Config
    sources: dict[str, str]

    def describe(self) -> dict[str, dict[str, object]]:
        """key -> {"value", "source"}, in declaration order, JSON-ready."""
        out: dict[str, dict[str, object]] = {}
        for key in _FIELDS:
            value = getattr(self.config, key)
            out[key] = {
                "value": list(value) if isinstance(value, tuple) else value,
                "source": self.sources[key],
            }
        return out


def load(
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Loaded:
    """Build the effective config.  ``flags`` holds only flags that were given.

    Raises:
        ConfigError: unreadable file, unknown key, bad value, or an invalid combination.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources = {key: "default" for key in _FIELDS}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        for key, value in data.items():
            if key not in _FIELDS:
                raise ConfigError(f"config file {path}: unknown key {key!r}")
            values[key], sources[key] = _coerce(key, value, path), path
    for key in _FIELDS:
        env_name = f"FABRICD_{key.upper()}"
        if env_name in environ:
            values[key] = _coerce(key, environ[env_name], env_name)
            sources[key] = f"env {env_name}"
    for key, value in (flags or {}).items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key], sources[key] = _coerce(key, value, f"--{key.replace('_', '-')}"), "flag"
    config = Config(**values)
    config.validate()
    return Loaded(config=config, sources=sources)


def held_bytes_limits(cfg: Config) -> tuple[int, int]:
    """The byte budgets in force: ``(per uid, per job)`` (:mod:`fabricd.engines.budget`).

    A setting of 0 (the default) is a quarter of the memory the daemon may use -- the node's
    physical memory, or its cgroup's limit where that is lower (cgroup v2 ``memory.max``, or
    v1 ``memory.limit_in_bytes``, of the cgroup it runs in): the daemon holds
    what its tenants make it hold on behalf of every job on the node, and one uid (or job) left
    to take more would make the kernel's OOM killer choose among processes -- likely the
    daemon, whose memory then looks largest, which would end every tenant's jobs.  A quarter
    leaves room for the training processes themselves and for a second tenant.
    """
    quarter = min(_physical_memory(), _cgroup_memory_limit()) // 4
    return (
        cfg.max_held_bytes_per_uid or quarter,
        cfg.max_held_bytes_per_job or quarter,
    )


def _physical_memory() -> int:
    """This node's RAM in bytes (1 GiB when the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 30


def _cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int:
    """The memory limit of the cgroup this process runs in; a huge number when there is none
    or it cannot be read (so the physical memory decides)."""
    unlimited = 1 << 62
    try:
        with open(proc_cgroup) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return unlimited
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy
            limit_file = f"{root}{path.rstrip('/')}/memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's
            limit_file = f"{root}/memory{path.rstrip('/')}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(limit_file) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(unlimited, int(text))
    return unlimited
