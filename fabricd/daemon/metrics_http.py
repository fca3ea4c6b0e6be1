"""The metrics endpoint: ``GET /metrics`` over HTTP, served from the daemon's event loop.

prometheus-client's own ``start_http_server`` runs a thread, and that thread would read the
tables the loop changes under it (a dict changing size while iterated raises).  This endpoint
is an asyncio protocol on the loop instead: a scrape reads the counters between two events, the
way ``status`` does, and costs the loop about a millisecond.

What a scraper may do is bounded, since anyone who can reach the port can connect: a request
head of at most 8 KiB, read within 5 s; ``Connection: close`` after each answer, which must be
taken within another 5 s (a scraper that never reads it would otherwise hold its connection,
its copy of the answer and its place for ever: closing a transport waits until what was written
is sent); and 16 connections at once.  Only ``GET``/``HEAD`` of ``/metrics`` (and ``/``) are
answered.  The address is ``metrics_address``: 127.0.0.1 by default, never every interface
unless the config says so.

**When the 16 places are taken, the newcomer evicts someone** rather than being turned away.
Turning newcomers away let any local user blind monitoring: 40 sockets that each send a byte a
second and never finish their head kept the 16 places busy, and 2 of 50 scrapes got through.
A scrape sends its whole head as soon as it connects (every Prometheus does), so the
connections worth keeping are the ones that are already answering or that just arrived; a
connection still dribbling its head after others came is the one to drop.  The victim is
chosen by, in order:

1. *the source holding the most connections* (the newcomer counted): one source churning
   through the places evicts its own, never a scraper from another.  A source is an address
   group a host can fill without privilege (:func:`source_group`): the whole loopback range
   (any local user may bind 127.0.0.2 ... 127.255.255.254), an IPv4 /24, an IPv6 /64;
2. *no complete head yet* before answering: an answer being taken is kept while any
   dribbling connection of that address remains;
3. *the oldest* (by arrival): a prompt scraper is evicted only if 16 connections arrive
   after it before its head is read, that is, a connect flood, not a slow client.

Why not the others.  *Shorter deadlines* alone do not help: a slowloris reconnects when cut,
and every deadline short enough to matter also cuts an honest scraper on a slow link (the
5 s stay).  *Places per source address* alone do not help on the default address: every local
user connects from 127.0.0.1, the local scraper too, so they share one quota; as the first
rule above they cost nothing there and protect a scraper on another host.  *A Unix-socket
endpoint* would keep other users out by file mode, but Prometheus cannot scrape one without a
proxy; an operator who wants other local users off the TCP port entirely can match the owner
uid in the firewall (docs/operations.md, "Metrics").  What eviction cannot stop is a connect
flood fast enough to push 16 connections past a scrape in the moment before its head is read;
that costs the daemon's loop its CPU on any port, and is a matter for the firewall.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
from typing import TYPE_CHECKING, Final, cast

from fabricd.transports.base import join_address, split_address

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("fabricd.metrics")

#: the most a request head may be, and how long it may take to arrive
MAX_REQUEST: Final = 8192
REQUEST_TIMEOUT: Final = 5.0
#: connections held at once; a newcomer past it evicts one (:meth:`MetricsServer.victim`)
MAX_CONNECTIONS: Final = 16
#: the classic text format, which prometheus-client's ``generate_latest`` writes and every
#: Prometheus reads
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: hosts that mean every interface: allowed only when ``metrics_address`` names them
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})


class MetricsServer:
    """The endpoint of one daemon.

    Args:
        render: builds the exposition (the registry's ``exposition``); called on the loop.
    """

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._server: asyncio.Server | None = None
        self._open: set[_Scrape] = set()
        self._arrivals = itertools.count()
        self.address = ""  #: the bound ``host:port`` (the real port when 0 was asked for)
        self.evicted = 0  #: connections closed to make room for a newcomer
        self.timed_out = 0  #: connections closed at a deadline (head not sent, answer not taken)

    @property
    def connections(self) -> int:
        """Scrapes connected now."""
        return len(self._open)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``, or ``""`` when not serving."""
        return f"http://{self.address}/metrics" if self.address else ""

    async def start(self, address: str) -> None:
        """Bind ``address`` (``host:port``; port 0: a free one) and serve.

        Raises:
            OSError: the address cannot be bound (in use, not this host's).
        """
        host, port = split_address(address)
        if host in WILDCARD_HOSTS:
            log.warning("metrics endpoint on every interface (%s), as metrics_address says", host)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Scrape(self), host, port, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        self.address = join_address(bound[0], bound[1])
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        """Stop serving: no new scrape, and those connected are hung up on (an answer not yet
        taken is dropped)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for scrape in list(self._open):
            scrape.cut()
        self.address = ""

    def counters(self) -> dict[str, int]:
        """The endpoint's status counters (the node merges them into ``status``)."""
        return {"metrics_evicted": self.evicted, "metrics_timed_out": self.timed_out}

    def arrival(self) -> int:
        """The next arrival's number: connections are ordered by it, oldest first."""
        return next(self._arrivals)

    def admit(self, scrape: _Scrape) -> None:
        """Take a new connection, evicting :meth:`victim` first when ``MAX_CONNECTIONS`` are
        open: a newcomer is never turned away (the module's docstring says why)."""
        while len(self._open) >= MAX_CONNECTIONS:
            victim = self.victim(scrape.source)
            self._open.discard(victim)  # now: its connection_lost comes a turn later
            victim.cut()
            self.evicted += 1
        self._open.add(scrape)

    def victim(self, newcomer: str) -> _Scrape:
        """The connection a newcomer from address ``newcomer`` evicts: of the address that
        holds the most (the newcomer counted), one with no complete head before one answering,
        the oldest first."""
        held = collections.Counter(scrape.source for scrape in self._open)
        held[newcomer] += 1
        return min(self._open, key=lambda s: (-held[s.source], s.answering, s.arrival))

    def forget(self, scrape: _Scrape) -> None:
        self._open.discard(scrape)

    def answer(self, head: bytes) -> bytes:
        """The whole response to a request ``head`` (its lines up to the blank one)."""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _response("400 Bad Request", b"not an HTTP/1 request\n")
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", b"only GET and HEAD\n")
        if target == b"/metrics":
            body, content_type = self._render(), CONTENT_TYPE
        elif target == b"/":
            body, content_type = b"fabricd: metrics at /metrics\n", "text/plain"
        else:
            return _response("404 Not Found", b"metrics are at /metrics\n")
        return _response("200 OK", b"" if method == b"HEAD" else body, content_type, len(body))


class _Scrape(asyncio.Protocol):
    """One connection: read a request head, answer it, hang up.

    A protocol rather than a stream handler: no task per connection, so nothing is left to
    cancel (and complain) when the daemon's loop ends with a scraper connected.
    """

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._head = bytearray()
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.source = ""  #: the client's address (its host, without the port)
        self.arrival = server.arrival()
        self.answering = False  #: its head is complete and its answer written

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not subclasses of asyncio.Transport, only alike)
        self._transport = cast("asyncio.Transport", transport)
        peer = transport.get_extra_info("peername")
        self.source = source_group(str(peer[0])) if isinstance(peer, tuple) and peer else ""
        self._server.admit(self)
        self._deadline = asyncio.get_running_loop().call_later(REQUEST_TIMEOUT, self.expire)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_REQUEST:
                self.hang_up()  # says too much
            return
        if end > MAX_REQUEST:
            self.hang_up()
            return
        self._transport.write(self._server.answer(bytes(self._head[:end])))
        self.answering = True
        if self._deadline is not None:  # the scraper must take the answer in time
            self._deadline.cancel()
            self._deadline = asyncio.get_running_loop().call_later(REQUEST_TIMEOUT, self.expire)
        self.hang_up()  # close() sends what was written first

    def hang_up(self) -> None:
        """Close once what was written is sent."""
        if self._transport is not None:
            self._transport.close()

    def expire(self) -> None:
        """A deadline passed: the head was not sent, or the answer not taken, in time."""
        self._server.timed_out += 1
        self.cut()

    def cut(self) -> None:
        """Close now, dropping what was written and not sent."""
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._server.forget(self)


def _response(
    status: str, body: bytes, content_type: str = "text/plain", length: int | None = None
) -> bytes:
    """An HTTP/1.1 response that closes its connection; ``length``: the GET body's (HEAD)."""
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return header + body


def source_group(host: str) -> str:
    """The group of addresses ``host`` belongs to for eviction: loopback as one (any local user
    may bind any 127/8 address, or ::1), an IPv4 /24, an IPv6 /64 (a host is commonly given a
    whole /64); an IPv4-mapped IPv6 address as its IPv4 one.  Anything unparsable as itself."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))
