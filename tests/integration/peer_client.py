"""A hand-driven peer for tests: open links to a daemon's peer port from any loopback address,
authenticate as a configured node with the shared secret, then send whatever a test wants.

Blocking sockets only (these run beside daemons that are real processes), and every wait has a
timeout that is a hang guard, never a measurement.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Final

from fabricd import frames
from fabricd.engines.handshake import HANDSHAKE_LIMITS, Channel, Handshake, Role
from fabricd.transports.base import split_address
from fabricd.wire import NEED_DATA, Decoder, Frame, encode

#: seconds any one wait may take before the test is stuck (a hang guard)
PATIENCE: Final = 20.0
_incarnations = itertools.count(time.time_ns())  #: each authenticated session is a new one


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


def authenticate(
    address: str,
    *,
    secret: bytes,
    node: int,
    dialled: int,
    fabric_size: int,
    channel: Channel = Channel.CONTROL,
    incarnation: int | None = None,
) -> socket.socket:
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
            return sock
        data = sock.recv(4096)
        if not data:
            sock.close()
            raise ConnectionError("the daemon closed the link during the handshake")
        decoder.feed(data)
        answers = []
        while (event := decoder.next_event()) is not NEED_DATA:
            if isinstance(event, Frame):
                answers += handshake.on_frame(frames.parse_handshake(event.kind, event.meta))


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret as the daemon reads it."""
    with open(path, "rb") as fh:
        return fh.read().strip()
