"""The node roster from etcd: which node (by name) holds which slot, at which address.

Rules: this module decides everything about membership from etcd that is not I/O — which slot
a daemon claims, what a registration read from etcd means for the address table, and what the
daemon reports while etcd cannot be reached — and never touches etcd or a clock: the service
(:mod:`fabricd.daemon.services.roster`) reads and writes etcd, hands what it read here with
``now``, and performs the returned :class:`AddressChanged` actions on the peering service.

Theory of operation.  The fabric's node ids stay small integers (every engine indexes by
them), but in etcd mode they are *slots* in a fixed id space of ``max_nodes``, and a node's
identity is its name.  A daemon registers under a lease, in one transaction:
``<prefix>slots/<i>`` = name and ``<prefix>nodes/<name>`` = ``{"address", "slot", "inc"}``
(``inc``: the daemon's incarnation; both keys under the lease, so both go when it expires),
and ``<prefix>names/<name>`` = ``i`` (no lease: the slot it had, which it asks for again after
a restart).  :func:`choose_slot` picks the slot:

    remembered slot    held by            choice
    i                  nobody             i   (a restarted node keeps its id)
    any                this name holds    WAIT (its previous lease has not expired yet)
                       one (any slot)
    i or none          someone else/none  the lowest free slot no other name remembers,
                                          else the lowest free slot, or FULL

A slot another name remembers is the last taken: its node may be away only from etcd (a
partition longer than the TTL) and still linked to the others as that id.  Waiting rather
than taking a slot while the same name holds one keeps two daemons that were
given one name from holding two ids: the second registers once the first's lease is gone.  The
transaction that takes a slot also requires that the name holds no registration, so two such
daemons racing cannot both win.

The view (:class:`Roster`) is slot → member.  A full read (:meth:`Roster.load`, after every
(re)connection) and each watch event (:meth:`Roster.on_put`, :meth:`Roster.on_delete`) move it,
and every change of a slot's address comes out as :class:`AddressChanged`: an address to dial
and admit, or ``""`` (the slot is free: never dialled, its links refused on arrival, like a
node whose name does not resolve).  Links already up are not cut when a registration goes:
the peers engine's liveness rules decide them (a node killed is silent, suspect, then down).
Each change also says who holds the slot now (its name, and the incarnation the registration
carries): the peers engine admits links as that id from that node only, so a view that is
behind refuses the new holder for now rather than admitting it under the old holder's name
(:mod:`fabricd.engines.link.peers`, "Names"), and closes the links of another holder.  A slot
that another name registers in than the one that held it last comes out ``replaced`` (for the
log: a node that lost etcd for longer than the TTL may still be up and linked as that id).
A registration that claims this daemon's own slot, a slot outside ``0..max_nodes-1``, or a
slot another name holds in the view is ignored and counted (a foreign or corrupt key); so is
one whose value does not decode or whose address cannot be dialled (:func:`dialable`:
:meth:`Roster.invalid`).

Partition.  While etcd cannot be reached the view is kept as it was (the fabric runs on its
last view: no address is removed for a silence of etcd's), the state is ``unreachable`` since
the first failure, and the service retries after :meth:`Roster.retry_in` (doubling from
:data:`FIRST_RETRY` to ``max_retry``).  The first full read after it is back replaces the view,
and the differences come out as changes.  Every operation is O(1) but a full read, O(slots).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Mapping

    from fabricd.wire import Meta

#: the first pause before etcd is tried again after a failure
FIRST_RETRY: Final = 0.1
#: distinct ignored registrations remembered, so that one read again is not counted again
MAX_IGNORED_REMEMBERED: Final = 1024


class Claim(enum.Enum):
    """A slot choice that is not a slot."""

    WAIT = "wait"  #: this name's own earlier registration still holds its slot
    FULL = "full"  #: every slot is taken


def choose_slot(
    held: Mapping[int, str],
    name: str,
    remembered: int | None,
    max_nodes: int,
    others_remember: Collection[int] = (),
) -> int | Claim:
    """The slot ``name`` claims, given the slots ``held`` now (slot → name), the one it had
    (``remembered``, ``None`` if none) and the slots other names had (``others_remember``);
    the table is in the module docstring."""
    if name in held.values():  # whichever slot it holds: never a second one
        return Claim.WAIT
    if remembered is not None and 0 <= remembered < max_nodes and remembered not in held:
        return remembered
    free = [slot for slot in range(max_nodes) if slot not in held]
    if not free:
        return Claim.FULL
    others = set(others_remember)
    return next((slot for slot in free if slot not in others), free[0])


@dataclass(frozen=True, slots=True)
class Member:
    """One registration: a node's name, the address its peers dial, its slot (node id), and
    the incarnation of the daemon that registered (``None``: a registration without one)."""

    name: str
    address: str
    slot: int
    incarnation: int | None = None

    def encode(self) -> bytes:
        """The value of ``<prefix>nodes/<name>``."""
        fields: dict[str, str | int] = {"address": self.address, "slot": self.slot}
        if self.incarnation is not None:
            fields["inc"] = self.incarnation
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, name: str, value: bytes) -> Member | None:
        """The registration ``value`` says, or ``None`` if it is not one (a foreign key)."""
        try:
            fields = json.loads(value)
            address, slot, inc = fields["address"], fields["slot"], fields.get("inc")
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not isinstance(address, str) or not dialable(address) or type(slot) is not int:
            return None
        if inc is not None and type(inc) is not int:
            return None
        return cls(name=name, address=address, slot=slot, incarnation=inc)


def dialable(address: str) -> bool:
    """Whether ``address`` is a ``host:port`` a peer can dial: anything else written to etcd
    (by mistake or by someone with write access to the prefix) must never reach the peering
    service, which would fail on it; a wildcard (0.0.0.0, ::) is a listen address, not one
    to dial, and a name the resolver cannot encode (an empty label as in ``h..``, one over
    63 characters, a control character) is never found."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return False
    if any(c.isspace() or c in "/[]" for c in host):
        return False
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        pass
    return ":" not in host and resolvable(host)  # (":": an IPv6 address that does not parse)


def resolvable(host: str) -> bool:
    """Whether ``host`` (brackets allowed around an IPv6 address) is an IP address or a name
    the resolver can encode: not one with an empty label (``h..``), a label over 63
    characters, or a control character.  The config's addresses are checked with it too."""
    if not host.isprintable():
        return False
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        pass
    else:
        return True
    try:  # as the resolver will encode it
        host.encode("idna")
    except UnicodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class AddressChanged:
    """``slot``'s address is now ``address`` (``""``: nobody holds it), held by ``name``
    registered as ``incarnation`` (``None``: the registration does not say; free slots have
    none); ``replaced``: the slot was last held by another name."""

    slot: int
    name: str
    address: str
    replaced: bool = False
    incarnation: int | None = None


class State(enum.Enum):
    """How this daemon stands with etcd (``status``'s ``membership.state``)."""

    CONNECTED = "connected"
    UNREACHABLE = "unreachable"


class Roster:
    """The address table etcd's registrations make, and this daemon's standing with etcd.

    Args:
        name, slot: this daemon's name and the slot it registered with (its node id).
        max_nodes: the size of the id space.
        now: the time of the first registration (connected since then).
        max_retry: the longest pause between two tries to reach etcd.
    """

    def __init__(
        self, *, name: str, slot: int, max_nodes: int, now: float, max_retry: float = 2.0
    ) -> None:
        if not 0 <= slot < max_nodes:
            raise ValueError(f"slot {slot} is not in 0..{max_nodes - 1}")
        self.name, self.slot, self.max_nodes = name, slot, max_nodes
        self.state, self.since = State.CONNECTED, now
        self.error = ""  #: why etcd was last found unreachable
        self.max_retry = max_retry
        self._retry = FIRST_RETRY
        self._by_slot: dict[int, Member] = {}
        self._by_name: dict[str, Member] = {}
        self._last: dict[int, str] = {}  #: slot → the name that held it last (gone or not)
        #: registrations ignored (undecodable, own slot, out of range, slot taken), each once
        #: however often it is read again (every full read)
        self._ignored: set[Member | tuple[str, bytes]] = set()
        self._ignored_count = 0
        self.registrations = 1  #: times this daemon registered (more after a lease was lost)

    # -- queries ------------------------------------------------------------------------------
    def address(self, slot: int) -> str:
        """``slot``'s address in the view ("" when nobody holds it)."""
        member = self._by_slot.get(slot)
        return member.address if member is not None else ""

    def name_of(self, slot: int) -> str:
        """The name holding ``slot`` ("" when nobody does; this daemon's own for its slot)."""
        if slot == self.slot:
            return self.name
        member = self._by_slot.get(slot)
        return member.name if member is not None else ""

    def members(self) -> list[Member]:
        """The other nodes registered, by slot."""
        return [self._by_slot[slot] for slot in sorted(self._by_slot)]

    def describe(self, now: float) -> Meta:
        """``status``'s ``membership``: the source, the state and since when, the view."""
        described: Meta = {
            "source": "etcd",
            "state": self.state.value,
            "since": round(now - self.since, 3),
            "name": self.name,
            "slot": self.slot,
            "max_nodes": self.max_nodes,
            "registered": {m.name: m.slot for m in self.members()},
        }
        if self.state is State.UNREACHABLE:
            described["error"] = self.error
        return described

    # -- the view -----------------------------------------------------------------------------
    def load(self, members: Iterable[Member]) -> list[AddressChanged]:
        """A full read of the registrations (after every (re)connection): the view becomes
        it, and every slot whose address differs comes out changed."""
        before = dict(self._by_slot)
        self._by_slot.clear()
        self._by_name.clear()
        replaced = {m.slot for m in members if self._add(m) and self._took_over(m)}
        changed = []
        for slot in sorted(before.keys() | self._by_slot.keys()):
            old, new = before.get(slot), self._by_slot.get(slot)
            if old != new:
                name = new.name if new is not None else old.name if old is not None else ""
                address, inc = (new.address, new.incarnation) if new else ("", None)
                changed.append(AddressChanged(slot, name, address, incarnation=inc))
        return [dataclasses.replace(c, replaced=True) if c.slot in replaced else c for c in changed]

    def on_put(self, member: Member) -> list[AddressChanged]:
        """A registration was written (a node joined, or registered again)."""
        old = self._by_name.get(member.name)
        changes = self.on_delete(member.name) if old is not None and old != member else []
        if old == member or not self._add(member):
            return changes
        changes = [c for c in changes if c.slot != member.slot]  # moved within one slot
        replaced = self._took_over(member)
        change = AddressChanged(
            member.slot, member.name, member.address, replaced, member.incarnation
        )
        return [*changes, change]

    def on_delete(self, name: str) -> list[AddressChanged]:
        """A registration went (its node left, or its lease expired)."""
        member = self._by_name.pop(name, None)
        if member is None:
            return []
        del self._by_slot[member.slot]
        return [AddressChanged(member.slot, name, "")]

    @property
    def ignored(self) -> int:
        """How many registrations were ignored, each counted once (of the first
        :data:`MAX_IGNORED_REMEMBERED` distinct ones; later ones may count again)."""
        return self._ignored_count

    def invalid(self, keys: Iterable[tuple[str, bytes]]) -> None:
        """Registrations were read that are not ones (:meth:`Member.decode` refused them):
        their names and values (one read again is not counted again)."""
        for key in keys:
            self._ignore(key)

    def _ignore(self, key: Member | tuple[str, bytes]) -> None:
        if key in self._ignored:
            return
        self._ignored_count += 1
        if len(self._ignored) < MAX_IGNORED_REMEMBERED:  # (bounded: values may keep changing)
            self._ignored.add(key)

    def _took_over(self, member: Member) -> bool:
        """Whether ``member`` (just added) holds a slot another name held last."""
        last, self._last[member.slot] = self._last.get(member.slot), member.name
        return last is not None and last != member.name

    def _add(self, member: Member) -> bool:
        slot = member.slot
        if slot == self.slot or not 0 <= slot < self.max_nodes or slot in self._by_slot:
            self._ignore(member)
            return False
        self._by_slot[slot] = self._by_name[member.name] = member
        return True

    # -- etcd's reachability ------------------------------------------------------------------
    def on_connected(self, now: float) -> None:
        """etcd answered again (a full read follows: :meth:`load`)."""
        if self.state is not State.CONNECTED:
            self.state, self.since, self.error = State.CONNECTED, now, ""
        self._retry = FIRST_RETRY

    def on_unreachable(self, now: float, error: str) -> None:
        """A call to etcd failed: the view is kept; the state says since when."""
        if self.state is not State.UNREACHABLE:
            self.state, self.since = State.UNREACHABLE, now
        self.error = error

    def on_registered(self) -> None:
        """This daemon registered again (its lease had expired: a long partition)."""
        self.registrations += 1

    def retry_in(self) -> float:
        """How long to wait before trying etcd again (doubling up to ``max_retry``)."""
        wait, self._retry = self._retry, min(self._retry * 2, self.max_retry)
        return min(wait, self.max_retry)
