"""Deadlines that a paused process does not turn into false timeouts.

A process stopped (SIGSTOP, a stalled VM) or with its loop blocked past a reply's deadline wakes up
with the timer expired and the reply, often, already on its socket. asyncio runs the expired timer
in the same loop turn as the read of that socket, before the reply is parsed, so a plain
`asyncio.wait_for` reports a timeout for a request that was answered. A deadline here that fires
more than PAUSE_S late was not this process's to keep: the answer gets GRACE_S more to be read.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")

PAUSE_S = 0.25  # a timer this late means the loop did not run: the process was paused or blocked
GRACE_S = 1.0  # then what may already have arrived gets this long to be read


def after_pause(due: float, now: float) -> float | None:
    """A timer due at `due` (loop time) fired at `now`: the deadline that replaces it if it fired
    PAUSE_S late or more (GRACE_S from now), else None (it fired in time: the deadline stands)."""
    return now + GRACE_S if now - due >= PAUSE_S else None


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """The awaitable's result, or asyncio.TimeoutError (it is cancelled) once `timeout` seconds
    have passed with the loop running, plus GRACE_S after each pause that outlasted the deadline."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(awaitable)
    deadline = loop.time() + timeout
    try:
        while True:
            await asyncio.wait((task,), timeout=max(0.0, deadline - loop.time()))
            if task.done():
                return task.result()
            if (deadline := after_pause(deadline, loop.time())) is None:
                raise asyncio.TimeoutError
    finally:
        task.cancel()
