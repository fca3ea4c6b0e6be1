"""Typed views of the peer frames' metadata, read and written at the wire boundary.

Rules: this package is the one place that knows which fields each peer frame kind carries and
what values they may hold (docs/protocol.md, "Frame kinds").  Engines take and return these
views, never raw ``dict`` metadata; the node parses a frame once, when it arrives
(:func:`parse`), and encodes it once, when it leaves (:meth:`to_meta`).

Every view is a frozen, slotted dataclass with the frame kind as ``KIND``.  :func:`parse`
raises :class:`~fabricd.errors.RemoteProtocolError` for a field that is missing or of the wrong
type or range, so a malformed frame is refused before any engine sees it, and the link that
sent it is closed.

The handshake's HELLO and AUTH have views too (:class:`Hello`, :class:`Auth`), read by their own
:func:`parse_handshake`: they are exchanged before a link is trusted, and an authenticated peer
that sends one again is refused by :func:`parse` like any other kind it may not send.

One module per capability (``link``, ``membership``, ``p2p``, ``collectives``, ``stochastic``,
``ps``) and the shared field readers (``fields``); ``registry`` reads every kind.
"""
