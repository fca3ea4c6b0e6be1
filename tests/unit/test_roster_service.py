"""The config a daemon runs with once registered in etcd (fabricd/daemon/services/roster.py,
``registered``): its id the slot, ``nodes`` the addresses read, as the roster engine takes
them, so the engine's first view changes nothing the peering service was built with."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
import pytest

from fabricd.daemon import main
from fabricd.daemon.config import load
from fabricd.daemon.services import roster
from fabricd.daemon.services.roster import Registration, RosterService, registered
from fabricd.engines.roster import Member, Roster, State
from fabricd.errors import ConfigError, TransportError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

FLAGS = {"membership": "etcd", "listen": "10.0.0.1:7700", "secret_env": "S", "max_nodes": 4}


async def _serve_until(service: RosterService, done: Callable[[], bool]) -> None:
    """Start ``service``, wait until ``done()`` holds (a hang guard: 30 s), and settle it."""
    service.start()
    for _ in range(3000):
        if done():
            break
        await asyncio.sleep(0.01)
    await service.settle()


def test_the_registered_config_has_the_slot_as_id_and_every_address_by_slot() -> None:
    loaded = load(environ={}, flags=FLAGS)
    members = [
        Member("b", "10.0.0.2:7700", 0),
        Member("c", "10.0.0.3:7700", 0),  # a second claim of slot 0: the first one holds it
        Member("d", "10.0.0.4:7700", 2),  # this daemon's own slot: ignored
        Member("e", "10.0.0.5:7700", 9),  # outside max_nodes: ignored
    ]
    registration = Registration(
        client=None, lease=1, slot=2, members=members, revision=5, endpoint=0
    )
    run = registered(loaded, registration)
    assert run.config.node_id == 2
    assert run.config.nodes == ("10.0.0.2:7700", "", "10.0.0.1:7700", "")
    assert (run.sources["node_id"], run.sources["nodes"]) == ("etcd", "etcd")
    engine = Roster(name="a", slot=2, max_nodes=4, now=0.0)
    changes = engine.load(members)
    assert {c.slot: c.address for c in changes} == {
        n: a for n, a in enumerate(run.config.nodes) if a and n != 2
    }


class _Peering:
    """The peering service as the roster service sees it: holders and addresses set, names
    asked."""

    def __init__(self) -> None:
        self.addresses: dict[int, str] = {}
        self.calls: list[str] = []
        self.name_of: Callable[[int], str] | None = None

    def set_address(self, node: int, address: str) -> None:
        self.addresses[node] = address
        self.calls.append(f"address {node} {address}")

    def set_holder(self, node: int, name: str, incarnation: int | None) -> None:
        self.calls.append(f"holder {node} {name!r} {incarnation}")


class _Host:
    def __init__(self) -> None:
        self.config = load(environ={}, flags=FLAGS).config

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return asyncio.ensure_future(coro)


class _DownClient:
    """etcd down: every call fails; closing takes a while (a channel being torn down)."""

    def __init__(self) -> None:
        self.closing = asyncio.Event()
        self.revoked = False  #: the drain tried to revoke the lease

    async def close(self) -> None:
        self.closing.set()
        await asyncio.sleep(0.5)

    async def get_lease_info(self, *_: object, **__: object) -> None:
        raise aetcd.ClientError("down")

    async def revoke_lease(self, *_: object) -> None:
        self.revoked = True
        raise aetcd.ClientError("down")


def _service(client: object) -> RosterService:
    registration = Registration(client=client, lease=1, slot=0, members=[], revision=1, endpoint=0)
    return RosterService(_Host(), _Peering(), registration)  # type: ignore[arg-type]


def test_the_drain_ends_the_roster_task_even_while_it_closes_a_client(monkeypatch) -> None:
    """A cancellation that lands inside the client's close must end the task, not send it
    back to etcd: the drain would wait for it forever."""
    client = _DownClient()

    async def connect(settings: object, endpoint: int) -> _DownClient:
        return client

    monkeypatch.setattr(roster, "_connect", connect)

    async def scenario() -> bool:
        service = _service(client)

        async def follow(registration: Registration) -> None:
            raise aetcd.ClientError("boom")

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await client.closing.wait()  # the task is inside _close now
        settle = asyncio.ensure_future(service.settle())
        await asyncio.wait({settle}, timeout=30)  # a hang guard
        assert service._task is not None
        return settle.done() and service._task.done() and client.revoked

    assert asyncio.run(scenario())


def test_an_unexpected_error_makes_etcd_unreachable_not_the_daemon_exit(monkeypatch) -> None:
    """grpc's UsageError (no RpcError) from a call, and a password file that cannot be read
    again while reconnecting: each is etcd unreachable, retried, and said in ``status``."""
    tries = 0
    tried_twice = asyncio.Event()

    async def connect(settings: object, endpoint: int) -> _DownClient:
        nonlocal tries
        tries += 1
        if tries >= 2:
            tried_twice.set()
        raise ConfigError("etcd_password_file p: No such file or directory")

    monkeypatch.setattr(roster, "_connect", connect)

    async def scenario() -> tuple[bool, State, str]:
        service = _service(_DownClient())

        async def follow(registration: Registration) -> None:
            raise grpc.aio.UsageError("channel closed")

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await asyncio.wait_for(tried_twice.wait(), timeout=30)  # a hang guard
        assert service._task is not None
        running = not service._task.done()
        await service.settle()
        return running, service.engine.state, service.engine.error

    running, state, error = asyncio.run(scenario())
    assert running
    assert state is State.UNREACHABLE
    assert error.startswith("ConfigError: etcd_password_file")


def test_a_connection_that_fails_is_closed(monkeypatch) -> None:
    """With a password the channel is open before the authentication fails: left open, an
    outage would leak one channel per retry."""
    made: list[_FailingClient] = []

    class _FailingClient:
        def __init__(self, settings: object, endpoint: str) -> None:
            self.closed = False
            made.append(self)

        async def connect(self) -> None:
            raise aetcd.ClientError("authentication failed")

        async def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(roster, "_Client", _FailingClient)
    settings = roster.EtcdSettings.from_config(load(environ={}, flags=FLAGS).config)
    for endpoint in range(3):
        with pytest.raises(aetcd.ClientError):
            asyncio.run(roster._connect(settings, endpoint))
    assert [client.closed for client in made] == [True, True, True]


def test_a_daemon_that_fails_before_serving_leaves_etcd_at_once(monkeypatch) -> None:
    """Its registration would otherwise hold the slot (and the name) for a whole TTL."""
    client = _DownClient()
    registration = Registration(client=client, lease=1, slot=0, members=[], revision=1, endpoint=0)

    async def register(cfg: object) -> Registration:
        return registration

    def cannot_bind(*_: object, **__: object) -> None:
        raise TransportError("cannot bind 10.0.0.1:7700")

    monkeypatch.setattr(roster, "register", register)
    monkeypatch.setattr(main, "Daemon", cannot_bind)
    monkeypatch.setattr(main.logs, "setup", lambda *_: None)
    with pytest.raises(TransportError):
        asyncio.run(main.serve(load(environ={}, flags=FLAGS)))
    assert client.revoked
    assert client.closing.is_set()


def test_a_daemon_that_crashes_leaves_etcd_with_its_current_registration(monkeypatch) -> None:
    """Registered again after a lost lease, the roster service holds another lease and client
    than the startup's: those are released, not the startup's long-gone lease."""
    startup = _DownClient()
    registration = Registration(client=startup, lease=1, slot=0, members=[], revision=1, endpoint=0)
    settled: list[bool] = []

    class _Roster:
        async def settle(self) -> None:
            settled.append(True)

    class _Crashing:
        def __init__(self, *_: object, **__: object) -> None:
            self.roster = _Roster()

        def stop(self) -> None: ...

        def reload_secrets(self) -> None: ...

        async def run(self) -> None:
            raise RuntimeError("a bug")

    async def register(cfg: object) -> Registration:
        return registration

    monkeypatch.setattr(roster, "register", register)
    monkeypatch.setattr(main, "Daemon", _Crashing)
    monkeypatch.setattr(main.logs, "setup", lambda *_: None)
    with pytest.raises(RuntimeError):
        asyncio.run(main.serve(load(environ={}, flags=FLAGS)))
    assert settled == [True]
    assert not startup.revoked


class _KV:
    def __init__(self, key: bytes, value: bytes, mod_revision: int = 0) -> None:
        self.key, self.value, self.mod_revision = key, value, mod_revision


class _Found(list[_KV]):
    header = type("Header", (), {"revision": 7})


class _Etcd:
    """Just what a registration calls, recorded: ``slots/3`` is held by this daemon's
    earlier run for the first ``held_for`` reads."""

    def __init__(self, held_for: int, holder: bytes = b"a") -> None:
        self.calls: list[str] = []
        self.holder = holder
        self.nodes: list[_KV] = []  #: the registrations under nodes/
        self.names = [_KV(b"/fabricd/names/a", b"3")]  #: the slots names remember
        self.held_for = held_for
        self.transactions = aetcd.Client().transactions
        self.refreshed = 0

    async def get_prefix(self, key: bytes) -> _Found:
        self.calls.append("read " + key.decode().rsplit("/", 2)[-2])
        if key.endswith(b"slots/") and self.held_for > 0:
            self.held_for -= 1
            return _Found([_KV(b"/fabricd/slots/3", self.holder)])
        if key.endswith(b"names/"):
            return _Found(self.names)
        if key.endswith(b"nodes/"):
            return _Found(self.nodes)
        return _Found()

    async def get(self, key: bytes) -> _KV:
        return _KV(key, Member(self.holder.decode(), "10.0.0.9:7700", 3).encode())

    async def get_lease_info(self, lease: int, keys: bool) -> object:
        return type("Info", (), {"TTL": -1})

    async def lease(self, ttl: int) -> object:
        self.calls.append("lease")
        return type("Lease", (), {"id": 9})

    async def transaction(self, compare: object, success: object, failure: object) -> tuple:
        self.calls.append("take")
        return True, None

    async def refresh_lease(self, lease: int) -> object:
        self.refreshed += 1
        return type("Reply", (), {"TTL": 10})

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> Any:
        await asyncio.Event().wait()  # no events: wait for the drain

    async def revoke_lease(self, lease: int) -> None:
        self.calls.append(f"revoke {lease}")

    async def close(self) -> None:
        self.calls.append("close")


def test_the_lease_is_granted_after_waiting_for_an_earlier_run_and_refreshed_at_start() -> None:
    """Granted before the wait, the lease aged through it and could expire right after the
    start, losing the registration of a daemon that just started."""
    etcd = _Etcd(held_for=2)
    settings = roster.EtcdSettings.from_config(load(environ={}, flags=FLAGS).config)
    settings = dataclasses.replace(settings, name="a")

    async def scenario() -> int:
        registration = await roster._claim(etcd, settings, 0, slot=None, incarnation=5)  # type: ignore[arg-type]
        assert (registration.slot, registration.incarnation) == (3, 5)
        service = RosterService(_Host(), _Peering(), registration)  # type: ignore[arg-type]
        service.start()
        for _ in range(5):  # a few turns of the loop, no time: the first refresh is at once
            await asyncio.sleep(0)
        refreshed = etcd.refreshed
        await service.settle()
        return refreshed

    assert asyncio.run(scenario()) >= 1
    assert etcd.calls.index("lease") > max(i for i, c in enumerate(etcd.calls) if c == "read slots")


def test_a_daemon_whose_slot_went_to_another_node_stops_serving_as_it(monkeypatch) -> None:
    """Its lease expired while etcd was unreachable and node "d" took slot 3: it stops (the
    drain closes its links) and exits non-zero, to register afresh, never serving on as id 3."""
    etcd = _Etcd(held_for=1_000, holder=b"d")

    async def connect(settings: object, endpoint: int) -> _Etcd:
        return etcd

    monkeypatch.setattr(roster, "_connect", connect)
    stopped = asyncio.Event()

    async def scenario() -> RosterService:
        registration = Registration(
            client=etcd, lease=1, slot=3, members=[], revision=1, endpoint=0
        )
        service = RosterService(
            _Host(),
            _Peering(),
            registration,
            on_slot_lost=stopped.set,  # type: ignore[arg-type]
        )

        async def follow(registration: Registration) -> None:
            raise roster.LeaseLost("this daemon's lease expired")

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await asyncio.wait_for(stopped.wait(), timeout=30)  # a hang guard
        assert service._task is not None
        await asyncio.wait({service._task}, timeout=30)
        assert service._task.done()
        await service.settle()
        return service

    assert asyncio.run(scenario()).slot_lost
    assert "lease" not in etcd.calls  # never registered again in another slot by itself


def _lose_the_lease(etcd: _Etcd, monkeypatch: pytest.MonkeyPatch, ttl: int = 10) -> RosterService:
    """Run a roster service for "a" in slot 3 (lease ``ttl``) whose lease is lost at once,
    until it stops or registers again (a hang guard: 30 s)."""
    monkeypatch.setattr(roster, "_connect", lambda settings, endpoint: _ready(etcd))
    stopped = asyncio.Event()

    async def scenario() -> RosterService:
        registration = Registration(
            client=etcd, lease=1, slot=3, members=[], revision=1, endpoint=0
        )
        host = _Host()
        host.config = dataclasses.replace(host.config, node_name="a", etcd_lease_ttl=ttl)
        service = RosterService(
            host,  # type: ignore[arg-type]
            _Peering(),  # type: ignore[arg-type]
            registration,
            on_slot_lost=stopped.set,
        )
        lost = [roster.LeaseLost("this daemon's lease expired")]

        async def follow(registration: Registration) -> None:
            if lost:
                raise lost.pop()
            stopped.set()  # registered again: following the new registration

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await asyncio.wait_for(stopped.wait(), timeout=30)
        await service.settle()
        return service

    return asyncio.run(scenario())


async def _ready(client: _Etcd) -> _Etcd:
    return client


def test_a_slot_another_name_held_while_the_lease_was_lost_is_not_taken_back(
    monkeypatch,
) -> None:
    """Node b took slot 3 while a was away from etcd and left again: the peers retired a's
    incarnation when b took over, so a registering again as the same incarnation would be
    refused by all of them for good: it stops (exit 75) and comes back as a new one."""
    etcd = _Etcd(held_for=0)  # the slot is free again
    etcd.names = [_KV(b"/fabricd/names/a", b"3", 5), _KV(b"/fabricd/names/b", b"3", 9)]
    service = _lose_the_lease(etcd, monkeypatch)
    assert service.slot_lost
    assert "lease" not in etcd.calls


def test_a_slot_nobody_held_since_is_registered_in_again(monkeypatch) -> None:
    """Another name remembering the slot from before this name's registration (an earlier
    holder) is no reason to stop: the lease lost, the slot is taken back."""
    etcd = _Etcd(held_for=0)
    etcd.names = [_KV(b"/fabricd/names/a", b"3", 5), _KV(b"/fabricd/names/b", b"3", 2)]
    service = _lose_the_lease(etcd, monkeypatch)
    assert not service.slot_lost
    assert [c for c in etcd.calls if c in ("lease", "take")] == ["lease", "take"]
    assert service.engine.registrations == 2


def test_a_slot_with_a_new_name_names_its_holder_before_its_address_is_set() -> None:
    """The holder (and its registered incarnation) is set first, so the old holder's links go
    and only the new one is admitted; then the new holder is dialled."""
    peering = _Peering()

    async def scenario() -> None:
        registration = Registration(
            client=None, lease=1, slot=0, members=[], revision=1, endpoint=0
        )
        service = RosterService(_Host(), peering, registration)  # type: ignore[arg-type]
        service._apply(service.engine.on_put(Member("a", "h:1", 2, incarnation=500)))
        service._apply(service.engine.on_delete("a"))
        service._apply(service.engine.on_put(Member("d", "h:4", 2, incarnation=100)))

    asyncio.run(scenario())
    assert peering.calls == [
        "holder 2 'a' 500",
        "address 2 h:1",
        "holder 2 '' None",
        "address 2 ",
        "holder 2 'd' 100",
        "address 2 h:4",
    ]


def test_a_name_another_daemon_holds_is_given_up_after_two_ttls() -> None:
    """Two daemons given one name: the second says where the first is, and does not start."""
    etcd = _Etcd(held_for=1_000_000)
    settings = roster.EtcdSettings.from_config(load(environ={}, flags=FLAGS).config)
    settings = dataclasses.replace(settings, name="a", ttl=1)
    with pytest.raises(ConfigError, match=r"'a' is still registered .* at 10\.0\.0\.9:7700"):
        asyncio.run(roster._claim(etcd, settings, 0, slot=None, incarnation=5))  # type: ignore[arg-type]
    assert "lease" not in etcd.calls


def test_the_view_is_read_whole_again_while_the_watch_says_nothing(monkeypatch) -> None:
    """aetcd's watch can die without ending: a periodic full read still brings news."""
    monkeypatch.setattr(roster, "RESYNC_INTERVAL", 0.01)
    etcd = _Etcd(held_for=0)
    own = roster.EtcdSettings.from_config(_Host().config).key("nodes", socket.gethostname())
    etcd.nodes = [
        _KV(b"/fabricd/nodes/b", Member("b", "10.0.0.2:7700", 1).encode()),
        _KV(own, Member("me", "10.0.0.1:7700", 0).encode()),  # (this daemon's own)
    ]
    peering = _Peering()

    async def scenario() -> None:
        registration = Registration(
            client=etcd, lease=1, slot=0, members=[], revision=1, endpoint=0
        )
        service = RosterService(_Host(), peering, registration)  # type: ignore[arg-type]
        await _serve_until(service, lambda: peering.calls)

    asyncio.run(scenario())
    assert peering.calls[:2] == ["holder 1 'b' None", "address 1 10.0.0.2:7700"]


class _Event:
    def __init__(self, kind: aetcd.EventKind, kv: _KV) -> None:
        self.kind, self.kv = kind, kv


class _Watched(_Etcd):
    """etcd whose watch brings "a" leaving and "b" taking slot 3 (revisions 8 and 9), while
    every full read answers from revision 7, before them (a slow or lagging member)."""

    def __init__(self) -> None:
        super().__init__(held_for=0)
        self.nodes = [_KV(b"/fabricd/nodes/a", Member("a", "10.0.0.5:7700", 3).encode(), 3)]
        self.reads = 0

    async def get_prefix(self, key: bytes) -> _Found:
        self.reads += key.endswith(b"nodes/")
        return await super().get_prefix(key)

    def registration(self) -> Registration:
        """This daemon's, read at revision 7: "a" in slot 3."""
        members = [Member("a", "10.0.0.5:7700", 3)]
        return Registration(client=self, lease=1, slot=0, members=members, revision=7, endpoint=0)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> Any:
        async def events() -> Any:
            b = Member("b", "10.0.0.6:7700", 3).encode()
            yield _Event(aetcd.EventKind.DELETE, _KV(b"/fabricd/nodes/a", b"", 8))
            yield _Event(aetcd.EventKind.PUT, _KV(b"/fabricd/nodes/b", b, 9))
            yield _Event(aetcd.EventKind.PUT, _KV(b"/fabricd/nodes/a", b"x", 6))  # read before
            await asyncio.Event().wait()

        return events()


def test_a_full_read_older_than_the_watchs_events_is_dropped(monkeypatch) -> None:
    """Applied, it would put "a" back in slot 3 after the watch gave it to "b": two spurious
    replacements, the second closing b's links."""
    monkeypatch.setattr(roster, "RESYNC_INTERVAL", 0.01)
    etcd = _Watched()
    peering = _Peering()

    async def scenario() -> RosterService:
        registration = etcd.registration()
        service = RosterService(_Host(), peering, registration)  # type: ignore[arg-type]
        await _serve_until(service, lambda: etcd.reads >= 3)
        return service

    service = asyncio.run(scenario())
    assert etcd.reads >= 3
    assert peering.calls == [
        "holder 3 'a' None",
        "address 3 10.0.0.5:7700",
        "holder 3 '' None",
        "address 3 ",
        "holder 3 'b' None",
        "address 3 10.0.0.6:7700",
    ]
    assert service.engine.ignored == 0  # the stale event was skipped, not refused


def test_a_cancel_the_task_group_drops_still_ends_the_roster_task(monkeypatch) -> None:
    """A child of the follow failing in the same turn as the drain's cancel: the task group
    raises the child's error and drops the cancel (Python 3.11); the task must not go back to
    etcd, or the drain waits for it in vain and the task outlives the daemon."""
    tries: list[int] = []

    async def connect(settings: object, endpoint: int) -> _DownClient:
        tries.append(endpoint)
        raise aetcd.ClientError("down")

    monkeypatch.setattr(roster, "_connect", connect)
    following = asyncio.Event()

    async def scenario() -> bool:
        service = _service(_DownClient())

        async def follow(registration: Registration) -> None:
            following.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # as the group does: the child's error instead
                raise OSError("the watch failed in the same turn") from None

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await asyncio.wait_for(following.wait(), timeout=30)  # a hang guard
        await service.settle()
        assert service._task is not None
        return service._task.done()

    assert asyncio.run(scenario())
    assert tries == []


def test_a_cancel_while_registering_again_revokes_the_new_lease_and_closes_the_client(
    monkeypatch,
) -> None:
    """The drain's cancel landing after the lease was granted: left alone, the lease would
    hold the slot for a TTL and the client stay open."""
    taking = asyncio.Event()

    class _Hanging(_Etcd):
        async def transaction(self, compare: object, success: object, failure: object) -> tuple:
            taking.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    etcd = _Hanging(held_for=0)
    monkeypatch.setattr(roster, "_connect", lambda settings, endpoint: _ready(etcd))

    async def scenario() -> None:
        registration = Registration(
            client=_DownClient(), lease=1, slot=3, members=[], revision=1, endpoint=0
        )
        service = RosterService(_Host(), _Peering(), registration)  # type: ignore[arg-type]

        async def follow(registration: Registration) -> None:
            raise roster.LeaseLost("this daemon's lease expired")

        service._follow = follow  # type: ignore[method-assign]
        service.start()
        await asyncio.wait_for(taking.wait(), timeout=30)  # a hang guard
        await service.settle()

    asyncio.run(scenario())
    assert etcd.calls[-2:] == ["revoke 9", "close"]


def test_a_name_another_daemon_holds_when_registering_again_stops_the_daemon(monkeypatch) -> None:
    """Not etcd unreachable, retried for ever: the daemon stops and exits 78, as at start."""
    etcd = _Etcd(held_for=1_000_000)  # "a" holds slot 3 for good: another daemon named "a"
    service = _lose_the_lease(etcd, monkeypatch, ttl=1)
    assert service.name_taken
    assert not service.slot_lost
    assert "lease" not in etcd.calls


class _Deleted(_Etcd):
    """etcd where this daemon's registration ("a", slot 3) is deleted under its live lease
    (etcdctl del) at revision 8; from then on a full read finds it registered again."""

    def __init__(self) -> None:
        super().__init__(held_for=0)
        self.registered = False

    async def get_lease_info(self, lease: int, keys: bool) -> object:
        return type("Info", (), {"TTL": 5})  # alive

    async def transaction(self, compare: object, success: object, failure: object) -> tuple:
        self.registered = True
        return await super().transaction(compare, success, failure)

    async def get_prefix(self, key: bytes) -> _Found:
        if key.endswith(b"nodes/") and self.registered:
            return _Found([_KV(key + b"a", Member("a", "10.0.0.1:7700", 3).encode())])
        return await super().get_prefix(key)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> Any:
        async def events() -> Any:
            if not self.registered:
                yield _Event(aetcd.EventKind.DELETE, _KV(prefix + b"a", b"", 8))
            await asyncio.Event().wait()

        return events()


def test_a_registration_deleted_under_a_live_lease_is_made_again(monkeypatch) -> None:
    """Otherwise the others never see this node again until it restarts: its lease lives, so
    nothing else would ever put the registration back."""
    etcd = _Deleted()
    monkeypatch.setattr(roster, "_connect", lambda settings, endpoint: _ready(etcd))

    async def scenario() -> RosterService:
        registration = Registration(
            client=etcd, lease=1, slot=3, members=[], revision=7, endpoint=0
        )
        host = _Host()
        host.config = dataclasses.replace(host.config, node_name="a")
        service = RosterService(host, _Peering(), registration)  # type: ignore[arg-type]
        await _serve_until(service, lambda: service.engine.registrations == 2)
        return service

    service = asyncio.run(scenario())
    assert service.engine.registrations == 2
    assert etcd.calls.index("revoke 1") < etcd.calls.index("lease")  # the slot let go first
    assert "take" in etcd.calls


def test_reads_that_stay_behind_the_watch_make_the_daemon_reconnect(monkeypatch) -> None:
    """etcd restored from a snapshot goes back in revisions, and its watch dies silently: if
    every periodic read, with no watch event meanwhile, stays older than what the watch applied,
    the daemon takes etcd as unreachable and reconnects, rather than drop every read for good."""
    monkeypatch.setattr(roster, "RESYNC_INTERVAL", 0.01)
    etcd = _Watched()
    never = asyncio.Event()

    async def connect(settings: object, endpoint: int) -> object:
        await never.wait()  # (the reconnect waits: the test looks at the state meanwhile)

    monkeypatch.setattr(roster, "_connect", connect)

    async def scenario() -> RosterService:
        registration = etcd.registration()
        service = RosterService(_Host(), _Peering(), registration)  # type: ignore[arg-type]
        await _serve_until(service, lambda: service.engine.state is State.UNREACHABLE)
        return service

    service = asyncio.run(scenario())
    assert etcd.reads >= roster.STALE_READS
    assert service.engine.state is State.UNREACHABLE
    assert "behind the watch" in service.engine.error
