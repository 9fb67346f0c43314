"""Running one service process: uvloop, logging, and a stop event set by SIGTERM / SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable, Callable

try:
    import uvloop
except ImportError:  # uvloop is a dependency; this keeps `baton` importable without it
    uvloop = None


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop)` on one event loop; SIGTERM/SIGINT set `stop`; returns the exit code."""
    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    if uvloop is not None:
        uvloop.run(wrapper())
    else:
        asyncio.run(wrapper())
    return 0
