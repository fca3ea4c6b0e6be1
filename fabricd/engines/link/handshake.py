"""Peer authentication: HMAC challenge-response with nonces from both sides.

Rules: this module decides whether a new connection speaks for a node of this fabric; it sends
nothing itself and reads no clock.  The daemon feeds it the first frames of a link (under tight
decoder limits, so an unauthenticated peer can make us hold at most a few KiB), parsed into
:class:`~fabricd.frames.link.Hello` and :class:`~fabricd.frames.link.Auth` views by
:func:`~fabricd.frames.link.parse_handshake`, which also refuses a peer of another protocol
version and a nonce of the wrong size; it sends what this module answers back on that link and
enforces the time limit.

Theory of operation (three frames; K is the shared secret, T the transcript)::

    initiator                                            acceptor
      HELLO {v, node, inc, name, nonce=Ni,
             channel}                          ─────►
                                               ◄─────  HELLO {v, node, inc, name, nonce=Na,
                                                              mac=HMAC(K, "acceptor" ‖ T)}
      AUTH {mac=HMAC(K, "initiator" ‖ T)}     ─────►

    T = msgpack([Ni, Na, initiator node, initiator inc, initiator name,
                 acceptor node, acceptor inc, acceptor name, channel])
    K = SHA-256("fabricd-v1-key" ‖ 0x00 ‖ secret)

During a rotation a node holds two secrets, an older and a newer one, and accepts either.  Its
HELLO as acceptor then carries a second proof, ``older_mac``, under the older secret; the
initiator takes the newest secret of its own that one of the two proofs matches, and proves
that one in AUTH; the acceptor checks AUTH against both.  So two nodes use the newer secret
as soon as both hold it, the older one while only one does, and no link is refused while
every pair shares a secret (docs/operations.md, "Rotating the secret")::

    initiator holds   acceptor holds   K of the link
    {S1}              {S1, S2}         S1
    {S1, S2}          {S1}             S1
    {S1, S2}          {S1, S2}         S2
    {S2}              {S1, S2}         S2
    {S1}              {S2}             refused: no common secret

The transcript is the same with one secret or two, and an active attacker who strips
``older_mac`` can only make the link fail or settle on a secret both nodes accept anyway.

Each side proves it knows K over a nonce the *other* side chose, so a recorded exchange cannot
be replayed, and the role labels keep one side's answer from being reflected as the other's.
The incarnation (a number that grows with each daemon start) and the node's name ride in the
authenticated transcript, so the daemon can reject links of a dead incarnation of a restarted
peer, and, under membership from etcd, of a node its view does not (yet) have in that slot
(:mod:`fabricd.engines.link.peers`, "Names").  This module checks neither: it only says who
the peer claims to be, proven with the secret.

Once done, both sides derive the link's two session keys (:meth:`Handshake.session_keys`), one
per direction, that seal every later frame (:mod:`fabricd.integrity`)::

    key(initiator → acceptor) = HMAC(K, "fabricd-v2-session\0initiator\0" ‖ T)
    key(acceptor → initiator) = HMAC(K, "fabricd-v2-session\0acceptor\0" ‖ T)

T holds both nonces, so each link (control and data each run their own handshake) and each
connection of the pair gets fresh keys; the labels differ from the handshake MACs' (which cross
the wire) in their prefix, so no key is ever sent.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Final

import msgpack

from fabricd.engines.actions import Answer
from fabricd.errors import RemoteProtocolError
from fabricd.frames.link import HANDSHAKE_KINDS, NONCE_SIZE, Auth, HandshakeFrame, Hello
from fabricd.wire import Limits

#: the longest node name a HELLO carries, in UTF-8 bytes (the config refuses longer ones)
MAX_NAME: Final = 255
#: decoder limits while a link is unauthenticated: a few KiB at most, handshake frames only
HANDSHAKE_LIMITS: Final = Limits(
    max_meta=768,
    max_payload=0,
    max_str=MAX_NAME,
    max_array=8,
    max_map=8,
    kinds=HANDSHAKE_KINDS,
)


class AuthenticationFailed(RemoteProtocolError):
    """The peer does not know the shared secret, or is not who it says it is."""


class Channel(enum.StrEnum):
    """The two links of a peer pair (ASAP §5)."""

    CONTROL = "control"  #: heartbeats, announcements, rendezvous; latency-bound
    DATA = "data"  #: payload chunks; throughput-bound


class Role(enum.Enum):
    INITIATOR = "initiator"  #: opened the connection
    ACCEPTOR = "acceptor"  #: accepted it


class _State(enum.Enum):
    START = enum.auto()  #: nothing exchanged yet
    WAIT_HELLO = enum.auto()  #: waiting for the other side's HELLO
    WAIT_AUTH = enum.auto()  #: acceptor: waiting for the initiator's AUTH
    DONE = enum.auto()  #: authenticated
    FAILED = enum.auto()  #: refused; the link must be closed


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerIdentity:
    """Who is on the other end of an authenticated link."""

    node: int
    incarnation: int
    channel: Channel
    name: str = ""  #: the name it sent (``""``: none, as a node of a static list may send)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionKeys:
    """The keys that seal an authenticated link's frames, one per direction."""

    send: bytes = field(repr=False)  #: seals what this side sends
    receive: bytes = field(repr=False)  #: opens what the peer sends


class Handshake:
    """One side of the handshake of one link.

    Args:
        role: whether we opened the connection.
        secret: the shared secret; during a rotation the newer of the two.
        older_secret: during a rotation, the older secret, accepted too (``None`` otherwise).
        node, incarnation: who we are.
        name: our node name (``""``: none), sent in HELLO and bound into the transcript.
        nonce: ``NONCE_SIZE`` fresh random bytes (injected, so tests are deterministic).
        fabric_size: node ids must be below this.
        channel: which channel we open (initiator only).
        expected_node: the node we dialled (initiator only).
        sealed_data: whether this node seals DATA payloads (``data_integrity = "mac"``); a
            peer that does otherwise is refused here, with the setting named, instead of
            failing every DATA frame it sends or receives later.
    """

    def __init__(
        self,
        *,
        role: Role,
        secret: bytes,
        older_secret: bytes | None = None,
        node: int,
        incarnation: int,
        nonce: bytes,
        fabric_size: int,
        name: str = "",
        channel: Channel | None = None,
        expected_node: int | None = None,
        sealed_data: bool = False,
    ) -> None:
        if len(nonce) != NONCE_SIZE:
            raise ValueError(f"nonce must be {NONCE_SIZE} bytes")
        if role is Role.INITIATOR and (channel is None or expected_node is None):
            raise ValueError("an initiator must name its channel and the node it dialled")
        self.role = role
        # HMAC would pad a short secret with zeros and hash a long one, making b"k" and b"k\0"
        # (or a long secret and its SHA-256) the same key; a derived key keeps them apart.
        # The newer first: it is the one preferred
        held = [secret] if older_secret is None else [secret, older_secret]
        self._keys = [hashlib.sha256(b"fabricd-v1-key\0" + k).digest() for k in held]
        self._key = self._keys[0]  #: the link's K once chosen (the acceptor's HELLO: the newer)
        self._node = node
        self._incarnation = incarnation
        self._name = name
        self._nonce = nonce
        self._fabric_size = fabric_size
        self._channel = channel
        self._expected = expected_node
        self._sealed_data = sealed_data
        self._state = _State.START
        self._peer: PeerIdentity | None = None
        self._transcript = b""

    @property
    def peer(self) -> PeerIdentity | None:
        """The authenticated peer, once the handshake is done."""
        return self._peer if self._state is _State.DONE else None

    def session_keys(self) -> SessionKeys:
        """The link's session keys; only once the handshake is done.

        Raises:
            RuntimeError: the handshake is not done (a caller bug).
        """
        if self._state is not _State.DONE:
            raise RuntimeError("no session keys before the handshake is done")
        ours = self._session_key(self.role)
        other = Role.ACCEPTOR if self.role is Role.INITIATOR else Role.INITIATOR
        return SessionKeys(send=ours, receive=self._session_key(other))

    def _session_key(self, sender: Role) -> bytes:
        label = b"fabricd-v2-session\0" + sender.value.encode() + b"\0"
        return hmac.new(self._key, label + self._transcript, hashlib.sha256).digest()

    def start(self) -> list[Answer]:
        """Begin: the initiator sends its HELLO; the acceptor waits."""
        if self._state is not _State.START:
            raise RuntimeError("handshake already started")
        self._state = _State.WAIT_HELLO
        if self.role is Role.ACCEPTOR:
            return []
        return [Answer(frame=self._hello())]

    def on_frame(self, frame: HandshakeFrame) -> list[Answer]:
        """Take one frame from the peer; return what to send back.  Check :attr:`peer` after.

        Raises:
            AuthenticationFailed: wrong secret or identity; close the link and log it.
            RemoteProtocolError: an unexpected frame, or one that names a node outside the
                fabric or lacks what its role must send; close the link.
        """
        try:
            return self._on_frame(frame)
        except RemoteProtocolError:
            self._state = _State.FAILED
            raise

    def _on_frame(self, frame: HandshakeFrame) -> list[Answer]:
        if self._state is _State.WAIT_HELLO and isinstance(frame, Hello):
            return self._on_hello(frame)
        if self._state is _State.WAIT_AUTH and isinstance(frame, Auth):
            self._key = self._choose_key([frame.mac], Role.INITIATOR)
            self._state = _State.DONE
            return []
        raise RemoteProtocolError(
            f"unexpected {frame.KIND.name} during handshake ({self._state.name})"
        )

    def _hello(self) -> Hello:
        if self.role is Role.INITIATOR:
            assert self._channel is not None
            return Hello(
                node=self._node,
                incarnation=self._incarnation,
                nonce=self._nonce,
                name=self._name,
                channel=self._channel.value,
                sealed_data=self._sealed_data,
            )
        macs = [self._mac(Role.ACCEPTOR, key) for key in self._keys]
        return Hello(
            node=self._node,
            incarnation=self._incarnation,
            nonce=self._nonce,
            name=self._name,
            mac=macs[0],
            older_mac=macs[1] if len(macs) > 1 else None,
            sealed_data=self._sealed_data,
        )

    def _on_hello(self, hello: Hello) -> list[Answer]:
        node, incarnation, nonce = hello.node, hello.incarnation, hello.nonce
        if node >= self._fabric_size:
            raise RemoteProtocolError(
                f"HELLO field 'node' is {node}, outside this fabric of {self._fabric_size} nodes"
            )
        if node == self._node:
            raise AuthenticationFailed(f"peer claims to be this node ({node})")
        if hello.sealed_data != self._sealed_data:
            theirs, ours = ("mac", "none") if hello.sealed_data else ("none", "mac")
            raise RemoteProtocolError(
                f"node {node} has data_integrity = {theirs!r}, this node {ours!r}: "
                "set the same data_integrity on every node"
            )
        if self.role is Role.INITIATOR:
            if node != self._expected:
                raise AuthenticationFailed(
                    f"dialled node {self._expected} but node {node} answered"
                )
            assert self._channel is not None
            channel = self._channel
            self._transcript = self._make_transcript(self._nonce, nonce, hello, channel)
            self._peer = PeerIdentity(
                node=node, incarnation=incarnation, channel=channel, name=hello.name
            )
            if hello.mac is None:
                raise RemoteProtocolError("the acceptor's HELLO carries no 'mac'")
            offered = [hello.mac] if hello.older_mac is None else [hello.mac, hello.older_mac]
            self._key = self._choose_key(offered, Role.ACCEPTOR)
            self._state = _State.DONE
            return [Answer(frame=Auth(mac=self._mac(Role.INITIATOR, self._key)))]
        if hello.channel is None:
            raise RemoteProtocolError("the initiator's HELLO names no channel")
        try:
            channel = Channel(hello.channel)
        except ValueError:
            raise RemoteProtocolError(f"unknown channel {hello.channel!r} in HELLO") from None
        self._channel = channel
        self._transcript = self._make_transcript(nonce, self._nonce, hello, channel)
        self._peer = PeerIdentity(
            node=node, incarnation=incarnation, channel=channel, name=hello.name
        )
        self._state = _State.WAIT_AUTH
        return [Answer(frame=self._hello())]

    def _make_transcript(
        self, initiator_nonce: bytes, acceptor_nonce: bytes, hello: Hello, ch: Channel
    ) -> bytes:
        ours = [self._node, self._incarnation, self._name]
        theirs = [hello.node, hello.incarnation, hello.name]
        ids = ours + theirs if self.role is Role.INITIATOR else theirs + ours
        packed: bytes = msgpack.packb([initiator_nonce, acceptor_nonce, *ids, ch.value])
        return packed

    def _mac(self, role: Role, key: bytes) -> bytes:
        label = b"fabricd-v1-" + role.value.encode()
        return hmac.new(key, label + self._transcript, hashlib.sha256).digest()

    def _choose_key(self, macs: list[bytes], role: Role) -> bytes:
        """The newest key of ours under which one of ``macs`` is ``role``'s proof.

        Raises:
            AuthenticationFailed: none is; the peer holds none of our secrets.
        """
        for key in self._keys:
            expected = self._mac(role, key)
            if any(hmac.compare_digest(mac, expected) for mac in macs):
                return key
        held = " (neither of the 2 it holds)" if len(self._keys) > 1 else ""
        raise AuthenticationFailed(
            f"authentication failed: the peer does not hold the same secret as this node{held}; "
            "compare the secret source on both nodes (during a rotation, every pair of nodes "
            "must share one secret)"
        )

    @property
    def used_older_secret(self) -> bool:
        """Whether the link was authenticated with the older of two secrets (a rotation
        under way on one of the two nodes)."""
        return self._state is _State.DONE and self._key is not self._keys[0]
