"""Running one service process: uvloop, logging, and a stop event set by SIGTERM / SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import Awaitable, Callable

try:
    import uvloop
except ImportError:  # uvloop is a dependency; this keeps `baton` importable without it
    uvloop = None


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def quiet_reconnect_noise(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: nats-py's reconnect loop gives up on a connect attempt at its
    timeout, and a name lookup still running then (e.g. of a restarting server's DNS name) fails
    later into a future nobody awaits, which asyncio reports as an ERROR with a traceback on every
    attempt of an outage. That one case is logged in a line at DEBUG (each failed attempt is
    already a warning from the bus); everything else goes to asyncio's default handler."""
    if (context.get("message") == "Future exception was never retrieved"
            and isinstance(context.get("exception"), socket.gaierror)):
        logging.getLogger("baton.runtime").debug("NATS reconnect: name lookup failed late: %s", context["exception"])
        return
    loop.default_exception_handler(context)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop)` on one event loop; SIGTERM/SIGINT set `stop`; returns the exit code."""
    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_reconnect_noise)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    if uvloop is not None:
        uvloop.run(wrapper())
    else:
        asyncio.run(wrapper())
    return 0
