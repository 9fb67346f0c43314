"""baton.supervisor's rules, on a fake clock and fake processes: back-off doubling to its cap, a
crash loop given up on, `baton up` told to exit once a role has nothing left; and a real
nats-server killed -9 comes back on its port."""
import asyncio
import os
import signal
import time

from baton.shared.bus import Bus
from baton.shared.bus.server import NatsServer
from baton.supervisor import MAX_BACKOFF_S, MAX_RESTARTS, Supervised, Supervisor


class FakeProcess:
    def __init__(self) -> None:
        self.code: int | None = None
        self.starts = 1

    def restart(self) -> None:
        self.code, self.starts = None, self.starts + 1


def unit(role: str = "decode") -> tuple[Supervised, FakeProcess]:
    proc = FakeProcess()
    return Supervised(f"{role}-0", role, lambda: proc.code, proc.restart, ""), proc


def crash_and_restart(unit_: Supervised, proc: FakeProcess, now: float) -> float:
    """Crash it at `now`; returns the back-off before it was started again."""
    proc.code = -9
    unit_.check(now)
    delay = unit_.restart_at - now
    unit_.check(now + delay - 0.01)
    assert proc.code == -9  # not yet
    unit_.check(now + delay)
    assert proc.code is None
    return delay


def test_backoff_doubles_to_its_cap_and_a_crash_loop_is_given_up_on():
    u, proc = unit()
    delays = [crash_and_restart(u, proc, now=float(i)) for i in range(MAX_RESTARTS)]
    assert delays == [min(MAX_BACKOFF_S, 0.5 * 2 ** i) for i in range(MAX_RESTARTS)]
    proc.code = 1
    u.check(MAX_RESTARTS)
    assert u.given_up and proc.starts == MAX_RESTARTS + 1
    u.check(1000.0)
    assert proc.starts == MAX_RESTARTS + 1  # given up on stays given up on


def test_exits_outside_the_window_do_not_count():
    u, proc = unit()
    for i in range(3 * MAX_RESTARTS):
        assert crash_and_restart(u, proc, now=100.0 * i) == 0.5
    assert not u.given_up


def test_baton_up_exits_only_when_a_role_has_nothing_left():
    (a, _), (b, _) = unit(), unit()
    supervisor = Supervisor([a, b])
    a.given_up = True
    assert supervisor.check(0.0) is None  # the other decode still serves
    b.given_up = True
    assert supervisor.check(0.0) == "no decode left (given up on)"


def test_a_killed_nats_server_is_restarted_on_its_port():
    with NatsServer() as server:
        unit = Supervised("nats-server", "nats-server", lambda: server.returncode, server.restart, "")
        old_pid = server.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.pid == old_pid or server.returncode is not None:
            assert time.monotonic() < deadline, "the server was not restarted"
            unit.check(time.monotonic())
            time.sleep(0.05)

        async def connects() -> None:
            async with await Bus.connect(server.url, "test"):
                pass
        asyncio.run(connects())
