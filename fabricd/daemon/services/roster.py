"""The roster service: membership from etcd (``membership = "etcd"``), the I/O of it.

Drives :mod:`fabricd.engines.roster`, which decides which slot to claim, what a registration
means for the address table and what a partition changes.  This module talks to etcd through
aetcd, an asyncio etcd v3 client (gRPC underneath; docs/operations.md, "Membership from etcd"):

* :func:`register`, before the daemon is built: a lease of ``etcd_lease_ttl`` seconds, the
  slot claimed in one transaction under it (``slots/<i>``, ``nodes/<name>`` with the daemon's
  incarnation, chosen here and kept by the daemon, and ``names/<name>`` remembered without a
  lease), and a full read of the registrations.  The daemon's node id is
  the slot, its ``nodes`` the addresses read ("" for free slots), so every engine sees the small
  integer ids it always has.  etcd unreachable at start is retried, with backoff, until it
  answers: the daemon is not ready (no READY=1) before it is registered;
* :class:`RosterService`, while the daemon runs: keeps the lease alive (every third of its
  TTL), watches ``nodes/`` from the revision read (and reads it whole every
  :data:`RESYNC_INTERVAL`; a read older than an event the watch applied is dropped, and an
  event a read already brought is skipped: the view never goes back in etcd's history), and
  hands every change to the peering
  service (:meth:`~fabricd.daemon.services.peering.PeeringService.set_holder`, then
  :meth:`~fabricd.daemon.services.peering.PeeringService.set_address`).  A call that
  fails or takes longer than a third of the TTL makes etcd *unreachable*: the view is kept,
  etcd is tried again with backoff (the next endpoint each time), and once it answers the
  lease is checked, registered again if it expired meanwhile (the same slot: a node's id never
  changes while it runs; a slot another name took, or held meanwhile, stops the daemon:
  exit 75, a fresh incarnation on restart), and the view read whole again.  ``status`` says which
  (``membership``); the drain revokes the lease, so the others see this node leave at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

import aetcd
import grpc

from fabricd.daemon.config import Loaded
from fabricd.daemon.service import BaseService
from fabricd.engines.roster import AddressChanged, Claim, Member, Roster, State, choose_slot
from fabricd.errors import ConfigError
from fabricd.transports.base import split_address

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from fabricd.daemon.config import Config
    from fabricd.daemon.service import Host
    from fabricd.daemon.services.peering import PeeringService
    from fabricd.wire import Meta

log = logging.getLogger("fabricd.roster")
#: the longest pause between two tries to reach etcd
MAX_RETRY: Final = 2.0
#: how often the view is read whole while the watch runs (a watch that died silently)
RESYNC_INTERVAL: Final = 60.0
#: the longest pause between two keepalives: etcd's authentication tokens expire after 300 s
#: unused (``--auth-token-ttl``), so a third of a long TTL would let them
MAX_KEEPALIVE: Final = 60.0
#: how long the drain waits for the roster task to end once cancelled (a hang guard)
SETTLE_TIMEOUT: Final = 2.0


class LeaseLost(Exception):
    """etcd answered, but this daemon's lease is gone (it expired during a partition)."""


class SlotTaken(Exception):
    """Registering again, this daemon's slot is held by another name."""


class NameTaken(ConfigError):
    """This daemon's name stays registered by another daemon (two were given one name)."""


#: periodic reads in a row older than what the watch applied, with no watch event
#: meanwhile, after which etcd is taken to have gone back (restored from a snapshot)
STALE_READS: Final = 3


class WatchEnded(Exception):
    """etcd closed the watch without an error: changes would be missed from here on."""


#: what a failed or lost call to etcd raises (aetcd maps gRPC's statuses to ClientError), and
#: what this module finds wrong with etcd's answers: each makes etcd unreachable, and retried;
#: so does any other exception while the daemon runs (grpc's UsageError, a password file that
#: cannot be read again), which is logged with its type
ETCD_ERRORS: Final = (
    aetcd.ClientError,
    grpc.RpcError,
    OSError,
    TimeoutError,
    LeaseLost,
    WatchEnded,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdSettings:
    """What this daemon needs of its config to talk to etcd and register."""

    endpoints: tuple[str, ...]
    prefix: bytes
    ttl: int
    name: str
    address: str
    max_nodes: int
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password_file: str = ""

    @classmethod
    def from_config(cls, cfg: Config) -> EtcdSettings:
        return cls(
            endpoints=cfg.etcd_endpoints,
            prefix=cfg.etcd_prefix.encode(),
            ttl=cfg.etcd_lease_ttl,
            name=cfg.node_name or socket.gethostname(),
            address=cfg.listen,
            max_nodes=cfg.max_nodes,
            ca_file=cfg.etcd_ca_file,
            cert_file=cfg.etcd_cert_file,
            key_file=cfg.etcd_key_file,
            user=cfg.etcd_user,
            password_file=cfg.etcd_password_file,
        )

    @property
    def call_timeout(self) -> float:
        """How long one call to etcd may take: a third of the lease, so a keepalive that
        hangs still leaves time for the next before the lease runs out."""
        return self.ttl / 3

    def key(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()


@dataclass(slots=True, kw_only=True)
class Registration:
    """A live registration: the client, its lease, the slot, and the view read with it."""

    client: aetcd.Client
    lease: int
    slot: int
    members: list[Member]
    revision: int  #: the revision the view was read at: the watch starts after it
    endpoint: int  #: the index of the endpoint the client talks to
    #: registrations read that are not ones (:meth:`Member.decode`): names and values
    refused: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)
    name: str = ""  #: the name registered (sent in every HELLO)
    #: the incarnation registered: the daemon's own (its start, ns), which peers admit
    incarnation: int = dataclasses.field(default_factory=time.time_ns)


class _Client(aetcd.Client):
    """aetcd's client, over TLS when the settings name a CA or a client certificate.

    aetcd 1.0 opens plaintext channels only; this subclass opens the channel itself when TLS
    is asked for and otherwise leaves everything (stubs, watcher, authentication) to aetcd.
    """

    def __init__(self, settings: EtcdSettings, endpoint: str) -> None:
        host, port = split_address(endpoint)
        user = settings.user or None
        password = _read_password(settings.password_file) if user else None
        timeout = max(1, int(settings.call_timeout))
        super().__init__(host=host, port=port, username=user, password=password, timeout=timeout)
        self._credentials = _credentials(settings)

    async def connect(self) -> None:
        if self._credentials is None or self._connected.is_set():
            await super().connect()
            return
        rpc = aetcd.rpc
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials)
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            answer = await self.auth_stub.Authenticate(request, timeout=self._timeout)
            self.metadata = (("token", answer.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


def _read_password(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"etcd_password_file {path}: {exc.strerror}") from None


def _credentials(settings: EtcdSettings) -> grpc.ChannelCredentials | None:
    if not (settings.ca_file or settings.cert_file):
        return None
    files = {}
    for key, path in (
        ("root_certificates", settings.ca_file),
        ("private_key", settings.key_file),
        ("certificate_chain", settings.cert_file),
    ):
        if path:
            try:
                with open(path, "rb") as fh:
                    files[key] = fh.read()
            except OSError as exc:
                raise ConfigError(f"etcd TLS file {path}: {exc.strerror}") from None
    return grpc.ssl_channel_credentials(**files)


async def _connect(settings: EtcdSettings, endpoint: int) -> aetcd.Client:
    client = _Client(settings, settings.endpoints[endpoint % len(settings.endpoints)])
    try:  # (closed on failure: with a password the channel is open by then, one per retry)
        async with asyncio.timeout(settings.call_timeout):
            await client.connect()
    except BaseException:
        await _close(client)
        raise
    return client


async def release(registration: Registration) -> None:
    """Leave etcd at once: the lease revoked (the others see this node go without waiting
    for its TTL) and the client closed, whatever etcd answers."""
    await _revoke(registration.client, registration.lease)
    await _close(registration.client)


async def _revoke(client: aetcd.Client, lease: int) -> None:
    """Revoke ``lease``, whatever etcd answers (within a second)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await client.revoke_lease(lease)


async def register(cfg: Config) -> Registration:
    """Register this daemon in etcd (module docstring), trying until etcd answers.

    Raises:
        ConfigError: every slot is taken, or a TLS or password file cannot be read.
    """
    settings = EtcdSettings.from_config(cfg)
    incarnation = time.time_ns()  # the daemon's: registered, so peers admit it by equality
    attempt, wait = 0, 0.1
    while True:
        client = None
        try:
            client = await _connect(settings, attempt)
            return await _claim(client, settings, attempt, slot=None, incarnation=incarnation)
        except ConfigError:
            if client is not None:
                await _close(client)
            raise
        except Exception as exc:  # (grpc's UsageError and InternalError are no RpcError)
            log.warning(
                "etcd at %s: %s; retrying in %.1fs",
                settings.endpoints[attempt % len(settings.endpoints)],
                _why(exc, settings.call_timeout),
                wait,
            )
            if client is not None:
                await _close(client)
        attempt, wait = attempt + 1, min(wait * 2, MAX_RETRY)
        await asyncio.sleep(wait)


def registered(loaded: Loaded, registration: Registration) -> Loaded:
    """The config the daemon runs with once registered: its node id the slot, ``nodes`` every
    slot's address as read ("" where free), both with ``etcd`` as their source."""
    cfg = loaded.config
    nodes = [""] * cfg.max_nodes
    nodes[registration.slot] = cfg.listen
    for member in registration.members:  # as the engine takes them: the first of a slot
        if 0 <= member.slot < cfg.max_nodes and not nodes[member.slot]:
            nodes[member.slot] = member.address
    config = dataclasses.replace(cfg, node_id=registration.slot, nodes=tuple(nodes))
    return Loaded(config=config, sources={**loaded.sources, "node_id": "etcd", "nodes": "etcd"})


async def _claim(
    client: aetcd.Client,
    settings: EtcdSettings,
    endpoint: int,
    *,
    slot: int | None,
    incarnation: int,
) -> Registration:
    """A slot (``slot``: this one only, registering again) under a new lease, registered as
    ``incarnation``, and the view.

    The lease is granted just before the slot is taken, never before a WAIT: a lease that
    aged while this daemon waited for its earlier run's would expire soon after the start.
    """
    name, waiting_since = settings.name, 0.0
    while True:
        held = {
            int(kv.key.rsplit(b"/", 1)[1]): kv.value.decode(errors="replace")
            for kv in await client.get_prefix(settings.key("slots/"))
            if kv.key.rsplit(b"/", 1)[1].isdigit()
        }
        remembered, others = await _memories(client, settings, slot)
        remembered = slot if slot is not None else remembered
        choice = choose_slot(held, name, remembered, settings.max_nodes, others)
        if slot is not None and choice != slot and choice is not Claim.WAIT:
            raise SlotTaken(f"slot {slot} is held by {held.get(slot)!r}")
        if choice is Claim.FULL:
            raise ConfigError(f"all {settings.max_nodes} slots (max_nodes) in etcd are taken")
        if choice is Claim.WAIT:
            now = asyncio.get_running_loop().time()
            waiting_since = waiting_since or now
            await _wait_for_name(client, settings, waited=now - waiting_since)
            continue
        lease = await client.lease(settings.ttl)
        try:
            if await _take(client, settings, lease.id, choice, incarnation):
                view = await _read_view(client, settings)
                break
        except BaseException:  # (a failure or a cancel: the lease would hold the slot a TTL)
            await _revoke(client, lease.id)
            raise
        await _revoke(client, lease.id)  # (lost the race: it would expire anyway)
    log.info("registered in etcd as %r, slot %d", name, choice)
    return Registration(
        client=client,
        lease=lease.id,
        slot=choice,
        members=view.members,
        revision=view.revision,
        endpoint=endpoint,
        refused=view.refused,
        name=name,
        incarnation=incarnation,
    )


async def _memories(
    client: aetcd.Client, settings: EtcdSettings, slot: int | None
) -> tuple[int | None, list[int]]:
    """The slot this name remembers (``names/``) and those other names remember.

    Registering again (``slot``, after the lease was lost): another name that remembers
    ``slot`` from after this name's own registration held the slot meanwhile, and the peers
    closed this daemon's links when it took over (one id, one node) and failed what was
    under way with it: the id meant another node in between, so this daemon does not resume
    as if nothing happened; it is :class:`SlotTaken` (the daemon stops and comes back as a
    fresh incarnation), even though the holder has left again.

    Raises:
        SlotTaken: registering again, and ``slot`` had another holder meanwhile.
    """
    remembered, own, others = None, 0, {}
    for kv in await client.get_prefix(settings.key("names/")):
        if kv.key == settings.key("names", settings.name):
            remembered, own = _int(kv.value), kv.mod_revision
        elif (other := _int(kv.value)) is not None:
            others[kv.key] = (other, kv.mod_revision)
    for key, (other, revision) in others.items():
        if slot is not None and other == slot and revision > own:
            holder = key.rsplit(b"/", 1)[1].decode(errors="replace")
            raise SlotTaken(f"slot {slot} was held by {holder!r} meanwhile")
    return remembered, [other for other, _ in others.values()]


async def _wait_for_name(client: aetcd.Client, settings: EtcdSettings, *, waited: float) -> None:
    """This daemon's name holds a slot (for ``waited`` seconds so far): an earlier run's
    lease, which expires within a TTL, or another daemon given the same name, which never
    lets go: said with the holder's address, and given up (ConfigError) after two TTLs."""
    if waited == 0 or waited >= 2 * settings.ttl:
        found = await client.get(settings.key("nodes", settings.name))
        holder = Member.decode(settings.name, found.value) if found is not None else None
        at = holder.address if holder is not None else "an unknown address"
        if waited:
            raise NameTaken(
                f"node_name {settings.name!r} is still registered in etcd, by a daemon at {at},"
                f" after {waited:.0f}s: two daemons were given one name"
            )
        log.warning(
            "name %r is registered in etcd (by %s): an earlier run's lease? waiting up to %ds",
            settings.name,
            at,
            2 * settings.ttl,
        )
    await asyncio.sleep(0.5)


def _int(value: bytes) -> int | None:
    return int(value) if value.isdigit() else None


async def _take(
    client: aetcd.Client, settings: EtcdSettings, lease: int, slot: int, incarnation: int
) -> bool:
    """Claim ``slot`` if it is still free and this name holds no registration (two daemons
    given one name racing: only one wins): one transaction, under the lease."""
    name, tx = settings.name, client.transactions
    member = Member(name=name, address=settings.address, slot=slot, incarnation=incarnation)
    ok, _ = await client.transaction(
        compare=[
            tx.create(settings.key("slots", str(slot))) == 0,
            tx.version(settings.key("nodes", name)) == 0,
        ],
        success=[
            tx.put(settings.key("slots", str(slot)), name.encode(), lease),
            tx.put(settings.key("nodes", name), member.encode(), lease),
            tx.put(settings.key("names", name), str(slot).encode()),
        ],
        failure=[],
    )
    return bool(ok)


class _View(NamedTuple):
    """A full read of ``nodes/``."""

    members: list[Member]  #: every other node's registration
    revision: int  #: the revision it was read at
    refused: list[tuple[str, bytes]]  #: registrations read that are not ones
    registered: bool  #: this daemon's own registration is there


async def _read_view(client: aetcd.Client, settings: EtcdSettings) -> _View:
    """Every registration but this daemon's, and whether its own is there."""
    found = await client.get_prefix(settings.key("nodes/"))
    members: list[Member] = []
    refused: list[tuple[str, bytes]] = []
    registered = False
    for kv in found:
        name = kv.key[len(settings.key("nodes/")) :].decode(errors="replace")
        if name == settings.name:
            registered = True
        elif (member := _decode(name, kv.value)) is not None:
            members.append(member)
        else:
            refused.append((name, kv.value))
    return _View(members, found.header.revision, refused, registered)


def _decode(name: str, value: bytes) -> Member | None:
    """The registration ``value`` says; one that is not (a foreign key, an address that
    cannot be dialled) is logged and ``None``."""
    member = Member.decode(name, value)
    if member is None:
        log.warning("ignoring registration %r in etcd: not a dialable address and slot", name)
    return member


def _why(exc: BaseException, timeout: float) -> str:
    """What went wrong with etcd, in words (a timeout's own text is empty)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    if not isinstance(exc, ETCD_ERRORS):  # unexpected: say what it was
        return f"{type(exc).__name__}: {exc}"
    return str(exc) or type(exc).__name__


async def _close(client: aetcd.Client) -> None:
    """Close ``client``, whatever etcd answers; a cancellation of the caller goes through
    (swallowed, it would send the roster task back to etcd and hang the drain)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await client.close()


class RosterService(BaseService):
    """Keeps this daemon registered and the peering service's addresses true to etcd."""

    name = "roster"

    def __init__(
        self,
        host: Host,
        peering: PeeringService,
        registration: Registration,
        *,
        on_slot_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.host = host
        #: called when this daemon's slot went to another node, or its name is another
        #: daemon's: the daemon must stop
        self.on_slot_lost = on_slot_lost
        self.slot_lost = False  #: so it did: the daemon exits non-zero, to register afresh
        #: registering again, another daemon held this one's name: the daemon stopped, and
        #: exits as a configuration error
        self.name_taken = False
        self.peering = peering
        self.settings = EtcdSettings.from_config(host.config)
        self._registration = registration
        self.engine = Roster(
            name=self.settings.name,
            slot=registration.slot,
            max_nodes=self.settings.max_nodes,
            now=host.now(),
            max_retry=min(MAX_RETRY, self.settings.call_timeout),
        )
        self.engine.invalid(registration.refused)
        self._apply(self.engine.load(registration.members))
        peering.name_of = self.engine.name_of
        self._task: asyncio.Task[None] | None = None
        #: the drain has begun (:meth:`settle`): a cancel the task group dropped (a child
        #: failing in the same turn) must not send the task back to etcd
        self._stopping = False
        self._events = 0  #: watch events applied
        #: the revision of the last full read the view was made from: the watch's events up
        #: to it are in the view already
        self._read_at = registration.revision
        #: the newest revision in the view (the read's, or a watch event's after it): a
        #: periodic read older than it would put back a state the watch moved on from
        self._newest = registration.revision

    def start(self) -> None:
        """Keep the lease and follow the registrations, until the drain."""
        self._task = self.host.spawn(self._run())

    async def _run(self) -> None:
        registration = self._registration
        while True:
            try:
                await self._follow(registration)
            except* Exception as failed:  # (from the keepalive's or the watch's task)
                self._unreachable(failed.exceptions[0])
            if self._stopping:  # (settle releases the registration)
                return
            await _close(registration.client)
            try:
                registration = await self._reconnect(registration)
            except SlotTaken as exc:
                self._lost_slot(exc)
                return
            except NameTaken as exc:
                self._lost_name(exc)
                return
            self._registration = registration

    def _lost_name(self, exc: NameTaken) -> None:
        """Registering again, another daemon holds this daemon's name: waiting on would never
        end (retried as etcd unreachable), so the daemon stops and exits as a configuration
        error (78), as it does when that is found at the start."""
        log.error("cannot register in etcd again: %s: stopping", exc)
        self.name_taken = True
        self.on_slot_lost()

    def _lost_slot(self, exc: SlotTaken) -> None:
        """This daemon's lease expired (a whole TTL without a keepalive) and another node
        took its slot: serving on as that id would make it mean two nodes, so the daemon
        stops (its links closed by the drain) and exits non-zero; restarted, it registers
        afresh in another slot."""
        log.error(
            "etcd gave this daemon's slot %d to another node while its lease was lost (%s): "
            "stopping; it registers afresh when restarted",
            self._registration.slot,
            exc,
        )
        self.slot_lost = True
        self.on_slot_lost()

    def _unreachable(self, exc: BaseException) -> None:
        why = _why(exc, self.settings.call_timeout)
        if self.engine.state is State.CONNECTED:
            log.warning("etcd unreachable (%s): keeping the last view", why)
        self.engine.on_unreachable(self.host.now(), why)

    async def _follow(self, registration: Registration) -> None:
        """Keep the lease alive and apply the watch's events, until a call fails."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._keep_alive(registration))
            tasks.create_task(self._watch(registration))
            tasks.create_task(self._resync(registration))

    async def _resync(self, registration: Registration) -> None:
        """Read the view whole every :data:`RESYNC_INTERVAL`: a watch that died silently
        (aetcd 1.0 never ends its iterator when the server ends the stream) would otherwise
        leave the view stale for good."""
        behind = 0  # reads in a row older than the watch's news, no event meanwhile
        while True:
            await asyncio.sleep(RESYNC_INTERVAL)
            events = self._events
            async with asyncio.timeout(self.settings.call_timeout):
                view = await _read_view(registration.client, self.settings)
            if view.revision < self._newest:  # (the watch applied newer events meanwhile)
                behind = behind + 1 if self._events == events else 0
                if behind >= STALE_READS:  # (etcd went back, a restore: the watch is dead)
                    raise WatchEnded(
                        f"etcd's reads stay at revision {view.revision}, behind the watch's "
                        f"{self._newest}"
                    )
                continue
            behind = 0
            if not view.registered:  # deleted (etcdctl del), the lease alive: register again
                raise LeaseLost("this daemon's registration is gone from etcd")
            self.engine.invalid(view.refused)
            self._load(view.members, view.revision)

    def _load(self, members: list[Member], revision: int) -> None:
        """Make the view a full read's, at ``revision``."""
        self._read_at = self._newest = revision
        self._apply(self.engine.load(members))

    async def _keep_alive(self, registration: Registration) -> None:
        """Refresh the lease every third of its TTL (at most :data:`MAX_KEEPALIVE`), the
        first time at once: the daemon was built between the registration and this start."""
        while True:
            async with asyncio.timeout(self.settings.call_timeout):
                reply = await registration.client.refresh_lease(registration.lease)
            if reply is None or reply.TTL <= 0:
                raise LeaseLost("this daemon's lease expired")
            await asyncio.sleep(min(self.settings.call_timeout, MAX_KEEPALIVE))

    async def _watch(self, registration: Registration) -> None:
        prefix = self.settings.key("nodes/")
        watch = await registration.client.watch_prefix(
            prefix, start_revision=registration.revision + 1
        )
        async for event in watch:
            name = event.kv.key[len(prefix) :].decode(errors="replace")
            self._events += 1
            if event.kv.mod_revision <= self._read_at:
                continue  # a full read brought it already
            if name == self.settings.name:  # this daemon's own registration
                if event.kind == aetcd.EventKind.DELETE:  # (etcdctl del, the lease alive)
                    raise LeaseLost("this daemon's registration was deleted from etcd")
                continue
            self._newest = max(self._newest, event.kv.mod_revision)
            if event.kind == aetcd.EventKind.DELETE:
                self._apply(self.engine.on_delete(name))
            elif (member := _decode(name, event.kv.value)) is not None:
                self._apply(self.engine.on_put(member))
            else:
                self.engine.invalid([(name, event.kv.value)])
        raise WatchEnded("etcd ended the watch")

    async def _reconnect(self, old: Registration) -> Registration:
        """Try etcd until it answers: the lease checked (registered again if it expired),
        the view read whole again."""
        endpoint = old.endpoint
        while True:
            await asyncio.sleep(self.engine.retry_in())
            endpoint += 1
            client = None
            try:
                client = await _connect(self.settings, endpoint)
                return await self._resume(client, old, endpoint)
            except BaseException as exc:  # (a cancel too: the client is no one else's)
                if client is not None:
                    await _close(client)
                if isinstance(exc, SlotTaken | NameTaken) or not isinstance(exc, Exception):
                    raise
                self._unreachable(exc)  # (any other: a daemon must not end for etcd's sake)

    async def _resume(self, client: aetcd.Client, old: Registration, endpoint: int) -> Registration:
        async with asyncio.timeout(self.settings.call_timeout):
            info = await client.get_lease_info(old.lease, keys=False)
        view = await _read_view(client, self.settings) if info.TTL > 0 else None
        if view is not None and view.registered:
            fresh = Registration(
                client=client,
                lease=old.lease,
                slot=old.slot,
                members=view.members,
                revision=view.revision,
                endpoint=endpoint,
                refused=view.refused,
                name=old.name,
                incarnation=old.incarnation,
            )
        else:  # (the lease expired, or the registration was deleted under it)
            log.warning("this daemon's etcd registration was lost: registering again")
            if view is not None:  # (its lease still holds the slot: let go of it first)
                async with asyncio.timeout(self.settings.call_timeout):
                    await client.revoke_lease(old.lease)
            fresh = await _claim(
                client, self.settings, endpoint, slot=old.slot, incarnation=old.incarnation
            )
            self.engine.on_registered()
        self.engine.on_connected(self.host.now())
        self.engine.invalid(fresh.refused)
        self._load(fresh.members, fresh.revision)
        log.info("etcd reachable again: %d other nodes registered", len(fresh.members))
        return fresh

    def _apply(self, changes: Iterable[AddressChanged]) -> None:
        for change in changes:
            if change.replaced:
                log.warning(
                    "node id %d now belongs to %r: closing the links of its last holder",
                    change.slot,
                    change.name,
                )
            # (first: only the holder is admitted, and another's links go, before it is dialled)
            holder = change.name if change.address else ""
            self.peering.set_holder(change.slot, holder, change.incarnation)
            if change.address:
                log.info("node %r (id %d) is at %s", change.name, change.slot, change.address)
            else:
                log.info("node %r (id %d) left etcd", change.name, change.slot)
            self.peering.set_address(change.slot, change.address)

    async def settle(self) -> None:
        """Leave etcd at once (the lease revoked), so the others need not wait for its TTL."""
        self._stopping = True
        if self._task is not None:  # (waited for, not awaited: its outcome is no news here)
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=SETTLE_TIMEOUT)
        await release(self._registration)

    def statistics(self) -> Meta:
        return {
            "membership": self.engine.describe(self.host.now()),
            "counters": {
                "etcd_events": self._events,
                "etcd_registrations": self.engine.registrations,
                "etcd_ignored_registrations": self.engine.ignored,
            },
        }
