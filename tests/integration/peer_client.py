"""A hand-driven peer for tests: open links to a daemon's peer port from any loopback address,
authenticate as a configured node with the shared secret, then send whatever a test wants,
sealed as a real peer seals its frames (:mod:`fabricd.integrity`) or raw.

Blocking sockets only (these run beside daemons that are real processes), and every wait has a
timeout that is a hang guard, never a measurement.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Final

from fabricd.engines.link.handshake import HANDSHAKE_LIMITS, Channel, Handshake, Role
from fabricd.frames import link as link_frames
from fabricd.integrity import Opener, Sealer
from fabricd.transports.base import split_address
from fabricd.wire import NEED_DATA, Decoder, Frame, Kind, encode, encode_head

#: seconds any one wait may take before the test is stuck (a hang guard)
PATIENCE: Final = 20.0
#: each authenticated session is a new incarnation, newer than any daemon started today (a
#: link of an older one is refused while the real node is not yet down)
_incarnations = itertools.count(time.time_ns() + 10**15)


def connect(address: str, source: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to ``address`` from ``source`` (any port)."""
    host, port = split_address(address)
    return socket.create_connection((host, port), timeout=PATIENCE, source_address=(source, 0))


def closed_by_peer(sock: socket.socket) -> bool:
    """Read until the far end closes ``sock``; False if it is still open after PATIENCE."""
    sock.settimeout(PATIENCE)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


@dataclass
class SealedLink:
    """An authenticated link: what it sends is sealed as a real peer seals it, unless a test
    writes raw bytes to :attr:`sock`."""

    sock: socket.socket
    sealer: Sealer
    decoder: Decoder  #: opens what the daemon sends
    _head: bytes = field(default=b"", repr=False)

    def frame(self, kind: Kind, meta: dict[str, object], payload: bytes = b"") -> bytes:
        """A whole sealed frame: header, metadata, payload, trailer."""
        return self.head(kind, meta, len(payload)) + payload + self.trailer(kind, payload)

    def head(self, kind: Kind, meta: dict[str, object], payload_len: int) -> bytes:
        """A sealed frame's header and metadata; :meth:`trailer` must follow its payload."""
        self._head = encode_head(kind, meta, payload_len, flags=self.sealer.flags(kind))
        return self._head

    def trailer(self, kind: Kind, payload: bytes = b"") -> bytes:
        """The trailer of the frame :meth:`head` began (DATA's MAC skips its payload)."""
        return self.sealer.seal(kind, self._head, [payload])

    def send(self, kind: Kind, meta: dict[str, object], payload: bytes = b"") -> None:
        self.sock.sendall(self.frame(kind, meta, payload))

    def close(self) -> None:
        self.sock.close()


def authenticate(
    address: str,
    *,
    secret: bytes,
    node: int,
    dialled: int,
    fabric_size: int,
    channel: Channel = Channel.CONTROL,
    incarnation: int | None = None,
) -> SealedLink:
    """A link to node ``dialled`` at ``address`` that passed the handshake as node ``node``.

    Raises:
        ConnectionError: the daemon closed the link during the handshake.
    """
    sock = connect(address)
    handshake = Handshake(
        role=Role.INITIATOR,
        secret=secret,
        node=node,
        incarnation=next(_incarnations) if incarnation is None else incarnation,
        nonce=os.urandom(32),
        fabric_size=fabric_size,
        channel=channel,
        expected_node=dialled,
    )
    decoder = Decoder(HANDSHAKE_LIMITS)
    answers = handshake.start()
    while True:
        for answer in answers:
            sock.sendall(encode(answer.frame.KIND, answer.frame.to_meta()))
        if handshake.peer is not None:
            keys = handshake.session_keys()
            opened = Decoder()
            opened.opener = Opener(keys.receive, require_data=False)
            return SealedLink(sock, Sealer(keys.send, cover_data=False), opened)
        data = sock.recv(4096)
        if not data:
            sock.close()
            raise ConnectionError("the daemon closed the link during the handshake")
        decoder.feed(data)
        answers = []
        while (event := decoder.next_event()) is not NEED_DATA:
            if isinstance(event, Frame):
                answers += handshake.on_frame(link_frames.parse_handshake(event.kind, event.meta))


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret as the daemon reads it."""
    with open(path, "rb") as fh:
        return fh.read().strip()


class PeerSession:
    """Both links of a pretend node ``node`` to node ``dialled``, one incarnation (a new one
    unless ``incarnation`` is given: the same daemon reconnecting): what a real peer that dials
    would open."""

    def __init__(
        self,
        address: str,
        *,
        secret: bytes,
        node: int,
        dialled: int,
        fabric_size: int,
        incarnation: int | None = None,
    ) -> None:
        if incarnation is None:
            incarnation = next(_incarnations)
        self.control = authenticate(
            address,
            secret=secret,
            node=node,
            dialled=dialled,
            fabric_size=fabric_size,
            incarnation=incarnation,
        )
        self.data = authenticate(
            address,
            secret=secret,
            node=node,
            dialled=dialled,
            fabric_size=fabric_size,
            channel=Channel.DATA,
            incarnation=incarnation,
        )

    def send(
        self, kind: Kind, meta: dict[str, object], payload: bytes = b"", *, data: bool = False
    ) -> None:
        """Send one sealed frame on the control link (``data``: on the data link)."""
        (self.data if data else self.control).send(kind, meta, payload)

    def receive(self, kind: Kind, *, data: bool = False) -> Frame:
        """The next frame of ``kind`` on the control link (``data``: on the data link; others
        are skipped)."""
        link = self.data if data else self.control
        link.sock.settimeout(PATIENCE)
        while True:
            while (event := link.decoder.next_event()) is not NEED_DATA:
                if isinstance(event, Frame) and event.kind is kind:
                    return event
            data = link.sock.recv(65536)
            if not data:
                raise ConnectionError(f"the daemon closed the link before a {kind.name}")
            link.decoder.feed(data)

    def close(self) -> None:
        self.control.close()
        self.data.close()
