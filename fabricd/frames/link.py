"""The frames of a peer link itself: the handshake (HELLO, AUTH), liveness and leaving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from fabricd.errors import RemoteProtocolError
from fabricd.frames.fields import get_bool
from fabricd.wire import PROTOCOL_VERSION, Kind, Meta, get_bytes, get_int, get_str

#: the size of a handshake nonce: fresh random bytes, one from each side
NONCE_SIZE: Final = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Liveness on the control channel; carries nothing."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Heartbeat:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """The sender is draining and will close its links."""

    KIND: ClassVar[Kind] = Kind.BYE

    def to_meta(self) -> Meta:
        return {}

    @classmethod
    def from_meta(cls, meta: Meta) -> Bye:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first handshake frame each way: who the sender is, and its nonce.

    The initiator names the ``channel`` it opens; the acceptor answers with ``mac``, its proof of
    the shared secret (:mod:`fabricd.engines.link.handshake` computes and checks it), and
    ``older_mac``, the same proof under its older secret, while it holds two (a rotation).
    ``node`` is only known to be a node id here: whether it lies in this fabric is the
    handshake's to check.  ``name`` is the sender's node name (``""`` when it has none, as a
    node of a static list may): under membership from etcd a node id is a slot that several
    names hold in turn, and the receiver admits only the name its view of etcd has for that
    slot (:mod:`fabricd.engines.link.peers`, "Names").
    """

    KIND: ClassVar[Kind] = Kind.HELLO
    version: int = PROTOCOL_VERSION
    node: int
    incarnation: int
    nonce: bytes
    name: str = ""
    channel: str | None = None
    mac: bytes | None = None
    older_mac: bytes | None = None
    #: whether the sender seals DATA payloads (``data_integrity = "mac"``): both ends must agree
    sealed_data: bool = False

    def to_meta(self) -> Meta:
        meta: Meta = {
            "v": self.version,
            "node": self.node,
            "inc": self.incarnation,
            "nonce": self.nonce,
            "sealed_data": self.sealed_data,
            "name": self.name,
        }
        if self.channel is not None:
            meta["channel"] = self.channel
        if self.mac is not None:
            meta["mac"] = self.mac
        if self.older_mac is not None:
            meta["older_mac"] = self.older_mac
        return meta

    @classmethod
    def from_meta(cls, meta: Meta) -> Hello:
        # the version first: a peer of another release may lay out its other fields otherwise,
        # and its operator should read that the releases differ, not which field is wrong
        version = get_int(meta, "v")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"peer speaks protocol {version}, this daemon {PROTOCOL_VERSION}; "
                "run the same fabricd release on every node"
            )
        node = get_int(meta, "node")
        incarnation = get_int(meta, "inc")
        nonce = get_bytes(meta, "nonce")
        if len(nonce) != NONCE_SIZE:
            raise RemoteProtocolError(
                f"handshake nonce has the wrong size ({len(nonce)} B, not {NONCE_SIZE} B)"
            )
        name = meta.get("name")
        if not isinstance(name, str):
            raise RemoteProtocolError("field 'name' must be a string")
        return cls(
            version=version,
            node=node,
            incarnation=incarnation,
            nonce=nonce,
            name=name,
            channel=get_str(meta, "channel") if "channel" in meta else None,
            mac=get_bytes(meta, "mac") if "mac" in meta else None,
            older_mac=get_bytes(meta, "older_mac") if "older_mac" in meta else None,
            sealed_data=get_bool(meta, "sealed_data"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    """The initiator's proof of the shared secret, the handshake's third and last frame."""

    KIND: ClassVar[Kind] = Kind.AUTH
    mac: bytes

    def to_meta(self) -> Meta:
        return {"mac": self.mac}

    @classmethod
    def from_meta(cls, meta: Meta) -> Auth:
        return cls(mac=get_bytes(meta, "mac"))


#: every frame of the handshake, the only frames a link may carry before it is authenticated
HandshakeFrame = Hello | Auth

_HANDSHAKE_BY_KIND: Final[dict[Kind, type[HandshakeFrame]]] = {Hello.KIND: Hello, Auth.KIND: Auth}
#: the kinds :func:`parse_handshake` reads
HANDSHAKE_KINDS: Final = frozenset(_HANDSHAKE_BY_KIND)


def parse_handshake(kind: Kind, meta: Meta) -> HandshakeFrame:
    """The typed view of a handshake frame's metadata.

    Raises:
        RemoteProtocolError: not a handshake frame kind, the peer speaks another protocol
            version, or a field is missing or out of range; close the link that sent it.
    """
    view = _HANDSHAKE_BY_KIND.get(kind)
    if view is None:
        raise RemoteProtocolError(f"{kind.name} is not a handshake frame")
    return view.from_meta(meta)
