"""Writes made while a read callback runs leave together when it returns.

Under load one read delivers many frames (or a client's many requests), and each answers on
the same link or client socket.  Written one by one, each is a ``writev`` or ``send`` of its
own, and on loopback each of those runs the receiver's whole TCP path in the sender's context.
Instead, a read callback brackets its work with :func:`hold` and :func:`release`.  A writer
sends its first frame of the callback at once (a lone frame, the common case at low load,
waits for nothing: holding it until the callback returns would delay the peer by the rest of
the callback's work) and calls :func:`defer` with its flush; what it queues after that it
keeps, and every deferred flush runs once, in the order first deferred, when the outermost
callback returns.  Outside a read callback nothing is held: a frame sent from a task or a
timer leaves at once, as before, and no frame ever waits for a loop iteration.

What is deferred must not raise (a flush that fails closes its own connection; one that raises,
a bug, is logged and the others still run) and must keep its writer's frames in the order they
were queued: each writer keeps one queue, so per link (or per client connection) wire order is
call order, whichever send method queued them.

Per thread: each event loop runs in one thread, and a held span never awaits.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("fabricd.transport")


class _Held(threading.local):
    """This thread's nesting depth of held spans and the flushes deferred to the end."""

    def __init__(self) -> None:
        self.depth = 0
        #: an ordered set: a writer deferred twice in one span still flushes once
        self.flushes: dict[Callable[[], None], None] = {}


_held = _Held()


def hold() -> None:
    """Start holding writes (a read callback begins); pair with :func:`release`."""
    _held.depth += 1


def release() -> None:
    """End a held span; the outermost one runs every deferred flush, first deferred first."""
    held = _held
    held.depth -= 1
    if held.depth:
        return
    flushes = held.flushes
    while flushes:  # a flush deferring again (it cannot hold now) would write at once
        flush = next(iter(flushes))
        del flushes[flush]
        try:
            flush()
        except Exception:  # a bug: logged, and the other writers still flush (else they
            # would hold all they send, even outside a read callback, until another one ends)
            log.exception("a deferred flush failed (a bug); the other writers go on")


def defer(flush: Callable[[], None]) -> bool:
    """Run ``flush`` when the current held span ends; ``False`` if none is open (write now)."""
    held = _held
    if not held.depth:
        return False
    held.flushes[flush] = None
    return True
