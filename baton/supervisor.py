"""What `baton up` does after start-up: restart what exits, with back-off, and give up on a crash loop.

A service that exits is started again after 0.5 s, 1 s, 2 s, ... (at most 8 s); a worker comes
back under a fresh worker id, so the registry never sees two instances of one id, and the dead
one is deregistered at once (routers and peers stop using it before its lease would run out).
After its 6th exit within 60 s a service is given up on. `baton up` keeps serving while every
role still has a process and exits 1 once one has none left (nothing could serve a request) or
its own NATS server cannot be kept alive.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from baton.shared.bus.server import NatsServerError

FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0
MAX_RESTARTS, CRASH_WINDOW_S = 5, 60.0  # a 6th exit within the window: given up on


def say(message: str) -> None:
    print(f"baton: {message}", file=sys.stderr, flush=True)


def describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


@dataclass
class Supervised:
    """One thing `baton up` keeps running: a service process or its NATS server."""
    name: str
    role: str
    exit_code: Callable[[], int | None]  # None while it runs
    restart: Callable[[], None]
    log: str  # "; see PATH", or empty
    on_exit: Callable[[], None] = lambda: None
    exits: list[float] = field(default_factory=list)  # unexpected exits within the crash window
    restart_at: float | None = None
    given_up: bool = False

    def check(self, now: float) -> None:
        """Notice an exit, restart once the back-off passed, give up on a crash loop."""
        if self.given_up:
            return
        if self.restart_at is None:
            code = self.exit_code()
            if code is not None:
                self.on_exit()
                self._exited(now, describe(code))
        elif now >= self.restart_at:
            self.restart_at = None
            try:
                self.restart()
                say(f"{self.name} restarted")
            except (OSError, NatsServerError) as exc:
                self._exited(now, f"restart failed: {exc}")

    def _exited(self, now: float, how: str) -> None:
        self.exits = [t for t in self.exits if now - t < CRASH_WINDOW_S] + [now]
        if len(self.exits) > MAX_RESTARTS:
            self.given_up = True
            say(f"giving up on {self.name}: it exited {len(self.exits)} times within {CRASH_WINDOW_S:g} s "
                f"(last: {how}){self.log}")
            return
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(self.exits) - 1))
        self.restart_at = now + delay
        say(f"{self.name} exited ({how}); restarting in {delay:g} s{self.log}")


class Supervisor:
    def __init__(self, units: list[Supervised]) -> None:
        self.units = units

    @classmethod
    def of(cls, cluster) -> "Supervisor":
        """Every service process of a baton.up.Cluster, and its NATS server if it started one."""
        units = [_child(cluster, index) for index in range(len(cluster.children))]
        if cluster.server is not None:
            server = cluster.server
            units.append(Supervised("nats-server", "nats-server", lambda: server.returncode, server.restart, ""))
        return cls(units)

    def check(self, now: float | None = None) -> str | None:
        """One round; returns why `baton up` must exit (a role with no process left), else None."""
        now = time.monotonic() if now is None else now
        for unit in self.units:
            unit.check(now)
        roles = {unit.role for unit in self.units}
        lost = sorted(role for role in roles if all(u.given_up for u in self.units if u.role == role))
        return f"no {', '.join(lost)} left (given up on)" if lost else None


def _child(cluster, index: int) -> Supervised:
    role = cluster.children[index][0]
    return Supervised(f"{role}-{index}", role, lambda: cluster.children[index][1].poll(),
                      lambda: cluster.respawn(index), f"; see {cluster.log_dir / f'{role}-{index}.log'}",
                      lambda: cluster.forget(index))
