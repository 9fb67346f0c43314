"""Ten minutes idle, then ten minutes of load, on one cluster of real processes (issue 31): the
server's JetStream consumer count stays flat, the registry logs no error, every reply is exact and
every page and slot comes back. Not in the default run (`-m soak`; 20 minutes); BATON_SOAK_S sets
each phase's seconds (600). docs/reliability.md has the last run's numbers."""
import asyncio
import os
import re
import time

import pytest

from baton.proto import subjects
from baton.proto.internal import LookupReply, LookupRequest
from baton.shared.bus import Bus
from e2e_cluster import running_cluster, wait_all_free
from test_control_plane import CachedReference, consumers
from test_faults import assert_exact, outcome, prompt

PHASE_S = float(os.environ.get("BATON_SOAK_S", "600"))
SAMPLE_S = 15.0  # how often the consumer count is read
IN_FLIGHT = 4
pytestmark = [pytest.mark.soak, pytest.mark.integration, pytest.mark.timeout(int(2 * PHASE_S) + 600)]
PROBLEM = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")


async def sample_consumers(bus: Bus, seconds: float, counts: list[int]) -> None:
    """Read the consumer count every SAMPLE_S for `seconds`, with lookups as the router makes them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counts.append(await consumers(bus))
        await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
        await asyncio.sleep(min(SAMPLE_S, max(0.0, deadline - time.monotonic())))
    counts.append(await consumers(bus))


async def load(bus: Bus, prompts: list[list[int]], seconds: float, results: list) -> None:
    """IN_FLIGHT clients, each sending the next request as soon as its last one is answered."""
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            p = prompts[n % len(prompts)]
            results.append((p, await outcome(bus, p, 48)))
            n += IN_FLIGHT
    await asyncio.gather(*(client(i) for i in range(IN_FLIGHT)))


def test_ten_minutes_idle_then_ten_minutes_of_load_keep_consumers_flat_and_the_registry_error_free():
    reference = CachedReference()
    prompts = [prompt(24 + 9 * i, 300 + i) for i in range(8)]
    for p in prompts:
        reference.greedy(tuple(p), 48)  # before the clock starts
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "soak") as bus:
                idle, loaded, results = [], [], []
                await sample_consumers(bus, PHASE_S, idle)
                await asyncio.gather(sample_consumers(bus, PHASE_S, loaded), load(bus, prompts, PHASE_S, results))
                await wait_all_free(cluster.nats_url, min_requests=len(results))
                return idle, loaded, results
        idle, loaded, results = asyncio.run(run())
        registry_log = next(cluster.log_dir.glob("registry-*.log")).read_text()
    print(f"consumers: idle {min(idle)}..{max(idle)} over {len(idle)} reads, loaded {min(loaded)}..{max(loaded)} "
          f"over {len(loaded)} reads; {len(results)} requests in {PHASE_S:g} s of load")
    assert max(idle + loaded) <= max(1, idle[0]), (idle, loaded)
    assert not PROBLEM.findall(registry_log), registry_log[-4000:]
    assert len(results) >= IN_FLIGHT
    for p, reply in results:
        assert_exact(reference, tuple(p), reply, 48)
