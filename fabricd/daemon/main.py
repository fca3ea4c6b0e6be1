"""Running the daemon as a process: event loop choice, signals, exit codes."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import TYPE_CHECKING

from fabricd.daemon import logs
from fabricd.daemon.node import Daemon
from fabricd.errors import ConfigError, TransportError

if TYPE_CHECKING:
    from collections.abc import Callable

    from fabricd.daemon.config import Loaded

log = logging.getLogger("fabricd.daemon")

#: exit status for a configuration the daemon refuses (sysexits EX_CONFIG)
EXIT_CONFIG = 78
#: exit status when the peer address cannot be bound (sysexits EX_UNAVAILABLE)
EXIT_UNAVAILABLE = 69
#: exit status when etcd gave this daemon's slot to another node (sysexits EX_TEMPFAIL): the
#: daemon stopped serving as that id, and registers afresh when restarted
EXIT_SLOT_LOST = 75


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ConfigError("event_loop = 'uvloop' but uvloop is not installed") from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def serve(loaded: Loaded) -> int:
    """Run one daemon until SIGTERM or SIGINT, then drain and return the exit status (0,
    :data:`EXIT_SLOT_LOST`, or :data:`EXIT_CONFIG` when registering again found its name
    another daemon's); SIGHUP reads the secret source again
    (:meth:`~fabricd.daemon.node.Daemon.reload_secrets`).

    What the daemon made to start (its modules, classes, tables) lives as long as it does, so
    it is moved out of the garbage collector's sight (:func:`gc.freeze`): every full
    collection would walk it again, about 6 ms of 40,000 objects on a small machine, a pause
    every client pays (issue 28, item 1).  Garbage it holds that forms cycles is collected
    no more; there is none worth the pause.
    """
    registration = None
    if loaded.config.membership == "etcd":
        try:  # an optional extra: only membership from etcd needs it
            from fabricd.daemon.services import roster
        except ImportError as exc:
            raise ConfigError(
                f"membership = 'etcd' needs the etcd extra (pip install 'fabricd[etcd]'): {exc}"
            ) from None
        registration = await roster.register(loaded.config)
        loaded = roster.registered(loaded, registration)
        cfg = loaded.config  # from here on, lines are tagged with the node id etcd gave
        logs.setup(cfg.log_level, cfg.log_format, cfg.node_id)
    daemon = None
    try:
        daemon = Daemon(loaded, registration=registration)
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        loop.add_signal_handler(signal.SIGHUP, daemon.reload_secrets)
        await daemon.run()
    except BaseException:  # (a crash, a cancel, an interrupt: leave etcd now, then go on)
        if daemon is not None and daemon.roster is not None:  # its registration, which is
            await daemon.roster.settle()  # another lease and client after registering again
        elif registration is not None:  # (failed before serving)
            await roster.release(registration)
        raise
    if daemon.roster is not None and daemon.roster.name_taken:
        return EXIT_CONFIG  # (its name is another daemon's: said in the log)
    return EXIT_SLOT_LOST if daemon.roster is not None and daemon.roster.slot_lost else 0


def run(loaded: Loaded) -> int:
    """The process body of ``fabricd``: returns the exit status."""
    cfg = loaded.config
    logs.setup(cfg.log_level, cfg.log_format, cfg.node_id)
    try:
        with asyncio.Runner(loop_factory=_loop_factory(cfg.event_loop)) as runner:
            status = runner.run(serve(loaded))
    except ConfigError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_CONFIG
    except TransportError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_UNAVAILABLE
    return status
